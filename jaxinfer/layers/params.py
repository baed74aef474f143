"""A parameter's declaration, made once where the layer creates it: its logical axes and how an
HF checkpoint holds it. The loader (models/loader.py), the tensor-parallel shardings
(parallel.py), dummy weights and EAGLE heads all read this one declaration; nothing keys on a
parameter's name.

- `axes`: one logical axis name per dimension of the parameter's logical shape (packed CPU
  weights: the shape they pack from), or None for an axis never split. parallel.py's
  ShardingRules map them to the mesh ("heads" -> "tp", "embed" -> whole, ...).
- `hf`: an HF layout, HF(names, transpose, fuse, kv): the checkpoint tensors the parameter is
  made of, as templates relative to the path of the module that holds the parameter's module
  ({module}: that module's attribute name, {leaf}: the parameter's, {e}: each expert index);
  whether HF stores them [out, in] (transposed here to [in, out]); how several join
  ("qkv": per KV head, its query group then its key and value head; "stack": side by side on a
  new axis 1; "experts": one tensor per expert and source, stacked); which sources are key /
  value projections (their heads replicated when the tensor-parallel size exceeds them);
  "interleaved": one tensor in our layout but for its last axis, which alternates gate and up
  columns (gpt-oss's stacked experts: [E, H, 2I] -> our [E, H, 2, I]);
  "head_rows": a slice of every head's columns of one [in, heads x per-head] tensor, its axes
  reordered (HF.split; DeepSeek-V3's absorbed attention weights from kv_b_proj).

Examples: a Linear's weight is HF(("{module}.weight",), transpose=True); the fused q/k/v
projection HF(("q_proj.weight", "k_proj.weight", "v_proj.weight"), True, "qkv",
(False, True, True)); Mixtral's stacked experts HF(("{module}.{e}.w1.weight",
"{module}.{e}.w3.weight"), True, "experts").
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class HF:
    names: tuple[str, ...] = ("{module}.{leaf}",)
    transpose: bool = False  # HF holds it [out, in]
    # None (one tensor) | "qkv" | "stack" | "experts" | "interleaved" | "first" (the first of
    # the names the checkpoint has: alternative names, `default` when it has none)
    fuse: str | None = None
    kv: tuple[bool, ...] = ()  # per name: a key / value projection
    default: float | None = None  # ("first") the value of a parameter the checkpoint lacks
    # ("head_rows") (first row, rows, rows per head, axes): of the one tensor, [in, heads x
    # rows per head] in our layout, each head's rows [first, first + rows), as [in, heads,
    # rows] transposed by `axes` (DeepSeek's absorbed W_UK / W_UV from kv_b_proj)
    split: tuple = ()
    flatten: bool = False  # the tensor's axes after the first flattened (a conv kernel)

    def is_kv(self, i: int) -> bool:
        return bool(self.kv) and self.kv[i]


LINEAR = HF(("{module}.weight",), transpose=True)
SAME = HF()


def param(value, *, axes: tuple, hf: HF = SAME, **metadata) -> nnx.Param:
    """An nnx.Param with its declaration (see the module docstring)."""
    return nnx.Param(value, axes=tuple(axes), hf=hf, **metadata)


def declared(var) -> tuple[tuple, HF]:
    """(axes, hf) of a parameter (a Variable or its state); undeclared: no split axis, its
    own tensor."""
    shape = logical_shape(var)
    axes = getattr(var, "axes", None) or (None,) * len(shape)
    return tuple(axes), getattr(var, "hf", None) or SAME


def scale_axes(weight_axes: tuple, stacked_experts: bool = False) -> tuple:
    """A quantized weight's scale / offset [KB, *out] ([E, KB, *out] for stacked experts):
    split as its weight's outputs (and experts), whole along the input blocks."""
    if stacked_experts:
        return (weight_axes[0], None, *weight_axes[2:])
    return (None, *weight_axes[1:])


def logical_shape(var) -> tuple[int, ...]:
    """A parameter's shape in our [in, out] layout (packed weights: what they pack from)."""
    return tuple(getattr(var, "unpacked_shape", None) or var.shape)


def checkpoint_names(path: str, var) -> tuple[str, ...]:
    """The checkpoint tensors parameter `path` (e.g. model.layers.0.self_attn.qkv_proj.weight)
    is made of."""
    _, hf = declared(var)
    parts = path.split(".")
    leaf = parts[-1]
    module = parts[-2] if len(parts) > 1 else ""
    head = ".".join(parts[:-2])
    head = head + "." if head else ""
    names = []
    experts = range(logical_shape(var)[0]) if hf.fuse == "experts" else (0,)
    for e in experts:  # (experts: all of expert 0's sources, then expert 1's, ...)
        for template in hf.names:
            names.append(head + template.format(module=module, leaf=leaf, e=e))
    return tuple(names)


def source_shape(var, index: int, head_dim: int, num_kv_heads: int | None = None
                 ) -> tuple[int, ...]:
    """Expected shape (our [in, out] layout) of the `index`-th checkpoint tensor of `var`."""
    _, hf = declared(var)
    shape = logical_shape(var)
    if hf.fuse in (None, "first"):
        return shape
    if hf.fuse == "experts":  # one expert's [in, out]
        return (shape[1], shape[-1])
    if hf.fuse == "interleaved":  # [..., 2, out] held as [..., 2 * out]
        return (*shape[:-2], 2 * shape[-1])
    if hf.fuse == "head_rows":  # [in, heads * per-head]
        _, rows, per, axes = hf.split
        heads_in_rows = [None] * 3
        for i, ax in enumerate(axes):
            heads_in_rows[ax] = shape[i]
        return (heads_in_rows[0], heads_in_rows[1] * per)
    if hf.fuse == "stack":  # [in, n, out]: each source [in, out]
        return (shape[0], shape[2]) if len(shape) == 3 else (shape[1],)
    # qkv: weight [in, Hkv, (G+2)*D] / bias [Hkv, (G+2)*D]
    kv_heads, width = shape[-2], shape[-1]
    out = kv_heads * (width - 2 * head_dim if index == 0 else head_dim)
    return (shape[0], out) if len(shape) == 3 else (out,)


def fuse(var, parts: list[np.ndarray], head_dim: int) -> np.ndarray:
    """The parameter from its checkpoint tensors, each already in our layout ([in, out]
    weights, [out] biases) and shape-checked; a single tensor is itself."""
    _, hf = declared(var)
    if hf.fuse in (None, "first"):
        (value,) = parts
        return value
    if hf.fuse == "head_rows":
        (value,) = parts
        first, rows, per, axes = hf.split
        value = value.reshape(value.shape[0], -1, per)[:, :, first:first + rows]
        return np.ascontiguousarray(value.transpose(axes))
    if hf.fuse == "interleaved":  # [..., 2 * out], gate and up alternating -> [..., 2, out]
        (value,) = parts
        pairs = value.reshape(*value.shape[:-1], -1, 2)
        return np.ascontiguousarray(np.swapaxes(pairs, -1, -2))
    if hf.fuse == "experts":
        per = len(hf.names)  # tensors per expert
        experts = [parts[i:i + per] for i in range(0, len(parts), per)]
        if per > 1:
            return np.stack([np.stack(p, axis=1) for p in experts])  # [E, in, per, out]
        return np.stack([p[0] for p in experts])  # [E, in, out]
    if hf.fuse == "stack":
        return np.stack(parts, axis=1 if parts[0].ndim == 2 else 0)  # [in, n, out]
    q, k, v = parts
    kv_heads = k.shape[-1] // head_dim
    lead = q.shape[:-1]  # (in,) for the weight, () for the bias
    q = q.reshape(*lead, kv_heads, -1)  # [.., Hkv, G*D]: the group of each KV head
    k = k.reshape(*lead, kv_heads, head_dim)
    v = v.reshape(*lead, kv_heads, head_dim)
    return np.concatenate([q, k, v], axis=-1)


def to_param_layout(var, value: np.ndarray) -> np.ndarray:
    """value in the [in, out] layout -> the parameter's own (column panels if packed)."""
    if getattr(var, "unpacked_shape", None) is None:
        return value
    from jaxinfer.layers.cpu_kernels import pack

    if getattr(var, "stacked_experts", False):  # each expert packed on its own
        return np.stack([pack(w.reshape(w.shape[0], -1)) for w in value])
    return pack(value.reshape(value.shape[0], -1))

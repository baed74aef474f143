"""Build a model from an HF folder (single or sharded safetensors) or with dummy weights.

The module is first built abstractly (nnx.eval_shape: no memory), then every parameter is filled
from the checkpoint tensor of the same dotted name, transposed for Linear weights ([out, in] in
HF, [in, out] here) and cast to the requested dtype. `load_format="dummy"` initialises random
weights of the right shapes inside one jitted function, so they are made directly on device.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig, resolve_dtype
from jaxinfer.config.dtypes import dtype as array_dtype
from jaxinfer.layers.params import (checkpoint_names, declared, fuse, logical_shape,
                                    source_shape, to_param_layout)
from jaxinfer.models.registry import get_model_class
from jaxinfer.parallel import param_spec, replicate_kv_heads, sharding, tp_model_config

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _param_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _safetensors_index(model_dir: str) -> dict[str, str]:
    """tensor name -> file, for single or sharded (model.safetensors.index.json) checkpoints."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return vl_names(_bare_names({name: os.path.join(model_dir, fn)
                                      for name, fn in weight_map.items()}))
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}"
        )
    from safetensors import safe_open

    with safe_open(single, framework="numpy") as f:
        return vl_names(_bare_names({name: single for name in f.keys()}))


# transformers >= 5 saves a vision-language checkpoint under its own module paths; the model
# classes use the hub's (Gemma 3's image path under `visual.`, as Qwen's tower): (prefix as
# stored, prefix the classes use). One table, read both ways; a language model stored under
# one of _VL_MARKERS marks such a checkpoint. (Gemma 3's hub layout: language_model.model.*,
# vision_tower.vision_model.*, multi_modal_projector.*)
_SIGLIP = "visual.vision_tower.vision_model."
_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."),
                ("model.vision_tower.vision_model.", _SIGLIP), ("model.vision_tower.", _SIGLIP),
                ("model.multi_modal_projector.", "visual.multi_modal_projector."),
                ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("vision_tower.vision_model.", _SIGLIP), ("vision_tower.", _SIGLIP),
                ("multi_modal_projector.", "visual.multi_modal_projector."))
_VL_MARKERS = ("model.language_model.", "language_model.model.")


def _stored_name(name: str, header: dict) -> str:
    """Where tensor `name` (as the model classes name it) is in a file: under that name, a
    bare decoder's (no "model."), or a vision-language checkpoint's (_VL_PREFIXES)."""
    candidates = [name, name.removeprefix("model.")]
    candidates += [stored + name[len(ours):] for stored, ours in _VL_PREFIXES
                   if name.startswith(ours)]
    return next((c for c in candidates if c in header), name)


def vl_names(files_by_name: dict[str, str]) -> dict[str, str]:
    """A vision-language checkpoint's names (transformers 5's, or Gemma 3's hub layout) as the
    model classes name the tensors."""
    if not any(n.startswith(_VL_MARKERS) for n in files_by_name):
        return files_by_name
    out = {}
    for n, fn in files_by_name.items():
        for stored, ours in _VL_PREFIXES:
            if n.startswith(stored):
                n = ours + n[len(stored):]
                break
        out[n] = fn
    return out


def _bare_names(files_by_name: dict[str, str]) -> dict[str, str]:
    """A bare decoder's checkpoint (HF's Qwen3Model & co: embed_tokens / layers / norm without
    the "model." prefix) under the names the model classes use; _iter_tensors reads each from
    its stored name."""
    if any(n.startswith("model.") for n in files_by_name) or \
            "embed_tokens.weight" not in files_by_name:
        return files_by_name
    return {("model." + n if n.split(".")[0] in ("embed_tokens", "layers", "norm") else n): fn
            for n, fn in files_by_name.items()}


_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _safetensors_header(fn: str) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and data offset."""
    with open(fn, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _iter_tensors(files_by_name: dict[str, str], wanted: list[str]):
    """(name, host numpy array) for each wanted tensor, one file open at a time. fp8 tensors
    (which safetensors' numpy reader cannot type) are read from the file directly."""
    from safetensors import safe_open

    from jaxinfer.layers.quantization import np_dtype

    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files_by_name[name], []).append(name)
    for fn, names in by_file.items():
        header, base = _safetensors_header(fn)
        with safe_open(fn, framework="numpy") as f:
            for name in names:
                stored = _stored_name(name, header)
                info = header[stored]
                if info["dtype"] in _RAW_DTYPES:
                    start, end = info["data_offsets"]
                    raw = np.fromfile(fn, np.uint8, end - start, offset=base + start)
                    yield name, raw.view(np_dtype(_RAW_DTYPES[info["dtype"]])).reshape(
                        info["shape"])
                else:
                    yield name, f.get_tensor(stored)


# MXFP4 (OCP microscaling, gpt-oss's experts): 4-bit e2m1 codes, two per byte (low nibble
# first), each 32 along the input sharing one power-of-two scale (uint8, bias 127).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_PARTS = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32] -> float32
    [E, in, out] (the orientation of the float checkpoints' stacked experts)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim != 4 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                         f"{scales.dtype}{list(scales.shape)} do not match (uint8 [E, out, G, "
                         f"16] and [E, out, G])")
    e, out, g, b = blocks.shape
    values = np.empty((e, out, g, 2 * b), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.ascontiguousarray(values.reshape(e, out, g * 2 * b).transpose(0, 2, 1))


def _with_mxfp4(tensors, mxfp4: set[str]):
    """The tensor stream with each MXFP4 tensor of `mxfp4` (its _blocks and _scales parts)
    replaced by its float32 value, under its own name."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        base = next((name[: -len(p)] for p in MXFP4_PARTS
                     if name.endswith(p) and name[: -len(p)] in mxfp4), None)
        if base is None:
            yield name, tensor
            continue
        got = parts.setdefault(base, {})
        got[name[len(base):]] = tensor
        if len(got) == 2:
            del parts[base]
            yield base, dequantize_mxfp4(got["_blocks"], got["_scales"])


_SCALE_NAMES = {".weight_scale": "scale", ".weight_scale_inv": "scale",
                ".weight_offset": "offset"}  # (weight_offset: jaxinfer's GGUF conversion)


def _checkpoint_scales(files_by_name: dict[str, str]) -> dict[str, dict[str, np.ndarray]]:
    """Every weight scale (and GGUF offset) in the checkpoint (small), by the name of the
    weight: {"scale": ..., "offset": ...}."""
    wanted = [n for n in files_by_name if n.endswith(tuple(_SCALE_NAMES))]
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in _iter_tensors(files_by_name, wanted):
        suffix = next(s for s in _SCALE_NAMES if name.endswith(s))
        out.setdefault(name[: -len(suffix)] + ".weight", {})[_SCALE_NAMES[suffix]] = \
            np.asarray(tensor, np.float32)
    return out


def _quantized_source(src: str, tensor: np.ndarray, entry: dict, qcfg, *, kv_repeat: int,
                      head_dim: int, is_kv: bool) -> tuple[np.ndarray, ...]:
    """A quantized checkpoint weight (HF [out, in]) with its scale (and offset) -> ours:
    [in, out] and [KB, out] each (KV heads replicated in all)."""
    from jaxinfer.layers.quantization import expand_checkpoint_scale

    if tensor.ndim != 2 or "scale" not in entry:
        raise ValueError(f"quantized tensor {src!r} has shape {tensor.shape}"
                         + ("" if "scale" in entry else " and no weight scale")
                         + ": expected a 2-D weight with its scale")
    out, inp = tensor.shape
    block = qcfg.block if qcfg else None
    extra = [expand_checkpoint_scale(entry[k], out, inp, block)  # [KB, out]
             for k in ("scale", "offset") if k in entry]
    if kv_repeat > 1 and is_kv:
        tensor = replicate_kv_heads(tensor, kv_repeat, head_dim)
        extra = [replicate_kv_heads(s.T, kv_repeat, head_dim).T for s in extra]
    return (transposed(tensor), *extra)


def _host_tensor(name: str, tensor: np.ndarray, expected_shape, dtype, *, kv_repeat: int,
                 head_dim: int, transpose: bool, is_kv: bool) -> np.ndarray:
    """Checkpoint tensor -> the model's layout ([in, out], KV heads replicated), checked."""
    if kv_repeat > 1 and is_kv:
        tensor = replicate_kv_heads(tensor, kv_repeat, head_dim)
    if transpose:
        tensor = transposed(tensor)
    if tuple(tensor.shape) != tuple(expected_shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)} (after transposing HF's [out, in] "
            f"layout where it applies) but the model expects {tuple(expected_shape)}"
        )
    # (a transposed tensor is a fresh copy already; device_put copies what it places)
    return tensor.astype(dtype, copy=False)


def transposed(x: np.ndarray, block: int = 256) -> np.ndarray:
    """x.T as a C-contiguous copy, copied block by block: numpy's strided copy of a large
    transpose misses the cache on every element (2.6x slower for a 8192 x 2048 matrix)."""
    if x.ndim != 2 or x.size < (1 << 16):
        return np.ascontiguousarray(x.T)
    out = np.empty(x.shape[::-1], x.dtype)
    for i in range(0, x.shape[0], block):
        for j in range(0, x.shape[1], block):
            out[j:j + block, i:i + block] = x[i:i + block, j:j + block].T
    return out


def _source_part(src: str, tensor: np.ndarray, ckpt_entry, shape, var, scale_var, qcfg, *,
                 kv_repeat: int, head_dim: int, transpose: bool, is_kv: bool):
    """One checkpoint tensor as its part of parameter `var`: for a float parameter the (if
    quantized in the checkpoint: dequantized) tensor in our layout; for a quantized one
    (scale_var set) the pair (quantized [in, out], scale [KB, out]), quantized here per output
    channel when the checkpoint's tensor is float."""
    from jaxinfer.layers.quantization import dequantize, quantize

    if ckpt_entry is not None:  # (its scale, offset: _checkpoint_scales)
        parts = _quantized_source(src, tensor, ckpt_entry, qcfg, kv_repeat=kv_repeat,
                                  head_dim=head_dim, is_kv=is_kv)
        q = parts[0]
        # (a float table in the checkpoint's own orientation, from GGUF's quantized
        # token_embd: the embedding where its packed tied head is not used)
        as_table = scale_var is None and not transpose
        if tuple(q.T.shape if as_table else q.shape) != tuple(shape):
            raise ValueError(f"tensor {src!r} has shape {tuple(tensor.shape)} but the model "
                             f"expects {tuple(shape)}"
                             + ("" if as_table else " (after transposing HF's [out, in])"))
        if scale_var is None:
            block = qcfg.in_block if qcfg is not None else None
            value = dequantize(*parts[:2], block, *parts[2:]).astype(var.dtype)
            return value.T if as_table else value
        if np.dtype(q.dtype) != np.dtype(var.dtype):
            raise ValueError(f"tensor {src!r} is {q.dtype} but the model holds "
                             f"{np.dtype(var.dtype)} weights")
        if len(parts) != 2 + bool(qcfg.offset):
            raise ValueError(f"tensor {src!r}: weight_offset "
                             + ("missing" if qcfg.offset else "unexpected"))
        return parts
    if scale_var is None:
        return _host_tensor(src, tensor, shape, var.dtype, kv_repeat=kv_repeat,
                            head_dim=head_dim, transpose=transpose, is_kv=is_kv)
    if qcfg.from_checkpoint:
        raise ValueError(f"the checkpoint's quantization_config quantizes {src!r} but it has "
                         f"no {src}_scale / {src}_scale_inv")
    value = _host_tensor(src, tensor, shape, np.float32, kv_repeat=kv_repeat, head_dim=head_dim,
                         transpose=transpose, is_kv=is_kv)
    return quantize(value, qcfg.weight_dtype)


def _place(var, tensor: np.ndarray, *, mesh, to_host: bool = False,
           expert_parallel: bool = False) -> jax.Array:
    """Host tensor -> parameter `var`'s device array, placed straight into its shards."""
    tensor = np.ascontiguousarray(tensor).reshape(np.shape(tensor))  # (keeps 0-d scalars 0-d)
    if to_host:  # (pipeline stages place their own parameters)
        return tensor
    if mesh is None:
        return jax.device_put(tensor)
    # Each device (of every process) receives only its own slice.
    spec = sharding(mesh, param_spec(var, mesh.size, expert_parallel))
    return jax.make_array_from_callback(tensor.shape, spec, lambda idx: tensor[idx])


def param_sources(expected: dict, available, rename=None) -> tuple[dict, list[str], list[str]]:
    """(parameter name -> its checkpoint tensors, LoRA slot parameters, parameters left at
    their declared default) for the parameters `expected` (name -> Variable), given the
    checkpoint tensor names `available` (a container); rename: as fill_from_checkpoint's."""
    names = list(expected)
    # (a quantized weight's weight_scale is filled with its weight)
    # (LoRA slots are no checkpoint's: they start empty, zeros, and adapters fill them)
    lora = [name for name in names if getattr(expected[name], "lora", False)]
    rename = rename or (lambda src: src)
    sources = {name: tuple(rename(src) for src in checkpoint_names(name, expected[name]))
               for name in names if not (name.endswith(("_scale", "_offset"))
                                         and name.rsplit("_", 1)[0] in expected)
               and name not in lora}
    # Parameters held under one of several names (fp8 KV cache scales: self_attn.k_scale, or
    # compressed-tensors' k_proj.output_scale): the first the checkpoint has, else their
    # declared default (1.0, as vLLM does).
    defaulted = []
    for name in list(sources):
        _, hf = declared(expected[name])
        if hf.fuse == "first":
            present = [src for src in sources[name] if src in available]
            if present:
                sources[name] = present[:1]
            elif hf.default is not None:
                del sources[name]
                defaulted.append(name)
    return sources, lora, defaulted


def source_owners(sources: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """checkpoint tensor -> the parameters made from it (a tied packed LM head shares the
    embedding's tensor)."""
    owners: dict[str, list[str]] = {}
    for name in sources:
        for src in sources[name]:
            owners.setdefault(src, []).append(name)
    return owners


def convert_tensors(expected: dict, sources: dict[str, tuple[str, ...]], tensors, *,
                    ckpt_scales: dict, kv_repeat: int, head_dim: int, qcfg, put) -> dict:
    """Checkpoint tensors -> parameter values, each handed to put(var, value in the
    parameter's own layout[, expert_parallel]) once all of its sources have arrived (fused
    q/k/v and gate/up, stacked experts); quantized where the model quantizes (a float
    tensor quantized here, a checkpoint's quantized one with its scale), packed where it
    packs. expected: parameter name -> its Variable; sources: parameter name -> its
    checkpoint tensors; tensors: (checkpoint name, host array) pairs. Returns the
    parameters still missing a source: {name: {source: part}} (the loader checked they
    cannot be; a weight update reports them)."""
    owners = source_owners(sources)
    from jaxinfer.layers.quantization import pack_nibbles, to_nibbles
    pending: dict[str, dict[str, np.ndarray]] = {}  # fused params still missing a part
    for src, tensor in tensors:
        for name in owners[src]:
            var = expected[name]
            scale_var = expected.get(name + "_scale")  # a quantized weight's weight_scale
            offset_var = expected.get(name + "_offset")  # (GGUF) weight_offset
            srcs = sources[name]
            _, hf = declared(var)
            index = srcs.index(src)
            if hf.fuse == "first" and var.shape == ():  # (a scale: one positive number)
                if tensor.size != 1 or not np.isfinite(tensor).all() or tensor.reshape(-1)[0] <= 0:
                    raise ValueError(f"scale {src!r} must be one positive number, got "
                                     f"shape {tuple(tensor.shape)}")
                put(var, np.asarray(tensor, np.float32).reshape(()), False)
                continue
            shape = source_shape(var, index % len(hf.names), head_dim)
            if hf.flatten:
                tensor = tensor.reshape(tensor.shape[0], -1)
            parts = pending.setdefault(name, {})
            parts[src] = _source_part(src, tensor, ckpt_scales.get(src), shape, var, scale_var,
                                      qcfg, kv_repeat=kv_repeat, head_dim=head_dim,
                                      transpose=hf.transpose,
                                      is_kv=hf.is_kv(index % len(hf.names)))
            if len(parts) < len(srcs):
                continue
            del pending[name]
            ordered = [parts[s] for s in srcs]
            if scale_var is not None:  # (quantized, scale[, offset]): each fused the same way
                fused = [ordered[0][i] if len(srcs) == 1 else fuse(
                    var, [p[i] for p in ordered], head_dim)
                    for i, suffix in enumerate(("", "_scale", "_offset")[:len(ordered[0])])]
                value = fused[0]
                nibbles = None  # (GGUF 4-bit codes, packed two to a byte for the C++ kernel)
                if (offset_var is not None and getattr(var, "unpacked_shape", None) is not None
                        and not getattr(var, "stacked_experts", False)):
                    nibbles = to_nibbles(value.reshape(value.shape[0], -1),
                                         fused[1].reshape(fused[1].shape[0], -1),
                                         fused[2].reshape(fused[2].shape[0], -1))
                    if nibbles is not None:
                        fused[2] = nibbles[1].reshape(fused[2].shape)
                for extra, evar, suffix in zip(fused[1:], (scale_var, offset_var),
                                               ("_scale", "_offset")):
                    if tuple(extra.shape) != logical_shape(evar):
                        raise ValueError(f"{name}: weight{suffix} of shape "
                                         f"{tuple(extra.shape)}, the model expects "
                                         f"{logical_shape(evar)}")
                    put(evar, to_param_layout(evar, extra))
                if nibbles is not None:
                    put(var, pack_nibbles(to_param_layout(var, nibbles[0])))
                    continue
            else:
                value = fuse(var, ordered, head_dim)
            put(var, to_param_layout(var, value))
    return pending


def fill_from_checkpoint(expected: dict, model_dir: str, model_config: ModelConfig | None, *,
                         put, kv_repeat: int = 1, rename=None) -> None:
    """Set every parameter of `expected` (name -> its abstract Variable) from the checkpoint in
    model_dir through put(var, host value[, expert_parallel]). rename: checkpoint tensor name
    as the parameter's path gives it -> its name in the file (a module loaded from inside
    another model's checkpoint: the MTP layer). model_config None: a module without fused
    q/k/v or quantized weights (a vision tower)."""
    files_by_name = _safetensors_index(model_dir)
    sources, lora, defaulted = param_sources(expected, files_by_name, rename)
    owners = source_owners(sources)  # (a tied packed LM head shares the embedding's tensor)
    wanted = list(owners)
    mxfp4 = set()
    if model_config is not None and model_config.mxfp4_experts:  # (dequantized as they come)
        mxfp4 = {n for n in wanted if n not in files_by_name
                 and all(n + p in files_by_name for p in MXFP4_PARTS)}
        wanted = [n for n in wanted if n not in mxfp4] + [n + p for n in mxfp4
                                                           for p in MXFP4_PARTS]
    missing = [n for n in wanted if n not in files_by_name]
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    convert_tensors(expected, sources, _with_mxfp4(_iter_tensors(files_by_name, wanted), mxfp4),
                    ckpt_scales=_checkpoint_scales(files_by_name), kv_repeat=kv_repeat,
                    head_dim=model_config.head_dim if model_config is not None else 0,
                    qcfg=model_config.quantization if model_config is not None else None,
                    put=put)
    for name in defaulted:
        var = expected[name]
        put(var, np.full(var.shape, declared(var)[1].default, np.float32), False)
    for name in lora:
        var = expected[name]
        put(var, np.zeros(var.shape, var.dtype), False)


def load_module(make, model_dir: str, model_config: ModelConfig | None = None, *,
                rename=None):
    """The module make() builds (abstractly first: no random weights), every parameter from
    the checkpoint in model_dir, on the default device (fill_from_checkpoint's arguments)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    flat = nnx.to_flat_state(abstract)

    def put(var, value, expert_parallel=False):
        var.set_value(jax.device_put(np.ascontiguousarray(value)))

    fill_from_checkpoint({_param_name(path): var for path, var in flat}, model_dir,
                         model_config, put=put, rename=rename)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build_model(model_config: ModelConfig, *, dtype: str, attention_backend: str, seed: int = 0,
                mesh=None, tp: int = 1):
    """A function building the model: packed weights for the `cpu` backend's matmul kernel
    where it runs on one device (float32; a tensor-parallel build is placed on a mesh)."""
    from jaxinfer.layers.cpu_kernels import use_packed_weights

    cls = get_model_class(model_config.architecture)
    packed = tp == 1 and use_packed_weights(attention_backend, array_dtype(dtype), mesh)

    def make():
        return cls(model_config, dtype=array_dtype(dtype), attention_backend=attention_backend,
                   rngs=nnx.Rngs(seed), mesh=mesh, packed=packed)

    return make


def load_model(model_dir: str, *, dtype: str = "auto", load_format: str = "auto",
               attention_backend: str = "xla", seed: int = 0,
               model_config: ModelConfig | None = None, mesh=None, to_host: bool = False,
               tp_size: int | None = None, expert_parallel: bool = False,
               sequence_parallel: bool = False):
    """Returns (model, model_config, dtype_name). With a mesh (tensor parallelism), every
    parameter goes from host memory straight into its shards, and the returned config has its
    KV heads replicated up to the mesh size where they were fewer. to_host: parameters stay
    numpy arrays in host memory (pipeline stages place them), KV heads replicated up to
    tp_size. expert_parallel: a mixture-of-experts model's experts split by expert over the
    devices (enable_expert_parallel), not each expert over them. sequence_parallel: the
    residual stream token-sharded between tensor-parallel regions."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r} is not supported (supported: {', '.join(LOAD_FORMATS)})"
        )
    model_config = model_config or ModelConfig.from_pretrained(model_dir)
    tp = tp_size if tp_size is not None else (1 if mesh is None else mesh.size)
    model_config, kv_repeat = tp_model_config(model_config, tp, expert_parallel,
                                              sequence_parallel)
    ep = model_config.expert_parallel
    dtype_name = resolve_dtype(dtype, model_config)
    make = build_model(model_config, dtype=dtype_name, attention_backend=attention_backend,
                       seed=seed, mesh=mesh, tp=tp)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    flat = nnx.to_flat_state(abstract)
    names = [_param_name(path) for path, _ in flat]
    if load_format == "dummy":
        shardings = nnx.from_flat_state([
            (path, sharding(mesh, param_spec(var, tp, ep)) if mesh else None)
            for path, var in flat])
        def dummy():
            return nnx.state(make())

        init = jax.jit(dummy, out_shardings=shardings if mesh is not None else None)
        state = init()
        if to_host:
            state = jax.device_get(state)
        return nnx.merge(graphdef, state), model_config, dtype_name

    def put(var, value, expert_parallel=ep):
        var.set_value(_place(var, value, mesh=mesh, to_host=to_host,
                             expert_parallel=expert_parallel))

    fill_from_checkpoint({name: var for (_, var), name in zip(flat, names)}, model_dir,
                         model_config, kv_repeat=kv_repeat, put=put)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model, model_config, dtype_name

"""Linear and gated-MLP layers. Weights are stored [in, out] (HF's [out, in] transposed), or,
with packed=True (float32 and bfloat16 models on the `cpu` backend), in column panels
[ceil(out/32), in, 32] multiplied by the C++ kernel (layers/cpu_kernels.py); the loader packs
them (the Param's `unpacked_shape` metadata says what it packs from). With a QuantConfig
(layers/quantization.py) the weight is held in fp8 / int8 with a float32 `weight_scale`
[KB, *out] beside it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.layers.lora import add_lora, lora_params
from jaxinfer.layers.params import HF, LINEAR, param, scale_axes


def _init(rngs: nnx.Rngs, shape, dtype, std: float = 0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def _initializer(rngs: nnx.Rngs, dtype, quant):
    """shape -> dummy weight values: N(0, 0.02) in dtype; quantized, N(0, 1) * qmax / 4 in
    the quantized dtype (times _scale_value: std 0.02 again)."""
    if quant is None:
        return lambda s: _init(rngs, s, dtype)
    from jaxinfer.layers.quantization import QMAX

    qmax = QMAX[quant.weight_dtype]
    return lambda s: jnp.clip(jax.random.normal(rngs.params(), s) * qmax / 4, -qmax,
                              qmax).astype(jnp.dtype(quant.weight_dtype))


def _scale_value(quant) -> float:
    """The dummy scale of quantized dummy weights (see _initializer)."""
    from jaxinfer.layers.quantization import QMAX

    return 0.02 * 4 / QMAX[quant.weight_dtype]


def _weight(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, packed: bool, quant=None, *,
            axes: tuple, hf: HF = LINEAR) -> nnx.Param:
    """A weight of logical shape (in, *out) and its declaration (layers/params.py): plain, or
    packed into column panels over the flattened outputs; quantized values with a quant
    config."""
    init = _initializer(rngs, dtype, quant)
    if not packed:
        return param(init(shape), axes=axes, hf=hf)
    from jaxinfer.layers.cpu_kernels import packed_shape

    n = math.prod(shape[1:])
    return param(init(packed_shape(shape[0], n)), axes=axes, hf=hf, unpacked_shape=shape)


def _scale(shape: tuple[int, ...], quant, packed: bool, axes: tuple,
           value: float | None = None):
    """weight_scale [KB, *out] of a quantized weight of logical shape (in, *out) and axes
    `axes` (dummy values: std 0.02 for the dummy weights above), packed into column panels
    [P, KB, 32] with the weight; value=0.0: a GGUF-style weight_offset of the same shape.
    (The checkpoint's scales are read with their weight: loader.py.)"""
    if quant is None:
        return None
    kb = 1 if quant.in_block is None else -(-shape[0] // quant.in_block)
    if value is None:
        value = _scale_value(quant)
    logical = (kb, *shape[1:])
    if not packed:
        return param(jnp.full(logical, value, jnp.float32), axes=scale_axes(axes))
    from jaxinfer.layers.cpu_kernels import packed_shape

    return param(jnp.full(packed_shape(kb, math.prod(shape[1:])), value, jnp.float32),
                 axes=scale_axes(axes), unpacked_shape=logical)


def _offset(shape: tuple[int, ...], quant, packed: bool, axes: tuple):
    """weight_offset (GGUF's asymmetric blocks: w = q * scale + offset), else None."""
    if quant is None or not quant.offset:
        return None
    return _scale(shape, quant, packed, axes, 0.0)


def _matmul(x: jax.Array, weight: jax.Array, packed: bool, out_shape: tuple[int, ...],
            scale: jax.Array | None = None, quant=None, offset: jax.Array | None = None):
    """x [T, in] @ a weight of logical shape (in, *out_shape) -> [T, *out_shape]
    (quantized: weight * scale (+ offset))."""
    if scale is not None:
        if packed:
            from jaxinfer.layers.cpu_kernels import matmul

            n = math.prod(out_shape)
            return matmul(x, weight, n, scale, offset).reshape(*x.shape[:-1], *out_shape)
        from jaxinfer.layers.quantization import qmatmul

        return qmatmul(x, weight, scale, out_shape, in_block=quant.in_block,
                       activation_fp8=quant.activation_fp8, offset=offset)
    if packed:
        from jaxinfer.layers.cpu_kernels import matmul

        return matmul(x, weight, math.prod(out_shape)).reshape(*x.shape[:-1], *out_shape)
    if len(out_shape) == 1:
        return x @ weight
    return jnp.einsum("ti,i...->t...", x, weight)


def _packed(packed: bool, quant) -> bool:
    """Quantized weights are packed for the CPU kernel with per-channel scales or GGUF's
    groups (not with checkpoints' 2-D blocks, whose last group may end short)."""
    return packed and (quant is None or quant.in_block is None or quant.method == "gguf")


def _value(p):
    return None if p is None else p[...]


class Linear(nnx.Module):
    """x @ W (+ b). axes: the logical axes of W [in, out] (layers/params.py), e.g. ("heads",
    "embed") for a row-parallel output projection; None: never split."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, packed: bool = False, quant=None,
                 axes: tuple = (None, None), lora=None):
        """lora: (slots, rank) of multi-LoRA serving (layers/lora.py), or None."""
        self.quant = quant
        self.packed, self.out_features = _packed(packed, quant), out_features
        shape = (in_features, out_features)
        self.weight = _weight(rngs, shape, dtype, self.packed, quant, axes=axes)  # [in, out]
        self.weight_scale = _scale(shape, quant, self.packed, axes)  # [KB, out] (quantized)
        self.weight_offset = _offset(shape, quant, self.packed, axes)
        self.bias = (param(jnp.zeros((out_features,), dtype), axes=axes[1:]) if use_bias
                     else None)  # [out]
        self.lora_a, self.lora_b = lora_params(lora, in_features, (out_features,), axes, 1,
                                               dtype)

    def __call__(self, x: jax.Array, lora_slots=None) -> jax.Array:
        """x [T, in] -> [T, out]; lora_slots: each token's adapter slot (int32 [T]) or None."""
        y = _matmul(x, self.weight[...], self.packed, (self.out_features,),
                    _value(self.weight_scale), self.quant, _value(self.weight_offset))
        if self.bias is not None:
            y = y + self.bias[...]
        return add_lora(y, x, self, lora_slots)

    def gated(self, x: jax.Array, act: str, out_dtype=None) -> jax.Array:
        """(act(gate) * up) @ W from a gate-up product x [T, 2 * in] (gate, then up): packed
        weights without LoRA (cpu_kernels.gated_matmul) -> [T, out] in out_dtype (default
        x's)."""
        from jaxinfer.layers.cpu_kernels import gated_matmul

        y = gated_matmul(x, self.weight[...], self.out_features, act,
                         _value(self.weight_scale), _value(self.weight_offset), out_dtype)
        return y if self.bias is None else y + self.bias[...]


class QKVLinear(nnx.Module):
    """The q, k and v projections as one matmul (vLLM's QKVParallelLinear).

    weight [in, Hkv, (G+2)*D] (G = Hq / Hkv): for each KV head, the G query heads of its group,
    then its key head, then its value head; bias [Hkv, (G+2)*D]. Splitting the KV-head axis
    over devices hands each device exactly its query, key and value heads (tensor
    parallelism), for any device count that divides Hkv. The loader builds it from HF's
    q_proj / k_proj / v_proj (models/fused.py)."""

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 use_bias: bool, dtype, rngs: nnx.Rngs, packed: bool = False, quant=None,
                 lora=None):
        self.quant = quant
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.packed = _packed(packed, quant)
        self.group = num_heads // num_kv_heads
        width = (self.group + 2) * head_dim
        shape = (in_features, num_kv_heads, width)
        axes = ("embed", "kv_heads", None)
        qkv = ("q_proj", "k_proj", "v_proj")
        self.weight = _weight(rngs, shape, dtype, self.packed, quant, axes=axes, hf=HF(
            tuple(f"{m}.weight" for m in qkv), transpose=True, fuse="qkv",
            kv=(False, True, True)))
        self.weight_scale = _scale(shape, quant, self.packed, axes)
        self.weight_offset = _offset(shape, quant, self.packed, axes)
        self.bias = (param(jnp.zeros((num_kv_heads, width), dtype), axes=axes[1:], hf=HF(
            tuple(f"{m}.bias" for m in qkv), fuse="qkv", kv=(False, True, True)))
            if use_bias else None)
        # (q, k and v parts: each adapter's delta lands in this fused per-KV-head layout)
        self.lora_a, self.lora_b = lora_params(lora, in_features, shape[1:], axes, 3, dtype)

    def __call__(self, x: jax.Array, lora_slots=None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, in] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        width = (self.group + 2) * self.head_dim
        y = _matmul(x, self.weight[...], self.packed, (self.num_kv_heads, width),
                    _value(self.weight_scale), self.quant, _value(self.weight_offset))
        if self.bias is not None:
            y = y + self.bias[...]
        t, g, d = x.shape[0], self.group, self.head_dim
        y = add_lora(y, x, self, lora_slots, (g * d, d, d))
        y = y.reshape(t, self.num_kv_heads, g + 2, d)
        q = y[:, :, :g].reshape(t, self.num_kv_heads * g, d)
        return q, y[:, :, g], y[:, :, g + 1]


class GateUpLinear(nnx.Module):
    """The gate and up projections as one matmul (vLLM's MergedColumnParallelLinear):
    weight [in, 2, I] (gate, then up), split over I for tensor parallelism."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs,
                 packed: bool = False, quant=None, lora=None):
        self.quant = quant
        self.packed, self.out_features = _packed(packed, quant), out_features
        shape = (in_features, 2, out_features)
        axes = ("embed", None, "mlp")
        self.weight = _weight(rngs, shape, dtype, self.packed, quant, axes=axes, hf=HF(
            ("gate_proj.weight", "up_proj.weight"), transpose=True, fuse="stack"))
        self.weight_scale = _scale(shape, quant, self.packed, axes)
        self.weight_offset = _offset(shape, quant, self.packed, axes)
        self.lora_a, self.lora_b = lora_params(lora, in_features, shape[1:], axes, 2, dtype,
                                               stacked=True)

    def __call__(self, x: jax.Array, lora_slots=None) -> tuple[jax.Array, jax.Array]:
        y = _matmul(x, self.weight[...], self.packed, (2, self.out_features),
                    _value(self.weight_scale), self.quant, _value(self.weight_offset))  # [T, 2, I]
        y = add_lora(y, x, self, lora_slots, "stack")
        return y[:, 0], y[:, 1]

    def product(self, x: jax.Array) -> jax.Array:
        """x [T, in] -> the gate-up product [T, 2I] (gate, then up) for a GatedMLP's gated path
        (packed weights without LoRA): in x's dtype from float weights (a bf16 model's bf16
        product, as its unfused path makes it: half the bytes for the gated kernel to read),
        float32 from quantized ones (their kernels make float32)."""
        from jaxinfer.layers.cpu_kernels import matmul

        out = jnp.float32 if self.quant is not None else x.dtype
        return matmul(x, self.weight[...], 2 * self.out_features, _value(self.weight_scale),
                      _value(self.weight_offset), out_dtype=out)


ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): the Llama/Qwen MLP (silu), Gemma's (gelu, tanh form).

    With packed weights (the cpu backend) and no LoRA, act(gate) * up is made inside the down
    projection's kernel from the gate-up product (`gated`): no XLA fusion
    between the two kernels (XLA split that one over its thread pool; bf16 and Q4 decode
    steps ran 2-5% faster without it, results/cpu_gated_mlp_ab_zen5.json)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs,
                 packed: bool = False, act: str = "silu", quant=(None, None), lora=None):
        self.act = act
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, dtype=dtype, rngs=rngs,
                                         packed=packed, quant=quant[0], lora=lora)
        self.down_proj = Linear(intermediate_size, hidden_size, use_bias=False, dtype=dtype,
                                rngs=rngs, packed=packed, quant=quant[1], axes=("mlp", "embed"),
                                lora=lora)
        self.gated = False
        if self.gate_up_proj.packed and self.down_proj.packed and lora is None:
            from jaxinfer.layers.cpu_kernels import GATED_ACTS

            self.gated = act in GATED_ACTS

    def __call__(self, x: jax.Array, lora_slots=None) -> jax.Array:
        if self.gated:
            return self.down_proj.gated(self.gate_up_proj.product(x), self.act, x.dtype)
        gate, up = self.gate_up_proj(x, lora_slots)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up, lora_slots)


def packed_rows(weight: jax.Array, ids: jax.Array, in_features: int,
                scale: jax.Array | None = None, offset: jax.Array | None = None) -> jax.Array:
    """Rows `ids` of W^T from a packed weight W [in, out] ([P, in, 32] column panels; 4-bit
    codes: uint8 [P, in / 2, 32]; quantized with scale / offset [P, in / G, 32]) -> float32
    [len(ids), in]: a packed tied LM head serves the embedding lookups too."""
    p, c = ids // 32, ids % 32
    cols = weight[p, :, c]  # [T, in] (4-bit: [T, in / 2], two codes a byte)
    if weight.dtype == jnp.uint8:
        cols = jnp.stack([cols & 15, cols >> 4], axis=-1).reshape(ids.shape[0], in_features)
    rows = cols.astype(jnp.float32)
    if scale is None:
        return rows
    s = scale[p, :, c]  # [T, in / G]
    grouped = rows.reshape(ids.shape[0], s.shape[1], -1) * s[..., None]
    if offset is not None:
        grouped = grouped + offset[p, :, c][..., None]
    return grouped.reshape(ids.shape[0], in_features)


class Embedding(nnx.Module):
    """The token embedding [V, H]. As a tied LM head on the `cpu` backend (packed_lm_head) it
    is held once, as the head: `lm_weight`, the table's transpose packed in column panels for
    the matmul kernel (with `quant`, GGUF's tied token_embd: quantized, with lm_weight_scale /
    lm_weight_offset), and the looked-up rows are gathered from those panels."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs,
                 packed_lm_head: bool = False, scale: float | None = None, quant=None):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.dtype = dtype
        self.scale = scale  # Gemma: looked-up rows x sqrt(hidden), in the table's dtype
        self.quant = quant if packed_lm_head else None
        if packed_lm_head:  # (the checkpoint's table [V, H] is this head's [out, in])
            shape, axes = (hidden_size, vocab_size), ("embed", "vocab")
            self.weight = None
            self.lm_weight = _weight(rngs, shape, dtype, True, self.quant, axes=axes)
            self.lm_weight_scale = _scale(shape, self.quant, True, axes)
            self.lm_weight_offset = _offset(shape, self.quant, True, axes)
        else:  # [V, H]
            self.weight = param(_init(rngs, (vocab_size, hidden_size), dtype),
                                axes=("vocab", "embed"))
            self.lm_weight = self.lm_weight_scale = self.lm_weight_offset = None

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.weight is not None:
            rows = jnp.take(self.weight[...], ids, axis=0)
        else:
            rows = packed_rows(self.lm_weight[...], ids, self.hidden_size,
                               _value(self.lm_weight_scale),
                               _value(self.lm_weight_offset)).astype(self.dtype)
        if self.scale is not None:
            rows = rows * jnp.asarray(self.scale, rows.dtype)
        return rows

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [T, H] -> logits [T, V].

        Unpacked, written as (W [V, H] . x^T)^T: XLA's CPU dot then reads the table in place
        instead of first copying out its transpose (113 MB for SmolLM2, ~15 ms per step)."""
        if self.lm_weight is not None:
            return _matmul(x, self.lm_weight[...], True, (self.vocab_size,),
                           _value(self.lm_weight_scale), self.quant,
                           _value(self.lm_weight_offset))
        return jax.lax.dot_general(self.weight[...], x, (((1,), (1,)), ((), ()))).T

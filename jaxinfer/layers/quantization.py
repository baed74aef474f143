"""Weight quantization: fp8 (e4m3) and int8 linear weights with float32 scales.

A quantized linear layer holds `weight` in the quantized dtype ([in, *out], or packed column
panels for the `cpu` backend's kernel) and `weight_scale` float32 [KB, *out]: one scale per
output column and input block of in / KB rows (KB = 1: per output channel, what quantizing at
load makes; KB = in / 128: block-wise checkpoints such as Qwen3-FP8 and DeepSeek's, whose
128 x 128 blocks give each column of a block the block's scale). The dequantized weight is
weight * scale, computed inside the step: the weight stays quantized in memory.

Where quantized weights come from (`QuantConfig.from_configs`):
- `quantization="fp8"` / `"int8"` on a float checkpoint: each decoder linear weight is
  quantized at load, symmetric, per output channel (scale = max |w[:, j]| / the format's max);
- a checkpoint's HF `quantization_config`: quant_method "fp8" (block-wise `weight_scale_inv`
  with `weight_block_size`, or a per-tensor `weight_scale`) and "compressed-tensors"
  (8-bit float or int weights, per channel / tensor / block `weight_scale`). Anything else
  (awq, gptq, bitsandbytes, mxfp4, 4-bit compressed-tensors, ...) is refused by name.
- "gguf": a .gguf file's projection and LM head blocks kept (checkpoints/gguf_convert.py): int8
  values with a scale and an offset (`weight_offset`) per group of 16 / 32 inputs; for the
  `cpu` backend's kernel, tensors of the 4-bit types are packed two values to a byte
  (`to_nibbles`, `pack_nibbles`).
Routed experts are quantized per expert as well (layers/moe.py). Embeddings, the LM head
(except GGUF's), MoE routers and shared experts stay unquantized; quantized checkpoint tensors
for them are dequantized at load.

Activations stay in the model's dtype (weight-only, W8A16) except with `activation_fp8`
(GPUs: W8A8): each row of x is scaled to fp8 dynamically (per token) and the product runs as
an fp8 x fp8 dot accumulating in float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config.dtypes import dtype as np_dtype
from jaxinfer.config.quant import QMAX, QuantConfig  # noqa: F401  (re-exported)


# -- host-side (numpy) quantization, used by the loader -------------------------------------

def to_nibbles(q: np.ndarray, scale: np.ndarray, offset: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """GGUF int8 values [in, out] whose codes span at most 16 consecutive values (the Q4
    types) -> (codes 0..15 uint8 [in, out], offset [KB, out] with the lowest code folded in:
    q * s + o = (q - lo) * s + (o + lo * s)); None when they do not fit in 4 bits or the
    input count is odd."""
    lo, hi = int(q.min()), int(q.max())
    if hi - lo > 15 or q.shape[0] % 2 or q.shape[0] % scale.shape[0]:
        return None
    if (q.shape[0] // scale.shape[0]) % 2:  # groups of an odd size would split a byte
        return None
    codes = (q.astype(np.int16) - lo).astype(np.uint8)
    return codes, (offset + np.float32(lo) * scale).astype(np.float32)


def pack_nibbles(packed_codes: np.ndarray) -> np.ndarray:
    """Column panels of 4-bit codes [P, K, 32] -> the kernel's byte rows [P, K / 2, 32]: row
    2j in each byte's low nibble, row 2j + 1 in its high one."""
    lo, hi = packed_codes[:, 0::2, :], packed_codes[:, 1::2, :]
    return (lo | (hi << 4)).astype(np.uint8)


def quantize(w: np.ndarray, weight_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """w [in, *out] float -> (quantized [in, *out], scale float32 [1, *out]): symmetric, per
    output column, scale = max |column| / the format's largest value (1 for a zero column)."""
    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / QMAX[weight_dtype], 1.0).astype(np.float32)
    scaled = w32 / scale
    if weight_dtype == "int8":
        return np.clip(np.rint(scaled), -127, 127).astype(np.int8), scale
    qmax = QMAX[weight_dtype]
    return np.clip(scaled, -qmax, qmax).astype(np_dtype(weight_dtype)), scale


def expand_checkpoint_scale(scale: np.ndarray, out_features: int, in_features: int,
                            block: tuple[int, int] | None) -> np.ndarray:
    """A checkpoint's weight scale (HF's [out, in] view: per tensor [] / [1], per channel
    [out] / [out, 1], or block-wise [ceil(out/bn), ceil(in/bk)]) -> ours, [KB, out]."""
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return np.full((1, out_features), s.reshape(()), np.float32)
    if block is not None and s.shape != (out_features, 1):
        bn, bk = block
        want = (-(-out_features // bn), -(-in_features // bk))
        if s.shape != want:
            raise ValueError(f"block-wise weight scale has shape {s.shape}; a [{out_features}, "
                             f"{in_features}] weight in {bn} x {bk} blocks needs {want}")
        return np.repeat(s, bn, axis=0)[:out_features].T.copy()  # [in blocks, out]
    if s.size == out_features:
        return s.reshape(1, out_features).copy()
    raise ValueError(f"weight scale of shape {s.shape} does not fit a weight with "
                     f"{out_features} outputs")


def dequantize(w: np.ndarray, scale: np.ndarray, in_block: int | None = None,
               offset: np.ndarray | None = None) -> np.ndarray:
    """w [in, *out] quantized, scale [KB, *out] (offset [KB, *out]: GGUF) -> float32
    [in, *out] (blocks of in_block rows, the last may be short; KB = 1: one block)."""
    w32 = np.asarray(w, np.float32)
    rows = in_block if scale.shape[0] > 1 else w32.shape[0]
    out = w32 * np.repeat(scale, rows, axis=0)[: w32.shape[0]]
    if offset is not None:
        out = out + np.repeat(offset, rows, axis=0)[: w32.shape[0]]
    return out


# -- device side: the matmul ----------------------------------------------------------------

def qmatmul(x: jax.Array, weight: jax.Array, scale: jax.Array, out_shape: tuple[int, ...], *,
            in_block: int | None = None, activation_fp8: bool = False,
            offset: jax.Array | None = None) -> jax.Array:
    """x [T, in] @ (weight [in, *out] * scale [KB, *out] (+ offset [KB, *out])) -> [T, *out]
    in x's dtype (KB > 1: blocks of in_block input rows, the last may be short)."""
    n = math.prod(out_shape)
    w = weight.reshape(weight.shape[0], n)
    s = scale.reshape(scale.shape[0], n).astype(jnp.float32)
    if offset is not None:  # GGUF groups (whole): dequantize q * d + m, then the dot
        kb = s.shape[0]
        full = w.reshape(kb, -1, n).astype(jnp.float32) * s[:, None] + offset.reshape(
            kb, 1, n).astype(jnp.float32)
        y = jnp.dot(x, full.reshape(-1, n).astype(x.dtype), preferred_element_type=jnp.float32)
        return y.astype(x.dtype).reshape(*x.shape[:-1], *out_shape)
    if s.shape[0] == 1:  # per output channel: the scale applies after the dot
        if activation_fp8 and w.dtype == jnp.float8_e4m3fn:
            y = _fp8_dot(x, w)
        else:
            y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        y = y * s[0]
    else:  # blocks of input rows: dequantize the weight (repeat each scale over its rows)
        rows = in_block
        full = jnp.repeat(s, rows, axis=0, total_repeat_length=s.shape[0] * rows)[: w.shape[0]]
        y = jnp.dot(x, (w.astype(jnp.float32) * full).astype(x.dtype),
                    preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], *out_shape)


def _fp8_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """W8A8: each row of x scaled into e4m3 (dynamic, per token), an fp8 x fp8 dot in
    float32, the row scales applied after."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    sx = jnp.where(amax > 0, amax / QMAX["float8_e4m3fn"], 1.0)
    m = QMAX["float8_e4m3fn"]
    xq = jnp.clip(x32 / sx, -m, m).astype(jnp.float8_e4m3fn)
    return jnp.dot(xq, w, preferred_element_type=jnp.float32) * sx


def with_activation_fp8(q: QuantConfig | None, on_gpu: bool) -> QuantConfig | None:
    """GPUs run fp8 weights as W8A8 (activations to fp8 per token); elsewhere weight-only."""
    if q is None or not on_gpu or q.weight_dtype != "float8_e4m3fn":
        return q
    return dataclasses.replace(q, activation_fp8=True)

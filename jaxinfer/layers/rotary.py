"""Rotary position embeddings (neox / rotate-half layout, as HF Llama), with linear, llama3 and
yarn scaling (HF's formulas, in float32 numpy at trace time)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, matching HF's computation."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling.factor)
    elif scaling.rope_type == "llama3":
        factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: interpolated frequencies (/ factor) for the dimensions that turn fewer than
    beta_slow times over the original context, extrapolated (unchanged) for those turning more
    than beta_fast times, a linear ramp between."""
    def correction_dim(rotations):
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolated
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The factor on cos and sin (yarn's attention scaling: 0.1 ln(factor) + 1, or the
    mscale ratio DeepSeek configs give, or attention_factor as set); 1 for the other types."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return (yarn_mscale(scaling.factor, scaling.mscale)
                / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling
                ) -> tuple[jax.Array, jax.Array]:
    """positions int32 [T] -> cos, sin float32 [T, D/2] for rotary base `theta` with
    `scaling` (yarn's attention factor applied)."""
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, theta, scaling))
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions int32 [T] -> cos, sin float32 [T, D/2]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by cos/sin [T, D/2] (rotate-half layout), in x.dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

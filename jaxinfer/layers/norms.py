"""RMSNorm, computed in float32 as HF does, returned in the input dtype. unit_offset: Gemma's
form, scaled by (1 + weight) in float32 before the cast (HF's Gemma3RMSNorm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.layers.params import param


class RMSNorm(nnx.Module):
    """kernel: computed by the C++ kernel (cpu_kernels.rms_norm; the cpu backend's packed
    models on one device set it), one call per norm instead of XLA's several fusions."""

    def __init__(self, dim: int, eps: float, *, dtype, unit_offset: bool = False,
                 kernel: bool = False):
        self.weight = param(jnp.zeros((dim,), dtype) if unit_offset
                            else jnp.ones((dim,), dtype), axes=(None,))  # [dim]
        self.eps = eps
        self.unit_offset = unit_offset
        self.kernel = kernel

    def add_norm(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + residual, its norm): a pre-norm block's residual add and the next norm."""
        if self.kernel:
            from jaxinfer.layers.cpu_kernels import rms_norm

            return rms_norm(x, self.weight[...], self.eps, residual=residual,
                            unit_offset=self.unit_offset)
        s = x + residual
        return s, self(s)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kernel:
            from jaxinfer.layers.cpu_kernels import rms_norm

            return rms_norm(x, self.weight[...], self.eps, unit_offset=self.unit_offset)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with a scale and a bias (vision encoders'), computed in float32."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), axes=(None,))
        self.bias = param(jnp.zeros((dim,), dtype), axes=(None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)

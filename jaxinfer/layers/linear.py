"""Linear and gated-MLP layers. Weights are stored [in, out] (HF's [out, in] transposed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(rngs: nnx.Rngs, shape, dtype, std: float = 0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (in_features, out_features), dtype))  # [in, out]
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None  # [out]

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class QKVLinear(nnx.Module):
    """The q, k and v projections as one matmul (vLLM's QKVParallelLinear).

    weight [in, Hkv, (G+2)*D] (G = Hq / Hkv): for each KV head, the G query heads of its group,
    then its key head, then its value head; bias [Hkv, (G+2)*D]. Splitting the KV-head axis
    over devices hands each device exactly its query, key and value heads (tensor
    parallelism), for any device count that divides Hkv. The loader builds it from HF's
    q_proj / k_proj / v_proj (models/fused.py)."""

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 use_bias: bool, dtype, rngs: nnx.Rngs):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        width = (self.group + 2) * head_dim
        self.weight = nnx.Param(_init(rngs, (in_features, num_kv_heads, width), dtype))
        self.bias = (nnx.Param(jnp.zeros((num_kv_heads, width), dtype)) if use_bias else None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, in] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        y = jnp.einsum("ti,ihw->thw", x, self.weight[...])  # [T, Hkv, (G+2)*D]
        if self.bias is not None:
            y = y + self.bias[...]
        t, g, d = x.shape[0], self.group, self.head_dim
        y = y.reshape(t, self.num_kv_heads, g + 2, d)
        q = y[:, :, :g].reshape(t, self.num_kv_heads * g, d)
        return q, y[:, :, g], y[:, :, g + 1]


class GateUpLinear(nnx.Module):
    """The gate and up projections as one matmul (vLLM's MergedColumnParallelLinear):
    weight [in, 2, I] (gate, then up), split over I for tensor parallelism."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (in_features, 2, out_features), dtype))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = jnp.einsum("ti,icj->tcj", x, self.weight[...])  # [T, 2, I]
        return y[:, 0], y[:, 1]


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, use_bias=False, dtype=dtype,
                                rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(jax.nn.silu(gate) * up)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (vocab_size, hidden_size), dtype))  # [V, H]

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [T, H] -> logits [T, V].

        Written as (W [V, H] . x^T)^T: XLA's CPU dot then reads the table in place instead of
        first copying out its transpose (113 MB for SmolLM2, ~15 ms per decode step)."""
        return jax.lax.dot_general(self.weight[...], x, (((1,), (1,)), ((), ()))).T

"""Allocation of the per-layer paged KV caches (the device side of the block pool)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    per_layer = 2 * block_size * cfg.num_key_value_heads * cfg.head_dim
    return per_layer * cfg.num_hidden_layers * jnp.dtype(dtype).itemsize


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh=None,
                       device=None):
    """[(k, v)] per layer, each [num_blocks, block_size, Hkv, D], zero-filled; with a mesh,
    split by KV head over it (each device allocates only its heads)."""
    from jaxinfer.parallel import KV_CACHE_SPEC, sharding

    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    if mesh is not None or device is None:
        device = sharding(mesh, KV_CACHE_SPEC)
    return [(jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]

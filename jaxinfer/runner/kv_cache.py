"""Allocation of the per-layer paged KV caches (the device side of the block pool)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    """Bytes one block takes over all layers, K and V (latent attention: the latent only)."""
    per_layer = block_size * cfg.num_key_value_heads * (cfg.head_dim + cfg.v_cache_dim)
    return per_layer * cfg.num_hidden_layers * jnp.dtype(dtype).itemsize


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh=None,
                       device=None):
    """[(k, v)] per layer, each [num_blocks, block_size, Hkv, D], zero-filled; with a mesh,
    split by KV head over it (each device allocates only its heads). Latent attention (MLA):
    k is the latent cache [num_blocks, block_size, 1, kv_lora_rank + rope dim], v empty
    ([..., 0]: nothing more is stored; replicated under a mesh, as XLA returns an empty
    array whatever its input's sharding))."""
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel import KV_CACHE_SPEC, sharding

    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    v_shape = shape[:-1] + (cfg.v_cache_dim,)
    v_device = device
    if mesh is not None or device is None:
        device = sharding(mesh, KV_CACHE_SPEC)
        v_device = sharding(mesh, P() if cfg.v_cache_dim == 0 else KV_CACHE_SPEC)
    return [(jnp.zeros(shape, dtype, device=device), jnp.zeros(v_shape, dtype, device=v_device))
            for _ in range(cfg.num_hidden_layers)]

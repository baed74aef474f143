"""Allocation of the per-layer paged KV caches (the device side of the block pool)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype,
                             num_layers: int | None = None) -> int:
    """Bytes one block takes over all layers (or num_layers of them), K and V (latent
    attention: the latent only)."""
    per_layer = block_size * cfg.num_key_value_heads * (cfg.head_dim + cfg.v_cache_dim)
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    return per_layer * layers * jnp.dtype(dtype).itemsize


def sliding_layers(cfg: ModelConfig) -> list[bool]:
    """Per decoder layer: whether it attends within a sliding window."""
    return [cfg.layer_sliding_window(i) is not None for i in range(cfg.num_hidden_layers)]


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh=None,
                       device=None, window_blocks: int = 0):
    """[(k, v)] per layer, each [num_blocks, block_size, Hkv, D], zero-filled; with a mesh,
    split by KV head over it (each device allocates only its heads). Latent attention (MLA):
    k is the latent cache [num_blocks, block_size, 1, kv_lora_rank + rope dim], v empty
    ([..., 0]: nothing more is stored; replicated under a mesh, as XLA returns an empty
    array whatever its input's sharding)). window_blocks > 0: the sliding-window layers'
    caches have that many blocks (their own pool, core/window_blocks.py)."""
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel import KV_CACHE_SPEC, sharding

    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    v_shape = shape[:-1] + (cfg.v_cache_dim,)
    v_device = device
    if mesh is not None or device is None:
        device = sharding(mesh, KV_CACHE_SPEC)
        v_device = sharding(mesh, P() if cfg.v_cache_dim == 0 else KV_CACHE_SPEC)
    caches = []
    for sliding in sliding_layers(cfg):
        n = window_blocks if window_blocks and sliding else num_blocks
        caches.append((jnp.zeros((n, *shape[1:]), dtype, device=device),
                       jnp.zeros((n, *v_shape[1:]), dtype, device=v_device)))
    return caches

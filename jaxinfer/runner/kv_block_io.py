"""Whole KV blocks in and out of the paged device cache, for KV connectors.

gather(block_ids) -> one array [L, 2, n, block_size, Hkv, D] (a copy: the caches are donated
to the next step, the copy is not); scatter(block_ids, data) writes such an array into the
cache. Both are compiled functions over the whole cache (no per-token host work); n is padded
to a power of two with the null block 0 (reads ignored, writes harmless) so that block counts
compile at most log2(max_blocks) variants each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _gather(kv_caches, ids):
    return jnp.stack([jnp.stack([k[ids], v[ids]]) for k, v in kv_caches])


def _scatter(kv_caches, ids, data):
    return [(k.at[ids].set(data[i, 0].astype(k.dtype)), v.at[ids].set(data[i, 1].astype(v.dtype)))
            for i, (k, v) in enumerate(kv_caches)]


def padded_count(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class KVBlockIO:
    def __init__(self, runner):
        self._runner = runner
        cfg = runner.model_config
        k0 = runner.kv_caches[0][0]
        if runner.kv_caches[0][1].shape != k0.shape:
            raise ValueError("KV connectors (kv_transfer_config) with a latent KV cache "
                             "(DeepSeek-V3's multi-head latent attention) are not supported yet")
        self.block_shape = tuple(k0.shape[1:])  # (block_size, Hkv, D)
        self.num_layers = cfg.num_hidden_layers
        self.dtype = k0.dtype
        self.mesh = runner.mesh
        self._replicated = None
        if runner.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            self._replicated = NamedSharding(runner.mesh, P())
        self._gather = jax.jit(_gather, out_shardings=self._replicated)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,))
        self.bytes_moved = 0

    def shape(self, n: int) -> tuple[int, ...]:
        """The array a transfer of n blocks moves (n padded)."""
        return (self.num_layers, 2, padded_count(n), *self.block_shape)

    def _ids(self, block_ids) -> np.ndarray:
        ids = np.zeros(padded_count(len(block_ids)), np.int32)
        ids[: len(block_ids)] = block_ids
        return ids

    def gather(self, block_ids) -> jax.Array:
        """The blocks' K and V, [L, 2, n_padded, block_size, Hkv, D], replicated (enqueued
        now, before any later step can overwrite them)."""
        out = self._gather(self._runner.kv_caches, self._ids(block_ids))
        self.bytes_moved += out.nbytes * len(block_ids) // out.shape[2]
        return out

    def scatter(self, block_ids, data) -> None:
        """Write data [L, 2, n_padded, ...] (host or device) into the blocks; entries of
        block_ids that are 0 (and the padding) land in the null block."""
        ids = self._ids(block_ids)
        if data.shape[2] != ids.shape[0]:
            raise ValueError(f"KV data for {data.shape[2]} blocks, {ids.shape[0]} expected")
        if self._replicated is not None or not isinstance(data, jax.Array):
            data = jax.device_put(data, self._replicated)
        r = self._runner
        r.kv_caches = self._scatter(r.kv_caches, ids, data)
        self.bytes_moved += data.nbytes * len(block_ids) // data.shape[2]

    def device(self):
        """The device single-device copies (transfers) live on: the first of the cache's."""
        return self._runner.kv_caches[0][0].addressable_shards[0].device

"""Pure-jnp references: the ground truth for every kernel and the `reference` attention backend.

Simple, jittable, and slow on purpose: correctness is the only goal here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": fully masked rows stay finite, and exp() of it is exactly 0.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def write_kv_reference(k_cache, v_cache, k, v, slot_mapping):
    """Scatter this step's K/V into the paged caches.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; k, v: [T, Hkv, D];
    slot_mapping: int32 [T], slot = block_id * block_size + offset (padding -> null block 0).
    Returns the updated caches (in place when the caller donates them).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = k_cache.reshape(flat_shape).at[slot_mapping].set(k.astype(k_cache.dtype))
    v_cache = v_cache.reshape(flat_shape).at[slot_mapping].set(v.astype(v_cache.dtype))
    return k_cache.reshape(num_blocks, block_size, num_kv_heads, head_dim), v_cache.reshape(
        num_blocks, block_size, num_kv_heads, head_dim
    )


def ragged_paged_attention_reference(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks=None,
    spans=None,
):
    """Causal attention of a flat, ragged query batch over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    kv_lens: int32 [R] (KV length incl. this step's tokens); block_tables: int32 [R, max_blocks];
    query_start_loc: int32 [R+1]; num_seqs: int32 [1] (rows >= num_seqs[0] are padding).
    Query token i of sequence s sits at position kv_lens[s] - q_len(s) + i and sees KV positions
    <= its own. Returns [T, Hq, D] in q.dtype; rows of padding tokens are zero.
    sinks: float32 [Hq] or None: attention sinks (gpt-oss), one learned logit per query head
    joining the softmax's denominator only (no value): softmax over [scores, sink], the sink's
    column dropped.
    spans: int32 [T, 2] or None: (lo, hi) KV positions each query token sees beyond the causal
    ones (Gemma 3's bidirectional attention within an image: its tokens see the whole image;
    hi < lo: none). The sliding window still applies: (causal or in span) and in window.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    max_kv = max_blocks * block_size
    token_idx = jnp.arange(num_tokens)
    kv_pos = jnp.arange(max_kv)
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)

    def one_sequence(s, out):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        kv_len = kv_lens[s]
        kv_valid = kv_pos < kv_len  # [L]
        # Unwritten pages may hold anything (NaN included): zero them before any product.
        k = k_cache[block_tables[s]].reshape(max_kv, num_kv_heads, head_dim)
        v = v_cache[block_tables[s]].reshape(max_kv, num_kv_heads, head_dim)
        k = jnp.where(kv_valid[:, None, None], k.astype(jnp.float32), 0.0)
        v = jnp.where(kv_valid[:, None, None], v.astype(jnp.float32), 0.0)
        in_seq = (token_idx >= start) & (token_idx < end)  # [T]
        q_pos = kv_len - (end - start) + (token_idx - start)  # [T]
        seen = kv_pos[None, :] <= q_pos[:, None]  # [T, L]
        if spans is not None:
            seen |= (kv_pos[None, :] >= spans[:, :1]) & (kv_pos[None, :] <= spans[:, 1:])
        mask = kv_valid[None, :] & seen
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = jnp.einsum("thgd,lhd->thgl", q_grouped, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask[:, None, None, :], scores, _MASK_VALUE)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            sink = jnp.broadcast_to(
                sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1),
                scores.shape[:-1] + (1,))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("thgl,lhd->thgd", probs, v).reshape(num_tokens, num_q_heads, head_dim)
        return jnp.where(in_seq[:, None, None], o, out)

    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = jax.lax.fori_loop(0, num_seqs[0], one_sequence, out)
    return out.astype(q.dtype)

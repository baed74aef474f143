"""XLA-native ragged paged attention whose cost follows the real work.

The `xla` attention backend: the default where the Pallas kernel does not run (CPU), and a safe
fallback elsewhere. The pure-jnp reference computes every sequence's scores for all T tokens of
the step against max_model_len positions (O(R x T x max_model_len) per layer); this computes
about sum over sequences of (query tokens x their real context), in two parts:

- decode rows (sequences [0, num_decodes), one query token each, laid out first by the runner):
  all rows at once, walking the KV cache in chunks of `kv_chunk` tokens with an online softmax,
  for as many chunks as the longest decode context needs (a dynamic trip count, so no extra
  compile buckets);
- the other sequences (prefill chunks, with or without cached context): one at a time, in tiles
  of `q_tile` query tokens, each tile walking only the KV chunks its causal window reaches.

Pages are gathered through the block table a chunk at a time; positions past a sequence's length
are masked (and their values zeroed: unwritten pages may hold anything, NaN included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": exp() of (it - a real max) is exactly 0, and never NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _cdiv(a, b):
    return (a + b - 1) // b


def _online_softmax_step(carry, scores, valid, v):
    """One KV chunk of the online softmax.

    carry: m, l [..., Hkv, G] and acc [..., Hkv, G, D]; scores [..., Hkv, G, C];
    valid bool broadcastable to scores; v [..., C, Hkv, D] (already zeroed where invalid)."""
    m, l, acc = carry
    scores = jnp.where(valid, scores, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.where(valid, jnp.exp(scores - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("...hgc,...chd->...hgd", p, v)
    return m_new, l, acc * corr[..., None] + pv


def ragged_paged_attention_xla(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                               num_seqs, num_decodes, *, sm_scale: float,
                               sliding_window: int | None = None, kv_chunk: int = 256,
                               q_tile: int = 64, sinks=None, spans=None):
    """Causal attention of a flat ragged batch over a paged KV cache (same contract as
    `ragged_paged_attention_reference`, plus `num_decodes`).

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; kv_lens int32 [R];
    block_tables int32 [R, max_blocks]; query_start_loc int32 [R+1]; num_seqs int32 [1];
    num_decodes int32 [1]: sequences [0, num_decodes) have exactly one query token (so their
    tokens are [0, num_decodes)). Returns [T, Hq, D] in q.dtype; padding rows are zero.
    sinks: float32 [Hq] or None (attention sinks: one more term, e^sink, in each row's
    softmax denominator). spans: int32 [T, 2] or None: (lo, hi) KV positions a token sees
    beyond the causal ones (see the reference); decode rows take none (a one-token chunk's
    span is itself).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    blocks_per_chunk = max(1, min(kv_chunk // block_size, max_blocks))
    chunk = blocks_per_chunk * block_size
    # Pad the table's width to whole chunks (with the null block) so slices never clamp.
    num_chunks_max = _cdiv(max_blocks, blocks_per_chunk)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_max * blocks_per_chunk - max_blocks)))
    chunk_iota = jnp.arange(chunk, dtype=jnp.int32)
    f32 = jnp.float32
    sink = None if sinks is None else sinks.astype(f32).reshape(num_kv_heads, group)

    def finish(m, l, acc):
        """The softmax's output from its state [..., Hkv, G(, D)]: acc / l, with the
        sinks' e^(sink - m) in the denominator."""
        if sink is not None:
            l = l + jnp.exp(sink - m)
        return acc / jnp.maximum(l, 1e-30)[..., None]

    def gather_kv(blocks, valid):
        """blocks int32 [..., bpc] -> k, v [..., C, Hkv, D] float32, zero where not valid."""
        shape = blocks.shape[:-1] + (chunk, num_kv_heads, head_dim)
        k = k_cache[blocks].reshape(shape).astype(f32)
        v = v_cache[blocks].reshape(shape).astype(f32)
        mask = valid[..., None, None]
        return jnp.where(mask, k, 0.0), jnp.where(mask, v, 0.0)

    def empty_carry(rows):
        """Online-softmax state of `rows` query rows: running max, sum and output."""
        return (jnp.full((rows, num_kv_heads, group), _MASK_VALUE, f32),
                jnp.zeros((rows, num_kv_heads, group), f32),
                jnp.zeros((rows, num_kv_heads, group, head_dim), f32))

    # -- decode rows: all together ------------------------------------------------------------
    rd = min(num_reqs, num_tokens)
    nd = num_decodes[0]
    dec_valid = jnp.arange(rd) < nd
    dec_len = jnp.where(dec_valid, kv_lens[:rd], 0)  # [Rd]
    qd = q[:rd].reshape(rd, num_kv_heads, group, head_dim).astype(f32) * sm_scale

    def decode_chunk(c, carry):
        blocks = jax.lax.dynamic_slice_in_dim(tables[:rd], c * blocks_per_chunk,
                                              blocks_per_chunk, axis=1)  # [Rd, bpc]
        pos = c * chunk + chunk_iota  # [C]
        valid = pos[None, :] < dec_len[:, None]  # [Rd, C]
        if sliding_window is not None:
            valid &= pos[None, :] > dec_len[:, None] - 1 - sliding_window
        k, v = gather_kv(blocks, valid)
        scores = jnp.einsum("rhgd,rchd->rhgc", qd, k)
        return _online_softmax_step(carry, scores, valid[:, None, None, :], v)

    init = empty_carry(rd)
    first = 0
    if sliding_window is not None:  # chunks wholly before every row's window are skipped
        lo = jnp.min(jnp.where(dec_valid, dec_len - sliding_window, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(lo, 0) // chunk
    m, l, acc = jax.lax.fori_loop(first, _cdiv(jnp.max(dec_len), chunk), decode_chunk, init)
    out_dec = finish(m, l, acc).reshape(rd, num_q_heads, head_dim)
    out_dec = jnp.where(dec_valid[:, None, None], out_dec, 0.0)

    # -- other sequences: one at a time, in query tiles -----------------------------------------
    tile = min(q_tile, num_tokens)
    q_pad = jnp.pad(q, ((0, tile), (0, 0), (0, 0)))
    if spans is not None:
        span_pad = jnp.pad(spans, ((0, tile), (0, 0)), constant_values=-1)
    out = jnp.zeros((num_tokens + tile, num_q_heads, head_dim), f32)
    out = out.at[:rd].set(out_dec)
    tile_iota = jnp.arange(tile, dtype=jnp.int32)

    def one_sequence(s, out):
        start = query_start_loc[s]
        q_len = query_start_loc[s + 1] - start
        kv_len = kv_lens[s]
        ctx = kv_len - q_len  # cached tokens before this step's chunk
        table = tables[s]

        def one_tile(t, out):
            t0 = start + t * tile
            rows = t * tile + tile_iota  # [TQ] index within the chunk
            row_valid = rows < q_len
            q_pos = ctx + rows  # [TQ]
            qt = jax.lax.dynamic_slice_in_dim(q_pad, t0, tile, axis=0)
            qt = qt.reshape(tile, num_kv_heads, group, head_dim).astype(f32) * sm_scale
            hi = jnp.minimum(kv_len, ctx + jnp.minimum((t + 1) * tile, q_len))  # KV end
            if spans is not None:  # (a span lies within this step's chunk: < kv_len)
                sp = jax.lax.dynamic_slice_in_dim(span_pad, t0, tile, axis=0)  # [TQ, 2]
                hi = kv_len

            def kv_chunk_step(c, carry):
                blocks = jax.lax.dynamic_slice_in_dim(table, c * blocks_per_chunk,
                                                      blocks_per_chunk)
                pos = c * chunk + chunk_iota  # [C]
                seen = pos[None, :] <= q_pos[:, None]  # [TQ, C]
                if spans is not None:
                    seen |= (pos[None, :] >= sp[:, :1]) & (pos[None, :] <= sp[:, 1:])
                valid = seen & (pos[None, :] < kv_len)
                if sliding_window is not None:
                    valid &= pos[None, :] > q_pos[:, None] - sliding_window
                k, v = gather_kv(blocks, pos < kv_len)
                scores = jnp.einsum("thgd,chd->thgc", qt, k)
                return _online_softmax_step(carry, scores, valid[:, None, None, :], v)

            init = empty_carry(tile)
            lo = 0
            if sliding_window is not None:
                lo = jnp.maximum(ctx + t * tile - sliding_window + 1, 0) // chunk
            m, l, acc = jax.lax.fori_loop(lo, _cdiv(hi, chunk), kv_chunk_step, init)
            o = finish(m, l, acc).reshape(tile, num_q_heads, head_dim)
            old = jax.lax.dynamic_slice_in_dim(out, t0, tile, axis=0)
            new = jnp.where(row_valid[:, None, None], o, old)
            return jax.lax.dynamic_update_slice_in_dim(out, new, t0, axis=0)

        return jax.lax.fori_loop(0, _cdiv(q_len, tile), one_tile, out)

    out = jax.lax.fori_loop(nd, num_seqs[0], one_sequence, out)
    return out[:num_tokens].astype(q.dtype)

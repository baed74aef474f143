"""Ragged paged attention for mixed prefill / decode / chunked prefill, as a Pallas kernel.

One program handles a tile of query tokens of ONE sequence for ONE KV head, with that head's
GQA group packed into the MMA rows (rows = tokens x padded group), and walks the sequence's KV
pages (several per iteration) with an online softmax. Programs map to (sequence, tile) through
a small work list computed in the wrapper, so ragged batches waste at most one tile per
sequence. For steps with few query tokens and long KV, the KV range is split over extra
programs (flash-decoding) and merged afterwards. A head_dim that is not a power of two (80, 96)
runs as power-of-two column chunks (64 + 16, 64 + 32), so nothing is padded.

Written for the Triton lowering of Pallas (jax.experimental.pallas.triton); runs on CPU with
interpret=True. The pure-jnp reference is pallas_kernels/reference.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import AttentionTuning, attention_tuning, num_kv_splits

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def head_dim_chunks(d: int) -> tuple[tuple[int, int], ...]:
    """Split head_dim into power-of-two column chunks of >= 16, largest first: (offset, size).

    Triton tiles must be powers of two and MMA operands at least 16 wide, so e.g. D=80 runs as
    64 + 16 and D=96 as 64 + 32: the scores sum the chunks' dot products and each chunk keeps
    its own output accumulator. Nothing is padded, so no bandwidth is spent on zeros."""
    if d < 16 or d % 16:
        raise ValueError(f"head_dim {d} must be a multiple of 16")
    chunks, off = [], 0
    for bit in reversed(range(d.bit_length())):
        size = 1 << bit
        if d - off >= size >= 16:
            chunks.append((off, size))
            off += size
    return tuple(chunks)


def _kernel(tile_seq_ref, tile_idx_ref, qsl_ref, kv_lens_ref, tables_ref, q_ref, k_ref, v_ref,
            *refs, block_q, group, group_pad, pages_per_iter, block_size, num_splits,
            d_chunks, sm_scale, sliding_window, soft_cap, interpret, has_sinks, has_spans):
    # With attention sinks (single split only; split partials are merged with them outside)
    # the first ref is the sink of every q row of this KV head, laid out as q's rows; with
    # spans, the next two are each q row's span (lo, hi), laid out the same way.
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    (lo_ref, hi_ref), out_refs = (refs[:2], refs[2:]) if has_spans else ((None, None), refs)
    w, split = pl.program_id(0), pl.program_id(2)
    block_m = block_q * group_pad
    block_kv = pages_per_iter * block_size
    seq = tile_seq_ref[w]
    s = jnp.maximum(seq, 0)
    seq_start, seq_end = qsl_ref[s], qsl_ref[s + 1]
    kv_len = kv_lens_ref[s]
    ctx_len = kv_len - (seq_end - seq_start)  # tokens cached before this step's queries
    q_start = seq_start + tile_idx_ref[w] * block_q

    # float32 caches are for exactness: 3-pass TF32 dots (about float32 accuracy on tensor
    # cores), not Triton's 1-pass TF32 default. IEEE float32 dots (FMA) spill heavily in Triton.
    # Interpret mode (CPU) computes float32 dots exactly and knows no such algorithm.
    precision = None
    if q_ref.dtype == jnp.float32 and not interpret:
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    rows = jax.lax.iota(jnp.int32, block_m)
    tok = q_start + rows // group_pad
    row_ok = (seq >= 0) & (tok < seq_end) & (rows % group_pad < group)
    q_pos = ctx_len + (tok - seq_start)  # [M] position of each row's token
    last_pos = ctx_len + jnp.minimum(q_start + block_q, seq_end) - 1 - seq_start
    kv_hi = jnp.where(seq >= 0, jnp.minimum(kv_len, last_pos + 1), 0)
    if has_spans:  # (a span lies within this step's chunk: below kv_len)
        kv_hi = jnp.where(seq >= 0, kv_len, 0)
    kv_lo = 0
    if sliding_window is not None:
        kv_lo = jnp.maximum(ctx_len + (q_start - seq_start) - sliding_window + 1, 0)
    it_lo, it_hi = kv_lo // block_kv, pl.cdiv(kv_hi, block_kv)
    per_split = pl.cdiv(it_hi - it_lo, num_splits)
    j0 = it_lo + split * per_split
    j1 = jnp.minimum(j0 + per_split, it_hi)

    q_rows = pl.ds(q_start * group_pad, block_m)  # rows padded in the wrapper: never OOB
    qs = [jnp.where(row_ok[:, None], q_ref[q_rows, pl.ds(off, size)], 0)  # [M, Dc] each
          for off, size in d_chunks]

    if has_spans:
        span_lo, span_hi = lo_ref[q_rows], hi_ref[q_rows]  # [M] each

    def body(j, carry):
        accs, m_prev, l_prev = carry
        ids = tables_ref[s, pl.ds(j * pages_per_iter, pages_per_iter)]  # [P]
        kv_pos = j * block_kv + jax.lax.iota(jnp.int32, block_kv)
        kv_ok = kv_pos < kv_len
        scores = None
        vs = []
        for qc, (off, size) in zip(qs, d_chunks):
            k = k_ref[ids, :, pl.ds(off, size)].reshape(block_kv, size)  # [BK, Dc]
            v = v_ref[ids, :, pl.ds(off, size)].reshape(block_kv, size)
            if k.dtype != q_ref.dtype:  # fp8 caches: widened to q's dtype as they load
                k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
            # Unwritten slots may hold NaN: zero them (where, not multiply) before any product.
            k = jnp.where(kv_ok[:, None], k, 0)
            vs.append(jnp.where(kv_ok[:, None], v, 0))
            part = jax.lax.dot_general(qc, k, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)
            scores = part if scores is None else scores + part
        scores = scores * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        seen = kv_pos[None, :] <= q_pos[:, None]
        if has_spans:
            seen |= (kv_pos[None, :] >= span_lo[:, None]) & (kv_pos[None, :] <= span_hi[:, None])
        mask = kv_ok[None, :] & seen
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = jnp.where(mask, scores, _MASK)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        alpha = jnp.exp2((m_prev - m_next) * _LOG2E)
        p = jnp.exp2((scores - m_next[:, None]) * _LOG2E)
        p = jnp.where(mask, p, 0.0)
        l_next = alpha * l_prev + p.sum(axis=-1)
        p = p.astype(vs[0].dtype)
        accs = tuple(alpha[:, None] * acc + jax.lax.dot_general(
            p, v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
            for acc, v in zip(accs, vs))
        return accs, m_next, l_next

    accs = tuple(jnp.zeros((block_m, size), jnp.float32) for _, size in d_chunks)
    m = jnp.full((block_m,), _MASK, jnp.float32)
    l = jnp.zeros((block_m,), jnp.float32)
    accs, m, l = jax.lax.fori_loop(j0, j1, body, (accs, m, l))

    # Masked stores: a tile's rows past its sequence belong to the next sequence's tiles.
    if num_splits == 1:
        (o_ref,) = out_refs
        if has_sinks:  # a logit with no value: e^(sink - m) more in the denominator
            l = l + jnp.exp2((sinks_ref[q_rows] - m) * _LOG2E)
        inv = 1.0 / jnp.where(l == 0, 1.0, l)
        for acc, (off, size) in zip(accs, d_chunks):
            plgpu.store(o_ref.at[q_rows, pl.ds(off, size)],
                        (acc * inv[:, None]).astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        for acc, (off, size) in zip(accs, d_chunks):
            plgpu.store(acc_ref.at[q_rows, pl.ds(off, size)], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[q_rows], m, mask=row_ok)
        plgpu.store(l_ref.at[q_rows], l, mask=row_ok)


def _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {k_cache.shape} and {v_cache.shape}")
    t, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of k_cache ({dk}); q {q.shape}, "
                         f"k_cache {k_cache.shape}")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of KV heads ({hkv}); "
                         f"q {q.shape}, k_cache {k_cache.shape}")
    if d < 16 or d % 16:
        raise ValueError(f"head_dim {d} must be a multiple of 16 (q {q.shape})")
    if bs & (bs - 1):
        raise ValueError(f"block_size {bs} must be a power of two (k_cache {k_cache.shape})")
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    if (q.dtype != k_cache.dtype and k_cache.dtype not in fp8) or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")
    r = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if kv_lens.shape != (r,) or block_tables.ndim != 2 or block_tables.shape[0] != r:
        raise ValueError(f"kv_lens must be [R] and block_tables [R, max_blocks]; got "
                         f"{kv_lens.shape} and {block_tables.shape}")
    if query_start_loc.shape != (r + 1,):
        raise ValueError(f"query_start_loc must be [R+1] = [{r + 1}], got {query_start_loc.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got {num_seqs.shape}")
    for name, a in (("kv_lens", kv_lens), ("block_tables", block_tables),
                    ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")


def _work_list(query_start_loc, num_seqs, num_tiles: int, block_q: int):
    """tile w -> (sequence, tile index within it); sequence -1 for unused tiles."""
    r = query_start_loc.shape[0] - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    q_lens = jnp.where(jnp.arange(r) < num_seqs[0], q_lens, 0)
    tiles = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(tiles)
    w = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)
    seq_c = jnp.minimum(seq, r - 1)
    idx = w - (ends[seq_c] - tiles[seq_c])
    used = w < ends[-1]
    return jnp.where(used, seq_c, -1).astype(jnp.int32), jnp.where(used, idx, 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "interpret", "num_splits", "tuning"))
def ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           num_seqs, sinks=None, spans=None, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           interpret: bool = False, num_splits: int | None = None,
                           tuning: AttentionTuning | None = None):
    """Causal attention of a flat ragged query batch over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; kv_lens: int32 [R]
    (KV length incl. this step's tokens); block_tables: int32 [R, max_blocks];
    query_start_loc: int32 [R+1]; num_seqs: int32 [1]. Returns [T, Hq, D]; rows of padding
    tokens are unspecified. `num_splits` and `tuning` override the automatic split-KV choice
    and the tuning table (for benchmarks and sweeps). sinks: float32 [Hq] attention sinks
    (one logit per query head in each row's softmax denominator, with no value), or None.
    spans: int32 [T, 2] or None: (lo, hi) KV positions each token sees beyond the causal
    ones (bidirectional image tokens; hi < lo: none).
    """
    _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    r, max_blocks = block_tables.shape
    group = hq // hkv
    group_pad = _next_pow2(group)
    tune = attention_tuning(d, bs, jnp.dtype(q.dtype).name, t, tuning)
    block_q = max(1, tune.block_m // group_pad)
    pages = tune.kv_tokens_per_iter // bs
    num_tiles = pl.cdiv(t, block_q) + r
    # Tiles with work: at most one per token, and no more than the work list holds.
    splits = num_splits or num_kv_splits(min(num_tiles, t) * hkv, max_blocks * bs)

    # Rows = tokens x padded group, per KV head; padded so no tile reads or writes past the end.
    rows = (t + block_q) * group_pad
    qh = q.reshape(t, hkv, group, d)
    qh = jnp.pad(qh, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    qh = qh.transpose(1, 0, 2, 3).reshape(hkv, rows, d)
    tables = jnp.pad(block_tables, ((0, 0), (0, pages)))
    tile_seq, tile_idx = _work_list(query_start_loc, num_seqs, num_tiles, block_q)

    in_sinks = sinks is not None and splits == 1
    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, group_pad=group_pad, pages_per_iter=pages,
        block_size=bs, num_splits=splits, d_chunks=head_dim_chunks(d), sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
        has_sinks=in_sinks, has_spans=spans is not None)
    if sinks is not None:  # [Hkv, G_pad]: each query head's sink (padding heads: none)
        sink_heads = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, group),
                             ((0, 0), (0, group_pad - group)), constant_values=_MASK)
    whole = lambda a: pl.BlockSpec(a.shape, lambda w, h, sp: (0,) * a.ndim)  # noqa: E731
    cache_spec = pl.BlockSpec((k_cache.shape[0], bs, None, d), lambda w, h, sp: (0, 0, h, 0))
    in_specs = [whole(tile_seq), whole(tile_idx), whole(query_start_loc), whole(kv_lens),
                whole(tables), pl.BlockSpec((None, rows, d), lambda w, h, sp: (h, 0, 0)),
                cache_spec, cache_spec]
    args = [tile_seq, tile_idx, query_start_loc, kv_lens, tables, qh, k_cache, v_cache]
    if in_sinks:  # laid out as q's rows: [Hkv, rows]
        args.append(jnp.tile(sink_heads, (1, t + block_q)))
        in_specs.append(pl.BlockSpec((None, rows), lambda w, h, sp: (h, 0)))
    if spans is not None:  # [rows] each: every q row's token's (lo, hi)
        for col in (0, 1):
            a = jnp.repeat(jnp.pad(spans[:, col].astype(jnp.int32), (0, block_q),
                                   constant_values=-1), group_pad)
            args.append(a)
            in_specs.append(whole(a))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((hkv, rows, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, rows, d), lambda w, h, sp: (h, 0, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, hkv, rows, d), jnp.float32),
                     jax.ShapeDtypeStruct((splits, hkv, rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, hkv, rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, rows, d), lambda w, h, sp: (sp, h, 0, 0)),
                     pl.BlockSpec((None, None, rows), lambda w, h, sp: (sp, h, 0)),
                     pl.BlockSpec((None, None, rows), lambda w, h, sp: (sp, h, 0))]
    compiler_params = None
    if not interpret:
        compiler_params = plgpu.CompilerParams(num_warps=tune.num_warps,
                                               num_stages=tune.num_stages)
    outs = pl.pallas_call(
        kernel, grid=(num_tiles, hkv, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(*args)
    if splits == 1:
        out = outs[0]
    else:
        acc, m, l = outs  # merge the splits' partial softmaxes
        m_all = m.max(axis=0)
        scale = jnp.exp(m - m_all[None]) * l
        denom = scale.sum(axis=0)
        if sinks is not None:
            denom = denom + jnp.exp(jnp.tile(sink_heads, (1, t + block_q)) - m_all)
        num = (jnp.exp(m - m_all[None])[..., None] * acc).sum(axis=0)
        out = (num / jnp.where(denom == 0, 1.0, denom)[..., None]).astype(q.dtype)
    out = out.reshape(hkv, t + block_q, group_pad, d)[:, :t, :group]
    return out.transpose(1, 0, 2, 3).reshape(t, hq, d)

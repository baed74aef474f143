"""On-device sampling inside the jitted step.

Order as in vLLM V1: penalties (repetition over prompt+output, frequency/presence over output) on
the raw logits; greedy rows take the argmax; random rows divide by temperature, drop tokens
below min_p * max prob, keep the top_k, then the top_p nucleus of what is left, and draw with
the Gumbel-max trick from a key that depends only on the request's seed and output index (so a
seeded request gives the same tokens whatever its batch companions). Logprobs are of the raw
model distribution (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # float32 [R]; 0 = greedy
    top_k: jax.Array  # int32 [R]; <= 0 = all tokens
    top_p: jax.Array  # float32 [R]
    min_p: jax.Array  # float32 [R]
    repetition_penalty: jax.Array  # float32 [R]
    frequency_penalty: jax.Array  # float32 [R]
    presence_penalty: jax.Array  # float32 [R]
    seeds: jax.Array  # uint32 [R]: per-request seed
    output_index: jax.Array  # int32 [R]: index of the token being sampled (RNG counter)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # int32 [R]
    logprob: jax.Array  # float32 [R]: raw logprob of the sampled token
    rank: jax.Array  # int32 [R]: 1 + number of tokens more likely than the sampled one
    top_ids: jax.Array  # int32 [R, K]
    top_logprobs: jax.Array  # float32 [R, K]


def apply_penalties(logits, output_counts, prompt_mask, md: SamplingMetadata):
    """logits [R, V]; output_counts int32 [R, V]; prompt_mask bool [R, V]."""
    seen = prompt_mask | (output_counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - md.presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype)


def _filtered_logits(logits, md: SamplingMetadata):
    """Temperature, min_p, top_k and top_p applied; dropped tokens are -inf. Returns sorted
    (descending) filtered logits and the vocabulary index of each sorted position."""
    vocab = logits.shape[-1]
    temp = jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
    scaled = logits / temp
    neg_sorted, order = jax.lax.sort(
        (-scaled, jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)),
        dimension=1, num_keys=1)
    sorted_logits = -neg_sorted  # [R, V] descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = probs >= md.min_p[:, None] * probs[:, :1]
    k = jnp.where(md.top_k > 0, md.top_k, vocab)[:, None]
    keep &= jnp.arange(vocab)[None, :] < k
    # top_p over the distribution renormalised after min_p and top_k.
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    before = jnp.cumsum(kept, axis=-1) - kept
    keep &= before < md.top_p[:, None]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return jnp.where(keep, sorted_logits, _NEG_INF), order


def _sampling_logits(logits, md: SamplingMetadata):
    """Temperature-scaled logits with min_p / top_k / top_p applied (dropped tokens -inf) and
    each position's vocabulary index. The sort behind the filters is skipped (lax.cond) when no
    sampling row uses them: then the logits stay in vocabulary order."""
    needs_filter = jnp.any((md.temperature > 0) & ((md.top_k > 0) | (md.top_p < 1.0)
                                                   | (md.min_p > 0.0)))

    def unfiltered(logits, md):
        temp = jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
        iota = jnp.broadcast_to(jnp.arange(logits.shape[-1], dtype=jnp.int32), logits.shape)
        return logits / temp, iota

    return jax.lax.cond(needs_filter, _filtered_logits, unfiltered, logits, md)


_BLOCK = 1024  # vocabulary entries per block of the inverse-CDF draw


def _row_keys(seeds, output_index):
    """Each row's PRNG key: (seed, output index) only, never the batch."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)


def _draw(filtered, keys):
    """One draw per row from softmax(filtered) (dropped entries -inf), by inverse CDF on one
    uniform per row (from `keys`): first the block of _BLOCK entries the uniform falls in (a
    cumulative sum over the blocks' masses), then the entry within it. One uniform per row
    instead of a Gumbel variate per vocabulary entry (measured on a 2-core CPU, 32 rows of
    49152: ~1.5 ms for the whole draw, ~11 ms for the threefry noise alone), and the
    cumulative sums stay short for float32. Always an entry of positive mass. Returns int32 [R] positions in `filtered`."""
    r, v = filtered.shape
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    mass = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))  # (-inf -> 0)
    nb = -(-v // _BLOCK)
    blocks = jnp.pad(mass, ((0, 0), (0, nb * _BLOCK - v))).reshape(r, nb, _BLOCK)

    def pick(cum, target, has_mass):
        """The first entry whose cumulative mass exceeds target, kept among those with mass
        (float rounding can put target at either end)."""
        n = cum.shape[-1]
        first = jnp.argmax(has_mass, axis=-1)
        last = n - 1 - jnp.argmax(has_mass[:, ::-1], axis=-1)
        return jnp.clip(jnp.sum(cum <= target[:, None], axis=-1), first, last)

    bsum = jnp.sum(blocks, axis=-1)  # [R, nb]
    bcum = jnp.cumsum(bsum, axis=-1)
    target = u * bcum[:, -1]
    b = pick(bcum, target, bsum > 0)
    before = jnp.take_along_axis(bcum - bsum, b[:, None], axis=1)[:, 0]
    row = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [R, _BLOCK]
    j = pick(jnp.cumsum(row, axis=-1), target - before, row > 0)
    return (b * _BLOCK + j).astype(jnp.int32)


def argmax(logits, kernel: bool = False):
    """jnp.argmax over the last axis of logits [R, V] (the first maximum; the first NaN if
    any), int32. kernel: compiled for CPU, by the C++ kernel (cpu_kernels.argmax, one pass
    per row; for the platforms it does not run on the program keeps the form below)."""
    if kernel:
        from jaxinfer.layers import cpu_kernels

        return jax.lax.platform_dependent(logits, cpu=cpu_kernels.argmax, default=_argmax)
    return _argmax(logits)


def argmax_kernel(mesh) -> bool:
    """Whether a step's argmax may take the C++ kernel: on CPU, where it is built, and on
    one device (under a mesh XLA could not partition the custom call)."""
    if mesh is not None or jax.default_backend() != "cpu":
        return False
    from jaxinfer.layers import cpu_kernels

    return cpu_kernels.available()


def _argmax(logits):
    """argmax as two plain reductions: XLA:CPU's fused index-and-value reduce read a step's
    logits at ~2 GB/s (3.5 ms of a 32-row SmolLM2 decode step on the 2-core Intel VM)."""
    m = jnp.max(logits, axis=-1, keepdims=True)  # (NaN if any entry is)
    hit = (logits == m) | jnp.isnan(logits)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, iota, logits.shape[-1]), axis=-1)


def sample_tokens(logits, md: SamplingMetadata, kernel: bool = False):
    """logits float32 [R, V] (penalties already applied) -> sampled ids int32 [R].

    Greedy rows take the argmax (kernel: see `argmax`). The random path (temperature,
    filters, one inverse-CDF draw per row: _draw) runs only when some row of the step samples:
    an all-greedy step skips it at run time (lax.cond), so it pays for no draw and no sort."""
    greedy_ids = argmax(logits, kernel)

    def random_path(logits, md):
        filtered, order = _sampling_logits(logits, md)
        pick = _draw(filtered, _row_keys(md.seeds, md.output_index))
        random_ids = jnp.take_along_axis(order, pick[:, None], axis=1)[:, 0]
        return jnp.where(md.temperature > 0, random_ids, greedy_ids)

    return jax.lax.cond(jnp.any(md.temperature > 0), random_path,
                        lambda logits, md: greedy_ids, logits, md)


def compute_logprobs(raw_logits, token_ids, num_logprobs: int) -> SamplerOutput:
    """Raw-distribution logprobs of the sampled tokens, their ranks and the top num_logprobs."""
    raw_logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(raw_logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprob=chosen, rank=rank,
                         top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)


def _expand(md: SamplingMetadata, rows, offsets) -> SamplingMetadata:
    """Per-request metadata [R] -> per verify position [N]: row rows[f], token index + offsets[f]."""
    taken = jax.tree.map(lambda x: x[rows], md)
    return dataclasses.replace(taken, output_index=taken.output_index + offsets)


def rejection_sample(logits, drafts, md: SamplingMetadata, verify_req, verify_pos, row_map,
                     num_drafts, kernel: bool = False):
    """Speculative decoding's verification, on the flat verify positions of a step.

    logits float32 [N, V]: the target's logits (penalties and grammar mask applied) at each
      request's 1 + d_i verify positions; position j of request i predicts output token
      output_index[i] + j and checks draft j (j < d_i).
    drafts int32 [N]: the draft checked at each position (-1: none, the bonus position).
    md: per-request metadata [R]; verify_req / verify_pos int32 [N]: each position's request
      row and j. row_map int32 [R, K+1]: flat index of (i, j) (any index where j > d_i).
    num_drafts int32 [R]. kernel: the greedy argmax's (see `argmax`).

    Greedy rows accept a draft while it equals the target's argmax. Random rows accept draft d
    with probability p(d) (the proposer's q is one-hot: min(1, p/q) = p) and on rejection draw
    from p with d removed (normalised max(p - q, 0)); p is exactly sample_tokens' distribution
    (temperature, min_p, top_k, top_p). Every draw is keyed by (seed, output index) only, so a
    seeded request's tokens do not depend on its batch companions, and the token drawn where all
    drafts pass (the bonus) is the one sample_tokens would draw there.

    Returns (tokens int32 [R, K+1], num_emitted int32 [R]): request i emits
    tokens[i, :num_emitted[i]] = its accepted drafts, then the target's own token."""
    fmd = _expand(md, verify_req, verify_pos)
    greedy_ids = argmax(logits, kernel)

    def random_path(logits, fmd):
        filtered, order = _sampling_logits(logits, fmd)
        is_draft = order == drafts[:, None]  # [N, V] (no position when drafts = -1)
        p_draft = jnp.sum(jnp.where(is_draft, jax.nn.softmax(filtered, axis=-1), 0.0), axis=-1)

        keys = _row_keys(fmd.seeds, fmd.output_index)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (), jnp.float32))(
            keys)
        pick = _draw(jnp.where(is_draft, _NEG_INF, filtered), keys)
        random_ids = jnp.take_along_axis(order, pick[:, None], axis=1)[:, 0]
        rand = fmd.temperature > 0
        return (jnp.where(rand, random_ids, greedy_ids),
                jnp.where(rand, u < p_draft, drafts == greedy_ids))

    tokens, accept = jax.lax.cond(
        jnp.any(fmd.temperature > 0), random_path,
        lambda logits, fmd: (greedy_ids, drafts == greedy_ids), logits, fmd)
    k1 = row_map.shape[1]
    j = jnp.arange(k1)[None, :]
    accepted = accept[row_map] & (j < num_drafts[:, None])  # [R, K+1]
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    out = jnp.where(j < num_accepted[:, None], drafts[row_map], tokens[row_map])
    return out.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)

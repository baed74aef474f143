"""Rejection sampling (jaxinfer.layers.sampler.rejection_sample) preserves the target
distribution, is exact for greedy rows, and depends only on a request's own seed and position.

Chi-square recipe (FEATURES.md 3.5): 100k draws, df = V - 1 = 7, critical value 24.32 at
p = 0.001 (a correct sampler fails once in a thousand runs; the seeds below are fixed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.sampler import SamplingMetadata, rejection_sample, sample_tokens

V = 8
CRIT_DF7 = 24.32  # chi-square, df = 7, p = 0.001


def _md(r, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, output_index=None):
    f = lambda v, dt: jnp.full((r,), v, dt)  # noqa: E731
    return SamplingMetadata(
        temperature=f(temperature, jnp.float32), top_k=f(top_k, jnp.int32),
        top_p=f(top_p, jnp.float32), min_p=f(min_p, jnp.float32),
        repetition_penalty=f(1.0, jnp.float32), frequency_penalty=f(0.0, jnp.float32),
        presence_penalty=f(0.0, jnp.float32),
        seeds=jnp.arange(r, dtype=jnp.uint32) if seeds is None else seeds,
        output_index=jnp.zeros(r, jnp.int32) if output_index is None else output_index)


def _layout(r, k, d):
    """Every row verifies d drafts (k = K): flat positions row-major, d + 1 per row."""
    runs = d + 1
    verify_req = jnp.repeat(jnp.arange(r, dtype=jnp.int32), runs)
    verify_pos = jnp.tile(jnp.arange(runs, dtype=jnp.int32), r)
    cols = jnp.minimum(jnp.arange(k + 1), d)
    row_map = (jnp.arange(r, dtype=jnp.int32)[:, None] * runs + cols[None, :]).astype(jnp.int32)
    return verify_req, verify_pos, row_map, jnp.full((r,), d, jnp.int32)


def _run(logits_per_pos, drafts, md, k):
    """logits_per_pos [d+1, V] shared by every row; drafts [d] the same for every row."""
    r = md.seeds.shape[0]
    d = len(drafts)
    verify_req, verify_pos, row_map, num_drafts = _layout(r, k, d)
    logits = jnp.tile(jnp.asarray(logits_per_pos, jnp.float32), (r, 1))
    flat_drafts = jnp.tile(jnp.asarray(list(drafts) + [-1], jnp.int32), r)
    fn = jax.jit(rejection_sample)
    return jax.device_get(fn(logits, flat_drafts, md, verify_req, verify_pos, row_map,
                             num_drafts))


def _chi2(counts, probs):
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was emitted"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def _target(logits, temperature=1.0, top_k=0):
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


LOGITS = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]))


@pytest.mark.parametrize("draft", [0, 7], ids=["likely-draft", "unlikely-draft"])
def test_first_token_follows_the_target(draft):
    """A right-ish and a deliberately wrong one-hot draft: the first emitted token ~ p."""
    n = 100_000
    tokens, emitted = _run(np.stack([LOGITS, LOGITS]), [draft], _md(n), k=1)
    counts = np.bincount(tokens[:, 0], minlength=V)
    assert _chi2(counts, _target(LOGITS)) < CRIT_DF7
    # The draft is accepted with probability p(draft).
    accept = (emitted == 2).mean()
    assert abs(accept - _target(LOGITS)[draft]) < 0.01


def test_chain_of_two_drafts_keeps_the_joint():
    """K = 2, temperature 0.7 and top_k = 6 on two different positions: the first token ~ p0,
    and after an accepted first draft the second ~ p1 (the joint factorises as the target's)."""
    n = 100_000
    l1 = LOGITS[::-1].copy()
    md = _md(n, temperature=0.7, top_k=6)
    tokens, emitted = _run(np.stack([LOGITS, l1, LOGITS]), [1, 3], md, k=2)
    p0, p1 = _target(LOGITS, 0.7, 6), _target(l1, 0.7, 6)
    assert _chi2(np.bincount(tokens[:, 0], minlength=V), p0) < CRIT_DF7
    second = tokens[emitted >= 2, 1]
    assert (tokens[emitted >= 2, 0] == 1).all()
    assert _chi2(np.bincount(second, minlength=V), p1) < CRIT_DF7
    assert abs((emitted >= 2).mean() - p0[1]) < 0.01


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    l0 = np.eye(V)[3] * 5.0
    l1 = np.eye(V)[6] * 5.0
    l2 = np.eye(V)[1] * 5.0
    md = _md(3, temperature=0.0)
    verify_req, verify_pos, row_map, num_drafts = _layout(3, 2, 2)
    logits = jnp.tile(jnp.asarray(np.stack([l0, l1, l2]), jnp.float32), (3, 1))
    drafts = jnp.asarray([3, 6, -1,   3, 5, -1,   4, 6, -1], jnp.int32)
    tokens, emitted = jax.device_get(jax.jit(rejection_sample)(
        logits, drafts, md, verify_req, verify_pos, row_map, num_drafts))
    assert emitted.tolist() == [3, 2, 1]
    assert tokens[0].tolist() == [3, 6, 1]  # both accepted + bonus
    assert tokens[1, :2].tolist() == [3, 6]  # second rejected, corrected to the argmax
    assert tokens[2, :1].tolist() == [3]


def test_bonus_token_is_the_plain_samplers_draw():
    """All drafts accepted (a one-hot target): the bonus equals sample_tokens' draw at that
    output index, so speculation changes no RNG stream."""
    n = 64
    seeds = jnp.arange(100, 100 + n, dtype=jnp.uint32)
    idx = jnp.arange(n, dtype=jnp.int32) * 3
    sure = np.full(V, -1e9)
    sure[2] = 0.0
    md = _md(n, seeds=seeds, output_index=idx)
    tokens, emitted = _run(np.stack([sure, LOGITS]), [2], md, k=1)
    assert (emitted == 2).all()
    plain = jax.device_get(sample_tokens(jnp.tile(jnp.asarray(LOGITS, jnp.float32), (n, 1)),
                                         _md(n, seeds=seeds, output_index=idx + 1)))
    assert tokens[:, 1].tolist() == plain.tolist()


def test_draws_do_not_depend_on_batch_companions():
    """Row with seed 7 gives the same tokens alone and among others, at any row index."""
    seeds = jnp.asarray([7, 1, 2, 3], jnp.uint32)
    both = _run(np.stack([LOGITS, LOGITS[::-1], LOGITS]), [4, 2], _md(4, seeds=seeds), k=2)
    alone = _run(np.stack([LOGITS, LOGITS[::-1], LOGITS]), [4, 2],
                 _md(1, seeds=seeds[:1]), k=2)
    moved = _run(np.stack([LOGITS, LOGITS[::-1], LOGITS]), [4, 2],
                 _md(3, seeds=jnp.asarray([5, 6, 7], jnp.uint32)), k=2)
    e = int(alone[1][0])
    assert both[1][0] == e == moved[1][2]
    assert both[0][0, :e].tolist() == alone[0][0, :e].tolist() == moved[0][2, :e].tolist()


def test_inverse_cdf_draw_across_blocks_never_picks_a_dropped_entry():
    """sample_tokens' draw (one uniform per row, the block of 1024 entries first, then the
    entry): over 2500 entries with a whole block and 30% of the others dropped (-inf), every
    draw has mass, and the counts follow softmax (chi-square over the entries expected >= 5
    times, the rest pooled; p = 0.001)."""
    from scipy.stats import chi2

    from jaxinfer.layers.sampler import _draw, _row_keys

    rng = np.random.default_rng(0)
    v, n = 2500, 40000
    logits = (rng.normal(size=v) * 1.5).astype(np.float32)
    logits[rng.random(v) < 0.3] = -np.inf
    logits[1024:2048] = -np.inf  # an empty block between two with mass
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    keys = _row_keys(jnp.arange(n, dtype=jnp.uint32) % 101, jnp.arange(n, dtype=jnp.int32))
    draws = np.asarray(jax.jit(lambda k: _draw(jnp.broadcast_to(jnp.asarray(logits), (n, v)),
                                               k))(keys))
    assert np.isfinite(logits[draws]).all()
    assert (draws >= 2048).any() and (draws < 1024).any()  # both blocks with mass drawn
    counts = np.bincount(draws, minlength=v)
    big = p * n >= 5
    obs = np.append(counts[big], n - counts[big].sum())
    exp = np.append(p[big] * n, n - p[big].sum() * n)
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2.ppf(0.999, big.sum()), (stat, big.sum())
    # A row with one entry of mass always draws it, at either end of a block.
    for only in (0, 1023, 2047, 2499):
        one = np.full(v, -np.inf, np.float32)
        one[only] = 0.0
        got = jax.jit(_draw)(jnp.broadcast_to(jnp.asarray(one), (64, v)), keys[:64])
        assert (np.asarray(got) == only).all()

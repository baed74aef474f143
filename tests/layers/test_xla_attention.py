"""The XLA ragged paged attention (the default backend) vs the pure-jnp reference."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.ragged_attention import ragged_paged_attention_xla
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.pallas_kernels.test_ragged_paged_attention import CASES, make_case

CASES = dict(CASES, **{
    "decodes-then-prefills": ([1, 1, 1, 40, 3], [100, 5, 33, 0, 70]),
    "long-context": ([1, 1, 130, 70], [500, 3, 10, 600]),
})


def leading_ones(q_lens):
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def check(args, n_real, num_decodes, *, tol, **kw):
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125,
                                           sliding_window=kw.get("sliding_window"))
    fn = jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=0.125, **kw))
    out = fn(*args, jnp.array([num_decodes], jnp.int32))
    ref, out = np.asarray(ref, np.float32)[:n_real], np.asarray(out, np.float32)[:n_real]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_matches_reference_float32(case, hq, hkv):
    rng = np.random.default_rng(zlib.crc32(f"xla-{case}-{hq}".encode()))
    q_lens, ctx = CASES[case]
    args, n = make_case(rng, q_lens, ctx, hq=hq, hkv=hkv, d=64, bs=16, dtype=jnp.float32)
    check(args, n, leading_ones(q_lens), tol=2e-5)


@pytest.mark.parametrize("kv_chunk,q_tile", [(16, 8), (32, 16), (512, 128)])
@pytest.mark.parametrize("sliding_window", [None, 1, 100])
def test_chunking_and_sliding_window(kv_chunk, q_tile, sliding_window):
    """Chunk/tile sizes smaller and larger than the sequences; windows that skip chunks."""
    rng = np.random.default_rng(kv_chunk + q_tile + (sliding_window or 0))
    q_lens, ctx = CASES["long-context"]
    args, n = make_case(rng, q_lens, ctx, hq=6, hkv=2, d=64, bs=16, dtype=jnp.float32)
    check(args, n, 2, tol=2e-5, kv_chunk=kv_chunk, q_tile=q_tile,
          sliding_window=sliding_window)


def test_num_decodes_zero_is_always_correct():
    """num_decodes only tells which rows may be batched; 0 runs every sequence as a prefill."""
    rng = np.random.default_rng(7)
    q_lens, ctx = CASES["decodes-then-prefills"]
    args, n = make_case(rng, q_lens, ctx, hq=6, hkv=2, d=64, bs=16, dtype=jnp.float32)
    check(args, n, 0, tol=2e-5)
    check(args, n, 2, tol=2e-5)  # fewer than the leading single-token rows is fine too


@pytest.mark.parametrize("d,bs,hq,hkv", [(128, 16, 9, 3), (64, 32, 8, 2)])
def test_matches_reference_bfloat16(d, bs, hq, hkv):
    rng = np.random.default_rng(d + bs)
    args, n = make_case(rng, [1, 1, 33, 7], [70, 5, 0, 40], hq=hq, hkv=hkv, d=d, bs=bs,
                        dtype=jnp.bfloat16)
    check(args, n, 2, tol=3e-2)


def test_padding_rows_are_zero_and_nan_pages_ignored():
    """Padding tokens come back as zeros; NaN in unwritten pages never leaks (make_case fills
    every unused slot with NaN)."""
    rng = np.random.default_rng(3)
    args, n = make_case(rng, [1, 5], [9, 2], hq=4, hkv=2, d=64, bs=16, dtype=jnp.float32,
                        pad_tokens=6, pad_reqs=3)
    out = np.asarray(jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=0.1))(
        *args, jnp.array([1], jnp.int32)))
    assert np.isfinite(out).all()
    assert not out[n:].any()

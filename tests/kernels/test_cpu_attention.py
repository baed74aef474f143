"""The C++ FFI attention kernel (the `cpu` backend) vs the pure-jnp reference."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers import cpu_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.kernels.test_ragged_paged_attention import make_case
from tests.kernels.test_xla_attention import CASES

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the C++ kernel could not be built here")


def run(args, **kw):
    return jax.jit(lambda *a: cpu_attention.ragged_paged_attention_cpu(*a, sm_scale=0.125, **kw))(
        *args)


def check(args, n_real, *, tol, **kw):
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125,
                                           sliding_window=kw.get("sliding_window"))
    out = run(args, **kw)
    assert out.dtype == args[0].dtype
    ref, out = np.asarray(ref, np.float32)[:n_real], np.asarray(out, np.float32)[:n_real]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_matches_reference_float32(case, hq, hkv):
    rng = np.random.default_rng(zlib.crc32(f"cpu-{case}-{hq}".encode()))
    args, n = make_case(rng, *CASES[case], hq=hq, hkv=hkv, d=64, bs=16, dtype=jnp.float32)
    check(args, n, tol=2e-5)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 100])
def test_sliding_window(sliding_window):
    rng = np.random.default_rng(sliding_window)
    args, n = make_case(rng, *CASES["long-context"], hq=6, hkv=2, d=64, bs=16,
                        dtype=jnp.float32)
    check(args, n, tol=2e-5, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d,bs,hq,hkv", [(128, 16, 9, 3), (64, 32, 8, 2)])
def test_half_precisions(dtype, d, bs, hq, hkv):
    rng = np.random.default_rng(d + bs)
    args, n = make_case(rng, [1, 1, 33, 7], [70, 5, 0, 40], hq=hq, hkv=hkv, d=d, bs=bs,
                        dtype=dtype)
    check(args, n, tol=3e-2)


def test_padding_rows_are_zero_and_nan_pages_ignored():
    rng = np.random.default_rng(3)
    args, n = make_case(rng, [1, 5], [9, 2], hq=4, hkv=2, d=64, bs=16, dtype=jnp.float32,
                        pad_tokens=6, pad_reqs=3)
    out = np.asarray(run(args))
    assert np.isfinite(out[:n]).all()
    assert not out[n:].any()


def test_many_items_use_the_thread_pool_and_stay_exact():
    """64 decode rows + a long prefill: more work items than threads, same answer as the
    reference (and as a second run: no race between the pool's threads)."""
    rng = np.random.default_rng(11)
    q_lens = [1] * 64 + [300]
    ctx = list(rng.integers(0, 200, 64)) + [40]
    args, n = make_case(rng, q_lens, ctx, hq=9, hkv=3, d=64, bs=16, dtype=jnp.float32)
    check(args, n, tol=2e-5)
    np.testing.assert_array_equal(np.asarray(run(args)), np.asarray(run(args)))


@pytest.mark.parametrize("field", ["block_id", "kv_len", "query_start_loc", "num_seqs"])
def test_out_of_range_metadata_is_an_error_not_a_crash(field):
    """Indices come from the device: a bad one fails the call with a message instead of
    reading outside the caches."""
    rng = np.random.default_rng(5)
    (q, k, v, lens, tables, qsl, ns), _ = make_case(rng, [1, 4], [20, 3], hq=4, hkv=2, d=64,
                                                    bs=16, dtype=jnp.float32)
    if field == "block_id":
        tables = tables.at[0, 0].set(k.shape[0] + 5)
    elif field == "kv_len":
        lens = lens.at[1].set(tables.shape[1] * 16 + 1)
    elif field == "query_start_loc":
        qsl = qsl.at[2].set(q.shape[0] + 1)
    else:
        ns = jnp.array([tables.shape[0] + 1], jnp.int32)
    with pytest.raises(Exception, match="paged_attention_cpu"):
        np.asarray(run((q, k, v, lens, tables, qsl, ns)))


def test_build_is_cached_and_keyed_by_source():
    path = cpu_attention.build()
    assert path == cpu_attention.library_path()
    assert cpu_attention.build() == path  # no rebuild

"""The C++ FFI attention kernel (the `cpu` backend) vs the pure-jnp reference."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers import cpu_kernels
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.pallas_kernels.test_ragged_paged_attention import make_case
from tests.layers.test_xla_attention import CASES

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ kernel could not be built here")


def run(args, **kw):
    return jax.jit(lambda *a: cpu_kernels.ragged_paged_attention_cpu(*a, sm_scale=0.125, **kw))(
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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d,bs", [(128, 128), (32, 16), (80, 16)])
def test_head_dims_float32(case, d, bs):
    """Prefill tiles' blocked P.V takes head dims in 64-column blocks (128: two); 32 and 80
    (not multiples of 64) take the per-row path; 128-token pages as on CPU by default."""
    rng = np.random.default_rng(zlib.crc32(f"cpu-d-{case}-{d}".encode()))
    args, n = make_case(rng, *CASES[case], hq=6, hkv=2, d=d, bs=bs, dtype=jnp.float32)
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


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("bs", [16, 128])
def test_decode_items_take_all_heads_and_match(hq, hkv, bs):
    """Eight tiles or more: decode-sized sequences (1-2 query tokens) go through the
    all-heads, key-by-key path (run_decode_item) while the prefill beside them stays per head;
    contexts from empty to many pages, pages in random places."""
    rng = np.random.default_rng(hq * 1000 + bs)
    q_lens = [1] * 10 + [2, 2, 37]
    ctx = [0, 1, 15, 16, 17, 200, 31, 129, 300, 64, 5, 140, 20]
    args, n = make_case(rng, q_lens, ctx, hq=hq, hkv=hkv, d=64, bs=bs, dtype=jnp.float32)
    check(args, n, tol=2e-5)


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_decode_items_read_a_bf16_cache(q_dtype):
    """A bf16 model's decode rows (bf16 q and cache; or float32 q over a bf16 cache) take the
    all-heads path too, each 16 cache entries widened exactly: the float32 answer over the
    same bf16 values, rounded once into q's dtype."""
    rng = np.random.default_rng(7)
    q_lens = [1] * 10 + [2, 37]
    ctx = [0, 1, 15, 16, 17, 200, 31, 129, 300, 64, 5, 20]
    args, n = make_case(rng, q_lens, ctx, hq=9, hkv=3, d=64, bs=16, dtype=jnp.bfloat16)
    args = (args[0].astype(q_dtype),) + tuple(args[1:])
    ref = ragged_paged_attention_reference(args[0].astype(jnp.float32),
                                           *(a.astype(jnp.float32) for a in args[1:3]),
                                           *args[3:], sm_scale=0.125)
    out = run(args)
    assert out.dtype == q_dtype
    np.testing.assert_allclose(np.asarray(out, np.float32)[:n], np.asarray(ref)[:n],
                               atol=1e-2 if q_dtype == jnp.bfloat16 else 2e-5,
                               rtol=1e-2 if q_dtype == jnp.bfloat16 else 2e-5)


@pytest.mark.parametrize("d", [32, 48, 64, 80, 96, 128])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (14, 2), (4, 4)])
@pytest.mark.parametrize("q_lens,ctx", [([1] * 10 + [2, 2], [0, 1, 15, 16, 17, 200, 31, 129,
                                                             300, 64, 5, 140]),
                                         ([1, 2], [700, 333])])
def test_bf16_decode_rows_match_over_head_dims_and_groups(d, hq, hkv, q_lens, ctx):
    """bf16 q and cache, all-heads and split decode items: scores on bf16 dot products where
    D is a multiple of 32 (as 32, 64 or 128 values, or in 32-value pieces), widened K
    elsewhere; P.V in register blocks of up to 6 rows (a group of 7 query heads: 6 + 1) and 64
    or 16 values. Checked against the float32 answer over the same bf16 values at the
    precision of the bf16 output."""
    rng = np.random.default_rng(d * 100 + hq)
    args, n = make_case(rng, q_lens, ctx, hq=hq, hkv=hkv, d=d, bs=16, dtype=jnp.bfloat16)
    ref = ragged_paged_attention_reference(*(a.astype(jnp.float32) for a in args[:3]),
                                           *args[3:], sm_scale=0.125)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.bfloat16), np.float32)[:n]
    out = np.asarray(run(args), np.float32)[:n]
    # at most one bf16 rounding step apart (8 bits), with a floor for values near 0
    np.testing.assert_allclose(out, ref, atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 80])
@pytest.mark.parametrize("hq,hkv,bs", [(9, 3, 128), (14, 2, 16), (4, 4, 16), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_prefill_items_match_over_head_dims_groups_and_pages(d, hq, hkv, bs, window):
    """bf16 q and cache, prefill tiles (run_blocked_item_bf16 where D is a multiple of 32,
    else widened rows): scores on bf16 dot products, P.V on bf16 probability pairs (pages
    of odd length: an odd last key), every row of a tile from one query token up, chunks
    after a cached context and a window. Checked against the float32 answer over the same
    bf16 values at the precision of the bf16 output."""
    rng = np.random.default_rng(d * 1000 + hq * 10 + bs + (window or 0))
    q_lens, ctx = [37, 16, 5, 200, 3], [0, 129, 300, 55, 16]
    args, n = make_case(rng, q_lens, ctx, hq=hq, hkv=hkv, d=d, bs=bs, dtype=jnp.bfloat16)
    ref = ragged_paged_attention_reference(*(a.astype(jnp.float32) for a in args[:3]),
                                           *args[3:], sm_scale=0.125, sliding_window=window)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.bfloat16), np.float32)[:n]
    out = np.asarray(run(args, sliding_window=window), np.float32)[:n]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("sliding_window", [1, 7, 40])
def test_decode_items_with_sliding_window(sliding_window):
    rng = np.random.default_rng(100 + sliding_window)
    q_lens = [1] * 9 + [2]
    ctx = [0, 3, 39, 40, 41, 100, 250, 16, 17, 90]
    args, n = make_case(rng, q_lens, ctx, hq=6, hkv=2, d=64, bs=16, dtype=jnp.float32)
    check(args, n, tol=2e-5, sliding_window=sliding_window)


def test_decode_items_refuse_a_bad_block_id_on_a_later_page():
    """The next page is prefetched while one is computed: a bad id there is skipped by the
    prefetch and refused when its page comes, never read."""
    rng = np.random.default_rng(9)
    (q, k, v, lens, tables, qsl, ns), _ = make_case(rng, [1] * 10, [100] * 10, hq=6, hkv=2,
                                                    d=64, bs=16, dtype=jnp.float32)
    tables = tables.at[4, 3].set(-7)
    with pytest.raises(Exception, match="block id out of range"):
        np.asarray(run((q, k, v, lens, tables, qsl, ns)))


@pytest.mark.parametrize("q_lens,ctx", [([1], [127]), ([1], [128]), ([1], [255]),
                                         ([1], [1000]), ([1], [4095]),
                                         ([1, 2, 1], [300, 150, 20]), ([2, 1, 37], [64, 700, 9])])
@pytest.mark.parametrize("hq,hkv,bs", [(9, 3, 16), (8, 1, 128), (4, 4, 16)])
def test_few_sequences_split_their_keys_and_match(q_lens, ctx, hq, hkv, bs):
    """Fewer than 8 tiles: a decode row's keys are split, page-aligned, over several items
    (every KV head each) whose partial sums are combined; a short context or a prefill beside
    it keeps one item per KV head. Same answer as the reference, and run to run."""
    rng = np.random.default_rng(sum(ctx) + hq * 10 + bs)
    args, n = make_case(rng, q_lens, ctx, hq=hq, hkv=hkv, d=64, bs=bs, dtype=jnp.float32)
    check(args, n, tol=2e-5)
    np.testing.assert_array_equal(np.asarray(run(args)), np.asarray(run(args)))


@pytest.mark.parametrize("sliding_window", [1, 7, 40, 300])
def test_split_keys_with_sliding_window(sliding_window):
    """A window makes some parts see no key at all (their max stays the mask value and they
    weigh nothing in the combination)."""
    rng = np.random.default_rng(200 + sliding_window)
    args, n = make_case(rng, [1, 2], [900, 333], hq=6, hkv=2, d=64, bs=16, dtype=jnp.float32)
    check(args, n, tol=2e-5, sliding_window=sliding_window)


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_split_keys_over_a_bf16_cache(q_dtype):
    rng = np.random.default_rng(8)
    args, n = make_case(rng, [1], [700], hq=9, hkv=3, d=64, bs=16, dtype=jnp.bfloat16)
    args = (args[0].astype(q_dtype),) + tuple(args[1:])
    ref = ragged_paged_attention_reference(args[0].astype(jnp.float32),
                                           *(a.astype(jnp.float32) for a in args[1:3]),
                                           *args[3:], sm_scale=0.125)
    out = run(args)
    assert out.dtype == q_dtype
    tol = 1e-2 if q_dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32)[:n], np.asarray(ref)[:n],
                               atol=tol, rtol=tol)


def test_split_keys_refuse_a_bad_block_id_in_a_later_part():
    rng = np.random.default_rng(10)
    (q, k, v, lens, tables, qsl, ns), _ = make_case(rng, [1], [600], hq=6, hkv=2, d=64, bs=16,
                                                    dtype=jnp.float32)
    tables = tables.at[0, 30].set(10_000)
    with pytest.raises(Exception, match="block id out of range"):
        np.asarray(run((q, k, v, lens, tables, qsl, ns)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_lens,ctx", [([40], [100]), ([3, 70], [150, 0])])
def test_prefill_tiles_refuse_a_bad_block_id_on_a_later_page(dtype, q_lens, ctx):
    """Prefill tiles (float32 and bf16 caches, one tile or several) walk their pages as decode
    items do: a bad id past the first page fails the call instead of being read."""
    rng = np.random.default_rng(11)
    (q, k, v, lens, tables, qsl, ns), _ = make_case(rng, q_lens, ctx, hq=6, hkv=2, d=64,
                                                    bs=16, dtype=dtype)
    last = len(q_lens) - 1
    tables = tables.at[last, (q_lens[-1] + ctx[-1] - 1) // 16].set(-3)
    with pytest.raises(Exception, match="block id out of range"):
        np.asarray(run((q, k, v, lens, tables, qsl, ns)))


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


def test_loading_the_kernels_keeps_subnormal_floats():
    """The library is compiled with -ffast-math but not linked with it: loading it must not
    turn on flush-to-zero for the process (hypothesis, numpy and XLA all rely on subnormals)."""
    import subprocess
    import sys

    code = ("import numpy as np; from jaxinfer.layers import cpu_kernels as c; "
            "assert c.available(); x = np.float32(1e-38) / np.float32(1000); "
            "print(float(x) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "True"


def test_build_is_cached_and_keyed_by_source():
    path = cpu_kernels.build()
    assert path == cpu_kernels.library_path()
    assert cpu_kernels.build() == path  # no rebuild


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (7, 64, 33), (32, 1536, 576), (50, 40, 31),
                                   (130, 96, 64), (0, 16, 32), (13, 64, 100), (12, 32, 96),
                                   (17, 48, 2048)])
def test_packed_matmul_matches_numpy(m, k, n):
    """Every row-block remainder (1..5 of 6), a partial last panel (n % 32), one panel,
    zero rows; from 12 rows full panels in pairs (an odd one and a partial one left alone)."""
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    wp = cpu_kernels.pack(w)
    assert wp.shape == cpu_kernels.packed_shape(k, n)
    out = jax.jit(lambda x, wp: cpu_kernels.matmul(x, wp, n))(x, wp)
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 64, 33), (12, 32, 96), (40, 96, 70),
                                   (33, 576, 1000), (12, 33, 64), (16, 30, 64), (17, 40, 128),
                                   (64, 1536, 576), (4, 64, 64), (5, 576, 960), (8, 33, 64),
                                   (11, 40, 100), (6, 64, 128), (9, 576, 128)])
def test_bf16_panels_match_float_products_of_the_bf16_weights(m, k, n):
    """bfloat16 panels (a bf16 model's weights, half the bytes): the product of a bf16
    model's rows (bf16 values) equals float64 x @ w, from one row (widened as streamed) to
    12+ rows (pairs of panels widened; from 16 rows on CPUs with AMX, tile products of the
    bf16 values; from 6 rows and an even K on CPUs with AVX512-BF16 but no AMX, vdpbf16ps
    products of k pairs; both exact for such rows); a bf16 x comes back bf16. Grouped (MoE)
    panels too."""
    import ml_dtypes

    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float64) @ w.astype(np.float64)
    out = jax.jit(lambda x, wp: cpu_kernels.matmul(x, wp, n))(x, cpu_kernels.pack(w))
    assert out.dtype == np.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-4)
    xb = jnp.asarray(x, jnp.bfloat16)
    out = jax.jit(lambda x, wp: cpu_kernels.matmul(x, wp, n))(xb, cpu_kernels.pack(w))
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(xb, np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2, atol=1e-2)
    # two experts, the rows split 1 : m - 1
    w2 = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    wp = np.stack([cpu_kernels.pack(w), cpu_kernels.pack(w2)])
    gs = jnp.asarray([1, m - 1], jnp.int32)
    got = jax.jit(lambda x, wp, gs: cpu_kernels.grouped_matmul(x, wp, gs, n))(x, wp, gs)
    want = np.concatenate([x[:1] @ w.astype(np.float64), x[1:] @ w2.astype(np.float64)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-4)


def _gated_ref(x, act):
    """act(gate) * up of rows [M, 2K] (gate, then up), in float64."""
    x = x.astype(np.float64)
    g, u = np.split(x, 2, axis=1)
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(1, 1536, 576), (5, 96, 70), (16, 64, 33), (0, 32, 32),
                                   (200, 512, 64), (32, 1536, 576)])
def test_gated_matmul_multiplies_the_activated_rows(act, wdtype, m, k, n):
    """A gated MLP's down projection from the gate-up product: (act(gate) * up) @ W, the
    activation made inside the kernel (one row; a few; zero rows; 200 x 512 and SmolLM2's
    32 x 1536 gated values, shared out over the pool in row chunks), float32 and bf16
    panels; both activations
    over the range where they bend (|gate| up to ~9)."""
    import ml_dtypes

    rng = np.random.default_rng(m + k + n + len(act))
    x = (3 * rng.standard_normal((m, 2 * k))).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.dtype(ml_dtypes.bfloat16) if wdtype == "bfloat16"
                                          else np.float32)
    gated = _gated_ref(x, act)
    want = gated @ w.astype(np.float64)
    got = jax.jit(lambda x, wp: cpu_kernels.gated_matmul(x, wp, n, act))(x, cpu_kernels.pack(w))
    assert got.shape == (m, n) and got.dtype == np.float32
    got = np.asarray(got)
    scale = max(1.0, float(np.abs(want).max())) if m else 1.0
    if wdtype == "bfloat16" and not np.allclose(got, want, rtol=1e-4, atol=1e-5 * scale):
        # bf16 panels multiply several rows as bf16 values (vdpbf16ps / AMX, where the CPU
        # has them): the gated rows rounded to bf16, exactly multiplied
        rounded = gated.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        want = rounded @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "gated"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (7, 64, 33), (300, 576, 96), (7, 64, 128),
                                   (300, 576, 192)])
def test_bf16_rows_and_results_stay_bf16_through_the_kernels(kind, m, k, n):
    """A bf16 model's rows go into the matmul kernels as they are and its results come out
    bf16 (plain, quantized and gated kernels; 300 x 576 values widen and round over the
    pool; with AVX512-BF16, N a multiple of 64 and 6 rows or more, bf16 panels read the bf16
    rows and round into the bf16 result in the products themselves): the same bits as the
    float32 call's results rounded to nearest even, and no convert left in the compiled
    program around the call."""
    import ml_dtypes

    rng = np.random.default_rng(m + k + n + len(kind))
    kk = 2 * k if kind == "gated" else k
    xb = jnp.asarray(rng.standard_normal((m, kk)), jnp.bfloat16)
    if kind == "int8":
        w = rng.integers(-127, 128, (k, n)).astype(np.int8)
        sc = jnp.asarray(cpu_kernels.pack(rng.uniform(0.01, 0.02, (1, n)).astype(np.float32)))
        def f(x, wp, out_dtype=None):
            return cpu_kernels.matmul(x, wp, n, scale=sc, out_dtype=out_dtype)
    else:
        dt = np.dtype(ml_dtypes.bfloat16) if kind != "float32" else np.dtype(np.float32)
        w = rng.standard_normal((k, n)).astype(dt)
        if kind == "gated":
            def f(x, wp, out_dtype=None):
                return cpu_kernels.gated_matmul(x, wp, n, "silu", out_dtype=out_dtype)
        else:
            def f(x, wp, out_dtype=None):
                return cpu_kernels.matmul(x, wp, n, out_dtype=out_dtype)
    wp = jnp.asarray(cpu_kernels.pack(w))
    got = jax.jit(f)(xb, wp)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    want = jax.jit(f)(xb.astype(jnp.float32), wp)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).astype(ml_dtypes.bfloat16).view(np.uint16))
    f32 = jax.jit(lambda x, wp: f(x, wp, jnp.float32))(xb, wp)  # bf16 rows, float32 result
    np.testing.assert_array_equal(np.asarray(f32), np.asarray(want))
    hlo = jax.jit(f).lower(xb, wp).compile().as_text()
    assert "convert" not in hlo, hlo


def test_bf16_results_rounded_in_the_products_keep_infinities_and_nans():
    """Where bf16 panels round their sums into a bf16 result themselves (12 rows, 128
    columns), infinite and NaN sums come out as `finish` rounds the float32 result: the same
    bits as the float32 call's results converted to bf16."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 64)).astype(np.float32)
    x[2, 5], x[3, :], x[4, 7], x[5, :2] = np.inf, np.nan, -np.inf, 3e38  # (3e38 x 2: overflow)
    wp = jnp.asarray(cpu_kernels.pack(rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16)))
    f = jax.jit(lambda x, wp: cpu_kernels.matmul(x, wp, 128))
    xb = jnp.asarray(x, jnp.bfloat16)
    want = np.asarray(f(xb.astype(jnp.float32), wp))
    assert np.isnan(want).any() and np.isinf(want).any()
    np.testing.assert_array_equal(np.asarray(f(xb, wp)).view(np.uint16),
                                  want.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_gated_matmul_refuses_an_unknown_activation_and_odd_rows():
    wp = jnp.asarray(cpu_kernels.pack(np.ones((16, 32), np.float32)))
    with pytest.raises(ValueError, match="relu"):
        cpu_kernels.gated_matmul(jnp.ones((1, 32), jnp.float32), wp, 32, "relu")
    with pytest.raises(Exception, match="gated matmul"):  # 33 values: no gate / up halves
        np.asarray(jax.jit(lambda x: cpu_kernels.gated_matmul(x, wp, 32, "silu"))(
            jnp.ones((1, 33), jnp.float32)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("t,h", [(1, 576), (7, 64), (0, 32), (300, 576)])
def test_rms_norm_kernel_matches_the_module(dtype, unit_offset, t, h):
    """The C++ RMSNorm (one row; a few; none; 300 x 576 values, shared out over the pool)
    = layers/norms.py's XLA form, plain and Gemma's (1 + w), float32 and bf16 (rounded where
    the module rounds: to 1 bf16 step, the sums of squares being added in another order);
    with a residual, the sum comes back exactly as x + r in the rows' dtype."""
    from jaxinfer.layers.norms import RMSNorm

    rng = np.random.default_rng(t + h + unit_offset)
    dt = jnp.dtype(dtype)
    norm = RMSNorm(h, 1e-5, dtype=dt, unit_offset=unit_offset)
    norm.weight[...] = jnp.asarray(rng.uniform(-1.5, 1.5, h), dt)
    x = jnp.asarray(4 * rng.standard_normal((t, h)), dt)
    r = jnp.asarray(rng.standard_normal((t, h)), dt)
    want, (want_s, want_n) = norm(x), norm.add_norm(x, r)
    norm.kernel = True
    got, (got_s, got_n) = jax.jit(lambda x, r: (norm(x), norm.add_norm(x, r)))(x, r)
    assert got.dtype == dt and got_s.dtype == dt and got_n.shape == (t, h)
    np.testing.assert_array_equal(np.asarray(got_s, np.float32), np.asarray(want_s, np.float32))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=1e-6)
    for a, b in ((got, want), (got_n, want_n)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_packed_matmul_refuses_mismatched_shapes():
    x = jnp.ones((2, 16), jnp.float32)
    wp = jnp.asarray(cpu_kernels.pack(np.ones((16, 64), np.float32)))  # 2 panels
    with pytest.raises(Exception, match="packed_matmul_cpu"):
        np.asarray(jax.jit(lambda x, wp: cpu_kernels.matmul(x, wp, 20))(x, wp))  # 1 panel's


def test_packed_model_matches_unpacked():
    """The same checkpoint loaded packed (`cpu` backend, fp32, one device) and plain (xla):
    layer outputs agree."""
    from jaxinfer.checkpoints.default_model import ensure_default_model
    from jaxinfer.models.loader import load_model

    path = ensure_default_model()
    packed, _, _ = load_model(path, dtype="float32", attention_backend="cpu")
    plain, _, _ = load_model(path, dtype="float32", attention_backend="xla")
    assert packed.model.layers[0].mlp.down_proj.weight[...].ndim == 3
    assert plain.model.layers[0].mlp.down_proj.weight[...].ndim == 2
    # packed: silu(gate) * up made inside the down projection's kernel; plain: by XLA
    assert packed.model.layers[3].mlp.gated and not plain.model.layers[3].mlp.gated
    # packed: the norms by the C++ kernel; plain: by XLA
    assert packed.model.layers[3].post_attention_layernorm.kernel and packed.model.norm.kernel
    assert not plain.model.layers[3].input_layernorm.kernel
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 576)), jnp.float32)
    ids = jnp.asarray([0, 31, 32, 49151, 7], jnp.int32)
    # the tied table is held once, as the packed head; lookups read it: the same rows
    assert packed.model.embed_tokens.weight is None
    np.testing.assert_array_equal(np.asarray(packed.model.embed_tokens(ids)),
                                  np.asarray(plain.model.embed_tokens(ids)))
    for fn in (lambda m: m.model.layers[3].mlp(x),
               lambda m: m.model.layers[3].post_attention_layernorm.add_norm(x, 2 * x),
               lambda m: m.model.norm(x),
               lambda m: m.model.layers[3].self_attn.qkv_proj(x),
               lambda m: m.compute_logits(x)):  # the tied LM head, packed from the table
        for a, b in zip(jax.tree.leaves(fn(packed)), jax.tree.leaves(fn(plain))):
            b = np.asarray(b)  # (fp32 sums in another order: relative to the output's scale)
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * np.abs(b).max())
    # bf16 models are packed too (bf16 panels); tensor-parallel builds never
    bf16, _, _ = load_model(path, dtype="bfloat16", attention_backend="cpu", load_format="dummy")
    assert bf16.model.layers[0].mlp.down_proj.weight[...].ndim == 3
    assert bf16.model.layers[0].mlp.down_proj.weight[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["float", "int8", "4bit"])
def test_rows_gathered_from_packed_panels(kind):
    """Embedding rows read from a packed head W [H, V] (float, int8 codes with group scales
    and offsets, 4-bit codes two to a byte) = rows of the dequantized W^T."""
    from jaxinfer.layers.linear import packed_rows
    from jaxinfer.layers.quantization import dequantize, pack_nibbles, to_nibbles

    rng = np.random.default_rng(1)
    h, v, g = 64, 70, 16  # (a partial last panel)
    ids = jnp.asarray([0, 69, 31, 32, 5, 5], jnp.int32)
    if kind == "float":
        w = rng.standard_normal((h, v)).astype(np.float32)
        got = packed_rows(jnp.asarray(cpu_kernels.pack(w)), ids, h)
        np.testing.assert_array_equal(np.asarray(got), w.T[np.asarray(ids)])
        return
    q = rng.integers(-8, 8 if kind == "4bit" else 100, (h, v)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, (h // g, v)).astype(np.float32)
    o = rng.uniform(-1, 1, (h // g, v)).astype(np.float32)
    want = dequantize(q, s, g, o).T[np.asarray(ids)]
    if kind == "4bit":
        codes, o = to_nibbles(q, s, o)
        packed = pack_nibbles(cpu_kernels.pack(codes))
    else:
        packed = cpu_kernels.pack(q)
    got = packed_rows(jnp.asarray(packed), ids, h, jnp.asarray(cpu_kernels.pack(s)),
                      jnp.asarray(cpu_kernels.pack(o)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_switch_env_var_takes_0_or_1_only(monkeypatch):
    try:
        for value, want in (("0", False), ("1", True)):
            monkeypatch.setenv("JAXINFER_CPU_ATTENTION", value)
            cpu_kernels.available.cache_clear()
            assert cpu_kernels.available() is want
        monkeypatch.setenv("JAXINFER_CPU_ATTENTION", "yes")
        cpu_kernels.available.cache_clear()
        with pytest.raises(ValueError, match="JAXINFER_CPU_ATTENTION='yes'"):
            cpu_kernels.available()
    finally:
        monkeypatch.undo()
        cpu_kernels.available.cache_clear()
        assert cpu_kernels.available()

"""The Pallas ragged paged attention (interpret mode on CPU) vs the pure-jnp reference."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.ragged_paged_attention import head_dim_chunks, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.tuning import _TABLE


def make_case(rng, q_lens, ctx_lens, *, hq, hkv, d, bs, dtype, num_blocks=None, pad_reqs=1,
              pad_tokens=5, max_blocks=None):
    """Random paged layout: each sequence gets random distinct blocks; unused slots are NaN."""
    r = len(q_lens)
    kv_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    need = [-(-k // bs) for k in kv_lens]
    max_blocks = max_blocks or max(max(need), 1)
    num_blocks = num_blocks or sum(need) + 3
    k = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((r + pad_reqs, max_blocks), np.int32)
    used = np.zeros((num_blocks, bs), bool)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[i : i + n]
        for j in range(kv_lens[s]):
            used[tables[s, j // bs], j % bs] = True
        i += n
    k[~used] = np.nan  # unwritten slots may hold anything
    v[~used] = np.nan
    t = sum(q_lens) + pad_tokens
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    qsl = np.array([0, *np.cumsum(q_lens)] + [sum(q_lens)] * pad_reqs, np.int32)
    lens = np.array(kv_lens + [0] * pad_reqs, np.int32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(qsl),
            jnp.asarray([r], np.int32)), sum(q_lens)


def check(args, n_real, *, tol, num_splits=None, **kw):
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125, **kw)
    out = ragged_paged_attention(*args, sm_scale=0.125, interpret=True, num_splits=num_splits,
                                 **kw)
    ref, out = np.asarray(ref, np.float32)[:n_real], np.asarray(out, np.float32)[:n_real]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


CASES = {
    "all-decode": ([1, 1, 1, 1, 1], [7, 30, 15, 64, 1]),
    "all-prefill": ([13, 32, 5], [0, 0, 0]),
    "mixed": ([1, 20, 1, 9], [40, 0, 16, 3]),
    "chunked-with-context": ([17, 8], [32, 47]),
    "single-tokens": ([1], [0]),
    "block-boundaries": ([16, 1, 15], [0, 31, 17]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_matches_reference_float32(case, hq, hkv):
    rng = np.random.default_rng(zlib.crc32(f"{case}-{hq}".encode()))
    args, n = make_case(rng, *CASES[case], hq=hq, hkv=hkv, d=64, bs=16, dtype=jnp.float32)
    check(args, n, tol=2e-5)


@pytest.mark.parametrize("d,bs,hq,hkv", [(128, 16, 9, 3), (64, 32, 8, 2), (128, 32, 16, 2)])
def test_matches_reference_bfloat16(d, bs, hq, hkv):
    rng = np.random.default_rng(d + bs)
    args, n = make_case(rng, [1, 33, 1, 7], [70, 0, 5, 40], hq=hq, hkv=hkv, d=d, bs=bs,
                        dtype=jnp.bfloat16)
    check(args, n, tol=3e-2)


def test_head_dim_chunks():
    assert head_dim_chunks(128) == ((0, 128),)
    assert head_dim_chunks(80) == ((0, 64), (64, 16))
    assert head_dim_chunks(96) == ((0, 64), (64, 32))
    assert head_dim_chunks(112) == ((0, 64), (64, 32), (96, 16))
    with pytest.raises(ValueError, match="head_dim 8 must be a multiple of 16"):
        head_dim_chunks(8)


@pytest.mark.parametrize("d,dtype,tol", [(80, jnp.float32, 2e-5), (96, jnp.float32, 2e-5),
                                         (112, jnp.bfloat16, 3e-2)])
def test_non_power_of_two_head_dim(d, dtype, tol):
    """head_dim 80/96/112 run as power-of-two column chunks; splits merge every chunk."""
    rng = np.random.default_rng(d)
    args, n = make_case(rng, [1, 20, 1, 9], [40, 0, 300, 3], hq=8, hkv=2, d=d, bs=16,
                        dtype=dtype)
    check(args, n, tol=tol)
    check(args, n, tol=tol, num_splits=3)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_kv_decode_matches_reference(splits):
    rng = np.random.default_rng(splits)
    args, n = make_case(rng, [1, 1, 1, 2], [300, 129, 5, 260], hq=8, hkv=2, d=64, bs=16,
                        dtype=jnp.float32)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
    out = ragged_paged_attention(*args, sm_scale=0.125, interpret=True, num_splits=splits)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], atol=2e-5, rtol=2e-5)


def test_sliding_window_and_soft_cap():
    rng = np.random.default_rng(3)
    args, n = make_case(rng, [9, 1, 20], [30, 50, 0], hq=4, hkv=2, d=64, bs=16,
                        dtype=jnp.float32)
    check(args, n, tol=2e-5, sliding_window=12)
    check(args, n, tol=2e-5, soft_cap=5.0)


def test_padded_sequences_are_ignored():
    rng = np.random.default_rng(4)
    args, n = make_case(rng, [3, 4], [5, 0], hq=4, hkv=2, d=64, bs=16, dtype=jnp.float32,
                        pad_reqs=3, pad_tokens=20)
    q, k, v, lens, tables, qsl, num = args
    # Garbage in the padding rows of the metadata must not matter.
    lens = lens.at[2:].set(99)
    tables = tables.at[2:].set(1)
    check((q, k, v, lens, tables, qsl, num), n, tol=2e-5)


def test_bad_shapes_raise_naming_the_argument():
    q = jnp.zeros((8, 4, 64))
    kc = jnp.zeros((10, 16, 2, 64))
    i32 = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    good = (q, kc, kc, i32(2), i32(2, 4), i32(3), i32(1))
    with pytest.raises(ValueError, match=r"q must be \[T, Hq, D\]"):
        ragged_paged_attention(q[0], *good[1:], sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ragged_paged_attention(jnp.zeros((8, 3, 64)), *good[1:], sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="head_dim 72 must be a multiple of 16"):
        ragged_paged_attention(jnp.zeros((8, 4, 72)), jnp.zeros((10, 16, 2, 72)),
                               jnp.zeros((10, 16, 2, 72)), *good[3:], sm_scale=1.0,
                               interpret=True)
    with pytest.raises(ValueError, match=r"query_start_loc must be \[R\+1\]"):
        ragged_paged_attention(*good[:5], i32(2), i32(1), sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        ragged_paged_attention(*good[:3], jnp.zeros(2), *good[4:], sm_scale=1.0,
                               interpret=True)
    with pytest.raises(ValueError, match="dtypes differ"):
        ragged_paged_attention(q.astype(jnp.bfloat16), *good[1:], sm_scale=1.0,
                               interpret=True)


SHIPPED = sorted({(d, bs, dt) for (d, bs, dt, _) in _TABLE}
                 | {(64, 16, "float32"), (128, 16, "float32"), (80, 16, "bfloat16")})


@pytest.mark.parametrize("d,bs,dtype", SHIPPED)
@pytest.mark.parametrize("t,r,splits", [(16, 16, None), (64, 64, 4), (1024, 32, None)])
def test_lowers_for_cuda(d, bs, dtype, t, r, splits):
    """Every shipped configuration lowers to a Triton custom call for an H100 (no GPU here)."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    S = jax.ShapeDtypeStruct
    dt = jnp.dtype(dtype)
    args = (S((t, 32, d), dt), S((64, bs, 8, d), dt), S((64, bs, 8, d), dt), S((r,), jnp.int32),
            S((r, 512 // bs), jnp.int32), S((r + 1,), jnp.int32), S((1,), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_paged_attention(
            *a, sm_scale=0.1, num_splits=splits)).trace(*args).lower(
                lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)])
def test_native_gpu_matches_reference(case, dtype, tol):
    """On a CUDA GPU: the compiled Triton kernel (not interpret mode) vs the reference."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    args, n = make_case(rng, *CASES[case], hq=32, hkv=8, d=128, bs=16, dtype=dtype)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.088)
    for splits in (None, 3):
        out = ragged_paged_attention(*args, sm_scale=0.088, num_splits=splits)
        np.testing.assert_allclose(np.asarray(out, np.float32)[:n],
                                   np.asarray(ref, np.float32)[:n], atol=tol, rtol=tol)

"""fp8 KV caches (kv_cache_dtype "fp8" / "fp8_e5m2"): quantize on write, every attention backend
reads them widened, per-tensor k / v scales applied outside the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxinfer.layers import cpu_kernels
from jaxinfer.layers.attention import AttentionMetadata, paged_attention, quantize_kv, write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv_reference
from tests.pallas_kernels.test_ragged_paged_attention import make_case

FP8 = {"fp8_e4m3": (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0, 2.0 ** -4),
       "fp8_e5m2": (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0, 2.0 ** -3)}


@pytest.mark.parametrize("kind", list(FP8))
def test_quantize_round_trip_within_the_format(kind):
    dtype, np_dtype, fmax, rel = FP8[kind]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096).astype(np.float32) * 3
    scale = 0.05
    q = np.asarray(quantize_kv(jnp.asarray(x), scale, dtype))
    assert q.dtype == np_dtype
    back = q.astype(np.float32) * scale
    # normal numbers: relative error <= half an ulp of the mantissa; never more than the range
    big = np.abs(x / scale) >= 2.0 ** -6
    assert np.all(np.abs(back - x)[big] <= rel * np.abs(x)[big])
    # saturation, not inf / nan, past the range
    huge = np.asarray(quantize_kv(jnp.asarray([1e30, -1e30], jnp.float32), 1.0, dtype))
    assert list(huge.astype(np.float32)) == [fmax, -fmax]


BACKENDS = ["reference", "xla", "pallas"] + (["cpu"] if cpu_kernels.available() else [])


CASES = {"mixed": ([1, 20, 1, 9], [40, 0, 16, 3]),
         # 10 decode rows: the cpu kernel's decode items (every KV head per page, fp8 widened
         # 16 at a time)
         "decodes": ([1] * 10, [5, 40, 16, 3, 70, 1, 33, 16, 17, 50]),
         # two long decodes: the cpu kernel splits their keys over items
         "few-long-decodes": ([1, 2], [300, 150])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", list(FP8))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_attends_over_fp8_caches(kind, backend, case):
    """paged_attention over an fp8 cache (with scales != 1) = the reference over the cache's
    dequantized values; and this step's k, v are written quantized."""
    dtype = FP8[kind][0]
    rng = np.random.default_rng(7)
    (q, k, v, lens, tables, qsl, ns), n = make_case(
        rng, *CASES[case], hq=4, hkv=2, d=64, bs=16, dtype=jnp.float32)
    ks, vs = jnp.float32(0.02), jnp.float32(0.5)
    kq, vq = quantize_kv(k, ks, dtype), quantize_kv(v, vs, dtype)
    ref = ragged_paged_attention_reference(
        q, kq.astype(jnp.float32) * ks, vq.astype(jnp.float32) * vs, lens, tables, qsl, ns,
        sm_scale=0.125)
    t = q.shape[0]
    slots = np.zeros(t, np.int32)  # block 0 is no sequence's: the writes land out of sight
    slots[0] = 5
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=tables, seq_lens=lens,
                           query_start_loc=qsl, num_seqs=ns, num_decodes=jnp.asarray([0]))
    knew = jnp.full((t, 2, 64), 0.3, jnp.float32)
    out, kc, vc = jax.jit(lambda *a: paged_attention(
        *a, sm_scale=0.125, backend=backend, sliding_window=None, kv_scales=(ks, vs)))(
            q, knew, knew, kq, vq, md)
    assert kc.dtype == dtype
    np.testing.assert_allclose(np.asarray(kc[0, 5], np.float32) * 0.02, 0.3, rtol=2 ** -3)
    np.testing.assert_allclose(np.asarray(vc[0, 5], np.float32) * 0.5, 0.3, rtol=2 ** -3)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], atol=2e-5, rtol=2e-5)


def _write_case(dtype):
    rng = np.random.default_rng(3)
    nb, bs, h, d, t = 6, 8, 2, 16, 7
    kc = jnp.asarray(rng.standard_normal((nb, bs, h, d)), jnp.float32).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((nb, bs, h, d)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    # padding rows -> slot 0 (the null block); past the end: dropped, as XLA's scatter does
    slots = jnp.asarray([9, 0, 47, 0, nb * bs, nb * bs + 100, 20], jnp.int32)
    return kc, vc, k, v, slots


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32,
                                   jnp.bfloat16])
def test_cpu_kv_write_equals_the_scatter(dtype):
    """The C++ KV write (fp8 caches on CPU use it) = XLA's scatter on the caches' bytes, and
    in place: compiled with the caches donated, no cache-sized copy is left in the program."""
    kc, vc, k, v, slots = _write_case(dtype)
    kq, vq = k.astype(dtype), v.astype(dtype)
    bits = jax.lax.bitcast_convert_type
    u8 = jnp.uint8 if jnp.dtype(dtype).itemsize == 1 else jnp.uint16 if jnp.dtype(
        dtype).itemsize == 2 else jnp.uint32
    want = write_kv_reference(bits(kc, u8), bits(vc, u8), bits(kq, u8), bits(vq, u8), slots)
    fn = jax.jit(cpu_kernels.write_kv_cpu, donate_argnums=(0, 1))
    text = fn.lower(kc, vc, kq, vq, slots).compile().as_text()
    assert not [line for line in text.splitlines() if " copy(" in line and "[6,8,2,16]" in line]
    got = fn(kc, vc, kq, vq, slots)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(bits(g, u8)), np.asarray(w))


@pytest.mark.parametrize("kind", list(FP8))
def test_fp8_write_without_the_cpu_kernels(kind, monkeypatch):
    """Where the C++ kernels are not built, fp8 caches are written by XLA's scatter on their
    bytes: the same caches."""
    dtype = FP8[kind][0]
    kc, vc, k, v, slots = _write_case(dtype)
    md = AttentionMetadata(slot_mapping=slots, block_tables=None, seq_lens=None,
                           query_start_loc=None, num_seqs=None, num_decodes=None)
    scales = (jnp.float32(0.5), jnp.float32(2.0))
    with_kernels = write_kv(kc, vc, k, v, md, scales)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    without = write_kv(kc, vc, k, v, md, scales)
    for a, b in zip(with_kernels, without):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    # the written rows hold k / k_scale (and v / v_scale), quantized
    np.testing.assert_array_equal(
        np.asarray(without[0].reshape(-1, 2, 16)[9].astype(jnp.float32)),
        np.asarray(quantize_kv(k[0], scales[0], dtype).astype(jnp.float32)))


def test_fp8_cache_kernel_lowers_for_cuda():
    """The Pallas kernel with an fp8 cache (bf16 queries) lowers to Triton for an H100."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    S = jax.ShapeDtypeStruct
    f8 = jnp.dtype(jnp.float8_e4m3fn)
    args = (S((64, 32, 128), jnp.bfloat16), S((64, 16, 8, 128), f8), S((64, 16, 8, 128), f8),
            S((64,), jnp.int32), S((64, 32), jnp.int32), S((65,), jnp.int32), S((1,), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1)).trace(
            *args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float_caches_on_cpu_take_the_kernel_write(dtype, monkeypatch):
    """float32 / bf16 caches on CPU are written by the C++ call too (one op a layer instead of
    XLA's four): the program holds it and no scatter, and the caches equal the scatter's
    (k, v given in float32: cast to the caches' type first)."""
    kc, vc, k, v, slots = _write_case(dtype)
    md = AttentionMetadata(slot_mapping=slots, block_tables=None, seq_lens=None,
                           query_start_loc=None, num_seqs=None, num_decodes=None)
    text = jax.jit(lambda *a: write_kv(*a, md)).lower(kc, vc, k, v).as_text()
    assert cpu_kernels.KV_WRITE_TARGET in text and "scatter" not in text
    got = write_kv(kc, vc, k, v, md)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    want = write_kv(kc, vc, k, v, md)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                      np.asarray(w.astype(jnp.float32)))

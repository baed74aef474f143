"""Attention sinks (gpt-oss: one learned logit per query head in the softmax denominator, with
no value) in every attention backend: the jnp reference against a float64 numpy transcription
of HF's eager formula, then the xla, C++ (`cpu`) and Pallas (interpret mode) kernels against
the reference, through prefill tiles, decode rows, sliding windows and split-KV merges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers import cpu_kernels
from jaxinfer.layers.ragged_attention import ragged_paged_attention_xla
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.pallas_kernels.test_ragged_paged_attention import make_case

SCALE = 0.125
# Decode rows first (the xla backend batches them; the C++ kernel's all-heads items need 8+
# tiles), then prefill chunks with and without context.
Q_LENS = [1] * 9 + [20, 3, 70]
CTX = [0, 5, 16, 40, 130, 7, 64, 1, 300, 0, 33, 90]


def sinks_for(hq: int, seed: int) -> jax.Array:
    """Logits around the scores' scale (some larger, some far below) so the sink matters."""
    rng = np.random.default_rng(seed)
    s = rng.normal(1.0, 2.0, hq).astype(np.float32)
    s[0] = -30.0  # ~no effect
    s[-1] = 8.0  # takes most of the mass
    return jnp.asarray(s)


def hf_formula(args, sinks, n_real, sliding_window=None):
    """float64 numpy, per sequence and head: softmax([q.k * scale ..., sink]) without the
    sink's column, times V (transformers' GptOss eager_attention_forward)."""
    q, k, v, lens, tables, qsl, num_seqs = (np.asarray(a, np.float64) if i < 3 else np.asarray(a)
                                            for i, a in enumerate(args))
    hq, hkv = q.shape[1], k.shape[2]
    bs = k.shape[1]
    out = np.zeros((n_real, hq, q.shape[2]))
    for s in range(int(num_seqs[0])):
        start, end, kv_len = qsl[s], qsl[s + 1], lens[s]
        pos = np.arange(kv_len)
        keys = k[tables[s][pos // bs], pos % bs]  # [L, Hkv, D]
        vals = v[tables[s][pos // bs], pos % bs]
        for t in range(start, end):
            qp = kv_len - (end - start) + (t - start)
            vis = pos <= qp
            if sliding_window is not None:
                vis &= pos > qp - sliding_window
            for h in range(hq):
                kh = h // (hq // hkv)
                logits = keys[vis, kh] @ q[t, h] * SCALE
                z = np.concatenate([logits, [float(sinks[h])]])
                p = np.exp(z - z.max())
                p = p[:-1] / p.sum()
                out[t, h] = p @ vals[vis, kh]
    return out


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(11)
    args, n = make_case(rng, Q_LENS, CTX, hq=8, hkv=2, d=64, bs=16, dtype=jnp.float32)
    return args, n, sinks_for(8, 1)


@pytest.mark.parametrize("window", [None, 24])
def test_reference_is_hf_formula(case, window):
    args, n, sinks = case
    ref = ragged_paged_attention_reference(*args, sm_scale=SCALE, sliding_window=window,
                                           sinks=sinks)
    np.testing.assert_allclose(np.asarray(ref)[:n], hf_formula(args, sinks, n, window),
                               atol=2e-5, rtol=2e-5)
    # The sinks change the answer (the test above would pass with a no-op otherwise).
    plain = ragged_paged_attention_reference(*args, sm_scale=SCALE, sliding_window=window)
    assert np.abs(np.asarray(plain)[:n] - np.asarray(ref)[:n]).max() > 1e-2


def _reference(args, sinks, window):
    return np.asarray(ragged_paged_attention_reference(
        *args, sm_scale=SCALE, sliding_window=window, sinks=sinks))


@pytest.mark.parametrize("window", [None, 1, 24])
def test_xla_backend(case, window):
    args, n, sinks = case
    fn = jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=SCALE, sliding_window=window,
                                                       kv_chunk=32, q_tile=16, sinks=sinks))
    out = fn(*args, jnp.array([9], jnp.int32))
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, sinks, window)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernel could not be built here")
@pytest.mark.parametrize("window", [None, 1, 24])
@pytest.mark.parametrize("bs", [16, 128])
def test_cpu_backend(window, bs):
    rng = np.random.default_rng(bs)
    args, n = make_case(rng, Q_LENS, CTX, hq=8, hkv=2, d=64, bs=bs, dtype=jnp.float32)
    sinks = sinks_for(8, 2)
    out = jax.jit(lambda *a: cpu_kernels.ragged_paged_attention_cpu(
        *a, sm_scale=SCALE, sliding_window=window, sinks=sinks))(*args)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, sinks, window)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernel could not be built here")
def test_cpu_backend_per_head_items():
    """Fewer than 8 tiles, and too many of them to split a row's keys: decode rows take the
    per-head items, not the all-heads ones."""
    rng = np.random.default_rng(5)
    args, n = make_case(rng, [1, 1, 5, 40], [30, 200, 3, 17], hq=6, hkv=3, d=64, bs=16,
                        dtype=jnp.float32)
    sinks = sinks_for(6, 3)
    out = jax.jit(lambda *a: cpu_kernels.ragged_paged_attention_cpu(
        *a, sm_scale=SCALE, sinks=sinks))(*args)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, sinks, None)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernel could not be built here")
@pytest.mark.parametrize("window", [None, 1, 24])
def test_cpu_backend_split_keys(window):
    """One or two decode sequences: their keys split over items; the sinks join the
    denominator once, when the parts are combined."""
    rng = np.random.default_rng(21)
    args, n = make_case(rng, [1, 2], [300, 140], hq=6, hkv=3, d=64, bs=16, dtype=jnp.float32)
    sinks = sinks_for(6, 5)
    out = jax.jit(lambda *a: cpu_kernels.ragged_paged_attention_cpu(
        *a, sm_scale=SCALE, sliding_window=window, sinks=sinks))(*args)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, sinks, window)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 24])
def test_pallas_kernel_interpret(num_splits, window):
    """Single split: the sinks join the denominator in the kernel; several: in the merge."""
    rng = np.random.default_rng(7 + num_splits)
    args, n = make_case(rng, [1, 1, 17, 2], [40, 5, 32, 60], hq=6, hkv=2, d=64, bs=16,
                        dtype=jnp.float32)
    sinks = sinks_for(6, 4)
    out = ragged_paged_attention(*args, sinks, sm_scale=SCALE, sliding_window=window,
                                 interpret=True, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, sinks, window)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [None, 4])
def test_pallas_kernel_with_sinks_lowers_for_cuda(splits):
    """gpt-oss's attention shape (64 query heads, 8 KV heads, head dim 64) with sinks lowers
    to a Triton custom call for an H100 (no GPU here)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    args = (S((64, 64, 64), bf16), S((64, 16, 8, 64), bf16), S((64, 16, 8, 64), bf16),
            S((64,), jnp.int32), S((64, 32), jnp.int32), S((65,), jnp.int32),
            S((1,), jnp.int32), S((64,), jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_paged_attention(
            *a, sm_scale=0.125, num_splits=splits)).trace(*args).lower(
                lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()

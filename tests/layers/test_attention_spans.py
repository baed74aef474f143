"""Bidirectional spans (Gemma 3: the tokens of an image see the whole image, HF's
`token_type_ids` block mask OR'ed with the causal one, the sliding window AND'ed after) in every
attention backend: the jnp reference against a float64 numpy transcription of HF's mask, then
the xla and Pallas (interpret mode) kernels against the reference, through prefill tiles,
decode rows, sliding windows shorter than an image and split-KV merges; the `cpu` backend
hands a step with spans to the xla path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.attention import AttentionMetadata, attention
from jaxinfer.layers.ragged_attention import ragged_paged_attention_xla
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.pallas_kernels.test_ragged_paged_attention import make_case

SCALE = 0.125
Q_LENS = [1] * 3 + [20, 3, 70]
CTX = [0, 40, 130, 0, 33, 90]
# images as (sequence, first position, length): inside each one's chunk (the scheduler never
# splits an image); one longer than the 24-token window, one that is a whole chunk
IMAGES = [(3, 3, 10), (3, 14, 4), (4, 33, 3), (5, 100, 40)]


def spans_for(q_lens, ctx, images, t):
    spans = np.full((t, 2), -1, np.int32)
    start = np.concatenate([[0], np.cumsum(q_lens)])
    for s, first, n in images:
        at = start[s] + first - ctx[s]
        spans[at:at + n] = (first, first + n - 1)
    return jnp.asarray(spans)


def hf_formula(args, spans, n_real, window):
    """float64 numpy: HF Gemma 3's masks — full layers OR(causal, same image), sliding layers
    AND(window, OR(causal, same image)) — then softmax(q.k * scale) V per head."""
    q, k, v = (np.asarray(a, np.float64) for a in args[:3])
    lens, tables, qsl, num_seqs = (np.asarray(a) for a in args[3:])
    spans = np.asarray(spans)
    hq, hkv, bs = q.shape[1], k.shape[2], k.shape[1]
    out = np.zeros((n_real, hq, q.shape[2]))
    for s in range(int(num_seqs[0])):
        start, end, kv_len = qsl[s], qsl[s + 1], lens[s]
        pos = np.arange(kv_len)
        keys, vals = k[tables[s][pos // bs], pos % bs], v[tables[s][pos // bs], pos % bs]
        for t in range(start, end):
            qp = kv_len - (end - start) + (t - start)
            lo, hi = spans[t]
            vis = (pos <= qp) | ((pos >= lo) & (pos <= hi))
            if window is not None:
                vis &= qp - pos < window
            for h in range(hq):
                kh = h // (hq // hkv)
                z = keys[vis, kh] @ q[t, h] * SCALE
                p = np.exp(z - z.max())
                out[t, h] = (p / p.sum()) @ vals[vis, kh]
    return out


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(3)
    args, n = make_case(rng, Q_LENS, CTX, hq=8, hkv=2, d=64, bs=16, dtype=jnp.float32)
    return args, n, spans_for(Q_LENS, CTX, IMAGES, args[0].shape[0])


def _reference(args, spans, window):
    return np.asarray(ragged_paged_attention_reference(*args, sm_scale=SCALE,
                                                       sliding_window=window, spans=spans))


@pytest.mark.parametrize("window", [None, 24])
def test_reference_is_hf_mask(case, window):
    args, n, spans = case
    ref = _reference(args, spans, window)
    np.testing.assert_allclose(ref[:n], hf_formula(args, spans, n, window), atol=2e-5,
                               rtol=2e-5)
    # the spans change the image tokens' rows, and only theirs
    plain = np.asarray(ragged_paged_attention_reference(*args, sm_scale=SCALE,
                                                        sliding_window=window))
    in_image = np.asarray(spans)[:n, 1] >= 0
    changed = np.abs(plain[:n] - ref[:n]).max(axis=(1, 2)) > 1e-3
    last = np.zeros(n, bool)  # an image's last token sees nothing more than causally
    for s, first, length in IMAGES:
        at = int(np.sum(Q_LENS[:s])) + first + length - 1 - CTX[s]
        last[at] = True
    np.testing.assert_array_equal(changed, in_image & ~last)


@pytest.mark.parametrize("window", [None, 24])
def test_xla_backend(case, window):
    args, n, spans = case
    fn = jax.jit(lambda *a: ragged_paged_attention_xla(
        *a, sm_scale=SCALE, sliding_window=window, kv_chunk=32, q_tile=16, spans=spans))
    out = fn(*args, jnp.array([3], jnp.int32))
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, spans, window)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_dispatch_takes_spans(case, backend):
    """attention(): the spans ride in the metadata; `cpu` runs such a step on the xla path."""
    args, n, spans = case
    q, k, v, lens, tables, qsl, num_seqs = args
    md = AttentionMetadata(slot_mapping=jnp.zeros(q.shape[0], jnp.int32), block_tables=tables,
                           seq_lens=lens, query_start_loc=qsl, num_seqs=num_seqs,
                           num_decodes=jnp.array([3], jnp.int32), attn_spans=spans)
    out = jax.jit(lambda q, md: attention(q, k, v, md, sm_scale=SCALE, backend=backend))(q, md)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, spans, None)[:n],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 24])
def test_pallas_kernel_interpret(case, num_splits, window):
    args, n, spans = case
    out = ragged_paged_attention(*args, None, spans, sm_scale=SCALE, sliding_window=window,
                                 interpret=True, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(out)[:n], _reference(args, spans, window)[:n],
                               atol=2e-5, rtol=2e-5)


def test_pallas_kernel_with_spans_lowers_for_cuda():
    """Gemma 3 4B's attention shape (8 query heads, 4 KV heads, head dim 256) with spans
    lowers to a Triton custom call for an H100 (no GPU here)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    args = (S((512, 8, 256), bf16), S((64, 16, 4, 256), bf16), S((64, 16, 4, 256), bf16),
            S((8,), jnp.int32), S((8, 32), jnp.int32), S((9,), jnp.int32),
            S((1,), jnp.int32), None, S((512, 2), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_paged_attention(
            *a, sm_scale=0.0625, sliding_window=1024)).trace(*args).lower(
                lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()

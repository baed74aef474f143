"""The LoRA delta (layers/lora.py) against a per-token numpy reference, for every layout of
parts, and its lowering for CUDA (the GPU path: plain dots, no CPU-only kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.lora import lora_delta

S, R, IN = 3, 4, 16


def _reference(x, a, b, slots, parts):
    """Per token: its slot's x A, each part's R columns expanded into that part's outputs."""
    out = np.zeros((x.shape[0], *((b.shape[0], *b.shape[3:]) if parts == "stack"
                                  else b.shape[2:])))
    for t, s in enumerate(slots):
        if not 0 <= s < S:
            continue
        h = x[t] @ a[:, s]  # [P*R]
        if parts is None:
            out[t] = np.tensordot(h, b[s], axes=1)
        elif parts == "stack":
            for p in range(b.shape[0]):
                out[t, p] = h[p * R:(p + 1) * R] @ b[p, s]
        else:
            start = 0
            for p, w in enumerate(parts):
                out[t, ..., start:start + w] = np.tensordot(
                    h[p * R:(p + 1) * R], b[s, ..., start:start + w], axes=1)
                start += w
    return out


@pytest.mark.parametrize("parts,out_shape", [(None, (8,)), ("stack", (2, 8)),
                                             ((4, 2, 2), (2, 8))])
def test_delta_equals_the_per_token_reference(parts, out_shape):
    rng = np.random.default_rng(0)
    n_parts = 1 if parts is None else 2 if parts == "stack" else 3
    x = rng.normal(size=(7, IN))
    a = rng.normal(size=(IN, S, n_parts * R))
    b = rng.normal(size=(out_shape[0], S, R, *out_shape[1:]) if parts == "stack"
                   else (S, R, *out_shape))
    slots = np.array([0, 2, -1, 1, 1, 0, 3], np.int32)  # (-1 and S: no adapter)
    got = lora_delta(jnp.asarray(x, jnp.float32), jnp.asarray(a, jnp.float32),
                     jnp.asarray(b, jnp.float32), jnp.asarray(slots), parts)
    np.testing.assert_allclose(np.asarray(got), _reference(x, a, b, slots, parts),
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[[2, 6]].any()


def test_delta_lowers_for_cuda():
    Sd = jax.ShapeDtypeStruct
    args = (Sd((32, 64), jnp.bfloat16), Sd((64, 4, 3 * 16), jnp.bfloat16),
            Sd((4, 16, 2, 96), jnp.bfloat16), Sd((32,), jnp.int32))
    lowered = jax.jit(lambda *a: lora_delta(*a, (64, 16, 16))).trace(*args).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "dot_general" in text and "custom_call" not in text

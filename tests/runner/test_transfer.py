"""A step's inputs cross to the device in one transfer (runner/transfer.py) and arrive bit for
bit as the per-array path would put them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.runner.step_inputs import empty_step_batch
from jaxinfer.runner.transfer import PackedBatch, device_batch, pack_step, step_input


def _filled(t=5, r=3):
    """A StepBatch with every optional part, each leaf random (odd sizes: bool leaves of 5
    bytes end mid-word; float bit patterns NaN / -0.0 / inf; uint32 above 2**31)."""
    class _LP:
        row_shape, row_dtype = (2,), np.float32

    b = empty_step_batch(t, r, max_blocks=7, num_slots=4, prompt_logprobs=True,
                         bitmask_width=3, num_spec=2, verify=True, bias=16,
                         logits_processors=(_LP(),), lora=True)
    rng = np.random.default_rng(0)
    for leaf in jax.tree.leaves(b):
        if leaf.dtype == np.bool_:
            leaf[...] = rng.random(leaf.shape) < 0.5
        elif leaf.dtype == np.float32:
            leaf[...] = rng.standard_normal(leaf.shape)
            leaf.reshape(-1)[:3] = [np.nan, -0.0, np.inf][: leaf.size]
        else:
            leaf[...] = rng.integers(np.iinfo(leaf.dtype).min, np.iinfo(leaf.dtype).max,
                                     leaf.shape, dtype=leaf.dtype)
    return b


def put_packed(tree):
    """The layer-wise path: packed on the host, split on the device."""
    return device_batch(pack_step(tree))


def test_put_packed_equals_per_array_put():
    b = _filled()
    packed, plain = put_packed(b), jax.device_put(b)
    assert jax.tree.structure(packed) == jax.tree.structure(plain)
    leaves = jax.tree.leaves(packed)
    assert len(leaves) > 30 and {x.dtype for x in leaves} >= {np.dtype(np.bool_),
                                                               np.dtype(np.float32),
                                                               np.dtype(np.uint32),
                                                               np.dtype(np.int32)}
    for got, want, host in zip(leaves, jax.tree.leaves(plain), jax.tree.leaves(b)):
        assert got.shape == want.shape == host.shape and got.dtype == want.dtype
        assert np.asarray(got).tobytes() == host.tobytes()
        assert got.sharding == want.sharding
    # The host buffers are reused step after step: what was put stays as it was put.
    before = np.asarray(leaves[0]).copy()
    jax.tree.leaves(b)[0][...] += 1
    assert np.array_equal(np.asarray(leaves[0]), before)
    # A second layout (another bucket) and the first again.
    small = empty_step_batch(1, 1, max_blocks=7, num_slots=4)
    assert [np.asarray(x).tobytes() for x in jax.tree.leaves(put_packed(small))] == \
        [x.tobytes() for x in jax.tree.leaves(small)]
    again = put_packed(b)
    assert all(np.asarray(x).tobytes() == h.tobytes()
               for x, h in zip(jax.tree.leaves(again), jax.tree.leaves(b)))


def test_put_packed_other_dtypes_take_the_plain_path():
    tree = {"a": np.arange(3, dtype=np.int64), "b": np.ones(2, np.float16)}
    got = put_packed(tree)
    assert np.array_equal(np.asarray(got["a"]), [0, 1, 2])
    assert np.asarray(got["b"]).dtype == np.float16


def test_packed_batch_unpacks_inside_a_program_bit_for_bit():
    """A whole step takes the packed host buffer and unpacks it inside (PackedBatch): every
    leaf arrives as the per-array put gives it; the layer-wise path's device() too."""
    import jax.numpy as jnp

    b = _filled()
    packed = pack_step(b)
    assert isinstance(packed, PackedBatch) and packed.arena.dtype == np.int32
    fn = jax.jit(lambda arena: packed.unpacked(arena))
    inside = fn.lower(packed.spec()).compile()(step_input(packed, packed))
    plain = jax.device_put(b)
    assert jax.tree.structure(inside) == jax.tree.structure(plain)
    for got, split, host in zip(jax.tree.leaves(inside), jax.tree.leaves(packed.device()),
                                jax.tree.leaves(b)):
        assert got.dtype == host.dtype and got.shape == host.shape
        assert np.asarray(got).tobytes() == host.tobytes() == np.asarray(split).tobytes()
    # The host buffers are reused step after step: a packed batch keeps what it was given.
    arena = packed.arena.copy()
    jax.tree.leaves(b)[0][...] += 1
    assert np.array_equal(packed.arena, arena)
    # A batch of another layout (another bucket) is refused by a program lowered for this one.
    other = pack_step(empty_step_batch(1, 1, max_blocks=7, num_slots=4))
    with pytest.raises(ValueError, match="layout"):
        step_input(other, packed)
    assert step_input(pack_step(b), packed).shape == packed.arena.shape
    # Leaves of other item sizes: device arrays put the plain way (no packed buffer).
    plain_tree = pack_step({"a": np.arange(3, dtype=np.int64)})
    assert isinstance(plain_tree["a"], jax.Array) and step_input(plain_tree, None) is plain_tree
    assert jnp.array_equal(plain_tree["a"], jnp.arange(3))

"""A step's host inputs to the device in one transfer.

A StepBatch is ~23 small numpy arrays. Putting them on the device one by one costs JAX's
per-array transfer path each (1.1-2 ms per step on a 2-core CPU VM, as much as the rest of
the host's step work together), so `pack_step` copies every leaf into one int32 buffer (each
leaf at a 4-byte-aligned offset, its bytes as they are): a PackedBatch, the buffer with its
layout. A whole-step program takes that buffer as its one input and unpacks it inside
(`unpacked`: slices and bitcasts, fused into their consumers), so a step needs no program of
its own to split it and no ~23 device arrays made and passed on (~0.2 ms of a step on a
2-core VM, where a batch-1 decode step takes ~8 ms). Programs that run a step as several
(layer-wise ones before they are fused) take `device()`: a small jitted program splits the
buffer into the StepBatch's leaves on the device (compiled once per layout, ~25 ms, cached by
JAX's jit). Leaves of another item size than 4 or 1 bytes (none today) and multi-process
meshes take the plain path (device arrays).
"""

from __future__ import annotations

import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32))
_BYTE_DTYPES = (np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.int8))

# (treedef, shapes and dtypes) -> the layout: ((offset in words, words, shape, dtype), ...)
_layouts: dict = {}
_layouts_lock = threading.Lock()


def _layout(leaves, treedef):
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
    got = _layouts.get(key)
    if got is not None:
        return got
    if not all(x.dtype in _WORD_DTYPES or x.dtype in _BYTE_DTYPES for x in leaves):
        got = None
    else:
        spans, off = [], 0
        for x in leaves:
            words = -(-x.nbytes // 4)
            spans.append((off, words, tuple(x.shape), np.dtype(x.dtype)))
            off += words
        got = (tuple(spans), max(off, 1))
    with _layouts_lock:
        _layouts[key] = got
    return got


def pack(leaves, spans, total: int) -> np.ndarray:
    """The leaves' bytes in one new int32 buffer (new each time: a transfer may alias it)."""
    arena = np.zeros(total, np.int32)
    raw = arena.view(np.uint8)
    for (off, _, _, _), x in zip(spans, leaves):
        raw[off * 4 : off * 4 + x.nbytes] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return arena


def unpack(spans, treedef, arena):
    """Inverse of pack, traced: the leaves as slices of `arena` bitcast to their dtypes."""
    leaves = []
    for off, words, shape, dtype in spans:
        w = lax.slice(arena, (off,), (off + words,))
        n = int(np.prod(shape, dtype=np.int64))
        if dtype == np.int32:
            x = w[:n]
        elif dtype in _WORD_DTYPES:
            x = lax.bitcast_convert_type(w, jnp.dtype(dtype))[:n]
        else:
            b = lax.bitcast_convert_type(w, jnp.uint8).reshape(-1)[:n]
            x = b != 0 if dtype == np.bool_ else lax.bitcast_convert_type(b, jnp.dtype(dtype))
        leaves.append(x.reshape(shape))
    return jax.tree.unflatten(treedef, leaves)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _split(spans, treedef, sharding, arena):
    out = unpack(spans, treedef, arena)
    if sharding is not None:
        out = jax.tree.map(lambda x: lax.with_sharding_constraint(x, sharding), out)
    return out


class PackedBatch:
    """A host pytree's leaves in one int32 buffer (`arena`, numpy, new per step) with the
    layout to take them apart again, on the device."""

    __slots__ = ("arena", "spans", "treedef", "sharding")

    def __init__(self, arena: np.ndarray, spans, treedef, sharding):
        self.arena, self.spans, self.treedef, self.sharding = arena, spans, treedef, sharding

    def device(self):
        """The pytree of device arrays (the jitted split: a program of its own; the numpy
        buffer goes straight into it, its C++ dispatch transferring it, ~90 us a step less
        than jax.device_put's Python path on a 2-core VM)."""
        return _split(self.spans, self.treedef, self.sharding, self.arena)

    def spec(self) -> jax.ShapeDtypeStruct:
        """The buffer's shape, for lowering a program that takes it."""
        return jax.ShapeDtypeStruct(self.arena.shape, jnp.int32, sharding=self.sharding)

    def unpacked(self, arena):
        """Inside a traced program: the pytree from the buffer `arena` (this layout)."""
        out = unpack(self.spans, self.treedef, arena)
        if self.sharding is not None:
            out = jax.tree.map(lambda x: lax.with_sharding_constraint(x, self.sharding), out)
        return out


def pack_step(tree, sharding=None):
    """Host numpy pytree -> a PackedBatch, or (a leaf of another item size, or none) the
    pytree of device arrays put the plain way."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = _layout(leaves, treedef)
    if layout is None or not leaves:
        return jax.device_put(tree, sharding)
    spans, total = layout
    return PackedBatch(pack(leaves, spans, total), spans, treedef, sharding)


def step_input(batch, packed: PackedBatch | None):
    """What a compiled whole step takes for a placed batch: the host buffer of a PackedBatch
    of the layout the program was lowered with (`packed`; it unpacks the buffer), else (None)
    the batch itself."""
    if packed is None:
        return batch
    if not isinstance(batch, PackedBatch) or (batch.spans is not packed.spans
                                              and batch.spans != packed.spans):
        raise ValueError("the step's packed inputs are not in the layout its program was "
                         "lowered for")
    return batch.arena


def device_batch(batch):
    """A placed step batch as device arrays (a PackedBatch split on the device)."""
    return batch.device() if isinstance(batch, PackedBatch) else batch

"""Layers shared by every model: norms, rotary embeddings, attention, linear, sampler."""

from flax import nnx


def module_list(items):
    """A list of submodules nnx tracks (nnx.List where this flax has it)."""
    return nnx.List(items) if hasattr(nnx, "List") else list(items)

"""What a compiled step carries from one step to the next, named.

A step program (step_program.py) is called as `executable(state, batch) -> (outputs, state)`.
The StepState holds:
- `params`: the model's weights, in the layout of the program that runs them (whole steps: the
  model's nnx.State; layer-wise: the shell's state and each layer's leaves; pipeline: one per
  stage). Read, never donated.
- `kv`: the paged KV caches, [(k, v)] per layer (pipeline: one such list per stage). Donated.
- `sampler`: SamplerState, per request slot. Donated.
- `draft_params`, `draft_kv`: speculative decoding's draft model or EAGLE head (its weights,
  read; its own paged KV cache over the same block ids, donated); None without one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """The sampler's memory per request slot, on the device."""

    counts: Any  # int32 [S, V]: each vocabulary token's count among the slot's output tokens
    prompt_mask: Any  # bool [S, V]: the token occurs in the slot's prompt (repetition penalty)
    # int32 [S]: the token the slot sampled last; the next step reads it on the device when
    # the host does not have it yet (async scheduling)
    last_sampled: Any

    @staticmethod
    def zeros(num_slots: int, vocab_size: int, device=None) -> "SamplerState":
        return SamplerState(jnp.zeros((num_slots, vocab_size), jnp.int32, device=device),
                            jnp.zeros((num_slots, vocab_size), bool, device=device),
                            jnp.zeros((num_slots,), jnp.int32, device=device))

    @staticmethod
    def shapes(num_slots: int, vocab_size: int) -> "SamplerState":
        """Shapes only (a pipeline's last stage on another process holds the real one)."""
        S = jax.ShapeDtypeStruct
        return SamplerState(S((num_slots, vocab_size), jnp.int32),
                            S((num_slots, vocab_size), bool), S((num_slots,), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepState:
    """Weights, KV caches and sampler state of one engine's steps (see the module docstring)."""

    params: Any
    kv: Any
    sampler: SamplerState
    draft_params: Any = None
    draft_kv: Any = None

    @property
    def weights(self) -> tuple:
        """What a step reads: (params, draft_params)."""
        return self.params, self.draft_params

    @property
    def carry(self) -> tuple:
        """What a step donates and returns updated: (kv, draft_kv, sampler)."""
        return self.kv, self.draft_kv, self.sampler

    def with_carry(self, carry: tuple) -> "StepState":
        kv, draft_kv, sampler = carry
        return dataclasses.replace(self, kv=kv, draft_kv=draft_kv, sampler=sampler)


def abstract(tree):
    """Arrays -> ShapeDtypeStructs of the same shape, dtype and sharding (what lowering needs;
    a donated array keeps them)."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(one, tree)


def place_replicated(mesh, tree):
    """Host numpy pytree -> what a step program takes: in one process, its leaves packed into
    one host buffer that the program's call transfers (transfer.PackedBatch: on the default
    device, or replicated over `mesh`); on several processes, device arrays replicated over
    `mesh` (every process contributes its identical copy)."""
    from jaxinfer.runner.transfer import pack_step

    if mesh is None:
        return pack_step(tree)
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return pack_step(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def single_stage_state(params, model_config, mesh, drafter, num_blocks: int, block_size: int,
                       kv_dtype, num_slots: int, window_blocks: int = 0) -> StepState:
    """The StepState of a model on one mesh (whole and layer-wise programs): `params` in the
    program's layout, zeroed KV caches (and the drafter's) and sampler state."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxinfer.runner.kv_cache import allocate_kv_caches

    replicated = None if mesh is None else NamedSharding(mesh, P())
    return StepState(
        params=params,
        kv=allocate_kv_caches(model_config, num_blocks, block_size, kv_dtype, mesh,
                              window_blocks=window_blocks),
        sampler=SamplerState.zeros(num_slots, model_config.vocab_size, replicated),
        draft_params=drafter.params if drafter is not None else None,
        draft_kv=drafter.allocate_kv(num_blocks, block_size, kv_dtype, mesh)
        if drafter is not None else None)

"""Whole steps: one XLA program per bucket and variant, every decoder layer unrolled in it,
then the tail (step_fn.step_tail). One launch per step: what GPUs want (as CUDA graphs would
give), at a compile cost that grows with depth (layerwise.py trades it away)."""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from jaxinfer.runner.spec_step import InStepDrafter
from jaxinfer.runner.step_fn import merge_mm_embeds, step_input_ids, step_tail
from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.runner.step_state import StepState, place_replicated, single_stage_state
from jaxinfer.runner.transfer import PackedBatch, step_input


def whole_step(graphdef, drafter: InStepDrafter | None, weights, carry, batch: StepBatch, *,
               features: StepFeatures, max_model_len: int):
    """One step: the forward over every layer, then the tail. weights = (params,
    draft_params); carry = (kv, draft_kv, sampler), donated. Returns (outputs, carry)."""
    params, draft_params = weights
    kv, draft_kv, sampler = carry
    model = nnx.merge(graphdef, params)
    draft = drafter.merge(draft_params) if drafter is not None else None
    input_ids = step_input_ids(sampler.last_sampled, batch.input_ids, batch.from_last_sampled,
                               batch.token_slots)
    target_hidden = None
    positions = batch.rotary_positions
    embeds = None
    if batch.mm_inputs is not None:  # (images: their encoder rows replace the embeddings)
        embeds = merge_mm_embeds(model.model.embed_tokens(input_ids), batch.mm_inputs)
    if drafter is not None and drafter.aux_layers:
        hidden, kv, target_hidden = model(input_ids, positions, kv, batch.attn,
                                          aux_layers=drafter.aux_layers, embeds=embeds)
    else:
        hidden, kv = model(input_ids, positions, kv, batch.attn, embeds=embeds)
    out, draft_kv, sampler = step_tail(
        model, hidden, input_ids, sampler, batch, features=features,
        target_hidden=target_hidden, draft=draft,
        draft_kind=drafter.kind if drafter is not None else "", draft_kv=draft_kv,
        max_model_len=max_model_len)
    return out, (kv, draft_kv, sampler)


def _whole_step_flat(graphdef, drafter, weights_def, packed, weight_leaves, carry, batch, **kw):
    """whole_step with its weights as flat leaves (see FlatWeights) and, `packed` a
    PackedBatch of the bucket's layout, the batch as its packed buffer."""
    weights = jax.tree.unflatten(weights_def, weight_leaves)
    if packed is not None:
        batch = packed.unpacked(batch)
    return whole_step(graphdef, drafter, weights, carry, batch, **kw)


class FlatWeights:
    """A state's weights as the flat list of arrays the compiled step takes, flattened again
    only when the state holds other weight trees. Flattening the model's nnx.State is Python
    work per leaf: ~150 us a step for SmolLM2's 182 leaves on a 2-core VM, ~2% of a batch-1
    decode step; a list of arrays passes through JAX's C++ dispatch. Every change of weights
    (updates, LoRA slot writes, sleep and wake-up) puts new trees into the state, never edits
    the held ones, so the trees' identity is the key."""

    def __init__(self):
        self._trees = (None, None)
        self._leaves = None

    def __call__(self, state: StepState) -> list:
        params, draft = self._trees
        if state.params is not params or state.draft_params is not draft or params is None:
            self._leaves = jax.tree.leaves(state.weights)
            self._trees = (state.params, state.draft_params)
        return self._leaves


class WholeStepProgram:
    kind = "whole"

    def __init__(self, model, *, max_model_len: int = 0, draft_model=None, eagle_head=None):
        self.model_config = model.config
        self.mesh = model.mesh
        self.graphdef, self.params = nnx.split(model)
        self.drafter = InStepDrafter.of(draft_model, eagle_head)
        self.max_model_len = max_model_len
        self.flat_weights = FlatWeights()

    def init_state(self, num_blocks: int, block_size: int, kv_dtype,
                   num_slots: int, window_blocks: int = 0) -> StepState:
        return single_stage_state(self.params, self.model_config, self.mesh, self.drafter,
                                  num_blocks, block_size, kv_dtype, num_slots, window_blocks)

    def set_params(self, params) -> None:
        """The weights after an update or wake-up (runner/weights.py)."""
        self.params = params

    def place(self, batch: StepBatch):
        return place_replicated(self.mesh, batch)

    def lower(self, t: int, r: int, features: StepFeatures, state: StepState, example):
        leaves, weights_def = jax.tree.flatten(state.weights)
        packed = example if isinstance(example, PackedBatch) else None
        fn = jax.jit(partial(_whole_step_flat, self.graphdef, self.drafter, weights_def, packed,
                             features=features, max_model_len=self.max_model_len),
                     donate_argnums=(1,))
        example = packed.spec() if packed is not None else example
        return _Lowered(fn.lower(leaves, state.carry, example), self.flat_weights, packed)


class _Lowered:
    def __init__(self, lowered, flat_weights: FlatWeights, packed: PackedBatch | None):
        self.lowered, self.flat_weights, self.packed = lowered, flat_weights, packed

    def compile(self) -> "WholeStep":
        return WholeStep(self.lowered.compile(), self.flat_weights, self.packed)


class WholeStep:
    """A compiled whole step: (state, batch) -> (outputs, state)."""

    def __init__(self, compiled, flat_weights: FlatWeights, packed: PackedBatch | None):
        self.compiled = compiled
        self.flat_weights = flat_weights
        self.packed = packed  # (the layout of its packed batch, or None: device arrays)

    def __call__(self, state: StepState, batch):
        out, carry = self.compiled(self.flat_weights(state), state.carry,
                                   step_input(batch, self.packed))
        return out, state.with_carry(carry)

    def as_text(self) -> str:
        return self.compiled.as_text()

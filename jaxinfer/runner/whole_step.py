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


class WholeStepProgram:
    kind = "whole"

    def __init__(self, model, *, max_model_len: int = 0, draft_model=None, eagle_head=None):
        self.model_config = model.config
        self.mesh = model.mesh
        self.graphdef, self.params = nnx.split(model)
        self.drafter = InStepDrafter.of(draft_model, eagle_head)
        self.max_model_len = max_model_len

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
        fn = jax.jit(partial(whole_step, self.graphdef, self.drafter, features=features,
                             max_model_len=self.max_model_len), donate_argnums=(1,))
        return _Lowered(fn.lower(state.weights, state.carry, example))


class _Lowered:
    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self) -> "WholeStep":
        return WholeStep(self.lowered.compile())


class WholeStep:
    """A compiled whole step: (state, batch) -> (outputs, state)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, state: StepState, batch):
        out, carry = self.compiled(state.weights, state.carry, batch)
        return out, state.with_carry(carry)

    def as_text(self) -> str:
        return self.compiled.as_text()

"""StepProgram: how an engine's steps are compiled and run, behind one small interface.

Three implementations, each in its own module:
- whole_step.WholeStepProgram: a step is one XLA program, every decoder layer unrolled in it
  (GPUs' default: one launch per step, as CUDA graphs would give);
- layerwise.LayerwiseProgram: a head, runs of layers (one executable per kind of run, compiled
  once whatever the depth) and the tail (CPUs' default: start-up in seconds);
- pipeline_step.PipelineProgram: one program per pipeline stage, each whole or layer-wise, the
  residual stream moved between the stages' devices.

The ModelRunner only ever calls:
- `init_state(num_blocks, block_size, kv_dtype, num_slots, window_blocks) -> StepState`:
  allocate the KV caches (window_blocks > 0: the sliding layers' caches that many blocks)
  and sampler state beside the weights (step_state.py);
- `place(batch) -> device batch`: the one transfer in of a step's StepBatch;
- `lower(t, r, features, state, example) -> lowered`: lower the step of bucket (T, R) and
  variant `features` against `state` (shapes: the live arrays may be donated meanwhile) and a
  placed example batch; `lowered.compile()` gives the executable, called
  `executable(state, device_batch) -> (outputs, state)` (KV caches and sampler state donated).
"""

from __future__ import annotations

from typing import Any, Protocol

from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.runner.step_state import StepState


class StepProgram(Protocol):
    kind: str  # "whole" | "layerwise" (a pipeline's stages are all one or the other)
    mesh: Any  # the tensor-parallel mesh (None: one device; pipeline: the last stage's)
    model_config: Any

    def init_state(self, num_blocks: int, block_size: int, kv_dtype,
                   num_slots: int, window_blocks: int = 0) -> StepState: ...

    def place(self, batch: StepBatch) -> Any: ...

    def lower(self, t: int, r: int, features: StepFeatures, state: StepState,
              example: Any) -> Any: ...


def make_step_program(model, *, kind: str, layers_per_program: int,
                      max_model_len: int = 0, draft_model=None, eagle_head=None,
                      stage_devices=None) -> StepProgram:
    """The program for `model` (or, pipeline parallelism, its list of PipelineStages, stage s
    on stage_devices[s]); kind "whole" or "layerwise"."""
    if kind not in ("whole", "layerwise"):
        raise ValueError(f"step_compilation={kind!r} is not supported "
                         "(supported: whole, layerwise)")
    if isinstance(model, list):
        from jaxinfer.runner.pipeline_step import PipelineProgram

        return PipelineProgram(model, stage_devices, kind=kind,
                               layers_per_program=layers_per_program)
    if kind == "layerwise":
        from jaxinfer.runner.layerwise import LayerwiseProgram

        return LayerwiseProgram(model, group=layers_per_program, max_model_len=max_model_len,
                                draft_model=draft_model, eagle_head=eagle_head)
    from jaxinfer.runner.whole_step import WholeStepProgram

    return WholeStepProgram(model, max_model_len=max_model_len, draft_model=draft_model,
                            eagle_head=eagle_head)

"""Multi-host (jax.distributed) step replay: process 0 schedules and broadcasts each step's
inputs (a header, then the StepBatch); processes > 0 receive them and run the same compiled
step, so every process takes part in the step's collectives."""

from __future__ import annotations

import numpy as np

from jaxinfer.runner.step_inputs import PLAIN, StepBatch, StepFeatures

_HEADER = 11  # t, r, six feature flags, the logit_bias bucket, processors on, stop


def broadcast_step(batch: StepBatch | None, features: StepFeatures = PLAIN) -> None:
    """Process 0: send one step (None: tell the others to stop)."""
    from jax.experimental import multihost_utils

    if batch is None:
        header = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], np.int32)
    else:
        header = np.array([batch.input_ids.shape[0], batch.req_slots.shape[0],
                           features.logprobs, features.penalties, features.prompt_logprobs,
                           features.structured, features.spec, features.verify,
                           features.bias, bool(features.logits_processors), 0], np.int32)
    multihost_utils.broadcast_one_to_all(header)
    if batch is not None:
        multihost_utils.broadcast_one_to_all(batch)


def receive_step(new_buffers, logits_processors=()) -> tuple[StepBatch, StepFeatures] | None:
    """Processes > 0: the next step's inputs and variant (new_buffers(t, r, prompt_logprobs,
    structured, verify) makes the host buffers of its shape), or None when process 0 stops."""
    from jax.experimental import multihost_utils

    t, r, lp, pen, plp, st, sp, vf, bias, procs, stop = (
        int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32)))
    if stop:
        return None
    features = StepFeatures(bool(lp), bool(pen), bool(plp), bool(st), bool(sp), bool(vf), bias,
                            tuple(logits_processors) if procs else ())
    batch = multihost_utils.broadcast_one_to_all(new_buffers(t, r, bool(plp), bool(st),
                                                             bool(vf), bias, bool(procs)))
    return batch, features

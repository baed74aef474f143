"""Speculative decoding: proposers (drafts) on top of the runner's verify step.

The runner verifies drafts with rejection sampling (jaxinfer.layers.sampler.rejection_sample);
the scheduler schedules them as extra query tokens and rolls rejected ones back."""

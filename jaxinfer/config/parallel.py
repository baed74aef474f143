"""ParallelConfig: how an engine is spread over devices and processes, and the pipeline's
layer partition (pure arithmetic, so it lives with the config: the model code imports the
config, never the other way round)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size devices per pipeline stage, pipeline_parallel_size stages per
    engine core, data_parallel_size engine cores (ranks) behind one front end. (Expert
    parallelism: enable_expert_parallel, over the tensor-parallel devices; sequence
    parallelism: enable_sequence_parallelism, the same devices.)"""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_sequence_parallelism: bool = False
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # Layers per stage, e.g. "4,4,5,3" (vLLM's VLLM_PP_LAYER_PARTITION, also read from the
    # env var JAXINFER_PP_LAYER_PARTITION); None: even, the remainder on the middle stages.
    pp_layer_partition: str | None = None
    # DP: prompts that share their first blocks go to the rank that has them cached.
    data_parallel_prefix_affinity: bool = True

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def devices_per_rank(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def get_pp_partition(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """Layers per stage, as vLLM's get_pp_indices splits them (even, the remainder on the
    stages before the last, from the second-to-last backwards), or `override`."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's "
                         f"{num_layers} layers (every stage needs at least one)")
    override = override or os.environ.get("JAXINFER_PP_LAYER_PARTITION") or None
    if override is not None:
        try:
            parts = [int(x) for x in str(override).split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition={override!r}: expected comma-separated "
                             f"layer counts, e.g. '4,4,5,3'") from None
        if len(parts) != pp_size:
            raise ValueError(f"pp_layer_partition={override!r} has {len(parts)} stages, "
                             f"pipeline_parallel_size is {pp_size}")
        if sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"pp_layer_partition={override!r} must give every stage >= 1 "
                             f"layer and sum to the model's {num_layers} layers "
                             f"(sums to {sum(parts)})")
        return parts
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def stage_bounds(parts: list[int]) -> list[tuple[int, int]]:
    """[start, end) layer range of each stage."""
    bounds, start = [], 0
    for n in parts:
        bounds.append((start, start + n))
        start += n
    return bounds

"""Frozen, validated engine configuration, one module per concern.

Every config is a frozen dataclass checked in ``__post_init__``: a bad value raises ValueError
naming the field and the limit, and nothing mutates a config after construction. Validation
reads no files (a speculative_config model folder is only checked to exist); `resolve_config`
(engine.py) is where model folders are read.

    model.py     ModelConfig (an HF config.json's architecture facts), RopeScaling, dtypes
    parallel.py  ParallelConfig (TP, PP, DP sizes), the pipeline's layer partition
    features.py  StructuredOutputsConfig, SpeculativeConfig, KVTransferConfig
    engine.py    CacheConfig, SchedulerConfig, EngineConfig, ResolvedConfig, resolve_config
"""

from jaxinfer.config.engine import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, SCHEDULING_POLICIES,
                                    CacheConfig, EngineConfig, ResolvedConfig, SchedulerConfig,
                                    multiprocessing_enabled, resolve_config)
from jaxinfer.config.features import (KV_CONNECTORS, KV_ROLES, MAX_SPEC_LEN, SPECULATIVE_METHODS,
                                      STRUCTURED_OUTPUT_BACKENDS, KVTransferConfig,
                                      SpeculativeConfig, StructuredOutputsConfig)
from jaxinfer.config.model import ModelConfig, RopeScaling, replace, resolve_dtype
from jaxinfer.config.parallel import ParallelConfig, get_pp_partition, stage_bounds

__all__ = [
    "ATTENTION_BACKENDS", "KV_CACHE_DTYPES", "SCHEDULING_POLICIES", "CacheConfig",
    "EngineConfig", "ResolvedConfig", "SchedulerConfig", "multiprocessing_enabled",
    "resolve_config", "KV_CONNECTORS", "KV_ROLES", "MAX_SPEC_LEN", "SPECULATIVE_METHODS",
    "STRUCTURED_OUTPUT_BACKENDS", "KVTransferConfig", "SpeculativeConfig",
    "StructuredOutputsConfig", "ModelConfig", "RopeScaling", "replace", "resolve_dtype",
    "ParallelConfig", "get_pp_partition", "stage_bounds",
]

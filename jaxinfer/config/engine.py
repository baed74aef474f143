"""EngineConfig (the user-facing options), the cache and scheduler configs, and their resolution
against the model folder (ResolvedConfig: what the front end and the engine core are built
from)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from jaxinfer.config.features import (RUNNERS, KVTransferConfig, PoolerConfig,
                                      SpeculativeConfig, StructuredOutputsConfig)
from jaxinfer.config.model import ModelConfig, engine_dtype
from jaxinfer.config.parallel import ParallelConfig, get_pp_partition

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
WARMUP_BUCKETS = ("start", "all")
STEP_COMPILATIONS = ("auto", "whole", "layerwise")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
# kv_cache_dtype -> the cache's array dtype ("fp8" is e4m3, as in vLLM)
KV_CACHE_ARRAY_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                         "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry and prefix caching."""

    # tokens per KV block; None: 128 on CPU devices (vLLM's CPU backend default: long
    # contiguous pages keep decode attention streaming from memory), 16 on GPUs
    block_size: int | None = None
    num_blocks: int | None = None  # total blocks incl. the null block (None: sized by the runner)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # "sha256" (stable across processes) | "builtin"
    hash_seed: int = 0  # root of the chained block hashes

    def __post_init__(self):
        if self.block_size is not None and (self.block_size < 1
                                            or self.block_size & (self.block_size - 1)):
            raise ValueError(f"CacheConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"CacheConfig.num_blocks must be >= 2, got {self.num_blocks}")
        if self.prefix_caching_hash_algo not in ("sha256", "builtin"):
            raise ValueError("CacheConfig.prefix_caching_hash_algo must be 'sha256' or 'builtin', "
                             f"got {self.prefix_caching_hash_algo!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and policy of the scheduler."""

    max_model_len: int  # longest sequence (prompt + output) in tokens
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # running requests at most
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: a prefill chunk takes at most this many tokens
    policy: str = "fcfs"  # "fcfs" | "priority" (lower value first, then arrival)
    # Admit a waiting request only if its whole sequence fits in the free blocks (vLLM's
    # scheduler_reserve_full_isl, default on): fewer preemptions under chunked prefill.
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self):
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("SchedulerConfig.long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: without chunked prefill a long prompt could "
                "never be scheduled; raise max_num_batched_tokens or enable chunked prefill"
            )

def _sub_config(value, cls, name: str):
    """An EngineConfig option given as `cls`, a dict of its fields (unknown keys refused by
    name) or None."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a {cls.__name__} or a dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; known: {sorted(known)}")
    return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything LLMEngine is built from (the user-facing options of LLM(...))."""

    model: str | None = None  # HF folder; None = the embedded SmolLM2
    tokenizer: str | None = None  # tokenizer folder; None = the model folder
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids, no output text
    # "auto": as vLLM, the checkpoint's dtype, but a generating model's float32 checkpoint
    # runs in bfloat16 (engine_dtype)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: max(2048, max_num_seqs), chunked prefill
    block_size: int | None = None  # None: 128 on CPU devices, 16 on GPUs (CacheConfig)
    # "auto" (the model's dtype) | "bfloat16" | "float16" | "float32" | "fp8" (= "fp8_e4m3")
    # | "fp8_e5m2": fp8 caches hold k / scale and v / scale (per-tensor scales from the
    # checkpoint's k_scale / v_scale, else 1.0), a quarter of float32's bytes
    kv_cache_dtype: str = "auto"
    # Quantized linear weights: "fp8" / "int8" (quantize a float checkpoint at load, per output
    # channel) or the checkpoint's own quantization_config ("fp8", "compressed-tensors"), which
    # None follows; a value that contradicts the checkpoint is refused. "gguf": a .gguf model
    # file (or model=None: the embedded one) keeps its quantized projection blocks.
    quantization: str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    load_format: str = "auto"
    # None / "auto": "cpu" (the C++ kernel) on CPU devices where it builds, else "xla"
    # (pallas: not yet verified on GPU)
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    # Mixture-of-experts models: experts split over the tensor-parallel devices (E / tp
    # whole experts each) instead of each expert split over them (vLLM's name). No effect on
    # dense models or at tensor_parallel_size 1.
    enable_expert_parallel: bool = False
    # Sequence parallelism (Megatron-style) under tensor parallelism: the residual stream
    # split by tokens between the tensor-parallel regions. No effect at tensor_parallel_size 1.
    enable_sequence_parallelism: bool = False
    num_kv_blocks: int | None = None  # explicit KV cache size in blocks (incl. null block)
    # Models with sliding and full layers (Gemma 3, gpt-oss) keep the sliding layers' KV in a
    # pool of their own that frees blocks as the window moves (core/window_blocks.py); True:
    # one pool, every layer keeps every block (vLLM's flag of the same name).
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory_bytes: int | None = None  # or a byte budget for the KV cache
    gpu_memory_utilization: float = 0.9  # on GPU: fraction of device memory the engine may use
    compilation_cache_dir: str | None = None  # None: <cache>/xla; "" disables the cache
    warmup: bool = True  # compile the start-up buckets before serving (see warmup_buckets)
    # "start": a few small buckets before serving, every other one in the background after
    # (a step whose bucket is not ready pads up to a ready one, or compiles it); "all": every
    # bucket before serving, the decode buckets fused into whole programs too when layer-wise
    # (multi-host engines always compile every bucket: peers compile in step).
    warmup_buckets: str = "start"
    # "whole": a step is one program, every decoder layer unrolled in it; "layerwise": one
    # layer compiled once and run L times (compile time independent of depth; a dispatch per
    # layer); "auto": layerwise on CPU, whole on GPU (docs/startup.md).
    step_compilation: str = "auto"
    # layerwise: decoder layers per compiled program (runs of this many share an executable):
    # 1 compiles least, more dispatch fewer programs per step (docs/startup.md; 5 measured
    # 3% faster steady state than 3 at the same cold start: results/layers_per_program_cpu.json).
    layers_per_program: int = 5
    # Smallest token bucket: 1, so a decode step of R sequences computes R rows, not 16 (a
    # batch-1 decode step on this CPU: 54 -> 29 ms; vLLM's CUDA-graph sizes also start at 1).
    min_token_bucket: int = 1
    bucket_growth: int = 2
    # Engine core in a child process behind a ZeroMQ client (vLLM's V1 layout). None: the env
    # var JAXINFER_ENABLE_MULTIPROCESSING (default "1"); False: the core runs in this process.
    enable_multiprocessing: bool | None = None
    # Overlap the host's scheduling with the device's step: step N+1 is dispatched before step
    # N's sampled ids are read back (they are patched into N+1's inputs on the device).
    # None (vLLM's default): on, unless the engine has something it cannot be combined with
    # (speculative decoding, pipeline parallelism) or pools. On CPUs too, where vLLM's CPU
    # build turns it off: with the step's inputs packed into one buffer, overlapping the
    # host's ~1.4 ms of work per step (cold caches after the weights stream through) made
    # batch-1 decode 5-6% faster and 32 x 128 decode 0.88x the time per token on a 2-core
    # Zen 5 VM (paired runs, docs/benchmarks.md). True is refused by name with those
    # combinations.
    async_scheduling: bool | None = None
    # Structured outputs (JSON schema, regex, choice, grammar): a StructuredOutputsConfig or a
    # dict of its fields, e.g. {"backend": "xgrammar"}.
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    # Speculative decoding: a SpeculativeConfig or a dict of its fields, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4}. None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # A KV connector: a KVTransferConfig or a dict of its fields, e.g. {"kv_connector":
    # "JaxTransferConnector", "kv_role": "kv_producer"}. None: off.
    kv_transfer_config: KVTransferConfig | dict | None = None
    # Data parallelism: this many engine-core processes (each with tensor_parallel_size
    # devices of its own), one load-balancing front end; prefix affinity sends prompts that
    # share their first blocks to the same rank.
    data_parallel_size: int = 1
    data_parallel_prefix_affinity: bool = True
    # Pipeline parallelism: the decoder layers split over this many stages (each stage on
    # its own tensor_parallel_size devices), up to this many step batches in flight.
    pipeline_parallel_size: int = 1
    # Layers per stage, e.g. "4,4,5,3" (vLLM's VLLM_PP_LAYER_PARTITION, also read from the
    # env var JAXINFER_PP_LAYER_PARTITION); None: even, the remainder on the middle stages.
    pp_layer_partition: str | None = None
    # vLLM's --generation-config: "auto" (the model folder's generation_config.json gives the
    # default sampling parameters: temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens; a request's own values override them), "vllm" (none: the built-in
    # defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's --reasoning-parser: "qwen3", "deepseek_r1" or "deepseek_v3" (jaxinfer/reasoning.py).
    # The chat route splits a choice's thinking into reasoning_content; structured outputs
    # constrain only the text after the thinking ends. None: off.
    reasoning_parser: str | None = None
    # vLLM's logits_processors: LogitsProcessor subclasses or their import paths
    # (jaxinfer/logits_processors.py), applied in batch inside the step to the requests
    # whose parameters ask for them; kept as 'module:QualName' paths.
    logits_processors: tuple | list | None = None
    # Multi-LoRA serving (vLLM's names): PEFT adapters over the base model, mixed in one
    # batch; max_loras: distinct adapters in one step (device slots per projection);
    # max_lora_rank: the slots' rank (adapters above it are refused); max_cpu_loras: adapters
    # kept loaded on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --limit-mm-per-prompt: images a prompt may carry at most, {"image": N} or its
    # JSON (vision-language models; None: vLLM's default, 999).
    limit_mm_per_prompt: dict | str | None = None
    # vLLM's enable_sleep_mode: sleep(level=1 | 2) may free the device's weights and KV
    # cache (RL rollouts between training steps; docs/rl.md). Level 0 (pause) needs nothing.
    enable_sleep_mode: bool = False
    # vLLM's runner: "generate" (text), "pooling" (one vector per prompt: embeddings,
    # LLM.embed, /v1/embeddings; prefill only, no sampling) or "auto" (pooling for a bare
    # decoder checkpoint such as Qwen3Model, else generate). `task="embed"` (vLLM's older
    # spelling) is runner="pooling".
    runner: str = "auto"
    task: str | None = None
    # How a pooling engine pools: a PoolerConfig or a dict of its fields, e.g.
    # {"pooling_type": "MEAN", "normalize": true}. None: from the model folder.
    pooler_config: PoolerConfig | dict | None = None

    def parallel_config(self) -> ParallelConfig:
        """The parallel sizes above as the ParallelConfig the engine is built from (checked:
        ValueError naming the field). ResolvedConfig.parallel holds it."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            enable_sequence_parallelism=self.enable_sequence_parallelism,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            pp_layer_partition=self.pp_layer_partition,
            data_parallel_prefix_affinity=self.data_parallel_prefix_affinity)

    def __post_init__(self):
        self.parallel_config()  # (checked at construction; built once more when resolved)
        if self.logits_processors is not None:
            from jaxinfer.logits_processors import processor_path

            procs = self.logits_processors
            if isinstance(procs, (str, type)) or not isinstance(procs, (list, tuple)):
                procs = [procs]
            object.__setattr__(self, "logits_processors",
                               tuple(processor_path(p) for p in procs) or None)
        if self.reasoning_parser is not None:
            from jaxinfer.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # (ValueError naming the choices)
        if self.limit_mm_per_prompt is not None:
            from jaxinfer.multimodal.inputs import parse_limit_mm_per_prompt

            parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # (ValueError naming it)
        if self.pipeline_parallel_size > 1:
            for name, bad in (("speculative_config", self.speculative_config is not None),
                              ("kv_transfer_config", self.kv_transfer_config is not None)):
                if bad:
                    raise ValueError(f"pipeline_parallel_size > 1 cannot be combined with "
                                     f"{name} yet (the pipeline keeps its own queue of "
                                     f"pipeline_parallel_size batches in flight)")
        if self.data_parallel_size > 1 and self.enable_multiprocessing is False:
            raise ValueError("data_parallel_size > 1 runs one engine-core process per rank: it "
                             "needs enable_multiprocessing (not False)")
        kvt = _sub_config(self.kv_transfer_config, KVTransferConfig, "kv_transfer_config")
        object.__setattr__(self, "kv_transfer_config", kvt)
        spec = _sub_config(self.speculative_config, SpeculativeConfig, "speculative_config")
        object.__setattr__(self, "speculative_config", spec)
        if self.async_scheduling:
            for name, why in async_scheduling_conflicts(self):
                raise ValueError(f"async_scheduling cannot be combined with {name} yet: {why}")
        soc = _sub_config(self.structured_outputs_config, StructuredOutputsConfig,
                          "structured_outputs_config")
        object.__setattr__(self, "structured_outputs_config", soc or StructuredOutputsConfig())
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        self._check_lora()
        self._check_runner()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported "
                             f"(supported: {', '.join(KV_CACHE_DTYPES)})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


    def _check_runner(self) -> None:
        if self.task is not None:
            if self.task not in ("embed", "generate"):
                raise ValueError(f"task={self.task!r} is not supported (supported: embed, "
                                 "generate; or use runner)")
            runner = "pooling" if self.task == "embed" else "generate"
            if self.runner not in ("auto", runner):
                raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}")
            object.__setattr__(self, "runner", runner)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} is not supported (supported: "
                             f"{', '.join(RUNNERS)})")
        pc = _sub_config(self.pooler_config, PoolerConfig, "pooler_config")
        object.__setattr__(self, "pooler_config", pc)
        if self.runner != "pooling":
            return
        for name, bad in (("speculative_config", self.speculative_config is not None),
                          ("enable_lora", self.enable_lora),
                          ("kv_transfer_config", self.kv_transfer_config is not None),
                          ("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1)):
            if bad:
                raise ValueError(f"runner='pooling' cannot be combined with {name} yet")

    def _check_lora(self) -> None:
        for name, low in (("max_loras", 1), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 1024:
                raise ValueError(f"{name} must be an integer in [{low}, 1024], got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras ({cpu!r}) must be >= max_loras ({self.max_loras})")
        if not self.enable_lora:
            return
        for name, bad, why in (
                ("speculative_config", self.speculative_config is not None,
                 "the drafter would run without the adapters"),
                ("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1,
                 "not tested with pipeline stages yet")):
            if bad:
                raise ValueError(f"enable_lora cannot be combined with {name} ({why})")


ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas", "reference")


def multiprocessing_enabled(config: EngineConfig) -> bool:
    if config.enable_multiprocessing is not None:
        return config.enable_multiprocessing
    value = os.environ.get("JAXINFER_ENABLE_MULTIPROCESSING", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", ""):
        raise ValueError(f"JAXINFER_ENABLE_MULTIPROCESSING={value!r}: use 0 or 1")
    return value not in ("0", "false", "no")


@dataclass(frozen=True)
class ResolvedConfig:
    """EngineConfig with every default resolved against the model folder: what both the front
    end (tokenizer, validation) and the engine core (model, cache, scheduler) are built from.
    Pure data: it crosses to the engine-core process as is."""

    engine: EngineConfig  # what the user asked for
    model_dir: str  # resolved model folder (the embedded default converted on demand)
    tokenizer_dir: str | None  # None: skip_tokenizer_init
    model_config: ModelConfig  # from the folder's config.json
    dtype: str  # concrete weight dtype ("float32" | "bfloat16" | "float16")
    kv_cache_dtype: str  # concrete KV cache dtype
    attention_backend: str
    max_model_len: int
    scheduler: SchedulerConfig
    cache: CacheConfig
    parallel: ParallelConfig  # the parallel sizes (engine's flat fields, checked)
    # Default sampling parameters from the generation config (SamplingParams field -> value;
    # empty with generation_config="vllm" or when the file sets none of them)
    default_sampling: dict
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, in order
    runner: str = "generate"  # "generate" | "pooling" (EngineConfig.runner resolved)
    pooler: Any = None  # pooling.ResolvedPooler of a pooling engine, else None


# generation_config.json key -> the SamplingParams field it sets by default (vLLM's list)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: str, model_dir: str) -> dict:
    """The default sampling parameters `generation_config` names ("auto": the model folder's
    generation_config.json; "vllm": none; else a folder's), checked as SamplingParams would
    check them (ValueError naming generation_config and the field)."""
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ValueError(f"generation_config={generation_config!r}: no "
                             "generation_config.json in that folder")
        return {}
    with open(path) as f:
        raw = json.load(f)
    defaults = {field: raw[key] for key, field in GENERATION_DEFAULTS.items()
                if raw.get(key) is not None}
    if defaults:
        from jaxinfer.sampling_params import SamplingParams

        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"generation_config ({path}): {e}") from None
    return defaults


def _generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Resolve the defaults of `config` (reads the model's config.json; loads no weights and
    needs no device). Raises ValueError naming the option on an impossible combination."""
    gguf = config.quantization == "gguf"
    if config.model is None:
        from jaxinfer.checkpoints.default_model import ensure_default_model

        model_dir = ensure_default_model(quantized=gguf)
    elif str(config.model).endswith(".gguf") and os.path.isfile(config.model):
        from jaxinfer.checkpoints.default_model import ensure_gguf_model

        model_dir = ensure_gguf_model(config.model, quantized=gguf)  # (vLLM loads GGUF so)
    else:
        model_dir = config.model
    mcfg = ModelConfig.from_pretrained(model_dir)
    if config.quantization is not None or mcfg.quantization is not None:
        from jaxinfer.config.quant import QuantConfig

        if mcfg.quantization is None:
            mcfg = dataclasses.replace(mcfg, quantization=QuantConfig.from_configs(
                config.quantization, None))
        elif config.quantization not in (None, mcfg.quantization.method):
            raise ValueError(f"quantization={config.quantization!r} does not match the "
                             f"checkpoint's quantization_config.quant_method="
                             f"{mcfg.quantization.method!r}")
    backend = config.attention_backend or "auto"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not supported "
                         f"(supported: {', '.join(ATTENTION_BACKENDS)})")
    runner, pooler = _resolve_runner(config, model_dir, mcfg)
    dtype = engine_dtype(config.dtype, mcfg, pooling=runner == "pooling")
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    kv_dtype = KV_CACHE_ARRAY_DTYPES.get(kv_dtype, kv_dtype)
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={mcfg.max_position_embeddings}")
    max_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
    if not config.enable_chunked_prefill:
        max_tokens = max(max_tokens, max_model_len)
    if max_tokens < config.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens={max_tokens} must be >= max_num_seqs="
                         f"{config.max_num_seqs}")
    prefix_caching = config.enable_prefix_caching
    if pooler is not None and pooler.pooling_type != "LAST" and prefix_caching:
        # (MEAN / CLS need every prompt token's hidden state: a prefix hit would skip some;
        # vLLM caches prefixes of LAST-pooled requests only, too)
        logger.info("pooling_type %s: prefix caching off (it needs every prompt token's "
                    "hidden state)", pooler.pooling_type)
        prefix_caching = False
    cache = CacheConfig(block_size=config.block_size, num_blocks=config.num_kv_blocks,
                        enable_prefix_caching=prefix_caching,
                        hash_seed=config.seed)
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=max_tokens,
                            max_num_seqs=config.max_num_seqs,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            policy=config.scheduling_policy)
    if config.pipeline_parallel_size > 1:
        get_pp_partition(mcfg.num_hidden_layers, config.pipeline_parallel_size,
                         config.pp_layer_partition)  # (the errors name the numbers)
    spec = config.speculative_config
    if spec is not None and spec.drafts_from_hidden_states and config.tensor_parallel_size > 1:
        raise ValueError(f"speculative_config.method={spec.method!r} does not support "
                         "tensor_parallel_size > 1 yet")
    if spec is not None and spec.method == "mtp":
        from jaxinfer.config.features import check_mtp_target

        check_mtp_target(mcfg)
    if spec is not None and spec.method == "draft_model":
        dcfg = ModelConfig.from_pretrained(spec.model)
        if dcfg.vocab_size != mcfg.vocab_size:
            raise ValueError(f"speculative_config.model has vocab_size={dcfg.vocab_size}, the "
                             f"target {mcfg.vocab_size}: a draft model must share the vocabulary")
        if dcfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model has max_position_embeddings="
                             f"{dcfg.max_position_embeddings} < max_model_len={max_model_len}")
    if config.async_scheduling is None:
        config = dataclasses.replace(config, async_scheduling=async_scheduling_combines(
            config, runner))
    if config.warmup_buckets not in WARMUP_BUCKETS:
        raise ValueError(f"warmup_buckets={config.warmup_buckets!r} is not supported "
                         f"(supported: {', '.join(WARMUP_BUCKETS)})")
    if config.step_compilation not in STEP_COMPILATIONS:
        raise ValueError(f"step_compilation={config.step_compilation!r} is not supported "
                         f"(supported: {', '.join(STEP_COMPILATIONS)})")
    if config.layers_per_program < 1:
        raise ValueError(f"layers_per_program must be >= 1, got {config.layers_per_program}")
    tokenizer_dir = None if config.skip_tokenizer_init else (config.tokenizer or model_dir)
    eos = mcfg.eos_token_ids + tuple(t for t in _generation_eos_ids(model_dir)
                                     if t not in mcfg.eos_token_ids)
    return ResolvedConfig(engine=config, model_dir=model_dir, tokenizer_dir=tokenizer_dir,
                          model_config=mcfg, dtype=dtype, kv_cache_dtype=kv_dtype,
                          attention_backend=backend, max_model_len=max_model_len,
                          scheduler=sched, cache=cache, parallel=config.parallel_config(),
                          default_sampling=generation_defaults(config.generation_config,
                                                               model_dir),
                          eos_token_ids=eos, runner=runner, pooler=pooler)


def async_scheduling_conflicts(config: EngineConfig) -> list[tuple[str, str]]:
    """(option, why) for each option of `config` that async scheduling does not combine with:
    async_scheduling=True is refused with them, None stays off."""
    out = []
    if config.speculative_config is not None:
        out.append(("speculative_config", "the drafts of a step depend on the tokens it "
                                          "accepts"))
    if config.pipeline_parallel_size > 1:
        out.append(("pipeline_parallel_size > 1", "the pipeline keeps its own queue of "
                                                  "pipeline_parallel_size batches in flight"))
    return out


def async_scheduling_combines(config: EngineConfig, runner: str) -> bool:
    """Whether async_scheduling=None turns on (vLLM's rule): not with what it does not
    combine with, nor for pooling (logged)."""
    reasons = [name for name, _ in async_scheduling_conflicts(config)]
    if runner == "pooling":
        reasons.append("a pooling runner")
    if reasons:
        logger.info("async scheduling off by default with %s", ", ".join(reasons))
    return not reasons


def _resolve_runner(config: EngineConfig, model_dir: str, mcfg: ModelConfig):
    """(runner, the resolved pooler of a pooling engine or None)."""
    from jaxinfer.pooling import BASE_MODEL_ARCHITECTURES, resolve_pooler

    runner = config.runner
    if runner == "auto":
        runner = "pooling" if mcfg.architecture in BASE_MODEL_ARCHITECTURES else "generate"
    if runner != "pooling":
        if config.pooler_config is not None:
            raise ValueError("pooler_config is for runner='pooling'")
        return runner, None
    return runner, resolve_pooler(config.pooler_config, model_dir, mcfg.hidden_size)

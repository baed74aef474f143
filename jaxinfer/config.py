"""Frozen, validated engine configuration.

Every config is a frozen dataclass checked in ``__post_init__``: a bad value raises ValueError
naming the field and the limit, and nothing mutates a config after construction.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in HF ``rope_scaling`` (types: none/default, linear, llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    @staticmethod
    def from_hf(d: dict | None) -> "RopeScaling":
        if not d:
            return RopeScaling()
        if "original_max_position_embeddings" not in d and d.get("rope_type") == "llama3":
            raise ValueError("rope_scaling llama3 needs original_max_position_embeddings")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type={rope_type!r} is not supported "
                "(supported: default, linear, llama3)"
            )
        return RopeScaling(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from an HF ``config.json``."""

    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    sliding_window: int | None = None  # only honoured where the kernel supports it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's declared dtype ("auto" resolves to it)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // n_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        if is_qwen2 and d.get("use_sliding_window"):
            raise ValueError("Qwen2 use_sliding_window=True (per-layer windows) is not supported")
        use_sw = d.get("use_sliding_window", True) and d.get("sliding_window")
        # transformers >= 5 writes `rope_parameters` (rope_theta inside); older: `rope_scaling`.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", is_qwen2)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(d["sliding_window"]) if use_sw and not is_qwen2 else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @staticmethod
    def from_pretrained(model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: a model folder needs a config.json")
        with open(path) as f:
            return ModelConfig.from_hf_dict(json.load(f))


def resolve_dtype(dtype: str, model_config: ModelConfig) -> str:
    """Map the user's dtype choice ("auto" = the checkpoint's) to a concrete dtype name."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
    if dtype != "auto":
        return dtype
    declared = model_config.torch_dtype.replace("torch.", "")
    return declared if declared in _DTYPES[1:] else "float32"


def replace(cfg, **changes):
    """dataclasses.replace, re-running validation."""
    return dataclasses.replace(cfg, **changes)


SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry and prefix caching."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # total blocks incl. the null block (None: sized by the runner)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # "sha256" (stable across processes) | "builtin"
    hash_seed: int = 0  # root of the chained block hashes

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
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


STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (vLLM's `structured_outputs_config`).

    backend: "guidance" (llguidance, the default under "auto"), "xgrammar" (optional extra;
    imports torch) or "auto" (llguidance, falling back to xgrammar for what llguidance refuses
    when xgrammar is installed). "llguidance" is accepted as another name for "guidance".
    disable_any_whitespace / disable_additional_properties: defaults for every request's JSON.
    compile_timeout_s: a grammar still compiling (or validating) after this long fails its
    request.
    max_spec_bytes / max_schema_depth: larger specs, and JSON schemas nesting deeper (counting
    the definitions their $refs lead to), are refused before a backend sees them (backends
    recurse natively: jaxinfer/structured_output/limits.py)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    compile_timeout_s: float = 30.0
    max_spec_bytes: int = 128 << 10
    max_schema_depth: int = 256

    def __post_init__(self):
        if self.backend == "llguidance":
            object.__setattr__(self, "backend", "guidance")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            hint = (" (outlines and lm-format-enforcer are not available in jaxinfer)"
                    if self.backend in ("outlines", "lm-format-enforcer") else "")
            raise ValueError(f"structured_outputs_config.backend={self.backend!r} is not "
                             f"supported{hint}; use one of "
                             f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
        if self.disable_additional_properties and self.backend == "xgrammar":
            raise ValueError("structured_outputs_config.disable_additional_properties is only "
                             "supported by the guidance backend")
        if not self.compile_timeout_s > 0:
            raise ValueError("structured_outputs_config.compile_timeout_s must be > 0, got "
                             f"{self.compile_timeout_s}")
        for name in ("max_spec_bytes", "max_schema_depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"structured_outputs_config.{name} must be an integer >= 1, "
                                 f"got {v!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPEC_LEN = 32  # as vLLM's rejection sampler


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer drafts up to
    `num_speculative_tokens` tokens per running request; the target verifies them all in one
    step and keeps the longest prefix the rejection sampler accepts, plus one token of its own.

    method "ngram": prompt lookup on the host: the longest suffix of n tokens
    (prompt_lookup_min <= n <= prompt_lookup_max; both default to 5 as in vLLM, one given sets
    the other) seen earlier in the request proposes the tokens that followed it.
    method "draft_model": `model` is a smaller HF model folder with the target's vocabulary;
    it runs inside the target's compiled step (its own paged KV cache, the same block ids) and
    drafts greedily, k single-token steps per step.
    method "eagle" / "eagle3": `model` is an EAGLE / EAGLE-3 head (HF EAGLE checkpoint layout,
    jaxinfer/spec_decode/eagle.py), run inside the target's step on its hidden states."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self):
        method = self.method
        if method is None and self.model in ("ngram", "[ngram]"):
            method = "ngram"
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            raise ValueError("speculative_config.method is required (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported; use one "
                             f"of {', '.join(SPECULATIVE_METHODS)}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_LEN:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPEC_LEN}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= "
                             f"prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if method == "ngram" and self.model not in (None, "ngram", "[ngram]"):
            raise ValueError("speculative_config.model is not used by method 'ngram'")
        if method in ("draft_model", "eagle", "eagle3"):
            if not self.model or not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError("speculative_config.model must be a model folder (with "
                                 f"config.json) for method {method!r}, got {self.model!r}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens the proposer writes: a draft model writes its KV
        at the k draft positions; n-gram lookup writes none."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens


KV_CONNECTORS = ("SharedStorageConnector", "JaxTransferConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (vLLM's `kv_transfer_config`): KV blocks leave an engine (kv_producer)
    and/or arrive from elsewhere (kv_consumer) instead of being computed (jaxinfer/kv_connector).

    kv_connector "SharedStorageConnector" (alias "ExampleConnector"): full prompt blocks are
    stored in a folder (`kv_connector_extra_config["shared_storage_path"]`), one safetensors
    file per block named by its chained prefix hash, and loaded by any engine that meets the
    same prefix, also after a restart.
    kv_connector "JaxTransferConnector": disaggregated prefill/decode between engine processes:
    the prefill engine (producer) keeps a finished prompt's blocks for the decode engine
    (consumer) to pull with jax.experimental.transfer; "done" notices go over ZeroMQ. kv_ip is
    the address both servers listen on; kv_port the notice port (0: any free one; with data
    parallelism, rank r listens on kv_port + r).

    kv_load_failure_policy: a load that fails or times out -> "recompute" the prompt (default)
    or "fail" the request with an error. kv_connector_extra_config: per connector, e.g.
    {"abort_timeout": s} (producer: free unpulled blocks after s seconds, default 120),
    {"pull_timeout": s} (consumer: give up a pull after s seconds, default 30)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_load_failure_policy: str = "recompute"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    engine_id: str | None = None
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        name = self.kv_connector
        if name == "ExampleConnector":
            object.__setattr__(self, "kv_connector", name := "SharedStorageConnector")
        if name not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector={name!r} is not supported; use "
                             f"one of {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} must be one of "
                             f"{', '.join(KV_ROLES)}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_transfer_config.kv_load_failure_policy must be 'recompute' or "
                             f"'fail', got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be in [0, 65535], got "
                             f"{self.kv_port!r}")
        extra = self.kv_connector_extra_config
        known = {"SharedStorageConnector": {"shared_storage_path", "pull_timeout"},
                 "JaxTransferConnector": {"abort_timeout", "pull_timeout"}}[name]
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) "
                             f"{unknown} for {name}; known: {sorted(known)}")
        for key in ("abort_timeout", "pull_timeout"):
            v = extra.get(key)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be "
                                 f"a number of seconds > 0, got {v!r}")
        if name == "SharedStorageConnector" and not extra.get("shared_storage_path"):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path "
                             "is required by SharedStorageConnector (a folder)")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


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
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: max(2048, max_num_seqs), chunked prefill
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "bfloat16" | "float16" | "float32"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str | None = None  # None: "xla" (pallas: not yet verified on GPU)
    tensor_parallel_size: int = 1
    num_kv_blocks: int | None = None  # explicit KV cache size in blocks (incl. null block)
    kv_cache_memory_bytes: int | None = None  # or a byte budget for the KV cache
    gpu_memory_utilization: float = 0.9  # on GPU: fraction of device memory the engine may use
    compilation_cache_dir: str | None = None  # None: <cache>/xla; "" disables the cache
    warmup: bool = True  # compile every bucket at start-up
    min_token_bucket: int = 16
    bucket_growth: int = 2
    # Engine core in a child process behind a ZeroMQ client (vLLM's V1 layout). None: the env
    # var JAXINFER_ENABLE_MULTIPROCESSING (default "1"); False: the core runs in this process.
    enable_multiprocessing: bool | None = None
    # Overlap the host's scheduling with the device's step: step N+1 is dispatched before step
    # N's sampled ids are read back (they are patched into N+1's inputs on the device).
    async_scheduling: bool = False
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

    def __post_init__(self):
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got "
                             f"{self.pipeline_parallel_size!r}")
        if self.pipeline_parallel_size > 1:
            for name, bad in (("async_scheduling", self.async_scheduling),
                              ("speculative_config", self.speculative_config is not None),
                              ("kv_transfer_config", self.kv_transfer_config is not None)):
                if bad:
                    raise ValueError(f"pipeline_parallel_size > 1 cannot be combined with "
                                     f"{name} yet (the pipeline keeps its own queue of "
                                     f"pipeline_parallel_size batches in flight)")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got "
                             f"{self.data_parallel_size!r}")
        if self.data_parallel_size > 1 and self.enable_multiprocessing is False:
            raise ValueError("data_parallel_size > 1 runs one engine-core process per rank: it "
                             "needs enable_multiprocessing (not False)")
        kvt = _sub_config(self.kv_transfer_config, KVTransferConfig, "kv_transfer_config")
        object.__setattr__(self, "kv_transfer_config", kvt)
        spec = _sub_config(self.speculative_config, SpeculativeConfig, "speculative_config")
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and self.async_scheduling:
            raise ValueError("speculative_config cannot be combined with async_scheduling yet: "
                             "the drafts of a step depend on the tokens it accepts")
        soc = _sub_config(self.structured_outputs_config, StructuredOutputsConfig,
                          "structured_outputs_config")
        object.__setattr__(self, "structured_outputs_config", soc or StructuredOutputsConfig())
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported "
                             f"(supported: {', '.join(KV_CACHE_DTYPES)})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


ATTENTION_BACKENDS = ("xla", "pallas", "reference")


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
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, in order


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
    if config.model is None:
        from jaxinfer.models.default_model import ensure_default_model

        model_dir = ensure_default_model()
    else:
        model_dir = config.model
    mcfg = ModelConfig.from_pretrained(model_dir)
    backend = config.attention_backend or "xla"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not supported "
                         f"(supported: {', '.join(ATTENTION_BACKENDS)})")
    dtype = resolve_dtype(config.dtype, mcfg)
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
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
    cache = CacheConfig(block_size=config.block_size, num_blocks=config.num_kv_blocks,
                        enable_prefix_caching=config.enable_prefix_caching,
                        hash_seed=config.seed)
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=max_tokens,
                            max_num_seqs=config.max_num_seqs,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            policy=config.scheduling_policy)
    if config.pipeline_parallel_size > 1:
        from jaxinfer.pipeline import get_pp_partition

        get_pp_partition(mcfg.num_hidden_layers, config.pipeline_parallel_size,
                         config.pp_layer_partition)  # (the errors name the numbers)
    spec = config.speculative_config
    if spec is not None and spec.method in ("eagle", "eagle3") and config.tensor_parallel_size > 1:
        raise ValueError(f"speculative_config.method={spec.method!r} does not support "
                         "tensor_parallel_size > 1 yet")
    if spec is not None and spec.method == "draft_model":
        dcfg = ModelConfig.from_pretrained(spec.model)
        if dcfg.vocab_size != mcfg.vocab_size:
            raise ValueError(f"speculative_config.model has vocab_size={dcfg.vocab_size}, the "
                             f"target {mcfg.vocab_size}: a draft model must share the vocabulary")
        if dcfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model has max_position_embeddings="
                             f"{dcfg.max_position_embeddings} < max_model_len={max_model_len}")
    tokenizer_dir = None if config.skip_tokenizer_init else (config.tokenizer or model_dir)
    eos = mcfg.eos_token_ids + tuple(t for t in _generation_eos_ids(model_dir)
                                     if t not in mcfg.eos_token_ids)
    return ResolvedConfig(engine=config, model_dir=model_dir, tokenizer_dir=tokenizer_dir,
                          model_config=mcfg, dtype=dtype, kv_cache_dtype=kv_dtype,
                          attention_backend=backend, max_model_len=max_model_len,
                          scheduler=sched, cache=cache, eos_token_ids=eos)

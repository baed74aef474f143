"""Configs of the optional features: structured outputs, speculative decoding, KV connectors.
Validated at construction (ValueError naming the field); nothing is read from disk here (a
model folder named by speculative_config is only checked to exist; engine.resolve_config
reads it)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

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


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# (vLLM's former name of "mtp" for DeepSeek checkpoints, still accepted there)
SPECULATIVE_ALIASES = {"[ngram]": "ngram", "deepseek_mtp": "mtp"}
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
    jaxinfer/spec_decode/eagle.py), run inside the target's step on its hidden states.
    method "mtp" (or "deepseek_mtp"): the multi-token-prediction layer a DeepSeek-V3
    checkpoint stores after its decoder layers drafts like an EAGLE head
    (jaxinfer/spec_decode/mtp.py); `model` defaults to the target's folder and
    num_speculative_tokens to 1 (k > 1 runs the one layer k times, as vLLM does)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self):
        method = self.method
        if method is None and self.model in ("ngram", "[ngram]"):
            method = "ngram"
        method = SPECULATIVE_ALIASES.get(method, method)
        if method is None:
            raise ValueError("speculative_config.method is required (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported; use one "
                             f"of {', '.join(SPECULATIVE_METHODS)}")
        object.__setattr__(self, "method", method)
        if method == "mtp" and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 1)
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
        if method in ("draft_model", "eagle", "eagle3") or (method == "mtp"
                                                              and self.model is not None):
            # (a stat of the folder, the one look at the disk in validation: a wrong path is
            # best named where the option is given; its contents are read by resolve_config)
            if not self.model or not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError("speculative_config.model must be a model folder (with "
                                 f"config.json) for method {method!r}, got {self.model!r}")

    @property
    def drafts_from_hidden_states(self) -> bool:
        """An EAGLE-style head (EAGLE, EAGLE-3, MTP): it reads the target's hidden states and
        runs inside the target's step on a KV cache of its own."""
        return self.method in ("eagle", "eagle3", "mtp")

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


POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine (runner="pooling") makes one vector of a prompt (vLLM's
    `pooler_config`): pooling_type LAST (the last token's final hidden state), MEAN (the
    average over the prompt's tokens) or CLS (the first token's); use_activation (also taken
    as `normalize`): L2-normalize the vector (embeddings); dimensions: the default Matryoshka
    truncation. None: what the model folder's sentence-transformers config says, else LAST,
    normalized (vLLM's defaults for a decoder used as an embedding model)."""

    pooling_type: str | None = None
    use_activation: bool | None = None
    normalize: bool | None = None  # (vLLM's older name of use_activation)
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type={self.pooling_type!r} is not "
                                 f"supported (supported: {', '.join(POOLING_TYPES)})")
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None:
            if self.use_activation not in (None, self.normalize):
                raise ValueError("pooler_config: normalize and use_activation disagree")
            object.__setattr__(self, "use_activation", bool(self.normalize))
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"pooler_config.dimensions must be an integer >= 1, got {d!r}")


MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def check_mtp_target(cfg) -> None:
    """A target whose checkpoint has one MTP layer, or a ValueError naming what is not so."""
    if cfg.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative_config.method='mtp' needs a model with multi-token "
                         f"prediction layers ({', '.join(MTP_ARCHITECTURES)}); "
                         f"{cfg.architecture} has none")
    n = cfg.num_nextn_predict_layers
    if n < 1:
        raise ValueError("speculative_config.method='mtp': the model's config has no MTP "
                         "layer (num_nextn_predict_layers is 0)")
    if n > 1:
        raise ValueError(f"speculative_config.method='mtp' with num_nextn_predict_layers={n} "
                         "is not supported yet (1: DeepSeek-V3 / R1's)")

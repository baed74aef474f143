"""The model's architecture facts (from an HF config.json) and dtype resolution."""

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

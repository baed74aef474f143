"""The model's architecture facts (from an HF config.json) and dtype resolution."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from jaxinfer.config.quant import QuantConfig
from jaxinfer.config.rope import RopeScaling
from jaxinfer.config.vision import Gemma3VisionConfig, VisionConfig

from jaxinfer.config.dtypes import WEIGHT_DTYPES

_DTYPES = ("auto", *WEIGHT_DTYPES)


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
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts == 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Qwen2-MoE: a shared expert beside the routed ones (its output gated by a sigmoid).
    shared_expert_intermediate_size: int = 0
    # Set by the engine (enable_expert_parallel under a mesh): experts whole, E / tp of them
    # per device, instead of every expert split over the devices.
    expert_parallel: bool = False
    # Set by the engine (enable_sequence_parallelism under a mesh): between the tensor-
    # parallel regions the residual stream is split by tokens over the devices.
    sequence_parallel: bool = False
    # Gemma 3 (text): gelu-tanh MLP, (1 + w) RMSNorms, embeddings scaled by sqrt(hidden),
    # four norms per layer, its own attention scale, sliding and global layers (each kind
    # with its own rope base), optional final logit soft-capping.
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight)
    scale_embeddings: bool = False  # embeddings x sqrt(hidden_size)
    sandwich_norms: bool = False  # post-attention, pre- and post-feedforward norms
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Per layer: uses the sliding window (when one is set). Empty: every layer does.
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # sliding layers' rope base (default scaling)
    final_logit_softcapping: float | None = None
    # gpt-oss: a bias on the attention output projection too, attention sinks (one learned
    # logit per query head in the softmax denominator), the experts' clamped SwiGLU
    # ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit) with biases,
    # a biased router.
    o_proj_bias: bool = False
    attention_sinks: bool = False
    moe_router_bias: bool = False  # a bias on the router's logits
    moe_expert_bias: bool = False  # a bias on each expert's gate/up and down projections
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V3 multi-head latent attention (kv_lora_rank > 0): the cache holds one latent
    # vector per token and layer (kv_lora_rank compressed K/V + qk_rope_head_dim decoupled-rope
    # key) as a single KV "head" of width head_dim = kv_lora_rank + qk_rope_head_dim, and no
    # separate V (v_cache_dim 0); q_lora_rank None: a plain q projection.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope over interleaved pairs (x0, x1), (x2, x3), ...
    # DeepSeek-V3 routing: sigmoid scores (+ e_score_correction_bias for the choice), the best
    # topk_group of n_group expert groups (each scored by its top-2 sum), top-k within them,
    # weights renormalised (norm_topk_prob) and scaled by routed_scaling_factor; shared
    # experts (moe_intermediate_size x n_shared_experts wide) beside them, ungated; the first
    # first_k_dense_replace layers dense.
    moe_scoring: str = "softmax"  # or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # DeepSeek-V3's multi-token prediction layers (num_nextn_predict_layers), stored in the
    # checkpoint after the decoder layers (model.layers.{num_hidden_layers}...): the MTP
    # drafter's (spec_decode/mtp.py); the model itself never runs them.
    num_nextn_predict_layers: int = 0
    # Vision-language models (Qwen2.5-VL, Gemma 3): the vision tower's config, the
    # placeholder token ids, and (Qwen) M-RoPE's sections: of the head_dim / 2 rotary
    # frequencies, the first mrope_section[0] turn with a token's temporal position, the
    # next with its row, the last with its column (text tokens: all three equal, plain rope).
    vision: VisionConfig | Gemma3VisionConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    mrope_section: tuple[int, ...] = ()
    # The checkpoint holds the experts in MXFP4 (gpt-oss: *_blocks / *_scales tensors, its
    # quantization_config quant_method "mxfp4"): dequantized to the model's dtype at load.
    mxfp4_experts: bool = False
    # Quantized linear weights (config/quant.py): from the checkpoint's quantization_config,
    # or the engine's `quantization` option (resolve_config); None: float weights.
    quantization: QuantConfig | None = None
    # An fp8 KV cache (set by the engine from kv_cache_dtype): each attention layer holds its
    # k_scale / v_scale (the checkpoint's self_attn.k_scale / v_scale, else 1.0).
    fp8_kv_cache: bool = False
    # Multi-LoRA serving (set by the engine from enable_lora): adapter slots on the device
    # per targetable projection and their padded rank; 0: no LoRA parameters.
    lora_slots: int = 0
    lora_rank: int = 0

    @property
    def lora(self) -> tuple[int, int] | None:
        """(slots, rank) of the linear layers' LoRA parameters, or None."""
        return (self.lora_slots, self.lora_rank) if self.lora_slots else None

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
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                    f"num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be > 0, got "
                                 f"{self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got "
                                 f"{self.decoder_sparse_step}")

    def layer_sliding_window(self, i: int) -> int | None:
        """Decoder layer i's sliding window (None: it attends to the whole context)."""
        if self.sliding_layers and not self.sliding_layers[i]:
            return None
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has the sparse MoE block instead of the dense MLP."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def v_cache_dim(self) -> int:
        """Width of the V cache per KV head: head_dim, or 0 with latent attention (the one
        latent cache serves as keys and values)."""
        return 0 if self.kv_lora_rank else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        """The common fields of an HF config.json, then what its architecture's family reads
        beyond them (config/families.py), then its quantization_config."""
        from jaxinfer.config.families import family_fields

        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        if isinstance(d.get("text_config"), dict):  # (a vision-language checkpoint)
            d = {**d, **d["text_config"], "architectures": archs}
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // n_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        use_sw = d.get("use_sliding_window", True) and d.get("sliding_window")
        # transformers >= 5 writes `rope_parameters` (rope_theta inside); older: `rope_scaling`.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        fields = dict(
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
            attention_bias=bool(d.get("attention_bias", False)),
            sliding_window=int(d["sliding_window"]) if use_sw else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        )
        fields.update(family_fields(arch, d))
        qc = d.get("quantization_config")
        if qc is not None and qc.get("quant_method") == "mxfp4" and arch == "GptOssForCausalLM":
            fields["mxfp4_experts"] = True  # (kept quantized: a follow-up)
        elif qc is not None:
            fields["quantization"] = QuantConfig.from_configs(None, qc)
        return ModelConfig(**fields)

    @staticmethod
    def from_pretrained(model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: a model folder needs a config.json")
        with open(path) as f:
            return ModelConfig.from_hf_dict(json.load(f))


def resolve_dtype(dtype: str, model_config: ModelConfig) -> str:
    """Map a dtype choice ("auto" = the checkpoint's) to a concrete dtype name (load_model's
    rule; an engine's "auto" is engine_dtype's)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
    if dtype != "auto":
        return dtype
    declared = model_config.torch_dtype.replace("torch.", "")
    return declared if declared in _DTYPES[1:] else "float32"


# Families vLLM refuses to run in float16 (numerical instability), by architecture prefix.
NO_FLOAT16 = ("Gemma2", "Gemma3", "Glm4")


def engine_dtype(dtype: str, mcfg: ModelConfig, *, pooling: bool) -> str:
    """The weight dtype an engine runs `dtype` in. "auto" is the checkpoint's dtype, except
    that a generating model's float32 checkpoint (or one that declares none) runs in bfloat16,
    as vLLM downcasts it to the platform's first dtype (bfloat16 on CPUs and GPUs alike).
    A pooling model's float32 checkpoint stays float32: vLLM takes float16 there rather than
    bfloat16 for the embeddings' precision, and float32 keeps more of it and runs faster on
    CPUs than float16, which the C++ kernels do not take (32 x 128-token embeddings of SmolLM2
    on the Zen 5 VM: 2.1 s, float16 2.8 s). A family vLLM will not run in float16 refuses it
    (ValueError naming `dtype`)."""
    no_f16 = mcfg.architecture.startswith(NO_FLOAT16)
    resolved = resolve_dtype(dtype, mcfg)
    if dtype == "auto" and resolved == "float32" and not pooling:
        resolved = "bfloat16"
    if resolved == "float16" and no_f16:
        raise ValueError(f"dtype={dtype!r}: {mcfg.architecture} does not run in float16 "
                         "(numerical instability, as in vLLM); use bfloat16 or float32")
    return resolved


def replace(cfg, **changes):
    """dataclasses.replace, re-running validation."""
    return dataclasses.replace(cfg, **changes)

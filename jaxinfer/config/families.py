"""What each model family's HF config.json says beyond the common fields ModelConfig reads
(config/model.py): one row per architecture in FAMILY_FIELDS, a function of the config dict
returning ModelConfig fields. A family whose config needs nothing more needs no row; every
config goes through the refusals of math not built (`_refuse_unsupported_math`). jax-free, so
the front end reads configs without the model code."""

from __future__ import annotations

from typing import Any, Callable

from jaxinfer.config.rope import RopeScaling

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text) fields. Its rope: global (full-attention) layers use rope_theta with
    rope_scaling, sliding layers rope_local_base_freq unscaled; transformers >= 5 writes both
    under rope_parameters, keyed by layer type."""
    types = _layer_types(d, 6)
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp:
        full, local = rp["full_attention"], rp.get("sliding_attention") or {}
    else:
        full = {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 1e6)}
        local = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"sliding layers' rope_type={local['rope_type']!r} is not supported "
                         "(supported: default)")
    cap = d.get("final_logit_softcapping")
    return dict(
        norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        sliding_window=int(d["sliding_window"]) if d.get("sliding_window") else None,
        rope_theta=float(full.get("rope_theta", 1e6)),
        rope_scaling=RopeScaling.from_hf(full),
        rope_local_theta=float(local.get("rope_theta", 10000.0)),
        final_logit_softcapping=float(cap) if cap else None,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def _layer_types(d: dict[str, Any], default_pattern: int) -> list[str]:
    """Each layer's attention kind, full_attention / sliding_attention: the config's
    layer_types, else (older configs) every default_pattern-th layer global."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                      or default_pattern)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if len(types) != n or bad:
        raise ValueError(f"layer_types must list {n} of full_attention / sliding_attention, "
                         f"got {types!r}")
    return list(types)


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: alternating sliding (window 128) and full layers, attention sinks, biased
    q/k/v/o, a biased router over num_local_experts whose top-k logits are softmaxed (= the
    top-k of the full softmax renormalised), experts intermediate_size wide with biases and a
    clamped SwiGLU, yarn rope (read by the common fields)."""
    types = _layer_types(d, 2)
    act = d.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported for GptOssForCausalLM")
    limit = d.get("swiglu_limit")
    return dict(
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        sliding_window=int(d["sliding_window"]) if d.get("sliding_window") else None,
        attention_bias=bool(d.get("attention_bias", True)),
        o_proj_bias=bool(d.get("attention_bias", True)),
        attention_sinks=True, moe_router_bias=True, moe_expert_bias=True,
        num_experts=int(d["num_local_experts"]),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or d.get("experts_per_token") or 4),
        moe_intermediate_size=int(d["intermediate_size"]),
        norm_topk_prob=True,
        swiglu_limit=None if limit is None else float(limit),
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
    )


def _deepseek_v3_fields(d: dict[str, Any], v2: bool = False) -> dict[str, Any]:
    """DeepSeek-V3 (and Kimi K2 and other checkpoints of its architecture): multi-head latent
    attention (the cache: one latent per token, as a single KV head of width kv_lora_rank +
    qk_rope_head_dim), group-limited sigmoid routing with a correction bias, shared experts,
    the first first_k_dense_replace layers dense. v2: DeepSeek-V2 / V2-Lite, the same but
    softmax routing, top-k over all experts ("greedy") or over the best topk_group groups by
    their best expert ("group_limited_greedy"), rope always over interleaved pairs."""
    kv_lora, rope_dim = int(d["kv_lora_rank"]), int(d["qk_rope_head_dim"])
    n_experts, n_group = int(d["n_routed_experts"]), int(d.get("n_group") or 1)
    topk_group = int(d.get("topk_group") or 1)
    if n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={n_experts} and "
                         f"topk_group={topk_group} must be between 1 and n_group")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={d['moe_layer_freq']} is not supported (1: every "
                         "layer past first_k_dense_replace is sparse)")
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    topk_method = d.get("topk_method") or methods[0]
    scoring = d.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    if topk_method not in methods or scoring != ("softmax" if v2 else "sigmoid"):
        raise ValueError(f"topk_method={topk_method!r} / scoring_func={scoring!r} are not "
                         f"supported for this architecture (supported: "
                         f"{' / '.join(methods)} with {'softmax' if v2 else 'sigmoid'})")
    if v2 and topk_method == "greedy":
        n_group = topk_group = 1
    first_dense = int(d.get("first_k_dense_replace") or 0)
    q_lora = d.get("q_lora_rank")
    return dict(
        num_key_value_heads=1, head_dim=kv_lora + rope_dim,
        kv_lora_rank=kv_lora, q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim,
        v_head_dim=int(d["v_head_dim"]),
        rope_interleave=True if v2 else bool(d.get("rope_interleave", True)),
        num_experts=n_experts, num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", not v2)),
        mlp_only_layers=tuple(range(first_dense)),
        moe_scoring=scoring, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        n_shared_experts=int(d.get("n_shared_experts") or 0),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
    )


def _refuse_unsupported_math(d: dict[str, Any], arch: str) -> None:
    """Config keys that would change the model's math in ways not built: an error naming the
    key, never a silently different model."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act={act!r} is not supported for {arch} (supported: "
                         f"{', '.join(HIDDEN_ACTS)})")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise ValueError(f"{key}={d[key]!r} is not supported (the attention kernels have "
                             f"no logit soft-capping and are causal)")
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):  # (their shared experts
        # and dense layers are built)
        return
    for key in ("n_shared_experts", "num_shared_experts"):  # (DeepSeek's layout)
        if d.get(key):
            raise ValueError(f"{key}={d[key]}: DeepSeek-style shared experts are not "
                             "supported yet")
    if d.get("shared_expert_intermediate_size") and arch != "Qwen2MoeForCausalLM":
        raise ValueError(f"shared_expert_intermediate_size="
                         f"{d['shared_expert_intermediate_size']}: shared experts are only "
                         f"supported for Qwen2MoeForCausalLM, not {arch}")
    if d.get("moe_layer_freq", 1) != 1 or d.get("first_k_dense_replace"):
        raise ValueError("moe_layer_freq / first_k_dense_replace (DeepSeek's layer pattern) "
                         "is not supported")


def _moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of ModelConfig from an HF config."""
    # Qwen3-MoE's configs say num_experts; Mixtral's (and transformers >= 5's) num_local_experts.
    experts = d.get("num_experts") or d.get("num_local_experts")
    if not experts:
        raise ValueError(f"{arch} config has no num_experts / num_local_experts")
    mixtral = arch == "MixtralForCausalLM"
    act = d.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported for {arch}'s experts "
                         "(supported: silu)")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
        # Mixtral's experts are intermediate_size wide; Qwen3-MoE's moe_intermediate_size.
        moe_intermediate_size=int(d["intermediate_size"] if mixtral
                                  else d["moe_intermediate_size"]),
        # Mixtral always renormalises its top-2 (softmax over the selected logits).
        norm_topk_prob=True if mixtral else bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(1 if d.get("decoder_sparse_step") is None
                                else d["decoder_sparse_step"]),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
    )


def _qwen2_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen2: q/k/v bias unless the config says otherwise; its sliding-window keys describe
    per-layer windows, not built."""
    if d.get("use_sliding_window"):
        raise ValueError("Qwen2 use_sliding_window=True (per-layer windows) is not supported")
    return dict(attention_bias=bool(d.get("attention_bias", True)), sliding_window=None)


def _qwen2_5_vl_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL: a Qwen2 language model with M-RoPE, and its vision tower."""
    from jaxinfer.config.vision import VisionConfig

    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    section = tuple(int(x) for x in rope.get("mrope_section") or (16, 24, 24))  # (HF's default)
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section={list(section)} must be 3 sections adding up to "
                         f"head_dim / 2 = {head_dim // 2}")
    vision = VisionConfig.from_hf_dict(d["vision_config"])
    return dict(**_qwen2_fields(d), vision=vision, mrope_section=section,
                image_token_id=int(d["image_token_id"]),
                video_token_id=None if d.get("video_token_id") is None
                else int(d["video_token_id"]))


def _gemma3_vl_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 with images (Gemma3ForConditionalGeneration): the text model's fields, the
    SigLIP tower and the image tokens."""
    from jaxinfer.config.vision import Gemma3VisionConfig

    image = d.get("image_token_id", d.get("image_token_index", 262144))
    return dict(**_qwen3_fields(d), **_gemma3_fields(d),
                vision=Gemma3VisionConfig.from_hf_dict(d), image_token_id=int(image))


def _qwen3_fields(d: dict[str, Any]) -> dict[str, Any]:
    return dict(qk_norm=True)


FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "Qwen2ForCausalLM": _qwen2_fields,
    "Qwen3ForCausalLM": _qwen3_fields,
    "Qwen2MoeForCausalLM": lambda d: {**_qwen2_fields(d),
                                      **_moe_fields(d, "Qwen2MoeForCausalLM")},
    "Qwen3MoeForCausalLM": lambda d: {**_qwen3_fields(d),
                                      **_moe_fields(d, "Qwen3MoeForCausalLM")},
    "MixtralForCausalLM": lambda d: _moe_fields(d, "MixtralForCausalLM"),
    "Gemma3ForCausalLM": lambda d: {**_qwen3_fields(d), **_gemma3_fields(d)},
    "GptOssForCausalLM": _gpt_oss_fields,
    "DeepseekV3ForCausalLM": _deepseek_v3_fields,
    "DeepseekV2ForCausalLM": lambda d: _deepseek_v3_fields(d, v2=True),
    "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl_fields,
    "Gemma3ForConditionalGeneration": _gemma3_vl_fields,
}
# Bare decoders (HF's *Model: no LM head), served as pooling models (runner="auto" picks
# pooling for them): the LM head (never used by a pooling step) is the embedding, so none is
# looked for in the weights. Architecture -> the fields of its family.
BARE_DECODERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaModel": lambda d: {}, "MistralModel": lambda d: {}, "Qwen2Model": _qwen2_fields,
    "Qwen3Model": _qwen3_fields}
FAMILY_FIELDS.update({arch: (lambda d, f=f: {**f(d), "tie_word_embeddings": True})
                      for arch, f in BARE_DECODERS.items()})


def family_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields architecture `arch` reads from config dict `d` beyond the common
    ones (after refusing math that is not built)."""
    _refuse_unsupported_math(d, arch)
    row = FAMILY_FIELDS.get(arch)
    return row(d) if row is not None else {}

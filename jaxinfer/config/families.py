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
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if len(types) != n or bad:
        raise ValueError(f"layer_types must list {n} of full_attention / sliding_attention, "
                         f"got {types!r}")
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

"""HF architecture name -> jaxinfer model class."""

from __future__ import annotations

from jaxinfer.models.llama import LlamaForCausalLM

# Llama-family variants differ only in config flags read by ModelConfig.from_hf_dict.
_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixture of experts: the same decoder with a sparse block in place of the dense MLP.
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    # Gemma 3 (text): config flags (norms, embeddings, layer kinds; models/llama.py).
    "Gemma3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str):
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None

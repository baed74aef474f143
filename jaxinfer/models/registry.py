"""HF architecture name -> the model class that implements it: one row per architecture,
naming the family's file (jaxinfer/models/<module>.py) and class, imported on first use (as
vLLM's registry does). `register_model` adds a row at run time (a family kept outside the
package, or a test's toy)."""

from __future__ import annotations

import importlib

from jaxinfer.config.families import BARE_DECODERS

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
}
# Bare decoders (HF's *Model: weights without the "model." prefix, no LM head), as pooling
# models (embeddings, e.g. Qwen3-Embedding): the Llama family's class; the loader maps names.
_REGISTRY.update({arch: ("llama", "LlamaForCausalLM") for arch in BARE_DECODERS})


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Serve HF `architecture` with `class_name` of `module` (a module path, or the name of a
    file in jaxinfer/models/)."""
    _REGISTRY[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str):
    try:
        module, name = _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None
    path = module if "." in module else f"jaxinfer.models.{module}"
    return getattr(importlib.import_module(path), name)

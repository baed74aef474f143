"""gpt-oss: the Llama-family decoder (models/llama.py) with gpt-oss's differences, most of
them switched on by its config (config/families.py): attention sinks (one learned logit per
query head in every softmax denominator, `self_attn.sinks`, in every attention backend), biased
q/k/v/o projections, sliding-window (128) and full layers alternating, yarn rope; and here its
mixture-of-experts block: a biased router (`mlp.router`), top-k of the logits softmaxed, and
experts stored stacked in the checkpoint (`mlp.experts.gate_up_proj` [E, H, 2I] with gate and
up columns interleaved, `down_proj` [E, I, H], a bias on each) whose activation is the clamped
SwiGLU: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
MXFP4 checkpoints (the released ones) load with their experts dequantized (models/loader.py)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.layers.moe import Experts, SparseMoE
from jaxinfer.layers.params import HF
from jaxinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# The checkpoint holds each stacked tensor whole under the experts module, in our [in, out]
# orientation; gate_up's last axis alternates gate and up columns.
GPT_OSS_EXPERT_LAYOUTS = (HF(fuse="interleaved"), HF(), HF(fuse="interleaved"), HF())


def clamped_swiglu(gate, up, *, alpha: float, limit: float | None):
    """gpt-oss's expert activation (HF GptOssExperts._apply_gate)."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def make_ffn(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        if cfg.quantization is not None:
            raise ValueError(f"quantization={cfg.quantization.method!r} is not supported for "
                             "gpt-oss yet (MXFP4 checkpoints load, their experts dequantized; "
                             "fp8 / int8 / compressed-tensors weights do not)")
        act = partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                          dtype=dtype, rngs=rngs, packed=packed,
                          hf_layouts=GPT_OSS_EXPERT_LAYOUTS, bias=cfg.moe_expert_bias,
                          act=act)
        return "mlp", SparseMoE(
            cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, True, dtype=dtype, rngs=rngs, packed=packed, mesh=mesh,
            expert_parallel=cfg.expert_parallel, router_name="router",
            router_bias=cfg.moe_router_bias,
            experts=experts)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

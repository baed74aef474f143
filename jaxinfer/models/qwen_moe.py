"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (models/llama.py) with a sparse
mixture-of-experts block (layers/moe.py) as the `mlp` of the layers the config makes sparse
(every decoder_sparse_step-th layer not in mlp_only_layers; the others keep the dense MLP).
Qwen3-MoE has Qwen3's q/k norms; Qwen2-MoE has q/k/v bias and a shared expert every token
runs, gated by a sigmoid."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.layers.moe import QWEN_EXPERT_NAMES, SparseMoE
from jaxinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, dense_mlp, module_quant


def sparse_moe(cfg: ModelConfig, layer_idx: int, attr: str, *, dtype, rngs, mesh, packed,
               expert_names=QWEN_EXPERT_NAMES) -> SparseMoE:
    """The router + experts block held as layer attribute `attr` (its checkpoint name)."""
    return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype=dtype, rngs=rngs,
                     packed=packed, mesh=mesh, expert_parallel=cfg.expert_parallel,
                     shared_intermediate_size=cfg.shared_expert_intermediate_size,
                     quant=module_quant(cfg, f"model.layers.{layer_idx}.{attr}.experts"),
                     expert_names=expert_names)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    def make_ffn(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        if not cfg.is_moe_layer(layer_idx):
            return "mlp", dense_mlp(cfg, layer_idx, dtype=dtype, rngs=rngs, packed=packed)
        return "mlp", sparse_moe(cfg, layer_idx, "mlp", dtype=dtype, rngs=rngs, mesh=mesh,
                                 packed=packed)


class QwenMoeForCausalLM(LlamaForCausalLM):
    layer_cls = QwenMoeDecoderLayer

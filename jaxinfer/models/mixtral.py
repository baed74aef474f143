"""Mixtral: the Llama-family decoder (models/llama.py) with a sparse mixture-of-experts block
in every layer, held as `block_sparse_moe` with its experts' projections named w1 (gate), w3
(up) and w2 (down) in the checkpoint; the top-2 router weights are always renormalised."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jaxinfer.models.qwen_moe import sparse_moe

MIXTRAL_EXPERT_NAMES = (("w1", "w3"), ("w2",))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_ffn(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        return "block_sparse_moe", sparse_moe(cfg, layer_idx, "block_sparse_moe", dtype=dtype,
                                              rngs=rngs, mesh=mesh, packed=packed,
                                              expert_names=MIXTRAL_EXPERT_NAMES)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

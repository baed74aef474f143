"""Gemma 3 (text): the Llama-family attention (models/llama.py) with Gemma's differences:
RMSNorms that scale by (1 + weight), embeddings scaled by sqrt(hidden), four norms per layer
(a post-attention norm on the attention output, pre- and post-feedforward norms around the
MLP), gelu-tanh MLPs, q/k norms, its own attention scale (query_pre_attn_scalar), sliding and
global layers each with its own rope base (the step's rope tables come stacked, both kinds,
and each layer picks its own), and final logit soft-capping."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.rotary import rope_tables as tables
from jaxinfer.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM
from jaxinfer.parallel import sequence_shard


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """x + post_attention_norm(attn(input_norm(x))), then
    x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    def __init__(self, cfg: ModelConfig, *, dtype, **kwargs):
        super().__init__(cfg, dtype=dtype, **kwargs)
        self.pre_feedforward_layernorm = self.norm(cfg, dtype)
        self.post_feedforward_layernorm = self.norm(cfg, dtype)

    @staticmethod
    def norm(cfg: ModelConfig, dtype) -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, unit_offset=True)

    @staticmethod
    def rope_index(cfg: ModelConfig, layer_idx: int):
        """Which rope table: 0 (global layers' base), 1 (sliding layers')."""
        return int(bool(cfg.sliding_layers) and cfg.sliding_layers[layer_idx])

    def __call__(self, x, cos, sin, kv_cache: KVCache, md: AttentionMetadata):
        sp = partial(sequence_shard, mesh=self.sp_mesh)
        x = sp(x)
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        x = sp(x + self.post_attention_layernorm(sp(h)))
        h = self.post_feedforward_layernorm(sp(self.mlp(self.pre_feedforward_layernorm(x),
                                                              lora_slots=md.lora_slots)))
        return sp(x + h), kv_cache


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    @staticmethod
    def embed_scale(cfg: ModelConfig):
        return cfg.hidden_size ** 0.5

    @staticmethod
    def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[2, T, D/2] each: the global layers' (rope_theta, rope_scaling), then the sliding
        layers' (rope_local_theta, unscaled)."""
        cos, sin = tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        lcos, lsin = tables(positions, cfg.head_dim, cfg.rope_local_theta, RopeScaling())
        return jnp.stack([cos, lcos]), jnp.stack([sin, lsin])

    @staticmethod
    def final_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
        """Soft-capping: cap * tanh(logits / cap)."""
        cap = cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

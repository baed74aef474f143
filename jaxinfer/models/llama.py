"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 3 text, and the
mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral) as a Flax NNX module.

One module covers the family; config flags select the differences: `attention_bias` (Qwen2's
q/k/v bias), `qk_norm` (Qwen3's per-head RMSNorm on q and k), tied or untied LM head, rope
scaling, and a sparse MoE block (layers/moe.py) in place of the dense MLP in the layers the
config makes sparse (`mlp` in Qwen2-MoE (with its shared expert) and Qwen3-MoE,
`block_sparse_moe` in Mixtral). Gemma 3 (text) too: (1 + w) norms (`norm_unit_offset`),
scaled embeddings, a post-attention norm on the attention output and pre/post-feedforward
norms (`sandwich_norms`), gelu-tanh MLPs, its attention scale, sliding and global layers with a
rope base each (`rope()` then returns both kinds' cos/sin, stacked, and each layer picks its
own), final logit soft-capping.

Attribute names follow HF's parameter names, so a checkpoint tensor's name is the
module path joined with dots (see loader.py), except the fused projections: qkv_proj (HF's
q/k/v_proj) and mlp.gate_up_proj (gate/up_proj), built at load time (models/fused.py).

Forward contract: a flat batch of T tokens of many sequences, their positions, the per-layer
paged KV caches and the AttentionMetadata. The caches are returned updated (the caller donates).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.layers import module_list
from jaxinfer.layers.attention import AttentionMetadata, paged_attention
from jaxinfer.layers.cpu_kernels import use_packed_weights
from jaxinfer.layers.linear import Embedding, GatedMLP, Linear, QKVLinear
from jaxinfer.layers.moe import SparseMoE
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from jaxinfer.parallel import sequence_shard

KVCache = tuple[jax.Array, jax.Array]  # k, v: [num_blocks, block_size, Hkv, D]


def rope_kinds(cfg: ModelConfig) -> int:
    """1, or 2 when sliding layers have a rope base of their own (Gemma 3)."""
    return 2 if cfg.rope_local_theta is not None else 1


def model_rope(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int32 [T] -> the rotary cos, sin every layer applies, [T, D/2]; with two
    kinds (rope_kinds) [2, T, D/2]: the global layers' (rope_theta, rope_scaling), then the
    sliding layers' (rope_local_theta, unscaled). Trace-time numpy frequencies: nothing to
    load, folded into the compiled step."""
    from jaxinfer.config import RopeScaling

    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                     cfg.rope_scaling))
    if rope_kinds(cfg) == 1:
        return cos, sin
    lcos, lsin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_local_theta,
                                                       RopeScaling()))
    return jnp.stack([cos, lcos]), jnp.stack([sin, lsin])


def module_quant(cfg: ModelConfig, module: str):
    """The QuantConfig of linear module `module` (None: float weights)."""
    return None if cfg.quantization is None else cfg.quantization.for_module(module)


def softcap_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """Final logit soft-capping (Gemma): cap * tanh(logits / cap); others unchanged."""
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0):
        self.mesh = mesh  # tensor parallelism: attention runs per device under shard_map
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.sm_scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.backend = attention_backend
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        # Which of the step's rope tables this layer uses (two kinds: 0 global, 1 sliding).
        self.rope_index = (None if rope_kinds(cfg) == 1
                           else int(bool(cfg.sliding_layers) and cfg.sliding_layers[layer_idx]))
        bias = cfg.attention_bias
        packed = use_packed_weights(attention_backend, dtype, mesh)
        prefix = f"model.layers.{layer_idx}.self_attn."
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_attention_heads,
                                  cfg.num_key_value_heads, cfg.head_dim, use_bias=bias,
                                  dtype=dtype, rngs=rngs, packed=packed,
                                  quant=module_quant(cfg, prefix + "qkv_proj"))
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, use_bias=False, dtype=dtype, rngs=rngs,
                             packed=packed, quant=module_quant(cfg, prefix + "o_proj"))
        # fp8 KV cache: per-tensor scales (float32 scalars; the loader fills them)
        if cfg.fp8_kv_cache:
            self.k_scale = nnx.Param(jnp.ones((), jnp.float32))
            self.v_scale = nnx.Param(jnp.ones((), jnp.float32))
        else:
            self.k_scale = self.v_scale = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype,
                                  unit_offset=cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype,
                                  unit_offset=cfg.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, kv_cache: KVCache, md: AttentionMetadata):
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_index is not None:
            cos, sin = cos[self.rope_index], sin[self.rope_index]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o, k_cache, v_cache = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], md, sm_scale=self.sm_scale, backend=self.backend,
            sliding_window=self.sliding_window, mesh=self.mesh,
            kv_scales=None if self.k_scale is None else (self.k_scale[...], self.v_scale[...]))
        return self.o_proj(o.reshape(num_tokens, -1)), (k_cache, v_cache)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0):
        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                           unit_offset=cfg.norm_unit_offset)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(cfg, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs, mesh=mesh, layer_idx=layer_idx)
        # Llama: the norm before the MLP. Sandwich (Gemma): the attention output's norm, with
        # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
        self.post_attention_layernorm = norm()
        # Sequence parallelism: the residual stream token-sharded over this mesh.
        self.sp_mesh = mesh if cfg.sequence_parallel else None
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        packed = use_packed_weights(attention_backend, dtype, mesh)
        self.ffn_name = "mlp"
        if cfg.is_moe_layer(layer_idx):
            self.ffn_name = cfg.moe_module
            ffn = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                            cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype=dtype,
                            rngs=rngs, packed=packed, mesh=mesh,
                            expert_parallel=cfg.expert_parallel,
                            shared_intermediate_size=cfg.shared_expert_intermediate_size,
                            quant=module_quant(
                                cfg, f"model.layers.{layer_idx}.{cfg.moe_module}.experts"))
        else:
            mlp = f"model.layers.{layer_idx}.mlp."
            ffn = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs,
                           packed=packed, act=cfg.hidden_act,
                           quant=(module_quant(cfg, mlp + "gate_up_proj"),
                                  module_quant(cfg, mlp + "down_proj")))
        setattr(self, self.ffn_name, ffn)

    def __call__(self, x, cos, sin, kv_cache: KVCache, md: AttentionMetadata):
        sp = partial(sequence_shard, mesh=self.sp_mesh)
        x = sp(x)
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        ffn = getattr(self, self.ffn_name)
        if self.sandwich:
            x = sp(x + self.post_attention_layernorm(sp(h)))
            h = self.post_feedforward_layernorm(sp(ffn(self.pre_feedforward_layernorm(x))))
            return sp(x + h), kv_cache
        x = sp(x + sp(h))
        x = sp(x + sp(ffn(self.post_attention_layernorm(x))))
        return x, kv_cache


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None):
        self.embed_tokens = Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs,
            packed_lm_head=cfg.tie_word_embeddings and use_packed_weights(attention_backend,
                                                                          dtype, mesh),
            scale=cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None,
            quant=module_quant(cfg, "lm_head") if cfg.tie_word_embeddings else None)
        self.layers = module_list(
            LlamaDecoderLayer(cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
                              mesh=mesh, layer_idx=i)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                            unit_offset=cfg.norm_unit_offset)


class LlamaForCausalLM(nnx.Module):
    """The whole model: embeddings, decoder layers, final norm and (un)tied LM head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, mesh=None):
        self.config = cfg
        self.mesh = mesh
        self.model = LlamaModel(cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
                                mesh=mesh)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                                  rngs=rngs,
                                  packed=use_packed_weights(attention_backend, dtype, mesh),
                                  quant=module_quant(cfg, "lm_head"))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, aux_layers: tuple[int, ...] = ()):
        """input_ids, positions: int32 [T] -> hidden states [T, H], updated kv_caches; with
        aux_layers also the residual stream entering each of those layers, concatenated
        [T, len(aux_layers) * H] (EAGLE-3 drafts from it)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        new_caches, aux = [], {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in aux_layers:
                aux[i] = x
            x, kv_cache = layer(x, cos, sin, kv_cache, md)
            new_caches.append(kv_cache)
        if aux_layers:
            return (self.model.norm(x), new_caches,
                    jnp.concatenate([aux[i] for i in aux_layers], axis=-1))
        return self.model.norm(x), new_caches

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions int32 [T] -> the rotary cos, sin the layers apply (see model_rope)."""
        return model_rope(self.config, positions)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] -> float32 logits [N, V]."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        if self.mesh is not None:  # sampling sees the full vocabulary on every device
            from jax.sharding import NamedSharding, PartitionSpec

            logits = jax.lax.with_sharding_constraint(
                logits, NamedSharding(self.mesh, PartitionSpec()))
        return softcap_logits(self.config, logits.astype(jnp.float32))

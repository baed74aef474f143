"""The Llama family as a Flax NNX module: Llama 2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias) and
Qwen3 (per-head RMSNorm on q and k); and the pieces the other families build on (their files:
qwen_moe.py, mixtral.py, gemma3.py): the attention block, the decoder layer with its FFN made
by `make_ffn`, the model skeleton.

Attribute names follow HF's parameter names, so a checkpoint tensor's name is the module path
joined with dots; where ours differ (the fused qkv_proj and gate_up_proj, stacked experts) the
parameter declares the checkpoint tensors it is made of (layers/params.py), with its logical
axes for tensor parallelism: the loader and the shardings read only those declarations.

The contract every model family keeps (the runner's step programs, pipeline stages and the
loader rely on it): `model.embed_tokens`, `model.layers` (each layer called as
`layer(x, cos, sin, kv_cache, md) -> (x, kv_cache)`, with an `ffn_name` attribute and a
`self_attn`; with LoRA on, md.lora_slots is set and the feed-forward block is called as
`ffn(x, lora_slots)`), `model.norm`, `lm_head` (None when tied), `config`, `mesh`, the
methods `rope` (positions -> cos, sin), `compute_logits` (hidden -> float32 logits) and
`__call__`; and the class functions `rope_tables(cfg, positions)` and
`final_logits(cfg, logits)`.

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
from jaxinfer.layers.linear import Embedding, GatedMLP, Linear, QKVLinear
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.params import HF, param
from jaxinfer.layers.rotary import apply_rotary, rope_tables
from jaxinfer.parallel import sequence_shard

KVCache = tuple[jax.Array, jax.Array]  # k, v: [num_blocks, block_size, Hkv, D]


def module_quant(cfg: ModelConfig, module: str, sources: tuple[str, ...] = ()):
    """The QuantConfig of linear module `module` (None: float weights); sources: the
    checkpoint modules beside it a fused module is made of."""
    return None if cfg.quantization is None else cfg.quantization.for_module(module, sources)


def _kv_scale(which: str):
    """An fp8 KV cache's per-tensor scale (float32 scalar): the checkpoint's self_attn.k_scale
    (or compressed-tensors' k_proj.output_scale), else 1.0."""
    return param(jnp.ones((), jnp.float32), axes=(), hf=HF(
        (f"{{module}}.{which}_scale", f"{{module}}.{which}_proj.output_scale"), fuse="first",
        default=1.0))


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0, packed: bool = False, rope_index=None):
        """rope_index: which of the step's rope tables this layer uses when a model has
        several kinds (Gemma 3: 0 global, 1 sliding); None: the only one."""
        self.mesh = mesh  # tensor parallelism: attention runs per device under shard_map
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.sm_scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.backend = attention_backend
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.rope_index = rope_index
        prefix = f"model.layers.{layer_idx}.self_attn."
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_attention_heads,
                                  cfg.num_key_value_heads, cfg.head_dim,
                                  use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs,
                                  packed=packed,
                                  quant=module_quant(cfg, prefix + "qkv_proj",
                                                     ("q_proj", "k_proj", "v_proj")),
                                  lora=cfg.lora)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, use_bias=cfg.o_proj_bias, dtype=dtype,
                             rngs=rngs,
                             packed=packed, quant=module_quant(cfg, prefix + "o_proj"),
                             axes=("heads", "embed"), lora=cfg.lora)
        # gpt-oss: one learned logit per query head in the softmax denominator (float32)
        self.sinks = (param(jnp.zeros((cfg.num_attention_heads,), jnp.float32), axes=("heads",))
                      if cfg.attention_sinks else None)
        if cfg.fp8_kv_cache:
            self.k_scale, self.v_scale = _kv_scale("k"), _kv_scale("v")
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
        q, k, v = self.qkv_proj(x, md.lora_slots)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_index is not None:
            cos, sin = cos[self.rope_index], sin[self.rope_index]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o, k_cache, v_cache = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], md, sm_scale=self.sm_scale, backend=self.backend,
            sliding_window=self.sliding_window, mesh=self.mesh,
            kv_scales=None if self.k_scale is None else (self.k_scale[...], self.v_scale[...]),
            sinks=None if self.sinks is None else self.sinks[...])
        return self.o_proj(o.reshape(num_tokens, -1), md.lora_slots), (k_cache, v_cache)


def dense_mlp(cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs,
              packed: bool) -> GatedMLP:
    """The dense gated MLP of decoder layer `layer_idx` (its `mlp`)."""
    mlp = f"model.layers.{layer_idx}.mlp."
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs,
                    packed=packed, act=cfg.hidden_act,
                    quant=(module_quant(cfg, mlp + "gate_up_proj", ("gate_proj", "up_proj")),
                           module_quant(cfg, mlp + "down_proj")), lora=cfg.lora)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0, packed: bool = False):
        self.input_layernorm = self.norm(cfg, dtype)
        self.self_attn = LlamaAttention(cfg, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs, mesh=mesh, layer_idx=layer_idx,
                                        packed=packed, rope_index=self.rope_index(cfg, layer_idx))
        self.post_attention_layernorm = self.norm(cfg, dtype)
        # Sequence parallelism: the residual stream token-sharded over this mesh.
        self.sp_mesh = mesh if cfg.sequence_parallel else None
        self.ffn_name, ffn = self.make_ffn(cfg, layer_idx, dtype=dtype, rngs=rngs, mesh=mesh,
                                           packed=packed)
        setattr(self, self.ffn_name, ffn)
        # packed weights (the cpu backend, one device): the norms by the C++ kernel, the
        # residual add before the second one with it
        self.input_layernorm.kernel = self.post_attention_layernorm.kernel = packed

    @staticmethod
    def norm(cfg: ModelConfig, dtype) -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    @staticmethod
    def rope_index(cfg: ModelConfig, layer_idx: int):
        return None

    def make_ffn(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        """(attribute name = checkpoint name, module) of the layer's feed-forward block."""
        return "mlp", dense_mlp(cfg, layer_idx, dtype=dtype, rngs=rngs, packed=packed)

    def __call__(self, x, cos, sin, kv_cache: KVCache, md: AttentionMetadata):
        sp = partial(sequence_shard, mesh=self.sp_mesh)
        x = sp(x)
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        ffn = getattr(self, self.ffn_name)
        if self.post_attention_layernorm.kernel:  # (one device: no sequence sharding)
            x, h = self.post_attention_layernorm.add_norm(x, h)
        else:
            x = sp(x + sp(h))
            h = self.post_attention_layernorm(x)
        x = sp(x + sp(ffn(h) if md.lora_slots is None else ffn(h, md.lora_slots)))
        return x, kv_cache


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_cls, *, dtype, attention_backend: str,
                 rngs: nnx.Rngs, mesh=None, packed: bool = False, embed_scale=None):
        self.embed_tokens = Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs,
            packed_lm_head=cfg.tie_word_embeddings and packed, scale=embed_scale,
            quant=module_quant(cfg, "lm_head") if cfg.tie_word_embeddings else None)
        self.layers = module_list(
            layer_cls(cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
                      mesh=mesh, layer_idx=i, packed=packed)
            for i in range(cfg.num_hidden_layers))
        self.norm = layer_cls.norm(cfg, dtype)
        self.norm.kernel = packed


class LlamaForCausalLM(nnx.Module):
    """The whole model: embeddings, decoder layers, final norm and (un)tied LM head.

    packed: linear weights in the `cpu` backend's column panels (float32 on one device; the
    worker's choice, passed down by the loader)."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, mesh=None, packed: bool = False):
        self.config = cfg
        self.mesh = mesh
        self.model = LlamaModel(cfg, self.layer_cls, dtype=dtype,
                                attention_backend=attention_backend, rngs=rngs, mesh=mesh,
                                packed=packed, embed_scale=self.embed_scale(cfg))
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                                  rngs=rngs, packed=packed, quant=module_quant(cfg, "lm_head"),
                                  axes=("embed", "vocab"))

    @staticmethod
    def embed_scale(cfg: ModelConfig):
        """A factor on the looked-up embeddings (Gemma: sqrt(hidden)); None: none."""
        return None

    @staticmethod
    def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions int32 [T] -> the rotary cos, sin every layer applies, [T, D/2].
        Trace-time numpy frequencies: nothing to load, folded into the compiled step."""
        return rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def final_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
        """The LM head's float32 logits as the family finishes them (Gemma: soft-capped)."""
        return logits

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata, aux_layers: tuple[int, ...] = (), embeds=None):
        """input_ids, positions: int32 [T] -> hidden states [T, H], updated kv_caches; with
        aux_layers also the residual stream entering each of those layers, concatenated
        [T, len(aux_layers) * H] (EAGLE-3 drafts from it). embeds [T, H]: the input
        embeddings instead of input_ids' (a vision-language model's, images merged in)."""
        x = self.model.embed_tokens(input_ids) if embeds is None else embeds
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
        """The step's rotary tables, computed once: behind the barrier, XLA:CPU fused the
        cos / sin into every layer's rotary fusion (30 times over: 1.4% of a decode step of
        32 sequences of SmolLM2 in libm's sincosf, none with it)."""
        return jax.lax.optimization_barrier(self.rope_tables(self.config, positions))

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
        return self.final_logits(self.config, logits.astype(jnp.float32))

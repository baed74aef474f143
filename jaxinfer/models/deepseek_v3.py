"""DeepSeek-V3 (and the checkpoints of its architecture: DeepSeek-R1, Kimi K2, ...) and
DeepSeek-V2 / V2-Lite (softmax routing, no correction bias; the same attention): the
Llama-family decoder skeleton (models/llama.py) with multi-head latent attention and
DeepSeek's mixture of experts.

Multi-head latent attention (MLA). Each token's keys and values come from one compressed
latent c (kv_lora_rank wide, after kv_a_layernorm) and one decoupled rope key k_pe
(qk_rope_head_dim, shared by every head): per head, k = [W_UK c, k_pe] and v = W_UV c, with
W_UK / W_UV the two halves of kv_b_proj. The paged cache holds only [c, k_pe] per token and
layer (kv_lora_rank + qk_rope_head_dim values: the point of MLA; the cache's one KV "head",
ModelConfig.head_dim, no V cache). Attention runs in the absorbed form for prefill and decode
alike: q_nope W_UK^T moves each head's query into the latent space, so that
scores = [q_nope W_UK^T, q_pe] . [c, k_pe] and the output, sum p c, leaves through W_UV (both
held per head as parameters, made from kv_b_proj at load): this
is multi-query attention over the latent cache with the cache as keys and as values
(layers/attention.py: paged_latent_attention), on every attention backend unchanged. The
expanded form (k, v per head) is HF's; the tests hold the two equal. The softmax scale is
qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when configured.

Mixture of experts: sigmoid scores; the choice adds e_score_correction_bias; experts come in
n_group groups, each scored by the sum of its two best, and only the best topk_group groups
compete for the top k; the weights are the chosen experts' scores (without the bias),
renormalised (norm_topk_prob) and times routed_scaling_factor. n_shared_experts shared experts
(one gated MLP, moe_intermediate_size x n_shared_experts wide) run on every token, ungated.
The first first_k_dense_replace layers have a dense MLP instead.

Tensor parallelism: heads split (q, kv_b, o projections), the latent cache replicated, one
copy per device (each device's heads read all of it; vLLM does the same); expert parallelism
as the other MoE families.

The checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}) is the MTP
drafter's (spec_decode/mtp.py), never this model's. Not built yet: fp8 KV caches, KV connectors
and LoRA with a latent cache (refused by name)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.layers.attention import AttentionMetadata, paged_latent_attention
from jaxinfer.layers.linear import GatedMLP, Linear
from jaxinfer.layers.moe import SparseMoE
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.params import HF, param
from jaxinfer.layers.rotary import apply_rotary, rope_tables, yarn_mscale
from jaxinfer.models.llama import (KVCache, LlamaDecoderLayer, LlamaForCausalLM, dense_mlp,
                                   module_quant)

_LATENT_NORM_EPS = 1e-6  # (HF's q_a_layernorm / kv_a_layernorm keep RMSNorm's default)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs.rope_type != "default" and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def _deinterleave(x):
    """Rope over interleaved pairs (x0, x1), (x2, x3), ... as rotate-half over the halves
    [x0, x2, ...], [x1, x3, ...] (q and k alike: their dot products are unchanged)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _per_head_dot(spec: str, a, b):
    """A batched (per-head) product accumulated in float32: XLA:CPU has no bf16 x bf16 ->
    float32 batched dot, so there the operands are widened first."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0, packed: bool = False):
        if cfg.fp8_kv_cache:
            raise ValueError("kv_cache_dtype=fp8 with multi-head latent attention "
                             "(DeepSeek-V3) is not supported yet")
        if cfg.lora is not None:
            raise ValueError("enable_lora with DeepSeek-V3 is not supported yet")
        self.num_heads, self.backend, self.mesh = cfg.num_attention_heads, attention_backend, mesh
        # Under tensor parallelism the config has the latent replicated to one copy per device
        # (parallel.tp_model_config: KV heads up to the mesh size).
        self.latent_copies = cfg.num_key_value_heads
        self.nope, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                cfg.v_head_dim)
        self.kv_lora_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        self.sm_scale = mla_softmax_scale(cfg)
        h, nh, qk = cfg.hidden_size, cfg.num_attention_heads, self.nope + self.rope_dim
        bias = cfg.attention_bias
        prefix = f"model.layers.{layer_idx}.self_attn."

        def linear(n_in, n_out, name, use_bias=False, axes=(None, None)):
            return Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, rngs=rngs, packed=packed,
                          quant=module_quant(cfg, prefix + name), axes=axes)

        # Tensor parallel: the q and kv_b projections split by heads, o_proj row-parallel; the
        # latent's own projections (q_a, kv_a) whole on every device.
        if cfg.q_lora_rank is None:
            self.q_proj = linear(h, nh * qk, "q_proj", axes=("embed", "heads"))
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(h, cfg.q_lora_rank, "q_a_proj", bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, nh * qk, "q_b_proj", axes=(None, "heads"))
        self.kv_a_proj_with_mqa = linear(h, cfg.kv_lora_rank + self.rope_dim,
                                         "kv_a_proj_with_mqa", bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS, dtype=dtype)
        # kv_b_proj [L, nh x (nope + v)] held as the absorbed weights, per head and laid out
        # for the step's batched products: W_UK [nh, nope, L], W_UV [nh, L, v] (slicing and
        # transposing kv_b_proj in the step cost 7.9 ms a layer on the CPU, these 1.2 ms).
        per = self.nope + self.v_dim
        init = nnx.initializers.normal(0.02)
        self.w_uk = param(init(rngs.params(), (nh, self.nope, cfg.kv_lora_rank), dtype),
                          axes=("heads", None, None), hf=HF(
                              ("{module}.kv_b_proj.weight",), transpose=True, fuse="head_rows",
                              split=(0, self.nope, per, (1, 2, 0))))
        self.w_uv = param(init(rngs.params(), (nh, cfg.kv_lora_rank, self.v_dim), dtype),
                          axes=("heads", None, None), hf=HF(
                              ("{module}.kv_b_proj.weight",), transpose=True, fuse="head_rows",
                              split=(self.nope, self.v_dim, per, (1, 0, 2))))
        self.o_proj = linear(nh * self.v_dim, h, "o_proj", bias, axes=("heads", "embed"))

    def __call__(self, x, cos, sin, kv_cache: KVCache, md: AttentionMetadata):
        t, nh = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(t, nh, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, :self.kv_lora_rank])  # [T, L]
        k_pe = ckv[:, None, self.kv_lora_rank:]  # [T, 1, R]
        if self.interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        q_lat = _per_head_dot("thn,hnl->thl", q_nope, self.w_uk[...]).astype(q.dtype)
        latent = jnp.concatenate([c[:, None, :], k_pe], axis=-1)  # [T, 1, L + R]
        if self.latent_copies > 1:
            latent = jnp.broadcast_to(latent, (t, self.latent_copies, latent.shape[-1]))
        o, cache = paged_latent_attention(jnp.concatenate([q_lat, q_pe], axis=-1), latent,
                                          kv_cache[0], md, sm_scale=self.sm_scale,
                                          backend=self.backend, mesh=self.mesh)
        o = _per_head_dot("thl,hlv->thv", o[..., :self.kv_lora_rank],
                          self.w_uv[...]).astype(x.dtype)
        return self.o_proj(o.reshape(t, nh * self.v_dim)), (cache, kv_cache[1])


class DeepseekV3MoE(SparseMoE):
    """Routed experts (Qwen-MoE's per-expert checkpoint names) behind DeepSeek's router
    (`gate`: weight and e_score_correction_bias), plus the ungated shared experts."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype=dtype, rngs=rngs,
                         packed=packed, mesh=mesh, expert_parallel=cfg.expert_parallel,
                         quant=module_quant(cfg, f"model.layers.{layer_idx}.mlp.experts"))
        self.scoring = cfg.moe_scoring  # (DeepSeek-V2: softmax, no correction bias)
        if self.scoring == "sigmoid":
            self.gate.e_score_correction_bias = param(
                jnp.zeros((cfg.num_experts,), jnp.float32), axes=(None,))
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.shared_experts = (GatedMLP(cfg.hidden_size,
                                        cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        dtype=dtype, rngs=rngs, packed=packed)
                               if cfg.n_shared_experts else None)

    def route(self, x):
        logits = jnp.dot(x.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32))
        if self.scoring == "sigmoid":
            weights, experts = grouped_sigmoid_route(
                logits, self.gate.e_score_correction_bias[...], self.top_k, self.n_group,
                self.topk_group, self.norm_topk_prob)
        else:
            weights, experts = grouped_softmax_route(logits, self.top_k, self.n_group,
                                                     self.topk_group, self.norm_topk_prob)
        return weights * self.routed_scaling_factor, experts

    def __call__(self, x, lora_slots=None):
        out = super().__call__(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def grouped_sigmoid_route(logits, bias, k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool):
    """DeepSeek-V3's router: logits float32 [T, E] -> (weights [T, k], expert ids int32)."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    groups = choice.reshape(t, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(groups, min(2, e // n_group))[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
    keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights, experts.astype(jnp.int32)


def grouped_softmax_route(logits, k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool):
    """DeepSeek-V2's router: softmax scores; with several groups only the best topk_group
    (each scored by its best expert) compete; the top-k scores are the weights (renormalised
    when norm_topk_prob, as vLLM does; V2's configs leave it off)."""
    t, e = logits.shape
    scores = jax.nn.softmax(logits, axis=-1)
    if n_group > 1:
        group_scores = jnp.max(scores.reshape(t, n_group, e // n_group), axis=-1)
        _, best = jax.lax.top_k(group_scores, topk_group)
        keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        scores = jnp.where(jnp.repeat(keep, e // n_group, axis=1), scores, 0.0)
    weights, experts = jax.lax.top_k(scores, k)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights, experts.astype(jnp.int32)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 mesh=None, layer_idx: int = 0, packed: bool = False):
        self.input_layernorm = self.norm(cfg, dtype)
        self.self_attn = MLAttention(cfg, dtype=dtype, attention_backend=attention_backend,
                                     rngs=rngs, mesh=mesh, layer_idx=layer_idx, packed=packed)
        self.post_attention_layernorm = self.norm(cfg, dtype)
        self.sp_mesh = None
        self.ffn_name, ffn = self.make_ffn(cfg, layer_idx, dtype=dtype, rngs=rngs, mesh=mesh,
                                           packed=packed)
        setattr(self, self.ffn_name, ffn)

    def make_ffn(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs, mesh, packed):
        if not cfg.is_moe_layer(layer_idx):  # (the first first_k_dense_replace layers)
            return "mlp", dense_mlp(cfg, layer_idx, dtype=dtype, rngs=rngs, packed=packed)
        return "mlp", DeepseekV3MoE(cfg, layer_idx, dtype=dtype, rngs=rngs, mesh=mesh,
                                    packed=packed)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    layer_cls = DeepseekV3DecoderLayer

    @staticmethod
    def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The decoupled rope's tables: qk_rope_head_dim wide (yarn as configured)."""
        return rope_tables(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)

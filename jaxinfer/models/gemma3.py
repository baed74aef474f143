"""Gemma 3 (text): the Llama-family attention (models/llama.py) with Gemma's differences:
RMSNorms that scale by (1 + weight), embeddings scaled by sqrt(hidden), four norms per layer
(a post-attention norm on the attention output, pre- and post-feedforward norms around the
MLP), gelu-tanh MLPs, q/k norms, its own attention scale (query_pre_attn_scalar), sliding and
global layers each with its own rope base (the step's rope tables come stacked, both kinds,
and each layer picks its own), and final logit soft-capping.

Gemma 3 with images (Gemma3ForConditionalGeneration): the SigLIP tower (models/siglip.py)
and the average-pooling projector turn each image into mm_tokens_per_image soft tokens, put
in place of the prompt's image tokens (unscaled: the sqrt(hidden) factor is the text
embeddings' only); in the language model an image's tokens see each other both ways (HF's
token_type_ids block mask: the steps whose chunks hold images carry each token's span,
AttentionMetadata.attn_spans; the scheduler never splits an image across steps)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.config.vision import SiglipVisionConfig
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.params import param
from jaxinfer.layers.rotary import rope_tables as tables
from jaxinfer.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM
from jaxinfer.models.siglip import SiglipVisionTower
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


class Gemma3MultiModalProjector(nnx.Module):
    """The SigLIP patches of an image average-pooled to mm_tokens_per_image (a square), a
    (1 + w) RMSNorm, then a matmul to the language model's width: [B, P^2, Hv] ->
    [B, mm_tokens_per_image, H]."""

    def __init__(self, vcfg: SiglipVisionConfig, text_hidden: int, mm_tokens_per_image: int,
                 *, dtype):
        side = int(round(mm_tokens_per_image ** 0.5))
        if side * side != mm_tokens_per_image or vcfg.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={mm_tokens_per_image} must be a square "
                             f"whose side divides the {vcfg.patches_per_side} patches a side")
        self.side, self.kernel = side, vcfg.patches_per_side // side
        self.mm_soft_emb_norm = RMSNorm(vcfg.hidden_size, vcfg.layer_norm_eps, dtype=dtype,
                                        unit_offset=True)
        self.mm_input_projection_weight = param(
            jnp.zeros((vcfg.hidden_size, text_hidden), dtype), axes=(None, None))

    def __call__(self, x):
        b, _, h = x.shape
        s, k = self.side, self.kernel
        pooled = x.astype(jnp.float32).reshape(b, s, k, s, k, h).mean(axis=(2, 4))
        normed = self.mm_soft_emb_norm(pooled.reshape(b, s * s, h).astype(x.dtype))
        return jnp.einsum("bnh,hd->bnd", normed, self.mm_input_projection_weight[...])


class Gemma3ImageEncoder(nnx.Module):
    """Gemma 3's image path: the SigLIP tower (`vision_tower`) and the projector
    (`multi_modal_projector`), under the checkpoint's names: pixel_values [B, C, S, S] ->
    soft tokens [B, mm_tokens_per_image, H]."""

    def __init__(self, vcfg: SiglipVisionConfig, text_hidden: int, mm_tokens_per_image: int,
                 *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.vision_tower = SiglipVisionTower(vcfg, dtype=dtype, rngs=rngs)
        self.multi_modal_projector = Gemma3MultiModalProjector(vcfg, text_hidden,
                                                               mm_tokens_per_image, dtype=dtype)

    def __call__(self, pixels):
        return self.multi_modal_projector(self.vision_tower(pixels))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The Gemma 3 language model and its image path (`visual`: the tower and projector)."""

    # an image's tokens attend to each other both ways (StepBatch attn spans)
    bidirectional_images = True

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, mesh=None, packed: bool = False):
        super().__init__(cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
                         mesh=mesh, packed=packed)
        vis = cfg.vision
        self.visual = Gemma3ImageEncoder(vis.siglip, cfg.hidden_size, vis.mm_tokens_per_image,
                                         dtype=dtype, rngs=rngs)

    @staticmethod
    def encoder_inputs(cfg: ModelConfig, feature, min_size: int) -> tuple[tuple, int, np.ndarray]:
        """One image's tower input: its patch rows [P^2, C x p x p] (multimodal/gemma3.py)
        back as pixel_values [1, C, S, S] (every image is S x S: one compiled size); its
        mm_tokens_per_image output rows, in order."""
        sig = cfg.vision.siglip
        side, p, c = sig.patches_per_side, sig.patch_size, sig.num_channels
        x = feature.pixels().reshape(side, side, c, p, p).transpose(2, 0, 3, 1, 4)
        n = cfg.vision.mm_tokens_per_image
        return (np.ascontiguousarray(x).reshape(1, c, side * p, side * p),), n, np.arange(n)

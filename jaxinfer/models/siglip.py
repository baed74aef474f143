"""The SigLIP vision encoder (Gemma 3's vision tower; config: config/vision.py), under the
checkpoint's names (vision_model.embeddings / encoder.layers / post_layernorm).

pixel_values [B, C, S, S] -> patch rows (the Conv2d with stride = kernel as the matmul it is,
its kernel flattened at load) + learned position embeddings -> pre-LayerNorm blocks
(bidirectional attention over the image's patches, biased q/k/v/out; fc1, gelu-tanh, fc2)
-> the final LayerNorm: [B, (S / P)^2, hidden]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config.vision import SiglipVisionConfig
from jaxinfer.layers import module_list
from jaxinfer.layers.linear import Linear
from jaxinfer.layers.norms import LayerNorm
from jaxinfer.layers.params import HF, param


class _PositionEmbedding(nnx.Module):
    def __init__(self, n: int, dim: int, *, dtype):
        self.weight = param(jnp.zeros((n, dim), dtype), axes=(None, None))


class SiglipEmbeddings(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        self.cfg = cfg
        self.patch_embedding = Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size,
                                      use_bias=True, dtype=dtype, rngs=rngs)
        self.patch_embedding.weight.set_metadata(
            hf=HF(("{module}.weight",), transpose=True, flatten=True))
        self.position_embedding = _PositionEmbedding(cfg.patches_per_side ** 2, cfg.hidden_size,
                                                     dtype=dtype)

    def __call__(self, pixels):
        b, c, s, _ = pixels.shape
        p, g = self.cfg.patch_size, s // self.cfg.patch_size
        rows = pixels.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(rows.reshape(b * g * g, c * p * p).astype(
            self.patch_embedding.weight.dtype)).reshape(b, g * g, -1)
        return x + self.position_embedding.weight[...]


class SiglipAttention(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, Linear(h, h, use_bias=True, dtype=dtype, rngs=rngs))

    def __call__(self, x):
        b, n, h = x.shape
        flat = x.reshape(b * n, h)
        q, k, v = (proj(flat).reshape(b, n, self.heads, self.head_dim).astype(jnp.float32)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.head_dim ** -0.5
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.out_proj(o.reshape(b * n, h).astype(x.dtype)).reshape(b, n, h)


class SiglipMLP(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=True, dtype=dtype,
                          rngs=rngs)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, use_bias=True, dtype=dtype,
                          rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(cfg, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        b, n, h = x.shape
        return x + self.mlp(self.layer_norm2(x).reshape(b * n, h)).reshape(b, n, h)


class SiglipEncoder(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        self.layers = module_list(SiglipEncoderLayer(cfg, dtype=dtype, rngs=rngs)
                                  for _ in range(cfg.num_hidden_layers))


class SiglipVisionModel(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs):
        self.embeddings = SiglipEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = SiglipEncoder(cfg, dtype=dtype, rngs=rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, pixels):
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionTower(nnx.Module):
    """HF's SiglipVisionModel (its one attribute `vision_model`, as checkpoints name it)."""

    def __init__(self, cfg: SiglipVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.vision_model = SiglipVisionModel(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, pixels):
        """pixel_values [B, C, S, S] -> [B, (S / P)^2, hidden]."""
        return self.vision_model(pixels)

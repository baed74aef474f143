"""EAGLE and EAGLE-3 draft heads (Llama), loaded from the usual HF EAGLE checkpoint layout.

An EAGLE head drafts from the target's hidden states. At position p it reads the token at p+1
and the target's hidden state at p (so its output predicts the token at p+2), through one
decoder layer with its own paged KV cache (same block ids as the target's):

- EAGLE (-1): x = fc([embed(token), hidden]) with hidden = the target's last (normed) hidden
  state; a decoder layer without input norm; logits = lm_head(out) (the target's LM head
  unless the checkpoint has one); the next step's hidden is `out`.
- EAGLE-3: hidden = fc(concat of the target's residual stream entering layers
  (2, L//2, L-3), or config eagle_config.eagle_aux_hidden_state_layer_ids); the "midlayer"
  attends over [input_layernorm(embed(token)), hidden_norm(hidden)] (2H wide); logits =
  lm_head(norm(out)) over the draft vocabulary, mapped to the target's with `d2t`
  (target id = draft id + d2t[draft id]); the next step's hidden is the pre-norm `out`.

Checkpoint tensor names: EAGLE: fc.weight [H, 2H] (fc.bias optional), layers.N.*,
embed_tokens.weight / lm_head.weight optional (shared with the target when absent). EAGLE-3:
fc.weight [H, k*H_target], midlayer.{input_layernorm, hidden_norm, self_attn.*, mlp.*,
post_attention_layernorm}, norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab]
(when draft_vocab_size != vocab_size), embed_tokens.weight optional.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.config.dtypes import dtype as array_dtype
from jaxinfer.layers import module_list
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.cpu_kernels import use_packed_weights
from jaxinfer.layers.linear import Embedding, GatedMLP, Linear, QKVLinear
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.rotary import rope_tables
from jaxinfer.layers.params import (checkpoint_names, declared, fuse, source_shape,
                                   to_param_layout)
from jaxinfer.models.llama import LlamaAttention, LlamaDecoderLayer


class _Identity(nnx.Module):
    def __call__(self, x):
        return x


class Eagle3Layer(nnx.Module):
    """The EAGLE-3 "midlayer": attention over [norm(embeds), hidden_norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 norm_before_residual: bool):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        packed = use_packed_weights(attention_backend, dtype, None)
        self.self_attn = LlamaAttention(cfg, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs, packed=packed)
        bias = cfg.attention_bias
        self.self_attn.qkv_proj = QKVLinear(
            2 * h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, use_bias=bias,
            dtype=dtype, rngs=rngs, packed=packed)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embeds, hidden, cos, sin, kv_cache, md: AttentionMetadata):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h, kv_cache = self.self_attn(x, cos, sin, kv_cache, md)
        residual = residual + h
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv_cache


@dataclasses.dataclass(frozen=True)
class EagleSpec:
    """What the head needs beyond ModelConfig, read from its config.json and checkpoint."""

    method: str  # "eagle" | "eagle3"
    aux_layers: tuple[int, ...]  # eagle3: target layers whose input is captured
    draft_vocab_size: int
    target_hidden_size: int
    fc_bias: bool
    has_embed: bool
    has_lm_head: bool
    norm_before_residual: bool


class EagleHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: EagleSpec, *, dtype, attention_backend: str,
                 rngs: nnx.Rngs):
        self.config = cfg
        self.method = spec.method
        self.aux_layers = spec.aux_layers
        h = cfg.hidden_size
        self.embed_tokens = (Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
                             if spec.has_embed else None)
        self.lm_head = (Linear(h, spec.draft_vocab_size, use_bias=False, dtype=dtype, rngs=rngs)
                        if spec.has_lm_head else None)
        mapped = spec.method == "eagle3" and spec.draft_vocab_size != cfg.vocab_size
        self.d2t = (nnx.Variable(jnp.zeros((spec.draft_vocab_size,), jnp.int32)) if mapped
                    else None)
        if spec.method == "eagle":
            self.fc = Linear(2 * h, h, use_bias=spec.fc_bias, dtype=dtype, rngs=rngs)
            packed = use_packed_weights(attention_backend, dtype, None)
            layers = [LlamaDecoderLayer(cfg, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs, packed=packed)
                      for _ in range(cfg.num_hidden_layers)]
            layers[0].input_layernorm = _Identity()
            self.layers = module_list(layers)
            self.norm = None
        else:
            fc_in = spec.target_hidden_size * len(spec.aux_layers)
            self.fc = Linear(fc_in, h, use_bias=spec.fc_bias, dtype=dtype, rngs=rngs)
            self.midlayer = Eagle3Layer(cfg, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs, norm_before_residual=spec.norm_before_residual)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers if self.method == "eagle" else 1

    def combine(self, target_hidden):
        """The hidden input of the first pass from what the target step captured: its last
        hidden state (EAGLE) or the concatenated aux states (EAGLE-3, through fc)."""
        return target_hidden if self.method == "eagle" else self.fc(target_hidden)

    def __call__(self, input_ids, positions, hidden, kv_caches, md: AttentionMetadata, target):
        """One pass over T tokens -> (logits-side hidden [T, H], next-step hidden [T, H],
        kv_caches). `hidden` is combine()'s output or the previous step's next-step hidden."""
        embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        embeds = embed(input_ids)
        cfg = self.config
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        new = []
        if self.method == "eagle":
            x = self.fc(jnp.concatenate([embeds, hidden], axis=-1))
            for layer, kv in zip(self.layers, kv_caches):
                x, kv = layer(x, cos, sin, kv, md)
                new.append(kv)
            return x, x, new
        out, kv = self.midlayer(embeds, hidden, cos, sin, kv_caches[0], md)
        return self.norm(out), out, [kv]

    def draft_ids(self, hidden, target):
        """Greedy draft token ids (the target's vocabulary) from logits-side hidden [N, H]."""
        if self.lm_head is None:
            logits = target.compute_logits(hidden)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if self.d2t is not None:
            ids = ids + self.d2t[...][ids]
        return ids


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3))


def _checkpoint(model_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = [f for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")]
    if not files:
        bins = [f for f in os.listdir(model_dir) if f.endswith(".bin")]
        hint = " (pytorch_model.bin checkpoints: convert them to safetensors)" if bins else ""
        raise ValueError(f"speculative_config.model: no .safetensors file in {model_dir}{hint}")
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(model_dir, f)))
    # Some EAGLE checkpoints prefix their names with "model.".
    return {k[6:] if k.startswith("model.") else k: v for k, v in tensors.items()}


def load_eagle_head(model_dir: str, method: str, target_config: ModelConfig, *, dtype: str,
                    attention_backend: str) -> EagleHead:
    """The head in `model_dir` (config.json + safetensors) for a target of `target_config`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    raw.setdefault("architectures", ["LlamaForCausalLM"])
    raw["architectures"] = ["LlamaForCausalLM"]  # the head's layer is a Llama layer
    raw.setdefault("vocab_size", target_config.vocab_size)
    cfg = ModelConfig.from_hf_dict(raw)
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model has vocab_size={cfg.vocab_size}, the target "
                         f"{target_config.vocab_size}")
    tensors = _checkpoint(model_dir)
    eagle_cfg = raw.get("eagle_config") or {}
    aux = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
                or default_aux_layers(target_config.num_hidden_layers))
    if method == "eagle3" and any(not 0 <= i < target_config.num_hidden_layers for i in aux):
        raise ValueError(f"EAGLE-3 aux hidden-state layers {aux} are outside the target's "
                         f"{target_config.num_hidden_layers} layers")
    spec = EagleSpec(
        method=method, aux_layers=aux if method == "eagle3" else (),
        draft_vocab_size=int(raw.get("draft_vocab_size") or cfg.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or target_config.hidden_size),
        fc_bias="fc.bias" in tensors, has_embed="embed_tokens.weight" in tensors,
        has_lm_head="lm_head.weight" in tensors,
        norm_before_residual=bool(raw.get("norm_before_residual", False)))
    if method == "eagle3" and not spec.has_lm_head:
        raise ValueError("speculative_config.model: an EAGLE-3 checkpoint needs lm_head.weight")
    if spec.target_hidden_size != target_config.hidden_size or (
            method == "eagle" and cfg.hidden_size != target_config.hidden_size):
        raise ValueError(f"speculative_config.model was trained for hidden size "
                         f"{spec.target_hidden_size}, the target has {target_config.hidden_size}")
    if cfg.hidden_size != target_config.hidden_size and not spec.has_embed:
        raise ValueError("speculative_config.model: its hidden size differs from the target's "
                         "and it has no embed_tokens of its own")
    jdt = array_dtype(dtype)
    head = EagleHead(cfg, spec, dtype=jdt, attention_backend=attention_backend,
                     rngs=nnx.Rngs(0))
    flat = nnx.to_flat_state(nnx.state(head))
    names = {".".join(str(p) for p in path): var for path, var in flat}
    sources = {name: checkpoint_names(name, var) for name, var in names.items()}
    missing = sorted({src for srcs in sources.values() for src in srcs} - set(tensors))
    if missing:
        raise ValueError(f"EAGLE checkpoint in {model_dir} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, var in names.items():
        if name == "d2t":
            var.set_value(jnp.asarray(tensors[name].astype(np.int32)))
            continue
        _, hf = declared(var)
        parts = []
        for i, src in enumerate(sources[name]):
            t = tensors[src].T if hf.transpose else tensors[src]
            want = source_shape(var, i, cfg.head_dim)
            if tuple(t.shape) != tuple(want):
                raise ValueError(f"EAGLE tensor {src!r} has shape {tuple(t.shape)} (after "
                                 f"transposing [out, in]), the head expects {tuple(want)}")
            parts.append(t)
        t = fuse(var, parts, cfg.head_dim)
        var.set_value(jnp.asarray(to_param_layout(var, t.astype(var.dtype))))
    nnx.update(head, nnx.from_flat_state(flat))
    return head

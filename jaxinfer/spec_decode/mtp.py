"""DeepSeek-V3's multi-token prediction (MTP) layer as a speculative-decoding drafter
(speculative_config method "mtp", vLLM's name; "deepseek_mtp" is its former one).

A DeepSeek-V3 checkpoint stores num_nextn_predict_layers MTP layers after its decoder layers,
as model.layers.{n} with n = num_hidden_layers: embed_tokens (the model's, repeated), enorm,
hnorm, eh_proj [H, 2H], one DeepSeek decoder layer (latent attention and MoE, under the same
names as any other layer) and shared_head.{norm, head}. It drafts like an EAGLE head
(runner/spec_step.py: eagle_propose): at position p it reads the token at p + 1 and the
target's final (normed) hidden state at p,

    x = eh_proj([enorm(embed(token)), hnorm(hidden)])    (the embedding zeroed at position 0)
    out = decoder_layer(x)                                 (its own latent KV cache)
    logits = shared_head.head(shared_head.norm(out))

and `out` is the hidden state of the next draft: num_speculative_tokens > 1 runs the one
layer again on its own output (as vLLM does: DeepSeek trained one MTP depth). Greedy drafts;
the rejection sampler keeps the output distribution the target's."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.config.features import check_mtp_target
from jaxinfer.config.dtypes import dtype as array_dtype
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.cpu_kernels import use_packed_weights
from jaxinfer.layers.linear import Embedding, Linear
from jaxinfer.layers.norms import RMSNorm

class SharedHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs, packed: bool, has_head: bool):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.head = (Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                            rngs=rngs, packed=packed) if has_head else None)


class MTPHead(nnx.Module):
    """One MTP layer with the EAGLE head's interface (combine, __call__, draft_ids)."""

    method = "mtp"
    aux_layers = ()
    num_kv_layers = 1

    def __init__(self, cfg: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs,
                 has_embed: bool = True, has_head: bool = True):
        from jaxinfer.models.deepseek_v3 import DeepseekV3DecoderLayer

        self.config = cfg
        h = cfg.hidden_size
        packed = use_packed_weights(attention_backend, dtype, None)
        self.embed_tokens = (Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
                             if has_embed else None)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * h, h, use_bias=False, dtype=dtype, rngs=rngs, packed=packed)
        self.mtp_block = DeepseekV3DecoderLayer(
            cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
            layer_idx=cfg.num_hidden_layers, packed=packed)
        self.shared_head = SharedHead(cfg, dtype=dtype, rngs=rngs, packed=packed,
                                      has_head=has_head)

    def combine(self, target_hidden):
        return target_hidden  # (the target's final normed hidden states, as vLLM's)

    def __call__(self, input_ids, positions, hidden, kv_caches, md: AttentionMetadata, target):
        """One pass over T tokens -> (logits-side hidden [T, H], next-step hidden [T, H],
        kv_caches)."""
        from jaxinfer.models.deepseek_v3 import DeepseekV3ForCausalLM

        embed = self.embed_tokens if self.embed_tokens is not None else \
            target.model.embed_tokens
        embeds = jnp.where((positions == 0)[:, None], 0, embed(input_ids))
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        cos, sin = DeepseekV3ForCausalLM.rope_tables(self.config, positions)
        out, kv = self.mtp_block(x, cos, sin, kv_caches[0], md)
        return self.shared_head.norm(out), out, [kv]

    def draft_ids(self, hidden, target):
        """Greedy draft token ids from logits-side hidden [N, H]."""
        head = self.shared_head.head
        logits = target.compute_logits(hidden) if head is None else head(hidden)
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def load_mtp_head(model_dir: str, target_config: ModelConfig, *, dtype: str,
                  attention_backend: str) -> MTPHead:
    """The MTP layer of the checkpoint in model_dir (model.layers.{num_hidden_layers}.*) for
    a target of `target_config`. Its embed_tokens and shared_head.head are the target's when
    the checkpoint leaves them out."""
    from jaxinfer.models.loader import _safetensors_index, load_module

    check_mtp_target(target_config)
    prefix = f"model.layers.{target_config.num_hidden_layers}."
    files = _safetensors_index(model_dir)
    if prefix + "eh_proj.weight" not in files:
        raise ValueError(f"speculative_config.method='mtp': the checkpoint in {model_dir} has "
                         f"no MTP layer ({prefix}eh_proj.weight is missing)")
    jdt = array_dtype(dtype)

    def make():
        return MTPHead(target_config, dtype=jdt, attention_backend=attention_backend,
                       rngs=nnx.Rngs(0), has_embed=prefix + "embed_tokens.weight" in files,
                       has_head=prefix + "shared_head.head.weight" in files)

    def rename(src: str) -> str:  # (the block's tensors sit beside the MTP layer's own)
        return prefix + src.removeprefix("mtp_block.")

    return load_module(make, model_dir, target_config, rename=rename)

"""Random EAGLE / EAGLE-3 heads in the HF EAGLE checkpoint layout, for tests."""

from __future__ import annotations

import json
import os

import numpy as np


def _layer(prefix, h, inter, n_heads, n_kv, hd, attn_in, rng, scale):
    w = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    return {
        f"{prefix}.self_attn.q_proj.weight": w(n_heads * hd, attn_in),
        f"{prefix}.self_attn.k_proj.weight": w(n_kv * hd, attn_in),
        f"{prefix}.self_attn.v_proj.weight": w(n_kv * hd, attn_in),
        f"{prefix}.self_attn.o_proj.weight": w(h, n_heads * hd),
        f"{prefix}.mlp.gate_proj.weight": w(inter, h),
        f"{prefix}.mlp.up_proj.weight": w(inter, h),
        f"{prefix}.mlp.down_proj.weight": w(h, inter),
        f"{prefix}.post_attention_layernorm.weight": np.ones(h, np.float32),
    }


def make_eagle_dir(path, method: str, hidden: int, vocab: int, *, seed: int = 0,
                   draft_vocab: int | None = None, aux_layers=None, scale: float = 0.15,
                   with_embed: bool = False):
    """EAGLE: fc [H, 2H] + layers.0 (no input_layernorm). EAGLE-3: fc [H, 3H] + midlayer
    (2H-wide q/k/v, input_layernorm, hidden_norm) + norm + lm_head [draft_vocab, H] (+ d2t)."""
    rng = np.random.default_rng(seed)
    h, inter, n_heads, n_kv, hd = hidden, 2 * hidden, 4, 2, hidden // 4
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else
                             "EAGLEModel"],
           "hidden_size": h, "intermediate_size": inter, "num_attention_heads": n_heads,
           "num_key_value_heads": n_kv, "num_hidden_layers": 1, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0}
    t = {}
    if method == "eagle":
        t["fc.weight"] = (rng.standard_normal((h, 2 * h)) * scale).astype(np.float32)
        t.update(_layer("layers.0", h, inter, n_heads, n_kv, hd, h, rng, scale))
    else:
        dv = draft_vocab or vocab
        cfg["draft_vocab_size"] = dv
        if aux_layers is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
        n_aux = len(aux_layers) if aux_layers is not None else 3
        t["fc.weight"] = (rng.standard_normal((h, n_aux * h)) * scale).astype(np.float32)
        t.update(_layer("midlayer", h, inter, n_heads, n_kv, hd, 2 * h, rng, scale))
        t["midlayer.input_layernorm.weight"] = np.ones(h, np.float32)
        t["midlayer.hidden_norm.weight"] = np.ones(h, np.float32)
        t["norm.weight"] = np.ones(h, np.float32)
        t["lm_head.weight"] = (rng.standard_normal((dv, h)) * scale).astype(np.float32)
        if dv != vocab:  # draft id j -> target id j + d2t[j]: every other target token
            t["d2t"] = np.arange(dv, dtype=np.int64)
    if with_embed:
        t["embed_tokens.weight"] = (rng.standard_normal((vocab, h)) * scale).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    from safetensors.numpy import save_file

    save_file(t, os.path.join(path, "model.safetensors"))
    return str(path)


def make_permutation_target(path, smollm2_dir, perm: np.ndarray):
    """A 64-token llama whose greedy next token is perm[current]: one-hot embeddings
    (hidden = vocab = 64), attention and MLP outputs zeroed, lm_head row v = e[perm^-1(v)]."""
    import torch

    from tests.engine.conftest import make_tiny_model_dir

    n = len(perm)
    hf = make_tiny_model_dir(path, "llama", smollm2_dir, vocab_size=n, hidden_size=n,
                             tie_word_embeddings=False)
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(torch.eye(n))
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.lm_head.weight.copy_(torch.eye(n)[np.argsort(perm)])
    hf.save_pretrained(path)
    return hf


def make_copying_eagle_dir(path, method: str, perm: np.ndarray):
    """Heads for make_permutation_target that draft from the right inputs. EAGLE: its output is
    the embedding of the token it reads (fc = [I, 0], layer outputs zeroed), so through the
    target's LM head it drafts perm[token]: every draft right, at every position, exactly when
    the head reads token p+1 at position p and its own drafts afterwards. EAGLE-3: its output
    is the target's residual stream entering layer 0 (the embedding of the token at p: fc =
    [I, 0, 0]) and its lm_head applies perm twice: the first draft is right, later ones (which
    carry the same hidden state) are not."""
    n = len(perm)
    make_eagle_dir(path, method, n, n, aux_layers=[0, 1, 1] if method == "eagle3" else None)
    from safetensors.numpy import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    eye = np.eye(n, dtype=np.float32)
    prefix = "layers.0" if method == "eagle" else "midlayer"
    t[f"{prefix}.self_attn.o_proj.weight"][:] = 0
    t[f"{prefix}.mlp.down_proj.weight"][:] = 0
    if method == "eagle":
        t["fc.weight"] = np.concatenate([eye, np.zeros_like(eye)], axis=1)
    else:
        t["fc.weight"] = np.concatenate([eye, np.zeros_like(eye), np.zeros_like(eye)], axis=1)
        t["lm_head.weight"] = eye[np.argsort(perm[perm])]
    save_file(t, f)
    return str(path)

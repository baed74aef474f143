"""Write a GGUF of random weights in the shape an HF config.json describes (Llama, Qwen2 and
Qwen3 families), for llama.cpp on a config without a checkpoint (the dummy weights
`compare_cpu.py --model benchmarks/configs/qwen3-0.6b` gives jaxinfer and vLLM).

The values do not matter to a speed comparison (greedy, EOS ignored), only the shapes and
dtypes do: matrices BF16 (or F32), 1-D tensors (norms, biases) F32 as llama.cpp's own
converter leaves them. The vocabulary is llama.cpp's "none" kind (vocab_size dummy tokens): the
benchmarks feed token ids. Needs the `gguf` package (test extra).
Usage: python benchmarks/peers/gguf_dummy.py CONFIG_DIR OUT.gguf [bf16|f32]
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

# HF architecture -> llama.cpp's architecture name
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _tensors(c: dict, arch: str):
    """(name, numpy shape: outermost first, as GGUF's readers give it) of every tensor."""
    h, ff, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hq, hkv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // hq
    yield "token_embd.weight", (c["vocab_size"], h)
    yield "output_norm.weight", (h,)
    if not c.get("tie_word_embeddings", False):
        yield "output.weight", (c["vocab_size"], h)
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,)
        for name, rows in (("attn_q", hq * d), ("attn_k", hkv * d), ("attn_v", hkv * d)):
            yield b + name + ".weight", (rows, h)
            if arch == "qwen2":
                yield b + name + ".bias", (rows,)
        if arch == "qwen3":
            yield b + "attn_q_norm.weight", (d,)
            yield b + "attn_k_norm.weight", (d,)
        yield b + "attn_output.weight", (h, hq * d)
        yield b + "ffn_norm.weight", (h,)
        yield b + "ffn_gate.weight", (ff, h)
        yield b + "ffn_up.weight", (ff, h)
        yield b + "ffn_down.weight", (h, ff)


def write_dummy(config_dir: str, dst: str, kind: str = "bf16", seed: int = 0) -> str:
    import gguf

    try:
        from benchmarks.peers.gguf_f32 import add_weight, write_out
    except ImportError:  # (run as a script from its folder)
        from gguf_f32 import add_weight, write_out

    if kind not in ("bf16", "f32"):
        raise ValueError(f"kind={kind!r}: bf16 or f32")
    with open(os.path.join(config_dir, "config.json")) as f:
        c = json.load(f)
    hf_arch = (c.get("architectures") or ["?"])[0]
    if hf_arch not in ARCHS:
        raise ValueError(f"{hf_arch}: only {', '.join(ARCHS)} configs")
    arch = ARCHS[hf_arch]
    hq = c["num_attention_heads"]
    d = c.get("head_dim") or c["hidden_size"] // hq
    w = gguf.GGUFWriter(dst, arch)
    w.add_name(os.path.basename(os.path.normpath(config_dir)) + " (random weights)")
    w.add_context_length(c.get("max_position_embeddings", 2048))
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(hq)
    w.add_head_count_kv(c.get("num_key_value_heads", hq))
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16"
                    else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("none")
    w.add_vocab_size(c["vocab_size"])
    rng = np.random.default_rng(seed)
    for name, shape in _tensors(c, arch):
        if len(shape) == 1:
            # norms ~1, biases ~0: activations stay in range through every layer
            t = np.ones(shape, np.float32) if name.endswith("norm.weight") else \
                np.zeros(shape, np.float32)
            w.add_tensor(name, t)
            continue
        add_weight(w, name, rng.standard_normal(shape, np.float32) * np.float32(0.02), kind)
    return write_out(w, dst)


if __name__ == "__main__":
    print(write_dummy(sys.argv[1], sys.argv[2], *sys.argv[3:4]))

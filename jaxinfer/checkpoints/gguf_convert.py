"""Convert a Llama-family GGUF file into an HF model folder, without torch.

Writes config.json, generation_config.json, model.safetensors (float32, dequantized with the
`gguf` package; llama.cpp's rotary row permutation of q/k undone), tokenizer.json (built from
the GGUF vocabulary and merges with `tokenizers`) and tokenizer_config.json (chat template).

keep_quantized (quantization="gguf"): the decoder projections stay quantized instead, as int8
values q with a float32 scale d and offset m per group of G input columns (w = q * d + m:
every supported block type is exactly that: Q8_0 / Q4_0 / Q4_1 and the K-quants' sub-blocks,
G = 32, or 16 when a Q6_K tensor is present), `weight` / `weight_scale` / `weight_offset` with
a `quantization_config` {"quant_method": "gguf", "group_size": G}. q, d and m are read back
through the `gguf` package's own dequantization (the block with its quant bits cleared gives
m; with every value 1, d + m), so its decoding of each layout is the definition.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np

SUPPORTED_ARCHS = ("llama",)
# GGUF pre-tokenizer names -> how HF's tokenizer.json splits text before BPE.
SUPPORTED_PRE = ("default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFConversionError(ValueError):
    pass


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half rotary layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (rotate-half -> interleaved); the inverse of unpermute_rotary."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: str):
    import gguf

    if not os.path.isfile(path):
        raise GGUFConversionError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on bad bytes
        raise GGUFConversionError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _require(reader, key):
    v = _field(reader, key)
    if v is None:
        raise GGUFConversionError(f"GGUF metadata is missing {key!r}")
    return v


def _config(reader) -> dict:
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tokens = _require(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(a("attention.head_count_kv", n_heads)),
        "head_dim": int(a("rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(a("context_length", 2048)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": int(a("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling_type = a("rope.scaling.type")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise GGUFConversionError(f"GGUF rope.scaling.type={scaling_type!r} is not supported")
    return cfg


# Kept block types: group size, and the byte ranges of a block holding quant bits with the
# byte each takes for "every value 1" (a nibble pair 0x11, a high-bit byte 0x00).
KEPT_TYPES = {
    "Q8_0": (32, [(2, 34, 0x01)]),
    "Q4_0": (32, [(2, 18, 0x11)]),
    "Q4_1": (32, [(4, 20, 0x11)]),
    "Q4_K": (32, [(16, 144, 0x11)]),
    "Q5_K": (32, [(16, 48, 0x00), (48, 176, 0x11)]),
    "Q6_K": (16, [(0, 128, 0x11), (128, 192, 0x00)]),
}


def gguf_groups(data: np.ndarray, qtype, shape: tuple[int, int], group: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A quantized GGUF tensor (raw blocks, [rows, bytes per row]) -> q int8 [rows, cols],
    scale and offset float32 [rows, cols / group], with q * scale + offset = gguf's
    dequantization (to float32 rounding)."""
    import gguf
    from gguf.quants import dequantize

    name = qtype.name
    if name not in KEPT_TYPES:
        raise GGUFConversionError(f"GGUF tensor type {name} cannot be kept quantized "
                                  f"(supported: {', '.join(KEPT_TYPES)})")
    _, ranges = KEPT_TYPES[name]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data, np.uint8).reshape(-1, type_size)  # one row per block
    zero, one = raw.copy(), raw.copy()
    for lo, hi, byte in ranges:
        zero[:, lo:hi] = 0
        one[:, lo:hi] = byte
    rows, cols = shape

    def deq(blocks):
        return np.asarray(dequantize(blocks.reshape(data.shape), qtype),
                          np.float32).reshape(rows, cols)

    w, w0, w1 = deq(raw), deq(zero), deq(one)
    step = w1 - w0  # per element: its group's scale
    scale, offset = step[:, ::group].copy(), w0[:, ::group].copy()
    if not (np.array_equal(np.repeat(scale, group, 1), step)
            and np.array_equal(np.repeat(offset, group, 1), w0)):
        raise GGUFConversionError(f"GGUF {name} tensor: scales are not constant over groups "
                                  f"of {group}")
    safe = np.where(step == 0, 1.0, step)
    q = np.where(step == 0, 0.0, np.rint((w - w0) / safe))
    if q.min() < -128 or q.max() > 127:
        raise GGUFConversionError(f"GGUF {name} tensor: values outside int8")
    return q.astype(np.int8), scale, offset


def _tensors(reader, cfg, keep_quantized: bool = False) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    group = 32
    by_name = {t.name: t for t in reader.tensors}
    head_kept = False
    if keep_quantized:
        kinds = {t.tensor_type.name for t in reader.tensors
                 if re.fullmatch(r"blk\.\d+\.(attn_[qkv]|attn_output|ffn_(gate|up|down))\.weight",
                                 t.name)}
        bad = sorted(kinds - set(KEPT_TYPES))
        if bad:
            raise GGUFConversionError(f"quantization='gguf': projection tensors of type "
                                      f"{', '.join(bad)} cannot be kept quantized (supported: "
                                      f"{', '.join(KEPT_TYPES)}); load it without "
                                      "quantization='gguf' (converted to float)")
        # The LM head too (llama.cpp's output matmul reads it quantized): output.weight, or
        # a tied model's token_embd, then kept quantized as the embedding (the cpu backend's
        # packed tied head serves the lookups from it; elsewhere it is dequantized at load);
        # left float when its type cannot be kept.
        head = by_name.get("output.weight", by_name.get("token_embd.weight"))
        head_kept = head is not None and head.tensor_type.name in KEPT_TYPES
        if head_kept:
            kinds.add(head.tensor_type.name)
        group = min(KEPT_TYPES[k][0] for k in kinds) if kinds else 32
        cfg["quantization_config"] = {"quant_method": "gguf", "group_size": group,
                                      "modules_to_not_convert": [] if head_kept
                                      else ["lm_head"]}
    out = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m:
            if m.group(2) not in _LAYER_MAP:
                if m.group(2).startswith("rope_freqs"):
                    raise GGUFConversionError("GGUF rope_freqs (llama3 rope scaling) not supported")
                continue
            name = f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
        elif t.name in _GLOBAL_MAP:
            name = _GLOBAL_MAP[t.name]
        else:
            continue
        # GGUF shapes are innermost-first; numpy order is the reverse ([out, in] as HF).
        shape = tuple(int(x) for x in reversed(t.shape))
        tied_head = t.name == "token_embd.weight" and "output.weight" not in by_name
        if keep_quantized and (name.endswith("_proj.weight") or (
                name == "lm_head.weight" or tied_head) and head_kept):
            parts = dict(zip(("", "_scale", "_offset"),
                             gguf_groups(t.data, t.tensor_type, shape, group)))
        else:
            parts = {"": np.asarray(dequantize(t.data, t.tensor_type),
                                    dtype=np.float32).reshape(shape)}
        for suffix, w in parts.items():
            if name.endswith("q_proj.weight"):
                w = unpermute_rotary(w, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                w = unpermute_rotary(w, cfg["num_key_value_heads"])
            out[name + suffix] = np.ascontiguousarray(w)
    if "model.embed_tokens.weight" not in out:
        raise GGUFConversionError("GGUF has no token_embd.weight tensor")
    return out


def _tokenizer(reader):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _require(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise GGUFConversionError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})"
        )
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in ("llama-bpe", "llama3"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == _TOKEN_TYPE_USER_DEFINED]
    tk.add_special_tokens(special)
    tk.add_tokens(user)
    return tk, tokens


def _tokenizer_config(reader, tokens, cfg) -> dict:
    def tok(key):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }


def convert_gguf(gguf_path: str, out_dir: str, keep_quantized: bool = False) -> str:
    """Convert `gguf_path` into an HF folder at `out_dir` (written atomically). Returns out_dir.
    keep_quantized: the decoder projections stay quantized (see the module docstring)."""
    from safetensors.numpy import save_file

    reader = _open(gguf_path)
    cfg = _config(reader)
    tensors = _tensors(reader, cfg, keep_quantized)
    tk, tokens = _tokenizer(reader)
    if tk.get_vocab_size() != cfg["vocab_size"]:
        cfg["vocab_size"] = max(cfg["vocab_size"], tk.get_vocab_size())
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    tk.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(reader, tokens, cfg), f, indent=2)
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir

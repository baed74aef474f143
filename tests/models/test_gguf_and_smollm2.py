"""GGUF conversion (a GGUF written here from a tiny HF Llama, and the real SmolLM2) vs HF."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from jaxinfer.checkpoints.default_model import ensure_default_model, find_default_gguf  # noqa: E402
from jaxinfer.checkpoints.gguf_convert import (  # noqa: E402
    GGUFConversionError, convert_gguf, permute_rotary, unpermute_rotary)
from jaxinfer.models.loader import load_model  # noqa: E402
from tests.helpers import PagedRunner, rel_err  # noqa: E402

TOKENIZER_STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 1234567890 digits.",
    "tabs\tand   runs of    spaces\n\n\nnew lines",
    "ünïcödé — naïve café, 日本語のテキスト, emoji 🤗🚀",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "   leading and trailing   ",
]


def _byte_tokens():
    """The 256 byte-level BPE symbols in GPT-2's order (printable bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _write_tiny_gguf(path, hf, cfg):
    """A GGUF as llama.cpp would write it: q/k rows permuted, F32 tensors, BPE vocab."""
    tokens = _byte_tokens() + ["Ġt", "he", "Ġthe", "<|end|>"]
    types = [1] * (len(tokens) - 1) + [3]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, p in hf.state_dict().items():
        arr = p.detach().numpy().astype(np.float32)
        if name in names:
            out = names[name]
        else:
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            out = f"blk.{i}.{layer[rest]}.weight"
            if rest == "self_attn.q_proj":
                arr = permute_rotary(arr, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj":
                arr = permute_rotary(arr, cfg.num_key_value_heads)
        w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    d = tmp_path_factory.mktemp("gguf")
    _write_tiny_gguf(d / "tiny.gguf", hf, cfg)
    out = convert_gguf(str(d / "tiny.gguf"), str(d / "hf"))
    return hf, d, out


def test_unpermute_inverts_permute():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(unpermute_rotary(permute_rotary(w, 4), 4), w)
    assert not np.array_equal(permute_rotary(w, 4), w)


def test_converted_tiny_gguf_matches_original_weights_and_logits(tiny_gguf):
    hf, _, out = tiny_gguf
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    orig = hf.state_dict()
    for name, p in back.state_dict().items():
        assert torch.equal(p, orig[name]), name
    model, _, _ = load_model(out, dtype="float32")
    ids = [5, 77, 200, 3, 9, 100, 250]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(PagedRunner(model).step({"s": ids})["s"], ref) < 1e-4


def test_converted_tiny_tokenizer_uses_merges_and_specials(tiny_gguf):
    _, d, out = tiny_gguf
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("the the<|end|>")["input_ids"]
    assert ids == [116, 257, 258, 259]  # "t", "he" (merged), "Ġthe" (two merges), special
    assert tok.decode(ids) == "the the<|end|>"
    ref = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="tiny.gguf")
    for s in TOKENIZER_STRINGS:
        assert tok(s)["input_ids"] == ref(s)["input_ids"], s


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(GGUFConversionError, match="not a readable GGUF"):
        convert_gguf(str(bad), str(tmp_path / "out"))
    with pytest.raises(GGUFConversionError, match="does not exist"):
        convert_gguf(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
    _, d, _ = tiny_gguf
    data = (d / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFConversionError):
        convert_gguf(str(cut), str(tmp_path / "out"))


# ---- the real embedded model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir():
    return ensure_default_model()


def test_smollm2_prefill_logits_match_hf(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    model, _, _ = load_model(smollm2_dir, dtype="float32")
    ours = PagedRunner(model, block_size=16, max_blocks=8).step({"p": ids})["p"]
    assert rel_err(ours, ref) < 1e-4
    assert ours[-1].argmax() == ref[-1].argmax()


def test_smollm2_tokenizer_roundtrip_and_matches_hf_gguf_tokenizer(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    path = find_default_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    for s in TOKENIZER_STRINGS:
        ids = tok(s)["input_ids"]
        assert ids == ref(s)["input_ids"], s
        assert tok.decode(ids) == s
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

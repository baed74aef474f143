"""Engine test fixtures: the real SmolLM2 and tiny random HF models with its tokenizer."""

from __future__ import annotations

import os
import shutil
import zlib

import pytest


def assert_no_leaks(llm):
    """After every engine test: no request left and every KV block back in the pool."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    # In the engine core (its process, or this one): no request, no block list, every block
    # free, no step in flight.
    assert eng.call_utility("leak_report") == []
    assert not eng.output_processor.requests and not eng.output_processor.child_to_parent


def hf_greedy(hf, ids, n):
    """HF transformers' greedy continuation through its own KV cache (eos ignored)."""
    import torch

    out_ids = []
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    torch = pytest.importorskip("torch")
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32).eval()


def make_tiny_model_dir(path, arch, smollm2_dir, sharpen: float = 1.0, **overrides):
    """A random-initialised tiny HF model of `arch` using SmolLM2's tokenizer files.

    `sharpen` scales the final norm weight, hence the logits: a peakier next-token distribution.
    """
    torch = pytest.importorskip("torch")
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "gemma3": transformers.Gemma3TextConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig,
           "gpt_oss": transformers.GptOssConfig,
           "deepseek_v3": transformers.DeepseekV3Config}[arch]
    cfg = cls(**common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(zlib.crc32(arch.encode()))  # str hash() differs per process
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights: a peaky distribution, so greedy has clear winners
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "norm" not in name:
                p.normal_(0.0, 0.1)
        hf.model.norm.weight.mul_(sharpen)
    hf.save_pretrained(path)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2_dir, fn), os.path.join(path, fn))
    return hf


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """The real SmolLM2 in float32, shared by the tests of one module."""
    from jaxinfer import LLM

    llm = LLM(smollm2_dir, dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=128, warmup=False, num_kv_blocks=200,
              block_size=16)  # (16-token blocks: the short prompts fill some, prefix hits)
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()  # its engine-core process


def check_family_engine_greedy(model_dir, hf, backend, **engine_kwargs):
    """A tiny family's engine (float32, `backend`, engine_kwargs) gives HF's greedy tokens
    through chunked prefill (16-token steps, prompts longer), preemption (10 blocks of 8) and
    a prefix-cache hit; returns the LLM for more checks."""
    from jaxinfer import LLM
    from jaxinfer.layers import cpu_kernels
    from tests.engine.test_llm_greedy import N_TOKENS, PROMPTS, _check

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=6,
              max_num_batched_tokens=16, long_prefill_token_threshold=8, warmup=False,
              num_kv_blocks=10, block_size=8, attention_backend=backend,
              enable_multiprocessing=False, **engine_kwargs)
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:8]
    assert max(len(tok(p)["input_ids"]) for p in prompts) > 16
    refs = {p: hf_greedy(hf, tok(p)["input_ids"], N_TOKENS) for p in prompts}
    _check(llm, prompts, refs)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    # The longest prompt again, twice: the second finds its full blocks cached (the first
    # may not: the tight cache can have reused them).
    _check(llm, prompts[4:5], refs)
    before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    _check(llm, prompts[4:5], refs)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > before
    return llm

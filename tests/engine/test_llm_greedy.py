"""Greedy outputs equal HF transformers token for token (float32), under every scheduling path."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, hf_greedy, make_tiny_model_dir

torch = pytest.importorskip("torch")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three primary colours are",
    "Once upon a time, in a small village by the river, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain photosynthesis in one sentence:",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Q: What is 12 times 12?\nA:",
    "The best thing about Paris in spring is",
    "List: apples, oranges,",
    "Hello",
    "In 1969, the first humans landed on",
    "Translate to French: good morning ->",
    "The three laws of thermodynamics state that energy cannot be created or destroyed, that",
    "My favourite programming language is",
]
N_TOKENS = 12


@pytest.fixture(scope="module")
def hf_refs(smol, smollm2_hf):
    tok = smol.get_tokenizer()
    return {p: hf_greedy(smollm2_hf, tok(p)["input_ids"], N_TOKENS) for p in PROMPTS}


GREEDY = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)


def _check(llm, prompts, refs):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[p], p
        assert o.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)
    return outs


def test_smollm2_continuous_batching_matches_hf(smol, hf_refs):
    outs = _check(smol, PROMPTS, hf_refs)
    tok = smol.get_tokenizer()
    assert outs[0].outputs[0].text == tok.decode(hf_refs[PROMPTS[0]])
    assert [o.prompt for o in outs] == PROMPTS  # input order


def test_smollm2_prefix_cache_hits_match_hf(smol, hf_refs):
    before = smol.llm_engine.get_stats()["prefix_cache_hits"]
    _check(smol, PROMPTS[:6], hf_refs)  # the same prompts again: their blocks are cached
    assert smol.llm_engine.get_stats()["prefix_cache_hits"] > before


def test_smollm2_preemption_matches_hf(smollm2_dir, hf_refs):
    # In this process: every request is queued before the first step. (With the core in its
    # own process it starts on the first request while the rest are still being tokenized; on
    # a loaded machine the early ones may finish before the late ones arrive: no preemption.)
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=128, warmup=False, num_kv_blocks=12, block_size=16,
              enable_prefix_caching=False, enable_multiprocessing=False)
    _check(llm, PROMPTS[:10], hf_refs)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0


def test_smollm2_chunked_prefill_matches_hf(smollm2_dir, hf_refs):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, warmup=False, num_kv_blocks=64,
              long_prefill_token_threshold=8)
    long_prompts = [p for p in PROMPTS if len(llm.get_tokenizer()(p)["input_ids"]) > 10]
    assert len(long_prompts) >= 2
    _check(llm, long_prompts + PROMPTS[:2], hf_refs)


@pytest.mark.parametrize("arch,extra", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"num_key_value_heads": 1, "rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
    ("gemma3", {"head_dim": 16, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]}),
])
def test_tiny_architectures_greedy_match_hf(tmp_path, smollm2_dir, arch, extra):
    hf = make_tiny_model_dir(tmp_path, arch, smollm2_dir, **extra)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, warmup=False, num_kv_blocks=40)
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:6]
    refs = {p: hf_greedy(hf, tok(p)["input_ids"], N_TOKENS) for p in prompts}
    _check(llm, prompts, refs)


@pytest.mark.parametrize("backend", [None, "xla"])
def test_cpu_default_and_xla_backends_match_hf_with_sliding_window(tmp_path, smollm2_dir,
                                                                   backend):
    """The default backend on CPU is the C++ kernel ("cpu"); "xla" stays selectable; both give
    HF's greedy tokens, here with a sliding window shorter than the prompts."""
    from jaxinfer.layers import cpu_kernels

    hf = make_tiny_model_dir(tmp_path, "mistral", smollm2_dir, sliding_window=8)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, warmup=False, num_kv_blocks=40,
              attention_backend=backend)
    want = backend or ("cpu" if cpu_kernels.available() else "xla")
    assert llm.llm_engine.attention_backend == want
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:5]
    refs = {p: hf_greedy(hf, tok(p)["input_ids"], N_TOKENS) for p in prompts}
    _check(llm, prompts, refs)


def test_pallas_backend_interpret_matches_hf(tmp_path, smollm2_dir):
    """The engine with the Pallas kernel (interpret mode on CPU) gives HF's greedy tokens."""
    hf = make_tiny_model_dir(tmp_path, "llama", smollm2_dir, num_attention_heads=4,
                             num_key_value_heads=2)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, warmup=False, num_kv_blocks=40,
              attention_backend="pallas")
    assert llm.llm_engine.attention_backend == "pallas"
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:5]
    refs = {p: hf_greedy(hf, tok(p)["input_ids"], N_TOKENS) for p in prompts}
    _check(llm, prompts, refs)

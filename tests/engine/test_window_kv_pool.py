"""A model with sliding and full layers (a tiny gpt-oss, window 8) keeps its sliding layers'
KV in a pool of their own that frees blocks as the window moves (core/window_blocks.py):
HF's greedy tokens through long requests, chunked prefill, preemption, prefix hits, async
scheduling and n-gram drafts; the blocks each request holds there; the memory it frees for
the full layers."""

from __future__ import annotations

import pytest

from jaxinfer.sampling_params import SamplingParams
from tests.engine.conftest import assert_no_leaks, hf_greedy
from tests.engine.test_llm_greedy import PROMPTS
from tests.models.test_gpt_oss import _tiny_gpt_oss

N = 56  # tokens generated: prompts of ~20 tokens end ~9 windows long
WINDOW, BLOCK = 8, 8


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("gpt_oss_window")
    hf = _tiny_gpt_oss(path, smollm2_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [PROMPTS[4], PROMPTS[15], PROMPTS[8], PROMPTS[0]]
    refs = {p: hf_greedy(hf, tok(p)["input_ids"], N) for p in prompts}
    return path, prompts, refs


def _core(llm):
    return llm.llm_engine.engine_core.core


def _watch(core):
    """Per request, the most blocks it held in each pool at the end of a schedule() call."""
    sched, peak = core.scheduler, {}
    schedule = sched.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for rid, blocks in sched.kv.window.req_to_blocks.items():
            live = sum(not b.is_null for b in blocks)
            main = len(sched.kv.req_to_blocks[rid])
            old = peak.get(rid, (0, 0))
            peak[rid] = (max(old[0], main), max(old[1], live))
        return out

    sched.schedule = watched
    return peak


def _llm(path, backend="cpu", **kw):
    from jaxinfer import LLM
    from jaxinfer.layers import cpu_kernels

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    kw.setdefault("num_kv_blocks", 24)
    return LLM(str(path), dtype="float32", max_model_len=96, max_num_seqs=4,
               max_num_batched_tokens=16, long_prefill_token_threshold=8, warmup=False,
               block_size=BLOCK, attention_backend=backend, enable_multiprocessing=False, **kw)


def _check(llm, prompts, refs):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[p], p
    assert_no_leaks(llm)


@pytest.mark.parametrize("kw", [
    pytest.param({"async_scheduling": False}, id="sync"),
    pytest.param({"async_scheduling": True}, id="async"),
    pytest.param({"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1}}, id="ngram"),
])
def test_long_requests_free_out_of_window_blocks_and_keep_hf_tokens(gpt_oss, kw):
    path, prompts, refs = gpt_oss
    llm = _llm(path, **kw)
    core = _core(llm)
    window = core.scheduler.kv.window
    assert window is not None and llm.llm_engine.get_stats()["num_window_kv_blocks"] > 1
    # The sliding layers' caches (layers 0 and 2) have the window pool's blocks.
    caches = core.runner.kv_caches
    assert caches[0][0].shape[0] == caches[2][0].shape[0] == window.pool.num_blocks
    assert caches[1][0].shape[0] == core.runner.num_kv_blocks == 24
    peak = _watch(core)
    _check(llm, prompts, refs)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0  # 24 blocks for 4 x ~10
    # Each request ended ~10 blocks long in the full layers' pool, never holding more than the
    # window (7 tokens), a 16-token chunk (+ 3 drafts) and their ragged ends in the other.
    margin = 3 if "speculative_config" in kw else 0
    bound = -(-(WINDOW - 1 + 16 + 2 * margin) // BLOCK) + 2
    assert max(m for m, _ in peak.values()) >= 9
    assert max(w for _, w in peak.values()) <= bound
    # The same prompts again: prefix hits (both pools keep the freed blocks cached).
    before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    _check(llm, prompts[:1], refs)
    _check(llm, prompts[:1], refs)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > before
    llm.shutdown()


def test_one_pool_when_disabled_and_more_blocks_for_the_same_memory(gpt_oss):
    path, prompts, refs = gpt_oss
    budget = 4 << 20
    one = _llm(path, kv_cache_memory_bytes=budget, num_kv_blocks=None,
               disable_hybrid_kv_cache_manager=True)
    assert _core(one).scheduler.kv.window is None
    assert "num_window_kv_blocks" not in one.llm_engine.get_stats()
    _check(one, prompts[:2], refs)
    n_one = _core(one).runner.num_kv_blocks
    per_layer = lambda c: c[0].nbytes + c[1].nbytes  # noqa: E731
    held_one = sum(per_layer(c) for c in _core(one).runner.kv_caches)
    one.shutdown()
    two = _llm(path, kv_cache_memory_bytes=budget, num_kv_blocks=None)
    core = _core(two)
    n_window = core.scheduler.kv.window.pool.num_blocks
    # Per block: 2 sliding layers and 1 full one. The full layers' pool gets what the
    # sliding layers no longer hold: (budget - n_window x 2/3 of a block) / (1/3 of one).
    assert n_window < n_one
    assert core.runner.num_kv_blocks == (n_one - 1) * 3 - n_window * 2 + 1
    # The same bytes: one pool holds the budget + its null block in all 3 layers; the split
    # holds the budget + the full pool's null block (the sliding pool's is in its count).
    held = sum(per_layer(c) for c in core.runner.kv_caches)
    layer_block = per_layer(core.runner.kv_caches[1]) // core.runner.num_kv_blocks
    assert held_one <= budget + 3 * layer_block and held == held_one - 2 * layer_block
    _check(two, prompts[:2], refs)
    two.shutdown()


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow),
                                     pytest.param("reference", marks=pytest.mark.slow)])
def test_every_attention_backend_reads_the_sliding_pool(gpt_oss, backend):
    """The xla path, the Pallas kernel (interpret mode here) and the jnp reference give HF's
    tokens with the sliding layers on their own pool (the C++ kernel: the tests above)."""
    path, prompts, refs = gpt_oss
    llm = _llm(path, backend=backend)
    assert _core(llm).scheduler.kv.window is not None
    _check(llm, prompts[:2], refs)
    llm.shutdown()


def test_sleep_and_wake_up_bring_back_both_pools(gpt_oss):
    """Sleep level 1 frees both pools' caches; waking brings them back at their sizes and
    the prompts give HF's tokens again (the prefix cache forgotten in both pools)."""
    path, prompts, refs = gpt_oss
    llm = _llm(path, enable_sleep_mode=True)
    core = _core(llm)
    _check(llm, prompts[:1], refs)
    shapes = [(k.shape, v.shape) for k, v in core.runner.kv_caches]
    llm.sleep(1)
    assert not core.scheduler.kv.window.pool.cached_block_hash_to_block
    assert llm.wake_up()
    assert [(k.shape, v.shape) for k, v in core.runner.kv_caches] == shapes
    _check(llm, prompts[:2], refs)
    llm.shutdown()

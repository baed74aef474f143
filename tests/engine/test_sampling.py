"""Sampling: seeds, top-k/top-p/temperature statistics, penalties, logprobs, n > 1."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, hf_greedy, make_tiny_model_dir

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=3.0)
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=64,
              max_num_batched_tokens=256, warmup=False, num_kv_blocks=600, block_size=16)
    yield llm, hf
    assert_no_leaks(llm)
    llm.shutdown()  # its engine-core process


def test_seeded_sampling_is_independent_of_batch_companions(tiny):
    llm, _ = tiny
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=7) for s in range(5)]
    batch = llm.generate(["Hi", "The weather today", "Once upon", "x = ", "A", "B"],
                         [others[0], p, *others[1:]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    different = llm.generate("The weather today", p.clone(seed=99), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(tiny):
    llm, hf = tiny
    prompts = ["The weather today", "Count: 1 2 3", "def f(x):"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=8, seed=5,
                                                 ignore_eos=True), use_tqdm=False)
    for g, t in zip(greedy, topk1):
        assert g.outputs[0].token_ids == t.outputs[0].token_ids


def _reference_distribution(logits, temperature, top_p, top_k=0, min_p=0.0):
    """vLLM's order in numpy: temperature, min_p, top_k, then top_p over what is left."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    keep = ps >= min_p * ps[0]
    if top_k > 0:
        keep &= np.arange(len(ps)) < top_k
    kept = np.where(keep, ps, 0.0)
    kept /= kept.sum()
    keep &= (np.cumsum(kept) - kept) < top_p
    keep[0] = True
    out = np.zeros_like(p)
    out[order[keep]] = ps[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [(0.8, 0.9, 0, 0.0),
                                                           (1.5, 1.0, 20, 0.0),
                                                           (1.0, 1.0, 0, 0.05)])
def test_sampling_follows_reference_distribution(tiny, temperature, top_p, top_k, min_p):
    from scipy.stats import chi2

    llm, hf = tiny
    prompt = "The weather today"
    ids = llm.get_tokenizer()(prompt)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
    ref = _reference_distribution(logits, temperature, top_p, top_k, min_p)
    n = 1000
    out = llm.generate(prompt, SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                              top_k=top_k, min_p=min_p, max_tokens=1, seed=7),
                       use_tqdm=False)[0]
    toks = np.array([o.token_ids[0] for o in out.outputs])
    assert ref[toks].min() > 0, "sampled a token outside the allowed set"
    support = np.flatnonzero(ref)
    assert 5 <= len(support) < 1000  # a real choice, not a near-greedy or flat one
    counts = np.bincount(toks, minlength=len(ref))
    big = support[ref[support] * n >= 5]  # chi-square needs expected counts >= 5
    obs = np.append(counts[big], n - counts[big].sum())
    exp = np.append(ref[big] * n, n - ref[big].sum() * n)
    mask = exp > 0
    stat = float((((obs - exp) ** 2)[mask] / exp[mask]).sum())
    assert stat < chi2.ppf(0.9995, mask.sum() - 1), (stat, mask.sum())


def test_repetition_penalty_greedy_matches_hf(tiny):
    llm, hf = tiny
    ids = llm.get_tokenizer()("one two one two one two")["input_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                          repetition_penalty=2.0, eos_token_id=None, pad_token_id=0)
    ref = ref[0, len(ids):].tolist()
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=10, repetition_penalty=2.0,
                                      ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref
    plain = hf_greedy(hf, ids, 10)
    assert plain != ref  # the penalty changed something, so the comparison means something


def test_frequency_and_presence_penalties_numerics():
    import jax.numpy as jnp

    from jaxinfer.layers.sampler import SamplingMetadata, apply_penalties

    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    counts = np.array([[2, 0, 1, 0]], np.int32)
    prompt = np.array([[False, True, False, False]])
    md = SamplingMetadata(*(jnp.asarray(v) for v in (
        [1.0], [0], [1.0], [0.0], [2.0], [0.5], [0.25], np.array([0], np.uint32), [0])))
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts),
                                     jnp.asarray(prompt), md))
    want = np.array([[2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0]])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_logprobs_match_hf(tiny):
    llm, hf = tiny
    ids = llm.get_tokenizer()("The weather today")["input_ids"]
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    seq = list(ids)
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0, -1], -1).numpy()
        top3 = np.argsort(-ref)[:3]
        assert set(top3) <= set(lp) and tok in lp
        assert lp[tok].rank == 1 and abs(lp[tok].logprob - ref[tok]) < 1e-4
        for t in top3:
            assert abs(lp[int(t)].logprob - ref[t]) < 1e-4
        total += lp[tok].logprob
        seq.append(tok)
    assert abs(out.cumulative_logprob - total) < 1e-5


def test_n_samples_share_the_prompt_blocks(tiny):
    llm, _ = tiny
    prompt = {"prompt_token_ids": list(range(100, 150))}  # 50 tokens: 3 full blocks of 16
    hits0 = llm.llm_engine.get_stats()["prefix_cache_hits"]
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5,
                                              ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 5 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits0 == 3 * 48  # children 2..4 hit child 1's blocks


def test_prompt_logprobs_match_hf_across_chunks(tmp_path, smollm2_dir):
    path = tmp_path / "m"
    hf = make_tiny_model_dir(path, "qwen2", smollm2_dir)
    # A 16-token budget cuts the 40-token prompt into chunks: positions cross chunk boundaries.
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, warmup=False, num_kv_blocks=40)
    ids = list(range(1000, 1040))
    out = llm.generate([{"prompt_token_ids": ids}, "plain"],
                       [SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0),
                        SamplingParams(max_tokens=2)], use_tqdm=False)
    pl = out[0].prompt_logprobs
    assert out[1].prompt_logprobs is None
    assert len(pl) == len(ids) and pl[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    for i in range(1, len(ids)):
        d = pl[i]
        assert ids[i] in d and abs(d[ids[i]].logprob - ref[i - 1, ids[i]]) < 1e-4
        top2 = np.argsort(-ref[i - 1])[:2]
        assert all(int(t) in d for t in top2)
        # The rank, up to tokens within the logprob tolerance of the chosen one (near-ties).
        chosen = ref[i - 1, ids[i]]
        lo = 1 + int((ref[i - 1] > chosen + 1e-4).sum())
        hi = 1 + int((ref[i - 1] > chosen - 1e-4).sum()) - 1
        assert lo <= d[ids[i]].rank <= hi
    assert_no_leaks(llm)


def test_prompt_logprobs_once_per_position_through_preemption(tmp_path, smollm2_dir):
    """A preempted request recomputes its prompt from position 0 (prefix caching is off for
    it): the positions it had sent before are not sent again (each request's list is one
    entry per prompt token) and the values equal an unpreempted run's."""
    path = tmp_path / "m"
    make_tiny_model_dir(path, "llama", smollm2_dir)
    prompts = [{"prompt_token_ids": list(range(1000 + 50 * i, 1020 + 50 * i + i))}
               for i in range(4)]
    params = SamplingParams(max_tokens=20, prompt_logprobs=1, temperature=0, ignore_eos=True)
    outs = {}
    for blocks in (9, 60):
        llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=32, warmup=False, num_kv_blocks=blocks,
                  block_size=8, enable_multiprocessing=False)
        outs[blocks] = llm.generate(prompts, params, use_tqdm=False)
        assert (llm.llm_engine.get_stats()["num_preemptions"] > 0) == (blocks == 9)
        assert_no_leaks(llm)
        llm.shutdown()
    for tight, roomy, p in zip(outs[9], outs[60], prompts):
        ids = p["prompt_token_ids"]
        assert len(tight.prompt_logprobs) == len(ids) and tight.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(tight.prompt_logprobs[i][ids[i]].logprob
                       - roomy.prompt_logprobs[i][ids[i]].logprob) < 1e-5
        assert tight.outputs[0].token_ids == roomy.outputs[0].token_ids


def test_kv_cache_dtype_bfloat16(tmp_path, smollm2_dir):
    """kv_cache_dtype (vLLM's option): a bfloat16 cache under a float32 model holds twice the
    blocks for the same bytes; greedy tokens match the float32 cache on a peaky model."""
    import jax.numpy as jnp

    path = tmp_path / "m"
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=3.0)
    budget = 1 << 20
    outs, blocks = {}, {}
    for kvd in ("auto", "bfloat16"):
        llm = LLM(str(path), dtype="float32", kv_cache_dtype=kvd, max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=32, warmup=False,
                  kv_cache_memory_bytes=budget, enable_multiprocessing=False)
        runner = llm.llm_engine.runner
        assert runner.kv_caches[0][0].dtype == (jnp.bfloat16 if kvd == "bfloat16"
                                                else jnp.float32)
        blocks[kvd] = runner.num_kv_blocks
        out = llm.generate([{"prompt_token_ids": list(range(1000, 1020))}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        outs[kvd] = out[0].outputs[0].token_ids
        assert_no_leaks(llm)
    assert blocks["bfloat16"] - 1 == 2 * (blocks["auto"] - 1)
    assert outs["bfloat16"] == outs["auto"]
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        LLM(str(path), kv_cache_dtype="fp4")


@pytest.mark.parametrize("kernel", [False, True])
def test_greedy_argmax_is_jnp_argmax(kernel):
    """The sampler's argmax (two XLA reductions, or the C++ kernel of the cpu backend) picks
    what jnp.argmax picks: the first of tied maxima (-0 ties +0), the first NaN of a row with
    NaNs (of either sign), index 0 of an all -inf row; rows of one value, of fewer values
    than the kernel's block (256) and of a block and a few more; and the kernel is the one
    that ran on CPU, not in the program lowered for CUDA."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.layers import cpu_kernels
    from jaxinfer.layers.sampler import argmax

    if kernel and not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 1000)).astype(np.float32)
    x[1, [3, 500, 999]] = 9.0  # ties
    x[2, 7], x[2, 300] = np.nan, np.nan
    x[3] = -np.inf
    x[4, 999] = np.inf
    x[5] = np.round(x[5])  # many ties
    x[6] = -1.0
    x[6, 600], x[6, 700] = -0.0, 0.0  # -0 == +0: the first
    x[7, 900], x[7, 20] = 1e30, -np.nan  # a negative NaN
    x[8, 255], x[8, 256] = 50.0, 50.0  # across a block boundary
    x[9] = np.linspace(-5, 5, 1000)[::-1]
    fn = jax.jit(lambda x: argmax(x, kernel))
    want = jnp.argmax(jnp.asarray(x), axis=-1)
    got = np.asarray(fn(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(want))
    assert list(got[:10]) == [int(np.argmax(x[0])), 3, 7, 0, 999, int(np.argmax(x[5])), 600,
                              20, 255, 0]
    for shape in ((1, 1), (3, 200), (2, 257), (33, 4099)):
        y = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(y))), np.argmax(y, axis=-1))
    hlo = fn.lower(jnp.asarray(x)).as_text()
    assert ("jaxinfer_argmax_cpu" in hlo) is kernel
    # Lowered for CUDA, the program keeps the XLA form.
    cuda = fn.trace(jnp.asarray(x)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxinfer_argmax_cpu" not in cuda and "reduce" in cuda

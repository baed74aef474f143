"""Speculative decoding end to end: greedy outputs are token-identical to non-speculative
greedy whatever the proposer proposes (an oracle that is always right, an adversary that is
always wrong, n-gram lookup), through chunked prefill, preemption, prefix-cache hits, stop
tokens and max_tokens inside an accepted run, and the max_model_len boundary; no block leaks,
no recompilation after warm-up; seeded sampling does not depend on batch companions.

Runs on a tiny random-weight llama (float32 on CPU: the verify pass's numerics match decode's
closely enough for exact greedy identity here)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.spec_decode.ngram import NgramProposer
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir
from tests.spec_decode.eagle_ckpt import (make_copying_eagle_dir, make_eagle_dir,
                                          make_permutation_target)

# One token bucket (32) and request buckets 1, 2, 4, 8: few step variants to compile.
OPTS = dict(dtype="float32", max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32,
            min_token_bucket=32, block_size=8, warmup=False, enable_multiprocessing=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-spec")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


def _workload():
    """Prompts longer than the token budget (chunked), a shared prefix (prefix hits), stop
    tokens and small max_tokens (finishing inside an accepted run), one prompt at the
    max_model_len boundary (max_tokens=None: it runs into max_model_len)."""
    shared = [500 + j for j in range(24)]
    prompts = [[1000 + 37 * i + j for j in range(5 + 9 * i)] for i in range(6)]
    prompts += [shared + [7, 8], shared + [9], [3000 + j for j in range(90)]]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    params[-1] = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    return [{"prompt_token_ids": p} for p in prompts], params


def _core(llm):
    return llm.llm_engine.engine_core.core


class _Oracle:
    """Drafts from known continuations: the reference output (right) or its tokens + 1
    (wrong at every position)."""

    def __init__(self, sequences, k, wrong=False):
        self.sequences, self.k, self.wrong = sequences, k, wrong

    def propose(self, token_ids, rows, lengths):
        out = []
        for row, n in zip(rows, lengths):
            have = token_ids[row, :n].tolist()
            full = next((s for s in self.sequences if s[:n] == have), [])
            nxt = full[n : n + self.k]
            out.append([(t + 1) % 49152 for t in nxt] if self.wrong else nxt)
        return out


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, smollm2_dir):
    """Another random model with the same vocabulary (a draft that is almost always wrong)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_model_dir(path, "qwen2", smollm2_dir, sharpen=2.0, hidden_size=32,
                        num_hidden_layers=1)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    prompts, params = _workload()
    llm = LLM(tiny_dir, num_kv_blocks=15, **OPTS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    lps = [[{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs]
           for o in outs if o.outputs[0].logprobs]
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0  # the cache is tight
    llm.shutdown()
    sequences = [p["prompt_token_ids"] + list(r[0]) for p, r in zip(prompts, ref)]
    return ref, lps, sequences


# CI runs K = 3 (oracle and adversary share compiled steps); the slow set adds K = 1 and 5,
# n-gram lookup (also checked through the server below) and the in-step drafters on this
# workload (CI checks those on the permutation target below, with preemption, chunked
# prefill, prefix hits and the max_model_len boundary too).
_slow = pytest.mark.slow


@pytest.mark.parametrize("proposer,k", [
    ("oracle", 3), ("wrong", 3), pytest.param("oracle", 1, marks=_slow),
    pytest.param("oracle", 5, marks=_slow), pytest.param("ngram", 2, marks=_slow),
    pytest.param("draft-self", 3, marks=_slow), pytest.param("draft-other", 2, marks=_slow),
    pytest.param("eagle", 3, marks=_slow), pytest.param("eagle3", 2, marks=_slow)])
def test_greedy_is_token_identical(tiny_dir, other_dir, reference, proposer, k, tmp_path):
    ref, ref_lps, sequences = reference
    prompts, params = _workload()
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    if proposer.startswith("draft"):
        spec = {"method": "draft_model", "num_speculative_tokens": k,
                "model": tiny_dir if proposer == "draft-self" else other_dir}
    elif proposer.startswith("eagle"):  # random heads (EAGLE-3: own embedding, draft vocab)
        head = make_eagle_dir(tmp_path / "head", proposer, 64, 49152, aux_layers=[0, 1, 1],
                              draft_vocab=1000, with_embed=True)
        spec = {"method": proposer, "num_speculative_tokens": k, "model": head}
    llm = LLM(tiny_dir, num_kv_blocks=15, speculative_config=spec, **OPTS)
    if proposer in ("oracle", "wrong"):
        _core(llm).runner.proposer = _Oracle(sequences, k, wrong=proposer == "wrong")
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    assert got == ref
    lps = [[{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs]
           for o in outs if o.outputs[0].logprobs]
    assert len(lps) == len(ref_lps) == 1 and len(lps[0]) == len(ref_lps[0])
    for a, b in zip(lps[0], ref_lps[0]):  # the accepted tokens' logprobs are decode's
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and stats["num_preemptions"] > 0
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == accepted
    if proposer in ("oracle", "draft-self"):
        assert accepted == drafted  # every draft right
        assert stats["spec_decode_num_drafts"] < sum(len(r[0]) for r in ref)  # fewer steps
    elif proposer == "wrong":
        assert accepted == 0
    elif proposer in ("draft-other", "eagle", "eagle3"):
        assert accepted < 0.2 * drafted
    else:  # (a random model's text gives n-gram lookup little to go on)
        assert accepted <= drafted
    assert_no_leaks(llm)
    llm.shutdown()


@pytest.fixture(scope="module")
def perm_target(tmp_path_factory, smollm2_dir):
    perm = np.random.default_rng(3).permutation(64)
    path = tmp_path_factory.mktemp("perm-target")
    make_permutation_target(path, smollm2_dir, perm)
    return str(path), perm


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_in_step_drafters_draft_from_the_right_inputs(tmp_path_factory, perm_target, method):
    """A target whose next token is perm[current], and drafters built to copy it: the target
    itself as draft model, and EAGLE heads. The draft model and the EAGLE head get every draft
    right at every position (the head must read token p+1 at position p, the token just
    emitted at each row's last accepted position, then its own drafts at the right positions
    with the right KV), the EAGLE-3 head exactly its first draft (it must read the target's
    residual stream entering the aux layers). With a tight cache (preemption), chunked
    prefill, a shared prefix (prefix hits) and a request running into max_model_len; the
    outputs follow the permutation chain."""
    target, perm = perm_target
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 64, 10 + 9 * i)] for i in range(4)]
    shared = [int(x) for x in rng.integers(0, 64, 24)]
    prompts += [shared + [1, 2], shared + [3], [int(x) for x in rng.integers(0, 64, 88)]]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 6 + [
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)]
    model = target if method == "draft_model" else make_copying_eagle_dir(
        tmp_path_factory.mktemp(method), method, perm)
    llm = LLM(target, num_kv_blocks=15, **OPTS, speculative_config={
        "method": method, "num_speculative_tokens": 3, "model": model})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):  # the permutation chain
        toks = [p[-1]] + list(o.outputs[0].token_ids)
        assert all(int(perm[a]) == b for a, b in zip(toks, toks[1:]))
    assert len(outs[-1].outputs[0].token_ids) == 96 - 88
    st = llm.llm_engine.get_stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    runs = st["spec_decode_num_drafts"]
    assert runs > 0 and per_pos[0] == runs
    if method == "eagle3":
        assert per_pos[1:] == [0, 0]
    else:
        assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert_no_leaks(llm)
    llm.shutdown()


def test_seeded_sampling_does_not_depend_on_companions(perm_target):
    """Random sampling through the accept / resample path (the permutation target at
    temperature 2 puts ~0.46 on its argmax, which the draft model drafts): a seeded request's
    tokens are the same alone and in a batch (draws are keyed by seed and output index)."""
    target, perm = perm_target
    # (the cache of the drafter tests above: the same compiled steps; no preemption here, which
    # would change which steps verify drafts)
    llm = LLM(target, num_kv_blocks=15, **OPTS, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": target})
    prompt = {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]}
    sp = SamplingParams(temperature=2.0, seed=1234, max_tokens=40, ignore_eos=True)
    alone = _run(llm, [prompt], [sp])[0]
    others = [{"prompt_token_ids": [20 + i, 21, 22, 23]} for i in range(2)]
    mixed = _run(llm, [others[0], prompt, others[1]],
                 [SamplingParams(temperature=1.0, seed=7, max_tokens=8), sp,
                  SamplingParams(temperature=0, max_tokens=8)])
    assert mixed[1] == alone
    assert llm.llm_engine.get_stats()["num_preemptions"] == 0
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted
    assert_no_leaks(llm)
    llm.shutdown()


def test_no_recompilation_after_warmup(perm_target):
    """Warm-up compiles both step variants of a speculative engine (with and without drafts
    to verify) at every bucket; serving then compiles nothing."""
    target, _ = perm_target
    llm = LLM(target, num_kv_blocks=15, **{**OPTS, "warmup": True}, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": target})
    before = llm.llm_engine.get_stats()["num_compilations"]
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": [int(x) for x in rng.integers(0, 64, 5 + 7 * i)]}
               for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_compilations"] == before
    assert all(k[2].spec for k in _core(llm).runner.compiled.keys())
    llm.shutdown()


def test_penalised_and_grammar_requests_get_no_drafts(tiny_dir):
    """Penalties would have to count drafts, and drafts are not grammar-filtered yet: such
    requests decode without drafts (and a structured output still follows its spec), while
    their batch companions speculate."""
    from jaxinfer.sampling_params import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = LLM(tiny_dir, num_kv_blocks=64, speculative_config=spec, **OPTS)
    core = _core(llm)
    seen = []
    take = core.scheduler.update_draft_token_ids

    def spy(drafts):
        take(drafts)
        seen.extend((r.grammar is not None, r.sampling_params.repetition_penalty)
                    for r in core.scheduler.requests.values() if r.spec_token_ids)
    core.scheduler.update_draft_token_ids = spy
    core.runner.proposer = _Oracle([], 3)
    core.runner.proposer.propose = lambda tok, rows, lengths: [[5, 6, 7]] * len(rows)
    rep = {"prompt_token_ids": [5, 6, 5, 6, 5, 6, 5]}
    outs = llm.generate([rep, rep, rep], [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta gamma"])),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)], use_tqdm=False)
    assert outs[1].outputs[0].text in ("alpha", "beta gamma")
    assert seen and set(seen) == {(False, 1.0)}  # only the plain request got drafts
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0
    assert_no_leaks(llm)
    llm.shutdown()


@pytest.mark.parametrize("spec,match", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/nonexistent"},
     "speculative_config.model"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 2}, "unknown option"),
])
def test_bad_speculative_config_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec)


def test_async_scheduling_with_speculation_is_refused():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                     async_scheduling=True)


def test_ngram_defaults_follow_vllm():
    from jaxinfer.config import SpeculativeConfig

    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


def test_ngram_proposer_finds_the_longest_most_recent_match():
    p = NgramProposer(1, 3, 4)
    rows = np.zeros((4, 16), np.int32)
    seqs = [
        [1, 2, 3, 9, 9, 1, 2, 3],  # suffix 1,2,3 seen at 0 -> 9, 9, 1, 2
        [5, 6, 7, 8, 1, 5, 6, 4, 4, 5, 6],  # "5 6" twice before: the most recent -> 4, 4, 5, 6
        [1, 2, 3, 4],  # no earlier occurrence of any suffix
        [7, 8, 7, 8, 7],  # 3-gram "7 8 7" at 0 -> 8, 7 (up to the end)
    ]
    for i, s in enumerate(seqs):
        rows[i, : len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    out = p.propose(rows, np.arange(4), lengths)
    assert out == [[9, 9, 1, 2], [4, 4, 5, 6], [], [8, 7]]
    assert NgramProposer(2, 2, 2).propose(rows, np.array([3, 0]), lengths[[3, 0]]) == \
        [[8, 7], [9, 9]]


def test_server_reports_spec_decode_metrics(tiny_dir):
    """Through the OpenAI server (engine-core process): greedy completions with n-gram
    speculation equal a plain LLM's, and /metrics carries vLLM's spec_decode_* counters."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from jaxinfer.engine.async_engine import AsyncLLM
    from tests.helpers import LiveServer

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    opts = {**OPTS, "enable_multiprocessing": True}
    live = LiveServer(AsyncLLM(EngineConfig(model=tiny_dir, num_kv_blocks=64,
                                            speculative_config=spec, **opts)), "tiny")
    try:
        prompt = [5, 6, 7, 5, 6, 7, 5, 6]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 85, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(live.base_url + "/metrics").text
        values = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^vllm:(spec_decode_\w+?)_total\{engine="0",model_name="tiny"\} (\S+)$', metrics,
            re.M)}
        assert values["spec_decode_num_draft_tokens"] > 0
        assert values["spec_decode_num_drafts"] > 0
        assert "spec_decode_num_accepted_tokens" in values
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    finally:
        live.close()
    plain = LLM(tiny_dir, num_kv_blocks=64, **OPTS)
    ref = plain.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=85, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    plain.shutdown()
    assert r.json()["choices"][0]["text"] == ref


def test_cli_takes_speculative_config():
    from jaxinfer.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineConfig(speculative_config=args.speculative_config).speculative_config.method \
        == "ngram"

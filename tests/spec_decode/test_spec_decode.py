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

OPTS = dict(dtype="float32", max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32,
            block_size=8, warmup=False, enable_multiprocessing=False)


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


@pytest.mark.parametrize("proposer,k", [
    ("oracle", 5), pytest.param("oracle", 1, marks=pytest.mark.slow), ("wrong", 3),
    ("ngram", 2), ("draft-self", 3), ("draft-other", 2)])
def test_greedy_is_token_identical(tiny_dir, other_dir, reference, proposer, k):
    ref, ref_lps, sequences = reference
    prompts, params = _workload()
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    if proposer.startswith("draft"):
        spec = {"method": "draft_model", "num_speculative_tokens": k,
                "model": tiny_dir if proposer == "draft-self" else other_dir}
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
    elif proposer == "draft-other":
        assert accepted < 0.2 * drafted
    else:  # (a random model's text gives n-gram lookup little to go on)
        assert accepted <= drafted
    assert_no_leaks(llm)
    llm.shutdown()


class _GreedyDraft:
    """Drafts = the target's own greedy continuation of each request's actual tokens, from
    the HF copy of the model (a perfect draft model: at temperature > 0 most drafts pass)."""

    def __init__(self, hf, k):
        self.hf, self.k = hf, k

    def propose(self, token_ids, rows, lengths):
        import torch

        out = []
        with torch.no_grad():
            for row, n in zip(rows, lengths):
                ids = token_ids[row, :n].tolist()
                drafts = []
                for _ in range(self.k):
                    drafts.append(int(self.hf(torch.tensor([ids + drafts])).logits[0, -1].argmax()))
                out.append(drafts)
        return out


def test_seeded_sampling_does_not_depend_on_companions(tmp_path_factory, smollm2_dir):
    """Random sampling through the accept/resample path: a seeded request's tokens are the
    same alone and in a batch (draws are keyed by seed and output index; drafts come from the
    request's own tokens). A peaky model whose greedy continuation is the draft makes most
    drafts pass at temperature 0.8, and some fail."""
    path = tmp_path_factory.mktemp("tiny-peaky")
    hf = make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=20.0)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(path), num_kv_blocks=64, speculative_config=spec, **OPTS)
    _core(llm).runner.proposer = _GreedyDraft(hf, 3)
    target = {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]}
    sp = SamplingParams(temperature=0.8, seed=1234, max_tokens=40, ignore_eos=True)
    alone = _run(llm, [target], [sp])[0]
    others = [{"prompt_token_ids": [200 + i, 201, 202, 203]} for i in range(5)]
    mixed = _run(llm, others[:2] + [target] + others[2:],
                 [SamplingParams(temperature=1.0, seed=i, max_tokens=30 + i) for i in range(2)]
                 + [sp] + [SamplingParams(temperature=0, max_tokens=25)] * 3)
    assert mixed[2] == alone
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0.5 * drafted < accepted < drafted
    assert_no_leaks(llm)
    llm.shutdown()


def test_no_recompilation_after_warmup(tiny_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(tiny_dir, num_kv_blocks=64, speculative_config=spec,
              **{**OPTS, "warmup": True})
    before = llm.llm_engine.get_stats()["num_compilations"]
    prompts, params = _workload()
    llm.generate(prompts[:6], params[:6], use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    # (request 4 asks for logprobs: that variant compiles on first use, by design)
    assert stats["num_compilations"] - before <= len(
        {k for k in _core(llm).runner._compiled if k[2].logprobs})
    assert all(k[2].spec for k in _core(llm).runner._compiled)
    llm.shutdown()


def test_penalised_and_grammar_requests_get_no_drafts(tiny_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = LLM(tiny_dir, num_kv_blocks=64, speculative_config=spec, **OPTS)
    rep = {"prompt_token_ids": [5, 6, 5, 6, 5, 6, 5]}
    _run(llm, [rep], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                     repetition_penalty=1.3)])
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] == 0
    assert_no_leaks(llm)
    llm.shutdown()


@pytest.mark.parametrize("spec,match", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "not implemented"),
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
            r'^jaxinfer:(spec_decode_\w+?)_total\{model_name="tiny"\} (\S+)$', metrics, re.M)}
        assert values["spec_decode_num_draft_tokens"] > 0
        assert values["spec_decode_num_drafts"] > 0
        assert "spec_decode_num_accepted_tokens" in values
        assert "jaxinfer:spec_decode_num_accepted_tokens_per_pos_total" in metrics
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

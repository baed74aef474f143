"""Data parallelism with real engine-core processes (2 ranks, a tiny model): DP=2 gives DP=1's
greedy outputs, spreads the requests, and keeps serving when a rank dies (its requests end
with an error naming it); the async front end (the server's) too."""

from __future__ import annotations

import asyncio

import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import make_tiny_model_dir

OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
            min_token_bucket=32, block_size=8, warmup=False, num_kv_blocks=80)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-dp")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


def prompts(n=8):
    return [{"prompt_token_ids": [1000 + 37 * i + j for j in range(5 + 7 * i)]}
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(tiny_dir, enable_multiprocessing=False, **OPTS)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]
    llm.shutdown()
    return out


@pytest.fixture(scope="module")
def dp2(tiny_dir):
    llm = LLM(tiny_dir, data_parallel_size=2, **OPTS)
    yield llm
    llm.shutdown()


def test_dp2_equals_dp1_and_spreads_the_work(dp2, reference):
    outs = dp2.generate(prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    eng = dp2.llm_engine
    assert eng.call_utility("leak_report") == []
    per_rank = eng.call_utility("get_stats")["per_rank"]
    assert len(per_rank) == 2 and all(s["prefix_cache_queries"] > 0 for s in per_rank)
    assert not eng.engine_core.lb.owner and eng.engine_core.lb.in_flight == [0, 0]
    # Aborts reach the rank holding the request; its blocks come back.
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for i, p in enumerate(prompts(4)):
        eng.add_request(f"a{i}", p, long)
    eng.step()
    eng.abort_request([f"a{i}" for i in range(4)])
    assert not eng.has_unfinished_requests() and eng.engine_core.lb.in_flight == [0, 0]
    import time

    end = time.time() + 30
    while eng.call_utility("leak_report") and time.time() < end:
        time.sleep(0.1)
    assert eng.call_utility("leak_report") == []


def test_async_front_end_over_two_ranks(tiny_dir, reference):
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=tiny_dir, data_parallel_size=2, **OPTS))

    async def one(p):
        out = None
        async for out in llm.generate(p, GREEDY):
            pass
        return out.outputs[0].token_ids

    async def run():
        got = await asyncio.gather(*(one(p) for p in prompts()))
        return got, await llm.call_utility("leak_report")

    async def burst():
        """200 concurrent short requests, then 6 sharing a 4-block prefix at once."""
        many = [{"prompt_token_ids": [2000 + 11 * i + j for j in range(3 + i % 20)]}
                for i in range(200)]
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

        async def drain(p, params):
            async for _ in llm.generate(p, params):
                pass

        await asyncio.gather(*(drain(p, short) for p in many))
        before = list(lb.num_routed)
        shared = [500 + j for j in range(32)]
        await asyncio.gather(*(drain({"prompt_token_ids": shared + [i]}, short)
                               for i in range(6)))
        return before, await llm.call_utility("leak_report")

    lb = llm.engine_core.lb
    try:
        got, leaks = asyncio.run(run())
        assert got == reference and leaks == []
        before, leaks = asyncio.run(burst())
        spread = [before[r] for r in (0, 1)]
        assert all(abs(n - 104) <= 16 for n in spread), spread  # 208 requests, +-15%
        delta = [lb.num_routed[r] - before[r] for r in (0, 1)]
        assert sorted(delta) == [0, 6], delta  # the shared-prefix burst stayed together
        assert leaks == [] and lb.in_flight == [0, 0]
    finally:
        llm.shutdown()


def test_a_dead_rank_fails_its_requests_and_the_others_keep_serving(tiny_dir, reference):
    llm = LLM(tiny_dir, data_parallel_size=2, data_parallel_prefix_affinity=False, **OPTS)
    try:
        eng = llm.llm_engine
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i, p in enumerate(prompts(4)):
            eng.add_request(f"q{i}", p, long)
        client = eng.engine_core
        on_rank1 = {rid.split("-")[0] for rid, r in client.lb.owner.items() if r == 1}
        assert on_rank1
        eng.step()
        client.clients[1].p.proc.kill()
        finished = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
        for rid, c in finished.items():
            if rid in on_rank1:
                assert c.finish_reason == "abort"
                assert "data-parallel engine core 1 died" in str(c.stop_reason)
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 60
        # Rank 0 serves what comes next.
        outs = llm.generate(prompts()[:3], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference[:3]
        assert eng.call_utility("leak_report") == []
    finally:
        llm.shutdown()

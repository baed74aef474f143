"""RL rollouts: weight updates (HF names against HF float64 with the same weights; the
engine's own layout taken without a copy; all or nothing), the prefix cache after an update,
weight-version spans, sleep levels 1 and 2 (device bytes down and back, no recompilation,
the same tokens), pause / resume in each mode under concurrent load (nothing lost, nothing
leaked), collective_rpc, and updates from a folder with the core in its own process."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, hf_greedy, make_tiny_model_dir

torch = pytest.importorskip("torch")

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
            warmup=False, num_kv_blocks=48, block_size=16, compilation_cache_dir="")
# 40 tokens: two full 16-token blocks the prefix cache can hit
IDS = [1] + [(37 * i + 11) % 4000 + 100 for i in range(39)]


def _perturbed(hf, seed: float):
    """hf with every parameter moved a little (in place); its HF state dict as numpy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("rl")
    hf = make_tiny_model_dir(root / "base", "llama", smollm2_dir)
    ref0 = hf_greedy(hf.double(), IDS, N)
    hf = hf.float()
    weights = _perturbed(hf, 1)
    ref1 = hf_greedy(hf.double(), IDS, N)
    assert ref1 != ref0  # (an update that changes nothing would test nothing)
    hf.float().save_pretrained(root / "updated")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "base" / fn, root / "updated" / fn)
    return str(root / "base"), str(root / "updated"), weights, ref0, ref1


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny[0], enable_multiprocessing=False, enable_sleep_mode=True, **OPTS)
    yield engine
    assert_no_leaks(engine)
    engine.shutdown()


def _run(llm, ids=IDS):
    return llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]


def _core(llm):
    return llm.llm_engine.engine_core.core


def test_update_weights_equals_hf_and_resets_the_prefix_cache(tiny, llm):
    base, _, weights, ref0, ref1 = tiny
    llm.reload_weights()  # (whatever an earlier test left)
    out = _run(llm)
    assert out.outputs[0].token_ids == ref0
    assert _run(llm).num_cached_tokens == 32  # cached before the update
    n = _core(llm).runner.num_compilations
    result = llm.update_weights(weights, weight_version="step-1")
    assert result["weight_version"] == "step-1" and result["skipped"] == ["lm_head.weight"]
    assert result["num_parameters"] == len(llm.collective_rpc("engine_weights")[0])
    out = _run(llm)
    assert out.num_cached_tokens == 0  # KV of the old weights is never reused
    assert out.outputs[0].token_ids == ref1
    assert [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions] == \
        [("step-1", 0, N)]
    stats = llm.llm_engine.get_stats()
    assert stats["weight_version"] == "step-1" and stats["num_weight_updates"] >= 1
    assert _core(llm).runner.num_compilations == n  # new arrays, same programs
    assert llm.get_weight_version() == "step-1"


def test_engine_layout_takes_sharded_arrays_without_a_copy(tiny, llm):
    import jax

    llm.update_weights(tiny[2])
    mine = {k: v * 1.0 for k, v in llm.collective_rpc("engine_weights")[0].items()}
    pointers = {k: v.unsafe_buffer_pointer() for k, v in mine.items()}
    result = llm.update_weights(mine, layout="engine")
    assert result["num_arrays_taken"] == len(mine) and result["num_arrays_copied"] == 0
    held = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(_core(llm).runner.state.params)}
    assert set(pointers.values()) <= held  # the very buffers the caller made
    assert _run(llm).outputs[0].token_ids == tiny[4]
    # numpy arrays (or another sharding) are placed: copied
    host = {k: np.asarray(v) for k, v in list(mine.items())[:2]}
    assert llm.update_weights(host, layout="engine")["num_arrays_copied"] == 2


def test_a_bad_update_changes_nothing(tiny, llm):
    base, _, weights, ref0, ref1 = tiny
    llm.update_weights(weights, weight_version="good")
    before = _run(llm).outputs[0].token_ids
    assert before == ref1
    other = {k: v + 1.0 for k, v in weights.items()}  # (would change the tokens)
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        ({**other, "model.layers.1.mlp.down_proj.weight": np.zeros((3, 3), np.float32)},
         "shape"),
        ({**other, "model.layers.9.mlp.down_proj.weight": other[q]}, "no parameter"),
        ({q: other[q]}, "k_proj"),  # one part of the fused q/k/v
        ({**other, q: np.full_like(other[q], np.nan)}, "non-finite"),
        ({**other, q: other[q].astype(np.int32)}, "floating"),
        ({}, "no tensors"),
        ({**{k: v for k, v in other.items() if k != "model.layers.0.mlp.up_proj.weight"},
          "model.layers.0.mlp.up_proj.weight_scale": np.ones(1, np.float32)},
         "without its weight"),
    ]
    for bad, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.update_weights(bad)
    with pytest.raises(ValueError, match="engine holds"):
        w = llm.collective_rpc("engine_weights")[0]
        llm.update_weights({k: v.astype(np.float16) for k, v in w.items()}, layout="engine")
    with pytest.raises(ValueError, match="layout"):
        llm.update_weights(other, layout="megatron")
    assert llm.get_weight_version() == "good"
    assert _run(llm).outputs[0].token_ids == before


def test_sleep_frees_the_device_and_wakes_without_recompiling(tiny, llm):
    from jaxinfer.runner.weights import live_device_bytes

    base, _, weights, ref0, ref1 = tiny
    llm.update_weights(weights)
    core = _core(llm)
    mem = core.worker.memory
    held = mem["weight_bytes_per_device"] + mem["kv_cache_bytes_per_device"]
    n = core.runner.num_compilations
    for level in (1, 2):
        awake = live_device_bytes()
        result = llm.sleep(level)
        assert llm.is_sleeping() and result["freed_bytes"] >= held
        assert live_device_bytes() <= awake - held
        with pytest.raises(RuntimeError, match="paused"):
            _run(llm)
        if level == 2:  # the weights come back as zeros: reload them, then the cache
            assert llm.wake_up(["weights"]) is False and llm.is_sleeping()
            llm.update_weights(weights)
            assert llm.wake_up(["kv_cache"]) is True
        else:
            assert llm.wake_up() is True
        assert not llm.is_sleeping() and live_device_bytes() >= awake - 1024
        assert _run(llm).outputs[0].token_ids == ref1
    assert core.runner.num_compilations == n
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="wake_up tag"):
        llm.wake_up(["gpu"])


def test_whole_step_programs_run_the_weights_the_state_holds(tiny):
    """Whole-step programs take the weights as flat leaves, flattened again only when the
    state holds new trees (whole_step.FlatWeights): after an update, a reload and a sleep
    and wake-up, each step runs the weights the state holds then."""
    base, _, weights, ref0, ref1 = tiny
    llm = LLM(base, enable_multiprocessing=False, enable_sleep_mode=True,
              step_compilation="whole", **OPTS)
    try:
        assert _run(llm).outputs[0].token_ids == ref0
        llm.update_weights(weights)
        assert _run(llm).outputs[0].token_ids == ref1
        llm.reload_weights()
        assert _run(llm).outputs[0].token_ids == ref0
        llm.update_weights(weights)
        llm.sleep(1)
        llm.wake_up()
        assert _run(llm).outputs[0].token_ids == ref1
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_collective_rpc(llm):
    assert llm.collective_rpc("cache_counts")[0].keys() >= {"compile_cache_requests"}
    assert llm.collective_rpc(lambda worker: worker.block_size) == [16]
    for bad in ("_make_runner", "nonexistent", "block_size"):
        with pytest.raises(ValueError, match="public method"):
            llm.collective_rpc(bad)


def test_pause_modes_under_concurrent_load(tiny):
    """AsyncLLM (its core in a thread of this process): each mode with 6 requests in run and
    one arriving while paused; nothing lost or duplicated, no block leaked; "keep" resumes
    the parked requests to the same greedy tokens."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    prompts = [IDS[:20 + 3 * i] for i in range(6)]
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    async def collect(eng, i, ids, started=None):
        last = None
        async for out in eng.generate({"prompt_token_ids": ids}, long, request_id=f"r{i}"):
            last = out
            if started is not None:
                started.add(i)
        return last

    async def main():
        eng = AsyncLLM(EngineConfig(model=tiny[0], enable_multiprocessing=False,
                                    async_scheduling=True, **OPTS))
        try:
            ref = await asyncio.gather(*(collect(eng, f"ref{i}", p)
                                         for i, p in enumerate(prompts)))
            ref = [o.outputs[0].token_ids for o in ref]
            for mode in ("abort", "wait", "keep"):
                started: set = set()
                tasks = [asyncio.create_task(collect(eng, f"{mode}{i}", p, started))
                         for i, p in enumerate(prompts)]
                while len(started) < len(prompts):  # (every one has its first tokens)
                    await asyncio.sleep(0.002)
                assert not any(t.done() for t in tasks)
                await eng.pause_generation(mode=mode)
                assert await eng.is_paused()
                late = asyncio.create_task(collect(eng, f"{mode}-late", prompts[0]))
                await asyncio.sleep(0.1)
                assert not late.done()  # held while paused
                if mode == "keep":  # (parked; the same weights again, a new label)
                    assert not any(t.done() for t in tasks)
                    await eng.reload_weights(weight_version="reloaded")
                await eng.resume_generation()
                outs = await asyncio.gather(*tasks)
                assert (await late).outputs[0].token_ids == ref[0]
                reasons = {o.outputs[0].finish_reason for o in outs}
                if mode == "abort":
                    assert reasons == {"abort"}
                else:
                    assert reasons == {"length"}
                    assert [o.outputs[0].token_ids for o in outs] == ref
                if mode == "keep":  # tokens before and after the update, labelled
                    for o in outs:
                        spans = o.outputs[0].weight_versions
                        assert [s.version for s in spans] == ["default", "reloaded"]
                        assert spans[0].start == 0 and spans[-1].end == 80
                        assert spans[0].end == spans[1].start > 0
                assert await eng.call_utility("leak_report") == []
            with pytest.raises(ValueError, match="pause mode"):
                await eng.pause_generation(mode="later")
        finally:
            eng.shutdown()

    asyncio.run(main())


def test_update_from_a_folder_with_the_core_in_its_own_process(tiny):
    base, updated, weights, ref0, ref1 = tiny
    llm = LLM(base, **OPTS)  # (multiprocessing: the default)
    try:
        with pytest.raises(TypeError, match="in this process"):
            llm.update_weights(weights)
        assert _run(llm).outputs[0].token_ids == ref0
        result = llm.update_weights_from_path(updated, weight_version="disk")
        assert result["weight_version"] == "disk"
        assert _run(llm).outputs[0].token_ids == ref1
        with pytest.raises(ValueError, match="update_weights_from_path"):
            llm.update_weights_from_path("/nonexistent")
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            llm.sleep(1)
        llm.reload_weights()
        assert _run(llm).outputs[0].token_ids == ref0
        # over JAX's transfer API: this process offers, the core's process pulls
        from jaxinfer.weight_transfer import WeightSender

        sender = WeightSender()
        result = llm.update_weights_from_transfer(sender.offer(weights), weight_version="x")
        assert result["weight_version"] == "x" and result["num_parameters"] > 0
        assert _run(llm).outputs[0].token_ids == ref1
        good = sender.offer({"model.norm.weight": weights["model.norm.weight"]})
        for bad, words in ((dict(good, uuids=[]), "uuids"), (dict(good, names=[1]), "names"),
                           (dict(good, dtypes=["str"]), "dtype"),
                           (dict(good, timeout_s=0), "timeout_s"),
                           (dict(good, extra=1), "unknown field"),
                           (dict(good, uuids=[good["uuids"][0] + 99], timeout_s=1.0),
                            "did not finish|failed")):
            with pytest.raises(ValueError, match=words):
                llm.update_weights_from_transfer(bad)
        assert _run(llm).outputs[0].token_ids == ref1  # (serving on, weights kept)
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_tensor_parallel_update_equals_hf(tiny):
    """TP=4 over a model with 2 KV heads: the update replicates them as loading does."""
    import json
    import os
    import subprocess
    import sys

    base, updated, _, ref0, ref1 = tiny
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": root}
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "rl",
                                                     "tp_update_worker.py"),
                        base, "4", updated, json.dumps(IDS)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"before": ref0, "after": ref1, "recompiled": False}


@pytest.mark.parametrize("quantization", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_quantized_weights_are_requantized(tiny, quantization):
    """An update of a quantized engine quantizes the new float weights as loading them
    would: the same tokens and logprobs as an engine started from the updated folder."""
    base, updated, weights, _, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1)
    got = []
    for model, update in ((base, True), (updated, False)):
        llm = LLM(model, quantization=quantization, enable_multiprocessing=False, **OPTS)
        try:
            if update:
                llm.update_weights(weights)
            out = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]
            o = out.outputs[0]
            got.append((o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs,
                                                                     o.token_ids)]))
        finally:
            llm.shutdown()
    assert got[0] == got[1]


def test_data_parallel_ranks_all_update_and_pause(tiny):
    base, updated, _, ref0, ref1 = tiny
    llm = LLM(base, data_parallel_size=2, **OPTS)
    try:
        assert _run(llm).outputs[0].token_ids == ref0
        llm.update_weights_from_path(updated, weight_version="dp")
        ranks = llm.llm_engine.get_stats()["per_rank"]
        assert [(r["weight_version"], r["num_weight_updates"]) for r in ranks] == \
            [("dp", 1), ("dp", 1)]
        assert len(llm.collective_rpc("cache_counts")) == 2
        assert _run(llm).outputs[0].token_ids == ref1
        llm.pause_generation()
        assert llm.is_paused()
        llm.resume_generation()
        assert not llm.is_paused() and _run(llm).outputs[0].token_ids == ref1
        assert_no_leaks(llm)
    finally:
        llm.shutdown()

"""Start-up: layer-wise steps (compile cost independent of depth) give the whole step's
outputs; buckets compile lazily (a start-up set, the rest in the background, steps padding up
to a ready bucket meanwhile); a warm start is answered by the persistent cache."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.compiled_steps import CompiledSteps
from jaxinfer.runner.step_inputs import PLAIN, StepFeatures
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
            num_kv_blocks=40, compilation_cache_dir="", enable_multiprocessing=False)


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [{t: lp.logprob for t, lp in d.items()} for d in (c.logprobs or [])]
        plps = [None if d is None else {t: lp.logprob for t, lp in d.items()}
                for d in (o.prompt_logprobs or [])]
        result.append((c.token_ids, c.finish_reason, lps, plps))
    return result


def _close(a, b, tol=2e-5):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < tol for k in a)


def _mixed_requests():
    """Four prompts of different lengths: logprobs and prompt logprobs, penalties, seeded
    sampling and plain greedy."""
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(9 + 17 * i)]}
               for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.4),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    return prompts, params


# mistral (a sliding window, ~30 s) runs with the slow tests; CI keeps qwen3.
@pytest.mark.parametrize("arch", ["qwen3", pytest.param("mistral", marks=pytest.mark.slow)])
def test_layerwise_equals_whole(tmp_path, smollm2_dir, arch):
    """Same greedy tokens, logprobs and prompt logprobs, with penalties and seeded sampling,
    through chunked prefill and preemption (a tight cache), as the whole-step engine."""
    make_tiny_model_dir(tmp_path, arch, smollm2_dir, sharpen=2.0, num_hidden_layers=3,
                        **({"sliding_window": 24} if arch == "mistral" else {}))
    prompts, params = _mixed_requests()
    got = {}
    for mode in ("whole", "layerwise"):
        llm = LLM(str(tmp_path), warmup=False, step_compilation=mode,
                  **{**OPTS, "num_kv_blocks": 14, "block_size": 8, "max_model_len": 96})
        assert llm.llm_engine.runner.step_compilation == mode
        got[mode] = _outputs(llm, prompts, params)
        assert llm.llm_engine.get_stats()["num_preemptions"] > 0  # (the cache is tight)
        assert_no_leaks(llm)
        llm.shutdown()
    for w, lw in zip(got["whole"], got["layerwise"]):
        assert w[:2] == lw[:2]
        assert len(w[2]) == len(lw[2]) and len(w[3]) == len(lw[3])
        for a, b in zip(w[2] + w[3], lw[2] + lw[3]):
            _close(a, b)


def _hlo_size(step) -> int:
    """Instructions over every executable of a compiled step."""
    parts = [step] if not hasattr(step, "layers") else [step.head, *step.layers, step.tail]
    return sum(p.as_text().count("\n") for p in parts)


def test_compile_cost_does_not_grow_with_depth(tmp_path, smollm2_dir):
    """What XLA compiles for a bucket (instructions over its executables) is the same for 3
    and 9 layers layer-wise (runs of 3: one executable run 1 or 3 times); whole, it grows
    with the layers (~80 instructions a layer with the cpu backend's kernels, on a fixed
    part of ~2200: the sampler and the rest of the step)."""
    sizes = {}
    for layers in (3, 9):
        path = tmp_path / f"l{layers}"
        make_tiny_model_dir(path, "llama", smollm2_dir, num_hidden_layers=layers)
        for mode in ("whole", "layerwise"):
            llm = LLM(str(path), warmup=False, step_compilation=mode, layers_per_program=3,
                      **OPTS)
            runner = llm.llm_engine.runner
            sizes[mode, layers] = _hlo_size(runner.compiled.compile(16, 2, PLAIN))
            if mode == "layerwise":  # one executable, run by every run of 3 layers
                assert runner.program.lm.runs == [(a, a + 3) for a in range(0, layers, 3)]
                assert len(runner.program.lm.kinds) == 1
            llm.shutdown()
    assert sizes["layerwise", 3] == sizes["layerwise", 9]
    assert sizes["whole", 9] - sizes["whole", 3] >= 6 * 40  # (6 more layers)


def test_layer_runs():
    from jaxinfer.runner.layerwise import layer_runs

    assert layer_runs(30, 3) == [(a, a + 3) for a in range(0, 30, 3)]
    assert layer_runs(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert layer_runs(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_runs(2, 5) == [(0, 2)]
    # EAGLE-3 reads the stream entering its aux layers: a run starts at each
    assert layer_runs(10, 3, (2, 5, 7)) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert layer_runs(4, 3, (0, 1, 1)) == [(0, 1), (1, 4)]


# -- CompiledSteps: lazy buckets (fake lowering: no JAX) ----------------------------------------

class _FakeLowered:
    def __init__(self, log, key, delay):
        self.log, self.key, self.delay = log, key, delay

    def compile(self):
        time.sleep(self.delay)
        self.log.append(self.key)
        return lambda *a: self.key


def _steps(delay=0.0):
    log = []
    return CompiledSteps(lambda t, r, f: _FakeLowered(log, (t, r, f), delay), PLAIN), log


class _FakeStep:
    """A compiled step that can be fused (as a LayerwiseStep)."""

    def __init__(self, key):
        self.key, self.fused = key, None


class _FakeStepLowered(_FakeLowered):
    def compile(self):
        self.log.append(self.key)
        return _FakeStep(self.key)


def test_steps_are_fused_hot_buckets_first_then_the_most_used_when_idle():
    """A bucket that ran hot_steps steps is fused while steps keep running; the others wait
    for an idle engine, most used first; a failed fusing leaves its step as it was. Steps
    count as layer-wise until their bucket is fused."""
    log, fused = [], []

    def lower_fused(t, r, f):
        if (t, r) == (64, 4):
            raise RuntimeError("no")
        return _FakeLowered(fused, (t, r), 0.0)

    steps = CompiledSteps(lambda t, r, f: _FakeStepLowered(log, (t, r, f), 0.0), PLAIN,
                          lower_fused=lower_fused, hot_steps=3)
    steps.start_background([], idle_seconds=0.3)
    steps.step_started()  # busy from here on
    for key, n in (((1, 1), 1), ((4, 4), 2), ((64, 4), 1), ((16, 16), 3)):
        for _ in range(n):
            steps.get(*key, PLAIN)
    deadline = time.time() + 10
    while not fused and time.time() < deadline:
        time.sleep(0.01)
    assert fused == [(16, 16)]  # hot: fused while busy ...
    time.sleep(0.4)
    assert fused == [(16, 16)]  # ... the others wait for an idle engine
    steps.step_finished()
    while not steps.settled() and time.time() < deadline:
        time.sleep(0.01)
    assert fused == [(16, 16), (4, 4), (1, 1)]  # most used first; (64, 4) failed
    assert steps.num_fused == 3 and steps.get(64, 4, PLAIN).fused is None
    assert steps.get(16, 16, PLAIN).fused is not None
    assert steps.num_steps == 9 and steps.num_layerwise_steps == 8  # (+1: 64 x 4 again)
    steps.close()


def test_a_bucket_compiles_once_whoever_asks():
    steps, log = _steps(delay=0.2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(steps.get(32, 2, PLAIN)()))
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert log == [(32, 2, PLAIN)] and results == [(32, 2, PLAIN)] * 4
    assert steps.num_compilations == 1


def test_a_step_pads_up_to_a_ready_bucket_only_when_near():
    """A step pads up to a near compiled bucket while its own compiles in the background
    (first in line, even while steps run); without one it compiles its own on the spot."""
    steps, log = _steps()
    steps.start_background([])  # (nothing proactive: only what steps ask for)
    assert steps.choose(16, 1, PLAIN) == (16, 1)  # nothing ready: its own (compiled by get)
    steps.get(32, 4, PLAIN)
    assert steps.choose(16, 8, PLAIN) == (16, 8)  # not enough rows
    assert steps.choose(8, 1, PLAIN) == (8, 1)  # 32 > 2 x 8 tokens: compiling is cheaper
    assert steps.choose(16, 1, StepFeatures(logprobs=True)) == (16, 1)  # another variant
    steps.get(32, 2, PLAIN)
    assert steps.choose(16, 1, PLAIN) == (32, 2)  # the smallest near one that holds it
    assert steps.choose(32, 2, PLAIN) == (32, 2)
    assert steps.num_padded_steps == 1
    deadline = time.time() + 10  # ... while (16, 1) compiles in the background
    while (16, 1, PLAIN) not in steps and time.time() < deadline:
        time.sleep(0.01)
    assert steps.choose(16, 1, PLAIN) == (16, 1)
    assert log.count((16, 1, PLAIN)) == 1
    steps.close()


def test_background_compiles_the_rest_and_stops_on_close():
    steps, log = _steps(delay=0.05)
    table = BucketTable.build(256, 8, min_tokens=16)
    start = table.start_pairs()
    assert start == [(16, 1), (16, 2), (16, 4), (16, 8)]
    # from one token up (the default): each decode batch size its own bucket
    assert BucketTable.build(256, 8, min_tokens=1).start_pairs() == [(1, 1), (2, 2), (4, 4),
                                                                     (8, 8)]
    assert BucketTable.build(2048, 64, min_tokens=16).start_pairs()[-2:] == [(32, 32),
                                                                             (64, 64)]
    steps.warmup([(t, r, PLAIN) for t, r in start], num_threads=2)
    assert sorted(k[:2] for k in steps.keys()) == sorted(start)
    rest = [(t, r, PLAIN) for t, r in table.all_pairs() if (t, r) not in start]
    steps.start_background(rest)  # (no step yet: the engine is idle)
    deadline = time.time() + 20
    while steps.background_left and time.time() < deadline:
        time.sleep(0.02)
    assert sorted(k[:2] for k in steps.keys()) == sorted(table.all_pairs())
    assert len(log) == len(set(log)) == len(table.all_pairs())
    slow, slow_log = _steps(delay=0.2)
    slow.start_background(rest)
    time.sleep(0.1)
    slow.close()
    assert len(slow_log) <= 1  # (the bucket it was at when told to stop)
    busy, busy_log = _steps()
    busy.step_started()  # a step runs (however long): buckets nobody asked for wait
    busy.start_background(rest, idle_seconds=0.3)
    time.sleep(0.6)
    assert busy_log == [] and busy.background_left == len(rest)
    busy.step_finished()
    time.sleep(0.15)
    assert busy_log == []  # (idle, but not for 0.3 s yet)
    deadline = time.time() + 10
    while busy.background_left and time.time() < deadline:
        time.sleep(0.02)
    assert len(busy_log) == len(rest)  # ... until the engine has been idle a while
    busy.close()


def test_background_compile_switch_is_0_or_1(monkeypatch):
    from jaxinfer.runner.compiled_steps import background_compile_enabled

    for value, want in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv("JAXINFER_BACKGROUND_COMPILE", value)
        assert background_compile_enabled() is want
    monkeypatch.setenv("JAXINFER_BACKGROUND_COMPILE", "false")
    with pytest.raises(ValueError, match="JAXINFER_BACKGROUND_COMPILE='false': use 0 or 1"):
        background_compile_enabled()


def test_a_dropped_engines_background_compiler_ends():
    """The background thread holds its CompiledSteps (hence the runner, weights and KV cache)
    only while it compiles: dropped without close(), they are collected and the thread ends."""
    import gc
    import weakref

    steps, _ = _steps()
    steps.start_background([(16, 1, PLAIN)], idle_seconds=0.0)
    thread, ref = steps._background, weakref.ref(steps)
    deadline = time.time() + 10
    while steps.background_left and time.time() < deadline:
        time.sleep(0.01)
    del steps
    while ref() is not None and time.time() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None
    thread.join(5)
    assert not thread.is_alive()


def test_engine_serves_during_background_compilation(tmp_path, smollm2_dir, caplog,
                                                      monkeypatch):
    """warmup_buckets="start": only the start-up set is compiled when the engine is ready;
    requests are served (same outputs as with every bucket compiled first) while the rest
    compile in the background, which ends with every bucket compiled."""
    monkeypatch.setenv("JAXINFER_BACKGROUND_COMPILE", "1")  # (conftest turns it off)
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, sharpen=2.0)
    prompts = [{"prompt_token_ids": [300 + 11 * i + j for j in range(5 + 13 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for buckets in ("all", "start"):
        with caplog.at_level(logging.INFO, logger="jaxinfer.engine.core"):
            llm = LLM(str(tmp_path), warmup=True, warmup_buckets=buckets, **OPTS)
        runner = llm.llm_engine.runner
        pairs = runner.buckets.all_pairs()
        compiled = {k[:2] for k in runner.compiled.keys()}
        assert compiled == set(pairs if buckets == "all" else runner.buckets.start_pairs())
        # ("all": the decode buckets are fused before serving too; "start": none yet)
        assert runner.compiled.num_fused == (len(runner.buckets.start_pairs())
                                             if buckets == "all" else 0)
        (line,) = [r.message for r in caplog.records if r.message.startswith("warm-up:")]
        assert f"{len(compiled)} step variants compiled" in line
        assert "from the persistent compilation cache" in line
        caplog.clear()
        got[buckets] = _outputs(llm, prompts, params)
        deadline = time.time() + 300
        while runner.compiled.background_left and time.time() < deadline:
            time.sleep(0.1)
        assert {k[:2] for k in runner.compiled.keys()} == set(pairs)
        assert_no_leaks(llm)
        llm.shutdown()
    assert got["start"] == got["all"]


def test_warm_start_compiles_nothing(tmp_path, smollm2_dir):
    """A second engine on the same persistent cache gets every executable from it (engine
    cores in their own processes, as users run them)."""
    make_tiny_model_dir(tmp_path / "m", "llama", smollm2_dir)
    opts = {**OPTS, "enable_multiprocessing": True, "warmup_buckets": "all",
            "compilation_cache_dir": str(tmp_path / "xla")}
    stats = []
    for _ in range(2):
        llm = LLM(str(tmp_path / "m"), warmup=True, **opts)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3),
                     use_tqdm=False)
        stats.append(llm.llm_engine.get_stats())
        llm.shutdown()
    cold, warm = stats
    # (cold: a few executables are alike across buckets, e.g. a head depends on T only)
    assert cold["compile_cache_hits"] < cold["compile_cache_requests"] // 2
    assert warm["compile_cache_requests"] == cold["compile_cache_requests"]
    assert warm["compile_cache_hits"] == warm["compile_cache_requests"]


def test_corrupt_compile_cache_is_rebuilt(tmp_path, smollm2_dir, caplog):
    """Every entry of the persistent compile cache overwritten with garbage or cut short: the
    engine removes them with one log line, compiles afresh, gives the same outputs and
    writes the entries again (the next start is answered by the cache: JAX alone would keep
    the corrupt entries, warn and recompile at every start)."""
    make_tiny_model_dir(tmp_path / "m", "llama", smollm2_dir)
    cache = tmp_path / "xla"
    opts = {**OPTS, "compilation_cache_dir": str(cache), "max_num_batched_tokens": 16,
            "max_num_seqs": 2}
    prompt = {"prompt_token_ids": [9, 8, 7, 6]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def start():
        llm = LLM(str(tmp_path / "m"), warmup=True, **opts)
        out = _outputs(llm, prompt, params)
        llm.shutdown()  # (the engine's own count, since it started)
        return out, llm.llm_engine.engine_core.core.worker.compile_cache.counts()

    want, _ = start()
    entries = [p for p in cache.rglob("*") if p.is_file()]
    assert entries
    for i, p in enumerate(entries):
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if i % 2 else b"\x00garbage" * 64)
    with caplog.at_level(logging.WARNING, logger="jaxinfer.runner.compile_cache"):
        got, counts = start()
    (line,) = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert f"removed {len(entries)} corrupt entries of {len(entries)}" in line
    assert got == want and counts["compile_cache_hits"] < counts["compile_cache_requests"]
    got, counts = start()
    assert got == want and counts["compile_cache_hits"] == counts["compile_cache_requests"] > 0


def test_each_engine_uses_the_cache_directory_it_asks_for(tmp_path, smollm2_dir):
    """JAX opens its persistent cache once per process; engines of one process that ask for
    different directories (or none) still get them."""
    make_tiny_model_dir(tmp_path / "m", "llama", smollm2_dir)
    opts = {**OPTS, "max_num_batched_tokens": 16, "max_num_seqs": 2}

    def files(d):
        return sorted(p.name for p in d.rglob("*-cache")) if d.exists() else []

    for name in ("a", "b"):
        llm = LLM(str(tmp_path / "m"), warmup=True, compilation_cache_dir=str(tmp_path / name),
                  **{k: v for k, v in opts.items() if k != "compilation_cache_dir"})
        llm.shutdown()
        assert files(tmp_path / name)
    before = files(tmp_path / "b")
    llm = LLM(str(tmp_path / "m"), warmup=True, **{**opts, "max_num_seqs": 1})  # cache off
    llm.shutdown()
    assert files(tmp_path / "b") == before


def test_fused_steps_swap_in_and_give_the_same_outputs(tmp_path, smollm2_dir, monkeypatch):
    """Layer-wise buckets are fused into whole programs in the background: a hot bucket while
    the engine is busy, the other used ones once it is idle. Steps then run fused (none on
    layer-wise programs) with the same tokens and logprobs, penalties and prompt logprobs
    included, and no KV block leaked."""
    monkeypatch.setenv("JAXINFER_BACKGROUND_COMPILE", "1")  # (conftest turns it off)
    make_tiny_model_dir(tmp_path, "qwen3", smollm2_dir, sharpen=2.0, num_hidden_layers=3)
    prompts, params = _mixed_requests()
    # (no warm-up: the buckets compile as steps ask; the background thread still fuses)
    llm = LLM(str(tmp_path), warmup=False, layers_per_program=2, **OPTS)
    compiled = llm.llm_engine.runner.compiled
    compiled.hot_steps = 3
    first = _outputs(llm, prompts, params)
    stats = llm.llm_engine.get_stats()
    assert stats["num_layerwise_steps"] > 0 and stats["num_steps"] >= stats["num_layerwise_steps"]
    deadline = time.time() + 300  # (the idle engine fuses every bucket steps used)
    while compiled.num_fused < len(compiled._uses) and time.time() < deadline:
        time.sleep(0.1)
    assert compiled.num_fused == len(compiled._uses) > 1 and not compiled._to_fuse()
    layerwise_before = compiled.num_layerwise_steps
    second = _outputs(llm, prompts, params)
    assert compiled.num_layerwise_steps == layerwise_before  # every step ran fused
    for a, b in zip(first, second):
        assert a[:2] == b[:2]
        for x, y in zip(a[2] + a[3], b[2] + b[3]):
            _close(x, y)
    assert_no_leaks(llm)
    llm.shutdown()

"""The engine core behind its clients: multiprocess by default, async scheduling token-identical
to synchronous stepping, a dead core is an error in the front end (never a hang)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.messages import (EngineCoreOutputs, EngineCoreRequest, EngineDeadError,
                                      encoder, outputs_decoder, request_decoder)
from jaxinfer.outputs import EngineCoreOutput, Logprobs
from jaxinfer.request import FinishReason
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

OPTS = dict(dtype="float32", max_model_len=96, max_num_seqs=6, max_num_batched_tokens=32,
            warmup=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-core")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


def test_core_process_sends_step_outputs_itself_in_order_with_the_queue():
    """EngineCoreProc.put_output: a step's tokens for the one front end go out from the busy
    loop's thread (no writer thread running here); with anything queued before them (a
    utility result) they queue behind it and the writer sends both in order; a socket that
    will not take them now (no peer yet) queues them too, nothing is dropped."""
    import zmq

    from jaxinfer.engine.core_proc import EngineCoreProc

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    inp = ctx.socket(zmq.PUSH)
    in_port = inp.bind_to_random_port("tcp://127.0.0.1")
    proc = EngineCoreProc({"outputs": [f"tcp://127.0.0.1:{port}"],
                           "inputs": [f"tcp://127.0.0.1:{in_port}"]})
    dec = outputs_decoder()

    def step(rid, tok):
        return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, (tok,), None)])

    def recv():
        assert pull.poll(5000), "nothing arrived"
        return dec.decode(pull.recv())

    try:
        proc.owners["r"] = 0
        time.sleep(0.2)  # (the PUSH socket connected)
        proc.put_output(step("r", 1))
        assert proc.pending == 0 and recv().outputs[0].new_token_ids == (1,)
        proc.put_output(EngineCoreOutputs(utility_output=(3, "ok", None)))
        proc.put_output(step("r", 2))  # behind the queued utility result: queued too
        assert proc.pending == 2 and not pull.poll(200)
        writer = threading.Thread(target=proc.write_outputs, daemon=True)
        writer.start()
        first, second = recv(), recv()
        assert tuple(first.utility_output) == (3, "ok", None)
        assert second.outputs[0].new_token_ids == (2,)
        deadline = time.monotonic() + 5
        while proc.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.pending == 0
        proc.put_output(EngineCoreOutputs(outputs=[EngineCoreOutput("r", (3,),
                                                                    FinishReason.LENGTH)]))
        assert recv().outputs[0].finish_reason == FinishReason.LENGTH
        assert "r" not in proc.owners  # (finished: its owner forgotten, as the writer does)
        proc.outputs.put(None)
        writer.join(timeout=5)
    finally:
        proc.close()
        pull.close()
        inp.close()
        ctx.term()
    # a socket that cannot take a message now (its high-water mark reached): the step's
    # outputs wait in the queue for the writer, which blocks on the socket instead
    full = EngineCoreProc({"outputs": ["tcp://127.0.0.1:1"], "inputs": []})
    sock = full.out_socks[0]

    class Full:
        def send(self, data, flags=0):
            raise zmq.Again()

    try:
        full.out_socks[0] = Full()
        full.put_output(step("r", 4))
        assert full.pending == 1 and full.outputs.qsize() == 1
    finally:
        full.out_socks[0] = sock
        sock.setsockopt(zmq.LINGER, 0)
        full.close()


def test_messages_round_trip():
    params = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[3], logprobs=2, seed=7)
    req = EngineCoreRequest("r-1", [1, 2, 3], params, 2, 12.5, 99, priority=1, cache_salt="s")
    got = request_decoder().decode(encoder().encode(req))
    assert got == req and got.sampling_params == params
    out = EngineCoreOutputs(outputs=[EngineCoreOutput(
        "r-1", (5, 6), FinishReason.STOP, "x", (Logprobs(5, -0.1, 1, (5, 7), (-0.1, -2.0)),),
        None, 16)], stats={"num_running_reqs": 1}, utility_output=(3, [1, 2], None))
    back = outputs_decoder().decode(encoder().encode(out))
    assert back.outputs == out.outputs and back.stats == out.stats
    assert tuple(back.utility_output) == (3, [1, 2], None)


def _workload():
    prompts = [{"prompt_token_ids": [1000 + 37 * i + j for j in range(5 + 9 * i)]}
               for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=10 + i,
                             stop_token_ids=[1234]) for i in range(8)]
    params[3] = SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True)
    params[5] = SamplingParams(temperature=0.8, seed=5, max_tokens=14, presence_penalty=0.5,
                               repetition_penalty=1.2, ignore_eos=True)
    return prompts, params


def test_async_scheduling_is_token_identical(tiny_dir):
    """Same tokens, logprobs and finish reasons with async scheduling as without, on a tight
    cache (preemption) and a small token budget (chunked prefill), with seeded sampling and
    penalties; through the engine-core process."""
    prompts, params = _workload()
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_dir, num_kv_blocks=13, block_size=8, async_scheduling=async_scheduling,
                  **OPTS)
        assert llm.llm_engine.multiprocessing
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[async_scheduling] = [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason,
             [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs or []])
            for o in outs]
        stats = llm.llm_engine.get_stats()
        assert stats["num_preemptions"] > 0
        assert_no_leaks(llm)
        llm.shutdown()
    for (toks_a, fin_a, lps_a), (toks_s, fin_s, lps_s) in zip(results[True], results[False]):
        assert (toks_a, fin_a) == (toks_s, fin_s)
        assert len(lps_a) == len(lps_s)
        for da, ds in zip(lps_a, lps_s):  # the same top tokens; values up to float noise
            assert da.keys() == ds.keys()
            assert all(abs(da[k] - ds[k]) < 1e-4 for k in da)
    assert all(len(r[0]) > 0 for r in results[True])
    assert any(r[2] for r in results[True])  # logprobs were compared


def test_llm_reads_the_core_itself_and_keeps_outputs_read_during_a_utility_call(tiny_dir):
    """The LLM's client has no reader thread (get_output reads the core's socket in the
    caller's thread); a utility call made while steps' outputs are on their way reads them
    too and keeps them for get_output: every token arrives, in order, after the call."""
    llm = LLM(tiny_dir, **OPTS)
    eng = llm.llm_engine
    assert eng.engine_core._reader is None
    assert not any(t.name == "jaxinfer-client-out" for t in threading.enumerate())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": [1000 + i, 1001, 1002]} for i in range(2)], params,
        use_tqdm=False)]
    for i in range(2):
        eng.add_request(f"u{i}", {"prompt_token_ids": [1000 + i, 1001, 1002]}, params)
    time.sleep(1.0)  # (the core steps meanwhile: its outputs wait on the socket)
    assert eng.engine_core.call_utility("get_stats")["num_steps"] > 0
    assert eng.engine_core._shared.outputs.qsize() > 0  # read while waiting, kept
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert [got["u0"], got["u1"]] == want
    llm.shutdown()


def test_killed_core_is_a_clear_error_within_seconds(tiny_dir):
    llm = LLM(tiny_dir, num_kv_blocks=40, **OPTS)
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": list(range(1000, 1010))},
                    SamplingParams(max_tokens=80, ignore_eos=True))
    assert eng.step()  # the core is serving
    os.kill(eng.engine_core.p.proc.pid, signal.SIGKILL)
    errors, t0 = [], time.monotonic()

    def drain():
        try:
            while eng.has_unfinished_requests():
                eng.step()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=drain, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the front end hung after the core died"
    assert time.monotonic() - t0 < 10
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "died" in str(errors[0])
    with pytest.raises(EngineDeadError):  # and every later call fails the same way
        llm.generate("hello", use_tqdm=False)
    llm.shutdown()


def test_async_llm_streams_fail_when_the_core_dies(tiny_dir):
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=tiny_dir, num_kv_blocks=40, **OPTS))

    async def main():
        got = []
        params = SamplingParams(max_tokens=80, ignore_eos=True)
        with pytest.raises(EngineDeadError):
            async for out in llm.generate({"prompt_token_ids": [1000, 1001]}, params):
                got.append(out)
                if len(got) == 2:
                    os.kill(llm.engine_core.p.proc.pid, signal.SIGKILL)
        assert len(got) >= 2
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("again", params):
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    llm.shutdown()


def test_core_dies_with_its_parent(tiny_dir):
    """A front end killed outright takes its engine core with it."""
    script = (
        "import sys\n"
        "from jaxinfer import LLM\n"
        f"llm = LLM({tiny_dir!r}, num_kv_blocks=40, **{OPTS!r})\n"
        "print(llm.llm_engine.engine_core.p.proc.pid, flush=True)\n"
        "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(core_pid):
            time.sleep(0.2)
        assert not _alive(core_pid), "the engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_block_size_defaults_to_128_on_cpu_and_a_set_one_is_kept(tiny_dir):
    """vLLM's CPU backend default: 128-token KV blocks on CPU devices (16 on GPUs); the core
    tells the front end (its processor checks prompts against blocks of that size)."""
    import jax

    from jaxinfer.runner.worker import resolve_block_size

    assert resolve_block_size(None, jax.devices("cpu")) == 128
    assert resolve_block_size(32, jax.devices("cpu")) == 32

    class Gpu:
        platform = "gpu"

    assert resolve_block_size(None, [Gpu()]) == 16
    with pytest.raises(ValueError, match="num_kv_blocks=3 x block_size=1073741824"):
        LLM(tiny_dir, num_kv_blocks=3, block_size=1 << 30, enable_multiprocessing=False, **OPTS)
    for block_size, want in ((None, 128), (16, 16)):
        llm = LLM(tiny_dir, num_kv_blocks=12, block_size=block_size,
                  enable_multiprocessing=False, **OPTS)
        assert llm.llm_engine.processor.block_size == want
        assert llm.llm_engine.engine_core.core.runner.block_size == want
        out = llm.generate({"prompt_token_ids": list(range(10, 60))},
                           SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        llm.shutdown()


def test_core_start_up_errors_reach_the_front_end(tiny_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        # the core's Scheduler refuses: 2 usable blocks of 16 < 96 tokens
        LLM(tiny_dir, num_kv_blocks=3, block_size=16, **OPTS)


def test_multiprocessing_switch(tiny_dir, monkeypatch):
    monkeypatch.setenv("JAXINFER_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(tiny_dir, num_kv_blocks=40, **OPTS)
    assert not llm.llm_engine.multiprocessing
    assert llm.llm_engine.scheduler is llm.llm_engine.engine_core.core.scheduler
    out = llm.generate({"prompt_token_ids": [1000, 1001]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    monkeypatch.setenv("JAXINFER_ENABLE_MULTIPROCESSING", "1")
    mp = LLM(tiny_dir, num_kv_blocks=40, **OPTS)
    with pytest.raises(AttributeError, match="another process"):
        mp.llm_engine.scheduler
    assert mp.generate({"prompt_token_ids": [1000, 1001]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    mp.shutdown()


@pytest.mark.parametrize("mp", [True, False])
def test_async_llm_serves_one_event_loop_after_another(tiny_dir, mp):
    """asyncio.run twice with one AsyncLLM (core process or background thread): the second
    loop is served too, with the same greedy tokens."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=tiny_dir, num_kv_blocks=40, enable_multiprocessing=mp,
                                **OPTS))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def one():
        last = None
        async for out in llm.generate({"prompt_token_ids": [1000, 1001, 1002]}, params):
            last = out
        return last.outputs[0].token_ids

    first = asyncio.run(asyncio.wait_for(one(), timeout=60))
    second = asyncio.run(asyncio.wait_for(one(), timeout=60))
    assert len(first) == 5 and second == first
    assert asyncio.run(llm.call_utility("leak_report")) == []
    llm.shutdown()

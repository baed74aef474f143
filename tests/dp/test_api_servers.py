"""`jaxinfer serve` as several processes on 127.0.0.1 (a tiny model): two API servers sharing
one port over two engine-core ranks; and a head with one rank plus a `--headless` node with
the other (the multi-node layout, over TCP). Greedy outputs equal one in-process engine's,
both API servers answer, /metrics adds up over them, 200 concurrent requests spread evenly
over the ranks; a headless node that dies is reported, its requests in flight end (abort,
naming the rank) and the head keeps serving on its own rank."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from jaxinfer import LLM, SamplingParams  # noqa: E402
from tests.kv_connector.test_pd_servers import (SERVE_ARGS, _complete, _port,  # noqa: E402
                                                _start, _wait_all_free, _wait_up)

OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
            block_size=8, warmup=False, enable_multiprocessing=False, num_kv_blocks=80)
PROMPTS = [[1000 + 37 * i + j for j in range(5 + 7 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    from tests.engine.conftest import make_tiny_model_dir

    path = tmp_path_factory.mktemp("tiny-api")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(tiny_dir, **OPTS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _metrics(url) -> dict[str, float]:
    """name{labels} -> value, summed over the API servers' files by the one answering."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _total(metrics, name, label="") -> float:
    """A series summed over its label sets (e.g. over the engines), those with `label` only."""
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") and label in k)


def _labelled(metrics, name, label) -> dict[str, float]:
    got = {}
    for key, value in metrics.items():
        m = re.match(rf'{re.escape(name)}\{{.*{label}="([^"]+)"', key)
        if m:
            got[m.group(1)] = value
    return got


@pytest.fixture(scope="module")
def two_servers(tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("api-logs")
    port = _port()
    proc = _start(["serve", tiny_dir, "--port", str(port), "--served-model-name", "tiny",
                   "--data-parallel-size", "2", "--api-server-count", "2", *SERVE_ARGS],
                  open(logs / "serve.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, [proc])
        yield url, proc, logs / "serve.log"
    finally:
        _stop([proc])


def test_two_api_servers_over_two_ranks(two_servers, reference):
    url, proc, log = two_servers
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    assert [o["choices"][0]["text"] for o in outs] == reference
    assert _complete(url, PROMPTS[3], stream=True) == reference[3]

    # 200 concurrent requests (new connections each: the kernel spreads them over the two
    # servers' shared port) spread over the two ranks within +-15%.
    before = _metrics(url)
    body = {"model": "tiny", "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    async def burst():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            return await asyncio.gather(*(client.post(
                url + "/v1/completions",
                json=dict(body, prompt=[2000 + 13 * i + j for j in range(3 + i % 9)]))
                for i in range(200)))

    codes = [r.status_code for r in asyncio.run(burst())]
    assert codes == [200] * 200
    _wait_all_free(url)
    after = _metrics(url)

    def delta(name, label):
        a, b = _labelled(after, name, label), _labelled(before, name, label)
        return {k: v - b.get(k, 0) for k, v in a.items()}

    routed = delta("jaxinfer:dp_requests_routed_total", "engine")
    assert sum(routed.values()) == 200 and all(abs(routed[r] - 100) <= 15 for r in "01"), routed
    served = delta("jaxinfer:api_server_requests_total", "api_server")
    assert sum(served.values()) == 200 and set(served) == {"0", "1"} and min(
        served.values()) > 0, served
    # /metrics (whichever server answers) totals every server's requests.
    length = ("vllm:request_success_total", 'finished_reason="length"')
    assert _total(after, *length) - _total(before, *length) == 200
    # (both engines served some: the request series carry the rank that served them)
    assert len(_labelled(after, "vllm:request_success_total", "engine")) == 2
    assert _total(after, "vllm:num_requests_running") == 0

    # Clients that go away mid-stream: whichever server and rank hold them, they are aborted
    # there and every block comes back.
    aborted = ("vllm:request_success_total", 'finished_reason="abort"')
    before = {aborted: _total(_metrics(url), *aborted)}
    for i in range(4):
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=dict(
                body, prompt=[4000 + 17 * i + j for j in range(20)], max_tokens=100,
                stream=True)) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
    end = time.time() + 30
    while _total(_metrics(url), *aborted) - before[aborted] < 4:
        assert time.time() < end, "the disconnected requests were not aborted"
        time.sleep(0.2)
    _wait_all_free(url)
    assert proc.poll() is None


@pytest.fixture(scope="module")
def head_and_headless(tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multinode-logs")
    port, rpc = _port(), _port()
    multinode = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
                 "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    os.environ["JAXINFER_ENGINE_HEARTBEAT_TIMEOUT"] = "4"  # (inherited by the head's servers)
    try:
        head = _start(["serve", tiny_dir, "--port", str(port), "--served-model-name", "tiny",
                       *multinode, *SERVE_ARGS], open(logs / "head.log", "w"))
        node = _start(["serve", tiny_dir, "--headless", "--data-parallel-start-rank", "1",
                       *multinode, *SERVE_ARGS], open(logs / "node.log", "w"))
    finally:
        del os.environ["JAXINFER_ENGINE_HEARTBEAT_TIMEOUT"]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, [head, node])
        yield url, head, node, logs
    finally:
        _stop([head, node])


def test_head_and_headless_node(head_and_headless, reference):
    url, head, node, logs = head_and_headless
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    assert [o["choices"][0]["text"] for o in outs] == reference
    routed = _labelled(_metrics(url), "jaxinfer:dp_requests_routed_total", "engine")
    assert set(routed) == {"0", "1"} and min(routed.values()) >= 3, routed

    # The headless node dies with requests in flight on its rank: they end, naming it.
    routed_before = _labelled(_metrics(url), "jaxinfer:dp_requests_routed_total", "engine")
    body = {"model": "tiny", "temperature": 0, "max_tokens": 110, "ignore_eos": True,
            "stream": True}
    long = [[3000 + 11 * i + j for j in range(6)] for i in range(4)]
    started = threading.Event()

    def stream(i):
        reason = None
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, prompt=long[i]),
                          timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: ") and line != "data: [DONE]":
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
        return reason

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        assert started.wait(60)  # the first token of any of them: none can have finished
        os.killpg(node.pid, signal.SIGKILL)
        reasons = [f.result() for f in futures]
    routed = _labelled(_metrics(url), "jaxinfer:dp_requests_routed_total", "engine")
    to_rank = {r: int(routed[r] - routed_before[r]) for r in "01"}
    # Those sent to rank 1 (before it died or before its silence was noticed) end "abort",
    # those on rank 0 run to their length.
    assert sorted(reasons) == ["abort"] * to_rank["1"] + ["length"] * to_rank["0"], \
        (reasons, to_rank)
    assert to_rank["1"] >= 1 and to_rank["0"] >= 1
    text = open(logs / "head.log").read()
    assert "data-parallel engine core 1 died" in text
    # The head keeps serving on rank 0, outputs unchanged; no KV block left in use there
    # (rank 1's series keep what it last reported).
    assert _complete(url, PROMPTS[2])["choices"][0]["text"] == reference[2]
    _wait_all_free(url, label='engine="0"')
    assert head.poll() is None
    assert json.loads(httpx.get(url + "/v1/models", timeout=10).text)["data"][0]["id"] == "tiny"


def test_ray_backend_runs_the_ranks_as_actors(tiny_dir, reference, tmp_path):
    """--data-parallel-backend ray (a local Ray instance; the optional extra, skipped
    without it): the ranks are Ray actors connected over TCP; same outputs."""
    pytest.importorskip("ray")
    port = _port()
    log = tmp_path / "ray.log"
    proc = _start(["serve", tiny_dir, "--port", str(port), "--served-model-name", "tiny",
                   "--data-parallel-size", "2", "--data-parallel-backend", "ray", *SERVE_ARGS],
                  open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, [proc])
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: _complete(url, p), PROMPTS))
        assert [o["choices"][0]["text"] for o in outs] == reference
        routed = _labelled(_metrics(url), "jaxinfer:dp_requests_routed_total", "engine")
        assert set(routed) == {"0", "1"}, routed
        assert "started as Ray actors" in open(log).read()
    finally:
        _stop([proc])

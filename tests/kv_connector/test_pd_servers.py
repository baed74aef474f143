"""Disaggregated prefill/decode with real processes on 127.0.0.1: `jaxinfer serve` as a
prefill instance and as a decode instance, `jaxinfer proxy` in front; greedy outputs through
the proxy equal one colocated engine's; killing the prefill instance mid-transfer leaves the
decode instance recomputing; afterwards every KV block is free."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from jaxinfer import LLM  # noqa: E402
from tests.kv_connector.test_kv_connector import GREEDY, OPTS, workload  # noqa: E402

SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "32", "--block-size", "8",
              "--num-gpu-blocks-override", "80", "--no-warmup"]


EXTRA = [9000 + j for j in range(40)]


def _port() -> int:
    """A free port below the kernel's ephemeral range: the servers bind it seconds later, and
    a port the kernel handed out (bind to 0) could meanwhile go to another socket the same way
    (the prefill instance's KV transfer server took the decode instance's port once in CI)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _start(args, log):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.entrypoints.cli", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_up(url, procs, timeout=180):
    end = time.time() + timeout
    while time.time() < end:
        for p in procs:
            assert p.poll() is None, f"a server exited with {p.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not come up")


def _metric(url, name, label: str = "") -> float:
    """The series `name` summed over its label sets holding `label` (every engine's, under
    data parallelism: the first line alone is engine 0's)."""
    values = [float(line.split()[-1])
              for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
              if line.startswith((name + "{", name + " ")) and label in line]
    if not values:
        raise AssertionError(f"no metric {name}")
    return sum(values)


def _wait_all_free(url, timeout=30, label=""):
    """Until every engine (those whose series hold `label`) holds no KV block and no request."""
    end = time.time() + timeout
    while time.time() < end:
        if (_metric(url, "vllm:kv_cache_usage_perc", label) == 0.0
                and _metric(url, "vllm:num_requests_running", label) == 0
                and _metric(url, "vllm:num_requests_waiting", label) == 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"{url}: KV blocks still in use")


def _complete(url, prompt_ids, stream=False, **extra):
    body = {"model": "tiny", "prompt": prompt_ids, "temperature": 0, "max_tokens": 12,
            "ignore_eos": True, "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    toks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                toks.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(toks)


@pytest.fixture(scope="module", params=["JaxTransferConnector", "SharedStorageConnector"])
def pd(request, tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-logs")
    pp, dp, xp = _port(), _port(), _port()
    connector = request.param
    extra = {}
    if connector == "SharedStorageConnector":
        extra["shared_storage_path"] = str(tmp_path_factory.mktemp("kv-store"))
    # (the producer's abort_timeout is a JaxTransferConnector option only)
    held = {"abort_timeout": 30} if connector == "JaxTransferConnector" else {}
    ktc = lambda role, **x: json.dumps({"kv_connector": connector,  # noqa: E731
                                        "kv_role": role,
                                        "kv_connector_extra_config": dict(extra, **x)})
    procs = {
        "prefill": _start(["serve", tiny_dir, "--port", str(pp), "--served-model-name", "tiny",
                           "--kv-transfer-config", ktc("kv_producer", **held),
                           *SERVE_ARGS], open(logs / "prefill.log", "w")),
        "decode": _start(["serve", tiny_dir, "--port", str(dp), "--served-model-name", "tiny",
                          "--kv-transfer-config", ktc("kv_consumer", pull_timeout=8),
                          *SERVE_ARGS], open(logs / "decode.log", "w")),
        "proxy": _start(["proxy", "--prefill", f"http://127.0.0.1:{pp}", "--decode",
                         f"http://127.0.0.1:{dp}", "--port", str(xp)],
                        open(logs / "proxy.log", "w")),
    }
    urls = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
            "proxy": f"http://127.0.0.1:{xp}"}
    try:
        for name in ("prefill", "decode", "proxy"):
            _wait_up(urls[name], procs.values())
        yield urls, procs, connector
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    from tests.engine.conftest import make_tiny_model_dir

    path = tmp_path_factory.mktemp("tiny-pd")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


@pytest.fixture(scope="module")
def colocated(tiny_dir):
    llm = LLM(tiny_dir, **OPTS)
    outs = llm.generate(workload() + [{"prompt_token_ids": EXTRA}], GREEDY)
    llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_pd_through_the_proxy_equals_colocated(pd, colocated):
    from concurrent.futures import ThreadPoolExecutor

    urls, _, connector = pd
    prompts = [p["prompt_token_ids"] for p in workload()]
    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: mixed lengths in flight
        outs = list(pool.map(lambda p: _complete(urls["proxy"], p), prompts))
    assert [o["choices"][0]["text"] for o in outs] == [t for _, t in colocated[:-1]]
    # Streaming through the proxy relays the decode instance's stream.
    assert _complete(urls["proxy"], prompts[4], stream=True) == colocated[4][1]
    # The prefill instance answers kv_transfer_params itself (what the proxy forwards).
    r = _complete(urls["prefill"], prompts[3], max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True})
    ktp = r["kv_transfer_params"]
    assert ktp["do_remote_prefill"] and ktp["remote_num_blocks"] == 3
    assert _complete(urls["decode"], prompts[3], kv_transfer_params=ktp)["choices"][0][
        "text"] == colocated[3][1]
    for name in ("prefill", "decode"):
        _wait_all_free(urls[name])
    # The decode instance loaded the prompts' KV (every full block but those holding a last
    # prompt token, less its own prefix-cache hits) and computed the rest.
    assert _metric(urls["decode"], "jaxinfer:kv_connector_loaded_tokens_total") >= 8 * 10
    assert _metric(urls["decode"], "jaxinfer:kv_connector_load_failures_total") == 0


def test_client_disconnect_at_the_proxy_frees_both_sides(pd):
    urls, _, _ = pd

    def aborts():
        text = httpx.get(urls["decode"] + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")
                   and 'finished_reason="abort"' in line)

    before = aborts()
    body = {"model": "tiny", "prompt": [7000 + j for j in range(45)], "temperature": 0,
            "max_tokens": 80, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", urls["proxy"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The client went away after its first token: the decode request is aborted, the
    # prefill side's held blocks were pulled and released.
    end = time.time() + 30
    while aborts() < before + 1:
        assert time.time() < end, "the decode request was not aborted"
        time.sleep(0.2)
    for name in ("prefill", "decode"):
        _wait_all_free(urls[name])


@pytest.mark.parametrize("pd", ["JaxTransferConnector"], indirect=True)
def test_killing_the_prefill_instance_mid_transfer(pd, colocated):
    """The prefill instance dies after handing out its params, before the decode instance
    pulls: the decode instance gives up after pull_timeout, recomputes, answers the colocated
    output, and holds no block afterwards."""
    urls, procs, _ = pd
    prompt = EXTRA
    r = _complete(urls["prefill"], prompt, max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True})
    ktp = r["kv_transfer_params"]
    os.killpg(procs["prefill"].pid, signal.SIGKILL)
    procs["prefill"].wait(timeout=30)
    out = _complete(urls["decode"], prompt, kv_transfer_params=ktp)
    assert out["choices"][0]["text"] == colocated[-1][1]
    _wait_all_free(urls["decode"])
    # The proxy skips a dead prefill instance: the decode instance computes the prompt.
    p = [p["prompt_token_ids"] for p in workload()][5]
    assert _complete(urls["proxy"], p)["choices"][0]["text"] == colocated[5][1]
    _wait_all_free(urls["decode"])

"""Disaggregated prefill/decode on CPU: TTFT and ITL, colocated vs 1 prefill + 1 decode.

A mixed workload through `jaxinfer bench serve`, two streams at once:
- "decode": short prompts with long outputs at a fixed concurrency (their ITL is what a
  prefill burst stalls in a colocated engine);
- "long": long prompts with short outputs arriving at a fixed rate (their TTFT).
Setups, SmolLM2-135M-Instruct (bfloat16 weights, the default), same flags for every server:
- colocated: one `jaxinfer serve` on both cores;
- pd: `jaxinfer serve` as prefill instance pinned to core 0, another as decode instance on
  core 1 (JaxTransferConnector), `jaxinfer proxy` in front (the same two cores in total).
Each setup runs the workload once to compile (not timed), then once timed. Prints and saves
JSON with both setups' numbers and the pd/colocated ratios.

Usage (from the repository root, with `make setup` done):

    PYTHONPATH=. .venv/bin/python benchmarks/disagg_pd.py \
        [--output-json benchmarks/results/disagg_pd_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

SERVE = ["--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
         "--num-gpu-blocks-override", "700", "--no-warmup", "--served-model-name", "smol"]
DECODE = ["--dataset", "random", "--num-prompts", "16", "--input-len", "64",
          "--output-len", "64", "--max-concurrency", "4", "--vocab-size", "40000"]
LONG = ["--dataset", "random", "--num-prompts", "6", "--input-len", "1536",
        "--output-len", "4", "--request-rate", "0.5", "--vocab-size", "40000"]
WARM_DECODE = ["--dataset", "random", "--num-prompts", "4", "--input-len", "64",
               "--output-len", "64", "--max-concurrency", "4", "--vocab-size", "40000"]
WARM_LONG = ["--dataset", "random", "--num-prompts", "2", "--input-len", "1536",
             "--output-len", "4", "--request-rate", "inf", "--vocab-size", "40000"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args, cores=None, log=None):
    cmd = [sys.executable, "-m", "jaxinfer.entrypoints.cli", *args]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    return subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_up(url, timeout=900):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up")


def _bench(url, args, out_json, seed):
    return _cli(["bench", "serve", "--base-url", url, "--model", "smol", "--seed", str(seed),
                 *args, "--output-json", out_json])


def _workload(url, tmp, tag, warm=False):
    """Both streams at once; returns their JSON results."""
    d, lo = os.path.join(tmp, f"{tag}-decode.json"), os.path.join(tmp, f"{tag}-long.json")
    procs = [_bench(url, WARM_DECODE if warm else DECODE, d, 1),
             _bench(url, WARM_LONG if warm else LONG, lo, 2)]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("bench serve failed")
    return json.load(open(d)), json.load(open(lo))


def _summary(decode, long):
    return {"decode_stream": {"itl_ms": decode["itl_ms"], "tpot_ms": decode["tpot_ms"],
                              "ttft_ms": decode["ttft_ms"],
                              "output_throughput": decode["output_throughput"],
                              "completed": decode["completed"], "failed": decode["failed"]},
            "long_stream": {"ttft_ms": long["ttft_ms"], "e2e_latency_ms": long["e2e_latency_ms"],
                            "completed": long["completed"], "failed": long["failed"]}}


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def run_setup(name, tmp, logdir):
    procs = []
    try:
        if name == "colocated":
            port = _port()
            procs.append(_cli(["serve", "--port", str(port), *SERVE], "0,1",
                              open(os.path.join(logdir, "colocated.log"), "w")))
            url = f"http://127.0.0.1:{port}"
            _wait_up(url)
        else:
            pp, dp, xp = _port(), _port(), _port()
            ktc = lambda role: json.dumps({"kv_connector": "JaxTransferConnector",  # noqa
                                           "kv_role": role})
            procs.append(_cli(["serve", "--port", str(pp), *SERVE, "--kv-transfer-config",
                               ktc("kv_producer")], "0",
                              open(os.path.join(logdir, "prefill.log"), "w")))
            procs.append(_cli(["serve", "--port", str(dp), *SERVE, "--kv-transfer-config",
                               ktc("kv_consumer")], "1",
                              open(os.path.join(logdir, "decode.log"), "w")))
            procs.append(_cli(["proxy", "--prefill", f"http://127.0.0.1:{pp}", "--decode",
                               f"http://127.0.0.1:{dp}", "--port", str(xp)], None,
                              open(os.path.join(logdir, "proxy.log"), "w")))
            for port in (pp, dp, xp):
                _wait_up(f"http://127.0.0.1:{port}")
            url = f"http://127.0.0.1:{xp}"
        _workload(url, tmp, f"{name}-warm", warm=True)
        _workload(url, tmp, f"{name}-warm2", warm=True)
        return _summary(*_workload(url, tmp, name))
    finally:
        _stop(procs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default="benchmarks/results/disagg_pd_cpu.json")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="disagg-bench-")
    logdir = args.log_dir or tmp
    results = {name: run_setup(name, tmp, logdir) for name in ("colocated", "pd")}
    c, p = results["colocated"], results["pd"]
    ratios = {}
    for stream, metric in (("decode_stream", "itl_ms"), ("decode_stream", "tpot_ms"),
                           ("decode_stream", "ttft_ms"), ("long_stream", "ttft_ms")):
        for stat in ("mean", "median", "p99"):
            ratios[f"{stream}.{metric}.{stat}"] = round(
                p[stream][metric][stat] / c[stream][metric][stat], 3)
    out = {"benchmark": "disagg_pd", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "model": "SmolLM2-135M-Instruct (bfloat16)",
           "workload": {"decode_stream": " ".join(DECODE), "long_stream": " ".join(LONG)},
           "serve_flags": " ".join(SERVE),
           "setups": {"colocated": "one jaxinfer serve, taskset -c 0,1",
                      "pd": "prefill jaxinfer serve (kv_producer, JaxTransferConnector) on "
                            "core 0, decode (kv_consumer) on core 1, jaxinfer proxy"},
           "results": results, "pd_over_colocated": ratios,
           "note": "ratios < 1: P/D is lower (better) on that latency"}
    print(json.dumps(out, indent=1))
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

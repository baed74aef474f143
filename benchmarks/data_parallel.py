"""Data parallelism on CPU: throughput and TTFT of DP=1 vs DP=2 through `jaxinfer bench serve`.

SmolLM2-135M-Instruct (bf16 weights), the same flags for both servers:
- DP=1: `jaxinfer serve` under `taskset -c 0` (one engine, one core);
- DP=2: `jaxinfer serve --data-parallel-size 2` under `taskset -c 0,1` (two engines; the two
  cores are shared by the OS between them, each process's XLA sees both).
Workload: 64 random prompts (128 tokens), 64 output tokens, all at once (max concurrency 64).
Each setup runs the workload once to compile (not timed), then once timed. Prints and saves
JSON with both setups and the DP=2 / DP=1 ratios.

Usage (from the repository root, with `make setup` done):

    PYTHONPATH=. .venv/bin/python benchmarks/data_parallel.py \
        [--output-json benchmarks/results/data_parallel_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

from benchmarks.disagg_pd import _cli, _port, _stop, _wait_up

SERVE = ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
         "--num-gpu-blocks-override", "1200", "--no-warmup", "--served-model-name", "smol"]
LOAD = ["--dataset", "random", "--num-prompts", "64", "--input-len", "128",
        "--output-len", "64", "--request-rate", "inf", "--max-concurrency", "64",
        "--vocab-size", "40000"]
WARM = ["--dataset", "random", "--num-prompts", "64", "--input-len", "128",
        "--output-len", "8", "--request-rate", "inf", "--max-concurrency", "64",
        "--vocab-size", "40000"]


def _bench(url, args, out, seed):
    p = _cli(["bench", "serve", "--base-url", url, "--model", "smol", "--seed", str(seed),
              *args, "--output-json", out])
    if p.wait() != 0:
        raise RuntimeError("bench serve failed")
    return json.load(open(out))


def run(dp: int, tmp: str, logdir: str) -> dict:
    port = _port()
    cores = "0" if dp == 1 else "0,1"
    procs = [_cli(["serve", "--port", str(port), *SERVE, "--data-parallel-size", str(dp)],
                  cores, open(os.path.join(logdir, f"dp{dp}.log"), "w"))]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url)
        _bench(url, WARM, os.path.join(tmp, f"dp{dp}-warm.json"), 1)
        r = _bench(url, LOAD, os.path.join(tmp, f"dp{dp}.json"), 2)
    finally:
        _stop(procs)
    return {k: r[k] for k in ("completed", "failed", "duration", "request_throughput",
                              "output_throughput", "ttft_ms", "tpot_ms", "itl_ms")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default="benchmarks/results/data_parallel_cpu.json")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dp-bench-")
    logdir = args.log_dir or tmp
    results = {"dp1": run(1, tmp, logdir), "dp2": run(2, tmp, logdir)}
    a, b = results["dp1"], results["dp2"]
    ratios = {"output_throughput": round(b["output_throughput"] / a["output_throughput"], 3)}
    for stat in ("mean", "median", "p99"):
        ratios[f"ttft_ms.{stat}"] = round(b["ttft_ms"][stat] / a["ttft_ms"][stat], 3)
    out = {"benchmark": "data_parallel", "machine": f"{platform.machine()}, {os.cpu_count()} "
           "cores", "model": "SmolLM2-135M-Instruct (bfloat16)", "serve_flags": " ".join(SERVE),
           "workload": " ".join(LOAD),
           "setups": {"dp1": "jaxinfer serve, taskset -c 0",
                      "dp2": "jaxinfer serve --data-parallel-size 2, taskset -c 0,1"},
           "results": results, "dp2_over_dp1": ratios}
    print(json.dumps(out, indent=1))
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

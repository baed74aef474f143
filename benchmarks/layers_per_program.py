"""Layers per layer-wise program: start-up cost against steady-state step speed, in one run.

For each `--groups` value G, `jaxinfer bench throughput` (32 requests x 128 random prompt / 128
output tokens, greedy, EOS ignored, SmolLM2 float32, --max-model-len 1024) with
`--step-compilation layerwise --layers-per-program G`, each in its own process:
  cold: an empty persistent compile cache, start-up buckets before serving (the default):
        wall time launch to exit, and the workload's own time;
  steady: every bucket compiled before the workload (--warmup-buckets all, cache warm),
        the groups interleaved `--reps` times, plus whole steps as the reference: output tok/s.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/layers_per_program.py [--groups 3,5] [--reps 2]
           [--output-json benchmarks/results/layers_per_program_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOAD = ["--num-prompts", "32", "--input-len", "128", "--output-len", "128", "--greedy",
            "--no-tqdm", "--max-model-len", "1024"]


def run(flags: list[str], cache_dir: str, label: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "jaxinfer.entrypoints.cli", "bench", "throughput", *WORKLOAD,
           *flags, "--output-json", out]
    env = dict(os.environ, JAXINFER_COMPILATION_CACHE_DIR=cache_dir, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    row = {"config": label, "flags": flags, "total_wall_s": wall,
           "workload_s": res["elapsed_time"],
           "output_tokens_per_second": res["output_tokens_per_second"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", default="3,5")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-whole", action="store_true", help="skip the whole-step reference")
    p.add_argument("--output-json", default=os.path.join(HERE, "results",
                                                         "layers_per_program_cpu.json"))
    args = p.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    configs = {f"layerwise/{g}": ["--step-compilation", "layerwise",
                                  "--layers-per-program", str(g)] for g in groups}
    caches = {k: tempfile.mkdtemp(prefix="jaxinfer-xla-lpp-") for k in configs}
    cold = [run(flags + ["--warmup-buckets", "start"], caches[k], k)
            for k, flags in configs.items()]
    if not args.no_whole:
        configs["whole"] = ["--step-compilation", "whole"]
        caches["whole"] = tempfile.mkdtemp(prefix="jaxinfer-xla-lpp-")
    steady = []
    for _ in range(args.reps):
        for k, flags in configs.items():
            steady.append(run(flags + ["--warmup-buckets", "all"], caches[k], k))

    def mean(k):
        xs = [r["output_tokens_per_second"] for r in steady if r["config"] == k]
        return sum(xs) / len(xs)

    result = {"benchmark": "layers_per_program", "workload": " ".join(WORKLOAD),
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count()},
              "cold": cold, "steady_state": steady,
              "steady_output_tok_s": {k: mean(k) for k in configs}}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["steady_output_tok_s"]))


if __name__ == "__main__":
    main()

"""Start-up and steady-state throughput of whole vs layer-wise steps, in one run (issue 29).

`jaxinfer bench throughput` (32 requests x 128 random prompt / 128 output tokens, greedy, EOS
ignored, SmolLM2 float32, --max-model-len 1024), each run in its own process, timed from the
outside (launch to exit) as well as its own workload time:
  cold: an empty persistent compile cache; the old default (whole steps, every bucket compiled
        before serving) and the new one (layer-wise steps, start-up buckets first, the rest in
        the background);
  steady state: every bucket compiled before the workload (--warmup-buckets all, caches
        warm), whole and layer-wise alternated `--reps` times: output tok/s of the workload.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/layerwise_startup.py [--reps 2]
           [--output-json benchmarks/results/layerwise_startup_cpu.json]
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


def run(mode: str, buckets: str, cache_dir: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "jaxinfer.entrypoints.cli", "bench", "throughput", *WORKLOAD,
           "--step-compilation", mode, "--warmup-buckets", buckets, "--output-json", out]
    env = dict(os.environ, JAXINFER_COMPILATION_CACHE_DIR=cache_dir, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    row = {"step_compilation": mode, "warmup_buckets": buckets, "total_wall_s": wall,
           "workload_s": res["elapsed_time"],
           "output_tokens_per_second": res["output_tokens_per_second"],
           "wall_over_workload": wall / res["elapsed_time"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--output-json", default=os.path.join(HERE, "results",
                                                         "layerwise_startup_cpu.json"))
    args = p.parse_args()
    caches = {m: tempfile.mkdtemp(prefix=f"jaxinfer-xla-{m}-") for m in ("whole", "layerwise")}
    cold = [run("whole", "all", caches["whole"]), run("layerwise", "start", caches["layerwise"])]
    steady = []
    for _ in range(args.reps):
        for mode in ("whole", "layerwise"):
            steady.append(run(mode, "all", caches[mode]))

    def mean(mode):
        xs = [r["output_tokens_per_second"] for r in steady if r["step_compilation"] == mode]
        return sum(xs) / len(xs)

    result = {"benchmark": "layerwise_startup", "workload": " ".join(WORKLOAD),
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count()},
              "cold": cold, "steady_state": steady,
              "steady_output_tok_s": {"whole": mean("whole"), "layerwise": mean("layerwise")},
              "steady_ratio_layerwise_over_whole": mean("layerwise") / mean("whole")}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("steady_output_tok_s",
                                             "steady_ratio_layerwise_over_whole")}))


if __name__ == "__main__":
    main()

"""What a user gets from the one command they would run: `jaxinfer bench throughput` at its
defaults against `vllm bench throughput` (vLLM's CPU build) on the same workload and CPU.

Both at their own defaults but for what must match: the model (the embedded SmolLM2 unless
--model), the dtype (default: neither is given one, and both run the float32 checkpoint in
bfloat16, vLLM's `auto` and ours since 2026-11-29; --dtype float32 gives both that), random
prompts of --input-len tokens, --output-len tokens each, EOS ignored, their default sampling
(temperature 1.0), every core (vLLM as its CPU docs say: VLLM_CPU_OMP_THREADS_BIND=0-(N-1),
VLLM_CPU_NUM_OF_RESERVED_CPU=0; VLLM_CPU_KVCACHE_SPACE=1 and --gpu-memory-utilization 0.5 to
fit a 24 GiB machine). Each run is a fresh process (start-up
not timed: both commands time generation only); engines alternate, --repeats rounds, medians.
jaxinfer's JSON says how its timed steps ran (padded up, layer-wise, compiled meanwhile).
Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_defaults.py --vllm-python P \\
      [--num-prompts 32 --input-len 128 --output-len 128] [--repeats 3] [--dtype auto]
      [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from compare_cpu import VLLM_THREAD_ENV, _cpu_name  # noqa: E402


_VLLM_BENCH = ("import sys\n"
               "from vllm.benchmarks.throughput import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))")


def run(engine: str, args, out: str) -> dict:
    work = ["--num-prompts", str(args.num_prompts), "--output-json", out]
    dtype = [] if args.dtype == "auto" else ["--dtype", args.dtype]
    if engine == "vllm":
        # `vllm bench throughput`, called through its module: the `vllm` command asks for the
        # version of a distribution named vllm, which the CPU build (vllm-cpu) is not.
        cmd = [args.vllm_python, "-c", _VLLM_BENCH, "--model", args.model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--random-range-ratio", "0", *dtype,
               "--gpu-memory-utilization", "0.5", *work]
        env = dict(os.environ, **VLLM_THREAD_ENV)
    else:
        cmd = [os.path.join(ROOT, ".venv", "bin", "jaxinfer"), "bench", "throughput",
               "--model", args.model, "--dataset", "random", "--input-len",
               str(args.input_len), "--output-len", str(args.output_len), *dtype,
               "--no-tqdm", *work, *engine.split()[1:]]
        env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        r = json.load(f)
    n_out = r.get("total_output_tokens") or args.num_prompts * args.output_len
    row = {"elapsed_s": r["elapsed_time"], "output_tok_s": n_out / r["elapsed_time"]}
    if "steps" in r:
        row["steps"] = r["steps"]
    return row


def main():
    from jaxinfer.checkpoints.default_model import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--engines", default="jaxinfer,vllm",
                    help="jaxinfer (optionally with flags: 'jaxinfer --warmup-buckets all'), vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="given to both (auto: none given, each engine's default)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    args.model = os.path.abspath(args.model or ensure_default_model())
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    tmp = tempfile.mkdtemp(prefix="jaxinfer-bench-defaults-")
    for round_ in range(args.repeats):
        for i, engine in enumerate(engines):
            row = run(engine, args, os.path.join(tmp, f"{round_}-{i}.json"))
            runs[engine].append(row)
            print(f"round {round_ + 1} {engine}: {row['output_tok_s']:.1f} output tok/s "
                  f"{row.get('steps', '')}", flush=True)
    medians = {e: statistics.median(r["output_tok_s"] for r in rs) for e, rs in runs.items()}
    base = medians.get(engines[0])
    print(f"\n{args.num_prompts} x {args.input_len}/{args.output_len}, dtype {args.dtype}, "
          f"{_cpu_name()}: median output tok/s of {args.repeats}")
    for e, m in medians.items():
        print(f"  {e:<36} {m:8.1f}   {engines[0]} / it: {base / m:.2f}x")
    result = {"benchmark": "bench_defaults", "model": os.path.basename(args.model),
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len}, "dtype": args.dtype,
              "median_output_tok_s": medians, "runs": runs,
              "ratio_to_first": {e: base / m for e, m in medians.items()},
              "command": " ".join(sys.argv), "cpu": _cpu_name(), "cpus": os.cpu_count()}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

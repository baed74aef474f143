"""Pipeline parallelism on CPU (informative: the fake CPU devices share the same two cores, so
a pipeline cannot be faster here; it shows the mechanics and their host cost).

SmolLM2-135M-Instruct (bf16 weights, 30 layers), in-process engine, XLA forced to expose 2 or 3
host devices. PP=1 vs PP=2 (15 + 15 layers) vs PP=3 (10 each): 48 requests of 96 random prompt
tokens and 32 output tokens, all at once (max_num_seqs 16, 256-token budget). Each layout runs
the workload once to compile (not timed), then once timed. Reports throughput, mean step time
(host + device wait), and the number of batches in flight at each collect (it should stay at P
while requests allow). Prints and saves JSON with the PP=k / PP=1 ratios.

Usage (from the repository root, with `make setup` done):

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_parallel.py \
        [--output-json benchmarks/results/pipeline_parallel_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(pp: int) -> dict:
    import collections
    import time

    import numpy as np

    from jaxinfer import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", pipeline_parallel_size=pp, max_model_len=256,
              max_num_seqs=16, max_num_batched_tokens=256, warmup=False, num_kv_blocks=800,
              block_size=16,
              enable_multiprocessing=False)
    core = llm.llm_engine.engine_core.core
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, 96).tolist()} for _ in range(48)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # compile the buckets this workload uses
    depths = collections.Counter()
    inner = core.runner.collect

    def counting(handle):  # (the batch collected was popped from the queue just before)
        if handle is not None:
            depths[len(core._in_flight) + 1] += 1
        return inner(handle)

    core.runner.collect = counting
    core.profile_steps(True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    timings = core.profile_steps(False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"pp": pp, "partition": core.pp_partition or [30], "wall_s": wall,
           "output_tokens": tokens, "output_tok_per_s": tokens / wall,
           "num_collected_steps": len(timings),
           "mean_step_s": float(np.mean([h + d for h, d in timings])),
           "mean_host_s": float(np.mean([h for h, _ in timings])),
           "batches_in_flight_at_collect": dict(sorted(depths.items())),
           "max_batches_in_flight": core.max_batches_in_flight,
           "leaks": core.leak_report()}
    llm.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default=os.path.join(ROOT, "benchmarks", "results",
                                                          "pipeline_parallel_cpu.json"))
    ap.add_argument("--worker", type=int, default=None)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker)))
        return
    runs = []
    for pp in (1, 2, 3):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={pp}",
               "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
        out = subprocess.run([sys.executable, __file__, "--worker", str(pp)], env=env,
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    base = runs[0]
    result = {
        "benchmark": "pipeline_parallel", "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores (fake CPU devices share them)",
        "model": "SmolLM2-135M-Instruct bf16", "workload": "48 x (96 prompt + 32 output "
        "tokens), all at once, max_num_seqs 16, 256-token budget, in-process engine",
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/pipeline_parallel.py",
        "runs": runs,
        "ratios_vs_pp1": {f"pp{r['pp']}": {
            "throughput": r["output_tok_per_s"] / base["output_tok_per_s"],
            "mean_step_time": r["mean_step_s"] / base["mean_step_s"]} for r in runs[1:]},
    }
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["ratios_vs_pp1"], indent=2))


if __name__ == "__main__":
    main()

"""Host scheduling overhead: microseconds per schedule() + update_from_output() step.

256 running requests decoding (prompt 512, block size 16, prefix caching on), driven by a fake
runner; prints a table and writes JSON. Usage:
    python benchmarks/scheduler_overhead.py [--num-reqs 256] [--steps 200] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from jaxinfer.config import SchedulerConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.outputs import RunnerOutput
from jaxinfer.request import Request
from jaxinfer.sampling_params import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    rng = random.Random(0)
    max_model_len = args.prompt_len + args.steps + 128
    blocks = args.num_reqs * (max_model_len // args.block_size + 2) + 1
    kv = KVCacheManager(blocks, args.block_size, max_model_len)
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len,
                                      max_num_batched_tokens=max(8192, args.num_reqs),
                                      max_num_seqs=args.num_reqs), kv)
    params = SamplingParams(max_tokens=args.steps + 100, ignore_eos=True)
    for i in range(args.num_reqs):
        prompt = [rng.randrange(50000) for _ in range(args.prompt_len)]
        sched.add_request(Request(str(i), prompt, params, eos_token_id=2))

    def step():
        so = sched.schedule()
        ids = tuple(so.num_scheduled_tokens)
        ro = RunnerOutput(req_ids=ids, sampled_token_ids=tuple((7,) for _ in ids))
        sched.update_from_output(so, ro)
        return so

    while len(sched.running) < args.num_reqs or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        step()  # prefill everything first
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        so = step()
        times.append((time.perf_counter() - t0) * 1e6)
        assert len(so.num_scheduled_tokens) == args.num_reqs
    res = {
        "benchmark": "scheduler_overhead",
        "num_running_reqs": args.num_reqs,
        "prompt_len": args.prompt_len,
        "block_size": args.block_size,
        "steps": args.steps,
        "us_per_step_median": statistics.median(times),
        "us_per_step_mean": statistics.mean(times),
        "us_per_step_p99": sorted(times)[int(0.99 * (len(times) - 1))],
        "us_per_request_median": statistics.median(times) / args.num_reqs,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }
    print(f"{'running reqs':>14} {'median us/step':>15} {'p99 us/step':>12} {'us/req':>8}")
    print(f"{args.num_reqs:>14} {res['us_per_step_median']:>15.0f} {res['us_per_step_p99']:>12.0f} "
          f"{res['us_per_request_median']:>8.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

"""Host overhead per engine step, synchronous vs async scheduling, at N running requests.

An EngineCore (in this process) over a small dummy-weight Llama (a config.json only: the
device step is cheap, so the host's share shows) decodes N requests at once. Per step it
records the host's time (schedule + input build + dispatch + update_from_output) and the time
the host waited for the device's results. In synchronous mode the device idles during all host
work; with async scheduling the host prepares step N+1 while step N runs. Prints a table and
writes JSON. Usage (from the repository root):

    PYTHONPATH=. python benchmarks/host_overhead.py [--num-reqs 256] [--steps 60] \
        [--model benchmarks/configs/tiny-llama] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(model: str, num_reqs: int, steps: int, prompt_len: int, async_scheduling: bool,
            warmup_steps: int = 8) -> dict:
    from jaxinfer.config import EngineConfig, resolve_config
    from jaxinfer.engine.core import EngineCore
    from jaxinfer.engine.messages import EngineCoreRequest
    from jaxinfer.sampling_params import SamplingParams

    import jax

    from jaxinfer.runner.worker import resolve_block_size

    max_len = prompt_len + steps + warmup_steps + 64
    bs = resolve_block_size(None, jax.devices())
    cfg = EngineConfig(model=model, load_format="dummy", skip_tokenizer_init=True,
                       dtype="float32", max_model_len=max_len, max_num_seqs=num_reqs,
                       max_num_batched_tokens=max(2048, num_reqs), warmup=False,
                       num_kv_blocks=num_reqs * (-(-max_len // bs) + 1) + 1,
                       async_scheduling=async_scheduling, compilation_cache_dir="")
    core = EngineCore(resolve_config(cfg))
    params = SamplingParams(temperature=0, max_tokens=steps + warmup_steps + 32, ignore_eos=True)
    for i in range(num_reqs):
        core.add_request(EngineCoreRequest(f"r{i}", [(7 * i + j) % 1000 + 10
                                                    for j in range(prompt_len)],
                                           params, None, time.time(), i))
    # Prefill everything (and compile the decode bucket) before measuring.
    while len(core.scheduler.running) < num_reqs or any(
            r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    for _ in range(warmup_steps):
        core.step()
    core.profile_steps(True)
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += len(core.step())
    wall = time.perf_counter() - t0
    timings = core.profile_steps(False)
    for r in list(core.scheduler.requests):
        core.abort_requests([r])
    host = [h * 1e3 for h, _ in timings]
    wait = [w * 1e3 for _, w in timings]
    return {"async_scheduling": async_scheduling, "steps": steps, "num_running_reqs": num_reqs,
            "outputs": n, "wall_ms_per_step": wall * 1e3 / steps,
            "host_ms_per_step_median": statistics.median(host),
            "host_ms_per_step_mean": statistics.mean(host),
            "device_wait_ms_per_step_median": statistics.median(wait)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "benchmarks", "configs", "tiny-llama"))
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import jax

    rows = [measure(args.model, args.num_reqs, args.steps, args.prompt_len, a)
            for a in (False, True)]
    sync, asy = rows
    # The device works about as long per step in both modes: in sync mode the host waits for
    # it after dispatching (wait ~ device time); idle = wall - device time.
    device_ms = sync["wall_ms_per_step"] - sync["host_ms_per_step_median"]
    for r in rows:
        r["device_idle_ms_per_step_est"] = max(r["wall_ms_per_step"] - device_ms, 0.0)
    print(f"{'mode':>6} {'wall ms/step':>13} {'host ms/step':>13} {'wait ms/step':>13} "
          f"{'device idle ms/step (est)':>26}")
    for r in rows:
        print(f"{'async' if r['async_scheduling'] else 'sync':>6} {r['wall_ms_per_step']:>13.2f} "
              f"{r['host_ms_per_step_median']:>13.2f} {r['device_wait_ms_per_step_median']:>13.2f}"
              f" {r['device_idle_ms_per_step_est']:>26.2f}")
    res = {"benchmark": "host_overhead", "model": os.path.relpath(args.model, ROOT),
           "num_running_reqs": args.num_reqs, "prompt_len": args.prompt_len, "rows": rows,
           "device_ms_per_step_est": device_ms,
           "async_speedup": sync["wall_ms_per_step"] / asy["wall_ms_per_step"],
           "command": "PYTHONPATH=. python benchmarks/host_overhead.py "
                      f"--num-reqs {args.num_reqs} --steps {args.steps}",
           "jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    print(f"async / sync wall per step: {1 / res['async_speedup']:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

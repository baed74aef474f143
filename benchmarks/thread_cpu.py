"""Where a CPU engine's CPU time goes, per output token and per kind of thread.

On a 2-core machine every thread the engine runs takes CPU from the compiled step's kernels:
the step's own threads (XLA's intra-op pool, tf_XLAEigen, and the threads XLA runs programs
on), the engine core's Python thread (scheduling, input building, dispatch, reading results),
and, with the core in its own process, the front end and ZeroMQ's I/O threads. This runs
LLM.generate on one workload in a fresh process per mode, its buckets compiled and fused
first, and reads every thread's CPU time (/proc, this process and its children) over the
timed runs (a thread that ends before the runs do is not counted; the engine's threads live
as long as it does). Reported per mode: wall ms per output token (prefill included) and CPU ms per
output token by kind of thread, with the CPU use (all threads' CPU over wall x cores).

Usage (from the repository root):
    PYTHONPATH=. python benchmarks/thread_cpu.py --workload 1x128x128 \
        --modes multiprocessing,in-process [--options '{"async_scheduling": false}'] \
        [--runs 8] [--output-json F]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_cpu import _cpu_name, wait_settled  # noqa: E402

MODES = {"multiprocessing": True, "in-process": False}


def _processes() -> list[int]:
    """This process and its descendants."""
    out, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for path in glob.glob(f"/proc/{pid}/task/*/children"):
            try:
                todo += [int(x) for x in open(path).read().split()]
            except OSError:  # (a thread or process that ended meanwhile)
                pass
    return out


def _threads() -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, CPU clock ticks, user + system)."""
    got = {}
    for pid in _processes():
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                text = open(path).read()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            got[(pid, int(path.split("/")[4]))] = (name, int(fields[11]) + int(fields[12]))
    return got


def _kind(pid: int, tid: int, name: str, front_end: int, multiprocessing: bool) -> str:
    if name.startswith("tf_XLAEigen"):
        return "XLA intra-op pool (kernels)"
    if name.startswith("ZMQ"):
        return "ZeroMQ I/O"
    if pid == front_end and tid == pid:
        return "front end" if multiprocessing else "front end + engine core (one thread)"
    if tid == pid:
        return "engine core's thread"
    if pid == front_end and multiprocessing:
        return "front end, other threads"
    return "other threads of the core (XLA program threads, kernels too)"


def child(args) -> None:
    from jaxinfer import LLM, SamplingParams

    n, i, o = (int(x) for x in args.workload.lower().split("x"))
    mp = MODES[args.mode]
    llm = LLM(None, dtype=args.dtype, max_model_len=i + o, max_num_seqs=max(n, 8),
              warmup_buckets="all", enable_multiprocessing=mp, **json.loads(args.options))
    vocab = llm.llm_engine.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False)

    def run(seed: int) -> float:
        import random

        rng = random.Random(seed)
        batch = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(i)]}
                 for _ in range(n)]
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(0)
    wait_settled(llm)
    run(1)
    before, t0 = _threads(), time.perf_counter()
    walls = [run(2 + k) for k in range(args.runs)]
    wall = time.perf_counter() - t0
    after = _threads()
    llm.shutdown()
    tokens = n * o * args.runs
    tick = os.sysconf("SC_CLK_TCK")
    kinds: dict[str, float] = {}
    for (pid, tid), (name, ticks) in after.items():
        used = (ticks - before.get((pid, tid), (name, 0))[1]) / tick
        kind = _kind(pid, tid, name, os.getpid(), mp)
        kinds[kind] = kinds.get(kind, 0.0) + used
    cpu = sum(kinds.values())
    print(json.dumps({
        "mode": args.mode, "options": json.loads(args.options),
        "wall_ms_per_token": round(1e3 * wall / tokens, 3),
        "run_seconds": [round(w, 3) for w in walls],
        "cpu_ms_per_token": {k: round(1e3 * v / tokens, 3)
                             for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "cpu_ms_per_token_total": round(1e3 * cpu / tokens, 3),
        "cpu_use": round(cpu / (wall * os.cpu_count()), 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="1x128x128", help="N x IN x OUT")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--modes", default="multiprocessing,in-process")
    ap.add_argument("--options", default="{}", help="more LLM keyword arguments, JSON")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # (a child's)
    args = ap.parse_args()
    if args.mode is not None:
        return child(args)
    if not isinstance(json.loads(args.options), dict):
        ap.error(f"--options must be a JSON object, got {args.options!r}")
    if "enable_multiprocessing" in json.loads(args.options):
        ap.error("--options: enable_multiprocessing is what --modes sets")
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}: use {', '.join(MODES)}")
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode,
               "--workload", args.workload, "--dtype", args.dtype, "--options", args.options,
               "--runs", str(args.runs)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{mode}: {row['wall_ms_per_token']:.2f} ms per output token (wall), "
              f"{row['cpu_ms_per_token_total']:.2f} ms of CPU, use {row['cpu_use']:.0%}")
        for kind, ms in row["cpu_ms_per_token"].items():
            print(f"    {ms:7.3f} ms  {kind}")
    result = {"benchmark": "thread_cpu", "workload": args.workload, "dtype": args.dtype,
              "machine": f"{_cpu_name()}, {os.cpu_count()} CPUs", "rows": rows,
              "command": "benchmarks/thread_cpu.py " + " ".join(sys.argv[1:])}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""bf16 (or --dtype float32) GEMMs on this CPU: our packed-weight kernel against the oneDNN
matmul vLLM's CPU build runs (`vllm._custom_ops.onednn_mm`, weights prepacked once by
`create_onednn_mm`, the path vLLM takes for an unquantized linear on x86 without AMX; in
float32 too), paired in time.

Two processes, one per side (ours under this checkout's .venv, oneDNN under vLLM's Python),
each holding the same projection shapes (SmolLM2-135M's and Qwen3-0.6B's: qkv, o, gate-up,
down) with enough copies of each weight that they stream from memory (64 MB or more per
shape); they take turns, shape by shape, the order alternating each round, a pause between
turns so that neither side's idle threads spin on the other's cores. Rows are in and out in
the weights' dtype on both sides (what a model's layers hand each other). Reported per shape
and row count M: each side's median GFLOP/s and the median of the rounds' ours / oneDNN
ratios (> 1: ours faster).

Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/gemm_vs_onednn.py \
        --vllm-python /work/peers/vllm-venv/bin/python [--rows 1,32,512,2048] [--rounds 3] \
        [--dtype bfloat16|float32] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# (model, projection, K, N)
SHAPES = [("SmolLM2-135M", "qkv", 576, 960), ("SmolLM2-135M", "gate_up", 576, 3072),
          ("SmolLM2-135M", "down", 1536, 576), ("Qwen3-0.6B", "qkv", 1024, 4096),
          ("Qwen3-0.6B", "o", 2048, 1024), ("Qwen3-0.6B", "gate_up", 1024, 6144),
          ("Qwen3-0.6B", "down", 3072, 1024)]
STREAM_BYTES = 64 << 20  # weight copies per shape: at least this many bytes (past the L3)


def copies(k: int, n: int, dtype: str) -> int:
    return max(2, -(-STREAM_BYTES // ((2 if dtype == "bfloat16" else 4) * k * n)))


def child_ours(rows: list[int], dtype: str):
    """Our side: one jitted call per (shape, M) multiplying x by every copy."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from jaxinfer.layers import cpu_kernels as ck
    from jaxinfer.runner.host_malloc import keep_freed_memory

    if not ck.available():
        raise SystemExit("the C++ kernels could not be built")
    keep_freed_memory()  # (as the engine does on CPUs)
    rng = np.random.default_rng(0)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    runs = {}
    for i, (_, _, k, n) in enumerate(SHAPES):
        ws = [jnp.asarray(ck.pack((0.02 * rng.standard_normal((k, n), np.float32)).astype(dt)))
              for _ in range(copies(k, n, dtype))]
        assert ws[0].dtype == dt  # (panels of the weights' dtype: the kernel's path for it)
        fn = jax.jit(lambda x, ws, n=n: [ck.matmul(x, w, n) for w in ws])
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), dt)
            jax.block_until_ready(fn(x, ws))

            def run(fn=fn, x=x, ws=ws):
                jax.block_until_ready(fn(x, ws))
            runs[i, m] = run
    return runs


def child_onednn(rows: list[int], dtype: str):
    """vLLM's side: a oneDNN handler per weight copy (prepacked), onednn_mm per call."""
    import torch
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        raise SystemExit("this vLLM build has no oneDNN matmul")
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    runs = {}
    for i, (_, _, k, n) in enumerate(SHAPES):
        hs = [ops.create_onednn_mm((torch.randn(n, k) * 0.02).to(dt).t(), 32)
              for _ in range(copies(k, n, dtype))]
        for m in rows:
            x = torch.randn(m, k).to(dt)
            for h in hs:
                ops.onednn_mm(h, x, None)

            def run(hs=hs, x=x):
                with torch.no_grad():
                    for h in hs:
                        ops.onednn_mm(h, x, None)
            runs[i, m] = run
    return runs


def child(args) -> None:
    rows = [int(r) for r in args.rows.split(",")]
    runs = (child_ours if args.child == "ours" else child_onednn)(rows, args.dtype)
    print("READY", flush=True)
    for line in sys.stdin:
        i, m, iters = (int(v) for v in line.split())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runs[i, m]()
            ts.append(time.perf_counter() - t0)
        print(json.dumps({"s": statistics.median(ts)}), flush=True)


def start(python: str, side: str, args, env: dict) -> subprocess.Popen:
    cmd = [python, os.path.abspath(__file__), "--child", side, "--rows", args.rows,
           "--dtype", args.dtype]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if line.strip() == "READY":
            return p
    raise RuntimeError(f"the {side} process ended before it was ready")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=False, help="vLLM's (CPU build) Python")
    ap.add_argument("--rows", default="1,32,512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--iters", type=int, default=5, help="timed calls per turn")
    ap.add_argument("--pause", type=float, default=0.5,
                    help="seconds between turns (oneDNN's OpenMP threads spin ~200 ms after "
                         "their work: without a pause they took half our turn's cores)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--child", choices=("ours", "onednn"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.vllm_python:
        ap.error("--vllm-python is required")
    ncpu = os.cpu_count() or 1
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = {"ours": start(sys.executable, "ours", args, dict(os.environ, PYTHONPATH=here)),
             "onednn": start(args.vllm_python, "onednn", args, dict(
                 os.environ, OMP_NUM_THREADS=str(ncpu), VLLM_CPU_OMP_THREADS_BIND=f"0-{ncpu - 1}",
                 VLLM_CPU_NUM_OF_RESERVED_CPU="0"))}
    rows = [int(r) for r in args.rows.split(",")]
    secs = {(i, m, side): [] for i in range(len(SHAPES)) for m in rows for side in procs}
    for r in range(args.rounds):
        order = ("ours", "onednn") if r % 2 == 0 else ("onednn", "ours")
        for i in range(len(SHAPES)):
            for m in rows:
                for side in order:
                    time.sleep(args.pause)
                    p = procs[side]
                    p.stdin.write(f"{i} {m} {args.iters}\n")
                    p.stdin.flush()
                    secs[i, m, side].append(json.loads(p.stdout.readline())["s"])
    for p in procs.values():
        p.stdin.close()
        p.wait()
    results = []
    print(f"{'shape':<28} {'M':>5} {'ours GFLOP/s':>13} {'oneDNN':>8} {'ours / oneDNN':>14}")
    for i, (model, proj, k, n) in enumerate(SHAPES):
        c = copies(k, n, args.dtype)
        for m in rows:
            flop = 2.0 * m * k * n * c
            ours, dnn = secs[i, m, "ours"], secs[i, m, "onednn"]
            ratio = statistics.median(d / o for o, d in zip(ours, dnn))
            row = {"model": model, "projection": proj, "K": k, "N": n, "M": m,
                   "ours_gflops": flop / statistics.median(ours) / 1e9,
                   "onednn_gflops": flop / statistics.median(dnn) / 1e9,
                   "ours_over_onednn": ratio,
                   "rounds": [d / o for o, d in zip(ours, dnn)]}
            results.append(row)
            print(f"{model + ' ' + proj + f' {k}x{n}':<28} {m:>5} {row['ours_gflops']:>13.1f} "
                  f"{row['onednn_gflops']:>8.1f} {ratio:>13.2f}x", flush=True)
    out = {"benchmark": "gemm_vs_onednn", "dtype": args.dtype, "rows": rows, "results": results,
           "rounds": args.rounds, "iters": args.iters,
           "command": "benchmarks/gemm_vs_onednn.py " + " ".join(sys.argv[1:]),
           "environment": {"python": platform.python_version(), "cpus": ncpu}}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

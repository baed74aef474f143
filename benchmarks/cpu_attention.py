"""The cpu backend's paged attention (csrc/paged_attention_cpu.cc) at SmolLM2-135M's shapes
(or Qwen3-0.6B's: --shape qwen3-0.6b, 28 layers, 16 query / 8 KV heads, D = 128).

Thirty layers (each its own K/V cache, so pages stream from memory as in a real step) chained
in one jitted function: decode cases (one query token per sequence: KV bytes read per second,
the number a decode step is bound by) and prefill cases (whole prompts, causal: GFLOP/s
counting the visible half of QK^T and P.V). 9 query / 3 KV heads, D = 64, 128-token pages;
queries and caches in float32, or in bfloat16 as a bf16 model runs them (--dtype). Prints a
line per case, writes JSON.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/cpu_attention.py [--cases ...] [--dtype D]
       [--output-json F]
Paired (two source trees' kernels taking turns, --rounds of --iters calls each, as
step_pair.py does for whole steps; writes a before_after JSON):
       ... benchmarks/cpu_attention.py --before /tmp/before --after . --cases decode-32@256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 128
SHAPES = {"smollm2-135m": (30, 9, 3, 64), "qwen3-0.6b": (28, 16, 8, 128)}
# name -> (kind, sequences, tokens: the context for decode, the prompt for prefill)
CASES = {
    "decode-32@256": ("decode", 32, 256),
    "decode-32@192": ("decode", 32, 192),
    "decode-8@1024": ("decode", 8, 1024),
    # batch 1 (one sequence: its keys split over the threads) and a few sequences
    "decode-1@256": ("decode", 1, 256),
    "decode-1@1024": ("decode", 1, 1024),
    "decode-1@4096": ("decode", 1, 4096),
    "decode-4@1024": ("decode", 4, 1024),
    # every layer reading one cache (6 MB in bf16, 12 MB in float32: in this CPU's L3), so
    # what the kernel computes shows apart from what DRAM delivers
    "decode-32@256-l3": ("decode-l3", 32, 256),
    "prefill-2x1024": ("prefill", 2, 1024),
    "prefill-32x128": ("prefill", 32, 128),
}


def build(kind: str, seqs: int, tokens: int, dtype: str = "float32"):
    """The case's thirty chained layers, compiled and run once: (run, info), run() timing one
    call in seconds."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.layers import cpu_kernels as ck

    per_seq = -(-tokens // BS)
    blocks = seqs * per_seq + 1
    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    caches = [(jnp.asarray(rng.standard_normal((blocks, BS, HKV, D), np.float32), dt),
               jnp.asarray(rng.standard_normal((blocks, BS, HKV, D), np.float32), dt))
              for _ in range(1 if kind == "decode-l3" else LAYERS)]
    if kind == "decode-l3":
        caches, kind = caches * LAYERS, "decode"
    q_len = 1 if kind == "decode" else tokens
    q = jnp.asarray(rng.standard_normal((seqs * q_len, HQ, D), np.float32), dt)
    kv_lens = jnp.full((seqs,), tokens, jnp.int32)
    tables = jnp.asarray(1 + np.arange(seqs * per_seq, dtype=np.int32).reshape(seqs, per_seq))
    starts = jnp.arange(seqs + 1, dtype=jnp.int32) * q_len
    num_seqs = jnp.array([seqs], jnp.int32)

    @jax.jit
    def layers(x, caches):
        for k, v in caches:  # each layer's output is the next one's queries
            x = ck.ragged_paged_attention_cpu(x, k, v, kv_lens, tables, starts, num_seqs,
                                              sm_scale=D ** -0.5)
        return x

    layers(q, caches).block_until_ready()

    def run() -> float:
        t0 = time.perf_counter()
        layers(q, caches).block_until_ready()
        return time.perf_counter() - t0

    info = {"kind": kind, "sequences": seqs, "tokens": tokens,
            "kv_bytes": LAYERS * seqs * tokens * HKV * D * dt.itemsize * 2,
            "flop": LAYERS * seqs * HQ * (tokens * (tokens + 1) / 2) * D * 4}
    return run, info


def measure(kind: str, seqs: int, tokens: int, iters: int, dtype: str = "float32") -> dict:
    run, info = build(kind, seqs, tokens, dtype)
    sec = statistics.median(run() for _ in range(iters))
    out = {"kind": info["kind"], "sequences": seqs, "tokens": tokens, "ms_30_layers": sec * 1e3}
    if info["kind"] == "decode":
        out["kv_read_gb_per_s"] = info["kv_bytes"] / sec / 1e9
    else:
        out["gflop_per_s"] = info["flop"] / sec / 1e9
    return out


def child(args) -> None:
    """Paired mode's side: build every case, then answer "case iters" lines with the median
    seconds of that many calls."""
    runs = {name: build(*CASES[name], args.dtype)[0] for name in args.cases.split(",")}
    print("READY", flush=True)
    for line in sys.stdin:
        name, iters = line.split()
        s = statistics.median(runs[name]() for _ in range(int(iters)))
        print(json.dumps({"case": name, "s": s}), flush=True)


def paired(args) -> None:
    """Two source trees' kernels taking turns (step_pair.py's pairing, for attention alone)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_pair import rev, start_child, take_turns

    child_args = ["--dtype", args.dtype, "--cases", args.cases, "--shape", args.shape]
    procs = {side: start_child(tree, os.path.abspath(__file__), child_args, "attention")
             for side, tree in (("before", args.before), ("after", args.after))}
    names = args.cases.split(",")
    ms = take_turns(procs, names, args.rounds, args.iters)
    rows = []
    for name in names:
        b, a = ms[name]["before"], ms[name]["after"]
        q = [y / x for x, y in zip(b, a)]
        rows.append({"measure": f"attention alone, {args.dtype}, {name} ({LAYERS} layers)",
                     "unit": "ms", "before": b, "after": a,
                     "paired_after_over_before": round(statistics.median(q), 4)})
        print(f"{name}: before {statistics.median(b):.2f} ms, after {statistics.median(a):.2f} "
              f"ms, paired after / before {statistics.median(q):.3f} (rounds {min(q):.3f}-"
              f"{max(q):.3f})", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "before_after", "before_rev": rev(args.before),
                       "after_rev": rev(args.after), "note": "",
                       "machine": f"{platform.processor() or platform.machine()}, "
                                  f"{os.cpu_count()} CPUs",
                       "commands": ["benchmarks/cpu_attention.py " + " ".join(sys.argv[1:])],
                       "rows": rows}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--before", default=None,
                    help="paired mode: a source tree (with .venv) whose kernels take turns "
                         "with --after's")
    ap.add_argument("--after", default=".")
    ap.add_argument("--rounds", type=int, default=10, help="paired mode: turns per side")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global LAYERS, HQ, HKV, D
    LAYERS, HQ, HKV, D = SHAPES[args.shape]
    if args.child:
        return child(args)
    if args.before:
        return paired(args)
    from jaxinfer.layers import cpu_kernels as ck

    if not ck.available():
        raise SystemExit("the C++ kernels could not be built")
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown --cases {unknown}; known: {list(CASES)}")
    results = {}
    for name in names:
        r = measure(*CASES[name], args.iters, args.dtype)
        results[name] = r
        rate = (f"{r['kv_read_gb_per_s']:.1f} GB/s of KV" if "kv_read_gb_per_s" in r
                else f"{r['gflop_per_s']:.0f} GFLOP/s")
        print(f"{name:16s} {r['ms_30_layers']:8.2f} ms for {LAYERS} layers, {rate}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "shapes": {"model": args.shape, "layers": LAYERS, "q_heads": HQ,
                                  "kv_heads": HKV, "head_dim": D, "block_size": BS,
                                  "dtype": args.dtype},
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

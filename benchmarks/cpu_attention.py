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
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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


def measure(kind: str, seqs: int, tokens: int, iters: int, dtype: str = "float32") -> dict:
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
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        layers(q, caches).block_until_ready()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    kv_bytes = LAYERS * seqs * tokens * HKV * D * dt.itemsize * 2
    out = {"kind": kind, "sequences": seqs, "tokens": tokens, "ms_30_layers": sec * 1e3}
    if kind == "decode":
        out["kv_read_gb_per_s"] = kv_bytes / sec / 1e9
    else:
        flop = LAYERS * seqs * HQ * (tokens * (tokens + 1) / 2) * D * 4
        out["gflop_per_s"] = flop / sec / 1e9
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    global LAYERS, HQ, HKV, D
    LAYERS, HQ, HKV, D = SHAPES[args.shape]
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

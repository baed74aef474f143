"""The matmuls of a SmolLM2 decode step on this CPU: XLA's dot vs the packed-weight kernel.

Thirty layers of SmolLM2-135M's projection shapes (qkv 576x960, o 576x576, gate-up 576x3072,
down 1536x576; each layer its own weights, so they stream from memory as in a real step),
chained in one jitted function, for several row counts M (the decode batch). Rows: XLA's dot
on [K, N] weights (with each XLA_FLAGS variant given, run in its own process) and the packed
kernel on [N/32, K, 32] weights (layers/cpu_kernels.py). Prints GFLOP/s, writes JSON.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/cpu_matmul.py [--rows 1,8,32,256,1024]
    [--xla-flags "" --xla-flags --xla_cpu_experimental_onednn_fusion_type=dot ...]
    [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30


def measure(kind: str, rows: list[int], iters: int) -> dict[int, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.layers import cpu_kernels as ck

    rng = np.random.default_rng(0)
    ws = [[rng.standard_normal(s).astype(np.float32) * 0.02 for s in SHAPES]
          for _ in range(LAYERS)]
    if kind == "packed":
        if not ck.available():
            raise SystemExit("the C++ kernels could not be built")
        params = [[jnp.asarray(ck.pack(w)) for w in layer] for layer in ws]

        def mm(x, w, n):
            return ck.matmul(x, w, n)
    elif kind == "packed-bf16":  # a bf16 model's panels; its rows are bf16 values
        import ml_dtypes

        if not ck.available():
            raise SystemExit("the C++ kernels could not be built")
        params = [[jnp.asarray(ck.pack(w.astype(ml_dtypes.bfloat16))) for w in layer]
                  for layer in ws]

        def mm(x, w, n):
            return ck.matmul(x, w, n)
    elif kind == "packed-int8":  # per-channel int8 weights, as quantization="int8" packs them
        if not ck.available():
            raise SystemExit("the C++ kernels could not be built")

        def q8(w):
            s = np.abs(w).max(axis=0, keepdims=True) / 127.0
            q = np.clip(np.round(w / s), -127, 127).astype(np.int8)
            return jnp.asarray(ck.pack(q)), jnp.asarray(ck.pack(s.astype(np.float32)))

        params = [[q8(w) for w in layer] for layer in ws]

        def mm(x, w, n):
            return ck.matmul(x, w[0], n, scale=w[1])
    else:
        params = [[jnp.asarray(w) for w in layer] for layer in ws]

        def mm(x, w, n):
            return x @ w

    def layers(params, x):
        for a, b, c, d in params:
            q = mm(x, a, 960)
            x = x + mm(q[:, :576], b, 576)
            g = mm(x, c, 3072)
            x = x + mm(jax.nn.silu(g[:, :1536]) * g[:, 1536:], d, 576)
        return x

    fn = jax.jit(layers)
    out = {}
    for m in rows:
        x = jnp.full((m, 576), 0.01, jnp.float32)
        fn(params, x).block_until_ready()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(params, x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        out[m] = sorted(ts)[len(ts) // 2]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32,64,256,1024")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--xla-flags", action="append", default=None,
                    help="an XLA_FLAGS value for a row of XLA's dot (repeatable; default: "
                         "none, oneDNN and XNNPACK dot fusion)")
    ap.add_argument("--variants", default="xla,packed,packed-int8",
                    help="which of xla (one row per --xla-flags), packed, packed-bf16, "
                         "packed-int8")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.run:
        print("RESULT " + json.dumps(measure(args.run, rows, args.iters)), flush=True)
        return
    flags = args.xla_flags or ["", "--xla_cpu_experimental_onednn_fusion_type=dot",
                               "--xla_cpu_experimental_xnn_fusion_type=dot"]
    flops = {m: 2 * m * LAYERS * sum(k * n for k, n in SHAPES) for m in rows}
    chosen = args.variants.split(",")
    kinds = {"packed": "packed kernel", "packed-bf16": "packed bf16",
             "packed-int8": "packed int8"}
    unknown = sorted(set(chosen) - {"xla", *kinds})
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (choose from xla, "
                 f"{', '.join(kinds)})")
    variants = ([("xla dot", "xla", f) for f in flags] if "xla" in chosen else []) + [
        (name, kind, "") for kind, name in kinds.items() if kind in chosen]
    weight_bytes = {"xla": 4, "packed": 4, "packed-bf16": 2, "packed-int8": 1}
    results = []
    for name, kind, flag in variants:
        env = dict(os.environ, XLA_FLAGS=flag)
        cmd = [sys.executable, os.path.abspath(__file__), "--run", kind, "--rows", args.rows,
               "--iters", str(args.iters)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        times = {int(k): v for k, v in json.loads(line[7:]).items()}
        wbytes = weight_bytes[kind] * LAYERS * sum(k * n for k, n in SHAPES)
        row = {"variant": name, "xla_flags": flag, "seconds": times,
               "gflops": {m: flops[m] / t / 1e9 for m, t in times.items()},
               "weight_gb_per_s": {m: wbytes / t / 1e9 for m, t in times.items()}}
        results.append(row)
        print(f"{name:<14} {flag or '(default flags)':<48} " + "  ".join(
            f"M={m}: {row['gflops'][m]:.0f}" for m in rows) + "  GFLOP/s; weights " + "  ".join(
            f"M={m}: {row['weight_gb_per_s'][m]:.1f}" for m in rows) + " GB/s", flush=True)
    result = {"benchmark": "cpu_matmul", "layers": LAYERS, "shapes": SHAPES, "rows": rows,
              "results": results, "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

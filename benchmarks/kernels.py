"""Attention kernel benchmark: Pallas ragged paged attention vs the jnp reference vs PyTorch SDPA.

Decode (1 query token per sequence) and prefill (one chunk per sequence) at Llama-3-8B head
shapes (32 q / 8 kv heads, D=128, bf16, block 16) over batch sizes and context lengths, with the
HBM roofline next to every number: bytes of KV read / measured copy bandwidth.

    python benchmarks/kernels.py --output-json benchmarks/results/kernels_<gpu>.json   # on a GPU
    python benchmarks/kernels.py --smoke --interpret                                    # CPU check

PyTorch's scaled_dot_product_attention runs in a separate process (--torch-worker) on the same
work in dense padded form, so the two frameworks never share the device's memory pool.
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

import numpy as np


def _time(fn, warmup: int, iters: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth (read + write bytes per second) of a large array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0)
    t = _time(lambda: copy(x), 3, 10)
    return 2 * nbytes / t


def measure_matmul_rate(dtype, n: int = 8192) -> float:
    """Dense matmul FLOP/s of the device at this dtype (the compute roof)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    t = _time(lambda: mm(a), 3, 10)
    return 2 * n**3 / t


def attention_flops(batch: int, ctx: int, q_len: int, hq: int, d: int) -> int:
    """QK^T and PV FLOPs of causal attention: query i of a chunk attends ctx + i + 1 keys."""
    attended = q_len * ctx + q_len * (q_len + 1) // 2
    return 4 * batch * attended * hq * d


# The cases a tuning sweep times (a subset: every case compiles every candidate).
SWEEP_CASES = {"decode": [(1, 32768), (8, 8192), (32, 4096), (64, 4096), (256, 2048)],
               "prefill": [(1, 0), (4, 2048)]}


def make_inputs(batch, ctx, q_len, *, hq, hkv, d, bs, dtype, seed=0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    kv_len = ctx + q_len
    blocks_per_seq = -(-kv_len // bs)
    num_blocks = batch * blocks_per_seq + 1
    k = jnp.asarray(rng.standard_normal((num_blocks, bs, hkv, d), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((num_blocks, bs, hkv, d), np.float32), dtype)
    tables = (1 + rng.permutation(num_blocks - 1)[: batch * blocks_per_seq]).reshape(
        batch, blocks_per_seq).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch * q_len, hq, d), np.float32), dtype)
    qsl = np.arange(batch + 1, dtype=np.int32) * q_len
    lens = np.full(batch, kv_len, np.int32)
    return (q, k, v, jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(qsl),
            jnp.asarray([batch], np.int32))


def torch_worker(cases_json: str) -> None:
    """Time torch SDPA on dense padded [B, H, L, D] tensors for each case; print JSON."""
    import torch
    import torch.nn.functional as F

    out = []
    for c in json.loads(cases_json):
        b, ctx, ql, hq, hkv, d = c["batch"], c["ctx"], c["q_len"], c["hq"], c["hkv"], c["d"]
        dt = torch.bfloat16 if c["dtype"] == "bfloat16" else torch.float32
        q = torch.randn(b, hq, ql, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, ctx + ql, d, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        causal = ql > 1

        def run():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and ctx == 0,
                                                  enable_gqa=True)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        out.append({**c, "torch_sdpa_s": statistics.median(ts)})
    print(json.dumps(out))


def _ms(v):
    return f"{v * 1e3:.3f}" if v is not None else "-"


def run_sweep(args, *, hq, hkv, d, bs, dtype, scale):
    """Time every candidate tuning on SWEEP_CASES; per regime, the candidate with the lowest
    geometric-mean time over its cases is the suggested tuning-table entry."""
    import jax

    from pallas_kernels.compile_report import sweep_candidates
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    out = {}
    for regime, cases in SWEEP_CASES.items():
        q_len = 1 if regime == "decode" else args.prefill_len
        if args.smoke:
            cases = [(1, 32), (2, 32)]
            q_len = 1 if regime == "decode" else 16
        inputs = [make_inputs(b, ctx, q_len, hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype)
                  for b, ctx in cases]
        table = []
        candidates = sweep_candidates(regime)[: 2 if args.smoke else None]
        for tune in candidates:
            fn = jax.jit(lambda *a, tune=tune: ragged_paged_attention(
                *a, sm_scale=scale, interpret=args.interpret, tuning=tune))
            try:
                times = [_time(lambda inp=inp: fn(*inp), 2, 3 if args.smoke else 10)
                         for inp in inputs]
            except Exception as e:  # a candidate that fails to compile is reported, not fatal
                table.append({"tuning": tune.__dict__, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            gmean = float(np.exp(np.mean(np.log(times))))
            table.append({"tuning": tune.__dict__, "times_s": times, "geomean_s": gmean})
            print(f"sweep {regime:7} {tune}  geomean {gmean * 1e3:.3f} ms", flush=True)
        ok = [r for r in table if "geomean_s" in r]
        best = min(ok, key=lambda r: r["geomean_s"]) if ok else None
        out[regime] = {"cases": cases, "q_len": q_len, "head_dim": d, "block_size": bs,
                       "dtype": dtype.name, "candidates": table,
                       "best": best and best["tuning"]}
        print(f"sweep {regime}: best {best and best['tuning']}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512,2048,4096,8192,32768")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--reference-max-kv-tokens", type=int, default=256 * 1024,
                    help="skip the slow jnp reference above this many KV tokens")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every candidate tuning (pallas_kernels.compile_report."
                         "sweep_candidates) on SWEEP_CASES and report the best per regime")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(args.torch_worker)

    import jax
    import jax.numpy as jnp

    from jaxinfer.bench import write_result
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from pallas_kernels.reference import ragged_paged_attention_reference

    hq, hkv, d, bs = 32, 8, 128, 16
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.smoke:
        hq, hkv, d, bs, batches, contexts = 4, 2, 64, 16, [1, 2], [32]
        args.prefill_len = 16
    dtype = jnp.dtype(args.dtype)
    bw = measure_bandwidth(1 << 24 if args.smoke else 1 << 30)
    peak = measure_matmul_rate(dtype, 256 if args.smoke else 8192)
    device = jax.devices()[0].device_kind
    platform_name = jax.devices()[0].platform
    cases = []
    for mode, q_len in (("decode", 1), ("prefill", args.prefill_len)):
        for b in batches:
            for ctx in contexts:
                if mode == "prefill" and b * q_len > 16384:
                    continue
                cases.append(dict(mode=mode, batch=b, ctx=ctx, q_len=q_len, hq=hq, hkv=hkv,
                                  d=d, dtype=dtype.name))
    rows = []
    scale = d ** -0.5
    pallas = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale,
                                                       interpret=args.interpret))
    ref = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))
    for c in cases:
        inp = make_inputs(c["batch"], c["ctx"], c["q_len"], hq=hq, hkv=hkv, d=d, bs=bs,
                          dtype=dtype)
        kv_tokens = c["batch"] * (c["ctx"] + c["q_len"])
        kv_bytes = 2 * kv_tokens * hkv * d * dtype.itemsize
        t_pallas = _time(lambda: pallas(*inp), 2, 5 if args.smoke else 20)
        t_ref = None
        if kv_tokens <= args.reference_max_kv_tokens:
            t_ref = _time(lambda: ref(*inp), 1, 3)
        floor = kv_bytes / bw
        flops = attention_flops(c["batch"], c["ctx"], c["q_len"], hq, d)
        roof = max(floor, flops / peak)
        rows.append({**c, "kv_bytes": kv_bytes, "flops": flops, "pallas_s": t_pallas,
                     "reference_s": t_ref, "hbm_floor_s": floor, "flop_floor_s": flops / peak,
                     "fraction_of_hbm_bw": floor / t_pallas,
                     "fraction_of_roofline": roof / t_pallas})
        r = rows[-1]
        print(f"{r['mode']:8} {r['batch']:>5} {r['ctx']:>6} pallas {_ms(t_pallas)} ms  "
              f"ref {_ms(t_ref)} ms  HBM floor {_ms(floor)} ms  "
              f"{100 * r['fraction_of_hbm_bw']:.1f}% of HBM bw", flush=True)
        if args.output_json:  # each row saved as it comes (a run cut off keeps them)
            write_result(args.output_json, {"benchmark": "kernels", "partial": True,
                                            "device": device, "jax": jax.__version__,
                                            "command": " ".join(sys.argv), "rows": rows,
                                            "copy_bandwidth_bytes_per_s": bw,
                                            "matmul_flops_per_s": peak})
    if not args.no_torch and platform_name == "gpu":
        res = subprocess.run([sys.executable, __file__, "--torch-worker", json.dumps(cases)],
                             capture_output=True, text=True,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES":
                                  os.environ.get("CUDA_VISIBLE_DEVICES", "0")})
        if res.returncode == 0:
            for row, t in zip(rows, json.loads(res.stdout.strip().splitlines()[-1])):
                row["torch_sdpa_s"] = t["torch_sdpa_s"]
        else:
            print("torch baseline failed:", res.stderr[-2000:], file=sys.stderr)
    result = {"benchmark": "kernels", "device": device, "jax": jax.__version__,
              "interpret": args.interpret, "copy_bandwidth_bytes_per_s": bw,
              "matmul_flops_per_s": peak, "sweep": None,
              "command": " ".join(sys.argv), "python": platform.python_version(), "rows": rows}
    report(result)
    write_result(args.output_json, result)  # the rows first: a sweep cut off keeps them
    if args.sweep:
        result["sweep"] = run_sweep(args, hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype, scale=scale)
    return write_result(args.output_json, result)


def report(result: dict) -> None:
    device, bw, peak = result["device"], result["copy_bandwidth_bytes_per_s"], \
        result["matmul_flops_per_s"]
    dtype_name = result["rows"][0]["dtype"] if result["rows"] else "-"
    print(f"device: {device}  jax {result['jax']}  measured copy bandwidth "
          f"{bw / 1e9:.0f} GB/s  matmul {peak / 1e12:.0f} TFLOP/s ({dtype_name})", flush=True)
    print(f"{'mode':8} {'batch':>5} {'ctx':>6} {'pallas ms':>10} {'ref ms':>9} {'sdpa ms':>8} "
          f"{'HBM ms':>8} {'FLOP ms':>8} {'% HBM':>6} {'% roof':>6}")
    for r in result["rows"]:
        print(f"{r['mode']:8} {r['batch']:>5} {r['ctx']:>6} {_ms(r['pallas_s']):>10} "
              f"{_ms(r['reference_s']):>9} {_ms(r.get('torch_sdpa_s')):>8} "
              f"{_ms(r['hbm_floor_s']):>8} {_ms(r['flop_floor_s']):>8} "
              f"{100 * r['fraction_of_hbm_bw']:>5.1f} {100 * r['fraction_of_roofline']:>6.1f}",
              flush=True)


if __name__ == "__main__":
    main()

"""KV block size vs the decode step on this CPU, measured in one process, interleaved.

Separate processes of the same configuration vary by up to ~20% on this shared VM, so both
engines are built side by side and their steps alternate. Each case's block tables are either
scattered (blocks in random places, as a cache looks after a while of serving) or sequential
(each sequence's blocks adjacent, the best case for 16-token blocks). The step is the
production compiled step (layer-wise by default, `cpu` attention), greedy, on the default
SmolLM2 in float32.
Usage:
    PYTHONPATH=. python benchmarks/block_size.py [--block-sizes 16,128] [--output-json F]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np


def make_step(bs: int, seqs: int, ctx: int, layout: str, step_compilation: str,
              max_model_len: int):
    from jaxinfer import LLM
    from jaxinfer.runner.step_inputs import PLAIN, empty_step_batch, fill_step_inputs

    llm = LLM(None, dtype="float32", max_model_len=max_model_len, max_num_seqs=64,
              max_num_batched_tokens=2048, warmup=False,
              num_kv_blocks=64 * -(-max_model_len // bs) + 2, block_size=bs,
              step_compilation=step_compilation, enable_multiprocessing=False)
    runner = llm.llm_engine.runner
    rng = np.random.default_rng(0)
    q_lens = np.ones(seqs, np.int32)
    computed = np.full(seqs, ctx - 1, np.int32)
    nb = -(-ctx // bs)
    ids = np.arange(1, runner.num_kv_blocks)
    if layout == "scattered":
        ids = rng.permutation(ids)
    table = np.zeros((seqs, runner.max_blocks), np.int32)
    for i in range(seqs):
        table[i, :nb] = ids[i * nb:(i + 1) * nb]
    tokens = rng.integers(10, 1000, (seqs, max_model_len + 1), dtype=np.int32)
    t, r = runner.buckets.pick(seqs, seqs)
    batch = empty_step_batch(t, r, runner.max_blocks, runner.max_num_seqs)
    fill_step_inputs(batch, tokens, table, np.arange(seqs, dtype=np.int32), computed, q_lens, bs)
    compiled = runner.compiled.get(t, r, PLAIN)
    dbatch = runner.program.place(batch)

    def step():
        out, runner.state = compiled(runner.state, dbatch)
        out["token_ids"].block_until_ready()
    return llm, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--cases", default="32x256,64x1000", help="SEQSxCONTEXT,...")
    ap.add_argument("--layouts", default="scattered,sequential")
    ap.add_argument("--step-compilation", default="layerwise")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import jax

    from jaxinfer.bench import write_result

    sizes = [int(b) for b in args.block_sizes.split(",")]
    rows = []
    for case in args.cases.split(","):
        seqs, ctx = (int(x) for x in case.split("x"))
        for layout in args.layouts.split(","):
            steps, keep = [], []
            for bs in sizes:
                llm, step = make_step(bs, seqs, ctx, layout, args.step_compilation, 1024)
                keep.append(llm)
                for _ in range(3):
                    step()
                steps.append(step)
            times = [[] for _ in sizes]
            for _ in range(args.iters):
                for i, step in enumerate(steps):
                    t0 = time.perf_counter()
                    step()
                    times[i].append(time.perf_counter() - t0)
            for bs, ts in zip(sizes, times):
                row = {"seqs": seqs, "context": ctx, "layout": layout, "block_size": bs,
                       "step_compilation": args.step_compilation,
                       "median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
                rows.append(row)
                print(f"{seqs:3d} x {ctx:4d} {layout:>10} block {bs:4d}: median "
                      f"{row['median_ms']:7.1f} ms  min {row['min_ms']:7.1f} ms", flush=True)
            for llm in keep:
                llm.shutdown()
    write_result(args.output_json, {
        "benchmark": "block_size", "model": "SmolLM2-135M-Instruct", "dtype": "float32",
        "attention_backend": "cpu", "rows": rows,
        "environment": {"jax": jax.__version__, "platform": jax.default_backend(),
                        "python": platform.python_version()}})


if __name__ == "__main__":
    main()

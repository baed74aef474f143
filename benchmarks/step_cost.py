"""Device time of one engine step, per attention backend: shows whether cost follows the work.

Builds synthetic steps with the production builder (decode rows, prefill chunks, mixed) on the
default SmolLM2 (fp32, or --dtype bfloat16) and times the compiled step (median of --iters
after one warm call).
The issue's case: 2048 tokens of 64 sequences (32-token prefill chunks) at max_model_len 1024.
Usage:
    PYTHONPATH=. python benchmarks/step_cost.py [--backends xla,reference] [--output-json F]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

# (name, [(query tokens, cached context)] per sequence)
CASES = {
    "prefill-2048x64": [(32, 0)] * 64,
    "prefill-1x512": [(512, 0)],
    "prefill-2x1024": [(1024, 0)] * 2,
    "prefill-16x128": [(128, 0)] * 16,
    "decode-1@256": [(1, 255)],
    "decode-1@1000": [(1, 999)],
    "decode-4@256": [(1, 255)] * 4,
    "decode-8@256": [(1, 255)] * 8,
    "decode-8@1000": [(1, 999)] * 8,
    "decode-32@256": [(1, 255)] * 32,
    "decode-64@1000": [(1, 999)] * 64,
    "mixed-31dec@300+1x256": [(1, 299)] * 31 + [(256, 128)],
}


def time_case(runner, seqs, iters: int) -> float:
    from jaxinfer.runner.step_inputs import PLAIN, empty_step_batch, fill_step_inputs

    n_req = len(seqs)
    q_lens = np.array([q for q, _ in seqs], np.int32)
    computed = np.array([c for _, c in seqs], np.int32)
    bs = runner.block_size
    table = np.zeros((n_req, runner.max_blocks), np.int32)
    nxt = 1
    for i, (q, c) in enumerate(seqs):
        nb = -(-(q + c) // bs)
        table[i, :nb] = np.arange(nxt, nxt + nb)
        nxt += nb
    assert nxt <= runner.num_kv_blocks, "KV cache too small for the case"
    tokens = np.random.default_rng(0).integers(10, 1000, (n_req, runner.max_model_len + 1),
                                               dtype=np.int32)
    t, r = runner.buckets.pick(int(q_lens.sum()), n_req)
    batch = empty_step_batch(t, r, runner.max_blocks, runner.max_num_seqs)
    fill_step_inputs(batch, tokens, table, np.arange(n_req, dtype=np.int32), computed, q_lens,
                     bs)
    compiled = runner.compiled.get(t, r, PLAIN)
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        out, runner.state = compiled(runner.state, runner.program.place(batch))
        out["token_ids"].block_until_ready()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cpu,xla")
    ap.add_argument("--step-compilation", default="auto")
    ap.add_argument("--layers-per-program", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per KV block (default: the engine's, 128 on CPU)")
    ap.add_argument("--quantization", default=None, help="int8, fp8 or gguf weights")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import jax

    from jaxinfer import LLM
    from jaxinfer.bench import write_result

    from jaxinfer.runner.worker import resolve_block_size

    bs = resolve_block_size(args.block_size, jax.devices())
    rows = []
    for backend in args.backends.split(","):
        llm = LLM(None, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=64,
                  max_num_batched_tokens=2048, attention_backend=backend, warmup=False,
                  num_kv_blocks=64 * -(-args.max_model_len // bs) + 2, block_size=bs,
                  step_compilation=args.step_compilation,
                  layers_per_program=args.layers_per_program,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  enable_multiprocessing=False)  # times the runner in this process
        runner = llm.llm_engine.runner
        for name in args.cases.split(","):
            seqs = CASES[name]
            s = time_case(runner, seqs, args.iters)
            work = sum(q * (c + (q + 1) / 2) for q, c in seqs)  # query x key pairs
            rows.append({"backend": backend, "dtype": args.dtype,
                         "step_compilation": args.step_compilation,
                         "layers_per_program": args.layers_per_program, "block_size": bs,
                         "quantization": args.quantization,
                         "kv_cache_dtype": args.kv_cache_dtype, "case": name, "tokens": sum(q for q, _ in seqs),
                         "seqs": len(seqs), "attention_pairs": work, "step_s": s})
            print(f"{backend:>9} {name:>24}: {s * 1e3:9.1f} ms", flush=True)
        del llm
    result = {"benchmark": "step_cost", "model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
              "max_model_len": args.max_model_len, "rows": rows,
              "environment": {"jax": jax.__version__, "platform": jax.default_backend(),
                              "python": platform.python_version()}}
    write_result(args.output_json, result)


if __name__ == "__main__":
    main()

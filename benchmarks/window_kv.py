"""Sliding-window KV blocks freed (issue 48): what the sliding layers' own pool
(core/window_blocks.py) gives a model with sliding and full layers, on this CPU.

1. Analytical, for the released models' attention widths: KV bytes a request of L tokens holds
   with one pool (every layer keeps every token) and with the sliding layers' pool (they keep
   their window), and the ratio.
2. Measured: a gpt-oss-shaped small model with random (dummy) float32 weights (12 layers
   alternating sliding (window 128) / full, 8 KV heads of 64, hidden 256, 4 experts), the
   same KV memory budget (--kv-gib, default 1 GiB, the CPU default) with and without
   `disable_hybrid_kv_cache_manager`: the full layers' blocks, and a batch of long requests
   (--requests x (--prompt + --output) tokens, all admitted at once): elapsed time, output
   tokens/s, preemptions, the most requests running at once. The two runs alternate,
   --repeats times; medians.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/window_kv.py [--repeats 3]
           [--output-json benchmarks/results/window_kv_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# The released models: layers, sliding layers, window, KV heads, head_dim (config.json values).
REAL = {"gpt-oss-20b": (24, 12, 128, 8, 64), "gpt-oss-120b": (36, 18, 128, 8, 64),
        "gemma-3-27b": (62, 52, 1024, 16, 128), "gemma-3-4b": (34, 29, 1024, 4, 256)}


def analytical(length: int, itemsize: int = 2) -> dict:
    out = {}
    for name, (layers, sliding, window, kv_heads, head_dim) in REAL.items():
        per_token_layer = 2 * kv_heads * head_dim * itemsize
        one = layers * length * per_token_layer
        two = ((layers - sliding) * length + sliding * min(window, length)) * per_token_layer
        out[name] = {"one_pool_bytes": one, "window_pool_bytes": two, "ratio": one / two}
    return out


def _config(path: str) -> None:
    from transformers import GptOssConfig

    cfg = GptOssConfig(vocab_size=32000, hidden_size=256, intermediate_size=256,
                       num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                       head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=128, max_position_embeddings=4096,
                       layer_types=["sliding_attention", "full_attention"] * 6,
                       tie_word_embeddings=False)
    cfg.architectures = ["GptOssForCausalLM"]
    cfg.save_pretrained(path)


def run(path: str, args, hybrid: bool) -> dict:
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=args.prompt + args.output, max_num_seqs=args.requests,
              kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)), warmup=False,
              disable_hybrid_kv_cache_manager=not hybrid, enable_multiprocessing=False)
    core = llm.llm_engine.engine_core.core
    sched = core.scheduler
    most = [0]
    schedule = sched.schedule

    def watched(*a, **k):
        out = schedule(*a, **k)
        most[0] = max(most[0], len(sched.running))
        return out

    sched.schedule = watched
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 32000, args.prompt).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    before = llm.llm_engine.get_stats()["num_preemptions"]
    most[0] = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    stats = llm.llm_engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    caches = core.runner.kv_caches
    res = {"elapsed_s": elapsed, "output_tok_s": n_out / elapsed,
           "preemptions": stats["num_preemptions"] - before, "most_running": most[0],
           "full_layer_blocks": core.runner.num_kv_blocks,
           "window_blocks": stats.get("num_window_kv_blocks", 0),
           "kv_cache_bytes": int(sum(k.nbytes + v.nbytes for k, v in caches)),
           "block_size": core.runner.block_size}
    llm.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--output-json",
                    default=os.path.join(HERE, "results", "window_kv_cpu.json"))
    args = ap.parse_args()
    from compare_cpu import _cpu_name

    path = os.path.join(tempfile.gettempdir(), "jaxinfer-window-kv-bench")
    os.makedirs(path, exist_ok=True)
    _config(path)
    runs = {"one_pool": [], "window_pool": []}
    for i in range(args.repeats):
        for name in (runs if i % 2 == 0 else reversed(list(runs))):
            r = run(path, args, hybrid=name == "window_pool")
            runs[name].append(r)
            print(name, json.dumps(r), flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in runs.items()}
    result = {
        "benchmark": "window_kv",
        "model": "gpt-oss-shaped, 12 layers (6 sliding, window 128), 8 KV heads x 64, "
                 "hidden 256, dummy float32 weights",
        "workload": f"{args.requests} x ({args.prompt} prompt + {args.output} output) tokens, "
                    f"greedy, all at once",
        "kv_cache_memory_bytes": int(args.kv_gib * (1 << 30)),
        "median": med,
        "window_over_one_pool": {
            "output_tok_s": med["window_pool"]["output_tok_s"] / med["one_pool"]["output_tok_s"],
            "full_layer_blocks": (med["window_pool"]["full_layer_blocks"]
                                  / med["one_pool"]["full_layer_blocks"])},
        "analytical_bf16_32k": analytical(32768),
        "runs": runs, "repeats": args.repeats,
        "command": "benchmarks/window_kv.py " + " ".join(sys.argv[1:]),
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "machine": platform.machine(), "cpu": _cpu_name()},
    }
    print(json.dumps({k: result[k] for k in ("median", "window_over_one_pool")}, indent=1))
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

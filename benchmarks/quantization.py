"""Quantized weights and the fp8 KV cache on this CPU (issue 32): memory, speed, agreement.

For the embedded SmolLM2-135M (float32 activations, the default `cpu` backend), one engine per
mode, every shape compiled (and fused: docs/startup.md) before timing:
  float32          the float model
  int8             quantization="int8": linear weights int8, per-channel scales (C++ kernel)
  fp8              quantization="fp8": linear weights fp8 e4m3, per-channel scales
  fp8+fp8kv        fp8 weights and kv_cache_dtype="fp8"
  gguf-q4_1        quantization="gguf": the embedded GGUF's Q4_1 projections kept (4-bit
                   codes two to a byte, a scale and offset per 32 inputs) and its tied Q8_0
                   token_embd (the LM head, which serves the lookups too)
Each reports weight bytes, KV blocks for the same byte budget, batch-1 decode ms/token
(1 x 128 in / 128 out, minus the first token) beside its floor (the bytes a step reads over
the measured read bandwidth), 32 x 128/128 output tokens/s, and greedy
agreement with float32 on 17 chat-style prompts (first token; all 16 tokens). With
--llama-cpp-bin, llama.cpp runs the embedded Q4_1 GGUF itself (llama-bench, llama-batched-
bench, F16 KV: its default) in the same run as the peer.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/quantization.py
           [--llama-cpp-bin DIR] [--output-json benchmarks/results/quantization_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = {"float32": {}, "int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"},
         "fp8+fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
         "gguf-q4_1": {"quantization": "gguf"}}
KV_BUDGET = 256 << 20


def run_mode(extra: dict, prompts_text: list[str]) -> dict:
    from compare_cpu import _prompts, wait_settled

    from jaxinfer import LLM, SamplingParams

    llm = LLM(None, dtype="float32", max_model_len=256, max_num_seqs=32,
              warmup=False, kv_cache_memory_bytes=KV_BUDGET, **extra)  # (shapes: warm-up runs)

    def timed(max_tokens, batch):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0, outs

    cfg = llm.llm_engine.model_config
    kv_item = 1 if extra.get("kv_cache_dtype") == "fp8" else 4
    res = {}
    for n, seed in ((1, 1), (32, 2)):
        batch = [{"prompt_token_ids": p} for p in _prompts(n, 128, 49152, seed)]
        timed(4, [{"prompt_token_ids": p} for p in _prompts(n, 128, 49152, seed + 10)])
        wait_settled(llm)  # the steady state: the buckets used fused
        ttft, _ = timed(1, [{"prompt_token_ids": p} for p in _prompts(n, 128, 49152, seed + 20)])
        elapsed, outs = timed(128, batch)
        res[f"{n}x128x128"] = {"elapsed_s": elapsed, "output_tok_s": n * 128 / elapsed,
                               "decode_ms_per_token": 1e3 * (elapsed - ttft) / 127}
    _, outs = timed(16, prompts_text)
    stats = llm.llm_engine.get_stats()
    llm.shutdown()
    # What a batch-1 decode step must read: every weight (the tied embedding table is held
    # once, as the packed LM head, which each step reads whole), and the KV of its context
    # (192 tokens on average over 128 in / 128 out).
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_item * 192
    return {"workloads": res, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "decode_bytes_per_step": stats["weight_bytes_per_device"] + kv,
            "weight_bytes": stats["weight_bytes_per_device"],
            "kv_cache_bytes": stats["kv_cache_bytes_per_device"],
            "num_kv_blocks": stats["num_kv_blocks"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--llama-cpp-bin", default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from tests.engine.test_llm_greedy import PROMPTS

    from jaxinfer.bench.roofline import measure_device

    read_bw = measure_device("float32")["read_bandwidth_bytes_per_s"]
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(MODES[mode], PROMPTS)
        r = results[mode]
        r["decode_floor_ms"] = 1e3 * r["decode_bytes_per_step"] / read_bw
        r["decode_fraction_of_floor"] = (r["decode_floor_ms"]
                                         / r["workloads"]["1x128x128"]["decode_ms_per_token"])
    base = results.get("float32")
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s (the batch-1 floor: bytes a step reads / it)")
    print(f"{'mode':<12} {'weights MiB':>11} {'KV blocks':>9} {'1x128 ms/tok':>12} "
          f"{'floor ms':>8} {'32x128 tok/s':>12} {'first eq':>8} {'16 eq':>6}")
    for mode, r in results.items():
        if base is not None:
            pairs = list(zip(r["tokens"], base["tokens"]))
            r["agree_first_token"] = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
            r["agree_all_16"] = sum(a == b for a, b in pairs) / len(pairs)
        w = r["workloads"]
        print(f"{mode:<12} {r['weight_bytes'] / 2**20:>11.1f} {r['num_kv_blocks']:>9} "
              f"{w['1x128x128']['decode_ms_per_token']:>12.2f} {r['decode_floor_ms']:>8.2f} "
              f"{w['32x128x128']['output_tok_s']:>12.1f} {r.get('agree_first_token', 1):>8.2f} "
              f"{r.get('agree_all_16', 1):>6.2f}")
    peer = None
    if args.llama_cpp_bin:
        from compare_cpu import run_llama_cpp

        from jaxinfer.checkpoints.default_model import find_default_gguf

        class A:
            llama_cpp_bin, gguf = args.llama_cpp_bin, find_default_gguf()

        import subprocess

        from compare_cpu import NCPU, _llama_env

        # Batch-1 decode: llama-bench -p 0 -n 128 (F16 KV, its default).
        peer = {"gguf": os.path.basename(A.gguf)}
        cmd = [os.path.join(A.llama_cpp_bin, "llama-bench"), "-m", A.gguf, "-p", "0", "-n",
               "128", "-t", str(NCPU)]
        text = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              env=_llama_env(A)).stdout
        line = [x for x in text.splitlines() if "tg128" in x][-1]
        tps = float(line.strip().strip("|").split("|")[-1].split("±")[0])
        peer["1x128x128"] = {"llama_bench_tg_tok_s": tps, "decode_ms_per_token": 1e3 / tps,
                             "command": " ".join(cmd)}
        try:  # 32 x 128/128 through llama-batched-bench
            peer["32x128x128"] = run_llama_cpp(A, (32, 128, 128), "f16")
        except Exception as e:  # noqa: BLE001  (e.g. a build whose kernels this VM refuses)
            peer["32x128x128"] = {"error": f"{type(e).__name__}: {e}"}
        p32 = peer["32x128x128"]
        print(f"{'llama.cpp Q4_1':<12} {os.path.getsize(A.gguf) / 2**20:>11.1f} {'-':>9} "
              f"{1e3 / tps:>12.2f} {'':>8} "
              + (f"{p32['output_tokens'] / p32['elapsed_s']:>12.1f}" if "error" not in p32
                 else f"{'failed':>12}"))
    out = {"benchmark": "quantization", "model": "SmolLM2-135M-Instruct (embedded)",
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count()},
           "kv_cache_memory_bytes": KV_BUDGET, "read_bandwidth_bytes_per_s": read_bw,
           "modes": results, "llama_cpp": peer,
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/quantization.py "
                      + " ".join(sys.argv[1:])}
    for r in results.values():
        r.pop("tokens")
    if args.output_json:
        os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

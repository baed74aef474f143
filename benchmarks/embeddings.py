"""Embeddings per second: jaxinfer's pooling runner against HF transformers (what
sentence-transformers runs: the model in torch, batches of 32 padded with an attention mask,
mean pooling, L2 normalization) and vLLM's CPU build (runner="pooling"), same CPU, same token
ids, one engine at a time (issue 47).

SmolLM2-135M-Instruct (float32), mean pooling, normalized. Workloads: 256 short inputs of
16 tokens, 32 long inputs of 512 tokens (random token ids, seeded; the same for every
engine). Each engine runs in its own subprocess per round (rounds alternate the engines;
--repeats rounds, the median reported); each subprocess times one untimed warm-up pass of
every workload first (jaxinfer: then waits for its background compilation to settle).
Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py [--vllm-python PY] [--repeats 3]
      [--output-json benchmarks/results/embeddings_cpu_intel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.compare_cpu import (VLLM_THREAD_ENV, _cpu_name, _env, _prompts,  # noqa: E402
                                    wait_settled)

WORKLOADS = {"256x16": (256, 16), "32x512": (32, 512)}
HF_BATCH = 32  # (sentence-transformers' default batch_size)


def _model(args) -> str:
    if args.model:
        return args.model
    from jaxinfer.checkpoints.default_model import ensure_default_model

    return ensure_default_model()


def run_engine(engine: str, args) -> dict:
    """Inside the subprocess: every workload on one engine; embeddings/s per workload and a
    checksum (the first vector) to compare engines by."""
    model = args.model
    vocab = 49152
    data = {w: _prompts(n, k, vocab, seed=7) for w, (n, k) in WORKLOADS.items()}
    if engine == "hf":
        import numpy as np
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()

        def embed(prompts):
            out = []
            with torch.inference_mode():
                for i in range(0, len(prompts), HF_BATCH):
                    chunk = prompts[i:i + HF_BATCH]
                    n = max(map(len, chunk))
                    ids = torch.tensor([p + [0] * (n - len(p)) for p in chunk])
                    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in chunk])
                    h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                    m = mask.unsqueeze(-1).to(h.dtype)
                    v = (h * m).sum(1) / m.sum(1)
                    out += torch.nn.functional.normalize(v, dim=-1).tolist()
            return np.array(out)
    elif engine == "vllm":
        import numpy as np
        from vllm import LLM

        llm = LLM(model, runner="pooling", dtype="float32", max_model_len=1024,
                  pooler_config={"pooling_type": "MEAN", "use_activation": True},
                  enable_prefix_caching=False)

        def embed(prompts):
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            return np.array([o.outputs.embedding for o in outs])
    else:
        import numpy as np

        from jaxinfer import LLM

        llm = LLM(model, runner="pooling", dtype="float32", max_model_len=1024,
                  pooler_config={"pooling_type": "MEAN"}, warmup_buckets="all")

        def embed(prompts):
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            return np.array([o.outputs.embedding for o in outs])
    result = {}
    for w, prompts in data.items():
        embed(prompts)  # warm-up (shapes, compilation)
    if engine == "jaxinfer":
        wait_settled(llm)
    for w, prompts in data.items():
        t0 = time.perf_counter()
        vecs = embed(prompts)
        dt = time.perf_counter() - t0
        result[w] = {"embeddings_per_s": len(prompts) / dt,
                     "tokens_per_s": sum(map(len, prompts)) / dt, "seconds": dt,
                     "first": [round(float(x), 6) for x in vecs[0][:8]]}
    return result


def _subprocess(engine: str, python: str, args, env_extra=None) -> dict:
    cmd = [python, os.path.abspath(__file__), "--run", engine, "--model", args.model]
    env = _env()
    env.update(env_extra or {})
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_engine(args.run, args)), flush=True)
        return
    args.model = _model(args)
    engines = [("jaxinfer", sys.executable, None), ("hf", sys.executable, None)]
    if args.vllm_python:
        engines.append(("vllm", args.vllm_python, VLLM_THREAD_ENV))
    else:
        print("vllm: skipped (no --vllm-python)")
    runs: dict[str, list[dict]] = {e: [] for e, _, _ in engines}
    for r in range(args.repeats):
        print(f"-- round {r + 1} of {args.repeats}", flush=True)
        for engine, python, env in engines:
            try:
                out = _subprocess(engine, python, args, env)
            except subprocess.CalledProcessError as e:
                print(f"{engine}: FAILED\n{(e.stderr or '')[-3000:]}")
                continue
            runs[engine].append(out)
            print(engine, {w: round(v["embeddings_per_s"], 1) for w, v in out.items()},
                  flush=True)
    table = {e: {w: statistics.median(run[w]["embeddings_per_s"] for run in rs)
                 for w in WORKLOADS} for e, rs in runs.items() if rs}
    print(f"\nSmolLM2-135M float32, mean pooling, {_cpu_name()}: embeddings/s (median of "
          f"{args.repeats})")
    for w in WORKLOADS:
        row = f"{w:<8}" + "".join(f"{e:>10} {table[e][w]:8.1f}" for e in table)
        for peer in ("hf", "vllm"):
            if peer in table:
                row += f"   jaxinfer/{peer} {table['jaxinfer'][w] / table[peer][w]:.2f}x"
        print(row)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "embeddings", "cpu": _cpu_name(), "ncpu": os.cpu_count(),
                       "model": os.path.basename(os.path.normpath(args.model)),
                       "dtype": "float32", "pooling": "MEAN, normalized",
                       "workloads": {w: {"inputs": n, "tokens_each": k}
                                     for w, (n, k) in WORKLOADS.items()},
                       "hf_batch_size": HF_BATCH, "repeats": args.repeats,
                       "median_embeddings_per_s": table, "runs": runs,
                       "command": "PYTHONPATH=. .venv/bin/python benchmarks/embeddings.py "
                                  + " ".join(sys.argv[1:])}, f, indent=1)
        print("wrote", args.output_json)


if __name__ == "__main__":
    main()

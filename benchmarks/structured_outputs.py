"""Structured outputs on CPU: per-token overhead of grammar-constrained decoding, and grammar
compile times.

1. Decode: N requests (default 64) decode together on SmolLM2-135M-Instruct, once
   unconstrained and once under a JSON schema (an array of at least 200 integers, so no request
   can end during the measurement). Per step: wall time, the host's share (schedule, bitmask
   fill, input build, update incl. advancing every grammar) and the device wait. The overhead
   is the difference per step and per generated token.
2. Compile: each test spec (JSON schemas, regexes, choice, Lark) compiled from scratch by each
   backend (llguidance; xgrammar when installed), and the front end's validation time.

Usage (from the repository root):

    PYTHONPATH=. python benchmarks/structured_outputs.py [--num-reqs 64] [--steps 30] \
        [--output-json benchmarks/results/structured_outputs_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LONG_ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": 200}


def decode(num_reqs: int, steps: int, backend: str, rounds: int = 3,
           warmup_steps: int = 4) -> list[dict]:
    """Alternates unconstrained and JSON-schema batches on one engine core, `rounds` times
    each (this machine's noise is 10-20% from one run to the next)."""
    from jaxinfer.config import EngineConfig, resolve_config
    from jaxinfer.engine.core import EngineCore
    from jaxinfer.engine.processor import Processor
    from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
    from jaxinfer.tokenizer import Tokenizer

    cfg = EngineConfig(dtype="float32", max_model_len=512, max_num_seqs=num_reqs,
                       max_num_batched_tokens=2048, warmup=False,
                       structured_outputs_config={"backend": backend})
    rc = resolve_config(cfg)
    core = EngineCore(rc)
    tok = Tokenizer(rc.tokenizer_dir)
    proc = Processor(tok, vocab_size=rc.model_config.vocab_size, max_model_len=512,
                     eos_token_id=tok.eos_token_id,
                     structured_outputs_config=cfg.structured_outputs_config)
    runs = []
    for k in range(2 * rounds):
        structured = k % 2 == 1
        so = StructuredOutputsParams(json=LONG_ARRAY) if structured else None
        params = SamplingParams(temperature=1.0, max_tokens=steps + warmup_steps + 40,
                                ignore_eos=not structured, structured_outputs=so)
        for i in range(num_reqs):
            msgs = [{"role": "user", "content": f"List 200 numbers as a JSON array ({i})."}]
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
            _, _, reqs = proc.make_requests(f"r{k}-{i}", prompt, params.clone(seed=i))
            core.add_request(reqs[0])
        while len(core.scheduler.running) < num_reqs or any(
                r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()
        for _ in range(warmup_steps):
            core.step()
        core.profile_steps(True)
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            tokens += sum(len(o.new_token_ids) for o in core.step())
        wall = time.perf_counter() - t0
        timings = core.profile_steps(False)
        finished_early = num_reqs - len(core.scheduler.running)
        core.abort_requests(list(core.scheduler.requests))
        runs.append({"structured": structured, "round": k // 2, "tokens": tokens,
                     "finished_early": finished_early, "ms_per_step": wall * 1e3 / steps,
                     "host_ms": [h * 1e3 for h, _ in timings],
                     "device_wait_ms": [w * 1e3 for _, w in timings]})
    core.shutdown()
    return runs


def summarize(runs: list[dict], structured: bool) -> dict:
    mine = [r for r in runs if r["structured"] == structured]
    host = [x for r in mine for x in r["host_ms"]]
    wait = [x for r in mine for x in r["device_wait_ms"]]
    tokens = sum(r["tokens"] for r in mine)
    steps = sum(len(r["host_ms"]) for r in mine)
    return {"structured": structured, "rounds": len(mine), "steps": steps, "tokens": tokens,
            "finished_early": sum(r["finished_early"] for r in mine),
            "ms_per_step_per_round": [r["ms_per_step"] for r in mine],
            "ms_per_step_median_round": statistics.median(r["ms_per_step"] for r in mine),
            "host_ms_per_step_median": statistics.median(host),
            "device_wait_ms_per_step_median": statistics.median(wait)}


def compile_times(backends: list[str]) -> list[dict]:
    import sys

    sys.path.insert(0, ROOT)
    from jaxinfer.config import StructuredOutputsConfig, resolve_config, EngineConfig
    from jaxinfer.structured_output import StructuredOutputManager, StructuredOutputValidator
    from jaxinfer.tokenizer import Tokenizer
    from tests.structured.test_structured_outputs import _specs

    rc = resolve_config(EngineConfig())
    tok = Tokenizer(rc.tokenizer_dir)
    source = lambda: (tok.backend_json(), tok.eos_token_id)  # noqa: E731
    rows = []
    for name in backends:
        config = StructuredOutputsConfig(backend=name)
        t0 = time.perf_counter()
        manager = StructuredOutputManager(config, source, rc.model_config.vocab_size)
        backend = manager.get(name)
        setup = time.perf_counter() - t0
        validator = StructuredOutputValidator(config, source, rc.model_config.vocab_size)
        validator.get(name)
        for spec_name, so, _ in _specs():
            t0 = time.perf_counter()
            validator.validate(so)
            t1 = time.perf_counter()
            compiled = backend.compile(so)
            t2 = time.perf_counter()
            backend.new_grammar(compiled)
            t3 = time.perf_counter()
            rows.append({"backend": name, "spec": spec_name, "validate_ms": (t1 - t0) * 1e3,
                         "compile_ms": (t2 - t1) * 1e3, "new_matcher_ms": (t3 - t2) * 1e3,
                         "backend_setup_s": setup})
        manager.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="guidance")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import importlib.util

    backends = ["guidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])
    compiles = compile_times(backends)
    print(f"{'backend':<10} {'spec':<24} {'validate ms':>12} {'compile ms':>11} "
          f"{'matcher ms':>11}")
    for r in compiles:
        print(f"{r['backend']:<10} {r['spec']:<24} {r['validate_ms']:>12.2f} "
              f"{r['compile_ms']:>11.2f} {r['new_matcher_ms']:>11.3f}")
    runs = decode(args.num_reqs, args.steps, args.backend, args.rounds)
    plain, constrained = summarize(runs, False), summarize(runs, True)
    overhead_step = constrained["ms_per_step_median_round"] - plain["ms_per_step_median_round"]
    host_overhead = constrained["host_ms_per_step_median"] - plain["host_ms_per_step_median"]
    print(f"\n{args.num_reqs} concurrent requests, {args.rounds} x {args.steps} decode steps "
          f"per mode (alternating), backend {args.backend}:")
    for r in (plain, constrained):
        rounds = ", ".join(f"{x:.0f}" for x in r["ms_per_step_per_round"])
        print(f"  {'JSON schema' if r['structured'] else 'unconstrained':<14} "
              f"{r['ms_per_step_median_round']:7.1f} ms/step (rounds: {rounds})  host "
              f"{r['host_ms_per_step_median']:5.1f} ms  device wait "
              f"{r['device_wait_ms_per_step_median']:6.1f} ms")
    print(f"  overhead: {overhead_step:+.1f} ms/step "
          f"({100 * overhead_step / plain['ms_per_step_median_round']:+.1f}%, within this "
          f"machine's noise); host: {host_overhead:+.2f} ms/step = "
          f"{host_overhead / args.num_reqs * 1e3:+.0f} us per structured token")
    result = {
        "benchmark": "structured_outputs", "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "model": "SmolLM2-135M-Instruct (float32)",
        "backend": args.backend, "schema": LONG_ARRAY, "num_reqs": args.num_reqs,
        "unconstrained": plain, "json_schema": constrained,
        "overhead_ms_per_step": overhead_step,
        "overhead_fraction": overhead_step / plain["ms_per_step_median_round"],
        "host_overhead_ms_per_step": host_overhead,
        "host_overhead_us_per_token": host_overhead / args.num_reqs * 1e3,
        "compile": compiles,
        "command": "PYTHONPATH=. python benchmarks/structured_outputs.py "
                   f"--num-reqs {args.num_reqs} --steps {args.steps} --rounds {args.rounds} "
                   f"--backend {args.backend}",
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()

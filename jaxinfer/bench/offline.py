"""`jaxinfer bench latency` and `jaxinfer bench throughput` (offline, through LLM)."""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from jaxinfer.bench import write_result

PERCENTILES = (10, 25, 50, 75, 90, 99)


def engine_args(p, defaults=None, **skip) -> None:
    """Every engine option as a flag (EngineConfig's fields: config/cli.py), bench's defaults:
    256 sequences at once, max_model_len from the workload (and the command's `defaults`)."""
    from jaxinfer.config.cli import add_engine_args

    add_engine_args(p, defaults={"max_num_seqs": 256, **(defaults or {})}, **skip)
    p.add_argument("--output-json", default=None)


def make_llm(args, max_model_len: int):
    """The LLM of the command's engine flags (max_model_len: the workload's, unless given)."""
    from jaxinfer.config.cli import engine_config_from_args
    from jaxinfer.llm import LLM

    llm = LLM.from_engine_config(engine_config_from_args(
        args, max_model_len=args.max_model_len or max_model_len))
    # With the engine core in its own process, this one starts JAX (the results' environment,
    # the roofline's bandwidth probe) only now, after the core took the GPU's memory: a client
    # preallocating 75% of the card then logs a string of CUDA out-of-memory errors while it
    # backs off (seen on an H200). No effect where JAX is up already (an engine in this
    # process) or where the user set it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return llm


def environment(llm=None) -> dict:
    import jax

    env = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "platform": jax.default_backend(), "python": platform.python_version()}
    if llm is not None:
        eng = llm.llm_engine
        env.update(model=eng.model_dir, architecture=eng.model_config.architecture,
                   dtype=eng.dtype, attention_backend=eng.attention_backend)
    return env


def run_latency(args) -> dict:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.bench.datasets import random_requests

    llm = make_llm(args, args.input_len + args.output_len)
    vocab = llm.llm_engine.model_config.vocab_size
    reqs = random_requests(args.batch_size, args.input_len, args.output_len, vocab_size=vocab,
                           seed=args.seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    lat = np.array(latencies)
    result = {"benchmark": "latency", "input_len": args.input_len,
              "output_len": args.output_len, "batch_size": args.batch_size,
              "num_iters": args.num_iters, "avg_latency": float(lat.mean()),
              "latencies": latencies,
              "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
              "environment": environment(llm)}
    print(f"Avg latency: {lat.mean():.4f} s  (batch {args.batch_size}, in {args.input_len}, "
          f"out {args.output_len})")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {np.percentile(lat, p):.4f} s")
    result["roofline"] = _decode_roofline(llm, args, float(lat.mean()))
    return write_result(args.output_json, result)


def _decode_roofline(llm, args, latency_s: float) -> dict:
    """The run beside its floor: the weights as held plus the KV at the middle context, read
    once per step at the measured read bandwidth (jaxinfer/bench/roofline.py). The time per
    step includes the prefill's share: a floor the run cannot reach, but the gap it shows."""
    from jaxinfer.bench.roofline import decode_floor, measure_read_bandwidth
    from jaxinfer.config.dtypes import dtype as array_dtype

    eng = llm.llm_engine
    weight_bytes = eng.get_stats().get("weight_bytes_per_device")
    if not weight_bytes:
        return {}
    bandwidth = measure_read_bandwidth()
    floor = decode_floor(weight_bytes, eng.model_config,
                         array_dtype(eng.resolved.kv_cache_dtype).itemsize, args.batch_size,
                         args.input_len + args.output_len // 2, bandwidth)
    per_step = latency_s / args.output_len
    print(f"Roofline: {per_step * 1e3:.2f} ms per output step (prefill's share included) vs "
          f"a {floor * 1e3:.2f} ms decode floor ({weight_bytes / 2**20:.0f} MiB of weights + "
          f"KV read at {bandwidth / 1e9:.1f} GB/s): {floor / per_step:.0%} of the floor")
    return {"ms_per_output_step": per_step * 1e3, "decode_floor_ms": floor * 1e3,
            "read_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes,
            "fraction_of_floor": floor / per_step}


def run_throughput(args) -> dict:
    if args.num_warmups < 0:
        raise SystemExit(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.dataset == "random-mm":
        raise SystemExit("--dataset random-mm is for `jaxinfer bench serve` (chat requests "
                         "with images); throughput takes token-id workloads")
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.bench.datasets import load_requests

    from jaxinfer.config import ModelConfig
    from jaxinfer.checkpoints.default_model import ensure_default_model
    from jaxinfer.tokenizer import Tokenizer

    model_dir = args.model or ensure_default_model()
    tokenizer = None
    if args.dataset == "sharegpt":
        tokenizer = Tokenizer.from_pretrained(args.tokenizer or model_dir)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    reqs = load_requests(args, tokenizer, vocab)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    llm = make_llm(args, longest)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0 if args.greedy else 1.0, top_p=1.0,
                             max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in reqs]
    if args.num_warmups > 0:  # (vLLM's --num-warmups: prompts of the workload, untimed)
        warm = load_requests(argparse.Namespace(**{**vars(args), "num_prompts": args.num_warmups,
                                                   "seed": args.seed + 1}), tokenizer, vocab)
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm],
                     [SamplingParams(temperature=0 if args.greedy else 1.0, top_p=1.0,
                                     max_tokens=r.output_len, ignore_eos=True,
                                     detokenize=False) for r in warm], use_tqdm=False)
    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - t0
    stats = llm.llm_engine.get_stats()
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # How the timed steps ran: compiled on the spot, padded up to a larger ready bucket
    # while their own compiled, or as several layer-wise programs (not yet fused).
    steps = {k: stats.get(k, 0) - before.get(k, 0)
             for k in ("num_steps", "num_compilations", "num_padded_up_steps",
                       "num_layerwise_steps", "num_fused_buckets")}
    result = {"benchmark": "throughput", "dataset": args.dataset, "num_requests": len(reqs),
              "total_prompt_tokens": n_in, "total_output_tokens": n_out,
              "elapsed_time": elapsed, "requests_per_second": len(reqs) / elapsed,
              "tokens_per_second": (n_in + n_out) / elapsed,
              "output_tokens_per_second": n_out / elapsed,
              "num_preemptions": stats["num_preemptions"], "steps": steps,
              "environment": environment(llm)}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s "
          f"({len(reqs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f} s)")
    print(f"Steps: {steps['num_steps']}, of which {steps['num_padded_up_steps']} padded up to "
          f"a larger bucket and {steps['num_layerwise_steps']} on layer-wise programs; "
          f"{steps['num_compilations']} compiled and {steps['num_fused_buckets']} fused "
          f"meanwhile")
    return write_result(args.output_json, result)


def add_parsers(sub) -> None:
    from jaxinfer.bench.datasets import add_dataset_args

    lat = sub.add_parser("latency", help="latency of one batch, repeated")
    engine_args(lat)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.set_defaults(bench=run_latency)

    thr = sub.add_parser("throughput", help="offline throughput over a dataset")
    # Every bucket compiled before the timed run (the steady state: what vLLM's compile and
    # graph capture at start-up give it); --warmup-buckets start times the lazy default.
    engine_args(thr, defaults={"warmup_buckets": "all"})
    add_dataset_args(thr, num_prompts=256, input_len=512, output_len=256)
    thr.add_argument("--greedy", action="store_true", help="temperature 0 (default: 1.0)")
    thr.add_argument("--no-tqdm", action="store_true")
    thr.add_argument("--num-warmups", type=int, default=0,
                     help="prompts of the workload run, untimed, before the timed benchmark")
    thr.set_defaults(bench=run_throughput)

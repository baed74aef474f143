"""`jaxinfer auto-tune --model M --input-len I --output-len O --max-latency-ms L ...` (vLLM's
auto_tune.sh): for each (max_num_seqs, max_num_batched_tokens) pair, a fresh server
(bench/sweep.py's Server) and the highest request rate (inf first, then lower) whose p99
end-to-end latency meets L; the best throughput over the pairs. DIR/result.txt,
DIR/result.json and DIR/auto_tune.png."""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import subprocess
import sys

from jaxinfer.bench.sweep import Server, _load


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} {text!r}: expected integers >= 1")
    return values


def run_auto_tune(args) -> int:
    from tqdm import tqdm

    seqs = _ints(args.num_seqs_list, "--num-seqs-list")
    tokens = _ints(args.num_batched_tokens_list, "--num-batched-tokens-list")
    if args.max_latency_ms <= 0:
        raise ValueError(f"--max-latency-ms must be > 0, got {args.max_latency_ms}")
    if not 0 <= args.min_cache_hit_pct < 100:
        raise ValueError(f"--min-cache-hit-pct must be in [0, 100), got {args.min_cache_hit_pct}")
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = int(args.input_len * args.min_cache_hit_pct / 100)
    max_len = args.input_len + args.output_len
    results = []
    pairs = list(itertools.product(seqs, tokens))
    for n_seqs, n_tokens in tqdm(pairs, desc="auto-tune", disable=args.no_tqdm):
        serve_argv = [sys.executable, "-m", "jaxinfer.entrypoints.cli", "serve", args.model,
                      *(["--served-model-name", args.served_model_name]
                        if args.served_model_name else []),
                      "--port", str(args.port), "--max-num-seqs", str(n_seqs),
                      "--max-num-batched-tokens", str(n_tokens), "--max-model-len",
                      str(max_len), *shlex.split(args.serve_args or "")]
        server = Server(serve_argv, os.path.join(args.output_dir,
                                                 f"serve-{n_seqs}-{n_tokens}.log"),
                        args.server_ready_timeout)
        entry = {"max_num_seqs": n_seqs, "max_num_batched_tokens": n_tokens, "runs": []}
        try:
            why = server.start()
            if why is not None:
                entry.update(status="server failed", error=why)
                results.append(entry)
                continue
            rate = math.inf
            while True:
                path = os.path.join(args.output_dir, f"bench-{n_seqs}-{n_tokens}-{rate:g}.json")
                argv = [sys.executable, "-m", "jaxinfer.entrypoints.cli", "bench", "serve",
                        "--base-url", f"http://127.0.0.1:{args.port}", "--model",
                        args.served_model_name or os.path.basename(
                            os.path.normpath(args.model)), "--dataset", "random",
                        "--num-prompts", str(args.num_prompts), "--input-len",
                        str(args.input_len - prefix), "--output-len", str(args.output_len),
                        "--random-prefix-len", str(prefix), "--request-rate", str(rate),
                        "--vocab-size", str(args.vocab_size), "--output-json", path]
                server.reset_prefix_cache()
                proc = subprocess.run(argv, capture_output=True, text=True)
                if proc.returncode != 0:
                    entry.update(status="bench failed", error=proc.stderr[-400:])
                    break
                res = _load(path)
                p99 = res["e2e_latency_ms"]["p99"]
                run = {"request_rate": rate, "e2e_p99_ms": p99,
                       "request_throughput": res["request_throughput"],
                       "output_throughput": res["output_throughput"],
                       "failed": res["failed"]}
                entry["runs"].append(run)
                if p99 is not None and p99 <= args.max_latency_ms and not res["failed"]:
                    entry.update(status="ok", **run)
                    break
                # Too slow: ask for less than was served (vLLM's script steps down from the
                # measured rate); give up below --min-request-rate.
                rate = (res["request_throughput"] if math.isinf(rate) else rate) * 0.7
                if rate < args.min_request_rate:
                    entry.update(status="latency not met")
                    break
        finally:
            server.stop()
        results.append(entry)
    ok = [r for r in results if r.get("status") == "ok"]
    best = max(ok, key=lambda r: r["output_throughput"]) if ok else None
    lines = []
    for r in results:
        if r.get("status") == "ok":
            lines.append(f"max_num_seqs: {r['max_num_seqs']}, max_num_batched_tokens: "
                         f"{r['max_num_batched_tokens']}, request_rate: {r['request_rate']:g}, "
                         f"e2el: {r['e2e_p99_ms']:.1f}, throughput: "
                         f"{r['output_throughput']:.2f}")
        else:
            lines.append(f"max_num_seqs: {r['max_num_seqs']}, max_num_batched_tokens: "
                         f"{r['max_num_batched_tokens']}, {r.get('status')}")
    lines.append(f"best_max_num_seqs: {best['max_num_seqs'] if best else None}, "
                 f"best_num_batched_tokens: {best['max_num_batched_tokens'] if best else None}, "
                 f"best_throughput: {best['output_throughput'] if best else 0:.2f}")
    with open(os.path.join(args.output_dir, "result.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.output_dir, "result.json"), "w") as f:
        json.dump({"max_latency_ms": args.max_latency_ms, "input_len": args.input_len,
                   "output_len": args.output_len, "min_cache_hit_pct": args.min_cache_hit_pct,
                   "results": results, "best": best}, f, indent=1)
    _plot_auto_tune(args.output_dir, results)
    print("\n".join(lines))
    return 0 if best else 1


def _plot_auto_tune(out_dir: str, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['max_num_seqs']}/{r['max_num_batched_tokens']}" for r in results]
    ax.bar(labels, [r.get("output_throughput", 0) if r.get("status") == "ok" else 0
                    for r in results])
    ax.set(xlabel="max_num_seqs / max_num_batched_tokens",
           ylabel="output tokens/s within the latency target", title="auto-tune")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "auto_tune.png"), dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- argparse


def add_parser(sub) -> None:
    a = sub.add_parser("auto-tune", help="best max_num_seqs x max_num_batched_tokens whose "
                       "p99 end-to-end latency meets a target (vLLM's auto_tune)")
    a.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
    a.add_argument("--served-model-name", default=None)
    a.add_argument("--input-len", type=int, required=True)
    a.add_argument("--output-len", type=int, required=True)
    a.add_argument("--max-latency-ms", type=float, required=True)
    a.add_argument("--num-seqs-list", default="8,16,32")
    a.add_argument("--num-batched-tokens-list", default="256,512,1024")
    a.add_argument("--min-cache-hit-pct", type=float, default=0.0)
    a.add_argument("--num-prompts", type=int, default=64)
    a.add_argument("--vocab-size", type=int, default=32000)
    a.add_argument("--min-request-rate", type=float, default=0.05)
    a.add_argument("--port", type=int, default=8004)
    a.add_argument("--serve-args", default=None, help="more `jaxinfer serve` flags")
    a.add_argument("--server-ready-timeout", type=float, default=600.0)
    a.add_argument("--no-tqdm", action="store_true")
    a.add_argument("-o", "--output-dir", default="auto_tune")

    def run(args):
        if args.model is None:
            from jaxinfer.checkpoints.default_model import ensure_default_model

            args.model = ensure_default_model()
        return run_auto_tune(args)

    a.set_defaults(func=run)

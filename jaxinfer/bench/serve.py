"""`jaxinfer bench serve`: an online load against any OpenAI-compatible completions endpoint
(the chat endpoint for --dataset random-mm: text with images as data: URLs).

Requests arrive as a Poisson process at --request-rate (gamma with --burstiness != 1), at
most --max-concurrency in flight; each streams, so TTFT, inter-token latency, TPOT and e2e are
measured on the client, as vLLM's benchmark_serving does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np

from jaxinfer.bench import write_result


def _body(model, req) -> tuple[str, dict]:
    """(route, body) of one request: completions with token ids, or (text / images) chat."""
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0.0,
              "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if req.text is None:
        return "/v1/completions", {**common, "prompt": req.prompt_token_ids}
    import base64

    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(img).decode()}}
        for img in req.images]
    parts.append({"type": "text", "text": req.text})
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": parts}]}


def _delta_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _one(client, base, model, req, headers, sem):
    async with sem:
        route, body = _body(model, req)
        url = base + route
        t0 = time.perf_counter()
        ttft, last, itls, n_out, ok, err = None, t0, [], 0, False, ""
        n_in = len(req.prompt_token_ids)
        try:
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    err = (await resp.aread()).decode()[:200]
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if data.get("usage"):
                            n_out = data["usage"]["completion_tokens"]
                            n_in = data["usage"]["prompt_tokens"]
                        if not data.get("choices") or not _delta_text(data["choices"][0]):
                            continue
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - t0
                        else:
                            itls.append(now - last)
                        last = now
                    ok = True
        except Exception as e:  # a failed request is counted, not fatal
            err = repr(e)
        e2e = time.perf_counter() - t0
        return {"ok": ok and ttft is not None, "ttft": ttft, "itls": itls, "e2e": e2e,
                "prompt_len": n_in, "output_len": n_out, "images": len(req.images),
                "error": err}


def _stats(values, scale=1e3) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


async def _run(args, reqs):
    import httpx

    url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency or len(reqs))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(_one(client, url, args.model, req, headers, sem)))
            if args.request_rate != float("inf"):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return results, duration


def run_serve(args) -> dict:
    from jaxinfer.bench.datasets import load_requests
    from jaxinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    reqs = load_requests(args, tokenizer, args.vocab_size)
    results, duration = asyncio.run(_run(args, reqs))
    good = [r for r in results if r["ok"]]
    tpots = [(r["e2e"] - r["ttft"]) / (r["output_len"] - 1) for r in good if r["output_len"] > 1]
    itls = [x for r in good for x in r["itls"]]
    n_out = sum(r["output_len"] for r in good)
    slo = {"ttft_ms": args.goodput_ttft_ms, "tpot_ms": args.goodput_tpot_ms,
           "e2e_ms": args.goodput_e2e_ms}
    n_good = 0
    for r in good:
        tpot = (r["e2e"] - r["ttft"]) / max(r["output_len"] - 1, 1)
        if ((slo["ttft_ms"] is None or r["ttft"] * 1e3 <= slo["ttft_ms"])
                and (slo["tpot_ms"] is None or tpot * 1e3 <= slo["tpot_ms"])
                and (slo["e2e_ms"] is None or r["e2e"] * 1e3 <= slo["e2e_ms"])):
            n_good += 1
    result = {
        "benchmark": "serve", "base_url": args.base_url, "model": args.model,
        "dataset": args.dataset, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "num_prompts": len(reqs), "completed": len(good), "failed": len(results) - len(good),
        "duration": duration, "total_input_tokens": sum(r["prompt_len"] for r in good),
        "total_images": sum(r["images"] for r in good),
        "total_output_tokens": n_out, "request_throughput": len(good) / duration,
        "output_throughput": n_out / duration,
        "ttft_ms": _stats([r["ttft"] for r in good]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls), "e2e_latency_ms": _stats([r["e2e"] for r in good]),
        "goodput_slo": slo, "goodput_requests_per_s": n_good / duration,
        "errors": [r["error"] for r in results if not r["ok"]][:5],
    }
    print(f"completed {len(good)}/{len(results)} in {duration:.2f}s: "
          f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} "
          f"output tok/s, goodput {result['goodput_requests_per_s']:.2f} req/s")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        s = result[k]
        if s["mean"] is not None:
            print(f"  {k:15} mean {s['mean']:9.2f}  median {s['median']:9.2f}  "
                  f"p99 {s['p99']:9.2f}")
    return write_result(args.output_json, result)


def add_parser(sub) -> None:
    from jaxinfer.bench.datasets import add_dataset_args

    p = sub.add_parser("serve", help="online load against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="for --dataset sharegpt")
    p.add_argument("--vocab-size", type=int, default=32000, help="range of random token ids")
    add_dataset_args(p, num_prompts=100, input_len=256, output_len=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput-ttft-ms", type=float, default=None)
    p.add_argument("--goodput-tpot-ms", type=float, default=None)
    p.add_argument("--goodput-e2e-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(bench=run_serve)

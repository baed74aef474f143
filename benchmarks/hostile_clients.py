"""The server under hostile requests (issue 27): how long /health takes while each one is
refused or admitted, what each is answered, whether a plain request still works after it,
and how fast a killed engine core shows.

Against `jaxinfer serve --max-model-len 1024` (the embedded SmolLM2, lazily compiled buckets),
the issue's own setting. For each probe: /health is polled every 20 ms from another thread
while the probe runs; the worst /health latency, the probe's status and wall time, and a
plain request afterwards are recorded. Last, the engine core is SIGKILLed during a stream:
the time until the stream's error event, the server's exit code. Prints and saves JSON.

Usage (from the repository root, with `make setup` done):

    PYTHONPATH=. .venv/bin/python benchmarks/hostile_clients.py \\
        [--output-json benchmarks/results/hostile_clients_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import threading
import time

import httpx

from benchmarks.disagg_pd import _cli, _port, _stop, _wait_up

MODEL = "smol"


def _ref_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["next"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def probes() -> list[tuple[str, str, bytes]]:
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    dump = lambda o: json.dumps(o, separators=(",", ":")).encode()  # noqa: E731
    grammar = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(3000)) + '\nr3000: "a"'
    return [
        ("top_k 2**31", "/v1/completions", dump({**base, "top_k": 2**31})),
        ("top_k 2**63", "/v1/completions", dump({**base, "top_k": 2**63})),
        ("seed 2**64", "/v1/completions", dump({**base, "seed": 2**64})),
        ("stop_token_ids [2**64]", "/v1/completions", dump({**base, "stop_token_ids": [2**64]})),
        ("min_tokens 2**64", "/v1/completions", dump({**base, "min_tokens": 2**64})),
        ("1000-link $ref chain (response_format)", "/v1/completions", dump({
            **base, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": _ref_chain(1000)}}})),
        ("1000-link $ref chain (tool parameters, required)", "/v1/chat/completions", dump({
            **chat, "tool_choice": "required", "tools": [{"type": "function", "function": {
                "name": "f", "parameters": _ref_chain(1000)}}]})),
        ("3000 chained grammar rules", "/v1/completions", dump({**base,
                                                                "guided_grammar": grammar})),
        ("lone surrogate in prompt", "/v1/completions",
         b'{"model":"smol","prompt":"a\\ud800b","max_tokens":2}'),
        ("lone surrogate in model", "/v1/completions",
         b'{"model":"smol\\ud800","prompt":"a","max_tokens":2}'),
        ("lone surrogate in a streamed stop string", "/v1/completions",
         b'{"model":"smol","prompt":"a","max_tokens":2,"stream":true,"stop":["x\\udc00"]}'),
        ("100,000 prompts", "/v1/completions", dump({**base, "prompt": ["x"] * 100_000})),
        ("3,000 prompts", "/v1/completions", dump({**base, "prompt": ["x"] * 3000})),
        ("1,024 prompts x 4 tokens (admitted)", "/v1/completions",
         dump({**base, "prompt": [[7, 8, 9, 10]] * 1024, "max_tokens": 1})),
        ("8 MB token-id prompt", "/v1/completions",
         dump({"model": MODEL, "prompt": [1] * 4_000_000})),
        ("top_logprobs without logprobs", "/v1/chat/completions",
         dump({**chat, "top_logprobs": 2})),
        ("min_tokens 1e6 without max_tokens", "/v1/chat/completions", dump({
            "model": MODEL, "messages": chat["messages"], "min_tokens": 1_000_000})),
        ("image_url part to a text model", "/v1/chat/completions", dump({
            **chat, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]})),
        ("NaN temperature", "/v1/completions",
         b'{"model":"smol","prompt":"Hi","temperature":NaN}'),
    ]


def run_probe(url, path, raw) -> dict:
    worst, stop = [0.0], threading.Event()

    def poll():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                httpx.get(url + "/health", timeout=30)
            except httpx.HTTPError:
                worst[0] = float("inf")
            worst[0] = max(worst[0], time.monotonic() - t0)
            time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    t0 = time.monotonic()
    try:
        r = httpx.post(url + path, content=raw, timeout=600,
                       headers={"content-type": "application/json"})
        status, body = r.status_code, r.text[:240]
    except httpx.HTTPError as e:
        status, body = "error", repr(e)
    seconds = time.monotonic() - t0
    stop.set()
    t.join()
    plain = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code
    return {"status": status, "seconds": round(seconds, 3),
            "worst_health_seconds": round(worst[0], 3), "plain_request_after": plain,
            "answer": body}


def kill_core(url, server) -> dict:
    core = int(subprocess.run(["pgrep", "-P", str(server.pid), "-f", "core_proc"],
                              capture_output=True, text=True).stdout.split()[0])
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    killed = error = None
    last = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and killed is None:
                os.kill(core, signal.SIGKILL)
                killed = time.monotonic()
            if "EngineDeadError" in line and error is None:
                error = time.monotonic()
            if line.startswith("data: "):
                last = line
    code = server.wait(timeout=60)
    return {"seconds_to_stream_error": round(error - killed, 3) if error else None,
            "stream_ended_with_done": last == "data: [DONE]",
            "seconds_to_server_exit": round(time.monotonic() - killed, 3),
            "server_exit_code": code}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output-json", default="benchmarks/results/hostile_clients_cpu.json")
    args = ap.parse_args()
    port = _port()
    url = f"http://127.0.0.1:{port}"
    server = _cli(["serve", "--port", str(port), "--max-model-len", "1024",
                   "--served-model-name", MODEL, "--no-warmup"])
    try:
        _wait_up(url)
        httpx.post(url + "/v1/completions", timeout=600, json={  # compile the first buckets
            "model": MODEL, "prompt": "Hi", "max_tokens": 2})
        results = {}
        for name, path, raw in probes():
            results[name] = res = run_probe(url, path, raw)
            print(f"{name:50s} {res['status']!s:5} {res['seconds']:8.2f} s   /health worst "
                  f"{res['worst_health_seconds']:.3f} s   then plain {res['plain_request_after']}")
        death = kill_core(url, server)
        print("engine core SIGKILL:", death)
    finally:
        _stop([server])
    out = {"command": "PYTHONPATH=. .venv/bin/python benchmarks/hostile_clients.py",
           "server": "jaxinfer serve --max-model-len 1024 --no-warmup (SmolLM2-135M-Instruct)",
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "probes": results, "engine_core_killed": death}
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", args.output_json)


if __name__ == "__main__":
    main()

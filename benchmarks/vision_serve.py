"""`jaxinfer bench serve --dataset random-mm` against `jaxinfer serve` on the Qwen2.5-VL-shaped
dummy model of vision_prefill.py (issue 49): chat requests with random text and random JPEG
images as data: URLs (vLLM's random-mm workload), streamed; TTFT, TPOT, throughput.

The model folder gets SmolLM2's tokenizer (the embedded model's) with the three vision tokens
added, so the chat route renders and tokenizes; weights are dummy (--load-format dummy).
Usage: PYTHONPATH=. .venv/bin/python benchmarks/vision_serve.py [--num-prompts 16]
           [--buckets '{(448, 448, 1): 0.5, (224, 224, 1): 0.5}'] [--max-concurrency 4]
           [--output-json benchmarks/results/vision_serve_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _model_dir() -> str:
    from tokenizers import AddedToken, Tokenizer

    from vision_prefill import CONFIG

    from jaxinfer.checkpoints.default_model import ensure_default_model

    smol = ensure_default_model()
    path = os.path.join(tempfile.gettempdir(), "jaxinfer-vl-serve-bench")
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(smol, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")])
    tok.save(os.path.join(path, "tokenizer.json"))
    shutil.copy(os.path.join(smol, "tokenizer_config.json"), path)
    cfg = json.loads(json.dumps(CONFIG))
    cfg.update(vision_start_token_id=tok.token_to_id("<|vision_start|>"),
               image_token_id=tok.token_to_id("<|image_pad|>"),
               vision_end_token_id=tok.token_to_id("<|vision_end|>"), video_token_id=49155)
    cfg["text_config"]["vocab_size"] = 49408
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--buckets", default="{(448, 448, 1): 0.5, (224, 224, 1): 0.5}")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--output-json",
                    default=os.path.join(HERE, "results", "vision_serve_cpu.json"))
    args = ap.parse_args()
    import httpx

    from compare_cpu import _cpu_name

    path = _model_dir()
    jx = [sys.executable, "-m", "jaxinfer.entrypoints.cli"]
    serve = jx + ["serve", path, "--load-format", "dummy", "--dtype", "float32",
                  "--port", str(args.port), "--served-model-name", "vl",
                  "--max-model-len", "2048", "--max-num-batched-tokens", "512",
                  "--max-num-seqs", str(args.max_concurrency)]
    log = open(os.path.join(tempfile.gettempdir(), "vision_serve.log"), "w")
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}); see {log.name}")
            time.sleep(1)
        out = os.path.join(tempfile.gettempdir(), "vision_serve_run.json")
        bench = jx + ["bench", "serve", "--base-url", url, "--model", "vl",
                      "--dataset", "random-mm", "--num-prompts", str(args.num_prompts),
                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--random-mm-base-items-per-request", "1",
                      "--random-mm-bucket-config", args.buckets,
                      "--max-concurrency", str(args.max_concurrency), "--output-json", out]
        # one untimed round first: every step variant and encoder size compiled
        subprocess.run(bench[:-2] + ["--num-prompts", "4", "--seed", "99"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(bench, check=True)
        with open(out) as f:
            result = json.load(f)
    finally:
        proc.terminate()
        proc.wait(60)
    result.update(benchmark="vision_serve", buckets=args.buckets,
                  command="PYTHONPATH=. .venv/bin/python benchmarks/vision_serve.py "
                          f"--num-prompts {args.num_prompts} --max-concurrency "
                          f"{args.max_concurrency}",
                  server=" ".join(serve[2:]), cpu=_cpu_name(), cpus=os.cpu_count())
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

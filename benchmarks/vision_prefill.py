"""Images on this CPU (issue 49): what an image costs at prefill on a Qwen2.5-VL-shaped (or,
--model gemma3, a Gemma-3-4B-shaped) small model with random (dummy) float32 weights, and
what the encoder cache saves.

Model: the vision tower at Qwen2.5-VL's own widths (hidden 1280, 16 heads, MLP 3420, patch
14, windows of 112 pixels, merger to the text width) but 8 of its 32 blocks (full attention
in blocks 3 and 7); a language model of 8 layers, hidden 1024, 8 heads of 128 (2 KV heads),
MLP 4864, M-RoPE sections 16/24/24 (Qwen2.5-VL's head width and sections); vocabulary
32000. Images:
448 x 448 pixels (32 x 32 patches, 256 tokens) unless --size says otherwise.

--model gemma3: the SigLIP tower at Gemma 3 4B's widths (hidden 1152, 16 heads, MLP 4304,
896 x 896 pixels in 64 x 64 patches of 14) but 6 of its 27 layers, pooled to 256 soft tokens;
the same language model shape with Gemma 3's layers (5 sliding of window 1024 per full one,
head 128); every image is 896 x 896 after resizing (--size is the input's side). Its image
tokens attend both ways: the step holding them runs attention on the xla path.

Measured, each the median of --iters runs after one untimed run:
- encoder_ms: one image through the tower (the runner's encode: plan, padded patches,
  the compiled tower, back to the host), with its FLOPs and the rate they ran at (this
  CPU's float32 matmul peak is what bounds it: compare cpu_matmul's GFLOP/s);
- first_run_ms: the untimed first run of each (the tower compiled for this size; the first
  request with an image compiles the steps' image variant of its buckets);
- request_ms for one request (a short text, the image, a short text; max_tokens=1; prefix
  caching off, so only the encoder cache can save work): a new image each time (miss),
  the same image again (hit: no encoder run), and a text-only prompt of the same length.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/vision_prefill.py [--iters 5] [--size 448]
           [--model qwen2_5_vl|gemma3]
           [--output-json benchmarks/results/vision_prefill_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

IMAGE, V_START, V_END = 31990, 31988, 31989
CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "image_token_id": IMAGE, "video_token_id": 31991, "vision_start_token_id": V_START,
    "vision_end_token_id": V_END, "tie_word_embeddings": False, "torch_dtype": "float32",
    "text_config": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4864,
                    "num_hidden_layers": 8, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                        "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 8, "hidden_size": 1280, "num_heads": 16,
                      "intermediate_size": 3420, "out_hidden_size": 1024, "patch_size": 14,
                      "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [3, 7], "in_channels": 3},
}

BOI, EOI, SOFT = 31988, 31989, 31990
GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": BOI, "eoi_token_index": EOI, "image_token_index": SOFT,
    "mm_tokens_per_image": 256, "torch_dtype": "float32",
    "text_config": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4864,
                    "num_hidden_layers": 8, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 128, "query_pre_attn_scalar": 128,
                    "sliding_window": 1024, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 6, "num_attention_heads": 16, "image_size": 896,
                      "patch_size": 14, "vision_use_head": False},
}
NEWLINES = 31980  # (ids of the runs of 1..4 newlines in the benchmark's tokenizer.json)


def _gemma3_tokenizer(path: str) -> None:
    """A tokenizer.json naming Gemma 3's newline-run tokens (the processor reads them)."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, **{"\n" * k: NEWLINES + k - 1 for k in range(1, 5)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(
        os.path.join(path, "tokenizer.json"))


def _image(size: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


FIRST_MS: dict[str, float] = {}  # the untimed first run of each measurement (compiles)


def _median_ms(fn, iters: int, name: str = "") -> float:
    t0 = time.perf_counter()
    fn(-1)  # (compiles)
    FIRST_MS[name] = (time.perf_counter() - t0) * 1e3
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def siglip_flops(v: dict, text_hidden: int, soft_tokens: int) -> float:
    """FLOPs of one image through SigLIP and Gemma 3's projector: patch embedding, the
    layers' matmuls and full attention over the patches, the projection."""
    h, i = v["hidden_size"], v["intermediate_size"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    matmuls = 2 * n * v["num_hidden_layers"] * (4 * h * h + 2 * h * i)
    attention = 4 * n * n * h * v["num_hidden_layers"]
    embed = 2 * n * 3 * v["patch_size"] ** 2 * h
    return float(matmuls + attention + embed + 2 * soft_tokens * h * text_hidden)


def encoder_flops(v: dict, patches: int) -> float:
    """FLOPs of one image through the tower: patch embedding, the blocks' matmuls and
    attention (within windows, or the whole image in the full blocks), the merger."""
    h, i, n = v["hidden_size"], v["intermediate_size"], patches
    window = (v["window_size"] // v["patch_size"]) ** 2
    full = len(v["fullatt_block_indexes"])
    matmuls = 2 * n * v["depth"] * (4 * h * h + 3 * h * i)
    attention = 4 * n * h * (full * n + (v["depth"] - full) * min(window, n))
    embed = 2 * n * 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * h
    merger = 2 * (n // 4) * (16 * h * h + 4 * h * v["out_hidden_size"])
    return float(matmuls + attention + embed + merger)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--model", choices=("qwen2_5_vl", "gemma3"), default="qwen2_5_vl")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    gemma = args.model == "gemma3"
    if args.output_json is None:
        args.output_json = os.path.join(HERE, "results", "vision_prefill_gemma3_cpu.json"
                                        if gemma else "vision_prefill_cpu.json")
    config = GEMMA3 if gemma else CONFIG
    import jax

    from compare_cpu import _cpu_name

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

    path = os.path.join(tempfile.gettempdir(), f"jaxinfer-vl-bench-{args.model}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if gemma:
        _gemma3_tokenizer(path)
        n_img = config["mm_tokens_per_image"]
    else:
        n_img = Qwen2VLImageProcessor().num_tokens(args.size, args.size)
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=max(512, n_img + 64),
              warmup=False, enable_prefix_caching=False, enable_multiprocessing=False)
    core = llm.llm_engine.engine_core.core
    params = SamplingParams(temperature=0, max_tokens=1)
    text = list(range(100, 116))
    # (Gemma 3: <start_of_image> alone; it becomes \n\n, boi, the soft tokens, eoi, \n\n)
    prompt = text + ([BOI] if gemma else [V_START, IMAGE, V_END]) + text

    def request(image) -> None:
        llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}],
                     params, use_tqdm=False)

    # one image through the tower alone
    proc = core.runner.mm
    from jaxinfer.multimodal.inputs import MultiModalProcessor

    mmp = MultiModalProcessor(llm.llm_engine.resolved.model_config, path)
    _, (feat,) = mmp.process([BOI if gemma else IMAGE], [_image(args.size, 0)])
    encoder_ms = _median_ms(lambda i: proc.encode(feat, core.runner.state.params), args.iters,
                            "encoder")
    runs0 = proc.num_encoder_runs
    miss_ms = _median_ms(lambda i: request(_image(args.size, 1000 + i)), args.iters,
                         "request_image")
    same = _image(args.size, 7)
    request(same)
    runs1 = proc.num_encoder_runs
    hit_ms = _median_ms(lambda i: request(same), args.iters, "request_hit")
    assert proc.num_encoder_runs == runs1, "the same image was encoded again"
    n_prompt = len(mmp.expand(prompt, [same]))
    text_ms = _median_ms(lambda i: llm.generate([{"prompt_token_ids": [5 + (i % 7)] * n_prompt}],
                                                params, use_tqdm=False), args.iters,
                         "request_text")
    flops = (siglip_flops(config["vision_config"], config["text_config"]["hidden_size"], n_img)
             if gemma else encoder_flops(config["vision_config"], n_img * 4))
    result = {
        "benchmark": "vision_prefill", "model": config, "image_pixels": [args.size] * 2,
        "image_tokens": n_img, "prompt_tokens": n_prompt,
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/vision_prefill.py --iters "
                   f"{args.iters} --size {args.size}"
                   + (" --model gemma3" if gemma else ""),
        "encoder_ms": encoder_ms,
        "encoder_gflop": flops / 1e9,
        "encoder_gflop_per_s": flops / encoder_ms / 1e6,
        "request_ms": {"image_miss": miss_ms, "image_hit": hit_ms, "text_only": text_ms},
        "encoder_runs_during_miss_runs": proc.num_encoder_runs - runs0,
        # the first run of each (not in the medians): the encoder's compile for this image
        # size; the first request with an image: the steps' image variant compiled
        "first_run_ms": dict(FIRST_MS),
        "encoder_compiled_patch_sizes": sorted(proc.compiled_sizes),
        "hit_saves": 1 - hit_ms / miss_ms,
        "environment": {"jax": jax.__version__, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "cpu": _cpu_name(),
                        "step_compilation": core.runner.step_compilation},
    }
    llm.shutdown()
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"image {args.size}x{args.size} ({n_img} tokens), prompt {n_prompt} tokens:")
    print(f"  encoder alone        {encoder_ms:8.1f} ms ({result['encoder_gflop']:.0f} GFLOP: "
          f"{result['encoder_gflop_per_s']:.0f} GFLOP/s)")
    print(f"  request, new image   {miss_ms:8.1f} ms")
    print(f"  request, cached image{hit_ms:8.1f} ms  ({result['hit_saves']:.0%} saved)")
    print(f"  request, text only   {text_ms:8.1f} ms")


if __name__ == "__main__":
    main()

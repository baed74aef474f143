"""Benchmark workloads: random, ShareGPT files, a seeded ShareGPT-like synthetic, presets, and
random-mm (vLLM's: random text with random images, for chat endpoints)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    # Chat workloads (random-mm): the user message's text and its images (encoded JPEG
    # bytes, sent as data: URLs); prompt_token_ids is then empty.
    text: str | None = None
    images: tuple[bytes, ...] = ()


def random_requests(n: int, input_len: int, output_len: int, *, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    prefix_len: int = 0) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - r), len * (1 + r)], random token ids (as vLLM's random);
    prefix_len: that many tokens shared by every prompt, in front of its own input_len ones
    (vLLM's --random-prefix-len: the part a prefix cache can hit)."""
    rng = random.Random(seed)
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    prefix = [rng.randrange(10, vocab_size) for _ in range(prefix_len)]

    def pick(n_):
        lo, hi = max(1, int(n_ * (1 - range_ratio))), max(1, int(n_ * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [BenchRequest(prefix + [rng.randrange(10, vocab_size)
                                   for _ in range(pick(input_len))],
                         pick(output_len)) for _ in range(n)]


def nano_vllm_requests(n: int = 256, *, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """nano-vllm's bench: input and output lengths uniform in 100..1024 (used with ignore_eos)."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(10, vocab_size) for _ in range(rng.randint(100, 1024))],
                         rng.randint(100, 1024)) for _ in range(n)]


def synthetic_sharegpt_requests(n: int, *, vocab_size: int, seed: int = 0,
                                max_len: int = 2048) -> list[BenchRequest]:
    """Lognormal lengths shaped like ShareGPT's (median prompt ~120 tokens, output ~200), for
    machines that cannot download the dataset."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = int(rng.lognormvariate(4.8, 1.0))
        o = int(rng.lognormvariate(5.3, 0.8))
        if 4 <= p and 4 <= o and p + o <= max_len:
            out.append(BenchRequest([rng.randrange(10, vocab_size) for _ in range(p)], o))
    return out


def sharegpt_requests(path: str, n: int, tokenizer, *, seed: int = 0,
                      max_len: int = 2048) -> list[BenchRequest]:
    """First human turn as prompt, the reply's token count as output length (vLLM's rule)."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt = tokenizer.encode(turns[0]["value"])
        completion = tokenizer.encode(turns[1]["value"])
        if len(prompt) < 4 or len(completion) < 4 or len(prompt) + len(completion) > max_len:
            continue
        out.append(BenchRequest(prompt, len(completion)))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"{path} yielded only {len(out)} usable conversations, asked for {n}")
    return out


# vLLM's default --random-mm-bucket-config: (height, width, frames) -> probability
DEFAULT_MM_BUCKETS = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5}
_WORDS = ("the", "of", "image", "light", "river", "stone", "cloud", "red", "blue", "small",
          "large", "city", "tree", "window", "road", "quiet", "bright", "north", "old", "new")


def parse_mm_buckets(value) -> dict[tuple[int, int, int], float]:
    """--random-mm-bucket-config: vLLM's Python-literal dict '{(256, 256, 1): 0.5, ...}' (or
    its JSON form '{"256x256": 0.5}'); images only (frames 1); probabilities normalised."""
    import ast

    if not value:
        return dict(DEFAULT_MM_BUCKETS)
    try:
        raw = ast.literal_eval(value) if isinstance(value, str) else value
    except (ValueError, SyntaxError):
        raise ValueError(f"--random-mm-bucket-config {value!r}: expected e.g. "
                         "'{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}'") from None
    out = {}
    for k, p in dict(raw).items():
        if isinstance(k, str):
            h, _, w = k.partition("x")
            k = (int(h), int(w), 1)
        h, w, t = (int(x) for x in k)
        if t != 1 or h < 1 or w < 1 or float(p) < 0:
            raise ValueError(f"--random-mm-bucket-config: bad bucket {k}: {p} (images: "
                             "frames 1, positive sizes, probability >= 0)")
        out[(h, w, t)] = float(p)
    total = sum(out.values())
    if not out or total <= 0:
        raise ValueError("--random-mm-bucket-config needs a bucket with probability > 0")
    return {k: p / total for k, p in out.items()}


def random_mm_requests(n: int, input_len: int, output_len: int, *, base_items: int = 1,
                       items_range_ratio: float = 0.0, limit: int = 255, buckets=None,
                       range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """vLLM's random-mm: per request, about input_len words of random text and
    base_items x (1 +- items_range_ratio) random images (at most `limit`), each of a size
    drawn from the buckets, as JPEG."""
    import io

    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    buckets = parse_mm_buckets(buckets)
    sizes, probs = list(buckets), list(buckets.values())
    cache: dict[tuple, bytes] = {}

    def pick(n_, r):
        lo, hi = max(0, int(n_ * (1 - r))), max(0, int(n_ * (1 + r)))
        return rng.randint(lo, hi)

    def image(h, w, k) -> bytes:  # (a few distinct images per size: encoding is the cost)
        key = (h, w, k)
        if key not in cache:
            buf = io.BytesIO()
            Image.fromarray(nprng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                buf, format="JPEG", quality=85)
            cache[key] = buf.getvalue()
        return cache[key]

    out = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(max(1, pick(input_len,
                                                                       range_ratio))))
        k = min(limit, pick(base_items, items_range_ratio))
        imgs = []
        for _ in range(k):
            h, w, _t = rng.choices(sizes, probs)[0]
            imgs.append(image(h, w, rng.randrange(1 << 30)))
        out.append(BenchRequest([], max(1, pick(output_len, range_ratio)), text=words,
                                images=tuple(imgs)))
    return out


def load_requests(args, tokenizer, vocab_size: int) -> list[BenchRequest]:
    ds = args.dataset
    if ds == "random-mm":
        return random_mm_requests(
            args.num_prompts, args.input_len, args.output_len,
            base_items=args.random_mm_base_items_per_request,
            items_range_ratio=args.random_mm_num_mm_items_range_ratio,
            limit=args.random_mm_limit_mm_per_prompt, buckets=args.random_mm_bucket_config,
            range_ratio=args.random_range_ratio, seed=args.seed)
    if ds == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len,
                               vocab_size=vocab_size, range_ratio=args.random_range_ratio,
                               seed=args.seed,
                               prefix_len=getattr(args, "random_prefix_len", 0) or 0)
    if ds == "nano-vllm":
        return nano_vllm_requests(args.num_prompts, vocab_size=vocab_size, seed=args.seed)
    if ds == "synthetic-sharegpt":
        return synthetic_sharegpt_requests(args.num_prompts, vocab_size=vocab_size,
                                           seed=args.seed)
    if ds == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, seed=args.seed)
    raise ValueError(f"unknown dataset {ds!r}")


DATASETS = ("random", "sharegpt", "synthetic-sharegpt", "nano-vllm", "random-mm")


def add_dataset_args(p, *, num_prompts: int, input_len: int, output_len: int) -> None:
    """The workload options shared by throughput, serve and the baselines."""
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON for --dataset sharegpt")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens shared by every prompt, before its --input-len own")
    p.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="random-mm: images per request (bench serve: the chat endpoint)")
    p.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request vary by this ratio")
    p.add_argument("--random-mm-limit-mm-per-prompt", type=int, default=255,
                   help="random-mm: at most this many images per request")
    p.add_argument("--random-mm-bucket-config", default=None,
                   help="random-mm: image sizes and their probabilities, e.g. "
                        "'{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}' (vLLM's default)")

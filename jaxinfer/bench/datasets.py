"""Benchmark workloads: random, ShareGPT files, a seeded ShareGPT-like synthetic, presets."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


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


def load_requests(args, tokenizer, vocab_size: int) -> list[BenchRequest]:
    ds = args.dataset
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


DATASETS = ("random", "sharegpt", "synthetic-sharegpt", "nano-vllm")


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

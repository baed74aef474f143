"""Block sizes for the Pallas kernels, per (head_dim, block_size, dtype) and step size.

One entry is timed on a GPU: (128, 16, bfloat16, decode), from `benchmarks/kernels.py --sweep`
on an H200 (2026-11-26, benchmarks/results/gpu_h200/kernels_sweep_partial_nvidia_h200.log;
10 of the 12 decode candidates timed before the run's time cap): 16 rows x 32 KV tokens at 4 warps
had the lowest geometric mean over the sweep's 5 decode cases, 0.544 ms, against 0.737 ms for the
compile-statistics pick (32, 64, 4) it replaces; every 16-row candidate beat every 32-row one.
The others are NOT timed on a GPU yet. The bfloat16 entries come from
a compile-only sweep for Hopper (`python -m pallas_kernels.compile_report --sweep`: Triton ->
ptxas for sm_90a on a CPU machine; results in benchmarks/results/triton_compile_sweep_sm90.json):
every entry compiles without register spills, and among those the pick maximises K/V bytes
buffered per SM (decode, bandwidth bound) or query rows resident per SM (prefill). The original
rule-of-thumb entries spilled for head_dim 128 (decode at 4 warps, prefill 64x64 at 4 warps).
`benchmarks/kernels.py --sweep` times the same candidates on a GPU: its picks replace these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionTuning:
    block_m: int  # query rows per program (tokens x padded GQA group), >= 16
    kv_tokens_per_iter: int  # KV tokens per inner-loop iteration (whole pages)
    num_warps: int
    num_stages: int


_T = AttentionTuning
_TABLE: dict[tuple[int, int, str, str], AttentionTuning] = {
    # (head_dim, block_size, dtype, regime) -> (block_m, kv_tokens_per_iter, warps, stages);
    # regime: "decode" (T <= 256 tokens in the step) or "prefill"
    (64, 16, "bfloat16", "decode"): _T(16, 128, 4, 2),
    (64, 16, "bfloat16", "prefill"): _T(128, 32, 4, 2),
    (64, 32, "bfloat16", "decode"): _T(16, 64, 4, 2),
    (64, 32, "bfloat16", "prefill"): _T(128, 32, 4, 2),
    (80, 16, "bfloat16", "decode"): _T(32, 128, 4, 2),
    (80, 16, "bfloat16", "prefill"): _T(64, 32, 4, 2),
    (96, 16, "bfloat16", "decode"): _T(16, 64, 4, 2),
    (96, 16, "bfloat16", "prefill"): _T(128, 64, 8, 2),
    (128, 16, "bfloat16", "decode"): _T(16, 32, 4, 2),  # timed on an H200 (docstring)
    (128, 16, "bfloat16", "prefill"): _T(128, 64, 8, 2),
    (128, 32, "bfloat16", "decode"): _T(32, 64, 4, 2),
    (128, 32, "bfloat16", "prefill"): _T(128, 64, 8, 2),
}
# Anything else: spill-free at head_dim 128 for bfloat16 (so also for smaller heads).
_DEFAULT = {"decode": _T(16, 32, 4, 2), "prefill": _T(64, 32, 4, 2)}
# float32 (a correctness dtype: 3-pass TF32 dots) needs small tiles to stay spill-free.
_DEFAULT_F32 = _T(16, 32, 4, 2)


def attention_tuning(head_dim: int, block_size: int, dtype: str, num_tokens: int,
                     override: AttentionTuning | None = None) -> AttentionTuning:
    """The table's entry for this shape (or `override`), with KV tokens per iteration rounded
    down to whole pages."""
    regime = "decode" if num_tokens <= 256 else "prefill"
    default = _DEFAULT_F32 if dtype == "float32" else _DEFAULT[regime]
    t = override or _TABLE.get((head_dim, block_size, dtype, regime), default)
    if t.block_m < 16 or t.block_m & (t.block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {t.block_m}")
    if t.kv_tokens_per_iter & (t.kv_tokens_per_iter - 1):
        raise ValueError(f"kv_tokens_per_iter must be a power of two, got {t.kv_tokens_per_iter}")
    # Whole pages per iteration, at least one (both powers of two, so pages is one too).
    return dataclasses.replace(t, kv_tokens_per_iter=max(block_size, t.kv_tokens_per_iter))


# H100 and H200 both have 132 SMs; two resident programs per SM is the fill target.
TARGET_PROGRAMS = 2 * 132
MIN_KV_PER_SPLIT = 1024
MAX_SPLITS = 8


def num_kv_splits(num_programs: int, max_kv_len: int) -> int:
    """Flash-decoding: when the step has too few programs to fill the GPU (few sequences at
    decode), split each sequence's KV range over more programs, merged afterwards.

    num_programs: an upper bound on the programs that have work (tiles with tokens x KV
    heads); max_kv_len: the longest KV the block table can hold. Each split covers 1/n of the
    sequence's actual KV, and a split is only worth its merge when it can get
    MIN_KV_PER_SPLIT tokens at the longest context."""
    if num_programs >= TARGET_PROGRAMS:
        return 1
    by_fill = -(-TARGET_PROGRAMS // max(num_programs, 1))
    return max(1, min(MAX_SPLITS, by_fill, max_kv_len // MIN_KV_PER_SPLIT))

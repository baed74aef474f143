"""Block sizes for the Pallas kernels, per (head_dim, block_size, dtype) and step size.

These are starting points chosen from Triton/Hopper rules of thumb (MMA tiles of >= 16 rows,
64-token KV chunks, 4 warps); they have NOT been tuned on a GPU yet (no GPU in the session that
wrote them). `benchmarks/kernels.py` is where they get measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionTuning:
    block_m: int  # query rows per program (tokens x padded GQA group), >= 16
    kv_tokens_per_iter: int  # KV tokens per inner-loop iteration (whole pages)
    num_warps: int
    num_stages: int


_TABLE: dict[tuple[int, int, str, str], AttentionTuning] = {
    # (head_dim, block_size, dtype, regime) -> tuning; regime: "decode" (small T) or "prefill"
    (64, 16, "bfloat16", "decode"): AttentionTuning(16, 64, 4, 2),
    (64, 16, "bfloat16", "prefill"): AttentionTuning(64, 64, 4, 2),
    (128, 16, "bfloat16", "decode"): AttentionTuning(16, 64, 4, 2),
    (128, 16, "bfloat16", "prefill"): AttentionTuning(64, 64, 4, 2),
    (64, 32, "bfloat16", "decode"): AttentionTuning(16, 64, 4, 2),
    (64, 32, "bfloat16", "prefill"): AttentionTuning(64, 64, 4, 2),
    (128, 32, "bfloat16", "decode"): AttentionTuning(16, 64, 4, 2),
    (128, 32, "bfloat16", "prefill"): AttentionTuning(64, 64, 4, 2),
}
_DEFAULT = {"decode": AttentionTuning(16, 64, 4, 2), "prefill": AttentionTuning(32, 32, 4, 1)}


def attention_tuning(head_dim: int, block_size: int, dtype: str, num_tokens: int
                     ) -> AttentionTuning:
    regime = "decode" if num_tokens <= 256 else "prefill"
    t = _TABLE.get((head_dim, block_size, dtype, regime), _DEFAULT[regime])
    # Whole pages per iteration, at least one.
    kv = max(block_size, (t.kv_tokens_per_iter // block_size) * block_size)
    return AttentionTuning(t.block_m, kv, t.num_warps, t.num_stages)


def num_kv_splits(num_tokens: int, max_kv_len: int) -> int:
    """Flash-decoding: split long KV over several programs when the step has few queries."""
    if num_tokens > 64 or max_kv_len < 4096:
        return 1
    return min(8, max_kv_len // 2048)

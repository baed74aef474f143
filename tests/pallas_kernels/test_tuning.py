"""The tuning table, the split-KV choice, and (where `triton` is installed) a Hopper compile of
every shipped kernel configuration with ptxas' resource report."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from pallas_kernels.tuning import (
    _TABLE,
    MAX_SPLITS,
    TARGET_PROGRAMS,
    AttentionTuning,
    attention_tuning,
    num_kv_splits,
)


def test_split_kv_fills_the_gpu_only_when_needed():
    # Llama-3-8B decode: 8 KV heads. 64 sequences -> 512 programs: enough, no split.
    assert num_kv_splits(64 * 8, 32768) == 1
    # One sequence at 32k: 8 programs -> as many splits as allowed.
    assert num_kv_splits(1 * 8, 32768) == MAX_SPLITS
    # 8 sequences at 16k: 64 programs -> ceil(264 / 64) = 5 splits.
    assert num_kv_splits(8 * 8, 16384) == -(-TARGET_PROGRAMS // 64) == 5
    # Short contexts are not worth a merge: at most one split per 1024 tokens.
    assert num_kv_splits(8, 512) == 1
    assert num_kv_splits(8, 2048) == 2


def test_tuning_lookup_and_validation():
    t = attention_tuning(128, 16, "bfloat16", 8)
    assert t == _TABLE[(128, 16, "bfloat16", "decode")]
    assert attention_tuning(128, 16, "bfloat16", 4096) == _TABLE[(128, 16, "bfloat16", "prefill")]
    # KV tokens per iteration are at least one page.
    assert attention_tuning(64, 32, "float32", 8, AttentionTuning(16, 16, 4, 2)).kv_tokens_per_iter == 32
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
        attention_tuning(64, 16, "bfloat16", 8, AttentionTuning(24, 64, 4, 2))
    with pytest.raises(ValueError, match="kv_tokens_per_iter must be a power of two, got 48"):
        attention_tuning(64, 16, "bfloat16", 8, AttentionTuning(16, 48, 4, 2))


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the triton package (a torch dependency) is not installed")


def _shipped_bf16():
    from pallas_kernels.compile_report import shipped_shapes

    return [s for s in shipped_shapes() if s.dtype == "bfloat16" and s.block_size == 16]


@needs_triton
@pytest.mark.parametrize("shape", _shipped_bf16(), ids=lambda s: s.name)
def test_shipped_configs_compile_for_hopper_without_spills(shape):
    """Triton compiles the lowered kernel for sm_90a; ptxas reports no register spills, the
    shared memory fits an SM, and K/V tiles arrive by 16-byte cp.async (pipelined loads)."""
    from pallas_kernels.compile_report import SM90, compile_report

    row = compile_report(shape)
    assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row
    assert 0 < row["shared_bytes"] <= SM90["max_smem_per_block"], row
    assert row["blocks_per_sm"] >= 1
    assert row["cp_async_16B"] > 0, row
    assert row["mma"], row  # the dots became tensor-core instructions


@needs_triton
def test_compile_report_sees_spills():
    """The check above can fail: a tile too large for 4 warps' registers spills."""
    from pallas_kernels.compile_report import compile_report, shipped_shapes

    shape = next(s for s in shipped_shapes() if s.name == "prefill-d128-bs16-bfloat16")
    row = compile_report(dataclasses.replace(shape, tuning=AttentionTuning(128, 64, 4, 2)))
    assert row["spill_store_bytes"] > 0

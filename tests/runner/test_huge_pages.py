"""Huge pages for a CPU engine's weights (runner/huge_pages.py)."""

from __future__ import annotations

import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runner import huge_pages
from jaxinfer.runner.huge_pages import HUGE

def _collapse_supported() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages on."""
    if not sys.platform.startswith("linux") or huge_pages.thp_mode() not in ("always",
                                                                             "madvise"):
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


thp = pytest.mark.skipif(not _collapse_supported(),
                         reason="needs Linux 6.1+ with transparent huge pages on")


def test_spans_round_weights_outwards_within_their_mapping():
    maps = [(10 * HUGE, 20 * HUGE), (30 * HUGE + 4096, 31 * HUGE),
            (40 * HUGE, 41 * HUGE + 8192), (41 * HUGE + 8192, 45 * HUGE + 4096)]
    buffers = [(11 * HUGE + 100, 1000),  # inside one huge page
               (11 * HUGE + 5000, HUGE),  # over two: joins the first
               (15 * HUGE - 8, 16),  # straddles a boundary
               (30 * HUGE + 8192, 4096),  # a mapping that starts and ends unaligned
               (25 * HUGE, HUGE),  # outside every mapping: left out
               (12 * HUGE, 0),  # empty
               # over two adjacent mappings (an earlier madvise splits one): clipped to the
               # second's end, not the first's
               (40 * HUGE + 4096, 3 * HUGE)]
    assert huge_pages.outer_spans(buffers, maps) == [
        (11 * HUGE, 13 * HUGE), (14 * HUGE, 16 * HUGE), (30 * HUGE + 4096, 31 * HUGE),
        (40 * HUGE, 44 * HUGE)]


def test_the_switch_takes_0_or_1():
    with pytest.raises(ValueError, match="JAXINFER_CPU_HUGE_PAGES='yes'"):
        huge_pages.huge_pages_enabled({"JAXINFER_CPU_HUGE_PAGES": "yes"})
    with pytest.raises(ValueError, match="JAXINFER_CPU_HUGE_PAGES='2'"):  # (GPU engines too)
        huge_pages.huge_pages_enabled({"JAXINFER_CPU_HUGE_PAGES": "2"}, cpu=False)
    assert huge_pages.huge_pages_enabled({}, cpu=False) is False
    assert huge_pages.huge_pages_enabled({"JAXINFER_CPU_HUGE_PAGES": "0"}) is False


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@thp
def test_weights_keep_their_values_on_huge_pages():
    w = jnp.arange(3 * HUGE // 4, dtype=jnp.float32) * 0.5  # 6 MiB
    small = jnp.full((1000,), 7.0)  # a weight under 2 MiB, likely sharing a page
    jax.block_until_ready((w, small))
    done = huge_pages.back_with_huge_pages({"w": w, "s": small})
    # (best effort: under memory pressure a page may not collapse now, so not all of them)
    assert done["advised_bytes"] >= 3 * HUGE and done["collapsed_bytes"] >= HUGE
    assert _huge_kib(w.unsafe_buffer_pointer()) >= 2048
    np.testing.assert_array_equal(np.asarray(w), np.arange(3 * HUGE // 4, dtype=np.float32) * 0.5)
    np.testing.assert_array_equal(np.asarray(small), np.full((1000,), 7.0, np.float32))
    assert huge_pages.back_with_huge_pages([]) == {"advised_bytes": 0, "collapsed_bytes": 0}


@thp
def test_an_engine_holds_its_weights_on_huge_pages_and_decodes_as_without(smollm2_dir,
                                                                           monkeypatch):
    from jaxinfer import LLM, SamplingParams

    def run(pages: str):
        monkeypatch.setenv("JAXINFER_CPU_HUGE_PAGES", pages)
        llm = LLM(smollm2_dir, dtype="bfloat16", enable_multiprocessing=False, warmup=False,
                  max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                  num_kv_blocks=64, block_size=16, compilation_cache_dir="")
        try:
            core = llm.llm_engine.engine_core.core
            assert core.worker.huge_pages == (pages == "1")
            if pages == "1":
                assert core.startup["huge_pages_s"] < 5
                big = max(jax.tree.leaves(core.runner.params), key=lambda x: x.nbytes)
                assert big.nbytes > 4 * HUGE and _huge_kib(big.unsafe_buffer_pointer()) >= 2048

            def tokens():
                outs = llm.generate([{"prompt_token_ids": list(range(100 + i, 140 + 7 * i))}
                                     for i in range(3)],
                                    SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
                return [o.outputs[0].token_ids for o in outs]

            before = tokens()
            if pages == "1":  # an update with fresh arrays (a trainer's): collapsed behind
                fresh = {k: v * 1.0 for k, v in llm.collective_rpc("engine_weights")[0].items()}
                llm.update_weights(fresh, layout="engine")
                thread = core.worker.weights.huge_pages_thread
                thread.join(60)
                assert thread.done["collapsed_bytes"] >= HUGE
                big = max(fresh.values(), key=lambda x: x.nbytes)
                assert _huge_kib(big.unsafe_buffer_pointer()) >= 2048
                assert tokens() == before
            return before
        finally:
            llm.shutdown()

    assert run("1") == run("0")

"""Async scheduling left unset (async_scheduling=None) is on, as vLLM has it on GPUs (on CPUs
too, where vLLM's CPU build turns it off: measured faster here, docs/benchmarks.md), and off
with what it does not combine with (speculative decoding, pipeline parallelism) or for
pooling; an explicit True with those is refused by name; the flags say both."""

from __future__ import annotations

import os

import pytest

from jaxinfer.config import EngineConfig, resolve_config
from jaxinfer.config.cli import engine_config_from_args
from jaxinfer.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "benchmarks", "configs", "tiny-llama")  # (a config.json only)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def _resolved(**kw) -> bool | None:
    return resolve_config(EngineConfig(model=TINY, skip_tokenizer_init=True, **kw)
                          ).engine.async_scheduling


def test_on_unless_off_asked_or_with_what_it_does_not_combine_with():
    assert EngineConfig().async_scheduling is None
    assert _resolved() is True
    assert _resolved(async_scheduling=False) is False
    assert _resolved(async_scheduling=True) is True
    assert _resolved(speculative_config=NGRAM) is False
    assert _resolved(pipeline_parallel_size=2) is False
    assert _resolved(runner="pooling") is False
    assert _resolved(runner="pooling", async_scheduling=True) is True  # (asked for: honoured)


def test_the_core_on_cpu_dispatches_ahead_unless_asked_not_to():
    from jaxinfer.engine.core import EngineCore

    for asked, depth in ((None, 2), (True, 2), (False, 1)):
        cfg = EngineConfig(model=TINY, load_format="dummy", skip_tokenizer_init=True,
                           dtype="float32", max_model_len=64, max_num_seqs=2, warmup=False,
                           num_kv_blocks=16, async_scheduling=asked, compilation_cache_dir="",
                           enable_multiprocessing=False)
        core = EngineCore(resolve_config(cfg))
        try:
            assert (core.async_scheduling, core.max_in_flight) == (depth == 2, depth)
        finally:
            core.shutdown()


@pytest.mark.parametrize("other", [dict(speculative_config=NGRAM),
                                   dict(pipeline_parallel_size=2)])
def test_asked_for_with_what_it_does_not_combine_with_is_refused(other):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=TINY, async_scheduling=True, **other)


def test_flags():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve"])).async_scheduling is None
    assert engine_config_from_args(parse(["serve", "--async-scheduling"])).async_scheduling
    assert engine_config_from_args(
        parse(["serve", "--no-async-scheduling"])).async_scheduling is False

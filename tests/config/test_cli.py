"""config/cli.py: every EngineConfig field is a flag of `jaxinfer generate`, `serve` and the
offline benchmarks, generated from the dataclass; flags read back into the EngineConfig they
describe, and a config's options written as flags parse back to the same config."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.config.cli import engine_config_from_args, engine_flags
from jaxinfer.entrypoints.cli import build_parser

FIELDS = [f.name for f in dataclasses.fields(EngineConfig) if f.init]


def _dests(argv_prefix: list[str]) -> set[str]:
    """The dests of the subcommand's parser (found by parsing its bare invocation)."""
    return set(vars(build_parser().parse_args(argv_prefix)))


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "latency"],
                                     ["bench", "throughput"], ["bench", "startup"]])
def test_every_engine_field_is_a_flag(command):
    missing = set(FIELDS) - _dests(command)
    if command == ["bench", "startup"]:  # (its own --compilation-cache-dir: the cold runs')
        missing.discard("compilation_cache_dir")
    assert not missing, f"{command}: no flag for {sorted(missing)}"


def test_flags_read_back_into_the_config_and_out_again():
    argv = ["serve", "m", "-tp", "2", "--max-num-seqs", "5", "--no-enable-prefix-caching",
            "--no-warmup", "--num-gpu-blocks-override", "77", "-q", "int8",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--kv-cache-dtype", "fp8", "--step-compilation", "whole", "--seed", "9"]
    args = build_parser().parse_args(argv)
    cfg = engine_config_from_args(args)
    assert (cfg.model, cfg.tensor_parallel_size, cfg.max_num_seqs, cfg.num_kv_blocks) == \
        ("m", 2, 5, 77)
    assert not cfg.enable_prefix_caching and not cfg.warmup and cfg.quantization == "int8"
    assert cfg.speculative_config.num_speculative_tokens == 3
    assert (cfg.kv_cache_dtype, cfg.step_compilation, cfg.seed) == ("fp8", "whole", 9)
    # written as flags again (what a benchmark passes to `jaxinfer serve`): the same config
    again = build_parser().parse_args(["serve", "m", *engine_flags(args)])
    assert engine_config_from_args(again) == cfg
    # defaults: EngineConfig's, except what a command sets for itself
    assert engine_config_from_args(build_parser().parse_args(["serve"])) == EngineConfig()
    gen = engine_config_from_args(build_parser().parse_args(["generate"]))
    assert (gen.max_model_len, gen.max_num_seqs, gen.seed) == (1024, 8, EngineConfig.seed)


def test_bad_values_are_refused_by_name():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1, 2]"])
    args = build_parser().parse_args(["serve", "--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(args)

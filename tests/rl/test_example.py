"""examples/rl_rollouts.py runs as a real loop on a tiny model: the trainer's pure-jnp forward
agrees with the engine's log-probabilities, each iteration's samples come from the weights
the previous one pushed."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.engine.conftest import make_tiny_model_dir

pytest.importorskip("optax")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rl_rollouts_example_loop(tmp_path, smollm2_dir):
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir)
    spec = importlib.util.spec_from_file_location(
        "rl_rollouts", os.path.join(ROOT, "examples", "rl_rollouts.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    got = example.main(str(tmp_path), iterations=3, samples=2, max_tokens=8, lr=1e-3,
                       engine_options=dict(max_num_seqs=16, num_kv_blocks=64, warmup=False,
                                           compilation_cache_dir=""))
    assert len(got["rewards"]) == 3
    assert got["logprob_max_diff"] < 1e-3
    assert got["versions"] == [["default"], ["iter-1"], ["iter-2"]]

"""Pipeline parallelism: the layer partition (vLLM's get_pp_indices, with its override), the
scheduler's batch queue (no request in two batches in flight, none preempted while in one),
and real runs on fake CPU devices: PP=2, PP=3, PP=2 x TP=2 and an uneven override give PP=1's
greedy tokens (logprobs within float32 noise) through preemption and chunked prefill, with
each stage's weights and KV cache on its own devices, P batches in flight and no block left."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.config.parallel import get_pp_partition, stage_bounds
from jaxinfer.pipeline import stage_devices
from tests.core.fake import FakeRunner, make_request, make_scheduler
from tests.engine.conftest import make_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def vllm_pp_indices(num_layers, rank, size):
    """vLLM's get_pp_indices (vllm/distributed/utils.py), without the env override."""
    per = num_layers // size
    parts = [per] * size
    for i in range(2, num_layers % size + 2):
        parts[-i] += 1
    start = sum(parts[:rank])
    return start, start + parts[rank]


def test_partition_matches_vllm_and_covers_every_layer_once(monkeypatch):
    monkeypatch.delenv("JAXINFER_PP_LAYER_PARTITION", raising=False)
    for layers in range(1, 40):
        for pp in range(1, min(layers, 8) + 1):
            parts = get_pp_partition(layers, pp)
            bounds = stage_bounds(parts)
            assert bounds == [vllm_pp_indices(layers, r, pp) for r in range(pp)]
            assert [i for a, b in bounds for i in range(a, b)] == list(range(layers))
    assert get_pp_partition(30, 2) == [15, 15] and get_pp_partition(30, 4) == [7, 8, 8, 7]
    assert get_pp_partition(5, 2, "4,1") == [4, 1]
    monkeypatch.setenv("JAXINFER_PP_LAYER_PARTITION", "1,3,1")
    assert get_pp_partition(5, 3) == [1, 3, 1]


@pytest.mark.parametrize("layers,pp,override,match", [
    (2, 3, None, "pipeline_parallel_size=3 exceeds the model's 2 layers"),
    (5, 2, "4,2", "sum to the model's 5 layers"),
    (5, 2, "5", "has 1 stages, pipeline_parallel_size is 2"),
    (5, 2, "5,0", ">= 1"),
    (5, 2, "a,b", "comma-separated"),
])
def test_partition_errors_name_the_numbers(layers, pp, override, match, monkeypatch):
    monkeypatch.delenv("JAXINFER_PP_LAYER_PARTITION", raising=False)
    with pytest.raises(ValueError, match=match):
        get_pp_partition(layers, pp, override)


def test_devices_short_is_named():
    import jax

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 x tensor_parallel_size=2 "
                                         r"needs 4 devices, 1 cpu"):
        stage_devices(2, 2, jax.devices()[:1])


def test_scheduler_batch_queue_keeps_batches_disjoint():
    """Random arrivals, P = 3 batches in flight, outputs applied oldest first: no request is
    ever in two batches in flight, none is preempted while in one, all finish, no block left."""
    rng = random.Random(0)
    s = make_scheduler(num_blocks=14, block_size=4, max_model_len=40,
                       max_num_batched_tokens=12, max_num_seqs=6)
    s.pipeline_depth = 3
    runner = FakeRunner()
    queue, n_added, max_depth = [], 0, 0
    for step in range(2000):
        if n_added < 30 and rng.random() < 0.5:
            s.add_request(make_request(f"r{n_added}", range(100 * n_added,
                                                            100 * n_added + rng.randint(2, 15)),
                                       max_tokens=rng.randint(1, 12)))
            n_added += 1
        if len(queue) < 3 and s.has_schedulable_requests():
            so = s.schedule()
            in_queue = {r for q, _ in queue for r in q.num_scheduled_tokens}
            assert not in_queue & set(so.num_scheduled_tokens)
            assert not in_queue & so.preempted_req_ids
            if so.num_scheduled_tokens or so.preempted_req_ids or so.finished_req_ids:
                queue.append((so, runner.execute(so)))
                max_depth = max(max_depth, len(queue))
                if len(queue) < 3:
                    continue
        if queue:
            so, ro = queue.pop(0)
            s.update_from_output(so, ro)
        elif n_added == 30 and not s.has_unfinished_requests():
            break
    assert n_added == 30 and not s.has_unfinished_requests() and not s.in_flight
    assert max_depth == 3 and s.num_preemptions > 0
    assert s.kv.get_num_free_blocks() == 13


def run_pp(model_dir, pp, tp=1, partition="-", mode="tiny", devices=4,
           step_compilation="auto", expert_parallel=False, quantization=""):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "PP_STEP_COMPILATION": step_compilation,
           "PP_EXPERT_PARALLEL": "1" if expert_parallel else "0",
           "PP_QUANTIZATION": quantization}
    env.pop("JAXINFER_PP_LAYER_PARTITION", None)
    out = subprocess.run([sys.executable, "tests/parallel/pp_worker.py", model_dir, str(pp),
                          str(tp), partition, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same(got, base):
    assert got["tokens"] == base["tokens"]
    np.testing.assert_allclose(np.concatenate(got["logprobs"]),
                               np.concatenate(base["logprobs"]), atol=2e-4)
    assert not got["leaked"] and not got["overlap"]
    assert got["num_preemptions"] > 0


_PP_CASES = {"ci": ((2, 1, "-", [3, 2]), (2, 2, "-", [3, 2])),
             "slow": ((3, 1, "-", [2, 2, 1]), (2, 1, "4,1", [4, 1]))}


@pytest.mark.parametrize("cases", [
    "ci", pytest.param("slow", marks=pytest.mark.slow)])  # (suite time: PP=3 and 4+1 slow)
def test_pp_matches_single_stage(tmp_path, smollm2_dir, cases):
    """(The stages compile layer-wise, the CPU default; the reference compiles whole steps.)"""
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, num_hidden_layers=5)
    base = run_pp(str(tmp_path), 1, step_compilation="whole")
    assert base["num_preemptions"] > 0 and not base["leaked"]
    assert base["step_compilation"] == "whole"
    for pp, tp, partition, parts in _PP_CASES[cases]:
        got = run_pp(str(tmp_path), pp, tp, partition)
        assert got["step_compilation"] == "layerwise"
        _same(got, base)
        assert got["partition"] == parts and got["max_in_flight"] == pp
        # Each stage on its own devices: weights and KV cache; embedding first, head last.
        want = [sorted(f"cpu:{d}" for d in range(s * tp, (s + 1) * tp)) for s in range(pp)]
        assert got["stage_devices"] == want and got["kv_devices"] == want, got
        assert got["stage_has"][0] == ["embed_tokens"]
        assert got["stage_has"][-1] == ["norm", "tied_embed"]
        assert all(h == [] for h in got["stage_has"][1:-1])


def test_pp_errors_name_the_numbers(tmp_path, smollm2_dir):
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, num_hidden_layers=2)
    got = run_pp(str(tmp_path), 3)
    assert "pipeline_parallel_size=3 exceeds the model's 2 layers" in got["error"]
    got = run_pp(str(tmp_path), 2, 3, devices=6)
    assert "tensor_parallel_size=3 must divide num_attention_heads=4" in got["error"]
    make_tiny_model_dir(tmp_path / "m4", "llama", smollm2_dir, num_hidden_layers=4)
    got = run_pp(str(tmp_path / "m4"), 3, 2)
    assert "pipeline_parallel_size=3 x tensor_parallel_size=2 needs 6 devices, 4 cpu" in \
        got["error"]


@pytest.mark.slow
def test_smollm2_over_two_and_three_stages(smollm2_dir):
    base = run_pp(smollm2_dir, 1, mode="smollm2")
    for pp, parts in ((2, [15, 15]), (3, [10, 10, 10])):
        got = run_pp(smollm2_dir, pp, mode="smollm2")
        # (4 sequences at most over 3 stages: the queue fills when the requests allow it)
        assert got["partition"] == parts and 2 <= got["max_in_flight"] <= pp
        assert got["tokens"] == base["tokens"] and not got["leaked"] and not got["overlap"]
        np.testing.assert_allclose(np.concatenate(got["logprobs"]),
                                   np.concatenate(base["logprobs"]), atol=2e-4)


# (slow: CI keeps test_pp_matches_single_stage[ci] for the pipeline and the tensor-parallel
# two-process test for jax.distributed)
@pytest.mark.slow
def test_pp_across_two_processes_matches_one(tmp_path, smollm2_dir):
    """Two processes x 2 CPU devices (jax.distributed, gloo), PP=2 x TP=2: stage 0 on process
    0, stage 1 on process 1, the residual stream and the sampled outputs moved by collectives
    over the global mesh; the tokens of one process at PP=1."""
    import socket

    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, num_hidden_layers=5)
    base = run_pp(str(tmp_path), 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env.pop("JAXINFER_PP_LAYER_PARTITION", None)
    procs = [subprocess.Popen([sys.executable, "tests/parallel/pp_worker.py", str(tmp_path),
                               "2", "2", "-", "tiny", str(port), str(pid), "2"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in (0, 1)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    driver = json.loads(outs[0][0].strip().splitlines()[-1])
    assert json.loads(outs[1][0].strip().splitlines()[-1]) == {"worker": 1}
    assert driver["step_compilation"] == "layerwise"  # (stage 0 here; stage 1 remote)
    _same(driver, base)
    assert driver["partition"] == [3, 2] and driver["max_in_flight"] == 2
    assert driver["stage_devices"] == [["cpu:0", "cpu:1"], "remote"]
    assert driver["kv_devices"] == [["cpu:0", "cpu:1"], "remote"]


@pytest.mark.slow  # (CI runs the llama cases above)
@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("qwen3", {"head_dim": 32}),
                                        ("mistral", {"sliding_window": 16})])
def test_pp_matches_single_stage_other_architectures(tmp_path, smollm2_dir, arch, extra):
    make_tiny_model_dir(tmp_path, arch, smollm2_dir, num_hidden_layers=3, **extra)
    base = run_pp(str(tmp_path), 1)
    for pp, tp in ((2, 1), (2, 2)):
        got = run_pp(str(tmp_path), pp, tp)
        _same(got, base)
        assert got["partition"] == [2, 1]


def test_quantized_weights_over_stages_match_single_stage(tmp_path, smollm2_dir):
    """int8 weights (quantized at load, per-channel scales) over 2 stages of 2 devices: each
    stage holds its layers' weights and scales, sharded over its devices."""
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, num_hidden_layers=3)
    base = run_pp(str(tmp_path), 1, quantization="int8")
    got = run_pp(str(tmp_path), 2, 2, quantization="int8")
    _same(got, base)
    assert got["partition"] == [2, 1]


@pytest.mark.slow  # (~40 s here; CI keeps PP through test_pp_matches_single_stage[ci])
def test_moe_pp_with_expert_parallel_matches_single_stage(tmp_path, smollm2_dir):
    """Qwen3-MoE (layers 0 and 2 sparse, 1 dense) over 2 stages, alone and with 2 devices per
    stage holding 2 of the 4 experts each (expert parallelism inside each stage)."""
    make_tiny_model_dir(tmp_path, "qwen3_moe", smollm2_dir, num_hidden_layers=3, head_dim=16,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        mlp_only_layers=[1])
    base = run_pp(str(tmp_path), 1)
    for pp, tp, ep in ((2, 1, False), (2, 2, True)):
        got = run_pp(str(tmp_path), pp, tp, expert_parallel=ep)
        _same(got, base)
        assert got["partition"] == [2, 1] and got["expert_parallel"] == ep

"""KV connectors in one process: the shared-storage connector as an offline KV cache and as
P/D, the JAX-transfer connector between two engines in one process, byte-identity of loaded
blocks, failure handling (corrupt files, dead producers, dropped notices, aborts while
loading) and no leaked blocks anywhere.

Runs on a tiny random-weight llama in float32 (greedy outputs are then exactly reproducible
whatever the batch)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
            min_token_bucket=32, block_size=8, warmup=False, enable_multiprocessing=False,
            num_kv_blocks=80)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-kvc")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


def workload():
    """Mixed lengths: shorter than a block (nothing to move), exactly block-aligned, several
    blocks, and two prompts sharing a 3-block prefix."""
    shared = [500 + j for j in range(24)]
    prompts = [[1000 + 37 * i + j for j in range(n)] for i, n in enumerate((5, 8, 16, 29, 61))]
    prompts += [shared + [7, 8, 9], shared + [11] * 12]
    return [{"prompt_token_ids": p} for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _core(llm):
    return llm.llm_engine.engine_core.core


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(tiny_dir, **OPTS)
    ref = _tokens(llm.generate(workload(), GREEDY))
    llm.shutdown()
    return ref


def _storage(path, role="kv_both", **extra):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def test_shared_storage_survives_a_restart(tiny_dir, reference, tmp_path):
    """An engine stores its prompts' blocks; a new engine (a restart) loads them: fewer
    tokens computed, the same greedy output, every block free afterwards."""
    llm = LLM(tiny_dir, kv_transfer_config=_storage(tmp_path, "kv_producer"), **OPTS)
    assert _tokens(llm.generate(workload(), GREEDY)) == reference
    assert_no_leaks(llm)
    llm.shutdown()
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".safetensors")]
    # Full prompt blocks (block 8) of 5, 8, 16, 29, 61, 27, 36 tokens: 0+1+2+3+7+3+4, the
    # 3-block shared prefix stored once: 17 files, nothing half-written left behind.
    assert len(files) == 17
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]

    llm = LLM(tiny_dir, kv_transfer_config=_storage(tmp_path, "kv_consumer"), **OPTS)
    outs = llm.generate(workload(), GREEDY)
    assert _tokens(outs) == reference
    stats = llm.llm_engine.call_utility("get_stats")
    # Every full block except the one holding a prompt's last token came from storage.
    want = sum((len(p["prompt_token_ids"]) - 1) // 8 * 8 for p in workload())
    assert stats["kv_connector_loaded_tokens"] + stats["prefix_cache_hits"] >= want
    assert stats["kv_connector_loaded_tokens"] > 0
    assert [o.num_cached_tokens for o in outs][3] == 24  # 29 tokens: 3 blocks loaded
    assert_no_leaks(llm)
    llm.shutdown()


def _drain(*llms, timeout=30.0):
    """Step in-process engine cores until their KV work (pulls, held blocks) is done."""
    import time

    end = time.time() + timeout
    while any(_core(llm).has_work() for llm in llms):
        assert time.time() < end, [_core(llm).leak_report() for llm in llms]
        for llm in llms:
            if _core(llm).has_work():
                _core(llm).step()


def _cached_blocks(llm, token_ids):
    """The block ids of the prompt's full blocks in the engine's prefix cache."""
    from jaxinfer.request import Request

    kv = _core(llm).scheduler.kv
    blocks, _ = kv.get_computed_blocks(Request("probe", token_ids, SamplingParams()))
    return [b.block_id for b in blocks]


def _block_bytes(llm, block_ids):
    caches = _core(llm).runner.kv_caches
    return [np.asarray(x)[block_ids] for kv in caches for x in kv]


def _transfer(role, **extra):
    return {"kv_connector": "JaxTransferConnector", "kv_role": role,
            "kv_connector_extra_config": extra}


def _prefill(p, prompts):
    """What the proxy does first: each prompt with max_tokens=1 and do_remote_decode."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return [o.kv_transfer_params for o in p.generate(prompts, params)]


def _decode_params(ktp):
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                          extra_args={"kv_transfer_params": ktp})


@pytest.fixture(scope="module")
def pd_pair(tiny_dir):
    # (A generous pull_timeout: on a loaded CI machine a good pull may take seconds; the
    # failure tests use their own decode engine with a short one.)
    p = LLM(tiny_dir, kv_transfer_config=_transfer("kv_producer", abort_timeout=6), **OPTS)
    d = LLM(tiny_dir, kv_transfer_config=_transfer("kv_consumer", pull_timeout=30), **OPTS)
    yield p, d
    for llm in (p, d):
        _drain(llm)
        assert_no_leaks(llm)
        llm.shutdown()


def test_jax_transfer_pd_equals_colocated_with_identical_blocks(pd_pair, reference):
    p, d = pd_pair
    prompts = workload()
    ktps = _prefill(p, prompts)
    for prompt, ktp in zip(prompts, ktps):
        n = (len(prompt["prompt_token_ids"]) - 1) // 8
        assert ktp["do_remote_prefill"] and ktp["remote_num_blocks"] == n
        assert ("remote_uuid" in ktp) == (n > 0)
    # Blocks are held for the decode side: not free yet.
    assert _core(p).scheduler.delayed_free
    outs = d.generate(prompts, [_decode_params(k) for k in ktps])
    assert _tokens(outs) == reference
    _drain(p, d)
    assert not _core(p).scheduler.delayed_free  # freed on the decode side's "done"
    stats = d.llm_engine.call_utility("get_stats")
    assert stats["kv_connector_loaded_tokens"] > 0 and stats["kv_connector_load_failures"] == 0
    # bytes moved = blocks x layers x 2 x block_size x kv_heads x head_dim x 4 (float32)
    loaded_blocks = stats["kv_connector_loaded_tokens"] // 8
    assert stats["kv_connector_bytes_moved"] == loaded_blocks * 2 * 2 * 8 * 2 * 16 * 4
    # Loaded blocks are byte-identical to the producer's.
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        pb, db = _cached_blocks(p, ids), _cached_blocks(d, ids)
        assert len(pb) == len(db) == (len(ids) - 1) // 8
        for a, b in zip(_block_bytes(p, pb), _block_bytes(d, db)):
            assert a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def impatient(tiny_dir):
    """A decode engine that gives a pull up after 2 s."""
    d = LLM(tiny_dir, kv_transfer_config=_transfer("kv_consumer", pull_timeout=2), **OPTS)
    yield d
    _drain(d)
    assert_no_leaks(d)
    d.shutdown()


def test_decode_side_recomputes_when_the_pull_fails(pd_pair, impatient, reference):
    """The producer never offered this uuid (as if it died): the pull is given up after
    pull_timeout and the prompt recomputed; the same output, nothing leaked."""
    p, d = pd_pair[0], impatient
    prompts = workload()[3:5]
    ktps = _prefill(p, prompts)
    bogus = [dict(k, remote_uuid=k["remote_uuid"] + 1) for k in ktps]
    outs = d.generate(prompts, [_decode_params(k) for k in bogus])
    assert _tokens(outs) == reference[3:5]
    stats = d.llm_engine.call_utility("get_stats")
    assert stats["kv_connector_load_failures"] >= 2
    # The producer's blocks were never pulled: freed after abort_timeout.
    _drain(p)
    assert _core(p).kv_connector.num_expired_sends >= 2


def test_fail_policy_finishes_the_request_with_the_error(tiny_dir, pd_pair):
    p, _ = pd_pair
    d = LLM(tiny_dir, kv_transfer_config=dict(_transfer("kv_consumer", pull_timeout=1),
                                              kv_load_failure_policy="fail"), **OPTS)
    prompts = workload()[4:5]
    ktp = _prefill(p, prompts)[0]
    out = d.generate(prompts, _decode_params(dict(ktp, remote_uuid=ktp["remote_uuid"] + 1)))[0]
    c = out.outputs[0]
    assert c.finish_reason == "abort" and c.token_ids == []
    assert "KV transfer from the prefill instance failed" in str(c.stop_reason)
    assert_no_leaks(d)
    d.shutdown()
    _drain(p)


def test_abort_while_pulling_frees_everything(pd_pair, impatient):
    p, d = pd_pair[0], impatient
    assert d.llm_engine.call_utility("reset_prefix_cache")
    prompt = workload()[4]
    ktp = _prefill(p, [prompt])[0]
    eng = d.llm_engine
    eng.add_request("x", prompt, _decode_params(dict(ktp, remote_uuid=ktp["remote_uuid"] + 1)))
    for _ in range(3):
        eng.step()
    from jaxinfer.request import RequestStatus

    (req,) = _core(d).scheduler.requests.values()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.abort_request("x")
    _drain(d, p)
    assert_no_leaks(d)


def test_dropped_done_notice_frees_after_abort_timeout(tiny_dir, pd_pair, reference,
                                                       monkeypatch):
    p, _ = pd_pair
    monkeypatch.setenv("JAXINFER_TEST_DROP_KV_NOTICES", "1")
    d = LLM(tiny_dir, kv_transfer_config=_transfer("kv_consumer"), **OPTS)
    monkeypatch.delenv("JAXINFER_TEST_DROP_KV_NOTICES")
    prompts = workload()[2:4]
    before = _core(p).kv_connector.num_expired_sends
    outs = d.generate(prompts, [_decode_params(k) for k in _prefill(p, prompts)])
    assert _tokens(outs) == reference[2:4]
    assert_no_leaks(d)
    d.shutdown()
    _drain(p)  # nobody said done: the producer frees after abort_timeout (6 s)
    assert _core(p).kv_connector.num_expired_sends == before + 2


def test_corrupt_block_file_is_recomputed(tiny_dir, reference, tmp_path):
    llm = LLM(tiny_dir, kv_transfer_config=_storage(tmp_path, "kv_producer"), **OPTS)
    llm.generate(workload(), GREEDY)
    _drain(llm)
    llm.shutdown()
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs)
    for path in files[::3]:  # flip bytes in the middle of every third block file
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xff\x00\xff\x00")
    llm = LLM(tiny_dir, kv_transfer_config=_storage(tmp_path, "kv_consumer"), **OPTS)
    assert _tokens(llm.generate(workload(), GREEDY)) == reference
    stats = llm.llm_engine.call_utility("get_stats")
    assert stats["kv_connector_load_failures"] > 0
    assert_no_leaks(llm)
    llm.shutdown()


def test_kv_transfer_config_errors_name_the_field(tmp_path):
    from jaxinfer.config import EngineConfig

    bad = [({"kv_connector": "Nope", "kv_role": "kv_both"}, "kv_connector='Nope'"),
           ({"kv_connector": "JaxTransferConnector", "kv_role": "x"}, "kv_role='x'"),
           ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"},
            "shared_storage_path"),
           (dict(_transfer("kv_both"), kv_load_failure_policy="retry"),
            "kv_load_failure_policy"),
           (_transfer("kv_both", pull_timeout=-1), "pull_timeout"),
           ({"kv_connector": "JaxTransferConnector", "kv_role": "kv_both", "bogus": 1},
            "bogus"),
           (_transfer("kv_both", pull_timout=5), "pull_timout"),
           (_storage(tmp_path, abort_timeout=5), "abort_timeout")]
    for cfg, needle in bad:
        with pytest.raises(ValueError, match=needle):
            EngineConfig(kv_transfer_config=cfg)
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, extra_args={"kv_transfer_params": {}})
    from jaxinfer.validation import check_extra_args

    with pytest.raises(ValueError, match=r"extra_args: unknown key\(s\) \['foo'\]"):
        check_extra_args(SamplingParams(extra_args={"foo": 1}))  # (what every engine checks)
    from jaxinfer.entrypoints.cli import build_parser

    store = json.dumps(_storage(tmp_path))
    for cmd in ("serve", "generate"):
        args = build_parser().parse_args([cmd, "--kv-transfer-config", store,
                                          "--data-parallel-size", "2"])
        cfg = EngineConfig(kv_transfer_config=args.kv_transfer_config,
                           data_parallel_size=args.data_parallel_size)
        assert cfg.kv_transfer_config.kv_connector == "SharedStorageConnector"
        assert cfg.kv_transfer_config.is_kv_producer and cfg.data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="needs enable_multiprocessing"):
        EngineConfig(data_parallel_size=2, enable_multiprocessing=False)


@pytest.mark.parametrize("extra", [dict(async_scheduling=False),
                                   dict(speculative_config={"method": "ngram",
                                                            "num_speculative_tokens": 3})],
                         ids=["sync-scheduling", "ngram-spec-decode"])
def test_decode_side_with_sync_scheduling_or_spec_decode(tiny_dir, pd_pair, reference, extra):
    p, _ = pd_pair
    d = LLM(tiny_dir, kv_transfer_config=_transfer("kv_consumer"), **OPTS, **extra)
    prompts = workload()
    outs = d.generate(prompts, [_decode_params(k) for k in _prefill(p, prompts)])
    assert _tokens(outs) == reference
    assert d.llm_engine.call_utility("get_stats")["kv_connector_loaded_tokens"] > 0
    _drain(p, d)
    assert_no_leaks(d)
    d.shutdown()


def test_pd_between_tensor_parallel_sizes(tiny_dir):
    """A TP=2 prefill instance feeding a TP=1 decode instance and the reverse (2 forced CPU
    devices, in a subprocess): the colocated output, blocks loaded, nothing leaked."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "tests/kv_connector/tp_pd_worker.py", tiny_dir],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for case in result.values():
        assert case["equal"] and case["loaded"] > 0 and case["leaks"] == [[], []], result


def test_penalised_request_computes_its_prompt_and_releases_the_producer(tiny_dir, pd_pair):
    """Penalties count every prompt token passing through a step: such a request on the
    decode side computes its prompt (no load) and still tells the producer it is done."""
    p, d = pd_pair
    assert d.llm_engine.call_utility("reset_prefix_cache")
    prompt = workload()[4]
    before = d.llm_engine.call_utility("get_stats")["kv_connector_loaded_tokens"]
    ktp = _prefill(p, [prompt])[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                            extra_args={"kv_transfer_params": ktp})
    want = LLM(tiny_dir, **OPTS)
    ref = want.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 repetition_penalty=1.3))
    want.shutdown()
    assert _tokens(d.generate([prompt], params)) == _tokens(ref)
    assert d.llm_engine.call_utility("get_stats")["kv_connector_loaded_tokens"] == before
    expired = _core(p).kv_connector.num_expired_sends
    _drain(p, d, timeout=2.5)  # freed by the notice, well before abort_timeout (6 s)
    assert _core(p).kv_connector.num_expired_sends == expired

"""Smoke runs of `jaxinfer bench ...`, the HF baseline and the plots: tiny sizes, JSON schema,
and counts that add up (never timings)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from jaxinfer.bench.datasets import nano_vllm_requests, synthetic_sharegpt_requests
from jaxinfer.entrypoints.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = ["--max-model-len", "64", "--max-num-seqs", "4", "--no-warmup", "--dtype", "float32"]


def test_the_front_end_does_not_preallocate_a_gpu_the_core_holds(monkeypatch):
    """Once the engine (its core in another process) is up, the benchmark's own JAX client
    allocates on demand; a value the user set stands."""
    import argparse

    from jaxinfer.bench import offline

    monkeypatch.setattr("jaxinfer.config.cli.engine_config_from_args", lambda a, **k: k)
    monkeypatch.setattr("jaxinfer.llm.LLM.from_engine_config", classmethod(lambda cls, c: c))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    args = argparse.Namespace(max_model_len=None)
    assert offline.make_llm(args, 12) == {"max_model_len": 12}
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    offline.make_llm(args, 12)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


@pytest.mark.slow  # the same engine paths as the throughput smoke test, which CI runs
def test_latency(tmp_path):
    out = tmp_path / "lat.json"
    assert cli(["bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                "--num-iters-warmup", "1", "--num-iters", "2", *ENGINE,
                "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "latency" and len(r["latencies"]) == 2
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert r["avg_latency"] > 0 and r["environment"]["architecture"] == "LlamaForCausalLM"
    roof = r["roofline"]  # the run beside its decode floor
    assert roof["ms_per_output_step"] == pytest.approx(r["avg_latency"] / 4 * 1e3)
    assert roof["weight_bytes"] > 0 and roof["read_bandwidth_bytes_per_s"] > 1e8
    assert roof["decode_floor_ms"] > 1e3 * roof["weight_bytes"] / roof["read_bandwidth_bytes_per_s"]
    assert roof["fraction_of_floor"] == pytest.approx(roof["decode_floor_ms"]
                                                      / roof["ms_per_output_step"])


def test_throughput_counts_add_up(tmp_path):
    out = tmp_path / "thr.json"
    assert cli(["bench", "throughput", "--dataset", "random", "--num-prompts", "5",
                "--input-len", "8", "--output-len", "3", "--random-range-ratio", "0.5",
                "--no-tqdm", "--num-warmups", "2", *ENGINE, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 5 and 5 * 1 <= r["total_output_tokens"] <= 5 * 4
    assert 5 * 4 <= r["total_prompt_tokens"] <= 5 * 12
    assert abs(r["requests_per_second"] * r["elapsed_time"] - 5) < 1e-6
    assert abs(r["output_tokens_per_second"] * r["elapsed_time"] - r["total_output_tokens"]) \
        < 1e-6
    # How the timed steps ran: a layer-wise engine (the CPU default) with background
    # compilation off (conftest) never fuses, so every step ran on layer-wise programs.
    steps = r["steps"]
    assert steps["num_steps"] >= 2 and steps["num_fused_buckets"] == 0
    assert steps["num_layerwise_steps"] == steps["num_steps"]
    assert 0 <= steps["num_padded_up_steps"] <= steps["num_steps"]


def test_negative_num_warmups_is_refused_by_name():
    with pytest.raises(SystemExit, match="--num-warmups must be >= 0, got -1"):
        cli(["bench", "throughput", "--num-warmups", "-1", *ENGINE])


def test_dataset_presets_shapes():
    reqs = nano_vllm_requests(256, vocab_size=1000, seed=1)
    assert len(reqs) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.output_len <= 1024
               for r in reqs)
    assert reqs == nano_vllm_requests(256, vocab_size=1000, seed=1)  # seeded
    syn = synthetic_sharegpt_requests(200, vocab_size=1000, seed=0)
    lens = sorted(len(r.prompt_token_ids) for r in syn)
    assert 60 < lens[100] < 250 and all(len(r.prompt_token_ids) + r.output_len <= 2048
                                        for r in syn)


@pytest.mark.slow  # (~35 s of probes; CI keeps the other bench commands' smoke tests)
def test_roofline(tmp_path):
    out = tmp_path / "roof.json"
    assert cli(["bench", "roofline", "--dtype", "float32", "--batch-sizes", "1,4",
                "--context", "16", "--decode-steps", "2", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["params"]["total"] == 134515008  # SmolLM2-135M, tied embeddings
    assert r["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    d = r["decode"]
    assert d[1]["decode_step_floor_s"] > d[0]["decode_step_floor_s"] > 0
    assert d[1]["compute_floor_s"] == pytest.approx(4 * d[0]["compute_floor_s"], rel=0.01)
    for row in d:  # the engine's own step, measured, beside its floors
        assert row["measured_step_s"] > 0 and row["fraction_of_floor"] > 0
        assert row["floor_s"] == max(row["decode_step_floor_s"], row["compute_floor_s"])
    assert r["device"]["decode_matmul_probe"] == [4, 576, 1536]


def test_serve_against_a_live_server(tmp_path, smollm2_dir):
    import argparse

    from jaxinfer.bench.serve import run_serve
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM
    from tests.helpers import LiveServer

    llm = AsyncLLM(EngineConfig(model=smollm2_dir, dtype="float32", max_model_len=64,
                                max_num_seqs=4, warmup=False, num_kv_blocks=40))
    live = LiveServer(llm, "smol", log_level="error")
    try:
        out = tmp_path / "serve.json"
        args = argparse.Namespace(
            base_url=live.base_url, model="smol", api_key=None, tokenizer=None,
            vocab_size=49152, dataset="random", dataset_path=None, num_prompts=6, input_len=8,
            output_len=4, random_range_ratio=0.0, request_rate=20.0, burstiness=1.0,
            max_concurrency=3, goodput_ttft_ms=None, goodput_tpot_ms=None,
            goodput_e2e_ms=None, seed=0, output_json=str(out))
        run_serve(args)
        r = json.loads(out.read_text())
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["total_output_tokens"] == 24 and r["total_input_tokens"] == 48
        assert r["ttft_ms"]["median"] > 0 and r["e2e_latency_ms"]["p99"] >= r["ttft_ms"]["p99"]
        assert r["goodput_requests_per_s"] == pytest.approx(r["request_throughput"])
    finally:
        live.close()


def test_hf_baseline_static_and_plots(tmp_path, smollm2_dir):
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "baselines"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import hf_transformers
        import plot
    finally:
        sys.path[:2] = []
    out = tmp_path / "hf.json"
    r = hf_transformers.main(["--model", smollm2_dir, "--dtype", "float32", "--num-prompts", "3",
                              "--input-len", "6", "--output-len", "3", "--batch-size", "2",
                              "--output-json", str(out)])
    assert r["baseline"] == "hf-transformers-static" and r["total_output_tokens"] == 9
    assert json.loads(out.read_text())["total_prompt_tokens"] == 18
    for b in (1, 4):
        (tmp_path / f"lat{b}.json").write_text(json.dumps(
            {"benchmark": "latency", "batch_size": b, "output_len": 8, "avg_latency": 0.5 * b}))
    (tmp_path / "s.json").write_text(json.dumps(
        {"benchmark": "serve", "request_rate": 2.0, "ttft_ms": {"median": 10.0},
         "e2e_latency_ms": {"median": 50.0}}))
    written = plot.main(["--results", str(tmp_path)])
    assert len(written) == 2 and all(os.path.getsize(p) > 1000 for p in written)


def test_compare_cpu_jaxinfer_only(tmp_path):
    """The peer comparison tool end to end with jaxinfer alone (peers are a manual install):
    a subprocess run, the table's ratio and the JSON schema."""
    import subprocess

    out = tmp_path / "cmp.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare_cpu.py"), "--engines",
         "jaxinfer,vllm,llama.cpp", "--workloads", "2x8x4,1x8x4", "--max-num-batched-tokens",
         "16", "--repeats", "2", "--output-json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vllm: skipped" in proc.stdout and "llama.cpp: skipped" in proc.stdout
    r = json.loads(out.read_text())
    assert r["workloads"] == ["2x8x4", "1x8x4"]
    for w, n in (("2x8x4", 2), ("1x8x4", 1)):
        j = r["results"][w]["jaxinfer"]
        assert j["output_tokens"] == n * 4 and j["elapsed_s"] > j["batch_ttft_s"] > 0
        assert j["decode_ms_per_token"] > 0
        assert r["jaxinfer_over_peer"][w] == {"jaxinfer": 1.0}
        # two rounds: the reported run is the slower (lower middle), every run beside it
        runs = j["output_tok_s_runs"]
        assert len(runs) == 2 and j["output_tok_s"] == min(runs) and r["repeats"] == 2
    assert r["threading"]["jaxinfer"]["cores"] == os.cpu_count()  # what each peer ran with


def test_startup_cold_then_warm(tmp_path, smollm2_dir):
    """`jaxinfer bench startup --modes llm`: a cold run compiles into an empty cache, the warm
    run on that cache finds the steps there (counts, not timings)."""
    from tests.engine.conftest import make_tiny_model_dir

    model = tmp_path / "tiny"
    make_tiny_model_dir(model, "llama", smollm2_dir)
    out = tmp_path / "startup.json"
    assert cli(["bench", "startup", "--model", str(model), "--modes", "llm",
                "--num-iters-cold", "1", "--num-iters-warm", "1",
                "--compilation-cache-dir", str(tmp_path / "xla"), *ENGINE,
                "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    (cold,), (warm,) = r["llm"]["cold"], r["llm"]["warm"]
    assert cold["compile_cache_hits"] == 0 and cold["num_compilations"] >= 1
    # every step compiled warm came from the cache the cold run left
    assert warm["compile_cache_hits"] >= warm["num_compilations"] >= 1
    for run in (cold, warm):
        assert set(run["engine_phases"]) >= {"load_weights_s", "allocate_kv_cache_s",
                                             "warmup_s", "warmup_compilations"}
        assert run["total_s"] >= run["engine_init_s"] > 0
    # A serve run passes every engine flag on to `jaxinfer serve`, which has them all (the
    # one generated set: config/cli.py), e.g. --load-format.
    from jaxinfer.bench.startup import _engine_flags
    from jaxinfer.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "startup", "--load-format", "dummy", *ENGINE])
    flags = _engine_flags(args)
    assert flags[flags.index("--load-format") + 1] == "dummy" and "--no-warmup" in flags
    served = build_parser().parse_args(["serve", *flags])
    assert (served.load_format, served.warmup, served.max_num_seqs) == ("dummy", False, 4)


@pytest.mark.parametrize("arch,kind", [("LlamaForCausalLM", "bf16"), ("Qwen3ForCausalLM", "f32")])
def test_dummy_gguf_for_llama_cpp_has_the_config_shapes(tmp_path, arch, kind):
    """benchmarks/peers/gguf_dummy.py (llama.cpp's peer model for a config without weights):
    llama.cpp's tensor names, each in the config's shape (GGUF lists dims innermost first),
    matrices in the asked dtype and 1-D tensors float32, the "none" vocabulary of
    vocab_size tokens; Qwen3 with its q / k norms."""
    gguf = pytest.importorskip("gguf")
    from benchmarks.peers.gguf_dummy import write_dummy

    with open(os.path.join(ROOT, "benchmarks", "configs", "tiny-llama", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=[arch], head_dim=48)  # (not hidden / heads: read as given)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    out = write_dummy(str(tmp_path / "cfg"), str(tmp_path / "m.gguf"), kind)
    r = gguf.GGUFReader(out)

    def field(key):
        f = r.fields[key]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]

    name = "qwen3" if arch == "Qwen3ForCausalLM" else "llama"
    assert field("general.architecture") == name and field("tokenizer.ggml.model") == "none"
    assert field(f"{name}.vocab_size") == 2048 and field(f"{name}.block_count") == 2
    assert field(f"{name}.attention.key_length") == 48
    shapes = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type)
              for t in r.tensors}
    mat = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.F32
    f32 = gguf.GGMLQuantizationType.F32
    assert shapes["token_embd.weight"] == ((2048, 128), mat)  # (tied: no output.weight)
    assert shapes["blk.1.attn_q.weight"] == ((4 * 48, 128), mat)
    assert shapes["blk.1.attn_k.weight"] == ((2 * 48, 128), mat)
    assert shapes["blk.1.attn_output.weight"] == ((128, 4 * 48), mat)
    assert shapes["blk.1.ffn_down.weight"] == ((128, 256), mat)
    assert shapes["blk.1.ffn_norm.weight"] == ((128,), f32)
    assert ("blk.1.attn_q_norm.weight" in shapes) == (name == "qwen3")
    per_layer = 11 if name == "qwen3" else 9
    assert len(shapes) == 2 + 2 * per_layer and "output.weight" not in shapes


def test_thread_cpu_reads_every_thread_and_names_its_kind():
    """benchmarks/thread_cpu.py: this process's threads (a busy one among them) with their
    CPU ticks, children's too, each put under one kind."""
    import subprocess
    import threading
    import time

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import thread_cpu

    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=busy)
    t.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        got = thread_cpu._threads()
    finally:
        stop.set()
        t.join()
        child.kill()
        child.wait()
    me = os.getpid()
    assert (me, me) in got and (me, t.native_id) in got and (child.pid, child.pid) in got
    assert got[(me, t.native_id)][1] > 0  # (its CPU ticks)
    kind = thread_cpu._kind
    assert kind(me, me, "python", me, True) == "front end"
    assert kind(me, me, "python", me, False) == "front end + engine core (one thread)"
    assert kind(7, 7, "python", me, True) == "engine core's thread"
    assert kind(7, 8, "tf_XLAEigen", me, True) == "XLA intra-op pool (kernels)"
    assert kind(7, 9, "ZMQbg/IO/0", me, True) == "ZeroMQ I/O"
    assert kind(7, 10, "python", me, True).startswith("other threads of the core")

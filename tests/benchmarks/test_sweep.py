"""`jaxinfer bench sweep serve | plot | plot_pareto` and `jaxinfer auto-tune` (issue 33): a real
2 x 1 sweep (plus a combination the server refuses) against live `jaxinfer serve` processes,
PNGs that are not blank, auto-tune on a 2 x 1 grid, --dry-run and --resume, bad params files,
and no process left behind."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys

import pytest

from jaxinfer.bench import sweep
from jaxinfer.bench.datasets import random_requests
from jaxinfer.entrypoints.cli import main as cli

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _servers_left(port: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"--port {port}" in line and "serve" in line
            and "pytest" not in line]


def test_params_flags_links_and_address(tmp_path):
    assert sweep.to_flags({"max_num_seqs": 8, "enforce_eager": True, "x": False, "y": None,
                           "request_rate": 1.5}) == ["--max-num-seqs", "8", "--enforce-eager",
                                                     "--request-rate", "1.5"]
    serve = [{"max_num_seqs": 4}, {"max_num_seqs": 8}]
    bench = [{"max_concurrency": 4}, {"max_concurrency": 8}]
    got = [(i, j) for i, _, j, _ in sweep.combinations(serve, bench, [])]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]
    linked = sweep.parse_link_vars("max_num_seqs=max_concurrency")
    assert [(i, j) for i, _, j, _ in sweep.combinations(serve, bench, linked)] == [(0, 0),
                                                                                   (1, 1)]
    assert sweep.server_address(["jaxinfer", "serve", "--port", "9001", "--host",
                                 "0.0.0.0"]) == ("127.0.0.1", 9001)
    assert sweep.server_address(["vllm", "serve", "m", "--port=9002"]) == ("127.0.0.1", 9002)
    assert sweep.bench_output_flags(["vllm", "bench", "serve"], "/d/r.json") == [
        "--save-result", "--result-dir", "/d", "--result-filename", "r.json"]
    assert sweep.pareto_front([(1, 5), (2, 4), (1.5, 3), (3, 1), (0.5, 5)]) == [0, 1, 3]


@pytest.mark.parametrize("content,match", [
    ('{"max_num_seqs": 4}', "non-empty JSON list of objects"),
    ("[]", "non-empty JSON list of objects"),
    ("[1, 2]", "non-empty JSON list of objects"),
    ('[{"a": [1]}]', "'a' must be a string, number, boolean or null"),
    ("[{", "not JSON"),
])
def test_bad_params_files_are_refused(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        sweep.load_params(str(path), "--serve-params")
    with pytest.raises(ValueError, match="SERVE_KEY=BENCH_KEY"):
        sweep.parse_link_vars("max_num_seqs")


def test_summarize_reads_jaxinfer_and_vllm_results():
    ours = {"completed": 4, "request_throughput": 1.0, "output_throughput": 8.0,
            "ttft_ms": {"mean": 1.0, "median": 2.0, "p99": 3.0},
            "tpot_ms": {"mean": 4.0, "median": 5.0, "p99": 6.0}}
    vllm = {"completed": 4, "request_throughput": 1.0, "output_throughput": 8.0,
            "mean_ttft_ms": 1.0, "median_ttft_ms": 2.0, "p99_ttft_ms": 3.0,
            "mean_e2el_ms": 7.0, "median_e2el_ms": 8.0, "p99_e2el_ms": 9.0}
    a, b = sweep.summarize(ours), sweep.summarize(vllm)
    assert a["ttft_ms_median"] == b["ttft_ms_median"] == 2.0 and a["tpot_ms_p99"] == 6.0
    assert b["e2e_latency_ms_p99"] == 9.0 and a["e2e_latency_ms_p99"] is None


def test_random_prefix_len_is_shared_and_leaves_the_rest_unchanged():
    plain = random_requests(4, 10, 3, vocab_size=500, seed=3)
    assert plain == random_requests(4, 10, 3, vocab_size=500, seed=3, prefix_len=0)
    pre = random_requests(4, 10, 3, vocab_size=500, seed=3, prefix_len=6)
    assert all(len(r.prompt_token_ids) == 16 for r in pre)
    assert len({tuple(r.prompt_token_ids[:6]) for r in pre}) == 1


def _cmds(port: int) -> tuple[str, str]:
    serve = (f"{PY} -m jaxinfer.entrypoints.cli serve --port {port} --max-model-len 128 "
             f"--no-warmup --dtype float32 --served-model-name smol")
    bench = (f"{PY} -m jaxinfer.entrypoints.cli bench serve --model smol --base-url "
             f"http://127.0.0.1:{port} --dataset random --input-len 16 --output-len 4 "
             f"--vocab-size 49152")
    return serve, bench


def test_dry_run_prints_commands_and_starts_nothing(tmp_path, capsys):
    port = _free_port()
    serve_cmd, bench_cmd = _cmds(port)
    (tmp_path / "s.json").write_text('[{"max_num_seqs": 2}, {"max_num_seqs": 4}]')
    out = tmp_path / "out"
    assert cli(["bench", "sweep", "serve", "--serve-cmd", serve_cmd, "--bench-cmd", bench_cmd,
                "--serve-params", str(tmp_path / "s.json"), "-o", str(out), "--num-runs", "2",
                "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text.count("serve: ") == 2 and text.count("  bench: ") == 4
    assert "--max-num-seqs 4" in text and "--output-json" in text
    assert not out.exists() and not _port_in_use(port)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, smollm2_dir):
    """A 2 x 1 sweep (+ a serve combination with a flag the server refuses)."""
    tmp = tmp_path_factory.mktemp("sweep")
    port = _free_port()
    serve_cmd, bench_cmd = _cmds(port)
    (tmp / "s.json").write_text(json.dumps([{"max_num_seqs": 2}, {"not_a_flag": 1},
                                            {"max_num_seqs": 4}]))
    (tmp / "b.json").write_text(json.dumps([{"num_prompts": 4, "max_concurrency": 4}]))
    out = tmp / "out"
    assert cli(["bench", "sweep", "serve", "--serve-cmd", serve_cmd, "--bench-cmd", bench_cmd,
                "--serve-params", str(tmp / "s.json"), "--bench-params", str(tmp / "b.json"),
                "-o", str(out), "--num-runs", "1", "--server-ready-timeout", "300"]) == 0
    return out, port, serve_cmd, bench_cmd, tmp


def test_sweep_summary_has_every_run_and_sane_numbers(swept):
    out, port, *_ = swept
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "server failed", "ok"]
    assert "not-a-flag" in rows[1]["error"] or "unrecognized" in rows[1]["error"]
    for r in (rows[0], rows[2]):
        assert float(r["completed"]) == 4 and float(r["output_throughput"]) > 0
        assert 0 < float(r["ttft_ms_median"]) <= float(r["e2e_latency_ms_p99"])
        assert float(r["request_throughput"]) > 0
    assert [r["serve_max_num_seqs"] for r in (rows[0], rows[2])] == ["2", "4"]
    assert (out / "serve0-bench0-run0.json").exists()
    assert not _servers_left(port) and not _port_in_use(port)


def test_resume_reruns_nothing_already_done(swept):
    out, port, serve_cmd, bench_cmd, tmp = swept
    (tmp / "s2.json").write_text(json.dumps([{"max_num_seqs": 2}, {"max_num_seqs": 4}]))
    before = (out / "serve0-bench0-run0.json").stat().st_mtime
    assert cli(["bench", "sweep", "serve", "--serve-cmd", serve_cmd, "--bench-cmd", bench_cmd,
                "--serve-params", str(tmp / "s2.json"), "--bench-params", str(tmp / "b.json"),
                "-o", str(out), "--num-runs", "1", "--resume"]) == 0
    assert (out / "serve0-bench0-run0.json").stat().st_mtime == before
    with open(out / "summary.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "ok"]


def _not_blank(path) -> bool:
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    return img.std() > 0.01


def test_plot_and_pareto_write_pngs_that_are_not_blank(swept):
    out = swept[0]
    assert cli(["bench", "sweep", "plot", str(out)]) == 0
    assert cli(["bench", "sweep", "plot_pareto", str(out)]) == 0
    for png in (out / "plots" / "latency_vs_throughput.png", out / "pareto" / "PARETO.png"):
        assert png.exists() and _not_blank(png)
    with pytest.raises(ValueError, match="--var-x 'nope'"):
        cli(["bench", "sweep", "plot", str(out), "--var-x", "nope"])


def test_auto_tune_picks_a_pair_and_writes_result(tmp_path, smollm2_dir):
    port = _free_port()
    out = tmp_path / "tune"
    cmd = [PY, "-m", "jaxinfer.entrypoints.cli", "auto-tune", "--model", smollm2_dir,
           "--input-len", "16", "--output-len", "4", "--max-latency-ms", "600000",
           "--num-seqs-list", "2,4", "--num-batched-tokens-list", "64", "--num-prompts", "4",
           "--vocab-size", "49152", "--min-cache-hit-pct", "50", "--port", str(port),
           "--serve-args", "--no-warmup --dtype float32", "--no-tqdm", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "result.txt").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("max_num_seqs: 2, max_num_batched_tokens: 64")
    assert lines[-1].startswith("best_max_num_seqs: ") and "best_throughput: " in lines[-1]
    best = json.loads((out / "result.json").read_text())["best"]
    assert best["max_num_seqs"] in (2, 4) and best["output_throughput"] > 0
    assert best["request_rate"] == float("inf")  # the target is generous: met at once
    assert _not_blank(out / "auto_tune.png")
    assert not _servers_left(port) and not _port_in_use(port)

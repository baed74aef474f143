"""benchmarks/kernels.py runs end to end on CPU (interpret mode) and writes its JSON schema."""

import json
import os
import subprocess
import sys


def test_kernel_benchmark_smoke(tmp_path):
    out = tmp_path / "k.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "benchmarks/kernels.py", "--smoke", "--interpret",
                    "--no-torch", "--sweep", "--output-json", str(out)], check=True, cwd=root,
                   env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"})
    res = json.loads(out.read_text())
    assert res["benchmark"] == "kernels" and res["interpret"] is True
    assert len(res["rows"]) == 4  # decode + prefill, 2 batch sizes, 1 context
    for row in res["rows"]:
        assert row["pallas_s"] > 0 and row["reference_s"] > 0 and row["kv_bytes"] > 0
        assert 0 < row["hbm_floor_s"] and 0 < row["flop_floor_s"]
        # Decode of 1 token over 33 keys at 4 heads x 64: 4 * 33 * 4 * 64 FLOPs per sequence.
        if row["mode"] == "decode":
            assert row["flops"] == row["batch"] * 4 * 33 * 4 * 64
        assert row["fraction_of_roofline"] >= row["fraction_of_hbm_bw"]
    for regime in ("decode", "prefill"):
        sweep = res["sweep"][regime]
        assert len(sweep["candidates"]) == 2
        assert all(c["geomean_s"] > 0 for c in sweep["candidates"])
        assert sweep["best"] in [c["tuning"] for c in sweep["candidates"]]

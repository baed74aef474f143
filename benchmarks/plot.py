"""Plots from benchmarks/results/*.json: throughput vs batch size (latency runs) and latency
vs request rate (serve runs). Usage: python benchmarks/plot.py [--results DIR] [--out DIR]"""

from __future__ import annotations

import argparse
import glob
import json
import os


def main(argv=None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--results", default=os.path.join(here, "results"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_dir = args.out or args.results
    runs = []
    for fn in sorted(glob.glob(os.path.join(args.results, "*.json"))):
        with open(fn) as f:
            try:
                runs.append(json.load(f))
            except json.JSONDecodeError:
                continue
    written = []
    lat = [r for r in runs if r.get("benchmark") == "latency"]
    if lat:
        fig, ax = plt.subplots()
        lat.sort(key=lambda r: r["batch_size"])
        xs = [r["batch_size"] for r in lat]
        ys = [r["batch_size"] * r["output_len"] / r["avg_latency"] for r in lat]
        ax.plot(xs, ys, marker="o", label="jaxinfer")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput vs batch size")
        ax.legend()
        path = os.path.join(out_dir, "throughput_vs_batch.png")
        fig.savefig(path, dpi=120)
        written.append(path)
    serve = [r for r in runs if r.get("benchmark") == "serve"
             and r.get("request_rate") not in (None, float("inf"))]
    if serve:
        fig, ax = plt.subplots()
        serve.sort(key=lambda r: r["request_rate"])
        for key in ("ttft_ms", "e2e_latency_ms"):
            ax.plot([r["request_rate"] for r in serve], [r[key]["median"] for r in serve],
                    marker="o", label=key.replace("_ms", " (median, ms)"))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title("Latency vs request rate")
        ax.legend()
        path = os.path.join(out_dir, "latency_vs_rate.png")
        fig.savefig(path, dpi=120)
        written.append(path)
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()

"""Parameter sweeps over live servers (vLLM's `bench sweep`).

- `jaxinfer bench sweep serve --serve-cmd CMD --bench-cmd CMD [--serve-params F.json]
  [--bench-params F.json] -o DIR [--num-runs N] [--dry-run] [--resume] [--link-vars A=B,...]`:
  every serve combination (each object's keys become `--key value` flags, underscores to
  dashes; true: a bare flag; false / null: left out) starts a fresh server, waits for its
  /health, runs the bench command once per bench combination and run (its result JSON kept
  in DIR), then stops the server and every process it started. A server that exits or is not
  ready within --server-ready-timeout, and a bench command that fails, are recorded as failed
  combinations and the sweep goes on. DIR/summary.csv: one row per run (parameters, status,
  throughputs, TTFT / TPOT / ITL / e2e mean, median, p99). The bench command may be
  `jaxinfer bench serve` (results via --output-json) or vLLM's `vllm bench serve` (via
  --save-result --result-dir --result-filename), against any OpenAI-compatible server.
- `jaxinfer bench sweep plot DIR [--var-x P]` and `plot_pareto DIR`: PNGs from summary.csv.
(`jaxinfer auto-tune`, built on the same Server: bench/auto_tune.py.)
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")
# vLLM's result keys for the same statistics
_VLLM_KEYS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "itl_ms": "itl_ms",
              "e2e_latency_ms": "e2el_ms"}


# ---------------------------------------------------------------- parameters and commands
def load_params(path: str | None, what: str) -> list[dict]:
    """A params file: a JSON list of objects of scalars. None: one empty combination."""
    if path is None:
        return [{}]
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {path}: not JSON ({e})") from None
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{what} {path}: expected a non-empty JSON list of objects")
    for d in data:
        for k, v in d.items():
            if not isinstance(v, (str, int, float, bool)) and v is not None:
                raise ValueError(f"{what} {path}: {k!r} must be a string, number, boolean or "
                                 f"null, got {type(v).__name__}")
    return data


def to_flags(params: dict) -> list[str]:
    """{"max_num_seqs": 8, "enforce_eager": true} -> ["--max-num-seqs", "8", "--enforce-eager"]."""
    out = []
    for k, v in params.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        else:
            out += [flag, str(v)]
    return out


def combinations(serve: list[dict], bench: list[dict], link_vars: list[tuple[str, str]]):
    """(serve index, serve params, bench index, bench params) over the Cartesian product,
    without the pairs whose linked variables (serve key = bench key) differ."""
    for (i, s), (j, b) in itertools.product(enumerate(serve), enumerate(bench)):
        if all(s.get(sk) == b.get(bk) for sk, bk in link_vars if sk in s and bk in b):
            yield i, s, j, b


def parse_link_vars(text: str | None) -> list[tuple[str, str]]:
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"--link-vars {item!r}: expected SERVE_KEY=BENCH_KEY")
        a, b = item.split("=", 1)
        pairs.append((a.strip(), b.strip()))
    return pairs


def server_address(argv: list[str]) -> tuple[str, int]:
    """host, port from a serve command line (defaults 127.0.0.1, 8000)."""
    host, port = "127.0.0.1", 8000
    for i, a in enumerate(argv):
        for name in ("--host", "--port"):
            value = None
            if a == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(name + "="):
                value = a.split("=", 1)[1]
            if value is not None:
                if name == "--host":
                    host = "127.0.0.1" if value in ("0.0.0.0", "") else value
                else:
                    port = int(value)
    return host, port


def bench_output_flags(argv: list[str], path: str) -> list[str]:
    """How the bench command is told where to write its result JSON."""
    if any(os.path.basename(a) == "vllm" for a in argv[:2]):
        return ["--save-result", "--result-dir", os.path.dirname(path),
                "--result-filename", os.path.basename(path)]
    return ["--output-json", path]


# ---------------------------------------------------------------- servers
class Server:
    """A server process group: started, waited for (GET /health), stopped with everything it
    started (its own session: SIGTERM to the group, SIGKILL after a grace period)."""

    def __init__(self, argv: list[str], log_path: str, ready_timeout: float):
        self.argv, self.log_path, self.ready_timeout = argv, log_path, ready_timeout
        self.host, self.port = server_address(argv)
        self.proc = None

    def start(self) -> str | None:
        """None when ready, else why not."""
        self._log = open(self.log_path, "w")
        with socket.socket() as s:  # (another server there would answer our health checks)
            if s.connect_ex((self.host, self.port)) == 0:
                return f"{self.host}:{self.port} is already in use by another process"
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        url = f"http://{self.host}:{self.port}/health"
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"server exited with status {self.proc.returncode} ({self._tail()})"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return None
            except OSError:
                pass
            time.sleep(0.5)
        return f"server not ready within {self.ready_timeout:g} s ({self._tail()})"

    def reset_prefix_cache(self) -> None:
        """Between runs, so that no run gets another's prompts from the prefix cache (a
        server without the endpoint keeps its cache: runs after the first may hit it)."""
        req = urllib.request.Request(f"http://{self.host}:{self.port}/reset_prefix_cache",
                                     method="POST")
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except OSError as e:
            print(f"[sweep] POST /reset_prefix_cache failed ({e}); runs may share cached "
                  "prefixes", file=sys.stderr)

    def _tail(self, n: int = 400) -> str:
        self._log.flush()
        try:
            with open(self.log_path) as f:
                return f.read()[-n:].strip().replace("\n", " | ")
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            self._log.close()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:  # anything of the group still alive (engine-core children included)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        self.proc = None


# ---------------------------------------------------------------- results
def summarize(result: dict) -> dict:
    """A bench result JSON (jaxinfer's or vLLM's) -> the summary row's metrics."""
    row = {"completed": result.get("completed"),
           "request_throughput": result.get("request_throughput"),
           "output_throughput": result.get("output_throughput")}
    for m in METRICS:
        nested = result.get(m)
        for stat in ("mean", "median", "p99"):
            if isinstance(nested, dict):
                v = nested.get(stat)
            else:
                v = result.get(f"{stat}_{_VLLM_KEYS[m]}")
            row[f"{m}_{stat}"] = v
    return row


def write_summary(out_dir: str, rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    path = os.path.join(out_dir, "summary.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def read_summary(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "summary.csv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: run `jaxinfer bench sweep serve -o "
                                f"{out_dir}` first")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = float(v) if v not in ("", None) else None
            except ValueError:
                pass
    return rows


# ---------------------------------------------------------------- sweep serve
def run_sweep(args) -> int:
    serve_list = load_params(args.serve_params, "--serve-params")
    bench_list = load_params(args.bench_params, "--bench-params")
    links = parse_link_vars(args.link_vars)
    if args.num_runs < 1:
        raise ValueError(f"--num-runs must be >= 1, got {args.num_runs}")
    serve_base, bench_base = shlex.split(args.serve_cmd), shlex.split(args.bench_cmd)
    plan: dict[int, list] = {}
    for i, s, j, b in combinations(serve_list, bench_list, links):
        plan.setdefault(i, []).append((j, b))
    if not args.dry_run:
        os.makedirs(args.output_dir, exist_ok=True)
    rows: list[dict] = []
    server = None
    try:
        for i, benches in plan.items():
            s = serve_list[i]
            serve_argv = serve_base + to_flags(s)
            todo = []
            for j, b in benches:
                for k in range(args.num_runs):
                    name = f"serve{i}-bench{j}-run{k}.json"
                    path = os.path.abspath(os.path.join(args.output_dir, name))
                    argv = bench_base + to_flags(b) + bench_output_flags(bench_base, path)
                    todo.append((j, b, k, path, argv))
            if args.dry_run:
                print("serve:", shlex.join(serve_argv))
                for *_, argv in todo:
                    print("  bench:", shlex.join(argv))
                continue
            base = {f"serve_{k}": v for k, v in s.items()}
            pending = []
            for t in todo:
                j, b, k, path, _ = t
                if args.resume and _done(path):  # kept from the interrupted sweep
                    rows.append({**base, **{f"bench_{x}": v for x, v in b.items()}, "run": k,
                                 "status": "ok", **summarize(_load(path))})
                else:
                    pending.append(t)
            if not pending:
                continue
            server = Server(serve_argv, os.path.join(args.output_dir, f"serve{i}.log"),
                            args.server_ready_timeout)
            print(f"[sweep] serve {i}: {shlex.join(serve_argv)}", flush=True)
            why = server.start()
            if why is not None:
                print(f"[sweep] serve {i} failed: {why}", flush=True)
                for j, b, k, path, _ in pending:
                    rows.append({**base, **{f"bench_{x}": v for x, v in b.items()}, "run": k,
                                 "status": "server failed", "error": why})
                server.stop()
                server = None
                continue
            for j, b, k, path, argv in pending:
                print(f"[sweep]   bench {j} run {k}: {shlex.join(argv)}", flush=True)
                if os.path.exists(path):  # a stale result must not pass for this run's
                    os.remove(path)
                server.reset_prefix_cache()
                proc = subprocess.run(argv, capture_output=True, text=True)
                row = {**base, **{f"bench_{x}": v for x, v in b.items()}, "run": k}
                if proc.returncode != 0 or not _done(path):
                    row.update(status="bench failed",
                               error=(proc.stderr or proc.stdout)[-400:].replace("\n", " | "))
                else:
                    row.update(status="ok", **summarize(_load(path)))
                rows.append(row)
            server.stop()
            server = None
    except KeyboardInterrupt:
        print("[sweep] interrupted: servers stopped; --resume continues where this stopped",
              file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        if rows and not args.dry_run:
            path = write_summary(args.output_dir, rows)
            print(f"[sweep] {len(rows)} runs ({sum(r['status'] == 'ok' for r in rows)} ok): "
                  f"{path}")
    return 0


def _done(path: str) -> bool:
    try:
        _load(path)
        return True
    except (OSError, ValueError):
        return False


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- plots
def _label(row: dict, prefix: str) -> str:
    parts = [f"{k[len(prefix):]}={_fmt(v)}" for k, v in row.items()
             if k.startswith(prefix) and v is not None]
    return ", ".join(parts) or "default"


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_summary(args.output_dir) if r.get("status") == "ok"]
    if not rows:
        raise ValueError(f"{args.output_dir}/summary.csv has no successful runs to plot")
    var_x = args.var_x
    if var_x is None:
        bench_keys = [k for k in rows[0] if k.startswith("bench_")]
        var_x = bench_keys[0] if bench_keys else "request_throughput"
    elif var_x not in rows[0]:
        raise ValueError(f"--var-x {var_x!r} is not a column of summary.csv "
                         f"(columns: {', '.join(rows[0])})")
    curves: dict[str, list[dict]] = {}
    for r in rows:
        curves.setdefault(_label(r, "serve_"), []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, rs in curves.items():
        rs = sorted(rs, key=lambda r: (r.get(var_x) is None, r.get(var_x) or 0))
        xs = [r.get(var_x) for r in rs]
        axes[0].plot(xs, [r["output_throughput"] for r in rs], "o-", label=label)
        axes[1].plot([r["output_throughput"] for r in rs],
                     [r["e2e_latency_ms_p99"] for r in rs], "o-", label=label)
        axes[2].plot([r["output_throughput"] for r in rs],
                     [r["ttft_ms_median"] for r in rs], "o-", label=label)
    axes[0].set(xlabel=var_x, ylabel="output tokens/s", title="throughput")
    axes[1].set(xlabel="output tokens/s", ylabel="p99 e2e latency (ms)",
                title="latency vs throughput")
    axes[2].set(xlabel="output tokens/s", ylabel="median TTFT (ms)", title="TTFT vs throughput")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(args.output_dir, "plots")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "latency_vs_throughput.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(path)
    return 0


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points):
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _device_count(row: dict) -> float:
    n = 1.0
    for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        v = row.get(f"serve_{k}")
        n *= v if isinstance(v, (int, float)) and v else 1
    return n


def _user_count(row: dict) -> float:
    for k in ("bench_max_concurrency", "bench_num_prompts"):
        v = row.get(k)
        if isinstance(v, (int, float)) and v and not math.isinf(v):
            return v
    return row.get("completed") or 1.0


def run_plot_pareto(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_summary(args.output_dir) if r.get("status") == "ok"]
    if not rows:
        raise ValueError(f"{args.output_dir}/summary.csv has no successful runs to plot")
    pts = [(r["output_throughput"] / _user_count(r), r["output_throughput"] / _device_count(r))
           for r in rows]
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], label="runs")
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "r-o", label="pareto front")
    for i, r in enumerate(rows):
        ax.annotate(_label(r, "serve_") + " | " + _label(r, "bench_"), pts[i], fontsize=6)
    ax.set(xlabel="output tokens/s per user", ylabel="output tokens/s per device",
           title="Pareto front")
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = os.path.join(args.output_dir, "pareto")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "PARETO.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(path)
    return 0


def add_parser(bsub) -> None:
    sw = bsub.add_parser("sweep", help="parameter sweeps over live servers, and their plots")
    ssub = sw.add_subparsers(dest="sweep_command", required=True)
    s = ssub.add_parser("serve", help="run a bench command against fresh servers over the "
                        "Cartesian product of two parameter lists")
    s.add_argument("--serve-cmd", required=True, help="e.g. 'jaxinfer serve MODEL --port 8000'")
    s.add_argument("--bench-cmd", required=True,
                   help="e.g. 'jaxinfer bench serve --model M --base-url http://127.0.0.1:8000'")
    s.add_argument("--serve-params", default=None, help="JSON list of serve flag objects")
    s.add_argument("--bench-params", default=None, help="JSON list of bench flag objects")
    s.add_argument("-o", "--output-dir", required=True)
    s.add_argument("--num-runs", type=int, default=3)
    s.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    s.add_argument("--resume", action="store_true", help="skip runs whose result exists")
    s.add_argument("--link-vars", default=None,
                   help="SERVE_KEY=BENCH_KEY,...: only pairs where these are equal")
    s.add_argument("--server-ready-timeout", type=float, default=600.0)
    s.set_defaults(bench=lambda a: run_sweep(a))
    p = ssub.add_parser("plot", help="latency / throughput PNGs from a sweep's summary.csv")
    p.add_argument("output_dir")
    p.add_argument("--var-x", default=None, help="x of the throughput plot (a summary column)")
    p.set_defaults(bench=lambda a: run_plot(a))
    q = ssub.add_parser("plot_pareto", help="tokens/s per user vs per device, pareto front")
    q.add_argument("output_dir")
    q.set_defaults(bench=lambda a: run_plot_pareto(a))


if __name__ == "__main__":  # (for debugging: python -m jaxinfer.bench.sweep ...)
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="bench_command", required=True))
    ns = ap.parse_args()
    sys.exit(ns.bench(ns))

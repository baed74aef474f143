"""Two engines (two source trees, or two sets of engine options) paired in time, through
LLM.generate: what step_pair.py does for one compiled step, here for everything a user's run
pays per token (the step, the host's scheduling and input building, the core process's
messages, async scheduling's overlap or its absence).

Each side is a process with its own LLM (the engine core in a process of its own, the
default), its buckets compiled and fused first; the parent has them take turns running the
workload (a max_tokens=1 run for the TTFT, then the whole run; new prompts every turn), the
order alternating each round, with a pause between turns so that one side's leftover work
(pool threads spinning down) does not land on the other's. Reported: per side the median
decode ms per output token ((wall - TTFT) / (OUT - 1), as compare_cpu.py), and the median of
the rounds' B / A ratios.

Usage (a tree: a checkout with .venv; options: JSON of LLM keyword arguments):
    python benchmarks/engine_pair.py --a-tree /tmp/before --b-tree . --workload 1x128x128
    python benchmarks/engine_pair.py --a-options '{"async_scheduling": false}' \
        --b-options '{"async_scheduling": true}' --workload 32x128x128 --dtype float32
The JSON is a `before_after` result (A before, B after; docs/hooks/results.py renders it).

Compare sides in the same mode. With one side's core in its own process and the other's in
the caller's (enable_multiprocessing), the pairing is biased, for a cause not found: on the
Zen 5 VM (2026-11-29) it gave the in-process side 0.80 of the other's time at 32 x 128/128,
where separate runs of each (benchmarks/thread_cpu.py) were level (0.98), and 0.92 at batch
1 against 0.95 there. Two sides alike (the core in its own process both) gave 0.986 there,
its rounds 0.89-1.13: use enough rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_cpu import _cpu_name, wait_settled  # noqa: E402
from step_pair import rev, start_child  # noqa: E402


def child(args) -> None:
    """Build the engine, warm the workload's shapes and let the background thread fuse them,
    then answer "seed" lines with {"ttft": s, "wall": s} of one turn."""
    from jaxinfer import LLM, SamplingParams

    n, i, o = (int(x) for x in args.workload.lower().split("x"))
    llm = LLM(None, dtype=args.dtype, max_model_len=i + o, max_num_seqs=max(n, 8),
              warmup_buckets="all", **json.loads(args.options or "{}"))
    vocab = llm.llm_engine.model_config.vocab_size

    def prompts(seed: int):
        import random

        rng = random.Random(seed)
        return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(i)]}
                for _ in range(n)]

    def timed(max_tokens: int, seed: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
        batch = prompts(seed)
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(4, 1)
    wait_settled(llm)
    print("READY", flush=True)
    for line in sys.stdin:
        seed = int(line)
        ttft = timed(1, 2 * seed + 10)
        wall = timed(o, 2 * seed + 11)
        print(json.dumps({"ttft": ttft, "wall": wall}), flush=True)
    llm.shutdown()


def start(tree: str, options: str, args) -> subprocess.Popen:
    return start_child(tree, os.path.abspath(__file__),
                       ["--dtype", args.dtype, "--workload", args.workload, "--options", options],
                       f"engine ({options})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a-tree", default=".", help="source tree of side A (before)")
    ap.add_argument("--b-tree", default=".", help="source tree of side B (after)")
    ap.add_argument("--a-options", default="{}", help="side A's LLM options, JSON")
    ap.add_argument("--b-options", default="{}", help="side B's LLM options, JSON")
    ap.add_argument("--workload", default="1x128x128", help="N x IN x OUT")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between turns")
    ap.add_argument("--note", default="")
    ap.add_argument("--machine", default=None, help="the machine, in words (default: the "
                    "CPU's model name and count)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    for opt in (args.a_options, args.b_options):
        if not isinstance(json.loads(opt), dict):
            ap.error(f"options must be a JSON object, got {opt!r}")
    n, _, o = (int(x) for x in args.workload.lower().split("x"))
    sides = {"A": (args.a_tree, args.a_options), "B": (args.b_tree, args.b_options)}
    procs = {k: start(tree, opts, args) for k, (tree, opts) in sides.items()}
    ms = {"A": [], "B": []}
    ttft = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
            time.sleep(args.pause)
            p = procs[side]
            p.stdin.write(f"{r}\n")
            p.stdin.flush()
            got = json.loads(p.stdout.readline())
            ms[side].append(round(1e3 * (got["wall"] - got["ttft"]) / (o - 1), 3))
            ttft[side].append(round(got["ttft"], 4))
        print(f"round {r}: A {ms['A'][-1]:.2f}, B {ms['B'][-1]:.2f} ms/token, "
              f"B / A {ms['B'][-1] / ms['A'][-1]:.3f}", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    ratios = [b / a for a, b in zip(ms["A"], ms["B"])]
    ratio = statistics.median(ratios)
    label = f"{args.workload}, {args.dtype}"
    print(f"{label}: A {statistics.median(ms['A']):.2f}, B {statistics.median(ms['B']):.2f} "
          f"ms/token; paired B / A {ratio:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    describe = {k: f"{rev(tree)} {opts}" for k, (tree, opts) in sides.items()}
    rows = [{"measure": f"decode ms per output token, {label}", "unit": "ms",
             "before": ms["A"], "after": ms["B"], "paired_after_over_before": round(ratio, 4)},
            {"measure": f"batch TTFT, {label}", "unit": "s", "before": ttft["A"],
             "after": ttft["B"]}]
    result = {"benchmark": "before_after", "before_rev": describe["A"],
              "after_rev": describe["B"], "note": args.note,
              "machine": args.machine or f"{_cpu_name()}, {os.cpu_count()} CPUs",
              "commands": ["benchmarks/engine_pair.py " + " ".join(sys.argv[1:])],
              "rows": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

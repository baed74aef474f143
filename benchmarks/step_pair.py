"""Before / after of one compiled step, paired in time: two processes, one per source tree,
each with its step compiled, take turns running a few timed steps (the order alternating
each round), so both sides see the same minutes of the machine.

Why: on these 2-core VMs the memory bandwidth a process gets moves by up to ~30% within
minutes (a batch-1 float32 step of SmolLM2 went 10.8 -> 14.4 ms and back inside one
process), so before / after runs a minute apart measure the hour, not the change. Each
round's after / before ratio is taken from adjacent turns; the median ratio is reported.

An A/A run (one tree on both sides, Zen 5 VM, 2026-11-29, 10 rounds) gave 0.975 at decode-1
and 0.963 at decode-32, rounds 0.90-1.03: the side started second ran a few percent faster, for
a cause not found. Take changes of that size as unproven, or run the pair both ways round
(swap --before and --after): with bias b and effect e, the two runs give b e and b / e.

Usage (a tree: a checkout with .venv, e.g. `git worktree add /tmp/before REV` and a link to
the .venv):
    python benchmarks/step_pair.py --before /tmp/before --after . --dtype bfloat16 \
        --cases decode-1@256,decode-32@256 [--quantization gguf] \
        [--model benchmarks/configs/qwen3-0.6b] [--output-json F]
The JSON is a `before_after` result (docs/hooks/results.py renders it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args) -> None:
    """Compile the step for every case, then answer "case iters" lines with the median
    seconds of that many timed steps."""
    sys.path.insert(0, HERE)
    import jax

    import step_cost
    from jaxinfer import LLM
    from jaxinfer.runner.worker import resolve_block_size

    bs = resolve_block_size(None, jax.devices())
    model = {}
    if args.model and not any(f.endswith((".safetensors", ".gguf"))
                              for f in os.listdir(args.model)):
        model = dict(load_format="dummy", skip_tokenizer_init=True)  # a config: random weights
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64, **model,
              max_num_batched_tokens=2048, attention_backend="cpu", warmup=False,
              num_kv_blocks=64 * -(-1024 // bs) + 2, block_size=bs, step_compilation="whole",
              quantization=args.quantization, enable_multiprocessing=False)
    runner = llm.llm_engine.runner
    for case in args.cases.split(","):
        step_cost.time_case(runner, step_cost.CASES[case], 2)
    print("READY", flush=True)
    for line in sys.stdin:
        case, iters = line.split()
        s = step_cost.time_case(runner, step_cost.CASES[case], int(iters))
        print(json.dumps({"case": case, "s": s}), flush=True)


def start_child(tree: str, script: str, child_args: list[str], what: str) -> subprocess.Popen:
    """`script --child child_args` under `tree`'s .venv (else this Python) with `tree` on the
    path, once it has printed READY; its stdin and stdout are the turns' pipe."""
    tree = os.path.abspath(tree)
    python = os.path.join(tree, ".venv", "bin", "python")
    cmd = [python if os.path.exists(python) else sys.executable, script, "--child", *child_args]
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if line.strip() == "READY":
            return p
    raise RuntimeError(f"the {what} process of {tree} ended before it was ready")


def start(tree: str, args) -> subprocess.Popen:
    child_args = ["--dtype", args.dtype, "--cases", args.cases]
    if args.model:
        child_args += ["--model", os.path.abspath(args.model)]
    if args.quantization:
        child_args += ["--quantization", args.quantization]
    return start_child(tree, os.path.abspath(__file__), child_args, "step")


def take_turns(procs: dict, cases: list[str], rounds: int, iters: int) -> dict:
    """The two sides ({"before": p, "after": p}, children answering "case iters" lines) take
    turns, the order alternating each round; ms[case][side]: each turn's milliseconds. The
    children are closed at the end."""
    ms = {c: {"before": [], "after": []} for c in cases}
    for r in range(rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for case in cases:
            for side in order:
                p = procs[side]
                p.stdin.write(f"{case} {iters}\n")
                p.stdin.flush()
                ms[case][side].append(round(json.loads(p.stdout.readline())["s"] * 1e3, 3))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return ms


def rev(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return tree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="source tree of the 'before' side")
    ap.add_argument("--after", default=".", help="source tree of the 'after' side")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--cases", default="decode-1@256")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--model", default=None,
                    help="a model directory (default: the embedded SmolLM2); one holding only "
                         "a config.json gets random weights, e.g. benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="timed steps per turn")
    ap.add_argument("--note", default="")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.before:
        ap.error("--before is required")
    procs = {"before": start(args.before, args), "after": start(args.after, args)}
    cases = args.cases.split(",")
    ms = take_turns(procs, cases, args.rounds, args.iters)
    kind = args.dtype + (f", {args.quantization}" if args.quantization else "")
    if args.model:
        kind = f"{os.path.basename(os.path.normpath(args.model))} {kind}"
    rows = []
    for case in cases:
        b, a = ms[case]["before"], ms[case]["after"]
        ratio = statistics.median(y / x for x, y in zip(b, a))
        rows.append({"measure": f"whole step, {kind}, {case}", "unit": "ms", "before": b,
                     "after": a, "paired_after_over_before": round(ratio, 4)})
        print(f"{kind} {case}: before {statistics.median(b):.2f} ms, after "
              f"{statistics.median(a):.2f} ms, paired after / before {ratio:.3f} "
              f"(rounds {min(y / x for x, y in zip(b, a)):.3f}-"
              f"{max(y / x for x, y in zip(b, a)):.3f})", flush=True)
    result = {"benchmark": "before_after", "before_rev": rev(args.before),
              "after_rev": rev(args.after), "note": args.note,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "commands": ["benchmarks/step_pair.py " + " ".join(sys.argv[1:])], "rows": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

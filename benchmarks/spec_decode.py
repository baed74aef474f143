"""Speculative decoding on CPU: output tokens/s with and without n-gram speculation, on SmolLM2.

Two workloads, greedy, through LLM.generate (in-process core, warm: every bucket compiled
before timing):
- "repeat": the model is asked to repeat or lightly edit a given passage (prompt lookup can
  copy long runs from the prompt);
- "open": open-ended questions (little for prompt lookup to copy; the cost of verifying
  drafts that fail shows).
Each at batch 1 (latency-bound) and batch 8. Rounds alternate spec off / on (this machine's
noise is 10-20% from run to run); the median is reported. Also: acceptance rate, mean
acceptance length (1 + accepted / verify runs), accepted tokens per draft position, and
whether spec and non-spec outputs are token-identical.

Usage (from the repository root):

    PYTHONPATH=. python benchmarks/spec_decode.py [--k 4] [--rounds 3] \
        [--output-json benchmarks/results/spec_decode_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, members agreed to increase funding for the library, reduce spending on "
    "travel, and set aside a reserve for unexpected repairs to the town hall.",
    "To install the package, first create a virtual environment, then activate it and run "
    "the installer. If the installer reports a missing compiler, install the build tools for "
    "your platform and try again. Finally, run the test suite to check the installation.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    "Rivers carry water from mountains to the sea. Along the way they shape valleys, feed "
    "farmland, and provide homes for fish and birds. Many cities grew up beside rivers because "
    "they offered water, food, and a way to travel and trade.",
]
TASKS = ["Repeat the following text exactly, with no comments:\n\n{p}",
         "Rewrite the following text, changing only the first word to uppercase:\n\n{p}"]
QUESTIONS = ["What are three tips for staying healthy?", "Explain what a CPU does.",
             "Write a short poem about the ocean.", "Why is the sky blue?",
             "Give me a recipe idea for dinner.", "What is machine learning?",
             "Describe a cat to someone who has never seen one.", "How do airplanes fly?"]


def prompts(kind: str, n: int) -> list[list[dict]]:
    if kind == "repeat":
        texts = [TASKS[i % 2].format(p=PASSAGES[i % len(PASSAGES)]) for i in range(n)]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [[{"role": "user", "content": t}] for t in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--output-json", default="benchmarks/results/spec_decode_cpu.json")
    args = ap.parse_args()

    from jaxinfer import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    opts = dict(dtype="float32", max_model_len=1024, max_num_seqs=8,
                max_num_batched_tokens=512, enable_multiprocessing=False)
    engines = {"off": LLM(**opts), "ngram": LLM(speculative_config=spec, **opts)}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = []
    for kind in ("repeat", "open"):
        for bs in (int(b) for b in args.batches.split(",")):
            convs = prompts(kind, bs)
            times = {"off": [], "ngram": []}
            tokens, outs, stats0 = {}, {}, None
            for name, llm in engines.items():  # warm: compile what this batch needs
                llm.chat(convs, sp, use_tqdm=False)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    before = llm.llm_engine.get_stats()
                    t0 = time.perf_counter()
                    res = llm.chat(convs, sp, use_tqdm=False)
                    times[name].append(time.perf_counter() - t0)
                    tokens[name] = sum(len(r.outputs[0].token_ids) for r in res)
                    outs[name] = [r.outputs[0].token_ids for r in res]
                    if name == "ngram":
                        after = llm.llm_engine.get_stats()
                        stats0 = {k: (after[k] - before[k]) if not isinstance(after[k], list)
                                  else [a - b for a, b in zip(after[k], before[k])]
                                  for k in after if k.startswith("spec_decode")}
            off = statistics.median(times["off"])
            on = statistics.median(times["ngram"])
            drafts = stats0["spec_decode_num_drafts"]
            row = {
                "workload": kind, "batch": bs, "output_tokens": tokens["off"],
                "tok_per_s_off": tokens["off"] / off, "tok_per_s_ngram": tokens["ngram"] / on,
                "speedup": (tokens["ngram"] / on) / (tokens["off"] / off),
                "times_off_s": times["off"], "times_ngram_s": times["ngram"],
                "identical_outputs": outs["off"] == outs["ngram"],
                "draft_tokens": stats0["spec_decode_num_draft_tokens"],
                "accepted_tokens": stats0["spec_decode_num_accepted_tokens"],
                "acceptance_rate": (stats0["spec_decode_num_accepted_tokens"]
                                    / max(stats0["spec_decode_num_draft_tokens"], 1)),
                "mean_acceptance_length": 1 + stats0["spec_decode_num_accepted_tokens"]
                / max(drafts, 1),
                "accepted_per_position": stats0["spec_decode_num_accepted_tokens_per_pos"],
            }
            results.append(row)
            print(f"{kind:6s} batch {bs}: off {row['tok_per_s_off']:.1f} tok/s, ngram "
                  f"{row['tok_per_s_ngram']:.1f} tok/s ({row['speedup']:.2f}x), acceptance "
                  f"{row['acceptance_rate']:.2f}, mean length {row['mean_acceptance_length']:.2f}"
                  f", identical {row['identical_outputs']}", flush=True)
    for llm in engines.values():
        llm.shutdown()
    out = {"benchmark": "spec_decode", "model": "SmolLM2-135M-Instruct (float32)",
           "speculative_config": spec, "max_tokens": args.max_tokens, "rounds": args.rounds,
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count()},
           "command": "PYTHONPATH=. python benchmarks/spec_decode.py", "results": results}
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.output_json)


if __name__ == "__main__":
    main()

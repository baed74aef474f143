"""Mixture-of-experts step cost on this CPU against dense models (issue 31).

Three models of SmolLM2-135M's size (30 layers, hidden 576, vocabulary 49152, tied embeddings;
12 query / 4 KV heads of 48, so that 2 devices split them), random (dummy) float32 weights:
  moe          Mixtral layout: 8 experts of width 768, top-2 per token (active MLP width 1536)
  dense-active Llama, MLP width 1536: the same parameters per token as `moe`
  dense-total  Llama, MLP width 6144: the same parameters in all as `moe`
Each compiled engine step is timed (step_cost.py's builder: decode rows at a 256-token context,
a 512-token prefill) on one device with the default backend. With --ep, `moe` also runs on 2
forced CPU devices under tensor parallelism (each expert split) and expert parallelism (4
experts each), in subprocesses: informative only on a 2-core CPU, where ragged_dot lowers to a
masked product per expert and two fake devices share the two cores.
Usage: PYTHONPATH=. .venv/bin/python benchmarks/moe_step.py [--iters 5] [--ep]
           [--output-json benchmarks/results/moe_step_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

COMMON = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
          "num_attention_heads": 12, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 10000.0,
          "torch_dtype": "float32"}
MODELS = {
    "moe": {**COMMON, "architectures": ["MixtralForCausalLM"], "intermediate_size": 768,
            "num_local_experts": 8, "num_experts_per_tok": 2},
    "dense-active": {**COMMON, "architectures": ["LlamaForCausalLM"], "intermediate_size": 1536},
    "dense-total": {**COMMON, "architectures": ["LlamaForCausalLM"], "intermediate_size": 6144},
}
CASES = {"decode-1@256": [(1, 255)], "decode-8@256": [(1, 255)] * 8,
         "decode-32@256": [(1, 255)] * 32, "prefill-1x512": [(512, 0)]}


def model_dir(name: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"jaxinfer-moe-bench-{name}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODELS[name], f)
    return path


def time_model(name: str, iters: int, tp: int = 1, ep: bool = False) -> dict[str, float]:
    from step_cost import time_case

    from jaxinfer import LLM

    llm = LLM(model_dir(name), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512, warmup=False,
              num_kv_blocks=32 * 2 + 8, block_size=128, tensor_parallel_size=tp,
              enable_expert_parallel=ep, enable_multiprocessing=False)
    runner = llm.llm_engine.runner
    out = {case: time_case(runner, seqs, iters) for case, seqs in CASES.items()}
    out["attention_backend"] = llm.llm_engine.attention_backend
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ep", action="store_true", help="also TP=2 vs EP=2 on 2 forced devices")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output-json", default=os.path.join(HERE, "results", "moe_step_cpu.json"))
    args = ap.parse_args()
    if args.run:  # subprocess: "tp" or "ep" on 2 forced devices
        print(json.dumps(time_model("moe", args.iters, tp=2, ep=args.run == "ep")))
        return
    import jax

    from jaxinfer.bench.roofline import param_count
    from jaxinfer.config import ModelConfig

    rows = {}
    for name in MODELS:
        rows[name] = time_model(name, args.iters)
        p = param_count(ModelConfig.from_hf_dict(MODELS[name]))
        rows[name].update(params_total=p["total"], params_active=p["active"])
        print(name, json.dumps(rows[name]), flush=True)
    if args.ep:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "PYTHONPATH": ROOT}
        for mode in ("tp", "ep"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", mode,
                                  "--iters", str(args.iters)], env=env, cwd=ROOT,
                                 capture_output=True, text=True, check=True)
            rows[f"moe-{mode}2"] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"moe-{mode}2", json.dumps(rows[f"moe-{mode}2"]), flush=True)
    ratios = {case: {"moe_over_dense_active": rows["moe"][case] / rows["dense-active"][case],
                     "moe_over_dense_total": rows["moe"][case] / rows["dense-total"][case]}
              for case in CASES}
    result = {"benchmark": "moe_step", "models": MODELS, "step_s": rows, "ratios": ratios,
              "environment": {"jax": jax.__version__, "python": platform.python_version(),
                              "cpus": os.cpu_count()}}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    for case, r in ratios.items():
        print(f"{case:>14}: moe / dense-active {r['moe_over_dense_active']:.2f}x, "
              f"moe / dense-total {r['moe_over_dense_total']:.2f}x")


if __name__ == "__main__":
    main()

"""Multi-head latent attention (DeepSeek-V3) on this CPU: KV bytes per token against the full
K/V the same attention would cache unabsorbed, and the compiled step cost of a DeepSeek-V3-
shaped small model with random (dummy) float32 weights (issue 48).

Model `mla`: 8 layers (the first dense), hidden 1024, 16 heads, kv_lora_rank 512 +
qk_rope_head_dim 64 (the latent: 576 values per token and layer, DeepSeek-V3's own widths),
qk_nope 128, v 128, q LoRA 384; 32 routed experts of width 256 in 4 groups (the best 2
compete), top 4, 1 shared expert; vocabulary 32000. Each engine step is timed with step_cost.py's
builder (decode rows at a 256-token context; a 512-token prefill) on the default backend.
The compression ratios are also printed for the real DeepSeek-V3 / Kimi K2 widths (from their
configs: analytical, no weights).
Usage: PYTHONPATH=. .venv/bin/python benchmarks/mla_step.py [--iters 5]
           [--output-json benchmarks/results/mla_step_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MLA = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
       "intermediate_size": 2816, "moe_intermediate_size": 256, "num_hidden_layers": 8,
       "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 1,
       "n_routed_experts": 32, "kv_lora_rank": 512, "q_lora_rank": 384,
       "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 4,
       "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
       "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
       "tie_word_embeddings": False, "torch_dtype": "float32",
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# The released models' attention widths (their config.json values).
REAL = {"DeepSeek-V3 / R1": {"num_hidden_layers": 61, "num_attention_heads": 128,
                             "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                             "qk_nope_head_dim": 128, "v_head_dim": 128},
        "Kimi K2": {"num_hidden_layers": 61, "num_attention_heads": 64, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}}
CASES = {"decode-1@256": [(1, 255)], "decode-8@256": [(1, 255)] * 8,
         "decode-32@256": [(1, 255)] * 32, "prefill-1x512": [(512, 0)]}


def kv_bytes(c: dict, itemsize: int) -> dict[str, float]:
    """Per token, over all layers: the latent cache vs the unabsorbed per-head K and V."""
    latent = c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * itemsize
    full = c["num_hidden_layers"] * c["num_attention_heads"] * (
        c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * itemsize
    return {"latent_bytes": latent, "full_kv_bytes": full, "compression": full / latent}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--output-json", default=os.path.join(HERE, "results", "mla_step_cpu.json"))
    args = ap.parse_args()
    import jax

    from compare_cpu import _cpu_name
    from step_cost import time_case

    from jaxinfer import LLM
    from jaxinfer.bench.roofline import kv_bytes_per_token, param_count
    from jaxinfer.config import ModelConfig

    path = os.path.join(tempfile.gettempdir(), "jaxinfer-mla-bench")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MLA, f)
    cfg = ModelConfig.from_hf_dict(MLA)
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512, warmup=False,
              num_kv_blocks=32 * 2 + 8, block_size=128, enable_multiprocessing=False)
    runner = llm.llm_engine.runner
    k, v = runner.kv_caches[0]
    cache_bytes = sum(a.nbytes + b.nbytes for a, b in runner.kv_caches)
    per_token = cache_bytes // (runner.num_kv_blocks * runner.block_size)
    assert per_token == kv_bytes_per_token(cfg, 4), (per_token, kv_bytes_per_token(cfg, 4))
    steps = {}
    for case, seqs in CASES.items():
        steps[case] = time_case(runner, seqs, args.iters)
        print(f"{case:>14}: {steps[case] * 1e3:.1f} ms", flush=True)
    p = param_count(cfg)
    result = {
        "benchmark": "mla_step", "model": MLA,
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/mla_step.py --iters "
                   f"{args.iters}",
        "attention_backend": llm.llm_engine.attention_backend,
        "cache_arrays_per_layer": {"latent": list(k.shape), "v": list(v.shape)},
        "kv_bytes_per_token": {"measured_float32": per_token, **kv_bytes(MLA, 4)},
        "real_models_bf16": {name: kv_bytes(c, 2) for name, c in REAL.items()},
        "params_total": p["total"], "params_active": p["active"],
        "step_s": steps,
        "environment": {"jax": jax.__version__, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "cpu": _cpu_name()},
    }
    llm.shutdown()
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    kb = result["kv_bytes_per_token"]
    print(f"KV bytes / token (float32): latent {kb['latent_bytes']} vs full K/V "
          f"{kb['full_kv_bytes']}: {kb['compression']:.1f}x")
    for name, r in result["real_models_bf16"].items():
        print(f"{name} (bf16): latent {r['latent_bytes']} B vs {r['full_kv_bytes']} B per "
              f"token: {r['compression']:.1f}x")


if __name__ == "__main__":
    main()

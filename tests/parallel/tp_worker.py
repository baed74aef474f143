"""Runs in a subprocess with several fake CPU devices (XLA_FLAGS set by the caller): greedy
tokens and their logprobs for one model at one tensor-parallel size, as JSON on stdout.

    tp_worker.py MODEL_DIR TP MODE [PORT PROCESS_ID NUM_PROCESSES]   (the last three: multi-host)
"""

from __future__ import annotations

import json
import sys


def _mlp_weight(mlp):
    """Layer 0's gate/up weight: the dense MLP's, or a MoE block's stacked experts'."""
    return mlp["experts"]["gate_up_proj"] if "experts" in mlp else mlp["gate_up_proj"]["weight"]


def _collectives(runner) -> list[str]:
    import re

    text = ""
    for compiled in list(runner.compiled._compiled.values()):
        for ex in getattr(compiled, "layers", [compiled]):
            text += ex.as_text()
    return sorted(set(re.findall(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all)\(",
                                 text)))


def main():
    model_dir, tp, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import jax

    if len(sys.argv) > 4:
        import jaxinfer.distributed

        port, pid, nproc = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        jaxinfer.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc,
                                        process_id=pid)

    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxinfer import LLM, SamplingParams

    try:
        if mode == "smollm2":
            llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, max_model_len=64,
                      max_num_seqs=4, max_num_batched_tokens=32, warmup=False, num_kv_blocks=24,
                      enable_multiprocessing=False)  # the test reads the runner
        else:
            # A tight cache forces preemption; repeated prompts hit the prefix cache. Mode
            # "draft": speculative decoding with the model as its own draft model; "ep":
            # expert parallelism (a mixture-of-experts model's experts split by expert), with
            # async scheduling; "ep-draft": expert parallelism with the draft model; "sp":
            # sequence parallelism (the residual stream split by tokens between TP regions).
            spec = ({"method": "draft_model", "num_speculative_tokens": 3, "model": model_dir}
                    if mode in ("draft", "ep-draft") else None)
            llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, max_model_len=64,
                      max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                      num_kv_blocks=11 if spec else 9, block_size=8,
                      enable_multiprocessing=False, speculative_config=spec,
                      enable_expert_parallel=mode in ("ep", "ep-draft", "quant-ep"),
                      async_scheduling=mode == "ep",  # (EP with the host running ahead)
                      enable_sequence_parallelism=mode == "sp",
                      # "quant": fp8 weights quantized at load, scales sharded with them, and
                      # an fp8 KV cache
                      quantization="fp8" if mode.startswith("quant") else None,
                      kv_cache_dtype="fp8" if mode.startswith("quant") else "auto")
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
        return
    if jax.process_index() > 0:  # a multi-host worker: LLM() returned when process 0 stopped
        print(json.dumps({"worker": jax.process_index()}))
        return
    n = 4 if mode == "smollm2" else 8
    prompts = [[100 + i, 7, 300, 9000 + i, 12, 55, 13, 14, 15][: 3 + i % 6] * (1 + i % 3)
               for i in range(n)]
    prompts += prompts[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10 if n == 8 else 6,
                                       ignore_eos=True, logprobs=3), use_tqdm=False)
    eng = llm.llm_engine
    kv = eng.scheduler.kv
    from flax import nnx

    params = nnx.state(eng.engine_core.core.worker.model)  # (the weights the steps read)
    res = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                     o.outputs[0].logprobs)] for o in outs],
        "num_preemptions": eng.scheduler.num_preemptions,
        "prefix_hits": kv.prefix_cache_stats.hits,
        "leaked": kv.get_num_free_blocks() != eng.runner.num_kv_blocks - 1,
        "kv_shards": len(eng.runner.kv_caches[0][0].sharding.device_set),
        "kv_heads": eng.engine_core.core.model_config.num_key_value_heads,  # as built
        "param_shards": len(_mlp_weight(params["model"]["layers"][0]["mlp"])
                            .value.sharding.device_set),
        "expert_parallel": eng.engine_core.core.model_config.expert_parallel,
        "sequence_parallel": eng.engine_core.core.model_config.sequence_parallel,
        # The collectives in the compiled decoder layers (an all-gather: SP is in effect).
        "collectives": _collectives(eng.runner),
        "weight_dtype": str(_mlp_weight(params["model"]["layers"][1]["mlp"]).value.dtype),
        "expert_dtype": str(_mlp_weight(params["model"]["layers"][0]["mlp"])
                            .value.dtype),
        "spec": {k: v for k, v in eng.get_stats().items() if k.startswith("spec_decode")},
    }
    llm.shutdown()
    print(json.dumps(res))


if __name__ == "__main__":
    main()

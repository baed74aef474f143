"""Runs in a subprocess with several fake CPU devices (XLA_FLAGS set by the caller): greedy
tokens and logprobs at one pipeline x tensor parallel layout, with a cache tight enough to
preempt and a token budget small enough to chunk prefills, as JSON on stdout.

    pp_worker.py MODEL_DIR PP TP [PARTITION] [MODE] [PORT PROCESS_ID NUM_PROCESSES]
                 (MODE: tiny | smollm2; the last three: multi-host over jax.distributed)
"""

from __future__ import annotations

import json
import os
import sys


def _devices(x):
    import jax

    if not isinstance(x, jax.Array):
        return "remote"  # another process's stage: only its shapes are here
    return sorted(str(d) for d in x.sharding.device_set)


def main():
    model_dir, pp, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    partition = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    smollm2 = len(sys.argv) > 5 and sys.argv[5] == "smollm2"
    import jax

    if len(sys.argv) > 6:
        import jaxinfer.distributed

        port, pid, nproc = sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
        jaxinfer.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc,
                                        process_id=pid)

    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxinfer import LLM, SamplingParams

    try:
        llm = LLM(model_dir, dtype="float32", pipeline_parallel_size=pp,
                  tensor_parallel_size=tp, pp_layer_partition=partition, max_model_len=64,
                  max_num_seqs=4, max_num_batched_tokens=16, warmup=False,
                  num_kv_blocks=24 if smollm2 else 9, block_size=8,
                  step_compilation=os.environ.get("PP_STEP_COMPILATION", "auto"),
                  enable_expert_parallel=os.environ.get("PP_EXPERT_PARALLEL") == "1",
                  quantization=os.environ.get("PP_QUANTIZATION") or None,
                  enable_multiprocessing=False)  # the test reads the core
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
        return
    if jax.process_index() > 0:  # a multi-host worker: LLM() returned when process 0 stopped
        print(json.dumps({"worker": jax.process_index()}))
        return
    n = 4 if smollm2 else 8
    prompts = [[100 + i, 7, 300, 9000 + i, 12, 55, 13, 14, 15][: 3 + i % 6] * (1 + i % 3)
               for i in range(n)]
    prompts += prompts[:3]
    core = llm.llm_engine.engine_core.core
    seen_overlap = []
    if pp > 1:  # every dispatch: no request in two batches in flight
        step = core.step

        def checked():
            batches = core.batches_in_flight()
            ids = [r for b in batches for r in b]
            seen_overlap.append(len(ids) != len(set(ids)))
            return step()

        core.step = checked
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6 if smollm2 else 10,
                                       ignore_eos=True, logprobs=3), use_tqdm=False)
    kv = core.scheduler.kv
    runner = core.runner
    res = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                     o.outputs[0].logprobs)] for o in outs],
        "num_preemptions": core.scheduler.num_preemptions,
        "leaked": core.leak_report(),
        "partition": core.pp_partition,
        "expert_parallel": core.model_config.expert_parallel,
        "step_compilation": core.runner.step_compilation,
        "max_in_flight": core.max_batches_in_flight,
        "overlap": any(seen_overlap),
        "stage_devices": [_devices(jax.tree.leaves(st)[0]) for st in runner.params]
        if pp > 1 else [],
        "kv_devices": [_devices(kv_s[0][0]) for kv_s in runner.kv_caches] if pp > 1 else [],
        "stage_has": ([sorted(k for k in ("embed_tokens", "norm", "lm_head", "tied_embed")
                              if st.get(k) is not None and len(jax.tree.leaves(st[k])))
                       for st in runner.params] if pp > 1 else []),
    }
    llm.shutdown()
    print(json.dumps(res))


if __name__ == "__main__":
    main()

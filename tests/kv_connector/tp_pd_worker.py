"""Run with 2 forced CPU devices: P/D between a TP=2 and a TP=1 engine (both ways) in one
process; prints JSON: the outputs equal the colocated TP=1 ones, nothing leaked."""

import json
import sys
import time

from jaxinfer import LLM, SamplingParams


def main():
    model = sys.argv[1]
    opts = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                min_token_bucket=32, block_size=8, warmup=False, enable_multiprocessing=False,
                num_kv_blocks=80)
    prompts = [{"prompt_token_ids": [1000 + 37 * i + j for j in range(n)]}
               for i, n in enumerate((5, 16, 29, 61))]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = LLM(model, **opts)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy)]
    ref.shutdown()
    result = {}
    for tp_p, tp_d in ((2, 1), (1, 2)):
        p = LLM(model, tensor_parallel_size=tp_p, kv_transfer_config={
            "kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"}, **opts)
        d = LLM(model, tensor_parallel_size=tp_d, kv_transfer_config={
            "kv_connector": "JaxTransferConnector", "kv_role": "kv_consumer"}, **opts)
        pre = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        ktps = [o.kv_transfer_params for o in p.generate(prompts, pre)]
        outs = d.generate(prompts, [SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True,
                                                   extra_args={"kv_transfer_params": k})
                                    for k in ktps])
        cores = [x.llm_engine.engine_core.core for x in (p, d)]
        end = time.time() + 30
        while any(c.has_work() for c in cores) and time.time() < end:
            for c in cores:
                if c.has_work():
                    c.step()
        result[f"{tp_p}->{tp_d}"] = {
            "equal": [o.outputs[0].token_ids for o in outs] == want,
            "loaded": d.llm_engine.call_utility("get_stats")["kv_connector_loaded_tokens"],
            "leaks": [c.leak_report() for c in cores]}
        p.shutdown()
        d.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Run in a subprocess with 4 fake CPU devices: greedy tokens and logprobs of the base model
and two adapters at tensor_parallel_size argv[2] (tests/lora/test_lora.py)."""

import json
import sys

from jaxinfer import LLM, LoRARequest, SamplingParams

model, tp, a1, a2 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
llm = LLM(model, dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
          warmup=False, num_kv_blocks=40, tensor_parallel_size=tp, enable_lora=True,
          max_loras=2, max_lora_rank=8, enable_multiprocessing=False, compilation_cache_dir="")
loras = [None, LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2), LoRARequest("a1", 1, a1)]
prompts = ["The capital of France is", "def f(x):", "Once upon a time", "1, 2, 3,"]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                            logprobs=1), lora_request=loras, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                               o.outputs[0].token_ids)]
                               for o in outs]}))
llm.shutdown()

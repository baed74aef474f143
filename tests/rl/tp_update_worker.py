"""Run in a subprocess with 4 fake CPU devices: greedy tokens at tensor_parallel_size
argv[2] before and after update_weights with the checkpoint of folder argv[3] as numpy
arrays (tests/rl/test_rl.py), and whether any step recompiled."""

import json
import sys

from jaxinfer import LLM, SamplingParams
from jaxinfer.models.loader import _iter_tensors, _safetensors_index

model, tp, updated = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model, dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
          warmup=False, num_kv_blocks=40, tensor_parallel_size=tp,
          enable_multiprocessing=False, compilation_cache_dir="")
ids = json.loads(sys.argv[4])
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens():
    return llm.generate([{"prompt_token_ids": ids}], greedy,
                        use_tqdm=False)[0].outputs[0].token_ids


before = tokens()
n = llm.llm_engine.engine_core.core.runner.num_compilations
files = _safetensors_index(updated)
llm.update_weights(dict(_iter_tensors(files, list(files))))
after = tokens()
print(json.dumps({"before": before, "after": after,
                  "recompiled": llm.llm_engine.engine_core.core.runner.num_compilations != n}))
llm.shutdown()

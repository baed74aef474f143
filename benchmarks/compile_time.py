"""Per-bucket lower / compile seconds of the embedded SmolLM2 in one process (no compile cache),
printed as JSON: run it in two trees alternately to see what a change does to compile time.

    JAXINFER_BACKGROUND_COMPILE=0 PYTHONPATH=. .venv/bin/python benchmarks/compile_time.py
"""

import json
import time

from jaxinfer import LLM
from jaxinfer.runner.step_inputs import PLAIN, StepFeatures

llm = LLM(None, warmup=False, compilation_cache_dir="", enable_multiprocessing=False, max_model_len=1024, max_num_seqs=64)
r = llm.llm_engine.engine_core.core.runner
out = {}
for (t, rr, f) in [(1, 1, PLAIN), (8, 8, PLAIN), (64, 64, PLAIN), (512, 64, PLAIN), (64, 64, StepFeatures(logprobs=True, penalties=True))]:
    lo0 = time.perf_counter()
    lowered = r._lower(t, rr, f)
    lo1 = time.perf_counter()
    lowered.compile()
    out[f"{t}x{rr}-{f}"] = (round(lo1 - lo0, 3), round(time.perf_counter() - lo1, 3))
print(json.dumps(out))
llm.shutdown()

"""After warm-up, serving further workloads compiles nothing."""

from __future__ import annotations

import jax
from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir


def test_no_compilation_after_warmup(tmp_path, smollm2_dir):
    make_tiny_model_dir(tmp_path, "qwen3", smollm2_dir, head_dim=32)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, warmup=True, num_kv_blocks=60,
              compilation_cache_dir="")
    runner = llm.llm_engine.runner
    assert runner.num_compilations == len(runner.buckets.all_pairs()) > 4
    events = []

    def listener(name, *args, **kwargs):
        if "compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        llm.generate(["a b c", "hello " * 20, "x"], SamplingParams(temperature=0, max_tokens=9),
                     use_tqdm=False)
        llm.generate([f"prompt {i} " * (i + 1) for i in range(7)],
                     SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=17,
                                    logprobs=2, presence_penalty=0.5), use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert runner.num_compilations == len(runner.buckets.all_pairs())
    assert events == [], events
    assert_no_leaks(llm)

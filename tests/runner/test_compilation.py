"""After warm-up, serving further workloads compiles nothing."""

from __future__ import annotations

import jax
from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir


def test_no_compilation_after_warmup(tmp_path, smollm2_dir, caplog):
    """Warm-up compiles the plain variant of every bucket: greedy and random sampling (top-p,
    seeds) then compile nothing. Variants (logprobs, penalties) compile once on first use, with
    a log line, and never again."""
    import logging

    from jaxinfer.runner.step_inputs import PLAIN

    make_tiny_model_dir(tmp_path, "qwen3", smollm2_dir, head_dim=32)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, warmup=True, warmup_buckets="all", num_kv_blocks=60,
              compilation_cache_dir="", enable_multiprocessing=False)  # watches the runner
    runner = llm.llm_engine.runner
    assert runner.num_compilations == len(runner.buckets.all_pairs()) > 4
    events = []

    def listener(name, *args, **kwargs):
        if "compile" in name:
            events.append(name)

    variant_workload = ([f"prompt {i} " * (i + 1) for i in range(7)],
                        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=17,
                                       logprobs=2, presence_penalty=0.5))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        llm.generate(["a b c", "hello " * 20, "x"], SamplingParams(temperature=0, max_tokens=9),
                     use_tqdm=False)
        llm.generate(["a b c", "hello " * 20, "x", "y z"],
                     SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=9),
                     use_tqdm=False)
        assert events == [], events
        assert runner.num_compilations == len(runner.buckets.all_pairs())
        with caplog.at_level(logging.INFO, logger="jaxinfer.runner.compiled_steps"):
            llm.generate(*variant_workload, use_tqdm=False)
        variants = [k for k in runner.compiled.keys() if k[2] != PLAIN]
        assert variants and all(k[2].logprobs and k[2].penalties for k in variants)
        assert runner.num_compilations == len(runner.buckets.all_pairs()) + len(variants)
        assert sum("on first use" in r.message for r in caplog.records) == len(variants)
        events.clear()
        llm.generate(*variant_workload, use_tqdm=False)
        assert events == [], events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert_no_leaks(llm)


def _aliased_params(hlo: str) -> set[int]:
    import re

    alias = re.search(r"input_output_alias=\{([^\n]*?)\}, entry", hlo).group(1)
    return {int(p) for p in re.findall(r"\((\d+), \{\}", alias)}


def _kv_copies(hlo: str, kv_shape: str) -> list[str]:
    import re

    assert kv_shape in hlo  # the pattern would have matched a copy, had there been one
    return [line for line in hlo.split("\n")
            if re.search(r"= " + re.escape(kv_shape) + r"\{[0-9,]*\} copy\(", line)]


def test_donated_step_never_copies_the_kv_cache(tmp_path, smollm2_dir):
    """From the compiled HLO: every KV array (and the sampler state) is aliased input->output,
    and no copy instruction produces a KV-cache-shaped array; a whole step, and each
    executable of a layer-wise one (a layer aliases its own K and V, the tail the sampler
    state)."""
    from jaxinfer.runner.step_inputs import StepFeatures

    make_tiny_model_dir(tmp_path, "llama", smollm2_dir)
    kv_shape = "f32[10,16,2,16]"
    for mode in ("whole", "layerwise"):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=16, warmup=False, num_kv_blocks=10, block_size=16,
                  compilation_cache_dir="", enable_multiprocessing=False,
                  step_compilation=mode)
        runner = llm.llm_engine.runner
        assert runner.step_compilation == mode
        step = runner.compiled.compile(16, 2, StepFeatures(penalties=True))
        num_sampler = len(jax.tree.leaves(runner.state.sampler))
        if mode == "whole":
            hlo = step.as_text()
            num_params = len(jax.tree.leaves(runner.state.params))
            donated = len(jax.tree.leaves(runner.kv_caches)) + num_sampler
            assert _aliased_params(hlo) == set(range(num_params, num_params + donated))
            assert _kv_copies(hlo, kv_shape) == []
            llm.shutdown()
            continue
        (layer,) = step.layers  # (the model's two layers: one run, one executable)
        hlo = layer.as_text()
        n = sum(len(lv) for lv in runner.program.lm.layer_leaves)
        # (leaves, x, cos, sin, [(k, v), (k, v)], md): the four caches follow x, cos, sin
        assert _aliased_params(hlo) == set(range(n + 3, n + 7))
        assert _kv_copies(hlo, kv_shape) == []
        tail = step.tail.as_text()  # (shell state, no draft, sampler state, ...)
        # (the sampler state follows the shell's leaves, all read by the tail: the tied
        # embedding is held once, as the packed LM head)
        used = len(jax.tree.leaves(runner.program.lm.shell_state))
        assert _aliased_params(tail) == set(range(used, used + num_sampler))
        llm.shutdown()

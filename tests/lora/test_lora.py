"""Multi-LoRA serving against HF transformers + peft in float64: every adapter's greedy tokens,
adapters mixed with the base model in one batch, more adapters than device slots, no
recompilation when slots are rewritten, prefix caching keyed on the adapter, adapters refused
by name (the engine serving on), a mixture-of-experts base, and tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer import LLM, LoRARequest, SamplingParams
from tests.engine.conftest import assert_no_leaks, hf_greedy, make_tiny_model_dir
from tests.lora.helpers import edit_config, make_adapter

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village",
           "1, 2, 3, 4,"]
N = 10
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
            warmup=False, num_kv_blocks=48, block_size=16, enable_multiprocessing=False,
            compilation_cache_dir="")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    """A tiny Llama, three adapters over it (all seven projections r=8; q/v r=4 saved in
    bfloat16; the MLP at r=16 with rsLoRA) and their float64 references: {name:
    (LoRARequest, {prompt: ids})}."""
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    hf = make_tiny_model_dir(base, "llama", smollm2_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    ids = {p: tok.encode(p, add_special_tokens=False).ids for p in PROMPTS}
    specs = {"a1": dict(targets=ALL, r=8, alpha=16, seed=1),
             "a2": dict(targets=["q_proj", "v_proj"], r=4, alpha=8, seed=2, bf16=True),
             "a3": dict(targets=["gate_proj", "up_proj", "down_proj"], r=16, alpha=32,
                        rslora=True, seed=3)}
    adapters = {}
    for i, (name, spec) in enumerate(specs.items()):
        ref = make_adapter(hf, str(root / name), **spec)
        adapters[name] = (LoRARequest(name, i + 1, str(root / name)),
                          {p: hf_greedy(ref, ids[p], N) for p in PROMPTS})
    hf64 = hf.double()
    adapters[None] = (None, {p: hf_greedy(hf64, ids[p], N) for p in PROMPTS})
    return base, root, hf, adapters


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny[0], enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                 **OPTS)
    yield engine
    engine.shutdown()


def _tokens(llm, prompts, loras):
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_and_mixed_batches_equal_peft(tiny, llm):
    _, _, _, adapters = tiny
    # the adapters change the output (a test of nothing otherwise)
    assert all(adapters[n][1] != adapters[None][1] for n in ("a1", "a2", "a3"))
    for name, (lora, refs) in adapters.items():  # each alone
        assert _tokens(llm, PROMPTS, lora) == [refs[p] for p in PROMPTS], name
    # One batch: the base and three adapters (more than the two device slots), twice over.
    runs = [(p, n) for n in (None, "a1", "a2", "a3") for p in PROMPTS[:2]]
    prompts = [p for p, _ in runs]
    loras = [adapters[n][0] for _, n in runs]
    want = [adapters[n][1][p] for p, n in runs]
    runner = llm.llm_engine.runner
    assert _tokens(llm, prompts, loras) == want
    compiled, writes = runner.num_compilations, runner.lora.num_slot_writes
    assert _tokens(llm, prompts[::-1], loras[::-1]) == want[::-1]
    assert runner.lora.num_slot_writes > writes  # slots were rewritten ...
    assert runner.num_compilations == compiled  # ... and nothing recompiled
    assert len(runner.lora.cpu) <= 2  # (max_cpu_loras: evicted adapters were read again)
    assert_no_leaks(llm)


def test_prefix_cache_is_keyed_on_the_adapter(tiny, llm):
    _, _, _, adapters = tiny
    prompt = "A long shared prefix that fills more than one KV block of sixteen tokens, " * 2
    core = llm.llm_engine
    hits = lambda: core.get_stats()["prefix_cache_hits"]  # noqa: E731
    a1 = adapters["a1"][0]
    base = _tokens(llm, [prompt], None)
    h0 = hits()
    with_a1 = _tokens(llm, [prompt], a1)
    assert hits() == h0  # the base model's blocks are not the adapter's
    assert _tokens(llm, [prompt], a1) == with_a1 and hits() > h0  # its own are reused
    assert _tokens(llm, [prompt], None) == base
    assert_no_leaks(llm)


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(tiny, llm):
    base_dir, root, hf, adapters = tiny
    bad = {}

    def variant(name, **kw):
        path = str(root / f"bad-{name}")
        make_adapter(hf, path, **{"targets": ["q_proj"], "r": 4, **kw})
        bad[name] = path
        return path

    variant("dora", use_dora=True)
    variant("save", modules_to_save=["lm_head"])
    variant("rank", r=32)
    variant("embed", targets=["embed_tokens"])
    edit_config(variant("alpha"), lora_alpha="x")
    corrupt = variant("corrupt")
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(40)
    cases = {"dora": "DoRA", "save": "modules_to_save", "rank": "max_lora_rank=16",
             "embed": "embedding", "alpha": "lora_alpha", "corrupt": "cannot read"}
    for i, (name, reason) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=reason) as e:
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest(f"bad-{name}", 100 + i,
                                                                        bad[name]))
        assert f"bad-{name}" in str(e.value)
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("gone", 120, "/nonexistent"))
    a1 = adapters["a1"][0]
    assert _tokens(llm, PROMPTS[:1], a1) == [adapters["a1"][1][PROMPTS[0]]]  # still serving
    with pytest.raises(ValueError, match="already adapter 'a1'"):
        llm.generate(PROMPTS[:1], GREEDY,
                     lora_request=LoRARequest("other", a1.lora_int_id, bad["rank"]))
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLM(base_dir, **OPTS).generate(PROMPTS[:1], GREEDY, lora_request=a1)


def test_moe_base_attention_adapters_match_and_expert_targets_are_refused(tmp_path,
                                                                          smollm2_dir):
    """(The reference in float32: HF's MoE layers have no float64 path.)"""
    hf = make_tiny_model_dir(tmp_path / "base", "qwen3_moe", smollm2_dir, head_dim=16,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             mlp_only_layers=[1])
    ref = make_adapter(hf, str(tmp_path / "attn"), targets=["q_proj", "k_proj", "v_proj",
                                                            "o_proj"], r=4, seed=5,
                       float64=False)
    make_adapter(hf, str(tmp_path / "experts"), targets=["gate_proj", "up_proj"], r=4)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "base" / "tokenizer.json"))
    ids = tok.encode(PROMPTS[0], add_special_tokens=False).ids
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=8, **OPTS)
    got = _tokens(llm, PROMPTS[:1], LoRARequest("attn", 1, str(tmp_path / "attn")))
    assert got == [hf_greedy(ref, ids, N)]
    with pytest.raises(ValueError, match="mixture-of-experts block.s fused experts"):
        llm.generate(PROMPTS[:1], GREEDY,
                     lora_request=LoRARequest("experts", 2, str(tmp_path / "experts")))
    # (older PEFT layouts: one module per expert)
    from safetensors.numpy import save_file

    per_expert = tmp_path / "per-expert"
    per_expert.mkdir()
    (per_expert / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file({f"base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_{ab}.weight":
               np.zeros(shape, np.float32) for ab, shape in (("A", (4, 64)), ("B", (32, 4)))},
              str(per_expert / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="mixture-of-experts block"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("pe", 3, str(per_expert)))
    assert_no_leaks(llm)
    llm.shutdown()


def test_tensor_parallel_adapters_equal_one_device(tmp_path, smollm2_dir):
    """TP=2 over a model with one KV head (replicated per device): the adapters' k / v parts
    are replicated the same way."""
    hf = make_tiny_model_dir(tmp_path / "base", "llama", smollm2_dir, num_key_value_heads=1)
    make_adapter(hf, str(tmp_path / "a1"), targets=ALL, r=8, seed=1)
    make_adapter(hf, str(tmp_path / "a2"), targets=["k_proj", "v_proj", "down_proj"], r=4,
                 seed=2)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    got = []
    for tp in (1, 2):
        out = subprocess.run([sys.executable, "tests/lora/tp_lora_worker.py",
                              str(tmp_path / "base"), str(tp), str(tmp_path / "a1"),
                              str(tmp_path / "a2")], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert got[0]["tokens"] == got[1]["tokens"]
    np.testing.assert_allclose(np.concatenate(got[0]["logprobs"]),
                               np.concatenate(got[1]["logprobs"]), atol=2e-4)
    assert len({tuple(t) for t in got[0]["tokens"]}) > 1


def test_async_scheduling_chunked_prefill_preemption_and_grammars_with_adapters(tiny):
    """Async scheduling, 8-token prefill chunks and a cache tight enough to preempt: every
    adapter's tokens are still HF's; a grammar constrains an adapter's request too."""
    base, _, _, adapters = tiny
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, async_scheduling=True,
              **{**OPTS, "num_kv_blocks": 7, "max_num_batched_tokens": 8, "block_size": 8,
                 "max_model_len": 48})
    runs = [(p, n) for n in ("a1", "a2", "a3", None) for p in PROMPTS[:2]][1:-1]
    got = _tokens(llm, [p for p, _ in runs], [adapters[n][0] for _, n in runs])
    assert got == [adapters[n][1][p] for p, n in runs]
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    from jaxinfer import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    out = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0.8, seed=1, max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=choices)),
        lora_request=adapters["a1"][0], use_tqdm=False)
    assert out[0].outputs[0].text in choices
    assert_no_leaks(llm)
    llm.shutdown()


def test_data_parallel_ranks_all_serve_the_adapters(tiny):
    """Two engine-core processes: an adapter reaches both ranks (requests spread over them
    return HF's tokens), and is removed from both."""
    base, _, _, adapters = tiny
    llm = LLM(base, enable_lora=True, max_lora_rank=16, data_parallel_size=2,
              data_parallel_prefix_affinity=False,
              **{**OPTS, "enable_multiprocessing": None})
    a1 = adapters["a1"][0]
    got = _tokens(llm, PROMPTS * 2, [a1, None] * len(PROMPTS))
    assert got == [adapters[n][1][p] for p, n in zip(PROMPTS * 2, ["a1", None] * 4)]
    per_rank = llm.llm_engine.get_stats()["per_rank"]
    assert all(r["num_steps"] > 0 for r in per_rank)  # (both ranks ran requests)
    assert llm.llm_engine.list_loras() == {a1.lora_int_id}
    assert llm.llm_engine.remove_lora(a1.lora_int_id)
    assert llm.llm_engine.list_loras() == set()
    llm.shutdown()


@pytest.mark.parametrize("arch,extra", [
    ("qwen3", {"head_dim": 32}),
    ("gemma3", {"head_dim": 16, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]})])
def test_other_families_equal_peft(tmp_path, smollm2_dir, arch, extra):
    """Qwen3 (q/k norms after the adapted q/k projections) and Gemma 3 (its own decoder
    layer, gelu MLP) with an adapter on all seven projections."""
    hf = make_tiny_model_dir(tmp_path / "base", arch, smollm2_dir, **extra)
    ref = make_adapter(hf, str(tmp_path / "a"), targets=ALL, r=8, seed=7)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "base" / "tokenizer.json"))
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=8, **OPTS)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    got = _tokens(llm, PROMPTS[:2], lora)
    want = [hf_greedy(ref, tok.encode(p, add_special_tokens=False).ids, N) for p in PROMPTS[:2]]
    assert got == want
    llm.shutdown()

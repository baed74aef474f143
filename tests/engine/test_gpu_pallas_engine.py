"""On a CUDA GPU: the engine with the compiled Pallas kernel (not interpret mode) gives HF
transformers' greedy tokens (float32), for head dims 64 and 128, with chunked prefill and a
batch of ragged prompts; whole and layer-wise step programs, async scheduling and n-gram
speculative decoding (the step contract's variants). Token-id prompts and no tokenizer, so it
needs neither SmolLM2 nor a tokenizer file (a bare GPU machine has neither)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.engine.conftest import assert_no_leaks, hf_greedy

torch = pytest.importorskip("torch")

N_TOKENS = 12


def _tiny_llama(path, hidden: int, heads: int, kv_heads: int, arch: str = "llama", **extra):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "gemma3": transformers.Gemma3TextConfig, "gpt_oss": transformers.GptOssConfig,
           "deepseek_v3": transformers.DeepseekV3Config}[arch]
    cfg = cls(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
              num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(zlib.crc32(f"gpu-{arch}-{hidden}-{heads}".encode()))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "gpt_oss":  # HF before ~5.2x hard-coded gpt-oss's 7.0 / 1.702 over the config's
        for layer in hf.model.layers:
            layer.mlp.experts.limit = getattr(cfg, "swiglu_limit", 7.0)
            layer.mlp.experts.alpha = getattr(cfg, "swiglu_alpha", 1.702)
    with torch.no_grad():  # peaky logits, so greedy has clear winners
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "norm" not in name:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,heads,kv_heads,extra", [
    (256, 4, 2, dict(step_compilation="whole")),
    (512, 4, 1, dict(step_compilation="whole")),
    (256, 4, 2, dict(step_compilation="layerwise")),
    (256, 4, 2, dict(step_compilation="whole", async_scheduling=True)),
    (256, 4, 2, dict(step_compilation="whole",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
], ids=["d64-whole", "d128-whole", "d64-layerwise", "d64-async", "d64-ngram-spec"])
def test_pallas_native_engine_matches_hf(tmp_path, hidden, heads, kv_heads, extra):
    import jax

    assert jax.default_backend() == "gpu"
    hf = _tiny_llama(tmp_path, hidden, heads, kv_heads)
    rng = np.random.default_rng(hidden)
    # Ragged prompts, two longer than the 32-token budget (chunked prefill over several steps).
    prompts = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (5, 17, 40, 3, 70, 9)]
    _greedy_matches_hf(tmp_path, hf, prompts, **extra)


def _greedy_matches_hf(path, hf, prompts, **extra):
    """The engine with the native kernel (4 sequences, a 32-token budget: chunked prefill)
    gives HF's greedy tokens for each prompt, and leaves no block behind."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=32, warmup=False, num_kv_blocks=64,
              attention_backend="pallas", skip_tokenizer_init=True,
              enable_multiprocessing=False, **extra)
    assert llm.llm_engine.attention_backend == "pallas"
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, N_TOKENS), len(p)
    assert_no_leaks(llm)
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_token_controls_and_processors_on_gpu(tmp_path, backend):
    """The step's newer features compiled for CUDA: logit_bias (bans, forces), allowed_token_ids
    and bad-word rows in the token bitmask, a custom logits processor, beside a plain row."""
    import jax

    from jaxinfer import LLM, SamplingParams
    from tests.engine.logits_processor_examples import BanToken

    assert jax.default_backend() == "gpu"
    _tiny_llama(tmp_path, 256, 4, 2)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, warmup=False, num_kv_blocks=64,
              attention_backend=backend, skip_tokenizer_init=True, enable_multiprocessing=False,
              logits_processors=[BanToken])
    prompt = {"prompt_token_ids": [5, 17, 40, 3, 70, 9]}

    def run(**kw):
        p = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, **kw)
        return list(llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids)

    base = run()
    assert base[0] not in run(logit_bias={base[0]: -100.0})
    assert run(logit_bias={300: 100.0}) == [300] * N_TOKENS
    assert set(run(allowed_token_ids=[7, 8, 9])) <= {7, 8, 9}
    assert base[0] not in run(bad_words_token_ids=[[base[0]]])
    assert base[0] not in run(extra_args={"ban_token": base[0]})
    assert run() == base
    assert_no_leaks(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,extra", [
    ("qwen3_moe", dict(head_dim=64, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=128, norm_topk_prob=False)),
    ("gemma3", dict(head_dim=64, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"])),
    # gpt-oss: attention sinks in the kernel, alternating windows, biased stacked experts
    ("gpt_oss", dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                     swiglu_limit=1.0)),
    # DeepSeek-V3: the latent cache (128 + 64 wide, one KV head) as keys and values
    ("deepseek_v3", dict(head_dim=64, kv_lora_rank=128, q_lora_rank=96, qk_rope_head_dim=64,
                         qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_group=2,
                         topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                         moe_intermediate_size=128, first_k_dense_replace=1)),
], ids=["qwen3-moe", "gemma3-window", "gpt-oss", "deepseek-v3-mla"])
def test_other_families_on_gpu(tmp_path, arch, extra):
    """A mixture-of-experts family (grouped expert matmuls), Gemma 3's sliding-window layers
    (the kernel's window mask, prompts longer than the window), gpt-oss (sinks) and DeepSeek-V3
    (latent attention) with the native kernel."""
    import jax

    assert jax.default_backend() == "gpu"
    kv_heads = 4 if arch == "deepseek_v3" else 2  # (HF's MLA expands K/V to every head)
    hf = _tiny_llama(tmp_path, 256, 4, kv_heads, arch=arch, **extra)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (5, 40, 70)]
    _greedy_matches_hf(tmp_path, hf, prompts)


@pytest.mark.gpu
def test_deepseek_mtp_drafts_on_gpu(tmp_path):
    """DeepSeek-V3's MTP layer drafting inside the step with the native kernel (its own
    latent cache): greedy tokens still HF's target's."""
    import jax

    from tests.spec_decode.test_mtp import add_mtp_layer

    assert jax.default_backend() == "gpu"
    hf = _tiny_llama(tmp_path, 256, 4, 4, arch="deepseek_v3", head_dim=64, kv_lora_rank=128,
                     q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                     n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                     n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1)
    rng = np.random.default_rng(11)
    w = lambda *s: 0.1 * rng.standard_normal(s)  # noqa: E731
    add_mtp_layer(tmp_path, hf, {"enorm.weight": 1 + w(256), "hnorm.weight": 1 + w(256),
                                 "eh_proj.weight": w(256, 512),
                                 "shared_head.norm.weight": 1 + w(256)})
    prompts = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (5, 40, 70)]
    _greedy_matches_hf(tmp_path, hf, prompts, step_compilation="whole",
                       speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.gpu
def test_lora_adapters_on_gpu(tmp_path):
    """Two PEFT adapters and the base model in one batch with the native kernel, against HF +
    peft in float64 (the adapters' slot matmuls compiled for CUDA)."""
    import jax

    from jaxinfer import LLM, LoRARequest, SamplingParams
    from tests.lora.helpers import make_adapter

    pytest.importorskip("peft")
    assert jax.default_backend() == "gpu"
    hf = _tiny_llama(tmp_path / "base", 256, 4, 2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    refs = {None: hf.double()}
    loras = {None: None}
    for i, name in enumerate(("a1", "a2")):
        refs[name] = make_adapter(hf, str(tmp_path / name), targets=targets, r=8, seed=i + 1)
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (6, 40)]
    llm = LLM(str(tmp_path / "base"), dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, warmup=False, num_kv_blocks=64,
              attention_backend="pallas", skip_tokenizer_init=True,
              enable_multiprocessing=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    runs = [(p, n) for n in (None, "a1", "a2") for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in runs], params,
                        lora_request=[loras[n] for _, n in runs], use_tqdm=False)
    want = [hf_greedy(refs[n], p, N_TOKENS) for p, n in runs]
    assert want[0] != want[2] and want[2] != want[4]  # the adapters change the tokens
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert_no_leaks(llm)

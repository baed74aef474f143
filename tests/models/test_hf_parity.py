"""Tiny random HF models (transformers + torch) vs jaxinfer: prefill and paged decode logits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxinfer.models.loader import load_model  # noqa: E402
from tests.helpers import PagedRunner, rel_err  # noqa: E402

TOL = 1e-4
COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)


def _configs():
    T = transformers
    return {
        "llama-gqa-untied": T.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False),
        "llama-mha-tied": T.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4,
                                        tie_word_embeddings=True),
        "llama3-rope-scaling": T.LlamaConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": T.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                   sliding_window=None),
        "qwen2-bias": T.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=True),
        "qwen3-qknorm": T.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, tie_word_embeddings=False),
        # Mixture of experts: layer 0 sparse, layer 1 dense (mlp_only_layers).
        "qwen3-moe": T.Qwen3MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True,
                                      mlp_only_layers=[1]),
        "qwen2-moe": T.Qwen2MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48),
        "mixtral": T.MixtralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=None),
        # Gemma 3: a sliding layer (window 8 < the prompt), a global one with linear rope
        # scaling, its own attention scale, final logit soft-capping.
        "gemma3": T.Gemma3TextConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=2.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0}}),
        # Qwen3 with yarn rope (Qwen's long-context setting): interpolated / extrapolated
        # frequencies and the attention factor on cos and sin.
        "qwen3-yarn": T.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, rope_parameters={
                                        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 32}),
        # gpt-oss: sinks, sliding (window 8 < the prompt) and full layers, biased q/k/v/o and
        # router, stacked biased experts with a clamped SwiGLU (limit low enough to clamp),
        # yarn rope untruncated.
        "gpt-oss": T.GptOssConfig(
            **{**COMMON, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=0.5, rope_parameters={
                "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0,
                "truncate": False}),
        # DeepSeek-V3: latent attention with a q LoRA, interleaved yarn rope with mscale, one
        # dense layer then MoE layers with 4 groups (the best 2 compete), a shared expert.
        "deepseek-v3": T.DeepseekV3Config(
            **{**COMMON, "num_hidden_layers": 3}, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
            v_head_dim=24, qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, head_dim=16, rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.9, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                "rope_theta": 10000.0}),
        # ... without a q LoRA (DeepSeek-V2-Lite's plain q_proj), no dense layer, plain rope
        # not interleaved, one group.
        "deepseek-v3-no-q-lora": T.DeepseekV3Config(
            **COMMON, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=2, n_routed_experts=4, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=0, rope_interleave=False,
            head_dim=16, norm_topk_prob=False),
        # DeepSeek-V2: softmax routing limited to the best 2 of 4 groups (by their best expert),
        # no correction bias, rope as complex pairs; V2-Lite's plain q projection.
        "deepseek-v2": T.DeepseekV2Config(
            **COMMON, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", num_experts_per_tok=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5, head_dim=16),
    }


def _hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Random biases / norm weights too, so that a mis-loaded tensor cannot hide behind 0s and 1s.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith((".gate.weight", ".router.weight")):  # MoE routers: decisive
                p.normal_(0.0, 0.5)  # top-k choices
            elif name.endswith("sinks"):  # around the scores' scale: they matter
                p.normal_(0.0, 1.0)
            elif cfg.model_type == "gpt_oss" and ".experts." in name:  # past the clamp
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():  # DeepSeek's router bias: it changes choices
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


# Variants whose new parts have unit tests of their own (yarn frequencies, the DeepSeek-V2
# router, the plain-q latent attention) run with the slow tests: CI keeps one config per family.
SLOW_CONFIGS = ("qwen3-yarn", "deepseek-v3-no-q-lora", "deepseek-v2")


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CONFIGS else n for n in _configs()])
def saved(request, tmp_path_factory):
    cfg = _configs()[request.param]
    hf = _hf_model(cfg)
    path = tmp_path_factory.mktemp(request.param)
    # A small shard size exercises model.safetensors.index.json on one config.
    shard = "40KB" if request.param == "llama-gqa-untied" else "1GB"
    hf.save_pretrained(path, max_shard_size=shard)
    return request.param, hf, str(path)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_prefill_and_paged_decode_match_hf(saved):
    name, hf, path = saved
    model, _, dtype = load_model(path, dtype="float32")
    assert dtype == "float32"
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 160, size=23).tolist()
    runner = PagedRunner(model)
    ours = runner.step({"a": prompt})["a"]
    ref = _hf_logits(hf, prompt)
    assert rel_err(ours, ref) < TOL, name

    # Decode greedily through the paged cache; HF's incremental KV cache is the reference.
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    for _ in range(6):
        ours = runner.step({"a": [tok]})["a"][0]
        with torch.no_grad():
            out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, ref = out.past_key_values, out.logits[0, -1].numpy()
        assert rel_err(ours, ref) < TOL, name
        tok = int(ref.argmax())


def test_mixed_batch_chunked_prefill_and_decode(saved):
    """Several sequences in one step: a prefill chunk on top of cached context beside decodes."""
    name, hf, path = saved
    model, _, _ = load_model(path, dtype="float32")
    rng = np.random.default_rng(1)
    seqs = {s: rng.integers(0, 160, size=n).tolist() for s, n in (("x", 19), ("y", 9), ("z", 1))}
    runner = PagedRunner(model)
    runner.step({"x": seqs["x"][:7], "y": seqs["y"]})  # x: first chunk only
    got = runner.step({"x": seqs["x"][7:], "y": [5], "z": seqs["z"]})
    assert rel_err(got["x"], _hf_logits(hf, seqs["x"])[7:]) < TOL, name
    assert rel_err(got["y"][-1], _hf_logits(hf, seqs["y"] + [5])[-1]) < TOL, name
    assert rel_err(got["z"], _hf_logits(hf, seqs["z"])) < TOL, name


def test_checkpoint_layout_is_the_one_saved(saved):
    """One config is saved sharded (index + several files), the others as one file: the
    loader's parity above therefore covers both layouts."""
    import os

    name, _, path = saved
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if name == "llama-gqa-untied":
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
        assert len(files) > 1
    else:
        assert files == ["model.safetensors"]


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_bfloat16_load_is_close(saved, backend):
    """bf16 weights: XLA's dots, or (the `cpu` backend) the C++ kernel's bf16 panels, then
    decode steps through the paged cache."""
    name, hf, path = saved
    model, _, dtype = load_model(path, dtype="bfloat16", attention_backend=backend)
    assert dtype == "bfloat16"
    o = model.model.layers[0].self_attn.o_proj.weight[...]
    assert (o.ndim == 3 and o.shape[-1] == 32) == (backend == "cpu")  # (panels [P, K, 32])
    prompt = list(range(3, 20))
    import jax.numpy as jnp

    runner = PagedRunner(model, dtype=jnp.bfloat16)
    ours = runner.step({"a": prompt})["a"]
    ref = _hf_logits(hf, prompt)
    if name == "gpt-oss":
        # Its low swiglu limit and sinks make a row's routing flip under bf16 rounding: HF's
        # own bf16 run is as far from its float32 on one row (rel. error 1.14), so the rows'
        # median is what can be held to bf16 accuracy here.
        errs = [rel_err(ours[i], ref[i]) for i in range(len(prompt))]
        assert np.median(errs) < 5e-2, (name, errs)
        return
    assert rel_err(ours, ref) < 5e-2, name
    for tok in (5, 77):
        prompt.append(tok)
        ours = runner.step({"a": [tok]})["a"][0]
        assert rel_err(ours, _hf_logits(hf, prompt)[-1]) < 5e-2, name


def test_param_count_equals_hf(saved):
    """bench's roofline counts every parameter HF's model has (latent attention, sinks,
    biased and shared experts included)."""
    from jaxinfer.bench.roofline import param_count
    from jaxinfer.config import ModelConfig

    name, hf, path = saved
    cfg = ModelConfig.from_pretrained(path)
    n_hf = sum(p.numel() for p in hf.parameters())
    n_hf += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("correction_bias"))
    assert param_count(cfg)["total"] == n_hf, name

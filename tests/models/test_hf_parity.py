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
            elif name.endswith(".gate.weight"):  # MoE routers: decisive top-k choices
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module", params=list(_configs()))
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
    qkv = model.model.layers[0].self_attn.qkv_proj.weight[...]
    assert (qkv.ndim == 3 and qkv.shape[-1] == 32) == (backend == "cpu")  # (panels [P, K, 32])
    prompt = list(range(3, 20))
    import jax.numpy as jnp

    runner = PagedRunner(model, dtype=jnp.bfloat16)
    ours = runner.step({"a": prompt})["a"]
    assert rel_err(ours, _hf_logits(hf, prompt)) < 5e-2, name
    for tok in (5, 77):
        prompt.append(tok)
        ours = runner.step({"a": [tok]})["a"][0]
        assert rel_err(ours, _hf_logits(hf, prompt)[-1]) < 5e-2, name

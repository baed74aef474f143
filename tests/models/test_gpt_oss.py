"""gpt-oss (GptOssForCausalLM): config fields, yarn rope against HF's formula, the clamped
SwiGLU, and the engine's greedy tokens against HF float32 through chunked prefill, prefix-cache
hits and preemption, on the C++ (`cpu`) and `xla` attention backends. (Prefill / decode logits
against HF: tests/models/test_hf_parity.py, the "gpt-oss" config.)"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = {"architectures": ["GptOssForCausalLM"], "vocab_size": 160, "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 128, "swiglu_limit": 7.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                            "rope_theta": 150000.0, "truncate": False}}


def test_config_fields():
    cfg = ModelConfig.from_hf_dict(BASE)  # (no layer_types: sliding, full, sliding, full)
    assert cfg.sliding_layers == (True, False, True, False)
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.attention_sinks and cfg.o_proj_bias and cfg.attention_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.norm_topk_prob and cfg.swiglu_limit == 7.0 and cfg.swiglu_alpha == 1.702
    rs = cfg.rope_scaling
    assert (rs.rope_type, rs.factor, rs.truncate, cfg.rope_theta) == ("yarn", 32.0, False,
                                                                       150000.0)


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list 4"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "needs original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
])
def test_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_mxfp4_checkpoint_config_dequantizes_at_load():
    cfg = ModelConfig.from_hf_dict({**BASE, "quantization_config": {"quant_method": "mxfp4"}})
    assert cfg.mxfp4_experts and cfg.quantization is None


def test_quantizing_gpt_oss_is_refused_by_name(tmp_path):
    from jaxinfer.models.loader import build_model

    cfg = ModelConfig.from_hf_dict({**BASE, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": None}})
    with pytest.raises(ValueError, match="quantization='fp8' is not supported for gpt-oss"):
        build_model(cfg, dtype="float32", attention_backend="xla")()


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False,
     "rope_theta": 150000.0},  # gpt-oss
    {"factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},  # Qwen
    {"factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3
    {"factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
     "attention_factor": 1.5, "beta_fast": 16.0, "beta_slow": 2.0},
])
def test_yarn_frequencies_and_attention_factor_equal_hf(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxinfer.config.rope import RopeScaling
    from jaxinfer.layers.rotary import rope_attention_factor, rope_inv_freq

    hf_cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                                      max_position_embeddings=131072,
                                      rope_parameters={"rope_type": "yarn", **params})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    scaling = RopeScaling.from_hf({"rope_type": "yarn", **params})
    np.testing.assert_allclose(rope_inv_freq(64, params["rope_theta"], scaling), inv.numpy(),
                               rtol=1e-6)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-6)


def test_clamped_swiglu_equals_hf():
    import jax.numpy as jnp

    from jaxinfer.models.gpt_oss import clamped_swiglu

    hf_cfg = transformers.GptOssConfig(num_local_experts=1, hidden_size=4, intermediate_size=8,
                                       swiglu_limit=1.5)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(hf_cfg)
    x = np.random.default_rng(0).normal(0, 3, (5, 16)).astype(np.float32)  # interleaved
    ref = experts._apply_gate(torch.tensor(x)).numpy()
    ours = clamped_swiglu(jnp.asarray(x[:, ::2]), jnp.asarray(x[:, 1::2]), alpha=1.702,
                          limit=1.5)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-6, atol=1e-6)


def _tiny_gpt_oss(path, smollm2_dir):
    """A random 3-layer gpt-oss with SmolLM2's tokenizer: sliding layers with a window of 8
    (shorter than the prompts), a full layer, sinks, 4 experts (top 2)."""
    from tests.engine.conftest import make_tiny_model_dir

    return make_tiny_model_dir(
        path, "gpt_oss", smollm2_dir, head_dim=16, num_hidden_layers=3, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
            "rope_theta": 150000.0, "truncate": False})


# (xla with the slow tests: CI keeps the CPU default backend, and xla's logits parity)
@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_engine_greedy_equals_hf_through_chunks_prefix_hits_and_preemption(
        tmp_path, smollm2_dir, backend):
    from tests.engine.conftest import check_family_engine_greedy

    check_family_engine_greedy(tmp_path, _tiny_gpt_oss(tmp_path, smollm2_dir),
                               backend).shutdown()


def test_mxfp4_checkpoint_loads_dequantized_and_equals_hf(tmp_path):
    """An MXFP4 checkpoint (experts as *_blocks / *_scales, quant_method "mxfp4", as the
    released gpt-oss ones): our load-time dequantization equals transformers' own
    (convert_moe_packed_tensors), and the model's logits equal HF's with those weights."""
    import json

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxinfer.models.loader import load_model
    from tests.helpers import PagedRunner, rel_err
    from tests.models.test_hf_parity import _configs, _hf_model, _hf_logits

    hf = _hf_model(_configs()["gpt-oss"])
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    rng = np.random.default_rng(0)
    n_mxfp4 = 0
    for name in list(tensors):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        e, k, n = tensors.pop(name).shape  # [E, in, out]
        blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 127, (e, n, k // 32), dtype=np.uint8)  # 2^-5 .. 2^-1
        ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                         dtype=torch.float32)
        assert tuple(ref.shape) == (e, k, n)
        hf.get_parameter(name).data.copy_(ref)  # HF now computes with the dequantized values
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        n_mxfp4 += 1
    assert n_mxfp4 == 2 * hf.config.num_hidden_layers
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    model, mcfg, _ = load_model(str(tmp_path), dtype="float32")
    assert mcfg.mxfp4_experts
    got = np.asarray(model.model.layers[0].mlp.experts.down_proj[...])
    np.testing.assert_array_equal(got, hf.model.layers[0].mlp.experts.down_proj.detach().numpy())
    prompt = list(range(3, 26))
    ours = PagedRunner(model).step({"a": prompt})["a"]
    assert rel_err(ours, _hf_logits(hf, prompt)) < 1e-4

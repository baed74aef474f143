"""Gemma 3 (text) config reading: both rope layouts (transformers >= 5's rope_parameters per
layer type, and the Hub's older rope_theta / rope_local_base_freq / sliding_window_pattern),
the layer pattern, and what is refused by name. (Logits and greedy tokens against HF:
test_hf_parity.py and tests/engine/test_llm_greedy.py.)"""

from __future__ import annotations

import pytest

from jaxinfer.config import ModelConfig

BASE = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 6, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4,
        "query_pre_attn_scalar": 16}


def test_older_hub_layout_pattern_and_rope_bases():
    cfg = ModelConfig.from_hf_dict({**BASE, "sliding_window_pattern": 3, "rope_theta": 1e6,
                                    "rope_local_base_freq": 1e4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert cfg.sliding_layers == (True, True, False, True, True, False)
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [4, 4, None]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0
    assert cfg.attn_scale == pytest.approx(16 ** -0.5)
    assert cfg.norm_unit_offset and cfg.scale_embeddings and cfg.sandwich_norms and cfg.qk_norm
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert cfg.final_logit_softcapping is None


def test_transformers5_layout():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = ModelConfig.from_hf_dict({
        **BASE, "layer_types": types, "final_logit_softcapping": 30.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 100.0}}})
    assert cfg.sliding_layers == (True,) * 5 + (False,)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (100.0, 10.0)
    assert cfg.rope_scaling.rope_type == "default" and cfg.final_logit_softcapping == 30.0


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0 is not supported"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
    ({"layer_types": ["sliding_attention"] * 5}, r"layer_types must list 6"),
    ({"layer_types": ["chunked_attention"] * 6}, r"layer_types must list 6"),
    ({"hidden_activation": "relu"}, r"hidden_act='relu' is not supported"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}},
     r"sliding layers' rope_type='linear'"),
])
def test_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_gemma3_logits_match_hf_on_the_cpu_backend(tmp_path):
    """The packed-weight `cpu` backend (the CPU default) on a Gemma 3 with windows shorter
    than the prompt: prefill logits equal HF's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from jaxinfer.layers import cpu_kernels
    from jaxinfer.models.loader import load_model
    from tests.helpers import PagedRunner, rel_err

    if not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), dtype="float32", attention_backend="cpu")
    prompt = np.random.default_rng(0).integers(0, 160, size=19).tolist()
    ours = PagedRunner(model).step({"a": prompt})["a"]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    assert rel_err(ours, ref) < 1e-4

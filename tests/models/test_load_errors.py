"""Bad input to the loader: clear errors naming what is wrong."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.models.loader import load_model
from jaxinfer.models.registry import get_model_class, supported_architectures

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "tie_word_embeddings": True}


def _save(tmp_path, cfg, tensors):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _tensors():
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": z(32, 16), "model.norm.weight": z(16)}
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": z(16), p + "post_attention_layernorm.weight": z(16),
              p + "self_attn.q_proj.weight": z(16, 16), p + "self_attn.k_proj.weight": z(8, 16),
              p + "self_attn.v_proj.weight": z(8, 16), p + "self_attn.o_proj.weight": z(16, 16),
              p + "mlp.gate_proj.weight": z(24, 16), p + "mlp.up_proj.weight": z(24, 16),
              p + "mlp.down_proj.weight": z(16, 24)})
    return t


def test_valid_tiny_checkpoint_loads(tmp_path):
    model, cfg, dtype = load_model(_save(tmp_path, TINY, _tensors()))
    assert cfg.head_dim == 8 and dtype == "float32"


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError) as e:
        get_model_class("GPTNeoXForCausalLM")
    for arch in supported_architectures():
        assert arch in str(e.value)
    assert "GPTNeoXForCausalLM" in str(e.value)


def test_missing_tensor_is_named(tmp_path):
    t = _tensors()
    del t["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        load_model(_save(tmp_path, TINY, t))


def test_misshaped_tensor_names_both_shapes(tmp_path):
    t = _tensors()
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    with pytest.raises(ValueError) as e:
        load_model(_save(tmp_path, TINY, t))
    msg = str(e.value)
    assert "self_attn.k_proj.weight" in msg and "(16, 16)" in msg and "(16, 8)" in msg


def test_bad_config_values():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict({**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="load_format"):
        load_model("/nonexistent", load_format="pt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model("/nonexistent")


def test_dummy_load_makes_right_shapes(tmp_path):
    path = _save(tmp_path, TINY, {})
    model, cfg, _ = load_model(path, load_format="dummy", dtype="bfloat16")
    w = model.model.layers[0].self_attn.qkv_proj.weight[...]
    assert w.shape == (16, 1, 32) and str(w.dtype) == "bfloat16"  # [in, Hkv, (2+2) * D]
    assert float(np.abs(np.asarray(w, np.float32)).sum()) > 0


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_fused_projections_compute_hf_q_k_v_gate_up(tmp_path, kv_heads):
    """qkv_proj / gate_up_proj built from HF's separate tensors give exactly x @ W.T of each
    (q heads grouped under their KV head, as GQA pairs them)."""
    rng = np.random.default_rng(kv_heads)
    cfg = {**TINY, "num_attention_heads": 4, "num_key_value_heads": kv_heads}
    d = 16 // 4
    t = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _tensors().items()}
    p = "model.layers.0."
    t[p + "self_attn.k_proj.weight"] = rng.standard_normal((kv_heads * d, 16)).astype(np.float32)
    t[p + "self_attn.v_proj.weight"] = rng.standard_normal((kv_heads * d, 16)).astype(np.float32)
    model, _, _ = load_model(_save(tmp_path, cfg, t), dtype="float32")
    x = rng.standard_normal((3, 16)).astype(np.float32)
    q, k, v = model.model.layers[0].self_attn.qkv_proj(jnp.asarray(x))
    np.testing.assert_allclose(q, (x @ t[p + "self_attn.q_proj.weight"].T).reshape(3, 4, d),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, (x @ t[p + "self_attn.k_proj.weight"].T).reshape(3, -1, d),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, (x @ t[p + "self_attn.v_proj.weight"].T).reshape(3, -1, d),
                               rtol=1e-5, atol=1e-5)
    gate, up = model.model.layers[0].mlp.gate_up_proj(jnp.asarray(x))
    np.testing.assert_allclose(gate, x @ t[p + "mlp.gate_proj.weight"].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(up, x @ t[p + "mlp.up_proj.weight"].T, rtol=1e-5, atol=1e-5)

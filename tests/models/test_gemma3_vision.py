"""Gemma 3's image path (SigLIP tower + projector, jaxinfer/models/{siglip,gemma3}.py) against
HF's get_image_features, loaded through the project's loader from HF's tensors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config.vision import SiglipVisionConfig
from jaxinfer.models.gemma3 import Gemma3ImageEncoder
from tests.helpers import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              image_size=112, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)


def test_image_features_equal_hf(tmp_path):
    from safetensors.torch import save_file

    from jaxinfer.models.loader import load_module

    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32),
        vision_config=VISION, mm_tokens_per_image=16)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random norms, biases and projection
        for name, p in hf.model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(1.0 if "norm" in name and "soft" not in name else 0.0, 0.1)
    # (the hub checkpoints' names: vision_tower.vision_model.*)
    tensors = {f"vision_tower.vision_model.{k}": v
               for k, v in hf.model.vision_tower.state_dict().items()}
    tensors.update({f"multi_modal_projector.{k}": v
                    for k, v in hf.model.multi_modal_projector.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))

    vcfg = SiglipVisionConfig.from_hf_dict(cfg.vision_config.to_dict())
    ours = load_module(lambda: Gemma3ImageEncoder(vcfg, 64, 16, rngs=nnx.Rngs(0)),
                       str(tmp_path))

    pixels = np.random.default_rng(0).standard_normal((2, 3, 112, 112)).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    got = np.asarray(ours(jnp.asarray(pixels)))
    assert got.shape == (2, 16, 64)
    assert rel_err(got, ref) < 1e-5  # (tight: gelu-tanh vs exact gelu differs by ~1e-4)


def test_siglip_config_refusals():
    with pytest.raises(ValueError, match="hidden_act"):
        SiglipVisionConfig.from_hf_dict({**VISION, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="vision_use_head"):
        SiglipVisionConfig.from_hf_dict({**VISION, "vision_use_head": True})
    from jaxinfer.models.gemma3 import Gemma3MultiModalProjector

    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        Gemma3MultiModalProjector(SiglipVisionConfig.from_hf_dict(VISION), 64, 15,
                                  dtype=jnp.float32)

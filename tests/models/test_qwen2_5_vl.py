"""Qwen2.5-VL's vision tower (jaxinfer/models/qwen2_5_vl.py) against HF's, loaded through the
project's checkpoint loader from HF's own tensors (the Conv3d patch kernel included)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.models.qwen2_5_vl import (Qwen2_5VisionTransformer, VisionConfig,
                                        segment_attention, vision_plan)
from tests.helpers import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=40,
              patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
              fullatt_block_indexes=[1])


@pytest.fixture(scope="module")
def hf_tower(tmp_path_factory):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    cfg = transformers.Qwen2_5_VLConfig(vision_config=VISION).vision_config
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    tower = m.Qwen2_5_VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():  # random norms and biases: a mis-loaded one cannot hide
        for name, p in tower.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("qwen2_5_vl_visual")
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()},
              str(path / "model.safetensors"))
    return tower, cfg, str(path)


def _load(path, cfg) -> Qwen2_5VisionTransformer:
    from jaxinfer.models.loader import fill_from_checkpoint

    vcfg = VisionConfig.from_hf_dict(cfg.to_dict())
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: Qwen2_5VisionTransformer(vcfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(abstract)
    expected = {".".join(str(p) for p in path): var for path, var in flat}
    facts = types.SimpleNamespace(mxfp4_experts=False, head_dim=vcfg.head_dim,
                                  quantization=None)
    fill_from_checkpoint(expected, path, facts,
                         put=lambda var, value, ep=False: var.set_value(jnp.asarray(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# (t, h, w) patch grids: windows of 2 x 2 merged units, some images ending in part windows;
# two frames (full attention per frame)
@pytest.mark.parametrize("grids", [[(1, 4, 4)], [(1, 10, 12), (1, 4, 6)], [(2, 6, 4)]])
def test_vision_tower_equals_hf(hf_tower, grids):
    tower_hf, cfg, path = hf_tower
    ours = _load(path, cfg)
    n = sum(t * h * w for t, h, w in grids)
    pixels = np.random.default_rng(len(grids)).standard_normal((n, 3 * 2 * 14 * 14))
    pixels = pixels.astype(np.float32)
    with torch.no_grad():
        ref = tower_hf(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output
    got = np.asarray(ours.encode(pixels, grids))
    assert got.shape == (n // 4, 40)
    assert rel_err(got, ref.numpy()) < 1e-4


def test_plan_covers_every_patch_once_in_windows():
    cfg = VisionConfig.from_hf_dict(VISION)
    plan = vision_plan(cfg, [(1, 10, 12), (2, 4, 6)])
    n = 120 + 48
    assert sorted(plan.perm.tolist()) == list(range(n))
    # windows of at most 2 x 2 merged units (16 patches), consecutive, inside one frame
    seg = plan.window_seg
    assert (np.diff(seg) >= 0).all() and np.bincount(seg).max() == 16
    assert set(plan.image_seg.tolist()) == {0, 1, 2}  # one image, then two frames
    for w in np.unique(seg):
        assert len(set(plan.image_seg[seg == w].tolist())) == 1


def test_segment_attention_chunks_equal_one_pass():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((70, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat([0, 1, 2], [30, 25, 15]), jnp.int32)
    whole = segment_attention(q, k, v, seg, 0.3, chunk=128)
    parts = segment_attention(q, k, v, seg, 0.3, chunk=16)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-6)
    # and each row attends only to its segment: a row of segment 2 ignores the others' values
    v2 = v.at[:55].set(100.0)
    np.testing.assert_allclose(np.asarray(segment_attention(q, k, v2, seg, 0.3))[55:],
                               np.asarray(whole)[55:], rtol=1e-5, atol=1e-6)


def test_vision_config_refusals():
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf_dict({**VISION, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="window_size"):
        VisionConfig.from_hf_dict({**VISION, "window_size": 50})
    with pytest.raises(ValueError, match="merge size"):
        vision_plan(VisionConfig.from_hf_dict(VISION), [(1, 5, 4)])

"""Qwen2.5-VL's vision tower (jaxinfer/models/qwen2_5_vl.py) against HF's, loaded through the
project's checkpoint loader from HF's own tensors (the Conv3d patch kernel included)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config.vision import VisionConfig
from jaxinfer.models.qwen2_5_vl import (Qwen2_5VisionTransformer, segment_attention,
                                        vision_plan)
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
    from jaxinfer.models.loader import load_module

    vcfg = VisionConfig.from_hf_dict(cfg.to_dict())
    return load_module(lambda: Qwen2_5VisionTransformer(vcfg, rngs=nnx.Rngs(0)), path)


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


IMAGE_ID, V_START, V_END = 190, 188, 189


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory):
    """A tiny Qwen2.5-VL (2 Qwen2 layers with M-RoPE sections 2/3/3, the tower above),
    saved as transformers saves it (model.language_model.*, model.visual.*)."""
    cfg = transformers.Qwen2_5_VLConfig(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        text_config=dict(vocab_size=200, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config={**VISION, "out_hidden_size": 64}, image_token_id=IMAGE_ID,
        video_token_id=191, vision_start_token_id=V_START, vision_end_token_id=V_END,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf.save_pretrained(path)
    return hf, str(path)


def _prompt(grids, rng):
    """text, <vision_start> image placeholders <vision_end>, text, ... for each image."""
    ids = rng.integers(0, 180, 5).tolist()
    for t, h, w in grids:
        ids += [V_START] + [IMAGE_ID] * (t * h * w // 4) + [V_END]
        ids += rng.integers(0, 180, 3).tolist()
    return ids


def test_mrope_positions_equal_hf(hf_vl):
    from jaxinfer.models.qwen2_5_vl import mrope_positions

    hf, _ = hf_vl
    rng = np.random.default_rng(0)
    grids = [(1, 4, 6), (1, 6, 4)]
    ids = _prompt(grids, rng)
    types_ = (torch.tensor([ids]) == IMAGE_ID).int()
    ref, ref_delta = hf.model.get_rope_index(torch.tensor([ids]), types_,
                                             image_grid_thw=torch.tensor(grids))
    pos, delta = mrope_positions(ids, IMAGE_ID, grids, 2)
    assert pos.tolist() == ref[:, 0].tolist() and delta == int(ref_delta)
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(ids, IMAGE_ID, grids[:1], 2)


def test_logits_with_images_equal_hf_through_prefill_and_decode(hf_vl):
    """Loaded from transformers' own layout; one image and two of different sizes in the
    prompt: prefill logits through the paged cache, then decode steps at M-RoPE's offset
    positions, against HF's incremental decoding."""
    import jax

    from jaxinfer.models.loader import load_model
    from jaxinfer.models.qwen2_5_vl import mrope_positions
    from jaxinfer.runner.kv_cache import allocate_kv_caches
    from jaxinfer.runner.step_inputs import empty_step_batch, fill_step_inputs

    hf, path = hf_vl
    model, cfg, _ = load_model(path, dtype="float32")
    assert cfg.mrope_section == (2, 3, 3) and cfg.image_token_id == IMAGE_ID
    for grids in ([(1, 4, 4)], [(1, 10, 12), (1, 4, 6)]):
        rng = np.random.default_rng(len(grids))
        ids = _prompt(grids, rng)
        n_patch = sum(t * h * w for t, h, w in grids)
        pixels = rng.standard_normal((n_patch, 1176)).astype(np.float32)
        kw = dict(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=(torch.tensor([ids]) == IMAGE_ID).int())
        with torch.no_grad():
            out = hf(torch.tensor([ids]), use_cache=True, **kw)
        past = out.past_key_values
        ref = out.logits[0].numpy()

        # ours: the tower's outputs at the placeholders, M-RoPE positions, one paged step
        emb = np.array(model.model.embed_tokens(jnp.asarray(ids)))
        emb[np.asarray(ids) == IMAGE_ID] = np.asarray(model.visual.encode(pixels, grids))
        pos3, delta = mrope_positions(ids, IMAGE_ID, grids, 2)
        kv = allocate_kv_caches(cfg, 64, 4, jnp.float32)
        table = np.arange(1, 33, dtype=np.int32)[None]
        tokens = np.zeros((1, 256), np.int32)
        tokens[0, :len(ids)] = ids

        def step(start, new, pos, embeds):
            batch = empty_step_batch(len(new) + 3, 2, 32, 1)
            fill_step_inputs(batch, tokens, table, np.array([0], np.int32),
                             np.array([start], np.int32), np.array([len(new)], np.int32), 4)
            t = len(batch.input_ids)
            p3 = np.zeros((3, t), np.int32)
            p3[:, :len(new)] = pos
            e = np.zeros((t, emb.shape[1]), np.float32)
            e[:len(new)] = embeds
            hidden, new_kv = model(jnp.asarray(batch.input_ids), jnp.asarray(p3), kv,
                                   jax.device_put(batch.attn), embeds=jnp.asarray(e))
            return np.asarray(model.compute_logits(hidden))[:len(new)], new_kv

        got, kv = step(0, ids, pos3, emb)
        assert rel_err(got, ref) < 1e-4, grids
        tok, n = int(ref[-1].argmax()), len(ids)
        for _ in range(3):
            tokens[0, n] = tok
            e = np.asarray(model.model.embed_tokens(jnp.asarray([tok])))
            got, kv = step(n, [tok], np.full((3, 1), n + delta), e)
            with torch.no_grad():
                out = hf(torch.tensor([[tok]]), cache=past, use_cache=True)
            past, ref_step = out.past_key_values, out.logits[0, -1].numpy()
            assert rel_err(got[0], ref_step) < 1e-4, grids
            tok, n = int(ref_step.argmax()), n + 1


def test_engine_serves_text_prompts_and_refuses_image_placeholders(hf_vl):
    """The engine runs Qwen2.5-VL on text (positions [T]: M-RoPE's three equal) with HF's
    greedy tokens; a prompt holding the image placeholder is refused by name until images
    are inputs."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              max_num_batched_tokens=16, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=16, block_size=8, max_num_seqs=4)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 180, n).tolist() for n in (7, 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                              min_new_tokens=6)[0, len(p):].tolist()
        assert list(o.outputs[0].token_ids) == ref
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate([{"prompt_token_ids": [5, IMAGE_ID, 6]}], use_tqdm=False)
    llm.shutdown()

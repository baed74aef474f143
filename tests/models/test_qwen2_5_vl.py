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


def tiny_qwen2_5_vl(path, *, vocab_size: int, image_token_id: int, start_id: int,
                    end_id: int, video_token_id: int, vision: dict, max_positions: int = 256,
                    std: float = 0.1, seed: int = 1):
    """A tiny random Qwen2.5-VL (2 Qwen2 layers with M-RoPE sections 2/3/3, the tower
    `vision`), saved at `path` as transformers saves it (model.language_model.*,
    model.visual.*); returns HF's model."""
    cfg = transformers.Qwen2_5_VLConfig(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config={**vision, "out_hidden_size": 64}, image_token_id=image_token_id,
        video_token_id=video_token_id, vision_start_token_id=start_id,
        vision_end_token_id=end_id, tie_word_embeddings=False)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, std)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory):
    """The tiny Qwen2.5-VL of these tests (vocabulary 200, the tower above)."""
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = tiny_qwen2_5_vl(path, vocab_size=200, image_token_id=IMAGE_ID, start_id=V_START,
                         end_id=V_END, video_token_id=191, vision=VISION)
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


def test_engine_serves_text_prompts_and_refuses_bare_placeholders(hf_vl):
    """The engine runs Qwen2.5-VL on text (M-RoPE's three positions equal) with HF's greedy
    tokens; a prompt holding the image placeholder without an image for it is refused by
    name."""
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


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _hf_greedy(hf, ids, images, n):
    """HF's greedy continuation of the expanded prompt with the images' pixel rows (our
    processor's: equal to HF's, tests/models/test_qwen2_vl_processor.py)."""
    from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

    pixels, grids = Qwen2VLImageProcessor()(images)
    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(t, pixel_values=torch.tensor(pixels),
                          image_grid_thw=torch.tensor(grids),
                          mm_token_type_ids=(t == IMAGE_ID).int(), attention_mask=t * 0 + 1,
                          max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _expand(ids, images):
    from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

    proc, out, k = Qwen2VLImageProcessor(), [], 0
    for t in ids:
        if t == IMAGE_ID:
            out += [IMAGE_ID] * proc.num_tokens(images[k].height, images[k].width)
            k += 1
        else:
            out.append(t)
    return out


@pytest.mark.parametrize("step_compilation,async_scheduling",
                         [("layerwise", False), ("whole", True)])
def test_engine_images_equal_hf(hf_vl, step_compilation, async_scheduling):
    """Images as engine inputs (multi_modal_data): one image first in the prompt, two of
    different sizes mid-prompt, through 16-token chunked prefill (text cut around the
    images, never inside one) and preemption, layer-wise steps and whole steps with async
    scheduling; greedy tokens equal HF's. The same image in
    two requests is encoded once (the encoder cache), and a prompt with the same text but
    another image shares no prefix block past the image."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=96,
              max_num_batched_tokens=16, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=13, block_size=8, max_num_seqs=4,
              step_compilation=step_compilation, async_scheduling=async_scheduling)
    rng = np.random.default_rng(7)
    a, b, c = _image(56, 56, 0), _image(112, 84, 1), _image(84, 140, 2)
    text = rng.integers(0, 180, 9).tolist()
    cases = [
        ([V_START, IMAGE_ID, V_END] + text, [a]),
        (text[:4] + [V_START, IMAGE_ID, V_END] + text[4:] + [V_START, IMAGE_ID, V_END, 7],
         [b, c]),
        ([V_START, IMAGE_ID, V_END] + text, [b]),  # same text as the first, another image
        (text[:4] + [V_START, IMAGE_ID, V_END] + text[4:] + [V_START, IMAGE_ID, V_END, 7],
         [b, c]),  # the second again
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}
                         for ids, ims in cases], params, use_tqdm=False)
    for (ids, ims), o in zip(cases, outs):
        assert list(o.prompt_token_ids) == _expand(ids, ims)
        assert list(o.outputs[0].token_ids) == _hf_greedy(hf, _expand(ids, ims), ims, 8)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0  # (13 blocks of 8 for four ~40-token requests)
    # a, b, c once each, b and c again at most after a preemption or an eviction
    core = llm.llm_engine.engine_core.core
    assert core.runner.mm.num_encoder_runs == stats["encoder_cache_runs"] >= 3
    assert stats["encoder_cache_hits"] > 0

    # One at a time: the same request again hits the encoder cache and the prefix cache;
    # the first prompt's text with image b instead of a shares no block holding the image.
    runs = core.runner.mm.num_encoder_runs
    again = llm.generate([{"prompt_token_ids": cases[1][0],
                           "multi_modal_data": {"image": cases[1][1]}}], params,
                         use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
    assert again.num_cached_tokens > 0
    first = llm.generate([{"prompt_token_ids": cases[0][0],
                           "multi_modal_data": {"image": [a]}}], params, use_tqdm=False)[0]
    other = llm.generate([{"prompt_token_ids": cases[0][0],
                           "multi_modal_data": {"image": [c]}}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens > 0 and other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == _hf_greedy(hf, _expand(cases[0][0], [c]), [c], 8)
    assert core.runner.mm.num_encoder_runs == runs  # (a, b, c all still in the encoder cache)
    assert not core.scheduler.requests
    llm.shutdown()


def test_engine_image_refusals(hf_vl):
    """Bad image inputs fail alone with the field named; the engine serves on."""
    import io

    from PIL import Image

    from jaxinfer import LLM, SamplingParams

    _, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=96,
              max_num_batched_tokens=32, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=16, block_size=8, max_num_seqs=4,
              limit_mm_per_prompt={"image": 2})
    ok = [V_START, IMAGE_ID, V_END, 5, 6]
    im = _image(56, 56, 0)
    buf = io.BytesIO()
    _image(64, 64, 3).save(buf, format="PNG")
    truncated = Image.open(io.BytesIO(buf.getvalue()[:200]))
    bad = [
        ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [im]}},
         "0 image placeholder"),
        ({"prompt_token_ids": ok * 3, "multi_modal_data": {"image": [im] * 3}},
         "limit of 2"),
        ({"prompt_token_ids": ok, "multi_modal_data": {"image": ["x.png"]}}, "PIL image"),
        ({"prompt_token_ids": ok, "multi_modal_data": {"video": [im]}}, "'video'"),
        ({"prompt_token_ids": ok, "multi_modal_data": {"image": [truncated]}}, "image 0"),
        ({"prompt_token_ids": ok, "multi_modal_data": {"image": [_image(1000, 4, 0)]}},
         "aspect ratio"),
        ({"prompt_token_ids": ok, "multi_modal_data": {"image": [_image(600, 600, 0)]}},
         "max_num_batched_tokens"),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": ok, "multi_modal_data": {"image": im}}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()


def test_engine_images_under_tensor_parallelism(hf_vl):
    """TP=2 (4 fake CPU devices) gives TP=1's greedy tokens for prompts with images; the
    vision tower is replicated on both devices (its weights declare no tensor-parallel
    axes), the language model split as usual."""
    from tests.parallel.vl_tp_worker import check_tp2_equals_tp1

    check_tp2_equals_tp1(hf_vl[1], "qwen")


def test_engine_images_with_ngram_drafts_equal_hf(hf_vl):
    """n-gram speculative decoding with images: the drafts sit at M-RoPE's offset positions
    and are verified by the target, so the tokens stay HF's greedy ones."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=96,
              max_num_batched_tokens=32, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=24, block_size=8, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    a, b = _image(56, 84, 3), _image(84, 56, 4)
    text = [11, 12, 13, 11, 12, 13, 11, 12]  # (repeats: the n-gram proposer finds drafts)
    cases = [([V_START, IMAGE_ID, V_END] + text, [a]),
             (text[:3] + [V_START, IMAGE_ID, V_END] + text, [b])]
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}
                         for ids, ims in cases],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    for (ids, ims), o in zip(cases, outs):
        assert list(o.outputs[0].token_ids) == _hf_greedy(hf, _expand(ids, ims), ims, 12)
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
    llm.shutdown()

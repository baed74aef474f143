"""Gemma 3 with images (Gemma3ForConditionalGeneration, jaxinfer/models/gemma3.py) against HF:
the image processor's pixels equal HF's PIL processor's; the prompt expansion equals HF's
processor's text tokenized; the engine's prompt logprobs and greedy tokens equal HF's with
the bidirectional image mask (an image longer than the sliding window; images first and
mid-prompt), through chunked prefill, preemption and prefix hits, layer-wise and whole
steps; refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

BOI, EOI, IMAGE = 250, 251, 252
NL = {1: 253, 2: 254, 3: 255, 4: 256}  # runs of newlines, as Gemma's vocabulary has them
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              image_size=112, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
MM_TOKENS = 16  # 8 x 8 patches pooled 2 x 2


def _tokenizer_json(path, vocab_size: int) -> None:
    """A word-level tokenizer whose vocabulary names the image and newline tokens as
    Gemma's does (the processor reads the newline tokens from it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for k, i in NL.items():
        vocab.pop(f"w{i}")
        vocab["\n" * k] = i
    for name, i in (("<start_of_image>", BOI), ("<end_of_image>", EOI),
                    ("<image_soft_token>", IMAGE)):
        vocab.pop(f"w{i}")
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok.save(str(path / "tokenizer.json"))


def tiny_gemma3_vl(path, *, vocab_size: int = 300, seed: int = 1,
                   image_ids: tuple[int, int, int] = (BOI, EOI, IMAGE), tokenizer: bool = True):
    """A tiny random Gemma 3 with images: 2 text layers (sliding window 8, then full), a
    2-layer SigLIP over 112 x 112 images, 16 soft tokens per image (image_ids: the boi, eoi
    and soft token ids); saved at `path` as transformers saves it, with a
    preprocessor_config.json and (tokenizer) a word-level tokenizer.json."""
    boi, eoi, image = image_ids
    cfg = transformers.Gemma3Config(
        architectures=["Gemma3ForConditionalGeneration"],
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=256, bos_token_id=2, eos_token_id=1,
                         query_pre_attn_scalar=16),
        vision_config=VISION, mm_tokens_per_image=MM_TOKENS, boi_token_index=boi,
        eoi_token_index=eoi, image_token_index=image)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if "language_model" in name or "soft" in name else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(path)
    if tokenizer:
        _tokenizer_json(path, vocab_size)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": 112, "width": 112},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
        "rescale_factor": 1 / 255, "do_pan_and_scan": False}))
    return hf


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl")
    return tiny_gemma3_vl(path), str(path)


def _image(w: int, h: int, seed: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    return im if mode == "RGBA" else im.convert(mode)


def _processor(hf_vl):
    from jaxinfer.config import ModelConfig
    from jaxinfer.multimodal.inputs import MultiModalProcessor

    _, path = hf_vl
    return MultiModalProcessor(ModelConfig.from_pretrained(path), path)


def test_image_processor_equals_hf(hf_vl):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ours = _processor(hf_vl).image_processor
    ref = Gemma3ImageProcessorPil(size={"height": 112, "width": 112}, do_pan_and_scan=False)
    for im in (_image(300, 200, 0), _image(50, 90, 1, "RGBA"), _image(112, 112, 2, "L"),
               _image(7, 640, 3)):
        rows, grids = ours([im])
        want = ref([im], return_tensors="np")["pixel_values"][0]  # [C, S, S]
        c, s, p = want.shape[0], 8, 14
        back = rows.reshape(s, s, c, p, p).transpose(2, 0, 3, 1, 4).reshape(c, 112, 112)
        np.testing.assert_allclose(back, want, atol=1e-6)
        assert grids.tolist() == [[1, 8, 8]]


def test_prompt_expansion_equals_hf_processor_text(hf_vl):
    """HF's processor writes "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"
    for each image and tokenizes the text; newline runs merge with the prompt's."""
    from tokenizers import Tokenizer

    _, path = hf_vl
    tok = Tokenizer.from_file(path + "/tokenizer.json")
    mm = _processor(hf_vl)
    assert mm.placeholder_text == "<start_of_image>"
    # (the word-level tokenizer splits on spaces: a newline run is one word, so the text
    # below spells the runs as Gemma's tokenizer would see them merged)
    image = " <start_of_image> " + "<image_soft_token> " * MM_TOKENS + "<end_of_image> "
    cases = [  # (prompt words, HF's expanded text with newline runs as they merge)
        ("w5 <start_of_image> w6", "w5 \n\n" + image + "\n\n w6"),
        ("w5 \n <start_of_image> \n w6", "w5 \n\n\n" + image + "\n\n\n w6"),
        ("<start_of_image> <start_of_image> \n\n w7",
         "\n\n" + image + "\n\n\n\n" + image + "\n\n\n\n w7"),
    ]
    for prompt, want in cases:
        ids = tok.encode(prompt).ids
        n = prompt.count("<start_of_image>")
        got = mm.expand(ids, [_image(20, 20, 0)] * n)
        assert got == tok.encode(want).ids, (prompt, tok.decode(got))
        out, feats = mm.process(ids, [_image(20, 20, k) for k in range(n)])
        assert out == got
        assert [out[f.offset - 1] for f in feats] == [BOI] * n
        assert all(set(out[f.offset:f.end]) == {IMAGE} and out[f.end] == EOI for f in feats)


def _hf_greedy(hf, ids, images, n, image_id: int = IMAGE):
    from jaxinfer.multimodal.gemma3 import Gemma3ImageProcessor

    proc = Gemma3ImageProcessor(image_size=112, merge_size=2)
    t = torch.tensor([ids])
    kw = {}
    if images:
        rows, _ = proc(images)
        pix = rows.reshape(len(images), 8, 8, 3, 14, 14).transpose(0, 3, 1, 4, 2, 5)
        kw = dict(pixel_values=torch.tensor(np.ascontiguousarray(pix).reshape(-1, 3, 112, 112)),
                  token_type_ids=(t == image_id).long())
    with torch.no_grad():
        out = hf.generate(t, attention_mask=t * 0 + 1, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, **kw)
        logits = hf(t, attention_mask=t * 0 + 1, **kw).logits[0].double()
    return out[0, len(ids):].tolist(), torch.log_softmax(logits, -1).numpy()


def _expand(ids, n_images):
    out = []
    for t in ids:
        if t == BOI:
            out += [NL[2], BOI] + [IMAGE] * MM_TOKENS + [EOI, NL[2]]
        else:
            out.append(t)
    return out


def _cases():
    rng = np.random.default_rng(5)
    a, b, c = _image(60, 40, 0), _image(112, 112, 1), _image(30, 90, 2, "RGBA")
    text = rng.integers(3, 240, 9).tolist()
    return [
        ([2, BOI] + text, [a]),
        ([2] + text[:4] + [BOI] + text[4:] + [BOI, 7], [b, c]),
        ([2, BOI] + text, [b]),  # the first's text with another image
        ([2] + text[:4] + [BOI] + text[4:] + [BOI, 7], [b, c]),
    ]


def test_prompt_logprobs_equal_hf(hf_vl):
    """Every prompt position's logprob equals HF's (atol 2e-4): the rows of an image's
    tokens see the whole image (16 tokens, twice the sliding window), through 24-token
    chunks that stop before an image."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              max_num_batched_tokens=24, warmup=False, enable_multiprocessing=False,
              block_size=8, max_num_seqs=4)
    cases = _cases()[:2]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}
                         for ids, ims in cases], params, use_tqdm=False)
    for (ids, ims), o in zip(cases, outs):
        full = _expand(ids, len(ims))
        _, logprobs = _hf_greedy(hf, full, ims, 1)
        got = np.array([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], full[1:])])
        want = logprobs[np.arange(len(full) - 1), full[1:]]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    llm.shutdown()


@pytest.mark.parametrize("step_compilation,async_scheduling",
                         [("layerwise", False), ("whole", True)])
def test_engine_images_equal_hf(hf_vl, step_compilation, async_scheduling):
    """Greedy tokens equal HF's: images first and mid-prompt, 24-token chunks (text cut
    around the images), preemption, the same image in two requests encoded once, and the
    prefix cache (the same request again)."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              max_num_batched_tokens=24, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=17, block_size=8, max_num_seqs=4,
              step_compilation=step_compilation, async_scheduling=async_scheduling)
    cases = _cases()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}
                         for ids, ims in cases], params, use_tqdm=False)
    for (ids, ims), o in zip(cases, outs):
        full = _expand(ids, len(ims))
        assert list(o.prompt_token_ids) == full
        assert list(o.outputs[0].token_ids) == _hf_greedy(hf, full, ims, 6)[0]
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["encoder_cache_hits"] > 0
    again = llm.generate([{"prompt_token_ids": cases[1][0],
                           "multi_modal_data": {"image": cases[1][1]}}], params,
                         use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
    assert not llm.llm_engine.engine_core.core.scheduler.requests
    llm.shutdown()


def test_bidirectional_mask_matters(hf_vl):
    """The check above could not pass with a causal mask: HF's logits at the image tokens
    change without token_type_ids (the block mask), by far more than its tolerance."""
    hf, _ = hf_vl
    full = _expand([2, BOI, 9, 10], 1)
    from jaxinfer.multimodal.gemma3 import Gemma3ImageProcessor

    rows, _ = Gemma3ImageProcessor(image_size=112, merge_size=2)([_image(60, 40, 0)])
    pix = np.ascontiguousarray(rows.reshape(1, 8, 8, 3, 14, 14).transpose(0, 3, 1, 4, 2, 5))
    t = torch.tensor([full])
    kw = dict(pixel_values=torch.tensor(pix.reshape(1, 3, 112, 112)))
    with torch.no_grad():
        bi = hf(t, token_type_ids=(t == IMAGE).long(), **kw).logits[0]
        causal = hf(t, **kw).logits[0]
    assert (bi - causal).abs().max() > 1e-2


def test_refusals(hf_vl):
    from jaxinfer import LLM, SamplingParams

    _, path = hf_vl
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              max_num_batched_tokens=24, warmup=False, enable_multiprocessing=False,
              block_size=8, max_num_seqs=4)
    p = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate([{"prompt_token_ids": [2, 5, 6], "multi_modal_data": {"image": [
            _image(20, 20, 0)]}}], p, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):  # bare soft tokens
        llm.generate([{"prompt_token_ids": [2, IMAGE, 6]}], p, use_tqdm=False)
    with pytest.raises(ValueError, match="aspect ratio"):
        llm.generate([{"prompt_token_ids": [2, BOI], "multi_modal_data": {"image": [
            _image(1, 300, 0)]}}], p, use_tqdm=False)
    from jaxinfer.config import ModelConfig
    from jaxinfer.multimodal.gemma3 import Gemma3ImageProcessor

    vis = ModelConfig.from_pretrained(path).vision
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        Gemma3ImageProcessor.from_config({"do_pan_and_scan": True}, vis)
    with pytest.raises(ValueError, match="image_size"):
        Gemma3ImageProcessor.from_config({"size": {"height": 224, "width": 224}}, vis)
    # the engine serves on
    out = llm.generate([{"prompt_token_ids": [2, BOI, 5],
                         "multi_modal_data": {"image": _image(20, 20, 0)}}], p,
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    llm.shutdown()


CHAT_IDS = (49152, 49153, 49154)  # boi, eoi, soft token after SmolLM2's vocabulary


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, smollm2_dir):
    """The tiny Gemma 3 with SmolLM2's tokenizer and chat template, Gemma's image tokens
    added as special tokens; (HF's model, the folder, the tokenizer)."""
    import os
    import shutil

    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("gemma3_vl_chat")
    hf = tiny_gemma3_vl(path, vocab_size=49160, image_ids=CHAT_IDS, tokenizer=False)
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<start_of_image>", "<end_of_image>", "<image_soft_token>")])
    assert tok.token_to_id("<image_soft_token>") == CHAT_IDS[2]
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(os.path.join(smollm2_dir, "tokenizer_config.json"), path)
    return hf, str(path), tok


def _chat_prompt(llm_tokenizer, tok, mm, text: str, images) -> list[int]:
    """The route's prompt: the template over the text with each image as <start_of_image>,
    tokenized, expanded."""
    rendered = llm_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
    return mm.expand(tok.encode(rendered, add_special_tokens=False).ids, images)


def _data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_llm_chat_with_gemma3_images(chat_dir):
    """LLM.chat with image_pil and data-URL parts: each image written as <start_of_image> in
    the rendered chat, the prompt expanded around it, greedy tokens equal HF's on it."""
    from jaxinfer import LLM, SamplingParams

    hf, path, tok = chat_dir
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32,
              max_num_seqs=2, warmup=False, enable_multiprocessing=False, block_size=8)
    a, b = _image(40, 70, 3), _image(90, 50, 4)
    conv = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": a}, {"type": "text", "text": "What differs from"},
        {"type": "image_url", "image_url": {"url": _data_url(b)}},
        {"type": "text", "text": "?"}]}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)[0]
    mm = llm.llm_engine.processor.multimodal
    full = _chat_prompt(llm.get_tokenizer(), tok, mm,
                        "<start_of_image>What differs from<start_of_image>?", [a, b])
    assert list(out.prompt_token_ids) == full
    assert full.count(CHAT_IDS[2]) == 2 * MM_TOKENS and full.count(CHAT_IDS[0]) == 2
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, full, [a, b], 6, CHAT_IDS[2])[0]
    llm.shutdown()


def test_chat_route_with_gemma3_images(chat_dir):
    """The server's chat route through the openai SDK (whole and streamed): an image_url
    data URL between text parts; the text equals HF's greedy continuation, usage counts the
    image tokens."""
    openai = pytest.importorskip("openai")
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM
    from tests.helpers import LiveServer

    hf, path, tok = chat_dir
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", max_model_len=128,
                                max_num_seqs=2, max_num_batched_tokens=32, warmup=False,
                                block_size=8))
    server = LiveServer(llm, "tiny-gemma")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        im = _image(64, 48, 6)
        common = dict(model="tiny-gemma", max_tokens=5, temperature=0,
                      extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                          {"type": "text", "text": "Describe"},
                          {"type": "image_url", "image_url": {"url": _data_url(im)}},
                          {"type": "text", "text": " briefly."}]}])
        r = client.chat.completions.create(**common)
        from transformers import AutoTokenizer

        full = _chat_prompt(AutoTokenizer.from_pretrained(path), tok,
                            server.server.llm.processor.multimodal,
                            "Describe<start_of_image> briefly.", [im])
        want = tok.decode(_hf_greedy(hf, full, [im], 5, CHAT_IDS[2])[0])
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(full)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **common) if c.choices)
        assert streamed == want
    finally:
        server.close()


@pytest.mark.slow
def test_engine_images_under_tensor_parallelism(hf_vl):
    """TP=2 (4 fake CPU devices) gives TP=1's greedy tokens for Gemma 3 prompts with images;
    the tower is replicated (its weights declare no tensor-parallel axes)."""
    from tests.parallel.vl_tp_worker import check_tp2_equals_tp1

    check_tp2_equals_tp1(hf_vl[1], "gemma")


def test_weight_update_reaches_the_tower_and_drops_encoder_outputs(hf_vl, tmp_path):
    """update_weights with another checkpoint's tensors (HF names, the tower's included):
    the same image prompt then gives the new model's tokens — the encoder outputs cached
    from the old tower are not reused."""
    from jaxinfer import LLM, SamplingParams

    hf, path = hf_vl
    other = tiny_gemma3_vl(tmp_path, seed=9)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              max_num_batched_tokens=24, warmup=False, enable_multiprocessing=False,
              block_size=8, max_num_seqs=2)
    ids, ims = _cases()[0]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": ims}}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    full = _expand(ids, 1)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(before) == _hf_greedy(hf, full, ims, 6)[0]
    runs = llm.llm_engine.get_stats()["encoder_cache_runs"]
    llm.update_weights({k: v.numpy() for k, v in other.state_dict().items()})
    after = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    want = _hf_greedy(other, full, ims, 6)[0]
    assert list(after) == want and want != list(before)
    assert llm.llm_engine.get_stats()["encoder_cache_runs"] == runs + 1  # (encoded again)
    llm.shutdown()


def test_core_checks_image_features(hf_vl):
    """The engine core's re-check of a request's images (one that bypassed the front end
    fails alone, the field named): Gemma 3's one grid, sizes, positions, values."""
    import msgspec

    from jaxinfer.config import ModelConfig
    from jaxinfer.multimodal.inputs import check_features

    vis = ModelConfig.from_pretrained(hf_vl[1]).vision
    ids, (f,) = _processor(hf_vl).process([2, BOI, 5], [_image(20, 20, 0)])
    kw = dict(image_token_id=IMAGE, patch_dim=vis.patch_dim, merge=vis.spatial_merge_size,
              grid=vis.grid)
    check_features([f], ids, **kw)
    nan = np.frombuffer(f.pixel_values, np.float32).copy()
    nan[3] = np.nan
    bad = [  # (the feature changed, the message)
        (dict(grid_thw=(1, 4, 16)), r"grid_thw must be \[1, 8, 8\]"),
        (dict(length=15), "length must be 16"),
        (dict(offset=f.offset - 1), "must hold the image token"),
        (dict(pixel_values=f.pixel_values[:-4]), "pixel_values must hold 64 x 588"),
        (dict(pixel_values=nan.tobytes()), "must be finite"),
        (dict(identifier="x" * 129), "identifier"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            check_features([msgspec.structs.replace(f, **change)], ids, **kw)
    with pytest.raises(ValueError, match="every image token"):
        check_features([f], ids + [IMAGE], **kw)

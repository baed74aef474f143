"""Images through the OpenAI chat route (a tiny Qwen2.5-VL with SmolLM2's tokenizer and the
vision tokens added): image_url data URLs and, behind --allowed-local-media-path, file://
paths, through the openai SDK, whole and streamed; the engine core in its own process (the
images cross as msgpack). Greedy text equals HF's; bad images are a 400 naming the part and
the server serves on."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil

import httpx
import numpy as np
import pytest

from tests.helpers import LiveServer
from tests.models.test_qwen2_5_vl import tiny_qwen2_5_vl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MODEL = "tiny-vl"
V_START, IMAGE, V_END = 49152, 49153, 49154
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
              patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
              fullatt_block_indexes=[1])


def _png(w, h, seed, fmt="PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, kind="png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_dir):
    from tokenizers import AddedToken, Tokenizer

    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    root = tmp_path_factory.mktemp("vl-server")
    path = root / "model"
    hf = tiny_qwen2_5_vl(path, vocab_size=49160, image_token_id=IMAGE, start_id=V_START,
                         end_id=V_END, video_token_id=49155, vision=VISION,
                         max_positions=512, std=0.15, seed=3)
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")])
    assert tok.token_to_id("<|image_pad|>") == IMAGE
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(os.path.join(smollm2_dir, "tokenizer_config.json"), path)
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(_png(84, 56, 5))
    llm = AsyncLLM(EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                                max_num_seqs=4, max_num_batched_tokens=64, warmup=False,
                                num_kv_blocks=64, limit_mm_per_prompt={"image": 2}))
    server = LiveServer(llm, MODEL, allowed_local_media_path=str(media))
    server.hf, server.tok, server.media = hf, tok, media
    yield server
    server.close()


def _hf_text(live, messages_text: str, images, n: int) -> str:
    """HF's greedy continuation of the rendered prompt with the images."""
    from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor()
    ids = live.tok.encode(messages_text, add_special_tokens=False).ids
    out, k = [], 0
    for t in ids:
        if t == IMAGE:
            out += [IMAGE] * proc.num_tokens(images[k].height, images[k].width)
            k += 1
        else:
            out.append(t)
    pixels, grids = proc(images)
    t = torch.tensor([out])
    with torch.no_grad():
        gen = live.hf.generate(t, pixel_values=torch.tensor(pixels),
                               image_grid_thw=torch.tensor(grids),
                               mm_token_type_ids=(t == IMAGE).int(), attention_mask=t * 0 + 1,
                               max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return live.tok.decode(gen[0, len(out):].tolist(), skip_special_tokens=True), len(out)


def _rendered(live, parts_text: str) -> str:
    """What SmolLM2's template makes of one user message (the route writes each image as
    the model's placeholder where its part was)."""
    tok = transformers.AutoTokenizer.from_pretrained(live.server.llm.resolved.model_dir)
    return tok.apply_chat_template([{"role": "user", "content": parts_text}],
                                   add_generation_prompt=True, tokenize=False)


def test_chat_with_images_equals_hf(live):
    from PIL import Image

    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x")
    a, b = _png(56, 56, 1), _png(112, 84, 2, fmt="JPEG")
    content = [{"type": "text", "text": "Look:"},
               {"type": "image_url", "image_url": {"url": _data_url(a)}},
               {"type": "text", "text": " and"},
               {"type": "image_url", "image_url": {"url": _data_url(b, "jpeg"),
                                                   "detail": "auto"}},
               {"type": "text", "text": " what differs?"}]
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    images = [Image.open(io.BytesIO(x)) for x in (a, b)]
    want, n_prompt = _hf_text(live, _rendered(live, f"Look:{ph} and{ph} what differs?"),
                              images, 6)
    common = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6,
                  temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**common)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == n_prompt
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **common) if c.choices)
    assert streamed == want

    # a file:// image inside --allowed-local-media-path
    url = (live.media / "cat.png").as_uri()
    r = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": url}}]}])
    want, _ = _hf_text(live, _rendered(live, ph), [Image.open(live.media / "cat.png")], 4)
    assert r.choices[0].message.content == want


def test_bad_images_are_400_naming_the_part(live, tmp_path):
    png = _png(64, 64, 3)
    outside = tmp_path / "secret.png"
    outside.write_bytes(png)
    bad = [
        ({"url": _data_url(png[:100])}, "content[0]"),  # truncated
        ({"url": "data:image/png;base64,@@@"}, "base64"),
        ({"url": "data:text/plain;base64,aGk="}, "image/"),
        ({"url": "https://example.com/cat.png"}, "not fetched"),
        ({"url": outside.as_uri()}, "outside"),
        ({"url": _data_url(_png(1000, 4, 0))}, "aspect ratio"),
        ({"url": _data_url(_png(600, 600, 0))}, "max_num_batched_tokens"),
        ({"url": _data_url(png), "detail": "high"}, "detail"),
        ({"url": _data_url(png), "extra": 1}, "extra"),
        ({"uri": _data_url(png)}, "image_url"),
    ]
    for part, match in bad:
        r = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url",
                                                       "image_url": part}]}]})
        assert r.status_code == 400, (part, r.text)
        assert match in r.json()["error"]["message"], (match, r.text)
    three = [{"type": "image_url", "image_url": {"url": _data_url(png)}}] * 3
    r = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": three}]})
    assert r.status_code == 400 and "limit of 2" in r.text
    r = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "assistant", "content": [{"type": "image_url",
                                               "image_url": {"url": _data_url(png)}}]}]})
    assert r.status_code == 400 and "user messages" in r.text
    # the server serves on, images included
    r = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": _data_url(png)}}]}]})
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["usage"]["prompt_tokens"] > 4


def test_fuzz_image_parts(live, tmp_path, monkeypatch):
    """The hostile-client fuzz over a vision-language server's image parts: every request
    is a 200 or a well-formed 4xx, the server answers a plain image request after each, and
    the engine ends idle (no leaked block or encoder entry in use)."""
    from hypothesis import strategies as st

    from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest
    from tests.entrypoints import test_hostile_clients as h

    png = _png(56, 84, 9)
    (tmp_path / "x.png").write_bytes(png)
    urls = [_data_url(png), _data_url(png[:60]), _data_url(png, "gif"), "data:image/png,raw",
            "data:image/png;base64,", "data:;base64,aGk=", "file:///etc/passwd",
            (live.media / "cat.png").as_uri(), (live.media / "nope.png").as_uri(),
            str(live.media / "cat.png"), "ftp://x/y.png", "http://127.0.0.1:1/a.png",
            _data_url(_png(2, 2, 0)), _data_url(_png(3000, 3000, 0, fmt="JPEG"))]

    def body(overrides):
        b = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi"},
            {"type": "image_url", "image_url": {"url": _data_url(png)}}]}]}
        for path, value in overrides.items():
            if path == "url":
                b["messages"][0]["content"][1]["image_url"]["url"] = value
            elif path == "detail":
                b["messages"][0]["content"][1]["image_url"]["detail"] = value
            elif path == "parts":
                b["messages"][0]["content"] = value
            else:
                h._set(b, path, value)
        return b

    def works(_):
        r = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, json=body({}))
        assert r.status_code == 200, r.text

    img = {"type": "image_url", "image_url": {"url": _data_url(png)}}
    monkeypatch.setattr(h, "VALUES", st.one_of(
        h.VALUES, st.sampled_from(urls),
        st.lists(st.sampled_from([img, {"type": "text", "text": "x"}, {"type": "image_url"}]),
                 max_size=4)))
    valid = [({"url": (live.media / "cat.png").as_uri()}, True),
             ({"parts": [img, img]}, False)]
    h._fuzz(live, "/v1/chat/completions", ChatCompletionRequest, body,
            ["url", "detail", "parts", "messages[0].content[0].image_url"], valid,
            examples=40, works=works)


def test_offline_chat_with_image_parts(live):
    """LLM.chat takes OpenAI content parts offline: image_url data URLs and vLLM's
    image_pil parts (file:// is the server's, refused by name); HF's text."""
    from PIL import Image

    from jaxinfer import LLM, SamplingParams

    llm = LLM(live.server.llm.resolved.model_dir, dtype="float32", max_model_len=256,
              max_num_batched_tokens=64, warmup=False, enable_multiprocessing=False,
              num_kv_blocks=32, max_num_seqs=2)
    a, b = _png(56, 56, 1), _png(84, 112, 4)
    conv = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": Image.open(io.BytesIO(a))},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_url(b)}}]}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                   use_tqdm=False)[0]
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    want, n = _hf_text(live, _rendered(live, f"{ph}and{ph}"),
                       [Image.open(io.BytesIO(x)) for x in (a, b)], 5)
    assert out.outputs[0].text == want and len(out.prompt_token_ids) == n
    with pytest.raises(ValueError, match="content.0.: file://"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (live.media / "cat.png").as_uri()}}]}],
            use_tqdm=False)
    with pytest.raises(ValueError, match="input_audio"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio"}]}], use_tqdm=False)
    llm.shutdown()


def test_bench_serve_random_mm(live, tmp_path):
    """`bench serve --dataset random-mm` (vLLM's workload: random text and random JPEG images,
    chat requests with data URLs): every request completes, the images' tokens are in the
    input count."""
    import argparse

    from jaxinfer.bench.datasets import parse_mm_buckets, random_mm_requests
    from jaxinfer.bench.serve import run_serve

    reqs = random_mm_requests(20, 8, 3, base_items=2, items_range_ratio=0.5, limit=3,
                              buckets="{(56, 56, 1): 0.5, (84, 56, 1): 0.5}", seed=1)
    counts = [len(r.images) for r in reqs]
    assert min(counts) >= 1 and max(counts) <= 3 and len(set(counts)) > 1
    from PIL import Image

    sizes = {Image.open(io.BytesIO(im)).size for r in reqs for im in r.images}
    assert sizes == {(56, 56), (56, 84)}
    assert parse_mm_buckets('{"448x448": 2, "224x224": 2}') == {(448, 448, 1): 0.5,
                                                                (224, 224, 1): 0.5}
    for bad in ("{(4, 4, 2): 1}", "{(4, 4, 1): 0}", "nope"):
        with pytest.raises(ValueError, match="random-mm-bucket-config"):
            parse_mm_buckets(bad)

    out = tmp_path / "serve.json"
    args = argparse.Namespace(
        base_url=live.base_url, model=MODEL, api_key=None, tokenizer=None, vocab_size=49152,
        dataset="random-mm", dataset_path=None, num_prompts=4, input_len=6, output_len=3,
        random_range_ratio=0.0, random_mm_base_items_per_request=2,
        random_mm_num_mm_items_range_ratio=0.0, random_mm_limit_mm_per_prompt=2,
        random_mm_bucket_config="{(56, 56, 1): 1.0}", request_rate=float("inf"),
        burstiness=1.0, max_concurrency=2, goodput_ttft_ms=None, goodput_tpot_ms=None,
        goodput_e2e_ms=None, seed=0, output_json=str(out))
    run_serve(args)
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (4, 0), r["errors"]
    assert r["total_images"] == 8 and r["total_output_tokens"] == 12
    assert r["total_input_tokens"] > 4 * (6 + 2 * 4)  # (each 56 x 56 image: 4 tokens)


def test_structured_output_with_an_image(live):
    """A grammar applies to a request with an image (the constraint is on the output)."""
    import re

    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x")
    r = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(_png(56, 56, 6))}},
            {"type": "text", "text": "yes or no?"}]}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert re.fullmatch("yes|no", r.choices[0].message.content), r.choices[0].message.content

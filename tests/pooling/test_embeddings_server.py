"""A pooling server (runner="pooling") on SmolLM2: /v1/embeddings through the openai SDK equals
HF transformers in float64 and one-by-one requests; base64; /v1/score and /rerank; refusals;
the generate routes are not served."""

from __future__ import annotations

import base64

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.engine.async_engine import AsyncLLM  # noqa: E402
from tests.helpers import LiveServer  # noqa: E402

MODEL = "smol-embed"
TEXTS = [f"Sentence number {i} is about {'cats' if i % 2 else 'the weather'} and more."
         for i in range(64)]


@pytest.fixture(scope="module")
def live(smollm2_dir):
    llm = AsyncLLM(EngineConfig(model=smollm2_dir, runner="pooling", dtype="float32",
                                max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128,
                                warmup=False, num_kv_blocks=64,
                                pooler_config={"pooling_type": "MEAN"}))
    srv = LiveServer(llm, MODEL)
    srv.client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    yield srv
    srv.close()


def test_embeddings_equal_hf_and_one_by_one(live, smollm2_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    batch = live.client.embeddings.create(model=MODEL, input=TEXTS)
    assert batch.model == MODEL and len(batch.data) == 64
    assert [d.index for d in batch.data] == list(range(64))
    got = np.array([d.embedding for d in batch.data])
    assert got.shape == (64, 576) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    for i in (0, 1, 37):  # one by one: the same vectors
        one = live.client.embeddings.create(model=MODEL, input=TEXTS[i]).data[0].embedding
        assert float(np.dot(one, got[i])) > 0.99999
    tok = live.server.llm.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    assert batch.usage.prompt_tokens == sum(map(len, ids)) == batch.usage.total_tokens
    hf = transformers.AutoModel.from_pretrained(smollm2_dir, torch_dtype=torch.float64).eval()
    for i in (0, 5):
        with torch.no_grad():
            h = hf(torch.tensor([ids[i]])).last_hidden_state[0].numpy().mean(0)
        assert float(got[i] @ (h / np.linalg.norm(h))) > 0.99999
    # token ids in, base64 out (the raw body: little-endian float32): the same vector
    r = httpx.post(live.base_url + "/v1/embeddings", json={
        "model": MODEL, "input": [ids[3]], "encoding_format": "base64"})
    b64 = r.json()["data"][0]["embedding"]
    assert isinstance(b64, str)
    vec = np.frombuffer(base64.b64decode(b64), "<f4")
    assert vec.shape == (576,) and float(vec @ got[3]) > 0.99999


def test_score_rerank_and_refusals(live):
    url = live.base_url
    r = httpx.post(url + "/v1/score", json={"model": MODEL, "text_1": TEXTS[0],
                                            "text_2": [TEXTS[0], TEXTS[2], TEXTS[1]]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] > scores[2]
    r = httpx.post(url + "/rerank", json={"model": MODEL, "query": TEXTS[0], "top_n": 2,
                                          "documents": [TEXTS[1], TEXTS[0], TEXTS[2]]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [1, 2]
    assert results[0]["document"]["text"] == TEXTS[0]
    for body, field in (({"input": "x", "dimensions": 64}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "frobnicate": 1}, "frobnicate"),
                        ({"input": []}, "input"),
                        ({"input": [10**9]}, "input"),
                        ({"input": "x " * 2000}, "input")):
        r = httpx.post(url + "/v1/embeddings", json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
    assert httpx.post(url + "/v1/embeddings", json={"model": "nope", "input": "x"}
                      ).status_code == 404
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert httpx.post(url + path, json={"model": MODEL}).status_code == 404, path
    # still serving, nothing held
    assert len(live.client.embeddings.create(model=MODEL, input="ok").data) == 1
    stats = live.server.llm.stats
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0

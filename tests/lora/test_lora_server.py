"""LoRA over the OpenAI server, driven by the `openai` client: --lora-modules, adapters in
/v1/models, a request's `model` naming an adapter, runtime load / unload behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING, errors in OpenAI's shape, the server serving on."""

from __future__ import annotations

import httpx
import pytest

from jaxinfer.config import EngineConfig
from tests.engine.conftest import hf_greedy, make_tiny_model_dir
from tests.helpers import LiveServer
from tests.lora.helpers import make_adapter

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_dir):
    from jaxinfer.engine.async_engine import AsyncLLM

    root = tmp_path_factory.mktemp("lora-server")
    hf = make_tiny_model_dir(root / "base", "llama", smollm2_dir)
    refs = {}
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(root / "base" / "tokenizer.json")).encode(
        PROMPT, add_special_tokens=False).ids
    for name, targets, seed in (("a1", ["q_proj", "v_proj", "down_proj"], 1),
                                ("a2", ["o_proj", "gate_proj"], 2)):
        refs[name] = hf_greedy(make_adapter(hf, str(root / name), targets=targets, r=4,
                                            seed=seed), ids, 6)
    make_adapter(hf, str(root / "dora"), targets=["q_proj"], r=4, use_dora=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    llm = AsyncLLM(EngineConfig(model=str(root / "base"), dtype="float32", max_model_len=64,
                                max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                num_kv_blocks=32, enable_lora=True, max_loras=2,
                                max_lora_rank=8))
    server = LiveServer(llm, MODEL, lora_modules=[f"a1={root / 'a1'}"])
    server.root, server.refs = root, refs
    yield server
    server.close()
    mp.undo()


def _tokens(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True,
                                                          "return_tokens_as_token_ids": True})
    assert r.model == model
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_models_adapters_and_runtime_updates(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "a1"}
    assert models["a1"].parent == MODEL and models["a1"].root == str(live.root / "a1")
    assert client.models.retrieve("a1").id == "a1"
    assert _tokens(client, "a1") == live.refs["a1"]
    base = _tokens(client, MODEL)
    assert base != live.refs["a1"]
    with pytest.raises(openai.NotFoundError, match="a2"):
        _tokens(client, "a2")
    url = live.base_url + "/v1/"
    r = httpx.post(url + "load_lora_adapter",
                   json={"lora_name": "a2", "lora_path": str(live.root / "a2")})
    assert r.status_code == 200 and "a2" in r.text
    assert _tokens(client, "a2") == live.refs["a2"]
    for body, status, words in (
            ({"lora_name": "a2", "lora_path": str(live.root / "a2")}, 400, "already"),
            ({"lora_name": "d", "lora_path": str(live.root / "dora")}, 400, "DoRA"),
            ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "not a folder"),
            ({"lora_name": "x"}, 400, "lora_path"),
            ({"lora_name": "x", "lora_path": "/p", "extra": 1}, 400, "extra")):
        r = httpx.post(url + "load_lora_adapter", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "a2")
    assert _tokens(client, MODEL) == base and _tokens(client, "a1") == live.refs["a1"]


def test_serve_flags_and_lora_modules_forms():
    from jaxinfer.config.cli import engine_config_from_args
    from jaxinfer.entrypoints.cli import build_parser
    from jaxinfer.entrypoints.openai.api_server import parse_lora_modules

    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
         "--max-cpu-loras", "5", "--lora-modules", "a=/x",
         '{"name": "b", "path": "/y", "base_model_name": "base"}'])
    cfg = engine_config_from_args(args)
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (
        True, 3, 32, 5)
    assert parse_lora_modules(args.lora_modules, "m") == [("a", "/x", "m"), ("b", "/y", "base")]
    for bad, words in (("nopath", "name=path"), ("=/x", "name=path"), ('{"name": "b"}', "path"),
                       ("{bad json", "JSON")):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules([bad], "m")
    for kw, words in ((dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
                      (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
                      (dict(enable_lora=True, pipeline_parallel_size=2), "pipeline"),
                      (dict(enable_lora=True, speculative_config={
                          "method": "ngram", "num_speculative_tokens": 2}), "speculative")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(**kw)

"""The RL routes over HTTP (VLLM_SERVER_DEV_MODE=1; absent without it): pause / resume with
a request parked in the middle, sleep / wake up, a weight update from a folder with its
version on /weight_info, collective_rpc; bad input is a 400 naming the parameter."""

from __future__ import annotations

import threading

import httpx
import pytest

from jaxinfer.config import EngineConfig
from tests.engine.conftest import hf_greedy, make_tiny_model_dir
from tests.helpers import LiveServer

torch = pytest.importorskip("torch")
MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_dir):
    from tokenizers import Tokenizer

    from jaxinfer.engine.async_engine import AsyncLLM

    root = tmp_path_factory.mktemp("rl-server")
    hf = make_tiny_model_dir(root / "base", "llama", smollm2_dir)
    ids = Tokenizer.from_file(str(root / "base" / "tokenizer.json")).encode(
        PROMPT, add_special_tokens=False).ids
    ref0 = hf_greedy(hf.double(), ids, 6)
    hf = hf.float()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    ref1 = hf_greedy(hf.double(), ids, 6)
    hf.float().save_pretrained(root / "updated")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")
    llm = AsyncLLM(EngineConfig(model=str(root / "base"), dtype="float32", max_model_len=64,
                                max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                num_kv_blocks=32, enable_sleep_mode=True))
    server = LiveServer(llm, MODEL)
    server.root, server.refs = root, (ref0, ref1)
    yield server
    server.close()
    mp.undo()


def _tokens(live, max_tokens=6):
    r = httpx.post(live.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _call(live, method, path, status=200, **kw):
    r = httpx.request(method, live.base_url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    return r.json()


def test_pause_sleep_update_and_rpc_routes(live):
    ref0, ref1 = live.refs
    assert _tokens(live) == ref0
    # pause "keep" with a request in the middle: it waits, then finishes after /resume
    assert _call(live, "POST", "/pause?mode=keep") == {"status": "paused"}
    assert _call(live, "GET", "/is_paused") == {"is_paused": True}
    got = []
    t = threading.Thread(target=lambda: got.append(_tokens(live)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got  # held while paused
    assert _call(live, "POST", "/resume") == {"status": "resumed"}
    t.join(60)
    assert got == [ref0]
    # sleep level 1 and wake
    assert _call(live, "POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}
    assert _call(live, "GET", "/is_sleeping") == {"is_sleeping": True}
    assert _call(live, "POST", "/wake_up?tags=weights") == {"status": "sleeping",
                                                           "tags": ["weights"]}
    assert _call(live, "POST", "/wake_up") == {"status": "awake", "tags": None}
    assert _tokens(live) == ref0
    # a new version from a folder
    r = _call(live, "POST", "/update_weights_from_path",
              json={"path": str(live.root / "updated"), "weight_version": "v2"})
    assert r["message"] == "Weights updated" and r["weight_version"] == "v2"
    assert _call(live, "GET", "/weight_info") == {"weight_version": "v2"}
    assert _tokens(live) == ref1
    assert _call(live, "POST", "/update_weight_version", json={"new_version": "v3"}) == \
        {"success": True, "new_version": "v3"}
    rpc = _call(live, "POST", "/collective_rpc", json={"method": "cache_counts"})
    assert "compile_cache_requests" in rpc["results"][0]
    for method, path, kw, param in (
            ("POST", "/pause?mode=later", {}, "mode"),
            ("POST", "/pause?clear_cache=maybe", {}, "clear_cache"),
            ("POST", "/pause?unknown=1", {}, "unknown"),
            ("POST", "/sleep?level=3", {}, "level"),
            ("POST", "/wake_up?tags=gpu", {}, "tags"),
            ("POST", "/update_weights_from_path", {"json": {"path": "/nonexistent"}}, None),
            ("POST", "/update_weights_from_path", {"json": {"path": 3}}, "path"),
            ("POST", "/collective_rpc", {"json": {"method": "sleep"}}, None),
            ("POST", "/collective_rpc", {"json": {"method": "cache_counts", "args": [1]}},
             "args"),
            ("POST", "/collective_rpc", {"json": {"method": "x", "timeout": 1}}, "timeout"),
            ("POST", "/update_weights_from_transfer", {"json": {"payload": 1}}, "payload"),
            ("POST", "/update_weights_from_transfer", {"json": {"payload": {"uuids": []}}},
             None)):
        err = _call(live, method, path, 400, **kw)["error"]
        assert param is None or err["param"] == param, err
    assert _tokens(live) == ref1  # serving on


def test_routes_do_not_exist_without_dev_mode(monkeypatch):
    from types import SimpleNamespace

    from jaxinfer.entrypoints.openai.app import build_app

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    # (routes only: no engine needed, only what the routes are chosen by)
    server = SimpleNamespace(llm=SimpleNamespace(resolved=SimpleNamespace(runner="generate")))
    paths = {r.path for r in build_app(server).routes}
    assert "/v1/completions" in paths
    dev = {"/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
           "/collective_rpc", "/update_weights_from_path", "/weight_info",
           "/update_weight_version", "/update_weights_from_transfer"}
    assert not paths & dev
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev <= {r.path for r in build_app(server).routes}

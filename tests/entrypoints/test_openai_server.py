"""The OpenAI-compatible server, live on 127.0.0.1, driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.engine.async_engine import AsyncLLM  # noqa: E402
from tests.helpers import LiveServer  # noqa: E402

MODEL = "smol"
ALIAS = "smol-alias"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    llm = AsyncLLM(EngineConfig(model=smollm2_dir, dtype="float32", max_model_len=256,
                                max_num_seqs=16, max_num_batched_tokens=128, warmup=False,
                                num_kv_blocks=300))
    # (two served names, as `--served-model-name smol smol-alias`: the first is the one
    # responses and metrics use)
    live = LiveServer(llm, [MODEL, ALIAS], trust_request_chat_template=True)
    srv = live.server
    srv.base_url = live.base_url
    yield srv
    live.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def wait_idle(server, timeout=30.0):
    """Until the engine holds no request and every KV block is free."""
    llm = server.llm
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = llm.stats  # the core's, as of its last step or its last going idle
        if (not llm.output_processor.has_unfinished() and st["num_running_reqs"] == 0
                and st["num_waiting_reqs"] == 0
                and st["num_free_kv_blocks"] == st["num_kv_blocks"] - 1):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {llm.stats}")


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_completion_usage_and_streaming_equals_non_streaming(server, client):
    tok = server.llm.tokenizer
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert chunks[-1].usage.completion_tokens == 12
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "length"
    wait_idle(server)


def test_chat_usage_streaming_and_stop(server, client):
    tok = server.llm.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30)
    c = r.choices[0]
    assert "Paris" in c.message.content and c.message.role == "assistant"
    assert c.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(msgs))
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                            max_tokens=30, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) \
        == c.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # A stop string: the text ends right before it, in both modes.
    word = c.message.content.split()[2]
    for stream in (False, True):
        res = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                             max_tokens=30, stop=[word], stream=stream)
        if stream:
            chunks = list(res)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            text, reason = res.choices[0].message.content, res.choices[0].finish_reason
        assert reason == "stop" and word not in text
        assert text == c.message.content[: c.message.content.index(word)]
    wait_idle(server)


def test_n_samples_and_logprobs(server, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0,
                                  seed=11, max_tokens=8, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 8
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(len(t) >= 2 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 24
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3,
                                       messages=[{"role": "user", "content": "Hi"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(x.top_logprobs) == 3 for x in content)
    assert "".join(x.token for x in content).startswith(r.choices[0].message.content[:3])
    wait_idle(server)


def test_concurrent_streams_equal_their_single_results(server, client):
    # 20 streams against the same 20 requests non-streamed (greedy: batch-invariant);
    # 200 streams below.
    prompts = [f"Item {i}: the {w} is" for i, w in
               enumerate(["sky", "sea", "cat", "dog", "sun"] * 4)]
    kw = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True})

    async def single(aclient, p):
        return (await aclient.completions.create(model=MODEL, prompt=p, **kw)).choices[0].text

    async def one(aclient, p):
        text = ""
        async for ch in await aclient.completions.create(model=MODEL, prompt=p, stream=True,
                                                         **kw):
            text += ch.choices[0].text
        return text

    async def run_all(fn):
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none",
                                     max_retries=0, timeout=300)
        return await asyncio.gather(*(fn(aclient, p) for p in prompts))

    singles = asyncio.run(run_all(single))  # non-streaming, all at once
    results = asyncio.run(run_all(one))
    assert results == singles
    wait_idle(server)


def test_client_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.",
            "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert server.llm.output_processor.has_unfinished()
    wait_idle(server)  # the request was aborted: nothing running, every block free
    metrics = httpx.get(server.base_url + "/metrics").text
    line = [m for m in metrics.splitlines()
            if m.startswith("vllm:request_success_total") and 'finished_reason="abort"' in m]
    assert line and float(line[0].split()[-1]) >= 1


def test_bad_requests_get_4xx_and_the_next_one_succeeds(server, client):
    url = server.base_url + "/v1/completions"
    cases = [
        (b"{not json", 400, "JSON"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "temperature": -0.5}), 400, "temperature"),
        (json.dumps({"model": MODEL, "prompt": "hello " * 300}), 400, "256"),
        (json.dumps({"model": MODEL, "prompt": "hello " * 200, "max_tokens": 100}), 400,
         "However, you requested 301 tokens (201 in the prompt, 100 in the completion)"),
        (json.dumps({"model": "gpt-4", "prompt": "x"}), 404, "gpt-4"),
        (json.dumps({"model": MODEL}), 400, "prompt"),
    ]
    for body, status, needle in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["code"] == status, (body, err)
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": []}, timeout=60)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
    wait_idle(server)


def _samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """/metrics text -> sample name -> [(labels, value)]."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def test_metrics_serve_vllms_grafana_dashboard(server, client):
    """Every series vLLM's Grafana dashboard queries is exported, with vLLM's labels
    (model_name = the served name, engine), and carries these requests."""
    before = _samples(httpx.get(server.base_url + "/metrics").text)
    n = 3
    for i in range(n):
        client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    wait_idle(server)
    after = _samples(httpx.get(server.base_url + "/metrics").text)
    path = __file__.rsplit("/", 1)[0] + "/data/vllm_grafana_metrics.txt"
    wanted = [w.strip() for w in open(path) if w.strip() and not w.startswith("#")]
    assert len(wanted) == 24
    missing = [w for w in wanted if w not in after]
    assert not missing, missing
    for name in wanted:
        for labels, _ in after[name]:
            assert labels.get("model_name") == MODEL and labels.get("engine") == "0", (name,
                                                                                       labels)

    def total(samples, name, **match):
        return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x
                                                               for k, x in match.items()))

    def grew(name, **match):
        return total(after, name, **match) - total(before, name, **match)

    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_params_max_tokens_count", "vllm:request_num_preemptions_count",
                 "vllm:request_prefill_kv_computed_tokens_count"):
        assert grew(name) == n, name
    assert grew("vllm:request_success_total", finished_reason="length") == n
    assert grew("vllm:generation_tokens_total") == 5 * n
    assert grew("vllm:request_max_num_generation_tokens_sum") == 5 * n
    assert grew("vllm:request_params_max_tokens_sum") == 5 * n
    assert grew("vllm:inter_token_latency_seconds_count") == 4 * n
    assert grew("vllm:request_prefill_time_seconds_sum") > 0
    assert grew("vllm:request_decode_time_seconds_sum") > 0
    assert grew("vllm:iteration_tokens_total_sum") >= 5 * n
    # TPOT = decode time / (tokens - 1), per request
    tpot = grew("vllm:request_time_per_output_token_seconds_sum")
    assert tpot == pytest.approx(grew("vllm:request_decode_time_seconds_sum") / 4, rel=1e-6)
    # e2e >= queue + inference for every request, so for the sums too
    assert grew("vllm:e2e_request_latency_seconds_sum") >= (
        grew("vllm:request_queue_time_seconds_sum")
        + grew("vllm:request_inference_time_seconds_sum")) - 1e-6
    awake = total(after, "vllm:engine_sleep_state", sleep_state="awake")
    assert awake == 1.0
    (info, value), = after["vllm:cache_config_info"]
    assert value == 1.0 and info["enable_prefix_caching"] == "True" and int(info["block_size"])


def test_tokenize_detokenize_version_ping_load_and_served_names(server, client):
    """vLLM's utility routes, and a request naming the second served name."""
    base, tok = server.base_url, server.llm.tokenizer

    def post(path, body, status=200):
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == status, (path, body, r.text)
        return r.json()

    text = "Hello world, count: 1 2 3"
    got = post("/tokenize", {"model": ALIAS, "prompt": text, "return_token_strs": True})
    ids = tok.encode(text)
    assert got == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    assert all(isinstance(s, str) and s for s in got["token_strs"])
    assert post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == \
        tok.encode(text, add_special_tokens=False)
    assert post("/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": text}
    # A chat through the template: the ids the chat route prefills (its usage says how many)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat_ids = post("/tokenize", {"messages": msgs})
    assert chat_ids["tokens"] == tok.apply_chat_template(msgs)
    r = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=2,
                                       temperature=0)
    assert r.usage.prompt_tokens == chat_ids["count"] and r.model == MODEL
    no_prompt = post("/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert no_prompt["count"] < chat_ids["count"]
    # Refusals name the field; an unknown model is a 404
    for body, field in (({"prompt": "x", "truncate": 3}, "truncate"),
                        ({"prompt": 5}, "prompt"),
                        ({"messages": msgs, "continue_final_message": True},
                         "continue_final_message"),
                        ({"messages": []}, "messages")):
        err = post("/tokenize", body, 400)["error"]
        assert err["param"] == field and field in err["message"], err
    vocab = server.llm.processor.vocab_size
    for tokens, field in (([0, vocab], "tokens"), ([-1], "tokens"), (["a"], "tokens.0")):
        err = post("/detokenize", {"tokens": tokens}, 400)["error"]
        assert err["param"] == field, err
    assert post("/tokenize", {"model": "nope", "prompt": "x"}, 404)["error"]["code"] == 404
    assert post("/detokenize", {"model": "nope", "tokens": [1]}, 404)["error"]["code"] == 404
    import jaxinfer

    assert httpx.get(base + "/version").json() == {"version": jaxinfer.__version__}
    assert httpx.get(base + "/ping").status_code == 200
    assert httpx.post(base + "/ping").status_code == 200
    wait_idle(server)
    assert httpx.get(base + "/load").json() == {"server_load": 0}
    assert client.models.retrieve(ALIAS).id == ALIAS


def test_models_health_metrics_and_auth(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    metrics = httpx.get(server.base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:num_preemptions_total", "vllm:engine_sleep_state",
                 "vllm:cache_config_info", "jaxinfer:engine_core_alive"):
        assert name in metrics, name
    server.api_key = "s3cret"
    try:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        authed = openai.OpenAI(base_url=server.base_url + "/v1", api_key="s3cret")
        assert authed.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(server.base_url + "/health").status_code == 200  # not under /v1
    finally:
        server.api_key = None
    wait_idle(server)


def _post(server, path, body, **kw):
    return httpx.post(server.base_url + path, json=body, timeout=60, **kw)


def test_fields_are_honoured_ignored_by_list_or_refused_by_name(server):
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # What OpenAI clients send routinely, and no-op values of what we cannot do yet: 200.
    for extra in ({"user": "u1", "store": False, "metadata": {"a": "b"}},
                  {"response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1}):
        assert _post(server, "/v1/completions", base | extra).status_code == 200, extra
    assert _post(server, "/v1/chat/completions",
                 chat | {"tool_choice": "none", "user": "u"}).status_code == 200
    refused = [
        ("/v1/chat/completions", chat | {"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x"}}},
         "response_format"),
        ("/v1/chat/completions", chat | {"response_format": {"type": "json_schema", "json_schema":
                                                             {"name": "x",
                                                              "schema": {"type": "foo"}}}},
         "response_format"),
        ("/v1/chat/completions", chat | {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/completions", base | {"guided_regex": "a(b"}, "guided_regex"),
        ("/v1/completions", base | {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", base | {"structured_outputs": {"regexp": "a"}},
         "structured_outputs"),
        ("/v1/completions", base | {"guided_regex": "a", "guided_choice": ["a"]},
         "guided_choice"),
        ("/v1/completions", base | {"guided_regex": "a", "guided_decoding_backend": "outlines"},
         "guided_decoding_backend"),
        # tools default to tool_choice="auto", which needs --enable-auto-tool-choice
        ("/v1/chat/completions", chat | {"tools": [{"type": "function",
                                                    "function": {"name": "f"}}]},
         "tool_choice"),
        ("/v1/chat/completions", chat | {"tools": []}, "tools"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function", "function": {}}]},
         "tools[0].function.name"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function",
                                                    "function": {"name": "f"}}],
                                         "tool_choice": {"type": "function",
                                                         "function": {"name": "g"}}},
         "tool_choice"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function",
                                                    "function": {"name": "f"}}],
                                         "tool_choice": "required",
                                         "response_format": {"type": "json_object"}},
         "response_format"),
        ("/v1/chat/completions", chat | {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", chat | {"messages": [{"role": "user", "content": "x",
                                                       "colour": "red"}]}, "messages.colour"),
        ("/v1/chat/completions", chat | {"tool_choice": "required"}, "tool_choice"),
        ("/v1/completions", base | {"logit_bias": {"fifty": 5}}, "logit_bias"),
        ("/v1/completions", base | {"best_of": 3}, "best_of"),
        ("/v1/completions", base | {"suffix": "end"}, "suffix"),
        ("/v1/completions", base | {"frobnicate": 1}, "frobnicate"),
        ("/v1/completions", base | {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", base | {"stream": True,
                                    "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ("/v1/completions", base | {"stream": True, "stream_options": {"bogus": 1}},
         "stream_options.bogus"),
    ]
    for path, body, field in refused:
        r = _post(server, path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
    wait_idle(server)


def test_unknown_routes_methods_and_big_bodies_get_openai_errors(server):
    r = httpx.get(server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
    old = server.max_request_body_bytes
    server.max_request_body_bytes = 1000
    try:
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 2000})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "body" and "1000" in err["message"]
        # Without a content-length (chunked upload) the limit holds too.
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       content=iter([b'{"model": "smol", "prompt": "', b"y" * 2000, b'"}']),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       content=iter([b'{"model": "smol", ', b'"prompt": "Hi", "max_tokens": 2}']),
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    finally:
        server.max_request_body_bytes = old
    wait_idle(server)


def test_lm_eval_loglikelihood_requests(server):
    """What lm-evaluation-harness's local-completions sends: token-id prompts, echo=true,
    logprobs, max_tokens 1 (or 0: prompt only, as vLLM allows)."""
    prompt = [504, 3458, 282, 4649, 314, 7042]  # "The capital of France is Paris"-like ids
    for max_tokens in (1, 0):
        r = _post(server, "/v1/completions", {
            "model": MODEL, "prompt": [prompt], "echo": True, "logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        lps = choice["logprobs"]
        n = len(prompt) + max_tokens
        assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == n
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert all(v <= 0 for v in lps["token_logprobs"][1:])
        # The top-1 alternative is at least as likely as the prompt's own token.
        for tok, v, top in zip(lps["tokens"][1:], lps["token_logprobs"][1:],
                               lps["top_logprobs"][1:]):
            assert tok in top and max(top.values()) >= v - 1e-6
        assert lps["text_offset"] == sorted(lps["text_offset"])
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == max_tokens
    # generate_until: stop strings and plain greedy text.
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": ["Q: 2+2?\nA:"],
                                          "max_tokens": 8, "temperature": 0, "stop": ["\n"],
                                          "seed": 1234})
    assert r.status_code == 200 and "\n" not in r.json()["choices"][0]["text"]
    wait_idle(server)


def test_health_answers_while_a_huge_prompt_is_refused(server):
    """A multi-megabyte prompt is refused (400, both numbers) without stalling the event loop:
    /health keeps answering meanwhile."""
    import threading

    result = {}

    def big():
        result["r"] = _post(server, "/v1/completions",
                            {"model": MODEL, "prompt": "The quick brown fox. " * 300_000})

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    r = result["r"]
    assert r.status_code == 400 and "256" in r.json()["error"]["message"], r.text
    assert worst < 5.0, worst
    wait_idle(server)


def test_n_is_capped_by_name(server, monkeypatch):
    monkeypatch.setenv("JAXINFER_MAX_N_SEQUENCES", "4")
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 5,
                                          "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "[1, 4]" in r.json()["error"]["message"]
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 4,
                                             "max_tokens": 1}).status_code == 200
    # prompts x n counts too
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": ["x", "y"], "n": 3,
                                          "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "6 sequences, more than the limit of 4" in r.json()["error"]["message"]
    wait_idle(server)


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_through_the_openai_client(server, client):
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), PERSON)
    # Streaming: the chunks add up to the same JSON.
    chunks = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=60, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    # vLLM's request extras: guided_choice, structured_outputs, guided_regex.
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, n=3,
                                  temperature=1.0, seed=1,
                                  extra_body={"guided_choice": ["blue", "green"]})
    assert all(ch.text in ("blue", "green") and ch.finish_reason == "stop" for ch in r.choices)
    r = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=12,
                                  temperature=0, extra_body={"structured_outputs": {
                                      "regex": "20[0-9][0-9]-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch("20[0-9][0-9]-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    wait_idle(server)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}}}
# A Hermes-style template that shows the tools to the model (SmolLM2's own does not).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools, one per <tool_call></tool_call>"
    " block:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _stream_calls(chunks):
    """Tool calls and content put together from streamed deltas, as OpenAI clients do."""
    calls, content, finish = {}, "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            if tc.function:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def test_tool_calls_named_and_required(server, client):
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    common = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=60,
                  tools=[WEATHER, TIME], extra_body={"chat_template": TOOL_TEMPLATE})
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, **common)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.content  # named: "stop", as OpenAI
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    calls, content, finish = _stream_calls(client.chat.completions.create(
        tool_choice=named, stream=True, **common))
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather",
                                                             call.function.arguments)]
    assert finish == "stop" and not content

    # required: a JSON array of calls (one at most with parallel_tool_calls=False).
    one = dict(common, parallel_tool_calls=False)
    r = client.chat.completions.create(tool_choice="required", **one)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message.content
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tc in c.message.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), params[tc.function.name])
    calls, content, finish = _stream_calls(client.chat.completions.create(
        tool_choice="required", stream=True, **one))
    assert [(x["name"], x["arguments"]) for x in calls] == [
        (tc.function.name, tc.function.arguments) for tc in c.message.tool_calls]
    assert finish == "tool_calls" and all(x["id"] for x in calls) and not content
    # Unlimited, this model keeps adding calls: cut short, the text comes back as content.
    r = client.chat.completions.create(tool_choice="required", **common)
    c = r.choices[0]
    if c.finish_reason == "length":
        assert not c.message.tool_calls and c.message.content.lstrip().startswith("[")
    else:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls

    # The calls and their results go back into the conversation (rendered by the template).
    follow = msgs + [{"role": "assistant", "content": None, "refusal": None,
                      "tool_calls": [{"id": call.id, "type": "function", "function": {
                          "name": "get_weather", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, temperature=0,
                                       max_tokens=5, tools=[WEATHER], tool_choice="none",
                                       extra_body={"chat_template": TOOL_TEMPLATE})
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    wait_idle(server)


def test_tool_choice_auto_with_a_parser(server, client, monkeypatch):
    from jaxinfer.entrypoints.openai.tools import HermesToolParser
    from jaxinfer.outputs import CompletionOutput

    msgs = [{"role": "user", "content": "Hi! How are you?"}]
    common = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=12, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(**common)  # auto is the default with tools
    monkeypatch.setattr(server, "tool_parser", HermesToolParser())
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(**common)  # SmolLM2's template ignores tools
    common["extra_body"] = {"chat_template": TOOL_TEMPLATE}
    r = client.chat.completions.create(**common)
    chunks = client.chat.completions.create(stream=True, **common)
    calls, content, finish = _stream_calls(chunks)
    m = r.choices[0].message
    assert calls == [] if not m.tool_calls else [c["name"] for c in calls] == [
        t.function.name for t in m.tool_calls]
    assert content == (m.content or "") and finish == r.choices[0].finish_reason
    # What the parser makes of a text with calls (the model above may not call any).
    req = openai_request(common)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Oslo", "unit": "C"}}\n</tool_call>'
    msg, fin = server.chat._chat_message(req, "auto", CompletionOutput(
        index=0, text=text, token_ids=[1], cumulative_logprob=None, logprobs=None,
        finish_reason="stop"))
    assert fin == "tool_calls" and msg["content"] == "Let me check."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Oslo", "unit": "C"}'}
    wait_idle(server)


def openai_request(kwargs):
    from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest

    body = {k: v for k, v in kwargs.items() if k != "extra_body"} | kwargs.get("extra_body", {})
    return ChatCompletionRequest(**body)


@pytest.mark.slow  # (CI keeps test_concurrent_streams_equal_their_single_results)
def test_200_streams_with_10_percent_disconnecting(server):
    """200 concurrent streams; every tenth client hangs up after its first chunk. The others
    complete with their token counts; the aborted ones free their blocks; the gauges go back
    to 0."""
    n, max_tokens = 200, 4
    url = server.base_url + "/v1/completions"

    async def one(h, i):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        leave = i % 10 == 0
        text, usage = "", None
        async with h.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                if ev["choices"]:
                    text += ev["choices"][0]["text"]
                    if leave:
                        return "left", None
        return text, usage

    async def run_all():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as h:
            return await asyncio.gather(*(one(h, i) for i in range(n)))

    results = asyncio.run(run_all())
    done = [(t, u) for t, u in results if t != "left"]
    assert len(done) == n - n // 10
    assert all(u and u["completion_tokens"] == max_tokens and t for t, u in done)
    wait_idle(server, timeout=120)
    gauges = {line.split("{")[0]: float(line.split()[-1])
              for line in httpx.get(server.base_url + "/metrics").text.splitlines()
              if line.startswith(("vllm:num_requests_running",
                                  "vllm:num_requests_waiting"))}
    assert gauges == {"vllm:num_requests_running": 0.0,
                      "vllm:num_requests_waiting": 0.0}, gauges


def test_max_waiting_requests_and_queue_timeout(server, monkeypatch):
    body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    url = server.base_url + "/v1/completions"
    monkeypatch.setattr(server, "max_waiting_requests", 2)

    async def burst():
        async with httpx.AsyncClient(timeout=120) as h:
            return await asyncio.gather(*(h.post(url, json=body) for _ in range(8)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 429, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    err = limited.json()["error"]
    assert err["type"] == "RateLimitError" and "--max-waiting-requests" in err["message"]
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in responses
               if r.status_code == 200)
    assert server.num_waiting == 0  # every admitted sequence got its first token
    monkeypatch.setattr(server, "max_waiting_requests", None)

    monkeypatch.setattr(server, "queue_timeout", 0.001)  # no first token comes that fast
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 503 and "--queue-timeout" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    wait_idle(server)  # the timed-out request was aborted, its blocks freed
    monkeypatch.setattr(server, "queue_timeout", 30.0)
    assert _post(server, "/v1/completions", body).status_code == 200
    assert server.num_waiting == 0


def test_streaming_echo_with_logprobs_equals_non_streaming(server):
    for max_tokens in (3, 0):
        body = {"model": MODEL, "prompt": "The capital of France is", "echo": True,
                "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
        full = _post(server, "/v1/completions", body).json()["choices"][0]
        text, lps, finish = "", {"tokens": [], "token_logprobs": [], "text_offset": []}, None
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                          json=body | {"stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                for key in lps:
                    lps[key] += ch["logprobs"][key]
                finish = ch["finish_reason"] or finish
        assert text == full["text"] and finish == full["finish_reason"]
        for key in lps:
            assert lps[key] == pytest.approx(full["logprobs"][key]), key
    wait_idle(server)


CAPITALS = [("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
            ("The capital of Italy is", [" Madrid", " Rome", " Oslo"], 1),
            ("The capital of Germany is", [" Lisbon", " Vienna", " Berlin"], 2),
            ("The capital of Spain is", [" Madrid", " Athens", " Dublin"], 0)]


@pytest.mark.slow
def test_lm_eval_harness_runs_unchanged(server, smollm2_dir, tmp_path):
    """lm-evaluation-harness's local-completions (loglikelihood: multiple choice) and
    local-chat-completions (generate_until) against the live server, with a local task.
    Needs the eval extra (pip install -e '.[eval]') and JAXINFER_SLOW_TESTS=1."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in CAPITALS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n" \
             "test_split: test\n"
    (tmp_path / "mc.yaml").write_text(
        "task: jaxinfer_capitals\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: jaxinfer_capitals_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: 'Complete: {{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    tasks = TaskManager(include_path=str(tmp_path))
    url = server.base_url + "/v1"
    res = lm_eval.simple_evaluate(
        model="local-completions", tasks=["jaxinfer_capitals"], task_manager=tasks,
        model_args=f"base_url={url}/completions,model={MODEL},tokenizer={smollm2_dir},"
                   "num_concurrent=2,max_retries=1,tokenized_requests=True")
    acc = res["results"]["jaxinfer_capitals"]["acc,none"]
    assert acc >= 0.75, res["results"]  # a 135M model knows these capitals
    res = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["jaxinfer_capitals_gen"], task_manager=tasks,
        apply_chat_template=True,
        model_args=f"base_url={url}/chat/completions,model={MODEL},max_retries=1")
    assert "exact_match,none" in res["results"]["jaxinfer_capitals_gen"]
    assert len(res["samples"]["jaxinfer_capitals_gen"]) == len(CAPITALS)
    wait_idle(server)


def test_cache_salt_keys_the_prefix_cache_apart(server, client):
    """vLLM's cache_salt: only requests with the same salt share prefix-cache blocks (the
    prompt is longer than one 128-token block); an unsalted request shares none with salted
    ones; a salt that is empty or too long is a 400 naming it."""
    prompt = "the quick brown fox jumps over the lazy dog " * 20

    def hits_after(**extra):
        wait_idle(server)
        before = server.llm.stats["prefix_cache_hits"]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **extra)
        wait_idle(server)
        return server.llm.stats["prefix_cache_hits"] - before

    salt_a = {"extra_body": {"cache_salt": "tenant-a-secret"}}
    hits_after(**salt_a)  # (fills the cache under salt a)
    assert hits_after(extra_body={"cache_salt": "tenant-b-secret"}) == 0
    assert hits_after() == 0
    assert hits_after(**salt_a) >= 128
    for bad in ("", "x" * 1025, 7):
        r = _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "cache_salt": bad,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def _spy(server, monkeypatch) -> list:
    """(params, keyword arguments) of every request the server hands the engine."""
    seen = []
    generate = server.llm.generate

    def spy(prompt, params, request_id=None, **kwargs):
        seen.append((params, kwargs))
        return generate(prompt, params, request_id, **kwargs)

    monkeypatch.setattr(server.llm, "generate", spy)
    return seen


def test_priority_and_cache_salt_reach_the_engine(server, monkeypatch):
    """The request fields the engine acts on are passed to it, not only validated."""
    import dataclasses

    rc = server.llm.resolved
    monkeypatch.setattr(server.llm, "resolved", dataclasses.replace(
        rc, engine=dataclasses.replace(rc.engine, scheduling_policy="priority")))
    seen = _spy(server, monkeypatch)
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, path, {"model": MODEL, "max_tokens": 1, "priority": -5,
                                 "cache_salt": "s", **body})
        assert r.status_code == 200, r.text
    assert [kw for _, kw in seen] == [
        {"priority": -5, "cache_salt": "s"},
        {"priority": -5, "cache_salt": "s", "chat_template_kwargs": {}}]
    wait_idle(server)


def test_generation_config_defaults_fill_unset_fields(server, monkeypatch):
    """With the model's generation config defaults (here top_k 1, max_new_tokens 3), a request
    that leaves top_k / max_tokens unset gets them; its own values override, and the default
    max_tokens caps a larger one (vLLM's rule)."""
    import dataclasses

    rc = server.llm.resolved
    monkeypatch.setattr(server.llm, "resolved", dataclasses.replace(
        rc, default_sampling={"top_k": 1, "max_tokens": 3}))
    seen = _spy(server, monkeypatch)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for body in (chat, {**chat, "top_k": 7, "max_tokens": 2}, {**chat, "max_tokens": 9}):
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
    assert [(p.top_k, p.max_tokens) for p, _ in seen] == [(1, 3), (7, 2), (1, 3)]
    wait_idle(server)


def test_chat_template_kwargs(server, monkeypatch):
    """vLLM's chat_template_kwargs (and the server's --default-chat-template-kwargs) reach the
    template as variables; a request's override the server's; names the server sets itself
    are refused naming the field."""
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}"
                " no thinking please{% endif %}")

    def prompt_tokens(**extra):
        r = _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "chat_template": template,
            "messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    monkeypatch.setattr(server, "default_chat_template_kwargs", {"enable_thinking": False})
    assert prompt_tokens() > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    for bad in ({"messages": []}, {"tools": []}, {"not a name": 1}):
        r = _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "chat_template_kwargs": bad,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    wait_idle(server)


# -- reasoning models (--reasoning-parser) -------------------------------------------------------
# A Qwen3-style template: thinking on unless enable_thinking is false, which closes the thinking
# section in the prompt (as Qwen3's own template does); OPEN_THINK opens it in the prompt instead.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}")


def _script(server, monkeypatch, pieces, finish="stop"):
    """The engine's answer replaced by `pieces`, one token each (cumulative outputs, as the
    engine streams them), so that the split is tested on known text, tags cut anywhere."""
    from jaxinfer.outputs import CompletionOutput, RequestOutput

    seen = {}

    async def generate(prompt, params, request_id=None, **kwargs):
        seen.update(kwargs, params=params)
        text = ""
        for i, piece in enumerate(pieces):
            text += piece
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [
                CompletionOutput(0, text, [5] * (i + 1), None, None,
                                 finish if last else None)], last)

    monkeypatch.setattr(server.llm, "generate", generate)
    return seen


def _stream_parts(chunks):
    reasoning, content, finish, both_names = "", "", None, True
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta.model_dump()
        if d.get("reasoning_content") is not None:
            both_names &= d.get("reasoning") == d["reasoning_content"]
            reasoning += d["reasoning_content"]
        content += d.get("content") or ""
        finish = ch.choices[0].finish_reason or finish
    assert both_names  # vLLM's newer name carries the same text
    return reasoning, content, finish


def test_reasoning_split_in_full_and_streamed_responses(server, client, monkeypatch):
    from jaxinfer.reasoning import get_reasoning_parser

    monkeypatch.setattr(server.llm.processor, "reasoning", get_reasoning_parser("qwen3"))
    msgs = [{"role": "user", "content": "Hi!"}]
    common = dict(model=MODEL, messages=msgs, max_tokens=50,
                  extra_body={"chat_template": THINK_TEMPLATE})
    text = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
    want = ("\nThe user greets me.\n", "\n\nHello! How can I help?")
    # Whole, then streamed a character at a time and in chunks that cut both tags.
    _script(server, monkeypatch, [text])
    m = client.chat.completions.create(**common).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"]) == want and m["reasoning"] == want[0]
    for pieces in ([*text], ["<thi", "nk>\nThe user", " greets me.\n</th", "ink>\n\nHel",
                             "lo! How can I help?"], ["<think>\nThe user greets me.\n<",
                                                      "/think>", "\n\nHello! How can I help?"]):
        _script(server, monkeypatch, pieces)
        r, c, finish = _stream_parts(client.chat.completions.create(stream=True, **common))
        assert (r, c, finish) == (*want, "stop"), pieces
    # include_reasoning false: the thinking is not sent; the answer is unchanged.
    _script(server, monkeypatch, [text])
    m = client.chat.completions.create(
        **{**common, "extra_body": {**common["extra_body"], "include_reasoning": False}}
    ).choices[0].message.model_dump()
    assert m["content"] == want[1] and m.get("reasoning_content") is None
    # enable_thinking false: the template closed the thinking; all of the output is the answer.
    off = {**common, "extra_body": {**common["extra_body"],
                                    "chat_template_kwargs": {"enable_thinking": False}}}
    seen = _script(server, monkeypatch, ["Hello", "! <think> is just text"])
    m = client.chat.completions.create(**off).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"]) == (None, "Hello! <think> is just text")
    assert seen["chat_template_kwargs"] == {"enable_thinking": False}  # (for the grammar)
    r, c, _ = _stream_parts(client.chat.completions.create(stream=True, **off))
    assert (r, c) == ("", "Hello! <think> is just text")
    # A template that opens the section in the prompt: the output has the end tag only.
    opened = {**common, "extra_body": {**common["extra_body"],
                                       "chat_template_kwargs": {"open_think": True}}}
    _script(server, monkeypatch, ["Short", " one.</th", "ink>Hi!"])
    m = client.chat.completions.create(**opened).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"]) == ("Short one.", "Hi!")
    # Cut short while thinking: all reasoning, no content, finish_reason length.
    _script(server, monkeypatch, ["<think>Let me", " count: 1, 2"], finish="length")
    r = client.chat.completions.create(**common).choices[0]
    assert (r.message.model_dump()["reasoning_content"], r.message.content,
            r.finish_reason) == ("Let me count: 1, 2", None, "length")
    wait_idle(server)


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_gpt_oss_harmony_channels_split_whole_and_streamed(server, client, monkeypatch):
    """--reasoning-parser openai_gptoss: the analysis channel is the reasoning, the final one
    the answer; the engine is asked for the special tokens (the channel markers)."""
    from jaxinfer.reasoning import get_reasoning_parser

    monkeypatch.setattr(server.llm.processor, "reasoning", get_reasoning_parser("openai_gptoss"))
    common = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=50,
                  extra_body={"chat_template": HARMONY_TEMPLATE})
    text = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hello! How can I help?")
    want = ("The user greets me.", "Hello! How can I help?")
    seen = _script(server, monkeypatch, [text])
    m = client.chat.completions.create(**common).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"]) == want
    assert seen["params"].skip_special_tokens is False
    for pieces in ([*text], ["<|channel|>analysis<|mes", "sage|>The user greets me.<|e",
                             "nd|><|start|>assistant<|channel|>fin", "al<|message|>Hello!",
                             " How can I help?"]):
        _script(server, monkeypatch, pieces)
        r, c, finish = _stream_parts(client.chat.completions.create(stream=True, **common))
        assert (r, c, finish) == (*want, "stop"), pieces
    wait_idle(server)


def test_gpt_oss_harmony_tool_calls(server, client, monkeypatch):
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: the analysis is the
    reasoning, the commentary message to functions.NAME the call (whole and streamed)."""
    from jaxinfer.entrypoints.openai.tools import HarmonyToolParser
    from jaxinfer.reasoning import get_reasoning_parser

    monkeypatch.setattr(server.llm.processor, "reasoning", get_reasoning_parser("openai_gptoss"))
    monkeypatch.setattr(server, "tool_parser", HarmonyToolParser())
    template = HARMONY_TEMPLATE.replace("{% for m in messages %}",
                                        "{% if tools %}tools{% endif %}{% for m in messages %}")
    common = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  max_tokens=80, tools=[WEATHER], extra_body={"chat_template": template})
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Oslo"}')
    _script(server, monkeypatch, [text])
    r = client.chat.completions.create(**common).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert r.message.model_dump()["reasoning_content"] == "Need the weather."
    assert [(t.function.name, t.function.arguments) for t in r.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    _script(server, monkeypatch, [text[:30], text[30:70], text[70:120], text[120:]])
    chunks = list(client.chat.completions.create(stream=True, **common))
    calls, content, finish = _stream_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert finish == "tool_calls" and content == ""
    # no call: the final message is the content
    _script(server, monkeypatch, ["<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
                                  "<|channel|>final<|message|>It is 18 C."])
    r = client.chat.completions.create(**common).choices[0]
    assert r.finish_reason == "stop" and r.message.content == "It is 18 C."
    wait_idle(server)


def test_tool_calls_are_parsed_after_the_thinking_only(server, client, monkeypatch):
    from jaxinfer.entrypoints.openai.tools import HermesToolParser
    from jaxinfer.reasoning import get_reasoning_parser

    monkeypatch.setattr(server.llm.processor, "reasoning", get_reasoning_parser("qwen3"))
    monkeypatch.setattr(server, "tool_parser", HermesToolParser())
    common = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  max_tokens=80, tools=[WEATHER], extra_body={"chat_template": TOOL_TEMPLATE})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    thought = 'Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>? Yes.'
    pieces = ["<think>", thought[:20], thought[20:], "</think>\n\n", call[:15], call[15:]]
    _script(server, monkeypatch, pieces)
    r = client.chat.completions.create(**common).choices[0]
    m = r.message.model_dump()
    assert r.finish_reason == "tool_calls" and m["reasoning_content"] == thought
    assert [(t.function.name, t.function.arguments) for t in r.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    assert m["content"] in (None, "\n\n", "")
    chunks = list(client.chat.completions.create(stream=True, **common))
    calls, content, finish = _stream_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert "".join(ch.choices[0].delta.model_dump().get("reasoning_content") or ""
                   for ch in chunks if ch.choices) == thought
    # The thinking alone mentions a call: it is not one.
    _script(server, monkeypatch, ["<think>", thought, "</think>", "It is 18 C."])
    r = client.chat.completions.create(**common).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content == "It is 18 C."
    wait_idle(server)


def test_chat_template_options(server, client):
    """continue_final_message, documents, an assistant's reasoning_content in the history,
    --chat-template-content-format openai, and the refusals vLLM gives."""
    tmpl = ("{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}({{ p.text }}){% endfor %}{% endif %}"
            "{% if m.reasoning_content %}~{{ m.reasoning_content }}~{% endif %}"
            "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

    def tokens(messages, **extra):
        r = _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "chat_template": tmpl, "messages": messages,
            **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    tok = server.llm.tokenizer
    user = {"role": "user", "content": "Name a colour."}
    open_end = [user, {"role": "assistant", "content": "The colour is"}]
    n = tokens(open_end, add_generation_prompt=False, continue_final_message=True)
    assert n == len(tok.encode("<user>Name a colour.</user><assistant>The colour is",
                               add_special_tokens=False))
    assert tokens([user], documents=[{"title": "Paint", "text": "..."}]) == len(tok.encode(
        "[Paint]<user>Name a colour.</user><assistant>", add_special_tokens=False))
    past = [user, {"role": "assistant", "content": "Red.", "reasoning_content": "Pick one."}]
    assert tokens(past) == len(tok.encode("<user>Name a colour.</user><assistant>Red.~Pick "
                                          "one.~</assistant><assistant>",
                                          add_special_tokens=False))
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": open_end,
                                               "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    server.content_format = "openai"
    try:
        assert tokens([user]) == len(tok.encode("<user>(Name a colour.)</user><assistant>",
                                                add_special_tokens=False))
    finally:
        server.content_format = "auto"
    wait_idle(server)


@pytest.mark.parametrize("parser,text", [
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                    "</parameter>\n</function>\n</tool_call>"),
    ("pythonic", '[get_weather(city="Oslo")]'),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    'get_weather\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>'
                    "<｜tool▁calls▁end｜>"),
])
def test_tool_parsers_through_the_server(server, client, monkeypatch, parser, text):
    """Each --tool-call-parser on a recorded output, whole and streamed in small pieces: the
    same calls and content; formats whose markers are special tokens get them decoded."""
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    monkeypatch.setattr(server, "tool_parser", TOOL_PARSERS[parser]())
    common = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  max_tokens=80, tools=[WEATHER], extra_body={"chat_template": TOOL_TEMPLATE})
    seen = _script(server, monkeypatch, [text[i:i + 3] for i in range(0, len(text), 3)])
    r = client.chat.completions.create(**common).choices[0]
    assert seen["params"].skip_special_tokens == (parser not in ("mistral", "deepseek_v3"))
    want = [("get_weather", '{"city": "Oslo"}')]
    assert r.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in r.message.tool_calls] == want
    calls, content, finish = _stream_calls(client.chat.completions.create(stream=True, **common))
    assert [(c["name"], c["arguments"]) for c in calls] == want and finish == "tool_calls"
    # (streamed, the newline before a call's marker went out before the marker came)
    assert content.rstrip() == (r.message.content or "") == ("" if parser == "pythonic"
                                                              else "Checking.")
    wait_idle(server)


def test_logit_bias_allowed_token_ids_and_bad_words(server, client):
    """OpenAI's logit_bias through the SDK (token ids as strings, values clamped to
    [-100, 100] as vLLM does) and vLLM's allowed_token_ids / bad_words through extra_body;
    bad values are 400s naming the field."""
    common = dict(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                  extra_body={"ignore_eos": True})
    r = client.completions.create(logit_bias={"1000": 100}, **common)
    assert server.llm.tokenizer.encode(r.choices[0].text, add_special_tokens=False) \
        == [1000] * 5
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logit_bias={"1000": 250})  # (clamped to 100)
    assert chat.choices[0].message.content == server.llm.tokenizer.decode([1000] * 4)
    allowed = [1000, 2000]
    r = client.completions.create(**{**common, "extra_body": {
        "ignore_eos": True, "allowed_token_ids": allowed}})
    assert set(server.llm.tokenizer.encode(r.choices[0].text, add_special_tokens=False)) \
        <= set(allowed)
    plain = client.completions.create(**common).choices[0].text
    word = plain.split()[0]
    r = client.completions.create(**{**common, "extra_body": {"ignore_eos": True,
                                                             "bad_words": [word]}})
    assert word not in r.choices[0].text.split()
    v = server.llm.llm_engine.model_config.vocab_size if hasattr(server.llm, "llm_engine") \
        else server.llm.processor.vocab_size
    for body, param in (({"logit_bias": {str(v): 1}}, "logit_bias"),
                        ({"logit_bias": {"one": 1}}, "logit_bias"),
                        ({"logit_bias": {"-1": 1}}, "logit_bias"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"allowed_token_ids": [v]}, "allowed_token_ids"),
                        ({"bad_words": [""]}, "bad_words")):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    wait_idle(server)


def test_vllm_xargs_reach_the_logits_processors(server, monkeypatch):
    """vLLM's vllm_xargs become SamplingParams.extra_args: keys the engine's processors read
    pass (checked by them), others are 400s naming vllm_xargs."""
    from tests.engine.logits_processor_examples import BanToken

    proc = server.llm.processor
    seen = _spy(server, monkeypatch)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = _post(server, "/v1/completions", {**body, "vllm_xargs": {"ban_token": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs", r.text
    # An engine with the processor reads the key (here only the front end's check is swapped:
    # this server's engine core has no processors, so the request stops at the front end's
    # validate_params for a bad value and at the core for a good one).
    monkeypatch.setattr(proc, "logits_processors", [BanToken])
    monkeypatch.setattr(proc, "extra_args_keys", frozenset({"ban_token"}))
    r = _post(server, "/v1/completions", {**body, "vllm_xargs": {"ban_token": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs", r.text
    assert "ban_token must be a token id" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {**body, "vllm_xargs": {"kv_transfer_params": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs"
    assert seen == []
    scripted = _script(server, monkeypatch, ["ok"])  # (the engine's answer, scripted)
    r = _post(server, "/v1/completions", {**body, "vllm_xargs": {"ban_token": 5}})
    assert r.status_code == 200, r.text
    assert scripted["params"].extra_args == {"ban_token": 5}
    wait_idle(server)


def test_prompt_logprobs_and_tokens_as_ids(server, client):
    """vLLM's prompt_logprobs (per prompt position, the first null; not with stream) and
    return_tokens_as_token_ids (logprob tokens as "token_id:<id>"), on both routes."""
    tok = server.llm.tokenizer
    prompt_ids = tok.encode("The sky is blue", add_special_tokens=False)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt_ids, "max_tokens": 2,
                                          "prompt_logprobs": 2, "logprobs": 1,
                                          "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for tid, d in zip(prompt_ids[1:], plp[1:]):
        assert str(tid) in d and 1 <= len(d) <= 3  # the prompt's token and the top 2
        assert all(v["logprob"] <= 0 and v["decoded_token"] == f"token_id:{k}"
                   for k, v in d.items())
        assert min(v["rank"] for v in d.values()) == 1
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
        top_logprobs=2, extra_body={"prompt_logprobs": 1, "return_tokens_as_token_ids": True})
    assert chat.model_extra["prompt_logprobs"][0] is None
    content = chat.choices[0].logprobs.content
    ids = [int(c.token.split(":")[1]) for c in content]
    assert tok.decode(ids, skip_special_tokens=True) == chat.choices[0].message.content
    assert all(c.token.startswith("token_id:") and
               all(t.token.startswith("token_id:") for t in c.top_logprobs) for c in content)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                                          "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    wait_idle(server)


def test_special_tokens_in_the_text(server):
    """skip_special_tokens false keeps them; spaces_between_special_tokens gives the text
    vLLM's fast detokenizer gives for either value: joined without spaces."""
    special = server.llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    texts = []
    for spaces in (True, False):
        r = _post(server, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
            "logit_bias": {str(special[0]): 100}, "skip_special_tokens": False,
            "spaces_between_special_tokens": spaces})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts == ["<|im_start|>" * 3] * 2
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                          "ignore_eos": True,
                                          "logit_bias": {str(special[0]): 100}})
    assert r.json()["choices"][0]["text"] == ""  # (skipped by default)
    wait_idle(server)


# -- Anthropic's Messages API ----------------------------------------------------------------------
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {
                    "type": "string", "enum": ["Paris", "London"]}}, "required": ["city"],
                    "additionalProperties": False}}


GREEDY_BODY = {"temperature": 0}  # (the 2026 SDK has no temperature argument: vLLM takes it)


def test_anthropic_messages_through_the_sdk_equal_chat(server, client):
    """The anthropic SDK against /v1/messages: plain, streaming, a forced tool and
    count_tokens parse, and carry what the chat route gives for the same greedy request."""
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}] + msgs,
        max_tokens=12, temperature=0, stop=["Purple"])
    m = ac.messages.create(model=ALIAS, system="Be brief.", messages=msgs, max_tokens=12,
                           extra_body=GREEDY_BODY, stop_sequences=["Purple"])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    if chat.choices[0].model_extra.get("stop_reason") == "Purple":
        expected = "stop_sequence"
    assert m.stop_reason == expected
    # streaming: the SDK's event accumulation gives the same message
    with ac.messages.stream(model=MODEL, system="Be brief.", messages=msgs, max_tokens=12,
                            extra_body=GREEDY_BODY, stop_sequences=["Purple"]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # a forced tool: a tool_use block whose input is the arguments the chat route gives
    tool_msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    t = ac.messages.create(model=MODEL, messages=tool_msgs, max_tokens=40, extra_body=GREEDY_BODY,
                           tools=[WEATHER_TOOL],
                           tool_choice={"type": "tool", "name": "get_weather"})
    chat_t = client.chat.completions.create(
        model=MODEL, messages=tool_msgs, max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER_TOOL["description"],
            "parameters": WEATHER_TOOL["input_schema"]}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (use,) = [b for b in t.content if b.type == "tool_use"]
    call = chat_t.choices[0].message.tool_calls[0]
    assert use.name == "get_weather" and use.input == json.loads(call.function.arguments)
    assert t.stop_reason == "tool_use" and isinstance(use.input.get("city"), str)
    with ac.messages.stream(model=MODEL, messages=tool_msgs, max_tokens=40,
                            extra_body=GREEDY_BODY,
                            tools=[WEATHER_TOOL],
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    # the tool's answer back: tool_use from the assistant, tool_result from the user
    follow = ac.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY_BODY,
                                tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                                messages=tool_msgs + [
                                    {"role": "assistant", "content": [use.model_dump()]},
                                    {"role": "user", "content": [{
                                        "type": "tool_result", "tool_use_id": use.id,
                                        "content": "Sunny, 21 C"}]}])
    assert follow.content and follow.usage.input_tokens > t.usage.input_tokens
    count = ac.messages.count_tokens(model=MODEL, system="Be brief.", messages=msgs)
    assert count.input_tokens == chat.usage.prompt_tokens
    # Refusals name the field, in Anthropic's error shape; the server keeps serving
    for kwargs, field in (({"max_tokens": 0}, "max_tokens"),
                          ({"thinking": {"type": "enabled", "budget_tokens": 2048}},
                           "thinking"),
                          ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                          ({"messages": [{"role": "user", "content": [{
                              "type": "image", "source": {"type": "base64", "data": "x",
                                                          "media_type": "image/png"}}]}]},
                           "messages[0].content[0].type")):
        args = dict(model=MODEL, messages=msgs, max_tokens=4) | kwargs
        with pytest.raises(anthropic.BadRequestError) as e:
            ac.messages.create(**args)
        err = e.value.body
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert field in err["error"]["message"], err
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="claude-nope", messages=msgs, max_tokens=4)
    wait_idle(server)


# -- OpenAI's Responses API --------------------------------------------------------------------
def test_responses_api_through_the_sdk_equals_chat(server, client):
    """client.responses: plain, streamed, a function tool and its output, previous_response_id,
    text.format; the same greedy text as the chat route."""
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                          temperature=0)
    r = client.responses.create(model=ALIAS, instructions="Be brief.",
                                input="Name three colours.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    # the same as input items, streamed: the SDK's accumulated response carries the text
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name three colours."}]}]
    with client.responses.stream(model=MODEL, input=items, max_output_tokens=12,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output_text == r.output_text and final.usage.output_tokens == \
        r.usage.output_tokens
    # previous_response_id continues the conversation; GET retrieves a stored response
    follow = client.responses.create(model=MODEL, previous_response_id=r.id,
                                     input="And two more?", max_output_tokens=4,
                                     temperature=0)
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 2
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # a forced function tool: a function_call item; its output goes back as an input item
    tool = {"type": "function", "name": "get_weather", "description": "The weather",
            "parameters": {"type": "object", "properties": {"city": {
                "type": "string", "enum": ["Paris", "London"]}}, "required": ["city"],
                "additionalProperties": False}}
    t = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=40, temperature=0)
    (call,) = [o for o in t.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris",
                                                                                 "London")
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[tool],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response()
    (scall,) = [o for o in streamed.output if o.type == "function_call"]
    assert scall.arguments == call.arguments
    answer = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0, tools=[tool], tool_choice="none",
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens >= 1
    # text.format json_schema
    js = client.responses.create(model=MODEL, input="A colour as JSON.", max_output_tokens=30,
                                 temperature=0, text={"format": {
                                     "type": "json_schema", "name": "c", "strict": True,
                                     "schema": {"type": "object", "properties": {"c": {
                                         "type": "string", "enum": ["red", "blue"]}},
                                         "required": ["c"], "additionalProperties": False}}})
    assert json.loads(js.output_text)["c"] in ("red", "blue")
    # refusals name the field
    for kwargs, field in (({"background": True}, "background"),
                          ({"reasoning": {"effort": "high"}}, "reasoning"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"input": [{"role": "user", "content": [
                              {"type": "input_image", "image_url": "data:x"}]}]},
                           "input[0].content[0].type"),
                          ({"extra_body": {"frobnicate": 1}}, "frobnicate")):
        args = dict(model=MODEL, input="x", max_output_tokens=2) | kwargs
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**args)
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    wait_idle(server)

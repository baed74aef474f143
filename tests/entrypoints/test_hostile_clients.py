"""No request can take the server down (issue 27): the probes that did, a property-based fuzz
of every field of every POST route with boundary values, clients that leave, and what a dead
engine looks like (/health 503, every /v1 request 503 in OpenAI's shape, /metrics, and the
server exiting non-zero so that a supervisor restarts it). A tiny random model, few tokens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from jaxinfer.config import EngineConfig  # noqa: E402
from tests.engine.conftest import make_tiny_model_dir  # noqa: E402
from tests.helpers import LiveServer  # noqa: E402

MODEL = "tiny"
MAX_N = 4
MAX_PROMPTS = 8
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
              warmup=False, num_kv_blocks=64)
# Examples per POST route in the suite (a few seconds each); JAXINFER_FUZZ_EXAMPLES for more.
EXAMPLES = int(os.environ.get("JAXINFER_FUZZ_EXAMPLES", "120"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-hostile")
    make_tiny_model_dir(path, "llama", smollm2_dir)
    return str(path)


@pytest.fixture(scope="module")
def live(tiny_dir):
    from jaxinfer.engine.async_engine import AsyncLLM

    mp = pytest.MonkeyPatch()
    mp.setenv("JAXINFER_MAX_N_SEQUENCES", str(MAX_N))
    llm = AsyncLLM(EngineConfig(model=tiny_dir, **ENGINE))
    server = LiveServer(llm, MODEL, max_prompts_per_request=MAX_PROMPTS)
    yield server
    server.close()
    mp.undo()


def post(live, path, body=None, raw: bytes | None = None, timeout=120):
    data = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    return httpx.post(live.base_url + path, content=data, timeout=timeout,
                      headers={"content-type": "application/json"})


def plain_request_works(live):
    r = post(live, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert httpx.get(live.base_url + "/health", timeout=30).status_code == 200


def assert_openai_error(r, status=None):
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == r.status_code and (status is None or r.status_code == status)
    assert err.get("param") is None or isinstance(err["param"], str)
    assert "Traceback" not in err["message"]
    return err


def assert_anthropic_error(r):
    body = r.json()
    assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]


def assert_well_formed(r):
    """2xx with a complete body (a stream ends with [DONE]) or 4xx in OpenAI's shape; the
    Messages route's in Anthropic's (its stream ends with message_stop)."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    anthropic = r.request.url.path.startswith("/v1/messages")
    if r.status_code >= 400:
        if anthropic and r.status_code not in (401, 413):
            assert_anthropic_error(r)
        else:
            assert_openai_error(r)
        return
    if anthropic and r.headers["content-type"].startswith("text/event-stream"):
        kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert kinds and kinds[0] == "message_start" and kinds[-1] in ("message_stop",
                                                                      "error"), r.text[-300:]
        if kinds[-1] == "error":
            assert '"overloaded_error"' not in r.text and '"api_error"' not in r.text, r.text
        return
    if anthropic:
        body = r.json()
        assert body.get("type") == "message" or set(body) == {"input_tokens"}, body
        return
    if r.request.url.path == "/v1/responses":
        if r.headers["content-type"].startswith("text/event-stream"):
            kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
            assert kinds[0] == "response.created", r.text[:300]
            assert kinds[-1] in ("response.completed", "error"), r.text[-300:]
            if kinds[-1] == "error":
                assert '"code": "5' not in r.text, r.text[-300:]
        else:
            assert r.json()["object"] == "response"
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for e in events[:-1]:
            ev = json.loads(e)
            assert "error" not in ev or ev["error"]["code"] < 500, ev
    else:
        body = r.json()
        assert ("choices" in body or {"tokens", "count"} <= set(body) or "prompt" in body
                or "data" in body or "results" in body), body


def wait_idle(live, timeout=60.0):
    llm = live.server.llm
    deadline = time.time() + timeout
    while time.time() < deadline:
        st_ = llm.stats
        if (not llm.output_processor.has_unfinished() and st_["num_running_reqs"] == 0
                and st_["num_waiting_reqs"] == 0
                and st_["num_free_kv_blocks"] == st_["num_kv_blocks"] - 1):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {llm.stats}")


# -- the probes of the issue --------------------------------------------------------------------
def ref_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["next"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_the_probes_that_took_the_server_down(live):
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    deep = ref_chain(1000)
    grammar = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(12000)) + \
        '\nr12000: "a"'
    cases = [
        ("/v1/completions", {**base, "top_k": 2**31}, "top_k", "2147483647"),
        ("/v1/completions", {**base, "top_k": 2**63}, "top_k", None),
        ("/v1/completions", {**base, "top_k": 49153}, "top_k", "49152"),
        ("/v1/completions", {**base, "seed": 2**64}, "seed", "9223372036854775807"),
        ("/v1/completions", {**base, "stop_token_ids": [2**64]}, "stop_token_ids.0", None),
        ("/v1/completions", {**base, "stop_token_ids": [49152]}, "stop_token_ids", "49151"),
        ("/v1/completions", {**base, "min_tokens": 2**64}, "min_tokens", None),
        ("/v1/completions", {**base, "prompt": [1, 2, 49152]}, "prompt", "49152"),
        ("/v1/completions", {**base, "prompt": ["x"] * 100_000}, "prompt", "limit of 8"),
        ("/v1/completions", {**base, "prompt": ["x"] * 3, "n": 2}, "n", "6 sequences"),
        ("/v1/completions", {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": deep}}}, "response_format", "max_schema_depth"),
        ("/v1/completions", {**base, "guided_grammar": grammar}, "guided_grammar",
         "max_spec_bytes"),
        ("/v1/completions", {**base, "min_tokens": 100}, "min_tokens", None),
        ("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": deep}}]},
         "tool_choice", "max_schema_depth"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1},
         "top_logprobs", None),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2**31},
         "top_logprobs", None),
        ("/v1/chat/completions", {"model": MODEL, "min_tokens": 1_000_000,
                                  "messages": chat["messages"]}, "min_tokens", "context"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {
                "url": "http://example.com/a.png"}}]}]}, "messages[0].content[1]", "image_url"),
        ("/v1/chat/completions", {**chat, "chat_template": "{{ 'x' * 100000000 }}"},
         "chat_template", "--trust-request-chat-template"),
        ("/v1/chat/completions", {**chat, "priority": 5}, "priority", "scheduling-policy"),
    ]
    for path, body, param, needle in cases:
        r = post(live, path, body)
        err = assert_openai_error(r, 400)
        assert err["param"] == param, (param, err)
        assert needle is None or needle in err["message"], (needle, err)
    raw_cases = [
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "tiny\\udfff", "prompt": "a"}', "model"),
        (b'{"model": "tiny", "prompt": "a", "stop": ["x\\ud800"], "stream": true}', "stop[0]"),
        (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', None),
        (b'{"model": "tiny", "prompt": "a", "temperature": 1e400}', "temperature"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ]
    for raw, param in raw_cases:
        err = assert_openai_error(post(live, "/v1/completions", raw=raw), 400)
        assert err["param"] == param, (raw[:60], err)
    # A spec within the limits that overflowed an 8 MiB stack (3000 chained rules) is served.
    ok = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(3000)) + '\nr3000: "a"'
    r = post(live, "/v1/completions", {**base, "guided_grammar": ok})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a", r.text
    # truncate_prompt_tokens: a prompt longer than the context, cut to its last 10 tokens.
    r = post(live, "/v1/completions", {**base, "prompt": list(range(5, 205)),
                                       "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
    plain_request_works(live)
    wait_idle(live)


def test_models_retrieve(live):
    r = httpx.get(f"{live.base_url}/v1/models/{MODEL}")
    assert r.status_code == 200
    assert r.json()["id"] == MODEL and r.json()["object"] == "model"
    assert_openai_error(httpx.get(f"{live.base_url}/v1/models/gpt-4"), 404)
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_health_answers_while_big_requests_are_refused_or_admitted(live):
    """An 8 MB token-id prompt (refused), the biggest admissible request (8 prompts of 60
    tokens, n=4) and 10,000 prompts (refused by count): /health keeps answering."""
    bodies = [
        json.dumps({"model": MODEL, "prompt": [1] * 4_000_000}, separators=(",", ":")).encode(),
        json.dumps({"model": MODEL, "prompt": [[7] * 60] * MAX_PROMPTS, "n": MAX_N,
                    "max_tokens": 4}).encode(),
        json.dumps({"model": MODEL, "prompt": [[7] * 60] * 10_000}).encode(),
    ]
    for raw in bodies:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault(
            "r", post(live, "/v1/completions", raw=raw)))
        t.start()
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert httpx.get(live.base_url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
        t.join()
        assert result["r"].status_code in (200, 400), result["r"].text[:300]
        assert worst < 2.0, worst  # (1 s on a quiet machine; this one is shared)
    wait_idle(live)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_all_its_sequences(live, stream):
    """2 prompts x n=2 (4 sequences of 60 tokens); the client hangs up once they run: every
    sequence is aborted and every block is free soon after (streaming or not)."""
    body = json.dumps({"model": MODEL, "prompt": ["Once", "Twice"], "n": 2,
                       "max_tokens": 60, "ignore_eos": True, "stream": stream}).encode()
    llm = live.server.llm
    before = _finished_counts(live)
    host, port = live.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 30
        while llm.stats["num_running_reqs"] < 3 and time.time() < deadline:
            time.sleep(0.01)  # (the engine is generating them)
        assert llm.stats["num_running_reqs"] >= 3
    t0 = time.monotonic()
    wait_idle(live, timeout=20)  # aborted at once: the full run takes far longer
    assert not llm.output_processor.has_unfinished()
    assert time.monotonic() - t0 < 20
    after = _finished_counts(live)
    # Both prompts were aborted (their 4 sequences with them); none ran to its length.
    assert after.get("abort", 0) - before.get("abort", 0) == 2, (before, after)
    assert after.get("length", 0) == before.get("length", 0), (before, after)


def _finished_counts(live) -> dict[str, float]:
    out = {}
    for line in httpx.get(live.base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0) + float(line.split()[-1])  # (over engines)
    return out


# -- fuzzing --------------------------------------------------------------------------------------
BOUNDARY = [0, -1, 1, 2, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63),
            -(2**63) - 1, 2**64, 10**30, 0.0, -0.0, 1e-300, 0.5, 1.0000001, 2.5, 1e38, 3.5e38,
            1e308, -1e308, float("nan"), float("inf"), float("-inf"), True, False, None, "",
            "x", "\ud800", "a\udc00b", "\x00", "\U0001F600", "\u202e\u0301", "x" * 5000, [],
            [0], [-1], [2**31], [2**64], [""], [None], ["x"] * 300, list(range(2000)), {},
            {"type": "text"}, {"type": "json_schema"}, [[1] * 70], [[]], [["x"]], [[1], "x"],
            {"enable_thinking": False}, {"messages": []}, {"0": 100.0}, {"-1": 1},
            {"5": float("nan")}, {str(2**40): 1}]


def _nested(depth):
    node = "x"
    for _ in range(depth):
        node = {"a": [node]}
    return node


VALUES = st.one_of(st.sampled_from(BOUNDARY), st.integers(), st.floats(), st.text(max_size=20),
                   st.sampled_from([_nested(70), _nested(200)]),
                   st.lists(st.integers(-(2**70), 2**70), max_size=4))


def _fields(model) -> list[str]:
    return sorted(model.model_fields) + ["unknown_field", "user"]


def _completion_body(overrides: dict) -> dict:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for path, value in overrides.items():
        _set(body, path, value)
    return body


def _chat_body(overrides: dict) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, value in overrides.items():
        _set(body, path, value)
    return body


def _set(body, path, value):
    """path: a field, or a nested place (a.b, a[0].b) whose containers are created."""
    if "." not in path and "[" not in path:
        body[path] = value
        return
    nested = {
        "response_format.type": {"response_format": {"type": value}},
        "response_format.json_schema": {"response_format": {"type": "json_schema",
                                                            "json_schema": value}},
        "response_format.schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": value}}},
        "structured_outputs.json": {"structured_outputs": {"json": value}},
        "structured_outputs.choice": {"structured_outputs": {"choice": value}},
        "structured_outputs.regex": {"structured_outputs": {"regex": value}},
        "stream_options.include_usage": {"stream": True,
                                         "stream_options": {"include_usage": value}},
        "messages[0].role": {"messages": [{"role": value, "content": "Hi"}]},
        "messages[0].content": {"messages": [{"role": "user", "content": value}]},
        "messages[0].content[0]": {"messages": [{"role": "user", "content": [value]}]},
        "messages[0].content[0].type": {"messages": [{"role": "user", "content": [
            {"type": value, "text": "x"}]}]},
        "messages[0].name": {"messages": [{"role": "user", "content": "Hi", "name": value}]},
        "messages[0].content[0].image_url": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": value}]}]},
        "messages[0].content[0].image_url.url": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": value}}]}]},
        "messages[1].reasoning_content": {"messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": value}]},
        "documents[0]": {"documents": [value]},
        "tools[0].function.name": {"tools": [{"type": "function", "function": {
            "name": value}}], "tool_choice": "required"},
        "tools[0].function.parameters": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": value}}], "tool_choice": "required"},
        "tool_choice.function.name": {"tools": [{"type": "function", "function": {
            "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": value}}},
    }
    body.update(nested[path])


COMPLETION_PLACES = ["response_format.type", "response_format.json_schema",
                     "response_format.schema", "structured_outputs.json",
                     "structured_outputs.choice", "structured_outputs.regex",
                     "stream_options.include_usage"]
CHAT_PLACES = COMPLETION_PLACES + ["messages[0].role", "messages[0].content",
                                   "messages[0].content[0]", "messages[0].content[0].type",
                                   "messages[0].name", "tools[0].function.name",
                                   "tools[0].function.parameters", "tool_choice.function.name",
                                   "messages[1].reasoning_content", "documents[0]",
                                   "messages[0].content[0].image_url",
                                   "messages[0].content[0].image_url.url"]


# Requests the server must accept, run before the generated ones (so that both outcomes are
# always exercised, whatever the generated examples happen to be); the newer fields in them.
VALID = [({"seed": 7}, False), ({"cache_salt": "fuzz-salt", "priority": 0}, True),
         ({"logit_bias": {"5": 100, "6": -100}, "allowed_token_ids": [5, 6, 7],
           "bad_words": ["x", "y z"]}, True),
         ({"prompt_logprobs": 2, "return_tokens_as_token_ids": True}, False)]
CHAT_VALID = VALID + [({"chat_template_kwargs": {"enable_thinking": False}}, False),
                      ({"include_reasoning": False, "documents": [{"title": "t", "text": "x"}],
                        "messages[1].reasoning_content": "thought"}, True),
                      ({"continue_final_message": True, "add_generation_prompt": False}, False)]


def _fuzz(live, route, model, make_body, places, valid, examples=EXAMPLES, streams=True,
          works=None):
    fields = _fields(model) + places
    seen = {"2xx": 0, "4xx": 0}

    def run(overrides, stream):
        body = make_body(overrides)
        if stream and "stream" not in overrides:
            body["stream"] = True
        r = post(live, route, body)
        assert_well_formed(r)
        seen["2xx" if r.status_code < 300 else "4xx"] += 1
        (works or plain_request_works)(live)
        return r

    for overrides, stream in valid:
        r = run(overrides, stream)
        assert r.status_code == 200, (overrides, r.text)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(fields), VALUES, min_size=1, max_size=3),
           st.booleans() if streams else st.just(False))
    def check(overrides, stream):
        run(overrides, stream)

    check()
    assert seen["4xx"] > 0, seen  # (and the valid requests above each got a 200)
    wait_idle(live)


def test_fuzz_completions(live):
    from jaxinfer.entrypoints.openai.protocol import CompletionRequest

    _fuzz(live, "/v1/completions", CompletionRequest, _completion_body, COMPLETION_PLACES,
          VALID)


def test_fuzz_chat_completions(live):
    from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest

    _fuzz(live, "/v1/chat/completions", ChatCompletionRequest, _chat_body, CHAT_PLACES,
          CHAT_VALID)


def _body_with(base: dict):
    def make(overrides: dict) -> dict:
        body = json.loads(json.dumps(base))
        for path, value in overrides.items():
            _set(body, path, value)
        return body
    return make


def test_fuzz_tokenize_routes(live):
    """/tokenize (a prompt, a chat) and /detokenize; then the GET routes with junk."""
    from jaxinfer.entrypoints.openai.serving_tokenize import (DetokenizeRequest,
                                                              TokenizeChatRequest,
                                                              TokenizeCompletionRequest)

    n = max(EXAMPLES // 6, 10)
    _fuzz(live, "/tokenize", TokenizeCompletionRequest,
          _body_with({"model": MODEL, "prompt": "Hi"}), [],
          [({"return_token_strs": True, "add_special_tokens": False}, False)], n, False)
    _fuzz(live, "/tokenize", TokenizeChatRequest,
          _body_with({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
          ["messages[0].role", "messages[0].content", "messages[0].content[0]",
           "messages[0].content[0].type", "messages[0].name"],
          [({"add_generation_prompt": False, "continue_final_message": True}, False),
           ({"chat_template_kwargs": {"enable_thinking": False}, "tools": [
               {"type": "function", "function": {"name": "f"}}]}, False)], n,
          False)
    _fuzz(live, "/detokenize", DetokenizeRequest,
          _body_with({"model": MODEL, "tokens": [5, 6, 7]}), [], [({"tokens": []}, False)], n,
          False)
    for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"),
                         ("GET", "/version")):
        r = httpx.request(method, live.base_url + path + "?x=%ff&y=" + "z" * 5000,
                          content=b"\xff{junk", timeout=30)
        assert r.status_code == 200, (path, r.text)
    plain_request_works(live)


def test_fuzz_anthropic_messages(live):
    """/v1/messages (plain and streamed) and /v1/messages/count_tokens."""
    from jaxinfer.entrypoints.openai.serving_messages import CountTokensRequest, MessagesRequest

    tool = {"name": "f", "input_schema": {"type": "object"}}
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    places = ["messages[0].role", "messages[0].content", "messages[0].content[0]",
              "messages[0].content[0].type"]
    valid = [({"system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["x"],
               "top_k": 3, "metadata": {"user_id": "u"}}, False),
             ({"tools": [tool], "tool_choice": {"type": "tool", "name": "f"}}, True),
             ({"messages": [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": [
                                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                            {"role": "user", "content": [
                                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
               "tools": [tool], "tool_choice": {"type": "none"}}, False)]
    _fuzz(live, "/v1/messages", MessagesRequest, _body_with(base), places, valid,
          max(EXAMPLES // 4, 10))
    count = {k: v for k, v in base.items() if k != "max_tokens"}
    _fuzz(live, "/v1/messages/count_tokens", CountTokensRequest, _body_with(count), places,
          [({"system": "Be brief."}, False)], max(EXAMPLES // 8, 10), False)


def test_fuzz_responses(live):
    """/v1/responses (plain and streamed) and GET /v1/responses/{id}."""
    from jaxinfer.entrypoints.openai.serving_responses import ResponsesRequest

    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    base = {"model": MODEL, "max_output_tokens": 2, "input": "Hi"}
    first = post(live, "/v1/responses", base)
    assert first.status_code == 200, first.text
    valid = [({"instructions": "Be brief.", "metadata": {"k": "v"}, "top_p": 0.5,
               "previous_response_id": first.json()["id"]}, False),
             ({"tools": [tool], "tool_choice": {"type": "function", "name": "f"}}, True),
             ({"input": [{"role": "user", "content": "Hi"},
                         {"type": "function_call", "call_id": "c1", "name": "f",
                          "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
               "tools": [tool], "tool_choice": "none", "store": False}, False),
             ({"text": {"format": {"type": "json_object"}}}, True)]
    places = ["input[0]", "input[0].role", "input[0].content", "input[0].type",
              "text.format.type", "tools[0].type"]

    def make(overrides):
        body = json.loads(json.dumps(base))
        for path, value in overrides.items():
            if path == "input[0]":
                body["input"] = [value]
            elif path.startswith("input[0]."):
                body["input"] = [{"role": "user", "content": "Hi", path[9:]: value}]
            elif path == "text.format.type":
                body["text"] = {"format": {"type": value}}
            elif path == "tools[0].type":
                body["tools"] = [dict(tool, type=value)]
            else:
                body[path] = value
        return body

    _fuzz(live, "/v1/responses", ResponsesRequest, make, places, valid,
          max(EXAMPLES // 4, 10))
    for rid in (first.json()["id"], "resp_nope", "%ff", "x" * 3000):
        r = httpx.get(live.base_url + "/v1/responses/" + rid, timeout=30)
        assert r.status_code in (200, 404), r.text
        assert r.status_code == 404 or r.json()["id"] == rid
        if r.status_code == 404:
            assert_openai_error(r, 404)


def test_fuzz_pooling_routes(tiny_dir):
    """A pooling server: /v1/embeddings, /v1/score, /rerank."""
    from jaxinfer.engine.async_engine import AsyncLLM
    from jaxinfer.entrypoints.openai.serving_embedding import (EmbeddingRequest, RerankRequest,
                                                               ScoreRequest)

    llm = AsyncLLM(EngineConfig(model=tiny_dir, **dict(ENGINE, runner="pooling")))
    pool = LiveServer(llm, MODEL, max_prompts_per_request=MAX_PROMPTS)

    def works(live):
        r = post(live, "/v1/embeddings", {"model": MODEL, "input": "Hi"})
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
        assert httpx.get(live.base_url + "/health", timeout=30).status_code == 200

    try:
        n = max(EXAMPLES // 6, 10)
        _fuzz(pool, "/v1/embeddings", EmbeddingRequest,
              _body_with({"model": MODEL, "input": ["Hi", "there"]}), [],
              [({"encoding_format": "base64", "truncate_prompt_tokens": 4,
                 "add_special_tokens": False, "normalize": False}, False),
               ({"input": [[5, 6, 7], [8]]}, False)], n, False, works)
        _fuzz(pool, "/v1/score", ScoreRequest,
              _body_with({"model": MODEL, "text_1": "Hi", "text_2": ["a", "b"]}), [],
              [({"text_1": ["x", "y"]}, False)], n, False, works)
        _fuzz(pool, "/rerank", RerankRequest,
              _body_with({"model": MODEL, "query": "Hi", "documents": ["a", "b"]}), [],
              [({"top_n": 1, "return_documents": False}, False)], n, False, works)
        assert post(pool, "/v1/completions", {"model": MODEL, "prompt": "x"}).status_code == 404
        stats = pool.server.llm.stats
        assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    finally:
        pool.close()


def test_fuzz_chat_behind_reasoning_and_tool_parsers(tiny_dir):
    """The chat route of a server with --reasoning-parser and --tool-call-parser: every answer
    goes through the thinking split, every grammar waits for the end of the thinking (this
    model never writes it), and the tool parser is armed."""
    from jaxinfer.engine.async_engine import AsyncLLM
    from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest

    mp = pytest.MonkeyPatch()
    mp.setenv("JAXINFER_MAX_N_SEQUENCES", str(MAX_N))
    llm = AsyncLLM(EngineConfig(model=tiny_dir, reasoning_parser="qwen3", **ENGINE))
    live = LiveServer(llm, MODEL, max_prompts_per_request=MAX_PROMPTS,
                      enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    try:
        _fuzz(live, "/v1/chat/completions", ChatCompletionRequest, _chat_body, CHAT_PLACES,
              CHAT_VALID, examples=max(EXAMPLES // 3, 1))
        r = post(live, "/v1/chat/completions", _chat_body({}))
        message = r.json()["choices"][0]["message"]  # (the split is on: the thinking is there)
        assert r.status_code == 200 and "reasoning_content" in message, r.text
    finally:
        live.close()
        mp.undo()


# -- a dead engine ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`jaxinfer serve` on the tiny model in its own session."""

    def __init__(self, tiny_dir, *flags):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.entrypoints.cli", "serve", tiny_dir,
             "--port", str(self.port), "--served-model-name", MODEL, "--dtype", "float32",
             "--max-model-len", "512", "--max-num-seqs", "4", "--no-warmup",
             "--num-gpu-blocks-override", "64", *flags],
            cwd=root, env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, "".join(self.log[-40:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "".join(self.log[-40:])
            time.sleep(0.2)

    def _read(self):
        for line in iter(self.proc.stdout.readline, b""):
            self.log.append(line.decode(errors="replace"))

    def core_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "core_proc"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _kill_core_mid_stream(srv) -> dict:
    """Start a long stream, SIGKILL the engine core at its first token, read the rest."""
    (core,) = srv.core_pids()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    result, lines = {}, []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and "killed_at" not in result:
                os.kill(core, signal.SIGKILL)
                result["killed_at"] = time.monotonic()
            if "EngineDeadError" in line:
                result["error_at"] = time.monotonic()
    result["text"] = "\n".join(lines)
    return result


def test_a_killed_engine_core_stops_the_server(tiny_dir):
    """SIGKILL of the engine core mid-stream: the stream ends with an error event and
    [DONE], /health stops answering 200 within a second, and the server process exits with
    a non-zero code (a supervisor restarts it)."""
    srv = ServeProcess(tiny_dir)
    try:
        result = _kill_core_mid_stream(srv)
        text = result.get("text", "")
        assert "EngineDeadError" in text and text.rstrip().endswith("data: [DONE]"), result
        # The stream heard of the death within the 100 ms poll (generous bound: shared CPU),
        # and from then on /health is not 200 (503 while the server stops, then refused).
        assert result["error_at"] - result["killed_at"] < 2.0, result
        try:
            assert httpx.get(srv.url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass  # (already gone)
        assert srv.proc.wait(timeout=30) == 1, "".join(srv.log[-30:])
        assert any("the engine core died" in line for line in srv.log)
    finally:
        srv.stop()


def test_a_dead_engine_kept_alive_answers_503_everywhere(tiny_dir):
    srv = ServeProcess(tiny_dir, "--keep-alive-on-engine-death")
    try:
        result = _kill_core_mid_stream(srv)
        assert "EngineDeadError" in result.get("text", ""), result
        deadline = time.time() + 5
        while httpx.get(srv.url + "/health").status_code == 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert_openai_error(httpx.get(srv.url + "/health"), 503)
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x"}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [
                               {"role": "user", "content": "x"}]})):
            for stream in (False, True):
                r = httpx.post(srv.url + path, json={**body, "stream": stream}, timeout=30)
                err = assert_openai_error(r, 503)
                assert err["type"] == "EngineDeadError" and "dead" in err["message"]
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'jaxinfer:engine_core_alive{engine="0",model_name="tiny"} 0.0' in metrics
        time.sleep(1.0)
        assert srv.proc.poll() is None  # kept up, as asked
    finally:
        srv.stop()


def test_data_parallel_all_ranks_dead_is_a_dead_engine(tiny_dir):
    """Two ranks: one dies, the server serves on (the gauge shows it); both die: 503."""
    from jaxinfer.engine.async_engine import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=tiny_dir, data_parallel_size=2, **ENGINE))
    live = LiveServer(llm, MODEL, keep_alive_on_engine_death=True)
    try:
        plain_request_works(live)
        clients = llm.engine_core.clients
        clients[1].p.proc.kill()
        deadline = time.time() + 10
        while llm.engine_core.ranks_alive()[1]:
            assert time.time() < deadline
            time.sleep(0.05)
        plain_request_works(live)
        metrics = httpx.get(live.base_url + "/metrics").text
        assert 'jaxinfer:engine_core_alive{engine="1",model_name="tiny"} 0.0' in metrics
        assert 'jaxinfer:engine_core_alive{engine="0",model_name="tiny"} 1.0' in metrics
        clients[0].p.proc.kill()
        deadline = time.time() + 5
        while httpx.get(live.base_url + "/health").status_code == 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert_openai_error(httpx.get(live.base_url + "/health"), 503)
        r = post(live, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert assert_openai_error(r, 503)["type"] == "EngineDeadError"
    finally:
        live.close()


def test_fuzz_lora_routes(tmp_path, tiny_dir):
    """vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING) and adapter model names:
    any body gets a well-formed answer, a 4xx for bad input, and the server serves on."""
    pytest.importorskip("peft")
    import transformers

    from jaxinfer.engine.async_engine import AsyncLLM
    from tests.lora.helpers import make_adapter

    adapter = str(tmp_path / "adapter")
    make_adapter(transformers.AutoModelForCausalLM.from_pretrained(tiny_dir), adapter,
                 targets=["q_proj", "v_proj"], r=2)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    llm = AsyncLLM(EngineConfig(model=tiny_dir, enable_lora=True, max_lora_rank=4, **ENGINE))
    live = LiveServer(llm, MODEL, lora_modules=[f"static={adapter}"])
    seen = {"2xx": 0, "4xx": 0}
    try:
        def run(route, body):
            r = post(live, route, body)
            if route == "/v1/completions" or r.status_code >= 300:
                assert_well_formed(r)
            else:  # (vLLM's plain-text answer)
                assert r.status_code == 200 and r.text.startswith("Success"), r.text
            seen["2xx" if r.status_code < 300 else "4xx"] += 1
            plain_request_works(live)
            return r

        ok = run("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapter})
        assert ok.status_code == 200, ok.text
        assert run("/v1/completions", {"model": "a", "prompt": "Hi", "max_tokens": 2}
                   ).status_code == 200
        assert run("/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
        fields = ["lora_name", "lora_path", "lora_int_id", "load_inplace", "unknown_field"]

        @settings(max_examples=max(EXAMPLES // 3, 1), deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                                "/v1/completions"]),
               st.dictionaries(st.sampled_from(fields), VALUES, max_size=3), VALUES)
        def check(route, body, model):
            if route == "/v1/completions":
                body = {"model": model, "prompt": "Hi", "max_tokens": 2}
            run(route, body)

        check()
        assert seen["4xx"] > 0, seen
        r = post(live, "/v1/completions", {"model": "static", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        wait_idle(live)
    finally:
        live.close()
        mp.undo()


def test_fuzz_rl_routes(tiny_dir):
    """The dev-mode RL routes (VLLM_SERVER_DEV_MODE): any query or body gets a well-formed
    answer (a 4xx names the problem), and after putting the engine back (wake_up, resume)
    plain requests are served: no route leaves the engine dead or stuck."""
    from jaxinfer.engine.async_engine import AsyncLLM

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")
    llm = AsyncLLM(EngineConfig(model=tiny_dir, enable_sleep_mode=True, **ENGINE))
    live = LiveServer(llm, MODEL)
    seen = {"2xx": 0, "4xx": 0}
    try:
        def restore():
            for path in ("/wake_up", "/resume"):
                r = httpx.post(live.base_url + path, timeout=60)
                assert r.status_code == 200, r.text
            plain_request_works(live)

        def check_answer(r):
            assert r.status_code < 500, (r.status_code, r.text[:500])
            assert r.headers["content-type"].startswith("application/json"), r.text[:200]
            if r.status_code >= 400:
                assert_openai_error(r)
            seen["2xx" if r.status_code < 300 else "4xx"] += 1

        q = st.one_of(st.sampled_from(["abort", "wait", "keep", "0", "1", "2", "3", "true",
                                       "false", "weights", "kv_cache", "scheduling", ""]),
                      st.text(max_size=12))
        payloads = st.dictionaries(st.sampled_from(["address", "uuids", "names", "shapes",
                                                    "dtypes", "layout", "timeout_s", "x"]),
                                   VALUES, max_size=6)
        queries = st.dictionaries(st.sampled_from(["mode", "clear_cache", "level", "tags",
                                                   "unknown"]), q, max_size=3)
        bodies = st.dictionaries(st.sampled_from(["path", "weight_version", "new_version",
                                                  "method", "args", "kwargs", "timeout",
                                                  "payload", "unknown_field"]),
                                 st.one_of(VALUES, st.just(tiny_dir), payloads,
                                           st.sampled_from(["cache_counts", "sleep",
                                                            "engine_weights"])),
                                 max_size=3)

        @settings(max_examples=max(EXAMPLES // 3, 1), deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(["/pause", "/resume", "/sleep", "/wake_up", "/collective_rpc",
                                "/update_weights_from_path", "/update_weight_version",
                                "/update_weights_from_transfer"]),
               queries, bodies)
        def check(route, query, body):
            r = httpx.post(live.base_url + route, params=query, timeout=120,
                           content=json.dumps(body, allow_nan=True).encode(),
                           headers={"content-type": "application/json"})
            check_answer(r)
            for path in ("/is_paused", "/is_sleeping", "/weight_info"):
                check_answer(httpx.get(live.base_url + path, timeout=60))
            restore()

        check()
        assert seen["4xx"] > 0 and seen["2xx"] > 0, seen
        wait_idle(live)
    finally:
        live.close()
        mp.undo()

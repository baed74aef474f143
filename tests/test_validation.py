"""Every request value against the range of the type it is packed into (validation.py):
SamplingParams, the model-dependent limits, the engine core's own checks, the server's body
reader. Boundary values: the last one accepted and the first one refused, by name."""

from __future__ import annotations

import math

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.messages import EngineCoreRequest, encoder, request_decoder
from jaxinfer.entrypoints.openai.body import (MAX_JSON_DEPTH, BodyError, check_prompt,
                                              json_depth, parse_json_body)
from jaxinfer.validation import (FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN, FieldError,
                                 check_core_request, check_for_model)

# field -> (accepted edge values, refused values)
EDGES = {
    "n": ([1], [0, -1, 2**31, True, 1.5]),
    "top_k": ([-1, 0, 1, INT32_MAX], [-2, 2**31, 2**63, -(2**63), 2**64, 1.0, "5"]),
    "seed": ([INT64_MIN, -1, 0, INT64_MAX], [INT64_MAX + 1, INT64_MIN - 1, 2**64, 0.5]),
    "max_tokens": ([1, INT32_MAX, None], [0, -1, 2**31, 2**63]),
    "min_tokens": ([0], [-1, 2**31, 2**64]),
    "logprobs": ([0, 20, None], [-1, 21, 2**31]),
    "prompt_logprobs": ([0, 20], [-1, 21]),
    "temperature": ([0.0, 1e-6, 2.0, FLOAT32_MAX], [-1e-9, math.inf, math.nan, 1e308, -0.5]),
    "top_p": ([1e-9, 1.0], [0.0, 1.0000001, math.nan, -1.0]),
    "min_p": ([0.0, 1.0], [-0.1, 1.1, math.inf]),
    "presence_penalty": ([-2.0, 2.0], [-2.01, 2.01, math.nan]),
    "frequency_penalty": ([-2.0, 0.0, 2.0], [2.5, -math.inf]),
    "repetition_penalty": ([1e-6, 1.0, 100.0], [0.0, -1.0, math.inf, 1e39]),
    "truncate_prompt_tokens": ([-1, 1, INT32_MAX, None], [0, -2, 2**31]),
    "stop_token_ids": ([[0, INT32_MAX], []], [[-1], [2**31], [2**64], ["a"], [1] * 1025]),
    "stop": (["x", ["a"] * 256, ["x" * 1024]], [[""], ["a"] * 257, ["x" * 1025], [1], 5]),
}


@pytest.mark.parametrize("field", sorted(EDGES))
def test_sampling_params_edges(field):
    ok, bad = EDGES[field]
    for value in ok:
        SamplingParams(**{field: value, **({"max_tokens": None} if field == "min_tokens"
                                            else {})})
    for value in bad:
        with pytest.raises(ValueError) as e:
            SamplingParams(**{field: value})
        assert isinstance(e.value, FieldError) and e.value.field == field, (value, e.value)
        assert field in str(e.value), str(e.value)


def test_min_tokens_within_max_tokens_and_every_valid_params_encode():
    with pytest.raises(FieldError, match="min_tokens"):
        SamplingParams(max_tokens=5, min_tokens=6)
    # The extremes of every int field survive the msgpack trip to the engine core.
    params = SamplingParams(top_k=INT32_MAX, seed=INT64_MIN, max_tokens=INT32_MAX,
                            min_tokens=INT32_MAX, stop_token_ids=[INT32_MAX],
                            temperature=FLOAT32_MAX, truncate_prompt_tokens=INT32_MAX)
    req = EngineCoreRequest("r", [1], params, 2, 0.0, 2**32 - 1, priority=INT64_MAX)
    assert request_decoder().decode(encoder().encode(req)) == req


def test_limits_that_depend_on_the_model():
    check_for_model(SamplingParams(top_k=100, stop_token_ids=[99]), vocab_size=100,
                    max_model_len=64)
    for kw, field in ((dict(top_k=101), "top_k"), (dict(stop_token_ids=[100]), "stop_token_ids"),
                      (dict(truncate_prompt_tokens=65), "truncate_prompt_tokens")):
        with pytest.raises(FieldError) as e:
            check_for_model(SamplingParams(**kw), vocab_size=100, max_model_len=64)
        assert e.value.field == field


def test_the_core_checks_requests_that_bypass_the_front_end():
    good = EngineCoreRequest("r", [1, 2], SamplingParams(), 2, 0.0, 7)
    check_core_request(good, vocab_size=100, max_model_len=8)
    params = SamplingParams()
    object.__setattr__(params, "top_k", 2**31)  # what validation would have refused
    cases = [
        (EngineCoreRequest("r", [1, 2], params, 2, 0.0, 7), "top_k"),
        (EngineCoreRequest("r", [1, 100], SamplingParams(), 2, 0.0, 7), "prompt_token_ids"),
        (EngineCoreRequest("r", [-1], SamplingParams(), 2, 0.0, 7), "prompt_token_ids"),
        (EngineCoreRequest("r", [2**70], SamplingParams(), 2, 0.0, 7), "prompt_token_ids"),
        (EngineCoreRequest("r", [1] * 9, SamplingParams(), 2, 0.0, 7), "prompt_token_ids"),
        (EngineCoreRequest("r", [1], SamplingParams(), 2, 0.0, 2**32), "sampling_seed"),
        (EngineCoreRequest("r", [1], SamplingParams(), 2, 0.0, 7, priority=2**63),
         "priority"),
        (EngineCoreRequest("r", [1], SamplingParams(top_k=101), 2, 0.0, 7), "top_k"),
    ]
    for req, field in cases:
        with pytest.raises(FieldError) as e:
            check_core_request(req, vocab_size=100, max_model_len=8)
        assert e.value.field == field, (req, e.value)


def test_body_reader_refuses_what_would_hurt_later():
    assert parse_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}  # a valid pair
    cases = [
        (b"", "empty", None), (b"[1]", "JSON object", None),
        (b'{"a": NaN}', "NaN", None), (b'{"a": -Infinity}', "Infinity", None),
        (b'{"a": "\\ud800"}', "surrogate", "a"),
        (b'{"m": [{"c": "x\\udfffy"}]}', "surrogate", "m[0].c"),
        (b'{"\\ud800": 1}', "surrogate", None),
        (b'{"a": "\xff"}', "UTF-8", None), (b'{"a": ', "malformed", None),
        (b'{"a":' + b"[" * (MAX_JSON_DEPTH + 5) + b"]" * (MAX_JSON_DEPTH + 5) + b"}",
         "levels deep", None),
        (b"[" * 100000, "levels deep", None),
    ]
    for raw, needle, param in cases:
        with pytest.raises(BodyError) as e:
            parse_json_body(raw)
        assert needle in str(e.value) and e.value.param == param, (raw[:30], e.value)
    deep_ok = b'{"a":' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    parse_json_body(deep_ok)
    assert json_depth(b'{"s": "[[[[{{{{", "t": "\\"[[["}') == 1  # brackets in strings skip


def test_prompt_shapes_counts_and_ids():
    kw = dict(max_prompts=3, vocab_size=100, max_model_len=5)
    for prompt in ("text", ["a", "b", "c"], [0, 99], [[1], [2, 3]]):
        check_prompt({"prompt": prompt}, **kw)
    cases = [({}, "required"), ({"prompt": []}, "empty"), ({"prompt": 5}, "string"),
             ({"prompt": ["a"] * 4}, "4 prompts, more than the limit of 3"),
             ({"prompt": [[1]] * 4}, "limit of 3"),
             ({"prompt": [1] * 6}, "6 tokens"), ({"prompt": [[1], [1] * 6]}, "6 tokens"),
             ({"prompt": [100]}, "token id 100"), ({"prompt": [[1], [-1]]}, "token id -1"),
             ({"prompt": [1, "a"]}, "integers"), ({"prompt": [1, 2.0]}, "integers"),
             ({"prompt": [1, True]}, "integers"), ({"prompt": ["a", [1]]}, "all strings"),
             ({"prompt": [[]]}, "empty"), ({"prompt": [None]}, "NoneType")]
    for body, needle in cases:
        with pytest.raises(BodyError) as e:
            check_prompt(body, **kw)
        assert needle in str(e.value), (body, str(e.value))

"""schemathesis against the server's own /openapi.json: generated requests (schema-valid and
schema-violating, a bounded number per operation) get no 5xx, and every response matches what
the spec documents (status code, content type, body schema, headers).

The server runs a tiny random-weight model and caps n at 4, so that whatever max_tokens / n
hypothesis picks, each example stays quick."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from jaxinfer.config import EngineConfig  # noqa: E402
from tests.engine.conftest import make_tiny_model_dir  # noqa: E402
from tests.helpers import LiveServer  # noqa: E402

EXAMPLES = 25  # per POST operation and generation mode


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_dir):
    from jaxinfer.engine.async_engine import AsyncLLM

    old = os.environ.get("JAXINFER_MAX_N_SEQUENCES")
    os.environ["JAXINFER_MAX_N_SEQUENCES"] = "4"
    path = tmp_path_factory.mktemp("tiny-openapi")
    make_tiny_model_dir(path, "llama", smollm2_dir)
    llm = AsyncLLM(EngineConfig(model=str(path), dtype="float32", max_model_len=64,
                                max_num_seqs=8, max_num_batched_tokens=64, warmup=False,
                                num_kv_blocks=64, enable_multiprocessing=False))
    server = LiveServer(llm, "tiny")
    yield server
    server.close()
    if old is None:
        os.environ.pop("JAXINFER_MAX_N_SEQUENCES")
    else:
        os.environ["JAXINFER_MAX_N_SEQUENCES"] = old


def _operations(live):
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_get_documented_responses(live, mode):
    from schemathesis.specs.openapi import checks

    ops = _operations(live)
    assert {(op.method, op.path) for op in ops} >= {("post", "/v1/completions"),
                                                     ("post", "/v1/chat/completions"),
                                                     ("get", "/v1/models"), ("get", "/health")}
    gen_mode = (schemathesis.GenerationMode.POSITIVE if mode == "positive"
                else schemathesis.GenerationMode.NEGATIVE)
    calls = {}
    for op in ops:
        if mode == "negative" and (op.method == "get"
                                   or op.path in ("/reset_prefix_cache", "/ping")):
            continue  # nothing to get wrong in a bare GET or a POST without a body
        n = EXAMPLES if op.method == "post" else 1

        @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=gen_mode))
        def check(case):
            response = case.call(base_url=live.base_url, timeout=120)
            calls[op.path] = calls.get(op.path, 0) + 1
            # A schema-valid body may still be refused (400 naming the field: e.g. an empty
            # prompt, max_tokens over the context); every other check applies.
            case.validate_response(response, excluded_checks=[checks.positive_data_acceptance])

        check()
    assert calls.get("/v1/completions", 0) >= EXAMPLES // 2, calls


def test_boundary_values_of_every_documented_range(live):
    """schemathesis' coverage phase: for every POST operation, the values at and just past
    each documented bound (minimum / maximum, lengths, types, required fields, enums), valid
    and invalid. No 5xx, nothing accepted that the spec says is invalid, every response as
    documented."""
    from schemathesis.specs.openapi import checks

    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    counts = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method != "post":
            continue
        config = schema.config.generation_for(operation=op, phase="coverage")
        codes: dict[int, int] = {}
        for case in schema.iter_coverage_cases(op, generation_modes=modes,
                                               generation_config=config):
            response = case.call(base_url=live.base_url, timeout=120)
            codes[response.status_code] = codes.get(response.status_code, 0) + 1
            case.validate_response(response, excluded_checks=[checks.positive_data_acceptance])
        counts[op.path] = codes
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert counts[path].get(400, 0) > 100 and counts[path].get(200, 0) > 0, counts


def test_pooling_server_documented_responses(tmp_path_factory, smollm2_dir):
    """A pooling server (runner="pooling"): its routes (embeddings, score, rerank), schema-valid
    and schema-violating requests and the boundary values, all as documented."""
    from schemathesis.specs.openapi import checks

    from jaxinfer.engine.async_engine import AsyncLLM

    path = tmp_path_factory.mktemp("tiny-openapi-pooling")
    make_tiny_model_dir(path, "llama", smollm2_dir)
    llm = AsyncLLM(EngineConfig(model=str(path), runner="pooling", dtype="float32",
                                max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                warmup=False, num_kv_blocks=64, enable_multiprocessing=False))
    live = LiveServer(llm, "tiny")
    try:
        schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        posts = {op.path for op in ops if op.method == "post"}
        assert {"/v1/embeddings", "/v1/score", "/rerank"} <= posts
        assert "/v1/completions" not in posts
        codes: dict[str, dict[int, int]] = {}
        for op in ops:
            if op.path not in ("/v1/embeddings", "/v1/score", "/score", "/rerank",
                               "/v1/rerank"):
                continue
            for mode in (schemathesis.GenerationMode.POSITIVE,
                         schemathesis.GenerationMode.NEGATIVE):
                @settings(max_examples=10, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(op.as_strategy(generation_mode=mode))
                def check(case):
                    response = case.call(base_url=live.base_url, timeout=120)
                    got = codes.setdefault(op.path, {})
                    got[response.status_code] = got.get(response.status_code, 0) + 1
                    case.validate_response(response,
                                           excluded_checks=[checks.positive_data_acceptance])

                check()
            config = schema.config.generation_for(operation=op, phase="coverage")
            for case in schema.iter_coverage_cases(op, generation_modes=[
                    schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                    generation_config=config):
                response = case.call(base_url=live.base_url, timeout=120)
                got = codes.setdefault(op.path, {})
                got[response.status_code] = got.get(response.status_code, 0) + 1
                case.validate_response(response,
                                       excluded_checks=[checks.positive_data_acceptance])
        assert codes["/v1/embeddings"].get(200, 0) > 0 and codes["/v1/embeddings"].get(400, 0)
    finally:
        live.close()

"""The FastAPI app of an OpenAIServer: routes, the body-limit and auth middleware, error
handlers (every error in OpenAI's shape) and the OpenAPI document."""

from __future__ import annotations

import logging
import os
import time
import warnings

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.messages import EngineDeadError
from jaxinfer.entrypoints.openai.dev_routes import (add_dev_routes, dev_mode, json_object,
                                                    str_field)
from jaxinfer.entrypoints.openai.errors import (APIError, engine_dead, error_response,
                                                internal_error, validation_error)
from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxinfer.entrypoints.openai.serving_embedding import (EmbeddingRequest, RerankRequest,
                                                           ScoreRequest)
from jaxinfer.entrypoints.openai.serving_messages import (CountTokensRequest, MessagesRequest,
                                                          anthropic_error)
from jaxinfer.entrypoints.openai.serving_responses import ResponsesRequest
from jaxinfer.entrypoints.openai.serving_tokenize import (DetokenizeRequest, DetokenizeResponse,
                                                          TokenizeChatRequest,
                                                          TokenizeCompletionRequest,
                                                          TokenizeResponse)

logger = logging.getLogger(__name__)


DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


# What /openapi.json says the routes answer (schemathesis checks the server against it).
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}


_ERROR = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}


_GENERATE_RESPONSES = {
    200: {"description": "The completion (application/json), or its server-sent events "
                         "(text/event-stream) with stream=true",
          "content": {"application/json": {"schema": {"type": "object",
                                                      "required": ["id", "choices"]}},
                      # (each server-sent event: its data is a JSON chunk, an error object,
                      # or [DONE])
                      "text/event-stream": {"schema": {
                          "type": "object", "required": ["data"],
                          "properties": {"data": {"type": "string"},
                                         "event": {"type": "string"}}}}}},
    400: {"description": "Bad request: the error names the field", **_ERROR},
    401: {"description": "Missing or wrong API key", **_ERROR},
    404: {"description": "Unknown model", **_ERROR},
    413: {"description": "Body over --max-request-body-bytes", **_ERROR},
    429: {"description": "Over --max-waiting-requests (Retry-After)", **_ERROR},
    499: {"description": "The client went away", **_ERROR},
    500: {"description": "The engine failed this request (it alone); see the server log",
          **_ERROR},
    503: {"description": "No first token within --queue-timeout (Retry-After), or the engine "
                         "is dead", **_ERROR},
}


def _request_body(model) -> dict:
    """The OpenAPI requestBody of a route that parses its own body (body.py)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI documents 422 for request bodies; this server answers 400 in OpenAI's shape."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        with warnings.catch_warnings():  # (a route with two methods: ids made unique below)
            warnings.filterwarnings("ignore", "Duplicate Operation ID")
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, ops in spec.get("paths", {}).items():
            if len(ops) > 1:
                for method, op in ops.items():
                    op["operationId"] = f"{op.get('operationId', path)}_{method}"
        for ops in spec.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in (CompletionRequest, ChatCompletionRequest,  # bodies parsed by body.py
                      TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
                      MessagesRequest, CountTokensRequest, ResponsesRequest,
                      EmbeddingRequest, ScoreRequest, RerankRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        app.openapi_schema = spec
    return app.openapi_schema


# -- the app --------------------------------------------------------------------------------
def build_app(server) -> FastAPI:
    app = FastAPI(title="jaxinfer OpenAI-compatible server")

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _dead_error(request, exc: EngineDeadError):
        return error_response(engine_dead(exc))

    @app.exception_handler(RequestValidationError)
    async def _request_validation_error(request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        # Unknown routes (404), wrong methods (405) and the like, in OpenAI's error shape.
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        # (a 405 keeps starlette's Allow header: RFC 9110)
        return error_response(APIError(msg, exc.status_code,
                                        headers=dict(exc.headers or {}) or None))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        # Never plain text, never a stack trace to the client (it goes to the log).
        logger.error("unhandled error in %s %s", request.method, request.url.path,
                     exc_info=exc)
        return error_response(internal_error(exc))

    app.add_middleware(_AuthAndBodyLimit, server=server)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The server and its engine are up (empty "
                                             "body)"},
                        503: {"description": "The engine is dead", **_ERROR}})
    async def health():
        err = server.llm.dead_error
        if err is not None:
            return error_response(engine_dead(err))
        return Response(status_code=200)

    @app.post("/reset_prefix_cache", response_class=Response,
              responses={200: {"description": "Every cached, unused KV block forgotten "
                                              "(empty body; vLLM's endpoint, used between "
                                              "benchmark runs)"},
                         503: {"description": "The engine is dead", **_ERROR}})
    async def reset_prefix_cache():
        err = server.llm.dead_error
        if err is not None:
            return error_response(engine_dead(err))
        await server.llm.call_utility("reset_prefix_cache")
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        server.metrics.update_gauges(server.llm.stats)
        server.metrics.set_engine_alive(server._ranks_alive())
        lb = getattr(server.llm.engine_core, "lb", None)
        if lb is not None:
            server.metrics.update_routing(lb.num_routed)
        return Response(server.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str | None = None) -> dict:
        """A served name's card, or (vLLM's) a LoRA adapter's: root its path, parent the
        base model."""
        lora = server.lora_requests.get(name) if name is not None else None
        base = name if name in server.model_names else server.model_name
        return {"id": name if lora else base, "object": "model",
                "created": int(time.time()), "owned_by": "jaxinfer",
                "root": lora.lora_path if lora else base,
                "parent": (lora.base_model_name or server.model_name) if lora else None,
                "max_model_len": server.llm.max_model_len}

    @app.get("/v1/models", responses={401: {"description": "Missing or wrong API key",
                                            **_ERROR}})
    async def models():
        return {"object": "list",
                "data": [model_card(n) for n in server.model_names]
                + [model_card(n) for n in server.lora_requests]}

    @app.get("/v1/models/{model:path}",
             responses={401: {"description": "Missing or wrong API key", **_ERROR},
                        404: {"description": "Unknown model", **_ERROR}})
    async def model(model: str):
        server.check_model(model)
        return model_card(model)

    if runtime_lora_updating():
        _lora_routes(app, server)
    if dev_mode():  # (vLLM's VLLM_SERVER_DEV_MODE: pause / sleep / weight routes)
        add_dev_routes(app, server)

    _utility_routes(app, server)
    if server.llm.resolved.runner == "pooling":
        _pooling_routes(app, server)
    else:
        _generate_routes(app, server)
    app.openapi = lambda: _openapi_without_422(app)

    @app.on_event("startup")
    async def _startup():
        # Read the core's outputs from now on: a core that dies is noticed at once.
        server.llm.start_output_handler()
        await server.load_static_loras()

    @app.on_event("shutdown")
    async def _shutdown():
        server.llm.shutdown()

    return app


def _generate_routes(app, server) -> None:
    """A generating model's routes: completions, chat, OpenAI's Responses API, Anthropic's
    Messages API."""

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES,
              openapi_extra=_request_body(CompletionRequest))
    async def completions(raw: Request):
        server._count_request()
        req = await server.parse(raw, CompletionRequest)
        return await server.completion.create(req, raw)

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES,
              openapi_extra=_request_body(ChatCompletionRequest))
    async def chat(raw: Request):
        server._count_request()
        req = await server.parse(raw, ChatCompletionRequest)
        return await server.chat.create(req, raw)

    @app.post("/v1/responses", openapi_extra=_request_body(ResponsesRequest), responses={
        **_GENERATE_RESPONSES,
        200: {"description": "The response object (application/json), or its events "
                             "(text/event-stream) with stream=true",
              "content": {"application/json": {"schema": {
                  "type": "object", "required": ["id", "object", "output", "status"]}},
                  "text/event-stream": {"schema": {
                      "type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string"},
                                     "event": {"type": "string"}}}}}},
        404: {"description": "Unknown model or previous_response_id", **_ERROR}})
    async def responses(raw: Request):
        server._count_request()
        return await server.responses.create(raw)

    @app.get("/v1/responses/{response_id}", responses={
        200: {"description": "A stored response", "content": {"application/json": {
            "schema": {"type": "object", "required": ["id", "object", "output"]}}}},
        401: {"description": "Missing or wrong API key", **_ERROR},
        404: {"description": "Not stored (or no longer: --responses-store-size)", **_ERROR}})
    async def retrieve_response(response_id: str):
        return server.responses.retrieve(response_id)

    _anthropic_routes(app, server)


def _pooling_routes(app, server) -> None:
    """A pooling model's routes (runner="pooling"): embeddings, score, rerank."""
    bad = {400: {"description": "Bad request: the error names the field", **_ERROR},
           401: {"description": "Missing or wrong API key", **_ERROR},
           404: {"description": "Unknown model", **_ERROR},
           413: {"description": "Body over --max-request-body-bytes", **_ERROR},
           429: {"description": "Over --max-waiting-requests (Retry-After)", **_ERROR},
           499: {"description": "The client went away", **_ERROR},
           500: {"description": "The engine failed this request", **_ERROR},
           503: {"description": "Queue timeout, or the engine is dead", **_ERROR}}

    def ok(what, required):
        return {200: {"description": what, "content": {"application/json": {"schema": {
            "type": "object", "required": required}}}}, **bad}

    @app.post("/v1/embeddings", openapi_extra=_request_body(EmbeddingRequest),
              responses=ok("The inputs' embeddings", ["object", "data", "usage"]))
    async def embeddings(raw: Request):
        server._count_request()
        return await server.embedding.embeddings(raw)

    async def score(raw: Request):
        server._count_request()
        return await server.embedding.score(raw)

    async def rerank(raw: Request):
        server._count_request()
        return await server.embedding.rerank(raw)

    for path in ("/v1/score", "/score"):
        app.post(path, openapi_extra=_request_body(ScoreRequest), name=path,
                 responses=ok("Cosine similarity of each text pair's embeddings",
                              ["data"]))(score)
    for path in ("/v1/rerank", "/rerank"):
        app.post(path, openapi_extra=_request_body(RerankRequest), name=path,
                 responses=ok("The documents by the cosine similarity of their embedding "
                              "and the query's", ["results"]))(rerank)


_ANTHROPIC_ERROR = {"content": {"application/json": {"schema": {
    "type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": {"type": "string"},
                                                             "message": {"type": "string"}}}}}}}}


def _anthropic_routes(app, server) -> None:
    """Anthropic's Messages API (vLLM serves it too); its errors in Anthropic's shape."""
    bad = {400: {"description": "Bad request: the message names the field",
                 **_ANTHROPIC_ERROR},
           404: {"description": "Unknown model", **_ANTHROPIC_ERROR},
           413: {"description": "Body over --max-request-body-bytes", **_ERROR},
           429: {"description": "Over --max-waiting-requests", **_ANTHROPIC_ERROR},
           499: {"description": "The client went away", **_ANTHROPIC_ERROR},
           500: {"description": "The engine failed this request", **_ANTHROPIC_ERROR},
           503: {"description": "Queue timeout, or the engine is dead", **_ANTHROPIC_ERROR}}

    async def answer(make):
        try:
            return await make()
        except APIError as e:
            return anthropic_error(e)
        except EngineDeadError as e:
            return anthropic_error(engine_dead(e))

    @app.post("/v1/messages", openapi_extra=_request_body(MessagesRequest), responses={
        200: {"description": "The message (application/json), or its server-sent events "
                             "(text/event-stream) with stream=true",
              "content": {"application/json": {"schema": {
                  "type": "object", "required": ["id", "type", "content"]}},
                  "text/event-stream": {"schema": {
                      "type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string"},
                                     "event": {"type": "string"}}}}}}, **bad})
    async def messages(raw: Request):
        server._count_request()
        return await answer(lambda: server.messages.create(raw))

    @app.post("/v1/messages/count_tokens", openapi_extra=_request_body(CountTokensRequest),
              responses={200: {"description": "The prompt's token count",
                               "content": {"application/json": {"schema": {
                                   "type": "object", "required": ["input_tokens"]}}}},
                         **bad})
    async def count_tokens(raw: Request):
        return await answer(lambda: server.messages.count_tokens(raw))


def _utility_routes(app, server) -> None:
    """vLLM's /tokenize, /detokenize, /version, /ping and /load."""
    import jaxinfer

    json_schema = {"application/json": {"schema": {"type": "object"}}}
    bad = {400: {"description": "Bad request: the error names the field", **_ERROR},
           404: {"description": "Unknown model", **_ERROR},
           413: {"description": "Body over --max-request-body-bytes", **_ERROR},
           503: {"description": "The engine is dead", **_ERROR}}
    tokenize_body = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                             {"$ref": "#/components/schemas/TokenizeChatRequest"}]}}}}}

    @app.post("/tokenize", openapi_extra=tokenize_body, response_model=TokenizeResponse,
              responses={200: {"description": "The prompt's (or the rendered chat's) token "
                                              "ids"}, **bad})
    async def tokenize(raw: Request):
        return await server.tokenize.tokenize(raw)

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest),
              response_model=DetokenizeResponse,
              responses={200: {"description": "The token ids' text"}, **bad})
    async def detokenize(raw: Request):
        return await server.tokenize.detokenize(raw)

    @app.get("/version", responses={200: {"description": "jaxinfer's version",
                                           "content": json_schema}})
    async def version():
        return {"version": jaxinfer.__version__}

    ping_responses = {200: {"description": "As /health: the engine is up (empty body)"},
                      503: {"description": "The engine is dead", **_ERROR}}

    # (GET and POST: SageMaker's health check posts; one route, so a 405 allows both)
    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response,
                   responses=ping_responses)
    async def ping():
        err = server.llm.dead_error
        if err is not None:
            return error_response(engine_dead(err))
        return Response(status_code=200)

    @app.get("/load", responses={200: {"description": "Generation requests in flight on this "
                                                      "API server (vLLM's server_load)",
                                       "content": json_schema}})
    async def load():
        return {"server_load": len(server.llm.output_processor.requests)}


class _AuthAndBodyLimit:
    """Pure ASGI middleware (starlette's BaseHTTPMiddleware hides http.disconnect from the
    app, so a client that left could not abort its request): Bearer auth for /v1, and the
    body read whole here, refused past --max-request-body-bytes (413) whether or not a
    content-length announced it, then replayed to the app; the app's later receive() calls
    reach the client's connection (its disconnect)."""

    def __init__(self, app, server: object):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if server.api_key and scope["path"].startswith("/v1"):
            if headers.get("authorization") != f"Bearer {server.api_key}":
                return await error_response(APIError("invalid or missing API key", 401))(
                    scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = server.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await error_response(APIError(
                f"request body of {int(length)} bytes exceeds the limit of {limit} bytes "
                "(--max-request-body-bytes)", 413, "body"))(scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nothing to answer
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                return await error_response(APIError(
                    f"request body exceeds the limit of {limit} bytes "
                    "(--max-request-body-bytes)", 413, "body"))(scope, receive, send)
            parts.append(part)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


def runtime_lora_updating() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter: the env var
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (true / 1); off, the routes do not exist (404)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in (
        "1", "true", "yes")


def _lora_routes(app, server) -> None:
    """vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    lora_body = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "properties": {
            "lora_name": {"type": "string"}, "lora_path": {"type": "string"},
            "lora_int_id": {"type": "integer"}}}}}}}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              openapi_extra=lora_body,
              responses={200: {"description": "Loaded (plain text)", "content": {
                  "text/plain": {"schema": {"type": "string"}}}},
                         400: {"description": "Bad or already loaded adapter", **_ERROR}})
    async def load_lora_adapter(raw: Request):
        body = await json_object(raw)
        extra = sorted(set(body) - {"lora_name", "lora_path", "load_inplace"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        if body.get("load_inplace"):
            raise APIError("load_inplace is not supported: unload the adapter first", 400,
                           "load_inplace")
        name = str_field(body, "lora_name")
        await server.load_lora(name, str_field(body, "lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              openapi_extra=lora_body,
              responses={200: {"description": "Unloaded (plain text)", "content": {
                  "text/plain": {"schema": {"type": "string"}}}},
                         400: {"description": "Bad request", **_ERROR},
                         404: {"description": "Unknown adapter", **_ERROR}})
    async def unload_lora_adapter(raw: Request):
        body = await json_object(raw)
        extra = sorted(set(body) - {"lora_name", "lora_int_id"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        name = str_field(body, "lora_name", required=False)
        lora_id = body.get("lora_int_id")
        if name is None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
            raise APIError("lora_name (a string) or lora_int_id (an integer) is required",
                           400, "lora_name")
        await server.unload_lora(name, lora_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name or lora_id}' removed "
                                 "successfully.")

"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health,
Prometheus metrics, optional Bearer auth. Every request is an AsyncLLM stream; many batch
together in the engine (continuous batching across HTTP requests)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.async_engine import AsyncLLM
from jaxinfer.engine.messages import EngineDeadError
from jaxinfer.entrypoints.openai.body import (BodyError, check_list_limits, check_prompt,
                                              parse_json_body)
from jaxinfer.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  UnsupportedField)
from jaxinfer.entrypoints.openai.tools import (TOOL_PARSERS, forced_tool_calls,
                                               make_tool_call_id, messages_for_template,
                                               named_tool, template_renders_tools)
from jaxinfer.metrics import EngineMetrics
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.validation import FieldError, max_n_sequences
from jaxinfer.validation import max_prompts_per_request as max_prompts_per_request_env

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers
        self.err_type = err_type or {
            400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            405: "MethodNotAllowedError", 413: "RequestTooLargeError",
            422: "UnprocessableEntityError", 429: "RateLimitError", 499: "ClientDisconnected",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")


def _engine_dead(err: BaseException) -> APIError:
    first = (str(err).splitlines() or [""])[0]
    return APIError(f"the engine is dead and cannot serve requests ({first}); the server is "
                    "shutting down", 503, None, "EngineDeadError")


def _internal_error(err: BaseException) -> APIError:
    return APIError(f"internal server error ({type(err).__name__}); see the server log", 500,
                    None, "InternalServerError")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(status_code=e.status, headers=e.headers, content={"error": {
        "message": e.message, "type": e.err_type, "param": e.param, "code": e.status}})


def _held_back(text: str, finished: bool, stop: list[str]) -> int:
    """How much of `text` may be streamed: a partial stop string may still be cut off."""
    if finished or not stop:
        return len(text)
    return max(len(text) - (max(len(s) for s in stop) - 1), 0)


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
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for ops in spec.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in (CompletionRequest, ChatCompletionRequest):  # bodies parsed by body.py
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        app.openapi_schema = spec
    return app.openapi_schema


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, model_name: str, api_key: str | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 max_waiting_requests: int | None = None, queue_timeout: float | None = None,
                 metrics_role: str = "only", max_prompts_per_request: int | None = None,
                 keep_alive_on_engine_death: bool = False,
                 trust_request_chat_template: bool = False):
        """metrics_role: "only" (the one API server), "primary" or "secondary" (one of
        several: Prometheus multiprocess mode; the engines' own counters are fed by the
        primary alone, so that they are not counted once per API server).
        keep_alive_on_engine_death: when the engine core dies, keep answering (503) instead
        of shutting down (for debugging; a supervisor should restart a dead server)."""
        self.llm = llm
        self.max_prompts_per_request = max_prompts_per_request or max_prompts_per_request_env()
        if self.max_prompts_per_request < 1:
            raise ValueError("--max-prompts-per-request must be >= 1, got "
                             f"{self.max_prompts_per_request}")
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        # vLLM's --trust-request-chat-template: a request's chat_template is jinja code run in
        # this process (a sandbox bounds what it reaches, not how long it runs), so it is
        # refused unless the operator trusts the clients.
        self.trust_request_chat_template = trust_request_chat_template
        # The uvicorn.Server serving the app (set by whoever runs it): told to exit when the
        # engine dies, unless keep_alive_on_engine_death.
        self.uvicorn_server = None
        self.engine_dead: BaseException | None = None
        # Admission: at most this many sequences waiting for their first token (429 past it),
        # and how long one may wait for it (then aborted, 503). None: no limit.
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"--max-waiting-requests must be >= 1, got {max_waiting_requests}")
        if queue_timeout is not None and not queue_timeout > 0:
            raise ValueError(f"--queue-timeout must be > 0, got {queue_timeout}")
        self.max_waiting_requests = max_waiting_requests
        self.queue_timeout = queue_timeout
        self.num_waiting = 0  # sequences admitted whose first token has not come yet
        if enable_auto_tool_choice and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser, one of "
                             f"{', '.join(TOOL_PARSERS)} (got {tool_call_parser!r})")
        # tool_choice="auto": the parser that finds calls in the text (None: refused).
        self.tool_parser = TOOL_PARSERS[tool_call_parser]() if enable_auto_tool_choice else None
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.metrics = EngineMetrics(model_name, role=metrics_role)
        llm.on_step = self._on_step
        llm.on_abort = self.metrics.on_abort
        llm.on_dead = self._on_engine_dead
        self.app = self._build_app()

    def _on_engine_dead(self, err: BaseException) -> None:
        """The engine core is gone: every stream has its error already; /health and every
        request answer 503 from now on, and (unless kept alive) the server exits once the
        requests in flight are answered, so that a supervisor restarts it."""
        self.engine_dead = err
        self.metrics.set_engine_alive(self._ranks_alive())
        if self.keep_alive_on_engine_death:
            logger.error("the engine core is dead; serving 503s (--keep-alive-on-engine-death)")
            return
        logger.error("the engine core is dead: shutting the server down")
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    def _ranks_alive(self) -> list[bool]:
        ranks = getattr(self.llm.engine_core, "ranks_alive", None)
        if ranks is not None:
            return ranks()
        return [not self.llm.errored]

    def _check_alive(self) -> None:
        err = self.llm.dead_error
        if err is not None:
            raise _engine_dead(err)

    # -- helpers --------------------------------------------------------------------------------
    def _on_step(self, outputs, stats) -> None:
        self.metrics.on_step(outputs, stats)
        lb = getattr(self.llm.engine_core, "lb", None)
        if lb is not None:  # (data parallel: requests per rank, for /metrics)
            self.metrics.update_routing(lb.num_routed)

    def _count_request(self) -> None:
        index = str(getattr(self.llm.engine_core, "client_index", 0))
        self.metrics.api_requests.labels(api_server=index, **self.metrics._lbl).inc()

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, "model",
                           "NotFoundError")

    def _check_length(self, n_prompt: int, max_tokens: int | None) -> None:
        limit = self.llm.max_model_len
        if n_prompt > limit:
            raise APIError(f"The prompt has {n_prompt} tokens, longer than the model's maximum "
                           f"context length of {limit} tokens.", 400, "prompt")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                           f"prompt, {max_tokens} in the completion).", 400, "max_tokens")

    def _params(self, req):
        """The request's SamplingParams, checked against every limit (the model's too)."""
        try:
            params = req.sampling_params()
            self.llm.processor.check_params(params)
        except ValueError as e:
            field = e.field if isinstance(e, FieldError) else \
                str(e).split(" ")[0].removeprefix("SamplingParams.")
            raise APIError(str(e), 400, field) from None
        if req.priority and self.llm.resolved.engine.scheduling_policy != "priority":
            raise APIError(f"priority={req.priority}: priority scheduling is not enabled "
                           "(--scheduling-policy priority)", 400, "priority")
        return params

    def _check_prompt(self, ids: list[int]) -> None:
        """What the Processor would refuse once the response had started (a stream's 200):
        an empty prompt, one the whole KV cache cannot hold."""
        if len(ids) > self.llm.max_model_len:
            return  # (_check_length names both numbers)
        try:
            self.llm.processor.validate_prompt(ids)
        except ValueError as e:
            raise APIError(str(e), 400, "prompt") from None

    def _check_min_tokens(self, n_prompt: int, params) -> None:
        """min_tokens must leave room: within max_tokens (SamplingParams) and the context."""
        room = self.llm.max_model_len - n_prompt
        if params.min_tokens > room:
            raise APIError(f"min_tokens={params.min_tokens} is more than the context leaves "
                           f"for the completion ({room} tokens: {self.llm.max_model_len} in "
                           f"the context, {n_prompt} in the prompt)", 400, "min_tokens")

    async def _check_structured(self, req, params) -> None:
        """A bad grammar / schema is a 400 naming the request field it came from (checked in
        a thread: the first check builds the grammar backend's tokenizer)."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.llm.processor.validate_structured_outputs,
                                    params.structured_outputs)
        except ValueError as e:
            raise APIError(f"{req.structured_field}: {e}", 400, req.structured_field) from None

    def _admit(self, num_prompts: int, params) -> list["_Ticket"]:
        """One ticket per prompt: its sequences count as waiting until their first token.
        Past --max-waiting-requests: 429 with Retry-After."""
        n = num_prompts * params.n
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + n > limit:
            raise APIError(f"{self.num_waiting} sequences are waiting for their first token and "
                           f"this request adds {n}: over the limit of {limit} "
                           "(--max-waiting-requests); retry later", 429, None,
                           headers={"Retry-After": "1"})
        return [_Ticket(self, params.n) for _ in range(num_prompts)]

    async def _run(self, prompt_ids: list[int], params, request_id: str,
                   ticket: "_Ticket") -> AsyncIterator[RequestOutput]:
        gen = self.llm.generate({"prompt_token_ids": prompt_ids}, params, request_id)
        try:
            try:
                if self.queue_timeout is None:
                    first = await anext(gen)
                else:
                    first = await asyncio.wait_for(anext(gen), self.queue_timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                await gen.aclose()  # aborts the request
                raise APIError(f"the request waited more than {self.queue_timeout:g} s for its "
                               "first token (--queue-timeout); retry later", 503, None,
                               headers={"Retry-After": "1"}) from None
            finally:
                ticket.release()
            _raise_if_failed(first)
            yield first
            async for out in gen:
                _raise_if_failed(out)
                yield out
        except ValueError as e:
            raise APIError(str(e), 400, "prompt") from None
        finally:
            ticket.release()
            await gen.aclose()

    async def _collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        async def last(gen):
            out = None
            async for out in gen:
                pass
            return out

        return list(await asyncio.gather(*(last(g) for g in gens)))

    async def _merge(self, gens: list[AsyncIterator[RequestOutput]]):
        """Interleave several streams: yields (stream index, output)."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await q.put((i, out, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await q.put((i, None, e))
            finally:
                await q.put((i, None, StopAsyncIteration()))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        done = 0
        try:
            while done < len(gens):
                i, out, err = await q.get()
                if isinstance(err, StopAsyncIteration):
                    done += 1
                elif err is not None:
                    raise err
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    # -- completions ----------------------------------------------------------------------------
    async def _encode(self, text: str, truncate: bool = False) -> list[int]:
        """Tokenize off the event loop (the Rust tokenizer releases the GIL): a huge prompt
        does not hold up /health or other requests. A text too long for the context whatever
        its tokens are is refused without tokenizing it (unless it is to be truncated)."""
        tok, limit = self.llm.tokenizer, self.llm.max_model_len
        at_least = len(text) // tok.max_token_chars
        if at_least > limit and not truncate:
            raise APIError(f"The prompt has at least {at_least} tokens ({len(text)} characters), "
                           f"longer than the model's maximum context length of {limit} tokens.",
                           400, "prompt")
        return await asyncio.to_thread(tok.encode, text)

    async def _prompts(self, prompt, params) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; the shape, count, lengths and token ids were
        checked by body.check_prompt. truncate_prompt_tokens applies to each."""
        truncate = params.truncate_prompt_tokens is not None
        cut = self.llm.processor.truncate
        if isinstance(prompt, str):
            return [(prompt, cut(await self._encode(prompt, truncate), params))]
        if isinstance(prompt[0], int):
            return [(None, cut(list(prompt), params))]
        if isinstance(prompt[0], str):
            return [(p, cut(await self._encode(p, truncate), params)) for p in prompt]
        return [(None, cut(list(p), params)) for p in prompt]

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """echo + logprobs: the prompt's tokens with their logprobs (the first has none), in
        the completions logprobs shape, as vLLM returns them."""
        tok = self.llm.tokenizer
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        for tid, d in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            text = tok.decode([tid])
            tokens.append(text)
            offsets.append(off)
            off += len(text)
            if d is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(d[tid].logprob)
            tops.append({p.decoded_token: p.logprob for p in d.values()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _completion_logprobs(self, c: CompletionOutput, start: int, text_offset: int):
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = d[tid]
            tokens.append(chosen.decoded_token)
            token_lps.append(chosen.logprob)
            tops.append({p.decoded_token: p.logprob for t, p in d.items() if t != tid
                         or len(d) == 1} | {chosen.decoded_token: chosen.logprob})
            offsets.append(off)
            off += len(chosen.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req.model)
        params = self._params(req)
        await self._check_structured(req, params)
        prompts = await self._prompts(req.prompt, params)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise APIError("kv_transfer_params needs a single prompt", 400, "kv_transfer_params")
        if len(prompts) * params.n > max_n_sequences():
            raise APIError(f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n}"
                           f" sequences, more than the limit of {max_n_sequences()} per request "
                           "(JAXINFER_MAX_N_SEQUENCES)", 400, "n")
        for _, ids in prompts:
            self._check_prompt(ids)
            self._check_length(len(ids), params.max_tokens)
            self._check_min_tokens(len(ids), params)
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tickets = self._admit(len(prompts), params)
        gens = [self._run(ids, params, f"{base}-{i}", t)
                for i, ((_, ids), t) in enumerate(zip(prompts, tickets))]
        n = params.n
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if not req.stream:
            outs = await self._with_disconnect(raw, self._collect(gens))
            choices = []
            for i, out in enumerate(outs):
                echo = (prompts[i][0] or self.llm.tokenizer.decode(prompts[i][1])) \
                    if req.echo else ""
                for c in out.outputs:
                    text = echo if req.prompt_only else echo + c.text
                    lps = None
                    if req.logprobs is not None:
                        lps = self._completion_logprobs(c, 0, len(echo))
                        if req.echo:
                            lps_p = self._prompt_logprobs(out)
                            if not req.prompt_only:
                                for key in lps_p:
                                    lps_p[key] += lps[key]
                            lps = lps_p
                    choices.append({"index": i * n + c.index, "text": text, "logprobs": lps,
                                    "finish_reason": "length" if req.prompt_only
                                    else c.finish_reason,
                                    "stop_reason": None if req.prompt_only else c.stop_reason})
            completion = 0 if req.prompt_only else sum(
                len(c.token_ids) for o in outs for c in o.outputs)
            _check_kv_transfer(outs)
            return {"id": base, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": choices,
                    "usage": {"prompt_tokens": usage_prompt, "completion_tokens": completion,
                              "total_tokens": usage_prompt + completion},
                    **_kv_params(outs)}

        async def events():
            sent_text: dict[tuple[int, int], int] = {}
            sent_toks: dict[tuple[int, int], int] = {}
            completion = 0
            echo_len: dict[int, int] = {}  # prompt -> length of its echoed text
            async for i, out in self._merge(gens):
                if req.echo and i not in echo_len:
                    # The prompt goes first, once its prefill is done (its logprobs then
                    # complete); with max_tokens=0 it is all there is.
                    if not any(c.token_ids or c.finish_reason for c in out.outputs):
                        continue
                    text = prompts[i][0] or self.llm.tokenizer.decode(prompts[i][1])
                    echo_len[i] = len(text)
                    lps = self._prompt_logprobs(out) if req.logprobs is not None else None
                    for k in range(n):
                        yield _sse({"id": base, "object": "text_completion", "created": created,
                                    "model": self.model_name, "choices": [{
                                        "index": i * n + k, "text": text, "logprobs": lps,
                                        "finish_reason": "length" if req.prompt_only else None,
                                        "stop_reason": None}]})
                if req.prompt_only:
                    continue  # the one token generated to get there is not part of it
                for c in out.outputs:
                    key = (i, c.index)
                    done = c.finish_reason is not None
                    upto = _held_back(c.text, done, params.stop)
                    t0, k0 = sent_text.get(key, 0), sent_toks.get(key, 0)
                    delta = c.text[t0:upto] if upto > t0 else ""
                    if not delta and not done and len(c.token_ids) == k0:
                        continue
                    sent_text[key] = max(t0, upto)
                    sent_toks[key] = len(c.token_ids)
                    if done:
                        completion += len(c.token_ids)
                    yield _sse({"id": base, "object": "text_completion", "created": created,
                                "model": self.model_name, "choices": [{
                                    "index": i * n + c.index, "text": delta,
                                    "logprobs": self._completion_logprobs(
                                        c, k0, t0 + echo_len.get(i, 0)),
                                    "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({"id": base, "object": "text_completion", "created": created,
                            "model": self.model_name, "choices": [],
                            "usage": {"prompt_tokens": usage_prompt,
                                      "completion_tokens": completion,
                                      "total_tokens": usage_prompt + completion}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(_guard(events()), media_type="text/event-stream")

    # -- chat -----------------------------------------------------------------------------------
    def _chat_logprobs(self, c: CompletionOutput, start: int, top_n: int):
        if c.logprobs is None:
            return None
        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = d[tid]
            tok = chosen.decoded_token or ""
            tops = sorted(d.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
            content.append({"token": tok, "logprob": chosen.logprob,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": p.decoded_token or "",
                                              "logprob": p.logprob,
                                              "bytes": list((p.decoded_token or "").encode())}
                                             for _, p in tops]})
        return {"content": content}

    def _tool_mode(self, req: ChatCompletionRequest) -> str:
        """ "none" (plain text), "forced" (named / required: the output is the calls) or
        "auto" (a parser looks for calls in the text)."""
        if req.forced_tool_choice:
            return "forced"
        if req.tool_choice == "auto" and req.tools:
            if self.tool_parser is None:
                raise APIError('tool_choice="auto" (the default when tools are given) requires '
                               "--enable-auto-tool-choice and --tool-call-parser to be set",
                               400, "tool_choice")
            template = req.chat_template or self.llm.tokenizer.chat_template
            if not template_renders_tools(template):
                raise APIError("tool_choice='auto': the chat template does not render tools, "
                               "so the model would never see them; pass a chat_template that "
                               "does, or use tool_choice='required' / a named function", 400,
                               "tools")
            return "auto"
        return "none"

    def _chat_message(self, req, mode: str, c: CompletionOutput) -> tuple[dict, str | None]:
        """The assistant message and finish_reason of one finished choice."""
        text, finish = c.text, c.finish_reason
        calls: list[dict] = []
        content: str | None = text
        if mode == "forced":
            try:
                calls = forced_tool_calls(text, req.tool_choice)
                content = None
            except (ValueError, KeyError, TypeError):  # cut short (length): not a whole call
                calls = []
        elif mode == "auto":
            content, calls = self.tool_parser.parse(text)
        if calls and req.parallel_tool_calls is False:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            if finish == "stop" and (mode == "auto" or req.tool_choice == "required"):
                finish = "tool_calls"
        return message, finish

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req.model)
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError("chat_template: a chat template passed with the request is not "
                           "rendered unless the server runs with --trust-request-chat-template "
                           "(a template is code)", 400, "chat_template")
        params = self._params(req)
        await self._check_structured(req, params)
        mode = self._tool_mode(req)
        conversation = messages_for_template(req.conversation())
        chars = sum(len(m["content"]) for m in conversation)
        at_least, limit = chars // self.llm.tokenizer.max_token_chars, self.llm.max_model_len
        if at_least > limit and params.truncate_prompt_tokens is None:
            # refused without rendering or tokenizing it
            raise APIError(f"The messages have at least {at_least} tokens ({chars} characters), "
                           f"longer than the model's maximum context length of {limit} tokens.",
                           400, "messages")
        try:
            extra = {"tools": req.tools} if req.tools else {}
            ids = await asyncio.to_thread(
                self.llm.tokenizer.apply_chat_template, conversation,
                chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                **extra)
        except Exception as e:  # template errors are the request's fault
            raise APIError(f"could not render the chat template: {e}", 400, "messages") from None
        ids = self.llm.processor.truncate(ids, params)
        self._check_prompt(ids)
        self._check_length(len(ids), params.max_tokens if (req.max_tokens or
                                                           req.max_completion_tokens) else None)
        self._check_min_tokens(len(ids), params)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        (ticket,) = self._admit(1, params)
        gen = self._run(ids, params, base, ticket)
        top_n = req.top_logprobs or 0
        if not req.stream:
            (out,) = await self._with_disconnect(raw, self._collect([gen]))
            completion = sum(len(c.token_ids) for c in out.outputs)
            choices = []
            for c in out.outputs:
                message, finish = self._chat_message(req, mode, c)
                choices.append({"index": c.index, "message": message,
                                "logprobs": self._chat_logprobs(c, 0, top_n),
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            _check_kv_transfer([out])
            return {"id": base, "object": "chat.completion", "created": created,
                    "model": self.model_name, "choices": choices,
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                              "total_tokens": len(ids) + completion},
                    **_kv_params([out])}

        def chunk(choices, **extra):
            return _sse({"id": base, "object": "chat.completion.chunk", "created": created,
                         "model": self.model_name, "choices": choices, **extra})

        async def events():
            sent_text: dict[int, int] = {}
            sent_toks: dict[int, int] = {}
            call_ids: dict[int, str] = {}
            completion = 0
            for k in range(params.n):
                yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            named = named_tool(req.tool_choice) if mode == "forced" else None
            async for _, out in self._merge([gen]):
                for c in out.outputs:
                    done = c.finish_reason is not None
                    upto = _held_back(c.text, done, params.stop)
                    if mode == "auto" and not done:  # a call may be starting: hold it back
                        upto = min(upto, self.tool_parser.safe_prefix(c.text))
                    elif mode == "forced" and named is None:  # required: the calls at the end
                        upto = 0
                    t0, k0 = sent_text.get(c.index, 0), sent_toks.get(c.index, 0)
                    piece = c.text[t0:upto] if upto > t0 else ""
                    if not piece and not done and len(c.token_ids) == k0:
                        continue
                    sent_text[c.index] = max(t0, upto)
                    sent_toks[c.index] = len(c.token_ids)
                    finish = c.finish_reason
                    delta: dict[str, Any] = {}
                    if named is not None:  # the arguments, as they come
                        if t0 == 0 and (piece or done):
                            call_ids[c.index] = make_tool_call_id()
                            delta["tool_calls"] = [{"index": 0, "id": call_ids[c.index],
                                                    "type": "function", "function": {
                                                        "name": named, "arguments": piece}}]
                        elif piece:
                            delta["tool_calls"] = [{"index": 0,
                                                    "function": {"arguments": piece}}]
                    elif piece:
                        delta["content"] = piece
                    if done and mode != "none" and named is None:
                        message, finish = self._chat_message(req, mode, c)
                        calls = message.get("tool_calls")
                        if calls:
                            delta["tool_calls"] = [{"index": i, **call}
                                                   for i, call in enumerate(calls)]
                            rest = (message["content"] or "")[sent_text[c.index]:]
                        else:
                            rest = c.text[sent_text[c.index]:]
                        if rest:
                            delta["content"] = delta.get("content", "") + rest
                    if done:
                        completion += len(c.token_ids)
                    yield chunk([{"index": c.index, "delta": delta,
                                  "logprobs": self._chat_logprobs(c, k0, top_n),
                                  "finish_reason": finish, "stop_reason": c.stop_reason}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage={"prompt_tokens": len(ids), "completion_tokens": completion,
                                       "total_tokens": len(ids) + completion})
            yield "data: [DONE]\n\n"

        return StreamingResponse(_guard(events()), media_type="text/event-stream")

    async def _with_disconnect(self, raw: Request, coro):
        """Run a non-streaming request; the moment its client disconnects, cancel it, which
        aborts every sequence of it in the engine (all prompts, all n) and frees their
        blocks. The disconnect is heard on the ASGI receive channel (vLLM's
        listen_for_disconnect): polling is_disconnected() misses it."""
        task = asyncio.ensure_future(coro)

        async def listen():
            while True:
                message = await raw.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(listen())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            watcher.cancel()
            raise
        if task in done:
            watcher.cancel()
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # (its aborts are sent)
        raise APIError("client disconnected", 499, None, "ClientDisconnected")

    async def parse(self, raw: Request, model):
        """The request body as `model`: parsed and bounded by body.py, then validated; a 400
        naming the field otherwise."""
        self._check_alive()
        try:
            data = await raw.body()
        except Exception:  # starlette's ClientDisconnect: gone before its body arrived
            raise APIError("client disconnected", 499, None, "ClientDisconnected") from None
        try:
            obj = parse_json_body(data)
            check_list_limits(obj)
            if model is CompletionRequest:
                check_prompt(obj, max_prompts=self.max_prompts_per_request,
                             vocab_size=self.llm.processor.vocab_size,
                             max_model_len=self.llm.max_model_len)
            else:
                messages = obj.get("messages")
                if isinstance(messages, list) and len(messages) > self.llm.max_model_len:
                    raise BodyError(f"messages has {len(messages)} messages, more than the "
                                    f"model's maximum context length of "
                                    f"{self.llm.max_model_len} tokens", "messages")
        except BodyError as e:
            raise APIError(str(e), 400, e.param) from None
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e.errors()) from None

    # -- the app --------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxinfer OpenAI-compatible server")
        server = self

        @app.exception_handler(APIError)
        async def _api_error(request, exc: APIError):
            return _error_response(exc)

        @app.exception_handler(EngineDeadError)
        async def _dead_error(request, exc: EngineDeadError):
            return _error_response(_engine_dead(exc))

        @app.exception_handler(RequestValidationError)
        async def _request_validation_error(request, exc: RequestValidationError):
            return _error_response(_validation_error(exc.errors()))

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc: StarletteHTTPException):
            # Unknown routes (404), wrong methods (405) and the like, in OpenAI's error shape.
            msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
            if exc.status_code == 404:
                msg = f"no route {request.method} {request.url.path}"
            # (a 405 keeps starlette's Allow header: RFC 9110)
            return _error_response(APIError(msg, exc.status_code,
                                            headers=dict(exc.headers or {}) or None))

        @app.exception_handler(Exception)
        async def _unexpected(request, exc: Exception):
            # Never plain text, never a stack trace to the client (it goes to the log).
            logger.error("unhandled error in %s %s", request.method, request.url.path,
                         exc_info=exc)
            return _error_response(_internal_error(exc))

        app.add_middleware(_AuthAndBodyLimit, server=server)

        @app.get("/health", response_class=Response,
                 responses={200: {"description": "The server and its engine are up (empty "
                                                 "body)"},
                            503: {"description": "The engine is dead", **_ERROR}})
        async def health():
            err = server.llm.dead_error
            if err is not None:
                return _error_response(_engine_dead(err))
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

        def model_card() -> dict:
            return {"id": server.model_name, "object": "model", "created": int(time.time()),
                    "owned_by": "jaxinfer", "root": server.model_name, "parent": None,
                    "max_model_len": server.llm.max_model_len}

        @app.get("/v1/models", responses={401: {"description": "Missing or wrong API key",
                                                **_ERROR}})
        async def models():
            return {"object": "list", "data": [model_card()]}

        @app.get("/v1/models/{model:path}",
                 responses={401: {"description": "Missing or wrong API key", **_ERROR},
                            404: {"description": "Unknown model", **_ERROR}})
        async def model(model: str):
            if model != server.model_name:
                raise APIError(f"The model `{model}` does not exist.", 404, "model",
                               "NotFoundError")
            return model_card()

        @app.post("/v1/completions", responses=_GENERATE_RESPONSES,
                  openapi_extra=_request_body(CompletionRequest))
        async def completions(raw: Request):
            server._count_request()
            req = await server.parse(raw, CompletionRequest)
            return await server.completions(req, raw)

        @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES,
                  openapi_extra=_request_body(ChatCompletionRequest))
        async def chat(raw: Request):
            server._count_request()
            req = await server.parse(raw, ChatCompletionRequest)
            return await server.chat(req, raw)

        app.openapi = lambda: _openapi_without_422(app)

        @app.on_event("startup")
        async def _startup():
            # Read the core's outputs from now on: a core that dies is noticed at once.
            server.llm.start_output_handler()

        @app.on_event("shutdown")
        async def _shutdown():
            server.llm.shutdown()

        return app


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's first error as a 400 naming the field (UnsupportedField: its own message)."""
    err = errors[0] if errors else {}
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedField):  # a field we cannot honour: say which
        return APIError(str(cause), 400, cause.field)
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # (pydantic names union members in loc: "stop.str", "stop.list[...]"; keep the field path)
    loc = [x for x in loc if not (x[:1].isalpha() and ("[" in x or x in _TYPE_NAMES))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        msg = f"malformed JSON body: {msg}"
    ctx = err.get("ctx") or {}
    if "le" in ctx or "ge" in ctx or "lt" in ctx or "gt" in ctx or "max_length" in ctx:
        got = repr(err.get("input"))
        msg = f"{msg}, got {got[:60]}"
    return APIError(f"{param}: {msg}" if param else msg, 400, param)


_TYPE_NAMES = ("str", "int", "float", "bool", "list", "dict", "none", "constrained-str",
               "constrained-int", "function-after", "function-before", "function-wrap")


class _AuthAndBodyLimit:
    """Pure ASGI middleware (starlette's BaseHTTPMiddleware hides http.disconnect from the
    app, so a client that left could not abort its request): Bearer auth for /v1, and the
    body read whole here, refused past --max-request-body-bytes (413) whether or not a
    content-length announced it, then replayed to the app; the app's later receive() calls
    reach the client's connection (its disconnect)."""

    def __init__(self, app, server: "OpenAIServer"):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if server.api_key and scope["path"].startswith("/v1"):
            if headers.get("authorization") != f"Bearer {server.api_key}":
                return await _error_response(APIError("invalid or missing API key", 401))(
                    scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = server.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _error_response(APIError(
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
                return await _error_response(APIError(
                    f"request body exceeds the limit of {limit} bytes "
                    "(--max-request-body-bytes)", 413, "body"))(scope, receive, send)
            parts.append(part)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


def _kv_params(outs: list[RequestOutput]) -> dict:
    """vLLM's response field: the KV connector's params (a prefill instance's answer)."""
    params = next((o.kv_transfer_params for o in outs if o.kv_transfer_params), None)
    return {} if params is None else {"kv_transfer_params": params}


def _check_kv_transfer(outs: list[RequestOutput]) -> None:
    """A KV transfer that failed under kv_load_failure_policy "fail" is a 503, not an empty
    completion."""
    for o in outs:
        for c in o.outputs:
            if (c.finish_reason == "abort" and isinstance(c.stop_reason, str)
                    and c.stop_reason.startswith("KV ")):
                raise APIError(c.stop_reason, 503, "kv_transfer_params")


def _raise_if_failed(out: RequestOutput) -> None:
    """A request the engine failed (finish_reason "error": it alone; the engine serves on)."""
    for c in out.outputs:
        if c.finish_reason == "error":
            raise APIError(f"the engine failed this request: {c.stop_reason}", 500, None,
                           "InternalServerError")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Ticket:
    """Sequences counted as waiting for their first token; released once (also when the
    response is dropped before its generator ever ran)."""

    def __init__(self, server: OpenAIServer, n: int):
        self.server, self.n = server, n
        server.num_waiting += n

    def release(self) -> None:
        if self.n:
            self.server.num_waiting -= self.n
            self.n = 0

    def __del__(self):
        self.release()


async def _guard(events):
    """Errors after the response started go out as an SSE error event in OpenAI's error shape,
    then `data: [DONE]` (as vLLM ends a failed stream): a client never waits on a stream that
    ended without its terminator."""
    try:
        async for e in events:
            yield e
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every error becomes an event
        if isinstance(exc, APIError):
            err = exc
        elif isinstance(exc, EngineDeadError):
            err = _engine_dead(exc)
        else:
            logger.error("error in a response stream", exc_info=exc)
            err = _internal_error(exc)
        yield _sse({"error": {"message": err.message, "type": err.err_type, "param": err.param,
                              "code": err.status}})
        yield "data: [DONE]\n\n"


def engine_config_from_args(args):
    from jaxinfer.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                        max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        attention_backend=args.attention_backend, seed=args.seed,
                        warmup=not args.no_warmup, async_scheduling=args.async_scheduling,
                        structured_outputs_config=args.structured_outputs_config,
                        speculative_config=args.speculative_config,
                        kv_transfer_config=args.kv_transfer_config,
                        block_size=args.block_size,
                        num_kv_blocks=args.num_gpu_blocks_override,
                        enable_prefix_caching=not args.no_enable_prefix_caching,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
                        data_parallel_size=args.data_parallel_size,
                        data_parallel_prefix_affinity=not
                        args.no_data_parallel_prefix_affinity,
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"))


def make_server(llm: AsyncLLM, args, metrics_role: str = "only") -> OpenAIServer:
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model))
                                      if args.model else "SmolLM2-135M-Instruct")
    keep_alive = (getattr(args, "keep_alive_on_engine_death", False)
                  or os.environ.get("JAXINFER_KEEP_ALIVE_ON_ENGINE_DEATH", "0") not in ("", "0"))
    return OpenAIServer(llm, name, api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"),
                        max_request_body_bytes=args.max_request_body_bytes,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        max_waiting_requests=args.max_waiting_requests,
                        queue_timeout=args.queue_timeout, metrics_role=metrics_role,
                        max_prompts_per_request=getattr(args, "max_prompts_per_request", None),
                        keep_alive_on_engine_death=keep_alive,
                        trust_request_chat_template=getattr(
                            args, "trust_request_chat_template", False))


def serve(server: OpenAIServer, config, sockets=None) -> int:
    """Run `server` under uvicorn (config: a uvicorn.Config of server.app) until it stops;
    the exit code is 1 when it stopped because the engine died (a supervisor restarts it)."""
    import uvicorn

    config.timeout_graceful_shutdown = config.timeout_graceful_shutdown or 10
    uv = uvicorn.Server(config)
    server.uvicorn_server = uv
    uv.run(sockets=sockets)
    if server.engine_dead is not None:
        logger.error("exiting: the engine core died (%s)",
                     (str(server.engine_dead).splitlines() or [""])[0])
        return 1
    return 0


def run_server(args) -> int:
    import uvicorn

    from jaxinfer.entrypoints.launcher import needs_launcher, run_launcher

    if needs_launcher(args):  # several API servers, ranks on other hosts, or engines only
        return run_launcher(args)
    llm = AsyncLLM(engine_config_from_args(args))
    server = make_server(llm, args)
    llm.start()
    return serve(server, uvicorn.Config(server.app, host=args.host, port=args.port,
                                        log_level="info"))

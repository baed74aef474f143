"""OpenAIServer: the OpenAI-compatible HTTP server over an AsyncLLM (completions, chat
completions, models, health, Prometheus metrics, optional Bearer auth). Every request is an
AsyncLLM stream; many batch together in the engine (continuous batching across HTTP requests).

This module holds what both routes share: the request checks, admission (--max-waiting-
requests, --queue-timeout), the engine streams, client disconnects, and the engine's death.
The routes are serving_completion.py and serving_chat.py, the app (routes, middleware, error
handlers, OpenAPI) app.py, the errors errors.py, the streaming helpers streaming.py; running it
under uvicorn from the command line is jaxinfer/entrypoints/serve.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from jaxinfer.engine.async_engine import AsyncLLM
from jaxinfer.entrypoints.openai.app import DEFAULT_MAX_REQUEST_BODY_BYTES, build_app
from jaxinfer.entrypoints.openai.body import (BodyError, check_list_limits, check_prompt,
                                              parse_json_body)
from jaxinfer.entrypoints.openai.errors import (APIError, engine_dead, raise_if_failed,
                                                validation_error)
from jaxinfer.entrypoints.openai.protocol import CompletionRequest
from jaxinfer.entrypoints.openai.serving_chat import ChatServing
from jaxinfer.entrypoints.openai.serving_completion import CompletionServing
from jaxinfer.entrypoints.openai.serving_embedding import EmbeddingServing
from jaxinfer.entrypoints.openai.serving_messages import MessagesServing
from jaxinfer.entrypoints.openai.serving_responses import DEFAULT_STORE_SIZE, ResponsesServing
from jaxinfer.entrypoints.openai.serving_tokenize import TokenizeServing
from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS
from jaxinfer.metrics import EngineMetrics
from jaxinfer.outputs import RequestOutput
from jaxinfer.validation import FieldError
from jaxinfer.validation import max_prompts_per_request as max_prompts_per_request_env

logger = logging.getLogger(__name__)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a jinja file, or the template itself (vLLM reads it the same
    way: a value with template syntax is the template)."""
    if value is None:
        return None
    if any(m in value for m in ("{{", "{%")):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a jinja "
                         f"template ({e.strerror})") from None


def parse_lora_modules(values, base_model: str) -> list[tuple[str, str, str]]:
    """vLLM's --lora-modules: each `name=path` or a JSON object {"name", "path",
    "base_model_name"} -> (name, path, base model name)."""
    out = []
    for value in values:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
                raise ValueError(f"--lora-modules {value!r}: a JSON module needs \"name\" and "
                                 "\"path\"")
            out.append((obj["name"], obj["path"], obj.get("base_model_name") or base_model))
        elif isinstance(value, str) and "=" in value and value.split("=", 1)[0]:
            name, path = value.split("=", 1)
            out.append((name, path, base_model))
        else:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
    return out


def _cache_config_info(llm) -> dict:
    """vllm:cache_config_info's labels: the KV cache as it was set up."""
    rc, info = llm.resolved, llm.engine_core.info
    return {"block_size": info["block_size"], "num_gpu_blocks": info["num_usable_kv_blocks"],
            "cache_dtype": rc.kv_cache_dtype,
            "enable_prefix_caching": rc.cache.enable_prefix_caching,
            "prefix_caching_hash_algo": rc.cache.prefix_caching_hash_algo,
            "gpu_memory_utilization": rc.engine.gpu_memory_utilization}


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, model_name: str | list[str], api_key: str | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 max_waiting_requests: int | None = None, queue_timeout: float | None = None,
                 metrics_role: str = "only", max_prompts_per_request: int | None = None,
                 keep_alive_on_engine_death: bool = False,
                 trust_request_chat_template: bool = False,
                 default_chat_template_kwargs: dict | None = None,
                 chat_template: str | None = None, chat_template_content_format: str = "auto",
                 lora_modules=None, responses_store_size: int = DEFAULT_STORE_SIZE,
                 allowed_local_media_path: str | None = None):
        """metrics_role: "only" (the one API server), "primary" or "secondary" (one of
        several: Prometheus multiprocess mode; the engines' own counters are fed by the
        primary alone, so that they are not counted once per API server).
        keep_alive_on_engine_death: when the engine core dies, keep answering (503) instead
        of shutting down (for debugging; a supervisor should restart a dead server)."""
        self.llm = llm
        if llm.resolved.default_sampling:  # (as vLLM says so)
            logger.info("default sampling parameters from the model's generation config "
                        "(--generation-config %s; a request's own values override them): %s",
                        llm.resolved.engine.generation_config, llm.resolved.default_sampling)
        self.max_prompts_per_request = max_prompts_per_request or max_prompts_per_request_env()
        if self.max_prompts_per_request < 1:
            raise ValueError("--max-prompts-per-request must be >= 1, got "
                             f"{self.max_prompts_per_request}")
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        # vLLM's --trust-request-chat-template: a request's chat_template is jinja code run in
        # this process (a sandbox bounds what it reaches, not how long it runs), so it is
        # refused unless the operator trusts the clients.
        self.trust_request_chat_template = trust_request_chat_template
        # vLLM's --default-chat-template-kwargs: template variables every chat request gets
        # (a request's chat_template_kwargs override them)
        from jaxinfer.entrypoints.openai.protocol import check_chat_template_kwargs

        check_chat_template_kwargs(default_chat_template_kwargs,
                                   "--default-chat-template-kwargs")
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        # vLLM's --chat-template (a file or the template itself; replaces the model's) and
        # --chat-template-content-format: "string" (a message's text parts joined into one
        # string, what "auto" does here) or "openai" (the parts as a list of
        # {"type": "text", "text": ...}, for templates that iterate over them)
        self.chat_template = load_chat_template(chat_template)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError("--chat-template-content-format must be auto, string or openai, "
                             f"got {chat_template_content_format!r}")
        self.content_format = chat_template_content_format
        # image_url parts with file:// URLs are read from inside this folder only (vLLM's
        # --allowed-local-media-path); None: refused
        if allowed_local_media_path is not None and not os.path.isdir(allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {allowed_local_media_path!r} is not "
                             "a folder")
        self.allowed_local_media_path = allowed_local_media_path
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
        # --served-model-name with several names (vLLM's): a request may name any of them;
        # responses and metrics name the first.
        names = [model_name] if isinstance(model_name, str) else list(model_name)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served model names must be non-empty strings, got {model_name!r}")
        self.model_names = list(dict.fromkeys(names))
        self.model_name = model_name = names[0]
        # LoRA adapters served under their own model names (--lora-modules, and
        # /v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING): name -> LoRARequest.
        self.lora_requests: dict = {}
        self.static_lora_modules = parse_lora_modules(lora_modules or [], model_name)
        if self.static_lora_modules and not llm.resolved.engine.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        self._next_lora_id = 1
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.metrics = EngineMetrics(model_name, role=metrics_role,
                                     max_model_len=llm.max_model_len,
                                     cache_config=_cache_config_info(llm),
                                     num_engines=llm.resolved.parallel.data_parallel_size)
        llm.on_step = self._on_step
        llm.on_abort = self.metrics.on_abort
        llm.on_dead = self._on_engine_dead
        self.completion = CompletionServing(self)
        self.chat = ChatServing(self)
        self.tokenize = TokenizeServing(self)
        self.messages = MessagesServing(self)
        self.responses = ResponsesServing(self, responses_store_size)
        self.embedding = EmbeddingServing(self)
        self.app = build_app(self)

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
            raise engine_dead(err)

    # -- helpers --------------------------------------------------------------------------------
    def _on_step(self, outputs, stats) -> None:
        self.metrics.on_step(outputs, stats)
        lb = getattr(self.llm.engine_core, "lb", None)
        if lb is not None:  # (data parallel: requests per rank, for /metrics)
            self.metrics.update_routing(lb.num_routed)

    def _count_request(self) -> None:
        index = str(getattr(self.llm.engine_core, "client_index", 0))
        self.metrics.api_requests.labels(api_server=index, **self.metrics._lbl).inc()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and name not in self.lora_requests:
            raise APIError(f"The model `{name}` does not exist.", 404, "model",
                           "NotFoundError")

    def response_model(self, req) -> str:
        """The `model` a response names: the adapter's when the request ran one."""
        return req.model if req.model in self.lora_requests else self.model_name

    # -- LoRA adapters ---------------------------------------------------------------------
    async def load_lora(self, name: str, path: str, base_model_name: str | None = None):
        """Load an adapter under model name `name` (APIError 400 naming what is wrong)."""
        from jaxinfer.lora.request import LoRARequest

        if not name or not path:
            raise APIError("both 'lora_name' and 'lora_path' must be provided", 400,
                           "lora_name" if not name else "lora_path")
        if name in self.lora_requests or name in self.model_names:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", 400,
                           "lora_name")
        try:
            lora = LoRARequest(name, self._next_lora_id, path, base_model_name)
            await self.llm.add_lora(lora)
        except ValueError as e:
            raise APIError(str(e), 400, "lora_path") from None
        self._next_lora_id += 1
        self.lora_requests[name] = lora
        return lora

    async def unload_lora(self, name: str | None, lora_int_id: int | None = None) -> None:
        lora = self.lora_requests.get(name) if name else next(
            (r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id), None)
        if lora is None:
            raise APIError(f"The lora adapter '{name or lora_int_id}' cannot be found.", 404,
                           "lora_name", "NotFoundError")
        try:
            await self.llm.remove_lora(lora.lora_int_id)
        except (ValueError, RuntimeError) as e:  # (in use by unfinished requests)
            prefix = "engine core utility failed: ValueError: "
            if isinstance(e, RuntimeError) and not str(e).startswith(prefix):
                raise
            raise APIError(str(e).removeprefix(prefix), 400, "lora_name") from None
        del self.lora_requests[lora.lora_name]

    async def load_static_loras(self) -> None:
        """--lora-modules, at start-up (a bad adapter stops the server, naming it)."""
        for name, path, base in self.static_lora_modules:
            try:
                await self.load_lora(name, path, base)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None

    def check_length(self, n_prompt: int, max_tokens: int | None) -> None:
        limit = self.llm.max_model_len
        if n_prompt > limit:
            raise APIError(f"The prompt has {n_prompt} tokens, longer than the model's maximum "
                           f"context length of {limit} tokens.", 400, "prompt")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                           f"prompt, {max_tokens} in the completion).", 400, "max_tokens")

    def sampling_params(self, req):
        """The request's SamplingParams, checked against every limit (the model's too)."""
        try:
            params = req.sampling_params(self.llm.resolved.default_sampling)
            self.llm.processor.check_params(params)
        except ValueError as e:
            field = e.field if isinstance(e, FieldError) else \
                str(e).split(" ")[0].removeprefix("SamplingParams.")
            if field.startswith("extra_args"):  # (the request's name for them)
                field = "vllm_xargs"
            raise APIError(str(e), 400, field) from None
        if req.priority and self.llm.resolved.engine.scheduling_policy != "priority":
            raise APIError(f"priority={req.priority}: priority scheduling is not enabled "
                           "(--scheduling-policy priority)", 400, "priority")
        return params

    @staticmethod
    def prompt_logprobs(req, out) -> dict:
        """vLLM's prompt_logprobs response field, when the request asked for it: per prompt
        position (the first: null) token id -> {logprob, rank, decoded_token}."""
        if req.prompt_logprobs is None:
            return {}
        as_ids = bool(req.return_tokens_as_token_ids)
        return {"prompt_logprobs": [None if d is None else {
            str(t): {"logprob": max(p.logprob, -9999.0), "rank": p.rank,
                     "decoded_token": f"token_id:{t}" if as_ids else p.decoded_token}
            for t, p in d.items()} for d in out.prompt_logprobs or []]}

    def check_prompt(self, ids: list[int], image_tokens: int = 0) -> None:
        """What the Processor would refuse once the response had started (a stream's 200):
        an empty prompt, one the whole KV cache cannot hold (image_tokens: how many of its
        tokens are its images', placed by the route)."""
        if len(ids) > self.llm.max_model_len:
            return  # (_check_length names both numbers)
        try:
            self.llm.processor.validate_prompt(ids, image_tokens)
        except ValueError as e:
            raise APIError(str(e), 400, "prompt") from None

    def check_min_tokens(self, n_prompt: int, params) -> None:
        """min_tokens must leave room: within max_tokens (SamplingParams) and the context."""
        room = self.llm.max_model_len - n_prompt
        if params.min_tokens > room:
            raise APIError(f"min_tokens={params.min_tokens} is more than the context leaves "
                           f"for the completion ({room} tokens: {self.llm.max_model_len} in "
                           f"the context, {n_prompt} in the prompt)", 400, "min_tokens")

    async def check_structured(self, req, params) -> None:
        """A bad grammar / schema is a 400 naming the request field it came from (checked in
        a thread: the first check builds the grammar backend's tokenizer)."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.llm.processor.validate_structured_outputs,
                                    params.structured_outputs)
        except ValueError as e:
            raise APIError(f"{req.structured_field}: {e}", 400, req.structured_field) from None

    def admit(self, num_prompts: int, params) -> list["_Ticket"]:
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

    async def run(self, prompt_ids: list[int], params, request_id: str, ticket: "_Ticket",
                  req, **kwargs) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt of request `req` (its priority and cache_salt; `kwargs`:
        more of the engine's per-request arguments)."""
        lora = self.lora_requests.get(req.model)
        if lora is not None:  # (the request's model names an adapter)
            kwargs["lora_request"] = lora
        prompt = {"prompt_token_ids": prompt_ids}
        images = kwargs.pop("multi_modal_data", None)
        if images:
            prompt["multi_modal_data"] = images
        gen = self.llm.generate(prompt, params, request_id,
                                priority=req.priority, cache_salt=req.cache_salt, **kwargs)
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
            raise_if_failed(first)
            yield first
            async for out in gen:
                raise_if_failed(out)
                yield out
        except ValueError as e:
            raise APIError(str(e), 400, "prompt") from None
        finally:
            ticket.release()
            await gen.aclose()

    async def collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        async def last(gen):
            out = None
            async for out in gen:
                pass
            return out

        return list(await asyncio.gather(*(last(g) for g in gens)))

    async def merge(self, gens: list[AsyncIterator[RequestOutput]]):
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
    async def encode(self, text: str, truncate: bool = False) -> list[int]:
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

    async def with_disconnect(self, raw: Request, coro):
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
        def check(obj):
            if model is CompletionRequest:
                check_prompt(obj, max_prompts=self.max_prompts_per_request,
                             vocab_size=self.llm.processor.vocab_size,
                             max_model_len=self.llm.max_model_len)

        obj = await self.read_json(raw, check)
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e.errors()) from None

    async def read_json(self, raw: Request, check=None) -> dict:
        """A route's JSON body, parsed and bounded by body.py (check(obj): more checks that
        raise BodyError) before any model sees it; a 400 naming the field otherwise."""
        self._check_alive()
        try:
            data = await raw.body()
        except Exception:  # starlette's ClientDisconnect: gone before its body arrived
            raise APIError("client disconnected", 499, None, "ClientDisconnected") from None
        try:
            obj = parse_json_body(data)
            check_list_limits(obj)
            for field in ("messages", "input"):  # (chat, Messages, Responses: each message
                # or item is at least a token; bounded before pydantic walks them)
                items = obj.get(field)  # ("input" of the embeddings: token ids, checked there)
                if (isinstance(items, list) and len(items) > self.llm.max_model_len
                        and (field == "messages" or isinstance(items[0], dict))):
                    raise BodyError(f"{field} has {len(items)} messages, more than the "
                                    f"model's maximum context length of "
                                    f"{self.llm.max_model_len} tokens", field)
            if check is not None:
                check(obj)
        except BodyError as e:
            raise APIError(str(e), 400, e.param) from None
        return obj

    @staticmethod
    def kv_params(outs: list[RequestOutput]) -> dict:
        """vLLM's response field: the KV connector's params (a prefill instance's answer)."""
        params = next((o.kv_transfer_params for o in outs if o.kv_transfer_params), None)
        return {} if params is None else {"kv_transfer_params": params}


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

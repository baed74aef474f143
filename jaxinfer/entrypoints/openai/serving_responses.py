"""OpenAI's Responses API (/v1/responses), as vLLM serves it: the request (instructions, input
items, function tools, text.format, previous_response_id) becomes a chat completion request,
runs through the chat route, and comes back as a Response object or as the Responses event
stream. Responses are kept in a bounded in-memory store (`--responses-store-size`) for
`previous_response_id` and GET /v1/responses/{id}."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.entrypoints.openai.errors import APIError, validated
from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest
from jaxinfer.entrypoints.openai.streaming import chat_chunks
from jaxinfer.validation import MAX_TOOLS

DEFAULT_STORE_SIZE = 1024  # responses kept for previous_response_id (oldest dropped first)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # (only the default: nothing to change)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # (echoed back)
    user: str | None = None  # (informational)
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None


def _refuse(field: str, why: str):
    raise APIError(f"{field}: {why}", 400, field)


def _text(content, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _refuse(where, "content must be a string or a list of text parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                  "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            _refuse(f"{where}[{i}].type", f"only text parts are supported (got "
                    f"{str(kind)[:40]!r}; text-only model)")
        if not isinstance(part.get("text"), str):
            _refuse(f"{where}[{i}].text", "a text part needs its text")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items) -> list[dict]:
    """Responses input items as chat messages: messages, function calls (an assistant's
    tool_calls), their outputs (tool messages), earlier reasoning (the next assistant
    message's reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                _refuse(where + ".role", f"unknown role {str(role)[:40]!r}")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _text(item.get("content"), where + ".content")}
            if role == "assistant" and thought is not None:
                msg["reasoning_content"], thought = thought, None
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    _refuse(f"{where}.{key}", "a function_call item needs call_id, name and "
                            "arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    msg["reasoning_content"], thought = thought, None
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                _refuse(where + ".call_id", "a function_call_output item needs its call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str)
                        else _text(output, where + ".output")})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in (item.get("content") or [])
                     if isinstance(c, dict)]
            thought = "".join(t for t in texts if isinstance(t, str))
        else:
            _refuse(where + ".type", f"input items of type {str(kind)[:40]!r} are not "
                    "supported (message, function_call, function_call_output, reasoning)")
    return out


def _chat_tools(tools) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            _refuse(f"tools[{i}].type", f"only function tools are served (got "
                    f"{str(tool.get('type'))[:40]!r})")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    _refuse("tool_choice", "tool_choice must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'name': ...}")


class ResponsesServing:
    def __init__(self, server, store_size: int = DEFAULT_STORE_SIZE):
        if not isinstance(store_size, int) or store_size < 0:
            raise ValueError(f"--responses-store-size must be an integer >= 0 (0: keep none), "
                             f"got {store_size!r}")
        self.server = server
        self.store_size = store_size
        # id -> (the response object, the conversation it continues: chat messages without
        # the instructions, the answer included)
        self.store: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def _keep(self, response: dict, history: list[dict]) -> None:
        if self.store_size <= 0:
            return
        self.store[response["id"]] = (response, history)
        while len(self.store) > self.store_size:
            self.store.popitem(last=False)

    def retrieve(self, response_id: str) -> dict:
        kept = self.store.get(response_id)
        if kept is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id",
                           "NotFoundError")
        return kept[0]

    async def create(self, raw):
        req = validated(ResponsesRequest, await self.server.read_json(raw))
        if req.background:
            _refuse("background", "background responses are not supported")
        if req.truncation == "auto":
            _refuse("truncation", "only 'disabled' (a too-long input is a 400)")
        if req.reasoning is not None:
            _refuse("reasoning", "reasoning effort is not configurable per request here: a "
                    "reasoning model thinks as its chat template says, and the server's "
                    "--reasoning-parser returns the reasoning items")
        if req.include:
            _refuse("include", "no extra output data can be included")
        if req.service_tier not in (None, "auto", "default"):
            _refuse("service_tier", "only 'auto' or 'default' (one tier here)")
        history: list[dict] = []
        if req.previous_response_id is not None:
            kept = self.store.get(req.previous_response_id)
            if kept is None:
                raise APIError(f"previous_response_id: response '{req.previous_response_id}' "
                               f"is not stored here (kept: the last {self.store_size})", 404,
                               "previous_response_id", "NotFoundError")
            history = list(kept[1])
        turn = input_messages(req.input)
        conversation = history + turn
        messages = ([{"role": "system", "content": req.instructions}]
                    if req.instructions else []) + conversation
        if not messages:
            _refuse("input", "the input holds no message")
        body: dict[str, Any] = {"messages": messages}
        if req.model is not None:
            body["model"] = req.model
        for name, value in (("max_tokens", req.max_output_tokens),
                            ("temperature", req.temperature), ("top_p", req.top_p),
                            ("parallel_tool_calls", req.parallel_tool_calls)):
            if value is not None:
                body[name] = value
        if req.tools:
            body["tools"] = _chat_tools(req.tools)
        if req.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(req.tool_choice)
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None or not fmt.name:
                _refuse("text.format", "a json_schema format needs its name and schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": bool(fmt.strict),
                **({"description": fmt.description} if fmt.description else {})}}
        if req.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        chat = validated(ChatCompletionRequest, body)
        shell = self._shell(req, self.server.response_model(chat))
        result = await self.server.chat.create(chat, raw)
        if not req.stream:
            response = _finish(shell, result)
            if req.store:
                self._keep(response, conversation + _as_messages(response))
            return response
        return StreamingResponse(self._events(result, shell, req, conversation),
                                 media_type="text/event-stream")

    @staticmethod
    def _shell(req: ResponsesRequest, model: str) -> dict:
        """The response object's fields known before generation."""
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                "created_at": int(time.time()), "status": "in_progress", "model": model,
                "output": [], "error": None, "incomplete_details": None,
                "instructions": req.instructions, "metadata": req.metadata or {},
                "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "text": {"format": fmt}, "truncation": req.truncation or "disabled",
                "store": req.store, "background": False, "user": req.user, "usage": None}

    async def _events(self, stream: StreamingResponse, shell: dict, req, conversation):
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return (f"event: {kind}\ndata: "
                    f"{json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n")

        yield event("response.created", response=dict(shell))
        yield event("response.in_progress", response=dict(shell))
        output: list[dict] = []
        current: dict | None = None  # the item being streamed
        calls: dict[int, dict] = {}  # the chat's tool call index -> its item
        finish, usage = None, None

        def close(item):
            k = output.index(item)
            if item["type"] == "message":
                part = item["content"][0]
                yield event("response.output_text.done", item_id=item["id"], output_index=k,
                            content_index=0, text=part["text"], logprobs=[])
                yield event("response.content_part.done", item_id=item["id"], output_index=k,
                            content_index=0, part=part)
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                yield event("response.reasoning_text.done", item_id=item["id"],
                            output_index=k, content_index=0, text=text)
            elif item["type"] == "function_call":
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=k, arguments=item["arguments"], name=item["name"])
            item["status"] = "completed"
            yield event("response.output_item.done", output_index=k, item=item)

        def start(item):
            nonlocal current
            out = list(close(current)) if current is not None else []
            output.append(item)
            current = item
            k = len(output) - 1
            added = dict(item, content=[]) if "content" in item else dict(item)
            out.append(event("response.output_item.added", output_index=k, item=added))
            if item["type"] == "message":
                out.append(event("response.content_part.added", item_id=item["id"],
                                 output_index=k, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []}))
            return out

        async for chunk in chat_chunks(stream):
            if "error" in chunk:
                err = chunk["error"]
                yield event("error", code=str(err.get("code")), message=err.get("message"),
                            param=err.get("param"))
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                if delta.get("reasoning"):
                    if current is None or current["type"] != "reasoning":
                        for e in start({"type": "reasoning", "id": _id("rs"),
                                        "summary": [], "status": "in_progress",
                                        "content": [{"type": "reasoning_text",
                                                     "text": ""}]}):
                            yield e
                    current["content"][0]["text"] += delta["reasoning"]
                    yield event("response.reasoning_text.delta", item_id=current["id"],
                                output_index=len(output) - 1, content_index=0,
                                delta=delta["reasoning"])
                if delta.get("content"):
                    if current is None or current["type"] != "message":
                        for e in start(_message_item("", "in_progress")):
                            yield e
                    current["content"][0]["text"] += delta["content"]
                    yield event("response.output_text.delta", item_id=current["id"],
                                output_index=len(output) - 1, content_index=0,
                                delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or ():
                    k = call.get("index", 0)
                    fn = call.get("function") or {}
                    if k not in calls:
                        calls[k] = {"type": "function_call", "id": _id("fc"),
                                    "call_id": call.get("id") or _id("call"),
                                    "name": fn.get("name"), "arguments": "",
                                    "status": "in_progress"}
                        for e in start(calls[k]):
                            yield e
                    if fn.get("arguments"):
                        calls[k]["arguments"] += fn["arguments"]
                        yield event("response.function_call_arguments.delta",
                                    item_id=calls[k]["id"],
                                    output_index=output.index(calls[k]),
                                    delta=fn["arguments"])
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
        if current is not None:
            for e in close(current):
                yield e
        response = dict(shell, output=output, usage=_usage(usage or {}))
        _set_status(response, finish)
        if req.store:
            self._keep(response, conversation + _as_messages(response))
        # (response.completed whatever the status, as vLLM: the SDK's stream helper waits
        # for it; an incomplete answer says so in its status and incomplete_details)
        yield event("response.completed", response=response)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _usage(u: dict) -> dict:
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _set_status(response: dict, finish: str | None) -> None:
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def _finish(shell: dict, chat: dict) -> dict:
    """The Response object of a chat completion."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict] = []
    if message.get("reasoning"):
        output.append({"type": "reasoning", "id": _id("rs"), "summary": [],
                       "status": "completed",
                       "content": [{"type": "reasoning_text", "text": message["reasoning"]}]})
    if message.get("content"):
        output.append(_message_item(message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    response = dict(shell, output=output, usage=_usage(chat["usage"]))
    _set_status(response, choice["finish_reason"])
    return response


def _as_messages(response: dict) -> list[dict]:
    """A response's output as chat messages (what a follow-up turn continues)."""
    text = "".join(p["text"] for item in response["output"] if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]

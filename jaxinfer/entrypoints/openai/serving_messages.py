"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as vLLM serves it: the
request becomes a chat completion request, runs through the chat route, and its answer (or
its stream of chunks) goes back in Anthropic's shapes and server-sent event names. Errors
use Anthropic's error shape."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxinfer.entrypoints.openai.errors import APIError, validated
from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest, UnsupportedField
from jaxinfer.entrypoints.openai.streaming import chat_chunks
from jaxinfer.validation import MAX_STOP_STRINGS, MAX_TOOLS

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentBlock(BaseModel):
    # (fields newer than this code, echoed back as null by clients that keep Anthropic's
    # blocks, are taken; one with a value is refused by name)
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "image", "tool_use", "tool_result", "thinking",
                  "redacted_thinking", "document"]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # an earlier answer's thinking
    signature: str | None = None
    cache_control: dict[str, Any] | None = None  # (a hint for Anthropic's own cache)
    source: dict[str, Any] | None = None
    data: str | None = None
    citations: Any = None

    @model_validator(mode="after")
    def _refuse_unknown(self):
        for key, value in (self.model_extra or {}).items():
            if value is not None:
                raise UnsupportedField(key, f"{key}: unsupported content block field")
        return self


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # (user_id: informational, as in vLLM)
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


def anthropic_error(err: APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                           else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": err.message}},
                        status_code=err.status, headers=err.headers)


def _refuse(field: str, why: str):
    raise APIError(f"{field}: {why}", 400, field)


def _text_of(blocks, where: str) -> str:
    """The text of a string or of text blocks (others refused by name)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks):
        b = b if isinstance(b, dict) else b.model_dump(exclude_none=True)
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            _refuse(f"{where}[{i}]", f"only text blocks are supported here (got "
                    f"{str(b.get('type'))[:40]!r})")
        parts.append(b["text"])
    return "".join(parts)


def _chat_messages(req) -> list[dict]:
    """Anthropic's system + messages as chat messages (tool_use -> tool_calls, tool_result ->
    a tool message)."""
    out: list[dict] = []
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for m, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        text, calls, thoughts = [], [], []
        for b, block in enumerate(msg.content):
            where = f"messages[{m}].content[{b}]"
            if block.type == "text":
                if block.text is None:
                    _refuse(where + ".text", "a text block needs its text")
                text.append(block.text)
            elif block.type == "tool_use" and msg.role == "assistant":
                if not block.id or not block.name:
                    _refuse(where, "a tool_use block needs its id and name")
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result" and msg.role == "user":
                if not block.tool_use_id:
                    _refuse(where + ".tool_use_id", "a tool_result block needs tool_use_id")
                if text:  # (text before the result stays in its order)
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                content = _text_of(block.content or "", where + ".content")
                if block.is_error:
                    content = f"Error: {content}"
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": content})
            elif block.type == "thinking" and msg.role == "assistant":
                thoughts.append(block.thinking or "")
            elif block.type == "redacted_thinking" and msg.role == "assistant":
                continue  # (encrypted by Anthropic: nothing a template could show)
            else:
                _refuse(where + ".type", f"{block.type} blocks are not supported in "
                        f"{msg.role} messages (text-only model; tool_use from the assistant, "
                        "tool_result from the user)")
        if text or calls or thoughts or not out or out[-1].get("role") != "tool":
            entry: dict[str, Any] = {"role": msg.role, "content": "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            if thoughts:
                entry["reasoning_content"] = "".join(thoughts)
            out.append(entry)
    return out


def _chat_fields(req) -> dict:
    if req.thinking is not None:
        _refuse("thinking", "extended thinking is not configured per request here: a "
                "reasoning model thinks as its chat template says (chat_template_kwargs), and "
                "the server's --reasoning-parser returns the thinking blocks")
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                _refuse("tool_choice.name", "tool_choice type 'tool' needs the tool's name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                choice.type]
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return body


class MessagesServing:
    def __init__(self, server):
        self.server = server

    async def _parse(self, raw, model):
        return validated(model, await self.server.read_json(raw))

    @staticmethod
    def _chat_request(body: dict) -> ChatCompletionRequest:
        return validated(ChatCompletionRequest, body)

    async def count_tokens(self, raw) -> dict:
        req = await self._parse(raw, CountTokensRequest)
        self.server.check_model(req.model)
        chat = self._chat_request(_chat_fields(req))
        ids, _ = await self.server.chat.render(chat)
        return {"input_tokens": len(ids)}

    async def create(self, raw):
        req = await self._parse(raw, MessagesRequest)
        if req.service_tier not in (None, "auto", "standard_only"):
            _refuse("service_tier", "only 'auto' or 'standard_only' (one tier here)")
        body = _chat_fields(req)
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        chat = self._chat_request(body)
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        info: dict = {}
        result = await self.server.chat.create(chat, raw, info)
        model = self.server.response_model(chat)
        if not req.stream:
            return _message(result, msg_id, model, req.stop_sequences)
        return StreamingResponse(_events(result, msg_id, model, info),
                                 media_type="text/event-stream")


def _stop(finish: str | None, stop_reason, has_calls: bool) -> tuple[str | None, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a chat choice's finish."""
    if has_calls and finish in ("stop", "tool_calls"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish in ("stop", "tool_calls"):
        return "end_turn", None
    return finish, None  # (abort / error: as they came)


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def _message(chat: dict, msg_id: str, model: str, stops) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content += [_tool_use(c) for c in calls]
    reason, sequence = _stop(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    usage = chat["usage"]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"]}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data), ensure_ascii=False)}\n\n"


async def _events(stream: StreamingResponse, msg_id: str, model: str, info: dict):
    """The chat route's chunks as Anthropic's events: message_start, per block
    content_block_start / _delta / _stop, message_delta (stop reason, usage), message_stop."""
    yield _event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": info.get("prompt_tokens", 0), "output_tokens": 0}}})
    index, open_kind = -1, None  # the block being streamed: its index and kind
    calls: dict[int, int] = {}  # the chat's tool call index -> its block index
    finish, stop_reason, usage = None, None, None

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        out = []
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        index, open_kind = index + 1, kind
        out.append(_event("content_block_start", {"index": index, "content_block": block}))
        return out

    async for chunk in chat_chunks(stream):
        if "error" in chunk:  # (the stream failed after it started)
            err = chunk["error"]
            yield _event("error", {"error": {
                "type": ERROR_TYPES.get(err.get("code"), "api_error"),
                "message": err.get("message", "")}})
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning")
            if thought:
                if open_kind != "thinking":
                    for e in start("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""}):
                        yield e
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": thought}})
            if delta.get("content"):
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or ():
                k = call.get("index", 0)
                fn = call.get("function") or {}
                if k not in calls:
                    for e in start("tool_use", {"type": "tool_use", "id": call.get("id"),
                                                "name": fn.get("name"), "input": {}}):
                        yield e
                    calls[k] = index
                if fn.get("arguments"):
                    yield _event("content_block_delta", {"index": calls[k], "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}})
            if choice.get("finish_reason") is not None:
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    reason, sequence = _stop(finish, stop_reason, bool(calls))
    usage = usage or {}
    yield _event("message_delta", {
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"input_tokens": usage.get("prompt_tokens", info.get("prompt_tokens", 0)),
                  "output_tokens": usage.get("completion_tokens", 0)}})
    yield _event("message_stop", {})

"""Server-sent events shared by both routes: the framing, the guard that turns an error after
the response started into an error event (then [DONE]), and the per-choice delta tracker."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, NamedTuple

from jaxinfer.engine.messages import EngineDeadError
from jaxinfer.entrypoints.openai.errors import APIError, engine_dead, internal_error

logger = logging.getLogger(__name__)


def held_back(text: str, finished: bool, stop: list[str]) -> int:
    """How much of `text` may be streamed: a partial stop string may still be cut off."""
    if finished or not stop:
        return len(text)
    return max(len(text) - (max(len(s) for s in stop) - 1), 0)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def guard(events):
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
            err = engine_dead(exc)
        else:
            logger.error("error in a response stream", exc_info=exc)
            err = internal_error(exc)
        yield sse({"error": {"message": err.message, "type": err.err_type, "param": err.param,
                              "code": err.status}})
        yield "data: [DONE]\n\n"


async def chat_chunks(stream):
    """The JSON chunks of the chat route's event stream (a StreamingResponse not yet sent),
    for the routes that re-shape them (Responses, Messages); an error event is a chunk with
    "error"."""
    async for raw in stream.body_iterator:
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


class Delta(NamedTuple):
    text: str  # the new text to send (may be empty)
    start: int  # characters of the choice's text sent before it
    start_tokens: int  # tokens of the choice sent before it
    done: bool  # the choice finished


class DeltaTracker:
    """Per choice (any hashable key): how much of its text and how many of its tokens have
    been sent. A stop string may still cut the text, so the end that could be the start of
    one is held back until the choice finishes; `limit` holds back more (a tool call that may
    be starting; the whole text for calls sent when they end)."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.text: dict[Any, int] = {}
        self.tokens: dict[Any, int] = {}
        self.completion_tokens = 0  # tokens of the finished choices

    def next(self, key, c, limit: int | None = None) -> Delta | None:
        """What to send for choice output `c`, or None when nothing changed."""
        done = c.finish_reason is not None
        upto = held_back(c.text, done, self.stop)
        if limit is not None:
            upto = min(upto, limit)
        t0, k0 = self.text.get(key, 0), self.tokens.get(key, 0)
        piece = c.text[t0:upto] if upto > t0 else ""
        if not piece and not done and len(c.token_ids) == k0:
            return None
        self.text[key] = max(t0, upto)
        self.tokens[key] = len(c.token_ids)
        if done:
            self.completion_tokens += len(c.token_ids)
        return Delta(piece, t0, k0, done)

    def sent(self, key) -> int:
        return self.text.get(key, 0)

"""AsyncLLM: the engine loop in a background thread, one async output stream per request.

LLMEngine is not thread-safe, so every call into it happens on the engine thread: asyncio
callers post commands (add / abort) on a queue; the thread applies them between steps and hands
each RequestOutput back to the caller's event loop. A request whose consumer goes away (client
disconnect, cancelled task) is aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 on_step: Callable[[list[RequestOutput], dict], None] | None = None,
                 on_abort: Callable[[str], None] | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self.on_abort = on_abort  # called on the engine thread when a live request is aborted
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counter = 0
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = self.engine.get_stats()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    # -- API for asyncio callers ----------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs of one request until it finishes.

        Raises ValueError (bad prompt or parameters) before the first output."""
        self.start()
        loop = asyncio.get_running_loop()
        request_id = request_id or self.new_request_id()
        stream = _Stream(loop, asyncio.Queue())
        accepted = loop.create_future()
        self._cmds.put(("add", (request_id, prompt, params, kwargs, stream, accepted)))
        finished = False
        try:
            await accepted  # raises the validation error, if any
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # -- the engine thread ----------------------------------------------------------------------
    def _apply(self, cmd, arg) -> None:
        if cmd == "add":
            request_id, prompt, params, kwargs, stream, accepted = arg
            try:
                self.engine.add_request(request_id, prompt, params, **kwargs)
            except Exception as e:  # validation: report to the caller, keep serving others
                stream.loop.call_soon_threadsafe(_set_exception, accepted, e)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_set_result, accepted, None)
        elif cmd == "abort":
            if self._streams.pop(arg, None) is not None:
                self.engine.abort_request(arg)
                if self.on_abort is not None:
                    self.on_abort(arg)

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                cmd, arg = self._cmds.get(block=block, timeout=0.5 if block else None)
                self._apply(cmd, arg)
                while True:
                    cmd, arg = self._cmds.get_nowait()
                    self._apply(cmd, arg)
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.get_stats()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug in a step: fail the requests in flight, keep going
                traceback.print_exc()
                for rid, stream in list(self._streams.items()):
                    stream.put(RuntimeError(f"engine step failed: {e}"))
                    self.engine.abort_request(rid)
                self._streams.clear()
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                stream.put(out)
            self.stats = self.engine.get_stats()
            if self.on_step is not None:
                self.on_step(outputs, self.stats)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

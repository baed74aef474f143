"""Clients of the EngineCore: in this process, or in a child process over ZeroMQ + msgspec.

    InprocClient        core in this process, stepped by the caller (tests, debugging, multi-host)
    ThreadedCoreClient  core in a background thread of this process (AsyncLLM without MP)
    SyncMPClient        core in a child process; blocking calls (LLM / LLMEngine)
    AsyncMPClient       core in a child process; asyncio calls (AsyncLLM / the server)
    DPSyncClient, DPAsyncClient (dp_client.py)  N cores, one per data-parallel rank

engine.make_client() picks one for a front end. The child process itself is core_proc.py; a core
that fails or vanishes is reported to the front end as EngineDeadError, never a hang (a front
end that did not start the core goes by its heartbeats).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

import zmq

from jaxinfer.config import ResolvedConfig
from jaxinfer.engine.core_proc import core_spec, spawn_core_process
from jaxinfer.engine.messages import (EngineCoreOutputs, EngineCoreRequest, EngineDeadError,
                                      RequestType, encoder, outputs_decoder)

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting front end checks that the core process is alive


# -- in this process ------------------------------------------------------------------------------
class InprocClient:
    """The core in this process; get_output() runs one step."""

    def __init__(self, rc: ResolvedConfig, devices=None):
        from jaxinfer.engine.core import EngineCore

        self.core = EngineCore(rc, devices)
        self.info = self.core.ready_info()
        self.stats = self.core.get_stats()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outs = self.core.step() if self.core.has_work() else []
        self.stats = self.core.get_stats()
        return EngineCoreOutputs(outputs=outs, stats=self.stats)

    def has_work(self) -> bool:
        return self.core.has_work()

    def call_utility(self, name: str, *args) -> Any:
        return getattr(self.core, name)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedCoreClient:
    """The core's busy loop in a background thread of this process, with the asyncio API of
    AsyncMPClient (for AsyncLLM when multiprocessing is off)."""

    def __init__(self, rc: ResolvedConfig, devices=None):
        from jaxinfer.engine.core import EngineCore

        self.core = EngineCore(rc, devices)
        self.info = self.core.ready_info()
        self.stats = self.core.get_stats()
        self._inputs: queue.Queue = queue.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-core", daemon=True)
        self._thread.start()
        self._aq: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._pump: threading.Thread | None = None
        self._dead: BaseException | None = None

    def _run(self) -> None:
        try:
            self.core.run_busy_loop(self._inputs, self._outputs)
        except BaseException as e:  # noqa: BLE001 - reported as the core's death
            logger.exception("engine core thread failed")
            self._outputs.put(EngineCoreOutputs(engine_error=f"engine core thread failed: {e!r}"))
        self._outputs.put(None)

    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop: deliver there from now on
            self._loop, self._aq = loop, asyncio.Queue()
            if self._dead is not None:
                self._aq.put_nowait(self._dead)
        if self._pump is not None:
            return

        def pump():  # outputs queue -> the current event loop
            while True:
                item = self._outputs.get()
                try:
                    self._loop.call_soon_threadsafe(self._deliver, item)
                except RuntimeError:  # that loop is closed: nobody waits for these outputs
                    pass
                if item is None:
                    return

        self._pump = threading.Thread(target=pump, name="jaxinfer-core-pump", daemon=True)
        self._pump.start()

    def _deliver(self, item: EngineCoreOutputs | None) -> None:
        if item is None or item.engine_error:
            if self._dead is not None:  # (the stop after an error: the error says why)
                return
            self._dead = EngineDeadError(item.engine_error if item else "engine core stopped")
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(self._dead)
            self._aq.put_nowait(self._dead)
            return
        _route(item, self._futures, self._aq, self)

    async def add_request_async(self, req: EngineCoreRequest) -> None:
        self._check()
        self._ensure_pump()
        self._inputs.put(("add", req))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None:
            self._inputs.put(("abort", list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_pump()
        item = await self._aq.get()
        if isinstance(item, BaseException):
            self._aq.put_nowait(item)  # every later reader fails too
            raise item
        return item

    async def call_utility_async(self, name: str, *args) -> Any:
        self._check()
        self._ensure_pump()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._futures[call_id] = fut
        self._inputs.put(("utility", (call_id, name, args)))
        return await fut

    def _check(self) -> None:
        if self._dead is not None:
            raise self._dead

    def shutdown(self) -> None:
        self._inputs.put(None)
        self._thread.join(timeout=30)
        self.core.shutdown()


def _route(item: EngineCoreOutputs, futures: dict, out_queue, holder) -> None:
    """Utility results to their futures; stats to holder.stats; step outputs to out_queue."""
    if item.stats is not None:
        holder.stats = item.stats
    if item.utility_output is not None:
        call_id, result, err = item.utility_output
        fut = futures.pop(call_id, None)
        if fut is not None and not fut.done():
            if err is not None:
                fut.set_exception(RuntimeError(f"engine core utility failed: {err}"))
            else:
                fut.set_result(result)
        return
    out_queue.put_nowait(item)


class _CoreConnection:
    """This front end's end of one engine core: a PUSH socket (front end -> core) and a PULL
    socket (core -> front end) bound at the given addresses, and the core's ready handshake.
    Liveness: when this front end started the core (`proc`), the process is running; when it
    did not (API servers sharing cores, cores on other hosts), some message arrived in the
    last `timeout` seconds (idle cores send heartbeats every second)."""

    def __init__(self, input_addr: str, output_addr: str, proc=None, timeout: float = 30.0):
        self.ctx = zmq.Context()
        self.input_addr, self.output_addr = input_addr, output_addr
        self.in_sock = self.ctx.socket(zmq.PUSH)
        self.in_sock.setsockopt(zmq.LINGER, 0)
        self.in_sock.bind(input_addr)
        self.out_sock = self.ctx.socket(zmq.PULL)
        self.out_sock.setsockopt(zmq.LINGER, 0)
        self.out_sock.bind(output_addr)
        self.proc, self.timeout = proc, timeout
        self.decoder = outputs_decoder()
        self.last_seen = time.monotonic()
        self._finalizer = weakref.finalize(self, _stop_process, proc, self.in_sock,
                                           self.out_sock, self.ctx)

    def start(self) -> None:
        try:
            self.info, self.stats = self._handshake()
        except BaseException:
            self._finalizer()
            raise

    def seen(self) -> None:
        self.last_seen = time.monotonic()

    def is_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return time.monotonic() - self.last_seen < self.timeout

    def _handshake(self) -> tuple[dict, dict]:
        waited = 0
        while True:
            if self.out_sock.poll(_POLL_MS):
                msg = self.decoder.decode(self.out_sock.recv())
                if msg.engine_error:
                    first = msg.engine_error.split("\n", 1)[0]
                    if first.startswith("ValueError: "):
                        raise ValueError(first[len("ValueError: "):])
                    raise RuntimeError(f"engine core failed to start: {msg.engine_error}")
                if msg.ready is None:  # a heartbeat before our handshake was read
                    continue
                self.seen()
                return msg.ready, msg.stats
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine core process exited during start-up (exit code "
                                   f"{self.proc.returncode})")
            waited += 1
            if self.proc is None and waited % 300 == 0:
                logger.info("waiting for the engine core at %s (%d s)", self.output_addr,
                            waited // 10)

    def dead_error(self) -> EngineDeadError:
        if self.proc is not None:
            return EngineDeadError(f"the engine core process died (exit code "
                                   f"{self.proc.returncode})")
        return EngineDeadError(f"the engine core at {self.output_addr} sent nothing for "
                               f"{self.timeout:g} s (its heartbeat is every second)")

    def try_send(self, frames) -> bool:
        """Queue a message for the core; False if it cannot take one now (its connection is
        gone, or the queue is full). A PUSH socket whose peer died would block forever."""
        try:
            self.in_sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def send(self, kind: RequestType, payload: bytes) -> None:
        while not self.try_send((kind.value, payload)):
            if not self.is_alive():
                raise self.dead_error()
            time.sleep(0.002)

    def shutdown(self) -> None:
        self._finalizer()


class _CoreProcess(_CoreConnection):
    """A core process of this front end's own, over two fresh ipc sockets."""

    def __init__(self, rc: ResolvedConfig, env: dict[str, str] | None = None):
        base = os.path.join(tempfile.gettempdir(), f"jaxinfer-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        super().__init__(f"ipc://{base}-in", f"ipc://{base}-out")
        try:
            self.proc = spawn_core_process(
                core_spec(rc, [self.input_addr], [self.output_addr]), env)
        except BaseException:
            self._finalizer()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self.in_sock,
                                           self.out_sock, self.ctx)
        self.start()


def _stop_process(proc, in_sock, out_sock, ctx) -> None:
    import subprocess

    if proc is None:  # a core this front end shares with others: just hang up
        in_sock.close(linger=0)
        out_sock.close(linger=0)
        ctx.term()
        return
    if proc.poll() is None:
        try:
            in_sock.send_multipart((RequestType.SHUTDOWN.value, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        proc.stdin.close()
    except OSError:
        pass
    in_sock.close(linger=0)
    out_sock.close(linger=0)
    ctx.term()


class _Shared:
    """State the output-reader thread shares with its client (not the client itself, so that
    a client nobody holds is collected and its core process stopped)."""

    def __init__(self, stats: dict, outputs=None):
        self.stats = stats
        self.dead: BaseException | None = None
        self.outputs = outputs if outputs is not None else queue.Queue()
        self.futures: dict[int, Future] = {}
        self.stop = threading.Event()

    def fail(self, err: BaseException) -> None:
        self.dead = err
        for fut in list(self.futures.values()):
            if not fut.done():
                fut.set_exception(err)
        self.outputs.put(err)


def _read_one(shared: _Shared, conn: _CoreConnection) -> None:
    """One message of the core's routed where it goes, or up to _POLL_MS waited for one;
    shared.fail(...) when the core is dead or its connection is lost."""
    try:
        if conn.out_sock.poll(_POLL_MS):
            msg = conn.decoder.decode(conn.out_sock.recv())
            conn.seen()
            if msg.engine_error:
                shared.fail(EngineDeadError(msg.engine_error))
            else:
                _route(msg, shared.futures, shared.outputs, shared)
        elif not conn.is_alive():
            shared.fail(conn.dead_error())
    except zmq.ZMQError as e:  # the socket was closed under us (shutdown, interpreter exit)
        if not shared.stop.is_set():
            shared.fail(EngineDeadError(f"engine core connection lost: {e}"))


def _read_outputs(shared: _Shared, conn: _CoreConnection) -> None:
    """SyncMPClient's reader thread (a data-parallel front end's): decode the core's
    messages until it stops or dies."""
    while not shared.stop.is_set() and shared.dead is None:
        _read_one(shared, conn)


class SyncMPClient:
    """Blocking client of an engine-core process (LLM / LLMEngine).

    With its own outputs (the default) the caller's thread reads the core's socket itself,
    in get_output and while call_utility waits: a reader thread handing each step's outputs
    over through a queue woke a thread more per step, which at batch 1 on 2 cores took CPU
    time from the step. A data-parallel front end's shared queue keeps a reader thread per
    core."""

    def __init__(self, rc: ResolvedConfig, env: dict[str, str] | None = None, outputs=None):
        """env: extra environment of the core process; outputs: where step outputs go (a
        data-parallel front end merges several cores' outputs; default: this client's own
        queue, read by get_output)."""
        self.p = _CoreProcess(rc, env)
        self.info = self.p.info
        self._shared = _Shared(self.p.stats, outputs)
        self._enc = encoder()
        self._ids = itertools.count()
        self._reader = None
        if outputs is not None:
            self._reader = threading.Thread(
                target=_read_outputs, args=(self._shared, self.p),
                name="jaxinfer-client-out", daemon=True)
            self._reader.start()
        self._finalizer = weakref.finalize(self, _stop_sync_client, self._shared, self._reader,
                                           self.p)

    def _pump(self) -> None:
        """(no reader thread) _read_one in the caller's thread; raises when the core is
        dead."""
        if self._shared.stop.is_set():
            raise EngineDeadError("this engine client was shut down")
        if self._shared.dead is None:
            _read_one(self._shared, self.p)
        if self._shared.dead is not None:
            raise self._shared.dead

    @property
    def stats(self) -> dict:
        return self._shared.stats

    def _check(self) -> None:
        if self._shared.dead is not None:
            raise self._shared.dead

    def add_request(self, req: EngineCoreRequest) -> None:
        self._check()
        self.p.send(RequestType.ADD, self._enc.encode(req))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._shared.dead is None:
            try:
                self.p.send(RequestType.ABORT, self._enc.encode(list(request_ids)))
            except EngineDeadError:  # a dead core holds nothing to abort
                pass

    def get_output(self) -> EngineCoreOutputs:
        if self._reader is None:
            while True:
                try:
                    item = self._shared.outputs.get_nowait()
                    break
                except queue.Empty:
                    self._pump()
        else:
            item = self._shared.outputs.get()
        if isinstance(item, BaseException):
            self._shared.outputs.put(item)
            raise item
        return item

    def call_utility(self, name: str, *args) -> Any:
        self._check()
        call_id = next(self._ids)
        fut: Future = Future()
        self._shared.futures[call_id] = fut
        self.p.send(RequestType.UTILITY, self._enc.encode((call_id, name, list(args))))
        while self._reader is None and not fut.done():
            self._pump()  # (step outputs read meanwhile wait in the queue for get_output)
        return fut.result()

    def shutdown(self) -> None:
        self._finalizer()


def _stop_sync_client(shared: _Shared, reader: threading.Thread | None,
                      p: _CoreProcess) -> None:
    shared.stop.set()
    if reader is not None:
        reader.join(timeout=5)
    p.shutdown()


class AsyncMPClient:
    """asyncio client of an engine-core process (AsyncLLM / the OpenAI server). Construction
    blocks until the core is ready; the sockets join the event loop on first use."""

    def __init__(self, rc: ResolvedConfig, env: dict[str, str] | None = None,
                 conn: _CoreConnection | None = None, client_index: int = 0):
        """conn: a core this front end shares with others (already handshaken); default: a
        core process of its own."""
        self.p = conn if conn is not None else _CoreProcess(rc, env)
        self.client_index = client_index
        self.info, self.stats = self.p.info, self.p.stats
        self._enc = encoder()
        self._ids = itertools.count()
        self._aq: asyncio.Queue | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._dead: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in = self._out = None

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop:
            return
        # First use, or a new event loop (asyncio.run called again): re-attach to this one.
        import zmq.asyncio

        if self._task is not None and not self._loop.is_closed():
            self._task.cancel()
        self._loop = loop
        self._in = zmq.asyncio.Socket.shadow(self.p.in_sock.underlying)
        self._out = zmq.asyncio.Socket.shadow(self.p.out_sock.underlying)
        self._aq = asyncio.Queue()
        if self._dead is not None:
            self._aq.put_nowait(self._dead)
        self._task = loop.create_task(self._read())

    async def _read(self) -> None:
        dec = self.p.decoder
        try:
            while True:
                if await self._out.poll(_POLL_MS):
                    msg = dec.decode(await self._out.recv())
                    self.p.seen()
                    if msg.engine_error:
                        self._fail(EngineDeadError(msg.engine_error))
                        return
                    _route(msg, self._futures, self._aq, self)
                elif not self.p.is_alive():
                    self._fail(self.p.dead_error())
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken socket or message: nothing more can come
            self._fail(EngineDeadError(f"engine core output failed: {e!r}"))

    def _fail(self, err: BaseException) -> None:
        self._dead = err
        for fut in list(self._futures.values()):
            if not fut.done():
                fut.set_exception(err)
        self._aq.put_nowait(err)

    def is_alive(self) -> bool:
        """The core can still serve (its process runs, or its heartbeats come)."""
        return self._dead is None and self.p.is_alive()

    def _check(self) -> None:
        if self._dead is not None:
            raise self._dead

    async def _send(self, frames) -> None:
        """Hand a message to the core without blocking the event loop on a core that is
        gone (a dead peer's PUSH socket would wait forever): retry while it is alive."""
        while not self.p.try_send(frames):
            self._check()
            if not self.p.is_alive():
                raise self.p.dead_error()
            await asyncio.sleep(0.002)

    async def add_request_async(self, req: EngineCoreRequest) -> None:
        self._check()
        self._ensure_started()
        await self._send((RequestType.ADD.value, self._enc.encode(req)))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None:
            self._ensure_started()
            try:
                await self._send((RequestType.ABORT.value,
                                  self._enc.encode(list(request_ids))))
            except EngineDeadError:  # a dead core holds nothing to abort
                pass

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        item = await self._aq.get()
        if isinstance(item, BaseException):
            self._aq.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, name: str, *args) -> Any:
        self._check()
        self._ensure_started()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._futures[call_id] = fut
        await self._send((RequestType.UTILITY.value, self._enc.encode(
            (call_id, name, list(args), self.client_index))))
        return await fut

    def shutdown(self) -> None:
        if self._task is not None:
            try:
                self._task.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        self.p.shutdown()



"""Clients of the EngineCore: in this process, or in a child process over ZeroMQ + msgspec.

    InprocClient        core in this process, stepped by the caller (tests, debugging, multi-host)
    ThreadedCoreClient  core in a background thread of this process (AsyncLLM without MP)
    SyncMPClient        core in a child process; blocking calls (LLM / LLMEngine)
    AsyncMPClient       core in a child process; asyncio calls (AsyncLLM / the server)
    DPSyncClient, DPAsyncClient (dp_client.py)  N cores, one per data-parallel rank

The child process (run_engine_core): an input thread decodes requests from the front ends'
PUSH sockets into a queue, the main thread runs EngineCore.run_busy_loop over that queue, an
output thread encodes and sends EngineCoreOutputs (to the front end each request came from,
when several API servers share the core; launcher.py). It exits when its parent dies (a pipe
closes), and a core that fails or vanishes is reported to the front end as EngineDeadError,
never a hang (a front end that did not start the core goes by its heartbeats).
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
import traceback
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

import zmq

from jaxinfer.config import ResolvedConfig
from jaxinfer.engine.messages import (EngineCoreOutputs, EngineCoreRequest, EngineDeadError,
                                      RequestType, encoder, outputs_decoder, request_decoder)
from jaxinfer.outputs import EngineCoreOutput
from jaxinfer.request import FinishReason

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting front end checks that the core process is alive
# JAX options a child process must share with its parent (numerics of the tests, platform).
_JAX_OPTIONS = ("jax_default_matmul_precision", "jax_enable_x64")


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


# -- the engine-core process ----------------------------------------------------------------------
def core_process_main() -> None:
    """Entry point of the child process (`python -m jaxinfer.engine.core_client`). Its stdin
    is the lifeline: the start-up spec arrives there (pickled), and its end of file means the
    parent is gone, so the core exits too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    spec = read_lifeline_payload()
    os._exit(run_engine_core(spec))


def core_spec(rc: ResolvedConfig, inputs: list[str], outputs: list[str], *, rank: int = 0,
              coordinator: str | None = None, heartbeat: float | None = None,
              jax_options: dict | None = None) -> dict:
    """What an engine-core process needs: its config, one (input, output) address pair per
    front end it serves (client index = position), the coordinator's stats address, and
    whether to send heartbeats (front ends that did not start it watch those)."""
    if jax_options is None:
        import jax

        jax_options = {name: getattr(jax.config, name) for name in _JAX_OPTIONS}
    return {"rc": rc, "inputs": list(inputs), "outputs": list(outputs), "rank": rank,
            "coordinator": coordinator, "heartbeat": heartbeat, "jax_options": jax_options}


def run_engine_core(spec: dict) -> int:
    """Run one engine core until told to stop; returns the exit code. With several front ends
    (API servers), each request's outputs go back to the front end that sent it (its
    client_index) and utility results to their caller; stats go to all, and to the DP
    coordinator (waiting, running, KV usage, requests held per front end) every 100 ms."""
    rc = spec["rc"]
    ctx = zmq.Context()
    out_socks = []
    for addr in spec["outputs"]:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(addr)
        out_socks.append(sock)
    in_sock = ctx.socket(zmq.PULL)  # fair-queued over every front end
    for addr in spec["inputs"]:
        in_sock.connect(addr)
    coord = None
    if spec.get("coordinator"):
        coord = ctx.socket(zmq.PUSH)
        coord.setsockopt(zmq.LINGER, 0)
        coord.setsockopt(zmq.SNDHWM, 16)
        coord.connect(spec["coordinator"])
    rank, heartbeat, n_clients = spec.get("rank", 0), spec.get("heartbeat"), len(out_socks)
    enc = encoder()

    def close_all():
        for sock in out_socks + [in_sock] + ([coord] if coord is not None else []):
            sock.close()
        ctx.term()

    def send_all(msg: EngineCoreOutputs) -> None:
        data = enc.encode(msg)
        for sock in out_socks:
            sock.send(data)

    try:
        import jax

        for name, value in spec["jax_options"].items():
            jax.config.update(name, value)
        from jaxinfer.engine.core import EngineCore

        core = EngineCore(rc)
    except BaseException as e:
        kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
        send_all(EngineCoreOutputs(engine_error=f"{kind}: {e}\n{traceback.format_exc()}"))
        close_all()
        return 1
    ready = dict(core.ready_info(), data_parallel_rank=rank)
    send_all(EngineCoreOutputs(ready=ready, stats=core.get_stats()))
    inputs: queue.Queue = queue.Queue()
    outputs: queue.Queue = queue.Queue()
    owners: dict[str, int] = {}  # request id -> the front end it came from
    received = [0] * n_clients  # requests received from each front end, ever
    coord_lock = threading.Lock()  # (the reader and the writer both publish)
    last_pub = [0.0]
    calls: dict[int, tuple[int, int]] = {}  # utility call -> (front end, its call id)
    call_ids = itertools.count()

    def read_inputs():
        import msgspec

        dec_req = request_decoder()
        while True:
            kind, payload = in_sock.recv_multipart()
            try:
                if kind == RequestType.SHUTDOWN.value:
                    inputs.put(None)
                    return
                handle_input(kind, payload, dec_req, msgspec)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("engine core could not handle a message of kind %r", kind)

    def handle_input(kind, payload, dec_req, msgspec):
        if kind == RequestType.ADD.value:
            try:
                req = dec_req.decode(payload)
            except (msgspec.DecodeError, ValueError, TypeError) as e:
                # A request that does not decode (or whose values SamplingParams refuses):
                # it fails alone, if its id can be read at all.
                fields = msgspec.msgpack.decode(payload)
                rid = fields[0] if isinstance(fields, list) and fields else None
                if not isinstance(rid, str):
                    raise
                client = fields[10] if len(fields) > 10 and isinstance(fields[10], int) else 0
                owners[rid] = client
                inputs.put(("refuse", (rid, f"refused: the request does not decode: {e}")))
                return
            owners[req.request_id] = req.client_index
            if 0 <= req.client_index < n_clients:
                received[req.client_index] += 1
            inputs.put(("add", req))
            if coord is not None:  # the coordinator hears of arrivals at once
                publish(None)
        elif kind == RequestType.ABORT.value:
            ids = msgspec.msgpack.decode(payload)
            for rid in ids:  # its front end forgets it: later outputs go nowhere
                owners.pop(rid, None)
            inputs.put(("abort", ids))
        elif kind == RequestType.UTILITY.value:
            call_id, name, args, *client = msgspec.msgpack.decode(payload)
            gid = next(call_ids)
            calls[gid] = (client[0] if client else 0, call_id)
            inputs.put(("utility", (gid, name, tuple(args))))

    last_stats = [core.get_stats()]
    coord_enc = encoder()

    def publish(stats: dict | None, min_interval: float = 0.02) -> None:
        """This rank's load to the coordinator (at most every min_interval seconds)."""
        import time

        if stats is not None:
            last_stats[0] = stats
        with coord_lock:
            now = time.monotonic()
            if now - last_pub[0] < min_interval:
                return
            last_pub[0] = now
            held = [0] * n_clients
            for c in list(owners.values()):
                if 0 <= c < n_clients:
                    held[c] += 1
            st = last_stats[0]
            try:
                coord.send(coord_enc.encode((
                    rank, st.get("num_waiting_reqs", 0), st.get("num_running_reqs", 0),
                    st.get("kv_cache_usage", 0.0), held, list(received))), zmq.NOBLOCK)
            except zmq.Again:  # the coordinator is behind: the next update says the same
                pass

    def write_outputs():
        stats = last_stats[0]
        while True:
            try:
                item = outputs.get(timeout=heartbeat if heartbeat else 1.0)
            except queue.Empty:
                if heartbeat:  # idle: tell the front ends (and the coordinator) we are alive
                    send_all(EngineCoreOutputs(stats=stats))
                if coord is not None:
                    publish(stats, 0.0)
                continue
            if item is None:
                return
            if item.stats is not None:
                stats = item.stats
            if coord is not None:
                publish(stats)
            try:
                deliver(item)
            except Exception as e:  # noqa: BLE001 - (an output that does not encode) its
                # requests or utility call fail; the writer goes on, nobody is left waiting.
                logger.exception("engine core could not send an output")
                error = f"the engine core could not send this output: {type(e).__name__}: {e}"
                if item.utility_output is not None:
                    deliver(EngineCoreOutputs(utility_output=(
                        item.utility_output[0], None, error)))
                elif item.outputs:
                    deliver(EngineCoreOutputs(outputs=[EngineCoreOutput(
                        o.request_id, (), FinishReason.ERROR, stop_reason=error)
                        for o in item.outputs]))

    def deliver(item: EngineCoreOutputs) -> None:
        if n_clients == 1 and item.utility_output is None:
            out_socks[0].send(enc.encode(item))
            for out in item.outputs:
                if out.finish_reason is not None:
                    owners.pop(out.request_id, None)
        elif item.utility_output is not None:
            gid, result, err = item.utility_output
            client, call_id = calls.pop(gid, (0, gid))
            out_socks[client].send(enc.encode(EngineCoreOutputs(
                utility_output=(call_id, result, err), stats=item.stats)))
        elif item.engine_error or not item.outputs:
            send_all(item)
        else:
            groups: dict[int, list] = {}
            for out in item.outputs:
                client = owners.get(out.request_id)
                if client is not None:  # else aborted by its front end: nobody waits
                    groups.setdefault(client, []).append(out)
            for client, outs in groups.items():
                out_socks[client].send(enc.encode(EngineCoreOutputs(outputs=outs,
                                                                    stats=item.stats)))
            for out in item.outputs:  # (once sent: a failed send is answered with an error)
                if out.finish_reason is not None:
                    owners.pop(out.request_id, None)

    threading.Thread(target=read_inputs, name="jaxinfer-core-in", daemon=True).start()
    writer = threading.Thread(target=write_outputs, name="jaxinfer-core-out", daemon=True)
    writer.start()
    code = 0
    try:
        core.run_busy_loop(inputs, outputs)
    except BaseException:
        outputs.put(EngineCoreOutputs(engine_error=f"engine core failed:\n"
                                                   f"{traceback.format_exc()}"))
        code = 1
    outputs.put(None)
    writer.join(timeout=10)
    try:
        core.shutdown()
    finally:
        close_all()
    return code


def spawn_python(module: str, payload, env: dict[str, str] | None = None, pass_fds=()):
    """Start `python -m module` (a fresh interpreter: no fork of a JAX process, and no
    `if __name__ == "__main__"` guard needed in the user's script) with `payload` pickled on
    its stdin, which stays open as its lifeline: when this process goes, so does the child
    (read_lifeline_payload)."""
    import pickle
    import subprocess
    import sys

    import jaxinfer  # the child imports this very jaxinfer, wherever the parent found it

    env = {**os.environ, **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env,
                            pass_fds=pass_fds)
    data = pickle.dumps(payload)
    proc.stdin.write(len(data).to_bytes(8, "little") + data)
    proc.stdin.flush()
    return proc


def read_lifeline_payload():
    """The child's side of spawn_python: the payload, and a thread that exits the process
    when stdin closes (the parent is gone)."""
    import pickle
    import sys

    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(8), "little")
    payload = pickle.loads(stdin.read(size))

    def watch_parent():
        while stdin.read(4096):
            pass
        os._exit(1)

    threading.Thread(target=watch_parent, name="jaxinfer-watch", daemon=True).start()
    return payload


def spawn_core_process(spec: dict, env: dict[str, str] | None = None):
    """Start an engine-core process (env: a data-parallel rank's devices)."""
    return spawn_python("jaxinfer.engine.core_client", spec, env)


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


def _read_outputs(shared: _Shared, conn: _CoreConnection) -> None:
    """SyncMPClient's reader thread: decode the core's messages until it stops or dies."""
    sock, decoder = conn.out_sock, conn.decoder
    try:
        while not shared.stop.is_set():
            if sock.poll(_POLL_MS):
                msg = decoder.decode(sock.recv())
                conn.seen()
                if msg.engine_error:
                    shared.fail(EngineDeadError(msg.engine_error))
                    return
                _route(msg, shared.futures, shared.outputs, shared)
            elif not conn.is_alive():
                shared.fail(conn.dead_error())
                return
    except zmq.ZMQError as e:  # the socket was closed under us (shutdown, interpreter exit)
        if not shared.stop.is_set():
            shared.fail(EngineDeadError(f"engine core connection lost: {e}"))


class SyncMPClient:
    """Blocking client of an engine-core process (LLM / LLMEngine)."""

    def __init__(self, rc: ResolvedConfig, env: dict[str, str] | None = None, outputs=None):
        """env: extra environment of the core process; outputs: where step outputs go (a
        data-parallel front end merges several cores' outputs; default: this client's own
        queue, read by get_output)."""
        self.p = _CoreProcess(rc, env)
        self.info = self.p.info
        self._shared = _Shared(self.p.stats, outputs)
        self._enc = encoder()
        self._ids = itertools.count()
        self._reader = threading.Thread(
            target=_read_outputs, args=(self._shared, self.p),
            name="jaxinfer-client-out", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _stop_sync_client, self._shared, self._reader,
                                           self.p)

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
        return fut.result()

    def shutdown(self) -> None:
        self._finalizer()


def _stop_sync_client(shared: _Shared, reader: threading.Thread, p: _CoreProcess) -> None:
    shared.stop.set()
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


if __name__ == "__main__":
    core_process_main()

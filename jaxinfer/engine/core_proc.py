"""The engine-core process (vLLM's EngineCoreProc): an EngineCore whose busy loop runs on the
main thread, an input thread that decodes the front ends' messages into a queue, and an
output thread that encodes the outputs and sends each request's to the front end it came
from (several API servers may share one core: launcher.py). It exits when its parent dies
(its stdin lifeline closes) or when told to; a failure at start-up or in a step is sent to
every front end as engine_error before it goes."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import traceback

import zmq

from jaxinfer.config import ResolvedConfig
from jaxinfer.engine.messages import (EngineCoreOutputs, RequestType, encoder,
                                      request_decoder)
from jaxinfer.engine.process import read_lifeline_payload, spawn_python
from jaxinfer.outputs import EngineCoreOutput
from jaxinfer.request import FinishReason

logger = logging.getLogger(__name__)

# JAX options a child process must share with its parent (numerics of the tests, platform).
_JAX_OPTIONS = ("jax_default_matmul_precision", "jax_enable_x64")


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


def spawn_core_process(spec: dict, env: dict[str, str] | None = None):
    """Start an engine-core process (env: a data-parallel rank's devices)."""
    return spawn_python("jaxinfer.engine.core_proc", spec, env)


def run_engine_core(spec: dict) -> int:
    """Run one engine core until told to stop; returns the exit code."""
    return EngineCoreProc(spec).run()


def core_process_main() -> None:
    """Entry point of the child process (`python -m jaxinfer.engine.core_proc`). Its stdin is
    the lifeline: the start-up spec arrives there (pickled), and its end of file means the
    parent is gone, so the core exits too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    spec = read_lifeline_payload()
    os._exit(run_engine_core(spec))


class EngineCoreProc:
    """One engine core serving its front ends over ZeroMQ. With several front ends (API
    servers), each request's outputs go back to the front end that sent it (its client_index)
    and utility results to their caller; stats go to all, and to the DP coordinator (waiting,
    running, KV usage, requests held per front end) at most every 20 ms."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.ctx = zmq.Context()
        self.out_socks = []
        for addr in spec["outputs"]:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(addr)
            self.out_socks.append(sock)
        self.in_sock = self.ctx.socket(zmq.PULL)  # fair-queued over every front end
        for addr in spec["inputs"]:
            self.in_sock.connect(addr)
        self.coord = None
        if spec.get("coordinator"):
            self.coord = self.ctx.socket(zmq.PUSH)
            self.coord.setsockopt(zmq.LINGER, 0)
            self.coord.setsockopt(zmq.SNDHWM, 16)
            self.coord.connect(spec["coordinator"])
        self.rank, self.heartbeat = spec.get("rank", 0), spec.get("heartbeat")
        self.n_clients = len(self.out_socks)
        self.enc = encoder()
        self.coord_enc = encoder()
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()  # for the writer thread
        # Sends on the output sockets happen under send_lock (the busy loop's thread sends a
        # step's outputs itself: put_output); `pending` counts what sits in `outputs` unsent.
        self.send_lock = threading.Lock()
        self.pending = 0
        self.owners: dict[str, int] = {}  # request id -> the front end it came from
        self.received = [0] * self.n_clients  # requests received from each front end, ever
        self.coord_lock = threading.Lock()  # (the reader and the writer both publish)
        self.last_pub = 0.0
        self.last_stats: dict = {}
        self.calls: dict[int, tuple[int, int]] = {}  # utility call -> (front end, its id)
        self.call_ids = itertools.count()
        self.core = None

    # -- lifecycle ----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            import jax

            for name, value in self.spec["jax_options"].items():
                jax.config.update(name, value)
            from jaxinfer.engine.core import EngineCore

            self.core = core = EngineCore(self.spec["rc"])
        except BaseException as e:
            kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
            self.send_all(EngineCoreOutputs(engine_error=f"{kind}: {e}\n"
                                                         f"{traceback.format_exc()}"))
            self.close()
            return 1
        ready = dict(core.ready_info(), data_parallel_rank=self.rank)
        self.last_stats = core.get_stats()
        self.send_all(EngineCoreOutputs(ready=ready, stats=self.last_stats))
        threading.Thread(target=self.read_inputs, name="jaxinfer-core-in", daemon=True).start()
        writer = threading.Thread(target=self.write_outputs, name="jaxinfer-core-out",
                                  daemon=True)
        writer.start()
        code = 0
        try:
            core.run_busy_loop(self.inputs, _Outputs(self))
        except BaseException:
            self.put_output(EngineCoreOutputs(engine_error=f"engine core failed:\n"
                                                           f"{traceback.format_exc()}"))
            code = 1
        self.outputs.put(None)
        writer.join(timeout=10)
        try:
            core.shutdown()
        finally:
            self.close()
        return code

    def close(self) -> None:
        for sock in self.out_socks + [self.in_sock] + ([self.coord] if self.coord else []):
            sock.close()
        self.ctx.term()

    def send_all(self, msg: EngineCoreOutputs) -> None:
        data = self.enc.encode(msg)
        for sock in self.out_socks:
            sock.send(data)

    # -- the input thread ---------------------------------------------------------------------
    def read_inputs(self) -> None:
        import msgspec

        dec_req = request_decoder()
        while True:
            kind, payload = self.in_sock.recv_multipart()
            try:
                if kind == RequestType.SHUTDOWN.value:
                    self.inputs.put(None)
                    return
                self.handle_input(kind, payload, dec_req, msgspec)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("engine core could not handle a message of kind %r", kind)

    def handle_input(self, kind, payload, dec_req, msgspec) -> None:
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
                self.owners[rid] = client
                self.inputs.put(("refuse", (rid, f"refused: the request does not decode: {e}")))
                return
            self.owners[req.request_id] = req.client_index
            if 0 <= req.client_index < self.n_clients:
                self.received[req.client_index] += 1
            self.inputs.put(("add", req))
            if self.coord is not None:  # the coordinator hears of arrivals at once
                self.publish(None)
        elif kind == RequestType.ABORT.value:
            ids = msgspec.msgpack.decode(payload)
            for rid in ids:  # its front end forgets it: later outputs go nowhere
                self.owners.pop(rid, None)
            self.inputs.put(("abort", ids))
        elif kind == RequestType.UTILITY.value:
            call_id, name, args, *client = msgspec.msgpack.decode(payload)
            gid = next(self.call_ids)
            self.calls[gid] = (client[0] if client else 0, call_id)
            self.inputs.put(("utility", (gid, name, tuple(args))))

    def publish(self, stats: dict | None, min_interval: float = 0.02) -> None:
        """This rank's load to the coordinator (at most every min_interval seconds)."""
        if stats is not None:
            self.last_stats = stats
        with self.coord_lock:
            now = time.monotonic()
            if now - self.last_pub < min_interval:
                return
            self.last_pub = now
            held = [0] * self.n_clients
            for c in list(self.owners.values()):
                if 0 <= c < self.n_clients:
                    held[c] += 1
            st = self.last_stats
            try:
                self.coord.send(self.coord_enc.encode((
                    self.rank, st.get("num_waiting_reqs", 0), st.get("num_running_reqs", 0),
                    st.get("kv_cache_usage", 0.0), held, list(self.received))), zmq.NOBLOCK)
            except zmq.Again:  # the coordinator is behind: the next update says the same
                pass

    # -- the outputs ------------------------------------------------------------------------
    def put_output(self, item: EngineCoreOutputs) -> None:
        """An output of the busy loop. A step's tokens for the one front end go out from this
        thread at once, when nothing queued is still to go before them and the socket takes
        them without blocking; the rest (utility results, errors, several front ends, a
        coordinator, a full socket) through the writer thread, in order. Handing every step
        to the writer thread cost each step its wake-up and two passes of the GIL: at batch 1
        on 2 cores, CPU time taken from the step itself."""
        direct = (self.n_clients == 1 and self.coord is None and item.outputs
                  and item.utility_output is None and not item.engine_error)
        with self.send_lock:
            if direct and self.pending == 0:
                try:
                    self.deliver(item, zmq.NOBLOCK)
                except Exception:  # noqa: BLE001 - full, or does not encode: the writer
                    pass  # thread's path (it blocks, or answers with an error)
                else:
                    if item.stats is not None:
                        self.last_stats = item.stats
                    return
            self.pending += 1
            self.outputs.put(item)

    def write_outputs(self) -> None:
        heartbeat = self.heartbeat
        while True:
            try:
                item = self.outputs.get(timeout=heartbeat if heartbeat else 1.0)
            except queue.Empty:
                with self.send_lock:
                    stats = self.last_stats
                    if heartbeat:  # idle: tell the front ends (and the coordinator) we live
                        self.send_all(EngineCoreOutputs(stats=stats))
                if self.coord is not None:
                    self.publish(stats, 0.0)
                continue
            if item is None:
                return
            with self.send_lock:
                if item.stats is not None:
                    self.last_stats = item.stats
                stats = self.last_stats
                try:
                    self.deliver(item)
                except Exception as e:  # noqa: BLE001 - (an output that does not encode)
                    # its requests or utility call fail; the writer goes on, nobody waits.
                    logger.exception("engine core could not send an output")
                    error = (f"the engine core could not send this output: "
                             f"{type(e).__name__}: {e}")
                    if item.utility_output is not None:
                        self.deliver(EngineCoreOutputs(utility_output=(
                            item.utility_output[0], None, error)))
                    elif item.outputs:
                        self.deliver(EngineCoreOutputs(outputs=[EngineCoreOutput(
                            o.request_id, (), FinishReason.ERROR, stop_reason=error)
                            for o in item.outputs]))
                finally:
                    self.pending -= 1
            if self.coord is not None:
                self.publish(stats)

    def deliver(self, item: EngineCoreOutputs, flags: int = 0) -> None:
        """Send `item` where it goes (flags: zmq.NOBLOCK for put_output's one-front-end
        send, which raises zmq.Again, having sent nothing, when the socket is full)."""
        enc, out_socks, owners = self.enc, self.out_socks, self.owners
        if self.n_clients == 1 and item.utility_output is None:
            out_socks[0].send(enc.encode(item), flags=flags)
            for out in item.outputs:
                if out.finish_reason is not None:
                    owners.pop(out.request_id, None)
        elif item.utility_output is not None:
            gid, result, err = item.utility_output
            client, call_id = self.calls.pop(gid, (0, gid))
            out_socks[client].send(enc.encode(EngineCoreOutputs(
                utility_output=(call_id, result, err), stats=item.stats)))
        elif item.engine_error or not item.outputs:
            self.send_all(item)
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


class _Outputs:
    """The busy loop's outputs queue, as EngineCoreProc.put_output takes them."""

    def __init__(self, proc: EngineCoreProc):
        self.put = proc.put_output


if __name__ == "__main__":
    core_process_main()

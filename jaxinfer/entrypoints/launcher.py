"""`jaxinfer serve` as several processes: K API servers, N engine cores, ranks on other hosts.

One node, `jaxinfer serve --data-parallel-size 2 --api-server-count 2`:

    launcher (this process): binds the listening socket (SO_REUSEPORT), runs the DP
    coordinator (a thread), answers remote ranks' handshakes, watches every child
      |- engine core, rank 0 .. N-1     (each: one PULL fed by every API server, one PUSH
      |                                  back to each; stats to the coordinator)
      '- API server 0 .. K-1            (uvicorn on the shared socket; each balances over all
                                         N ranks with its own in-flight counts plus the
                                         coordinator's table of the others')

Several nodes (vLLM's flags): the head runs `--data-parallel-size N --data-parallel-size-local
L --data-parallel-address HEAD_IP --data-parallel-rpc-port P` (ranks 0..L-1 here); each other
node runs `--headless --data-parallel-size N --data-parallel-size-local L2
--data-parallel-start-rank S --data-parallel-address HEAD_IP --data-parallel-rpc-port P`,
which starts engine cores only: each asks the head (a ZeroMQ handshake on P) for the API
servers' and coordinator's addresses, then connects to them over TCP. A headless node stops
its cores when the head stops answering; the head's API servers fail a silent rank's requests
and keep serving on the others.

`--data-parallel-backend ray` starts every rank as a Ray actor instead (Ray places them on its
cluster's nodes; the actors connect back over TCP like headless ranks).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import msgspec
import zmq

from jaxinfer.engine.process import free_port

logger = logging.getLogger("jaxinfer.launcher")

DEFAULT_RPC_PORT = 13345
PING_S = 2.0  # a headless node pings the head this often
HEAD_SILENCE_S = 30.0  # ... and stops its cores after this long without an answer


def heartbeat_timeout() -> float:
    """How long a front end waits for a word from a core it did not start."""
    return float(os.environ.get("JAXINFER_ENGINE_HEARTBEAT_TIMEOUT", "30"))


def needs_launcher(args) -> bool:
    return (args.api_server_count > 1 or args.headless
            or args.data_parallel_backend == "ray"
            or (args.data_parallel_size_local is not None
                and args.data_parallel_size_local != args.data_parallel_size))


def check_args(args) -> None:
    n = args.data_parallel_size
    local = n if args.data_parallel_size_local is None else args.data_parallel_size_local
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.headless:
        if args.data_parallel_backend == "ray":
            raise ValueError("--headless starts engine cores of a head on another node; with "
                             "--data-parallel-backend ray the head starts every rank itself")
        if not 0 <= args.data_parallel_start_rank or args.data_parallel_start_rank + local > n:
            raise ValueError(f"--data-parallel-start-rank {args.data_parallel_start_rank} + "
                             f"--data-parallel-size-local {local} exceeds --data-parallel-size "
                             f"{n}")
        if local < 1:
            raise ValueError(f"--data-parallel-size-local must be >= 1 with --headless, got "
                             f"{local}")
    elif not 0 <= local <= n:
        raise ValueError(f"--data-parallel-size-local must be between 0 and "
                         f"--data-parallel-size {n}, got {local}")
    elif args.data_parallel_start_rank:
        raise ValueError("--data-parallel-start-rank is for --headless nodes (the head holds "
                         "ranks 0 .. --data-parallel-size-local - 1)")


def _listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Addresses:
    """Every socket of a multi-process serve: for API server k and rank r, the core's input
    (bound by the API server) and output (bound by the API server, one per rank so it knows
    who spoke); the coordinator's stats (PULL) and table (PUB) sockets. `bind_*` are what the
    owners bind, `*` what the others connect to (the same for ipc)."""

    def __init__(self, num_servers: int, num_ranks: int, tcp_host: str | None):
        self.tmpdir = tempfile.mkdtemp(prefix="jaxinfer-serve-")
        if tcp_host is None:
            def pair(name):
                addr = f"ipc://{self.tmpdir}/{name}"
                return addr, addr
        else:
            ip = socket.gethostbyname(tcp_host)

            def pair(name):
                port = free_port(ip)
                return f"tcp://{ip}:{port}", f"tcp://{ip}:{port}"
        self.core_in = [[pair(f"in-{k}-{r}") for r in range(num_ranks)]
                        for k in range(num_servers)]
        self.core_out = [[pair(f"out-{k}-{r}") for r in range(num_ranks)]
                         for k in range(num_servers)]
        self.stats = pair("coord-stats")
        self.publish = pair("coord-pub")

    def rank_spec(self, rank: int) -> dict:
        """What rank `rank` connects to (sent to it, or to its headless node)."""
        return {"inputs": [row[rank][1] for row in self.core_in],
                "outputs": [row[rank][1] for row in self.core_out],
                "coordinator": self.stats[1]}

    def server_spec(self, k: int) -> list[tuple[str, str]]:
        return [(self.core_in[k][r][0], self.core_out[k][r][0])
                for r in range(len(self.core_in[k]))]


def _stop_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _spawn_local_rank(rc, addrs: Addresses, rank: int, local_index: int) -> subprocess.Popen:
    from jaxinfer.engine.core_proc import core_spec, spawn_core_process
    from jaxinfer.engine.dp_client import rank_env

    env = rank_env(rc, local_index)
    env["JAXINFER_DP_RANK"] = str(rank)
    r = addrs.rank_spec(rank)
    return spawn_core_process(core_spec(rc, r["inputs"], r["outputs"], rank=rank,
                                        coordinator=r["coordinator"], heartbeat=1.0), env)


class _Handshake:
    """The head's side of remote ranks: HELLO rank -> the addresses to connect to; PING ->
    PONG (the headless node's way to know the head lives)."""

    def __init__(self, host: str, port: int, addrs: Addresses, remote_ranks: set[int]):
        self.addrs, self.expected = addrs, set(remote_ranks)
        self.registered: dict[int, str] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{socket.gethostbyname(host)}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-dp-handshake",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            ident, data = self._sock.recv_multipart()
            try:
                msg = msgspec.msgpack.decode(data)
                reply = self._answer(msg, ident)
            except Exception as e:  # a bad message gets an error, the head keeps going
                reply = {"error": f"bad handshake message: {e}"}
            self._sock.send_multipart([ident, msgspec.msgpack.encode(reply)])

    def _answer(self, msg: dict, ident: bytes) -> dict:
        if "ping" in msg:
            return {"pong": True}
        rank = msg.get("hello")
        if rank not in self.expected:
            return {"error": f"data-parallel rank {rank} is not expected from another node "
                             f"(remote ranks: {sorted(self.expected)})"}
        if rank in self.registered and self.registered[rank] != ident.hex():
            return {"error": f"data-parallel rank {rank} has registered already"}
        self.registered[rank] = ident.hex()
        logger.info("data-parallel rank %d registered from %s", rank, msg.get("host", "?"))
        return {"spec": self.addrs.rank_spec(rank)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


def run_launcher(args) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s launcher %(levelname)s %(message)s")
    check_args(args)
    if args.headless:
        return run_headless(args)
    from jaxinfer.config import resolve_config
    from jaxinfer.engine.coordinator import DPCoordinator
    from jaxinfer.engine.process import spawn_python
    from jaxinfer.entrypoints.serve import engine_config_from_args

    n, k_count = args.data_parallel_size, args.api_server_count
    ray = args.data_parallel_backend == "ray"
    local = 0 if ray else (n if args.data_parallel_size_local is None
                           else args.data_parallel_size_local)
    remote = n - local
    rc = resolve_config(engine_config_from_args(args))
    tcp_host = (args.data_parallel_address or "127.0.0.1") if remote else None
    addrs = Addresses(k_count, n, tcp_host)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir = os.path.join(addrs.tmpdir, "prom")
    os.makedirs(prom_dir)
    listen = _listen_socket(args.host, args.port, reuse_port=k_count > 1)
    coordinator = DPCoordinator(n, addrs.stats[0], addrs.publish[0]).start()
    handshake = None
    if remote and not ray:
        handshake = _Handshake(args.data_parallel_address or "127.0.0.1",
                               args.data_parallel_rpc_port, addrs, set(range(local, n)))
        logger.info("waiting for data-parallel ranks %d..%d from other nodes on port %d",
                    local, n - 1, args.data_parallel_rpc_port)
    engines = {rank: _spawn_local_rank(rc, addrs, rank, rank) for rank in range(local)}
    ray_ranks = None
    if ray:
        from jaxinfer.entrypoints.ray_launcher import RayRanks

        ray_ranks = RayRanks(rc, addrs, n)
    servers = []
    for k in range(k_count):
        payload = {"args": {a: v for a, v in vars(args).items() if not callable(v)},
                   "client_index": k, "num_ranks": n,
                   "connections": addrs.server_spec(k), "coordinator": addrs.publish[1],
                   "listen_fd": listen.fileno(), "heartbeat_timeout": heartbeat_timeout(),
                   "metrics_role": "primary" if k == 0 else "secondary"}
        servers.append(spawn_python("jaxinfer.entrypoints.launcher", payload,
                                    pass_fds=(listen.fileno(),)))
    listen.close()  # the API servers hold it now
    logger.info("%d API server(s) on %s:%d over %d data-parallel rank(s) (%d here)",
                k_count, args.host, args.port, n, local)
    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code, reported = 0, set()
    try:
        while not stopping.is_set():
            for k, p in enumerate(servers):
                if p.poll() is not None:
                    logger.error("API server %d exited (code %s): stopping", k, p.returncode)
                    code = p.returncode or 1
                    stopping.set()
            for rank, p in engines.items():
                if p.poll() is not None and rank not in reported:
                    reported.add(rank)
                    if coordinator.table[rank] is None:  # never came up: nothing can serve
                        logger.error("engine core rank %d failed to start (exit code %s): "
                                     "stopping", rank, p.returncode)
                        code = 1
                        stopping.set()
                    else:
                        logger.error("engine core rank %d died (exit code %s); the API "
                                     "servers fail its requests and keep serving on the "
                                     "other ranks", rank, p.returncode)
            if engines and len(reported) == len(engines) and not remote:
                logger.error("every engine core has died: stopping")
                code = code or 1
                stopping.set()
            if ray_ranks is not None and ray_ranks.failed_at_start(coordinator.table):
                code = 1
                stopping.set()
            stopping.wait(0.5)
    finally:
        _stop_all(servers)
        _stop_all(list(engines.values()))
        if ray_ranks is not None:
            ray_ranks.shutdown()
        if handshake is not None:
            handshake.stop()
        coordinator.stop()
        import shutil

        shutil.rmtree(addrs.tmpdir, ignore_errors=True)
    return code


def run_headless(args) -> int:
    """Engine cores only, for a head on another node."""
    from jaxinfer.config import resolve_config
    from jaxinfer.engine.core_proc import core_spec, spawn_core_process
    from jaxinfer.engine.dp_client import rank_env
    from jaxinfer.entrypoints.serve import engine_config_from_args

    n = args.data_parallel_size
    local = n if args.data_parallel_size_local is None else args.data_parallel_size_local
    start = args.data_parallel_start_rank
    head = f"tcp://{args.data_parallel_address or '127.0.0.1'}:{args.data_parallel_rpc_port}"
    rc = resolve_config(engine_config_from_args(args))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(head)

    def ask(msg: dict, timeout_s: float) -> dict | None:
        sock.send(msgspec.msgpack.encode(msg))
        if sock.poll(int(timeout_s * 1000)):
            return msgspec.msgpack.decode(sock.recv())
        return None

    engines = {}
    try:
        for i, rank in enumerate(range(start, start + local)):
            reply = None
            while reply is None:
                reply = ask({"hello": rank, "host": socket.gethostname()}, 5.0)
                if reply is None:
                    logger.info("waiting for the head at %s", head)
            if "error" in reply:
                logger.error("the head refused rank %d: %s", rank, reply["error"])
                return 1
            spec = reply["spec"]
            env = rank_env(rc, i)
            env["JAXINFER_DP_RANK"] = str(rank)
            engines[rank] = spawn_core_process(core_spec(
                rc, spec["inputs"], spec["outputs"], rank=rank,
                coordinator=spec["coordinator"], heartbeat=1.0), env)
        logger.info("headless: data-parallel ranks %d..%d started for the head at %s",
                    start, start + local - 1, head)
        stopping = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stopping.set())
        signal.signal(signal.SIGINT, lambda *a: stopping.set())
        last_pong = time.monotonic()
        while not stopping.is_set():
            if ask({"ping": start}, PING_S) is not None:
                last_pong = time.monotonic()
                stopping.wait(PING_S)
            elif time.monotonic() - last_pong > HEAD_SILENCE_S:
                logger.error("the head at %s has not answered for %.0f s: stopping", head,
                             HEAD_SILENCE_S)
                return 1
            if all(p.poll() is not None for p in engines.values()):
                logger.error("every engine core of this node has exited")
                return 1
        return 0
    finally:
        _stop_all(list(engines.values()))
        sock.close()
        ctx.term()


def api_server_main() -> None:
    """One API server of several (a child of run_launcher)."""
    from jaxinfer.engine.process import read_lifeline_payload

    payload = read_lifeline_payload()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s api{payload['client_index']} %(levelname)s "
                               f"%(message)s")
    import uvicorn

    from jaxinfer.engine.async_engine import AsyncLLM
    from jaxinfer.engine.core_client import _CoreConnection
    from jaxinfer.engine.dp_client import DPAsyncClient
    from jaxinfer.entrypoints.serve import engine_config_from_args, make_server, serve

    import argparse

    args, k = argparse.Namespace(**payload["args"]), payload["client_index"]
    conns = [_CoreConnection(i, o, timeout=payload["heartbeat_timeout"])
             for i, o in payload["connections"]]
    llm = AsyncLLM(engine_config_from_args(args), make_client=lambda rc: DPAsyncClient(
        rc, payload["num_ranks"], connections=conns, client_index=k,
        coordinator=payload["coordinator"]))
    server = make_server(llm, args, metrics_role=payload["metrics_role"])
    sock = socket.socket(fileno=payload["listen_fd"])
    config = uvicorn.Config(server.app, log_level="info")
    os._exit(serve(server, config, sockets=[sock]))


if __name__ == "__main__":
    api_server_main()

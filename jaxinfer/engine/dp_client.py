"""Data parallelism: N engine-core processes behind one load-balancing client.

Each rank is an ordinary engine-core process (core_client._CoreProcess running core_proc.py) with its own devices
(on GPU, CUDA_VISIBLE_DEVICES set to the rank's tensor_parallel_size devices before JAX
starts; on CPU each process has the host device) and its own KV cache and scheduler. Dense
models need no lockstep between ranks: no dummy batches, no all-reduce (MoE expert
parallelism would; jaxinfer serves no MoE model yet).

Routing (DPLoadBalancer, pure Python): the rank with the fewest requests in flight, counted by
this front end on every send and every finish (exact for one front end, so a burst between
two stats messages cannot pile onto one rank, the stale-stats imbalance of vLLM's internal
LB), plus, when several API servers share the ranks, the requests the other front ends hold
there as published by the DP coordinator (coordinator.py), once its table has seen every
request this front end sent (in a burst it lags, and a stale row would tilt the routing);
ties go to the rank with the lower KV usage in its last stats, then round robin. Prefix
affinity: a prompt whose first full blocks were sent to a rank recently goes to that rank
(where its prefix is cached) unless that rank has max_num_seqs more requests in flight than
the least loaded one.

A rank that dies is taken out of the rotation: its requests in flight finish at once with
finish_reason "abort" and a stop_reason naming the rank (they are not retried: their tokens
so far were already streamed); the other ranks keep serving. Aborts go to the rank that holds
the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import queue
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError
from jaxinfer.outputs import EngineCoreOutput
from jaxinfer.request import FinishReason

logger = logging.getLogger(__name__)

_AFFINITY_BLOCKS = 4  # prompt blocks that key prefix affinity
_AFFINITY_ENTRIES = 4096


class DPLoadBalancer:
    def __init__(self, num_ranks: int, block_size: int, max_num_seqs: int,
                 prefix_affinity: bool = True):
        self.n = num_ranks
        self.block_size = block_size
        self.slack = max_num_seqs
        self.prefix_affinity = prefix_affinity
        self.in_flight = [0] * num_ranks
        self.num_routed = [0] * num_ranks  # requests sent to each rank, ever
        self.alive = [True] * num_ranks
        self.kv_usage = [0.0] * num_ranks
        # Requests other front ends hold on each rank (from the DP coordinator; zero when this
        # front end is the only one).
        self.others = [0] * num_ranks
        self.owner: dict[str, int] = {}  # request id -> rank
        self._prefix: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        self.num_affinity_hits = 0

    def _prefix_key(self, prompt_ids) -> bytes | None:
        n = min(len(prompt_ids) // self.block_size, _AFFINITY_BLOCKS) * self.block_size
        if n == 0:
            return None
        return hashlib.sha256(repr(list(prompt_ids[:n])).encode()).digest()

    def choose(self, request_id: str, prompt_ids) -> int:
        ranks = [r for r in range(self.n) if self.alive[r]]
        if not ranks:
            raise EngineDeadError("every data-parallel engine core has died")
        load = [self.in_flight[r] + self.others[r] for r in range(self.n)]
        least = min(load[r] for r in ranks)
        key = self._prefix_key(prompt_ids) if self.prefix_affinity else None
        rank = self._prefix.get(key) if key is not None else None
        if rank is not None and self.alive[rank] and load[rank] < least + self.slack:
            self.num_affinity_hits += 1
        else:
            order = ranks[self._next % len(ranks):] + ranks[:self._next % len(ranks)]
            rank = min(order, key=lambda r: (load[r], self.kv_usage[r]))
            self._next += 1
        if key is not None:
            self._prefix[key] = rank
            self._prefix.move_to_end(key)
            if len(self._prefix) > _AFFINITY_ENTRIES:
                self._prefix.popitem(last=False)
        self.in_flight[rank] += 1
        self.num_routed[rank] += 1
        self.owner[request_id] = rank
        return rank

    def finished(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.in_flight[rank] -= 1

    def rank_died(self, rank: int) -> list[str]:
        """Take a rank out; returns its requests in flight (now forgotten)."""
        self.alive[rank] = False
        lost = [rid for rid, r in self.owner.items() if r == rank]
        for rid in lost:
            del self.owner[rid]
        self.in_flight[rank] = 0
        for key in [k for k, r in self._prefix.items() if r == rank]:
            del self._prefix[key]
        return lost


def rank_env(rc, rank: int) -> dict[str, str]:
    """Environment of rank `rank`'s core process: on a GPU machine, its own devices (the
    rank's slice of CUDA_VISIBLE_DEVICES, or of 0, 1, ... when unset; harmless on CPU). The
    front end itself never initialises a device backend (it would take GPU memory)."""
    tp = rc.parallel.devices_per_rank  # (tp x pp)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((rank + 1) * tp)]
    if (rank + 1) * tp > len(ids):
        raise ValueError(f"data_parallel_size x tensor_parallel_size needs {(rank + 1) * tp} "
                         f"GPUs, CUDA_VISIBLE_DEVICES has {len(ids)}")
    return {"JAXINFER_DP_RANK": str(rank), "CUDA_VISIBLE_DEVICES": ",".join(
        ids[rank * tp:(rank + 1) * tp])}


def _lost_outputs(request_ids, rank: int, err) -> EngineCoreOutputs:
    reason = f"data-parallel engine core {rank} died: {str(err).splitlines()[0]}"
    return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, (), FinishReason.ABORT,
                                                       stop_reason=reason)
                                      for rid in request_ids])


def _merge_stats(stats: list[dict]) -> dict:
    """One stats dict over the ranks: counts summed, usage averaged, per rank kept."""
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[k] = out.get(k, 0) + v
    if stats:
        for k in ("kv_cache_usage", "prefix_cache_hit_rate"):
            if k in out:
                out[k] /= len(stats)
        q, h = out.get("prefix_cache_queries", 0), out.get("prefix_cache_hits", 0)
        out["prefix_cache_hit_rate"] = h / q if q else 0.0
        out["time"] = max(s.get("time", 0) for s in stats)
    out["per_rank"] = stats
    return out


def _combine(name: str, results: list):
    if name == "leak_report":
        return [f"rank {i}: {p}" for i, r in enumerate(results) for p in (r or [])]
    if name == "get_stats":
        return _merge_stats(results)
    if name in ("reset_prefix_cache", "remove_lora"):
        return all(results)
    if name == "add_lora":
        return any(results)
    if name == "list_loras":
        return results[0]
    if name in ("pause_generation", "get_pause_state"):  # (paused once every rank is)
        return "draining" if "draining" in results else results[0]
    if name in ("is_paused", "is_sleeping", "wake_up"):
        return all(results)
    if name in ("update_weights", "update_weights_from_path", "update_weights_from_transfer",
                "reload_weights", "sleep"):
        return dict(results[0], per_rank=results)
    if name in ("get_weight_version", "resume_generation", "set_weight_version"):
        return results[0]
    if name == "collective_rpc":  # (one result per worker, rank by rank)
        return [r for rank in results for r in rank]
    if name == "ready_info":
        return results[0]
    return results


class _Tagged:
    """A rank's view of the shared output queue: items go in as (rank, item)."""

    def __init__(self, q, rank: int):
        self.q, self.rank = q, rank

    def put(self, item) -> None:
        self.q.put((self.rank, item))

    put_nowait = put


class _DPBase:
    def _setup(self, rc, num_ranks: int, make):
        with ThreadPoolExecutor(num_ranks) as pool:  # the ranks start (and compile) at once
            futures = [pool.submit(make, rank) for rank in range(num_ranks)]
            self.clients = [f.result() for f in futures]
        info = dict(self.clients[0].info)
        info["num_usable_kv_blocks"] = min(c.info["num_usable_kv_blocks"] for c in self.clients)
        info["data_parallel_size"] = num_ranks
        self.info = info
        self.lb = DPLoadBalancer(num_ranks, info["block_size"], rc.scheduler.max_num_seqs,
                                 rc.parallel.data_parallel_prefix_affinity)

    @property
    def stats(self) -> dict:
        stats, ranks = [], []
        for r, c in enumerate(self.clients):
            if self.lb.alive[r]:  # (a dead rank's last stats would count forever)
                self.lb.kv_usage[r] = c.stats.get("kv_cache_usage", 0.0)
                stats.append(c.stats)
                ranks.append(r)
        return dict(_merge_stats(stats), ranks=ranks)  # (ranks[i]: per_rank[i]'s rank)

    def _after_output(self, rank: int, item) -> EngineCoreOutputs | None:
        """Bookkeeping for an item from rank `rank`: a dead rank's requests finish."""
        if isinstance(item, BaseException):
            if not self.lb.alive[rank]:
                return None
            lost = self.lb.rank_died(rank)
            logger.error("data-parallel engine core %d died (%s); %d requests in flight there "
                         "fail, the other ranks keep serving", rank, item, len(lost))
            if not any(self.lb.alive):
                raise item
            return _lost_outputs(lost, rank, item)
        for out in item.outputs:
            if out.finish_reason is not None:
                self.lb.finished(out.request_id)
        item.engine_index = rank
        return item

    def _route(self, request: EngineCoreRequest) -> int:
        return self.lb.choose(request.request_id, request.prompt_token_ids)

    def _by_rank(self, request_ids) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.lb.owner.get(rid)
            if rank is not None and self.lb.alive[rank]:
                groups.setdefault(rank, []).append(rid)
        return groups


class DPSyncClient(_DPBase):
    """N SyncMPClients (LLM / LLMEngine with data_parallel_size=N)."""

    def __init__(self, rc, num_ranks: int):
        from jaxinfer.engine.core_client import SyncMPClient

        self._outputs: queue.Queue = queue.Queue()
        self._setup(rc, num_ranks, lambda rank: SyncMPClient(
            rc, env=rank_env(rc, rank), outputs=_Tagged(self._outputs, rank)))

    def add_request(self, req: EngineCoreRequest) -> None:
        rank = self._route(req)
        try:
            self.clients[rank].add_request(req)
        except EngineDeadError as e:
            self._outputs.put((rank, e))

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self._by_rank(request_ids).items():
            self.clients[rank].abort_requests(ids)
            for rid in ids:
                self.lb.finished(rid)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            rank, item = self._outputs.get()
            out = self._after_output(rank, item)
            if out is not None:
                return out

    def call_utility(self, name: str, *args) -> Any:
        results = [c.call_utility(name, *args) for r, c in enumerate(self.clients)
                   if self.lb.alive[r]]
        return _combine(name, results)

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()


class DPAsyncClient(_DPBase):
    """N AsyncMPClients (AsyncLLM / the server with data_parallel_size=N). By default it
    starts the N core processes itself; an API server of several (`--api-server-count`, or a
    head whose ranks run on other hosts) gets `connections` to cores the launcher started,
    its `client_index`, and the coordinator's address, whose table it folds into routing."""

    def __init__(self, rc, num_ranks: int, connections=None, client_index: int = 0,
                 coordinator: str | None = None):
        from jaxinfer.engine.core_client import AsyncMPClient

        self.client_index, self.coordinator_addr = client_index, coordinator
        self.num_coordinator_updates = 0
        if connections is None:
            self._setup(rc, num_ranks, lambda rank: AsyncMPClient(rc, env=rank_env(rc, rank)))
        else:
            def make(rank):
                connections[rank].start()  # waits for the core's ready handshake
                return AsyncMPClient(rc, conn=connections[rank], client_index=client_index)

            self._setup(rc, num_ranks, make)
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop = None

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        for t in self._tasks:
            t.cancel()
        self._loop, self._queue = loop, asyncio.Queue()
        self._tasks = [loop.create_task(self._pump(rank)) for rank in range(len(self.clients))]
        if self.coordinator_addr:
            self._tasks.append(loop.create_task(self._subscribe()))

    async def _subscribe(self) -> None:
        """The coordinator's table -> the load balancer's view of the other front ends."""
        import msgspec
        import zmq
        import zmq.asyncio

        from jaxinfer.engine.coordinator import others_load

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.coordinator_addr)
        try:
            while True:
                table = msgspec.msgpack.decode(await sock.recv())
                self.num_coordinator_updates += 1
                # Only a table that has seen every request this front end sent says where
                # the others stand; in a burst it lags, and a row that lags more than another
                # would tilt routing (the stale-stats snowball): own counts alone then.
                fresh = all(row is not None and len(row) > 5
                            and row[5][self.client_index] == self.lb.num_routed[r]
                            for r, row in enumerate(table))
                self.lb.others = (others_load(table, self.client_index) if fresh
                                  else [0] * len(table))
        finally:
            sock.close(0)

    async def _pump(self, rank: int) -> None:
        client = self.clients[rank]
        while True:
            try:
                item = await client.get_output_async()
            except EngineDeadError as e:
                self._queue.put_nowait((rank, e))
                return
            self._queue.put_nowait((rank, item))

    async def add_request_async(self, req: EngineCoreRequest) -> None:
        self._ensure_started()
        req.client_index = self.client_index
        rank = self._route(req)

        try:
            await self.clients[rank].add_request_async(req)
        except EngineDeadError as e:
            self._queue.put_nowait((rank, e))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rank, ids in self._by_rank(request_ids).items():
            await self.clients[rank].abort_requests_async(ids)
            for rid in ids:
                self.lb.finished(rid)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        while True:
            rank, item = await self._queue.get()
            out = self._after_output(rank, item)
            if out is not None:
                return out

    def is_alive(self) -> bool:
        """Some rank can still serve."""
        return any(self.lb.alive[r] and c.is_alive() for r, c in enumerate(self.clients))

    def ranks_alive(self) -> list[bool]:
        return [self.lb.alive[r] and c.is_alive() for r, c in enumerate(self.clients)]

    async def call_utility_async(self, name: str, *args) -> Any:
        results = [await c.call_utility_async(name, *args)
                   for r, c in enumerate(self.clients) if self.lb.alive[r]]
        return _combine(name, results)

    def shutdown(self) -> None:
        for t in self._tasks:
            try:
                t.cancel()
            except RuntimeError:
                pass
        for c in self.clients:
            c.shutdown()

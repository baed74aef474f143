"""The data-parallel coordinator: engine stats in, one table out to every front end.

When several front ends (API servers, `--api-server-count K`) share the data-parallel engine
cores, none of them sees the others' requests. Each engine core pushes its load here at most
every 100 ms (and every second when idle): waiting and running requests, KV usage, and how
many requests it holds for each front end. The coordinator publishes the table (one row per
rank) on a PUB socket at most every 20 ms when it changed and every second regardless (so a front end
that subscribes late is current within a second). A front end then scores rank r as its own
requests in flight there (exact, counted on every send and finish) plus the other front ends'
requests held there, from a table that has seen every request this front end sent (each row
also counts the requests received from each front end; a table that lags behind a burst would
tilt the routing towards whichever rank reported last, so it is not used until it catches up).

It runs as a thread of the launcher process (`jaxinfer serve` with K > 1 API servers or with
ranks on other hosts); a single front end needs no coordinator: it hears every rank itself.
Dense models need no DP waves or lockstep, so there are none (vLLM's START_DP_WAVE exists for
MoE collectives; jaxinfer serves no MoE model yet).
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

logger = logging.getLogger(__name__)

PUBLISH_MIN_S = 0.02
PUBLISH_IDLE_S = 1.0


class RankLoad(msgspec.Struct, array_like=True):
    waiting: int
    running: int
    kv_cache_usage: float
    held: list[int]  # requests this rank holds for each front end (client index)
    received: list[int] = []  # requests it has received from each front end, ever


def decode_update(data: bytes) -> tuple[int, RankLoad]:
    rank, waiting, running, kv, held, *received = msgspec.msgpack.decode(data)
    return rank, RankLoad(waiting, running, kv, held, received[0] if received else [])


class DPCoordinator:
    def __init__(self, num_ranks: int, stats_addr: str, publish_addr: str):
        self.num_ranks = num_ranks
        self.stats_addr, self.publish_addr = stats_addr, publish_addr
        self.table: list[RankLoad | None] = [None] * num_ranks
        self.num_updates = self.num_published = 0
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(stats_addr)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(publish_addr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "DPCoordinator":
        self._thread = threading.Thread(target=self.run, name="jaxinfer-dp-coordinator",
                                        daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        changed, last = False, 0.0
        while not self._stop.is_set():
            if self._pull.poll(int(PUBLISH_MIN_S * 1000)):
                try:
                    rank, load = decode_update(self._pull.recv())
                except (msgspec.DecodeError, ValueError, TypeError) as e:
                    logger.warning("coordinator: bad stats message dropped (%s)", e)
                    continue
                if 0 <= rank < self.num_ranks:
                    changed = changed or self.table[rank] != load
                    self.table[rank] = load
                    self.num_updates += 1
            now = time.monotonic()
            if (changed and now - last >= PUBLISH_MIN_S) or now - last >= PUBLISH_IDLE_S:
                self._pub.send(enc.encode(self.table))
                self.num_published += 1
                changed, last = False, now

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pull.close()
        self._pub.close()
        self._ctx.term()


def others_load(table: list, client_index: int) -> list[int]:
    """Per rank: the requests it holds for front ends other than `client_index`."""
    out = []
    for row in table:
        if row is None:
            out.append(0)
            continue
        held = row[3] if isinstance(row, (list, tuple)) else row.held  # (a decoded table)
        out.append(sum(h for c, h in enumerate(held) if c != client_index))
    return out

"""JaxTransferConnector: disaggregated prefill/decode between engine processes.

Transport: JAX's own transfer API (jax.experimental.transfer: a server per engine; the decode
side pulls arrays the prefill side offered), plus a ZeroMQ side channel on which the decode
side says "done" so that the prefill side frees the blocks (the TPU connector's design in
tpu-inference; it also runs between CPU processes).

Prefill instance (kv_producer): a request sent with kv_transfer_params {"do_remote_decode":
true} (by the proxy, with max_tokens=1) finishes as usual; its full prompt blocks (all but the
block holding the last prompt token when the prompt is block-aligned) are gathered into one
array, offered under a random uuid, and kept allocated until the decode side says done, or
abort_timeout seconds pass (then freed with a warning: nobody pulled them). The response's
kv_transfer_params tell the decode side where to pull from.

Decode instance (kv_consumer): a request carrying those params waits in WAITING_FOR_REMOTE_KVS
with its blocks allocated while the array is pulled; blocks it already has in its own prefix
cache are not overwritten. The pulled blocks are scattered into the cache, the request
computes its last prompt token itself and samples the first output token (so P/D output is
the colocated output). A pull that fails or takes longer than pull_timeout seconds is given
up (its connection poisoned): the request recomputes its prompt (kv_load_failure_policy
"recompute") or finishes with the error ("fail").
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import jax

from jaxinfer.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput,
                                        KVConnectorScheduler, KVConnectorWorker, LoadSpec,
                                        SaveSpec)

logger = logging.getLogger(__name__)


def _timeout(config, key: str, default: float) -> float:
    return float(config.kv_connector_extra_config.get(key, default))


class JaxTransferScheduler(KVConnectorScheduler):
    def __init__(self, config, block_size: int, engine_id: str, worker: "JaxTransferWorker"):
        super().__init__(config, block_size)
        self.engine_id = engine_id
        self.transfer_address = worker.transfer_address
        self.notify_address = worker.notify_address
        self.abort_timeout = _timeout(config, "abort_timeout", 120.0)
        self._matched: dict[str, tuple[int, int, dict]] = {}
        self._pending_loads: dict[str, dict] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._cancels: list[str] = []
        self._notices: list[dict] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        p = request.kv_transfer_params
        if not self.config.is_kv_consumer or not p or not p.get("do_remote_prefill"):
            return 0, False
        num_remote = int(p.get("remote_num_blocks") or 0)
        notice = {"notify": p.get("remote_notify"), "uuid": p.get("remote_uuid")}
        if request.skip_prefix_cache:
            # Penalties / prompt logprobs need every prompt token to pass through a step here.
            if num_remote:
                self._notices.append(notice)
            return 0, False
        if num_remote and p.get("block_size") != self.block_size:
            logger.warning("request %s: the prefill instance's block_size %s differs from "
                           "this engine's %d; computing the prompt here", request.request_id,
                           p.get("block_size"), self.block_size)
            self._notices.append(notice)
            return 0, False
        first = num_computed_tokens // self.block_size
        n = min(num_remote, first + self.max_loadable_blocks(request, num_computed_tokens)) - first
        if n <= 0:  # all in the local prefix cache (or nothing sent): only say done
            if num_remote:
                self._notices.append(notice)
            return 0, False
        self._matched[request.request_id] = (first, n, p)
        return n * self.block_size, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        first, n, p = matched
        num_remote = int(p["remote_num_blocks"])
        # Remote block j lands in local block j; blocks the local prefix cache already had,
        # and remote blocks past what this request uses, go to the null block.
        ids = [0] * first + list(block_ids[first:first + n]) + [0] * (num_remote - first - n)
        source = {"uuid": int(p["remote_uuid"]), "host": p["remote_host"],
                  "notify": p.get("remote_notify"), "num_blocks": num_remote}
        self._loads.append(LoadSpec(request.request_id, tuple(ids), source))
        self._pending_loads[request.request_id] = source

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._matched.pop(rid, None)
        if rid in self._pending_loads:  # aborted while pulling: the pull must never land
            del self._pending_loads[rid]
            self._cancels.append(rid)
            return False, None
        p = request.kv_transfer_params
        if (p and p.get("do_remote_prefill") and not request.kv_load_tried
                and p.get("remote_uuid") is not None):
            # Finished (aborted) before it was ever admitted: the producer can let go now.
            self._notices.append({"notify": p.get("remote_notify"), "uuid": p["remote_uuid"]})
            return False, None
        if not self.config.is_kv_producer or not p or not p.get("do_remote_decode"):
            return False, None
        from jaxinfer.request import RequestStatus

        if request.status in (RequestStatus.FINISHED_ABORTED,
                              RequestStatus.FINISHED_ERROR):
            return False, None
        n = min((request.num_prompt_tokens - 1) // self.block_size, len(block_ids))
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": self.engine_id, "remote_host": self.transfer_address,
                  "remote_notify": self.notify_address, "remote_num_blocks": n,
                  "remote_block_ids": list(block_ids[:n]), "block_size": self.block_size}
        if n == 0:
            return False, params
        uuid = int.from_bytes(os.urandom(7), "little")
        params["remote_uuid"] = uuid
        self._saves.append(SaveSpec(rid, tuple(block_ids[:n]),
                                    {"uuid": uuid, "deadline": time.time() + self.abort_timeout}))
        return True, params

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_recving | set(out.failed_recving):
            self._pending_loads.pop(rid, None)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(tuple(self._loads), tuple(self._saves), tuple(self._cancels),
                                   tuple(self._notices))
        self._loads, self._saves, self._cancels, self._notices = [], [], [], []
        return meta

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._saves or self._cancels or self._notices)


class JaxTransferWorker(KVConnectorWorker):
    def __init__(self, config, device):
        import zmq
        from jax.experimental import transfer

        super().__init__(config)
        ip = config.kv_ip
        self.server = transfer.start_transfer_server(device.client, f"{ip}:0", [f"{ip}:0"])
        self.transfer_address = self.server.address()
        self._ctx = zmq.Context()
        self._notify_in = self._ctx.socket(zmq.PULL)
        self._notify_in.setsockopt(zmq.LINGER, 0)
        if config.kv_port:  # (data-parallel rank r: kv_port + r, as vLLM's side channel)
            port = config.kv_port + int(os.environ.get("JAXINFER_DP_RANK", "0"))
            self._notify_in.bind(f"tcp://{ip}:{port}")
        else:
            port = self._notify_in.bind_to_random_port(f"tcp://{ip}")
        self.notify_address = f"tcp://{ip}:{port}"
        self._notify_out: dict[str, object] = {}
        self.pull_timeout = _timeout(config, "pull_timeout", 30.0)
        self._sends: dict[int, tuple[str, float, object]] = {}  # uuid -> (req, deadline, data)
        self._loads: dict[str, tuple] = {}
        self.num_expired_sends = 0
        self.num_failed_pulls = 0
        # Test hook: drop the decode side's "done" notices (the producer must then time out).
        self._drop_notices = os.environ.get("JAXINFER_TEST_DROP_KV_NOTICES") == "1"

    def _notify(self, address: str | None, uuid) -> None:
        if not address or uuid is None or self._drop_notices:
            return
        import zmq

        sock = self._notify_out.get(address)
        if sock is None:
            sock = self._notify_out[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(address)
        try:
            sock.send(int(uuid).to_bytes(8, "little"), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("could not tell %s that KV %s was pulled: %s", address, uuid, e)

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        for rid in meta.cancels:
            load = self._loads.pop(rid, None)
            if load is not None:
                self._give_up(load)
        for notice in meta.notices:
            self._notify(notice["notify"], notice["uuid"])
        for save in meta.saves:
            data = self.io.gather(save.block_ids)
            single = data.addressable_shards[0].data
            uuid, deadline = save.dest["uuid"], save.dest["deadline"]
            # The server drops the offer at the deadline too (a late pull then times out).
            self.server.await_pull(uuid, [single],
                                   timeout=datetime.datetime.fromtimestamp(deadline))
            self._sends[uuid] = (save.req_id, deadline, single)
        for load in meta.loads:
            src = load.source
            spec = jax.ShapeDtypeStruct(self.io.shape(src["num_blocks"]), self.io.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(
                                            self.io.device()))
            try:
                conn = self.server.connect(src["host"])
                arr = conn.pull(src["uuid"], [spec])[0]
            except Exception as e:  # noqa: BLE001
                conn, arr = None, e
            self._loads[load.req_id] = (arr, conn, time.time() + self.pull_timeout,
                                        load.block_ids, src)

    def _give_up(self, load) -> None:
        arr, conn, _, _, src = load
        if conn is not None and hasattr(conn, "_poison_connection"):
            conn._poison_connection()  # fails the pending pull (nothing lands)
        self._notify(src.get("notify"), src.get("uuid"))

    def get_finished(self) -> KVConnectorOutput:
        import zmq

        out = KVConnectorOutput()
        while True:
            try:
                msg = self._notify_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            entry = self._sends.pop(int.from_bytes(msg, "little"), None)
            if entry is not None:
                out.finished_sending.add(entry[0])
        now = time.time()
        for uuid, (rid, deadline, _) in list(self._sends.items()):
            if now > deadline:
                del self._sends[uuid]
                self.num_expired_sends += 1
                logger.warning("request %s: nobody pulled its KV blocks within abort_timeout; "
                               "freeing them", rid)
                out.finished_sending.add(rid)
        for rid, load in list(self._loads.items()):
            arr, conn, deadline, block_ids, src = load
            if isinstance(arr, Exception):
                err = f"{type(arr).__name__}: {arr}"
            elif arr.is_ready():
                try:
                    arr.block_until_ready()
                    self.io.scatter(block_ids, arr)
                    err = None
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
            elif now > deadline:
                err = f"the pull did not finish within pull_timeout={self.pull_timeout:g} s"
            else:
                continue
            del self._loads[rid]
            if err is None:
                self._notify(src.get("notify"), src.get("uuid"))
                out.finished_recving.add(rid)
            else:
                self.num_failed_pulls += 1
                logger.warning("request %s: KV pull from %s failed: %s", rid, src.get("host"),
                               err)
                self._give_up(load)
                out.failed_recving[rid] = f"KV transfer from the prefill instance failed: {err}"
        return out

    def has_pending_work(self) -> bool:
        return bool(self._sends or self._loads)

    def shutdown(self) -> None:
        for load in self._loads.values():
            self._give_up(load)
        self._loads.clear()
        for s in self._notify_out.values():
            s.close(0)
        self._notify_in.close(0)
        self._ctx.term()

"""SharedStorageConnector: KV blocks stored in a folder, keyed by chained prefix hashes.

A producer (kv_producer / kv_both) stores the full prompt blocks of every request that
finishes; a consumer (kv_consumer / kv_both) that meets a prompt whose leading blocks are
stored loads them instead of computing them. The folder outlives the engine, so it is also an
offline KV cache that survives restarts, and two engines sharing it act as prefill and decode
instances (vLLM's ExampleConnector, formerly SharedStorageConnector).

Layout: <shared_storage_path>/<fingerprint>/<key[:2]>/<key>.safetensors, one file per block;
key = chained sha256 over the block's tokens and its parent's key (the cache_salt keys the
first block), fingerprint = the model's config, block size and KV dtype. A file holds one
tensor "kv", the block's raw bytes ([L, 2, block_size, Hkv, D] of the cache dtype, as uint8),
with its dtype, shape and sha256 in the metadata: a load checks all three (a corrupted or
truncated file fails the load, which the scheduler then recomputes). Files are written to a
temporary name and renamed, so readers never see half a file. Never pickle.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxinfer.core.kv_cache_utils import block_extra_keys, hash_block_tokens
from jaxinfer.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput,
                                        KVConnectorScheduler, KVConnectorWorker, LoadSpec,
                                        SaveSpec)

logger = logging.getLogger(__name__)

_ROOT = hashlib.sha256(b"jaxinfer-shared-storage-root").digest()


def block_keys(token_ids, num_blocks: int, block_size: int, cache_salt: str | None,
               lora_request=None) -> list[str]:
    """The storage keys of the first blocks (salted, and keyed on the LoRA adapter as the
    prefix cache is: an adapter's KV is never another request's)."""
    keys, parent = [], _ROOT
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   block_extra_keys(i, cache_salt, lora_request), "sha256")
        keys.append(parent.hex())
    return keys


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, config, block_size: int, root: str):
        super().__init__(config, block_size)
        self.root = root
        os.makedirs(root, exist_ok=True)
        self._matched: dict[str, tuple[int, list[str]]] = {}
        self._pending_loads: set[str] = set()
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._cancels: list[str] = []
        self._waiting_since: dict[str, float] = {}
        self.wait_timeout = float(config.kv_connector_extra_config.get("pull_timeout", 30.0))

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".safetensors")

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not self.config.is_kv_consumer or request.skip_prefix_cache:
            return 0, False
        first = num_computed_tokens // self.block_size
        most = self.max_loadable_blocks(request, num_computed_tokens)
        if most == 0:
            return 0, False
        keys = block_keys(request.all_token_ids, first + most, self.block_size,
                          request.cache_salt, request.lora_request)[first:]
        n = 0
        while n < most and os.path.exists(self.path(keys[n])):
            n += 1
        # As a P/D decode instance: the prefill instance announced how many blocks it stores
        # (kv_transfer_params); wait for the files still being written, up to pull_timeout.
        p = request.kv_transfer_params or {}
        if p.get("do_remote_prefill"):
            promised = min(int(p.get("remote_num_blocks") or 0), first + most) - first
            if n < promised:
                since = self._waiting_since.setdefault(request.request_id, time.time())
                if time.time() - since < self.wait_timeout:
                    return None, False
                logger.warning("request %s: %d of %d announced KV blocks are in shared storage "
                               "after %g s; computing the rest", request.request_id, n,
                               promised, self.wait_timeout)
            self._waiting_since.pop(request.request_id, None)
        if n == 0:
            return 0, False
        self._matched[request.request_id] = (first, keys[:n])
        return n * self.block_size, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        first, keys = matched
        self._loads.append(LoadSpec(request.request_id, tuple(block_ids[first:first + len(keys)]),
                                    {"paths": [self.path(k) for k in keys]}))
        self._pending_loads.add(request.request_id)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._matched.pop(rid, None)
        self._waiting_since.pop(rid, None)
        if rid in self._pending_loads:  # aborted while its blocks were loading
            self._pending_loads.discard(rid)
            self._cancels.append(rid)
            return False, None
        if not self.config.is_kv_producer:
            return False, None
        from jaxinfer.request import RequestStatus

        n = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
        params = None
        p = request.kv_transfer_params or {}
        if p.get("do_remote_decode") and request.status not in (
                RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            # For a decode instance: how many blocks it will find (it waits for them).
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_num_blocks": min(n, (request.num_prompt_tokens - 1)
                                               // self.block_size),
                      "block_size": self.block_size}
        keys = block_keys(request.all_token_ids, n, self.block_size, request.cache_salt,
                          request.lora_request)
        todo = [(b, self.path(k)) for b, k in zip(block_ids[:n], keys)
                if not os.path.exists(self.path(k))]
        if not todo:
            return False, params
        self._saves.append(SaveSpec(rid, tuple(b for b, _ in todo),
                                    {"paths": [p for _, p in todo]}))
        return True, params  # freed once the worker has copied them out (next step)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_recving | set(out.failed_recving):
            self._pending_loads.discard(rid)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(tuple(self._loads), tuple(self._saves), tuple(self._cancels))
        self._loads, self._saves, self._cancels = [], [], []
        return meta

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._saves or self._cancels)


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config):
        super().__init__(config)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="jaxinfer-kv-storage")
        self._loads: dict[str, tuple] = {}  # req_id -> (future, block_ids)
        self._sent: set[str] = set()
        self._writes: list = []
        self.num_load_errors = 0

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        for rid in meta.cancels:
            self._loads.pop(rid, None)  # its data, if read, is dropped unwritten
        for save in meta.saves:
            data = self.io.gather(save.block_ids)  # enqueued before any later step
            self._writes.append(self._pool.submit(self._write, data, save.dest["paths"]))
            self._sent.add(save.req_id)
        for load in meta.loads:
            fut = self._pool.submit(self._read, load.source["paths"])
            self._loads[load.req_id] = (fut, load.block_ids)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_sending=self._sent)
        self._sent = set()
        for rid, (fut, block_ids) in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[rid]
            try:
                data = fut.result()
                self.io.scatter(block_ids, data)
                out.finished_recving.add(rid)
            except Exception as e:  # noqa: BLE001 - any failure is a failed load
                self.num_load_errors += 1
                logger.warning("KV load of request %s failed: %s", rid, e)
                out.failed_recving[rid] = f"KV load from shared storage failed: {e}"
        self._writes = [f for f in self._writes if not f.done()]
        return out

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._sent)

    def wait_for_save(self) -> None:
        """Block until every store issued so far is on disk."""
        for f in self._writes:
            f.result()
        self._writes = []

    def _write(self, data, paths: list[str]) -> None:
        from safetensors.numpy import save_file

        arr = np.asarray(data)  # waits for the gather
        try:
            for i, path in enumerate(paths):
                block = np.ascontiguousarray(arr[:, :, i])
                raw = block.view(np.uint8).reshape(-1)
                meta = {"dtype": str(block.dtype), "shape": ",".join(map(str, block.shape)),
                        "sha256": hashlib.sha256(raw.tobytes()).hexdigest()}
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
                save_file({"kv": raw}, tmp, metadata=meta)
                os.replace(tmp, path)
        except Exception:
            logger.exception("storing KV blocks failed")
            raise

    def _read(self, paths: list[str]) -> np.ndarray:
        from safetensors import safe_open

        io = self.io
        shape = io.shape(len(paths))
        dtype = np.dtype(io.dtype)
        out = np.zeros(shape, dtype)
        want = (shape[0], 2, *shape[3:])
        for i, path in enumerate(paths):
            with safe_open(path, "np") as f:
                meta = f.metadata() or {}
                raw = f.get_tensor("kv")
            if meta.get("dtype") != str(dtype) or meta.get("shape") != ",".join(map(str, want)):
                raise ValueError(f"{path}: holds {meta.get('dtype')} [{meta.get('shape')}], "
                                 f"this engine's blocks are {dtype} {list(want)}")
            if hashlib.sha256(raw.tobytes()).hexdigest() != meta.get("sha256"):
                raise ValueError(f"{path}: checksum mismatch (the file is corrupted)")
            out[:, :, i] = raw.view(dtype).reshape(want)
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

"""KV connectors: KV blocks to and from other engines or storage (see base.py)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid

from jaxinfer.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput,  # noqa: F401
                                        KVConnectorScheduler, KVConnectorWorker)


def model_fingerprint(model_name: str, model_config, block_size: int, kv_dtype) -> str:
    """Blocks are interchangeable only between engines with the same model (its folder's
    name and config), block size and KV dtype."""
    import dataclasses

    desc = json.dumps({"name": model_name, "model": dataclasses.asdict(model_config),
                       "block_size": block_size,
                       "kv_dtype": str(kv_dtype)}, sort_keys=True, default=str)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def create_connector(config, *, block_size: int, fingerprint: str, device
                     ) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The scheduler side and the worker side of the configured connector (one engine core
    holds both; the worker side starts any server first, the scheduler side names it in the
    kv_transfer_params it hands out)."""
    engine_id = config.engine_id or uuid.uuid4().hex[:12]
    if config.kv_connector == "SharedStorageConnector":
        from jaxinfer.kv_connector.shared_storage import (SharedStorageScheduler,
                                                          SharedStorageWorker)

        root = os.path.join(config.kv_connector_extra_config["shared_storage_path"], fingerprint)
        return SharedStorageScheduler(config, block_size, root), SharedStorageWorker(config)
    if config.kv_connector == "JaxTransferConnector":
        from jaxinfer.kv_connector.jax_transfer import JaxTransferScheduler, JaxTransferWorker

        worker = JaxTransferWorker(config, device)
        return JaxTransferScheduler(config, block_size, engine_id, worker), worker
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")

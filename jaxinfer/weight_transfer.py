"""Weights between processes (or hosts) over JAX's transfer API, the transport the
JaxTransferConnector moves KV blocks with (jax.experimental.transfer): the trainer's process
offers its arrays, the engine's worker pulls them straight onto its device, no file and no
host round trip through msgpack.

Trainer side:

    from jaxinfer.weight_transfer import WeightSender

    sender = WeightSender()                       # a transfer server on this process's device
    payload = sender.offer(params)                # {name: array}; HF names or layout="engine"
    llm.update_weights_from_transfer(payload)     # or POST /update_weights_from_transfer

The payload is small and JSON-able (the server's address, one pull id per engine rank, the
names, shapes and dtypes): it crosses any process boundary. Each offer is pulled once per
id (`num_pulls`: one per data-parallel rank) or dropped at its deadline. The engine then
updates as `update_weights` does (checked, all or nothing)."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping

import jax
import numpy as np

from jaxinfer.runner.weights import LAYOUTS

MAX_TENSORS = 1 << 16


class WeightSender:
    """Offers arrays to engines over jax.experimental.transfer (see the module docstring)."""

    def __init__(self, device=None, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        self.device = device or jax.devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, f"{host}:0",
                                                     [f"{host}:0"])
        self._next = int.from_bytes(os.urandom(6), "little")

    def offer(self, weights: Mapping, *, layout: str = "hf", num_pulls: int = 1,
              timeout_s: float = 300.0) -> dict:
        """Offer `weights` ({name: array}) for `num_pulls` pulls within timeout_s seconds;
        returns the payload an engine pulls them with."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not supported (supported: "
                             f"{', '.join(LAYOUTS)})")
        names = list(weights)
        arrays = [jax.device_put(weights[n], self.device) for n in names]
        deadline = datetime.datetime.fromtimestamp(time.time() + timeout_s)
        uuids = []
        for _ in range(num_pulls):
            self._next += 1
            self.server.await_pull(self._next, arrays, timeout=deadline)
            uuids.append(self._next)
        return {"address": self.server.address(), "uuids": uuids, "layout": layout,
                "names": names, "shapes": [list(a.shape) for a in arrays],
                "dtypes": [np.dtype(a.dtype).name for a in arrays]}


def _payload_error(msg: str) -> ValueError:
    return ValueError(f"update_weights_from_transfer: {msg}")


def check_payload(payload) -> dict:
    """The payload's fields checked (types, lengths, dtypes): ValueError naming the field."""
    if not isinstance(payload, Mapping):
        raise _payload_error("the payload must be an object (WeightSender.offer's answer)")
    extra = sorted(set(payload) - {"address", "uuids", "layout", "names", "shapes", "dtypes",
                                   "timeout_s"})
    if extra:
        raise _payload_error(f"unknown field(s) {extra}")
    address, uuids = payload.get("address"), payload.get("uuids")
    names, shapes, dtypes = payload.get("names"), payload.get("shapes"), payload.get("dtypes")
    if not isinstance(address, str) or not address or len(address) > 256:
        raise _payload_error("address must be the sender's host:port")
    if not isinstance(uuids, list) or not uuids or not all(
            isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 2**63 for u in uuids):
        raise _payload_error("uuids must be a non-empty list of non-negative integers")
    if not isinstance(names, list) or not names or len(names) > MAX_TENSORS or not all(
            isinstance(n, str) and 0 < len(n) <= 1024 for n in names):
        raise _payload_error(f"names must be a list of 1 to {MAX_TENSORS} tensor names")
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(s, list) and len(s) <= 8 and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in s)
            for s in shapes):
        raise _payload_error("shapes must give one list of dimensions per name")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise _payload_error("dtypes must give one dtype per name")
    for d in dtypes:
        try:
            ok = isinstance(d, str) and jax.numpy.dtype(d).kind in "fiuV"
        except TypeError:
            ok = False
        if not ok:
            raise _payload_error(f"dtype {str(d)[:40]!r} is not an array dtype")
    layout = payload.get("layout", "hf")
    if layout not in LAYOUTS:
        raise _payload_error(f"layout must be one of {', '.join(LAYOUTS)}")
    timeout = payload.get("timeout_s", 300.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout <= 3600:
        raise _payload_error("timeout_s must be a number of seconds in (0, 3600]")
    return dict(payload, layout=layout, timeout_s=float(timeout))


class WeightReceiver:
    """The engine side: pulls an offer onto `device` (the worker keeps one)."""

    def __init__(self, device, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        self.device = device
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])

    def pull(self, payload: dict, rank: int = 0) -> dict:
        """{name: array on the device} of a checked payload; ValueError when the pull fails
        or does not finish within its timeout_s."""
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(tuple(s), jax.numpy.dtype(d), sharding=sharding)
                 for s, d in zip(payload["shapes"], payload["dtypes"])]
        uuid = payload["uuids"][rank % len(payload["uuids"])]
        try:
            conn = self.server.connect(payload["address"])
            arrays = conn.pull(uuid, specs)
        except Exception as e:  # noqa: BLE001 - the sender's problem, reported by name
            raise _payload_error(f"pulling from {payload['address']} failed: "
                                 f"{type(e).__name__}: {e}") from None
        deadline = time.time() + payload["timeout_s"]
        while not all(a.is_ready() for a in arrays):
            if time.time() > deadline:
                if hasattr(conn, "_poison_connection"):
                    conn._poison_connection()  # (fails the pending pull: nothing lands)
                raise _payload_error(f"the pull did not finish within "
                                     f"timeout_s={payload['timeout_s']:g}")
            time.sleep(0.001)
        try:
            jax.block_until_ready(arrays)
        except Exception as e:  # noqa: BLE001
            raise _payload_error(f"the pull failed: {type(e).__name__}: {e}") from None
        return dict(zip(payload["names"], arrays))

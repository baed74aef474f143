"""The KV connector interface (vLLM V1's split between a scheduler side and a worker side).

A connector moves KV blocks between this engine and somewhere else (another engine, a folder)
so that prompts are not recomputed. Its two halves:

Scheduler side (host, pure Python, runs inside Scheduler):
  get_num_new_matched_tokens(request, num_computed_tokens) -> (n | None, load_async)
      how many prompt tokens past the local prefix hits the connector can bring in (full
      blocks only; None: ask again next step). jaxinfer's connectors always load
      asynchronously: the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated.
  update_state_after_alloc(request, block_ids, num_external_tokens)
      the blocks those tokens landed in (all of the request's blocks, in order).
  build_connector_meta() -> KVConnectorMetadata
      what the worker must do this step (loads, saves/sends, cancels); it travels in the
      SchedulerOutput with the step's inputs, and resets the connector's pending state.
  request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
      a request ended: keep its blocks (until the worker reports them sent) and/or hand
      parameters to the client (the P/D proxy passes them on to the decode instance).
  update_connector_output(out)  the worker's report reached the scheduler.
  has_pending_work() -> bool: metadata not yet handed to the worker.

Worker side (owns nothing but transfers; it reads and writes the device caches only through
the runner's compiled gather/scatter, and never keeps a reference to the caches, which each
step donates):
  register_block_io(io)  the runner's KVBlockIO
  bind_connector_metadata(meta)  start this step's loads, saves and cancels
  get_finished() -> KVConnectorOutput  poll: scatter finished loads into the cache and report
      finished_recving, failed_recving (with the reason) and finished_sending
  shutdown()
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Blocks of one request to fill from elsewhere."""

    req_id: str
    block_ids: tuple[int, ...]  # local blocks to fill, in prompt order
    # Connector-specific: file keys (shared storage) or the remote pull's parameters.
    source: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """Blocks of one finished request to store or offer for pulling."""

    req_id: str
    block_ids: tuple[int, ...]
    dest: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KVConnectorMetadata:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    cancels: tuple[str, ...] = ()  # requests whose pending load must never land (aborted)
    notices: tuple[dict, ...] = ()  # "done" notices with no load (a full local prefix hit)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.cancels or self.notices)


@dataclasses.dataclass
class KVConnectorOutput:
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: dict[str, str] = dataclasses.field(default_factory=dict)  # id -> reason
    finished_sending: set[str] = dataclasses.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving or self.finished_sending)


class KVConnectorScheduler:
    """Base of the scheduler side; the defaults load nothing and save nothing."""

    def __init__(self, config, block_size: int):
        self.config = config
        self.block_size = block_size

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        """The worker side's report (loads done or failed, blocks sent) reached the
        scheduler."""

    def has_pending_work(self) -> bool:
        return False

    def max_loadable_blocks(self, request, num_computed_tokens: int) -> int:
        """Full prompt blocks past the computed ones that a load may cover: the last prompt
        token is always computed here (its logits give the first output token), so a
        block-aligned prompt loads one block less."""
        return max((request.num_tokens - 1) // self.block_size
                   - num_computed_tokens // self.block_size, 0)


class KVConnectorWorker:
    """Base of the worker side."""

    def __init__(self, config):
        self.config = config
        self.io = None

    def register_block_io(self, io) -> None:
        self.io = io

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def has_pending_work(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass

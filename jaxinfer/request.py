"""Request state on the host (mutable, owned by the scheduler)."""

from __future__ import annotations

import enum
import time
from typing import Sequence

from jaxinfer.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The engine failed this request (an error while admitting it or building its inputs):
    # it ends alone, the engine serves the others (vLLM's FinishReason.ERROR).
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1  # in the waiting queue, skipped until its grammar is compiled
    WAITING_FOR_REMOTE_KVS = 2  # in the waiting queue, skipped until its KV has arrived
    RUNNING = 3
    PREEMPTED = 4
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One sequence being generated: its tokens, progress and KV bookkeeping."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        sampling_seed: int = 0,
        structured_backend: str | None = None,
        parent_id: str | None = None,
        reasoning_end_ids: list[int] | None = None,
        lora_request=None,
        mm_features=None,
    ):
        self.request_id = request_id
        # Its images (multimodal/inputs.py MultiModalFeature), in prompt order.
        self.mm_features = list(mm_features or ())
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its LoRARequest (None: the base model)
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.sampling_seed = sampling_seed  # the seed of this request's RNG stream (uint32)
        # Resolved max_tokens (SamplingParams.max_tokens None -> the room left in max_model_len).
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or scheduled into it)
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1: not yet admitted)
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # (time.time(), set by the engine core)
        # Tokens sampled by scheduled steps whose results have not come back yet (async
        # scheduling keeps one in flight; synchronous stepping is back to 0 before scheduling).
        # (The runner's InputBatch.pending counts them too, to read their ids on the device.)
        self.num_output_placeholders = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        # Draft tokens proposed for the next step (speculative decoding); scheduled on top of
        # all_token_ids, verified by the step, never part of all_token_ids until accepted.
        self.spec_token_ids: list[int] = []
        # Structured outputs: the backend the front end chose, the compile in progress and the
        # request's matcher (StructuredOutputManager).
        self.structured_backend = structured_backend
        self.parent_id = parent_id  # the n > 1 request this sample belongs to (fair admission)
        self.grammar = None
        # Behind a reasoning model's thinking: the grammar waits until the output ends with
        # these ids (core/stop.py advance_grammar), None once it applies.
        self.reasoning_end_ids = list(reasoning_end_ids) if reasoning_end_ids else None
        self.grammar_future = None
        # allowed_token_ids / bad_words: the step masks this request's row (core/token_masks);
        # the allowed tokens' row is built on first use.
        self.uses_token_mask = sampling_params.uses_token_mask
        self.allowed_row = None
        self.grammar_deadline = 0.0
        # Skip prefix-cache hits when every prompt position's logits are needed, or when
        # penalties need every token to pass through the step (cached tokens do not).
        p = sampling_params
        self.skip_prefix_cache = (p.prompt_logprobs is not None or p.uses_penalties)
        # Prompt logprobs: entries sent to the front end, and where this run of the prompt
        # is (a preempted request recomputes its prompt from position 0).
        self.prompt_logprobs_sent = 0
        self.prompt_logprobs_run = 0
        # KV connectors (disaggregated prefill/decode): the request's kv_transfer_params, and
        # whether the connector was asked already (once per request: a preempted request
        # recomputes); during a load, the prefix-cache hit it started from.
        self.kv_transfer_params: dict | None = (p.extra_args or {}).get("kv_transfer_params")
        self.kv_load_tried = False
        self.num_local_hit_tokens = 0
        self.num_external_tokens = 0

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def stats(self) -> tuple[float | None, int]:
        """(first scheduled time, preemptions so far): what its outputs carry for metrics."""
        return (self.first_scheduled_time, self.num_preemptions)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def new_prompt_logprobs(self, entries: tuple) -> tuple:
        """A step's prompt logprobs for this request (from the position its chunk starts
        at; None first when that is 0) less those sent before a preemption: each prompt
        position's entry goes out once."""
        if not entries:
            return entries
        start = 0 if entries[0] is None else self.prompt_logprobs_run
        self.prompt_logprobs_run = start + len(entries)
        skip = max(0, self.prompt_logprobs_sent - start)
        self.prompt_logprobs_sent = max(self.prompt_logprobs_sent, self.prompt_logprobs_run)
        return entries[skip:]

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority-queue order: lower priority value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def lora_fits(request: Request, loras: set[int], max_loras: int,
              waiting: bool = False) -> bool:
    """vLLM's rule: a step runs at most max_loras distinct adapters. Whether `request` may
    join a step whose adapters so far are `loras` (its adapter is added when it may). Once a
    waiting request finds no room, no later waiting request with an adapter joins that step
    (marked by -1): the running adapters drain instead of starving it."""
    i = request.lora_int_id
    if not i:
        return True
    if -1 in loras or (i not in loras and len(loras) >= max_loras):
        if waiting:
            loras.add(-1)
        return False
    loras.add(i)
    return True

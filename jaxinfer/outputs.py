"""Step batches passed between scheduler, runner and output processor (frozen diffs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxinfer.request import FinishReason
from jaxinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (first admission, or resumption after preemption)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt + outputs so far (all recomputed after preemption)
    num_prompt_tokens: int  # how many of token_ids are prompt
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # every block of the request
    num_computed_tokens: int  # KV already in the cache (prefix hits) before this step
    sampling_seed: int = 0  # seed of the request's RNG stream
    lora_int_id: int = 0  # the request's LoRA adapter (0: the base model)
    mm_features: tuple = ()  # its images (multimodal/inputs.py MultiModalFeature)
    # Models with sliding and full layers: every block of the request in the sliding layers'
    # pool (core/window_blocks.py; the null block where freed). () otherwise.
    window_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: tuple[int, ...]  # blocks appended this step
    num_computed_tokens: int  # before this step
    new_window_block_ids: tuple[int, ...] = ()  # sliding layers' pool: blocks appended


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # finished/aborted since the last step: runner drops them
    preempted_req_ids: frozenset[str]  # preempted this step: runner drops them
    # req_id -> draft tokens scheduled this step (included in num_scheduled_tokens), to verify
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # What the KV connector's worker side does this step (loads, saves, cancels), or None.
    kv_connector_metadata: object = None
    # Vision-language engines: req_id -> indices of its images the runner encodes before
    # this step (each image once), and the encoder outputs it may drop.
    scheduled_encoder_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    free_encoder_mm_hashes: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class Logprobs:
    """Top-N logprobs of one position: the chosen token's and the N best."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class RunnerOutput:
    req_ids: tuple[str, ...]  # in step order
    sampled_token_ids: tuple[tuple[int, ...], ...]  # per request; () while still prefilling
    logprobs: dict[str, tuple[Logprobs, ...]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[Logprobs | None, ...]] = field(default_factory=dict)
    # A pooling engine: request id -> its pooled vector (float32 bytes), for the requests
    # whose prompt the step completed.
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step did to one request (scheduler -> output processor)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: tuple[Logprobs, ...] = ()
    new_prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # from the KV connector, when the request finished
    # Finished ("stop") because its grammar is complete: the last token is output, not EOS.
    grammar_terminated: bool = False
    # The label of the weights that produced new_token_ids (None: the weights the engine
    # started with, "default"), set by the engine core once weights were updated or labelled.
    weight_version: str | None = None
    # (when the core first scheduled the request (time.time()), its preemptions so far), on
    # outputs with tokens: for the per-request metrics (queue / prefill time, preemptions).
    request_stats: tuple[float | None, int] | None = None
    pooled: bytes | None = None  # a pooling engine: the prompt's vector (float32 bytes)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- user-facing outputs (vLLM's field names) ------------------------------------------------------

@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request, and what /metrics needs of it."""

    arrival_time: float
    first_scheduled_time: float | None = None  # (when the engine core first scheduled it)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    engine_index: int = 0  # the data-parallel rank that served it
    n_param: int = 1  # SamplingParams.n
    max_tokens_param: int | None = None  # SamplingParams.max_tokens as given


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) were sampled by the weights labelled `version` (vLLM's)."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # When finished: which weights sampled which tokens (weight updates during a rollout,
    # for off-policy corrections); None while unfinished.
    weight_versions: list[WeightVersionSpan] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Disaggregated prefill/decode: what the KV connector handed out when the request
    # finished (a prefill instance's answer tells the decode instance where the KV is).
    kv_transfer_params: dict | None = None
    # A pooling engine (runner="pooling"): the prompt's pooled vector, float32 bytes, before
    # PoolingParams (truncation, normalization) are applied: LLM.embed / the server do that.
    pooled: bytes | None = None

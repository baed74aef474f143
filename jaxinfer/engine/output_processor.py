"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (text, logprobs, stop strings, n > 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.outputs import (CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics,
                              RequestOutput, WeightVersionSpan)
from jaxinfer.request import FinishReason, Request
from jaxinfer.sampling_params import SamplingParams


@dataclass
class _SampleState:
    """One sample (child request) of a user request."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # (weight version, index of its first output token), one entry per change of version
    version_starts: list[tuple[str, int]] = field(default_factory=list)

    def track_version(self, version: str | None, num_new: int) -> None:
        version = version or "default"
        if not self.version_starts or self.version_starts[-1][0] != version:
            self.version_starts.append((version, len(self.token_ids) - num_new))

    def version_spans(self) -> list[WeightVersionSpan]:
        starts = self.version_starts
        ends = [s for _, s in starts[1:]] + [len(self.token_ids)]
        return [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends)]


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _SampleState]  # child request id -> state
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    kv_transfer_params: dict | None = None  # from the KV connector when it finished
    pooled: bytes | None = None  # a pooling engine's vector of the prompt

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[Request]) -> None:
        params = children[0].sampling_params
        samples = {}
        for i, child in enumerate(children):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens)
            samples[child.request_id] = _SampleState(
                index=i, detok=detok, logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[child.request_id] = request_id
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, samples,
            RequestMetrics(arrival_time=children[0].arrival_time, n_param=params.n,
                           max_tokens_param=params.max_tokens),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> list[str]:
        """Forget a user request; returns its child ids (for the scheduler)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for cid in state.samples:
            self.child_to_parent.pop(cid, None)
        return list(state.samples)

    def _logprob_dict(self, lp) -> dict[int, Logprob]:
        d = {tid: Logprob(v, rank=i + 1) for i, (tid, v) in
             enumerate(zip(lp.top_ids, lp.top_logprobs))}
        d[lp.token_id] = Logprob(lp.logprob, rank=lp.rank)
        if self.tokenizer is None:  # skip_tokenizer_init: ids only
            return d
        return {tid: Logprob(p.logprob, p.rank, self.tokenizer.decode([tid]))
                for tid, p in d.items()}

    def process_outputs(self, outputs: list[EngineCoreOutput], engine_index: int = 0
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of updated requests, child ids the scheduler must stop).
        engine_index: the data-parallel rank these came from (for the metrics)."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        to_stop: list[str] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            state = self.requests[parent_id]
            sample = state.samples[out.request_id]
            m = state.metrics
            if out.request_stats is not None:  # (the core's: when it first scheduled it)
                scheduled, preemptions = out.request_stats
                m.first_scheduled_time = m.first_scheduled_time or scheduled
                m.num_preemptions = max(m.num_preemptions, preemptions)
            m.first_scheduled_time = m.first_scheduled_time or now
            m.engine_index = engine_index
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.pooled is not None:
                state.pooled = out.pooled
            if out.new_token_ids:
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
            if (out.new_prompt_logprobs and state.prompt_logprobs is not None
                    and sample.index == 0):
                state.prompt_logprobs.extend(
                    None if lp is None else self._logprob_dict(lp)
                    for lp in out.new_prompt_logprobs)
            sample.token_ids.extend(out.new_token_ids)
            if out.new_token_ids:
                sample.track_version(out.weight_version, len(out.new_token_ids))
            for lp in out.new_logprobs:
                if sample.logprobs is not None:
                    sample.logprobs.append(self._logprob_dict(lp))
                    sample.cumulative_logprob += lp.logprob
            finish, stop_reason = out.finish_reason, out.stop_reason
            if sample.detok is not None:
                # EOS / a stop token id ended it: that token is not rendered.
                stop_terminated = finish == FinishReason.STOP and not out.grammar_terminated
                hit = sample.detok.update(out.new_token_ids, stop_terminated)
                if hit is not None:
                    if finish is None:
                        to_stop.append(out.request_id)
                    finish, stop_reason = FinishReason.STOP, hit
            if finish is not None:
                sample.finish_reason, sample.stop_reason = finish, stop_reason
            touched[parent_id] = state
        results = []
        for parent_id, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[parent_id]
                for cid in state.samples:
                    self.child_to_parent.pop(cid, None)
            results.append(self._make_output(state))
        return results, to_stop

    def _make_output(self, state: _RequestState) -> RequestOutput:
        outs = []
        for s in sorted(state.samples.values(), key=lambda s: s.index):
            outs.append(CompletionOutput(
                index=s.index, text=s.detok.output_text if s.detok else "",
                token_ids=list(s.token_ids), cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=str(s.finish_reason) if s.finish_reason else None,
                stop_reason=s.stop_reason,
                weight_versions=s.version_spans() if s.finish_reason else None))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids,
                             prompt_logprobs=state.prompt_logprobs,
                             outputs=outs, finished=state.finished, metrics=state.metrics,
                             num_cached_tokens=state.num_cached_tokens,
                             kv_transfer_params=state.kv_transfer_params,
                             pooled=state.pooled)

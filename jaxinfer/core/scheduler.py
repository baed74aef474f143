"""The scheduler: one token-budget loop over running then waiting requests (vLLM V1 design).

There are no prefill/decode phases: each request's num_computed_tokens catches up with its
num_tokens, a chunk at a time. Running requests are served first; if one cannot get KV blocks,
requests are preempted (recompute) from the tail of running (fcfs) or by lowest priority
(priority) until it can, and no waiting request is admitted in that step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

from jaxinfer.config import SchedulerConfig
from jaxinfer.core.encoder_cache_manager import (EncoderCacheManager, StepImages, check_images,
                                                 commit_images, fit_images)
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.kv_transfer import apply_connector_output, start_kv_load
from jaxinfer.core.request_queue import make_queue
from jaxinfer.core.stop import advance_grammar, check_stop, take_drafts
from jaxinfer.core.token_masks import bitmask_width, needs_last_tokens, step_bitmask
from jaxinfer.outputs import (CachedRequestData, EngineCoreOutput, NewRequestData, RunnerOutput,
                              SchedulerOutput)
from jaxinfer.request import FinishReason, Request, RequestStatus, lora_fits


logger = logging.getLogger(__name__)

_BLOCKED = (RequestStatus.WAITING_FOR_FSM, RequestStatus.WAITING_FOR_REMOTE_KVS)
ENCODER_CACHE_MIN_ROWS = 4096  # (4096 x 2048 float32 rows: 32 MiB of host memory)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 kv_connector=None, structured_output_manager=None, speculative_config=None,
                 vocab_size: int = 0):
        self.config = config
        self.bitmask_width = bitmask_width(vocab_size)
        # Speculative decoding (None: off): drafts arrive via update_draft_token_ids.
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = (speculative_config.num_lookahead_tokens
                                     if speculative_config else 0)
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        self._eagle = (speculative_config is not None
                       and speculative_config.drafts_from_hidden_states)
        self.spec_num_drafts = 0  # verify runs (requests with >= 1 draft in a step)
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * k
        # Grammars of structured-output requests (None: structured outputs are refused).
        self.structured_output_manager = structured_output_manager
        # Requests with a grammar that sample a token in the step just scheduled, in order.
        self._structured_rows: list[Request] = []
        # Outputs of requests finished outside a step (a grammar that failed to compile).
        self.extra_outputs: list[EngineCoreOutput] = []
        # Requests that failed while this step's inputs were prepared (their grammar's mask):
        # the engine core finishes them with an error once the step is dispatched.
        self.step_failures: dict[str, str] = {}
        self.num_failed_requests = 0  # finished with FINISHED_ERROR
        self.num_grammar_rejections = 0
        self.kv = kv_cache_manager
        # Scheduler side of a KV connector (None: none; jaxinfer/kv_connector/base.py). It
        # may bring a waiting request's prompt KV in from elsewhere (the request then waits in
        # WAITING_FOR_REMOTE_KVS), and its request_finished(request, block_ids) ->
        # (delay_free, kv_transfer_params) may keep a finished request's blocks (while a decode
        # instance pulls them) until the worker reports them sent (finish_delayed_free).
        self.kv_connector = kv_connector
        self.kv_load_failure_policy = "recompute"
        self.delayed_free: dict[str, Request] = {}
        self.num_kv_load_failures = 0
        self.num_kv_loaded_tokens = 0
        self.max_model_len = config.max_model_len
        capacity = kv_cache_manager.num_usable_blocks * kv_cache_manager.block_size
        if capacity < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({kv_cache_manager.num_usable_blocks} "
                f"blocks of {kv_cache_manager.block_size}), fewer than max_model_len="
                f"{config.max_model_len}: lower max_model_len or give the cache more blocks"
            )
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Pipeline parallelism: up to pipeline_depth batches in flight; a request in one of
        # them is neither scheduled again nor preempted until its batch's outputs are in.
        self.pipeline_depth = 1
        self.in_flight: set[str] = set()
        self.max_loras = 0  # enable_lora: distinct adapters in one step (set by the core)
        # Vision-language engines (enable_encoder_cache): the images each step encodes.
        self.encoder_cache: EncoderCacheManager | None = None

    def enable_encoder_cache(self, cache_rows: int = ENCODER_CACHE_MIN_ROWS) -> None:
        """Take requests with images: at most max_num_batched_tokens encoder rows computed
        per step (vLLM's encoder budget); outputs kept in an encoder cache of
        max(max_num_batched_tokens, cache_rows) rows (the runner keeps them in host memory,
        so more than vLLM's max_num_batched_tokens: another request with the same image
        finds it later)."""
        self.encoder_cache = EncoderCacheManager(max(self.config.max_num_batched_tokens,
                                                     cache_rows))

    # -- requests in and out --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Its values were validated by the front end (the Processor) and
        their device ranges checked by the engine core; refused here are only the scheduler's
        own invariants (ValueError): an id in use, a prompt that is empty, longer than
        max_model_len or larger than the whole KV cache, a grammar without a tokenizer."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        need = self.kv.blocks_needed(request.num_prompt_tokens + 1)
        if need > self.kv.num_usable_blocks:
            raise ValueError(f"the request needs {need} KV blocks, more than the whole cache "
                             f"({self.kv.num_usable_blocks} blocks)")
        if request.mm_features:
            check_images(request, self.encoder_cache, self.config.max_num_batched_tokens)
        if request.use_structured_output and self.structured_output_manager is None:
            raise ValueError("structured_outputs need the tokenizer, but the engine was started "
                             "with skip_tokenizer_init=True")
        if request.max_tokens is None:
            request.max_tokens = self.max_model_len - request.num_prompt_tokens
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or otherwise finish) requests wherever they are; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    abort = finish_requests

    def fail_requests(self, errors: dict[str, str]) -> None:
        """Finish requests with an error of their own (FINISHED_ERROR; the message is the
        output's stop_reason): the engine failed them while admitting them, preparing their
        inputs or applying their outputs, and keeps serving everyone else."""
        for rid, error in errors.items():
            request = self.requests.get(rid)
            if request is None:  # finished already (or never known)
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.in_flight.discard(rid)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = error
            self.num_failed_requests += 1
            try:
                self._free_request(request)
            except Exception:  # (a connector that fails on it: the blocks go back all the same)
                logger.exception("freeing failed request %s", rid)
                self.kv.free(request)
                self.finished_req_ids.add(rid)
                self.requests.pop(rid, None)
            self.extra_outputs.append(EngineCoreOutput(rid, (), FinishReason.ERROR,
                                                       stop_reason=error))

    def take_step_failures(self) -> dict[str, str]:
        failures, self.step_failures = self.step_failures, {}
        return failures

    def _free_request(self, request: Request) -> dict | None:
        """Forget a finished request; its blocks go back unless the connector delays that.
        Returns the connector's kv_transfer_params (or None)."""
        delay, params = False, None
        if self.kv_connector is not None:
            delay, params = self.kv_connector.request_finished(
                request, self.kv.get_block_ids(request.request_id))
        if delay:
            self.delayed_free[request.request_id] = request
        else:
            self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    def finish_delayed_free(self, request_ids: Iterable[str]) -> None:
        """Release the blocks of finished requests whose freeing the connector delayed."""
        for rid in request_ids:
            request = self.delayed_free.pop(rid, None)
            if request is not None:
                self.kv.free(request)

    def set_request_ready(self, request_id: str) -> None:
        """A request waiting for its grammar (WAITING_FOR_FSM) or for remote KV
        (WAITING_FOR_REMOTE_KVS) may now be scheduled."""
        request = self.requests.get(request_id)
        if request is not None and request.status in _BLOCKED:
            request.status = RequestStatus.WAITING

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_schedulable_requests(self) -> bool:
        """Some request could go into a new batch (waiting, or running and not in flight)."""
        return bool(len(self.waiting)) or any(r.request_id not in self.in_flight
                                              for r in self.running)

    # -- one step -------------------------------------------------------------------------------
    def _preempt_one(self) -> Request | None:
        """Preempt the last (fcfs) or least important (priority) running request that is not
        in a batch in flight; None if there is none."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.config.policy == "priority":
            victim = max(candidates, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = candidates[-1]
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # drafts were for the step it no longer gets
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, tuple[int, ...]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []
        loras: set[int] = set()  # the step's LoRA adapters (at most max_loras)
        enc = StepImages(cfg.max_num_batched_tokens)  # images this step needs encoded
        # long_prefill_token_threshold keeps one long prefill from starving the others; with
        # nobody else running or waiting it does not apply (as in vLLM).
        threshold = cfg.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            threshold = 0

        # Running requests first (their sliding-window blocks that no next token reads go
        # back first: the sliding layers' pool is sized on it).
        self.kv.free_out_of_window(self.running)
        i = 0
        in_flight = self.in_flight
        # Pipeline parallelism: a batch takes at most max_num_seqs / P sequences, so that the
        # running requests fill P batches (one batch of all of them would leave the queue at
        # one batch in flight).
        seats = (-(-cfg.max_num_seqs // self.pipeline_depth) if self.pipeline_depth > 1
                 else cfg.max_num_seqs)
        while i < len(self.running) and budget > 0 and len(num_scheduled) < seats:
            request = self.running[i]
            if request.request_id in in_flight or not lora_fits(request, loras, self.max_loras):
                i += 1  # (pipeline: its batch has not returned; or too many adapters)
                continue
            computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            # A token still in flight (async scheduling) is computed by this step all the same
            # (the runner patches its id in on the device), unless it will end the request.
            num_tokens = len(request.all_token_ids) + placeholders
            if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                                 or num_tokens >= self.max_model_len):
                i += 1
                continue
            # Drafts (speculative decoding) are scheduled as extra query tokens to verify.
            n = num_tokens + len(request.spec_token_ids) - computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.max_model_len - computed)
            if request.mm_features and n > 0:
                n = fit_images(self.encoder_cache, request, computed, n, budget, enc)
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(
                    request, n, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                victim = self._preempt_one()
                if victim is None:  # everyone else is in flight: this one waits its turn
                    break
                preempted.append(victim)
                if victim is request:
                    break
                if victim.request_id in num_scheduled:
                    # Under priority the victim may sit before us, already scheduled: undo it.
                    budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    i -= 1
            if new_blocks is None:  # it preempted itself or nothing could give way
                break
            cached_reqs.append(CachedRequestData(
                request.request_id,
                tuple([b.block_id for b in new_blocks]) if new_blocks else (),
                computed, self.kv.pop_new_window_block_ids(request.request_id),
            ))
            num_scheduled[request.request_id] = n
            num_spec = computed + n - num_tokens
            if num_spec > 0:
                spec_tokens[request.request_id] = tuple(request.spec_token_ids[:num_spec])
            budget -= n
            i += 1

        # Then waiting requests, unless this step preempted. Requests still waiting for their
        # grammar or their remote KV are passed over and keep their place. The children of an
        # n > 1 request take at most half the seats in the first pass, so that a request with
        # a large n does not hold everyone behind it back; seats still free after the others
        # go to the deferred children in a second pass.
        skipped: list[Request] = []
        deferred: list[Request] = []
        cap = max(1, cfg.max_num_seqs // 2)
        children: dict[str, int] | None = None
        while not preempted and len(self.waiting) and budget > 0:
            if len(self.running) >= cfg.max_num_seqs or len(num_scheduled) >= seats:
                break
            request = self.waiting.peek()
            if (request.status == RequestStatus.WAITING_FOR_FSM
                    and request.grammar_future is not None):  # (else: set_request_ready)
                err = self.structured_output_manager.check_ready(request)
                if err:
                    self.waiting.pop()
                    self._fail_request(request, err)
                    continue
                if err == "":
                    request.status = RequestStatus.WAITING
            if (request.status in _BLOCKED or request.num_output_placeholders
                    or not lora_fits(request, loras, self.max_loras, waiting=True)):
                # (a request preempted with a token in flight resumes once the token is in;
                # one whose adapter would exceed max_loras waits for a step with room)
                skipped.append(self.waiting.pop())
                continue
            parent = request.parent_id
            if parent is not None:
                if children is None:
                    children = {}
                    for r in self.running:
                        if r.parent_id is not None:
                            children[r.parent_id] = children.get(r.parent_id, 0) + 1
                if children.get(parent, 0) >= cap:
                    deferred.append(self.waiting.pop())
                    skipped.append(request)
                    continue
            n = self._admit(request, budget, threshold, new_reqs, num_scheduled, enc)
            if n is None:
                break
            if n == 0:  # its KV is coming (connector) or its image cannot be encoded yet
                skipped.append(self.waiting.pop())
                continue
            self.waiting.pop()
            budget -= n
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
        admitted = set()
        for request in deferred:
            if (budget <= 0 or len(self.running) >= cfg.max_num_seqs
                    or len(num_scheduled) >= seats):
                break
            if not lora_fits(request, loras, self.max_loras, waiting=True):
                continue
            n = self._admit(request, budget, threshold, new_reqs, num_scheduled, enc)
            if n is None:
                break
            if n == 0:
                continue
            budget -= n
            admitted.add(request.request_id)
        for request in reversed(skipped):
            if request.request_id not in admitted:
                self.waiting.prepend(request)

        preempted_ids = frozenset(r.request_id for r in preempted)
        encoder_inputs, freed = commit_images(self.encoder_cache, enc, self.requests,
                                              num_scheduled)
        out = SchedulerOutput(
            scheduled_new_reqs=tuple(new_reqs),
            scheduled_cached_reqs=tuple(cached_reqs),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=preempted_ids,
            scheduled_spec_decode_tokens=spec_tokens,
            kv_connector_metadata=(self.kv_connector.build_connector_meta()
                                   if self.kv_connector is not None else None),
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_mm_hashes=freed,
        )
        self.finished_req_ids = set()
        if self.pipeline_depth > 1:
            in_flight.update(num_scheduled)
        requests = self.requests
        structured = self._structured_rows = []
        for rid, n in num_scheduled.items():
            request = requests[rid]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples a real token
                if request.grammar is not None or request.uses_token_mask:
                    structured.append(request)
        return out

    def _admit(self, request: Request, budget: int, threshold: int, new_reqs: list,
               num_scheduled: dict, enc: StepImages | None = None) -> int | None:
        """Move a waiting request (already out of the queue, or at its head) to running with
        its first chunk: the tokens scheduled, or None when it does not fit (stop admitting)."""
        cfg = self.config
        hit_blocks, num_hit = [], 0
        base = request.num_computed_tokens  # > 0 only after a KV connector's load
        if base == 0:
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if hit_blocks and self._eagle:
                # An EAGLE / MTP head's KV at a block's last position read the token after it, which
                # may differ for this request: recompute the last hit block (vLLM does too).
                hit_blocks = hit_blocks[:-1]
                num_hit = len(hit_blocks) * self.kv.block_size
                self.kv.prefix_cache_stats.hits -= self.kv.block_size
            if self.kv_connector is not None and not request.kv_load_tried:
                try:
                    loading = start_kv_load(self, request, hit_blocks, num_hit)
                except Exception as e:  # that request's fault or the connector's: it fails
                    logger.exception("KV connector failed on request %s", request.request_id)
                    request.kv_load_tried = True
                    self.step_failures[request.request_id] = (
                        f"KV connector error: {type(e).__name__}: {e}")
                    return 0  # (it stays in the queue; the core fails it after this step)
                if loading != -1:
                    return loading  # None: no room; 0: it waits for its KV
        n = request.num_tokens - base - num_hit
        if 0 < threshold < n:
            n = threshold
        if not cfg.enable_chunked_prefill and n > budget:
            return None  # strict FCFS: the head is not skipped
        n = min(n, budget)
        if request.mm_features and enc is not None:
            n = fit_images(self.encoder_cache, request, base + num_hit, n, budget,
                           enc)
            if n == 0:
                return 0  # (its image waits for the encoder budget or the cache's room)
        new_blocks = self.kv.allocate_slots(request, n, num_hit, hit_blocks,
                                            num_lookahead_tokens=self.num_lookahead_tokens,
                                            full_sequence_must_fit=cfg.scheduler_reserve_full_isl)
        if new_blocks is None:
            return None
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = base + num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = base + num_hit
        new_reqs.append(NewRequestData(
            req_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=tuple(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=base + num_hit,
            sampling_seed=request.sampling_seed, lora_int_id=request.lora_int_id,
            mm_features=tuple(request.mm_features),
            window_block_ids=self.kv.get_window_block_ids(request.request_id)))
        num_scheduled[request.request_id] = n
        return n

    def update_connector_output(self, out) -> None:
        """The worker side's news: loads that arrived or failed, blocks sent."""
        if self.kv_connector is not None and out:
            apply_connector_output(self, out)

    def has_pending_kv_work(self) -> bool:
        """Blocks held for a transfer, or connector work not handed to the worker yet: the
        engine must keep stepping (with nothing to compute) until they are done."""
        return self.kv_connector is not None and (bool(self.delayed_free)
                                                  or self.kv_connector.has_pending_work())

    def _fail_request(self, request: Request, error: str) -> None:
        """Finish a waiting request with an error the client sees (its stop_reason)."""
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self.extra_outputs.append(EngineCoreOutput(request.request_id, (), FinishReason.ABORT,
                                                   stop_reason=error))

    def take_extra_outputs(self) -> list[EngineCoreOutput]:
        outs, self.extra_outputs = self.extra_outputs, []
        return outs

    def get_grammar_bitmask(self) -> tuple[list[str], "object"] | None:
        """For the step just scheduled: (request ids, int32 bitmask [n, ceil(V/32)]) of the
        requests with a grammar that sample in it, or None when there are none."""
        rows = self._structured_rows
        if not rows:
            return None
        errors: dict[str, str] = {}
        bitmask = step_bitmask(rows, self.structured_output_manager, self.bitmask_width, errors)
        self.step_failures.update(errors)  # (their rows allow EOS only; they end after the step)
        return [r.request_id for r in rows], bitmask

    def last_step_sampled_grammars(self) -> bool:
        """Some request with a grammar (or bad words) samples in the step scheduled last: the
        next step's masks need that step's tokens (async scheduling collects it first)."""
        return needs_last_tokens(self._structured_rows)

    # -- after the step -------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, ro: RunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free finished requests."""
        outputs = []
        finished = []
        requests, scheduled = self.requests, so.num_scheduled_tokens
        if self.in_flight:
            self.in_flight.difference_update(scheduled)
        spec = so.scheduled_spec_decode_tokens
        logprobs, prompt_logprobs = ro.logprobs, ro.prompt_logprobs
        errors: dict[str, str] = {}
        for rid, sampled in zip(ro.req_ids, ro.sampled_token_ids):
            request = requests.get(rid)
            if request is None or rid not in scheduled:
                continue  # aborted while the step ran
            try:
                out = self._apply_step_output(request, sampled, spec, logprobs,
                                              prompt_logprobs)
            except Exception as e:  # this request's state: it fails, the others go on
                logger.exception("applying the step's output to request %s failed", rid)
                errors[rid] = (f"engine error while applying the step's output: "
                               f"{type(e).__name__}: {e}")
                continue
            if out is None:
                continue
            outputs.append(out)
            if out.finish_reason is not None:
                finished.append((request, len(outputs) - 1))
        for request, k in finished:
            if request in self.running:
                self.running.remove(request)
            else:  # preempted while its last token was in flight (async scheduling)
                self.waiting.remove(request)
            params = self._free_request(request)
            if params is not None:
                outputs[k] = dataclasses.replace(outputs[k], kv_transfer_params=params)
        if errors:
            self.fail_requests(errors)  # (their error outputs go out with the step's)
        return outputs

    def _apply_step_output(self, request: Request, sampled, spec, logprobs,
                           prompt_logprobs) -> EngineCoreOutput | None:
        """One request's part of update_from_output: its new tokens, stop checks, grammar."""
        rid = request.request_id
        prompt_lps = prompt_logprobs.get(rid) if prompt_logprobs else None
        if prompt_lps:
            prompt_lps = request.new_prompt_logprobs(prompt_lps)
        if spec and rid in spec:
            # The step verified the drafts: it returns the accepted ones plus one token.
            # Rejected drafts' KV is not computed; the next step recomputes from there.
            num_draft = len(spec[rid])
            num_accepted = len(sampled) - 1
            request.num_computed_tokens -= num_draft - num_accepted
            request.spec_token_ids = []
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += num_draft
            self.spec_num_accepted_tokens += num_accepted
            per_pos = self.spec_accepted_per_pos
            if len(per_pos) < num_draft:  # (drafts set by hand, no speculative_config)
                per_pos.extend([0] * (num_draft - len(per_pos)))
            for j in range(num_accepted):
                per_pos[j] += 1
        if not sampled:
            # A partial prefill: no output token.
            if prompt_lps:
                return EngineCoreOutput(rid, (), new_prompt_logprobs=prompt_lps)
            return None
        request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
        new_ids = sampled
        grammar = request.grammar
        for i, tok in enumerate(sampled):
            request.output_token_ids.append(tok)
            request.all_token_ids.append(tok)
            if check_stop(request, self.max_model_len):
                new_ids = sampled[: i + 1]
                break
            if grammar is not None and advance_grammar(request, tok):
                self.num_grammar_rejections += request.status == RequestStatus.FINISHED_ABORTED
                new_ids = sampled[: i + 1]
                break
        lps = logprobs.get(rid, ())[: len(new_ids)] if logprobs else ()
        status = request.status
        reason = RequestStatus.finish_reason(status) if status > RequestStatus.PREEMPTED \
            else None
        return EngineCoreOutput(
            rid, tuple(new_ids), reason, request.stop_reason, tuple(lps), prompt_lps,
            max(request.num_cached_tokens, 0), request_stats=request.stats,
            grammar_terminated=grammar is not None and reason == FinishReason.STOP
            and grammar.is_terminated() and new_ids[-1] != request.eos_token_id)

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """Drafts from the proposer for the next step (core/stop.py: who takes how many)."""
        for rid, tokens in drafts.items():
            request = self.requests.get(rid)
            if request is not None:
                take_drafts(request, tokens, self.max_model_len)

    # -- stats ----------------------------------------------------------------------------------
    def make_stats(self) -> dict:
        st = self.kv.prefix_cache_stats
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "prefix_cache_hit_rate": st.hit_rate,
            "num_preemptions": self.num_preemptions,
            **({} if self.encoder_cache is None else {
                "encoder_cache_runs": self.encoder_cache.num_encoder_runs,
                "encoder_cache_hits": self.encoder_cache.num_hits,
            }),
            **({} if self.speculative_config is None else {
                "spec_decode_num_drafts": self.spec_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
            }),
        }

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

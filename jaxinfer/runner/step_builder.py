"""From the scheduler's diff to one step's host inputs: StepBuilder applies a SchedulerOutput
to the persistent InputBatch and fills a padded StepBatch (host buffers reused in turn) for the
bucket the runner picks; BuiltStep is what the runner dispatches and later reads back by."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import numpy as np

from jaxinfer.outputs import SchedulerOutput
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.step_inputs import (StepBatch, StepFeatures, empty_step_batch,
                                         fill_step_inputs, fill_verify_inputs,
                                         fill_window_inputs, logit_bias_bucket,
                                         reset_step_batch)

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "frequency_penalty", "presence_penalty")


@dataclasses.dataclass
class BuiltStep:
    """One step's inputs, and per row what reading its results back needs (taken at build
    time: a request may leave the batch before the step is collected)."""

    batch: StepBatch  # the host inputs (its buffer is not refilled before the step is read)
    features: StepFeatures
    req_ids: list[str]  # in row order
    slots: np.ndarray  # int32 [n_req] persistent slot per row
    computed: np.ndarray  # int32 [n_req] tokens computed before the step
    samples: np.ndarray  # bool [n_req] the row samples a real token (not a partial prefill)
    num_drafts: np.ndarray | None  # int32 [n_req] drafts to verify (speculative decoding)
    num_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_tokens: np.ndarray  # int32 [n_req]


class StepBuilder:
    def __init__(self, batch: InputBatch, *, block_size: int, max_blocks: int,
                 num_slots: int, bitmask_width: int, num_spec: int, eagle: bool,
                 num_host_buffers: int = 2, logits_processors=(), lora: bool = False,
                 pooling: str = "", mm=None):
        """num_spec: K drafts at most per request (0: no speculative decoding); eagle: rows
        also carry the token after each one (an EAGLE head drafts from them);
        num_host_buffers: buffers per shape used in turn (a buffer is refilled only after the
        step that read it has finished: 2, or P + 1 with P pipeline batches in flight)."""
        self.input_batch = batch
        self.block_size, self.max_blocks, self.num_slots = block_size, max_blocks, num_slots
        self.bitmask_width, self.num_spec, self.eagle = bitmask_width, num_spec, eagle
        self.num_host_buffers = num_host_buffers
        self.logits_processors = tuple(logits_processors)
        self.lora = lora  # steps carry each token's adapter slot
        self.pooling = pooling  # a pooling engine's pooling type (StepFeatures.pooling)
        # Vision-language engines: the runner's MultiModalRunner (encoder rows per step,
        # M-RoPE positions), else None.
        self.mm = mm
        self.mrope = mm is not None and mm.mrope
        self.window = batch.window_block_table is not None  # sliding layers' own pool
        self._host_buffers: dict[tuple, list[StepBatch]] = {}

    def new_buffers(self, t: int, r: int, prompt_logprobs: bool, structured: bool = False,
                    verify: bool = False, bias: int = 0, processors: bool = False,
                    mm: bool = False) -> StepBatch:
        return empty_step_batch(t, r, self.max_blocks, self.num_slots, prompt_logprobs,
                                self.bitmask_width if structured else 0, self.num_spec, verify,
                                bias, self.logits_processors if processors else (),
                                self.lora, self.mrope, self.mm.hidden_size if mm else 0,
                                spans=mm and self.mm.spans, window=self.window)

    def _buffers(self, t: int, r: int, prompt_logprobs: bool, structured: bool,
                 verify: bool, bias: int, processors: bool, mm: bool) -> StepBatch:
        key = (t, r, prompt_logprobs, structured, verify, bias, processors, mm)
        ring = self._host_buffers.get(key)
        if ring is None:
            ring = self._host_buffers[key] = [self.new_buffers(*key)
                                              for _ in range(self.num_host_buffers)]
        ring.append(ring.pop(0))  # the one used longest ago
        batch = ring[0]
        reset_step_batch(batch, self.num_slots)
        return batch

    def apply_diff(self, so: SchedulerOutput) -> dict[str, str]:
        """Take the step's diff into the InputBatch. Returns the new requests that could not
        be taken in (request id -> error): one request whose values do not fit its slot
        fails alone."""
        b = self.input_batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            b.remove(rid)
        failed = {}
        for new in so.scheduled_new_reqs:
            b.remove(new.req_id)  # a resumed request restarts from a clean slot
            try:
                b.add(new)
            except Exception as e:  # noqa: BLE001 - that request fails, the step goes on
                logger.exception("preparing the inputs of request %s failed", new.req_id)
                b.remove(new.req_id)
                failed[new.req_id] = (f"engine error while preparing the request's inputs: "
                                      f"{type(e).__name__}: {e}")
        for c in so.scheduled_cached_reqs:
            s = b.req_id_to_slot[c.req_id]
            # The scheduler keeps the count of computed tokens (it advances it when it
            # schedules, rolls rejected drafts back when it applies a step); each step's diff
            # brings it here, so the runner never keeps a count of its own.
            b.num_computed[s] = c.num_computed_tokens
            if c.new_block_ids:
                b.append_blocks(s, c.new_block_ids)
            if c.new_window_block_ids:
                b.append_window_blocks(s, c.new_window_block_ids)
        return failed

    def build(self, so: SchedulerOutput, grammar,
              choose_bucket: Callable[[int, int, StepFeatures], tuple[int, int]],
              lora_slots: dict[int, int] | None = None) -> BuiltStep:
        """The step's inputs. choose_bucket(n_tokens, n_seqs, features) -> the (T, R) bucket
        it runs in. grammar: (request ids, bitmask) of the rows under a grammar, or None.
        lora_slots: the device slot of each of the step's adapters (lora_int_id -> slot)."""
        b = self.input_batch
        sched = so.num_scheduled_tokens
        n_req = len(sched)
        q_lens = np.fromiter(sched.values(), np.int32, n_req)
        req_ids = list(sched)
        is_one = q_lens == 1
        if not is_one[: int(is_one.sum())].all():
            # Single-token sequences first: the xla attention batches them (num_decodes).
            order = np.argsort(q_lens != 1, kind="stable")
            q_lens = q_lens[order]
            req_ids = [req_ids[i] for i in order]
        slots = np.fromiter((b.req_id_to_slot[r] for r in req_ids), np.int32, n_req)
        n_tok = int(q_lens.sum())
        computed = b.num_computed[slots]
        wants_pl = bool(np.any((b.num_prompt_logprobs[slots] >= 0)
                               & (computed < b.num_prompt_tokens[slots])))
        penalties = bool(np.any(b.uses_penalties[slots]))
        structured = grammar is not None
        spec = so.scheduled_spec_decode_tokens
        verify = bool(self.num_spec and spec and any(rid in spec for rid in req_ids))
        bias = logit_bias_bucket(int(b.num_logit_bias[slots].max()))
        processors = bool(b.uses_processor[slots].any())
        images = self.mm.step_images(req_ids, computed, q_lens) if self.mm else []
        features = StepFeatures(logprobs=bool(np.any(b.num_logprobs[slots] >= 0)),
                                penalties=penalties, prompt_logprobs=wants_pl,
                                structured=structured, spec=self.num_spec > 0, verify=verify,
                                bias=bias,
                                logits_processors=self.logits_processors if processors else (),
                                pooling=self.pooling, mm=bool(images))
        t, r = choose_bucket(n_tok, n_req, features)
        batch = self._buffers(t, r, wants_pl, structured, verify, bias, processors,
                              bool(images))
        if processors:
            for rows, active, all_rows, all_active in zip(batch.lp_rows, batch.lp_active,
                                                          b.lp_rows, b.lp_active):
                rows[:n_req] = all_rows[slots]
                active[:n_req] = all_active[slots]
        if bias:
            for i in np.flatnonzero(b.num_logit_bias[slots]):
                ids, vals = b.logit_bias[int(slots[i])]
                batch.bias_ids[i, :len(ids)] = ids
                batch.bias_vals[i, :len(ids)] = vals
        num_drafts = self._take_drafts(spec, req_ids, slots) if self.num_spec else None
        if structured:
            grammar_ids, grammar_bitmask = grammar
            row_of = {rid: i for i, rid in enumerate(req_ids)}
            batch.bitmask.fill(-1)
            batch.bitmask[[row_of[rid] for rid in grammar_ids]] = grammar_bitmask
        pos = fill_step_inputs(batch, b.token_ids, b.block_table, slots, computed, q_lens,
                               self.block_size)
        if self.window:
            fill_window_inputs(batch, b.window_block_table, slots, pos, self.block_size)
        if num_drafts is not None:
            fill_verify_inputs(batch, num_drafts)
            batch.sample_rows[:n_req] = computed + q_lens >= b.num_tokens[slots]
            if self.eagle:  # the token after each one, where known
                row = np.repeat(np.arange(n_req), q_lens)
                nxt = pos + 1
                known = nxt < (b.num_tokens[slots] + num_drafts)[row]
                batch.draft_input_ids[:n_tok] = np.where(
                    known, b.token_ids[slots[row], np.minimum(nxt, b.token_ids.shape[1] - 1)], 0)
        tok_slot = batch.token_slots[:n_tok]
        if images:
            self.mm.fill(batch, images)
        if self.mrope:
            self.mm.fill_rope(batch, req_ids, computed, q_lens, pos)
        if self.lora:
            ids = b.lora_id[slots]
            row = np.fromiter((lora_slots.get(int(i), -1) if i else -1 for i in ids),
                              np.int32, n_req)
            batch.attn.lora_slots[:n_tok] = np.repeat(row, q_lens)
        if wants_pl:
            has_next = pos + 1 < b.num_prompt_tokens[tok_slot]
            batch.next_token_ids[:n_tok] = np.where(
                has_next, b.token_ids[tok_slot, np.minimum(pos + 1, b.token_ids.shape[1] - 1)], 0)
        if penalties:
            batch.token_is_output[:n_tok] = pos >= b.num_prompt_tokens[tok_slot]
            resets = b.needs_reset[slots]
            batch.reset_slots[:n_req] = np.where(resets, slots, self.num_slots)
        b.needs_reset[slots] = False  # penalty state matters only to steps that use it
        sm = batch.sampling
        for name in _SAMPLING_FIELDS:
            getattr(sm, name)[:n_req] = getattr(b, name)[slots]
        sm.seeds[:n_req] = b.seed[slots]
        sm.output_index[:n_req] = b.num_tokens[slots] - b.num_prompt_tokens[slots]
        # The token sampled by the step in flight (async scheduling) is read on the device.
        batch.from_last_sampled[:n_tok] = ((b.pending[tok_slot] > 0)
                                           & (pos == b.num_tokens[tok_slot] - 1))
        samples = computed + q_lens >= b.num_tokens[slots]  # else a partial prefill
        return BuiltStep(batch, features, req_ids, slots, computed, samples, num_drafts,
                         b.num_logprobs[slots], b.num_prompt_logprobs[slots],
                         b.num_prompt_tokens[slots])

    def _take_drafts(self, spec: dict[str, Any], req_ids, slots) -> np.ndarray:
        """Drafts to verify per row, written after each row's tokens (speculative steps)."""
        b = self.input_batch
        num_drafts = np.zeros(len(req_ids), np.int32)
        for i, rid in enumerate(req_ids):
            drafts = spec.get(rid) if spec else None
            if drafts:
                s, n0 = slots[i], b.num_tokens[slots[i]]
                b.token_ids[s, n0 : n0 + len(drafts)] = drafts  # tokens to verify
                num_drafts[i] = len(drafts)
        return num_drafts


def without_requests(so: SchedulerOutput, grammar, ids) -> tuple[SchedulerOutput, Any]:
    """The step without the requests `ids` (and their grammar bitmask rows)."""
    keep = {r: n for r, n in so.num_scheduled_tokens.items() if r not in ids}
    so = dataclasses.replace(
        so, scheduled_new_reqs=tuple(n for n in so.scheduled_new_reqs if n.req_id not in ids),
        scheduled_cached_reqs=tuple(c for c in so.scheduled_cached_reqs
                                    if c.req_id not in ids),
        num_scheduled_tokens=keep, total_num_scheduled_tokens=sum(keep.values()),
        scheduled_spec_decode_tokens={r: d for r, d in so.scheduled_spec_decode_tokens.items()
                                      if r not in ids})
    if grammar is not None:
        grammar_ids, bitmask = grammar
        rows = [i for i, r in enumerate(grammar_ids) if r not in ids]
        grammar = ([grammar_ids[i] for i in rows], bitmask[rows]) if rows else None
    return so, grammar

"""ModelRunner: the only host<->device boundary, and the orchestration of one step.

Per step: apply the SchedulerOutput diff to the persistent InputBatch, build the flat padded
inputs in numpy (step_inputs.py), pick the (T, R) bucket, make ONE transfer in, run the
compiled step (step_fn.py; compiled_steps.py keeps the compiled variants; KV caches and sampler
state donated), make ONE transfer back of the sampled ids and logprobs. Pipeline parallelism
(pipeline_plan.py), in-step drafting (spec_step.py) and multi-host replay (multihost.py) live
in their own modules; this one holds the runner's state and wires them together.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.outputs import Logprobs, RunnerOutput, SchedulerOutput
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.compiled_steps import CompiledSteps, background_compile_enabled
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.kv_cache import allocate_kv_caches
from jaxinfer.runner.multihost import broadcast_step, receive_step
from jaxinfer.runner.pipeline_plan import PipelinePlan, lower_pipeline
from jaxinfer.runner.step_fn import model_step
from jaxinfer.runner.step_inputs import (StepBatch, StepFeatures, empty_step_batch,
                                         fill_step_inputs, fill_verify_inputs, reset_step_batch)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_dtype,
                 buckets: BucketTable | None = None, speculative_config=None,
                 draft_model=None, eagle_head=None, stage_devices=None,
                 step_compilation: str = "whole", layers_per_program: int = 1):
        """model: the model, or (pipeline parallelism) its list of PipelineStages, stage s on
        the devices stage_devices[s]. step_compilation: "whole" (a step is one program, every
        layer unrolled in it) or "layerwise" (runs of layers_per_program layers, each run's
        program compiled once: compile time independent of depth; layerwise.py; pipeline
        stages too, each on its own)."""
        self.stages = model if isinstance(model, list) else None
        if self.stages is not None:
            self._init_pipeline(self.stages, stage_devices)
            model = self.stages[-1]
        self.model_config = cfg = model.config
        self.mesh = model.mesh
        # Step inputs and sampler state are replicated over the mesh (None: default device).
        self._replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        if self.stages is not None:  # (the sampler state lives with the last stage)
            self._replicated = self._stage_targets[-1]
        self.graphdef, self.state = nnx.split(model)
        if self.stages is not None:
            self.graphdef = [g for g, _ in self._stage_split]
            self.state = [st for _, st in self._stage_split]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.buckets = buckets or BucketTable.build(max_num_batched_tokens, max_num_seqs)
        if self.stages is None:
            self.kv_caches = allocate_kv_caches(cfg, num_kv_blocks, block_size, kv_dtype,
                                                self.mesh)
        else:  # each stage's layers' caches on its devices (another process's: shapes)
            self.kv_caches = []
            for i, st in enumerate(self.stages):
                scfg = dataclasses.replace(cfg, num_hidden_layers=len(st.layers))
                if self._plan.local[i]:
                    self.kv_caches.append(allocate_kv_caches(
                        scfg, num_kv_blocks, block_size, kv_dtype, st.mesh,
                        device=self._stage_targets[i]))
                else:
                    shape = (num_kv_blocks, block_size, scfg.num_key_value_heads, scfg.head_dim)
                    kv = jax.ShapeDtypeStruct(shape, kv_dtype)
                    self.kv_caches.append([(kv, kv)] * scfg.num_hidden_layers)
        if self.stages is not None and not self._plan.local[-1]:  # on another process
            self.sampler_state = (
                jax.ShapeDtypeStruct((max_num_seqs, cfg.vocab_size), jnp.int32),
                jax.ShapeDtypeStruct((max_num_seqs, cfg.vocab_size), bool),
                jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32))
        else:
            self.sampler_state = (
                jnp.zeros((max_num_seqs, cfg.vocab_size), jnp.int32, device=self._replicated),
                jnp.zeros((max_num_seqs, cfg.vocab_size), bool, device=self._replicated),
                jnp.zeros((max_num_seqs,), jnp.int32, device=self._replicated))
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks)
        self.bitmask_width = (cfg.vocab_size + 31) // 32
        # Speculative decoding: K drafts at most per request; every step verifies (the spec
        # variant), and a proposer drafts from the tokens each step leaves.
        self.num_spec = speculative_config.num_speculative_tokens if speculative_config else 0
        self.base_features = StepFeatures(spec=self.num_spec > 0)
        self.proposer = None
        # A draft model runs inside the step (its own KV cache, the same block ids); its
        # drafts come back with the sampled tokens.
        self.draft_graphdef = self.draft_state = self.draft_kv = None
        self.draft_kind = ""
        self._drafts: np.ndarray | None = None  # [R, K] of the step collected last
        if draft_model is not None:
            self.draft_kind = "model"
            self.draft_graphdef, self.draft_state = nnx.split(draft_model)
            self.draft_kv = allocate_kv_caches(draft_model.config, num_kv_blocks, block_size,
                                               kv_dtype, self.mesh)
        elif eagle_head is not None:  # an EAGLE head: the same, reading the target's states
            self.draft_kind = "eagle"
            self.draft_graphdef, self.draft_state = nnx.split(eagle_head)
            self.draft_kv = allocate_kv_caches(
                dataclasses.replace(eagle_head.config, num_hidden_layers=eagle_head.num_kv_layers),
                num_kv_blocks, block_size, kv_dtype, self.mesh)
        elif speculative_config is not None:
            from jaxinfer.spec_decode.ngram import NgramProposer

            self.proposer = NgramProposer(speculative_config.prompt_lookup_min,
                                          speculative_config.prompt_lookup_max, self.num_spec)
        self._last_sampled_rows: tuple[list[str], np.ndarray] = ([], np.zeros(0, np.int32))
        # Requests whose inputs could not be prepared (request id -> error), left out of the
        # step that dispatch() launched; the engine core finishes them with that error.
        self.failed_requests: dict[str, str] = {}
        self.kv_connector = None  # a KV connector's worker side (set_kv_connector)
        # Host step buffers per (T, R, prompt_logprobs, structured), two of each used in turn:
        # a buffer is refilled only after the step that read it has finished.
        self._host_buffers: dict[tuple[int, int, bool, bool], list] = {}
        # (P batches in flight under pipeline parallelism: P + 1 buffers in turn)
        self.num_host_buffers = 2 if self.stages is None else len(self.stages) + 1
        if step_compilation not in ("whole", "layerwise"):
            raise ValueError(f"step_compilation={step_compilation!r} is not supported "
                             "(supported: whole, layerwise)")
        self.layerwise = None
        self._stage_layerwise = None
        if step_compilation == "layerwise" and self.stages is not None:
            from jaxinfer.runner.layerwise import PipelineStageSteps

            last = len(self.stages) - 1
            self._stage_layerwise = [
                PipelineStageSteps(st, layers_per_program, s == 0, s == last)
                if self._plan.local[s] else None for s, st in enumerate(self.stages)]
        if step_compilation == "layerwise" and self.stages is None:
            from jaxinfer.runner.layerwise import LayerwiseSteps

            self.layerwise = LayerwiseSteps(
                model, draft_graphdef=self.draft_graphdef, draft_kind=self.draft_kind,
                aux_layers=tuple(eagle_head.aux_layers) if eagle_head is not None else (),
                max_model_len=max_model_len, group=layers_per_program)
        self.step_compilation = ("layerwise" if self.layerwise is not None
                                 or self._stage_layerwise is not None else "whole")
        self.compiled = CompiledSteps(self._lower, self.base_features, self._multiprocess)

    def _init_pipeline(self, stages, groups) -> None:
        self._stage_targets = [NamedSharding(st.mesh, P()) if st.mesh is not None
                               else groups[i][0] for i, st in enumerate(stages)]
        self._plan = PipelinePlan(stages, groups, self._stage_targets)
        self._stage_split = [nnx.split(st) for st in stages]

    def _to_device(self, tree):
        """Host numpy pytree -> device arrays (replicated over the mesh, every process; under
        pipeline parallelism one copy per stage, on its devices)."""
        if self.stages is not None:  # (another process's stage: the host copy, for shapes)
            return [jax.device_put(tree, target) if local else tree
                    for target, local in zip(self._stage_targets, self._plan.local)]
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._replicated, x), tree)

    # -- multi-host: process 0 drives, the others replay its steps ------------------------------
    @property
    def _multiprocess(self) -> bool:
        return jax.process_count() > 1

    def serve_remote_steps(self) -> None:
        """On processes > 0: run process 0's steps until it stops them."""
        while True:
            step = receive_step(self._new_buffers)
            if step is None:
                return
            batch, features = step
            t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
            _, kv, self.sampler_state = self.compiled.get(t, r, features)(
                self._params(), self._kv(), self.sampler_state, self._to_device(batch))
            self._set_kv(kv)

    def stop_remote_steps(self) -> None:
        if self._multiprocess and jax.process_index() == 0:
            broadcast_step(None)

    # -- compilation ----------------------------------------------------------------------------
    def _new_buffers(self, t: int, r: int, prompt_logprobs: bool,
                     structured: bool = False, verify: bool = False) -> StepBatch:
        return empty_step_batch(t, r, self.max_blocks, self.max_num_seqs, prompt_logprobs,
                                self.bitmask_width if structured else 0, self.num_spec, verify)

    def _lower(self, t: int, r: int, features: StepFeatures):
        """Lower one bucket and variant (any thread: the background compiler too). The KV
        caches and sampler state go in as shapes: the live arrays may be donated to a step
        meanwhile."""
        example = self._to_device(self._new_buffers(t, r, features.prompt_logprobs,
                                                    features.structured, features.verify))
        kv, sampler_state = _abstract((self._kv(), self.sampler_state))
        if self.stages is not None:
            kv_caches = kv[0] if self.draft_graphdef is not None else kv
            return lower_pipeline(self.graphdef, self.state, kv_caches, sampler_state,
                                  self._plan, self._stage_targets, example, features,
                                  self._stage_layerwise)
        if self.layerwise is not None:
            return self.layerwise.lower(t, r, features, self._params(), kv, sampler_state,
                                        example)
        jitted = jax.jit(partial(model_step, self.graphdef, features=features,
                                 draft_graphdef=self.draft_graphdef,
                                 draft_kind=self.draft_kind, max_model_len=self.max_model_len),
                         donate_argnums=(1, 2))
        return jitted.lower(self._params(), kv, sampler_state, example)

    def _params(self):
        if self.layerwise is not None:
            return self.layerwise.params(self.draft_state)
        return self.state if self.draft_graphdef is None else (self.state, self.draft_state)

    def _kv(self):
        return self.kv_caches if self.draft_graphdef is None else (self.kv_caches, self.draft_kv)

    def _set_kv(self, kv) -> None:
        if self.draft_graphdef is None:
            self.kv_caches = kv
        else:
            self.kv_caches, self.draft_kv = kv

    @property
    def num_compilations(self) -> int:
        return self.compiled.num_compilations

    @property
    def compile_seconds(self) -> float:
        return self.compiled.compile_seconds

    def warmup(self, progress=None, num_threads: int | None = None,
               buckets: str = "all") -> None:
        """Compile the plain variant's buckets ahead of time (into the persistent cache too):
        buckets="all": every one before returning; "start": the start-up set before
        returning (start_pairs), every other one after, in a background thread. Variants with
        logprobs / penalties / prompt_logprobs compile on first use (with a log line)."""
        bases = [self.base_features]
        if self.num_spec:  # steps with drafts to verify, and steps without
            bases.append(dataclasses.replace(self.base_features, verify=True))
        pairs = self.buckets.all_pairs()
        first = pairs if buckets == "all" or self._multiprocess else self.buckets.start_pairs()
        self.compiled.warmup([(t, r, f) for f in bases for t, r in first], progress,
                             num_threads)
        rest = [(t, r, f) for t, r in pairs for f in bases if (t, r) not in first]
        if not background_compile_enabled():
            rest = []  # (only the buckets steps ask for: the test suite's setting)
        self.compiled.start_background(rest)

    def close(self) -> None:
        """Stop background compilation (the engine core's shutdown)."""
        self.compiled.close()

    # -- one step -------------------------------------------------------------------------------
    def _apply_diff(self, so: SchedulerOutput) -> dict[str, str]:
        """Returns the new requests that could not be taken in (request id -> error): one
        request whose values do not fit its slot fails alone."""
        b = self.batch
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
        return failed

    def _buffers(self, t: int, r: int, prompt_logprobs: bool, structured: bool,
                 verify: bool = False) -> StepBatch:
        key = (t, r, prompt_logprobs, structured, verify)
        pair = self._host_buffers.get(key)
        if pair is None:
            pair = self._host_buffers[key] = [self._new_buffers(*key)
                                              for _ in range(self.num_host_buffers)]
        pair.append(pair.pop(0))  # the one used longest ago
        batch = pair[0]
        reset_step_batch(batch, self.max_num_seqs)
        return batch

    def _build(self, so: SchedulerOutput, grammar=None):
        b = self.batch
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
        features = StepFeatures(logprobs=bool(np.any(b.num_logprobs[slots] >= 0)),
                                penalties=penalties, prompt_logprobs=wants_pl,
                                structured=structured, spec=self.num_spec > 0, verify=verify)
        # Its bucket, or a ready larger one while its own is still to compile.
        t, r = self.compiled.choose(*self.buckets.pick(n_tok, n_req), features)
        batch = self._buffers(t, r, wants_pl, structured, verify)
        num_drafts = None
        if self.num_spec:
            num_drafts = np.zeros(n_req, np.int32)
            if spec:
                for i, rid in enumerate(req_ids):
                    drafts = spec.get(rid)
                    if drafts:
                        s, n0 = slots[i], b.num_tokens[slots[i]]
                        b.token_ids[s, n0 : n0 + len(drafts)] = drafts  # tokens to verify
                        num_drafts[i] = len(drafts)
        if structured:
            grammar_ids, grammar_bitmask = grammar
            row_of = {rid: i for i, rid in enumerate(req_ids)}
            batch.bitmask.fill(-1)
            batch.bitmask[[row_of[rid] for rid in grammar_ids]] = grammar_bitmask
        pos = fill_step_inputs(batch, b.token_ids, b.block_table, slots, computed, q_lens,
                               self.block_size)
        if num_drafts is not None:
            fill_verify_inputs(batch, num_drafts)
            batch.sample_rows[:n_req] = computed + q_lens >= b.num_tokens[slots]
            if self.draft_kind == "eagle":  # the token after each one, where known
                row = np.repeat(np.arange(n_req), q_lens)
                nxt = pos + 1
                known = nxt < (b.num_tokens[slots] + num_drafts)[row]
                batch.draft_input_ids[:n_tok] = np.where(
                    known, b.token_ids[slots[row], np.minimum(nxt, b.token_ids.shape[1] - 1)], 0)
        tok_slot = batch.token_slots[:n_tok]
        if wants_pl:
            has_next = pos + 1 < b.num_prompt_tokens[tok_slot]
            batch.next_token_ids[:n_tok] = np.where(
                has_next, b.token_ids[tok_slot, np.minimum(pos + 1, b.token_ids.shape[1] - 1)], 0)
        if penalties:
            batch.token_is_output[:n_tok] = pos >= b.num_prompt_tokens[tok_slot]
            resets = b.needs_reset[slots]
            batch.reset_slots[:n_req] = np.where(resets, slots, self.max_num_seqs)
        b.needs_reset[slots] = False  # penalty state matters only to steps that use it
        sm = batch.sampling
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            getattr(sm, name)[:n_req] = getattr(b, name)[slots]
        sm.seeds[:n_req] = b.seed[slots]
        sm.output_index[:n_req] = b.num_tokens[slots] - b.num_prompt_tokens[slots]
        # The token sampled by the step in flight (async scheduling) is read on the device.
        batch.from_last_sampled[:n_tok] = ((b.pending[tok_slot] > 0)
                                           & (pos == b.num_tokens[tok_slot] - 1))
        samples = computed + q_lens >= b.num_tokens[slots]  # else a partial prefill
        return _Built(batch, features, req_ids, slots, computed, samples, num_drafts)

    def dispatch(self, so: SchedulerOutput, grammar=None) -> "_InFlightStep | None":
        """Apply the diff, build the inputs and launch the step; does not wait for it. The
        rows that sample a real token count it at once (InputBatch.num_tokens / pending), so
        the next step can be built before this one is collected. None: nothing to run."""
        if so.scheduled_spec_decode_tokens and not self.num_spec:
            raise ValueError("draft tokens were scheduled, but speculative decoding is off")
        if self.kv_connector is not None and so.kv_connector_metadata:
            # Loads, saves and cancels start before the step: a gather is enqueued before
            # the step can overwrite its blocks.
            self.kv_connector.bind_connector_metadata(so.kv_connector_metadata)
        failed = self._apply_diff(so)
        if failed:
            self.failed_requests.update(failed)
            so, grammar = _without_requests(so, grammar, failed)
        if not so.num_scheduled_tokens:
            return None
        batch, features, req_ids, slots, computed, samples, num_drafts = self._build(so, grammar)
        t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
        # (a step compiling its bucket on the spot counts as running: background
        # compilation of buckets nobody asked for waits)
        self.compiled.step_started()
        try:
            compiled = self.compiled.get(t, r, features)
            if self._multiprocess:
                broadcast_step(batch, features)
            device_batch = self._to_device(batch)  # the one transfer in
            out, kv, self.sampler_state = compiled(self._params(), self._kv(),
                                                   self.sampler_state, device_batch)
        except BaseException:
            self.compiled.step_finished()
            raise
        self._set_kv(kv)
        b = self.batch
        positions = b.num_tokens[slots].copy()  # where each sampled token goes
        b.num_tokens[slots] += samples
        b.pending[slots] += samples
        return _InFlightStep(out, batch, req_ids, slots, computed, samples, positions,
                             b.num_logprobs[slots], b.num_prompt_logprobs[slots],
                             b.num_prompt_tokens[slots], num_drafts)

    def collect(self, step: "_InFlightStep | None") -> RunnerOutput:
        """Wait for a dispatched step and read its results back (the one transfer out)."""
        if step is None:
            return RunnerOutput(req_ids=(), sampled_token_ids=())
        try:
            out = jax.device_get(step.out)
        finally:
            self.compiled.step_finished()
        b = self.batch
        tokens = out["token_ids"]
        if "num_emitted" in out:
            self._collect_spec(out, step)
        else:
            for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
                # The slot may have been freed (finished) or re-used since the dispatch.
                if step.samples[i] and b.req_id_to_slot.get(rid) == s:
                    n = step.positions[i]
                    if n < b.token_ids.shape[1]:
                        b.token_ids[s, n] = tokens[i]
                    b.pending[s] -= 1
        prompt_lps = {}
        if "prompt_logprobs" in out:
            prompt_lps = self._prompt_logprobs(out["prompt_logprobs"], step)
        return self._to_runner_output(out, step, prompt_lps)

    def _collect_spec(self, out, step: "_InFlightStep") -> None:
        """Write each row's emitted tokens (accepted drafts + one) and roll its computed
        tokens back by the rejected drafts (their KV is garbage, recomputed later)."""
        b = self.batch
        tokens, emitted = out["token_ids"], out["num_emitted"]
        rows, slots = [], []
        for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
            if not step.samples[i] or b.req_id_to_slot.get(rid) != s:
                continue
            e = int(emitted[i])
            n = step.positions[i]
            m = min(e, b.token_ids.shape[1] - n)
            b.token_ids[s, n : n + m] = tokens[i, :m]
            b.num_tokens[s] += e - 1  # (the rejected drafts' KV: the scheduler rolls back)
            b.pending[s] -= 1
            rows.append(rid)
            slots.append(s)
        self._last_sampled_rows = (rows, np.array(slots, np.int32))
        if "drafts" in out:
            index = {rid: i for i, rid in enumerate(step.req_ids)}
            self._drafts = out["drafts"][[index[r] for r in rows]]

    def take_failed_requests(self) -> dict[str, str]:
        failed, self.failed_requests = self.failed_requests, {}
        return failed

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts for the requests that sampled in the step collected last (speculative
        decoding; empty when off). The scheduler filters and caps them."""
        rows, slots = self._last_sampled_rows
        self._last_sampled_rows = ([], np.zeros(0, np.int32))
        if self._drafts is not None:  # from the draft model, in the step itself
            drafts, self._drafts = self._drafts, None
            return {rid: d.tolist() for rid, d in zip(rows, drafts)}
        if self.proposer is None or not rows:
            return {}
        b = self.batch  # (the scheduler decides which requests may take drafts)
        try:
            drafts = self.proposer.propose(b.token_ids, slots, b.num_tokens[slots])
        except Exception:  # noqa: BLE001 - drafts are optional: this step goes without
            logger.exception("the n-gram proposer failed; no drafts this step")
            return {}
        return {rid: d for rid, d in zip(rows, drafts) if d}

    def set_kv_connector(self, worker) -> None:
        """Attach a KV connector's worker side: it reaches the cache only through a
        KVBlockIO (compiled gathers and scatters of whole blocks)."""
        from jaxinfer.runner.kv_block_io import KVBlockIO

        self.kv_connector = worker
        worker.register_block_io(KVBlockIO(self))

    def get_kv_connector_output(self):
        """Poll the connector: scatter loads that arrived into the cache (before any later
        step), report loads done or failed and blocks sent. None without a connector."""
        return None if self.kv_connector is None else self.kv_connector.get_finished()

    def execute(self, so: SchedulerOutput, grammar=None) -> RunnerOutput:
        """grammar: (request ids, int32 bitmask [n, ceil(V/32)]) of the rows sampling under a
        grammar (Scheduler.get_grammar_bitmask), or None."""
        return self.collect(self.dispatch(so, grammar))

    def _prompt_logprobs(self, pl_out, step: "_InFlightStep") -> dict:
        """Per request: Logprobs of the prompt tokens this step predicted (None for token 0)."""
        chosen, rank, top_ids, top_lps = pl_out
        batch = step.batch
        computed, qsl = step.computed, batch.attn.query_start_loc
        result = {}
        for i, rid in enumerate(step.req_ids):
            k = step.num_prompt_logprobs[i]
            n_prompt = step.num_prompt_tokens[i]
            if k < 0 or computed[i] >= n_prompt:
                continue
            entries = [None] if computed[i] == 0 else []
            for j in range(qsl[i], qsl[i + 1]):
                pos = computed[i] + (j - qsl[i])
                if pos + 1 >= n_prompt:
                    break
                entries.append(Logprobs(
                    token_id=int(batch.next_token_ids[j]), logprob=float(chosen[j]),
                    rank=int(rank[j]), top_ids=tuple(int(x) for x in top_ids[j, :k]),
                    top_logprobs=tuple(float(x) for x in top_lps[j, :k])))
            result[rid] = tuple(entries)
        return result

    def _to_runner_output(self, out, step: "_InFlightStep", prompt_lps) -> RunnerOutput:
        sampled, logprobs = [], {}
        token_ids = out["token_ids"].tolist()
        emitted = out.get("num_emitted")
        row_map = step.batch.row_map
        lp = out.get("logprobs")
        for i, rid in enumerate(step.req_ids):
            if not step.samples[i]:
                sampled.append(())  # partial prefill: no token
                continue
            if emitted is None:
                toks, flat = (token_ids[i],), (i,)
            else:
                e = int(emitted[i])
                toks, flat = tuple(token_ids[i][:e]), row_map[i, :e]
            sampled.append(toks)
            k = step.num_logprobs[i]
            if k >= 0:
                logprobs[rid] = tuple(Logprobs(
                    token_id=tok, logprob=float(lp.logprob[f]), rank=int(lp.rank[f]),
                    top_ids=tuple(int(x) for x in lp.top_ids[f, :k]),
                    top_logprobs=tuple(float(x) for x in lp.top_logprobs[f, :k]))
                    for tok, f in zip(toks, flat))
        return RunnerOutput(req_ids=tuple(step.req_ids), sampled_token_ids=tuple(sampled),
                            logprobs=logprobs, prompt_logprobs=prompt_lps)


def _abstract(tree):
    """Arrays -> ShapeDtypeStructs of the same shape, dtype and sharding (what lowering needs;
    a donated array keeps them)."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(one, tree)


class _Built(NamedTuple):
    """One step's inputs as _build made them."""

    batch: StepBatch
    features: StepFeatures
    req_ids: list[str]  # in row order
    slots: np.ndarray  # int32 [n_req]
    computed: np.ndarray  # int32 [n_req] tokens computed before the step
    samples: np.ndarray  # bool [n_req] the row samples a token (not a partial prefill)
    num_drafts: np.ndarray | None  # int32 [n_req] drafts to verify (spec decoding)


def _without_requests(so: SchedulerOutput, grammar, ids) -> tuple[SchedulerOutput, Any]:
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


@dataclasses.dataclass
class _InFlightStep:
    """A dispatched step: its device outputs and what collect() needs to read them."""

    out: dict  # device arrays: token_ids [R] (+ logprobs, prompt_logprobs)
    batch: StepBatch  # the host inputs (its buffer is not refilled before collect)
    req_ids: list[str]  # in row order
    slots: np.ndarray  # int32 [n_req] persistent slot per row
    computed: np.ndarray  # int32 [n_req] tokens computed before the step
    samples: np.ndarray  # bool [n_req] the row samples a real token (not a partial prefill)
    positions: np.ndarray  # int32 [n_req] the sampled token's position in the sequence
    # Per row, as at dispatch (the request may leave the batch before collect):
    num_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_tokens: np.ndarray  # int32 [n_req]
    num_drafts: np.ndarray | None = None  # int32 [n_req] drafts verified (spec decoding)

"""ModelRunner: the only host<->device boundary, and the orchestration of one step.

Per step: diff -> inputs -> dispatch -> collect. The SchedulerOutput diff goes into the
persistent InputBatch and the step's padded numpy inputs are built (step_builder.py) for the
(T, R) bucket picked; ONE transfer in; the compiled step of the engine's StepProgram runs
(step_program.py: whole steps, layer-wise, or pipeline stages; compiled_steps.py keeps the
compiled variants) over the StepState (step_state.py: weights, KV caches and sampler state,
the latter two donated); ONE transfer back of the sampled ids and logprobs (step_outputs.py).
The runner never asks how the step is compiled; in-step drafting (spec_step.py) and multi-host
replay (multihost.py) live in their own modules.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxinfer.core.token_masks import bitmask_width
from jaxinfer.outputs import RunnerOutput, SchedulerOutput
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.compiled_steps import CompiledSteps, background_compile_enabled
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.multihost import broadcast_step, receive_step
from jaxinfer.runner.step_builder import BuiltStep, StepBuilder, without_requests
from jaxinfer.runner.step_inputs import StepFeatures
from jaxinfer.runner.step_outputs import runner_output, write_accepted, write_sampled
from jaxinfer.runner.step_program import StepProgram
from jaxinfer.runner.step_state import abstract

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: its device outputs, its inputs, and where each sampled token goes."""

    out: dict  # device arrays: token_ids [R] (+ num_emitted, drafts, logprobs, prompt_logprobs)
    step: BuiltStep
    positions: np.ndarray  # int32 [n_req] the sampled token's position in the sequence
    weight_version: str | None = None  # the label of the weights it ran with (engine core)


class ModelRunner:
    def __init__(self, program: StepProgram, *, num_kv_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, kv_dtype,
                 buckets: BucketTable | None = None, speculative_config=None,
                 pipeline_depth: int = 1, logits_processors=(), lora=None,
                 pooling: str = "", multimodal=None, window_kv_blocks: int = 0):
        """program: how steps are compiled and run (step_program.make_step_program);
        pipeline_depth: step batches in flight at most (P under pipeline parallelism);
        logits_processors: custom LogitsProcessor instances (jaxinfer/logits_processors.py);
        lora: the LoRAManager of an engine serving adapters (lora/manager.py), or None;
        pooling: a pooling engine's pooling type (LAST / MEAN / CLS; "": a generating one);
        multimodal: a vision-language engine's MultiModalRunner (runner/multimodal.py);
        window_kv_blocks: blocks of the sliding layers' own pool (0: none, one pool)."""
        self.lora = lora
        self.mm = multimodal
        if multimodal is not None and jax.process_count() > 1:
            raise ValueError("images (a vision-language model) are not supported on "
                             "multi-host engines yet")
        self.program = program
        self.model_config = cfg = program.model_config
        self.mesh = program.mesh
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.buckets = buckets or BucketTable.build(max_num_batched_tokens, max_num_seqs)
        self.window_kv_blocks = window_kv_blocks
        self.state = program.init_state(num_kv_blocks, block_size, kv_dtype, max_num_seqs,
                                        window_kv_blocks)
        self.logits_processors = tuple(logits_processors)
        self.extra_args_keys = frozenset(k for p in self.logits_processors
                                         for k in p.extra_args_keys)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks,
                                self.logits_processors, window=window_kv_blocks > 0)
        # Speculative decoding: K drafts at most per request; every step verifies (the spec
        # variant). A draft model or EAGLE head drafts inside the step (its drafts come back
        # with the sampled tokens); else an n-gram proposer drafts from the tokens on the host.
        self.num_spec = speculative_config.num_speculative_tokens if speculative_config else 0
        self.base_features = StepFeatures(spec=self.num_spec > 0, pooling=pooling)
        self.pooling = pooling
        # MEAN / CLS pooling over chunks: request id -> its sum so far / its first token's
        # state, until the step that completes its prompt
        self._pool_partial: dict[str, np.ndarray] = {}
        drafter = getattr(program, "drafter", None)
        self.proposer = None
        if speculative_config is not None and drafter is None:
            from jaxinfer.spec_decode.ngram import NgramProposer

            self.proposer = NgramProposer(speculative_config.prompt_lookup_min,
                                          speculative_config.prompt_lookup_max, self.num_spec)
        self._drafts: np.ndarray | None = None  # [R, K] of the step collected last
        self._last_sampled_rows: tuple[list[str], np.ndarray] = ([], np.zeros(0, np.int32))
        self.builder = StepBuilder(self.batch, block_size=block_size, max_blocks=self.max_blocks,
                                   num_slots=max_num_seqs, bitmask_width=bitmask_width(cfg.vocab_size),
                                   num_spec=self.num_spec,
                                   eagle=drafter is not None and drafter.kind == "eagle",
                                   num_host_buffers=pipeline_depth + 1,
                                   logits_processors=self.logits_processors,
                                   lora=lora is not None, pooling=pooling, mm=multimodal)
        # Requests whose inputs could not be prepared (request id -> error), left out of the
        # step that dispatch() launched; the engine core finishes them with that error.
        self.failed_requests: dict[str, str] = {}
        self.kv_connector = None  # a KV connector's worker side (set_kv_connector)
        self.step_compilation = program.kind
        # Layer-wise steps are fused into whole-step programs in the background, per bucket
        # as steps use it (compiled_steps.py); not with background compilation off.
        fusable = hasattr(program, "lower_fused") and background_compile_enabled()
        self.compiled = CompiledSteps(self._lower, self.base_features, self._multiprocess,
                                      lower_fused=self._lower_fused if fusable else None)

    # -- the state, by name (KV connectors, stats and tests read it) ----------------------------
    @property
    def kv_caches(self):
        return self.state.kv

    @kv_caches.setter
    def kv_caches(self, kv) -> None:
        self.state = dataclasses.replace(self.state, kv=kv)

    @property
    def params(self):
        return self.state.params

    # -- multi-host: process 0 drives, the others replay its steps ------------------------------
    @property
    def _multiprocess(self) -> bool:
        return jax.process_count() > 1

    def serve_remote_steps(self) -> None:
        """On processes > 0: run process 0's steps until it stops them."""
        while True:
            step = receive_step(self.builder.new_buffers, self.logits_processors)
            if step is None:
                return
            batch, features = step
            features = dataclasses.replace(features, pooling=self.pooling)  # (engine-wide)
            t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
            _, self.state = self.compiled.get(t, r, features)(self.state,
                                                              self.program.place(batch))

    def stop_remote_steps(self) -> None:
        if self._multiprocess and jax.process_index() == 0:
            broadcast_step(None)

    # -- compilation ----------------------------------------------------------------------------
    def _example(self, t: int, r: int, features: StepFeatures):
        return self.program.place(self.builder.new_buffers(
            t, r, features.prompt_logprobs, features.structured, features.verify,
            features.bias, bool(features.logits_processors), features.mm))

    def _lower(self, t: int, r: int, features: StepFeatures):
        """Lower one bucket and variant (any thread: the background compiler too). The state
        goes in as shapes: the live KV caches and sampler state may be donated meanwhile."""
        return self.program.lower(t, r, features, abstract(self.state),
                                  self._example(t, r, features))

    def _lower_fused(self, t: int, r: int, features: StepFeatures):
        """The same bucket and variant as one whole program (layer-wise programs only)."""
        return self.program.lower_fused(features, abstract(self.state),
                                        self._example(t, r, features))

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
        # "all": no compiling once serving, so the decode buckets (what nearly every step
        # runs) are fused now too (layer-wise programs; see compiled_steps.py)
        fuse = ([(t, r, f) for f in bases for t, r in self.buckets.start_pairs()]
                if buckets == "all" else [])
        self.compiled.warmup([(t, r, f) for f in bases for t, r in first], progress,
                             num_threads, fuse=fuse)
        rest = [(t, r, f) for t, r in pairs for f in bases if (t, r) not in first]
        if not background_compile_enabled():
            rest = []  # (only the buckets steps ask for: the test suite's setting)
        self.compiled.start_background(rest)

    def start_background(self) -> None:
        """No warm-up: nothing compiled ahead, but (background compilation on) the thread
        that fuses the buckets steps use, and compiles those they pad up from, still runs."""
        if background_compile_enabled():
            self.compiled.start_background([])

    def close(self) -> None:
        """Stop background compilation (the engine core's shutdown)."""
        self.compiled.close()

    # -- one step -------------------------------------------------------------------------------
    def _choose_bucket(self, n_tok: int, n_req: int, features: StepFeatures) -> tuple[int, int]:
        """The step's bucket, or a ready larger one while its own is still to compile."""
        return self.compiled.choose(*self.buckets.pick(n_tok, n_req), features)

    def dispatch(self, so: SchedulerOutput, grammar=None) -> InFlightStep | None:
        if self._pool_partial and so.finished_req_ids:  # (aborted mid-prompt)
            for rid in so.finished_req_ids:
                self._pool_partial.pop(rid, None)
        return self._dispatch(so, grammar)

    def _dispatch(self, so: SchedulerOutput, grammar=None) -> InFlightStep | None:
        """Apply the diff, build the inputs and launch the step; does not wait for it. The
        rows that sample a real token count it at once (InputBatch.num_tokens / pending), so
        the next step can be built before this one is collected. None: nothing to run.
        grammar: (request ids, int32 bitmask [n, ceil(V/32)]) of the rows sampling under a
        grammar (Scheduler.get_grammar_bitmask), or None."""
        if so.scheduled_spec_decode_tokens and not self.num_spec:
            raise ValueError("draft tokens were scheduled, but speculative decoding is off")
        if self.kv_connector is not None and so.kv_connector_metadata:
            # Loads, saves and cancels start before the step: a gather is enqueued before
            # the step can overwrite its blocks.
            self.kv_connector.bind_connector_metadata(so.kv_connector_metadata)
        failed = self.builder.apply_diff(so)
        if self.mm is not None:
            failed.update(self.mm.apply(so, self.state.params))
        if failed:
            self.failed_requests.update(failed)
            so, grammar = without_requests(so, grammar, failed)
        lora_slots = None
        if self.lora is not None:
            so, grammar, lora_slots = self._activate_loras(so, grammar)
        if not so.num_scheduled_tokens:
            return None
        step = self.builder.build(so, grammar, self._choose_bucket, lora_slots)
        batch = step.batch
        t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
        # (a step compiling its bucket on the spot counts as running: background
        # compilation of buckets nobody asked for waits)
        self.compiled.step_started()
        try:
            compiled = self.compiled.get(t, r, step.features)
            if self._multiprocess:
                broadcast_step(batch, step.features)
            out, self.state = compiled(self.state, self.program.place(batch))  # one transfer in
        except BaseException:
            self.compiled.step_finished()
            raise
        b = self.batch
        positions = b.num_tokens[step.slots].copy()  # where each sampled token goes
        b.num_tokens[step.slots] += step.samples
        b.pending[step.slots] += step.samples
        return InFlightStep(out, step, positions)

    def _activate_loras(self, so: SchedulerOutput, grammar):
        """Put the step's adapters into device slots (new weights in the state; no
        recompilation); requests whose adapter cannot be loaded fail alone."""
        b = self.batch
        of = {rid: int(b.lora_id[b.req_id_to_slot[rid]]) for rid in so.num_scheduled_tokens}
        slots, params, failed = self.lora.activate({i for i in of.values() if i}, self.params)
        self.state = dataclasses.replace(self.state, params=params)
        if failed:
            bad = {rid: f"LoRA adapter error: {failed[i]}" for rid, i in of.items()
                   if i in failed}
            self.failed_requests.update(bad)
            so, grammar = without_requests(so, grammar, bad)
        return so, grammar, slots

    def collect(self, inflight: InFlightStep | None) -> RunnerOutput:
        """Wait for a dispatched step and read its results back (the one transfer out)."""
        if inflight is None:
            return RunnerOutput(req_ids=(), sampled_token_ids=())
        try:
            out = jax.device_get(inflight.out)
        finally:
            self.compiled.step_finished()
        if "num_emitted" in out:
            self._last_sampled_rows, drafts = write_accepted(self.batch, out, inflight.step,
                                                             inflight.positions)
            if drafts is not None:
                self._drafts = drafts
        else:
            write_sampled(self.batch, out, inflight.step, inflight.positions)
        ro = runner_output(out, inflight.step)
        if "pooled" in out:
            ro.pooled.update(self._pooled(out["pooled"], inflight.step))
        return ro

    def _pooled(self, pooled: np.ndarray, step) -> dict[str, bytes]:
        """The vectors of the requests whose prompt this step completed; MEAN adds each
        chunk's sum to the request's (restarting at position 0: a preempted request is
        recomputed), CLS keeps the state of position 0."""
        done: dict[str, bytes] = {}
        partial = self._pool_partial
        for i, rid in enumerate(step.req_ids):
            row, first = pooled[i], step.computed[i] == 0
            if self.pooling == "MEAN":
                row = row if first else partial.get(rid, 0) + row
            elif self.pooling == "CLS" and not first:
                row = partial.get(rid, row)
            if step.samples[i]:
                partial.pop(rid, None)
                if self.pooling == "MEAN":
                    row = row / max(int(step.num_prompt_tokens[i]), 1)
                done[rid] = np.asarray(row, np.float32).tobytes()
            elif self.pooling != "LAST":
                partial[rid] = row
        return done

    def execute(self, so: SchedulerOutput, grammar=None) -> RunnerOutput:
        return self.collect(self.dispatch(so, grammar))

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

    # -- KV connectors ----------------------------------------------------------------------------
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

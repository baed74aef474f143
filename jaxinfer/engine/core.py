"""EngineCore: a scheduler and a worker, with no tokenizer (vLLM V1's engine core).

It takes EngineCoreRequests (token ids + sampling parameters) and returns EngineCoreOutputs
(new token ids, finish reasons, logprobs). The front end (LLMEngine / AsyncLLM) does text.
A client drives it: in this process (InprocClient) or in its own process (core_proc.py),
where `run_busy_loop` serves two queues fed by socket I/O threads. The worker (runner/
worker.py) holds the devices, the model and the runner; this module imports no jax.

One step loop for every mode, keyed by how many step batches may be in flight: 1
(synchronous), 2 (async scheduling: step N+1 is dispatched before step N's sampled ids are
read; the runner patches them into N+1's inputs on the device and the scheduler counts the
token in flight, Request.num_output_placeholders) or P (pipeline parallelism: P batches, no
request in two of them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
import traceback
from collections import deque

from jaxinfer.config import ResolvedConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest
from jaxinfer.outputs import EngineCoreOutput, SchedulerOutput
from jaxinfer.request import FinishReason, Request, RequestStatus
from jaxinfer.validation import check_core_request

logger = logging.getLogger(__name__)


def _tokenizer_source(tokenizer_dir: str):
    """(tokenizer.json text, EOS id) of the model's tokenizer, read when a grammar first needs
    it (the core has no tokenizer otherwise)."""
    def load():
        from jaxinfer.tokenizer import Tokenizer

        tok = Tokenizer(tokenizer_dir)
        return tok.backend_json(), tok.eos_token_id
    return load


class EngineCore:
    """Scheduler + worker over `devices` (default: all of this process's JAX devices; a data-
    parallel rank passes its own subset)."""

    def __init__(self, rc: ResolvedConfig, devices=None):
        from jaxinfer.runner.worker import Worker

        cfg = rc.engine
        self.resolved = rc
        self.worker = Worker(rc, devices)
        self.runner = self.worker.runner
        cache, sched = rc.cache, rc.scheduler
        block_size = self.worker.block_size  # (None resolved for these devices)
        spec = cfg.speculative_config
        kv = KVCacheManager(self.worker.num_kv_blocks, block_size, rc.max_model_len,
                            enable_caching=cache.enable_prefix_caching,
                            hash_algo=cache.prefix_caching_hash_algo, hash_seed=cache.hash_seed,
                            window=self.worker.sliding_window,
                            window_blocks=self.worker.window_kv_blocks,
                            window_margin=spec.num_speculative_tokens if spec else 0)
        self.structured_output_manager = None
        if rc.tokenizer_dir is not None:
            from jaxinfer.structured_output import StructuredOutputManager

            self.structured_output_manager = StructuredOutputManager(
                cfg.structured_outputs_config, _tokenizer_source(rc.tokenizer_dir),
                self.model_config.vocab_size)
        kv_worker = kv_sched = None
        kvt = cfg.kv_transfer_config
        if kvt is not None:
            from jaxinfer.kv_connector import create_connector, model_fingerprint

            if self.worker.num_processes > 1:
                raise ValueError("kv_transfer_config is not supported with multi-host engines "
                                 "yet (the connector runs on process 0 only)")
            kv_sched, kv_worker = create_connector(
                kvt, block_size=block_size, device=self.worker.devices[0],
                fingerprint=model_fingerprint(os.path.basename(os.path.normpath(rc.model_dir)),
                                              self.model_config, block_size,
                                              self.worker.kv_dtype))
        self.scheduler = Scheduler(sched, kv, kv_connector=kv_sched,
                                   structured_output_manager=self.structured_output_manager,
                                   speculative_config=spec,
                                   vocab_size=self.model_config.vocab_size)
        if kvt is not None:
            self.scheduler.kv_load_failure_policy = kvt.kv_load_failure_policy
        pp = rc.parallel.pipeline_parallel_size
        # Step batches in flight at most: 1 (sync), 2 (async scheduling), P (pipeline
        # parallelism; the scheduler then puts no request into two batches in flight).
        self.async_scheduling = bool(cfg.async_scheduling)
        self.max_in_flight = pp if pp > 1 else (2 if self.async_scheduling else 1)
        self.scheduler.pipeline_depth = pp
        if cfg.enable_lora:
            self.scheduler.max_loras = cfg.max_loras
        self.max_batches_in_flight = 0  # (the most seen; benchmarks/pipeline_parallel.py)
        if self.runner.mm is not None:
            self.scheduler.enable_encoder_cache()
        if kv_worker is not None:
            self.runner.set_kv_connector(kv_worker)
        self.kv_connector = kv_worker
        self.speculative = spec is not None
        t0 = time.perf_counter()
        if cfg.warmup:
            self.runner.warmup(buckets=cfg.warmup_buckets)
        else:
            self.runner.start_background()
        self.startup = dict(self.worker.timings, warmup_s=time.perf_counter() - t0,
                            warmup_compilations=self.runner.num_compilations,
                            step_compilation=self.runner.step_compilation)
        if cfg.warmup:
            cache = self.worker.cache_counts()
            logger.info("warm-up: %d step variants compiled in %.1fs (%s steps); %d of %d "
                        "executables came from the persistent compilation cache; %d buckets "
                        "left to compile in the background", self.runner.num_compilations,
                        self.startup["warmup_s"], self.runner.step_compilation,
                        cache["compile_cache_hits"], cache["compile_cache_requests"],
                        self.runner.compiled.background_left)
        # Steps dispatched and not yet collected: (SchedulerOutput, the runner's handle).
        self._in_flight: deque = deque()
        # RL rollouts (pause / resume, weight updates, sleep): "running", "draining" (pause
        # mode "wait": requests already in run to the end, new ones are held) or "paused"
        # (nothing is scheduled); requests that arrived while not running wait in _held.
        self.pause_state = "running"
        self._clear_cache_when_drained = False
        self._held: list[Request] = []
        self._pending_outputs: list[EngineCoreOutput] = []  # (requests a pause aborted)
        self.weight_version: str | None = None  # the label of the weights (None: "default")
        self.num_weight_updates = 0
        self.sleep_level: int | None = None  # None: awake
        # Host time per step (schedule + build + dispatch + collect bookkeeping + update), and
        # the time the host waited on the device: for benchmarks/async_scheduling.py.
        self.step_timings: list[tuple[float, float]] | None = None

    # -- the worker's facts (tests and benchmarks read them here) -------------------------------
    @property
    def model_config(self):
        return self.worker.model_config

    @property
    def pp_partition(self):
        return self.worker.pp_partition

    @property
    def devices(self):
        return self.worker.devices

    @property
    def is_worker(self) -> bool:
        """Multi-host: processes > 0 only replay process 0's steps (run_worker_loop)."""
        return self.worker.is_follower

    def run_worker_loop(self) -> None:
        """Multi-host, processes > 0: execute process 0's steps until it shuts down."""
        self.runner.serve_remote_steps()

    def ready_info(self) -> dict:
        """What the front end learns at start-up (it validates requests against it)."""
        return {"num_kv_blocks": self.runner.num_kv_blocks,
                "num_usable_kv_blocks": self.scheduler.kv.num_usable_blocks,
                "block_size": self.scheduler.kv.block_size,
                "num_compilations": self.runner.num_compilations,
                "startup": dict(self.startup)}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. The front end's Processor is where requests are validated; here
        only the values that reach device arrays are checked again against their ranges (the
        same functions: validation.check_core_request), so that a request that bypassed a
        front end fails alone (ValueError, that request only) instead of failing a step."""
        check_core_request(req, vocab_size=self.model_config.vocab_size,
                           max_model_len=self.resolved.max_model_len,
                           extra_args_keys=self.runner.extra_args_keys)
        if req.mm_features:
            from jaxinfer.multimodal.inputs import check_features

            mc = self.model_config
            images = self.runner.mm is not None
            check_features(req.mm_features, req.prompt_token_ids,
                           image_token_id=mc.image_token_id if images else None,
                           patch_dim=mc.vision.patch_dim if images else 0,
                           merge=mc.vision.spatial_merge_size if images else 1,
                           grid=getattr(mc.vision, "grid", None) if images else None)
            if self.kv_connector is not None:
                raise ValueError("mm_features: images cannot be combined with a KV connector "
                                 "(kv_transfer_config) yet")
        if req.lora_request is not None:  # (loaded now: a bad adapter fails this request)
            self.add_lora(req.lora_request)
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_id=req.eos_token_id, arrival_time=req.arrival_time,
            priority=req.priority, cache_salt=req.cache_salt, sampling_seed=req.sampling_seed,
            structured_backend=req.structured_backend, parent_id=req.parent_id,
            reasoning_end_ids=req.reasoning_end_ids, lora_request=req.lora_request,
            mm_features=req.mm_features)
        if self.pause_state != "running":
            self._held.append(request)  # (scheduled once generation resumes)
        else:
            self.scheduler.add_request(request)

    # -- LoRA adapters (enable_lora) ---------------------------------------------------------
    def _lora(self):
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True "
                             "(--enable-lora)")
        return self.runner.lora

    def add_lora(self, lora_request) -> bool:
        """Load an adapter (ValueError naming it and the reason when it cannot be served);
        False when it was already loaded."""
        from jaxinfer.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):  # (a utility call's decoded tuple)
            lora_request = LoRARequest(*lora_request)
        return self._lora().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; refused while a request that uses it is unfinished."""
        users = [r for r in self.scheduler.requests.values() if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {len(users)} "
                             "unfinished request(s)")
        return self._lora().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora().list()

    def abort_requests(self, request_ids, status=RequestStatus.FINISHED_ABORTED) -> None:
        if self._held:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            self._held = [r for r in self._held if r.request_id not in ids]
        self.scheduler.finish_requests(request_ids, status)

    def has_work(self) -> bool:
        if self._pending_outputs or self._in_flight:
            return True
        if self.pause_state == "paused":
            return False
        return self.scheduler.has_unfinished_requests() or self.has_kv_work()

    def has_kv_work(self) -> bool:
        """KV transfers under way (loads, blocks held for a pull, work not handed over)."""
        return self.kv_connector is not None and (self.scheduler.has_pending_kv_work()
                                                  or self.kv_connector.has_pending_work())

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One turn of the loop: while fewer than max_in_flight batches are in flight and some
        request can go into a new one, schedule and dispatch a batch (the device runs it
        while the host goes on); once the queue is full, or nothing more can go in, collect
        the oldest batch and apply its outputs (oldest first). Synchronous stepping is the
        case of one batch: schedule, run, read back, update.

        The grammar barrier (async scheduling): a request with a grammar that samples in the
        step in flight needs that step's token before its next mask can be filled, so every
        step in flight is collected first (pipeline parallelism never schedules a request
        that is in flight, so it needs no barrier)."""
        sched = self.scheduler
        depth = self.max_in_flight
        if self.pause_state == "paused":  # (kept requests stay as they are; nothing new runs)
            return self._finish_step(self._collect_in_flight(), False)
        if self.async_scheduling and self._in_flight and sched.last_step_sampled_grammars():
            return self._grammar_barrier()
        t0 = time.perf_counter()
        dispatched = False
        # (one batch: schedule whenever stepped, even with only KV transfers under way: the
        # scheduler output carries the connector's work)
        if len(self._in_flight) < depth and (depth == 1 or sched.has_schedulable_requests()):
            so = self._schedule()
            handle = self.runner.dispatch(so, sched.get_grammar_bitmask())
            self._fail_step_requests()
            if handle is not None:
                handle.weight_version = self.weight_version  # (the weights it runs with)
            if handle is not None or depth == 1:
                for other, _ in (self._in_flight if sched.pipeline_depth > 1 else ()):
                    # (pipeline: the invariant the scheduler keeps; tests assert it too)
                    assert not (other.num_scheduled_tokens.keys()
                                & so.num_scheduled_tokens.keys()), "request in two batches"
                self._in_flight.append((so, handle))
                self.max_batches_in_flight = max(self.max_batches_in_flight,
                                                 len(self._in_flight))
                dispatched = handle is not None
        if not self._in_flight:
            return self._finish_step([], dispatched)
        if dispatched and len(self._in_flight) < depth and sched.has_schedulable_requests():
            return self._finish_step([], True)  # fill the queue first
        so, handle = self._in_flight.popleft()
        t1 = time.perf_counter()
        ro = self.runner.collect(handle)
        t2 = time.perf_counter()
        outs = self._stamp(sched.update_from_output(so, ro), handle, ro)
        if self.speculative:
            sched.update_draft_token_ids(self.runner.take_draft_token_ids())
        if self.step_timings is not None and handle is not None:
            self.step_timings.append(((t1 - t0) + (time.perf_counter() - t2), t2 - t1))
        return self._finish_step(outs, handle is not None)

    def _grammar_barrier(self) -> list[EngineCoreOutput]:
        """Collect every step in flight, then fill the masks and dispatch the next step (it
        runs while the caller processes these outputs)."""
        outs = self._collect_in_flight()
        if self.scheduler.has_unfinished_requests():
            so = self._schedule()
            handle = self.runner.dispatch(so, self.scheduler.get_grammar_bitmask())
            self._fail_step_requests()
            if handle is not None:
                handle.weight_version = self.weight_version
                self._in_flight.append((so, handle))
        return self._finish_step(outs, True)

    def _collect_in_flight(self) -> list[EngineCoreOutput]:
        """Collect every step in flight, oldest first, and apply its outputs."""
        outs: list[EngineCoreOutput] = []
        while self._in_flight:
            so, handle = self._in_flight.popleft()
            ro = self.runner.collect(handle)
            outs += self._stamp(self.scheduler.update_from_output(so, ro), handle, ro)
        return outs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next batch; the time a request is first scheduled is noted (its
        queue time, in the server's metrics)."""
        so = self.scheduler.schedule()
        if so.scheduled_new_reqs:
            now, requests = time.time(), self.scheduler.requests
            for new in so.scheduled_new_reqs:
                request = requests.get(new.req_id)
                if request is not None and request.first_scheduled_time is None:
                    request.first_scheduled_time = now
        return so

    @staticmethod
    def _stamp(outs: list[EngineCoreOutput], handle, ro=None) -> list[EngineCoreOutput]:
        """Label the tokens with the weights that sampled them (once weights changed); a
        pooling engine's outputs carry their pooled vectors."""
        if ro is not None and ro.pooled:
            outs = [dataclasses.replace(o, pooled=ro.pooled[o.request_id])
                    if o.request_id in ro.pooled else o for o in outs]
        version = getattr(handle, "weight_version", None)
        if version is None:
            return outs
        return [dataclasses.replace(o, weight_version=version) if o.new_token_ids else o
                for o in outs]

    def _fail_step_requests(self) -> None:
        """Requests that failed while the step was prepared (their grammar mask, their input
        slot, the KV connector) end with their error; the step ran without them."""
        errors = self.scheduler.take_step_failures()
        errors.update(self.runner.take_failed_requests())
        if errors:
            self.scheduler.fail_requests(errors)

    def _finish_step(self, outs: list[EngineCoreOutput], ran: bool) -> list[EngineCoreOutput]:
        if self.kv_connector is not None:
            conn = self.scheduler.kv_connector
            if conn.has_pending_work():
                # Work that arose after the step was scheduled (the blocks of requests that
                # just finished): hand it over now rather than with the next step.
                self.kv_connector.bind_connector_metadata(conn.build_connector_meta())
            self.scheduler.update_connector_output(self.runner.get_kv_connector_output())
        extra = self.scheduler.take_extra_outputs()
        if self._pending_outputs:
            extra, self._pending_outputs = extra + self._pending_outputs, []
        if self.pause_state == "draining" and not self.scheduler.has_unfinished_requests() \
                and not self._in_flight:
            self._paused_now(self._clear_cache_when_drained)
        if extra:
            outs = outs + extra
        elif not ran and not outs and (self.scheduler.has_unfinished_requests()
                                       or self.has_kv_work()):
            # Nothing could be scheduled (grammars compiling, KV arriving): no hot spin.
            time.sleep(0.0005 if self.scheduler.get_num_unfinished_requests() else 0.005)
        return outs

    def batches_in_flight(self) -> list[list[str]]:
        """The request ids of each batch in flight, oldest first."""
        return [list(so.num_scheduled_tokens) for so, _ in self._in_flight]

    # -- utilities (callable from clients by name) ----------------------------------------------
    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        stats["num_free_kv_blocks"] = self.scheduler.kv.get_num_free_blocks()
        stats["num_kv_blocks"] = self.runner.num_kv_blocks
        window = self.scheduler.kv.window
        if window is not None:  # the sliding layers' own pool (core/window_blocks.py)
            stats["num_window_kv_blocks"] = window.pool.num_blocks
            stats["num_free_window_kv_blocks"] = window.pool.get_num_free_blocks()
        stats["attention_backend"] = self.worker.attention_backend
        stats.update(getattr(self.worker, "memory", {}))
        stats["num_compilations"] = self.runner.num_compilations
        stats["compile_seconds"] = self.runner.compile_seconds
        stats["num_buckets_compiling_in_background"] = self.runner.compiled.background_left
        compiled = self.runner.compiled
        stats["num_padded_up_steps"] = compiled.num_padded_steps
        stats["num_steps"] = compiled.num_steps
        stats["num_layerwise_steps"] = compiled.num_layerwise_steps  # (not yet fused)
        stats["num_fused_buckets"] = compiled.num_fused
        stats["fuse_seconds"] = compiled.fuse_seconds
        stats["background_settled"] = compiled.settled()  # (nothing left to compile or fuse)
        stats.update(self.worker.cache_counts())
        som = self.structured_output_manager
        if som is not None:
            stats["num_grammar_compiles"] = som.num_compiles
            stats["grammar_compile_seconds"] = som.compile_seconds
            stats["num_grammar_rejections"] = self.scheduler.num_grammar_rejections
        if self.kv_connector is not None:
            w, sch = self.kv_connector, self.scheduler
            stats["kv_connector_loaded_tokens"] = sch.num_kv_loaded_tokens
            stats["kv_connector_load_failures"] = sch.num_kv_load_failures
            stats["kv_connector_blocks_held"] = sum(
                len(sch.kv.req_to_blocks.get(r, ())) for r in sch.delayed_free)
            stats["kv_connector_bytes_moved"] = w.io.bytes_moved
            stats["kv_connector_expired_sends"] = getattr(w, "num_expired_sends", 0)
        stats["weight_version"] = self.get_weight_version()
        stats["num_weight_updates"] = self.num_weight_updates
        stats["pause_state"] = self.pause_state
        stats["num_held_requests"] = len(self._held)
        stats["sleep_level"] = self.sleep_level
        stats["time"] = time.time()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def leak_report(self) -> list[str]:
        """What is still held although no request is live (empty when all is well)."""
        s, kv = self.scheduler, self.scheduler.kv
        if self._in_flight and not (s.requests or s.running or len(s.waiting)):
            # (async scheduling: a step dispatched before its requests finished stays in
            # flight until the loop's next turn; it has no live request to give a token to)
            self._collect_in_flight()
        problems = []
        if s.delayed_free:
            problems.append(f"blocks held for KV transfers: {sorted(s.delayed_free)}")
        if s.requests or s.running or len(s.waiting):
            problems.append(f"requests left: {sorted(s.requests)}")
        if self._in_flight:
            problems.append(f"{len(self._in_flight)} steps in flight")
        if self._held:
            problems.append(f"requests held by a pause: {[r.request_id for r in self._held]}")
        if kv.get_num_free_blocks() != self.runner.num_kv_blocks - 1:
            problems.append(f"free blocks {kv.get_num_free_blocks()} != "
                            f"{self.runner.num_kv_blocks - 1}")
        if kv.req_to_blocks or kv.num_cached_blocks:
            problems.append(f"block lists left: {sorted(kv.req_to_blocks)}")
        w = kv.window
        if w is not None and (w.pool.get_num_free_blocks() != w.pool.num_blocks - 1
                              or w.req_to_blocks or w.new_ids):
            problems.append(f"sliding-window blocks held: {sorted(w.req_to_blocks)}, free "
                            f"{w.pool.get_num_free_blocks()} of {w.pool.num_blocks - 1}")
        return problems

    # -- RL rollouts: pause / resume, weight updates, sleep / wake up (docs/rl.md) -------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> str:
        """Stop generating; new requests are held until resume_generation. mode "abort":
        every unfinished request ends now (finish_reason "abort"); "wait": they run to the
        end first (the pause state is "draining" until then); "keep": they stay where they
        are, their KV cache kept, and continue after resume. clear_cache: reset the prefix
        cache once paused (not with "keep"). Returns the pause state ("paused" or
        "draining")."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            ids = list(self.scheduler.requests)
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs += [EngineCoreOutput(rid, (), FinishReason.ABORT)
                                      for rid in ids]
        if mode == "wait" and self.scheduler.has_unfinished_requests():
            self.pause_state = "draining"
            self._clear_cache_when_drained = clear_cache
        else:
            self._paused_now(clear_cache and mode != "keep")
        return self.pause_state

    def _paused_now(self, clear_cache: bool) -> None:
        self.pause_state = "paused"
        if clear_cache:
            self.scheduler.kv.reset_prefix_cache(force=True)

    def resume_generation(self) -> None:
        """Schedule again: kept requests continue, held ones are queued (arrival order)."""
        if self.sleep_level:
            raise ValueError("the engine is asleep: wake_up first")
        self.sleep_level = None  # (a level-0 sleep is only a pause)
        self.pause_state = "running"
        held, self._held = self._held, []
        for request in held:
            self.scheduler.add_request(request)

    def is_paused(self) -> bool:
        return self.pause_state != "running"

    def get_pause_state(self) -> str:
        return self.pause_state

    def _weights_changed(self, result: dict, weight_version: str | None) -> dict:
        """After an update: KV and image encoder outputs computed with the old weights are
        never reused (every cached block forgotten, the blocks of running requests too; the
        encoder cache emptied), and the new label."""
        self.scheduler.kv.reset_prefix_cache(force=True)
        if self.scheduler.encoder_cache is not None:
            self.scheduler.encoder_cache.reset()
        self.num_weight_updates += 1
        self.weight_version = (str(weight_version) if weight_version is not None
                               else str(self.num_weight_updates))
        return dict(result, weight_version=self.weight_version)

    def update_weights(self, weights, layout: str = "hf",
                       weight_version: str | None = None) -> dict:
        """Swap in new weights between two steps (runner/weights.py): `weights` maps HF
        checkpoint names (layout "hf") or the engine's own parameter paths ("engine") to
        arrays. All or nothing: a bad tensor raises and the old weights keep serving."""
        return self._weights_changed(self.worker.update_weights(weights, layout),
                                     weight_version)

    def update_weights_from_path(self, path: str, weight_version: str | None = None) -> dict:
        """Update from a safetensors folder (the way across processes)."""
        return self._weights_changed(self.worker.update_weights_from_path(path),
                                     weight_version)

    def update_weights_from_transfer(self, payload: dict,
                                     weight_version: str | None = None) -> dict:
        """Pull a WeightSender's offer over JAX's transfer API (another process or host)."""
        return self._weights_changed(self.worker.update_weights_from_transfer(payload),
                                     weight_version)

    def reload_weights(self, weight_version: str | None = None) -> dict:
        """The model's own checkpoint again (after sleep level 2, or to undo updates)."""
        return self.update_weights_from_path(self.resolved.model_dir, weight_version)

    def set_weight_version(self, weight_version: str) -> None:
        self.weight_version = str(weight_version)

    def get_weight_version(self) -> str:
        return self.weight_version or "default"

    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """Pause (mode as pause_generation), then free device memory: level 1 copies the
        weights to host memory and frees them and the KV cache; level 2 frees both without a
        copy. Level 0 only pauses. Returns the live bytes before and after."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if self.sleep_level is not None:
            raise ValueError(f"the engine is already asleep (level {self.sleep_level})")
        if level and not self.resolved.engine.enable_sleep_mode:
            raise ValueError("sleep levels 1 and 2 need enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if level and mode == "keep" and self.scheduler.has_unfinished_requests():
            raise ValueError("sleep frees the KV cache: mode='keep' cannot keep the "
                             f"{self.scheduler.get_num_unfinished_requests()} unfinished "
                             "request(s); pause_generation(mode='keep') keeps them")
        if level and mode == "wait" and self.scheduler.has_unfinished_requests():
            raise ValueError("sleep(mode='wait'): pause_generation(mode='wait') first and "
                             "sleep once it is paused (the front ends do so)")
        if level and self.kv_connector is not None:
            raise ValueError("sleep levels 1 and 2 are not supported with a KV connector")
        self.pause_generation(mode, clear_cache=bool(level))
        result = {"level": level}
        if level:
            self._pending_outputs += self._collect_in_flight()  # (they read the KV cache)
            self.scheduler.kv.reset_prefix_cache(force=True)  # (the KV cache goes away)
            result = self.worker.sleep(level)
        self.sleep_level = level
        return result

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights" and / or "kv_cache" (None: all); once all is back,
        generation resumes. Returns whether the engine is fully awake."""
        if tags is not None:
            bad = [t for t in tags if t not in WAKE_TAGS]
            if bad:
                raise ValueError(f"wake_up tag {bad[0]!r} is not one of {', '.join(WAKE_TAGS)}")
            tags = [t for t in tags if t != "scheduling"]
        if self.sleep_level is None:
            return True
        if self.sleep_level and (tags is None or tags):
            self.worker.wake_up(tags)
        if self.sleep_level and self.worker.weights.sleeping_tags:
            return False
        self.sleep_level = None
        self.resume_generation()
        return True

    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def collective_rpc(self, method: str, args=(), kwargs=None) -> list:
        """Call a public method of the worker (every worker of this core: one); returns
        their results in a list. A callable is called with the worker first (in-process
        only: nothing but names crosses a process boundary)."""
        if callable(method):
            return [method(self.worker, *args, **(kwargs or {}))]
        if method in _CORE_OWNED:  # (the core's bookkeeping goes with them: call those)
            raise ValueError(f"collective_rpc({method!r}): call the engine's {method}() "
                             "instead (it pauses, resets the prefix cache, labels versions)")
        if not isinstance(method, str) or method.startswith("_") or \
                not callable(getattr(self.worker, method, None)):
            raise ValueError(f"the worker has no public method {method!r}")
        try:
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        except Exception as e:  # (the caller's method and arguments: its error, not ours)
            raise ValueError(f"collective_rpc({method!r}) failed: {type(e).__name__}: "
                             f"{e}") from None

    def profile_steps(self, enable: bool = True) -> list:
        """Start recording (host seconds, device-wait seconds) per step; returns what was
        recorded so far and clears it."""
        done = self.step_timings or []
        self.step_timings = [] if enable else None
        return done

    def shutdown(self) -> None:
        self.runner.close()
        self.worker.compile_cache.close()
        self.runner.stop_remote_steps()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    # -- the busy loop (engine-core process, or a background thread) ----------------------------
    def run_busy_loop(self, inputs: "queue.Queue", outputs: "queue.Queue") -> None:
        """Serve `inputs` until a None arrives. Items: ("add", EngineCoreRequest),
        ("abort", [ids]), ("utility", (call_id, name, args)). Puts EngineCoreOutputs on
        `outputs`: one per step that produced something, one for each utility call, and one
        with fresh stats whenever the core goes idle. A failing step ends the loop with an
        engine_error (the front end then fails every request: nothing hangs)."""
        stats_sent = True
        while True:
            try:
                item = inputs.get(block=not self.has_work())
            except queue.Empty:
                item = ()
            while item != ():
                if item is None:
                    return
                stats_sent = False
                self._handle_input(item, outputs)
                try:
                    item = inputs.get_nowait()
                except queue.Empty:
                    item = ()
            if self.has_work():
                kv_busy = self.has_kv_work()
                try:
                    outs = self.step()
                except Exception:
                    tb = traceback.format_exc()
                    logger.error("engine core step failed:\n%s", tb)
                    outputs.put(EngineCoreOutputs(engine_error=f"engine core step failed:\n{tb}"))
                    return
                if outs:
                    outputs.put(EngineCoreOutputs(outputs=outs, stats=self.get_stats()))
                    stats_sent = True
                elif kv_busy:
                    stats_sent = False  # blocks may have been freed: publish when idle
            if not stats_sent and not self.has_work():
                outputs.put(EngineCoreOutputs(stats=self.get_stats()))
                stats_sent = True

    def _handle_input(self, item, outputs: "queue.Queue") -> None:
        kind, arg = item
        if kind == "add":
            try:
                self.add_request(arg)
            except Exception as e:  # the front end validates first; never leave it waiting
                logger.error("engine core refused request %s: %s", arg.request_id, e)
                outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    arg.request_id, (), FinishReason.ERROR, stop_reason=f"refused: {e}")]))
        elif kind == "refuse":  # a request the input thread could not decode
            rid, error = arg
            outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                rid, (), FinishReason.ERROR, stop_reason=error)]))
        elif kind == "abort":
            self.abort_requests(arg)
        elif kind == "utility":
            call_id, name, args = arg
            try:
                if name.startswith("_") or name not in UTILITIES:
                    raise AttributeError(f"EngineCore has no utility {name!r}")
                result, err = getattr(self, name)(*args), None
            except Exception as e:
                result, err = None, f"{type(e).__name__}: {e}"
            outputs.put(EngineCoreOutputs(utility_output=(call_id, result, err),
                                          stats=self.get_stats()))
        else:
            raise ValueError(f"unknown engine core input {kind!r}")


UTILITIES = ("get_stats", "reset_prefix_cache", "leak_report", "profile_steps", "ready_info",
             "add_lora", "remove_lora", "list_loras", "pause_generation", "resume_generation",
             "is_paused", "get_pause_state", "update_weights", "update_weights_from_path",
             "update_weights_from_transfer",
             "reload_weights", "set_weight_version", "get_weight_version", "sleep", "wake_up",
             "is_sleeping", "collective_rpc")
PAUSE_MODES = ("abort", "wait", "keep")
_CORE_OWNED = ("sleep", "wake_up", "update_weights", "update_weights_from_path",
               "update_weights_from_transfer")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")

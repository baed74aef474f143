"""EngineCore: the scheduler and the model runner, with no tokenizer (vLLM V1's engine core).

It takes EngineCoreRequests (token ids + sampling parameters) and returns EngineCoreOutputs
(new token ids, finish reasons, logprobs). The front end (LLMEngine / AsyncLLM) does text.
A client drives it: in this process (InprocClient) or in its own process (core_client.py),
where `run_busy_loop` serves two queues fed by socket I/O threads.

Async scheduling (`async_scheduling=True`): `step_async` dispatches step N+1 before reading
step N's sampled ids. The runner patches the ids of step N into step N+1's inputs on the
device; the scheduler counts the token in flight (Request.num_output_placeholders).
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections import deque

import jax
import numpy as np

from jaxinfer.config import ResolvedConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest
from jaxinfer.outputs import EngineCoreOutput
from jaxinfer.request import FinishReason, Request, RequestStatus
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.kv_cache import kv_cache_bytes_per_block
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.validation import check_core_request

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU (as vLLM's CPU backend has a fixed space)


def _on_gpu(devices) -> bool:
    return devices[0].platform in ("gpu", "cuda", "rocm")


def enable_compilation_cache(path: str | None) -> None:
    import os

    from jaxinfer.models.default_model import cache_dir

    if path == "":
        return
    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _tokenizer_source(tokenizer_dir: str):
    """(tokenizer.json text, EOS id) of the model's tokenizer, read when a grammar first needs
    it (the core has no tokenizer otherwise)."""
    def load():
        from jaxinfer.tokenizer import Tokenizer

        tok = Tokenizer(tokenizer_dir)
        return tok.backend_json(), tok.eos_token_id
    return load


class EngineCore:
    """Scheduler + runner over `devices` (default: all of this process's JAX devices; a data-
    parallel rank passes its own subset)."""

    def __init__(self, rc: ResolvedConfig, devices=None):
        from jaxinfer.models.loader import load_model
        from jaxinfer.parallel import make_mesh

        cfg = rc.engine
        self.resolved = rc
        enable_compilation_cache(cfg.compilation_cache_dir)
        self.devices = list(devices) if devices is not None else jax.devices()
        pp = cfg.pipeline_parallel_size
        stage_groups = stage_meshes = None
        if pp > 1:
            from jaxinfer.pipeline import stage_devices

            stage_groups = stage_devices(pp, cfg.tensor_parallel_size, self.devices)
            stage_meshes = [make_mesh(cfg.tensor_parallel_size, g)
                            if cfg.tensor_parallel_size > 1 else None for g in stage_groups]
            self.mesh = None  # (each stage has its own; parameters stay on the host here)
        else:
            self.mesh = make_mesh(cfg.tensor_parallel_size, self.devices)
        model, mcfg, dtype = load_model(rc.model_dir, dtype=rc.dtype,
                                        load_format=cfg.load_format,
                                        attention_backend=rc.attention_backend, seed=cfg.seed,
                                        model_config=rc.model_config, mesh=self.mesh,
                                        to_host=pp > 1, tp_size=cfg.tensor_parallel_size)
        self.pp_partition = None
        if pp > 1:  # the loaded model -> P stages, each on its own devices
            from jaxinfer.pipeline import get_pp_partition, split_model

            self.pp_partition = get_pp_partition(mcfg.num_hidden_layers, pp,
                                                 cfg.pp_layer_partition)
            model = split_model(model, self.pp_partition, stage_groups, stage_meshes)
        self.model_config = mcfg  # as built (KV heads replicated up to tp where needed)
        self.kv_dtype = jnp_dtype(rc.kv_cache_dtype)
        spec = cfg.speculative_config
        self.draft_model = eagle_head = None
        if spec is not None and spec.method in ("eagle", "eagle3"):
            from jaxinfer.spec_decode.eagle import load_eagle_head

            eagle_head = load_eagle_head(spec.model, spec.method, mcfg, dtype=rc.dtype,
                                         attention_backend=rc.attention_backend)
        if spec is not None and spec.method == "draft_model":
            self.draft_model, _, _ = load_model(spec.model, dtype=rc.dtype,
                                                load_format=cfg.load_format,
                                                attention_backend=rc.attention_backend,
                                                seed=cfg.seed, mesh=self.mesh)
        self._eagle_head = eagle_head
        num_blocks = self._num_kv_blocks()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if cfg.tensor_parallel_size * pp != jax.device_count():
                raise ValueError(
                    f"multi-host runs need tensor_parallel_size x pipeline_parallel_size == "
                    f"all devices ({jax.device_count()} over {jax.process_count()} processes), "
                    f"got {cfg.tensor_parallel_size} x {pp}")
            # Every process must size the cache as process 0 did.
            num_blocks = int(multihost_utils.broadcast_one_to_all(np.int64(num_blocks)))
        cache, sched = rc.cache, rc.scheduler
        kv = KVCacheManager(num_blocks, cache.block_size, rc.max_model_len,
                            enable_caching=cache.enable_prefix_caching,
                            hash_algo=cache.prefix_caching_hash_algo, hash_seed=cache.hash_seed)
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

            if jax.process_count() > 1:
                raise ValueError("kv_transfer_config is not supported with multi-host engines "
                                 "yet (the connector runs on process 0 only)")
            kv_sched, kv_worker = create_connector(
                kvt, block_size=cache.block_size, device=self.devices[0],
                fingerprint=model_fingerprint(os.path.basename(os.path.normpath(rc.model_dir)),
                                              self.model_config, cache.block_size,
                                              self.kv_dtype))
        self.scheduler = Scheduler(sched, kv, kv_connector=kv_sched,
                                   structured_output_manager=self.structured_output_manager,
                                   speculative_config=spec)
        if kvt is not None:
            self.scheduler.kv_load_failure_policy = kvt.kv_load_failure_policy
        buckets = BucketTable.build(sched.max_num_batched_tokens, sched.max_num_seqs,
                                    min_tokens=cfg.min_token_bucket, growth=cfg.bucket_growth)
        self.runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=cache.block_size,
                                  max_model_len=rc.max_model_len,
                                  max_num_seqs=sched.max_num_seqs,
                                  max_num_batched_tokens=sched.max_num_batched_tokens,
                                  kv_dtype=self.kv_dtype, buckets=buckets,
                                  speculative_config=spec, draft_model=self.draft_model,
                                  eagle_head=eagle_head, stage_devices=stage_groups)
        # Pipeline parallelism: up to P step batches in flight, no request in two of them.
        self.pipeline_depth = pp
        self.scheduler.pipeline_depth = pp
        self.max_batches_in_flight = 0  # (the most seen; benchmarks/pipeline_parallel.py)
        if kv_worker is not None:
            self.runner.set_kv_connector(kv_worker)
        self.kv_connector = kv_worker
        self.speculative = spec is not None
        if cfg.warmup:
            self.runner.warmup()
        self.async_scheduling = cfg.async_scheduling
        # Steps dispatched and not yet collected (async scheduling keeps at most two).
        self._in_flight: deque = deque()
        # Host time per step (schedule + build + dispatch + collect bookkeeping + update), and
        # the time the host waited on the device: for benchmarks/async_scheduling.py.
        self.step_timings: list[tuple[float, float]] | None = None

    @property
    def is_worker(self) -> bool:
        """Multi-host: processes > 0 only replay process 0's steps (run_worker_loop)."""
        return jax.process_index() > 0

    def run_worker_loop(self) -> None:
        """Multi-host, processes > 0: execute process 0's steps until it shuts down."""
        self.runner.serve_remote_steps()

    def _num_kv_blocks(self) -> int:
        rc, c = self.resolved, self.resolved.engine
        per_block = kv_cache_bytes_per_block(self.model_config, c.block_size, self.kv_dtype)
        if self.draft_model is not None:  # its cache has as many blocks, with the same ids
            per_block += kv_cache_bytes_per_block(self.draft_model.config, c.block_size,
                                                  self.kv_dtype)
        if self._eagle_head is not None:
            import dataclasses

            head = self._eagle_head
            per_block += kv_cache_bytes_per_block(
                dataclasses.replace(head.config, num_hidden_layers=head.num_kv_layers),
                c.block_size, self.kv_dtype)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif _on_gpu(self.devices):
            stats = self.devices[0].memory_stats() or {}
            limit = stats.get("bytes_limit", 0)
            in_use = stats.get("bytes_in_use", 0)
            mcfg = self.model_config
            # Activations and sampler state of the largest step, with a 2x margin.
            act = 2 * 4 * rc.scheduler.max_num_batched_tokens * (
                4 * mcfg.hidden_size + 3 * mcfg.intermediate_size)
            act += 2 * 4 * c.max_num_seqs * mcfg.vocab_size * 8
            # Per device: with tensor parallelism each device holds 1/tp of every block.
            budget = (int(c.gpu_memory_utilization * limit) - in_use - act) * c.tensor_parallel_size
            if self.pp_partition:  # a stage's devices hold only its layers' part of a block
                budget = budget * self.model_config.num_hidden_layers // max(self.pp_partition)
        else:
            budget = _CPU_KV_BYTES
        blocks = budget // per_block + 1
        if blocks < 2:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, "
                             f"{per_block} bytes per block)")
        return int(blocks)

    def ready_info(self) -> dict:
        """What the front end learns at start-up (it validates requests against it)."""
        return {"num_kv_blocks": self.runner.num_kv_blocks,
                "num_usable_kv_blocks": self.scheduler.kv.num_usable_blocks,
                "block_size": self.scheduler.kv.block_size,
                "num_compilations": self.runner.num_compilations}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request (ValueError on what the front end should have refused: every
        value is checked again here, so that a request that bypassed a front end fails alone
        instead of failing a step)."""
        check_core_request(req, vocab_size=self.model_config.vocab_size,
                           max_model_len=self.resolved.max_model_len)
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_id=req.eos_token_id, arrival_time=req.arrival_time,
            priority=req.priority, cache_salt=req.cache_salt, sampling_seed=req.sampling_seed,
            structured_backend=req.structured_backend, parent_id=req.parent_id))

    def abort_requests(self, request_ids, status=RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_work(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or self.has_kv_work())

    def has_kv_work(self) -> bool:
        """KV transfers under way (loads, blocks held for a pull, work not handed over)."""
        return self.kv_connector is not None and (self.scheduler.has_pending_kv_work()
                                                  or self.kv_connector.has_pending_work())

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Synchronous: schedule, run, read back, update."""
        if self.pipeline_depth > 1:
            return self.step_with_batch_queue()
        if self.async_scheduling:
            return self.step_async()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        handle = self.runner.dispatch(so, self.scheduler.get_grammar_bitmask())
        self._fail_step_requests()
        t1 = time.perf_counter()
        ro = self.runner.collect(handle)
        t2 = time.perf_counter()
        outs = self.scheduler.update_from_output(so, ro)
        if self.speculative:
            self.scheduler.update_draft_token_ids(self.runner.take_draft_token_ids())
        if self.step_timings is not None and handle is not None:
            self.step_timings.append(((t1 - t0) + (time.perf_counter() - t2), t2 - t1))
        return self._finish_step(outs, handle is not None)

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
        if extra:
            outs = outs + extra
        elif not ran and not outs and (self.scheduler.has_unfinished_requests()
                                       or self.has_kv_work()):
            # Nothing could be scheduled (grammars compiling, KV arriving): no hot spin.
            time.sleep(0.0005 if self.scheduler.get_num_unfinished_requests() else 0.005)
        return outs

    def step_async(self) -> list[EngineCoreOutput]:
        """Pipelined: dispatch the next step, then collect the oldest one in flight (while the
        device already runs the next). Outputs lag one step behind dispatch."""
        # (Between calls at most one step is in flight: the one scheduled last.)
        if self._in_flight and self.scheduler.last_step_sampled_grammars():
            return self._step_async_structured()
        t0 = time.perf_counter()
        dispatched = False
        if self.scheduler.has_unfinished_requests() and len(self._in_flight) < 2:
            so = self.scheduler.schedule()
            handle = self.runner.dispatch(so, self.scheduler.get_grammar_bitmask())
            self._fail_step_requests()
            if handle is not None:
                self._in_flight.append((so, handle))
                dispatched = True
        if not self._in_flight or (dispatched and len(self._in_flight) < 2):
            return self._finish_step([], dispatched)
        so, handle = self._in_flight.popleft()
        t1 = time.perf_counter()
        ro = self.runner.collect(handle)
        t2 = time.perf_counter()
        outs = self.scheduler.update_from_output(so, ro)
        if self.step_timings is not None:
            self.step_timings.append(((t1 - t0) + (time.perf_counter() - t2), t2 - t1))
        return self._finish_step(outs, True)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism (vLLM's step_with_batch_queue): while fewer than P batches
        are in flight and some request is not in one, schedule and dispatch another batch and
        return; else wait for the oldest batch and apply its outputs. Batches are disjoint in
        requests (the scheduler skips requests in flight), outputs are applied in dispatch
        order."""
        t0 = time.perf_counter()
        dispatched = False
        sched = self.scheduler
        if len(self._in_flight) < self.pipeline_depth and sched.has_schedulable_requests():
            so = sched.schedule()
            handle = self.runner.dispatch(so, sched.get_grammar_bitmask())
            self._fail_step_requests()
            if handle is not None:
                for _, (other, _h) in enumerate(self._in_flight):
                    # (the invariant the scheduler keeps; tests/engine asserts it too)
                    assert not (other.num_scheduled_tokens.keys()
                                & so.num_scheduled_tokens.keys()), "request in two batches"
                self._in_flight.append((so, handle))
                self.max_batches_in_flight = max(self.max_batches_in_flight,
                                                 len(self._in_flight))
                dispatched = True
        if not self._in_flight:
            return self._finish_step([], dispatched)
        if dispatched and len(self._in_flight) < self.pipeline_depth \
                and sched.has_schedulable_requests():
            return self._finish_step([], True)  # fill the pipeline first
        so, handle = self._in_flight.popleft()
        t1 = time.perf_counter()
        ro = self.runner.collect(handle)
        t2 = time.perf_counter()
        outs = sched.update_from_output(so, ro)
        if self.step_timings is not None:
            self.step_timings.append(((t1 - t0) + (time.perf_counter() - t2), t2 - t1))
        return self._finish_step(outs, True)

    def batches_in_flight(self) -> list[list[str]]:
        """The request ids of each batch in flight, oldest first."""
        return [list(so.num_scheduled_tokens) for so, _ in self._in_flight]

    def _step_async_structured(self) -> list[EngineCoreOutput]:
        """A grammar's next mask needs the tokens still in flight: collect every step in
        flight first, then fill the masks and dispatch the next step (it runs while the
        caller processes these outputs)."""
        outs: list[EngineCoreOutput] = []
        while self._in_flight:
            so, handle = self._in_flight.popleft()
            outs += self.scheduler.update_from_output(so, self.runner.collect(handle))
        if self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            handle = self.runner.dispatch(so, self.scheduler.get_grammar_bitmask())
            self._fail_step_requests()
            if handle is not None:
                self._in_flight.append((so, handle))
        return self._finish_step(outs, True)

    # -- utilities (callable from clients by name) ----------------------------------------------
    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        stats["num_free_kv_blocks"] = self.scheduler.kv.get_num_free_blocks()
        stats["num_kv_blocks"] = self.runner.num_kv_blocks
        stats["num_compilations"] = self.runner.num_compilations
        stats["compile_seconds"] = self.runner.compile_seconds
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
        stats["time"] = time.time()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def leak_report(self) -> list[str]:
        """What is still held although no request is live (empty when all is well)."""
        s, kv = self.scheduler, self.scheduler.kv
        problems = []
        if s.delayed_free:
            problems.append(f"blocks held for KV transfers: {sorted(s.delayed_free)}")
        if s.requests or s.running or len(s.waiting):
            problems.append(f"requests left: {sorted(s.requests)}")
        if self._in_flight:
            problems.append(f"{len(self._in_flight)} steps in flight")
        if kv.get_num_free_blocks() != self.runner.num_kv_blocks - 1:
            problems.append(f"free blocks {kv.get_num_free_blocks()} != "
                            f"{self.runner.num_kv_blocks - 1}")
        if kv.req_to_blocks or kv.num_cached_blocks:
            problems.append(f"block lists left: {sorted(kv.req_to_blocks)}")
        return problems

    def profile_steps(self, enable: bool = True) -> list:
        """Start recording (host seconds, device-wait seconds) per step; returns what was
        recorded so far and clears it."""
        done = self.step_timings or []
        self.step_timings = [] if enable else None
        return done

    def shutdown(self) -> None:
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


UTILITIES = ("get_stats", "reset_prefix_cache", "leak_report", "profile_steps", "ready_info")

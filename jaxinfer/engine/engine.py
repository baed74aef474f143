"""LLMEngine: add_request / step / abort, wiring processor, scheduler, runner and outputs."""

from __future__ import annotations

import json
import os
import time
from typing import Iterable

import jax
import numpy as np

from jaxinfer.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.processor import Processor, PromptType
from jaxinfer.layers.attention import DEFAULT_BACKEND, check_backend
from jaxinfer.outputs import RequestOutput
from jaxinfer.parallel import make_mesh
from jaxinfer.request import RequestStatus
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.kv_cache import kv_cache_bytes_per_block
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU (as vLLM's CPU backend has a fixed space)


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _enable_compilation_cache(path: str | None) -> None:
    from jaxinfer.models.default_model import cache_dir

    if path == "":
        return
    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _extra_eos_ids(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from jaxinfer.models.default_model import ensure_default_model
        from jaxinfer.models.loader import load_model

        self.config = config
        _enable_compilation_cache(config.compilation_cache_dir)
        # The Pallas kernel becomes the GPU default once it has been compiled and verified on a
        # GPU (tests/kernels -m gpu); until then the XLA ragged attention is the default.
        backend = config.attention_backend or DEFAULT_BACKEND
        self.attention_backend = check_backend(backend)
        model_dir = config.model or ensure_default_model()
        self.model_dir = model_dir
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir)
        self.mesh = make_mesh(config.tensor_parallel_size)
        model, mcfg, dtype = load_model(model_dir, dtype=config.dtype,
                                        load_format=config.load_format,
                                        attention_backend=backend, seed=config.seed,
                                        mesh=self.mesh)
        self.model_config, self.dtype = mcfg, dtype
        # The KV cache's dtype: the model's ("auto") or a narrower one (half the KV bytes per
        # token; K/V are rounded when written, attention still computes in float32).
        self.kv_dtype = model_kv_dtype(dtype if config.kv_cache_dtype == "auto"
                                       else config.kv_cache_dtype)
        max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.max_model_len = max_model_len
        max_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        if not config.enable_chunked_prefill:
            max_tokens = max(max_tokens, max_model_len)
        if max_tokens < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_tokens} must be >= max_num_seqs="
                             f"{config.max_num_seqs}")
        cache_cfg = CacheConfig(block_size=config.block_size,
                                enable_prefix_caching=config.enable_prefix_caching,
                                hash_seed=config.seed)
        sched_cfg = SchedulerConfig(max_model_len=max_model_len,
                                    max_num_batched_tokens=max_tokens,
                                    max_num_seqs=config.max_num_seqs,
                                    enable_chunked_prefill=config.enable_chunked_prefill,
                                    long_prefill_token_threshold=config.long_prefill_token_threshold,
                                    policy=config.scheduling_policy)
        num_blocks = self._num_kv_blocks()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if config.tensor_parallel_size != jax.device_count():
                raise ValueError(
                    f"multi-host runs need tensor_parallel_size == all devices "
                    f"({jax.device_count()} over {jax.process_count()} processes), got "
                    f"{config.tensor_parallel_size}")
            # Every process must size the cache as process 0 did.
            num_blocks = int(multihost_utils.broadcast_one_to_all(np.int64(num_blocks)))
        kv = KVCacheManager(num_blocks, cache_cfg.block_size, max_model_len,
                            enable_caching=cache_cfg.enable_prefix_caching,
                            hash_algo=cache_cfg.prefix_caching_hash_algo,
                            hash_seed=cache_cfg.hash_seed)
        self.scheduler = Scheduler(sched_cfg, kv)
        buckets = BucketTable.build(max_tokens, config.max_num_seqs,
                                    min_tokens=config.min_token_bucket,
                                    growth=config.bucket_growth)
        self.runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=config.block_size,
                                  max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=max_tokens, kv_dtype=self.kv_dtype,
                                  buckets=buckets)
        if config.warmup:
            self.runner.warmup()
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None and mcfg.eos_token_ids:
            eos = mcfg.eos_token_ids[0]
        self.processor = Processor(self.tokenizer, vocab_size=mcfg.vocab_size,
                                   max_model_len=max_model_len, eos_token_id=eos,
                                   extra_eos_token_ids=mcfg.eos_token_ids
                                   + _extra_eos_ids(model_dir), seed=config.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0
        self.is_worker = jax.process_index() > 0
        if self.is_worker:  # multi-host: replay process 0's steps until it shuts down
            self.runner.serve_remote_steps()

    def shutdown(self) -> None:
        """Multi-host: release the worker processes (no-op otherwise)."""
        self.runner.stop_remote_steps()

    def _num_kv_blocks(self) -> int:
        c = self.config
        per_block = kv_cache_bytes_per_block(self.model_config, c.block_size, self.kv_dtype)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif _on_gpu():
            stats = jax.devices()[0].memory_stats() or {}
            limit = stats.get("bytes_limit", 0)
            in_use = stats.get("bytes_in_use", 0)
            mcfg = self.model_config
            # Activations and sampler state of the largest step, with a 2x margin.
            act = 2 * 4 * (c.max_num_batched_tokens or 2048) * (
                4 * mcfg.hidden_size + 3 * mcfg.intermediate_size)
            act += 2 * 4 * c.max_num_seqs * mcfg.vocab_size * 8
            # Per device: with tensor parallelism each device holds 1/tp of every block.
            budget = (int(c.gpu_memory_utilization * limit) - in_use - act) * c.tensor_parallel_size
        else:
            budget = _CPU_KV_BYTES
        blocks = budget // per_block + 1
        if blocks < 2:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, "
                             f"{per_block} bytes per block)")
        return int(blocks)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (naming the field) on bad input."""
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, children = self.processor.make_requests(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority,
            cache_salt=cache_salt)
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added)
            raise
        self.output_processor.add_request(request_id, text, ids, children)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.scheduler.finish_requests(self.output_processor.abort(rid),
                                           RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        ro = self.runner.execute(so)
        core_outputs = self.scheduler.update_from_output(so, ro)
        outputs, to_stop = self.output_processor.process_outputs(core_outputs)
        if to_stop:
            self.scheduler.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return outputs

    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        stats["num_free_kv_blocks"] = self.scheduler.kv.get_num_free_blocks()
        stats["num_kv_blocks"] = self.runner.num_kv_blocks
        stats["num_compilations"] = self.runner.num_compilations
        stats["time"] = time.time()
        return stats


def model_kv_dtype(dtype_name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype_name]

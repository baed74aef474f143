"""Worker: the device world of one engine core. It owns what the scheduler never sees: the
devices and their mesh, the model (and a draft model or EAGLE head), the pipeline's stages,
the KV cache's size in blocks (from device memory, the same on every process of a multi-host
engine) and the ModelRunner that steps over them. The engine core holds a scheduler and a
worker; only the worker imports jax."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxinfer.config import ResolvedConfig
from jaxinfer.config.dtypes import dtype as array_dtype
from jaxinfer.core.window_blocks import window_pool_blocks
from jaxinfer.logits_processors import load_processor
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.compile_cache import CompileCacheCounter, enable_compilation_cache
from jaxinfer.runner.host_malloc import keep_freed_memory
from jaxinfer.runner.huge_pages import back_with_huge_pages, huge_pages_enabled
from jaxinfer.runner.kv_cache import kv_cache_bytes_per_block, sliding_layers
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.runner.step_program import make_step_program

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 1 << 30  # default KV budget on CPU (as vLLM's CPU backend has a fixed space)


def on_gpu(devices) -> bool:
    return devices[0].platform in ("gpu", "cuda", "rocm")


def resolve_attention_backend(name: str, devices) -> str:
    """"auto" -> "cpu" (the C++ kernel) on CPU devices where it builds, else "xla"; "cpu"
    refused on other devices."""
    platform = devices[0].platform
    if name == "auto":
        if platform == "cpu":
            from jaxinfer.layers import cpu_kernels

            return "cpu" if cpu_kernels.available() else "xla"
        return "xla"
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on CPU devices only, not {platform}")
    return name


CPU_BLOCK_SIZE = 128  # (vLLM's CPU backend default too)
GPU_BLOCK_SIZE = 16


def resolve_block_size(block_size: int | None, devices) -> int:
    """The KV block size, None resolved: 128 tokens on CPU devices, where decode attention is
    bound by reading the cache and long contiguous pages stream (benchmarks/block_size.py,
    results/block_size_cpu.json, pages scattered as after a while of serving: a decode step of
    32 sequences at 256 tokens of context 101 -> 91 ms, of 64 at 1000 318 -> 273 ms); 16 on
    GPUs (the Pallas kernel's page size)."""
    if block_size is not None:
        return block_size
    return CPU_BLOCK_SIZE if devices[0].platform == "cpu" else GPU_BLOCK_SIZE


def _bytes_per_device(tree) -> int:
    """The most bytes of `tree`'s arrays any one device holds (its shards; host arrays count
    whole)."""
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        if shards is None:
            per["host"] = per.get("host", 0) + getattr(leaf, "nbytes", 0)
            continue
        for sh in shards:
            per[sh.device] = per.get(sh.device, 0) + sh.data.nbytes
    return int(max(per.values(), default=0))


class Worker:
    """Devices, weights and KV cache of one engine core (default devices: all of this
    process's JAX devices; a data-parallel rank passes its own subset)."""

    def __init__(self, rc: ResolvedConfig, devices=None):
        from jaxinfer.models.loader import load_model
        from jaxinfer.parallel import make_mesh

        cfg = rc.engine
        par = rc.parallel
        self.resolved = rc
        t0 = time.perf_counter()
        enable_compilation_cache(cfg.compilation_cache_dir)
        self.compile_cache = CompileCacheCounter()  # (this engine's compilations)
        self.devices = list(devices) if devices is not None else jax.devices()
        self.attention_backend = resolve_attention_backend(rc.attention_backend, self.devices)
        self.block_size = resolve_block_size(rc.cache.block_size, self.devices)
        pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.stage_groups = stage_meshes = None
        if pp > 1:
            from jaxinfer.pipeline import stage_devices

            self.stage_groups = stage_devices(pp, tp, self.devices)
            stage_meshes = [make_mesh(tp, g) if tp > 1 else None for g in self.stage_groups]
            self.mesh = None  # (each stage has its own; parameters stay on the host here)
        else:
            self.mesh = make_mesh(tp, self.devices)
        from jaxinfer.layers.attention import is_fp8

        from jaxinfer.layers.quantization import with_activation_fp8

        model_config = dataclasses.replace(
            rc.model_config, fp8_kv_cache=is_fp8(array_dtype(rc.kv_cache_dtype)),
            # fp8 weights on GPUs: W8A8 (activations to fp8 per token, fp8 x fp8 dots)
            quantization=with_activation_fp8(rc.model_config.quantization,
                                             on_gpu(self.devices)),
            lora_slots=cfg.max_loras if cfg.enable_lora else 0,
            lora_rank=cfg.max_lora_rank if cfg.enable_lora else 0)
        model, mcfg, dtype = load_model(rc.model_dir, dtype=rc.dtype,
                                        load_format=cfg.load_format,
                                        attention_backend=self.attention_backend, seed=cfg.seed,
                                        model_config=model_config, mesh=self.mesh,
                                        to_host=pp > 1, tp_size=tp,
                                        expert_parallel=par.enable_expert_parallel,
                                        sequence_parallel=par.enable_sequence_parallelism)
        self.pp_partition = None
        if pp > 1:  # the loaded model -> P stages, each on its own devices
            from jaxinfer.config.parallel import get_pp_partition
            from jaxinfer.pipeline import split_model

            self.pp_partition = get_pp_partition(mcfg.num_hidden_layers, pp,
                                                 par.pp_layer_partition)
            model = split_model(model, self.pp_partition, self.stage_groups, stage_meshes)
        self.model = model
        self.model_config = mcfg  # as built (KV heads replicated up to tp where needed)
        # (how many times each checkpoint KV head is held: weight updates convert as loading)
        self.kv_repeat = max(1, mcfg.num_key_value_heads // rc.model_config.num_key_value_heads)
        self._weights = None  # the WeightManager (runner/weights.py), made on first use
        self._receiver = None  # (weight_transfer.WeightReceiver, made on first use)
        # (vLLM accepts these where they change nothing; say so rather than stay silent)
        if par.enable_expert_parallel and not mcfg.expert_parallel:
            logger.warning("enable_expert_parallel has no effect: %s", "the model has no experts"
                           if not mcfg.num_experts else "tensor_parallel_size is 1")
        if par.enable_sequence_parallelism and not mcfg.sequence_parallel:
            logger.warning("enable_sequence_parallelism has no effect at "
                           "tensor_parallel_size 1")
        self.kv_dtype = array_dtype(rc.kv_cache_dtype)
        spec = cfg.speculative_config
        self.draft_model = self.eagle_head = None
        if spec is not None and spec.method in ("eagle", "eagle3"):
            from jaxinfer.spec_decode.eagle import load_eagle_head

            self.eagle_head = load_eagle_head(spec.model, spec.method, mcfg, dtype=rc.dtype,
                                              attention_backend=self.attention_backend)
        if spec is not None and spec.method == "mtp":
            from jaxinfer.spec_decode.mtp import load_mtp_head

            self.eagle_head = load_mtp_head(spec.model or rc.model_dir, mcfg, dtype=rc.dtype,
                                            attention_backend=self.attention_backend)
        if spec is not None and spec.method == "draft_model":
            self.draft_model, _, _ = load_model(spec.model, dtype=rc.dtype,
                                                load_format=cfg.load_format,
                                                attention_backend=self.attention_backend,
                                                seed=cfg.seed, mesh=self.mesh)
        # Start-up phases in seconds (jaxinfer bench startup reports them).
        self.timings = {"load_weights_s": time.perf_counter() - t0}
        num_blocks, self.window_kv_blocks = self._kv_pools()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if tp * pp != jax.device_count():
                raise ValueError(
                    f"multi-host runs need tensor_parallel_size x pipeline_parallel_size == "
                    f"all devices ({jax.device_count()} over {jax.process_count()} processes), "
                    f"got {tp} x {pp}")
            # Every process must size the cache as process 0 did.
            pools = multihost_utils.broadcast_one_to_all(
                np.array([num_blocks, self.window_kv_blocks], np.int64))
            num_blocks, self.window_kv_blocks = int(pools[0]), int(pools[1])
        for name, n in (("num_kv_blocks", num_blocks),
                        ("the sliding layers' pool", self.window_kv_blocks)):
            if n * self.block_size > np.iinfo(np.int32).max:  # slot ids are int32
                raise ValueError(f"{name}={n} x block_size={self.block_size} KV slots "
                                 f"exceed the int32 slot ids ({np.iinfo(np.int32).max})")
        self.num_kv_blocks = num_blocks
        t1 = time.perf_counter()
        self.runner = self._make_runner()
        self.timings["allocate_kv_cache_s"] = time.perf_counter() - t1
        self.memory = {"weight_bytes_per_device": _bytes_per_device(self.runner.params),
                       "kv_cache_bytes_per_device": _bytes_per_device(self.runner.kv_caches)}
        q = mcfg.quantization
        kinds = None if q is None else "GGUF blocks" if q.method == "gguf" else q.weight_dtype
        logger.info("weights: %.1f MiB per device (%s); KV cache: %d blocks of %d tokens, "
                    "%.1f MiB per device (%s)",
                    self.memory["weight_bytes_per_device"] / 2**20,
                    f"{rc.dtype}, linear layers {kinds}" if q else rc.dtype,
                    num_blocks, self.block_size,
                    self.memory["kv_cache_bytes_per_device"] / 2**20,
                    np.dtype(self.kv_dtype).name)
        # Steps' freed buffers kept in malloc's heap for the next step (after the weights are
        # loaded, so that loading's temporaries still go back to the system).
        self.malloc_keep = keep_freed_memory(cpu=self.devices[0].platform == "cpu")
        # The weights on huge pages (huge_pages.py).
        self.huge_pages = huge_pages_enabled(cpu=self.devices[0].platform == "cpu")
        if self.huge_pages:
            t1 = time.perf_counter()
            done = back_with_huge_pages(self.runner.state.weights)
            self.timings["huge_pages_s"] = time.perf_counter() - t1
            logger.info("huge pages: %.1f MiB of weights collapsed (%.2f s)",
                        done["collapsed_bytes"] / 2**20, self.timings["huge_pages_s"])

    # -- the weights of a live engine: updates, sleep, wake-up (runner/weights.py) -------------
    @property
    def weights(self):
        if self._weights is None:
            from jaxinfer.runner.weights import WeightManager

            if isinstance(self.model, list):
                raise ValueError("weight updates and sleep mode are not supported with "
                                 "pipeline_parallel_size > 1 yet")
            if jax.process_count() > 1:
                raise ValueError("weight updates and sleep mode are not supported on "
                                 "multi-host engines yet")
            self._weights = WeightManager(self)
        return self._weights

    def engine_weights(self) -> dict:
        return self.weights.engine_weights()

    def update_weights(self, weights, layout: str = "hf") -> dict:
        return self.weights.update(weights, layout)

    def update_weights_from_path(self, path: str) -> dict:
        """The tensors of a safetensors folder (single or sharded) that this model is made
        of (others are ignored, as loading ignores them)."""
        from jaxinfer.models.loader import _iter_tensors, _safetensors_index

        try:
            files = _safetensors_index(path)
        except (FileNotFoundError, NotADirectoryError, OSError) as e:
            raise ValueError(f"update_weights_from_path: {e}") from None
        return self.weights.update(dict(_iter_tensors(files, list(files))), "hf",
                                   only_known=True)

    def update_weights_from_transfer(self, payload) -> dict:
        """Pull a WeightSender's offer onto this worker's device (weight_transfer.py), then
        update as update_weights does."""
        import os

        from jaxinfer.weight_transfer import WeightReceiver, check_payload

        payload = check_payload(payload)
        manager = self.weights  # (refusals first: pipeline / multi-host)
        if self._receiver is None:
            self._receiver = WeightReceiver(self.devices[0])
        arrays = self._receiver.pull(payload, int(os.environ.get("JAXINFER_DP_RANK", "0")))
        return manager.update(arrays, payload["layout"])

    def sleep(self, level: int) -> dict:
        return self.weights.sleep(level)

    def wake_up(self, tags=None) -> dict:
        return self.weights.wake_up(tags)

    def cache_counts(self) -> dict[str, int]:
        return self.compile_cache.counts()

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def is_follower(self) -> bool:
        """Multi-host: processes > 0 only replay process 0's steps."""
        return jax.process_index() > 0

    def _make_runner(self) -> ModelRunner:
        """The runner over this worker's model and a KV cache of num_kv_blocks blocks."""
        rc, sched = self.resolved, self.resolved.scheduler
        cfg = rc.engine
        buckets = BucketTable.build(sched.max_num_batched_tokens, sched.max_num_seqs,
                                    min_tokens=cfg.min_token_bucket, growth=cfg.bucket_growth)
        program = make_step_program(self.model, kind=self.step_compilation,
                                    layers_per_program=cfg.layers_per_program,
                                    max_model_len=rc.max_model_len,
                                    draft_model=self.draft_model, eagle_head=self.eagle_head,
                                    stage_devices=self.stage_groups)
        lora = None
        if cfg.enable_lora:
            from jaxinfer.lora.manager import LoRAManager

            if jax.process_count() > 1:
                raise ValueError("enable_lora is not supported on multi-host engines yet")
            lora = LoRAManager(self.model, max_loras=cfg.max_loras,
                               max_lora_rank=cfg.max_lora_rank,
                               max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras,
                               head_dim=self.model_config.head_dim)
        multimodal = None
        # (vision-language models take images on one host; multi-host engines serve them
        # text only, and the core refuses a request with images by name)
        if (getattr(self.model, "encoder_inputs", None) is not None
                and jax.process_count() == 1):
            from jaxinfer.runner.multimodal import MultiModalRunner

            multimodal = MultiModalRunner(self.model)
        return ModelRunner(program, num_kv_blocks=self.num_kv_blocks,
                           block_size=self.block_size, max_model_len=rc.max_model_len,
                           max_num_seqs=sched.max_num_seqs,
                           max_num_batched_tokens=sched.max_num_batched_tokens,
                           kv_dtype=self.kv_dtype, buckets=buckets,
                           speculative_config=cfg.speculative_config,
                           pipeline_depth=len(self.model) if isinstance(self.model, list) else 1,
                           logits_processors=[load_processor(p)(rc)
                                              for p in cfg.logits_processors or ()],
                           lora=lora,
                           pooling=rc.pooler.pooling_type if rc.runner == "pooling" else "",
                           multimodal=multimodal, window_kv_blocks=self.window_kv_blocks)

    @property
    def step_compilation(self) -> str:
        """The engine's step_compilation with "auto" resolved: layerwise on CPU (start-up in
        seconds, compile time independent of depth; steady state 5-15% behind whole steps
        with today's CPU kernels: docs/cpu.md), whole on GPU (one program per step, as CUDA
        graphs would: L dispatches per step cost more there than the compile time they
        save)."""
        mode = self.resolved.engine.step_compilation
        if mode == "auto":
            mode = "whole" if on_gpu(self.devices) else "layerwise"
        return mode

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers' own pool, or None (one pool)."""
        return self.model_config.sliding_window if self.window_kv_blocks else None

    def _window_pool(self) -> int:
        """Blocks of the sliding layers' own pool (0: none): for a model with sliding and
        full layers, sized so that it never runs out (core/window_blocks.py); not with a KV
        connector, a drafter with a cache of its own or pipeline stages (they address every
        layer's blocks with one table), nor with disable_hybrid_kv_cache_manager."""
        rc, cfg = self.resolved, self.model_config
        sliding = sliding_layers(cfg)
        spec = rc.engine.speculative_config
        if (not any(sliding) or all(sliding) or rc.engine.disable_hybrid_kv_cache_manager
                or rc.engine.kv_transfer_config is not None or self.pp_partition
                or self.draft_model is not None or self.eagle_head is not None):
            return 0
        return window_pool_blocks(cfg.sliding_window, self.block_size,
                                  rc.scheduler.max_num_seqs,
                                  rc.scheduler.max_num_batched_tokens,
                                  margin=spec.num_speculative_tokens if spec else 0)

    def _kv_pools(self) -> tuple[int, int]:
        """(blocks of the KV cache, blocks of the sliding layers' own pool or 0). With a
        memory budget the sliding pool is used only where it leaves the full layers more
        blocks than one pool would; num_kv_blocks, when given, is the full layers' count."""
        window = self._window_pool()
        blocks = self._num_kv_blocks()
        if not window or self.resolved.engine.num_kv_blocks is not None:
            return blocks, window
        if window >= blocks:
            return blocks, 0
        cfg, n_sliding = self.model_config, sum(sliding_layers(self.model_config))
        per_full = kv_cache_bytes_per_block(cfg, self.block_size, self.kv_dtype,
                                            cfg.num_hidden_layers - n_sliding)
        per_sliding = kv_cache_bytes_per_block(cfg, self.block_size, self.kv_dtype, n_sliding)
        budget = (blocks - 1) * (per_full + per_sliding)
        return (budget - window * per_sliding) // per_full + 1, window

    def _num_kv_blocks(self) -> int:
        rc, c = self.resolved, self.resolved.engine
        per_block = kv_cache_bytes_per_block(self.model_config, self.block_size, self.kv_dtype)
        if self.draft_model is not None:  # its cache has as many blocks, with the same ids
            per_block += kv_cache_bytes_per_block(self.draft_model.config, self.block_size,
                                                  self.kv_dtype)
        if self.eagle_head is not None:
            head = self.eagle_head
            per_block += kv_cache_bytes_per_block(
                dataclasses.replace(head.config, num_hidden_layers=head.num_kv_layers),
                self.block_size, self.kv_dtype)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif on_gpu(self.devices):
            stats = self.devices[0].memory_stats() or {}
            limit = stats.get("bytes_limit", 0)
            in_use = stats.get("bytes_in_use", 0)
            mcfg = self.model_config
            # Activations and sampler state of the largest step, with a 2x margin.
            act = 2 * 4 * rc.scheduler.max_num_batched_tokens * (
                4 * mcfg.hidden_size + 3 * mcfg.intermediate_size)
            act += 2 * 4 * c.max_num_seqs * mcfg.vocab_size * 8
            # Per device: with tensor parallelism each device holds 1/tp of every block.
            budget = (int(c.gpu_memory_utilization * limit) - in_use - act) * rc.parallel.tensor_parallel_size
            if self.pp_partition:  # a stage's devices hold only its layers' part of a block
                budget = budget * self.model_config.num_hidden_layers // max(self.pp_partition)
        else:
            budget = CPU_KV_BYTES
        blocks = budget // per_block + 1
        if blocks < 2:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, "
                             f"{per_block} bytes per block)")
        return int(blocks)

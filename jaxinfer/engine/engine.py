"""LLMEngine: the synchronous front end (vLLM V1's LLMEngine).

Processor (tokenize, validate) -> EngineCoreClient -> OutputProcessor (detokenize, stop
strings). The engine core (scheduler + runner) runs in a child process by default
(SyncMPClient); with multiprocessing off (`enable_multiprocessing=False` or
JAXINFER_ENABLE_MULTIPROCESSING=0), and always on multi-host runs, it runs in this process.
"""

from __future__ import annotations

from typing import Iterable

from jaxinfer.config import EngineConfig, ResolvedConfig, multiprocessing_enabled, resolve_config
from jaxinfer.engine.messages import as_value_error
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.processor import Processor, PromptType
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer


def make_processor(rc, tokenizer, info: dict) -> Processor:
    mcfg = rc.model_config
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None and mcfg.eos_token_ids:
        eos = mcfg.eos_token_ids[0]
    return Processor(tokenizer, vocab_size=mcfg.vocab_size, max_model_len=rc.max_model_len,
                     eos_token_id=eos, extra_eos_token_ids=rc.eos_token_ids,
                     seed=rc.engine.seed, num_usable_kv_blocks=info["num_usable_kv_blocks"],
                     block_size=info["block_size"],
                     structured_outputs_config=rc.engine.structured_outputs_config,
                     reasoning_parser=rc.engine.reasoning_parser,
                     logits_processors=rc.engine.logits_processors,
                     enable_lora=rc.engine.enable_lora,
                     placeholder_token_ids=tuple(t for t in (mcfg.image_token_id,
                                                             mcfg.video_token_id)
                                                 if t is not None),
                     multimodal=make_multimodal_processor(rc))


def make_multimodal_processor(rc):
    """A vision-language model's image step (None for text-only models and for those whose
    image path is not served yet)."""
    mcfg = rc.model_config
    if mcfg.vision is None or rc.parallel.pipeline_parallel_size > 1:
        return None
    from jaxinfer.multimodal.inputs import MultiModalProcessor, parse_limit_mm_per_prompt

    return MultiModalProcessor(mcfg, rc.model_dir,
                               parse_limit_mm_per_prompt(rc.engine.limit_mm_per_prompt),
                               max_tokens_per_image=rc.scheduler.max_num_batched_tokens)


def check_in_process(client, what: str) -> None:
    """Arrays and callables cannot cross a process boundary (the core's messages are
    msgpack): say so rather than fail in the encoder."""
    if not hasattr(client, "core"):
        raise TypeError(f"{what} passes arrays or code: it needs the engine core in this "
                        "process (enable_multiprocessing=False, or "
                        "JAXINFER_ENABLE_MULTIPROCESSING=0); across processes use "
                        "update_weights_from_path")


def in_process_only() -> bool:
    """Multi-host (jax.distributed) runs keep the core in the process that joined the mesh."""
    from jaxinfer.distributed import is_initialized

    return is_initialized()


def use_multiprocessing(rc: ResolvedConfig, devices=None) -> bool:
    """Whether a front end runs its engine core(s) in child processes."""
    return (multiprocessing_enabled(rc.engine) and devices is None
            and not in_process_only())


def make_client(rc: ResolvedConfig, *, asyncio_api: bool, devices=None):
    """The engine-core client a front end uses: data_parallel_size cores in processes of
    their own (DP clients), one core in a child process (SyncMPClient / AsyncMPClient), or in
    this process (InprocClient, stepped by the caller / ThreadedCoreClient, a background
    thread)."""
    dp = rc.parallel.data_parallel_size
    mp = use_multiprocessing(rc, devices)
    if dp > 1:
        if not mp:
            raise ValueError("data_parallel_size > 1 needs the engine cores in their own "
                             "processes (multiprocessing on, single-host, no devices=)")
        from jaxinfer.engine.dp_client import DPAsyncClient, DPSyncClient

        return (DPAsyncClient if asyncio_api else DPSyncClient)(rc, dp)
    from jaxinfer.engine.core_client import (AsyncMPClient, InprocClient, SyncMPClient,
                                             ThreadedCoreClient)

    if mp:
        return AsyncMPClient(rc) if asyncio_api else SyncMPClient(rc)
    return ThreadedCoreClient(rc, devices) if asyncio_api else InprocClient(rc, devices)


class LLMEngine:
    def __init__(self, config: EngineConfig, devices=None):
        self.config = config
        self.resolved = rc = resolve_config(config)
        self.model_dir, self.model_config = rc.model_dir, rc.model_config
        self.max_model_len, self.dtype = rc.max_model_len, rc.dtype
        self.tokenizer = Tokenizer.from_pretrained(rc.tokenizer_dir) if rc.tokenizer_dir else None
        self.multiprocessing = use_multiprocessing(rc, devices)
        self.engine_core = make_client(rc, asyncio_api=False, devices=devices)
        self.processor = make_processor(rc, self.tokenizer, self.engine_core.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0
        self._loras: dict[int, object] = {}  # adapters this front end loaded (by id)

    @property
    def attention_backend(self) -> str:
        """The attention backend the engine core runs ("auto" resolved by its worker)."""
        if self.resolved.attention_backend != "auto":
            return self.resolved.attention_backend
        return self.get_stats().get("attention_backend", "auto")

    # -- in-process introspection (tests, benchmarks) -------------------------------------------
    def _core(self):
        core = getattr(self.engine_core, "core", None)
        if core is None:
            raise AttributeError("the engine core runs in another process: use "
                                 "enable_multiprocessing=False (or JAXINFER_ENABLE_"
                                 "MULTIPROCESSING=0) to reach its scheduler and runner")
        return core

    @property
    def scheduler(self):
        return self._core().scheduler

    @property
    def runner(self):
        return self._core().runner

    @property
    def is_worker(self) -> bool:
        return not self.multiprocessing and self._core().is_worker

    def run_worker_loop(self) -> None:
        """Multi-host, processes > 0: execute process 0's steps until it shuts down."""
        self._core().run_worker_loop()

    def shutdown(self) -> None:
        """Stop the engine core (its process, or the multi-host workers)."""
        self.engine_core.shutdown()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request=None) -> str:
        """Validate and queue a request; raises ValueError (naming the field) on bad input.
        lora_request: a LoRARequest (enable_lora), loaded first when new (ValueError naming
        the adapter when it cannot be served)."""
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, children = self.processor.make_requests(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority,
            cache_salt=cache_salt, lora_request=lora_request)
        if lora_request is not None:
            self.add_lora(lora_request)
        self.output_processor.add_request(request_id, text, ids, children)
        for child in children:
            self.engine_core.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = []
        for rid in request_ids:
            children += self.output_processor.abort(rid)
        self.engine_core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The next batch of outputs from the core (one engine step's worth); [] when no
        request is unfinished (nothing would come)."""
        if not self.output_processor.has_unfinished():
            return []
        eo = self.engine_core.get_output()
        outputs, to_stop = self.output_processor.process_outputs(eo.outputs, eo.engine_index)
        if to_stop:  # stop strings: the core stops generating for them
            self.engine_core.abort_requests(to_stop)
        return outputs

    def get_stats(self) -> dict:
        """The core's stats as of its last step."""
        return dict(self.engine_core.stats)

    # -- LoRA adapters (vLLM's LLMEngine methods) -----------------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Load an adapter into the engine (ValueError naming it and the reason when it
        cannot be served); False when it was loaded already."""
        self.processor.check_lora(lora_request)
        known = self._loras.get(lora_request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) == (
                lora_request.lora_name, lora_request.lora_path):
            return False  # (else the core says what clashes)
        added = self._utility("add_lora", lora_request)
        self._loras[lora_request.lora_int_id] = lora_request
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        self._loras.pop(lora_int_id, None)
        return self.engine_core.call_utility("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.engine_core.call_utility("list_loras"))

    def call_utility(self, name: str, *args):
        """Run an EngineCore utility (get_stats, reset_prefix_cache, leak_report, ...)."""
        return self.engine_core.call_utility(name, *args)

    def _utility(self, name: str, *args):
        """A utility whose ValueError (bad input) comes back as a ValueError."""
        try:
            return self.engine_core.call_utility(name, *args)
        except RuntimeError as e:
            raise as_value_error(e) from None

    # -- RL rollouts: pause / resume, weight updates, sleep / wake up (docs/rl.md) -------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> str:
        """EngineCore.pause_generation; "wait" returns "draining" while requests finish
        (step() runs them; the state turns "paused")."""
        return self._utility("pause_generation", mode, clear_cache)

    def resume_generation(self) -> None:
        self._utility("resume_generation")

    def is_paused(self) -> bool:
        return self._utility("is_paused")

    def update_weights(self, weights, *, layout: str = "hf",
                       weight_version: str | None = None) -> dict:
        """New weights from arrays (HF checkpoint names, or layout="engine": the engine's
        own parameter paths); the engine core must run in this process."""
        check_in_process(self.engine_core, "update_weights")
        return self._utility("update_weights", weights, layout, weight_version)

    def update_weights_from_path(self, path: str, weight_version: str | None = None) -> dict:
        return self._utility("update_weights_from_path", path, weight_version)

    def update_weights_from_transfer(self, payload: dict,
                                     weight_version: str | None = None) -> dict:
        return self._utility("update_weights_from_transfer", payload, weight_version)

    def reload_weights(self, weight_version: str | None = None) -> dict:
        return self._utility("reload_weights", weight_version)

    def get_weight_version(self) -> str:
        return self._utility("get_weight_version")

    def set_weight_version(self, weight_version: str) -> None:
        self._utility("set_weight_version", weight_version)

    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        return self._utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self._utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self._utility("is_sleeping")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        if callable(method):
            check_in_process(self.engine_core, "collective_rpc with a callable")
        return self._utility("collective_rpc", method, tuple(args), kwargs)

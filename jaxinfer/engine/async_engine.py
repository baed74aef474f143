"""AsyncLLM: the asyncio front end (vLLM V1's AsyncLLM), one output stream per request.

Processor and OutputProcessor run on the event loop; the engine core runs in its own process
behind an AsyncMPClient (or, with multiprocessing off, in a background thread). One output-
handler task reads the core's outputs, detokenizes them and feeds each request's queue. A
request whose consumer goes away (client disconnect, cancelled task) is aborted, which frees
its KV blocks; a dead core fails every open stream with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, AsyncIterator, Callable

from jaxinfer.config import EngineConfig, resolve_config
from jaxinfer.engine.engine import check_in_process, make_processor, use_multiprocessing
from jaxinfer.engine.engine import make_client as default_client
from jaxinfer.engine.messages import EngineDeadError, as_value_error
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, *,
                 on_step: Callable[[list[RequestOutput], dict], None] | None = None,
                 on_abort: Callable[[str], None] | None = None,
                 make_client: Callable[[Any], Any] | None = None):
        """make_client(resolved config): the engine-core client to use instead of the one the
        config implies (an API server of several gets a client of the shared cores)."""

        config = config or EngineConfig()
        self.resolved = rc = resolve_config(config)
        self.tokenizer = Tokenizer.from_pretrained(rc.tokenizer_dir) if rc.tokenizer_dir else None
        self.max_model_len = rc.max_model_len
        self.multiprocessing = use_multiprocessing(rc)
        self.engine_core = (make_client(rc) if make_client is not None
                            else default_client(rc, asyncio_api=True))
        self.processor = make_processor(rc, self.tokenizer, self.engine_core.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.on_step = on_step  # called on the event loop after each batch of outputs (metrics)
        self.on_abort = on_abort  # called when a live request is aborted
        # Called once, on the event loop, when the engine core is found dead (the server
        # answers 503 from then on and exits).
        self.on_dead: Callable[[BaseException], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._handler: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._counter = itertools.count(1)

    @property
    def stats(self) -> dict[str, Any]:
        """The core's stats as of its last step (or last going idle)."""
        return self.engine_core.stats

    @property
    def core(self):
        """The EngineCore itself when it runs in this process (else AttributeError)."""
        return self.engine_core.core

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the core is up after construction; the output handler starts on the
        serving event loop (start_output_handler, or the first request)."""

    def start_output_handler(self) -> None:
        """Start reading the core's outputs now (on the running event loop), so that a core
        that dies is noticed at once, not when the next request comes."""
        if self._dead is None:
            self._ensure_handler()

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine core cannot serve any more (None while it can)."""
        if self._dead is None:
            alive = getattr(self.engine_core, "is_alive", None)
            if alive is not None and not alive():
                return EngineDeadError("the engine core process is gone")
        return self._dead

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _set_dead(self, err: BaseException) -> None:
        if self._dead is not None:
            return
        logger.error("engine core is dead: %s", str(err).splitlines()[0] if str(err) else err)
        self._dead = err
        for q in self._streams.values():
            q.put_nowait(err)
        self._streams.clear()
        if self.on_dead is not None:
            try:
                self.on_dead(err)
            except Exception:  # noqa: BLE001
                logger.exception("on_dead callback failed")

    def shutdown(self) -> None:
        if self._handler is not None:
            try:
                self._handler.cancel()
            except RuntimeError:  # its loop is closed already
                pass
        self.engine_core.shutdown()

    def new_request_id(self, prefix: str = "req") -> str:
        # (an API server of several tags its ids: they meet in the shared engine cores)
        index = getattr(self.engine_core, "client_index", 0)
        tag = f"s{index}-" if index else ""
        return f"{prefix}-{tag}{next(self._counter)}"

    def _ensure_handler(self) -> None:
        if self._dead is not None:
            raise self._dead
        loop = asyncio.get_running_loop()
        if self._handler is None or self._handler.done() or self._handler.get_loop() is not loop:
            self._handler = loop.create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        while True:
            try:
                eo = await self.engine_core.get_output_async()
            except EngineDeadError as e:
                self._set_dead(e)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the client itself broke: nothing can come
                logger.exception("reading the engine core's outputs failed")
                self._set_dead(EngineDeadError(f"engine core output handling failed: {e!r}"))
                return
            try:
                outputs, to_stop = self.output_processor.process_outputs(eo.outputs,
                                                                         eo.engine_index)
            except Exception as e:  # noqa: BLE001 - a bug on some output of this batch: the
                # requests of the batch fail (the others go on), nobody is left waiting.
                logger.exception("processing engine core outputs failed")
                await self._fail_requests({o.request_id for o in eo.outputs}, e)
                continue
            if to_stop:  # stop strings: the core stops generating for them
                await self.engine_core.abort_requests_async(to_stop)
            for out in outputs:
                q = self._streams.get(out.request_id)
                if q is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                q.put_nowait(out)
            if self.on_step is not None and outputs:
                try:
                    self.on_step(outputs, self.stats)
                except Exception:  # noqa: BLE001 - metrics must not stop the outputs
                    logger.exception("on_step callback failed")

    async def _fail_requests(self, child_ids: set[str], err: BaseException) -> None:
        """Fail the user requests these core requests belong to, and abort them in the core."""
        parents = {self.output_processor.child_to_parent.get(c) for c in child_ids} - {None}
        children = []
        for rid in parents:
            children += self.output_processor.abort(rid)
            q = self._streams.pop(rid, None)
            if q is not None:
                q.put_nowait(RuntimeError(f"processing this request's output failed: {err!r}"))
        if children:
            await self.engine_core.abort_requests_async(children)

    # -- API for asyncio callers ----------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs of one request until it finishes.

        Raises ValueError (bad prompt or parameters) before the first output."""
        self._ensure_handler()
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is not None and params.structured_outputs is not None:
            # Grammar validation (and the backend's first tokenizer build) off the event loop.
            await asyncio.to_thread(self.processor.validate_structured_outputs,
                                    params.structured_outputs)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # (images are decoded, resized and hashed off the event loop)
            text, ids, children = await asyncio.to_thread(
                self.processor.make_requests, request_id, prompt, params, **kwargs)
        else:
            text, ids, children = self.processor.make_requests(request_id, prompt, params,
                                                               **kwargs)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self.output_processor.add_request(request_id, text, ids, children)
        finished = False
        try:
            for child in children:
                await self.engine_core.add_request_async(child)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def encode(self, prompt, pooling_params=None, request_id: str | None = None, *,
                     priority: int = 0, lora_request=None,
                     truncate_prompt_tokens: int | None = None):
        """vLLM's AsyncLLM.encode: a pooling engine's (runner="pooling") vector of one prompt,
        yielded once as a PoolingRequestOutput when its prompt is done (outputs.data: float32,
        after pooling_params' truncation and normalization)."""
        import numpy as np

        from jaxinfer.pooling import PoolingOutput, PoolingRequestOutput, finish

        pooler = self.resolved.pooler
        if self.resolved.runner != "pooling":
            raise ValueError("encode needs a pooling model: runner='pooling'")
        if pooling_params is not None:
            pooling_params.verify(pooler)
            if pooling_params.truncate_prompt_tokens is not None:
                truncate_prompt_tokens = pooling_params.truncate_prompt_tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                truncate_prompt_tokens=truncate_prompt_tokens)
        async for out in self.generate(prompt, params, request_id, priority=priority,
                                       lora_request=lora_request):
            if out.finished:
                if out.pooled is None:
                    raise RuntimeError(f"request {out.request_id} ended without its vector")
                yield PoolingRequestOutput(
                    out.request_id, PoolingOutput(finish(np.frombuffer(out.pooled, np.float32),
                                                         pooler, pooling_params)),
                    out.prompt_token_ids, True, out.num_cached_tokens, out.prompt)

    def abort(self, request_id: str) -> None:
        """Abort a live request (a no-op when it has finished)."""
        self._streams.pop(request_id, None)
        children = self.output_processor.abort(request_id)
        if not children:
            return
        if self.on_abort is not None:
            self.on_abort(request_id)
        if self._dead is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a stream finalised after its loop ended: nothing to tell
                return
            loop.create_task(self.engine_core.abort_requests_async(children))

    # -- LoRA adapters (vLLM's AsyncLLM methods) ------------------------------------------------
    async def add_lora(self, lora_request) -> bool:
        """Load an adapter into the engine core(s) (ValueError naming it and the reason when
        it cannot be served); False when it was loaded already."""
        self.processor.check_lora(lora_request)
        return await self._utility("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call_utility("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        return set(await self.call_utility("list_loras"))

    async def call_utility(self, name: str, *args):
        """Run an EngineCore utility (get_stats, reset_prefix_cache, leak_report, ...)."""
        return await self.engine_core.call_utility_async(name, *args)

    async def _utility(self, name: str, *args):
        """A utility whose ValueError (bad input) comes back as a ValueError."""
        try:
            return await self.engine_core.call_utility_async(name, *args)
        except RuntimeError as e:
            raise as_value_error(e) from None

    # -- RL rollouts: pause / resume, weight updates, sleep / wake up (docs/rl.md) -------------
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (vLLM's AsyncLLM.pause_generation): "abort" ends unfinished
        requests, "wait" returns once they finished, "keep" parks them; new requests wait
        for resume_generation."""
        state = await self._utility("pause_generation", mode, clear_cache)
        while state != "paused":  # ("wait": until every request in run has finished)
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine core died while pausing: "
                                      f"{self.dead_error}")
            await asyncio.sleep(0.01)
            state = await self._utility("get_pause_state")
        await asyncio.sleep(0.02)  # (the last outputs reach their streams first)

    async def resume_generation(self) -> None:
        await self._utility("resume_generation")

    async def is_paused(self) -> bool:
        return await self._utility("is_paused")

    async def update_weights(self, weights, *, layout: str = "hf",
                             weight_version: str | None = None) -> dict:
        """New weights from arrays (the core in this process: its thread swaps them in
        between two steps); see LLMEngine.update_weights."""
        check_in_process(self.engine_core, "update_weights")
        return await self._utility("update_weights", weights, layout, weight_version)

    async def update_weights_from_path(self, path: str,
                                       weight_version: str | None = None) -> dict:
        return await self._utility("update_weights_from_path", path, weight_version)

    async def update_weights_from_transfer(self, payload: dict,
                                           weight_version: str | None = None) -> dict:
        return await self._utility("update_weights_from_transfer", payload, weight_version)

    async def reload_weights(self, weight_version: str | None = None) -> dict:
        return await self._utility("reload_weights", weight_version)

    async def get_weight_version(self) -> str:
        return await self._utility("get_weight_version")

    async def set_weight_version(self, weight_version: str) -> None:
        await self._utility("set_weight_version", weight_version)

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """vLLM's sleep: pause (mode), then free device memory (level 1 or 2; 0: only
        pause). mode "wait" lets unfinished requests finish first."""
        if mode == "wait":
            await self.pause_generation(mode="wait", clear_cache=level >= 1)
        return await self._utility("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._utility("is_sleeping")

    async def collective_rpc(self, method, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        if callable(method):
            check_in_process(self.engine_core, "collective_rpc with a callable")
        return await self._utility("collective_rpc", method, tuple(args), kwargs)

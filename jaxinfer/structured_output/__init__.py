"""Structured outputs: a grammar per request masks the logits every step (vLLM's "guided
decoding").

Front end: `StructuredOutputValidator` picks the backend ("auto": llguidance, then xgrammar
for what llguidance refuses, when installed) and refuses a bad spec with a ValueError naming
it, before the request reaches the core.

Engine core: `StructuredOutputManager` compiles grammars in a thread pool while the request
waits (WAITING_FOR_FSM; the rest of the batch keeps running), caches compiled grammars by spec,
fails a request whose compile outlasts `compile_timeout_s`, and fills the int32 bitmask
[rows, ceil(V/32)] of the requests that sample in a step. The step unpacks it on the device.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from jaxinfer.config import StructuredOutputsConfig
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured_output.backends import (BACKENDS, Backend, Grammar, bitmask_width,
                                                 xgrammar_available)
from jaxinfer.structured_output.limits import StackThreadPool, check_spec_limits

logger = logging.getLogger(__name__)

__all__ = ["StructuredOutputValidator", "StructuredOutputManager", "Grammar", "bitmask_width"]


class _Backends:
    """The backends of one process, each built on first use (llguidance's tokenizer takes
    about half a second; xgrammar's import a few seconds)."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer_source, vocab_size: int):
        self.config = config
        # A callable returning (tokenizer.json text, EOS id), called once, on first use.
        self._tokenizer_source = tokenizer_source
        self._tokenizer = None
        self.vocab_size = vocab_size
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Backend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    self._tokenizer = self._tokenizer_source()
                tokenizer_json, eos = self._tokenizer
                backend = BACKENDS[name](tokenizer_json, self.vocab_size, eos, self.config)
                self._backends[name] = backend
            return backend


    def check_limits(self, params: StructuredOutputsParams) -> None:
        check_spec_limits(params, max_spec_bytes=self.config.max_spec_bytes,
                          max_schema_depth=self.config.max_schema_depth)


class StructuredOutputValidator(_Backends):
    def __init__(self, config: StructuredOutputsConfig, tokenizer_source, vocab_size: int):
        super().__init__(config, tokenizer_source, vocab_size)
        self._pool: StackThreadPool | None = None

    def validate(self, params: StructuredOutputsParams) -> str:
        """The backend that will run `params` (ValueError naming the problem otherwise).
        Within the size and depth limits, on a big-stack thread, within compile_timeout_s."""
        self.check_limits(params)
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = StackThreadPool(2, "jaxinfer-grammar-check")
        fut = self._pool.submit(self._validate, params)
        try:
            return fut.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            fut.cancel()
            raise ValueError(f"structured_outputs.{params.kind}: checking the specification "
                             f"took more than structured_outputs_config.compile_timeout_s="
                             f"{self.config.compile_timeout_s:g} s") from None

    def _validate(self, params: StructuredOutputsParams) -> str:
        try:
            return self._validate_with_backends(params)
        except ValueError:
            raise
        except Exception as e:  # the spec's fault as far as the request is concerned
            raise ValueError(f"structured_outputs.{params.kind}: could not be checked "
                             f"({type(e).__name__}: {e})") from None

    def _validate_with_backends(self, params: StructuredOutputsParams) -> str:
        name = self.config.backend
        if name != "auto":
            self.get(name).validate(params)
            return name
        try:
            self.get("guidance").validate(params)
            return "guidance"
        except ValueError as first:
            if not xgrammar_available():
                raise
            try:
                self.get("xgrammar").validate(params)
            except ValueError:
                raise first from None
            return "xgrammar"


class StructuredOutputManager(_Backends):
    """Engine-core side: compile (thread pool + cache), per-request matchers, bitmask fill."""

    CACHE_SIZE = 256

    def __init__(self, config, tokenizer_source, vocab_size):
        super().__init__(config, tokenizer_source, vocab_size)
        self.width = bitmask_width(vocab_size)
        # (big stacks: backends recurse natively while compiling; limits.py)
        self._executor = StackThreadPool(max(1, ((os.cpu_count() or 1) + 1) // 2),
                                         "jaxinfer-grammar")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._bitmask = np.full((0, self.width), -1, np.int32)
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_rejected_tokens = 0

    def _compile(self, name: str, params: StructuredOutputsParams):
        t0 = time.perf_counter()
        compiled = self.get(name).compile(params)
        self.num_compiles += 1
        self.compile_seconds += time.perf_counter() - t0
        return compiled

    def grammar_init(self, request) -> None:
        """Start the request's grammar: at once on a cache hit, else compiled in the pool while
        the request waits in WAITING_FOR_FSM."""
        from jaxinfer.request import RequestStatus

        params = request.sampling_params.structured_outputs
        self.check_limits(params)  # (ValueError: the core refuses the request)
        name = request.structured_backend or ("guidance" if self.config.backend == "auto"
                                              else self.config.backend)
        request.structured_backend = name
        key = (name, params.key())
        fut = self._compiled.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._executor.submit(self._compile, name, params)
            self._compiled[key] = fut
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        request.grammar_future = fut
        request.grammar_deadline = time.monotonic() + self.config.compile_timeout_s
        if fut.done() and fut.exception() is None:
            self._attach(request)
        else:
            request.status = RequestStatus.WAITING_FOR_FSM

    def _attach(self, request) -> None:
        request.grammar = self.get(request.structured_backend).new_grammar(
            request.grammar_future.result())
        request.grammar_future = None

    def check_ready(self, request) -> str | None:
        """For a WAITING_FOR_FSM request: "" when its grammar is ready (attached), None while it
        is still compiling, else the error that fails the request."""
        fut = request.grammar_future
        if fut.done():
            err = fut.exception()
            if err is not None:
                return f"structured output grammar failed to compile: {err}"
            try:
                self._attach(request)
            except Exception as e:  # noqa: BLE001 - reported to the request, not raised
                return f"structured output grammar failed: {type(e).__name__}: {e}"
            return ""
        if time.monotonic() > request.grammar_deadline:
            return (f"structured output grammar did not compile within "
                    f"structured_outputs_config.compile_timeout_s="
                    f"{self.config.compile_timeout_s:g} s")
        return None

    def grammar_bitmask(self, requests: list, errors: dict[str, str] | None = None
                        ) -> np.ndarray:
        """Rows in `requests` order (each has a grammar): the tokens allowed next. A view of a
        reused buffer, valid until the next call. With `errors`, a request whose matcher fails
        to fill its row is recorded there (request id -> message) and gets an EOS-only row,
        so that one broken grammar fails its own request, not the step."""
        n = len(requests)
        if self._bitmask.shape[0] < n:
            self._bitmask = np.full((max(n, 2 * self._bitmask.shape[0]), self.width), -1,
                                    np.int32)
        bm = self._bitmask[:n]
        bm.fill(0)
        try:
            self._fill(requests, bm)
        except Exception:
            if errors is None:
                raise
            bm.fill(0)
            for i, r in enumerate(requests):  # row by row: find the one(s) that fail
                if r.reasoning_end_ids is not None:
                    bm[i] = -1
                    continue
                try:
                    self.get(r.structured_backend).fill_bitmasks([r.grammar], bm[i:i + 1])
                except Exception as e:  # noqa: BLE001 - reported to that request
                    logger.exception("grammar bitmask of request %s failed", r.request_id)
                    bm[i] = 0
                    errors[r.request_id] = (f"structured output grammar failed: "
                                            f"{type(e).__name__}: {e}")
        # A row with nothing allowed (a matcher in an error state) allows EOS, so the sampler
        # never has to pick among masked tokens.
        empty = ~bm.any(axis=1)
        if empty.any():
            for i in np.flatnonzero(empty):
                eos = requests[i].eos_token_id
                if eos is None:
                    bm[i] = -1
                else:
                    bm[i, eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        return bm

    def _fill(self, requests: list, bm: np.ndarray) -> None:
        by_backend: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            if r.reasoning_end_ids is not None:  # still thinking: any token
                bm[i] = -1
            else:
                by_backend.setdefault(r.structured_backend, []).append(i)
        for name, rows in by_backend.items():
            backend = self.get(name)
            if len(rows) == len(requests):
                backend.fill_bitmasks([r.grammar for r in requests], bm)
            else:
                sub = np.zeros((len(rows), self.width), np.int32)
                backend.fill_bitmasks([requests[i].grammar for i in rows], sub)
                bm[rows] = sub

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""CompiledSteps: the compiled step functions of a runner, keyed by (T, R, StepFeatures):
lowering on demand (through the runner's `lower`), compiling, the cache, the counts and the
warm-up that compiles the common variants ahead of time."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

from jaxinfer.runner.step_inputs import StepFeatures

logger = logging.getLogger(__name__)


class CompiledSteps:
    def __init__(self, lower: Callable[[int, int, StepFeatures], object],
                 base_features: StepFeatures, multiprocess: bool = False):
        """lower(t, r, features): the lowered step of that bucket and variant (its
        .compile() gives the callable). base_features: the variant every step of this engine
        starts from (plain, or spec); others are logged when they compile on first use."""
        self._lower = lower
        self.base_features = base_features
        self.multiprocess = multiprocess  # (multi-host: compile in turn, in step with peers)
        self._compiled: dict[tuple[int, int, StepFeatures], object] = {}
        self.num_compilations = 0
        self.compile_seconds = 0.0

    def __contains__(self, key) -> bool:
        return key in self._compiled

    def keys(self) -> list[tuple[int, int, StepFeatures]]:
        return list(self._compiled)

    def compile(self, t: int, r: int, features: StepFeatures):
        t0 = time.perf_counter()
        compiled = self._lower(t, r, features).compile()
        self._add((t, r, features), compiled, time.perf_counter() - t0)
        return compiled

    def _add(self, key, compiled, seconds: float) -> None:
        self._compiled[key] = compiled
        self.num_compilations += 1
        self.compile_seconds += seconds

    def get(self, t: int, r: int, features: StepFeatures):
        compiled = self._compiled.get((t, r, features))
        if compiled is None:
            if dataclasses.replace(features, verify=False) != self.base_features:
                logger.info("compiling step variant T=%d R=%d %s on first use", t, r, features)
            compiled = self.compile(t, r, features)
        return compiled

    def warmup(self, keys: list[tuple[int, int, StepFeatures]], progress=None,
               num_threads: int | None = None) -> None:
        """Compile `keys` ahead of time (into the persistent cache too). Buckets are traced
        and lowered here, one after another (Python), and compiled by `num_threads` threads
        (default: one per CPU core, at most 4): XLA compiles outside the GIL, so on a 2-core
        machine start-up takes about half the time."""
        from concurrent.futures import ThreadPoolExecutor

        todo = [k for k in keys if k not in self._compiled]
        n = num_threads or min(os.cpu_count() or 1, 4)
        if n <= 1 or self.multiprocess:
            for t, r, f in todo:
                self.compile(t, r, f)
                if progress:
                    progress(t, r)
            return

        def compile_one(lowered):
            t0 = time.perf_counter()
            return lowered.compile(), time.perf_counter() - t0

        with ThreadPoolExecutor(n, thread_name_prefix="jaxinfer-compile") as pool:
            futures = [(key, pool.submit(compile_one, self._lower(*key))) for key in todo]
            for key, fut in futures:
                compiled, seconds = fut.result()
                self._add(key, compiled, seconds)
                if progress:
                    progress(key[0], key[1])

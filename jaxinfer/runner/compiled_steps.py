"""CompiledSteps: the compiled step functions of a runner, keyed by (T, R, StepFeatures):
lowering on demand (through the runner's `lower`), compiling, the cache, the counts, the
warm-up that compiles the start-up buckets ahead of time and the background thread that
compiles the others while the engine serves, and, for layer-wise programs, fuses the buckets
steps use into whole-step programs swapped in as they become ready (most used first).

Any thread may compile a key; a key being compiled by one thread is waited for by the others,
never compiled twice. A step whose bucket is not ready may pad up to a ready larger one
(`choose`): no step waits for the background thread."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Callable

from jaxinfer.runner.step_inputs import StepFeatures

logger = logging.getLogger(__name__)


def background_compile_enabled() -> bool:
    """JAXINFER_BACKGROUND_COMPILE: "1" (default) compiles buckets nobody asked for yet when
    the engine is idle and fuses layer-wise steps into whole programs; "0" only the buckets
    steps ask for, as they were built. Anything else is refused."""
    value = os.environ.get("JAXINFER_BACKGROUND_COMPILE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"JAXINFER_BACKGROUND_COMPILE={value!r}: use 0 or 1")
    return value == "1"


_STOP = object()
# Held while a step is traced and lowered (never while XLA compiles): tracing holds the GIL, so
# threads gain nothing by doing it at once, and a fused step traced beside another lowering
# was seen to fail inside JAX (KeyError on a jaxpr variable) once.
TRACE_LOCK = threading.RLock()
# Engines with a background compiler: stopped at interpreter exit, before daemon threads are
# torn down mid-compile (an abort). Weak: an engine dropped without shutdown goes away.
_LIVE: "weakref.WeakSet[CompiledSteps]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for steps in list(_LIVE):
        steps.close()


def _background_loop(ref) -> None:
    """The background compiler's thread: a weak reference to its CompiledSteps between
    compiles, so it ends when they are closed or collected."""
    _lower_this_threads_priority()
    while True:
        steps = ref()
        if steps is None:
            return
        job = steps._next_job(wait=1.0)
        if job is _STOP:
            steps.background_left = 0
            return
        if job is not None:
            what, key = job
            steps._working = True
            try:
                if what == "fuse":
                    steps._fuse(key)
                else:
                    steps._compile_in_background(key)
            finally:
                steps._working = False
        del steps


def _lower_this_threads_priority() -> None:
    """Nice 19 for the calling thread only (Linux: a thread is a schedulable task with its own
    id), so that compiling in the background takes the cores the running steps leave idle
    rather than half of them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # (not Linux, or not allowed: compile at equal priority)
        pass


class CompiledSteps:
    def __init__(self, lower: Callable[[int, int, StepFeatures], object],
                 base_features: StepFeatures, multiprocess: bool = False,
                 lower_fused: Callable[[int, int, StepFeatures], object] | None = None,
                 hot_steps: int = 64):
        """lower(t, r, features): the lowered step of that bucket and variant (its
        .compile() gives the callable). base_features: the variant every step of this engine
        starts from (plain, or spec); others are logged when they compile on first use.
        lower_fused(t, r, features): the same step lowered as one whole program, for steps
        that run as several (layer-wise: their `.fused` takes it once compiled); None: no
        fusing. hot_steps: a bucket that has run this many steps is fused even while the
        engine is busy (others wait for an idle engine)."""
        self._lower = lower
        self._lower_fused = lower_fused
        self.hot_steps = hot_steps
        self.base_features = base_features
        self.multiprocess = multiprocess  # (multi-host: compile in turn, in step with peers)
        self._compiled: dict[tuple[int, int, StepFeatures], object] = {}
        self.num_compilations = 0
        self.compile_seconds = 0.0
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int, StepFeatures], threading.Event] = {}
        self._background: threading.Thread | None = None
        self._stop = threading.Event()
        self.background_left = 0  # keys the background thread has still to compile
        self._wake = threading.Condition()
        self._demanded: list[tuple[int, int, StepFeatures]] = []  # asked for by steps
        self._last_step = 0.0  # time.monotonic() of the last step started or finished
        self._steps_running = 0  # dispatched and not yet collected
        self.num_padded_steps = 0  # steps that ran in a larger ready bucket than their own
        self._todo: list[tuple[int, int, StepFeatures]] = []  # background, when idle
        self._idle_seconds = 0.5
        self._background_done = 0
        self._uses: dict[tuple[int, int, StepFeatures], int] = {}  # steps run per key
        self._hot: list[tuple[int, int, StepFeatures]] = []  # to fuse, busy or not
        self._fuse_tried: set[tuple[int, int, StepFeatures]] = set()
        self.num_steps = 0
        self.num_layerwise_steps = 0  # steps that ran as several programs (not yet fused)
        self.num_fused = 0
        self.fuse_seconds = 0.0
        self._working = False  # the background thread is at a job

    def __contains__(self, key) -> bool:
        return key in self._compiled

    def keys(self) -> list[tuple[int, int, StepFeatures]]:
        return list(self._compiled)

    def compile(self, t: int, r: int, features: StepFeatures):
        """The compiled step of this key: compiled here, or by the thread already at it."""
        key = (t, r, features)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                return compiled
            event = self._pending.get(key)
            mine = event is None
            if mine:
                event = self._pending[key] = threading.Event()
        if not mine:
            event.wait()
            compiled = self._compiled.get(key)
            return compiled if compiled is not None else self.compile(t, r, features)
        try:
            t0 = time.perf_counter()
            with TRACE_LOCK:
                lowered = self._lower(t, r, features)
            compiled = lowered.compile()
            self._add(key, compiled, time.perf_counter() - t0)
            logger.debug("compiled T=%d R=%d %s in %.2fs (%s)", t, r, features,
                         time.perf_counter() - t0, threading.current_thread().name)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        return compiled

    def _add(self, key, compiled, seconds: float) -> None:
        with self._lock:
            self._compiled[key] = compiled
            self.num_compilations += 1
            self.compile_seconds += seconds

    def get(self, t: int, r: int, features: StepFeatures):
        """The compiled step of this key, for a step about to run (counted)."""
        key = (t, r, features)
        compiled = self._compiled.get(key)
        if compiled is None:
            if dataclasses.replace(features, verify=False) != self.base_features:
                logger.info("compiling step variant T=%d R=%d %s on first use", t, r, features)
            compiled = self.compile(t, r, features)
        self.num_steps += 1
        if getattr(compiled, "fused", False) is None:  # (several programs, not fused yet)
            self.num_layerwise_steps += 1
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses == self.hot_steps and self._lower_fused is not None:
                with self._wake:
                    self._hot.append(key)
                    self._wake.notify()
        return compiled

    def choose(self, t: int, r: int, features: StepFeatures, max_growth: int = 2
               ) -> tuple[int, int]:
        """The bucket a step of bucket (t, r) runs in: its own when compiled; else the
        smallest compiled one that holds it with T' <= max_growth x T, while its own
        compiles in the background (first in line); else its own, compiled on the spot by
        get (a decode step padded 4x would run its layers on 4x the tokens step after step:
        compiling its own bucket, ~1.4 s, costs less)."""
        key = (t, r, features)
        if key in self._compiled:
            return t, r
        with self._lock:
            ready = [(t2, r2) for t2, r2, f in self._compiled
                     if f == features and t <= t2 <= max_growth * t and r2 >= r]
        if not ready or self._background is None:
            return t, r
        with self._wake:
            if key not in self._demanded:
                self._demanded.append(key)
            self._wake.notify()
        self.num_padded_steps += 1
        return min(ready)

    def step_started(self) -> None:
        """A step was dispatched (the runner): buckets nobody asked for wait."""
        with self._wake:
            self._steps_running += 1
            self._last_step = time.monotonic()

    def step_finished(self) -> None:
        """A step was collected. (No wake-up: the background thread waits for idleness with a
        timeout; waking it after every step cost each decode step a thread switch.)"""
        with self._wake:
            self._steps_running = max(0, self._steps_running - 1)
            self._last_step = time.monotonic()

    def _idle_for(self) -> float:
        """Seconds since the engine last ran a step (0 while one runs)."""
        return 0.0 if self._steps_running else time.monotonic() - self._last_step

    def start_background(self, keys: list[tuple[int, int, StepFeatures]],
                         idle_seconds: float = 0.5) -> None:
        """A background thread (nice 19) that compiles, first, the buckets steps asked for
        while they ran padded up (choose), then `keys` in order, but those only once no step
        has run for `idle_seconds`: compiling takes CPU that running steps would otherwise
        have (measured: 2x slower steps), so buckets nobody needs yet wait for an idle
        engine. The thread holds this object only while it compiles: an engine dropped
        without shutdown is still collected (and its thread ends)."""
        if self.multiprocess:
            return
        self._todo = [k for k in keys if k not in self._compiled]
        self.background_left = len(self._todo)
        self._idle_seconds = idle_seconds
        _LIVE.add(self)
        self._background = threading.Thread(target=_background_loop,
                                            args=(weakref.ref(self),),
                                            name="jaxinfer-bg-compile", daemon=True)
        self._background.start()

    def _next_job(self, wait: float):
        """The next job, ("compile" | "fuse", key), None if there is none within `wait`
        seconds, or _STOP. In order: buckets steps asked for; hot buckets to fuse; once the
        engine is idle, buckets nobody asked for yet, then the other buckets steps used
        (most steps first) to fuse."""
        with self._wake:
            if self._stop.is_set():
                return _STOP
            if self._demanded:
                return "compile", self._demanded.pop(0)
            if self._hot:
                return "fuse", self._hot.pop(0)
            idle = self._idle_for()
            if idle >= self._idle_seconds:
                if self._todo:
                    return "compile", self._todo.pop(0)
                used = self._to_fuse()
                if used:
                    return "fuse", used[0]
            later = self._todo or self._to_fuse()
            self._wake.wait(min(wait, max(self._idle_seconds - idle, 0.01)) if later
                            else wait)
            return _STOP if self._stop.is_set() else None

    def _to_fuse(self) -> list[tuple[int, int, StepFeatures]]:
        """Keys steps ran on as several programs, not fused (nor tried), most used first."""
        if self._lower_fused is None:
            return []
        uses = dict(self._uses)  # (a copy: steps count into it meanwhile)
        return sorted((k for k in uses if k not in self._fuse_tried), key=lambda k: -uses[k])

    def _fuse(self, key) -> None:
        """Compile `key`'s step as one program and swap it in (its `.fused`): the steps
        dispatched after that run it. A failure leaves the step as it was."""
        with self._wake:
            if key in self._fuse_tried:
                return
            self._fuse_tried.add(key)
        step = self._compiled.get(key)
        if step is None or getattr(step, "fused", False) is not None:
            return
        try:
            t0 = time.perf_counter()
            with TRACE_LOCK:
                lowered = self._lower_fused(*key)
            fused = lowered.compile()
        except Exception:  # noqa: BLE001 - the bucket keeps running as it did
            logger.exception("fusing the step of bucket %s failed", key[:2])
            return
        step.fused = fused
        with self._lock:
            self.num_fused += 1
            self.fuse_seconds += time.perf_counter() - t0
        logger.debug("fused T=%d R=%d %s into one program in %.2fs", key[0], key[1], key[2],
                     time.perf_counter() - t0)

    def _compile_in_background(self, key) -> None:
        try:
            if key not in self._compiled:
                self.compile(*key)
                self._background_done += 1
        except Exception:  # noqa: BLE001 - that bucket compiles on first use instead
            logger.exception("background compilation of bucket %s failed", key[:2])
        self.background_left = len(self._todo)  # (after the compile: none left = all done)
        if not self._todo and not self._demanded and self._background_done:
            logger.info("compiled %d more buckets in the background",
                        self._background_done)
            self._background_done = 0

    def settled(self) -> bool:
        """Nothing left for the background thread: every bucket compiled and every bucket
        steps used fused (or no background thread). Benchmarks wait for it to time the
        steady state an engine reaches."""
        if self._background is None or not self._background.is_alive():
            return True
        with self._wake:
            return not (self._working or self._demanded or self._hot or self._todo
                        or self._to_fuse())

    def close(self, timeout: float = 30.0) -> None:
        """Stop the background compilation (after the bucket it is at)."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        _LIVE.discard(self)
        if self._background is not None and self._background is not threading.current_thread():
            self._background.join(timeout)

    def warmup(self, keys: list[tuple[int, int, StepFeatures]], progress=None,
               num_threads: int | None = None, fuse=()) -> None:
        """Compile `keys` ahead of time (into the persistent cache too), by `num_threads`
        threads (default: one per CPU core, at most 4): tracing takes the GIL, but XLA
        compiles outside it, so on a 2-core machine start-up takes about half the time.
        Then fuse the keys in `fuse` (no-op without fusing), with the same threads."""
        from concurrent.futures import ThreadPoolExecutor

        todo = [k for k in keys if k not in self._compiled]
        fuse = [k for k in fuse if self._lower_fused is not None and not self.multiprocess]
        n = num_threads or min(os.cpu_count() or 1, 4)
        if n <= 1 or self.multiprocess:  # (multi-host: in turn, in step with the peers)
            for t, r, f in todo:
                self.compile(t, r, f)
                if progress:
                    progress(t, r)
            for key in fuse:
                self._fuse(key)
            return
        with ThreadPoolExecutor(n, thread_name_prefix="jaxinfer-compile") as pool:
            futures = [(key, pool.submit(self.compile, *key)) for key in todo]
            for key, fut in futures:
                fut.result()
                if progress:
                    progress(key[0], key[1])
            for fut in [pool.submit(self._fuse, key) for key in fuse]:
                fut.result()

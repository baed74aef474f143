"""The persistent XLA compilation cache: where it lives, entries a crash left corrupt, and
how many compilations it answered."""

from __future__ import annotations

import logging
import os
import threading

import jax

logger = logging.getLogger(__name__)


_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"


class CompileCacheCounter:
    """Compilations that asked the persistent cache, and those it answered, from this
    object's creation until close() (jax.monitoring events of this process)."""

    def __init__(self):
        self.requests = self.hits = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event in (_REQUESTS, _HITS):
            with self._lock:
                if event == _REQUESTS:
                    self.requests += 1
                else:
                    self.hits += 1

    def counts(self) -> dict[str, int]:
        return {"compile_cache_requests": self.requests, "compile_cache_hits": self.hits}

    def close(self) -> None:
        try:
            jax.monitoring.unregister_event_listener(self._on_event)
        except (AssertionError, ValueError):  # (already gone)
            pass


def enable_compilation_cache(path: str | None) -> None:
    """The persistent compilation cache in `path` ("": off; None: JAXINFER_COMPILATION_CACHE_DIR,
    else <jaxinfer cache>/xla)."""
    from jaxinfer.checkpoints.cache import cache_dir

    if path is None:
        path = os.environ.get("JAXINFER_COMPILATION_CACHE_DIR")
    if path == "":
        _use_cache_dir(None)
        return
    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    drop_corrupt_cache_entries(path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _use_cache_dir(path)


def _use_cache_dir(path: str | None) -> None:
    """Point JAX's persistent cache at `path` (None: off). JAX opens its cache once per
    process and ignores a later change of the directory, so an engine that asks for another
    one (or for none) resets it."""
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    try:
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # (another JAX: the first directory stays)
        logger.warning("could not switch the persistent compilation cache to %s", path)


_VERIFIED = "jaxinfer-verified.json"


def drop_corrupt_cache_entries(path: str) -> int:
    """Remove the entries of the persistent compile cache in `path` that do not decompress
    (cut short by a crash, or overwritten): JAX warns on each read and compiles afresh, but
    never writes a key that exists, so without this a corrupt entry would cost a compile at
    every start. Entries checked before (same size and mtime, listed in a manifest) are not
    read again. Returns how many were removed (one log line says so). Entries of another
    JAX version or device are never corrupt, only unused: their keys differ."""
    import json

    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:  # (another JAX: its own checks only)
        return 0
    manifest = os.path.join(path, _VERIFIED)
    try:
        with open(manifest) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    verified, bad = {}, []
    for name in sorted(os.listdir(path)):
        if not name.endswith("-cache"):
            continue
        full = os.path.join(path, name)
        try:
            st = os.stat(full)
            sig = [st.st_size, st.st_mtime_ns]
            if seen.get(name) != sig:
                with open(full, "rb") as f:
                    decompress_executable(f.read())
            verified[name] = sig
        except FileNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - whatever the codec raises: the entry is unusable
            bad.append(name)
            for victim in (full, full[: -len("-cache")] + "-atime"):
                try:
                    os.remove(victim)
                except OSError:
                    pass
    if bad:
        logger.warning("persistent compilation cache %s: removed %d corrupt entr%s of %d "
                       "(compiled and written again when next needed)", path, len(bad),
                       "y" if len(bad) == 1 else "ies", len(bad) + len(verified))
    if verified != seen:
        tmp = f"{manifest}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(verified, f)
            os.replace(tmp, manifest)
        except OSError:
            pass
    return len(bad)

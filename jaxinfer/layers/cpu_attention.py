"""The `cpu` attention backend: ragged paged attention as a C++ XLA FFI custom call.

The kernel (jaxinfer/csrc/paged_attention_cpu.cc) reads each KV page in place and does only
the attention math, on XLA's intra-op thread pool. It is compiled here, on first use, with the
machine's C++ compiler against the FFI headers jaxlib ships (no network), into the cache
folder (<cache>/ext, keyed by the source, jaxlib's version, the compiler flags and this CPU's
instruction-set flags), under a file lock so concurrent engine processes build it once.
`make setup` builds it ahead. Where it cannot be built (no compiler), `available()` says so,
the reason is logged once, and the default backend on CPU stays `xla`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess

import jax
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxinfer_paged_attention_cpu"
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                       "paged_attention_cpu.cc")
# -ffast-math lets GCC call glibc's vector exp (libmvec); the kernel uses no infinities or NaNs
# (a finite mask value; positions outside a row's window are never read).
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-std=c++17", "-fPIC",
          "-shared"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def _cache_dir() -> str:
    from jaxinfer.models.default_model import cache_dir

    return os.path.join(cache_dir(), "ext")


def library_path() -> str:
    import jaxlib

    with open(_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read())
    key.update(" ".join(_FLAGS + [jaxlib.__version__, _cpu_flags()]).encode())
    return os.path.join(_cache_dir(), f"paged_attention_cpu-{key.hexdigest()[:16]}.so")


def build() -> str:
    """Compile the kernel unless this exact build exists; returns the library's path."""
    import fcntl

    path = library_path()
    if os.path.isfile(path):
        return path
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") \
        or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(path):  # another process built it meanwhile
            return path
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), _SOURCE, "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a reader never sees half a library
    return path


@functools.cache
def available() -> bool:
    """Whether the kernel is built (building it now if needed) and registered with XLA."""
    if os.environ.get("JAXINFER_CPU_ATTENTION", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferPagedAttentionCpu),
                                    platform="cpu")
    except Exception as e:  # noqa: BLE001  (any build or load failure: fall back, say why)
        logger.warning("cpu attention backend unavailable, using xla: %s", e)
        return False
    return True


def ragged_paged_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                               num_seqs, *, sm_scale: float, sliding_window: int | None = None):
    """Same contract as `ragged_paged_attention_reference`; q [T, Hq, D] -> [T, Hq, D]."""
    if not available():
        raise RuntimeError("attention_backend='cpu' needs the C++ kernel, which could not be "
                           "built here (see the warning above)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    i32 = np.int32
    return call(q, k_cache, v_cache, kv_lens.astype(i32), block_tables.astype(i32),
                query_start_loc.astype(i32), num_seqs.astype(i32),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0))

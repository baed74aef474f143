"""Freed host memory kept for reuse on CPU engines.

Each CPU step allocates its buffers afresh (XLA's temporaries and outputs, the kernels'
scratch). glibc serves large requests with mmap and gives them back on free (and trims the
heap's top past 128 KB), so every step page-faulted its buffers in again: ~4300 faults a
decode step of 32 sequences; keeping them saved 6-20% of the process's CPU time. With malloc's
mmap and trim thresholds raised to 256 MB after the weights are loaded, freed buffers stay
in the heap and the next step reuses them (benchmarks/results/cpu_malloc_keep_ab_amd.json).
This is what vLLM's CPU backend asks of its users by preloading tcmalloc.

JAXINFER_CPU_MALLOC_KEEP: "1" (default) or "0" (glibc's defaults); anything else is refused.
A user's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or glibc.malloc tunables are
left as they are. Sleep mode gives the freed memory back (release_freed_memory).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

KEEP_BYTES = 256 << 20
_M_TRIM_THRESHOLD = -1  # (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(env=None, *, cpu: bool = True) -> bool:
    """Raise glibc malloc's mmap and trim thresholds to KEEP_BYTES on a CPU engine; whether it
    did. The switch is checked on every engine, so a bad value is refused on GPUs too."""
    env = os.environ if env is None else env
    value = env.get("JAXINFER_CPU_MALLOC_KEEP", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"JAXINFER_CPU_MALLOC_KEEP={value!r}: use 0 or 1")
    if not cpu or value == "0" or platform.system() != "Linux":
        return False
    if ("MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", "")):
        return False  # the user's own settings stand
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = (mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1
          and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1)
    if not ok:
        logger.warning("mallopt refused the thresholds: per-step buffers are faulted in afresh")
    return ok


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (malloc_trim), where libc is glibc."""
    if platform.system() != "Linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

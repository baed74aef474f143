"""Freed host memory kept in malloc's heap on CPU engines (runner/host_malloc.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from jaxinfer.runner import host_malloc

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0]
                                == "glibc", reason="glibc's malloc thresholds")

# A 64 MB buffer filled, freed, allocated again and filled again: the page faults of the
# second fill (each fresh page faults once; reused heap pages do not).
_REFILL = """
import ctypes, resource, sys
from jaxinfer.runner import host_malloc
kept = host_malloc.keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
n = 64 << 20
p = libc.malloc(n); libc.memset(p, 1, n); libc.free(p)
p = libc.malloc(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.memset(p, 2, n)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _refill_faults(mode: str, env=None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _REFILL, mode], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_a_freed_step_buffer_is_reused_without_page_faults():
    kept, faults = _refill_faults("keep")
    assert kept == "True"
    assert faults < 500  # (16384 pages of 4 KB: none of them fresh)
    kept, faults = _refill_faults("default")
    assert kept == "False" and faults > 8000  # glibc's defaults: mmap'd afresh


def test_the_switch_takes_0_or_1_and_a_users_own_settings_stand():
    with pytest.raises(ValueError, match="JAXINFER_CPU_MALLOC_KEEP='yes'"):
        host_malloc.keep_freed_memory({"JAXINFER_CPU_MALLOC_KEEP": "yes"})
    with pytest.raises(ValueError, match="JAXINFER_CPU_MALLOC_KEEP='2'"):  # (GPU engines too)
        host_malloc.keep_freed_memory({"JAXINFER_CPU_MALLOC_KEEP": "2"}, cpu=False)
    assert host_malloc.keep_freed_memory({}, cpu=False) is False
    assert host_malloc.keep_freed_memory({"JAXINFER_CPU_MALLOC_KEEP": "0"}) is False
    for env in ({"MALLOC_MMAP_THRESHOLD_": "65536"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}):
        assert host_malloc.keep_freed_memory(env) is False

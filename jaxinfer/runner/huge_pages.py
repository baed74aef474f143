"""Transparent huge pages for a CPU engine's weights.

XLA:CPU allocates its buffers with malloc, on 4 KiB pages. Where the kernel's transparent huge
pages are in `madvise` mode (the default of many distributions) they never get 2 MiB pages, and
a decode step, which streams every weight, misses the TLB every 4 KiB. Once the engine has
placed its weights, `back_with_huge_pages` asks for huge pages over their memory (madvise
MADV_HUGEPAGE; rounded outwards to 2 MiB, as many weights are smaller and share pages with
their neighbours) and collapses the resident pages into huge ones at once (MADV_COLLAPSE,
Linux 6.1+; ~0.25 s a GiB on the Zen 5 VM). Weights that replace others while the engine
serves (updates, wake-up) are collapsed on a background thread (`back_with_huge_pages_later`).

Not the KV caches: collapsing them cost ~0.8 s a GiB at start-up there, and dropping their
pages to have them fault back in as huge pages made the first steps over each block slow
(~2 ms a fresh 2 MiB page on that VM) and a 32 x 128/128 run ~12% slower. Nor every
allocation (glibc's malloc.hugetlb=1): each step's temporaries would fault in 2 MiB at a time.

JAXINFER_CPU_HUGE_PAGES: "1" (default) or "0" (XLA's pages as they come); anything else is
refused. Nothing happens off Linux or where transparent huge pages are "never".
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading

import jax

HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The kernel's transparent huge page mode: always / madvise / never ("" if unknown)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_pages_enabled(env=None, *, cpu: bool = True) -> bool:
    """Whether a CPU engine backs its weights with huge pages. The switch is checked on every
    engine, so a bad value is refused on GPUs too."""
    env = os.environ if env is None else env
    value = env.get("JAXINFER_CPU_HUGE_PAGES", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"JAXINFER_CPU_HUGE_PAGES={value!r}: use 0 or 1")
    return (cpu and value == "1" and sys.platform.startswith("linux")
            and thp_mode() in ("always", "madvise"))


def _mappings() -> list[tuple[int, int]]:
    """The process's mappings [(start, end)], in address order."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split(None, 1)[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def outer_spans(buffers, maps) -> list[tuple[int, int]]:
    """The 2 MiB-aligned spans covering `buffers` [(address, bytes)], each clipped to the
    mappings that hold its buffer (its first byte's below, its last byte's above: a buffer
    may run over several adjacent mappings, as an earlier madvise splits one where its flags
    change), merged where they touch; buffers outside every mapping are left out."""
    starts = [lo for lo, _ in maps]

    def holder(address):
        i = bisect.bisect_right(starts, address) - 1
        return i if i >= 0 and maps[i][0] <= address < maps[i][1] else None

    out = []
    for address, size in buffers:
        if size <= 0:
            continue
        first, last = holder(address), holder(address + size - 1)
        if first is None or last is None:
            continue
        out.append((max(address // HUGE * HUGE, maps[first][0]),
                    min(-(-(address + size) // HUGE) * HUGE, maps[last][1])))
    out.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def cpu_buffers(tree) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU shard of the arrays in `tree`."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.nbytes:
                out.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return out


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def back_with_huge_pages(weights) -> dict:
    """Huge pages for the memory of the arrays of `weights` (their contents kept). Returns
    the bytes advised and collapsed; a failing call leaves the pages as they were (a hint).
    Collapsed one huge page at a time, each tried twice: MADV_COLLAPSE fails a whole range
    when one page of it cannot be collapsed now (EAGAIN under memory pressure)."""
    return _advise_and_collapse(outer_spans(cpu_buffers(weights), _mappings()))


def back_with_huge_pages_later(weights) -> threading.Thread:
    """`back_with_huge_pages` on a thread of its own at the lowest priority, for weights that
    replace others while the engine serves (updates, wake-up): the call returns at once. A
    trainer's freshly allocated arrays, taken without a copy, took up to ~1.2 s for SmolLM2's
    0.5 GB in float32 to collapse on the Zen 5 VM, where the update itself took 5 ms. The
    spans are read now, while the arrays are known; the thread's result is its `.done`."""
    spans = outer_spans(cpu_buffers(weights), _mappings())
    thread = threading.Thread(target=_collapse_quietly, args=(spans,), daemon=True,
                              name="jaxinfer-huge-pages")
    thread.done = None
    thread.start()
    return thread


def _collapse_quietly(spans) -> None:
    thread = threading.current_thread()
    try:  # (Linux: a thread's nice value is its own)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass
    # (a range freed or unmapped meanwhile makes its calls fail: a hint, nothing lost)
    thread.done = _advise_and_collapse(spans)


def _advise_and_collapse(spans) -> dict:
    madvise = _madvise()
    done = {"advised_bytes": 0, "collapsed_bytes": 0}
    for lo, hi in spans:
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            continue
        done["advised_bytes"] += hi - lo
        # (the aligned huge pages inside the span: a span clipped to its mapping may start or
        # end between boundaries, and a page there cannot be huge)
        for page in range(-(-lo // HUGE) * HUGE, hi // HUGE * HUGE, HUGE):
            if any(madvise(page, HUGE, _MADV_COLLAPSE) == 0 for _ in range(2)):
                done["collapsed_bytes"] += HUGE
    return done

"""Process-wide CPU allocator setting for training loops: keep freed memory for reuse.

A CPU training step allocates and frees the same large temporaries (gathered vectors,
gradients, key buffers of a few MB) every step. glibc's ``malloc`` serves blocks above its
mmap threshold with fresh ``mmap`` s and hands the top of its heap back to the system once
more than its trim threshold is free, so the next step touches brand-new pages: one page
fault per 4 KiB. On virtual machines a fault costs microseconds, and a step of
:class:`sparsekit.EmbeddingBagCollection` measured ~4,000 faults and 7-13 ms of system
time per step (``benchmarks/bench_collection.py``: 24 ms steps instead of 15.5 ms).
:func:`keep_freed_memory` raises both thresholds, so freed blocks stay in the process and
are reused without faults; the cost is that the process keeps its peak heap (as PyTorch's
CUDA caching allocator keeps its peak on the GPU). It is what ``LD_PRELOAD`` of jemalloc or
tcmalloc, PyTorch's own advice for CPU training, achieves without a second library.

Nothing calls it on import: it changes the whole process. ``python -m sparsekit.train``
and ``benchmarks/`` call it (both sides of a comparison run under it); call it at the start
of your own training script.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_memory"]

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit systems.
_MAX_MMAP_THRESHOLD = 32 << 20

_applied = False


def keep_freed_memory(mmap_threshold: int = _MAX_MMAP_THRESHOLD, trim_threshold: int = 1 << 30) -> bool:
    """Sets glibc ``malloc`` to serve blocks below ``mmap_threshold`` bytes from its heap and
    to return heap memory to the system only when more than ``trim_threshold`` bytes are free.

    Args:
        mmap_threshold: blocks at least this large still get their own ``mmap`` (and are
            unmapped when freed): at most 32 MiB, glibc's limit.
        trim_threshold: free bytes at the top of the heap kept before any is returned.

    Returns:
        True when glibc took both settings; False on another C library (musl, macOS,
        Windows), where nothing is changed.

    Raises:
        ValueError: a threshold that is not an int in range.
    """
    global _applied
    for name, value, high in (("mmap_threshold", mmap_threshold, _MAX_MMAP_THRESHOLD),
                              ("trim_threshold", trim_threshold, (1 << 31) - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"keep_freed_memory: {name} must be an int in [0, {high}], got {value!r}")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    _applied = _applied or ok
    return ok


def freed_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` has taken effect in this process."""
    return _applied

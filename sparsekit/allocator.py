"""CPU memory for training: keep freed memory for reuse (a process-wide allocator setting),
and tables read at random rows in huge pages (:func:`table_full`, :func:`huge_tables`).

A CPU training step frees and allocates the same large temporaries every step, and glibc
hands them back to the system, so every step faults in fresh pages.
:func:`keep_freed_memory` raises glibc's mmap and trim thresholds so freed blocks are
reused (the process keeps its peak heap, as CUDA's caching allocator does); measured by
``benchmarks/bench_collection.py``. Nothing calls it on import: it changes the whole
process. ``python -m sparsekit.train`` and ``benchmarks/`` call it; call it at the start of
your own training script.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
from typing import Iterator

import torch

__all__ = ["keep_freed_memory", "table_full", "table_zeros"]

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


# ---- tables in huge pages ----

# madvise advice (Linux's mman-common.h, the same value on every architecture).
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 1 << 21
# Tables from this size go in huge pages (see table_full).
HUGE_TABLE_BYTES = 256 << 20
_madvise = None
# Set by huge_tables(): every table of at least one huge page asks for them.
_huge_all = False


@contextlib.contextmanager
def huge_tables(enabled: bool) -> Iterator[None]:
    """Within, when ``enabled``: every :func:`table_full` / :func:`table_zeros` of at least
    one huge page asks for huge pages, whatever its own size. For tables read together at
    random rows (a collection's), where the TLB's reach is spent on all of them at once: 26
    tables of 64 MiB miss it as one of 1.6 GiB does (``benchmarks/bench_bags.py``, 1M-row
    cells)."""
    global _huge_all
    before, _huge_all = _huge_all, bool(enabled) or _huge_all
    try:
        yield
    finally:
        _huge_all = before


def _libc_madvise():
    """glibc's ``madvise`` through ctypes, or None where there is none (cached)."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if platform.system() == "Linux":
            try:
                function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
            except (OSError, AttributeError):
                function = None
            if function is not None:
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                function.restype = ctypes.c_int
                _madvise = function
    return _madvise or None


def huge_page_mode() -> str:
    """The kernel's transparent huge page setting (``always``, ``madvise`` or ``never``);
    ``never`` where it cannot be read (not Linux, no THP)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def table_full(shape, fill_value, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.full(shape, fill_value)`` for a table read at random rows (an embedding
    weight, its Adam moments, a hash table's slots): on a Linux CPU, a table of at least
    ``HUGE_TABLE_BYTES`` (256 MiB) asks for transparent huge pages (``MADV_HUGEPAGE``)
    before the fill first touches its pages.

    A lookup of a random row in a table far larger than the TLB's reach costs a page walk
    per row with 4 KiB pages; with 2 MiB pages a few thousand TLB entries cover gigabytes
    (measured by ``benchmarks/bench_huge_pages.py``). The price is paid once, when the
    table is made (a fresh huge page can fault in slowly), which a short run never earns
    back, hence the threshold: a table of 256 MiB serves a long training run. The hint
    costs no memory, since the fill touches every page anyway;
    where THP is off (``never``) or this is not Linux it changes nothing, and any failure
    of it is ignored.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    # device None is the current default device (torch.device("meta") as a context, say).
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    # A plain CPU tensor with memory of its own (not a FakeTensor under tracing, whose
    # data_ptr is 0).
    real = type(out) is torch.Tensor and out.device.type == "cpu"
    threshold = _HUGE_PAGE if _huge_all else HUGE_TABLE_BYTES
    madvise = _libc_madvise() if real and nbytes >= threshold else None
    if madvise is not None:
        begin = out.data_ptr()
        first = (begin + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        last = (begin + nbytes) & ~(_HUGE_PAGE - 1)
        if last > first:
            madvise(first, last - first, _MADV_HUGEPAGE)
    return out.fill_(fill_value)


def table_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``table_full(shape, 0, ...)``: a zeroed table, in huge pages when it is large."""
    return table_full(shape, 0, dtype, device)

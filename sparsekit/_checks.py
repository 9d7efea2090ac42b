"""Checks shared by the ops, the hash table and the layers."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

# Messages of torch's allocators (CPU, CUDA) and of its size arithmetic.
_ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "storage size calculation overflowed",
                        "tried to allocate", "overflow when unpacking")


class AllocationError(MemoryError, RuntimeError):
    """A tensor sized by an argument cannot be allocated (a MemoryError and, like torch's
    own allocation failures, a RuntimeError)."""


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        size /= 1024
        if size < 1024 or unit == "EiB":
            return f"{count:,} bytes ({size:,.1f} {unit})"
    raise AssertionError("unreachable")


@contextlib.contextmanager
def allocation(what: str, shape: Sequence[int], dtype: torch.dtype, device) -> Iterator[None]:
    """Turns an allocation failure inside the block into an error that names what was being
    allocated (``what``: the argument that sized it) and the bytes it would need.

    Args:
        what: e.g. ``"HashTable: capacity=1099511627776 (2 slot arrays)"``.
        shape: the shape of the largest tensor allocated.
        dtype: its dtype.
        device: where it goes.
    """
    try:
        yield
    except (RuntimeError, MemoryError, TypeError) as error:
        if not (isinstance(error, (MemoryError, torch.OutOfMemoryError))
                or any(marker in str(error).lower() for marker in _ALLOCATION_FAILURES)):
            raise
        numel = 1
        for size in shape:
            numel *= int(size)
        needed = numel * torch.empty((), dtype=dtype).element_size()
        where = "the default device" if device is None else str(device)
        raise AllocationError(f"{what}: needs a {list(shape)} {dtype} tensor of {_bytes(needed)} on {where}, "
                              "which cannot be allocated; choose a smaller value") from error

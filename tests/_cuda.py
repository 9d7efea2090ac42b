"""Helpers of the CUDA-only tests."""

import warnings
from typing import Callable

import torch


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times ``fn()`` makes the host wait for the GPU, as torch's sync debug mode
    sees them (``.item()``, ``.cpu()``, a copy to pageable memory, ``nonzero`` ...)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)

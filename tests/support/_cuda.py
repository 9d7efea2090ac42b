"""Helpers of the CUDA-only tests."""

import os
import sys
import tempfile
import warnings
from typing import Callable

import torch


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times ``fn()`` makes the host wait for the GPU, as torch's sync debug mode
    sees them (``.item()``, ``.cpu()``, a copy to pageable memory, ``nonzero`` ...).

    The mode's warnings come two ways: as Python warnings from the ops called from Python,
    and printed by c10 on stderr from inside sparsekit's kernels (their copies of a count to
    the host: the GPU run showed them there, not among the Python warnings). Both are
    counted; stderr is read at the file descriptor."""
    torch.cuda.synchronize()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        printed.seek(0)
        text = printed.read().decode(errors="replace")
    # Only the syncs: the first use of the debug mode in a process also warns that it "is a
    # prototype feature" (counted as a sync, it made one call of a test count one more).
    return sum(SYNC_WARNING in str(w.message) for w in caught) + text.count(SYNC_WARNING)


SYNC_WARNING = "called a synchronizing CUDA operation"

"""Where the host may read a tensor's values: the one place the step's Python decides it.

A CPU tensor's values are host memory, free to read; a GPU tensor's wait for the device (a
host sync). The step takes its host-side shortcuts (numpy checks, host lists) only where
:func:`host_readable` allows, so :func:`emulate_device` runs the GPU branches on CPU tensors
and a test counts what they read back (``tests/collection/test_collection_syncs.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import Tensor

__all__ = ["host_readable", "emulate_device"]

_emulating = False


def host_readable(tensor: Tensor) -> bool:
    """Whether ``tensor``'s values can be read without waiting for a device."""
    return tensor.device.type == "cpu" and not _emulating


@contextlib.contextmanager
def emulate_device() -> Iterator[None]:
    """Within: every tensor is treated as a device's, so the GPU branches run on the CPU."""
    global _emulating
    before, _emulating = _emulating, True
    try:
        yield
    finally:
        _emulating = before

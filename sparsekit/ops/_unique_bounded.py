"""The fake of ``sparsekit::unique_bounded`` (distinct keys in ``[0, bound)`` numbered with a
bitmap, ``csrc/cpu/unique_bounded_cpu.cpp``) and the rule for when the CPU uses it instead
of the hash-based ``unique``."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._checks import index_dtype


# Bits of bitmap per lookup up to which the CPU numbers the distinct rows with
# unique_bounded (a bitmap of the table's rows) rather than the hash-based unique: zeroing
# and scanning a word of the bitmap costs less than hashing one key.
_BOUNDED_UNIQUE_BITS_PER_KEY = 128


def _bitmap_numbers(bound: int, n: int) -> bool:
    """Whether the CPU numbers ``n`` rows in ``[0, bound)`` with ``unique_bounded``'s bitmap
    rather than hashing them (see ``_BOUNDED_UNIQUE_BITS_PER_KEY``)."""
    return bound <= _BOUNDED_UNIQUE_BITS_PER_KEY * n + (1 << 16)


@torch.library.register_fake("sparsekit::unique_bounded")
def _unique_bounded_fake(keys: Tensor, bound, group: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    index_dtype("unique_bounded", "keys", keys, "tensor of keys")
    # The bitmaps take bound / 8 bytes per worker (the kernel's bound). Two checks: a traced
    # bound gets no guard on a compound condition.
    torch._check(bound >= 0, lambda: f"unique_bounded: bound must lie in [0, 2^40), got {bound}")
    torch._check(bound < 1 << 40, lambda: f"unique_bounded: bound must lie in [0, 2^40), got {bound}")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (keys.new_empty(num_unique), keys.new_empty(keys.shape, dtype=torch.int64),
            keys.new_empty(num_unique + 1 if group else 0, dtype=torch.int64),
            keys.new_empty(keys.numel() if group else 0, dtype=torch.int64))

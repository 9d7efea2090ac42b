"""``unique`` and the fakes of ``sparsekit::unique`` / ``sparsekit::unique_tables``
(``csrc/cpu/unique_cpu.cpp``, ``csrc/cuda/unique_cuda.cu``)."""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
from torch import Tensor

from .._checks import csr_offsets, index_dtype, shape_of, tensor_arguments
from ._common import _flag, _ops


@torch.library.register_fake("sparsekit::unique")
def _unique_fake(keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    index_dtype("unique", "keys", keys, "tensor of keys")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (
        keys.new_empty(num_unique),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty(num_unique, dtype=torch.int64),
    )


@torch.library.register_fake("sparsekit::unique_tables")
def _unique_tables_fake(keys: Tensor, offsets: List[int], tables: List[int],
                        num_tables: int) -> Tuple[Tensor, Tensor, Tensor]:
    op = "unique_tables"
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"unique_tables: keys must be 1-D, got shape {shape_of(keys)}")
    # Per-table bookkeeping is allocated for every table (the kernel's bound).
    torch._check(0 <= num_tables <= 1 << 20,
                 lambda: f"unique_tables: num_tables must lie in [0, 2^20], got {num_tables}")
    torch._check(len(offsets) == len(tables) + 1,
                 lambda: f"unique_tables: offsets must hold one more entry than tables ({len(tables) + 1}), "
                         f"got {len(offsets)}")
    csr_offsets(op, offsets, keys.numel())
    for s, table in enumerate(tables):
        torch._check(0 <= table < num_tables,
                     lambda: f"unique_tables: tables[{s}] = {table} is not a table in [0, {num_tables})")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (keys.new_empty(num_unique), keys.new_empty(keys.shape, dtype=torch.int64),
            keys.new_empty(num_tables, dtype=torch.int64))


def unique(
    keys: Tensor, return_inverse: bool = True, return_counts: bool = False
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Distinct keys in order of first occurrence (hash-based; deterministic on every device).

    Args:
        keys: int64 or int32 tensor of any shape (read flattened). Every value is a valid
            key, including INT64_MIN, INT64_MAX, -1 and 0.
        return_inverse: also return ``inverse`` (int64, shape of ``keys``) with
            ``keys == unique_keys[inverse]``.
        return_counts: also return ``counts`` (int64 ``[U]``), occurrences of each unique key.

    Returns:
        ``unique_keys`` (``[U]``, dtype of ``keys``), then ``inverse`` and/or ``counts`` when
        asked, in that order (the ``torch.unique`` convention); a bare tensor when neither is.
    """
    tensor_arguments("unique", keys=keys)
    return_inverse = _flag("unique", "return_inverse", return_inverse)
    return_counts = _flag("unique", "return_counts", return_counts)
    unique_keys, inverse, counts = _ops.unique(keys)
    out = (unique_keys,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out

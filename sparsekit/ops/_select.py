"""``select_smallest``, eviction's radix select (``csrc/cpu/select_cpu.cpp``,
``csrc/cuda/select_cuda.cu``), and its fake."""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch
from torch import Tensor

from .._checks import same_device, shape_of, shown, tensor_arguments
from .._checks import type_name as _type_name
from ._common import _integer, _ops


@torch.library.register_fake("sparsekit::select_smallest")
def _select_smallest_fake(columns: List[Tensor], eligible: Tensor, k: int) -> Tensor:
    op = "select_smallest"
    same_device(op, eligible=eligible, columns=columns)
    torch._check(1 <= len(columns) <= 4, lambda: f"{op}: columns must hold 1 to 4 tensors, got {len(columns)}")
    torch._check(eligible.dtype == torch.bool and eligible.dim() == 1,
                 lambda: f"{op}: eligible must be a 1-D bool tensor, got {eligible.dtype} with shape "
                         f"{shape_of(eligible)}")
    n = eligible.shape[0]
    for c, column in enumerate(columns):
        torch._check(column.dtype == torch.int64 and column.dim() == 1,
                     lambda: f"{op}: columns[{c}] must be int64 [{shown(n)}] like eligible, got {column.dtype} with "
                             f"shape {shape_of(column)}")
        torch._check(column.shape[0] == n,
                     lambda: f"{op}: columns[{c}] must be int64 [{shown(n)}] like eligible, got {column.dtype} with "
                             f"shape {shape_of(column)}")
    torch._check(k >= 0, lambda: f"{op}: k must be >= 0, got {k}")
    # How many entries are eligible is data; that there are at least k entries is not.
    torch._check(k <= n, lambda: f"{op}: k={k} but there are only {shown(n)} entries, so at most {shown(n)} are "
                                         "eligible")
    return eligible.new_empty((k,), dtype=torch.int64)


def select_smallest(columns: Sequence[Tensor], eligible: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` lexicographically smallest eligible entries (eviction's victims).

    A radix select (no sort of the entries): a few passes over them, each narrowing the
    bucket that holds the ``k``-th entry, then one compaction. Deterministic on every
    device and thread count.

    Args:
        columns: 1 to 4 int64 ``[n]`` tensors compared in order: entry ``i`` is the tuple
            ``(columns[0][i], columns[1][i], ...)``; ties of whole tuples go to the
            smaller index.
        eligible: bool ``[n]``; only these entries may be chosen.
        k: how many to choose, ``0 <= k <=`` the number of eligible entries.

    Returns:
        int64 ``[k]``: the chosen indices in ascending order.

    Example::

        last_seen = torch.tensor([5, 1, 3, 1])
        keys = torch.tensor([10, 20, 30, 5])
        select_smallest([last_seen, keys], torch.ones(4, dtype=torch.bool), 2)  # tensor([1, 3])
    """
    if isinstance(columns, Tensor) or not isinstance(columns, Iterable):
        raise TypeError(f"select_smallest: columns must be a list of tensors, got {_type_name(columns)}")
    columns = list(columns)
    tensor_arguments("select_smallest", eligible=eligible, **{f"columns[{i}]": c for i, c in enumerate(columns)})
    return _ops.select_smallest(columns, eligible, _integer("select_smallest", "k", k))

"""Helpers for CSR bags shared by the lookups' backward and the layers: the bag of each
lookup, either offsets convention as CSR, the padding row, and a ``repeat_interleave``
that stays on the calling thread for eager CPU tensors."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor


def _repeat_interleave(values: Tensor, repeats: Tensor, output_size: int) -> Tensor:
    """``torch.repeat_interleave(values, repeats, output_size=output_size)`` (1-D ``values``
    and ``repeats``), on the calling thread for eager CPU tensors.

    torch's CPU kernel splits even a few hundred repeats over the threads (a
    ``parallel_for`` of grain 1), so with another process on a core a short call can wait a
    whole scheduler time slice for its second thread; numpy's ``repeat`` runs serially
    (``tests/ops/test_parallel.py`` keeps the lookups off torch's kernel). On CUDA, traced,
    or when the repeats do not add up to ``output_size`` (torch's error then), torch's op."""
    if (values.device.type == "cpu" and repeats.device.type == "cpu" and type(values) is Tensor
            and type(repeats) is Tensor and not values.requires_grad and not torch.compiler.is_compiling()):
        try:
            arrays = values.numpy(), repeats.numpy()
        except RuntimeError:  # a tensor numpy cannot view (a functorch wrapper): torch's op
            arrays = None
        if arrays is not None:
            try:
                out = torch.from_numpy(np.repeat(*arrays))
            except ValueError:
                # torch's message (its kernel given a negative repeat and output_size 0
                # crashes the process, torch 2.13)
                raise RuntimeError("repeats can not be negative") from None
            if out.shape[0] == output_size:
                return out
    # output_size spares CUDA the host sync that sizing the result would need.
    return torch.repeat_interleave(values, repeats, output_size=output_size)


def _bag_index(offsets: Tensor, nnz: int) -> Tensor:
    """``[nnz]`` int64: the bag each lookup belongs to, from CSR offsets."""
    bags = offsets.shape[0] - 1
    return _repeat_interleave(torch.arange(bags, device=offsets.device), offsets[1:] - offsets[:-1], nnz)


def _padding_row(padding_idx: Optional[int], num_rows: int) -> Optional[int]:
    """padding_idx in [0, num_rows) (negative counts from the end, as in nn.EmbeddingBag), or None."""
    if padding_idx is None:
        return None
    return padding_idx + num_rows if padding_idx < 0 else padding_idx


def _csr_offsets(offsets: Tensor, nnz: int, include_last_offset: bool) -> Tensor:
    """``[bags + 1]`` int64 CSR offsets from either offsets convention."""
    offsets = offsets.long()
    if include_last_offset:
        return offsets
    return torch.cat([offsets, offsets.new_full((1,), nnz)])

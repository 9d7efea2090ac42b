"""``embedding_bag`` and ``embedding_gather``: the wrappers and fakes of the lookup ops
(``csrc/cpu/embedding_cpu.cpp``, ``csrc/cuda/embedding_cuda.cu``). Their sparse gradients
are registered by ``_embedding_backward``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import float_dtype, index_dtype, same_device, tensor_arguments
from ._common import _choice, _flag, _integer, _ops, _refuse_forward_ad


def _check_embedding_bag_shapes(weight: Tensor, rows: Tensor, offsets: Tensor, padding_idx: Optional[int],
                                include_last_offset: bool):
    """The checks of the fakes; returns the number of bags."""
    same_device("embedding_bag", weight=weight, rows=rows, offsets=offsets)
    float_dtype("embedding_bag", "weight", weight)
    index_dtype("embedding_bag", "rows", rows)
    index_dtype("embedding_bag", "offsets", offsets)
    torch._check(weight.dim() == 2, lambda: f"embedding_bag: weight must be 2-D, got {weight.dim()}-D")
    torch._check(rows.dim() == 1, lambda: f"embedding_bag: rows must be 1-D, got {rows.dim()}-D")
    torch._check(offsets.dim() == 1, lambda: f"embedding_bag: offsets must be 1-D, got {offsets.dim()}-D")
    if padding_idx is not None:
        num_rows = weight.shape[0]
        torch._check(-num_rows <= padding_idx < num_rows,
                     lambda: f"embedding_bag: padding_idx must lie in [-num_rows, num_rows) = [{-num_rows}, "
                             f"{num_rows}), got {padding_idx}; pass None for no padding row")
    if include_last_offset:
        torch._check(offsets.shape[0] >= 1, lambda: "embedding_bag: offsets must hold bags + 1 >= 1 entries")
        return offsets.shape[0] - 1
    return offsets.shape[0]


@torch.library.register_fake("sparsekit::embedding_bag")
def _embedding_bag_fake(
    weight: Tensor, rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor] = None, mode: str = "sum",
    padding_idx: Optional[int] = None, include_last_offset: bool = True,
) -> Tensor:
    bags = _check_embedding_bag_shapes(weight, rows, offsets, padding_idx, include_last_offset)
    torch._check(mode in ("sum", "mean", "max"),
                 lambda: f'embedding_bag: mode must be "sum", "mean" or "max", got "{mode}"')
    torch._check(per_sample_weights is None or mode != "max",
                 lambda: "embedding_bag: per_sample_weights is only supported for mode='sum' or 'mean'")
    if per_sample_weights is not None:
        same_device("embedding_bag", weight=weight, per_sample_weights=per_sample_weights)
        torch._check(per_sample_weights.dtype == weight.dtype,
                     lambda: "embedding_bag: per_sample_weights must have weight's dtype")
        torch._check(per_sample_weights.dim() == 1 and per_sample_weights.shape[0] == rows.shape[0],
                     lambda: "embedding_bag: per_sample_weights must be 1-D [nnz]")
    return weight.new_empty((bags, weight.shape[1]))


@torch.library.register_fake("sparsekit::embedding_bag_argmax")
def _embedding_bag_argmax_fake(
    weight: Tensor, rows: Tensor, offsets: Tensor, padding_idx: Optional[int] = None, include_last_offset: bool = True
) -> Tensor:
    bags = _check_embedding_bag_shapes(weight, rows, offsets, padding_idx, include_last_offset)
    return weight.new_empty((bags, weight.shape[1]), dtype=torch.int64)


@torch.library.register_fake("sparsekit::embedding_gather")
def _embedding_gather_fake(weight: Tensor, rows: Tensor) -> Tensor:
    same_device("embedding_gather", weight=weight, rows=rows)
    float_dtype("embedding_gather", "weight", weight)
    index_dtype("embedding_gather", "rows", rows)
    torch._check(weight.dim() == 2, lambda: f"embedding_gather: weight must be 2-D, got {weight.dim()}-D")
    return weight.new_empty(tuple(rows.shape) + (weight.shape[1],))


def embedding_bag(
    weight: Tensor,
    rows: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor] = None,
    mode: str = "sum",
    padding_idx: Optional[int] = None,
    include_last_offset: bool = True,
) -> Tensor:
    """Pooled embedding lookup over bags: ``out[b] = pool(weight[rows[offsets[b]:offsets[b+1]]])``.

    Offsets come in two conventions. The default, ``include_last_offset=True``, is CSR:
    ``bags + 1`` entries, the last one ``nnz``. ``include_last_offset=False`` takes
    ``nn.EmbeddingBag``'s default ``[bags]`` bag starts, the last bag running to ``nnz``::

        rows = torch.tensor([4, 2, 7])                     # nnz = 3 lookups, 2 bags: [4, 2] and [7]
        embedding_bag(w, rows, torch.tensor([0, 2, 3]))    # CSR (default): bags + 1 offsets
        embedding_bag(w, rows, torch.tensor([0, 2]), include_last_offset=False)  # nn.EmbeddingBag style
        embedding_bag(w, rows, torch.tensor([0, 2]))       # raises: offsets[-1] == 2 != nnz, with a
                                                           # hint to pass include_last_offset=False

    Args:
        weight: ``[R, D]`` float32, float64, float16 or bfloat16 table (half types
            accumulate in float32); any strides (rows are read as-is when their columns
            are dense, e.g. ``big[:, 1:33]``; otherwise a contiguous copy is made).
        rows: ``[nnz]`` int64 or int32 row ids in ``[0, R)``; ``-1`` (a missing key) is
            skipped. Anything else raises, naming the first bad entry.
        offsets: int64 or int32 bag boundaries, non-decreasing from ``offsets[0] == 0``:
            ``[bags + 1]`` with ``offsets[-1] == nnz`` (``include_last_offset=True``) or
            ``[bags]`` (``include_last_offset=False``). Bad offsets raise (checked before
            rows), naming the first bad bag.
        per_sample_weights: optional ``[nnz]`` of ``weight``'s dtype, scaling each row
            (``"sum"`` and ``"mean"`` only; with ``"max"`` it raises, as in torch).
        mode: ``"sum"``, ``"mean"`` or ``"max"``. Mean divides by the number of valid rows
            of the bag (weighted: by the sum of their weights), bit for bit as
            ``nn.EmbeddingBag`` does for float32 and float64 (float16 and bfloat16 sum
            and divide in float32 and round once, which can differ from torch's in the last
            bit). Max takes each column's maximum over the valid rows as
            ``nn.EmbeddingBag`` does: the first valid row, then only a strictly larger value
            (a NaN wins only when it comes first; ties keep the earlier row).
        padding_idx: optional row skipped exactly like ``-1``: it adds nothing, is not
            counted by mean and gets no gradient. In ``[-R, R)``; negative counts from the
            end, as in ``nn.EmbeddingBag``.
        include_last_offset: see above; ``True`` (the default) is sparsekit's CSR offsets.

    Returns:
        ``[bags, D]`` of ``weight``'s dtype; a bag with no valid row (or whose valid weights
        sum to zero in weighted mean) is zeros. Differentiable in ``weight`` (a sparse COO
        gradient with one entry per distinct valid row looked up, gradients summed: on the
        CPU rows ascending and marked coalesced, on CUDA rows in order of first occurrence,
        not marked; max sends each column's gradient
        to the arg-max row, ties to the first valid lookup in bag order) and in
        ``per_sample_weights`` (dense). Forward and gradients are bit-identical run to run;
        max mode (a selection) is also bit-identical between CPU and CUDA.

        Double backward works in every mode: with ``create_graph=True`` the first-order
        gradients are the same (bit for bit, the weight's still sparse) and differentiable
        again in ``grad_output``, ``weight`` and ``per_sample_weights``. Sum and mean take
        their second derivatives from a plain-torch pooling of the distinct rows looked up
        (dense over those rows only; the weight's second-order gradient is sparse COO too);
        max's backward is made of differentiable ops.

    Raises:
        TypeError: ``mode`` not a str, ``padding_idx`` not an int (a bool is not one) or
            None, ``include_last_offset`` not a bool (None or 0 would silently pick the
            other offsets convention).
    """
    tensor_arguments("embedding_bag", weight=weight, rows=rows, offsets=offsets,
                     **({} if per_sample_weights is None else {"per_sample_weights": per_sample_weights}))
    _refuse_forward_ad("embedding_bag", weight=weight, per_sample_weights=per_sample_weights)
    mode = _choice("embedding_bag", "mode", mode)
    padding_idx = _integer("embedding_bag", "padding_idx", padding_idx, optional=True)
    include_last_offset = _flag("embedding_bag", "include_last_offset", include_last_offset)
    return _ops.embedding_bag(weight, rows, offsets, per_sample_weights, mode, padding_idx, include_last_offset)


def embedding_gather(weight: Tensor, rows: Tensor) -> Tensor:
    """Unpooled embedding lookup: ``out[...] = weight[rows[...]]``, zeros where ``rows == -1``.

    Args:
        weight: ``[R, D]`` float32, float64, float16 or bfloat16 table.
        rows: int64 or int32 row ids of any shape, each in ``[0, R)`` or ``-1``.

    Returns:
        ``rows.shape + [D]`` of ``weight``'s dtype. Differentiable in ``weight`` (sparse COO
        gradient with one entry per distinct row, as for :func:`embedding_bag`), and twice
        differentiable: with ``create_graph=True`` that gradient is differentiable again in
        ``grad_output``, as for :func:`embedding_bag`.
    """
    tensor_arguments("embedding_gather", weight=weight, rows=rows)
    _refuse_forward_ad("embedding_gather", weight=weight)
    return _ops.embedding_gather(weight, rows)

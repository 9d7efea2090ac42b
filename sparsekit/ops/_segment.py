"""``segment_sum``, ``segment_mean`` and ``segment_reduce``: wrappers, fakes and autograd of
``sparsekit::segment_sum`` and ``sparsekit::segment_sum_parts``
(``csrc/cpu/segment_cpu.cpp``, ``csrc/cuda/segment_cuda.cu``), and the CUDA entry that
follows ``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, List

import torch
from torch import Tensor

from .._checks import AllocationError, allocation, float_dtype, index_dtype, same_device, shape_of, shown
from .._checks import tensor_arguments
from ._common import _choice, _flag, _integer, _ops, _refuse_forward_ad
from ._dispatch import _sparse_library


def _following_deterministic_algorithms(kernel: Any) -> Callable[..., Any]:
    """The CUDA kernel of ``sparsekit::segment_sum`` called with ``deterministic=True``
    whenever ``torch.use_deterministic_algorithms(True)`` is in force. The wrapper
    :func:`segment_sum` does that already; ``torch.ops.sparsekit.segment_sum(data, ids, n)``,
    which every op's bit-reproducibility under that flag covers too (docs/design.md, "Ops
    and their contracts"), would go straight to the atomics: the stable ABI offers the C++
    kernel no way to read the global flag, so the dispatcher's CUDA entry reads it here."""
    def cuda_kernel(keyset, data, segment_ids, num_segments, deterministic=False):
        deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
        return kernel.call_boxed(keyset, data, segment_ids, num_segments, deterministic)
    return cuda_kernel


if torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::segment_sum", "CUDA"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose
        _sparse_library.impl("segment_sum", _following_deterministic_algorithms(
            torch.library.get_kernel("sparsekit::segment_sum", "CUDA")), "CUDA", with_keyset=True)


@torch.library.register_fake("sparsekit::segment_sum")
def _segment_sum_fake(data: Tensor, segment_ids: Tensor, num_segments, deterministic: bool = False) -> Tensor:
    same_device("segment_sum", data=data, segment_ids=segment_ids)
    torch._check(data.dim() >= 1, lambda: "segment_sum: data must have at least one dimension [N, ...], got a scalar")
    float_dtype("segment_sum", "data", data)
    index_dtype("segment_sum", "segment_ids", segment_ids)
    torch._check(segment_ids.dim() == 1, lambda: "segment_sum: segment_ids must be 1-D")
    torch._check(segment_ids.shape[0] == data.shape[0], lambda: "segment_sum: segment_ids and data lengths differ")
    torch._check(num_segments >= 0, lambda: f"segment_sum: num_segments must be >= 0, got {num_segments}")
    return data.new_empty((num_segments,) + tuple(data.shape[1:]))


def _segment_sum_setup_context(ctx, inputs, output) -> None:
    _, segment_ids, _, _ = inputs
    ctx.save_for_backward(segment_ids)


def _segment_rows_gradient(grad: Tensor, segment_ids: Tensor) -> Tensor:
    """The gradient of a segment sum's data rows from its output's: ``grad[segment_ids[i]]``
    for row ``i``, zeros for dropped rows (negative ids). Differentiable torch ops."""
    if grad.shape[0] == 0:
        # No segments: every row was dropped (all ids negative), so its gradient is zero.
        return grad.new_zeros((segment_ids.shape[0],) + tuple(grad.shape[1:]))
    # d out[s] / d data[i] is 1 exactly when segment_ids[i] == s; dropped rows get zeros.
    valid = segment_ids >= 0
    picked = grad.index_select(0, torch.where(valid, segment_ids, 0))
    mask = valid.view((-1,) + (1,) * (grad.dim() - 1))
    return torch.where(mask, picked, torch.zeros((), dtype=grad.dtype, device=grad.device))


def _segment_sum_backward(ctx, grad: Tensor):
    (segment_ids,) = ctx.saved_tensors
    return _segment_rows_gradient(grad, segment_ids), None, None, None


torch.library.register_autograd(
    "sparsekit::segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup_context
)


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False, *,
                reduce: str = "sum") -> Tensor:
    """TensorFlow ``unsorted_segment_sum``: ``out[s] = sum(data[i] for i with segment_ids[i] == s)``.

    Args:
        data: ``[N, ...]`` float32, float64, float16 or bfloat16 (half types accumulate in float32).
        segment_ids: ``[N]`` int64 or int32. Negative ids are dropped (padding); an id
            ``>= num_segments`` raises.
        num_segments: number of output rows.
        deterministic: bit-identical results run to run. The CPU kernel always is; on CUDA
            this switches from atomics to a sort-based reduction. Also on whenever
            ``torch.use_deterministic_algorithms(True)`` is in force, as for torch's own
            ``index_add_``.
        reduce: ``"sum"``, or ``"mean"`` for :func:`segment_mean` (keyword only; also
            :func:`segment_reduce`).

    Returns:
        ``[num_segments, ...]`` of ``data``'s dtype, zeros for empty segments.
        Differentiable in ``data``, any number of times (the backward is a gather made of
        differentiable torch ops).

    Raises:
        TypeError: ``num_segments`` not an int (a bool is not one), ``deterministic`` not a
            bool, ``reduce`` not a str.
        ValueError: ``reduce`` neither ``"sum"`` nor ``"mean"``.
    """
    if reduce != "sum":
        reduce = _choice("segment_sum", "reduce", reduce)
        if reduce != "mean":
            raise ValueError(f"segment_sum: reduce must be 'sum' or 'mean', got {reduce!r}")
        return segment_mean(data, segment_ids, num_segments, deterministic)
    tensor_arguments("segment_sum", data=data, segment_ids=segment_ids)
    _refuse_forward_ad("segment_sum", data=data)
    num_segments = _integer("segment_sum", "num_segments", num_segments)
    deterministic = _flag("segment_sum", "deterministic", deterministic)
    with allocation(lambda: f"segment_sum: num_segments={num_segments} (the output)",
                    (num_segments,) + tuple(data.shape[1:]), data.dtype, data.device, accumulator=True):
        return _ops.segment_sum(data, segment_ids, num_segments, _deterministic(deterministic))


def _deterministic(requested: bool) -> bool:
    """The deterministic path when asked for or when torch's global flag demands it."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


def _segment_counts(segment_ids: Tensor, num_segments: int) -> Tensor:
    """int64 ``[num_segments]``: rows per segment, negative ids dropped. Integer atomics
    are exact, so this is deterministic on every device and exact past 2^24 rows."""
    ids = segment_ids.long()
    # Dropped rows count in a spare last bucket, so no data-dependent mask (no host sync).
    bucket = torch.where(ids >= 0, ids, num_segments)
    with allocation(lambda: f"segment_mean: num_segments={num_segments} (the counts)", (num_segments + 1,), torch.int64,
                    ids.device):
        counts = torch.zeros(num_segments + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, bucket, torch.ones_like(bucket))[:num_segments]


def segment_mean(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """Like :func:`segment_sum`, divided by the number of rows in each segment (empty -> 0).
    float16 / bfloat16 rows are summed and divided in float32 and rounded once (through a
    float32 copy of ``data``: twice its bytes more memory).

    Args and returns as :func:`segment_sum`. Differentiable in ``data``.
    """
    tensor_arguments("segment_mean", data=data, segment_ids=segment_ids)
    _refuse_forward_ad("segment_mean", data=data)
    num_segments = _integer("segment_mean", "num_segments", num_segments)
    deterministic = _flag("segment_mean", "deterministic", deterministic)
    # float16 / bfloat16 rows are summed in float32 and divided before the one rounding
    # (as embedding_bag's mean): a sum rounded to the half type first would overflow to inf
    # where the mean is representable (two rows of 60000 in float16), and round twice.
    if data.dtype in (torch.float16, torch.bfloat16):
        # Named like the op's other allocations: torch's own message names neither the op
        # nor the argument.
        with allocation(lambda: "segment_mean: a float32 copy of data (float16 / bfloat16 rows are summed in float32)",
                        tuple(data.shape), torch.float32, data.device):
            summed = data.float()
    else:
        summed = data
    try:
        totals = segment_sum(summed, segment_ids, num_segments, deterministic)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        # The sum's checks are the mean's: its errors name segment_mean, the op called.
        message = str(error)
        if type(error) not in (RuntimeError, ValueError, TypeError, IndexError, AllocationError) or \
                not message.startswith("segment_sum:"):
            raise
        raise type(error)("segment_mean:" + message[len("segment_sum:"):]) from None
    # Exact integer counts (a float count stops growing at 2^24 rows in float32), divided in
    # float32 at least.
    # No column: nothing to divide, and no [num_segments] counts (2**62 segments of nothing
    # are a valid output). Tested on the row shape alone: num_segments may be traced from
    # the data, where a test of it would be a graph break.
    if math.prod(data.shape[1:]) == 0:
        return totals.to(data.dtype)  # a half type's was summed in float32
    count_dtype = torch.promote_types(data.dtype, torch.float32)
    counts = _segment_counts(segment_ids, num_segments).clamp_(min=1).to(count_dtype)
    return (totals.to(count_dtype) / counts.view((-1,) + (1,) * (data.dim() - 1))).to(data.dtype)


def segment_reduce(
    data: Tensor, segment_ids: Tensor, num_segments: int, reduce: str = "sum", deterministic: bool = False
) -> Tensor:
    """:func:`segment_sum` (``reduce="sum"``) or :func:`segment_mean` (``reduce="mean"``)."""
    reduce = _choice("segment_reduce", "reduce", reduce)
    num_segments = _integer("segment_reduce", "num_segments", num_segments)
    deterministic = _flag("segment_reduce", "deterministic", deterministic)
    if reduce == "sum":
        return segment_sum(data, segment_ids, num_segments, deterministic)
    if reduce == "mean":
        return segment_mean(data, segment_ids, num_segments, deterministic)
    raise ValueError(f"segment_reduce: reduce must be 'sum' or 'mean', got {reduce!r}")


def _segment_sum_parts_setup_context(ctx, inputs, output) -> None:
    data, segment_ids, _ = inputs
    ctx.save_for_backward(segment_ids)
    ctx.rows = [part.shape[0] for part in data]


def _segment_sum_parts_backward(ctx, grad: Tensor):
    """As segment_sum's, cut into the parts' rows."""
    (segment_ids,) = ctx.saved_tensors
    return list(_segment_rows_gradient(grad, segment_ids).split(ctx.rows)), None, None


torch.library.register_autograd("sparsekit::segment_sum_parts", _segment_sum_parts_backward,
                                setup_context=_segment_sum_parts_setup_context)


@torch.library.register_fake("sparsekit::segment_sum_parts")
def _segment_sum_parts_fake(data: List[Tensor], segment_ids: Tensor, num_segments: int) -> Tensor:
    op = "segment_sum_parts"
    torch._check(len(data) > 0, lambda: f"{op}: data must hold at least one tensor")
    same_device(op, data=data, segment_ids=segment_ids)
    first = data[0]
    torch._check(first.dim() >= 1, lambda: f"{op}: data[0] must have at least one dimension [rows, ...], got a scalar")
    for p, part in enumerate(data):
        torch._check(part.dim() == first.dim() and part.dtype == first.dtype
                     and tuple(part.shape[1:]) == tuple(first.shape[1:]),
                     lambda: f"{op}: data[{p}] ({part.dtype} {shape_of(part)}) must have the dtype and row shape of "
                             f"data[0] ({first.dtype} {shape_of(first)})")
    rows = sum(part.shape[0] for part in data)
    index_dtype(op, "segment_ids", segment_ids)
    torch._check(segment_ids.dim() == 1 and segment_ids.shape[0] == rows,
                 lambda: f"{op}: segment_ids must be 1-D with one entry per row of data ({shown(rows)}), got shape "
                         f"{shape_of(segment_ids)}")
    torch._check(num_segments >= 0, lambda: f"{op}: num_segments must be >= 0, got {num_segments}")
    float_dtype(op, "data", first)
    return first.new_empty((num_segments, *first.shape[1:]))

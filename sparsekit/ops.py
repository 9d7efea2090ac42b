"""Typed wrappers, fake (meta) kernels and autograd for ``torch.ops.sparsekit.*``.

Every op has a CPU and a CUDA kernel compiled into ``sparsekit._C``; the fakes below
let ``torch.compile`` trace them, with data-dependent output sizes taken from
``torch.library.get_ctx().new_dynamic_size()``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the kernels)

_ops = torch.ops.sparsekit

_INT_KEY_DTYPES = (torch.int64, torch.int32)


# ---- unique ----


@torch.library.register_fake("sparsekit::unique")
def _unique_fake(keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    torch._check(keys.dtype in _INT_KEY_DTYPES, lambda: f"unique: keys must be int64 or int32, got {keys.dtype}")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (
        keys.new_empty(num_unique),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty(num_unique, dtype=torch.int64),
    )


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
    unique_keys, inverse, counts = _ops.unique(keys)
    out = (unique_keys,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out


# ---- segment_sum / segment_mean ----


@torch.library.register_fake("sparsekit::segment_sum")
def _segment_sum_fake(data: Tensor, segment_ids: Tensor, num_segments, deterministic: bool = False) -> Tensor:
    torch._check(data.dim() >= 1, lambda: "segment_sum: data must have at least one dimension")
    torch._check(segment_ids.dim() == 1, lambda: "segment_sum: segment_ids must be 1-D")
    torch._check(segment_ids.shape[0] == data.shape[0], lambda: "segment_sum: segment_ids and data lengths differ")
    return data.new_empty((num_segments,) + tuple(data.shape[1:]))


def _segment_sum_setup_context(ctx, inputs, output) -> None:
    _, segment_ids, _, _ = inputs
    ctx.save_for_backward(segment_ids)


def _segment_sum_backward(ctx, grad: Tensor):
    (segment_ids,) = ctx.saved_tensors
    # d out[s] / d data[i] is 1 exactly when segment_ids[i] == s; dropped rows get zeros.
    valid = segment_ids >= 0
    picked = grad.index_select(0, torch.where(valid, segment_ids, 0))
    mask = valid.view((-1,) + (1,) * (grad.dim() - 1))
    return torch.where(mask, picked, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None, None


torch.library.register_autograd(
    "sparsekit::segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup_context
)


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """TensorFlow ``unsorted_segment_sum``: ``out[s] = sum(data[i] for i with segment_ids[i] == s)``.

    Args:
        data: ``[N, ...]`` float32, float64, float16 or bfloat16 (half types accumulate in float32).
        segment_ids: ``[N]`` int64 or int32. Negative ids are dropped (padding); an id
            ``>= num_segments`` raises.
        num_segments: number of output rows.
        deterministic: bit-identical results run to run. The CPU kernel always is; on CUDA
            this switches from atomics to a sort-based reduction.

    Returns:
        ``[num_segments, ...]`` of ``data``'s dtype, zeros for empty segments.
        Differentiable in ``data``.
    """
    return _ops.segment_sum(data, segment_ids, num_segments, deterministic)


def segment_mean(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """Like :func:`segment_sum`, divided by the number of rows in each segment (empty -> 0).

    Args and returns as :func:`segment_sum`. Differentiable in ``data``.
    """
    totals = _ops.segment_sum(data, segment_ids, num_segments, deterministic)
    # Counts in float32 at least: float16 cannot count past 2048 exactly.
    count_dtype = torch.promote_types(data.dtype, torch.float32)
    ones = torch.ones(segment_ids.shape[0], dtype=count_dtype, device=data.device)
    counts = _ops.segment_sum(ones, segment_ids, num_segments, deterministic).clamp_(min=1)
    return (totals.to(count_dtype) / counts.view((-1,) + (1,) * (data.dim() - 1))).to(data.dtype)


def segment_reduce(
    data: Tensor, segment_ids: Tensor, num_segments: int, reduce: str = "sum", deterministic: bool = False
) -> Tensor:
    """:func:`segment_sum` (``reduce="sum"``) or :func:`segment_mean` (``reduce="mean"``)."""
    if reduce == "sum":
        return segment_sum(data, segment_ids, num_segments, deterministic)
    if reduce == "mean":
        return segment_mean(data, segment_ids, num_segments, deterministic)
    raise ValueError(f"segment_reduce: reduce must be 'sum' or 'mean', got {reduce!r}")

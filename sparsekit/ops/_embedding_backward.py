"""The autograd of ``sparsekit::embedding_bag`` and ``sparsekit::embedding_gather``: sparse
COO weight gradients (sum, mean and max modes), per-sample-weight gradients, and double
backward through ``_double_backward``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._bags import _bag_index, _csr_offsets, _padding_row
from ._common import _ops
from ._double_backward import _LookupSpec, _lookup_gradients
from ._embedding import embedding_gather
from ._segment import segment_sum
from ._sparse_gradient import _first_lookup_of, _number_rows, _sparse_row_gradient


def _lookup_dots(left: Tensor, left_index: Tensor, right: Tensor, right_index: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n]`` of ``dtype``: ``dot(left[left_index[i]], right[right_index[i]])``, 0 where right_index is -1.

    On the CPU this runs in chunks of about 4 MiB of gathered rows: a fresh ``[n, D]``
    temporary would cost more in page faults than the products. CUDA's caching allocator
    has no such cost, and one chunk keeps it to one launch (and one range-check sync) per op."""
    n, dim = left_index.shape[0], left.shape[1]
    chunk = max(1, (1 << 20) // max(dim, 1)) if left.device.type == "cpu" else max(n, 1)
    dots = []
    for start in range(0, n, chunk):
        a = embedding_gather(left, left_index[start:start + chunk]).to(dtype)
        b = embedding_gather(right, right_index[start:start + chunk]).to(dtype)
        dots.append(torch.linalg.vecdot(a, b))
    return torch.cat(dots) if dots else left.new_zeros(0, dtype=dtype)


def _embedding_bag_setup_context(ctx, inputs, output) -> None:
    weight, rows, offsets, per_sample_weights, mode, padding_idx, include_last_offset = inputs
    ctx.mode = mode
    ctx.num_rows = weight.shape[0]
    ctx.weight_id = id(weight)
    ctx.padding_idx = padding_idx
    ctx.include_last_offset = include_last_offset
    weighted = per_sample_weights is not None
    # The per-sample-weight gradient needs the table rows (and, for mean, the output); max
    # needs the table to find the arg-max again.
    ctx.save_for_backward(
        rows,
        offsets,
        per_sample_weights,
        weight if weighted or mode == "max" else None,
        output if weighted and mode == "mean" else None,
    )


def _max_gradient(grad_output: Tensor, weight: Tensor, rows: Tensor, offsets: Tensor, lookup_rows: Tensor,
                  ctx) -> Tensor:
    """Max mode's sparse weight gradient: grad_output[b, c] goes to column c of the row whose
    lookup holds bag b's maximum in that column (ties: the first valid lookup in bag order).

    The arg-max is recomputed (``embedding_bag_argmax``) instead of being kept from the
    forward, and the ``[bags * D]`` contributions are summed per (row, column) with
    ``segment_sum(deterministic=True)``: bit-identical run to run on every device."""
    dim = grad_output.shape[1]
    positions = _ops.embedding_bag_argmax(weight, rows, offsets, ctx.padding_idx, ctx.include_last_offset)
    keys, inverse, _, _, skip, coalesced = _number_rows(lookup_rows, ctx.num_rows, group=False)
    groups = keys.shape[0]
    # Group of each arg-max lookup (those of the -1 group, if any, are dropped). Position
    # nnz reads a padded 0, so bags without a valid lookup (-1) need no branch.
    nnz = lookup_rows.shape[0]
    group_of_lookup = torch.cat([inverse, inverse.new_zeros(1)])
    flat_positions = torch.where(positions >= 0, positions, nnz).reshape(-1)
    group = group_of_lookup.index_select(0, flat_positions).view_as(positions)
    column = torch.arange(dim, device=positions.device)
    segment = torch.where(positions >= 0, group * dim + column, -1).reshape(-1)
    acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    summed = segment_sum(grad_output.to(acc_dtype).reshape(-1, 1), segment, groups * dim, deterministic=True)
    values = summed.view(groups, dim)[skip:].to(grad_output.dtype)
    indices = keys[skip:].to(torch.int64).unsqueeze(0)
    return torch.sparse_coo_tensor(indices, values, (ctx.num_rows, dim), is_coalesced=coalesced,
                                   check_invariants=False)


def _embedding_bag_backward_of(ctx, grad_output: Tensor):
    rows, offsets, per_sample_weights, weight, output = ctx.saved_tensors
    nnz = rows.shape[0]
    csr = _csr_offsets(offsets, nnz, ctx.include_last_offset)
    # Half-precision gradients are pooled in float32 (grad_output is only [bags, D]).
    acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    padding_row = _padding_row(ctx.padding_idx, ctx.num_rows)
    # The padding row gets no gradient: in the backward it is one more missing row. (The
    # forward skips it in the kernel; this backward pass over rows is noise next to unique.)
    # (An int32 rows never holds a padding row past int32, and torch would wrap it to compare.)
    unpadded = padding_row is None or padding_row > torch.iinfo(rows.dtype).max
    lookup_rows = rows if unpadded else torch.where(rows == padding_row, -1, rows)

    if ctx.mode == "max":
        # Made of differentiable ops (a selection, segment_sum, sparse_coo_tensor): a second
        # derivative needs nothing more.
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = _max_gradient(grad_output, weight, rows, offsets, lookup_rows, ctx)
        return grad_weight, None, None, None, None, None, None

    bag = _bag_index(csr, nnz)
    valid = lookup_rows >= 0
    needs_weight = ctx.needs_input_grad[0]
    needs_per_sample_weights = per_sample_weights is not None and ctx.needs_input_grad[3]
    mode, num_rows = ctx.mode, ctx.num_rows

    def first_order(grad_output: Tensor, weight: Optional[Tensor], per_sample_weights: Optional[Tensor]):
        # mean: out[b] = sum_i w_i weight[r_i] / S_b, S_b = number (or weight sum) of valid rows.
        inverse_denominator = None
        if mode == "mean":
            if per_sample_weights is None:
                # Exact integer counts from a prefix sum: no atomics, no rounding.
                prefix = torch.cat([valid.new_zeros(1, dtype=torch.int64), torch.cumsum(valid, 0)])
                denominator = (prefix[csr[1:]] - prefix[csr[:-1]]).to(acc_dtype)
            else:
                # The forward's own weight sums, bit for bit and without atomics: embedding_bag
                # over the [nnz, 1] table of weights (0 for skipped lookups; adding 0.0 changes
                # no sum) runs the forward's summation order, long bags split alike on CUDA.
                masked = torch.where(valid, per_sample_weights.to(acc_dtype), 0).unsqueeze(1)
                lookups = torch.arange(nnz, device=rows.device)
                denominator = _ops.embedding_bag(masked, lookups, csr, None, "sum").squeeze(1)
            # The forward pools a bag with nothing to divide by to zeros; its gradient is zero too.
            safe = torch.where(denominator != 0, denominator, 1)
            inverse_denominator = torch.where(denominator != 0, 1 / safe, 0)

        # d loss / d out[b], divided by S_b for mean: each lookup then only adds its weight w_i.
        bag_grad = grad_output.to(acc_dtype)
        if inverse_denominator is not None:
            bag_grad = bag_grad * inverse_denominator.unsqueeze(1)

        grad_weight = None
        if needs_weight:
            scale = None if per_sample_weights is None else per_sample_weights.to(acc_dtype)
            grad_weight = _sparse_row_gradient(bag_grad, bag, lookup_rows, num_rows, scale, grad_output.dtype)

        grad_per_sample_weights = None
        if needs_per_sample_weights:
            # sum:  d out[b] / d w_i = weight[r_i]
            # mean: d out[b] / d w_i = (weight[r_i] - out[b]) / S_b, and bag_grad already holds the 1 / S_b.
            dots = _lookup_dots(bag_grad, bag, weight, lookup_rows, acc_dtype)
            if mode == "mean" and output.dtype != acc_dtype:
                # A half output was rounded from the float32 mean: (weight[r_i] - out[b]) cancels,
                # and the rounded out[b] would leave errors of percents of the gradient in bfloat16. The
                # bag's (g_b / S_b) . mean_b in float32 is (sum_j w_j * dots_j) / S_b (dots hold one
                # 1 / S_b). (A sum per bag in a fixed order, as the denominator's: deterministic.)
                scaled = torch.where(valid, per_sample_weights.to(acc_dtype) * dots, 0).unsqueeze(1)
                bag_dots = _ops.embedding_bag(scaled, torch.arange(nnz, device=rows.device), csr, None,
                                              "sum").squeeze(1) * inverse_denominator
                dots = torch.where(valid, dots - bag_dots.index_select(0, bag), 0)
            elif mode == "mean":
                bag_dots = torch.linalg.vecdot(bag_grad, output.to(acc_dtype))
                dots = torch.where(valid, dots - bag_dots.index_select(0, bag), 0)
            grad_per_sample_weights = dots.to(per_sample_weights.dtype)
        return grad_weight, grad_per_sample_weights

    spec = _LookupSpec(lookup_rows, bag, mode, first_order)
    grad_weight, grad_per_sample_weights = _lookup_gradients(spec, grad_output, weight, per_sample_weights)
    return grad_weight, None, None, grad_per_sample_weights, None, None, None


def _embedding_bag_backward(ctx, grad_output: Tensor):
    with _first_lookup_of(ctx.weight_id, grad_output):
        return _embedding_bag_backward_of(ctx, grad_output)


torch.library.register_autograd(
    "sparsekit::embedding_bag", _embedding_bag_backward, setup_context=_embedding_bag_setup_context
)


def _embedding_gather_setup_context(ctx, inputs, output) -> None:
    weight, rows = inputs
    ctx.num_rows = weight.shape[0]
    ctx.weight_id = id(weight)
    ctx.save_for_backward(rows)


def _embedding_gather_backward_of(ctx, grad_output: Tensor, dtype: Optional[torch.dtype] = None):
    """The weight's gradient, of ``dtype`` (default: the output gradient's)."""
    (rows,) = ctx.saved_tensors
    flat_rows = rows.reshape(-1)
    positions = torch.arange(flat_rows.shape[0], device=rows.device)
    num_rows = ctx.num_rows

    def first_order(grad_output: Tensor, weight: None, per_sample_weights: None):
        # Explicit sizes: reshape(-1, 0) of a zero-width gradient is ambiguous and raises.
        source = grad_output.reshape(flat_rows.shape[0], grad_output.shape[-1])
        if source.dtype in (torch.float16, torch.bfloat16):
            source = source.float()
        return _sparse_row_gradient(source, positions, flat_rows, num_rows, dtype=dtype or grad_output.dtype), None

    # Each lookup is its own bag of one; the gradient does not depend on the weight's values.
    spec = _LookupSpec(flat_rows, positions, "gather", first_order)
    grad_weight, _ = _lookup_gradients(spec, grad_output, None, None)
    return grad_weight, None


def _embedding_gather_backward(ctx, grad_output: Tensor):
    with _first_lookup_of(ctx.weight_id, grad_output):
        return _embedding_gather_backward_of(ctx, grad_output)


torch.library.register_autograd(
    "sparsekit::embedding_gather", _embedding_gather_backward, setup_context=_embedding_gather_setup_context
)

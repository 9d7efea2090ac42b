"""The pooled read of a collection's tables, and its backward.

One native op reads every feature's bags of every table of one dtype into a
``[B, sum of dims]`` block (``sparsekit::pooled_read``, features side by side). Its
backward groups the lookups by row and either gives each table a coalesced sparse
gradient (``pooled_read_backward``, the unfused path: any ``torch.optim`` optimizer) or
applies a fused optimizer to the rows it touched in the same pass
(``pooled_read_update_``: no gradient is materialised). See ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from ._checks import compile_disabled
from .exchange import _CoalescedGradMarker, _sparse_gradients
from .tables_cuda import _device_ints

__all__: List[str] = []


@torch.library.register_fake("sparsekit::pooled_read")
def _pooled_read_fake(weights: List[Tensor], rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                      feature_tables: List[int], feature_columns: List[int], feature_means: List[int],
                      total_dim, errors: Optional[Tensor] = None) -> Tensor:
    num_features = max(len(feature_tables), 1)
    return weights[0].new_empty(((offsets.shape[0] - 1) // num_features, total_dim))


@torch.library.register_fake("sparsekit::pooled_read_backward")
def _pooled_read_backward_fake(grads: List[Tensor], weights: List[Tensor], rows: Tensor, offsets: Tensor,
                               per_sample_weights: Optional[Tensor], feature_tables: List[int],
                               feature_means: List[int], errors: Optional[Tensor] = None,
                               grad_columns: Sequence[int] = ()) -> Tuple[Tensor, Tensor, Tensor]:
    ctx = torch.library.get_ctx()
    dtype = torch.float64 if weights[0].dtype == torch.float64 else torch.float32
    return (rows.new_empty(ctx.new_dynamic_size()), rows.new_empty(len(weights)),
            weights[0].new_empty(ctx.new_dynamic_size(), dtype=dtype))


@torch.library.register_fake("sparsekit::pooled_read_update_")
def _pooled_read_update_fake(weights: List[Tensor], state1: List[Tensor], state2: List[Tensor], steps: List[Tensor],
                             grads: List[Tensor], rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                             feature_tables: List[int], feature_means: List[int], optimizer: str, hyper: List[float],
                             lr: Optional[Tensor] = None, errors: Optional[Tensor] = None,
                             grad_columns: Sequence[int] = ()) -> None:
    return None


class ReadLayout(NamedTuple):
    """Where one pooled read puts its features: per feature of the batch, the index of its
    table among the read's weights (-1: another read's), its first column in the
    ``[B, total_dim]`` block and whether its combiner is the mean; ``split``: the read
    gives each of its features' columns as an output of its own (their gradients then
    reach the backward where they lie, with no concatenation), else the block."""

    feature_tables: List[int]
    feature_columns: List[int]
    feature_means: List[int]
    total_dim: int
    split: bool = False


class FusedStep(NamedTuple):
    """A fused optimizer's update as the backward applies it: its name (the op's), its
    settings and the state of each table read (see :class:`sparsekit.fused.FusedOptimizer`)."""

    optimizer: str
    hyper: List[float]
    lr: Optional[Tensor]
    state1: List[Tensor]
    state2: List[Tensor]
    steps: List[Tensor]


class _PooledRead(torch.autograd.Function):
    """The pooled read of the tables ``weights`` as one autograd node. ``fused``: None for the
    unfused path (coalesced sparse gradients), else a callable giving the :class:`FusedStep`
    the backward applies in place; ``markers``: each table's :class:`_CoalescedGradMarker`;
    ``errors``: None (bad input raises), or the step's error word, where the read and the
    fused update record it instead (no host read)."""

    @staticmethod
    def forward(ctx, layout: ReadLayout, rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                markers: Sequence[_CoalescedGradMarker], fused: Any, errors: Optional[Tensor],
                *weights: Tensor) -> Tensor:
        out = torch.ops.sparsekit.pooled_read(list(weights), rows, offsets, per_sample_weights, layout.feature_tables,
                                              layout.feature_columns, layout.feature_means, layout.total_dim, errors)
        ctx.save_for_backward(rows, offsets, per_sample_weights)
        ctx.layout, ctx.markers, ctx.fused, ctx.errors = layout, markers, fused, errors
        ctx.stamps = [marker.stamp for marker in markers]
        # Not saved for backward: a fused update writes them in place (and an earlier step's
        # update may have, before this backward), which autograd's version check refuses.
        ctx.weights = weights
        # An output the loss does not use adds nothing (its feature is left out), rather
        # than a block of zeros.
        ctx.set_materialize_grads(False)
        if layout.split:
            return tuple(out.split(_call_dims(layout, weights), dim=1))
        return out

    @staticmethod
    @compile_disabled  # the sparse gradients and the in-place update run eagerly
    def backward(ctx, *outputs_grads: Optional[Tensor]):
        rows, offsets, per_sample_weights = ctx.saved_tensors
        layout, weights = ctx.layout, ctx.weights
        op_grads, grad_columns, given = _op_grads(layout, outputs_grads, rows)
        # A feature whose output got no gradient is left out; a table all of whose features
        # are gets none (as a module whose output is unused).
        feature_tables = [t if g else -1 for t, g in zip(layout.feature_tables, given)]
        needed = [ctx.needs_input_grad[_WEIGHTS + j] for j in range(len(weights))]
        # A table loaded or reset since the forward gets nothing from it (its features are
        # left out); rows given to other keys since (eviction) are dropped lookup by lookup.
        lost = [not needed[j] or j not in feature_tables or marker.lost(stamp)
                for j, (marker, stamp) in enumerate(zip(ctx.markers, ctx.stamps))]
        if any(lost):
            feature_tables = [-1 if t >= 0 and lost[t] else t for t in feature_tables]
        weights_grad = ctx.needs_input_grad[3]
        if torch.is_grad_enabled() and ctx.fused is None:
            # create_graph=True: a backward of torch's differentiable ops, so that a gradient
            # penalty's second-order terms reach the weights and the dense layers.
            block = _block(layout, weights, outputs_grads, (offsets.numel() - 1) // len(feature_tables))
            scale_grad, parts = _traced_gradients(layout, feature_tables, weights, block, rows, offsets,
                                                  per_sample_weights, weights_grad)
            grads = _sparse_gradients(parts, ctx.markers, ctx.stamps, [False] * len(weights),
                                      [(w.shape, w.dtype) for w in weights])
            return (None, None, None, scale_grad) + (None,) * (_WEIGHTS - 4) + tuple(grads)
        scale_grad = None
        if weights_grad:
            block = _block(layout, weights, outputs_grads, (offsets.numel() - 1) // len(feature_tables))
            scale_grad = _traced_gradients(layout, feature_tables, weights, block, rows, offsets, per_sample_weights,
                                           True, tables=False)[0]
        if ctx.fused is not None:
            rows = _rows_still_owned(rows, offsets, feature_tables, weights, ctx.markers, ctx.stamps, lost)
            if any(t >= 0 for t in feature_tables):
                step = ctx.fused(weights)
                with torch.no_grad():
                    torch.ops.sparsekit.pooled_read_update_(
                        list(weights), step.state1, step.state2, step.steps, op_grads, rows, offsets,
                        per_sample_weights, feature_tables, layout.feature_means, step.optimizer, step.hyper, step.lr,
                        ctx.errors, grad_columns)
            return (None, None, None, scale_grad) + (None,) * (_WEIGHTS - 4 + len(weights))
        if not any(t >= 0 for t in feature_tables):
            return (None, None, None, scale_grad) + (None,) * (_WEIGHTS - 4 + len(weights))
        # With the step's error word a bad lookup (a bad direct key in error_mode "late") is
        # recorded there and left out, as the fused update leaves it out, instead of raising.
        unique_rows, per_table, values = torch.ops.sparsekit.pooled_read_backward(
            op_grads, list(weights), rows, offsets, per_sample_weights, feature_tables, layout.feature_means,
            ctx.errors, grad_columns)
        counts = per_table.tolist()  # a host read (a sync on CUDA): the sparse gradients' sizes
        parts: List[Optional[Tuple[Tensor, Tensor]]] = []
        row_start = value_start = 0
        for weight, count, gone in zip(weights, counts, lost):
            dim = weight.shape[1]
            part = (unique_rows[row_start:row_start + count],
                    values[value_start:value_start + count * dim].view(count, dim))
            parts.append(None if gone else part)
            row_start += count
            value_start += count * dim
        grads = _sparse_gradients(parts, ctx.markers, ctx.stamps, [False] * len(weights),
                                  [(w.shape, w.dtype) for w in weights])
        return (None, None, None, scale_grad) + (None,) * (_WEIGHTS - 4) + tuple(grads)


# The place of the first weight among _PooledRead's inputs.
_WEIGHTS = 7


def _traced_gradients(layout: ReadLayout, feature_tables: List[int], weights: Sequence[Tensor], grad: Tensor,
                      rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], scale_grad: bool,
                      tables: bool = True) -> Tuple[Optional[Tensor], List[Optional[Tuple[Tensor, Tensor]]]]:
    """The read's backward in torch's differentiable ops (double backward, per-sample weights'
    gradient): that gradient (when ``scale_grad``) and, with ``tables``, each table's distinct
    rows ascending and their summed gradients (None for a table not read here)."""
    num_features = len(feature_tables)
    batch = (offsets.numel() - 1) // max(num_features, 1)
    lengths = offsets[1:] - offsets[:-1]
    bag = ops._repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, rows.numel())
    feature = torch.div(bag, max(batch, 1), rounding_mode="floor")
    sample = bag - feature * batch
    columns = _device_ints(layout.feature_columns, rows.device)
    means = _device_ints(layout.feature_means, rows.device).bool()
    tables_of = _device_ints(feature_tables, rows.device)
    scale = None
    if scale_grad and per_sample_weights is not None:
        scale = torch.zeros(rows.numel(), dtype=grad.dtype, device=grad.device)
    parts: List[Optional[Tuple[Tensor, Tensor]]] = []
    for j, weight in enumerate(weights):
        dim = weight.shape[1]
        # A row outside its table (a bad direct key left in, error_mode "late" / "assert") is
        # left out, as the kernels leave it out.
        inside = (rows >= 0) & (rows < weight.shape[0])
        position = ((tables_of.index_select(0, feature) == j) & inside).nonzero().squeeze(1)
        b, f = sample.index_select(0, position), feature.index_select(0, position)
        looked = grad[b.unsqueeze(1), columns.index_select(0, f).unsqueeze(1) + torch.arange(dim, device=grad.device)]
        divisor = torch.where(means.index_select(0, f), lengths.index_select(0, bag.index_select(0, position)), 1)
        looked = looked / divisor.to(looked.dtype).unsqueeze(1)
        row = rows.index_select(0, position)
        if per_sample_weights is not None:
            if scale is not None:
                scale = scale.index_add(0, position, (looked * weight.index_select(0, row).to(looked.dtype)).sum(1))
            looked = looked * per_sample_weights.index_select(0, position).to(looked.dtype).unsqueeze(1)
        if not tables or not any(t == j for t in feature_tables):
            parts.append(None)
            continue
        distinct, inverse = torch.unique(row, sorted=True, return_inverse=True)
        value_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        parts.append((distinct, ops.segment_sum(looked.to(value_dtype), inverse, distinct.numel())))
    return scale, parts


def _call_dims(layout: ReadLayout, weights: Sequence[Tensor]) -> List[int]:
    """The widths of the read's features (those of its tables), in feature order."""
    return [weights[t].shape[1] for t in layout.feature_tables if t >= 0]


def _op_grads(layout: ReadLayout, outputs_grads: Sequence[Optional[Tensor]],
              rows: Tensor) -> Tuple[List[Tensor], List[int], List[bool]]:
    """The output gradients as the backward ops take them: ``(grads, grad_columns, given)``.
    A block output's gradient goes whole with the layout's columns (the op takes each
    feature's columns itself: no slice per feature); split outputs go one per feature. A
    feature not ``given`` (another read's, or its output got no gradient) is not read."""
    num_features = len(layout.feature_tables)
    if not layout.split:
        block = outputs_grads[0]
        if block is None:
            return [], [], [False] * num_features
        # An expanded gradient (of a sum) repeats one value along its columns: made dense.
        if block.shape[1] > 1 and block.stride(1) != 1:
            block = block.contiguous()
        return [block], list(layout.feature_columns), [t >= 0 for t in layout.feature_tables]
    placeholder = rows.new_empty(0)
    grads = [placeholder] * num_features
    given = [False] * num_features
    mine = [f for f, t in enumerate(layout.feature_tables) if t >= 0]
    for f, grad in zip(mine, outputs_grads):
        if grad is None:
            continue
        grads[f] = grad if grad.shape[1] <= 1 or grad.stride(1) == 1 else grad.contiguous()
        given[f] = True
    return grads, [], given


def _block(layout: ReadLayout, weights: Sequence[Tensor], outputs_grads: Sequence[Optional[Tensor]],
           batch: int) -> Tensor:
    """The read's output gradient as one ``[B, total_dim]`` block (zeros where an output got
    none): the differentiable backward's input."""
    dtype, device = weights[0].dtype, weights[0].device
    if not layout.split:
        given = outputs_grads[0]
        return given if given is not None else torch.zeros(batch, layout.total_dim, dtype=dtype, device=device)
    # Split outputs are the block's columns in feature order.
    return torch.cat([grad if grad is not None else torch.zeros(batch, dim, dtype=dtype, device=device)
                      for grad, dim in zip(outputs_grads, _call_dims(layout, weights))], dim=1)


def _rows_still_owned(rows: Tensor, offsets: Tensor, feature_tables: List[int], weights: Sequence[Tensor],
                      markers: Sequence[_CoalescedGradMarker], stamps: Sequence[int], lost: Sequence[bool]) -> Tensor:
    """``rows`` with the lookups of rows given to new keys since the forward (a later
    forward's eviction) set to -1, so that a fused update never lands an evicted key's
    gradient on the key that took its row. Unchanged (no copy) unless a table evicted."""
    moved = [j for j, (marker, stamp) in enumerate(zip(markers, stamps)) if not lost[j] and marker.stamp != stamp]
    if not moved:
        return rows
    rows = rows.clone()
    batch = (offsets.numel() - 1) // max(len(feature_tables), 1)
    bounds = offsets[::batch].tolist() if batch else [0] * (len(feature_tables) + 1)
    for f, t in enumerate(feature_tables):
        if t not in moved:
            continue
        part = rows[bounds[f]:bounds[f + 1]]
        given = markers[t].row_since.index_select(0, part.clamp(min=0)) > stamps[t]
        part.masked_fill_(given & (part >= 0), -1)
    return rows


def update_distinct_rows(fused: Any, weight: Tensor, rows: Tensor, values: Tensor) -> None:
    """Applies the fused update ``fused([weight])`` to the distinct ``rows`` of ``weight``
    whose summed gradients are ``values`` (``[n, dim]``): each row a bag of its own, so the
    arithmetic is the pooled backward's. The table's step counts even for no row."""
    step = fused([weight])
    offsets = torch.arange(rows.numel() + 1, device=rows.device)
    with torch.no_grad():
        torch.ops.sparsekit.pooled_read_update_(
            [weight], step.state1, step.state2, step.steps, [values.to(weight.dtype).contiguous()], rows, offsets,
            None, [0], [0], step.optimizer, step.hyper, step.lr)


def pooled_read(layout: ReadLayout, rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                weights: Sequence[Tensor], markers: Sequence[_CoalescedGradMarker], fused: Any = None,
                errors: Optional[Tensor] = None) -> Tensor:
    """``[B, layout.total_dim]``: every feature's pooled bags of the tables ``weights`` (one
    dtype), as one differentiable read (see :class:`_PooledRead`)."""
    if not torch.is_grad_enabled() or not (any(w.requires_grad for w in weights) or (
            per_sample_weights is not None and per_sample_weights.requires_grad)):
        # Nothing to differentiate (eval, no_grad, frozen tables): the op alone, with no
        # autograd node to build for 2 + tables inputs.
        out = torch.ops.sparsekit.pooled_read(list(weights), rows, offsets, per_sample_weights, layout.feature_tables,
                                              layout.feature_columns, layout.feature_means, layout.total_dim, errors)
        return tuple(out.split(_call_dims(layout, weights), dim=1)) if layout.split else out
    return _PooledRead.apply(layout, rows, offsets, per_sample_weights, markers, fused, errors, *weights)

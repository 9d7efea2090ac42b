"""Second and higher derivatives of the sum and mean lookups: the first-order backward
wrapped as an autograd function whose own backward differentiates a plain-torch pooling
of the distinct rows looked up."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor


class _LookupSpec(NamedTuple):
    """One sum or mean lookup's backward, as :class:`_LookupGradient` needs it."""

    lookup_rows: Tensor  # [nnz] the row each lookup reads, -1 where skipped (missing or padding)
    bag: Tensor  # [nnz] int64: the bag (row of the flattened grad_output) each lookup adds to
    mode: str  # "sum" or "mean" (embedding_bag), "gather" (embedding_gather: one bag per lookup)
    # (grad_output, weight, per_sample_weights) -> (grad_weight, grad_per_sample_weights): the
    # first-order backward, the only one that runs without create_graph.
    first_order: Callable[[Tensor, Optional[Tensor], Optional[Tensor]],
                          Tuple[Optional[Tensor], Optional[Tensor]]]


def _rows_of(grad: Tensor, rows: Tensor) -> Tensor:
    """Dense ``[len(rows), D]``: rows ``rows`` of a sparse COO or strided ``[R, D]`` gradient."""
    picked = grad.index_select(0, rows)
    return picked.to_dense() if picked.layout == torch.sparse_coo else picked


def _reference_pool(table: Tensor, local: Tensor, valid: Tensor, bag: Tensor, bags: int,
                    per_sample_weights: Optional[Tensor], mode: str) -> Tensor:
    """Plain-torch sum / mean pooling of ``table[local[i]]`` into bag ``bag[i]`` over the valid
    lookups (weighted by ``per_sample_weights``): the forward the second derivatives differentiate."""
    scale = valid.to(table.dtype) if per_sample_weights is None else torch.where(valid, per_sample_weights, 0)
    lookups = table.index_select(0, local) * scale.unsqueeze(1)
    pooled = table.new_zeros(bags, table.shape[1]).index_add(0, bag, lookups)
    if mode == "mean":
        denominator = scale.new_zeros(bags).index_add(0, bag, scale)
        nonzero = denominator != 0
        pooled = torch.where(nonzero.unsqueeze(1), pooled / torch.where(nonzero, denominator, 1).unsqueeze(1), 0)
    return pooled


class _LookupGradient(torch.autograd.Function):
    """The first-order gradients of a sum or mean lookup (``embedding_bag``, ``embedding_gather``)
    as a differentiable function of ``(grad_output, weight, per_sample_weights)``: what a
    backward with ``create_graph=True`` returns, so that it can be differentiated again.

    Forward is the first-order backward itself (the same sparse gradient, bit for bit).
    Backward differentiates :func:`_reference_pool` twice over the distinct rows looked up (a
    dense ``[distinct rows, D]`` block, never the table), so the weight's second-order
    gradient is sparse COO too; under ``create_graph=True`` again that plain-torch graph is
    recorded, so third and higher derivatives follow."""

    @staticmethod
    def forward(ctx, grad_output: Tensor, weight: Optional[Tensor], per_sample_weights: Optional[Tensor],
                spec: _LookupSpec):
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad_output, weight, per_sample_weights)
        return spec.first_order(grad_output, weight, per_sample_weights)

    @staticmethod
    def backward(ctx, grad_grad_weight: Optional[Tensor], grad_grad_per_sample_weights: Optional[Tensor]):
        grad_output, weight, per_sample_weights = ctx.saved_tensors
        spec = ctx.spec
        if per_sample_weights is None:
            grad_grad_per_sample_weights = None  # no such output
        if grad_grad_weight is None and grad_grad_per_sample_weights is None:
            return None, None, None, None
        create_graph = torch.is_grad_enabled()

        def variable(tensor: Tensor) -> Tensor:
            # A node of its own to differentiate by: under create_graph an alias, still recorded
            # into the caller's graph (a derivative by the tensor itself would also count the
            # paths through grad_output's own history: d/dp twice), else a fresh leaf.
            if create_graph and tensor.requires_grad:
                return tensor.view_as(tensor)
            return tensor.detach().requires_grad_()

        dim = grad_output.shape[-1]
        bags = spec.bag.shape[0] if spec.mode == "gather" else grad_output.shape[0]
        acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
        valid = spec.lookup_rows >= 0
        distinct, local = torch.unique(torch.where(valid, spec.lookup_rows, 0).long(), return_inverse=True)
        with torch.enable_grad():
            bag_grad = variable(grad_output.reshape(bags, dim).to(acc_dtype))
            # Without per-sample weights the gradients do not depend on the table's values.
            table = variable(weight.index_select(0, distinct).to(acc_dtype) if weight is not None
                             else bag_grad.new_zeros(distinct.shape[0], dim))
            scale = None if per_sample_weights is None else variable(per_sample_weights.to(acc_dtype))
            leaves = [table] + ([] if scale is None else [scale])
            mode = "sum" if spec.mode == "gather" else spec.mode
            pooled = _reference_pool(table, local, valid, spec.bag, bags, scale, mode)
            first = torch.autograd.grad(pooled, leaves, bag_grad, create_graph=True)
            outputs, upstream = [], []
            if grad_grad_weight is not None:
                outputs.append(first[0])
                upstream.append(_rows_of(grad_grad_weight, distinct).to(acc_dtype))
            if grad_grad_per_sample_weights is not None:
                outputs.append(first[1])
                upstream.append(grad_grad_per_sample_weights.to(acc_dtype))
            second = torch.autograd.grad(outputs, [bag_grad] + leaves, upstream, allow_unused=True,
                                         create_graph=create_graph)
        needs_grad_output, needs_weight, needs_per_sample_weights = ctx.needs_input_grad[:3]
        grad_grad_output = grad_weight = grad_per_sample_weights = None
        if needs_grad_output and second[0] is not None:
            grad_grad_output = second[0].reshape(grad_output.shape).to(grad_output.dtype)
        if weight is not None and needs_weight and second[1] is not None:
            grad_weight = torch.sparse_coo_tensor(distinct.unsqueeze(0), second[1].to(weight.dtype), weight.shape,
                                                  is_coalesced=True, check_invariants=False)
        if scale is not None and needs_per_sample_weights and second[2] is not None:
            grad_per_sample_weights = second[2].to(per_sample_weights.dtype)
        return grad_grad_output, grad_weight, grad_per_sample_weights, None


def _lookup_gradients(spec: _LookupSpec, grad_output: Tensor, weight: Optional[Tensor],
                      per_sample_weights: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The first-order gradients; differentiable again when the backward runs with
    ``create_graph=True`` (grad mode on)."""
    if torch.is_grad_enabled():
        return _LookupGradient.apply(grad_output, weight, per_sample_weights, spec)
    return spec.first_order(grad_output, weight, per_sample_weights)

"""Float32 lookups of float16 / bfloat16 tables for the traced layers, rounded to the half
type once as the eager forward rounds: ``sparsekit::_embedding_gather_float`` (a
Python-defined op) and the pooling built on it."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._bags import _bag_index
from ._common import _ops
from ._embedding import _embedding_gather_fake
from ._embedding_backward import _embedding_gather_backward_of, _embedding_gather_setup_context
from ._segment import segment_sum
from ._sparse_gradient import _first_lookup_of


@torch.library.custom_op("sparsekit::_embedding_gather_float", mutates_args=())
def _embedding_gather_float(weight: Tensor, rows: Tensor) -> Tensor:
    """Internal: ``embedding_gather(weight, rows)`` of a float16 / bfloat16 table, widened to
    float32 in one op (the traced collection's weighted and mean half tables). Its backward
    sums each row's float32 gradients and rounds them to the table's dtype once, as the
    eager lookup does, where ``embedding_gather(...).float()`` would round every lookup's
    gradient to the half type before the sum."""
    return _ops.embedding_gather(weight, rows).float()


@_embedding_gather_float.register_fake
def _embedding_gather_float_fake(weight: Tensor, rows: Tensor) -> Tensor:
    return _embedding_gather_fake(weight, rows).float()


def _embedding_gather_float_setup_context(ctx, inputs, output) -> None:
    _embedding_gather_setup_context(ctx, inputs, output)
    ctx.weight_dtype = inputs[0].dtype


def _embedding_gather_float_backward(ctx, grad_output: Tensor):
    # embedding_gather's, from the float32 gradient to the table's dtype (differentiable again).
    with _first_lookup_of(ctx.weight_id, grad_output):
        return _embedding_gather_backward_of(ctx, grad_output, ctx.weight_dtype)


_embedding_gather_float.register_autograd(_embedding_gather_float_backward,
                                          setup_context=_embedding_gather_float_setup_context)


def _pooled_float(weight: Tensor, rows: Tensor, offsets: Tensor, scale: Optional[Tensor] = None) -> Tensor:
    """Internal: the float32 sums of a float16 / bfloat16 table's rows over the CSR bags
    ``offsets``, each row times its ``scale`` first when given (0 for a lookup to skip), not
    rounded back: what the traced layers pool before a mean's division or a weighting, so
    that the result is rounded to the half type once, as the eager forward rounds it. A -1
    row reads zeros."""
    vectors = _embedding_gather_float(weight, rows)
    if scale is not None:
        vectors = vectors * scale.unsqueeze(1)
    return segment_sum(vectors, _bag_index(offsets, rows.shape[0]), offsets.numel() - 1)

"""``lazy_adam_`` and the fakes of ``sparsekit::lazy_adam_`` / ``sparsekit::lazy_adam_tables_``
(``csrc/cpu/lazy_adam_cpu.cpp``, ``csrc/cuda/lazy_adam_cuda.cu``): the row-wise Adam update
:class:`sparsekit.LazyAdam` runs, with the checks the kernels make.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

import torch
from torch import Tensor

from .._checks import float_dtype, index_dtype, same_device, shape_of, shown, tensor_arguments
from ._common import _check_not_inference, _integer, _ops, _real


@torch.library.register_fake("sparsekit::lazy_adam_tables_")
def _lazy_adam_tables_fake(weights: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                           rows: List[Tensor], grads: List[Tensor], steps: List[int], hyper: List[float]) -> None:
    op = "lazy_adam_tables_"
    same_device(op, weights=weights, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, rows=rows, grads=grads)
    torch._check(len(weights) == len(exp_avgs) == len(exp_avg_sqs) == len(rows) == len(grads) == len(steps)
                 and len(hyper) == 5 * len(weights),
                 lambda: f"{op}: one weight, moment pair, rows, grad and step per table, five hyper")
    for t, weight in enumerate(weights):
        exp_avg = exp_avgs[t]
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError(f"{op}: weights[{t}] must be a float32, float16 or bfloat16 tensor, got {weight.dtype}")
        if exp_avg.dtype != torch.float32:
            raise RuntimeError(f"{op}: exp_avgs[{t}] must be float32 (a half weight keeps float32 moments), got "
                               f"{exp_avg.dtype}")
        torch._check(weight.is_contiguous() and weight.shape == exp_avg.shape,
                     lambda: f"{op}: weights[{t}] {shape_of(weight)} must be contiguous with the shape of "
                             f"exp_avgs[{t}] {shape_of(exp_avg)}")
        # The float32 moments stand in for a half weight: the rest must match them.
        half = weight.dtype != torch.float32
        _check_lazy_adam_args(f"{op}: table {t}", exp_avg if half else weight, exp_avg, exp_avg_sqs[t], rows[t],
                              grads[t], steps[t], *hyper[5 * t:5 * t + 5])
        torch._check(rows[t].dtype == torch.int64 and rows[t].is_contiguous(),
                     lambda: f"{op}: rows[{t}] must be a contiguous int64 tensor")
    return None


def _check_lazy_adam_args(op: str, weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor,
                          step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The C++ check_lazy_adam_args (everything that does not read rows), with its messages;
    ``op`` is ``"lazy_adam_"`` or ``"lazy_adam_tables_: table t"`` (whose float32 moments
    stand in for a half ``weight``)."""
    float_dtype(op, "weight", weight)
    torch._check(weight.dim() >= 1, lambda: f"{op}: weight must have at least one dimension [R, ...], got a scalar")
    torch._check(exp_avg.shape == weight.shape and exp_avg_sq.shape == weight.shape,
                 lambda: f"{op}: exp_avg {shape_of(exp_avg)} and exp_avg_sq {shape_of(exp_avg_sq)} must have the "
                         f"shape of weight {shape_of(weight)}")
    torch._check(exp_avg.dtype == weight.dtype and exp_avg_sq.dtype == weight.dtype and grad.dtype == weight.dtype,
                 lambda: f"{op}: exp_avg ({exp_avg.dtype}), exp_avg_sq ({exp_avg_sq.dtype}) and grad ({grad.dtype}) "
                         f"must have the dtype of weight ({weight.dtype})")
    torch._check(weight.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous(),
                 lambda: f"{op}: weight, exp_avg and exp_avg_sq must be contiguous (they are updated in place, so a "
                         ".contiguous() copy would not do); allocate the optimizer state with torch.zeros_like")
    index_dtype(op, "rows", rows)
    torch._check(rows.dim() == 1, lambda: f"{op}: rows must be 1-D [u], got shape {shape_of(rows)}")
    torch._check(grad.dim() == weight.dim() and grad.shape[0] == rows.shape[0]
                 and tuple(grad.shape[1:]) == tuple(weight.shape[1:]),
                 lambda: f"{op}: grad must have shape [u, ...] = {[shown(rows.shape[0]), *shape_of(weight)[1:]]} "
                         f"(one row of gradient per entry of rows), got {shape_of(grad)}")
    torch._check(step >= 1, lambda: f"{op}: step must be >= 1 (the first update is step 1), got {step}")
    # Written so that NaN fails too.
    for key, value, high in (("lr", lr, None), ("eps", eps, None), ("beta1", beta1, 1.0), ("beta2", beta2, 1.0),
                             ("weight_decay", weight_decay, None)):
        torch._check(value >= 0.0 and (high is None or value < high),
                     lambda: f"{op}: {key} must be {'in [0, 1)' if high else '>= 0'}, got {value}")


@torch.library.register_fake("sparsekit::lazy_adam_")
def _lazy_adam_fake(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor, step: int,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0) -> None:
    same_device("lazy_adam_", weight=weight, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, rows=rows, grad=grad)
    _check_lazy_adam_args("lazy_adam_", weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps,
                          weight_decay)
    return None


def lazy_adam_(
    weight: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    rows: Tensor,
    grad: Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Lazy Adam in place: only ``rows`` of the weight and of both moments change.

    For each row ``r = rows[i]`` with gradient ``g = grad[i]``::

        g += weight_decay * w[r]
        m[r] = b1 * m[r] + (1 - b1) * g          # computed as m += (1 - b1) * (g - m)
        v[r] = b2 * v[r] + (1 - b2) * g * g      # computed as v += (1 - b2) * (g * g - v)
        w[r] -= lr * sqrt(1 - b2**step) / (1 - b1**step) * m[r] / (sqrt(v[r]) + eps)

    the update of ``torch.optim.SparseAdam`` (plus weight decay). float32 and float64
    compute in the parameter dtype, one rounding per operation as SparseAdam does, so the
    moments match it bit for bit; float16 and bfloat16 compute in float32. A row outside
    ``[0, R)`` or given twice raises and nothing is written (on CUDA: one host sync to read
    the check). The update is not differentiable: with grad mode on, a weight or moment
    that requires grad is refused (call it under ``torch.no_grad()``, as optimizers do),
    and the three tensors' version counters advance, so a backward that saved the weight
    before the update raises, as after torch's own optimizers.

    Args:
        weight: ``[R, ...]`` contiguous float32/float64/float16/bfloat16, updated in place.
        exp_avg: first moment, weight's shape and dtype, updated in place.
        exp_avg_sq: second moment, weight's shape and dtype, updated in place.
        rows: int64 or int32 ``[u]`` **distinct** row indices (checked: sum the gradient
            rows of a repeated row first, as :class:`sparsekit.LazyAdam` does).
        grad: ``[u, ...]`` gradient rows, weight's dtype.
        step: the step number after incrementing (``>= 1``), for the bias correction.
        lr: learning rate ``>= 0``.
        beta1: first-moment decay in ``[0, 1)``.
        beta2: second-moment decay in ``[0, 1)``.
        eps: denominator term ``>= 0``.
        weight_decay: L2 penalty ``>= 0`` added to the gradient of the touched rows.
    """
    tensor_arguments("lazy_adam_", weight=weight, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, rows=rows, grad=grad)
    step = _integer("lazy_adam_", "step", step)
    lr, beta1, beta2, eps, weight_decay = (
        _real("lazy_adam_", name, value) for name, value in
        (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)))
    updated = (("weight", weight), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    _check_in_place_update("lazy_adam_", updated)
    _check_not_inference("lazy_adam_", updated)
    _ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay)


def _check_in_place_update(op: str, tensors: Iterable[Tuple[str, Tensor]]) -> None:
    """An optimizer kernel writes its tensors in place, outside autograd: with grad mode on,
    a tensor that requires grad is refused, as torch refuses an in-place op on a leaf that
    requires grad (the optimizers run under ``torch.no_grad()``)."""
    if not torch.is_grad_enabled():
        return
    for name, tensor in tensors:
        if isinstance(tensor, Tensor) and tensor.requires_grad:
            raise RuntimeError(f"{op}: {name} requires grad and grad mode is on: the update is in place and not "
                               "differentiable; call it under torch.no_grad(), as optimizers do")

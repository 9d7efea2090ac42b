"""LazyAdam: Adam that touches only the embedding rows present in a sparse gradient."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.optim.adam import adam as _functional_adam

from . import ops

__all__ = ["LazyAdam"]


def _step_dtype() -> torch.dtype:
    # The dtype torch.optim.Adam gives its step tensor, so state dicts are interchangeable.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class LazyAdam(torch.optim.Optimizer):
    """Adam for models that mix embedding tables with sparse gradients and dense layers.

    * A parameter whose gradient is a sparse COO tensor (``nn.Embedding(sparse=True)``,
      :func:`sparsekit.ops.embedding_bag`, ...) gets the lazy update of
      ``torch.optim.SparseAdam`` and TensorFlow's LazyAdam through the fused
      :func:`sparsekit.ops.lazy_adam_` kernel: only the rows in the gradient change, their
      moments included; every other row keeps its weight and moments bit for bit. An
      uncoalesced gradient (duplicate rows) is summed per row first with
      :func:`sparsekit.ops.unique` and :func:`sparsekit.ops.segment_sum`.
    * A parameter with a dense gradient gets ordinary Adam, computed by
      ``torch.optim.adam.adam`` with the same settings ``torch.optim.Adam`` would use, so
      the results are those of ``torch.optim.Adam``.

    ``weight_decay`` is L2 regularization added to the gradient (``torch.optim.Adam``'s
    convention); on sparse parameters it applies to the touched rows only.

    State per parameter: ``step`` (a CPU scalar tensor, as ``torch.optim.Adam`` keeps it;
    one counter per parameter, incremented on every step the parameter has a gradient),
    ``exp_avg`` and ``exp_avg_sq`` (the parameter's shape and dtype). All of it is saved
    by ``state_dict()``.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (default 1e-3).
        betas: decay of the first and second moment estimates (default (0.9, 0.999)).
        eps: term added to the denominator (default 1e-8).
        weight_decay: L2 penalty (default 0).
    """

    def __init__(
        self,
        params: Iterable[Union[Tensor, Dict[str, Any]]],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"LazyAdam: invalid learning rate {lr}; it must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"LazyAdam: invalid eps {eps}; it must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LazyAdam: invalid betas {betas}; both must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"LazyAdam: invalid weight_decay {weight_decay}; it must be >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _init_state(self, param: Tensor) -> Dict[str, Any]:
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _sparse_rows_and_values(param: Tensor, grad: Tensor) -> Tuple[Tensor, Tensor]:
        """Distinct rows of a sparse gradient and the summed gradient of each."""
        if grad.sparse_dim() != 1:
            raise RuntimeError(
                f"LazyAdam: a sparse gradient must index the first dimension only (sparse_dim 1, as "
                f"nn.Embedding(sparse=True) gives), got sparse_dim {grad.sparse_dim()} for a parameter of "
                f"shape {tuple(param.shape)}")
        indices = grad._indices()[0]
        values = grad._values()
        if grad.is_coalesced() or indices.numel() == 0:
            return indices, values
        # The update is non-linear in the gradient, so duplicate rows must be summed first;
        # sparsekit's own unique + segment_sum do it without the sort of .coalesce().
        rows, inverse = ops.unique(indices, return_inverse=True)
        return rows, ops.segment_sum(values, inverse, rows.numel())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Performs one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            dense_params: List[Tensor] = []
            dense_grads: List[Tensor] = []
            dense_exp_avgs: List[Tensor] = []
            dense_exp_avg_sqs: List[Tensor] = []
            dense_steps: List[Tensor] = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self._init_state(param)
                if grad.is_sparse:
                    if torch.is_complex(param):
                        raise RuntimeError("LazyAdam: sparse gradients of complex parameters are not supported")
                    # Counted even for an empty gradient, as torch.optim.SparseAdam does.
                    state["step"] += 1
                    rows, values = self._sparse_rows_and_values(param, grad)
                    if rows.numel() == 0:
                        continue
                    ops.lazy_adam_(param, state["exp_avg"], state["exp_avg_sq"], rows, values,
                                   int(state["step"].item()), float(lr), beta1, beta2, group["eps"],
                                   group["weight_decay"])
                elif grad.layout != torch.strided:
                    raise RuntimeError(f"LazyAdam: gradients of layout {grad.layout} are not supported; "
                                       "use dense or sparse COO gradients")
                else:
                    dense_params.append(param)
                    dense_grads.append(grad)
                    dense_exp_avgs.append(state["exp_avg"])
                    dense_exp_avg_sqs.append(state["exp_avg_sq"])
                    dense_steps.append(state["step"])
            if dense_params:
                # torch's own Adam (it increments the steps), with the foreach/fused choice
                # torch.optim.Adam makes by default, so the numbers are Adam's.
                _functional_adam(
                    dense_params, dense_grads, dense_exp_avgs, dense_exp_avg_sqs, [], dense_steps,
                    foreach=None, capturable=False, differentiable=False, fused=None, grad_scale=None,
                    found_inf=None, has_complex=any(torch.is_complex(p) for p in dense_params),
                    amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
                    eps=group["eps"], maximize=False)
        return loss

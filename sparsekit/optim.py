"""LazyAdam: Adam that touches only the embedding rows present in a sparse gradient. Its
checks of settings, gradients' states and saved states are in :mod:`sparsekit.optim_checks`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.optim.adam import adam as _functional_adam

from . import ops, shard_registry
from ._checks import compile_disabled
from .allocator import table_zeros
from .optim_checks import (  # noqa: F401  (_saved_step: imported from here by the checkpoints)
    _check_element_sparse,
    _check_hyperparameters,
    _check_saved_state,
    _check_step_state,
    _gradient_name,
    _kept_step,
    _saved_step,
    _step_dtype,
)

__all__ = ["LazyAdam"]


def _moment_zeros(param: Tensor, dtype: torch.dtype) -> Tensor:
    """A zeroed Adam moment of ``param``'s shape: in huge pages on the CPU (the rows of an
    embedding's moments are read and written at random, as its weight's), in its layout
    otherwise."""
    if param.is_contiguous():
        return table_zeros(param.shape, dtype, param.device)
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def _sum_repeated_rows(indices: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    """The distinct rows of a sparse gradient's ``indices`` and each one's summed ``values``,
    without ``.coalesce()``'s sort: on the CPU for rows in the table a bitmap and one bag sum
    per row (rows ascending); elsewhere ``unique`` + ``segment_sum``."""
    if (indices.device.type == "cpu" and values.dim() == 2 and indices.dtype == torch.int64
            and ops._bitmap_numbers(num_rows, indices.numel())):
        bounds = torch.aminmax(indices)
        if 0 <= int(bounds.min) and int(bounds.max) < num_rows:
            rows, _, offsets, order = torch.ops.sparsekit.unique_bounded(indices, num_rows, True)
            return rows, torch.ops.sparsekit.embedding_bag(values, order, offsets, None, "sum", None, True)
    rows, inverse = ops.unique(indices, return_inverse=True)
    return rows, ops.segment_sum(values, inverse, rows.numel())


class LazyAdam(torch.optim.Optimizer):
    """Adam for models that mix embedding tables with sparse gradients and dense layers.

    * A parameter whose gradient is a sparse COO tensor (``nn.Embedding(sparse=True)``,
      :func:`sparsekit.ops.embedding_bag`, ...) gets the lazy update of
      ``torch.optim.SparseAdam`` and TensorFlow's LazyAdam through the fused
      :func:`sparsekit.ops.lazy_adam_` kernel: only the rows in the gradient change, their
      moments included; every other row keeps its weight and moments bit for bit (a
      gradient with several sparse dims, as SparseAdam takes, changes only the elements or
      slices it names: contiguous parameters). An
      uncoalesced gradient (duplicate rows) is summed per row first with
      :func:`sparsekit.ops.unique` and :func:`sparsekit.ops.segment_sum`. The CPU tables
      of a step (float32, and half-precision embedding shards) are updated together, in
      one multi-table call of the kernel (one float32 table: ``lazy_adam_`` itself).
    * A parameter with a dense gradient gets ordinary Adam, computed by
      ``torch.optim.adam.adam`` with the same settings ``torch.optim.Adam`` would use, so
      the results are those of ``torch.optim.Adam`` with its default execution, bit for bit
      on the CPU for every dtype (its multi-tensor path for float32 / float64, its
      one-tensor loop for the others, where the two differ in the last bit). A float16 /
      bfloat16 embedding shard keeps float32 moments: its dense gradient is applied to a
      float32 copy of the weight (Adam's numbers there), rounded to nearest once.

    ``weight_decay`` is L2 regularization added to the gradient (``torch.optim.Adam``'s
    convention); on sparse parameters it applies to the touched rows only.

    State per parameter: ``step`` (a CPU scalar tensor, as ``torch.optim.Adam`` keeps it;
    one counter per parameter, incremented on every step the parameter has a gradient),
    ``exp_avg`` and ``exp_avg_sq`` (the parameter's shape, dtype and device; float32 for a
    float16 / bfloat16 embedding shard). All of it is saved by ``state_dict()``.

    Settings are real numbers (``numbers.Real``: Python or NumPy ints and floats, not bools
    and not tensors, so a scheduler may set a NumPy ``lr``; ``lr`` may also be a tensor of one
    element, as ``torch.optim.Adam`` takes, read at each step), converted to float for the lazy
    kernels and passed as they are to torch's Adam for dense parameters (as
    ``torch.optim.Adam`` passes them). There is no AMSGrad and no decoupled (AdamW) weight
    decay: a group with ``amsgrad=True``, or ``decoupled_weight_decay=True`` and a non-zero
    ``weight_decay`` (from a loaded ``torch.optim.Adam`` / ``AdamW`` state, say) raises
    ``ValueError``.

    Args:
        params: parameters or parameter groups (dense tensors: sparse *parameters* raise
            ``ValueError``, as in ``torch.optim.SparseAdam``; non-contiguous ones are fine).
        lr: learning rate (default 1e-3).
        betas: decay of the first and second moment estimates (default (0.9, 0.999)).
        eps: term added to the denominator (default 1e-8).
        weight_decay: L2 penalty (default 0).
        maximize: maximize the objective instead of minimizing it (default False), as in
            ``torch.optim.SparseAdam`` and ``torch.optim.Adam``.

    A step is all or nothing: every group's settings (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad`` and ``decoupled_weight_decay`` if present, as edited in
    ``param_groups``: a bad one raises ``ValueError``) and
    every gradient are checked first (layout, shape, dtype, device, and the rows of every
    sparse gradient, read back in one host read per step on CUDA), and so is the state each
    of them will update (``step``, ``exp_avg`` and ``exp_avg_sq`` present, with the shapes,
    dtypes and devices above); only then is anything updated, so a bad setting, gradient or
    state raises with ``step``, weights and moments of every parameter unchanged.
    """

    def __init__(
        self,
        params: Iterable[Union[Tensor, Dict[str, Any]]],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        maximize: bool = False,
    ) -> None:
        _check_hyperparameters(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "LazyAdam")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=bool(maximize))
        # torch's constructor adds every group through add_param_group, which refuses sparse
        # parameters (naming the group and index of each).
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the group's settings (its own or
        the defaults) checked as the constructor's are before it is added, and its parameters
        dense (``ValueError`` for a sparse one, as at construction, rather than a failure
        halfway through a later step)."""
        if isinstance(param_group, dict):
            _check_hyperparameters({**self.defaults, **param_group},
                                   f"LazyAdam.add_param_group (parameter group {len(self.param_groups)})")
        super().add_param_group(param_group)
        group = len(self.param_groups) - 1
        sparse = [[group, i] for i, param in enumerate(self.param_groups[group]["params"]) if param.is_sparse]
        if sparse:
            self.param_groups.pop()  # torch appended it (and checked nothing else): nothing changed
            raise ValueError(f"LazyAdam: sparse parameters at indices {sparse} (group, index): LazyAdam needs dense "
                             "parameter tensors; their gradients may be sparse")

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # load_state_dict ends here: states of older versions (a plain number as step, no
        # maximize) are brought up to date, as torch.optim.Adam does. A step saved by a fused
        # or capturable torch.optim.Adam sits on the parameter's device: it comes back to the
        # CPU, where LazyAdam keeps it and torch's foreach Adam accepts it next to any params.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            for param in group["params"]:
                param_state = self.state.get(param, {})
                step = param_state.get("step")
                if step is None:
                    continue
                if not torch.is_tensor(step) or (step.numel() == 1 and (
                        step.device.type != "cpu" or step.dim() or step.dtype not in (torch.float32, torch.float64))):
                    param_state["step"] = _kept_step(step)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state saved by ``LazyAdam.state_dict()`` (or ``torch.optim.SparseAdam``'s,
        continued with ``weight_decay`` 0, or ``torch.optim.Adam``'s or
        ``AdamW``'s, when LazyAdam computes its update: no ``amsgrad``, and a decoupled
        weight decay only of 0; its ``foreach`` / ``fused`` / ``capturable`` /
        ``differentiable`` flags are kept and ignored, and the state continues as torch's
        default Adam would continue it).

        Every parameter's saved state is checked before anything is loaded: either empty
        (no step yet) or ``step`` (a finite integer >= 0 below 2**63 - 1: a number, or a one-element tensor
        as ``torch.optim.Adam`` saves it), ``exp_avg`` and ``exp_avg_sq`` (floating-point
        tensors of the parameter's shape; the parameter's dtype for a complex one). Moments
        are cast to the parameter's dtype and device, as ``torch.optim.Adam`` does (float32
        for a float16 / bfloat16 embedding shard).

        Raises:
            ValueError: the state lacks LazyAdam's settings (it was saved by another
                optimizer) or holds invalid ones or ones LazyAdam cannot honour (the message
                names each: ``amsgrad=True``, ``decoupled_weight_decay=True`` with a non-zero
                ``weight_decay``), or a parameter's saved state is invalid
                (the message names the parameter, its group and the field); nothing is
                changed.
        """
        # torch runs the load pre-hooks (register_load_state_dict_pre_hook: the documented way
        # to adapt a saved state, e.g. to rename fields or remap parameters by param_names)
        # first: what they return is the state to check and load, not the raw argument.
        hooks = getattr(self, "_optimizer_load_state_dict_pre_hooks", None)
        if hooks and isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch's load_state_dict does
            for pre_hook in hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list):
            raise ValueError("LazyAdam.load_state_dict: expected what LazyAdam.state_dict() returns "
                             f"(a dict with 'state' and 'param_groups'), got {type(state_dict).__name__}")
        # torch.optim.SparseAdam's groups: Adam's settings without weight decay (it has none),
        # continued with weight_decay 0. The caller's dict is left as it is.
        groups = [dict(group, weight_decay=0.0) if isinstance(group, dict) and "weight_decay" not in group
                  and {"lr", "betas", "eps"} <= set(group) else group for group in groups]
        state_dict = dict(state_dict, param_groups=groups)
        for index, group in enumerate(groups):
            missing = sorted({"lr", "betas", "eps", "weight_decay"} - set(group))
            if missing:
                raise ValueError(f"LazyAdam.load_state_dict: parameter group {index} of the state lacks {missing}: "
                                 "it was saved by another optimizer")
            _check_hyperparameters(group, f"LazyAdam.load_state_dict (parameter group {index})")
        saved_states = state_dict.get("state", {})
        if not isinstance(saved_states, Mapping):
            raise ValueError("LazyAdam.load_state_dict: 'state' must map parameter ids to their state dicts, got "
                             f"{type(saved_states).__name__}")
        # The saved ids name parameters in group order, as torch pairs them; groups of other
        # sizes are refused by torch's load_state_dict below, before it changes anything.
        same_sizes = len(groups) == len(self.param_groups) and all(
            isinstance(saved, dict) and len(saved.get("params", ())) == len(group["params"])
            for saved, group in zip(groups, self.param_groups))
        where: Dict[Any, Tuple[int, int, Tensor]] = {}
        if same_sizes:
            for g, (saved, group) in enumerate(zip(groups, self.param_groups)):
                for i, (saved_id, param) in enumerate(zip(saved["params"], group["params"])):
                    where[saved_id] = (g, i, param)
            for saved_id, saved in saved_states.items():
                if saved_id in where:
                    _check_saved_state(saved, *where[saved_id], saved_id)
        if hooks and isinstance(state_dict, dict):
            # The hooks ran above: torch's load_state_dict must not run them a second time.
            self._optimizer_load_state_dict_pre_hooks = type(hooks)()
            try:
                super().load_state_dict(state_dict)
            finally:
                self._optimizer_load_state_dict_pre_hooks = hooks  # the same dict: hook handles stay valid
        else:
            super().load_state_dict(state_dict)
        # torch casts every state tensor to its parameter's dtype; a half embedding shard's
        # moments stay float32, so take them again from the saved state, uncast.
        for saved_id, saved in saved_states.items():
            param = where[saved_id][2] if saved_id in where else None
            if param is not None and _half_shard(param):
                for name in ("exp_avg", "exp_avg_sq"):
                    if isinstance(saved.get(name), Tensor):
                        self.state[param][name] = saved[name].to(device=param.device, dtype=torch.float32)

    def _init_state(self, param: Tensor) -> Dict[str, Any]:
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            # A float16 / bfloat16 embedding shard keeps float32 moments (and is updated in
            # float32, then rounded to nearest): see _lazy_adam_rows.
            dtype = torch.float32 if _half_shard(param) else param.dtype
            state["exp_avg"] = _moment_zeros(param, dtype)
            state["exp_avg_sq"] = _moment_zeros(param, dtype)
        return state

    @staticmethod
    def _sparse_rows_and_values(param: Tensor, grad: Tensor) -> Tuple[Tensor, Tensor]:
        """Distinct rows of a (checked) sparse gradient and the summed gradient of each; with
        ``sparse_dim`` k > 1, rows of :func:`_row_view` (the first k dims as one)."""
        indices = _row_indices(grad)
        values = grad._values()
        if grad.is_coalesced() or indices.numel() == 0:
            return indices, values
        # Autograd stores a sparse gradient as a copy without the coalesced flag (the layers
        # put it back with a hook; sparsekit.ops' lookups, eager or compiled, cannot). On the
        # CPU their rows ascend: one compare over them spares the unique and the sum.
        if indices.device.type == "cpu" and bool((indices[1:] > indices[:-1]).all()):
            return indices, values
        # The update is non-linear in the gradient, so duplicate rows must be summed first.
        return _sum_repeated_rows(indices, values, _row_view(param, grad.sparse_dim()).shape[0])

    def _check_gradients(self, rows_checked_later: Optional[Set[int]] = None) -> Dict[int, int]:
        """Every gradient and the state it will update, before any update (RuntimeError naming the
        parameter, its group and the fault); returns each step counter by parameter ``id``. Rows of
        ids in ``rows_checked_later`` are left to the fused kernel's own check."""
        ranges: List[Tensor] = []
        where: List[Tuple[int, int, Tensor]] = []
        steps: Dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    if torch.is_complex(param):
                        raise RuntimeError(f"{_gradient_name(g, i, param)}: sparse gradients of complex parameters "
                                           "are not supported")
                    if grad.sparse_dim() < 1 or grad.shape != param.shape:
                        raise RuntimeError(
                            f"{_gradient_name(g, i, param)} must have the parameter's shape and at least one "
                            f"sparse dimension; got sparse_dim {grad.sparse_dim()}, shape {tuple(grad.shape)}")
                    if grad.sparse_dim() > 1:
                        _check_element_sparse(g, i, param, self.state.get(param))
                    if grad._nnz() and (rows_checked_later is None or id(param) not in rows_checked_later):
                        indices = _row_indices(grad)
                        low, high = torch.aminmax(indices)
                        if grad.sparse_dim() > 1:
                            # An index past its own dimension could land on another valid row
                            # of the flattened view: each is checked against its size.
                            every = grad._indices()
                            outside = functools.reduce(torch.logical_or, (
                                (every[d] < 0) | (every[d] >= param.shape[d]) for d in range(grad.sparse_dim())))
                            low = torch.where(outside.any(), -1, low)
                        # A gradient marked coalesced is used as it is: rows that do not strictly
                        # ascend may repeat one, which lazy_adam_ refuses only once the parameters
                        # before this one are updated. Flagged here, read with the bounds.
                        unordered = (indices[1:] <= indices[:-1]).any().to(low.dtype) if grad.is_coalesced() \
                            else torch.zeros_like(low)
                        ranges.append(torch.stack([low, high, unordered]))
                        where.append((g, i, param))
                elif grad.layout != torch.strided:
                    raise RuntimeError(f"{_gradient_name(g, i, param)}: gradients of layout {grad.layout} are not "
                                       "supported; use dense or sparse COO gradients")
                elif grad.shape != param.shape:
                    raise RuntimeError(f"{_gradient_name(g, i, param)} has shape {tuple(grad.shape)}")
                # torch refuses such a gradient unless param.grad_dtype is changed; the kernels
                # and torch's Adam would then fail (or silently convert) mid-step.
                if grad.dtype != param.dtype or grad.device != param.device:
                    raise RuntimeError(f"{_gradient_name(g, i, param)} is {grad.dtype} on {grad.device} but the "
                                       f"parameter is {param.dtype} on {param.device}; a gradient must have its "
                                       "parameter's dtype and device")
                checked_later = rows_checked_later is not None and id(param) in rows_checked_later
                step = _check_step_state(self.state.get(param), param, grad, g, i, check_memory=not checked_later)
                if step is not None:
                    steps[id(param)] = step
        if not ranges:
            return steps
        # One host read for every sparse gradient of the step.
        bounds = torch.stack([r.to(ranges[0].device) for r in ranges]).tolist()
        for (low, high, unordered), (g, i, param) in zip(bounds, where):
            sparse_dim = param.grad.sparse_dim()
            if sparse_dim > 1 and (low < 0 or high >= _row_view(param, sparse_dim).shape[0]):
                raise RuntimeError(f"LazyAdam: the sparse gradient of parameter {i} of group {g} names an index "
                                   f"outside the parameter's shape {tuple(param.shape)}; nothing was updated")
            if sparse_dim == 1 and (low < 0 or high >= param.shape[0]):
                bad = low if low < 0 else high
                raise RuntimeError(f"LazyAdam: the sparse gradient of parameter {i} of group {g} names row {bad}, "
                                   f"outside [0, {param.shape[0]}); nothing was updated")
            if unordered:  # rare: a coalesced flag set by hand; repeated rows are what the update cannot take
                distinct, counts = torch.unique(_row_indices(param.grad), return_counts=True)
                repeated = distinct[counts > 1]
                if repeated.numel():
                    raise RuntimeError(f"LazyAdam: the sparse gradient of parameter {i} of group {g} is marked "
                                       f"coalesced but holds row {int(repeated[0])} more than once (coalesce() it, "
                                       "or build it without is_coalesced=True); nothing was updated")
        return steps

    def _fusable(self, param: Tensor) -> bool:
        """Whether the sparse update of ``param`` can go through the one multi-table CPU
        kernel (float32, or a float16 / bfloat16 embedding shard with float32 moments;
        contiguous; no rows handed to new keys to reset)."""
        grad = param.grad
        if grad is None or not grad.is_sparse or param.device.type != "cpu" \
                or not (param.dtype == torch.float32 or _half_shard(param)) \
                or not param.is_contiguous() or grad.sparse_dim() != 1 or grad.shape != param.shape \
                or shard_registry.fresh_rows(param) is not None:
            return False
        # .get: a parameter without state must not get an empty one here, and a damaged state
        # is not fused (_check_gradients then names what is wrong).
        state = self.state.get(param)
        if not state:
            return True
        moments = [state.get(name) for name in ("exp_avg", "exp_avg_sq")]
        return all(isinstance(m, Tensor) and m.dtype == torch.float32 and m.is_contiguous() for m in moments)

    def _fused_sparse_step(self, fused: Set[int], counted: Dict[int, int]) -> None:
        """The sparse updates of the ``fused`` parameters (ids), every group at once: one
        multi-table lazy Adam call, which checks every row of every table before it writes; then
        their step counters (``counted``: each one's value before the step)."""
        tables: List[List[Any]] = [[] for _ in range(5)]
        steps: List[int] = []
        hyper: List[float] = []
        states = []
        created: List[Tensor] = []  # parameters whose state this call makes: gone again if it fails
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in fused:
                    continue
                if not self.state.get(param):
                    created.append(param)
                state = self._init_state(param)
                rows, values = self._sparse_rows_and_values(param, param.grad)
                if group.get("maximize", False):
                    values = -values  # exact, as SparseAdam's -grad
                values = values.float()  # a half shard's gradient, widened as _lazy_adam_rows does
                for column, value in zip(tables, (param, state["exp_avg"], state["exp_avg_sq"], rows, values)):
                    column.append(value)
                steps.append(counted.get(id(param), 0) + 1)
                hyper.extend(map(_float_setting, (group["lr"], *group["betas"], group["eps"], group["weight_decay"])))
                states.append(state)
        try:
            if len(states) == 1 and tables[0][0].dtype == torch.float32:
                # One float32 table: the single-table kernel itself (the same arithmetic).
                torch.ops.sparsekit.lazy_adam_(*(column[0] for column in tables), steps[0], *hyper)
            else:
                torch.ops.sparsekit.lazy_adam_tables_(*tables, steps, hyper)
        except RuntimeError:
            for param in created:
                del self.state[param]
            self._check_gradients()  # LazyAdam's own message for a bad row
            raise
        # Counted even for an empty gradient, as torch.optim.SparseAdam does (one call for all).
        torch._foreach_add_([state["step"] for state in states], 1)

    # torch.compile runs the step eagerly (one graph break): dynamo does not trace sparse gradients.
    @compile_disabled
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

        # Settings edited in param_groups (or by a scheduler) are checked like the
        # constructor's, every group before any is updated: a bad one changes nothing.
        for index, group in enumerate(self.param_groups):
            _check_hyperparameters(group, f"LazyAdam.step (parameter group {index})")
        fused = {id(p) for group in self.param_groups for p in group["params"] if self._fusable(p)}
        steps = self._check_gradients(fused)
        if fused:
            self._fused_sparse_step(fused, steps)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            maximize = group.get("maximize", False)
            dense_params: List[Tensor] = []
            dense_grads: List[Tensor] = []
            dense_exp_avgs: List[Tensor] = []
            dense_exp_avg_sqs: List[Tensor] = []
            dense_steps: List[Tensor] = []
            widened: List[Tuple[Tensor, Tensor]] = []
            for param in group["params"]:
                if param.grad is None or id(param) in fused:
                    continue
                grad = param.grad
                state = self._init_state(param)
                if grad.is_sparse:
                    # Counted even for an empty gradient, as torch.optim.SparseAdam does.
                    state["step"] += 1
                    rows, values = self._sparse_rows_and_values(param, grad)
                    if rows.numel() == 0:
                        continue
                    if maximize:
                        values = -values  # exact, as SparseAdam's -grad
                    _reset_reused_rows(param, state, rows)
                    k = grad.sparse_dim()
                    _lazy_adam_rows(_row_view(param, k), _row_view(state["exp_avg"], k),
                                    _row_view(state["exp_avg_sq"], k), rows, values,
                                    int(state["step"].item()),
                                    *map(_float_setting, (lr, beta1, beta2, group["eps"], group["weight_decay"])))
                else:
                    _reset_reused_rows(param, state, None)  # a dense gradient updates every row
                    if state["exp_avg"].dtype != param.dtype:
                        # A half shard with float32 moments (checked above): Adam on a float32
                        # copy of the weight, rounded to nearest once, as its lazy rows are.
                        widened.append((param, param.float()))
                        param, grad = widened[-1][1], grad.float()
                    dense_params.append(param)
                    dense_grads.append(grad)
                    dense_exp_avgs.append(state["exp_avg"])
                    dense_exp_avg_sqs.append(state["exp_avg_sq"])
                    dense_steps.append(state["step"])
            if dense_params:
                _dense_adam(dense_params, dense_grads, dense_exp_avgs, dense_exp_avg_sqs, dense_steps, group)
            for param, updated in widened:
                param.copy_(updated)
        return loss


# The dtypes whose CPU multi-tensor Adam equals torch.optim.Adam's default one-tensor loop
# bit for bit, every setting included; float16 / bfloat16 round differently and complex
# tensors with weight decay differ, so those take the loop.
_MULTI_TENSOR_EXACT_ON_CPU = (torch.float32, torch.float64)


def _dense_adam(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                steps: List[Tensor], group: Dict[str, Any]) -> None:
    """torch's own Adam (``torch.optim.adam.adam``) on the dense parameters of ``group``, with
    the numbers of ``torch.optim.Adam``'s default: the multi-tensor path where it equals the
    one-tensor loop bit for bit (float32, float64 on the CPU; CUDA), else the loop."""
    buckets: Dict[Optional[bool], List[int]] = {}
    for index, param in enumerate(params):
        device = param.device.type
        foreach = (True if device == "cuda" or param.dtype in _MULTI_TENSOR_EXACT_ON_CPU else False) \
            if device in ("cpu", "cuda") else None
        buckets.setdefault(foreach, []).append(index)
    # torch.optim.Adam takes float betas only (a NumPy float64 is one, and is passed as it is).
    beta1, beta2 = (beta if isinstance(beta, float) else float(beta) for beta in group["betas"])
    for foreach, chosen in buckets.items():
        every = len(chosen) == len(params)
        pick = (lambda tensors: tensors) if every else (lambda tensors: [tensors[i] for i in chosen])
        chosen_params = pick(params)
        _functional_adam(
            chosen_params, pick(grads), pick(exp_avgs), pick(exp_avg_sqs), [], pick(steps),
            foreach=foreach, capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
            has_complex=any(torch.is_complex(p) for p in chosen_params), amsgrad=False, beta1=beta1, beta2=beta2,
            lr=_float_setting(group["lr"]) if isinstance(group["lr"], Tensor) else _torch_adam_setting(group["lr"]),
            weight_decay=_torch_adam_setting(group["weight_decay"]),
            eps=_torch_adam_setting(group["eps"]), maximize=group.get("maximize", False))


def _float_setting(value: Any) -> float:
    """A (checked) setting as the float the lazy kernels take (a tensor lr is read: a host
    sync when it lives on a GPU)."""
    return value if type(value) is float else float(value)


def _torch_adam_setting(value: Any) -> Any:
    """A (checked) lr, eps or weight_decay as torch.optim.Adam passes it: a Python or NumPy
    number unchanged, any other real number (a Fraction) as a float."""
    return value if isinstance(value, (int, float, np.number)) else float(value)


def _row_view(tensor: Tensor, sparse_dim: int) -> Tensor:
    """``tensor`` as the rows a gradient of ``sparse_dim`` sparse dimensions indexes: itself
    for 1, else a view ``[prod(shape[:sparse_dim]), *shape[sparse_dim:]]``."""
    return tensor if sparse_dim == 1 else tensor.view(-1, *tensor.shape[sparse_dim:])


def _row_indices(grad: Tensor) -> Tensor:
    """The rows of :func:`_row_view` a sparse gradient's entries name (its first index row
    for ``sparse_dim`` 1, else the row-major number of its first ``sparse_dim`` indices;
    ascending and distinct when the gradient is coalesced)."""
    indices = grad._indices()
    rows = indices[0]
    for d in range(1, indices.shape[0]):  # scalar sizes: no host-to-device copy on CUDA
        rows = rows * grad.shape[d] + indices[d]
    return rows


def _reset_reused_rows(param: Tensor, state: Dict[str, Any], rows: Optional[Tensor]) -> None:
    """Zeroes the moments of ``rows`` (None: all) that a dynamic layer gave to new keys since
    their last update (:func:`sparsekit.shard_registry.fresh_rows`) and clears the flags: a new key never
    inherits an evicted key's moments. Set to zero, not masked (inf * 0 is NaN). No host sync."""
    fresh = shard_registry.fresh_rows(param)
    if fresh is None:
        return
    shape = (-1,) + (1,) * (param.dim() - 1)
    if rows is None:
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].masked_fill_(fresh.view(shape), 0)
        fresh.fill_(False)
        return
    reset = fresh.index_select(0, rows).view(shape)
    for name in ("exp_avg", "exp_avg_sq"):
        moments = state[name]
        moments.index_copy_(0, rows, moments.index_select(0, rows).masked_fill_(reset, 0))
    fresh.index_fill_(0, rows, False)


def _lazy_adam_rows(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, values: Tensor, step: int,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """:func:`sparsekit.ops.lazy_adam_` on any parameter: a non-contiguous parameter or moment
    has its touched rows gathered, updated (bit for bit the same) and copied back."""
    mixed = exp_avg.dtype != param.dtype  # a half shard with float32 moments
    if not mixed and param.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous():
        ops.lazy_adam_(param, exp_avg, exp_avg_sq, rows, values, step, lr, beta1, beta2, eps, weight_decay)
        return
    rows = rows.long()
    local = [t.index_select(0, rows).to(exp_avg.dtype) for t in (param, exp_avg, exp_avg_sq)]
    ops.lazy_adam_(*local, torch.arange(rows.numel(), device=rows.device), values.contiguous().to(exp_avg.dtype),
                   step, lr, beta1, beta2, eps, weight_decay)
    for target, updated in zip((param, exp_avg, exp_avg_sq), local):
        # .to() rounds to nearest (even) for the half shard's weight.
        target.index_copy_(0, rows, updated.to(target.dtype))


def _half_shard(param: Tensor) -> bool:
    """A float16 / bfloat16 model-parallel embedding shard (its moments are float32)."""
    return param.dtype in (torch.float16, torch.bfloat16) and shard_registry.is_shard(param)

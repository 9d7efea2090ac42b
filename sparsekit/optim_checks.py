"""LazyAdam's checks, made before a step or a load changes anything: its settings (those of
torch.optim.Adam / AdamW it cannot honour refused), every gradient's state, and a saved
state's fields; and the form LazyAdam keeps a saved ``step`` in.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import shard_registry
from ._checks import holds_values, memory_span


# The state LazyAdam keeps per parameter (and torch.optim.Adam, which may keep more).
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _step_dtype() -> torch.dtype:
    # The dtype torch.optim.Adam gives its step tensor, so state dicts are interchangeable.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _kept_step(step: Any) -> Tensor:
    """A saved ``step`` (a number or a one-element tensor) as LazyAdam keeps it: a 0-dim
    float32 / float64 CPU tensor (a tensor's own dtype when it is one of those)."""
    if not torch.is_tensor(step):
        return torch.tensor(float(step), dtype=_step_dtype())
    dtype = step.dtype if step.dtype in (torch.float32, torch.float64) else _step_dtype()
    return step.detach().to(device="cpu", dtype=dtype).reshape(())


def _gradient_name(group: int, position: int, param: Tensor) -> str:
    """The words naming a gradient in :meth:`LazyAdam._check_gradients`'s errors (built
    only to raise: the checks run for every parameter on every step)."""
    return f"LazyAdam: the gradient of parameter {position} of group {group} (shape {tuple(param.shape)})"


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number LazyAdam takes as a setting: any ``numbers.Real``
    (a Python or NumPy int or float, as ``torch.optim.Adam`` takes, or what an LR scheduler's
    lambda returns), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _shown_setting(value: Any) -> str:
    """``repr(value)``, or a short form of an int too long for one (past 4300 digits Python
    refuses to make its decimal string)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4000:
        return f"{'-' if value < 0 else ''}<an int of {value.bit_length()} bits>"
    return repr(value)


def _check_hyperparameters(settings: Dict[str, Any], where: str) -> None:
    """ValueError naming the first invalid setting, or every one of torch.optim.Adam's /
    AdamW's settings in ``settings`` that LazyAdam cannot honour."""
    betas = settings["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_real(b) for b in betas)):
        tensor = " (a tensor beta is not supported)" if isinstance(betas, (tuple, list)) and any(
            isinstance(b, Tensor) for b in betas) else ""
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2) of floats, got {betas!r}{tensor}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{where}: invalid betas {tuple(betas)}; both must be in [0, 1)")
    for name, label in (("lr", "learning rate lr"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        value = settings[name]
        if isinstance(value, Tensor) and name == "lr":
            _check_tensor_lr(value, where)
            continue
        if isinstance(value, Tensor):
            raise ValueError(f"{where}: {label} is a tensor ({value!r}); a tensor {name} is not supported, pass a "
                             f"float (e.g. {name}=float(value))")
        if not _is_real(value) or not value >= 0.0:
            raise ValueError(f"{where}: invalid {label} {_shown_setting(value)}; it must be a real number >= 0")
        try:
            float(value)
        except OverflowError:
            # A Python int past float64 (10**400): the step converts every setting to a float
            # and failed there with a bare "OverflowError: int too large to convert to float".
            raise ValueError(f"{where}: invalid {label} {_shown_setting(value)}; it must be a real number >= 0 "
                             "that a float64 can hold") from None
    # Settings that change the update and that LazyAdam does not implement (AdamW's decay
    # unless 0, AMSGrad, NAdam's momentum_decay) are refused rather than silently ignored.
    # torch's execution flags (foreach, fused, capturable, differentiable) say how, not what,
    # and are accepted and ignored.
    if "momentum_decay" in settings:
        raise ValueError(f"{where}: these are torch.optim.NAdam's settings (momentum_decay; its update is not "
                         "Adam's, which LazyAdam computes); load the state into torch.optim.NAdam")
    unsupported = []
    if settings.get("amsgrad", False):
        unsupported.append("amsgrad=True (LazyAdam keeps no max_exp_avg_sq)")
    if settings.get("decoupled_weight_decay", False) and settings["weight_decay"] != 0:
        unsupported.append(f"decoupled_weight_decay=True with weight_decay={settings['weight_decay']!r} (AdamW's "
                           "decay of the weight; LazyAdam's weight_decay is L2 added to the gradient, as in "
                           "torch.optim.Adam)")
    if unsupported:
        raise ValueError(f"{where}: LazyAdam cannot honour {' and '.join(unsupported)}; use the optimizer that "
                         "made these settings, or set them to False to continue as plain Adam")


def _check_tensor_lr(value: Tensor, where: str) -> None:
    """A tensor lr, as ``torch.optim.Adam`` takes one (a scheduler or a captured step changes
    it in place): one floating-point element, no gradient; its value is checked (>= 0) where
    it can be read without a device sync, on the CPU."""
    if value.numel() != 1 or not value.is_floating_point() or value.requires_grad or not holds_values(value):
        raise ValueError(f"{where}: a tensor learning rate lr must be a floating-point tensor of one element, dense "
                         f"and with data (not on the meta device), that does not require grad, got {value.dtype} of "
                         f"shape {tuple(value.shape)} on {value.device}")
    if value.device.type == "cpu" and not bool(value >= 0):
        raise ValueError(f"{where}: invalid learning rate lr {value.item()!r}; it must be a real number >= 0")


def _check_step_state(state: Optional[Dict[str, Any]], param: Tensor, grad: Tensor, group_index: int,
                      position: int, check_memory: bool = True) -> Optional[int]:
    """RuntimeError naming the entry of ``param``'s ``state`` the update could not use (missing,
    a bad ``step``, moments of the wrong shape, device or dtype, shared memory when
    ``check_memory``, a step that cannot advance); returns the step's value (None: no state)."""
    # Built only to raise: this runs for every parameter on every step.
    def name() -> str:
        return f"LazyAdam: the state of parameter {position} of group {group_index} (shape {tuple(param.shape)})"

    # The update writes the weight and moments in place while it reads the gradient: shared
    # memory gives a silently wrong step, and the kernel refuses it, but only once the
    # parameters before this one are updated.
    if not state:
        if check_memory:
            _check_disjoint(name, {"the parameter": param, "the gradient": grad._values() if grad.is_sparse else grad})
        return None
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise RuntimeError(f"{name()} lacks {missing}: load a complete state (LazyAdam.state_dict()) or none")
    step = state["step"]
    if not (isinstance(step, Tensor) and step.numel() == 1 and step.dtype in (torch.float32, torch.float64)
            and step.device.type == "cpu"):
        got = (f"{step.dtype} tensor of shape {tuple(step.shape)} on {step.device}" if isinstance(step, Tensor)
               else type(step).__name__)
        raise RuntimeError(f"{name()}: 'step' must be a one-element float32 or float64 CPU tensor, got {got}")
    value = step.item()
    if not _valid_step(value):
        raise RuntimeError(f"{name()}: 'step' must be a finite integer >= 0 below 2**63 - 1, got {value}; nothing "
                           "was updated")
    # torch's Adam wants the parameter's dtype. The lazy update also runs in float32 or
    # float64 moments (an embedding shard's float32 ones, a checkpoint's of another precision:
    # load_checkpoint keeps their dtype), as long as both moments share it.
    dtypes = [param.dtype]
    first = state["exp_avg"].dtype if isinstance(state["exp_avg"], Tensor) else None
    if not grad.is_sparse and param.dtype in (torch.float16, torch.bfloat16):
        # A half embedding shard's float32 moments: its dense gradient (an L2 term over the
        # weight) is also applied in float32 and the weight rounded once (see step).
        dtypes = [first] if first in (param.dtype, torch.float32) else [param.dtype, torch.float32]
    elif grad.is_sparse:
        if first is not None and (first == param.dtype or first in (torch.float32, torch.float64)):
            dtypes = [first]
        else:
            dtypes = [param.dtype] + [d for d in (torch.float32, torch.float64) if d != param.dtype]
    for key in ("exp_avg", "exp_avg_sq"):
        moment = state[key]
        if not (isinstance(moment, Tensor) and moment.layout == torch.strided and moment.shape == param.shape
                and moment.dtype in dtypes and moment.device == param.device):
            got = (f"{moment.layout} {moment.dtype} tensor of shape {tuple(moment.shape)} on {moment.device}"
                   if isinstance(moment, Tensor) else type(moment).__name__)
            raise RuntimeError(f"{name()}: {key!r} must be a dense {' or '.join(map(str, dtypes))} tensor of the "
                               f"parameter's shape on {param.device}, got {got}")
    # An inference tensor (made or loaded under torch.inference_mode()) cannot be updated in
    # place outside it: checked here, so the update never fails halfway.
    made_there = [key for key in _STATE_KEYS if isinstance(state[key], Tensor) and state[key].is_inference()]
    if made_there and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name()}: {made_there} were made under torch.inference_mode() (a state loaded "
                           "there?), and a step outside it cannot update them in place; load the state outside "
                           "inference mode; nothing was updated")
    if check_memory:  # else the fused kernel checks it before it writes
        _check_disjoint(name, {"the parameter": param, "'exp_avg'": state["exp_avg"],
                               "'exp_avg_sq'": state["exp_avg_sq"],
                               "the gradient": grad._values() if grad.is_sparse else grad})
    return int(value)


def _check_disjoint(name: Callable[[], str], tensors: Dict[str, Tensor]) -> None:
    """RuntimeError naming two of ``tensors`` (same device, strided) whose bytes intersect."""
    spans = [(label, memory_span(t)) for label, t in tensors.items() if t.numel() and t.layout == torch.strided]
    for index, (label, (begin, end)) in enumerate(spans):
        for other, (other_begin, other_end) in spans[index + 1:]:
            if begin < other_end and other_begin < end:
                raise RuntimeError(f"{name()}: {label} and {other} share memory; each must be a tensor of its own "
                                   "(the update writes the weight and moments in place while it reads the gradient)")


def _saved_step(step: Any) -> Tuple[Optional[float], bool]:
    """A saved ``step``'s value (None when neither a real number nor a one-element tensor) and
    whether it is a finite integer >= 0 an update can advance once kept (:func:`_kept_step`)."""
    if isinstance(step, Tensor):
        # A meta or sparse one holds no value that .item() can read.
        usable = (step.numel() == 1 and not step.is_complex() and step.dtype != torch.bool and not step.is_meta
                  and step.layout == torch.strided)
        value = step.item() if usable else None
    else:
        usable = isinstance(step, numbers.Real) and not isinstance(step, bool)
        value = step if usable else None
    return value, usable and _valid_step(value) and _valid_step(_kept_step(step).item())


def _valid_step(value: float) -> bool:
    """Whether a step counter's value is one an update can advance: a finite integer >= 0
    whose successor fits in int64 (the lazy kernel's step)."""
    return math.isfinite(value) and 0 <= value < _STEP_LIMIT and float(value).is_integer()


_STEP_LIMIT = 2**63 - 1


def _check_saved_state(saved: Any, group_index: int, position: int, param: Tensor, saved_id: Any) -> None:
    """ValueError naming the parameter and the field of a saved per-parameter state that
    ``LazyAdam.load_state_dict`` must not load (see there for what is accepted)."""
    name = (f"LazyAdam.load_state_dict: the state of parameter {saved_id!r} (index {position} of group "
            f"{group_index}, shape {tuple(param.shape)})")
    if not isinstance(saved, Mapping):
        raise ValueError(f"{name} must be a dict, got {type(saved).__name__}")
    if not saved:
        return  # no step yet: created at the first update
    missing = [key for key in _STATE_KEYS if key not in saved]
    if missing:
        raise ValueError(f"{name} lacks {missing}: it must hold all of {list(_STATE_KEYS)} or be empty")
    step = saved["step"]
    value, valid = _saved_step(step)
    if not valid:
        got = (f"a {step.dtype} tensor of shape {tuple(step.shape)}" + (f" holding {value}" if value is not None
                                                                         else "")
               if isinstance(step, Tensor) else repr(step))
        raise ValueError(f"{name}: 'step' must be a finite integer >= 0 below 2**63 - 1 (a number or a one-element "
                         "tensor; kept as a float, it must stay below that), "
                         f"got {got}")
    for key in ("exp_avg", "exp_avg_sq"):
        moment = saved[key]
        # torch casts floating-point state to a real parameter's dtype, but leaves a complex
        # parameter's state as it is.
        fits = isinstance(moment, Tensor) and moment.layout == torch.strided and (
            moment.dtype == param.dtype if param.is_complex() else moment.is_floating_point())
        if not fits or moment.shape != param.shape:
            got = (f"a {moment.layout} {moment.dtype} tensor of shape {tuple(moment.shape)}"
                   if isinstance(moment, Tensor) else type(moment).__name__)
            want = str(param.dtype) if param.is_complex() else "floating-point"
            raise ValueError(f"{name}: {key!r} must be a dense {want} tensor of the parameter's shape "
                             f"{tuple(param.shape)}, got {got}")


def _check_element_sparse(group_index: int, position: int, param: Tensor, state: Optional[Dict[str, Any]]) -> None:
    """An element-wise sparse gradient (``sparse_dim`` > 1) updates a row view of the
    parameter and its moments, which needs them contiguous."""
    if shard_registry.is_shard(param):
        raise RuntimeError(f"{_gradient_name(group_index, position, param)} has sparse_dim > 1, but it is an "
                           "embedding shard, whose gradient names rows (sparse_dim 1); nothing was updated")
    moments = [state.get(name) for name in ("exp_avg", "exp_avg_sq")] if state else []
    if not param.is_contiguous() or any(isinstance(m, Tensor) and not m.is_contiguous() for m in moments):
        raise RuntimeError(f"{_gradient_name(group_index, position, param)} has sparse_dim > 1, which LazyAdam "
                           "updates only on a contiguous parameter with contiguous moments; nothing was updated")

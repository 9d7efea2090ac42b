"""Argument checks shared by the wrappers of ``sparsekit.ops`` and the op namespace.

The dispatcher reads ``True`` as 1 for an int argument and accepts None or 0 for a bool
one; these helpers check the Python types first (TypeError, as torch's own functions
raise) and leave the ranges to the kernels. Also two refusals several wrappers share:
a forward-mode tangent, and an in-place write to an inference tensor.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

from .. import _C  # noqa: F401  (registers the kernels)
from .._checks import integer_argument
from .._checks import type_name as _type_name

_ops = torch.ops.sparsekit


def _integer(where: str, name: str, value: Any, optional: bool = False) -> Any:
    """An int argument of an op's schema (``integer_argument``), within int64: a wider
    Python int would reach the dispatcher, whose message contradicts itself ("Expected a
    value of type 'int' ... found type 'int'")."""
    value = integer_argument(where, name, value, optional)
    # Not while compiling: dynamo takes a traced SymInt for an int, and a data-dependent one
    # (ids.max().item() + 1, a unique's size) cannot be compared without a graph break.
    if isinstance(value, int) and not torch.compiler.is_compiling() and not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"{where}: {name} must fit in int64, [-2**63, 2**63), got {value}")
    return value


def _refuse_forward_ad(op: str, **named: Optional[Tensor]) -> None:
    """RuntimeError when a differentiable argument carries a forward-mode tangent
    (``torch.autograd.forward_ad.make_dual``, ``torch.func.jvp`` / ``jacfwd`` / ``hessian``).
    The ops' autograd (``torch.library.register_autograd``) is reverse mode only, and torch
    would drop the tangent without a word: ``unpack_dual(out).tangent`` would be None, and
    ``torch.func.jvp`` / ``jacfwd`` would return zeros, a silently wrong Jacobian. Outside a dual
    level (every ordinary call) this is one integer compare."""
    if getattr(_forward_ad, "_current_level", 0) < 0:
        return
    for name, tensor in named.items():
        if tensor is not None and _forward_ad.unpack_dual(tensor).tangent is not None:
            raise RuntimeError(
                f"{op}: forward-mode AD is not supported ({name} carries a tangent from "
                "torch.autograd.forward_ad or torch.func.jvp / jacfwd / hessian, which the op would drop, "
                "giving a zero derivative); use reverse mode: backward() or torch.autograd.grad")


def _flag(op: str, name: str, value: Any) -> bool:
    """``value`` if it is a Python bool (as torch's functions, numpy's bool is not one)."""
    if value is True or value is False:
        return value
    raise TypeError(f"{op}: {name} must be a bool, got {value!r} ({_type_name(value)})")


def _real(op: str, name: str, value: Any) -> Any:
    """``value`` if it is a real number (int, float or a numpy one; not a bool) or a traced
    SymFloat / SymInt."""
    if type(value) is float or type(value) is int or isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return value
    raise TypeError(f"{op}: {name} must be a float, got {value!r} ({_type_name(value)})")


def _choice(op: str, name: str, value: Any) -> str:
    """``value`` if it is a str (which one is the kernel's check)."""
    if isinstance(value, str):
        return value
    raise TypeError(f"{op}: {name} must be a str, got {value!r} ({_type_name(value)})")


def _check_not_inference(op: str, tensors: Iterable[Tuple[str, Tensor]]) -> None:
    """Refuses to write in place to an inference tensor (made under ``torch.inference_mode()``)
    outside inference mode, as torch's own in-place ops do ("Inplace update to inference
    tensor outside InferenceMode is not allowed"). Such a tensor has no autograd or
    ADInplaceOrView dispatch key, so no kernel of the op's dispatch sees it first; checked
    here before anything is written."""
    if torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
        return
    for name, tensor in tensors:
        if isinstance(tensor, Tensor) and tensor.is_inference():
            raise RuntimeError(f"{op}: {name} was made under torch.inference_mode() and cannot be updated in "
                               "place outside it (as torch's in-place ops refuse); make it outside inference "
                               "mode (a clone() there will do), or call this under torch.inference_mode()")

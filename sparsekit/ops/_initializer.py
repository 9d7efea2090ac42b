"""``key_seeded_uniform``, the key-seeded initializer of new embedding rows
(``csrc/cpu/initializer_cpu.cpp``, ``csrc/cuda/initializer_cuda.cu``), and its fake."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES, allocation, index_dtype, tensor_arguments
from .._checks import type_name as _type_name
from ._common import _integer, _ops, _real


def key_seeded_uniform(
    keys: Tensor,
    dim: int,
    *,
    seed: int = 0,
    low: float = -0.05,
    high: float = 0.05,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Initial embedding rows, uniform in ``[low, high]`` and seeded by the key.

    Row ``i`` is a pure function of ``(seed, keys[i])`` (column ``j`` of ``(seed, key,
    j)``), computed with integer hashing and one correctly rounded fma, so a key gets
    the same first vector on every rank, world size, device and insertion order. The
    value is drawn in ``[low, high]`` and then rounded to ``dtype`` (to nearest): where a
    bound is not representable in ``dtype`` a value may land on the bound's rounding, one
    step past it (bfloat16's default ``+-0.05`` gives ``+-0.050048828125`` about once in
    700 draws).

    Args:
        keys: int64 or int32 ``[N]`` (an int32 key gives the row of the equal int64 key).
        dim: columns per row, ``>= 0``.
        seed: any int64; different seeds give independent tables.
        low: lower bound.
        high: upper bound, ``>= low``; both finite in ``dtype`` (``|low|, |high| <=
            torch.finfo(dtype).max``), so every value is.
        dtype: float32, float64, float16 or bfloat16 (the result's), float32 when None.

    Returns:
        ``[N, dim]`` tensor of ``dtype`` on the keys' device.

    Raises:
        TypeError: ``dim`` or ``seed`` not an int, ``low`` or ``high`` not a real number
            (a bool is neither), ``dtype`` not a torch.dtype.
        RuntimeError: a bound not finite, outside ``dtype``'s range (an int or a long
            double beyond float64 included) or ``low > high``, as the kernel checks.
    """
    tensor_arguments("key_seeded_uniform", keys=keys)
    op = "key_seeded_uniform"
    dim, seed = _integer(op, "dim", dim), _integer(op, "seed", seed)
    low, high = _real(op, "low", low), _real(op, "high", high)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype or None, got {dtype!r} ({_type_name(dtype)})")
    for name, value in (("low", low), ("high", high)):
        _check_bound_fits_float64(op, name, value, dtype or torch.float32)
    with allocation(lambda: f"key_seeded_uniform: {keys.shape[0] if keys.dim() else 1} keys x dim={dim} (the output)",
                    (keys.shape[0] if keys.dim() else 1, dim), dtype or torch.float32, keys.device):
        return _ops.key_seeded_uniform(keys, dim, seed, low, high, dtype)


def _check_bound_fits_float64(op: str, name: str, value: Any, dtype: torch.dtype) -> None:
    """A finite bound the kernel cannot take as a double (an int or a long double beyond
    float64, which the dispatcher refuses with a message of its own, or rounds to inf): the
    error the kernel gives a bound beyond ``dtype``'s range, naming the bound."""
    # Traced (dynamic=True makes a float argument symbolic, and dynamo cannot trace math.isinf
    # of it): the op's fake kernel checks the bounds as it traces.
    if isinstance(value, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling():
        return
    try:
        beyond = math.isinf(float(value)) and not np.isinf(value)
    except OverflowError:  # a Python int beyond float64
        beyond = True
    if not beyond:
        return  # finite, or inf / nan as given: the kernel's own checks say why
    if isinstance(value, int):
        # Not str(value): an int of more than 4300 digits has none.
        exponent = math.floor(math.log10(abs(value)))
        text = f"{'-' if value < 0 else ''}{abs(value) / 10 ** (exponent - 15) / 1e15:.6g}e+{exponent}"
    else:
        text = repr(value)
    where = f"{dtype}'s finite range [{-torch.finfo(dtype).max}, {torch.finfo(dtype).max}]" \
        if dtype.is_floating_point else "the float64 range"
    raise RuntimeError(f"{op}: {name} must be finite and lie in {where}, got {text} (beyond float64)")


@torch.library.register_fake("sparsekit::key_seeded_uniform")
def _key_seeded_uniform_fake(
    keys: Tensor, dim: int, seed: int, low: float, high: float, dtype: Optional[torch.dtype] = None
) -> Tensor:
    index_dtype("key_seeded_uniform", "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: "key_seeded_uniform: keys must be 1-D [N]")
    torch._check(dim >= 0, lambda: f"key_seeded_uniform: dim must be >= 0, got {dim}")
    torch._check(math.isfinite(low) and math.isfinite(high) and low <= high,
                 lambda: f"key_seeded_uniform: need finite low <= high, got low={low} high={high}")
    torch._check(dtype is None or dtype in FLOAT_DTYPES,
                 lambda: f"key_seeded_uniform: dtype must be float32, float64, float16 or bfloat16, got {dtype}")
    largest = torch.finfo(dtype or torch.float32).max
    torch._check(abs(low) <= largest and abs(high) <= largest,
                 lambda: f"key_seeded_uniform: low and high must lie in {dtype or torch.float32}'s finite range "
                         f"[{-largest}, {largest}], got low={low} high={high}")
    return keys.new_empty((keys.shape[0], dim), dtype=dtype if dtype is not None else torch.float32)

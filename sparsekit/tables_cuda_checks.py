"""The C++ kernels' argument checks and messages (csrc/torch_api.h, common.h, hashtable.h,
lazy_adam.h), reproduced for the CUDA composites of :mod:`sparsekit.tables_cuda`, so that an
op refuses the same arguments with the same words on both devices.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._checks import memory_span

# ---- the C++ kernels' message formatting (csrc/torch_api.h) ----

# c10's names of dtypes, as the C++ messages print them.
_DTYPE_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble", torch.bool: "Bool", torch.qint8: "QInt8",
    torch.quint8: "QUInt8", torch.qint32: "QInt32", torch.bfloat16: "BFloat16",
}


def _dtype(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _device(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "cuda" if device.index is None else f"cuda:{device.index}"
    return "device"


def _where(device: torch.device) -> str:
    """How a message names the device the kernel runs for: "CPU" as the CPU kernel says it."""
    return "CPU" if device.type == "cpu" else _device(device)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _real(value: float) -> str:
    """A double as a C++ ostream prints it (%g; glibc's -nan)."""
    if math.isnan(value):
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    return "%g" % value


def _fail(message: str) -> None:
    raise RuntimeError(message)


# ---- argument checks ----


def _key_tensor(tensor: Tensor, op: str, arg: str) -> None:
    if tensor.dtype not in (torch.int64, torch.int32):
        _fail(f"{op}: {arg} must be an int64 or int32 tensor of keys, got {_dtype(tensor.dtype)}; cast it with "
              ".long()")


def _index_tensor(tensor: Tensor, op: str, arg: str) -> None:
    if tensor.dtype not in (torch.int64, torch.int32):
        _fail(f"{op}: {arg} must be an int64 or int32 tensor, got {_dtype(tensor.dtype)}")


def _keys_on(keys: Tensor, op: str, device: Optional[torch.device]) -> torch.device:
    """The device the kernel runs for (``keys``' by default), after the kernels' first two
    checks: an int64 / int32 ``keys`` tensor, on that device."""
    _key_tensor(keys, op, "keys")
    if device is None:
        device = keys.device
    if keys.device != device:
        _fail(f"{op}: expected a {_where(device)} tensor, got {_device(keys.device)}")
    return device


def _overlaps(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a_begin, a_end = memory_span(a)
    b_begin, b_end = memory_span(b)
    return a_begin < b_end and b_begin < a_end


def _no_shared_writes(op: str, uses: List[Tuple[Tensor, str, int, bool]]) -> None:
    """common.h check_no_shared_writes: (tensor, arg, index, written), the same sweep."""
    spans = []
    for u, (tensor, _, _, _) in enumerate(uses):
        if tensor.numel() == 0:
            continue
        begin, end = memory_span(tensor)
        spans.append((begin, end, u))
    spans.sort(key=lambda span: span[0])  # stable, as std::stable_sort
    furthest = furthest_written = None
    for span in spans:
        other = furthest if uses[span[2]][3] else furthest_written
        if other is not None and span[0] < other[1]:
            a, b = uses[other[2]], uses[span[2]]
            _fail(f"{op}: {a[1]}[{a[2]}] and {b[1]}[{b[2]}] share memory, and the op writes "
                  f"{a[1] if a[3] else b[1]}; every tensor it writes must be one of its own")
        if furthest is None or span[1] > furthest[1]:
            furthest = span
        if uses[span[2]][3] and (furthest_written is None or span[1] > furthest_written[1]):
            furthest_written = span


def _table_offsets(offsets: Sequence[int], num_tables: int, n: int, op: str) -> None:
    """hashtable_cpu.cpp check_table_offsets."""
    if len(offsets) != num_tables + 1:
        _fail(f"{op}: offsets must hold one more entry than there are tables ({num_tables + 1}), got {len(offsets)}")
    if not (offsets[0] == 0 and offsets[-1] == n):
        _fail(f"{op}: offsets must run from 0 to {n}, got {offsets[0]} .. {offsets[-1]}")
    for t in range(num_tables):
        if offsets[t] > offsets[t + 1]:
            _fail(f"{op}: offsets must never decrease, got offsets[{t}] = {offsets[t]} > offsets[{t + 1}] = "
                  f"{offsets[t + 1]}")


def _hash_table_slots(slot_keys: Tensor, slot_rows: Tensor, op: str) -> None:
    """hashtable.h check_hash_table_slots."""
    for name, tensor in (("slot_keys", slot_keys), ("slot_rows", slot_rows)):
        if tensor.dtype != torch.int64:
            _fail(f"{op}: {name} must be int64, got {_dtype(tensor.dtype)}")
    if slot_keys.dim() != 1 or slot_rows.dim() != 1:
        _fail(f"{op}: slot_keys and slot_rows must be 1-D [S], got shapes {_shape(slot_keys.shape)} and "
              f"{_shape(slot_rows.shape)}")
    slots = slot_keys.shape[0]
    if slots != slot_rows.shape[0]:
        _fail(f"{op}: slot_keys has {slots} slots but slot_rows has {slot_rows.shape[0]}; they must match")
    if not (slots > 0 and (slots & (slots - 1)) == 0):
        _fail(f"{op}: the slot count must be a power of two (index = hash & (S - 1)), got {slots}")
    if not (slot_keys.is_contiguous() and slot_rows.is_contiguous()):
        _fail(f"{op}: slot_keys and slot_rows must be contiguous")
    if slot_keys.device != slot_rows.device:
        _fail(f"{op}: slot_keys is on {_device(slot_keys.device)} but slot_rows is on {_device(slot_rows.device)}; "
              "keep the table on one device")
    if _overlaps(slot_keys, slot_rows):
        _fail(f"{op}: slot_keys and slot_rows share memory; a table's two slot arrays must be tensors of their own")


def _hash_table_find_args(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor, op: str) -> None:
    """hashtable.h check_hash_table_find_args."""
    _hash_table_slots(slot_keys, slot_rows, op)
    _key_tensor(keys, op, "keys")
    if keys.device != slot_keys.device:
        _fail(f"{op}: keys are on {_device(keys.device)} but the table is on {_device(slot_keys.device)}; move the "
              "keys with .to(table.device)")


def _first_bad(bad: Tensor, values: Tensor) -> Tuple[int, int]:
    """``(i, values[i])`` for the first ``i`` where ``bad`` holds, ``(len, 0)`` when none: one
    host sync."""
    n = bad.shape[0]
    first = torch.where(bad, torch.arange(n, device=bad.device), n).amin().view(1)
    at, value = torch.cat([first, values.index_select(0, first.clamp(max=n - 1)).to(torch.int64)]).tolist()
    return at, value


def _lazy_adam_args(op: str, weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor,
                    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """lazy_adam.h check_lazy_adam_args."""
    dtype = weight.dtype
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        _fail(f"{op}: weight must be float32, float64, float16 or bfloat16, got {_dtype(dtype)}")
    if weight.dim() < 1:
        _fail(f"{op}: weight must have at least one dimension [R, ...], got a scalar")
    if not (exp_avg.shape == weight.shape and exp_avg_sq.shape == weight.shape):
        _fail(f"{op}: exp_avg {_shape(exp_avg.shape)} and exp_avg_sq {_shape(exp_avg_sq.shape)} must have the shape "
              f"of weight {_shape(weight.shape)}")
    if not (exp_avg.dtype == dtype and exp_avg_sq.dtype == dtype and grad.dtype == dtype):
        _fail(f"{op}: exp_avg ({_dtype(exp_avg.dtype)}), exp_avg_sq ({_dtype(exp_avg_sq.dtype)}) and grad "
              f"({_dtype(grad.dtype)}) must have the dtype of weight ({_dtype(dtype)})")
    if not (weight.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()):
        _fail(f"{op}: weight, exp_avg and exp_avg_sq must be contiguous (they are updated in place, so a "
              ".contiguous() copy would not do); allocate the optimizer state with torch.zeros_like")
    _index_tensor(rows, op, "rows")
    if rows.dim() != 1:
        _fail(f"{op}: rows must be 1-D [u], got shape {_shape(rows.shape)}")
    if not (grad.dim() == weight.dim() and grad.shape[0] == rows.shape[0] and grad.shape[1:] == weight.shape[1:]):
        expected = [rows.shape[0], *weight.shape[1:]]
        _fail(f"{op}: grad must have shape [u, ...] = {_shape(expected)} (one row of gradient per entry of rows), "
              f"got {_shape(grad.shape)}")
    device = weight.device
    if not (exp_avg.device == device and exp_avg_sq.device == device and rows.device == device
            and grad.device == device):
        _fail(f"{op}: weight, exp_avg, exp_avg_sq, rows and grad must be on one device (weight is on "
              f"{_device(device)})")
    if not step >= 1:
        _fail(f"{op}: step must be >= 1 (the first update is step 1), got {step}")
    if not lr >= 0.0:
        _fail(f"{op}: lr must be >= 0, got {_real(lr)}")
    if not eps >= 0.0:
        _fail(f"{op}: eps must be >= 0, got {_real(eps)}")
    if not (beta1 >= 0.0 and beta1 < 1.0):
        _fail(f"{op}: beta1 must be in [0, 1), got {_real(beta1)}")
    if not (beta2 >= 0.0 and beta2 < 1.0):
        _fail(f"{op}: beta2 must be in [0, 1), got {_real(beta2)}")
    if not weight_decay >= 0.0:
        _fail(f"{op}: weight_decay must be >= 0, got {_real(weight_decay)}")


def _lazy_adam_disjoint(op: str, weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor,
                        grad: Tensor) -> None:
    """lazy_adam.h check_lazy_adam_disjoint."""
    named = [(weight, "weight"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq"), (grad, "grad"), (rows, "rows")]
    for i in range(3):
        for j in range(i + 1, 5):
            if _overlaps(named[i][0], named[j][0]):
                _fail(f"{op}: {named[i][1]} and {named[j][1]} share memory; each must be a tensor of its own (the "
                      "update writes weight and the moments in place while it reads rows and grad)")

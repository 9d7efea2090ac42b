"""Typed wrappers, fake (meta) kernels and autograd for ``torch.ops.sparsekit.*``.

Every op has a CPU and a CUDA kernel compiled into ``sparsekit._C`` (a few internal ones
are composites of others: ``sparsekit.tables_cuda`` on CUDA, ``_embedding_gather_float``
here); the fakes below let ``torch.compile`` trace them, with data-dependent output sizes
taken from ``torch.library.get_ctx().new_dynamic_size()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

from . import _C  # noqa: F401  (registers the kernels)
from ._checks import FLOAT_DTYPES, AllocationError, allocation, csr_offsets, dense_layout, float_dtype
from ._checks import hash_table_slots
from ._checks import index_dtype, integer_argument, same_device, shape_of, shown, tensor_arguments
from ._checks import type_name as _type_name

_ops = torch.ops.sparsekit


# ---- sparse-layout arguments ----
# The kernels take dense (strided) tensors. A sparse one passed the wrappers' dtype and
# shape checks and met the dispatcher's "Could not run 'sparsekit::...' with arguments
# from the 'SparseCPU' backend", naming no argument: a kernel for the sparse dispatch keys
# of every op names it instead (for torch.ops.sparsekit.* and every caller alike).
_SPARSE_KEYS = ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA")
# The same for quantized tensors (strided, so they pass the layout checks): the dispatcher's
# "Could not run 'sparsekit::...' with arguments from the 'QuantizedCPU' backend" named none.
_QUANTIZED_KEYS = ("QuantizedCPU", "QuantizedCUDA")


def _refusing_sparse(op: str, names: List[str]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for name, value in list(zip(names, args)) + list(kwargs.items()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, Tensor):
                    dense_layout(f"{op}: {name}", item)
        raise TypeError(f"{op}: the arguments must be dense (strided), unquantized tensors")
    return kernel


def _marking_writes(op_name: str, written: List[int]):
    """The autograd view/in-place kernel of an op that writes arguments in place: runs the
    kernel, then marks what it wrote as modified, as torch's own in-place ops do, so that a
    backward that saved one of them before raises ("modified by an inplace operation")
    instead of using the new values (the dispatcher does not do it for ops defined in C++;
    torch.library.custom_op registers the same). Only after a call that succeeded: a
    refused call changed nothing."""
    overload = getattr(_ops, op_name).default
    after = torch._C._after_ADInplaceOrView_keyset

    def kernel(keyset, *args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = overload.redispatch(keyset & after, *args, **kwargs)
        tensors = []
        for i in written:
            arg = args[i] if i < len(args) else None
            tensors.extend(arg if isinstance(arg, (list, tuple)) else [arg] if isinstance(arg, Tensor) else [])
        if tensors:
            torch.autograd.graph.increment_version(tensors)
        return result
    return kernel


_sparse_library = torch.library.Library("sparsekit", "IMPL")
# The kernels' ops (sparsekit._C defined them above); not the Python-defined traced ones.
for _name in sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("sparsekit::") and not n.startswith("sparsekit::_")):
    _schema = getattr(_ops, _name).default._schema
    for _key in _SPARSE_KEYS + _QUANTIZED_KEYS:
        _sparse_library.impl(_name, _refusing_sparse(_name, [a.name for a in _schema.arguments]), _key)
    _written = [i for i, a in enumerate(_schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if _written:
        _sparse_library.impl(_name, _marking_writes(_name, _written), "ADInplaceOrView", with_keyset=True)


def _following_deterministic_algorithms(kernel: Any) -> Callable[..., Any]:
    """The CUDA kernel of ``sparsekit::segment_sum`` called with ``deterministic=True``
    whenever ``torch.use_deterministic_algorithms(True)`` is in force. The wrapper
    :func:`segment_sum` does that already, but ``torch.ops.sparsekit.segment_sum(data, ids,
    n)`` (DESIGN.md: "with torch.use_deterministic_algorithms(True) every op ... is
    bit-reproducible") went straight to the atomics: the stable ABI offers the C++ kernel no
    way to read the global flag, so the dispatcher's CUDA entry reads it here."""
    def cuda_kernel(keyset, data, segment_ids, num_segments, deterministic=False):
        deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
        return kernel.call_boxed(keyset, data, segment_ids, num_segments, deterministic)
    return cuda_kernel


if torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::segment_sum", "CUDA"):
    import warnings as _warnings
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose
        _sparse_library.impl("segment_sum", _following_deterministic_algorithms(
            torch.library.get_kernel("sparsekit::segment_sum", "CUDA")), "CUDA", with_keyset=True)


# ---- argument types of the wrappers ----
# The dispatcher reads True as 1 for an int argument and accepts None or 0 for a bool one,
# so a mistyped flag or size would silently pick another behaviour; the wrappers check the
# Python types first (TypeError, as torch's own functions raise), the kernels the ranges.


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
    drops the tangent without a word: ``unpack_dual(out).tangent`` was None, and
    ``torch.func.jvp`` / ``jacfwd`` returned zeros, a silently wrong Jacobian. Outside a dual
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


# ---- unique ----


@torch.library.register_fake("sparsekit::unique")
def _unique_fake(keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    index_dtype("unique", "keys", keys, "tensor of keys")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (
        keys.new_empty(num_unique),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty(num_unique, dtype=torch.int64),
    )


@torch.library.register_fake("sparsekit::unique_tables")
def _unique_tables_fake(keys: Tensor, offsets: List[int], tables: List[int],
                        num_tables: int) -> Tuple[Tensor, Tensor, Tensor]:
    op = "unique_tables"
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"unique_tables: keys must be 1-D, got shape {shape_of(keys)}")
    # Per-table bookkeeping is allocated for every table (the kernel's bound).
    torch._check(0 <= num_tables <= 1 << 20,
                 lambda: f"unique_tables: num_tables must lie in [0, 2^20], got {num_tables}")
    torch._check(len(offsets) == len(tables) + 1,
                 lambda: f"unique_tables: offsets must hold one more entry than tables ({len(tables) + 1}), "
                         f"got {len(offsets)}")
    csr_offsets(op, offsets, keys.numel())
    for s, table in enumerate(tables):
        torch._check(0 <= table < num_tables,
                     lambda: f"unique_tables: tables[{s}] = {table} is not a table in [0, {num_tables})")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (keys.new_empty(num_unique), keys.new_empty(keys.shape, dtype=torch.int64),
            keys.new_empty(num_tables, dtype=torch.int64))


def unique(
    keys: Tensor, return_inverse: bool = True, return_counts: bool = False
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Distinct keys in order of first occurrence (hash-based; deterministic on every device).

    Args:
        keys: int64 or int32 tensor of any shape (read flattened). Every value is a valid
            key, including INT64_MIN, INT64_MAX, -1 and 0.
        return_inverse: also return ``inverse`` (int64, shape of ``keys``) with
            ``keys == unique_keys[inverse]``.
        return_counts: also return ``counts`` (int64 ``[U]``), occurrences of each unique key.

    Returns:
        ``unique_keys`` (``[U]``, dtype of ``keys``), then ``inverse`` and/or ``counts`` when
        asked, in that order (the ``torch.unique`` convention); a bare tensor when neither is.
    """
    tensor_arguments("unique", keys=keys)
    return_inverse = _flag("unique", "return_inverse", return_inverse)
    return_counts = _flag("unique", "return_counts", return_counts)
    unique_keys, inverse, counts = _ops.unique(keys)
    out = (unique_keys,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out


# ---- segment_sum / segment_mean ----


@torch.library.register_fake("sparsekit::segment_sum")
def _segment_sum_fake(data: Tensor, segment_ids: Tensor, num_segments, deterministic: bool = False) -> Tensor:
    same_device("segment_sum", data=data, segment_ids=segment_ids)
    torch._check(data.dim() >= 1, lambda: "segment_sum: data must have at least one dimension [N, ...], got a scalar")
    float_dtype("segment_sum", "data", data)
    index_dtype("segment_sum", "segment_ids", segment_ids)
    torch._check(segment_ids.dim() == 1, lambda: "segment_sum: segment_ids must be 1-D")
    torch._check(segment_ids.shape[0] == data.shape[0], lambda: "segment_sum: segment_ids and data lengths differ")
    torch._check(num_segments >= 0, lambda: f"segment_sum: num_segments must be >= 0, got {num_segments}")
    return data.new_empty((num_segments,) + tuple(data.shape[1:]))


def _segment_sum_setup_context(ctx, inputs, output) -> None:
    _, segment_ids, _, _ = inputs
    ctx.save_for_backward(segment_ids)


def _segment_rows_gradient(grad: Tensor, segment_ids: Tensor) -> Tensor:
    """The gradient of a segment sum's data rows from its output's: ``grad[segment_ids[i]]``
    for row ``i``, zeros for dropped rows (negative ids). Differentiable torch ops."""
    if grad.shape[0] == 0:
        # No segments: every row was dropped (all ids negative), so its gradient is zero.
        return grad.new_zeros((segment_ids.shape[0],) + tuple(grad.shape[1:]))
    # d out[s] / d data[i] is 1 exactly when segment_ids[i] == s; dropped rows get zeros.
    valid = segment_ids >= 0
    picked = grad.index_select(0, torch.where(valid, segment_ids, 0))
    mask = valid.view((-1,) + (1,) * (grad.dim() - 1))
    return torch.where(mask, picked, torch.zeros((), dtype=grad.dtype, device=grad.device))


def _segment_sum_backward(ctx, grad: Tensor):
    (segment_ids,) = ctx.saved_tensors
    return _segment_rows_gradient(grad, segment_ids), None, None, None


torch.library.register_autograd(
    "sparsekit::segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup_context
)


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False, *,
                reduce: str = "sum") -> Tensor:
    """TensorFlow ``unsorted_segment_sum``: ``out[s] = sum(data[i] for i with segment_ids[i] == s)``.

    Args:
        data: ``[N, ...]`` float32, float64, float16 or bfloat16 (half types accumulate in float32).
        segment_ids: ``[N]`` int64 or int32. Negative ids are dropped (padding); an id
            ``>= num_segments`` raises.
        num_segments: number of output rows.
        deterministic: bit-identical results run to run. The CPU kernel always is; on CUDA
            this switches from atomics to a sort-based reduction. Also on whenever
            ``torch.use_deterministic_algorithms(True)`` is in force, as for torch's own
            ``index_add_``.
        reduce: ``"sum"``, or ``"mean"`` for :func:`segment_mean` (keyword only; also
            :func:`segment_reduce`).

    Returns:
        ``[num_segments, ...]`` of ``data``'s dtype, zeros for empty segments.
        Differentiable in ``data``, any number of times (the backward is a gather made of
        differentiable torch ops).

    Raises:
        TypeError: ``num_segments`` not an int (a bool is not one), ``deterministic`` not a
            bool, ``reduce`` not a str.
        ValueError: ``reduce`` neither ``"sum"`` nor ``"mean"``.
    """
    if reduce != "sum":
        reduce = _choice("segment_sum", "reduce", reduce)
        if reduce != "mean":
            raise ValueError(f"segment_sum: reduce must be 'sum' or 'mean', got {reduce!r}")
        return segment_mean(data, segment_ids, num_segments, deterministic)
    tensor_arguments("segment_sum", data=data, segment_ids=segment_ids)
    _refuse_forward_ad("segment_sum", data=data)
    num_segments = _integer("segment_sum", "num_segments", num_segments)
    deterministic = _flag("segment_sum", "deterministic", deterministic)
    with allocation(lambda: f"segment_sum: num_segments={num_segments} (the output)",
                    (num_segments,) + tuple(data.shape[1:]), data.dtype, data.device, accumulator=True):
        return _ops.segment_sum(data, segment_ids, num_segments, _deterministic(deterministic))


def _deterministic(requested: bool) -> bool:
    """The deterministic path when asked for or when torch's global flag demands it."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


def _segment_counts(segment_ids: Tensor, num_segments: int) -> Tensor:
    """int64 ``[num_segments]``: rows per segment, negative ids dropped. Integer atomics
    are exact, so this is deterministic on every device and exact past 2^24 rows."""
    ids = segment_ids.long()
    # Dropped rows count in a spare last bucket, so no data-dependent mask (no host sync).
    bucket = torch.where(ids >= 0, ids, num_segments)
    with allocation(lambda: f"segment_mean: num_segments={num_segments} (the counts)", (num_segments + 1,), torch.int64,
                    ids.device):
        counts = torch.zeros(num_segments + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, bucket, torch.ones_like(bucket))[:num_segments]


def segment_mean(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """Like :func:`segment_sum`, divided by the number of rows in each segment (empty -> 0).
    float16 / bfloat16 rows are summed and divided in float32 and rounded once (through a
    float32 copy of ``data``: twice its bytes more memory).

    Args and returns as :func:`segment_sum`. Differentiable in ``data``.
    """
    tensor_arguments("segment_mean", data=data, segment_ids=segment_ids)
    _refuse_forward_ad("segment_mean", data=data)
    num_segments = _integer("segment_mean", "num_segments", num_segments)
    deterministic = _flag("segment_mean", "deterministic", deterministic)
    # float16 / bfloat16 rows are summed in float32 and divided before the one rounding
    # (as embedding_bag's mean): a sum rounded to the half type first would overflow to inf
    # where the mean is representable (two rows of 60000 in float16), and round twice.
    if data.dtype in (torch.float16, torch.bfloat16):
        # Named like the op's other allocations: torch's own message names neither the op
        # nor the argument.
        with allocation(lambda: "segment_mean: a float32 copy of data (float16 / bfloat16 rows are summed in float32)",
                        tuple(data.shape), torch.float32, data.device):
            summed = data.float()
    else:
        summed = data
    try:
        totals = segment_sum(summed, segment_ids, num_segments, deterministic)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        # The sum's checks are the mean's: its errors name segment_mean, the op called.
        message = str(error)
        if type(error) not in (RuntimeError, ValueError, TypeError, IndexError, AllocationError) or \
                not message.startswith("segment_sum:"):
            raise
        raise type(error)("segment_mean:" + message[len("segment_sum:"):]) from None
    # Exact integer counts (a float count stops growing at 2^24 rows in float32), divided in
    # float32 at least.
    # No column: nothing to divide, and no [num_segments] counts (2**62 segments of nothing
    # are a valid output). Tested on the row shape alone: num_segments may be traced from
    # the data, where a test of it would be a graph break.
    if math.prod(data.shape[1:]) == 0:
        return totals.to(data.dtype)  # a half type's was summed in float32
    count_dtype = torch.promote_types(data.dtype, torch.float32)
    counts = _segment_counts(segment_ids, num_segments).clamp_(min=1).to(count_dtype)
    return (totals.to(count_dtype) / counts.view((-1,) + (1,) * (data.dim() - 1))).to(data.dtype)


def segment_reduce(
    data: Tensor, segment_ids: Tensor, num_segments: int, reduce: str = "sum", deterministic: bool = False
) -> Tensor:
    """:func:`segment_sum` (``reduce="sum"``) or :func:`segment_mean` (``reduce="mean"``)."""
    reduce = _choice("segment_reduce", "reduce", reduce)
    num_segments = _integer("segment_reduce", "num_segments", num_segments)
    deterministic = _flag("segment_reduce", "deterministic", deterministic)
    if reduce == "sum":
        return segment_sum(data, segment_ids, num_segments, deterministic)
    if reduce == "mean":
        return segment_mean(data, segment_ids, num_segments, deterministic)
    raise ValueError(f"segment_reduce: reduce must be 'sum' or 'mean', got {reduce!r}")


# ---- hashtable / lazy_adam ----


@torch.library.register_fake("sparsekit::hash_table_find")
def _hash_table_find_fake(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    same_device("hash_table_find", slot_keys=slot_keys, slot_rows=slot_rows, keys=keys)
    hash_table_slots("hash_table_find", slot_keys, slot_rows)
    index_dtype("hash_table_find", "keys", keys, "tensor of keys")
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.register_fake("sparsekit::hash_table_insert_absent_")
def _hash_table_insert_absent_fake(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor, rows: Tensor,
                                   num_occupied: Optional[int] = None) -> None:
    op = "hash_table_insert_absent_"
    same_device(op, slot_keys=slot_keys, slot_rows=slot_rows, keys=keys, rows=rows)
    hash_table_slots(op, slot_keys, slot_rows)
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(rows.dtype == torch.int64, lambda: f"{op}: rows must be int64, got {rows.dtype}")
    num_keys, num_slots = keys.numel(), slot_keys.shape[0]
    torch._check(rows.numel() == num_keys,
                 lambda: f"{op}: rows has {shown(rows.numel())} entries but keys has {shown(num_keys)}; give one "
                         "row per key")
    torch._check(num_keys <= num_slots,
                 lambda: f"{op}: {shown(num_keys)} keys cannot fit in a table of {shown(num_slots)} slots")
    if num_occupied is not None:
        # The kernel checks the count only when there are keys to place ("|": no guard on a
        # traced key count).
        torch._check((num_keys == 0) | ((0 <= num_occupied) & (num_occupied <= num_slots)),
                     lambda: f"{op}: num_occupied must lie in [0, {shown(num_slots)}], got {num_occupied}")
        torch._check((num_keys == 0) | (num_occupied + num_keys <= num_slots),
                     lambda: f"{op}: {shown(num_keys)} keys do not fit in the {shown(num_slots - num_occupied)} empty "
                             f"slots of the table ({num_occupied} of {shown(num_slots)} occupied); nothing was "
                             "inserted")
    return None


@torch.library.register_fake("sparsekit::hash_table_find_tables")
def _hash_table_find_tables_fake(slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor,
                                 offsets: List[int]) -> Tensor:
    op = "hash_table_find_tables"
    same_device(op, keys=keys, slot_keys=slot_keys, slot_rows=slot_rows)
    torch._check(len(slot_keys) == len(slot_rows) and len(offsets) == len(slot_keys) + 1,
                 lambda: f"{op}: one slot_keys, slot_rows and offsets entry per table (and one more offset)")
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"{op}: keys must be 1-D, got shape {shape_of(keys)}")
    for t, (table_keys, table_rows) in enumerate(zip(slot_keys, slot_rows)):
        hash_table_slots(f"{op}: table {t}", table_keys, table_rows)
    csr_offsets(op, offsets, keys.numel())
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.register_fake("sparsekit::hash_table_score_tables_")
def _hash_table_score_tables_fake(last_seen: List[Tensor], count: List[Tensor], rows: Tensor, offsets: List[int],
                                  clocks: List[int]) -> None:
    op = "hash_table_score_tables_"
    same_device(op, rows=rows, last_seen=last_seen, count=count)
    torch._check(len(last_seen) == len(count) == len(clocks) and len(offsets) == len(count) + 1,
                 lambda: f"{op}: one last_seen, count, clock and offsets entry per table (and one more offset)")
    torch._check(rows.dtype == torch.int64 and rows.dim() == 1,
                 lambda: f"{op}: rows must be 1-D int64, got {rows.dtype} with shape {shape_of(rows)}")
    for t, (seen, counts) in enumerate(zip(last_seen, count)):
        torch._check(seen.dtype == torch.int64 and counts.dtype == torch.int64 and seen.dim() == 1
                     and counts.dim() == 1 and seen.is_contiguous() and counts.is_contiguous(),
                     lambda: f"{op}: last_seen[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length")
        torch._check(seen.shape[0] == counts.shape[0],
                     lambda: f"{op}: last_seen[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length")
    csr_offsets(op, offsets, rows.numel())
    return None


@torch.library.register_fake("sparsekit::lookup_rows")
def _lookup_rows_fake(slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor, offsets: List[int],
                      segment_tables: List[int], direct_rows: List[int]) -> Tuple[Tensor, Tensor]:
    op = "lookup_rows"
    same_device(op, keys=keys, slot_keys=slot_keys, slot_rows=slot_rows)
    torch._check(len(slot_keys) == len(slot_rows), lambda: f"{op}: one slot_keys and slot_rows entry per table")
    torch._check(len(segment_tables) == len(direct_rows) and len(offsets) == len(segment_tables) + 1,
                 lambda: f"{op}: one segment_tables and direct_rows entry per segment (and one more offset)")
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"{op}: keys must be 1-D, got shape {shape_of(keys)}")
    for t, (table_keys, table_rows) in enumerate(zip(slot_keys, slot_rows)):
        hash_table_slots(f"{op}: table {t}", table_keys, table_rows)
    csr_offsets(op, offsets, keys.numel())
    return keys.new_empty(keys.shape, dtype=torch.int64), keys.new_empty(2, dtype=torch.int64)


@torch.library.register_fake("sparsekit::hash_table_touch_tables_")
def _hash_table_touch_tables_fake(last_seen: List[Tensor], count: List[Tensor], rows: Tensor, offsets: List[int],
                                  segment_tables: List[int], sizes: List[int], clocks: List[int]) -> None:
    op = "hash_table_touch_tables_"
    same_device(op, rows=rows, last_seen=last_seen, count=count)
    torch._check(len(last_seen) == len(count) == len(clocks) == len(sizes),
                 lambda: f"{op}: one last_seen, count, size and clock entry per table")
    torch._check(len(offsets) == len(segment_tables) + 1,
                 lambda: f"{op}: one segment_tables entry per segment (and one more offset)")
    torch._check(rows.dtype == torch.int64 and rows.dim() == 1,
                 lambda: f"{op}: rows must be 1-D int64, got {rows.dtype} with shape {shape_of(rows)}")
    csr_offsets(op, offsets, rows.numel())
    return None


@torch.library.register_fake("sparsekit::hash_table_place_tables_")
def _hash_table_place_tables_fake(slot_keys: List[Tensor], slot_rows: List[Tensor], row_keys: List[Tensor],
                                  count: List[Tensor], keys: Tensor, offsets: List[int], sizes: List[int]) -> None:
    op = "hash_table_place_tables_"
    same_device(op, keys=keys, slot_keys=slot_keys, slot_rows=slot_rows, row_keys=row_keys, count=count)
    torch._check(len(slot_keys) == len(slot_rows) == len(row_keys) == len(count) == len(sizes)
                 and len(offsets) == len(sizes) + 1,
                 lambda: f"{op}: one slot_keys, slot_rows, row_keys, count, sizes and offsets entry per table (and "
                         "one more offset)")
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"{op}: keys must be 1-D, got shape {shape_of(keys)}")
    csr_offsets(op, offsets, keys.numel())
    for t in range(len(sizes)):
        hash_table_slots(f"{op}: table {t}", slot_keys[t], slot_rows[t])
        rk, counts = row_keys[t], count[t]
        torch._check(rk.dtype == torch.int64 and counts.dtype == torch.int64 and rk.dim() == 1 and counts.dim() == 1
                     and rk.is_contiguous() and counts.is_contiguous(),
                     lambda: f"{op}: row_keys[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length")
        torch._check(rk.shape[0] == counts.shape[0],
                     lambda: f"{op}: row_keys[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length")
        num_new, capacity, num_slots = offsets[t + 1] - offsets[t], rk.shape[0], slot_keys[t].shape[0]
        torch._check(0 <= sizes[t] <= capacity - num_new,
                     lambda: f"{op}: table {t} holds {sizes[t]} of its {shown(capacity)} rows, so its {num_new} new "
                             "keys do not fit; nothing was inserted")
        torch._check(sizes[t] + num_new <= num_slots,
                     lambda: f"{op}: {num_new} keys do not fit in the {shown(num_slots - sizes[t])} empty slots of "
                             f"table {t} ({sizes[t]} of {shown(num_slots)} occupied); nothing was inserted")
    return None


def hash_table_find(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    """Rows of ``keys`` in an open-addressing table (see :class:`sparsekit.HashTable`).

    Args:
        slot_keys: int64 ``[S]``, ``S`` a power of two: the key held by each slot.
        slot_rows: int64 ``[S]``: the row held by each slot, ``-1`` where the slot is empty.
        keys: int64 or int32 keys of any shape, on the table's device. int32 keys are
            compared as int64.

    Returns:
        int64 rows with the shape of ``keys``, ``-1`` where a key is absent.
    """
    tensor_arguments("hash_table_find", slot_keys=slot_keys, slot_rows=slot_rows, keys=keys)
    return _ops.hash_table_find(slot_keys, slot_rows, keys)


def hash_table_insert_absent_(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor, rows: Tensor,
                              num_occupied: Optional[int] = None) -> None:
    """Places keys that are distinct and absent from the table, in place.

    The caller guarantees distinctness and absence (not checked) and should keep the table
    at most half full (at most ``S / 2`` keys), which keeps probing short. A call whose
    keys do not all fit in the empty slots, or with a negative row, raises and writes
    nothing, on every device alike.

    Host syncs on CUDA: without ``num_occupied``, two (counting the occupied slots, and
    reading the row check); with it, none, and the caller also vouches for ``rows >= 0``
    (a negative row then makes the call write nothing without raising; the CPU still
    raises) and for the count itself: the fit is checked against ``num_occupied``, so a
    count below the real one can let a call that does not fit run out of empty slots: the
    CPU then puts back every slot it claimed and raises "no empty slot left" (the table as it
    was), CUDA keeps the keys that found a slot and drops the others without raising (it
    reads no flag back). :class:`sparsekit.HashTable`
    passes its size and rows it made itself.

    Args:
        slot_keys: int64 ``[S]``, written in place.
        slot_rows: int64 ``[S]``, written in place (``-1`` marks an empty slot).
        keys: int64 or int32 ``[n]`` keys, distinct and absent.
        rows: int64 ``[n]`` rows ``>= 0``; the slot of ``keys[i]`` gets ``rows[i]``.
        num_occupied: the number of occupied slots, when the caller knows it; None: counted.
    """
    tensor_arguments("hash_table_insert_absent_", slot_keys=slot_keys, slot_rows=slot_rows, keys=keys, rows=rows)
    num_occupied = _integer("hash_table_insert_absent_", "num_occupied", num_occupied, optional=True)
    _check_not_inference("hash_table_insert_absent_", (("slot_keys", slot_keys), ("slot_rows", slot_rows)))
    _ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, rows, num_occupied)


@torch.library.register_fake("sparsekit::hash_table_erase_")
def _hash_table_erase_fake(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    same_device("hash_table_erase_", slot_keys=slot_keys, slot_rows=slot_rows, keys=keys)
    hash_table_slots("hash_table_erase_", slot_keys, slot_rows)
    index_dtype("hash_table_erase_", "keys", keys, "tensor of keys")
    return keys.new_empty(keys.shape, dtype=torch.int64)


def hash_table_erase_(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    """Erases keys from an open-addressing table, in place: their slots become tombstones.

    A tombstone (``slot_rows[s] == -2``) does not end a probe sequence, so the keys placed
    after an erased one stay reachable, and :func:`hash_table_insert_absent_` reuses it.
    Tombstones lengthen probes until the table is rebuilt (:class:`sparsekit.HashTable`
    rebuilds once they reach a quarter of the slots). No host sync on CUDA.

    Args:
        slot_keys: int64 ``[S]``.
        slot_rows: int64 ``[S]``, written in place.
        keys: int64 or int32 keys, distinct; absent keys are skipped.

    Returns:
        int64 rows the keys held (shape of ``keys``), ``-1`` for an absent key.
    """
    tensor_arguments("hash_table_erase_", slot_keys=slot_keys, slot_rows=slot_rows, keys=keys)
    _check_not_inference("hash_table_erase_", (("slot_rows", slot_rows),))
    return _ops.hash_table_erase_(slot_keys, slot_rows, keys)


@torch.library.register_fake("sparsekit::select_smallest")
def _select_smallest_fake(columns: List[Tensor], eligible: Tensor, k: int) -> Tensor:
    op = "select_smallest"
    same_device(op, eligible=eligible, columns=columns)
    torch._check(1 <= len(columns) <= 4, lambda: f"{op}: columns must hold 1 to 4 tensors, got {len(columns)}")
    torch._check(eligible.dtype == torch.bool and eligible.dim() == 1,
                 lambda: f"{op}: eligible must be a 1-D bool tensor, got {eligible.dtype} with shape "
                         f"{shape_of(eligible)}")
    n = eligible.shape[0]
    for c, column in enumerate(columns):
        torch._check(column.dtype == torch.int64 and column.dim() == 1,
                     lambda: f"{op}: columns[{c}] must be int64 [{shown(n)}] like eligible, got {column.dtype} with "
                             f"shape {shape_of(column)}")
        torch._check(column.shape[0] == n,
                     lambda: f"{op}: columns[{c}] must be int64 [{shown(n)}] like eligible, got {column.dtype} with "
                             f"shape {shape_of(column)}")
    torch._check(k >= 0, lambda: f"{op}: k must be >= 0, got {k}")
    # How many entries are eligible is data; that there are at least k entries is not.
    torch._check(k <= n, lambda: f"{op}: k={k} but there are only {shown(n)} entries, so at most {shown(n)} are "
                                         "eligible")
    return eligible.new_empty((k,), dtype=torch.int64)


def select_smallest(columns: Sequence[Tensor], eligible: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` lexicographically smallest eligible entries (eviction's victims).

    A radix select (no sort of the entries): a few passes over them, each narrowing the
    bucket that holds the ``k``-th entry, then one compaction. Deterministic on every
    device and thread count.

    Args:
        columns: 1 to 4 int64 ``[n]`` tensors compared in order: entry ``i`` is the tuple
            ``(columns[0][i], columns[1][i], ...)``; ties of whole tuples go to the
            smaller index.
        eligible: bool ``[n]``; only these entries may be chosen.
        k: how many to choose, ``0 <= k <=`` the number of eligible entries.

    Returns:
        int64 ``[k]``: the chosen indices in ascending order.

    Example::

        last_seen = torch.tensor([5, 1, 3, 1])
        keys = torch.tensor([10, 20, 30, 5])
        select_smallest([last_seen, keys], torch.ones(4, dtype=torch.bool), 2)  # tensor([1, 3])
    """
    if isinstance(columns, Tensor) or not isinstance(columns, Iterable):
        raise TypeError(f"select_smallest: columns must be a list of tensors, got {_type_name(columns)}")
    columns = list(columns)
    tensor_arguments("select_smallest", eligible=eligible, **{f"columns[{i}]": c for i, c in enumerate(columns)})
    return _ops.select_smallest(columns, eligible, _integer("select_smallest", "k", k))


def _segment_sum_parts_setup_context(ctx, inputs, output) -> None:
    data, segment_ids, _ = inputs
    ctx.save_for_backward(segment_ids)
    ctx.rows = [part.shape[0] for part in data]


def _segment_sum_parts_backward(ctx, grad: Tensor):
    """As segment_sum's, cut into the parts' rows."""
    (segment_ids,) = ctx.saved_tensors
    return list(_segment_rows_gradient(grad, segment_ids).split(ctx.rows)), None, None


torch.library.register_autograd("sparsekit::segment_sum_parts", _segment_sum_parts_backward,
                                setup_context=_segment_sum_parts_setup_context)


@torch.library.register_fake("sparsekit::segment_sum_parts")
def _segment_sum_parts_fake(data: List[Tensor], segment_ids: Tensor, num_segments: int) -> Tensor:
    op = "segment_sum_parts"
    torch._check(len(data) > 0, lambda: f"{op}: data must hold at least one tensor")
    same_device(op, data=data, segment_ids=segment_ids)
    first = data[0]
    torch._check(first.dim() >= 1, lambda: f"{op}: data[0] must have at least one dimension [rows, ...], got a scalar")
    for p, part in enumerate(data):
        torch._check(part.dim() == first.dim() and part.dtype == first.dtype
                     and tuple(part.shape[1:]) == tuple(first.shape[1:]),
                     lambda: f"{op}: data[{p}] ({part.dtype} {shape_of(part)}) must have the dtype and row shape of "
                             f"data[0] ({first.dtype} {shape_of(first)})")
    rows = sum(part.shape[0] for part in data)
    index_dtype(op, "segment_ids", segment_ids)
    torch._check(segment_ids.dim() == 1 and segment_ids.shape[0] == rows,
                 lambda: f"{op}: segment_ids must be 1-D with one entry per row of data ({shown(rows)}), got shape "
                         f"{shape_of(segment_ids)}")
    torch._check(num_segments >= 0, lambda: f"{op}: num_segments must be >= 0, got {num_segments}")
    float_dtype(op, "data", first)
    return first.new_empty((num_segments, *first.shape[1:]))


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


# ---- routing ----


def partition_by_owner(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Bucket keys by the rank that owns them: a stable counting sort by ``uint64(key) % world_size``.

    This is the routing step of the model-parallel layers: ``keys_by_owner`` is ready for
    ``all_to_all_single`` with ``counts`` as the send split sizes, and ``positions``
    brings the answers back into input order.

    Args:
        keys: int64 or int32 ``[N]``; every value is a valid key (negative ones own by
            their unsigned value, so ``-1 % 2 == 1``).
        world_size: number of ranks, in ``[1, 2^24]``.

    Returns:
        ``(keys_by_owner, positions, counts)``: ``keys_by_owner`` (keys' dtype, ``[N]``)
        holds rank 0's keys, then rank 1's, ..., each rank's in input order;
        ``positions`` (int64 ``[N]``) with ``keys_by_owner[positions[i]] == keys[i]``;
        ``counts`` (int64 ``[world_size]``) keys per owner. No host synchronisation.
    """
    tensor_arguments("partition_by_owner", keys=keys)
    return _ops.partition_by_owner(keys, _integer("partition_by_owner", "world_size", world_size))


@torch.library.register_fake("sparsekit::partition_by_owner")
def _partition_by_owner_fake(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    index_dtype("partition_by_owner", "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: "partition_by_owner: keys must be 1-D [N]")
    torch._check(1 <= world_size <= 2**24,
                 lambda: f"partition_by_owner: world_size must be in [1, 2^24], got {world_size}")
    return (
        keys.new_empty(keys.shape),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty((world_size,), dtype=torch.int64),
    )


# ---- initializer ----


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


# ---- embedding ----


def _check_embedding_bag_shapes(weight: Tensor, rows: Tensor, offsets: Tensor, padding_idx: Optional[int],
                                include_last_offset: bool):
    """The checks of the fakes; returns the number of bags."""
    same_device("embedding_bag", weight=weight, rows=rows, offsets=offsets)
    float_dtype("embedding_bag", "weight", weight)
    index_dtype("embedding_bag", "rows", rows)
    index_dtype("embedding_bag", "offsets", offsets)
    torch._check(weight.dim() == 2, lambda: f"embedding_bag: weight must be 2-D, got {weight.dim()}-D")
    torch._check(rows.dim() == 1, lambda: f"embedding_bag: rows must be 1-D, got {rows.dim()}-D")
    torch._check(offsets.dim() == 1, lambda: f"embedding_bag: offsets must be 1-D, got {offsets.dim()}-D")
    if padding_idx is not None:
        num_rows = weight.shape[0]
        torch._check(-num_rows <= padding_idx < num_rows,
                     lambda: f"embedding_bag: padding_idx must lie in [-num_rows, num_rows) = [{-num_rows}, "
                             f"{num_rows}), got {padding_idx}; pass None for no padding row")
    if include_last_offset:
        torch._check(offsets.shape[0] >= 1, lambda: "embedding_bag: offsets must hold bags + 1 >= 1 entries")
        return offsets.shape[0] - 1
    return offsets.shape[0]


@torch.library.register_fake("sparsekit::embedding_bag")
def _embedding_bag_fake(
    weight: Tensor, rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor] = None, mode: str = "sum",
    padding_idx: Optional[int] = None, include_last_offset: bool = True,
) -> Tensor:
    bags = _check_embedding_bag_shapes(weight, rows, offsets, padding_idx, include_last_offset)
    torch._check(mode in ("sum", "mean", "max"),
                 lambda: f'embedding_bag: mode must be "sum", "mean" or "max", got "{mode}"')
    torch._check(per_sample_weights is None or mode != "max",
                 lambda: "embedding_bag: per_sample_weights is only supported for mode='sum' or 'mean'")
    if per_sample_weights is not None:
        same_device("embedding_bag", weight=weight, per_sample_weights=per_sample_weights)
        torch._check(per_sample_weights.dtype == weight.dtype,
                     lambda: "embedding_bag: per_sample_weights must have weight's dtype")
        torch._check(per_sample_weights.dim() == 1 and per_sample_weights.shape[0] == rows.shape[0],
                     lambda: "embedding_bag: per_sample_weights must be 1-D [nnz]")
    return weight.new_empty((bags, weight.shape[1]))


@torch.library.register_fake("sparsekit::embedding_bag_argmax")
def _embedding_bag_argmax_fake(
    weight: Tensor, rows: Tensor, offsets: Tensor, padding_idx: Optional[int] = None, include_last_offset: bool = True
) -> Tensor:
    bags = _check_embedding_bag_shapes(weight, rows, offsets, padding_idx, include_last_offset)
    return weight.new_empty((bags, weight.shape[1]), dtype=torch.int64)


@torch.library.register_fake("sparsekit::embedding_gather")
def _embedding_gather_fake(weight: Tensor, rows: Tensor) -> Tensor:
    same_device("embedding_gather", weight=weight, rows=rows)
    float_dtype("embedding_gather", "weight", weight)
    index_dtype("embedding_gather", "rows", rows)
    torch._check(weight.dim() == 2, lambda: f"embedding_gather: weight must be 2-D, got {weight.dim()}-D")
    return weight.new_empty(tuple(rows.shape) + (weight.shape[1],))


# Bits of bitmap per lookup up to which the CPU numbers the distinct rows with
# unique_bounded (a bitmap of the table's rows) rather than the hash-based unique: zeroing
# and scanning a word of the bitmap costs less than hashing one key.
_BOUNDED_UNIQUE_BITS_PER_KEY = 128


def _bitmap_numbers(bound: int, n: int) -> bool:
    """Whether the CPU numbers ``n`` rows in ``[0, bound)`` with ``unique_bounded``'s bitmap
    rather than hashing them (see ``_BOUNDED_UNIQUE_BITS_PER_KEY``)."""
    return bound <= _BOUNDED_UNIQUE_BITS_PER_KEY * n + (1 << 16)


@torch.library.register_fake("sparsekit::unique_bounded")
def _unique_bounded_fake(keys: Tensor, bound, group: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    index_dtype("unique_bounded", "keys", keys, "tensor of keys")
    # The bitmaps take bound / 8 bytes per worker (the kernel's bound). Two checks: a traced
    # bound gets no guard on a compound condition.
    torch._check(bound >= 0, lambda: f"unique_bounded: bound must lie in [0, 2^40), got {bound}")
    torch._check(bound < 1 << 40, lambda: f"unique_bounded: bound must lie in [0, 2^40), got {bound}")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (keys.new_empty(num_unique), keys.new_empty(keys.shape, dtype=torch.int64),
            keys.new_empty(num_unique + 1 if group else 0, dtype=torch.int64),
            keys.new_empty(keys.numel() if group else 0, dtype=torch.int64))


# torch from 2.13 compiles a lookup's traced backward with data-dependent sizes in the
# default mode. Before, inductor cannot lower its slices of such a size, and max mode's
# backward guards on one: failures dynamo does not fall back on, where torch's own refusal
# of the sizes (DynamicOutputShapeException) makes it run the frame eagerly. So torch
# before 2.13 keeps that refusal.
_SIZES_IN_DEFAULT_MODE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _traced_fake_mode(tensor: Tensor) -> Any:
    """The fake mode tracing ``tensor`` where :func:`_allow_dynamic_sizes` applies (torch
    from 2.13, compiling), else None: an eager backward pays no search for one (torch from
    2.13 says it is compiling while AOT autograd traces a compiled backward)."""
    if not _SIZES_IN_DEFAULT_MODE or not torch.compiler.is_compiling():
        return None
    return torch._guards.detect_fake_mode(tensor)


def _allow_dynamic_sizes(tensor: Tensor) -> None:
    """Lets the ops' fakes make data-dependent sizes for the rest of the compilation whose
    fake mode traces ``tensor`` (a lookup's backward). ``torch.compile`` allows them only
    under ``fullgraph=True`` or ``capture_dynamic_output_shape_ops``: in its default mode
    AOT autograd's trace of the backward (where a graph cannot break) failed on the distinct
    rows' count, and dynamo ran the whole frame eagerly, the dense layers too, saying
    nothing. The backward's graph is then the one ``fullgraph=True`` compiles. For the rest
    of the compilation: inductor compiles the backward at the first ``backward()`` and runs
    the fakes again then. (torch keeps the permission in the shape environment's settings;
    were they to move, the default mode runs eagerly as before.)"""
    mode = torch._guards.detect_fake_mode(tensor)
    env = getattr(mode, "shape_env", None)
    settings = getattr(env, "settings", None)
    if settings is None or getattr(settings, "allow_dynamic_output_shape_ops", True):
        return
    try:
        env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True)
    except (TypeError, AttributeError):  # another torch's layout: as without this
        pass


# Whether the lookup backward being traced may make data-dependent sizes: not when its
# weight gets a gradient from another lookup of the same trace (see _first_lookup_of).
_SIZES_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("sparsekit_sizes_allowed", default=True)


@contextlib.contextmanager
def _first_lookup_of(weight_id: int, rows: Tensor):
    """Around a lookup's backward: traced, whether its weight (``id`` of the forward's
    weight) already had a lookup's backward traced in this trace. A weight with two sparse
    gradients cannot be compiled (README, known limit: AOT autograd's fake dispatch fails
    adding them); its second backward raises torch's refusal of data-dependent sizes, so
    that outside ``fullgraph=True`` dynamo runs the frame eagerly, as it did before
    :func:`_allow_dynamic_sizes`, instead of failing inside torch."""
    env = getattr(_traced_fake_mode(rows), "shape_env", None)
    if env is None:
        yield
        return
    seen = env.__dict__.setdefault("_sparsekit_lookup_weights", set())
    token = _SIZES_ALLOWED.set(weight_id not in seen)
    seen.add(weight_id)
    try:
        yield
    finally:
        _SIZES_ALLOWED.reset(token)


def _number_rows(rows: Tensor, num_rows: int, group: bool) -> Tuple[Tensor, Tensor, Optional[Tensor],
                                                                     Optional[Tensor], int, bool]:
    """:func:`_number_rows_of` (traced, from torch 2.13: with data-dependent sizes allowed,
    see :func:`_allow_dynamic_sizes`, unless :func:`_first_lookup_of` says no)."""
    if _traced_fake_mode(rows) is not None:
        if not _SIZES_ALLOWED.get():
            # The refusal dynamo falls back on (the permission may already stand for this
            # compilation, given to the weight's first lookup).
            raise torch._subclasses.fake_tensor.DynamicOutputShapeException(torch.ops.sparsekit.unique_bounded.default)
        _allow_dynamic_sizes(rows)
    return _number_rows_of(rows, num_rows, group)


def _number_rows_of(rows: Tensor, num_rows: int, group: bool) -> Tuple[Tensor, Tensor, Optional[Tensor],
                                                                       Optional[Tensor], int, bool]:
    """The distinct rows of ``rows`` (values in ``[-1, num_rows)``) for a sparse gradient:
    ``(keys, inverse, offsets, order, skip, coalesced)``, ``rows == keys[inverse]``;
    ``keys[:skip]`` is the missing row -1 (``skip`` 0 or 1). With ``group``, the lookups
    grouped by row: ``order[offsets[u]:offsets[u + 1]]`` (ascending) read row ``keys[u]``;
    else ``offsets`` and ``order`` are None.

    On the CPU ``keys`` ascend (``coalesced``). ``unique_bounded`` numbers them with a
    bitmap of the table's rows and groups the lookups with a counting sort (327k lookups of
    a 1M-row table: 4x faster than hashing them and sorting); for a table far larger than
    its lookups ``unique`` numbers them and a sort of the distinct rows puts them in order.
    On CUDA ``unique`` numbers them in order of first occurrence. Except on the eager
    bitmap path, a leading -1 marker makes the -1 lookups group 0 whatever the batch holds
    (``skip`` is 1), sliced off with it without a data-dependent mask or a host read of the
    data (no extra host sync on CUDA, no graph break); off the bitmap path a stable sort
    groups them."""
    nnz = rows.shape[0]
    # Traced (fake tensors): torch before 2.13 says is_compiling() False while AOT autograd
    # traces a compiled graph's backward, so the fake mode is looked for too.
    eager = not torch.compiler.is_compiling() and torch._guards.detect_fake_mode(rows) is None
    bitmap = (rows.device.type == "cpu" and isinstance(nnz, int) and isinstance(num_rows, int)
              and _bitmap_numbers(num_rows, nnz))
    if bitmap and eager:
        keys, inverse, offsets, order = torch.ops.sparsekit.unique_bounded(rows, num_rows, group)
        skip = int(keys.numel() > 0 and bool(keys[0] < 0))
        return (keys, inverse, offsets, order, skip, True) if group else (keys, inverse, None, None, skip, True)
    marker = torch.full((1,), -1, dtype=rows.dtype, device=rows.device)
    if bitmap:
        # The marker is position 0: first in group 0 (the counting sort is stable).
        keys, inverse, offsets, order = torch.ops.sparsekit.unique_bounded(torch.cat([marker, rows]), num_rows, group)
        if not group:
            return keys, inverse[1:], None, None, 1, True
        return keys, inverse[1:], torch.cat([offsets[:1], offsets[1:] - 1]), order[1:] - 1, 1, True
    keys, inverse, counts = _ops.unique(torch.cat([marker, rows]))
    inverse = inverse[1:]
    coalesced = rows.device.type == "cpu"
    if coalesced:
        # Ascending, as the bitmap gives them (the same gradient eager and traced); the
        # marker sorts first, so the -1 group stays group 0.
        by_key = torch.from_numpy(np.argsort(keys.numpy(), kind="stable")) if eager else \
            torch.sort(keys, stable=True).indices
        rank = torch.empty_like(by_key).index_copy_(0, by_key, torch.arange(by_key.shape[0]))
        keys, inverse, counts = keys.index_select(0, by_key), rank.index_select(0, inverse), \
            counts.index_select(0, by_key)
    if not group:
        return keys, inverse, None, None, 1, coalesced
    # Group 0 counted the marker once.
    group_ends = torch.cumsum(counts, 0) - 1
    order = torch.sort(inverse, stable=True).indices
    return keys, inverse, torch.cat([group_ends.new_zeros(1), group_ends]), order, 1, coalesced


def _sparse_row_gradient(source: Tensor, source_index: Tensor, rows: Tensor, num_rows: int,
                         scale: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The sparse ``[num_rows, D]`` gradient ``sum_i scale[i] * source[source_index[i]]`` into row ``rows[i]``.

    Lookup ``i`` of row ``rows[i]`` contributes ``source[source_index[i]]`` (its bag's
    grad_output, or its own), times ``scale[i]`` when given; lookups of row -1 contribute
    nothing. The result, of ``dtype`` (default ``source``'s: the values are cast before the
    sparse tensor is built, which inductor can compile, where it cannot cast a sparse
    tensor), has one entry per distinct row (summed); on the CPU the rows
    ascend and it is flagged coalesced, on CUDA they are in order of first occurrence (see
    :func:`_number_rows`).

    The per-lookup rows are never materialised (``[nnz, D]`` would cost more than the
    whole forward): the lookups are grouped row by row, and ``embedding_bag`` sums each
    group straight out of ``source`` as one CSR bag per row, writing each output row once.
    Sums run in lookup order (on CUDA a long group is cut into fixed chunks combined in a
    fixed order), so the gradient is bit-identical run to run on every device.
    """
    dim = source.shape[1]
    keys, _, offsets, order, skip, coalesced = _number_rows(rows, num_rows, group=True)
    grouped_scale = None if scale is None else scale.index_select(0, order)
    # The -1 lookups (group 0, order[:offsets[1]], when skip is 1) read source index -1,
    # which embedding_bag skips without a load: they are never gathered, only stepped over.
    grouped_index = source_index.index_select(0, order)
    if skip:
        grouped_index = torch.where(torch.arange(order.shape[0], device=order.device) < offsets[1], -1,
                                    grouped_index)
    summed = _ops.embedding_bag(source, grouped_index, offsets, grouped_scale, "sum")
    if dtype is not None:
        summed = summed.to(dtype)
    return torch.sparse_coo_tensor(keys[skip:].to(torch.int64).unsqueeze(0), summed[skip:], (num_rows, dim),
                                   is_coalesced=coalesced, check_invariants=False)


def _repeat_interleave(values: Tensor, repeats: Tensor, output_size: int) -> Tensor:
    """``torch.repeat_interleave(values, repeats, output_size=output_size)`` (1-D ``values``
    and ``repeats``), on the calling thread for eager CPU tensors.

    torch's CPU kernel splits even a few hundred repeats over the threads (a
    ``parallel_for`` of grain 1): with another process on a core, a call of 10 us waited a
    time slice (4-8 ms) for its second thread in 1 of 25 calls (measured with two threads
    while a build ran). numpy's ``repeat`` runs serially and was as fast or faster at every
    size measured (1k-327k outputs: 51 against 137 us for 16,384 x 20, two threads, the
    build running). On CUDA, traced, or when the repeats do not add up to ``output_size``
    (torch's error then), torch's op."""
    if (values.device.type == "cpu" and repeats.device.type == "cpu" and type(values) is Tensor
            and type(repeats) is Tensor and not values.requires_grad and not torch.compiler.is_compiling()):
        try:
            arrays = values.numpy(), repeats.numpy()
        except RuntimeError:  # a tensor numpy cannot view (a functorch wrapper): torch's op
            arrays = None
        if arrays is not None:
            try:
                out = torch.from_numpy(np.repeat(*arrays))
            except ValueError:
                # torch's message (its kernel given a negative repeat and output_size 0
                # crashes the process, torch 2.13)
                raise RuntimeError("repeats can not be negative") from None
            if out.shape[0] == output_size:
                return out
    # output_size spares CUDA the host sync that sizing the result would need.
    return torch.repeat_interleave(values, repeats, output_size=output_size)


def _bag_index(offsets: Tensor, nnz: int) -> Tensor:
    """``[nnz]`` int64: the bag each lookup belongs to, from CSR offsets."""
    bags = offsets.shape[0] - 1
    return _repeat_interleave(torch.arange(bags, device=offsets.device), offsets[1:] - offsets[:-1], nnz)


def _lookup_dots(left: Tensor, left_index: Tensor, right: Tensor, right_index: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n]`` of ``dtype``: ``dot(left[left_index[i]], right[right_index[i]])``, 0 where right_index is -1.

    On the CPU this runs in chunks of about 4 MiB of gathered rows: a fresh ``[n, D]``
    temporary would cost more in page faults than the products. CUDA's caching allocator
    has no such cost, and one chunk keeps it to one launch (and one range-check sync) per op."""
    n, dim = left_index.shape[0], left.shape[1]
    chunk = max(1, (1 << 20) // max(dim, 1)) if left.device.type == "cpu" else max(n, 1)
    dots = []
    for start in range(0, n, chunk):
        a = embedding_gather(left, left_index[start:start + chunk]).to(dtype)
        b = embedding_gather(right, right_index[start:start + chunk]).to(dtype)
        dots.append(torch.linalg.vecdot(a, b))
    return torch.cat(dots) if dots else left.new_zeros(0, dtype=dtype)


def _padding_row(padding_idx: Optional[int], num_rows: int) -> Optional[int]:
    """padding_idx in [0, num_rows) (negative counts from the end, as in nn.EmbeddingBag), or None."""
    if padding_idx is None:
        return None
    return padding_idx + num_rows if padding_idx < 0 else padding_idx


def _embedding_bag_setup_context(ctx, inputs, output) -> None:
    weight, rows, offsets, per_sample_weights, mode, padding_idx, include_last_offset = inputs
    ctx.mode = mode
    ctx.num_rows = weight.shape[0]
    ctx.weight_id = id(weight)
    ctx.padding_idx = padding_idx
    ctx.include_last_offset = include_last_offset
    weighted = per_sample_weights is not None
    # The per-sample-weight gradient needs the table rows (and, for mean, the output); max
    # needs the table to find the arg-max again.
    ctx.save_for_backward(
        rows,
        offsets,
        per_sample_weights,
        weight if weighted or mode == "max" else None,
        output if weighted and mode == "mean" else None,
    )


def _csr_offsets(offsets: Tensor, nnz: int, include_last_offset: bool) -> Tensor:
    """``[bags + 1]`` int64 CSR offsets from either offsets convention."""
    offsets = offsets.long()
    if include_last_offset:
        return offsets
    return torch.cat([offsets, offsets.new_full((1,), nnz)])


def _max_gradient(grad_output: Tensor, weight: Tensor, rows: Tensor, offsets: Tensor, lookup_rows: Tensor,
                  ctx) -> Tensor:
    """Max mode's sparse weight gradient: grad_output[b, c] goes to column c of the row whose
    lookup holds bag b's maximum in that column (ties: the first valid lookup in bag order).

    The arg-max is recomputed (``embedding_bag_argmax``) instead of being kept from the
    forward, and the ``[bags * D]`` contributions are summed per (row, column) with
    ``segment_sum(deterministic=True)``: bit-identical run to run on every device."""
    dim = grad_output.shape[1]
    positions = _ops.embedding_bag_argmax(weight, rows, offsets, ctx.padding_idx, ctx.include_last_offset)
    keys, inverse, _, _, skip, coalesced = _number_rows(lookup_rows, ctx.num_rows, group=False)
    groups = keys.shape[0]
    # Group of each arg-max lookup (those of the -1 group, if any, are dropped). Position
    # nnz reads a padded 0, so bags without a valid lookup (-1) need no branch.
    nnz = lookup_rows.shape[0]
    group_of_lookup = torch.cat([inverse, inverse.new_zeros(1)])
    flat_positions = torch.where(positions >= 0, positions, nnz).reshape(-1)
    group = group_of_lookup.index_select(0, flat_positions).view_as(positions)
    column = torch.arange(dim, device=positions.device)
    segment = torch.where(positions >= 0, group * dim + column, -1).reshape(-1)
    acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    summed = segment_sum(grad_output.to(acc_dtype).reshape(-1, 1), segment, groups * dim, deterministic=True)
    values = summed.view(groups, dim)[skip:].to(grad_output.dtype)
    indices = keys[skip:].to(torch.int64).unsqueeze(0)
    return torch.sparse_coo_tensor(indices, values, (ctx.num_rows, dim), is_coalesced=coalesced,
                                   check_invariants=False)


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


def _embedding_bag_backward_of(ctx, grad_output: Tensor):
    rows, offsets, per_sample_weights, weight, output = ctx.saved_tensors
    nnz = rows.shape[0]
    csr = _csr_offsets(offsets, nnz, ctx.include_last_offset)
    # Half-precision gradients are pooled in float32 (grad_output is only [bags, D]).
    acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    padding_row = _padding_row(ctx.padding_idx, ctx.num_rows)
    # The padding row gets no gradient: in the backward it is one more missing row. (The
    # forward skips it in the kernel; this backward pass over rows is noise next to unique.)
    # (An int32 rows never holds a padding row past int32, and torch would wrap it to compare.)
    unpadded = padding_row is None or padding_row > torch.iinfo(rows.dtype).max
    lookup_rows = rows if unpadded else torch.where(rows == padding_row, -1, rows)

    if ctx.mode == "max":
        # Made of differentiable ops (a selection, segment_sum, sparse_coo_tensor): a second
        # derivative needs nothing more.
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = _max_gradient(grad_output, weight, rows, offsets, lookup_rows, ctx)
        return grad_weight, None, None, None, None, None, None

    bag = _bag_index(csr, nnz)
    valid = lookup_rows >= 0
    needs_weight = ctx.needs_input_grad[0]
    needs_per_sample_weights = per_sample_weights is not None and ctx.needs_input_grad[3]
    mode, num_rows = ctx.mode, ctx.num_rows

    def first_order(grad_output: Tensor, weight: Optional[Tensor], per_sample_weights: Optional[Tensor]):
        # mean: out[b] = sum_i w_i weight[r_i] / S_b, S_b = number (or weight sum) of valid rows.
        inverse_denominator = None
        if mode == "mean":
            if per_sample_weights is None:
                # Exact integer counts from a prefix sum: no atomics, no rounding.
                prefix = torch.cat([valid.new_zeros(1, dtype=torch.int64), torch.cumsum(valid, 0)])
                denominator = (prefix[csr[1:]] - prefix[csr[:-1]]).to(acc_dtype)
            else:
                # The forward's own weight sums, bit for bit and without atomics: embedding_bag
                # over the [nnz, 1] table of weights (0 for skipped lookups; adding 0.0 changes
                # no sum) runs the forward's summation order, long bags split alike on CUDA.
                masked = torch.where(valid, per_sample_weights.to(acc_dtype), 0).unsqueeze(1)
                lookups = torch.arange(nnz, device=rows.device)
                denominator = _ops.embedding_bag(masked, lookups, csr, None, "sum").squeeze(1)
            # The forward pools a bag with nothing to divide by to zeros; its gradient is zero too.
            safe = torch.where(denominator != 0, denominator, 1)
            inverse_denominator = torch.where(denominator != 0, 1 / safe, 0)

        # d loss / d out[b], divided by S_b for mean: each lookup then only adds its weight w_i.
        bag_grad = grad_output.to(acc_dtype)
        if inverse_denominator is not None:
            bag_grad = bag_grad * inverse_denominator.unsqueeze(1)

        grad_weight = None
        if needs_weight:
            scale = None if per_sample_weights is None else per_sample_weights.to(acc_dtype)
            grad_weight = _sparse_row_gradient(bag_grad, bag, lookup_rows, num_rows, scale, grad_output.dtype)

        grad_per_sample_weights = None
        if needs_per_sample_weights:
            # sum:  d out[b] / d w_i = weight[r_i]
            # mean: d out[b] / d w_i = (weight[r_i] - out[b]) / S_b, and bag_grad already holds the 1 / S_b.
            dots = _lookup_dots(bag_grad, bag, weight, lookup_rows, acc_dtype)
            if mode == "mean" and output.dtype != acc_dtype:
                # A half output was rounded from the float32 mean: (weight[r_i] - out[b]) cancels,
                # and the rounded out[b] left errors of ~8% of the gradient in bfloat16. The
                # bag's (g_b / S_b) . mean_b in float32 is (sum_j w_j * dots_j) / S_b (dots hold one
                # 1 / S_b). (A sum per bag in a fixed order, as the denominator's: deterministic.)
                scaled = torch.where(valid, per_sample_weights.to(acc_dtype) * dots, 0).unsqueeze(1)
                bag_dots = _ops.embedding_bag(scaled, torch.arange(nnz, device=rows.device), csr, None,
                                              "sum").squeeze(1) * inverse_denominator
                dots = torch.where(valid, dots - bag_dots.index_select(0, bag), 0)
            elif mode == "mean":
                bag_dots = torch.linalg.vecdot(bag_grad, output.to(acc_dtype))
                dots = torch.where(valid, dots - bag_dots.index_select(0, bag), 0)
            grad_per_sample_weights = dots.to(per_sample_weights.dtype)
        return grad_weight, grad_per_sample_weights

    spec = _LookupSpec(lookup_rows, bag, mode, first_order)
    grad_weight, grad_per_sample_weights = _lookup_gradients(spec, grad_output, weight, per_sample_weights)
    return grad_weight, None, None, grad_per_sample_weights, None, None, None


def _embedding_bag_backward(ctx, grad_output: Tensor):
    with _first_lookup_of(ctx.weight_id, grad_output):
        return _embedding_bag_backward_of(ctx, grad_output)


torch.library.register_autograd(
    "sparsekit::embedding_bag", _embedding_bag_backward, setup_context=_embedding_bag_setup_context
)


def _embedding_gather_setup_context(ctx, inputs, output) -> None:
    weight, rows = inputs
    ctx.num_rows = weight.shape[0]
    ctx.weight_id = id(weight)
    ctx.save_for_backward(rows)


def _embedding_gather_backward_of(ctx, grad_output: Tensor, dtype: Optional[torch.dtype] = None):
    """The weight's gradient, of ``dtype`` (default: the output gradient's)."""
    (rows,) = ctx.saved_tensors
    flat_rows = rows.reshape(-1)
    positions = torch.arange(flat_rows.shape[0], device=rows.device)
    num_rows = ctx.num_rows

    def first_order(grad_output: Tensor, weight: None, per_sample_weights: None):
        # Explicit sizes: reshape(-1, 0) of a zero-width gradient is ambiguous and raises.
        source = grad_output.reshape(flat_rows.shape[0], grad_output.shape[-1])
        if source.dtype in (torch.float16, torch.bfloat16):
            source = source.float()
        return _sparse_row_gradient(source, positions, flat_rows, num_rows, dtype=dtype or grad_output.dtype), None

    # Each lookup is its own bag of one; the gradient does not depend on the weight's values.
    spec = _LookupSpec(flat_rows, positions, "gather", first_order)
    grad_weight, _ = _lookup_gradients(spec, grad_output, None, None)
    return grad_weight, None


def _embedding_gather_backward(ctx, grad_output: Tensor):
    with _first_lookup_of(ctx.weight_id, grad_output):
        return _embedding_gather_backward_of(ctx, grad_output)


torch.library.register_autograd(
    "sparsekit::embedding_gather", _embedding_gather_backward, setup_context=_embedding_gather_setup_context
)


@torch.library.custom_op("sparsekit::_embedding_gather_float", mutates_args=())
def _embedding_gather_float(weight: Tensor, rows: Tensor) -> Tensor:
    """Internal: ``embedding_gather(weight, rows)`` of a float16 / bfloat16 table, widened to
    float32 in one op (the traced collection's weighted and mean half tables). Its backward
    sums each row's float32 gradients and rounds them to the table's dtype once, as the
    eager lookup does: ``embedding_gather(...).float()`` rounded every lookup's gradient to
    the half type before the sum."""
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


def embedding_bag(
    weight: Tensor,
    rows: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor] = None,
    mode: str = "sum",
    padding_idx: Optional[int] = None,
    include_last_offset: bool = True,
) -> Tensor:
    """Pooled embedding lookup over bags: ``out[b] = pool(weight[rows[offsets[b]:offsets[b+1]]])``.

    Offsets come in two conventions. The default, ``include_last_offset=True``, is CSR:
    ``bags + 1`` entries, the last one ``nnz``. ``include_last_offset=False`` takes
    ``nn.EmbeddingBag``'s default ``[bags]`` bag starts, the last bag running to ``nnz``::

        rows = torch.tensor([4, 2, 7])                     # nnz = 3 lookups, 2 bags: [4, 2] and [7]
        embedding_bag(w, rows, torch.tensor([0, 2, 3]))    # CSR (default): bags + 1 offsets
        embedding_bag(w, rows, torch.tensor([0, 2]), include_last_offset=False)  # nn.EmbeddingBag style
        embedding_bag(w, rows, torch.tensor([0, 2]))       # raises: offsets[-1] == 2 != nnz, with a
                                                           # hint to pass include_last_offset=False

    Args:
        weight: ``[R, D]`` float32, float64, float16 or bfloat16 table (half types
            accumulate in float32); any strides (rows are read as-is when their columns
            are dense, e.g. ``big[:, 1:33]``; otherwise a contiguous copy is made).
        rows: ``[nnz]`` int64 or int32 row ids in ``[0, R)``; ``-1`` (a missing key) is
            skipped. Anything else raises, naming the first bad entry.
        offsets: int64 or int32 bag boundaries, non-decreasing from ``offsets[0] == 0``:
            ``[bags + 1]`` with ``offsets[-1] == nnz`` (``include_last_offset=True``) or
            ``[bags]`` (``include_last_offset=False``). Bad offsets raise (checked before
            rows), naming the first bad bag.
        per_sample_weights: optional ``[nnz]`` of ``weight``'s dtype, scaling each row
            (``"sum"`` and ``"mean"`` only; with ``"max"`` it raises, as in torch).
        mode: ``"sum"``, ``"mean"`` or ``"max"``. Mean divides by the number of valid rows
            of the bag (weighted: by the sum of their weights), bit for bit as
            ``nn.EmbeddingBag`` does for float32 and float64 (float16 and bfloat16 sum
            and divide in float32 and round once, which can differ from torch's in the last
            bit). Max takes each column's maximum over the valid rows as
            ``nn.EmbeddingBag`` does: the first valid row, then only a strictly larger value
            (a NaN wins only when it comes first; ties keep the earlier row).
        padding_idx: optional row skipped exactly like ``-1``: it adds nothing, is not
            counted by mean and gets no gradient. In ``[-R, R)``; negative counts from the
            end, as in ``nn.EmbeddingBag``.
        include_last_offset: see above; ``True`` (the default) is sparsekit's CSR offsets.

    Returns:
        ``[bags, D]`` of ``weight``'s dtype; a bag with no valid row (or whose valid weights
        sum to zero in weighted mean) is zeros. Differentiable in ``weight`` (a sparse COO
        gradient with one entry per distinct valid row looked up, gradients summed: on the
        CPU rows ascending and marked coalesced, on CUDA rows in order of first occurrence,
        not marked; max sends each column's gradient
        to the arg-max row, ties to the first valid lookup in bag order) and in
        ``per_sample_weights`` (dense). Forward and gradients are bit-identical run to run;
        max mode (a selection) is also bit-identical between CPU and CUDA.

        Double backward works in every mode: with ``create_graph=True`` the first-order
        gradients are the same (bit for bit, the weight's still sparse) and differentiable
        again in ``grad_output``, ``weight`` and ``per_sample_weights``. Sum and mean take
        their second derivatives from a plain-torch pooling of the distinct rows looked up
        (dense over those rows only; the weight's second-order gradient is sparse COO too);
        max's backward is made of differentiable ops.

    Raises:
        TypeError: ``mode`` not a str, ``padding_idx`` not an int (a bool is not one) or
            None, ``include_last_offset`` not a bool (None or 0 would silently pick the
            other offsets convention).
    """
    tensor_arguments("embedding_bag", weight=weight, rows=rows, offsets=offsets,
                     **({} if per_sample_weights is None else {"per_sample_weights": per_sample_weights}))
    _refuse_forward_ad("embedding_bag", weight=weight, per_sample_weights=per_sample_weights)
    mode = _choice("embedding_bag", "mode", mode)
    padding_idx = _integer("embedding_bag", "padding_idx", padding_idx, optional=True)
    include_last_offset = _flag("embedding_bag", "include_last_offset", include_last_offset)
    return _ops.embedding_bag(weight, rows, offsets, per_sample_weights, mode, padding_idx, include_last_offset)


def embedding_gather(weight: Tensor, rows: Tensor) -> Tensor:
    """Unpooled embedding lookup: ``out[...] = weight[rows[...]]``, zeros where ``rows == -1``.

    Args:
        weight: ``[R, D]`` float32, float64, float16 or bfloat16 table.
        rows: int64 or int32 row ids of any shape, each in ``[0, R)`` or ``-1``.

    Returns:
        ``rows.shape + [D]`` of ``weight``'s dtype. Differentiable in ``weight`` (sparse COO
        gradient with one entry per distinct row, as for :func:`embedding_bag`), and twice
        differentiable: with ``create_graph=True`` that gradient is differentiable again in
        ``grad_output``, as for :func:`embedding_bag`.
    """
    tensor_arguments("embedding_gather", weight=weight, rows=rows)
    _refuse_forward_ad("embedding_gather", weight=weight)
    return _ops.embedding_gather(weight, rows)


# ---- the training harness's interaction (internal, CPU only) ----


@torch.library.register_fake("sparsekit::_pair_dots")
def _pair_dots_fake(vectors: Tensor) -> Tensor:
    n = vectors.shape[1]
    return vectors.new_empty(vectors.shape[0], n * (n - 1) // 2)


@torch.library.register_fake("sparsekit::_pair_dots_backward")
def _pair_dots_backward_fake(grad: Tensor, vectors: Tensor) -> Tensor:
    return vectors.new_empty(vectors.shape)

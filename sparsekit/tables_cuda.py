"""CUDA kernels of the multi-table ops, as composites of ops that have CUDA kernels.

``hash_table_find_tables``, ``hash_table_place_tables_``, ``hash_table_score_tables_``,
``lazy_adam_tables_``, ``segment_sum_parts``, ``unique_bounded`` and ``unique_tables`` have C++
CPU kernels only; this module registers a CUDA kernel for each, written from sparsekit's
per-table ops and plain torch ops, so that every op runs on both devices (``docs/design.md``).
Each composite is device-agnostic and tested on CPU tensors against the C++ kernel, bit for
bit: the same outputs, in-place effects, checks and messages. Unavoidable differences: slot
positions (not rows) of ``hash_table_place_tables_`` and the last bits of float sums of
``segment_sum_parts`` may differ. Each op's host syncs are in its docstring. A native CUDA
kernel in ``sparsekit._C`` takes precedence.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .tables_cuda_checks import (
    _device,
    _dtype,
    _fail,
    _first_bad,
    _hash_table_find_args,
    _index_tensor,
    _key_tensor,
    _keys_on,
    _lazy_adam_args,
    _lazy_adam_disjoint,
    _no_shared_writes,
    _shape,
    _table_offsets,
    _where,
)

__all__ = ["hash_table_find_tables", "hash_table_place_tables_", "hash_table_score_tables_", "lazy_adam_tables_",
           "segment_sum_parts", "unique_bounded", "unique_tables"]

_ops = torch.ops.sparsekit
_INT64_MAX = 2**63 - 1


def _device_ints(values: Union[Sequence[int], Tensor], device: torch.device) -> Tensor:
    """An int64 tensor of a few host values on ``device``, copied through pinned memory on
    CUDA: ``torch.tensor(values, device=cuda)`` copies from pageable memory, a host sync."""
    host = values if isinstance(values, Tensor) else torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# ---- hash tables ----


def hash_table_find_tables(slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor,
                           offsets: List[int]) -> Tensor:
    """``hash_table_find`` over several tables: ``keys[offsets[t]:offsets[t + 1]]`` in table ``t``.

    Args:
        slot_keys, slot_rows: the int64 ``[S_t]`` slot arrays of each table.
        keys: int64 or int32 ``[n]``, grouped by table.
        offsets: ``[T + 1]`` CSR bounds of each table's keys.

    Returns:
        int64 ``[n]`` rows, -1 where a key is absent from its table. No host sync.
    """
    op = "hash_table_find_tables"
    if len(slot_keys) != len(slot_rows):
        _fail(f"{op}: slot_keys holds {len(slot_keys)} tables but slot_rows {len(slot_rows)}; give both arrays of "
              "every table")
    _key_tensor(keys, op, "keys")
    if keys.dim() != 1:
        _fail(f"{op}: keys must be 1-D, got shape {_shape(keys.shape)}")
    for t in range(len(slot_keys)):
        _hash_table_find_args(slot_keys[t], slot_rows[t], keys, f"{op}: table {t}")
    _table_offsets(offsets, len(slot_keys), keys.numel(), op)
    parts = [_ops.hash_table_find(slot_keys[t], slot_rows[t], keys[offsets[t]:offsets[t + 1]])
             for t in range(len(slot_keys)) if offsets[t + 1] > offsets[t]]
    if not parts:
        return keys.new_empty(keys.shape, dtype=torch.int64)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def hash_table_score_tables_(last_seen: List[Tensor], count: List[Tensor], rows: Tensor, offsets: List[int],
                             clocks: List[int]) -> None:
    """Scores the rows of several tables in place: for ``rows[i]`` of table ``t`` (``i`` in
    ``[offsets[t], offsets[t + 1])``), ``last_seen[t][rows[i]] = clocks[t]`` and
    ``count[t][rows[i]] += 1``; -1 is skipped. Every row is checked before anything is
    written: one host sync on CUDA.

    Args:
        last_seen, count: int64 ``[R_t]`` contiguous scores of each table, written in place.
        rows: int64 ``[n]``, each in ``[-1, R_t)``.
        offsets: ``[T + 1]`` CSR bounds of each table's rows.
        clocks: each table's clock.
    """
    op = "hash_table_score_tables_"
    if not (len(last_seen) == len(count) and len(clocks) == len(count)):
        _fail(f"{op}: last_seen ({len(last_seen)}), count ({len(count)}) and clocks ({len(clocks)}) must hold one "
              "entry per table")
    if not (rows.dtype == torch.int64 and rows.dim() == 1):
        _fail(f"{op}: rows must be 1-D int64, got {_dtype(rows.dtype)} with shape {_shape(rows.shape)}")
    for t, (seen, counts) in enumerate(zip(last_seen, count)):
        if not (seen.dtype == torch.int64 and counts.dtype == torch.int64 and seen.dim() == 1 and counts.dim() == 1
                and seen.shape[0] == counts.shape[0] and seen.is_contiguous() and counts.is_contiguous()):
            _fail(f"{op}: last_seen[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length")
        if seen.device != rows.device or counts.device != rows.device:
            _fail(f"{op}: table {t}'s scores are not on the rows' device ({_device(rows.device)})")
    _table_offsets(offsets, len(count), rows.numel(), op)
    uses = [(rows, "rows", 0, False)]
    for t in range(len(count)):
        uses += [(last_seen[t], "last_seen", t, True), (count[t], "count", t, True)]
    _no_shared_writes(op, uses)
    n = rows.shape[0]
    if n == 0:
        return
    device = rows.device
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    bound = torch.repeat_interleave(_device_ints([c.shape[0] for c in count], device), _device_ints(lengths, device),
                                    output_size=n)
    at, value = _first_bad((rows < -1) | (rows >= bound), rows)
    if at < n:
        t = bisect.bisect_right(offsets, at) - 1
        _fail(f"{op}: rows[{at}] = {value} of table {t} is outside its scores [-1, {count[t].shape[0]})")
    for t in range(len(count)):
        a, b = offsets[t], offsets[t + 1]
        if b == a or count[t].shape[0] == 0:  # (a table without rows has only -1s to skip)
            continue
        part = rows[a:b]
        valid = part >= 0
        # Skipped rows (-1) are sent to the slice's largest row, written with the same stamp
        # (or, when every row is -1, to row 0 with its own stamp): every write to one row
        # writes one value, so the order of the scattered writes does not matter.
        largest = part.amax()
        spare = largest.clamp(min=0)
        index = torch.where(valid, part, spare)
        stamp = torch.where(largest >= 0, clocks[t], last_seen[t].index_select(0, spare.view(1)))
        last_seen[t].index_put_((index,), stamp.expand(index.shape[0]))
        count[t].index_put_((index,), valid.to(torch.int64), accumulate=True)


def hash_table_place_tables_(slot_keys: List[Tensor], slot_rows: List[Tensor], row_keys: List[Tensor],
                             count: List[Tensor], keys: Tensor, offsets: List[int], sizes: List[int]) -> None:
    """Places several growing tables' new keys in place: ``keys[offsets[t]:offsets[t + 1]]``
    (distinct, absent from table ``t``, not checked) take rows ``sizes[t], sizes[t] + 1, ...``
    in order: their slots, ``row_keys[t][row] = key``, ``count[t][row] = 0``. Every table is
    checked before anything is written. No host sync.

    Args:
        slot_keys, slot_rows: each table's int64 ``[S_t]`` slot arrays, written in place.
        row_keys, count: each table's int64 ``[capacity_t]`` contiguous arrays, written in place.
        keys: int64 or int32 ``[n]``, grouped by table.
        offsets: ``[T + 1]`` CSR bounds of each table's keys.
        sizes: the keys each table holds (its first free row).
    """
    op = "hash_table_place_tables_"
    num_tables = len(slot_keys)
    if not (len(slot_rows) == num_tables and len(row_keys) == num_tables and len(count) == num_tables
            and len(sizes) == num_tables):
        _fail(f"{op}: slot_keys ({num_tables}), slot_rows ({len(slot_rows)}), row_keys ({len(row_keys)}), count "
              f"({len(count)}) and sizes ({len(sizes)}) must hold one entry per table")
    _key_tensor(keys, op, "keys")
    if keys.dim() != 1:
        _fail(f"{op}: keys must be 1-D, got shape {_shape(keys.shape)}")
    _table_offsets(offsets, num_tables, keys.numel(), op)
    for t in range(num_tables):
        _hash_table_find_args(slot_keys[t], slot_rows[t], keys, f"{op}: table {t}")
        rk, counts = row_keys[t], count[t]
        if not (rk.dtype == torch.int64 and counts.dtype == torch.int64 and rk.dim() == 1 and counts.dim() == 1
                and rk.shape[0] == counts.shape[0] and rk.is_contiguous() and counts.is_contiguous()
                and rk.device == keys.device and counts.device == keys.device):
            _fail(f"{op}: row_keys[{t}] and count[{t}] must be contiguous 1-D int64 tensors of one length on "
                  f"{_device(keys.device)}")
        num_new, capacity = offsets[t + 1] - offsets[t], rk.shape[0]
        if not (sizes[t] >= 0 and sizes[t] <= capacity - num_new):
            _fail(f"{op}: table {t} holds {sizes[t]} of its {capacity} rows, so its {num_new} new keys do not fit; "
                  "nothing was inserted")
        num_slots = slot_keys[t].shape[0]
        # hashtable.h check_hash_insert_fits
        if not (0 <= sizes[t] <= num_slots):
            _fail(f"{op}: num_occupied must lie in [0, {num_slots}], got {sizes[t]}")
        if sizes[t] + num_new > num_slots:
            _fail(f"{op}: {num_new} keys do not fit in the {num_slots - sizes[t]} empty slots of the table ({sizes[t]} "
                  f"of {num_slots} occupied); nothing was inserted. Keep the table at most half full "
                  "(sparsekit.HashTable does)")
    uses = [(keys, "keys", 0, False)]
    for t in range(num_tables):
        uses += [(slot_keys[t], "slot_keys", t, True), (slot_rows[t], "slot_rows", t, True),
                 (row_keys[t], "row_keys", t, True), (count[t], "count", t, True)]
    _no_shared_writes(op, uses)
    for t in range(num_tables):
        a, b = offsets[t], offsets[t + 1]
        if b == a:
            continue
        new_keys = keys[a:b]
        # The table's size as num_occupied: its fit is checked above, and no host sync on CUDA.
        _ops.hash_table_insert_absent_(slot_keys[t], slot_rows[t], new_keys,
                                       torch.arange(sizes[t], sizes[t] + b - a, device=keys.device), sizes[t])
        row_keys[t][sizes[t]:sizes[t] + b - a].copy_(new_keys)
        count[t][sizes[t]:sizes[t] + b - a].zero_()


# ---- lazy Adam ----


# lazy_adam_cpu.cpp kBitmapRowsPerUpdate: below this many rows of weight per row given (+ 2^16)
# the CPU finds a repeated row with a bitmap, naming the first repeat in position order;
# above, with a sort, naming the smallest repeated row.
_BITMAP_ROWS_PER_UPDATE = 128


def lazy_adam_tables_(weights: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], rows: List[Tensor],
                      grads: List[Tensor], steps: List[int], hyper: List[float],
                      device: Optional[torch.device] = None) -> None:
    """``lazy_adam_`` over several tables in place: table ``t`` updates ``weights[t]``,
    ``exp_avgs[t]``, ``exp_avg_sqs[t]`` at ``rows[t]`` with ``grads[t]``, step ``steps[t]`` and
    ``hyper[5t:5t + 5]`` = (lr, beta1, beta2, eps, weight_decay). Every argument and every row
    of every table is checked before anything is written (one host sync on CUDA); then one
    ``lazy_adam_`` per table with rows (its own sync each). A float16 / bfloat16 weight is
    updated through float32 copies of its rows, rounded back to nearest, as the CPU kernel
    does it, bit for bit.

    Args:
        weights: ``[R_t, ...]`` contiguous float32, float16 or bfloat16, on ``device``.
        exp_avgs, exp_avg_sqs: float32 moments of each weight's shape.
        rows: contiguous int64 ``[u_t]`` distinct rows in ``[0, R_t)``.
        grads: float32 ``[u_t, ...]``.
        steps: each table's step (``>= 1``).
        hyper: five floats per table.
        device: the device the kernel runs for (default: that of ``weights[0]``).
    """
    op = "lazy_adam_tables_"
    num_tables = len(weights)
    if not (len(exp_avgs) == num_tables and len(exp_avg_sqs) == num_tables and len(rows) == num_tables
            and len(grads) == num_tables and len(steps) == num_tables and len(hyper) == 5 * num_tables):
        _fail(f"{op}: weights ({num_tables}), exp_avgs ({len(exp_avgs)}), exp_avg_sqs ({len(exp_avg_sqs)}), rows "
              f"({len(rows)}), grads ({len(grads)}) and steps ({len(steps)}) must hold one entry per table and hyper "
              f"five ({len(hyper)})")
    if device is None and num_tables:
        device = weights[0].device
    for t in range(num_tables):
        weight, exp_avg = weights[t], exp_avgs[t]
        dtype = weight.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.device != device:
            _fail(f"{op}: weights[{t}] must be a float32, float16 or bfloat16 {_where(device)} tensor, got "
                  f"{_dtype(dtype)} on {_device(weight.device)}")
        if exp_avg.dtype != torch.float32:
            _fail(f"{op}: exp_avgs[{t}] must be float32 (a half weight keeps float32 moments), got "
                  f"{_dtype(exp_avg.dtype)}")
        if not (weight.is_contiguous() and weight.shape == exp_avg.shape):
            _fail(f"{op}: weights[{t}] {_shape(weight.shape)} must be contiguous with the shape of exp_avgs[{t}] "
                  f"{_shape(exp_avg.shape)}")
        # The moments stand in for a half weight: the rest must match them.
        _lazy_adam_args(f"{op}: table {t}", weight if dtype == torch.float32 else exp_avg, exp_avg, exp_avg_sqs[t],
                        rows[t], grads[t], steps[t], *hyper[5 * t:5 * t + 5])
        _lazy_adam_disjoint(op, weight, exp_avg, exp_avg_sqs[t], rows[t], grads[t])
        if not (rows[t].dtype == torch.int64 and rows[t].is_contiguous()):
            _fail(f"{op}: rows[{t}] must be a contiguous int64 tensor")
    counts = [r.shape[0] for r in rows]
    num_rows = [w.shape[0] for w in weights]
    total = sum(counts)
    if total > 0:
        _check_rows(op, rows, counts, num_rows, device)
    # lazy_adam_cpu.cpp checks the tables against each other with contiguous gradients: a copy
    # made for a strided one shares memory with nothing.
    uses = []
    for t in range(num_tables):
        uses += [(weights[t], "weights", t, True), (exp_avgs[t], "exp_avgs", t, True),
                 (exp_avg_sqs[t], "exp_avg_sqs", t, True), (rows[t], "rows", t, False)]
        if grads[t].is_contiguous():
            uses.append((grads[t], "grads", t, False))
    _no_shared_writes(op, uses)
    for t in range(num_tables):
        weight = weights[t]
        if counts[t] == 0 or weight.numel() == 0:
            continue
        lr, beta1, beta2, eps, weight_decay = hyper[5 * t:5 * t + 5]
        if weight.dtype == torch.float32:
            _ops.lazy_adam_(weight, exp_avgs[t], exp_avg_sqs[t], rows[t], grads[t], steps[t], lr, beta1, beta2, eps,
                            weight_decay)
            continue
        # A half weight: float32 copies of its rows through lazy_adam_, rounded back to nearest.
        local = [weight.index_select(0, rows[t]).float(), exp_avgs[t].index_select(0, rows[t]),
                 exp_avg_sqs[t].index_select(0, rows[t])]
        _ops.lazy_adam_(*local, torch.arange(counts[t], device=weight.device), grads[t], steps[t], lr, beta1, beta2,
                        eps, weight_decay)
        for target, updated in zip((weight, exp_avgs[t], exp_avg_sqs[t]), local):
            target.index_copy_(0, rows[t], updated.to(target.dtype))


def _check_rows(op: str, rows: List[Tensor], counts: List[int], num_rows: List[int], device: torch.device) -> None:
    """Every row of every table in ``[0, R_t)`` (the first bad one in table order named), then
    no row repeated within a table (the first such table named, its row as the CPU names it):
    one host sync."""
    num_tables = len(rows)
    total = sum(counts)
    every = torch.cat([r for r in rows if r.shape[0] > 0])
    per_table = _device_ints(counts, device)
    table = torch.repeat_interleave(torch.arange(num_tables, device=device), per_table, output_size=total)
    bound = torch.repeat_interleave(_device_ints(num_rows, device), per_table, output_size=total)
    bad = (every < 0) | (every >= bound)
    first_bad = torch.where(bad, torch.arange(total, device=device), total).amin()
    # Repeats: rows made distinct across tables (table t's start after the rows of the tables
    # before it), sorted stably, so each repeat after the first stands after an equal value.
    starts = [0]
    for r in num_rows[:-1]:
        starts.append(starts[-1] + r)
    global_rows = every + _device_ints(starts, device).index_select(0, table)
    ordered, position = torch.sort(global_rows, stable=True)
    repeat = ordered[1:] == ordered[:-1]
    later = position[1:]
    owner = table.index_select(0, later)
    first_repeat = torch.full((num_tables,), total, dtype=torch.int64, device=device).scatter_reduce_(
        0, owner, torch.where(repeat, later, total), "amin")
    smallest_repeat = torch.full((num_tables,), _INT64_MAX, dtype=torch.int64, device=device).scatter_reduce_(
        0, owner, torch.where(repeat, every.index_select(0, later), _INT64_MAX), "amin")
    packed = torch.cat([first_bad.view(1), every.index_select(0, first_bad.clamp(max=total - 1).view(1)),
                        first_repeat, every.index_select(0, first_repeat.clamp(max=total - 1)), smallest_repeat])
    values = packed.tolist()  # the host sync
    at, value = values[0], values[1]
    if at < total:
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        t = bisect.bisect_right(offsets, at) - 1
        _fail(f"{op}: rows[{t}] holds {value}, outside [0, {num_rows[t]}) (the rows of weights[{t}]); nothing was "
              "updated")
    first_repeat = values[2:2 + num_tables]
    at_first = values[2 + num_tables:2 + 2 * num_tables]
    smallest = values[2 + 2 * num_tables:]
    for t in range(num_tables):
        if first_repeat[t] < total:
            bitmap = num_rows[t] <= _BITMAP_ROWS_PER_UPDATE * counts[t] + (1 << 16)
            _fail(f"{op}: rows[{t}] holds row {at_first[t] if bitmap else smallest[t]} more than once (a sparse "
                  "gradient marked coalesced that is not?); nothing was updated")


# ---- segment sum ----


def segment_sum_parts(data: List[Tensor], segment_ids: Tensor, num_segments: int,
                      device: Optional[torch.device] = None) -> Tensor:
    """``segment_sum`` of the rows of several tensors one after the other: ``segment_ids``
    spans them all. Here ``segment_sum`` of their concatenation (one host sync on CUDA,
    segment_sum's); float sums in the order of ``segment_sum`` on the device (the CPU's: in
    position order, the same bits as the CPU kernel).

    Args:
        data: tensors ``[n_p, ...]`` of one float dtype and row shape, on ``device``.
        segment_ids: int64 or int32 ``[sum n_p]``; negative ids dropped, ``>= num_segments`` raise.
        num_segments: output rows (``>= 0``).
        device: the device the kernel runs for (default: that of ``data[0]``).

    Returns:
        ``[num_segments, ...]`` of ``data``'s dtype.
    """
    op = "segment_sum_parts"
    if not data:
        _fail(f"{op}: data must hold at least one tensor")
    first = data[0]
    if first.dim() < 1:
        _fail(f"{op}: data[0] must have at least one dimension [rows, ...], got a scalar")
    if device is None:
        device = first.device
    rows = 0
    for p, part in enumerate(data):
        if not (part.dim() == first.dim() and part.dtype == first.dtype and part.shape[1:] == first.shape[1:]
                and part.device == device):
            _fail(f"{op}: data[{p}] ({_dtype(part.dtype)} {_shape(part.shape)} on {_device(part.device)}) must be a "
                  f"{_where(device)} tensor with the dtype and row shape of data[0] ({_dtype(first.dtype)} "
                  f"{_shape(first.shape)})")
        rows += part.shape[0]
    _index_tensor(segment_ids, op, "segment_ids")
    if not (segment_ids.dim() == 1 and segment_ids.shape[0] == rows):
        _fail(f"{op}: segment_ids must be 1-D with one entry per row of data ({rows}), got shape "
              f"{_shape(segment_ids.shape)}")
    if segment_ids.device != device:
        _fail(f"{op}: segment_ids must be a {_where(device)} tensor, got {_device(segment_ids.device)}")
    if num_segments < 0:
        _fail(f"{op}: num_segments must be >= 0, got {num_segments}")
    if first.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        _fail(f"{op}: data must be float32, float64, float16 or bfloat16, got {_dtype(first.dtype)}")
    joined = first if len(data) == 1 else torch.cat(data)
    try:
        return _ops.segment_sum(joined, segment_ids, num_segments, torch.are_deterministic_algorithms_enabled())
    except RuntimeError as error:
        message = str(error)
        if not message.startswith("segment_sum:"):
            raise
        if message.startswith("segment_sum: segment_ids holds "):
            # The CPU kernel names the largest id (CUDA's segment_sum may name another bad one).
            largest = int(segment_ids.max())
            message = (f"segment_sum: segment_ids holds {largest} but num_segments is {num_segments}; ids must be "
                       "< num_segments (negative ids are dropped as padding)")
        raise RuntimeError(op + message[len("segment_sum"):]) from None


# ---- unique ----


def unique_bounded(keys: Tensor, bound: int, group: bool = False,
                   device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sorted unique of keys in ``[-1, bound)``: ``keys == unique_keys[inverse]``; with
    ``group``, ``order`` lists the positions grouped by key (ascending within a group) and
    ``offsets`` bounds the groups in it. ``torch.unique`` and a stable sort: two host syncs on
    CUDA (the range check, the unique count).

    Args:
        keys: int64 or int32 of any shape, each in ``[-1, bound)``.
        bound: in ``[0, 2^40)``.
        group: also ``offsets`` ``[U + 1]`` and ``order`` ``[n]`` (else both ``[0]``).
        device: the device the kernel runs for (default: that of ``keys``).

    Returns:
        ``unique_keys`` ``[U]`` of ``keys``' dtype, ``inverse`` int64 of ``keys``' shape,
        ``offsets`` and ``order`` int64.
    """
    op = "unique_bounded"
    device = _keys_on(keys, op, device)
    if not (0 <= bound < 1 << 40):
        _fail(f"{op}: bound must lie in [0, 2^40), got {bound}")
    n = keys.numel()
    if n == 0:
        offsets = torch.zeros(1 if group else 0, dtype=torch.int64, device=device)
        return (keys.new_empty(0), keys.new_empty(keys.shape, dtype=torch.int64), offsets,
                keys.new_empty(0, dtype=torch.int64))
    flat = keys.reshape(-1)
    low, high = (int(v) for v in torch.stack(torch.aminmax(flat)).tolist())
    if low < -1 or high >= bound:
        # As int64: torch wraps a bound past int32 to an int32 keys' width in a comparison.
        at, value = _first_bad((flat < -1) | (flat.long() >= bound), flat)
        _fail(f"{op}: keys must lie in [-1, bound) = [-1, {bound}), got {value} at position {at}")
    if not group:
        unique_keys, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        empty = keys.new_empty(0, dtype=torch.int64)
        return unique_keys, inverse.view(keys.shape), empty, empty.clone()
    unique_keys, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    order = torch.sort(inverse, stable=True).indices
    return unique_keys, inverse.view(keys.shape), offsets, order


def unique_tables(keys: Tensor, offsets: List[int], tables: List[int], num_tables: int,
                  device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Distinct keys per table: segment ``s`` (``keys[offsets[s]:offsets[s + 1]]``) belongs to
    table ``tables[s]``. The distinct keys table after table, each table's in order of first
    occurrence; ``inverse`` with ``keys == unique_keys[inverse]``; each table's distinct count.
    Two ``unique`` calls (keys, then ``key_id * num_tables + table``) and a stable sort by
    table: two host syncs on CUDA.

    Args:
        keys: int64 or int32 ``[n]``.
        offsets: ``[S + 1]`` CSR bounds of the segments.
        tables: ``[S]`` the table of each segment, in ``[0, num_tables)``.
        num_tables: in ``[0, 2^20]``.
        device: the device the kernel runs for (default: that of ``keys``).

    Returns:
        ``unique_keys`` ``[U]`` of ``keys``' dtype, ``inverse`` int64 ``[n]``, ``per_table``
        int64 ``[num_tables]``.
    """
    op = "unique_tables"
    device = _keys_on(keys, op, device)
    if keys.dim() != 1:
        _fail(f"{op}: keys must be 1-D, got shape {_shape(keys.shape)}")
    if not (0 <= num_tables <= 1 << 20):
        _fail(f"{op}: num_tables must lie in [0, 2^20], got {num_tables}")
    n = keys.numel()
    if len(offsets) != len(tables) + 1:
        _fail(f"{op}: offsets must hold one more entry than tables ({len(tables) + 1}), got {len(offsets)}")
    if not (offsets[0] == 0 and offsets[-1] == n):
        _fail(f"{op}: offsets must run from 0 to {n}, got {offsets[0]} .. {offsets[-1]}")
    for s in range(len(tables)):
        if offsets[s] > offsets[s + 1]:
            _fail(f"{op}: offsets must never decrease, got offsets[{s}] = {offsets[s]} > offsets[{s + 1}] = "
                  f"{offsets[s + 1]}")
        if not 0 <= tables[s] < num_tables:
            _fail(f"{op}: tables[{s}] = {tables[s]} is not a table in [0, {num_tables})")
    per_table = torch.zeros(num_tables, dtype=torch.int64, device=device)
    if n == 0:
        return keys.new_empty(0), keys.new_empty(0, dtype=torch.int64), per_table
    # Segments cover the keys in order, so a table's first occurrences over its segments are
    # its first occurrences in the keys: the (key, table) pairs deduplicated in key order,
    # then grouped stably by table.
    table_of_key = torch.repeat_interleave(_device_ints(tables, device),
                                           _device_ints([b - a for a, b in zip(offsets, offsets[1:])], device),
                                           output_size=n)
    distinct_keys, key_id, _ = _ops.unique(keys)
    pair_ids, pair_of_key, _ = _ops.unique(key_id * num_tables + table_of_key)
    pair_tables = torch.remainder(pair_ids, num_tables)
    sorted_tables, order = torch.sort(pair_tables, stable=True)
    position = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=device))
    unique_keys = distinct_keys.index_select(0, torch.div(pair_ids.index_select(0, order), num_tables,
                                                          rounding_mode="floor"))
    bounds = torch.searchsorted(sorted_tables, torch.arange(num_tables + 1, device=device))
    return unique_keys, position.index_select(0, pair_of_key), bounds.diff()


# ---- registration for the CUDA dispatch key ----


def _cuda_device(*args: Any) -> torch.device:
    """The device of the first CUDA tensor among the arguments (lists searched in order)."""
    for arg in args:
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, Tensor) and item.device.type == "cuda":
                return item.device
    raise AssertionError("a CUDA kernel called without a CUDA tensor")


def _on_cuda(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` for the CUDA dispatch key: it runs for the first CUDA tensor's device, under
    its device guard (the per-table ops guard themselves; the plain allocations here need it)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        device = _cuda_device(*args, *kwargs.values())
        with torch.cuda.device(device):
            return function(*args, **kwargs, device=device)
    kernel.__name__ = function.__name__
    return kernel


def _guarded(function: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.device(_cuda_device(*args, *kwargs.values())):
            return function(*args, **kwargs)
    kernel.__name__ = function.__name__
    return kernel


_KERNELS: Dict[str, Callable[..., Any]] = {
    "hash_table_find_tables": _guarded(hash_table_find_tables),
    "hash_table_place_tables_": _guarded(hash_table_place_tables_),
    "hash_table_score_tables_": _guarded(hash_table_score_tables_),
    "lazy_adam_tables_": _on_cuda(lazy_adam_tables_),
    "segment_sum_parts": _on_cuda(segment_sum_parts),
    "unique_bounded": _on_cuda(unique_bounded),
    "unique_tables": _on_cuda(unique_tables),
}


def _register() -> torch.library.Library:
    library = torch.library.Library("sparsekit", "IMPL")
    for name, kernel in _KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekit::{name}", "CUDA"):
            library.impl(name, kernel, "CUDA")
    return library


_library = _register()  # kept alive: the registrations last as long as the library object

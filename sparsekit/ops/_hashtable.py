"""Open-addressing hash-table ops (``csrc/cpu/hashtable_cpu.cpp``,
``csrc/cuda/hashtable_cuda.cu``): the wrappers :class:`sparsekit.HashTable` calls and the
fakes of every ``sparsekit::hash_table_*`` op and of ``sparsekit::lookup_rows``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._checks import csr_offsets, hash_table_slots, index_dtype, same_device, shape_of, shown, tensor_arguments
from ._common import _check_not_inference, _integer, _ops


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


def _tables_and_keys(op: str, slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor,
                     offsets: Optional[List[int]]) -> None:
    """The fakes' checks of a multi-table search: 1-D integer keys, each table's slots, and
    CSR ``offsets`` over the keys (None: bounds on the device, checked by the caller)."""
    index_dtype(op, "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: f"{op}: keys must be 1-D, got shape {shape_of(keys)}")
    for t, (table_keys, table_rows) in enumerate(zip(slot_keys, slot_rows)):
        hash_table_slots(f"{op}: table {t}", table_keys, table_rows)
    if offsets is not None:
        csr_offsets(op, offsets, keys.numel())


@torch.library.register_fake("sparsekit::hash_table_find_tables")
def _hash_table_find_tables_fake(slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor,
                                 offsets: List[int]) -> Tensor:
    op = "hash_table_find_tables"
    same_device(op, keys=keys, slot_keys=slot_keys, slot_rows=slot_rows)
    torch._check(len(slot_keys) == len(slot_rows) and len(offsets) == len(slot_keys) + 1,
                 lambda: f"{op}: one slot_keys, slot_rows and offsets entry per table (and one more offset)")
    _tables_and_keys(op, slot_keys, slot_rows, keys, offsets)
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


def _segment_bounds(op: str, bounds: Tensor, num_segments: int, like: Tensor) -> None:
    """The fakes' check of a segment-bounds tensor (its values are the kernel's to judge)."""
    torch._check(bounds.dtype == torch.int64 and bounds.dim() == 1 and bounds.shape[0] == num_segments + 1,
                 lambda: f"{op}: bounds must be a 1-D int64 tensor of {num_segments + 1} entries (one more than "
                         f"segments), got a {bounds.dtype} tensor of shape {shape_of(bounds)}")
    same_device(op, bounds=bounds, rows=like)


@torch.library.register_fake("sparsekit::lookup_rows")
def _lookup_rows_fake(slot_keys: List[Tensor], slot_rows: List[Tensor], keys: Tensor, bounds: Tensor,
                      segment_tables: List[int], direct_rows: List[int], write_rows: bool = True) -> Tuple[Tensor, Tensor]:
    op = "lookup_rows"
    same_device(op, keys=keys, slot_keys=slot_keys, slot_rows=slot_rows)
    torch._check(len(slot_keys) == len(slot_rows), lambda: f"{op}: one slot_keys and slot_rows entry per table")
    torch._check(len(segment_tables) == len(direct_rows),
                 lambda: f"{op}: one segment_tables and direct_rows entry per segment")
    _tables_and_keys(op, slot_keys, slot_rows, keys, None)
    _segment_bounds(op, bounds, len(segment_tables), keys)
    torch._check(write_rows or all(t == -1 for t in segment_tables),
                 lambda: f"{op}: write_rows=False needs every segment direct")
    return keys.new_empty(keys.shape if write_rows else (0,), dtype=torch.int64), keys.new_empty(3, dtype=torch.int64)


@torch.library.register_fake("sparsekit::hash_table_touch_tables_")
def _hash_table_touch_tables_fake(last_seen: List[Tensor], count: List[Tensor], rows: Tensor, bounds: Tensor,
                                  segment_tables: List[int], sizes: List[int], clocks: List[int],
                                  errors: Optional[Tensor] = None) -> None:
    op = "hash_table_touch_tables_"
    same_device(op, rows=rows, last_seen=last_seen, count=count)
    torch._check(len(last_seen) == len(count) == len(clocks) == len(sizes),
                 lambda: f"{op}: one last_seen, count, size and clock entry per table")
    torch._check(rows.dtype == torch.int64 and rows.dim() == 1,
                 lambda: f"{op}: rows must be 1-D int64, got {rows.dtype} with shape {shape_of(rows)}")
    _segment_bounds(op, bounds, len(segment_tables), rows)
    if errors is not None:
        torch._check(errors.dtype == torch.int64 and errors.dim() == 1 and errors.shape[0] == 2,
                     lambda: f"{op}: errors must be a contiguous int64 tensor [2], got {errors.dtype} of shape "
                             f"{shape_of(errors)}")
        same_device(op, errors=errors, rows=rows)
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

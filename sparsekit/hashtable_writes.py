"""The writes under a :class:`sparsekit.hashtable.HashTable`'s calls, as a mixin of it: scoring
rows, placing keys at rows, removing keys (rows kept ``0 .. len - 1``), rebuilding the slots,
clearing, and undoing an insert. Each is idempotent and finished again when interrupted
(:func:`_finished`), or undone, so size, slots and rows never disagree; :func:`_locked` makes
each public call of a table atomic under its lock.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from . import ops

if TYPE_CHECKING:
    from .hashtable import _InsertPlan


def _finished(writes: Callable[..., None], *args: Any) -> None:
    """Runs ``writes(*args)``, idempotent writes of a table; interrupted halfway, runs them
    again before the error goes on, so size, slots and rows never disagree."""
    try:
        writes(*args)
    except BaseException:
        writes(*args)
        raise


def _locked(method):
    """Runs a :class:`HashTable` method under the table's re-entrant lock: the kernels release
    the GIL and a call keeps Python state between them, so each public call must be atomic."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # Dynamo cannot enter a lock ("Unsupported context manager: RLock"): a table's
            # call in compiled code (fullgraph=True refused it, the default mode broke the
            # graph) is traced as before the lock; a compiled graph holds no Python lock.
            return method(self, *args, **kwargs)
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class _TableWrites:
    """A HashTable's writes (see the module); uses its tensors, size, tombstones and clock."""

    def _score(self, rows: Tensor, counts: Optional[Tensor]) -> None:
        """Stamps distinct ``rows`` with the clock and adds ``counts`` (None: one each). A
        row given a key this step counts from 0 (:meth:`_place` cleared it)."""
        if rows.numel() == 0:
            return
        if counts is None and rows.device.type == "cpu":
            # One pass stamps and counts every row, where the ops below take four.
            torch.ops.sparsekit.hash_table_score_tables_([self._last_seen], [self._count], rows,
                                                         [0, rows.numel()], [self._clock])
            return
        self._last_seen.index_fill_(0, rows, self._clock)
        current = self._count.index_select(0, rows)
        self._count.index_copy_(0, rows, current.add_(1) if counts is None else current.add_(counts))

    def _undo_insert(self, plan: _InsertPlan, size: int, tombstones: int, touched: Tensor,
                     saved: Tuple[Tensor, Tensor]) -> None:
        """Puts the table back as it was before :meth:`_commit_insert` of ``plan`` began,
        whatever part of it ran: the new keys leave their slots, the victims get theirs
        (and their rows' keys) back, the scores of the rows it wrote are restored."""
        if plan.new_keys.numel() > 0:
            ops.hash_table_erase_(self._slot_keys, self._slot_rows, plan.new_keys)  # absent ones are skipped
        if plan.victims.numel() > 0:
            self._row_keys[plan.victims] = plan.evicted_keys.long()
            gone = ops.hash_table_find(self._slot_keys, self._slot_rows, plan.evicted_keys) < 0
            if bool(gone.any()):
                ops.hash_table_insert_absent_(self._slot_keys, self._slot_rows, plan.evicted_keys[gone],
                                              plan.victims[gone])
        self._last_seen.index_copy_(0, touched, saved[0])
        self._count.index_copy_(0, touched, saved[1])
        self._size = size
        # An upper bound, as everywhere: the erases above may have left tombstones.
        self._tombstones = tombstones + plan.new_keys.numel() + plan.victims.numel()

    def _place(self, keys: Tensor, rows: Tensor) -> None:
        """Stores distinct absent ``keys`` at ``rows`` that no key holds (never used, or
        freed by an erase this step) and counts them in ``len(self)``. Their counts start
        from 0 (an evicted key's count is cleared); the caller scores them."""
        # The rows' own entries first: no key holds those rows, so if a write fails, no key
        # was made findable at a row whose entries say otherwise.
        self._row_keys[rows] = keys.long()
        self._count.index_fill_(0, rows, 0)
        # The table's own size and rows: the op needs no host sync to check them.
        ops.hash_table_insert_absent_(self._slot_keys, self._slot_rows, keys, rows, self._size)
        self._size += keys.numel()

    def _remove(self, keys: Tensor) -> None:
        """Removes distinct ``keys`` (absent ones are skipped) and moves the keys of the last
        rows into the freed ones, so rows in use stay ``0 .. len - 1``: rows change. For
        tables whose rows index nothing else (a layer's pending admissions)."""
        if keys.numel() == 0 or self._size == 0:
            return
        rows = self.find(keys)
        rows = rows[rows >= 0]
        removed = rows.numel()
        if removed == 0:
            return
        size, new_size = self._size, self._size - removed
        gone = torch.zeros(size, dtype=torch.bool, device=self.device)
        gone[rows] = True
        holes = gone[:new_size].nonzero().squeeze(1)
        movers = (~gone[new_size:]).nonzero().squeeze(1) + new_size
        # Everything the writes below need, read first: they are then idempotent, and an
        # interrupted removal (a KeyboardInterrupt between two writes had left keys out of
        # their slots, or in two rows) is finished by running them again.
        removed_keys = self._row_keys[rows]
        moved = (self._row_keys[movers], self._last_seen[movers], self._count[movers]) if holes.numel() > 0 else None
        _finished(self._apply_remove, removed_keys, holes, moved, size, new_size)
        self._rebuild_if_worn()

    def _apply_remove(self, removed_keys: Tensor, holes: Tensor, moved: Optional[Tuple[Tensor, Tensor, Tensor]],
                      size: int, new_size: int) -> None:
        """The writes of :meth:`_remove` (see there); running them twice gives what once does."""
        ops.hash_table_erase_(self._slot_keys, self._slot_rows, removed_keys)
        self._tombstones += removed_keys.numel()
        if moved is not None:
            moved_keys, moved_last_seen, moved_count = moved
            ops.hash_table_erase_(self._slot_keys, self._slot_rows, moved_keys)
            self._tombstones += holes.numel()
            self._size = new_size  # the movers' rows are free from here: the slots count no key past new_size
            ops.hash_table_insert_absent_(self._slot_keys, self._slot_rows, moved_keys, holes,
                                          new_size - holes.numel())
            self._row_keys[holes] = moved_keys
            self._last_seen[holes] = moved_last_seen
            self._count[holes] = moved_count
        self._last_seen[new_size:size] = 0
        self._count[new_size:size] = 0
        self._size = new_size

    def _rebuild_if_worn(self) -> None:
        """Drops the tombstones once they may fill more than a quarter of the slots (a
        count that is an upper bound), which would make probes long."""
        if self._tombstones * 4 > self.num_slots:
            self._rebuild()

    def _rebuild(self) -> None:
        """Re-places every live key into cleared slots: drops the tombstones. Interrupted
        between the clearing and the placing (which left every key unfindable), it places
        them again before the error goes on: the rows' keys are the truth it rebuilds from."""
        _finished(self._place_live_keys)

    def _place_live_keys(self) -> None:
        self._slot_rows.fill_(-1)
        if self._size > 0:
            ops.hash_table_insert_absent_(self._slot_keys, self._slot_rows, self._row_keys[:self._size],
                                          torch.arange(self._size, dtype=torch.int64, device=self.device), 0)
        self._tombstones = 0

    def _clear_all(self) -> None:
        self._slot_rows.fill_(-1)
        self._slot_keys.zero_()
        self._last_seen.zero_()
        self._count.zero_()
        self._size = 0
        self._tombstones = 0

"""A key -> row hash table over plain tensors, on CPU or CUDA, optionally dynamic.

Arbitrary int64 (or int32) keys map to dense rows ``0, 1, 2, ...`` of an embedding weight,
by linear probing over ``S`` slots, ``S`` the smallest power of two ``>= 2 * capacity``
(and ``>= 16``): a full table is at most half occupied, so probes stay short. An empty slot
is marked in ``slot_rows`` (-1), so every key value is valid. Dynamic tables
(``eviction="lru"|"lfu"``) erase keys to tombstones (-2); once tombstones reach a quarter of
the slots the table is rebuilt in place, so probe lengths stay bounded. Per row the table
also keeps its key (``row_keys``), last touch (``last_seen``) and ``count``, for export,
eviction and checkpoints. Its low-level writes are in :mod:`sparsekit.hashtable_writes`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops
from ._checks import allocation, dense_layout, device_argument, integer_argument, size_argument, tensor_integer
from .allocator import table_full, table_zeros
from .hashtable_writes import _finished, _locked, _TableWrites

__all__ = ["HashTable", "HashTableFullError"]

_KEY_DTYPES = (torch.int64, torch.int32)
# The largest clock (and layer total) a state may load: a step adds one, so an int64 clock
# never overflows from there.
_MAX_CLOCK = 2**62
_EVICTION_POLICIES = (None, "lru", "lfu")


class HashTableFullError(RuntimeError):
    """An insert needed more rows than the table's capacity; the table was left unchanged."""


def _slot_count(capacity: int) -> int:
    slots = 16
    while slots < 2 * capacity:
        slots <<= 1
    return slots


_INT64_MAX = 2**63 - 1


class _InsertPlan(NamedTuple):
    """What an insert will do, worked out without changing the table (see ``HashTable._plan_insert``)."""

    shape: Tuple[int, ...]
    inverse: Optional[Tensor]  # [n]: flattened key -> its entry of unique_keys; None: the keys are distinct
    counts: Optional[Tensor]   # [U]: occurrences of each unique key in the call; None: one each
    rows: Tensor          # [U]: the row of each unique key, -1 where new
    missing: Tensor       # [U] bool: the key is new
    new_keys: Tensor      # [N] the new keys, in order of first occurrence
    new_rows: Tensor      # [N] their rows: the victims' rows ascending, then size, size + 1, ...
    victims: Tensor       # [E] rows evicted for them, ascending
    evicted_keys: Tensor  # [E] the keys of those rows (int64)


class _CheckedState(NamedTuple):
    """A saved state that ``HashTable._check_state`` found loadable, ready for ``_load_checked``."""

    keys: Tensor       # [n] distinct, of the table's key_dtype, on its device
    last_seen: Tensor  # [n] int64, on its device
    count: Tensor      # [n] int64, on its device
    clock: int


def _check_state_of(table: "HashTable", state: Any, where: str) -> _CheckedState:
    """``table._check_state(state)``, its error led by ``where`` (the layer, and which of its
    tables), for the layers' loads that check every table before they change any."""
    try:
        return table._check_state(state)
    except (ValueError, TypeError, HashTableFullError) as error:
        raise type(error)(f"{where}: {error}") from error


def _check_pending_of(table: _CheckedState, pending: _CheckedState, where: str) -> None:
    """A layer's pending admissions ``pending`` against its table's state ``table`` (both
    checked): a pending key has been seen in at least one step and holds no row yet."""
    if pending.keys.numel() == 0:
        return
    if bool((pending.count < 1).any()):
        raise ValueError(f"{where}: a pending key's count (the steps it was seen in) must be at least 1, got "
                         f"{int(pending.count.min())}; the state is damaged")
    both = torch.isin(pending.keys, table.keys)
    if bool(both.any()):
        raise ValueError(f"{where}: key {int(pending.keys[both][0])} is both pending admission and in the table; "
                         "the state is damaged")


def _find_in_tables(tables: Sequence["HashTable"], keys: Tensor, offsets: List[int]) -> Tensor:
    """Rows of ``keys[offsets[t]:offsets[t + 1]]`` in ``tables[t]`` for every t (-1: absent);
    nothing is changed. On the CPU one op for all tables (an EmbeddingBagCollection's owner
    step would otherwise pay a dispatch and its Python per table); elsewhere table by table."""
    if keys.device.type == "cpu":
        return torch.ops.sparsekit.hash_table_find_tables([t._slot_keys for t in tables],
                                                          [t._slot_rows for t in tables], keys, offsets)
    parts = [ops.hash_table_find(t._slot_keys, t._slot_rows, keys[a:b])
             for t, a, b in zip(tables, offsets, offsets[1:])]
    return torch.cat(parts) if parts else keys.new_empty(0, dtype=torch.int64)


def _touch_tables(tables: Sequence["HashTable"], rows: Tensor, offsets: List[int]) -> None:
    """Scores distinct present rows, ``rows[offsets[t]:offsets[t + 1]]`` of ``tables[t]`` (-1
    skipped), as an insert of present keys would: ``last_seen`` becomes the clock, ``count``
    grows by one. One op for all tables (on CUDA one host sync)."""
    if rows.device.type in ("cpu", "cuda"):
        torch.ops.sparsekit.hash_table_score_tables_([t._last_seen for t in tables], [t._count for t in tables],
                                                     rows, offsets, [t._clock for t in tables])
        return
    for table, a, b in zip(tables, offsets, offsets[1:]):
        part = rows[a:b]
        part = part[part >= 0]
        table._score(part, None)


def _grow_tables(tables: Sequence["HashTable"], keys: Tensor, offsets: List[int]) -> None:
    """Gives the distinct absent ``keys[offsets[t]:offsets[t + 1]]`` of ``tables[t]`` the
    table's next rows in order, as :meth:`HashTable._place` would (the caller checked they fit
    and scores them)."""
    sizes = [t._size for t in tables]
    try:
        if keys.device.type == "cpu":
            torch.ops.sparsekit.hash_table_place_tables_(
                [t._slot_keys for t in tables], [t._slot_rows for t in tables], [t._row_keys for t in tables],
                [t._count for t in tables], keys, offsets, sizes)
            for table, a, b in zip(tables, offsets, offsets[1:]):
                table._size += b - a
        else:
            for table, a, b in zip(tables, offsets, offsets[1:]):
                if b > a:
                    table._place(keys[a:b], torch.arange(table._size, table._size + b - a, dtype=torch.int64,
                                                         device=keys.device))
    except BaseException:
        # Interrupted after the op placed the keys (a KeyboardInterrupt before the sizes
        # caught up; elsewhere than the CPU, between two tables' placings or inside one):
        # the slots held keys at rows past len(table), which later inserts handed out
        # again. Take them back out: nothing changed, as when the op refuses.
        for table, size, a, b in zip(tables, sizes, offsets, offsets[1:]):
            if b > a:
                ops.hash_table_erase_(table._slot_keys, table._slot_rows, keys[a:b])
                table._count[size:size + b - a] = 0
                table._tombstones += b - a
            table._size = size
            table._rebuild_if_worn()
        raise


# The attributes of a HashTable that hold its tensors.
_TABLE_TENSORS = ("_slot_keys", "_slot_rows", "_row_keys", "_last_seen", "_count")


class HashTable(_TableWrites):
    """Find-or-insert map from keys to consecutive row ids, stored in plain tensors.

    Row ids are deterministic: new keys get ``len(table), len(table) + 1, ...`` in order of
    first occurrence in the inserted batch, on every device.

    Every key carries scores, whether or not eviction is on: ``last_seen`` (the
    :attr:`clock` when it was last inserted or touched) and ``count`` (how many times it
    occurred in the calls that inserted or touched it).

    Args:
        capacity: the most keys the table may hold (the rows of the embedding it indexes).
        key_dtype: ``torch.int64`` (default) or ``torch.int32``; the dtype of the keys
            :meth:`insert` takes and :meth:`export` returns. Keys are stored as int64.
        device: where the table lives (default: the current default device).
        eviction: ``None`` (default: a full table raises :class:`HashTableFullError`),
            ``"lru"`` or ``"lfu"``: an insert that does not fit first evicts exactly as many
            keys as needed, never one of its own, those with the lowest score (lru:
            ``last_seen``; lfu: ``count``, then ``last_seen``), ties broken by the smaller
            key. The new keys, in order of first occurrence, take the freed rows in
            ascending order, then rows ``len(table), len(table) + 1, ...``.

    Example::

        table = HashTable(1000)
        rows = table.insert(torch.tensor([42, -7, 42]))   # tensor([0, 1, 0])
        table.find(torch.tensor([-7, 5]))                  # tensor([1, -1])

        lru = HashTable(2, eviction="lru")
        lru.insert(torch.tensor([1, 2])); lru.tick()
        lru.insert(torch.tensor([1]));    lru.tick()
        lru.insert(torch.tensor([3]), return_evicted=True)
        # (tensor([1]), tensor([2]), tensor([1])): key 2 (last seen at clock 0) made room
    """

    def __init__(
        self,
        capacity: int,
        *,
        key_dtype: torch.dtype = torch.int64,
        device: Optional[Union[torch.device, str]] = None,
        eviction: Optional[str] = None,
    ) -> None:
        capacity = size_argument("HashTable", "capacity", capacity, minimum=1)
        if key_dtype not in _KEY_DTYPES:
            raise TypeError(f"HashTable: key_dtype must be torch.int64 or torch.int32, got {key_dtype}")
        if eviction not in _EVICTION_POLICIES:
            raise ValueError(f"HashTable: eviction must be None, 'lru' or 'lfu', got {eviction!r}")
        device_argument("HashTable", device)
        self._capacity = capacity
        self._key_dtype = key_dtype
        self._eviction = eviction
        slots = _slot_count(capacity)
        with allocation(f"HashTable: capacity={capacity} ({slots} slots, 2 arrays)", (slots,), torch.int64, device):
            self._slot_keys = table_zeros(slots, torch.int64, device)
            self._slot_rows = table_full((slots,), -1, torch.int64, device)
        with allocation(f"HashTable: capacity={capacity} (keys and scores of every row)", (3, capacity),
                        torch.int64, device):
            self._row_keys = table_zeros(capacity, torch.int64, device)
            self._last_seen = table_zeros(capacity, torch.int64, device)
            self._count = table_zeros(capacity, torch.int64, device)
        self._size = 0
        self._tombstones = 0
        self._clock = 0
        self._lock = threading.RLock()

    # -- properties -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The most keys the table may hold."""
        return self._capacity

    @property
    def num_slots(self) -> int:
        """Slots of the open-addressing array (a power of two, ``>= 2 * capacity``)."""
        return self._slot_keys.numel()

    @property
    def key_dtype(self) -> torch.dtype:
        return self._key_dtype

    @property
    def eviction(self) -> Optional[str]:
        """``None``, ``"lru"`` or ``"lfu"``."""
        return self._eviction

    @property
    def device(self) -> torch.device:
        return self._slot_keys.device

    @property
    def clock(self) -> int:
        """The table's clock: starts at 0, :meth:`tick` adds 1; inserts and touches stamp keys with it."""
        return self._clock

    @_locked
    def tick(self) -> int:
        """Advances :attr:`clock` by one (the layers tick once per training forward); returns the new clock."""
        self._clock += 1
        return self._clock

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (f"HashTable(size={self._size}, capacity={self._capacity}, key_dtype={self._key_dtype}, "
                f"eviction={self._eviction!r}, clock={self._clock}, device={self.device})")

    def __getstate__(self) -> Dict[str, Any]:
        # A lock is no state (and pickle, deepcopy and torch.multiprocessing refuse one).
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- lookups ----------------------------------------------------------------------

    def _check_keys(self, keys: Tensor, method: str, *, exact_dtype: bool) -> None:
        if not isinstance(keys, Tensor):
            raise TypeError(f"HashTable.{method}: keys must be a tensor, got {type(keys).__name__}")
        dense_layout(f"HashTable.{method}: keys", keys)
        if exact_dtype and keys.dtype != self._key_dtype:
            raise TypeError(f"HashTable.{method}: keys are {keys.dtype} but the table's key_dtype is "
                            f"{self._key_dtype}; cast them with .to({self._key_dtype})")
        if not exact_dtype and keys.dtype not in _KEY_DTYPES:
            raise TypeError(f"HashTable.{method}: keys must be int64 or int32, got {keys.dtype}")
        if keys.device != self.device:
            raise RuntimeError(f"HashTable.{method}: keys are on {keys.device} but the table is on "
                               f"{self.device}; move them with .to(table.device)")

    @_locked
    def find(self, keys: Tensor) -> Tensor:
        """Rows of ``keys``; the table (scores included) is not changed.

        Args:
            keys: int64 or int32 tensor of any shape, on the table's device.

        Returns:
            int64 rows with the shape of ``keys``, ``-1`` where a key is absent.
        """
        self._check_keys(keys, "find", exact_dtype=False)
        return ops.hash_table_find(self._slot_keys, self._slot_rows, keys)

    @_locked
    def touch(self, keys: Tensor) -> Tensor:
        """A :meth:`find` that also scores the present keys (for training).

        A present key's ``last_seen`` becomes :attr:`clock` and its ``count`` grows by its
        occurrences in ``keys``; absent keys are not inserted.

        Returns:
            int64 rows with the shape of ``keys``, ``-1`` where a key is absent.
        """
        self._check_keys(keys, "touch", exact_dtype=False)
        if keys.numel() == 0:
            return torch.empty(keys.shape, dtype=torch.int64, device=self.device)
        unique_keys, inverse, counts = ops.unique(keys.reshape(-1), return_inverse=True, return_counts=True)
        rows = self.find(unique_keys)
        found = rows >= 0
        self._score(rows[found], counts[found])
        return rows[inverse].view(keys.shape)

    @_locked
    def scores(self, keys: Tensor) -> Tuple[Tensor, Tensor]:
        """``(last_seen, count)`` of ``keys`` (int64, shape of ``keys``), ``-1`` for absent keys."""
        self._check_keys(keys, "scores", exact_dtype=False)
        rows = self.find(keys)
        found = rows >= 0
        if self._capacity == 0:
            absent = torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
            return absent, absent.clone()
        safe = torch.where(found, rows, 0)
        last_seen = torch.where(found, self._last_seen[safe], -1)
        count = torch.where(found, self._count[safe], -1)
        return last_seen, count

    # -- inserts and eviction -----------------------------------------------------------

    @_locked
    def insert(self, keys: Tensor, return_evicted: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
        """Find-or-insert: rows of ``keys``, giving absent keys rows.

        New keys get consecutive rows ``len(self), len(self) + 1, ...`` in order of first
        occurrence in ``keys`` (read flattened). With eviction, when they do not fit, the
        rows of exactly as many evicted keys are reused first (see the class). Every key of
        the call is scored: ``last_seen`` = :attr:`clock`, ``count`` += its occurrences (a
        new key starts from them).

        On CUDA this syncs with the host twice without eviction (unique's output size, and
        the count of new keys, which the capacity check needs before anything is written);
        an insert that evicts adds the victim selection's few passes.

        Args:
            keys: tensor of ``key_dtype``, any shape, on the table's device.
            return_evicted: also return the evicted pairs.

        Returns:
            int64 rows with the shape of ``keys``; with ``return_evicted``, ``(rows,
            evicted_keys, evicted_rows)``, the evicted pairs in ascending row order
            (``evicted_keys`` of ``key_dtype``).

        Raises:
            HashTableFullError: without eviction, the new keys do not fit in ``capacity``;
                with it, the call itself holds more than ``capacity`` distinct keys.
                Nothing is changed (keys, rows, scores, clock).
            TypeError: ``return_evicted`` not a bool (1 or None would silently pick a
                return type), or keys not a tensor of ``key_dtype``.
        """
        return_evicted = ops._flag("HashTable.insert", "return_evicted", return_evicted)
        self._check_keys(keys, "insert", exact_dtype=True)
        plan = self._plan_insert(keys)
        rows = self._commit_insert(plan)
        if return_evicted:
            return rows, plan.evicted_keys.to(self._key_dtype), plan.victims
        return rows

    def _plan_insert(self, keys: Tensor, distinct: bool = False) -> _InsertPlan:
        """Works out an insert without changing anything; raises HashTableFullError when it
        cannot be done. ``distinct``: the caller vouches that the keys are distinct (a
        layer's owner dedups them already), which saves a unique (and its host sync)."""
        device = self.device
        flat = keys.reshape(-1)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        if flat.numel() == 0:
            return _InsertPlan(tuple(keys.shape), empty, empty, empty, empty.bool(), flat, empty, empty, empty)
        if distinct:
            unique_keys, inverse, counts = flat, None, None
        else:
            unique_keys, inverse, counts = ops.unique(flat, return_inverse=True, return_counts=True)
        rows = self.find(unique_keys)
        missing = rows < 0
        # Boolean indexing keeps order, so new keys stay in order of first occurrence.
        new_keys = unique_keys[missing]
        num_new = new_keys.numel()
        free = self._capacity - self._size
        if num_new > free and (self._eviction is None or unique_keys.numel() > self._capacity):
            if self._eviction is None:
                raise HashTableFullError(
                    f"HashTable.insert: {num_new} new keys do not fit: the table holds {self._size} of its "
                    f"capacity {self._capacity} ({free} free); nothing was inserted. Build the table with a larger "
                    "capacity or with eviction='lru'|'lfu'")
            raise HashTableFullError(
                f"HashTable.insert: the call holds {unique_keys.numel()} distinct keys, more than the table's "
                f"capacity {self._capacity}, so eviction cannot make room (a key of the call is never evicted); "
                "nothing was inserted. Insert fewer keys per call or build a larger table")
        num_evict = max(0, num_new - free)
        victims = empty
        if num_evict > 0:
            eligible = torch.ones(self._size, dtype=torch.bool, device=device)
            eligible[rows[~missing]] = False  # never a key of this call
            size = self._size
            columns = [self._last_seen[:size], self._row_keys[:size]] if self._eviction == "lru" else \
                [self._count[:size], self._last_seen[:size], self._row_keys[:size]]
            victims = ops.select_smallest(columns, eligible, num_evict)
        new_rows = torch.cat([victims, torch.arange(self._size, self._size + num_new - num_evict, dtype=torch.int64,
                                                    device=device)])
        evicted_keys = self._row_keys[victims] if num_evict > 0 else empty
        return _InsertPlan(tuple(keys.shape), inverse, counts, rows, missing, new_keys, new_rows, victims,
                           evicted_keys)

    def _commit_insert(self, plan: _InsertPlan) -> Tensor:
        """Carries out a plan of :meth:`_plan_insert` (nothing in it can fail for lack of room).
        All or nothing even when interrupted halfway: erase, placement and scoring are undone
        (:meth:`_undo_insert`) before the error goes on."""
        if plan.rows.numel() == 0:
            return torch.empty(plan.shape, dtype=torch.int64, device=self.device)
        num_evict = plan.victims.numel()
        num_new = plan.new_keys.numel()
        rows = plan.rows
        size, tombstones = self._size, self._tombstones
        # The rows this call writes (present keys' scores; new rows' keys and scores), kept to
        # undo it: every key's row once the new ones have theirs. A masked_scatter, not a
        # boolean selection, which on CUDA would wait for the device (placement syncs never).
        if num_new > 0:
            rows = rows.masked_scatter(plan.missing, plan.new_rows)
        saved = (self._last_seen.index_select(0, rows), self._count.index_select(0, rows))
        try:
            if num_evict > 0:
                ops.hash_table_erase_(self._slot_keys, self._slot_rows, plan.evicted_keys)
                self._tombstones += num_evict
                self._size -= num_evict
            if num_new > 0:
                self._place(plan.new_keys, plan.new_rows)
            self._score(rows, plan.counts)
            # In here too: a rebuild interrupted (it then re-places the live keys) must not
            # leave an insert that raised but kept its keys.
            self._rebuild_if_worn()
        except BaseException:
            self._undo_insert(plan, size, tombstones, rows, saved)
            raise
        return (rows if plan.inverse is None else rows[plan.inverse]).view(plan.shape)

    @_locked
    def export(self, min_last_seen: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """The entries, ordered by row.

        Args:
            min_last_seen: None: every key. An int: only keys last seen at a clock
                ``>= min_last_seen`` (an incremental dump: pass the :attr:`clock` of the
                previous dump).

        Returns:
            ``(keys, rows)``: keys of ``key_dtype`` and their int64 rows, ascending, copies
            that later inserts leave as they are. Without a bound ``rows = arange(len(self))``.
        """
        keys = self._row_keys[:self._size]
        rows = torch.arange(self._size, dtype=torch.int64, device=self.device)
        if min_last_seen is not None:
            min_last_seen = integer_argument("HashTable.export", "min_last_seen", min_last_seen, optional=True)
            # Clocks are int64: a bound past either end selects no key or every key (as a
            # Python comparison would), where torch would overflow converting it.
            if min_last_seen > _INT64_MAX:
                recent = torch.zeros(self._size, dtype=torch.bool, device=self.device)
            else:
                recent = self._last_seen[:self._size] >= max(min_last_seen, -_INT64_MAX - 1)
            keys, rows = keys[recent], rows[recent]
        # A copy, not a view of the table's keys: later inserts must not change a dump.
        return keys.to(self._key_dtype, copy=min_last_seen is None), rows

    @_locked
    def clear(self) -> None:
        """Removes every key (and its scores); capacity, dtype, policy, clock and device stay.
        Interrupted halfway (a KeyboardInterrupt between its writes had left ``len`` keys that
        no find reached), it finishes before the error goes on."""
        _finished(self._clear_all)

    # -- persistence and devices ------------------------------------------------------

    @_locked
    def state_dict(self) -> Dict[str, Tensor]:
        """Plain tensors that :func:`torch.load` reads with ``weights_only=True``.

        Returns:
            ``{"keys": keys in row order (key_dtype, on the table's device),
            "capacity": int64 scalar, "last_seen": int64 [len], "count": int64 [len]
            (row order), "clock": int64 scalar}``. The slot layout is not saved, so a state
            loads into a table of any capacity that can hold it, on any device.
        """
        keys, _ = self.export()
        return {"keys": keys, "capacity": torch.tensor(self._capacity, dtype=torch.int64),
                "last_seen": self._last_seen[:self._size].clone(), "count": self._count[:self._size].clone(),
                "clock": torch.tensor(self._clock, dtype=torch.int64)}

    @_locked
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replaces the contents with a saved state: key ``keys[i]`` gets row ``i`` and its scores.

        The table keeps its own capacity, key dtype, policy and device. A state without
        scores (an older checkpoint) loads with zero scores and clock 0. Everything is
        checked before the table changes: a state that raises leaves it as it was.

        Raises:
            HashTableFullError: the saved keys do not fit in this table's capacity.
            ValueError: the state has no ``keys``, an entry is a meta tensor (no data), the
                keys are not distinct, or the scores or clock do not match them.
            TypeError: the state is not a dict, or the saved keys are int64 and the table's
                ``key_dtype`` is int32.
        """
        self._load_checked(self._check_state(state_dict))

    def _check_state(self, state_dict: Dict[str, Any]) -> _CheckedState:
        """Every check of :meth:`load_state_dict`, nothing written: the state ready to load
        on this table. A layer checks all its tables' states this way before it changes any."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"HashTable.load_state_dict: expected the dict HashTable.state_dict() returns, got "
                            f"{type(state_dict).__name__}")
        if "keys" not in state_dict:
            raise ValueError("HashTable.load_state_dict: the state has no 'keys' entry; pass what "
                             "HashTable.state_dict() returned")
        for name in ("keys", "last_seen", "count", "clock"):
            # Nor does a sparse one fail before the table is cleared for the load.
            if isinstance(state_dict.get(name), Tensor) and state_dict[name].layout != torch.strided:
                raise ValueError(f"HashTable.load_state_dict: '{name}' is a {state_dict[name].layout} tensor; "
                                 "the state holds dense (strided) tensors")
            # A meta tensor passes the dtype and shape checks but fails deep inside the first copy.
            if isinstance(state_dict.get(name), Tensor) and state_dict[name].is_meta:
                raise ValueError(f"HashTable.load_state_dict: '{name}' is a meta tensor, which holds no data; "
                                 "pass a state with real tensors (e.g. torch.load(..., map_location='cpu'))")
        keys = state_dict["keys"]
        if not isinstance(keys, Tensor) or keys.dim() != 1 or keys.dtype not in _KEY_DTYPES:
            raise ValueError("HashTable.load_state_dict: 'keys' must be a 1-D int64 or int32 tensor")
        if keys.dtype != self._key_dtype and not (keys.dtype == torch.int32 and self._key_dtype == torch.int64):
            raise TypeError(f"HashTable.load_state_dict: saved keys are {keys.dtype} but the table's key_dtype "
                            f"is {self._key_dtype}; build the table with key_dtype={keys.dtype}")
        if keys.numel() > self._capacity:
            raise HashTableFullError(
                f"HashTable.load_state_dict: {keys.numel()} saved keys do not fit in the table's capacity "
                f"{self._capacity} (it holds {self._size}); nothing was loaded. Build the table with a "
                "larger capacity")
        scores = []
        for name in ("last_seen", "count"):
            value = state_dict.get(name)
            if value is None:
                value = torch.zeros(keys.numel(), dtype=torch.int64)
            if not isinstance(value, Tensor) or value.dtype != torch.int64 or tuple(value.shape) != (keys.numel(),):
                raise ValueError(f"HashTable.load_state_dict: '{name}' must be int64 [{keys.numel()}] like 'keys', "
                                 f"got {getattr(value, 'dtype', type(value).__name__)} "
                                 f"{tuple(getattr(value, 'shape', ()))}")
            scores.append(value.to(self.device))
        clock = tensor_integer(state_dict.get("clock", 0))
        with contextlib.suppress(TypeError):  # a numpy integer too; anything else is refused below
            clock = integer_argument("HashTable.load_state_dict", "clock", clock)
        # Bounded well inside int64: every training step adds one, and an int64 past its end
        # would fail a later insert after it placed its keys.
        if isinstance(clock, bool) or not isinstance(clock, int) or not 0 <= clock < _MAX_CLOCK:
            raise ValueError(f"HashTable.load_state_dict: 'clock' must be a non-negative int64 scalar below 2**62, "
                             f"got {clock!r}")
        # Scores a table can hold: a count of occurrences (0 for a state saved without
        # scores), and a last sight at a clock reading already passed. A negative one would
        # read as an absent key's -1 in scores() and skew LRU / LFU eviction.
        last_seen, count = scores
        if keys.numel() > 0:
            wrong = torch.stack([(count < 0).any(), (count >= _MAX_CLOCK).any(), (last_seen < 0).any(),
                                 (last_seen > clock).any()]).tolist()
            if any(wrong):
                # A count, as the clock, loads only below 2**62: each insert or touch adds one,
                # and past int64's end it would wrap to a negative count, which LFU evicts first.
                what = "'count' holds a negative count" if wrong[0] else \
                    "'count' holds a count of 2**62 or more" if wrong[1] else \
                    "'last_seen' holds a negative clock reading" if wrong[2] else \
                    f"'last_seen' holds a clock reading past the state's clock {clock}"
                raise ValueError(f"HashTable.load_state_dict: {what} (count in [{int(count.min())}, "
                                 f"{int(count.max())}], last_seen in "
                                 f"[{int(last_seen.min())}, {int(last_seen.max())}]); the state is damaged")
        keys = keys.to(device=self.device, dtype=self._key_dtype)
        if keys.numel() > 0 and ops.unique(keys, return_inverse=False).numel() != keys.numel():
            raise ValueError("HashTable.load_state_dict: the saved keys are not distinct")
        return _CheckedState(keys, scores[0], scores[1], clock)

    def _load_checked(self, checked: _CheckedState) -> None:
        """Replaces the contents with a state of :meth:`_check_state`; nothing here can fail
        for the state's sake (its keys are distinct, of ``key_dtype``, and fit)."""
        self.clear()
        self.insert(checked.keys)
        self._last_seen[:checked.keys.numel()] = checked.last_seen
        self._count[:checked.keys.numel()] = checked.count
        self._clock = checked.clock

    def _tensors(self) -> Tuple[Tensor, ...]:
        """The tensors that hold the table: its slots, and its rows' keys and scores."""
        return tuple(getattr(self, name) for name in _TABLE_TENSORS)

    @_locked
    def to(self, device: Union[torch.device, str]) -> "HashTable":
        """The table on ``device``: ``self`` when already there, else a copy.

        The slot layout depends only on the keys, so the slot arrays move as they are. A
        table on the meta device holds no data: it becomes an empty table of the same
        capacity, key dtype and eviction on ``device`` (as ``nn.Module.to_empty`` leaves
        parameters to be filled).
        """
        if device is None or isinstance(device, torch.dtype):
            hint = " (a table's keys keep their key_dtype)" if device is not None else ""
            raise TypeError(f"HashTable.to: device must be a torch.device, a string or an int, got {device!r}{hint}")
        device = torch.device(device_argument("HashTable.to", device))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        if self.device.type == "meta":
            return HashTable(self._capacity, key_dtype=self._key_dtype, eviction=self._eviction, device=device)
        moved = HashTable.__new__(HashTable)
        moved.__setstate__(self.__getstate__())
        for name in _TABLE_TENSORS:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

"""A key -> row hash table over plain tensors, on CPU or CUDA.

The table maps arbitrary int64 (or int32) keys to dense row ids ``0, 1, 2, ...`` of an
embedding weight. It is open addressing with linear probing over ``S`` slots, ``S`` the
smallest power of two ``>= 2 * capacity`` (and ``>= 16``): a full table is at most half
occupied, so probe sequences stay short and always end. ``slot_rows[s] == -1`` marks an
empty slot, so every key value is valid, including ``INT64_MIN``, ``INT64_MAX``, ``-1``
and ``0``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from ._checks import allocation

__all__ = ["HashTable", "HashTableFullError"]

_KEY_DTYPES = (torch.int64, torch.int32)


class HashTableFullError(RuntimeError):
    """An insert needed more rows than the table's capacity; the table was left unchanged."""


def _slot_count(capacity: int) -> int:
    slots = 16
    while slots < 2 * capacity:
        slots <<= 1
    return slots


class HashTable:
    """Find-or-insert map from keys to consecutive row ids, stored in plain tensors.

    Row ids are deterministic: new keys get ``len(table), len(table) + 1, ...`` in order of
    first occurrence in the inserted batch, on every device.

    Args:
        capacity: the most keys the table may hold (the rows of the embedding it indexes).
        key_dtype: ``torch.int64`` (default) or ``torch.int32``; the dtype of the keys
            :meth:`insert` takes and :meth:`export` returns. Keys are stored as int64.
        device: where the table lives (default: the current default device).

    Example::

        table = HashTable(1000)
        rows = table.insert(torch.tensor([42, -7, 42]))   # tensor([0, 1, 0])
        table.find(torch.tensor([-7, 5]))                  # tensor([1, -1])
    """

    def __init__(
        self,
        capacity: int,
        *,
        key_dtype: torch.dtype = torch.int64,
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"HashTable: capacity must be a non-negative int, got {capacity!r}")
        if key_dtype not in _KEY_DTYPES:
            raise TypeError(f"HashTable: key_dtype must be torch.int64 or torch.int32, got {key_dtype}")
        self._capacity = capacity
        self._key_dtype = key_dtype
        slots = _slot_count(capacity)
        with allocation(f"HashTable: capacity={capacity} ({slots} slots, 2 arrays)", (slots,), torch.int64, device):
            self._slot_keys = torch.zeros(slots, dtype=torch.int64, device=device)
            self._slot_rows = torch.full((slots,), -1, dtype=torch.int64, device=device)
        self._size = 0

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
    def device(self) -> torch.device:
        return self._slot_keys.device

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (f"HashTable(size={self._size}, capacity={self._capacity}, key_dtype={self._key_dtype}, "
                f"device={self.device})")

    # -- lookups ----------------------------------------------------------------------

    def _check_keys(self, keys: Tensor, method: str, *, exact_dtype: bool) -> None:
        if not isinstance(keys, Tensor):
            raise TypeError(f"HashTable.{method}: keys must be a tensor, got {type(keys).__name__}")
        if exact_dtype and keys.dtype != self._key_dtype:
            raise TypeError(f"HashTable.{method}: keys are {keys.dtype} but the table's key_dtype is "
                            f"{self._key_dtype}; cast them with .to({self._key_dtype})")
        if not exact_dtype and keys.dtype not in _KEY_DTYPES:
            raise TypeError(f"HashTable.{method}: keys must be int64 or int32, got {keys.dtype}")
        if keys.device != self.device:
            raise RuntimeError(f"HashTable.{method}: keys are on {keys.device} but the table is on "
                               f"{self.device}; move them with .to(table.device)")

    def find(self, keys: Tensor) -> Tensor:
        """Rows of ``keys``; the table is not changed.

        Args:
            keys: int64 or int32 tensor of any shape, on the table's device.

        Returns:
            int64 rows with the shape of ``keys``, ``-1`` where a key is absent.
        """
        self._check_keys(keys, "find", exact_dtype=False)
        return ops.hash_table_find(self._slot_keys, self._slot_rows, keys)

    def insert(self, keys: Tensor) -> Tensor:
        """Find-or-insert: rows of ``keys``, giving absent keys new rows.

        New keys get consecutive rows ``len(self), len(self) + 1, ...`` in order of first
        occurrence in ``keys`` (read flattened). On CUDA this syncs with the host twice
        (unique's output size, and the count of new keys, which the capacity check needs
        before anything is written); placing the keys adds none.

        Args:
            keys: tensor of ``key_dtype``, any shape, on the table's device.

        Returns:
            int64 rows with the shape of ``keys``.

        Raises:
            HashTableFullError: the new keys do not fit in ``capacity``; nothing is inserted.
        """
        self._check_keys(keys, "insert", exact_dtype=True)
        if keys.numel() == 0:
            return torch.empty(keys.shape, dtype=torch.int64, device=self.device)
        unique_keys, inverse = ops.unique(keys.reshape(-1), return_inverse=True)
        unique_rows = self.find(unique_keys)
        missing = unique_rows < 0
        # Boolean indexing keeps order, so new keys stay in order of first occurrence.
        new_keys = unique_keys[missing]
        num_new = new_keys.numel()
        if self._size + num_new > self._capacity:
            raise HashTableFullError(
                f"HashTable.insert: {num_new} new keys do not fit: the table holds {self._size} of its "
                f"capacity {self._capacity} ({self._capacity - self._size} free); nothing was inserted. "
                "Build the table with a larger capacity")
        if num_new > 0:
            new_rows = torch.arange(self._size, self._size + num_new, dtype=torch.int64, device=self.device)
            # The table's own size and rows: the op needs no host sync to check them.
            ops.hash_table_insert_absent_(self._slot_keys, self._slot_rows, new_keys, new_rows, self._size)
            unique_rows.masked_scatter_(missing, new_rows)
            self._size += num_new
        return unique_rows[inverse].view(keys.shape)

    def export(self) -> Tuple[Tensor, Tensor]:
        """All entries, ordered by row.

        Returns:
            ``(keys, rows)``: ``keys`` of ``key_dtype`` ``[len(self)]`` with ``keys[i]``
            the key of row ``i``, and ``rows = arange(len(self))`` (int64).
        """
        occupied = self._slot_rows >= 0
        rows = self._slot_rows[occupied]
        keys = torch.empty(self._size, dtype=torch.int64, device=self.device)
        # Rows are exactly 0 .. size-1, so a scatter orders the keys without a sort.
        keys[rows] = self._slot_keys[occupied]
        return keys.to(self._key_dtype), torch.arange(self._size, dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        """Removes every key; capacity, dtype and device stay."""
        self._slot_keys.zero_()
        self._slot_rows.fill_(-1)
        self._size = 0

    def _truncate(self, size: int) -> None:
        """Removes the keys of rows ``>= size``: undoes every insert since the table held
        ``size`` keys (the rollback of a step that failed after inserting).

        Clearing their slots is safe without tombstones: a key inserted earlier was placed
        when those slots were still empty, so no older key's probe passes through them.
        """
        if not 0 <= size <= self._size:
            raise ValueError(f"HashTable._truncate: size must lie in [0, {self._size}], got {size}")
        if size == self._size:
            return
        self._slot_rows.masked_fill_(self._slot_rows >= size, -1)
        self._size = size

    # -- persistence and devices ------------------------------------------------------

    def state_dict(self) -> Dict[str, Tensor]:
        """Plain tensors that :func:`torch.load` reads with ``weights_only=True``.

        Returns:
            ``{"keys": keys in row order (key_dtype, on the table's device),
            "capacity": int64 scalar}``. The slot layout is not saved, so a state loads
            into a table of any capacity that can hold it, on any device.
        """
        keys, _ = self.export()
        return {"keys": keys, "capacity": torch.tensor(self._capacity, dtype=torch.int64)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replaces the contents with a saved state: key ``keys[i]`` gets row ``i``.

        The table keeps its own capacity, key dtype and device.

        Raises:
            HashTableFullError: the saved keys do not fit in this table's capacity (the
                table is left unchanged).
            ValueError: the state has no ``keys`` or they are not distinct.
            TypeError: the saved keys are int64 and the table's ``key_dtype`` is int32.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"HashTable.load_state_dict: expected the dict HashTable.state_dict() returns, got "
                            f"{type(state_dict).__name__}")
        if "keys" not in state_dict:
            raise ValueError("HashTable.load_state_dict: the state has no 'keys' entry; pass what "
                             "HashTable.state_dict() returned")
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
        keys = keys.to(device=self.device, dtype=self._key_dtype)
        if keys.numel() > 0 and ops.unique(keys, return_inverse=False).numel() != keys.numel():
            raise ValueError("HashTable.load_state_dict: the saved keys are not distinct")
        self.clear()
        self.insert(keys)

    def to(self, device: Union[torch.device, str]) -> "HashTable":
        """The table on ``device``: ``self`` when already there, else a copy.

        The slot layout depends only on the keys, so the slot arrays move as they are.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        moved = HashTable.__new__(HashTable)
        moved._capacity = self._capacity
        moved._key_dtype = self._key_dtype
        moved._slot_keys = self._slot_keys.to(device)
        moved._slot_rows = self._slot_rows.to(device)
        moved._size = self._size
        return moved

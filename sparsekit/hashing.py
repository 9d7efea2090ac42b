"""Feature hashing: raw categorical values (str, bytes, int) to int64 embedding keys.

Keys are XXH3-64 digests (the ``xxhash`` package) reinterpreted as signed int64, so
every key falls anywhere in the int64 range, which is exactly what the hash-table
embeddings accept. Each slot hashes with its own seed, derived from ``(seed, slot)``:
the same string in two slots gives two unrelated keys, so slots can share one table
without colliding on equal raw values.

Value encodings:
  * ``str`` is hashed as its UTF-8 bytes, so ``"a1b2"`` and ``b"a1b2"`` give the same key.
  * ``int`` (any integer type, including numpy integers) is hashed as its 8-byte
    little-endian two's complement, under a seed distinct from the text seed, so the
    integer 7 and an 8-byte string that happens to spell it never collide by design.
    Integers outside the int64 range raise ``OverflowError``.

Digests depend only on the value, slot and seed: they are the same across runs,
processes, machines and Python hash randomisation.
"""

from __future__ import annotations

import operator
import struct
from functools import lru_cache
from typing import Iterable, Sequence, Union

import numpy as np
import torch
import xxhash

Value = Union[str, bytes, bytearray, memoryview, int]

_SEED_LAYOUT = struct.Struct("<QqB")
_INT_LAYOUT = struct.Struct("<q")
_TEXT, _INT = 0, 1
_TWO_63 = 1 << 63
_TWO_64 = 1 << 64
_digest = xxhash.xxh3_64_intdigest


def _to_int64(digest: int) -> int:
    return digest - _TWO_64 if digest >= _TWO_63 else digest


@lru_cache(maxsize=4096)
def _seed(slot: int, seed: int, kind: int) -> int:
    # Hashing the (seed, slot, kind) triple, rather than adding them, keeps the seeds of
    # neighbouring slots unrelated.
    return _digest(_SEED_LAYOUT.pack(seed % _TWO_64, slot, kind))


def _integer(value, name: str, where: str) -> int:
    """``value`` as a Python int: any integer type but bool (TypeError otherwise)."""
    if isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, got {value!r}") from None


def _slot_and_seed(slot, seed, where: str):
    """``(slot, seed % 2**64)`` checked: ints, the slot in the int64 range."""
    if type(slot) is not int or type(seed) is not int:  # plain ints skip the slow path
        slot, seed = _integer(slot, "slot", where), _integer(seed, "seed", where)
    if not -_TWO_63 <= slot < _TWO_63:
        raise ValueError(f"{where}: slot must be in the int64 range, got {slot}")
    return slot, seed % _TWO_64


def slot_seed(slot: int, seed: int = 0) -> int:
    """The XXH3-64 seed with which text values of ``slot`` are hashed.

    Args:
        slot: slot (feature column) index; any int64.
        seed: global seed; any integer (taken modulo 2**64).

    Returns:
        An unsigned 64-bit integer.

    Raises:
        TypeError: ``slot`` or ``seed`` not an int (bool included).
        ValueError: ``slot`` outside the int64 range.
    """
    return _seed(*_slot_and_seed(slot, seed, "sparsekit.hashing.slot_seed"), _TEXT)


def hash_value(value: Value, slot: int = 0, *, seed: int = 0) -> int:
    """Hash one raw categorical value of ``slot`` to an int64 key.

    Args:
        value: a ``str`` (hashed as UTF-8), ``bytes``-like, or integer in the int64 range.
        slot: the slot the value belongs to; equal values in different slots give
            different keys.
        seed: global seed shared by all slots.

    Returns:
        A Python int in ``[-2**63, 2**63)``.

    Raises:
        TypeError: for a value of any other type (floats included: hash ``repr`` or a
            rounded int), or a ``slot`` or ``seed`` that is not an int.
        OverflowError: for an integer value outside the int64 range.
        ValueError: a ``slot`` outside the int64 range.
    """
    slot, seed = _slot_and_seed(slot, seed, "sparsekit.hashing")
    if isinstance(value, str):
        return _to_int64(_digest(value.encode("utf-8"), _seed(slot, seed, _TEXT)))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _to_int64(_digest(value, _seed(slot, seed, _TEXT)))
    try:
        integer = operator.index(value)
    except TypeError:
        raise TypeError(
            f"sparsekit.hashing: cannot hash a {type(value).__name__}; pass str, bytes or int "
            "(convert floats to a string or an int first)") from None
    try:
        packed = _INT_LAYOUT.pack(integer)
    except struct.error:
        raise OverflowError(
            f"sparsekit.hashing: integer {integer} is outside the int64 range; "
            "pass it as a string instead") from None
    return _to_int64(_digest(packed, _seed(slot, seed, _INT)))


def hash_values(values: Union[Iterable[Value], np.ndarray, torch.Tensor], slot: int = 0, *,
                seed: int = 0) -> torch.Tensor:
    """Hash a list of raw values of one slot.

    Args:
        values: an iterable of str / bytes / int, or an integer numpy array or tensor
            (hashed element by element as integers).
        slot: the slot all values belong to.
        seed: global seed.

    Returns:
        int64 tensor ``[len(values)]`` with ``out[i] == hash_value(values[i], slot, seed=seed)``.

    Raises:
        TypeError: ``values`` is one str or bytes (it would be hashed character by
            character: use :func:`hash_value`), a float array, or holds a value
            :func:`hash_value` refuses.
    """
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"sparsekit.hashing.hash_values: values must be a sequence of values, got one "
                        f"{type(values).__name__}; hash a single value with hash_value")
    if isinstance(values, (np.ndarray, torch.Tensor)):
        if values.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or (
                isinstance(values, np.ndarray) and values.dtype.kind not in "iub"):
            raise TypeError(f"sparsekit.hashing.hash_values: array of dtype {values.dtype}; "
                            "pass integers, strings or bytes")
        values = values.reshape(-1).tolist()
    keys = [hash_value(value, slot, seed=seed) for value in values]
    return torch.tensor(keys, dtype=torch.int64).reshape(len(keys))


def hash_rows(rows: Sequence[Sequence[Value]], *, seed: int = 0, first_slot: int = 0) -> torch.Tensor:
    """Hash a table of raw values whose column ``j`` is slot ``first_slot + j``.

    Args:
        rows: ``B`` rows of ``S`` values each (str / bytes / int).
        seed: global seed.
        first_slot: slot index of the first column.

    Returns:
        int64 tensor ``[B, S]``.

    Raises:
        ValueError: if the rows do not all have the same length.
    """
    if len(rows) == 0:
        return torch.empty(0, 0, dtype=torch.int64)
    width = len(rows[0])
    keys = []
    for index, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"sparsekit.hashing.hash_rows: row {index} has {len(row)} values, "
                             f"row 0 has {width}; every row needs one value per slot")
        keys.append([hash_value(value, first_slot + column, seed=seed)
                     for column, value in enumerate(row)])
    return torch.tensor(keys, dtype=torch.int64).reshape(len(rows), width)

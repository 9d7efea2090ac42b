"""Feature hashing: raw categorical values (str, bytes, int) to int64 embedding keys.

Keys are XXH3-64 digests reinterpreted as signed int64. Each slot hashes with its own seed
derived from ``(seed, slot)``, so slots can share one table without colliding on equal raw
values. ``str`` hashes as its UTF-8 bytes (no encoding: ``ValueError``); a bytes-like value
(buffer protocol, C order; not numpy arrays) as its raw bytes; an ``int`` (numpy integers
too) as 8 little-endian bytes under a seed distinct from the text seed (outside int64:
``OverflowError``). ``bool`` is refused (``TypeError``): a flag hashed as 1 would share the
integer 1's key. Digests depend only on value, slot and seed: the same across runs,
processes and machines.
"""

from __future__ import annotations

import struct
from collections.abc import ItemsView, KeysView, Mapping, Set as AbstractSet
from functools import lru_cache
from typing import Iterable, Sequence, Union

import numpy as np
import torch
import xxhash

from ._checks import as_index, integer_argument, is_bool, type_name

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


def _slot_and_seed(slot, seed, where: str, slot_name: str = "slot"):
    """``(slot, seed % 2**64)`` checked: ints, the slot in the int64 range."""
    if type(slot) is not int or type(seed) is not int:  # plain ints skip the slow path
        slot, seed = integer_argument(where, slot_name, slot), integer_argument(where, "seed", seed)
    if not -_TWO_63 <= slot < _TWO_63:
        raise ValueError(f"{where}: {slot_name} must be in the int64 range, got {slot}")
    return slot, seed % _TWO_64


def _shown(value) -> str:
    """``value`` for an error message: its repr, cut short, and its type."""
    text = repr(value)
    return f"{text if len(text) <= 64 else text[:61] + '...'} ({type_name(value)})"


def _refuse_unordered(where: str, name: str, value, wanted: str) -> None:
    """A TypeError naming ``where`` and ``name`` and saying what is ``wanted`` for a mapping,
    whose iteration would yield its keys, or a set, whose order can change from run to run
    (str hashes are salted per process): neither has an ``i``-th value for ``out[i]``."""
    if isinstance(value, Mapping):
        hint = "a mapping would be read as its keys: pass a list of its values if they are meant"
    elif isinstance(value, AbstractSet) and not isinstance(value, (KeysView, ItemsView)):  # a dict's views keep its order
        hint = "a set has no fixed order: pass sorted(...) of it"
    else:
        return
    raise TypeError(f"{where}: {name} must be {wanted}, got {_shown(value)}; {hint}")


def _length(where: str, name: str, value, wanted: str) -> int:
    """``len(value)`` of a sequence argument; a TypeError naming ``where`` and ``name`` and
    saying what is ``wanted`` for a mapping or set (:func:`_refuse_unordered`) or an object
    with no length (an iterator: materialise it with ``list()`` first)."""
    _refuse_unordered(where, name, value, wanted)
    try:
        return len(value)
    except TypeError:
        pass
    hint = "; pass list(...) for an iterator or generator" if hasattr(value, "__next__") else ""
    raise TypeError(f"{where}: {name} must be {wanted}, got {_shown(value)}{hint}")


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
        value: a ``str`` (hashed as UTF-8); a bytes-like object (``bytes``, ``bytearray``,
            ``memoryview`` or any other buffer-protocol object, e.g. ``array.array``; not a
            numpy array or scalar), hashed as its raw bytes in C order; or an integer in the
            int64 range (any integer type: numpy integers, 0-d integer arrays and tensors; not
            a bool).
        slot: the slot the value belongs to; equal values in different slots give
            different keys.
        seed: global seed shared by all slots.

    Returns:
        A Python int in ``[-2**63, 2**63)``.

    Raises:
        TypeError: for a value of any other type (floats included: hash ``repr`` or a
            rounded int; bools: convert with ``int()``), or a ``slot`` or ``seed`` that is
            not an int.
        OverflowError: for an integer value outside the int64 range.
        ValueError: a ``str`` with no UTF-8 encoding (a lone surrogate), or a ``slot``
            outside the int64 range.
    """
    where = "sparsekit.hashing.hash_value"
    return _hash_at(value, *_slot_and_seed(slot, seed, where), where)


class _Refused(Exception):
    """Why :func:`_hash` refuses a value: ``error`` (a TypeError, ValueError or
    OverflowError) still to be named by its caller."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _renamed(refused: _Refused, where: str, name: str = "", *index: int) -> Exception:
    """The refusal's error, named by the function ``where`` and, given ``name``, the value's
    place (``values[i]``, ``rows[i][j]``)."""
    place = f": {name}" + "".join(f"[{i}]" for i in index) if name else ""
    return type(refused.error)(f"{where}{place}: {refused.error}")


def _hash_at(value: Value, slot: int, seed: int, where: str, name: str = "", *index: int) -> int:
    """:func:`_hash` of one value, a refusal :func:`_renamed`."""
    try:
        return _hash(value, slot, seed)
    except _Refused as refused:
        raise _renamed(refused, where, name, *index) from refused.__cause__


def _hash(value: Value, slot: int, seed: int) -> int:
    """:func:`hash_value` of a slot and seed already checked (``seed`` taken modulo 2**64).
    Its errors say what is wrong with the value; the caller puts where in front."""
    if isinstance(value, str):
        try:
            encoded = value.encode("utf-8")
        except UnicodeEncodeError as error:
            shown = value if len(value) <= 64 else value[:61] + "..."
            raise _Refused(ValueError(
                f"cannot hash {shown!r}: str values are hashed as their UTF-8 bytes and "
                f"{value[error.start:error.end]!r} (a lone surrogate, at index {error.start}) has no UTF-8 "
                "encoding; pass bytes, or repair the string first")) from error
        return _to_int64(_digest(encoded, _seed(slot, seed, _TEXT)))
    if isinstance(value, (bytes, bytearray)):
        return _to_int64(_digest(value, _seed(slot, seed, _TEXT)))
    if isinstance(value, memoryview):
        return _to_int64(_digest(value if value.c_contiguous else value.tobytes(), _seed(slot, seed, _TEXT)))
    if isinstance(value, torch.Tensor) and value.dim() != 0 and value.numel() == 1:
        # A one-element tensor converts with operator.index; as a numpy array of shape [1]
        # does not, neither does it here: it is a sequence, not one integer.
        raise _Refused(TypeError(f"cannot hash a {value.dim()}-d tensor of shape {list(value.shape)} as "
                        "one value; pass a 0-d tensor or an int (hash_values hashes a tensor element by element)"))
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise _Refused(TypeError("cannot hash a tensor on the meta device: it holds no values"))
    if is_bool(value):
        raise _Refused(TypeError(f"cannot hash a bool ({value!r}): it would share the key of the "
                        "integer 1 or 0; convert it to int explicitly (int(value)) if that is what is meant"))
    try:
        integer = as_index(value)
    except TypeError:
        integer = None
    if integer is None:
        view = None
        if not isinstance(value, (np.ndarray, np.generic)):  # their buffers hold elements, not bytes
            try:
                view = memoryview(value)  # any other buffer exporter is bytes-like
            except TypeError:
                pass
        if view is not None:
            with view:
                return _to_int64(_digest(view if view.c_contiguous else view.tobytes(), _seed(slot, seed, _TEXT)))
        hint = ("; hash an array element by element with hash_values, or its raw bytes with .tobytes()"
                if isinstance(value, (np.ndarray, torch.Tensor)) else "")
        raise _Refused(TypeError(
            f"cannot hash a {type(value).__name__}; pass str, bytes (or another "
            f"bytes-like object) or int (convert floats to a string or an int first){hint}"))
    try:
        packed = _INT_LAYOUT.pack(integer)
    except struct.error:
        raise _Refused(OverflowError(
            f"integer {integer} is outside the int64 range; "
            "pass it as a string instead")) from None
    return _to_int64(_digest(packed, _seed(slot, seed, _INT)))


_VALUES_WANTED = "an iterable of str, bytes or int values (a list, tuple, generator ...), a numpy array or a tensor"


def hash_values(values: Union[Iterable[Value], np.ndarray, torch.Tensor], slot: int = 0, *,
                seed: int = 0) -> torch.Tensor:
    """Hash a list of raw values of one slot.

    Args:
        values: an iterable (list, tuple, generator ...) of str / bytes-like / int values,
            each hashed as :func:`hash_value` hashes it (an ``array.array`` is an iterable of
            its elements, as a numpy array is); an integer numpy array or tensor (hashed
            element by element as integers); or a numpy array of strings (dtype kind
            ``"U"``, ``"S"`` or numpy 2's ``StringDType``) or of objects, hashed element by
            element as :func:`hash_value` hashes them (a ``"S"`` array holds its bytes
            without trailing NULs, as numpy stores them). Arrays and tensors are read
            flattened.
        slot: the slot all values belong to.
        seed: global seed.

    Returns:
        int64 tensor ``[n]`` (``n`` values; ``values.size`` for an array) with
        ``out[i] == hash_value(values[i], slot, seed=seed)``.

    Raises:
        TypeError: ``values`` is not iterable (``None``, one int ...), is one str, bytes,
            bytearray or memoryview (it would be hashed character by character: use
            :func:`hash_value`), is a mapping or set (no ``i``-th value for ``out[i]``), is a
            float, complex or bool array or tensor (convert bools with ``.astype(np.int64)`` /
            ``.long()``), or holds a value :func:`hash_value` refuses; or ``slot`` or
            ``seed`` is not an int (checked even for no values).
        ValueError: a value :func:`hash_value` refuses with ``ValueError``, or a ``slot``
            outside the int64 range.
    """
    where = "sparsekit.hashing.hash_values"
    slot, seed = _slot_and_seed(slot, seed, where)
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"sparsekit.hashing.hash_values: values must be a sequence of values, got one "
                        f"{type(values).__name__}; hash a single value with hash_value")
    _refuse_unordered(where, "values", values, _VALUES_WANTED)
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.dtype.is_floating_point or values.dtype.is_complex:
            hint = "; convert bools to int explicitly (.long())" if values.dtype == torch.bool else ""
            raise TypeError(f"sparsekit.hashing.hash_values: tensor of dtype {values.dtype}; pass integers, "
                            f"strings or bytes{hint}")
        if values.layout != torch.strided or values.device.type == "meta":
            what = "a meta tensor (it holds no values)" if values.device.type == "meta" else \
                f"a {values.layout} tensor"
            raise TypeError(f"sparsekit.hashing.hash_values: values is {what}; pass a dense tensor "
                            "(.to_dense()) with values")
        values = values.reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "iuUSOT":
            hint = "; convert bools to int explicitly (.astype(np.int64))" if values.dtype.kind == "b" else ""
            raise TypeError(f"sparsekit.hashing.hash_values: array of dtype {values.dtype}; pass integers, "
                            f"strings or bytes{hint}")
        values = values.reshape(-1).tolist()
    else:
        try:
            values = iter(values)
        except TypeError:
            raise TypeError(f"{where}: values must be {_VALUES_WANTED}, got {_shown(values)}; hash a single "
                            "value with hash_value") from None
    keys = []
    for value in values:  # what the caller's iterable itself raises passes as it is
        try:
            keys.append(_hash(value, slot, seed))
        except _Refused as refused:  # (not _hash_at: a call per value costs a fifth more)
            raise _renamed(refused, where, "values", len(keys)) from refused.__cause__
    return torch.tensor(keys, dtype=torch.int64).reshape(len(keys))


def hash_rows(rows: Sequence[Sequence[Value]], *, seed: int = 0, first_slot: int = 0) -> torch.Tensor:
    """Hash a table of raw values whose column ``j`` is slot ``first_slot + j``.

    Args:
        rows: a sequence (list, tuple, 2-d numpy array or tensor ...: anything with a
            length, not a mapping or set) of ``B`` rows, each a sequence of ``S`` values (str /
            bytes-like / int, hashed as :func:`hash_value` hashes them).
        seed: global seed.
        first_slot: slot index of the first column; an int (not a bool), with
            ``first_slot + S - 1`` in the int64 range.

    Returns:
        int64 tensor ``[B, S]``.

    Raises:
        TypeError: ``rows`` or a row is not a sequence (``None``, an int, an iterator or
            generator: pass ``list(rows)``, a mapping: it would be read as its keys); a row
            that is one str or bytes (it would be read as a row of characters: wrap it,
            ``[value]``, for a one-slot row); a value :func:`hash_value` refuses; or a
            ``first_slot`` or ``seed`` that is not an int (checked even for no rows).
        ValueError: if the rows do not all have the same length, or a column's slot
            ``first_slot + j`` is outside the int64 range.
    """
    where = "sparsekit.hashing.hash_rows"
    first_slot, seed = _slot_and_seed(first_slot, seed, where, "first_slot")
    if isinstance(rows, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{where}: rows must be a sequence of rows, got one {type(rows).__name__}")
    count = _length(where, "rows", rows, "a sequence of rows (a list, tuple, 2-d array or tensor)")
    if count == 0:
        return torch.empty(0, 0, dtype=torch.int64)
    width = None
    keys = []
    for index, row in enumerate(rows):
        if isinstance(row, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"{where}: row {index} is one {type(row).__name__} ({row!r}), "
                            "not a row of values (it would be read as a row of characters); pass "
                            f"[{row!r}] for a row of one slot")
        length = _length(where, f"row {index}", row, "a sequence of values (a list, tuple, 1-d array or tensor)")
        if width is None:
            width = length
            if first_slot + width > _TWO_63:
                raise ValueError(f"{where}: first_slot + {width - 1} (the slot of the last of the {width} "
                                 f"columns) must be in the int64 range, got first_slot={first_slot}")
        if length != width:
            raise ValueError(f"{where}: row {index} has {length} values, "
                             f"row 0 has {width}; every row needs one value per slot")
        keys.append([_hash_at(value, first_slot + column, seed, where, "rows", index, column)
                     for column, value in enumerate(row)])
    return torch.tensor(keys, dtype=torch.int64).reshape(len(keys), width)

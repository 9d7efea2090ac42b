"""The collection's inputs and table settings: :class:`TableConfig` and :class:`KeyedJagged`
(TorchRec's ``KeyedJaggedTensor`` layout, feature-major), each checked where it is built,
and a TorchRec-like object read through its methods with the same checks."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._checks import plain_tensor, size_argument, tensor_integer, type_name
from . import variable_batch
from .shard import KeySeededUniform


_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_table_fields(name: Any, embedding_dim: Any, capacity: Any, features: Any, combiner: Any, dtype: Any,
                        use_hashtable: Any, eviction: Any, admit_after: Any,
                        initializer: Any) -> Tuple[int, int, int]:
    """The rules of a :class:`TableConfig`'s fields, shared by its constructor and the
    collection's check of its tables: ``(embedding_dim, capacity, admit_after)`` as ints;
    TypeError for a field of the wrong type, ValueError out of range, naming field and table."""
    if not isinstance(name, str):
        raise TypeError(f"TableConfig: name must be a non-empty str, got {name!r} ({type_name(name)})")
    if not name:
        raise ValueError("TableConfig: name must be a non-empty str, got ''")
    sizes = [size_argument(f"TableConfig {name!r}", field, value)
             for field, value in (("embedding_dim", embedding_dim), ("capacity", capacity))]
    if isinstance(features, str) or not isinstance(features, (list, tuple)) \
            or not all(isinstance(f, str) for f in features):
        raise TypeError(f"TableConfig {name!r}: features must be a non-empty list of feature names, "
                        f"got {features!r}")
    if not features or not all(features):
        raise ValueError(f"TableConfig {name!r}: features must be a non-empty list of feature names, "
                         f"got {features!r}")
    if len(set(features)) != len(features):
        raise ValueError(f"TableConfig {name!r}: features names a feature twice: {list(features)}")
    if combiner not in ("sum", "mean"):
        raise ValueError(f"TableConfig {name!r}: combiner must be 'sum' or 'mean', got {combiner!r}")
    if dtype not in _TABLE_DTYPES:
        raise TypeError(f"TableConfig {name!r}: dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                        f"got {dtype}")
    # A bool, not anything truthy: use_hashtable="no" would otherwise mean True.
    if not isinstance(use_hashtable, bool):
        raise TypeError(f"TableConfig {name!r}: use_hashtable must be True or False, got {use_hashtable!r}")
    if eviction is not None and not isinstance(eviction, str):
        raise TypeError(f"TableConfig {name!r}: eviction must be None, 'lru' or 'lfu', got {eviction!r}")
    if eviction not in (None, "lru", "lfu"):
        raise ValueError(f"TableConfig {name!r}: eviction must be None, 'lru' or 'lfu' (lower case), "
                         f"got {eviction!r}")
    admit_after = size_argument(f"TableConfig {name!r}", "admit_after", admit_after, maximum=2**63 - 1)
    if not use_hashtable and (eviction is not None or admit_after != 1):
        raise ValueError(f"TableConfig {name!r}: eviction and admit_after need use_hashtable=True (a "
                         f"direct-mapped table has a row for every key), got eviction={eviction!r}, "
                         f"admit_after={admit_after!r}")
    if initializer is not None and not callable(initializer):
        raise TypeError(f"TableConfig {name!r}: initializer must be callable or None")
    if isinstance(initializer, KeySeededUniform):
        # Its float32 rows are rounded into the table's dtype: bounds past the dtype's largest
        # finite value would give inf rows (float16 ends at 65504).
        largest = torch.finfo(dtype).max
        if max(abs(initializer.low), abs(initializer.high)) > largest:
            raise ValueError(f"TableConfig {name!r}: the initializer's bounds (low={initializer.low}, "
                             f"high={initializer.high}) must lie in {dtype}'s finite range [{-largest}, {largest}]")
    return sizes[0], sizes[1], admit_after


class TableConfig:
    """One table of an :class:`EmbeddingBagCollection`.

    Args:
        name: the table's name (unique in the collection).
        embedding_dim: width of its vectors.
        capacity: per rank: keys of its hash table, or rows with ``use_hashtable=False``
            (keys then lie in ``[0, capacity * world_size)``).
        features: names of the features that read this table (several may share it).
        combiner: ``"sum"`` or ``"mean"`` (the weighted sum divided by the bag's length).
        dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``: the weight's
            dtype. Pooling and the exchange run in float32; :class:`sparsekit.LazyAdam`
            keeps float32 moments and rounds the updated rows to nearest.
        use_hashtable, eviction, admit_after: as for :class:`sparsekit.DistributedEmbedding`:
            a bool; None, ``"lru"`` or ``"lfu"``; an int >= 1 (eviction and admission need
            ``use_hashtable=True``).
        initializer: ``(keys int64 [n], dim) -> [n, dim]``; None: :class:`KeySeededUniform`
            seeded by the table's name, so the same key in two tables starts with
            independent vectors.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, naming the field
            and the table (checked here, not first when the collection is built).
    """

    def __init__(self, name: str, embedding_dim: int, capacity: int, features: Sequence[str], combiner: str = "sum",
                 dtype: torch.dtype = torch.float32, use_hashtable: bool = True, eviction: Optional[str] = None,
                 admit_after: int = 1, initializer: Optional[Callable[[Tensor, int], Tensor]] = None) -> None:
        embedding_dim, capacity, admit_after = _check_table_fields(
            name, embedding_dim, capacity, features, combiner, dtype, use_hashtable, eviction, admit_after, initializer)
        self.name, self.embedding_dim, self.capacity = name, embedding_dim, capacity
        self.features = list(features)
        self.combiner, self.dtype, self.use_hashtable = combiner, dtype, use_hashtable
        self.eviction, self.admit_after, self.initializer = eviction, admit_after, initializer

    def _checked_copy(self) -> "TableConfig":
        """A copy of the config as it is now, its fields checked (see
        :func:`_check_table_fields`) and its sizes Python ints; the config is left as it is."""
        sizes = _check_table_fields(self.name, self.embedding_dim, self.capacity, self.features, self.combiner,
                                    self.dtype, self.use_hashtable, self.eviction, self.admit_after, self.initializer)
        table = copy.copy(self)
        table.embedding_dim, table.capacity, table.admit_after = sizes
        return table

    def __repr__(self) -> str:
        return (f"TableConfig(name={self.name!r}, embedding_dim={self.embedding_dim}, capacity={self.capacity}, "
                f"features={self.features}, combiner={self.combiner!r}, dtype={self.dtype}, "
                f"use_hashtable={self.use_hashtable}, eviction={self.eviction!r}, admit_after={self.admit_after})")


def _kind(value: Any) -> str:
    """A short description of a bad argument for an error message."""
    if isinstance(value, Tensor):
        layout = "" if value.layout == torch.strided else f"{str(value.layout).replace('torch.', '')} "
        return f"a {layout}{value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _check_dense(tensor: Tensor, name: str) -> None:
    """TypeError unless ``tensor`` is dense (strided): a sparse one passes the dtype checks,
    then fails deep in an op, after a table changed, with torch's "Could not run ... SparseCPU"."""
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got {_kind(tensor)}; use .to_dense()")
    plain_tensor(name, tensor)


_KEY_DTYPES = (torch.int64, torch.int32)
# Per-value weights: the dtypes that convert to float32 (the float8 types as torch has them).
_WEIGHT_DTYPES = tuple(getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))
# How the errors call each part: the constructor's arguments, or the methods of a
# TorchRec-like input (read by the collection).
_ARGUMENT_LABELS = {arg: arg for arg in ("keys", "values", "lengths", "offsets", "weights")}
_METHOD_LABELS = {"keys": "keys()", "values": "values()", "lengths": "lengths()", "offsets": "offsets()",
                  "weights": "weights_or_none()"}
_INPUT = "EmbeddingBagCollection: the input's "


class KeyedJagged:
    """TorchRec's ``KeyedJaggedTensor`` layout: bags of keys per feature, feature-major.

    Args:
        keys: the feature names, in order.
        values: int64 or int32 ``[nnz]``: every bag's keys one after the other, the bags
            ordered feature-major (every sample of feature 0, then feature 1, ...).
        lengths: int64 or int32 ``[len(keys) * B]``, the bag sizes; or
        offsets: int64 or int32 ``[len(keys) * B + 1]``, ``offsets[0] == 0``,
            ``offsets[-1] == nnz``. Both may be given when they agree (``offsets == [0,
            cumsum(lengths)]``).
        weights: optional float ``[nnz]`` (float32, float64, float16, bfloat16 or a float8
            type), one per value (multiplied into its vector).

    Raises:
        TypeError: ``keys`` not a list (or tuple, ...) of str, or a set (no fixed order); a
            tensor argument that is no tensor or of the wrong dtype (``weights`` of another
            dtype than above: no int, bool, complex or packed float4).
        ValueError: neither ``lengths`` nor ``offsets``; a tensor of the wrong shape
            (not 1-D, empty ``offsets``, ``weights`` not ``[nnz]``); ``lengths`` and
            ``offsets`` that disagree. The values of ``lengths`` / ``offsets`` (>= 0,
            summing to ``nnz``) are checked by the collection, which reads them on every
            rank.

    Example::

        kjt = KeyedJagged(["user", "item"], torch.tensor([7, 8, 9, 3]),
                          lengths=torch.tensor([2, 0, 1, 1]))   # B = 2: user bags [7, 8], [];
                                                                # item bags [9], [3]
    """

    def __init__(self, keys: Sequence[str], values: Tensor, lengths: Optional[Tensor] = None,
                 offsets: Optional[Tensor] = None, weights: Optional[Tensor] = None) -> None:
        if lengths is None and offsets is None:
            raise ValueError("KeyedJagged: give lengths or offsets")
        self._set_checked(keys, values, lengths, offsets, weights, "KeyedJagged: ", _ARGUMENT_LABELS)

    @classmethod
    def _from_methods(cls, kjt: Any) -> "KeyedJagged":
        """A KeyedJagged of any object with TorchRec's ``KeyedJaggedTensor`` methods, checked as
        the constructor checks its arguments (the errors name the input's methods); ``offsets()``
        when it gives a tensor, else ``lengths()``."""
        for method in ("keys", "values"):
            if not callable(getattr(kjt, method, None)):
                raise TypeError(f"EmbeddingBagCollection: the input must be a sk.KeyedJagged (or a TorchRec "
                                f"KeyedJaggedTensor), got {type(kjt).__name__} without {method}()")
        has_offsets, has_lengths = callable(getattr(kjt, "offsets", None)), callable(getattr(kjt, "lengths", None))
        if not (has_offsets or has_lengths):
            raise TypeError(f"EmbeddingBagCollection: the input ({type(kjt).__name__}) has neither offsets() nor "
                            "lengths()")
        # One of the two, as the input's own offsets() usually derives from its lengths().
        lengths, offsets = None, kjt.offsets() if has_offsets else None
        if offsets is None and has_lengths:
            lengths = kjt.lengths()
        if offsets is None and lengths is None:
            called = " and ".join(m for m, has in (("offsets()", has_offsets), ("lengths()", has_lengths)) if has)
            raise TypeError(f"{_INPUT}{called} returned None; one of them must return an int64 or int32 tensor")
        weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
        variable = callable(getattr(kjt, "variable_stride_per_key", None)) and kjt.variable_stride_per_key()
        values = kjt.values()
        if variable:
            # TorchRec's variable batch per feature: its bags selected by the inverse indices
            # into one batch B for every feature (sparsekit/variable_batch.py).
            values, offsets, weights = variable_batch.expand(kjt, list(kjt.keys()), lengths, offsets, values,
                                                             weights)
            lengths = None
        out = cls.__new__(cls)
        out._set_checked(kjt.keys(), values, lengths, offsets, weights, _INPUT, _METHOD_LABELS)
        if not variable and callable(getattr(kjt, "stride", None)) and out._keys:
            # An integer in any form (a one-element integer tensor, a NumPy integer) is
            # compared; anything else is not a batch size and is left alone.
            stride = tensor_integer(kjt.stride())
            if isinstance(stride, numbers.Integral) and not isinstance(stride, bool):
                stride = int(stride)
            if isinstance(stride, int) and not isinstance(stride, bool) and stride != out.stride():
                raise ValueError(f"{_INPUT}stride() is {stride} but lengths()/offsets() give "
                                 f"{out.lengths().numel()} bags for {len(out._keys)} features, a batch of "
                                 f"{out.stride()}")
        return out

    def _set_checked(self, keys: Any, values: Any, lengths: Any, offsets: Any, weights: Any, owner: str,
                     labels: Dict[str, str]) -> None:
        """The one set of checks of an input (the constructor's and a TorchRec-like
        object's); an error reads ``owner + labels[arg] + " must be ..."``."""
        names = {arg: owner + label for arg, label in labels.items()}
        if isinstance(keys, (str, bytes, Tensor, set, frozenset)) or not isinstance(keys, Iterable):
            # (A set has no fixed order: values would go to other features in another process.)
            raise TypeError(f"{names['keys']} must be a list of feature names (str), got {_kind(keys)}")
        keys = list(keys)  # once: an iterator would be empty after the check below
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"{names['keys']} must be a list of feature names (str), got {keys!r}")
        if not isinstance(values, Tensor) or values.dtype not in _KEY_DTYPES:
            raise TypeError(f"{names['values']} must be an int64 or int32 tensor [nnz], got {_kind(values)}")
        _check_dense(values, names["values"])
        if values.dim() != 1:
            raise ValueError(f"{names['values']} must be 1-D [nnz], got shape {tuple(values.shape)}")
        for arg, value, shape in (("lengths", lengths, "[len(keys) * B]"), ("offsets", offsets,
                                                                           "[len(keys) * B + 1]")):
            if value is None:
                continue
            # Not cast: a float, bool, uint8 or int16 tensor would be truncated or wrap silently.
            if not isinstance(value, Tensor) or value.dtype not in _KEY_DTYPES:
                raise TypeError(f"{names[arg]} must be an int64 or int32 tensor {shape}, got {_kind(value)}")
            _check_dense(value, names[arg])
            if value.dim() != 1:
                raise ValueError(f"{names[arg]} must be 1-D {shape}, got shape {tuple(value.shape)}")
        if offsets is not None and offsets.numel() == 0:
            raise ValueError(f"{names['offsets']} must hold len(keys) * B + 1 >= 1 entries (at least [0]), "
                             "got an empty tensor")
        if lengths is not None and offsets is not None:
            agree = offsets.numel() == lengths.numel() + 1 and offsets.device == lengths.device
            if agree:
                expected = torch.zeros(offsets.numel(), dtype=torch.int64, device=offsets.device)
                torch.cumsum(lengths.long(), 0, out=expected[1:])
                agree = torch.equal(offsets.long(), expected)  # a host read on a GPU, only when both are given
            if not agree:
                raise ValueError(f"{names['lengths']} and {labels['offsets']} disagree: offsets must be [0, "
                                 "cumsum(lengths)] on the same device (or give only one of them)")
        if weights is not None:
            # is_floating_point excludes complex, int and bool: none of them is a weight.
            # (Not a packed float4: it does not convert to float32.)
            if not isinstance(weights, Tensor) or weights.dtype not in _WEIGHT_DTYPES:
                raise TypeError(f"{names['weights']} must be a float tensor [nnz] (float32, float64, float16, "
                                f"bfloat16 or float8) or None, got {_kind(weights)}")
            _check_dense(weights, names["weights"])
            if weights.shape != values.shape:
                raise ValueError(f"{names['weights']} must be [nnz] = [{values.numel()}] (one per value), got shape "
                                 f"{tuple(weights.shape)}")
        self._keys, self._values, self._lengths, self._offsets, self._weights = \
            keys, values, lengths, offsets, weights
        self._labels = labels

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            offsets = torch.zeros(self._lengths.numel() + 1, dtype=torch.int64, device=self._lengths.device)
            torch.cumsum(self._lengths.long(), 0, out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    def weights_or_none(self) -> Optional[Tensor]:
        return self._weights

    def stride(self) -> int:
        """The batch size ``B``."""
        bags = self.lengths().numel()
        return bags // len(self._keys) if self._keys else 0

    # -- TorchRec's KeyedJaggedTensor conveniences --------------------------------------------

    def weights(self) -> Tensor:
        """The per-value weights; ValueError when there are none (TorchRec's ``weights()``)."""
        if self._weights is None:
            raise ValueError("KeyedJagged.weights: this input has no weights (use weights_or_none())")
        return self._weights

    def _split_bags(self) -> int:
        """``B``, ValueError unless the bags split into the features (``lengths`` ``[len(keys) * B]``)."""
        bags = self.lengths().numel()
        if not self._keys:
            if bags:
                raise ValueError(f"KeyedJagged: {bags} bags but no keys")
            return 0
        if bags % len(self._keys):
            raise ValueError(f"KeyedJagged: {bags} bags do not split into {len(self._keys)} features of equal "
                             "batch size (lengths must be [len(keys) * B])")
        return bags // len(self._keys)

    def _bounds(self, batch: int) -> List[int]:
        """Where each feature's values start, then ``nnz`` (one host read), for ``batch`` =
        :meth:`_split_bags`."""
        return self.offsets()[::batch].tolist() if batch else [0] * (len(self._keys) + 1)

    def offset_per_key(self) -> List[int]:
        """Where each feature's values start in ``values()``, then ``nnz``: ``len(keys) + 1``
        ints (one host read)."""
        return self._bounds(self._split_bags())

    def length_per_key(self) -> List[int]:
        """The number of values of each feature (TorchRec's ``length_per_key()``)."""
        bounds = self.offset_per_key()
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def _feature(self, f: int, batch: int, bounds: List[int]) -> KeyedJagged:
        """Feature ``f``'s bags as a one-key KeyedJagged (``bounds``: :meth:`_bounds`)."""
        start, end = bounds[f], bounds[f + 1]
        offsets = self.offsets()[f * batch:(f + 1) * batch + 1].long() - start if batch else \
            torch.zeros(1, dtype=torch.int64, device=self._values.device)
        weights = None if self._weights is None else self._weights[start:end]
        return KeyedJagged([self._keys[f]], self._values[start:end], offsets=offsets, weights=weights)

    def __getitem__(self, key: str) -> KeyedJagged:
        """One feature's bags, as a one-key KeyedJagged (``values()``, ``lengths()`` ``[B]``,
        ``offsets()`` ``[B + 1]`` from 0, ``weights_or_none()``: the methods of TorchRec's
        ``JaggedTensor``, which ``kjt[key]`` returns there). KeyError for a key it lacks. A
        key listed more than once gives its last bags, as TorchRec's ``{key: index}`` and
        :meth:`to_dict` do."""
        if not isinstance(key, str) or key not in self._keys:
            raise KeyError(f"KeyedJagged: no feature {key!r}; keys: {self._keys}")
        batch = self._split_bags()
        last = len(self._keys) - 1 - self._keys[::-1].index(key)
        return self._feature(last, batch, self._bounds(batch))

    def to_dict(self) -> Dict[str, KeyedJagged]:
        """``{key: self[key]}`` in key order (TorchRec's ``to_dict()``), with one host read."""
        batch = self._split_bags()
        bounds = self._bounds(batch)
        return {key: self._feature(f, batch, bounds) for f, key in enumerate(self._keys)}

    # Indexed by feature name only: iteration (and ``in``) would fall back on integer indexes.
    __iter__ = None

    def to(self, device: Union[torch.device, str], non_blocking: bool = False) -> KeyedJagged:
        """A copy with every tensor on ``device`` (TorchRec's ``KeyedJaggedTensor.to``)."""
        moved = [None if t is None else t.to(device, non_blocking=non_blocking)
                 for t in (self._values, self._lengths, self._offsets, self._weights)]
        out = KeyedJagged.__new__(KeyedJagged)
        out._keys, out._values, out._lengths, out._offsets, out._weights = list(self._keys), *moved
        out._labels = self._labels
        return out

    def __repr__(self) -> str:
        return f"KeyedJagged(keys={self._keys}, nnz={self._values.numel()}, batch={self.stride()})"


def _as_keyed_jagged(kjt: Any) -> KeyedJagged:
    """The collection's input as a checked :class:`KeyedJagged`: itself, or a TorchRec-like
    object converted by :meth:`KeyedJagged._from_methods` (one set of checks for both)."""
    # Not isinstance: a subclass may override the methods, so it is read through them.
    return kjt if type(kjt) is KeyedJagged else KeyedJagged._from_methods(kjt)

"""Many tables in one lookup: ``EmbeddingBagCollection``, ``TableConfig``, ``KeyedJagged``.

Each table is one shard module (``ebc.shards[i]``) with the single layers' machinery:
hash or direct rows, eviction, admission, stats, export and checkpoints. One process
runs the staged engine of :mod:`sparsekit.engine` (rows resolved, one pooled read, its
backward or fused optimizer: ``docs/architecture.md``). Under a process group the
``(table, key)`` pair lives on rank ``uint64(key + table_index) % world_size``; the
pairs go to their owners in one all-to-all (after a header all-to-all that carries the
counts, error flags and mode, so a bad input anywhere stops every rank before a key
moves), the owners look them up together (plan, agree through one status all-reduce,
commit) and one all-to-all brings the vectors back; the backward mirrors it.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import numbers
import zlib
from collections.abc import Iterable
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import engine, ops, traced
from ._checks import compile_disabled, device_argument, plain_tensor, size_argument, tensor_integer, type_name
from .checkpoint.collective import collective_device
from . import keyed, variable_batch
from .fused import FusedOptimizer
from .pooled import update_distinct_rows
from .exchange import (
    _BAD_KEY,
    _BAD_OFFSETS,
    _LOCAL_EXCEPTION,
    _OWNER_EXCEPTION,
    _TABLE_FULL,
    _agree_on_config,
    _all_to_all_rows,
    _AllToAll,
    _CoalescedGradMarker,
    _deepcopy_sharing_group,
    _GatherPieces,
    _GatherRows,
    _make_step_lock,
    _mean_of_sum,
    _offsets_error_flags,
    _one_per_bag,
    _owners,
    _PoolRows,
    _read_rows,
    _reduce_without_group,
    _resolve_group,
    _sort_rows,
    _state_without_lock,
    _stepping,
    _table_gradients,
    _unique_tables,
    _wire_device,
)
from .hashtable import HashTableFullError, _find_in_tables, _touch_tables
from .shard import (
    KeySeededUniform,
    _check_modes_agree,
    _check_own_weights,
    _check_state_dict_keys,
    _check_writable,
    _ModelParallelEmbedding,
    _place_new_keys,
    _row_layout,
    _row_layout_text,
)
from .tables_cuda import _device_ints

__all__ = ["TableConfig", "KeyedJagged", "EmbeddingBagCollection", "UnknownTableError"]

_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class UnknownTableError(KeyError, ValueError):
    """A table name the collection does not have: a ``KeyError`` (a failed look-up by
    name) and a ``ValueError`` (a bad argument, as the contract's errors are)."""

    def __str__(self) -> str:
        # KeyError's own str() is the repr of its argument (quoted); the message reads better plain.
        return str(self.args[0]) if self.args else ""


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


# The single layers' setting names in a table shard's configuration, as TableConfig names them.
_TABLE_FIELDS = {"embedding_vec_size": "embedding_dim", "max_vocabulary_size_per_gpu": "capacity",
                 "embedding_initializer": "initializer"}


def _default_seeds(tables: Sequence[TableConfig]) -> List[int]:
    """Per table, the seed of its default initializer: the CRC-32 of its name, or, for tables
    whose CRC-32s collide, 63 bits of the name's BLAKE2b digest, so no two tables share one."""
    crc = [zlib.crc32(t.name.encode()) for t in tables]
    defaults = [seed for seed, t in zip(crc, tables) if t.initializer is None]
    return [int.from_bytes(hashlib.blake2b(t.name.encode(), digest_size=8, person=b"sparsekit-seed").digest(),
                           "little") >> 1 if t.initializer is None and defaults.count(seed) > 1 else seed
            for seed, t in zip(crc, tables)]


class _TableShard(_ModelParallelEmbedding):
    """One table of a collection on this rank: its weight shard, hash table, admissions."""

    _capacity_argument = "capacity"  # TableConfig's
    _dim_argument = "embedding_dim"
    _initializer_argument = "initializer"

    def __init__(self, config: TableConfig, index: int, process_group, device, default_seed: int) -> None:
        object.__setattr__(self, "_layer_name", f"EmbeddingBagCollection table {config.name!r}")
        initializer = config.initializer if config.initializer is not None else KeySeededUniform(seed=default_seed)
        super().__init__(config.capacity, config.embedding_dim, config.use_hashtable, torch.int64, initializer,
                         process_group, device, config.eviction, config.admit_after, None, config.dtype, index)
        self.config = config

    def _config(self) -> Dict[str, object]:
        # Named by TableConfig's fields, which the mismatch error then names.
        config = {_TABLE_FIELDS.get(key, key): value for key, value in super()._config().items()}
        return {**config, "table": self.config.name, "features": ",".join(self.config.features),
                "combiner": self.config.combiner}

    def _repr_settings(self) -> str:
        return (f"table={self.config.name!r}, features={self.config.features}, combiner={self.config.combiner!r}, "
                f"dtype={self.weight.dtype}, ")

    def _plan(self, keys: Tensor) -> Any:
        """What this table does for its distinct owned keys this step (may raise; changes nothing)."""
        if self.hash_table is None:
            return self._direct_rows(keys)
        if not self.training:
            return self.hash_table.find(keys)
        return self._plan_lookup(keys)

    def _commit(self, plan: Any) -> Tensor:
        return plan if isinstance(plan, Tensor) else self._commit_lookup(plan)


class _PresentRows(NamedTuple):
    """A training plan of a hash table whose keys are all present: their rows, scored at commit."""

    rows: Tensor


def _sort_table_rows(rows: List[Tensor], weights: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(sorted_rows, order)`` of several tables' distinct rows, ``torch.cat(rows)``: each
    table's rows ascending (-1 first) in its own block, blocks in table order, by one sort."""
    device = weights[0].device
    sizes = [r.numel() for r in rows]
    bases = list(itertools.accumulate((w.shape[0] + 1 for w in weights[:-1]), initial=0))
    flat = torch.cat(rows) if len(rows) > 1 else rows[0]
    base_of = ops._repeat_interleave(_device_ints(bases, device), _device_ints(sizes, device), flat.numel())
    sorted_codes, order = _sort_rows(flat + (base_of + 1))
    return sorted_codes - (base_of + 1), order


class _GrowRows(NamedTuple):
    """A training plan of a hash table without eviction or admission whose new keys fit: its
    keys' rows (-1: new), the new keys and their initial vectors; at commit the new keys take
    rows ``len(table), len(table) + 1, ...``."""

    rows: Tensor
    new_keys: Tensor
    initial: Tensor


class _LookupTables(torch.autograd.Function):
    """Rows of several shards of one dim as one float32 block, missing rows (-1) as zeros.
    The rows asked of each table are distinct, so each weight's gradient is the output
    gradient reordered by row: no sum, one coalesced sparse gradient per table."""

    @staticmethod
    def forward(ctx, rows: List[Tensor], markers: List[_CoalescedGradMarker], may_miss: List[bool], fused: Any,
                *weights: Tensor) -> Tensor:
        sizes = [r.numel() for r in rows]
        out = torch.empty(sum(sizes), weights[0].shape[1], dtype=torch.float32, device=weights[0].device)
        for weight, part, table_rows, miss in zip(weights, out.split(sizes), rows, may_miss):
            _read_rows(weight, table_rows, miss, part)
        sorted_rows, order = _sort_table_rows(rows, weights)
        ctx.save_for_backward(sorted_rows, order)
        ctx.sizes, ctx.markers, ctx.may_miss = sizes, markers, may_miss
        ctx.stamps = [marker.stamp for marker in markers]
        ctx.weight_meta = [(w.shape, w.dtype) for w in weights]
        # Not saved for backward: the fused update writes them in place (see _PooledRead).
        ctx.fused, ctx.weights = fused, (weights if fused is not None else None)
        return out

    @staticmethod
    @compile_disabled  # as _LookupOwned.backward
    def backward(ctx, grad: Tensor):
        sorted_rows, order = ctx.saved_tensors
        values = grad.index_select(0, order)
        if ctx.fused is None:
            return (None, None, None, None, *_table_gradients(ctx, values, sorted_rows, 4))
        # The fused optimizer updates the owned rows here, with the gradient the unfused
        # path gives each table (so the same numbers), and no gradient is materialised.
        for j, (rows, part) in enumerate(zip(sorted_rows.split(ctx.sizes), values.split(ctx.sizes))):
            marker, stamp = ctx.markers[j], ctx.stamps[j]
            if ctx.needs_input_grad[4 + j] and not marker.lost(stamp):
                rows, part = marker.own_rows(rows, part, stamp, ctx.may_miss[j])
                update_distinct_rows(ctx.fused, ctx.weights[j], rows, part)
        return (None,) * (4 + len(ctx.weights))


class EmbeddingBagCollection(nn.Module):
    """Many pooled embedding tables behind one fused, model-parallel lookup per step.

    Args:
        tables: the :class:`TableConfig` of each table (names distinct, each feature read
            by one table).
        process_group: the group to shard over; None: the default group when
            torch.distributed is initialised, else none (one process).
        device: where the shards live.
        fused_params: None (the backward gives each table a sparse gradient, for any
            optimizer: sk.LazyAdam, torch.optim.SparseAdam, ...), or the optimizer the
            backward applies to the rows it touched, with no gradient materialised, e.g.
            ``{"optimizer": "rowwise_adagrad", "lr": 0.01}`` (see
            :class:`sparsekit.FusedOptimizer`; ``ebc.fused_optimizer``). Under a process group each
            rank updates the rows it owns.

    Forward:
        A :class:`KeyedJagged` (or TorchRec ``KeyedJaggedTensor``-like object) ->
        ``{feature: [B, embedding_dim]}`` in the table's dtype, in the order of
        ``kjt.keys()``. Features no table reads raise; tables whose features are absent
        from a batch are fine. Every rank of the group must call forward (and backward)
        the same number of times.

    Raises (forward; under a process group on every rank, the others a RuntimeError naming
    the rank that failed, with no table changed anywhere):
        TypeError, ValueError: a malformed input, checked as :class:`KeyedJagged`'s
            constructor checks its arguments (for a TorchRec-like object, naming its method,
            e.g. ``lengths()``); features no table reads; offsets or lengths that do not
            fit the values; a key out of range of a direct-mapped table.
        RuntimeError: a part of the input on another device than the collection (named).
        HashTableFullError: a table without eviction cannot take the batch's new keys.

    Example::

        ebc = sk.EmbeddingBagCollection([
            sk.TableConfig("users", 16, 100_000, ["user_id"]),
            sk.TableConfig("items", 64, 10_000, ["item_id", "last_item"], dtype=torch.bfloat16),
        ])
        kjt = sk.KeyedJagged(["user_id", "item_id"], values, lengths=lengths)
        pooled = ebc(kjt)            # {"user_id": [B, 16] float32, "item_id": [B, 64] bfloat16}
    """

    def __init__(self, tables: Sequence[Any], process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[torch.device, str]] = None,
                 fused_params: Optional[Mapping[str, Any]] = None, is_weighted: Optional[bool] = None,
                 output: Optional[str] = None) -> None:
        super().__init__()
        # One training forward at a time (see exchange._stepping); its tables' shards keep
        # locks of their own, which the collection's calls do not use.
        _make_step_lock(self)
        if isinstance(tables, TableConfig) or not isinstance(tables, (list, tuple)) or not tables \
                or not all(isinstance(t, TableConfig) or keyed.is_torchrec_config(t) for t in tables):
            raise TypeError("EmbeddingBagCollection: tables must be a non-empty list of sk.TableConfig (or TorchRec "
                            "EmbeddingBagConfig)")
        device_argument("EmbeddingBagCollection", device)
        # TorchRec's configs as given (embedding_bag_configs()), and its defaults when any
        # table comes as one: weights ignored unless weighted, a KeyedTensor in config order.
        self._given_configs = list(tables)
        from_torchrec = any(not isinstance(t, TableConfig) for t in tables)
        tables = [t if isinstance(t, TableConfig) else keyed.table_from_torchrec(t, TableConfig, KeySeededUniform)
                  for t in tables]
        if is_weighted is not None and not isinstance(is_weighted, bool):
            raise TypeError(f"EmbeddingBagCollection: is_weighted must be True, False or None, got {is_weighted!r}")
        self._weighted = (not from_torchrec) if is_weighted is None else is_weighted
        if output is None:
            output = "keyed" if from_torchrec else "dict"
        if output not in ("dict", "keyed"):
            raise ValueError(f"EmbeddingBagCollection: output must be 'dict' or 'keyed', got {output!r}")
        self._output = output
        # Checked again (a config may have been changed since it was built), as copies: a
        # config edited after the build (its combiner, dtype, capacity, ...) must not
        # half-change the built tables; like nn.Linear's arguments, the configs are read once.
        checked = [t._checked_copy() for t in tables]
        names = [t.name for t in checked]
        if len(set(names)) != len(names):
            raise ValueError(f"EmbeddingBagCollection: table names must be distinct, got {names}")
        self.tables = checked
        for table in self.tables:
            table.features = list(table.features)
        self._feature_table: Dict[str, int] = {}
        for index, table in enumerate(self.tables):
            for feature in table.features:
                if feature in self._feature_table:
                    raise ValueError(f"EmbeddingBagCollection: feature {feature!r} is read by tables "
                                     f"{self.tables[self._feature_table[feature]].name!r} and {table.name!r}; "
                                     "a feature reads one table (several features may share one)")
                self._feature_table[feature] = index
        self.process_group, self.world_size, self.rank = _resolve_group(process_group, "EmbeddingBagCollection")
        # A list, not a ModuleDict: a table may be called "items" or "a.b".
        self.shards = nn.ModuleList([_TableShard(t, i, self.process_group, device, seed)
                                     for i, (t, seed) in enumerate(zip(self.tables, _default_seeds(self.tables)))])
        self._shards: List[_TableShard] = list(self.shards)
        self._by_name = {t.name: shard for t, shard in zip(self.tables, self._shards)}
        # Tables of one dim are pooled together: one gather + segment_sum per dim, not per table.
        groups: Dict[int, List[int]] = {}
        for index, table in enumerate(self.tables):
            groups.setdefault(table.embedding_dim, []).append(index)
        self._groups = list(groups.values())
        self._group_of = {t: g for g, members in enumerate(self._groups) for t in members}
        sequence = [t for members in self._groups for t in members]
        self._sequence_position = torch.tensor([sequence.index(t) for t in range(len(self.tables))])
        self._config_agreed = self.world_size == 1
        if output == "keyed":
            dtypes = {t.dtype for t in self.tables}
            if len(dtypes) > 1:
                raise ValueError("EmbeddingBagCollection: output='keyed' (one [B, sum of dims] tensor) needs one "
                                 f"dtype across the tables, got {sorted(map(str, dtypes))}; use output='dict'")
        self._fused: Optional[FusedOptimizer] = None
        if fused_params is not None:
            self._fused = FusedOptimizer.from_params([shard.weight for shard in self._shards], fused_params)
        traced.register(self)

    # -- TorchRec's interface ---------------------------------------------------------------

    def embedding_bag_configs(self) -> List[Any]:
        """The tables' configs as given (``sk.TableConfig`` or TorchRec ``EmbeddingBagConfig``)."""
        return list(self._given_configs)

    def is_weighted(self) -> bool:
        """Whether the inputs' per-value weights are applied (TorchRec's ``is_weighted``:
        unweighted, a weighted input's weights are ignored)."""
        return self._weighted

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._shards[0].weight.device

    def torchrec_state_dict(self) -> Dict[str, Tensor]:
        """The tables in TorchRec's names, ``embedding_bags.<table>.weight`` (see
        :func:`sparsekit.keyed.torchrec_state_dict`)."""
        return keyed.torchrec_state_dict(self)

    def load_torchrec_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a TorchRec ``EmbeddingBagCollection``'s ``state_dict()`` (see
        :func:`sparsekit.keyed.load_torchrec_state_dict`)."""
        keyed.load_torchrec_state_dict(self, state_dict)

    @property
    def fused_optimizer(self) -> Optional[FusedOptimizer]:
        """The optimizer the backward applies to the tables (``fused_params``), or None: a
        ``torch.optim.Optimizer`` whose ``step()`` does nothing (the backward updated the
        rows), for LR schedulers and ``state_dict()`` / ``load_state_dict()``."""
        return self._fused

    def _fused_update(self, weights: Sequence[Tensor]) -> Any:
        """The fused update of ``weights`` for the backward; rows given to new keys since the
        last update (eviction) start from zero state first."""
        for shard in self._shards:
            if shard._fresh_rows is not None and any(shard.weight is w for w in weights):
                fresh = shard._fresh_rows.nonzero().squeeze(1)
                if fresh.numel():
                    self._fused.reset_rows(shard.weight, fresh)
                    shard._fresh_rows.zero_()
        return self._fused.update_of(list(weights))

    # -- module plumbing ------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        return _state_without_lock(super().__getstate__())

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Copies and unpickling end here: the copy must be found by its compiled graphs too.
        super().__setstate__(state)
        # A collection pickled before these settings existed: its behaviour then.
        for name, value in (("_weighted", True), ("_output", "dict"), ("_fused", None), ("_given_configs", None)):
            self.__dict__.setdefault(name, value)
        if self._given_configs is None:
            self._given_configs = list(self.tables)
        _make_step_lock(self)
        traced.register(self)

    def reset_parameters(self) -> None:
        """Puts every table's shard on this rank back in a new collection's state, in place
        (after ``to_empty()``, say): direct tables get their initial rows again, hash tables
        forget every key (see ``DistributedEmbedding.reset_parameters``). Optimizer state is
        not touched. Local: no collective."""
        for shard in self._shards:
            shard.reset_parameters()

    def __reduce_ex__(self, protocol):
        return _reduce_without_group(self, "EmbeddingBagCollection", protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> EmbeddingBagCollection:
        """An independent copy (its own tables, weights, flags and totals) over the same
        process group; each table's weight keeps its marks (see ``_deepcopy_sharing_group``)."""
        return _deepcopy_sharing_group(self, memo)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # The entries name the tables by position (shards.<i>): their names ride along in the
        # state dict's metadata (as nn.Module's versions do), so that a collection listing its
        # tables in another order can refuse the state instead of loading one into another.
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            metadata.setdefault(prefix[:-1], {})["tables"] = [table.name for table in self.tables]

    def _check_table_names(self, state_dict: Mapping[str, Any], prefix: str, saved: Any) -> None:
        """ValueError when the state's tables (``saved``: their names by position, recorded
        by ``state_dict()``) are not this collection's at the positions the state holds; a
        state without names (saved before they were recorded) loads by position."""
        if not isinstance(saved, (list, tuple)):
            return
        names = [table.name for table in self.tables]
        start = f"{prefix}shards."
        held = {key[len(start):].partition(".")[0] for key in state_dict if key.startswith(start)}
        if any(str(index) in held and (index >= len(saved) or saved[index] != name)
               for index, name in enumerate(names)):
            raise ValueError(f"EmbeddingBagCollection: load_state_dict: the state holds tables {list(saved)} (in that "
                             f"order) but this collection has {names}: its entries name tables by position "
                             "(shards.<i>), so one table would load another's keys and vectors; build the collection "
                             "with its tables in the saved order, or reshard with sk.save_checkpoint / "
                             "sk.load_checkpoint, which match tables by name")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Before any table loads: the state's tables must be these, at these positions.
        self._check_table_names(state_dict, prefix, local_metadata.get("tables"))
        # nn.Module loads the tables one after the other: every table's entries are checked
        # first, so that one table's bad state raises, or fails the call, before any table
        # changes (a table that finds the call failed already writes nothing).
        if not error_msgs:
            for index, shard in self.shards.named_children():
                error_msgs.extend(shard._check_load(state_dict, f"{prefix}shards.{index}."))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, but a call that raises changes no table: with
        ``strict=True`` missing and unexpected keys raise before anything loads, and every
        table's weight and hash table state are checked before any table changes. With
        ``strict=False`` the tables absent from the state keep theirs; a hash table's weight
        without its table state (or the reverse) raises ValueError.
        With state-dict or load hooks registered on it (or a submodule), which may rename,
        add or drop entries, the missing and unexpected keys are torch's own check, after
        the hooks ran."""
        _check_state_dict_keys(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    # -- per-table access ----------------------------------------------------------------------

    @property
    def weights(self) -> Dict[str, nn.Parameter]:
        """``{table name: its local shard}`` (model-parallel embedding variables)."""
        return {name: shard.weight for name, shard in self._by_name.items()}

    def _shard(self, table_name: str) -> _TableShard:
        # A str check first: an unhashable name (a list) would raise TypeError from the dict.
        if not isinstance(table_name, str) or table_name not in self._by_name:
            raise UnknownTableError(f"EmbeddingBagCollection: no table {table_name!r}; tables: "
                                    f"{list(self._by_name)}")
        return self._by_name[table_name]

    def stats(self, table_name: str) -> Dict[str, int]:
        """The table's ``size``, ``capacity``, ``evicted``, ``admitted`` and ``pending``,
        summed over ranks (a collective under a process group: every rank calls it with
        the same name).

        Raises:
            UnknownTableError: (a ``KeyError`` and a ``ValueError``) no table of that name,
                listing the tables. Under a process group every rank raises when any rank
                names no table: that rank this error, the others a ``RuntimeError``.
        """
        error: Optional[BaseException] = None
        try:
            shard = self._shard(table_name)
        except UnknownTableError as exc:
            error = exc
        if self.world_size > 1:
            # Agree on the table before the stats' all-reduce: with a bad name on one rank the
            # others would wait in it until the group's timeout, and with another good name
            # the sums would mix two tables. One all-reduce (MAX) of (bad, index, -index).
            index = -1 if error is not None else list(self._by_name).index(table_name)
            flags = torch.tensor([int(error is not None), index, -index], dtype=torch.int64,
                                 device=collective_device(self.process_group))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
            bad, highest, lowest = flags.tolist()
            if error is None and not bad and highest != -lowest:
                error = ValueError(f"EmbeddingBagCollection.stats: the ranks asked for different tables (this "
                                   f"rank {table_name!r}); every rank must name the same table")
            if error is not None:
                raise error
            if bad:
                raise RuntimeError(f"EmbeddingBagCollection.stats({table_name!r}) failed on another rank (see "
                                   "the error there); nothing was changed on this rank")
        elif error is not None:
            raise error
        with _stepping(self, True):  # not across the all-reduce: a forward's collectives may hold it
            values = shard._local_stats()
        return shard._summed_stats(values)

    def export(self, table_name: str, min_last_seen: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """This rank's keys of the table and their vectors (in the table's dtype); see
        :meth:`sparsekit.DistributedEmbedding.export`. Not a collective.

        Raises:
            UnknownTableError: (a ``KeyError`` and a ``ValueError``) no table of that name.
            ValueError: ``min_last_seen`` with a direct-mapped table.
        """
        shard = self._shard(table_name)
        with _stepping(self, True):  # keys and rows of one moment: no forward of the collection evicts in between
            return shard.export(min_last_seen)

    __prepare_scriptable__ = traced._refuse_scripting

    # -- forward ------------------------------------------------------------------------------

    def forward(self, kjt: Any) -> Dict[str, Tensor]:
        # torch.compile: one process traces the lookup (sparsekit.traced); with many ranks it
        # runs eagerly, one graph break per collection (see README, torch.compile).
        if self.world_size == 1 and torch.compiler.is_compiling():
            return self._traced_forward(kjt)
        return self._eager_forward(kjt)

    @compile_disabled
    def _eager_forward(self, kjt: Any) -> Dict[str, Tensor]:
        if torch.jit.is_tracing():
            traced.refuse_torchscript("EmbeddingBagCollection")
        with _stepping(self, self.training):
            return self._ticking(lambda: self._forward(kjt))

    def _ticking(self, forward: Callable[[], Any]) -> Any:
        """``forward()``, checked first, and every table's clock advanced after it in training."""
        # Every table's clock (and its pending keys' clock) advances once per training
        # forward on every rank, as a single layer's does, also for a table with no key this
        # step: clocks that drifted apart between tables or ranks would mix scores of
        # different ages when a checkpoint is resharded.
        if self.world_size == 1:  # else in the forward, where every rank hears of it
            _check_writable(self._shards, "EmbeddingBagCollection", self.training)
        clocks = self._clocks() if self.training else None
        out = forward()
        if clocks is not None:
            for shard, (table_clock, pending_clock) in zip(self._shards, clocks):
                if shard.hash_table is not None and shard.hash_table.clock == table_clock:
                    shard.hash_table.tick()
                if shard._pending is not None and shard._pending.clock == pending_clock:
                    shard._pending.tick()
        return out

    def _traced_forward(self, kjt: Any) -> Dict[str, Tensor]:
        """One process under torch.compile: the rows from the opaque ``sparsekit::_collection_rows``
        (:mod:`sparsekit.traced`), then a traced pooled read per feature. The eager forward's
        numbers, except an ulp with per-sample weights on float32 tables (a fused multiply-add)."""
        # The row op runs while the module holds its own parameters: a functional_call
        # substitute is seen here only.
        _check_own_weights(self._shards, "EmbeddingBagCollection", self.training)
        kjt = _as_keyed_jagged(kjt)
        features, values, weights = kjt.keys(), kjt.values(), kjt.weights_or_none() if self._weighted else None
        device = self._shards[0].weight.device
        self._check_features(kjt, features, values, weights, device)
        offsets = kjt.offsets().long()
        names = list(self._feature_table)
        # Raises there for what the eager forward refuses (bags that do not split into the
        # features, bad offsets, a full table, ...), before anything below reads the rows.
        found = traced.collection_rows(values, offsets, [names.index(f) for f in features], id(self))
        batch = (offsets.numel() - 1) // max(len(features), 1)
        pooled_of: Dict[str, Tensor] = {}
        lengths = offsets[1:] - offsets[:-1]
        # One pooled read per table, of all its features' bags: a weight read twice would get
        # two sparse gradients, which a compiled backward cannot add (see README). Each
        # table's rows fill the first places of an [nnz] array (a size the trace knows), -1
        # after them, in its last bag, where the kernels skip them.
        for t, members, (rows, table_offsets, positions) in zip(*self._tables_of(features),
                                                                zip(found[0::3], found[1::3], found[2::3])):
            shard = self._shards[t]
            # Fused: the read takes no gradient to the weight; the tap's backward updates it.
            weight = shard.weight if self._fused is None else shard.weight.detach()
            scale = None if weights is None else weights.index_select(0, positions.clamp(min=0)).float()
            if weight.dtype == torch.float32 or (scale is None and shard.config.combiner == "sum"):
                # A half table's kernel sums in float32 and rounds once, as the eager cast does.
                pooled = ops.embedding_bag(weight, rows, table_offsets, scale, "sum")
            else:  # float32 sums of the half rows, weighted or divided before the one rounding, as eager
                pooled = ops._pooled_float(weight, rows, table_offsets,
                                           None if scale is None else torch.where(positions >= 0, scale, 0))
            mean = shard.config.combiner == "mean"
            bag_lengths = torch.cat([lengths[f * batch:(f + 1) * batch] for f in members])
            if mean:
                pooled = _mean_of_sum(pooled, bag_lengths)
            pooled = pooled.to(weight.dtype)
            if self._fused is not None and shard.weight.requires_grad and torch.is_grad_enabled():
                # The bags without the -1 tail: a mean divides by a bag's own length.
                bags = torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)])
                pooled = traced.fused_tap(pooled, shard.weight, rows, bags,
                                          None if scale is None else scale.detach(), id(self), t, len(members),
                                          mean)
            for f, part in zip(members, pooled.split(batch) if batch > 0 else [pooled] * len(members)):
                pooled_of[features[f]] = part
        if self._output == "keyed":
            return self._keyed(pooled_of, batch)
        return {feature: pooled_of[feature] for feature in features}

    def _traced_update(self, weight: Tensor, grad: Tensor, rows: Tensor, offsets: Tensor, scale: Optional[Tensor],
                       table: int, num_features: int, mean: bool) -> None:
        """The body of ``sparsekit::_fused_update``: the fused optimizer's step of table
        ``table`` (state kept for its weight) applied to ``weight``, from the gradient of the
        table's pooled bags (its ``num_features`` features one after the other, ``[F * B, dim]``)
        over the CSR ``offsets`` of its values; ``rows`` may hold -1 after them (the trace's
        tail), read here as one more feature that nothing updates."""
        step = self._fused_update([self._shards[table].weight])
        batch = grad.shape[0] // num_features
        grads = list(grad.to(weight.dtype).contiguous().split(batch)) if batch else [grad] * num_features
        tables, means = [0] * num_features, [int(mean)] * num_features
        if batch:
            offsets = torch.cat([offsets, offsets[-1:].expand(batch - 1), offsets.new_full((1,), rows.numel())])
            grads, tables, means = grads + [grads[0][:0]], tables + [-1], means + [0]
        with torch.no_grad():
            torch.ops.sparsekit.pooled_read_update_([weight], step.state1, step.state2, step.steps, grads, rows,
                                                    offsets, scale, tables, means, step.optimizer, step.hyper,
                                                    step.lr)

    def _tables_of(self, features: List[str]) -> Tuple[List[int], List[List[int]]]:
        """The tables ``features`` read, in table order, and each one's features (positions in ``features``)."""
        members: Dict[int, List[int]] = {}
        for f, feature in enumerate(features):
            members.setdefault(self._feature_table[feature], []).append(f)
        tables = sorted(members)
        return tables, [members[t] for t in tables]

    def _traced_rows(self, values: Tensor, offsets: Tensor, features: List[int]) -> List[Tensor]:
        """The body of ``sparsekit::_collection_rows``: per table the rows of its features'
        values, their bags as CSR offsets and the values' positions, with the eager forward's
        checks and table changes."""
        names = list(self._feature_table)
        kjt = KeyedJagged([names[i] for i in features], values, offsets=offsets)
        with _stepping(self, self.training):
            return self._ticking(lambda: self._rows_of_tables(kjt))

    def _rows_of_tables(self, kjt: KeyedJagged) -> List[Tensor]:
        device = self._shards[0].weight.device
        prepared = self._prepare(kjt, device)
        self._raise_for_flags(int(prepared["flags"].item()), prepared)
        value_rows = torch.zeros(0, dtype=torch.int64, device=device)
        if prepared["pair_keys"].numel() > 0:
            rows = self._owner_lookup(prepared["send_keys"], prepared["send_tables"], [prepared["pairs_per_table"]],
                                      unique=True, vectors=False)
            rows = [r for r in rows if r is not None]
            value_rows = (torch.cat(rows) if len(rows) > 1 else rows[0]).index_select(0, prepared["pair_of_value"])
        bounds, batch, offsets = prepared["bounds"], prepared["batch"], prepared["offsets"]
        out: List[Tensor] = []
        nnz = value_rows.numel()
        for _, members in zip(*self._tables_of(prepared["features"])):
            positions = torch.full((nnz,), -1, dtype=torch.int64, device=device)
            rows = torch.full((nnz,), -1, dtype=torch.int64, device=device)
            # Each feature's bags, shifted to where its values land among the table's.
            parts, start = [], 0
            for f in members:
                a, b = bounds[f], bounds[f + 1]
                positions[start:start + b - a] = torch.arange(a, b, device=device)
                rows[start:start + b - a] = value_rows[a:b]
                parts.append(offsets[f * batch:(f + 1) * batch] + (start - a))
                start += b - a
            parts.append(offsets.new_full((1,), nnz))  # the last bag takes the -1 tail
            out += [rows, torch.cat(parts), positions]
        return out

    def _clocks(self) -> List[Tuple[Optional[int], Optional[int]]]:
        return [(None if s.hash_table is None else s.hash_table.clock, None if s._pending is None else s._pending.clock)
                for s in self._shards]

    def _forward(self, kjt: Any) -> Dict[str, Tensor]:
        device = self._shards[0].weight.device
        num_tables, world = len(self._shards), self.world_size
        error: Optional[BaseException] = None
        prepared = None
        flags = torch.zeros((), dtype=torch.int64, device=device)
        try:
            if world > 1:
                _check_writable(self._shards, "EmbeddingBagCollection", self.training)
            prepared = self._prepare(kjt, device, batch_only=world == 1)
            flags = prepared["flags"]
        except BaseException as exc:  # noqa: BLE001 - shared with every rank, then re-raised
            error = exc

        if world == 1:
            if error is not None:
                raise error
            self._raise_for_flags(int(flags.item()), prepared)
            step = engine.StepContext(prepared["features"], prepared["table_of_feature"], prepared["batch"],
                                      prepared["bounds"], prepared["offsets"], prepared["keys"], prepared["weights"])
            engine.resolve_rows(step, self._shards, self.training, self._direct_key_error)
            fused = self._fused_update if self._fused is not None else None
            if self._output == "keyed":
                keys, dims = self._keyed_layout()
                return keyed.KeyedTensor(keys, dims, engine.read_pooled(step, self._shards, fused, keys))
            return engine.read_pooled(step, self._shards, fused)

        device = _wire_device(self._shards[0].weight, self.process_group)  # meta tables: refused above
        if not self._config_agreed:
            config: Dict[str, object] = {"tables": ",".join(t.name for t in self.tables)}
            for shard in self._shards:
                config.update({f"{shard.config.name}.{key}": value for key, value in shard._config().items()})
            _agree_on_config(config, device, self.process_group, world, "EmbeddingBagCollection", "collection")
            self._config_agreed = True
        if error is None:
            per_owner_table = prepared["per_owner_table"]
        else:
            per_owner_table = torch.zeros(world, num_tables, dtype=torch.int64, device=device)
            flags = torch.tensor(_LOCAL_EXCEPTION, dtype=torch.int64, device=device)
        # Per owner: pair count, error flags, train/eval mode, then pairs per table. One host
        # read gives every split size and every rank's verdict.
        # Bit 1: this forward records a backward (see shard._check_modes_agree).
        records = torch.is_grad_enabled() and any(shard.weight.requires_grad for shard in self._shards)
        mode = torch.full((world, 1), int(self.training) | int(records) << 1, dtype=torch.int64, device=device)
        # Then whether this rank's batch lists a feature of each table: every rank learns which
        # tables some rank's batch names this step, and each such table gets a gradient on
        # every rank (empty where the rank owns none of its keys, or where no rank has any)
        # and its step counted, as in one process.
        listed = _device_ints(self._listed(prepared) if error is None else [False] * num_tables, device)
        # Then each table's weight dtype and row width: the configuration is compared once, and
        # a collection converted after (.half(), .double()) on one rank would train on with
        # tables that differ between the ranks.
        layouts = _device_ints([_row_layout(shard.weight) for shard in self._shards], device)
        send_header = torch.cat([per_owner_table.sum(1, keepdim=True), flags.expand(world, 1), mode,
                                 per_owner_table, listed.expand(world, num_tables), layouts.expand(world, num_tables)],
                                dim=1)
        recv_header = torch.empty_like(send_header)
        dist.all_to_all_single(recv_header, send_header.contiguous(), group=self.process_group)
        header = torch.cat([send_header, recv_header]).tolist()
        sent, got = header[:world], header[world:]
        peer_flags = [row[1] for row in got]
        if any(peer_flags):
            if error is not None:
                raise error
            self._raise_for_flags(peer_flags[self.rank], prepared)
            failed = [rank for rank, flag in enumerate(peer_flags) if flag]
            raise RuntimeError(f"EmbeddingBagCollection: rank(s) {failed} of the process group rejected their "
                               "input (see the error on those ranks); no rank went on with this step")
        _check_modes_agree("EmbeddingBagCollection", "collection", [row[2] for row in got])
        peer_layouts = [row[3 + 2 * num_tables:] for row in got]
        differing = [t for t in range(num_tables) if len({layout[t] for layout in peer_layouts}) > 1]
        if differing:
            table = differing[0]
            shown = ", ".join(f"rank {rank}: {_row_layout_text(layout[table])}"
                              for rank, layout in enumerate(peer_layouts))
            raise ValueError(f"EmbeddingBagCollection: table {self.tables[table].name!r}'s weight dtype or row width "
                             f"differs between the ranks of the process group ({shown}); convert the collection alike "
                             "on every rank")
        dims = [shard.embedding_vec_size for shard in self._shards]
        sent_counts = [row[3:3 + num_tables] for row in sent]
        got_counts = [row[3:3 + num_tables] for row in got]
        present = [any(row[3 + num_tables + t] > 0 for row in got) for t in range(num_tables)]
        send_pairs = torch.stack([prepared["send_keys"], prepared["send_tables"]], dim=1)
        recv_pairs = _all_to_all_rows(send_pairs, [row[0] for row in got], [row[0] for row in sent],
                                      self.process_group)
        per_group = self._owner_lookup(recv_pairs[:, 0], recv_pairs[:, 1], got_counts, unique=False,
                                       present=present)
        # The vectors go back in the pairs' order: per source rank, table by table.
        flat = self._pack(per_group, got_counts)
        send_elements = [sum(n * d for n, d in zip(row, dims)) for row in sent_counts]
        recv_elements = [sum(n * d for n, d in zip(row, dims)) for row in got_counts]
        back = _AllToAll.apply(flat, send_elements, recv_elements, self.process_group)
        pooled = self._pool(prepared, self._unpack(back, sent_counts), sent_counts)
        return self._keyed(pooled, prepared["batch"]) if self._output == "keyed" else pooled

    def _keyed_layout(self) -> Tuple[List[str], List[int]]:
        """The keyed output's features (every table's, in config order) and their widths."""
        keys = [f for table in self.tables for f in table.features]
        return keys, [self._shards[self._feature_table[f]].embedding_vec_size for f in keys]

    def _keyed(self, pooled: Dict[str, Tensor], batch: int) -> "keyed.KeyedTensor":
        """The dict of a multi-rank step as the keyed output: every table's features in
        config order, a feature absent from the batch reading as zeros (as in one process)."""
        keys, dims = self._keyed_layout()
        weight = self._shards[0].weight
        parts = [pooled[f] if f in pooled else weight.new_zeros(batch, d) for f, d in zip(keys, dims)]
        return keyed.KeyedTensor(keys, dims, torch.cat(parts, dim=1))

    def _listed(self, prepared: Dict[str, Any]) -> List[bool]:
        """Per table, whether the batch names one of its features (even with no keys): such
        a table joins the lookup and gets a gradient, empty if it read no row, so that its
        optimizer step counts as nn.EmbeddingBag's does for an empty input."""
        listed = [False] * len(self._shards)
        for t in prepared["table_of_feature"]:
            listed[t] = True
        return listed

    def _table_offsets(self, counts: List[List[int]]) -> List[int]:
        """Row of each table's first pair in its dim group's block (tables of a group
        stacked in group order, each with ``sum_s counts[s][t]`` rows)."""
        offsets = [0] * len(self._shards)
        for members in self._groups:
            start = 0
            for t in members:
                offsets[t] = start
                start += sum(row[t] for row in counts)
        return offsets

    def _pack(self, per_group: List[Optional[Tensor]], counts: List[List[int]]) -> Tensor:
        """One flat float32 buffer: for each rank s, for each table t, the ``counts[s][t]``
        rows of that rank in table t's part of its dim group's block."""
        device = self._shards[0].weight.device
        pieces: Dict[Tuple[int, int], Tensor] = {}
        # A group that sends nothing back but looked up (no rows) stays in the graph through
        # an empty piece, so that its tables get their (empty) gradients and the backward's
        # exchange runs here as on the other ranks.
        unsent = []
        for g, members in enumerate(self._groups):
            order = [(s, t) for t in members for s in range(len(counts)) if counts[s][t] > 0]
            if not order:
                if per_group[g] is not None:
                    unsent.append(per_group[g].reshape(-1)[:0])
                continue
            # One split per group (its backward is one cat), in the block's (table, rank) order.
            for key, part in zip(order, per_group[g].split([counts[s][t] for s, t in order])):
                pieces[key] = part.reshape(-1)
        flat = [pieces[(s, t)] for s in range(len(counts)) for t in range(len(self._shards)) if (s, t) in pieces]
        flat += unsent
        return torch.cat(flat) if flat else torch.zeros(0, device=device)

    def _unpack(self, flat: Tensor, counts: List[List[int]]) -> List[Optional[Tensor]]:
        """The inverse of :meth:`_pack`: per dim group, its tables' rows (table after table
        in group order, each rank after rank), ``[rows, dim]``."""
        dims = [shard.embedding_vec_size for shard in self._shards]
        order = [(s, t) for s, row in enumerate(counts) for t, n in enumerate(row) if n > 0]
        blocks: Dict[Tuple[int, int], Tensor] = {}
        if order:
            for (s, t), part in zip(order, flat.split([counts[s][t] * dims[t] for s, t in order])):
                blocks[(s, t)] = part.view(counts[s][t], dims[t])
        out: List[Optional[Tensor]] = []
        for members in self._groups:
            parts = [blocks[(s, t)] for t in members for s in range(len(counts)) if (s, t) in blocks]
            if not parts and flat.requires_grad:
                # No rows of this group came back, but the pooled zeros hang on the exchange's
                # output, so that every rank's backward reaches it (see _pack).
                parts = [flat[:0].view(0, dims[members[0]])]
            out.append(torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None))
        return out

    def _check_features(self, kjt: KeyedJagged, features: List[str], values: Tensor, weights: Optional[Tensor],
                        device: torch.device) -> None:
        """The input's checks that need no data: every feature read by a table, once, every tensor on ``device``."""
        unknown = [f for f in features if f not in self._feature_table]
        if unknown:
            raise ValueError(f"EmbeddingBagCollection: no table reads feature(s) {unknown}; tables read "
                             f"{sorted(self._feature_table)}")
        if len(set(features)) != len(features):
            raise ValueError(f"EmbeddingBagCollection: the input names a feature twice: {features}")
        for arg, tensor in (("values", values), ("lengths", kjt._lengths), ("offsets", kjt._offsets),
                            ("weights", weights)):
            if tensor is not None and tensor.device != device:
                raise RuntimeError(f"{_INPUT}{kjt._labels[arg]} is on {tensor.device} but the collection is on "
                                   f"{device}; move it there with .to({str(device)!r})")
        if (weights is not None and not torch.compiler.is_compiling() and weights.is_inference()
                and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                and any(shard.weight.requires_grad for shard in self._shards)):
            # The weighted sum saves them for backward, which autograd refuses only after a
            # training step's keys went into the tables.
            raise RuntimeError(f"{_INPUT}{kjt._labels['weights']} was made under torch.inference_mode() and cannot "
                               "be saved for backward; make it outside inference_mode (a clone() there will do), "
                               "or run the forward under torch.no_grad() / inference_mode")

    def _prepare(self, kjt: Any, device: torch.device, batch_only: bool = False) -> Dict[str, Any]:
        """Reads and checks this rank's input; dedups its (table, key) pairs. With
        ``batch_only`` (one process) it stops before the dedup: ``"keys"`` and no
        ``"pair_keys"``."""
        kjt = _as_keyed_jagged(kjt)  # raises TypeError / ValueError for a malformed input
        # An unweighted collection ignores the input's weights (TorchRec's is_weighted).
        features, values, weights = kjt.keys(), kjt.values(), kjt.weights_or_none() if self._weighted else None
        self._check_features(kjt, features, values, weights, device)
        offsets = kjt.offsets()
        num_features = len(features)
        num_bags = offsets.numel() - 1
        if num_features == 0:
            if num_bags > 0 or values.numel() > 0:
                raise ValueError("EmbeddingBagCollection: an input without features must be empty")
            if self.world_size > 1 and self.training and torch.is_grad_enabled():
                # Its forward returns {}: no tensor to call backward on, while every other
                # rank's backward waits in the gradients' all-to-all for this one.
                raise ValueError("EmbeddingBagCollection: the input names no feature, so this rank's output "
                                 "would hold nothing to call backward on while the other ranks' backward waits "
                                 "for it; give an empty batch with its features named (lengths of zeros, or "
                                 "B = 0) instead")
            batch = 0
        else:
            if num_bags < 0 or num_bags % num_features != 0:
                raise ValueError(f"EmbeddingBagCollection: {num_bags} bags do not split into {num_features} "
                                 "features of equal batch size (lengths must be [len(keys) * B], offsets "
                                 "[len(keys) * B + 1])")
            batch = num_bags // num_features
        offsets = offsets.long()
        nnz = values.numel()
        one_per_bag = None  # valid offsets with one value per bag (decided below when on the host)
        if offsets.device.type == "cpu":
            # Offsets that strictly rise from 0 to nnz == num_bags are valid and rise by exactly
            # one per bag: one numpy pass decides both for such an input (neighbours compared,
            # never subtracted: int64 differences can wrap, as lengths of 2**63 - 1 make them).
            host = offsets.detach().numpy()
            rising = num_bags == 0 or not bool((host[1:] <= host[:-1]).any())
            one_per_bag = bool(rising and nnz == num_bags and host[0] == 0 and host[-1] == nnz)
        flags = torch.zeros((), dtype=torch.int64) if one_per_bag else _offsets_error_flags(offsets, nnz)
        # Feature boundaries in the values (one host read for every feature).
        bounds = offsets[::batch].tolist() if batch > 0 else [0] * (num_features + 1)
        flags_bad_bounds = len(bounds) != num_features + 1 or any(b < a for a, b in zip(bounds, bounds[1:])) \
            or bounds[0] != 0 or bounds[-1] != nnz
        if flags_bad_bounds:
            flags = flags | _BAD_OFFSETS
            bounds = [0] * (num_features + 1)
            keys = values.new_empty(0).long()
        else:
            keys = values.long()
        table_of_feature = [self._feature_table[f] for f in features]
        if not flags_bad_bounds and one_per_bag is None:
            one_per_bag = _one_per_bag(offsets, keys.numel())
        if batch_only:
            return {"features": features, "batch": batch, "bounds": bounds, "offsets": offsets, "keys": keys,
                    "weights": weights, "table_of_feature": table_of_feature, "flags": flags}
        num_tables = len(self._shards)
        # The distinct (table, key) pairs, table after table: feature f's values are
        # bounds[f]:bounds[f + 1], a segment of its table.
        if keys.numel() > 0:
            pair_keys, pair_of_value, per_table = _unique_tables(keys, bounds, table_of_feature, num_tables)
        else:
            pair_keys = pair_of_value = torch.zeros(0, dtype=torch.int64, device=device)
            per_table = torch.zeros(num_tables, dtype=torch.int64, device=device)
        pair_tables = ops._repeat_interleave(torch.arange(num_tables, device=device), per_table, pair_keys.numel())
        # Direct-mapped tables: keys must lie in [0, capacity * world_size).
        if any(s.hash_table is None for s in self._shards) and pair_keys.numel() > 0:
            limits = _device_ints([-1 if s.hash_table is not None else s.num_keys_capacity for s in self._shards],
                                  device)
            limit = limits.index_select(0, pair_tables)
            bad = (limit >= 0) & ((pair_keys < 0) | (pair_keys >= limit))
            flags = flags | (bad.any().long() * _BAD_KEY)
        # Send order: by owner, then by table (stable): every (owner, table) block is
        # contiguous, so vectors travel as per-table 2-D blocks. One owner: the pairs are
        # in that order already.
        world = self.world_size
        if world == 1:
            order, block, block_counts = None, pair_tables, per_table
        else:
            block = _owners(pair_keys, world, pair_tables) * num_tables + pair_tables
            order = torch.sort(block, stable=True).indices
            block = block.index_select(0, order)
            block_counts = torch.bincount(block, minlength=world * num_tables)
        # A pair's row in its table's received block (blocks of a table stacked rank by rank).
        counts = block_counts.view(world, num_tables)
        before_in_table = torch.cumsum(counts, 0) - counts              # same table, earlier owners
        block_starts = torch.cumsum(block_counts, 0) - block_counts      # position of each block in send order
        send_rank_in_table = torch.arange(block.numel(), device=device) + \
            (before_in_table.reshape(-1) - block_starts).index_select(0, block)
        pair_row = send_rank_in_table if order is None else \
            torch.empty_like(order).index_copy_(0, order, send_rank_in_table)
        # All bags' ids at once (per feature: minus f * batch), when pooling needs them.
        one_per_bag = not flags_bad_bounds and one_per_bag
        bag_of_value = None
        if weights is not None or not one_per_bag:
            if flags_bad_bounds or num_bags == 0:
                bag_of_value = keys.new_zeros(0 if flags_bad_bounds else keys.numel())
            else:
                # Bad offsets are only flagged so far (raised once every rank knows): count the
                # bags from offsets made valid (valid ones unchanged), so that repeat_interleave
                # never sees a negative length or a total other than nnz.
                safe = torch.cummax(offsets.clamp(0, nnz), 0).values
                safe[-1] = nnz
                bag_of_value = ops._repeat_interleave(torch.arange(num_bags, device=device), safe[1:] - safe[:-1],
                                                      keys.numel())
        return {"features": features, "batch": batch, "bounds": bounds, "offsets": offsets, "weights": weights,
                "table_of_feature": table_of_feature, "pair_keys": pair_keys, "pair_tables": pair_tables,
                "pair_of_value": pair_of_value, "pair_row": pair_row, "bag_of_value": bag_of_value,
                "send_keys": pair_keys if order is None else pair_keys.index_select(0, order),
                "send_tables": pair_tables if order is None else pair_tables.index_select(0, order),
                "per_owner_table": counts,
                # One process: the pairs per table (one host read; with a group the header has them).
                "pairs_per_table": counts[0].tolist() if world == 1 else None, "flags": flags,
                "one_per_bag": one_per_bag}

    def _raise_for_flags(self, flags: int, prepared: Optional[Dict[str, Any]]) -> None:
        if flags & _BAD_OFFSETS:
            raise ValueError("EmbeddingBagCollection: offsets must start at 0, never decrease and end at "
                             "len(values) (lengths must be >= 0 and sum to len(values))")
        if flags & _BAD_KEY:
            keys, tables = prepared["pair_keys"], prepared["pair_tables"]
            for index, shard in enumerate(self._shards):
                if shard.hash_table is not None:
                    continue
                mine = keys[tables == index]
                bad = mine[(mine < 0) | (mine >= shard.num_keys_capacity)]
                if bad.numel() > 0:
                    raise self._direct_key_error(index, int(bad[0]))

    def _direct_key_error(self, table: int, key: int) -> ValueError:
        """The error for ``key`` given to direct-mapped table ``table`` outside its range."""
        shard = self._shards[table]
        return ValueError(f"EmbeddingBagCollection: key {key} of table {shard.config.name!r} is out of range: with "
                          f"use_hashtable=False keys must lie in [0, capacity * world_size) = "
                          f"[0, {shard.num_keys_capacity})")

    def _owner_lookup(self, keys: Tensor, tables: Tensor, counts: List[List[int]], unique: bool,
                      vectors: bool = True, present: Optional[List[bool]] = None) -> List[Optional[Tensor]]:
        """The owner's part: per dim group, float32 vectors ``[n, dim]`` of the pairs it received,
        grouped by source rank, then table. ``unique``: the pairs are already distinct and grouped
        by table (one process); with ``vectors=False`` the rows instead."""
        device = keys.device
        num_tables = len(self._shards)
        # The distinct owned pairs, table after table.
        # Plan every table's lookup, agree across ranks, then commit: a failure anywhere
        # changes no table on any rank. The dedup of the received pairs is part of it, so an
        # out-of-memory there cannot leave the other ranks waiting in the status all-reduce.
        plans: List[Any] = [None] * num_tables
        error: Optional[BaseException] = None
        try:
            if unique:
                owned_keys, owned_of_received = keys, None
                owned_per_table = [sum(row[t] for row in counts) for t in range(num_tables)]
            else:
                sizes = [n for row in counts for n in row]
                owned_keys, owned_of_received, per_table = _unique_tables(
                    keys, list(itertools.accumulate(sizes, initial=0)), list(range(num_tables)) * len(counts),
                    num_tables)
                owned_per_table = per_table.tolist()
            self._plan_tables(owned_keys, owned_per_table, plans)
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, then it is re-raised
            error = exc
        training_tables = self.training and any(s.hash_table is not None for s in self._shards)
        if self.world_size > 1 and training_tables:
            kind = 0 if error is None else (_TABLE_FULL if isinstance(error, HashTableFullError) else _OWNER_EXCEPTION)
            # torch.full: a fill, where torch.tensor(..., device=cuda) would wait for the stream.
            status = torch.full((1,), 0 if error is None else (self.rank + 1) * 4 + kind, dtype=torch.int64,
                                device=device)
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.process_group)
            word = int(status.item())
            if word != 0:
                if error is not None:
                    raise error
                failed_rank, failed_kind = word // 4 - 1, word % 4
                what = ("a hash table is full (or, with eviction, one call holds more distinct keys than it "
                        "holds)" if failed_kind == _TABLE_FULL else "the lookup failed")
                raise (HashTableFullError if failed_kind == _TABLE_FULL else RuntimeError)(
                    f"EmbeddingBagCollection: on rank {failed_rank} {what} (see the error there); no rank went on "
                    "with this step")
        elif error is not None:
            raise error
        rows = self._commit_tables(plans)
        if not vectors:
            return rows
        # Per dim group, its tables' owned vectors stacked in group order.
        owned_offsets = self._table_offsets([owned_per_table])
        if present is not None and self.training:
            # A table with keys on some rank but none owned here reads no row, yet joins the
            # lookup: its weight's gradient is then empty, not missing, and the backward's
            # exchange runs on this rank as on the others.
            rows = [torch.empty(0, dtype=torch.int64, device=device) if r is None and present[t] else r
                    for t, r in enumerate(rows)]
        stacked = []
        for members in self._groups:
            members = [t for t in members if rows[t] is not None]
            shards = [self._shards[t] for t in members]
            stacked.append(_LookupTables.apply([rows[t] for t in members], [s._grad_marker for s in shards],
                                               [s._may_miss() for s in shards],
                                               self._fused_update if self._fused is not None else None,
                                               *[s.weight for s in shards])
                           if members else None)
        if unique:
            return stacked  # the pairs came table by table, each once: already in block order
        # Each received pair's row in its group's stacked vectors (its owned pair's rank in
        # its table plus the table's offset in the group); then the received pairs in block
        # order (group by group, table by table, each in received order).
        table_starts = itertools.accumulate(owned_per_table, initial=0)
        shift = _device_ints([o - s for o, s in zip(owned_offsets, table_starts)], device)
        row_of_received = owned_of_received + shift.index_select(0, tables)
        in_block_order = torch.sort(_device_ints(self._sequence_position, device).index_select(0, tables),
                                    stable=True).indices
        out: List[Optional[Tensor]] = []
        start = 0
        for g, members in enumerate(self._groups):
            n = sum(row[t] for row in counts for t in members)
            if n == 0:
                out.append(None if stacked[g] is None else stacked[g][:0])
                continue
            out.append(_GatherRows.apply(stacked[g], row_of_received.index_select(0, in_block_order[start:start + n])))
            start += n
        return out

    def _plan_tables(self, keys: Tensor, per_table: List[int], plans: List[Any]) -> None:
        """Fills ``plans[t]``, what table t does for its distinct owned keys this step (None: no
        keys), changing nothing; may raise. Present keys only scored (:class:`_PresentRows`), new
        keys that fit only placed (:class:`_GrowRows`), else an insert plan as the single layers'."""
        starts = list(itertools.accumulate(per_table, initial=0))
        searched = [t for t, shard in enumerate(self._shards) if per_table[t] > 0 and shard.hash_table is not None
                    and (not self.training or shard._pending is None)]
        growing: List[Tuple[int, Tensor, Tensor]] = []  # (table, its keys' rows, its new keys)
        if searched:
            every = len(searched) == sum(1 for count in per_table if count > 0)
            segments = list(itertools.accumulate((per_table[t] for t in searched), initial=0))
            part = keys if every else torch.cat([keys[starts[t]:starts[t + 1]] for t in searched])
            found = _find_in_tables([self._shards[t].hash_table for t in searched], part, segments)
            if self.training:
                missing = found < 0
                misses = missing.long().cumsum(0).index_select(
                    0, _device_ints(segments[1:], found.device) - 1).tolist()
                misses = [b - a for a, b in zip([0] + misses, misses)]
                new_keys = part[missing].split(misses) if sum(misses) > 0 else ()
            for i, t in enumerate(searched):
                rows = found[segments[i]:segments[i + 1]]
                if not self.training:
                    plans[t] = rows
                elif misses[i] == 0:
                    plans[t] = _PresentRows(rows)
                else:
                    shard = self._shards[t]
                    table = shard.hash_table
                    if table._eviction is None and shard._fresh_rows is None \
                            and misses[i] <= table.capacity - len(table):
                        growing.append((t, rows, new_keys[i]))
            for (t, rows, keys_of_table), initial in zip(growing, self._initial_rows(growing)):
                plans[t] = _GrowRows(rows, keys_of_table, initial)
        for t, shard in enumerate(self._shards):
            if per_table[t] > 0 and plans[t] is None:
                plans[t] = shard._plan(keys[starts[t]:starts[t + 1]])

    def _commit_tables(self, plans: List[Any]) -> List[Optional[Tensor]]:
        """Carries out the plans of :meth:`_plan_tables`: each table's rows (None: no keys).
        The tables that place new keys do it together (one op on the CPU), and with those
        that only score rows they are scored together in one op."""
        found: Dict[int, Tensor] = {}
        growing = [t for t, plan in enumerate(plans) if isinstance(plan, _GrowRows)]
        if growing:
            found.update(zip(growing, self._grow([self._shards[t] for t in growing], [plans[t] for t in growing])))
        found.update((t, plan.rows) for t, plan in enumerate(plans) if isinstance(plan, _PresentRows))
        if found:
            rows = list(found.values())
            tables = [self._shards[t].hash_table for t in found]
            _touch_tables(tables, torch.cat(rows) if len(rows) > 1 else rows[0],
                          list(itertools.accumulate((r.numel() for r in rows), initial=0)))
            for table in tables:
                table.tick()
        return [None if plan is None else found[t] if t in found else shard._commit(plan)
                for t, (shard, plan) in enumerate(zip(self._shards, plans))]

    @torch.no_grad()
    def _grow(self, shards: List[_TableShard], plans: List["_GrowRows"]) -> List[Tensor]:
        """Gives the new keys of each shard's :class:`_GrowRows` plan the table's next rows and
        their initial vectors, as a single layer's insert would, and returns every key's row per
        shard; the caller scores them."""
        counts = [plan.new_keys.numel() for plan in plans]
        sizes = _place_new_keys(shards, torch.cat([plan.new_keys for plan in plans]) if len(plans) > 1
                                else plans[0].new_keys, counts, [plan.initial for plan in plans])
        # A new key's row: its table's old size plus its rank among the table's new keys,
        # i.e. its rank among all new keys (a running count) shifted per table.
        lengths = [plan.rows.numel() for plan in plans]
        rows = torch.cat([plan.rows for plan in plans]) if len(plans) > 1 else plans[0].rows
        missing = rows < 0
        shift = _device_ints([size - before for size, before in zip(sizes, itertools.accumulate(counts, initial=0))],
                             rows.device)
        shift = ops._repeat_interleave(shift, _device_ints(lengths, rows.device), rows.numel())
        new_rows = missing.cumsum(0).sub_(1).add_(shift)
        return list(torch.where(missing, new_rows, rows).split(lengths))

    def _initial_rows(self, new: List[Tuple[int, Tensor, Tensor]]) -> List[Tensor]:
        """The initial vectors of the new keys of each ``(table, rows, new keys)``: one call per
        group of tables sharing one :class:`KeySeededUniform`, dim and dtype, else one per table."""
        groups: Dict[Any, List[int]] = {}
        for i, (t, _, _) in enumerate(new):
            shard = self._shards[t]
            init = shard.embedding_initializer
            group = (init.seed, init.low, init.high, shard.embedding_vec_size, shard.weight.dtype) \
                if type(init) is KeySeededUniform else t
            groups.setdefault(group, []).append(i)
        out: List[Optional[Tensor]] = [None] * len(new)
        for members in groups.values():
            keys = [new[i][2] for i in members]
            initial = self._shards[new[members[0]][0]].initial_rows(
                torch.cat(keys).long() if len(keys) > 1 else keys[0].long())
            for i, part in zip(members, initial.split([k.numel() for k in keys])):
                out[i] = part
        return out

    def _pool(self, prepared: Dict[str, Any], per_group: List[Optional[Tensor]],
              counts: List[List[int]]) -> Dict[str, Tensor]:
        """Per dim group, one gather + segment sum for all its features' bags (in float32)
        from the group's block of vectors ``per_group[g]`` (the exchange's); then per
        feature the mean and the cast to its table's dtype."""
        device = self._shards[0].weight.device
        batch, bounds, offsets, weights = prepared["batch"], prepared["bounds"], prepared["offsets"], \
            prepared["weights"]
        bag_of_value = prepared["bag_of_value"]
        shift = _device_ints(self._table_offsets(counts), device)
        # Each value's row in its dim group's block (its pair's row in its table's part).
        value_row = (prepared["pair_row"] + shift.index_select(0, prepared["pair_tables"])).index_select(
            0, prepared["pair_of_value"])
        features = prepared["features"]
        pooled_of: Dict[int, Tensor] = {}
        for g, members in enumerate(self._groups):
            group_features = [f for f in range(len(features)) if self._group_of[prepared["table_of_feature"][f]] == g]
            if not group_features:
                continue
            dim = self._shards[members[0]].embedding_vec_size
            # Runs of consecutive features, (first, last, position in the group): a run's
            # values are contiguous, and its bags are the run's bags shifted by one amount.
            runs: List[Tuple[int, int, int]] = []
            for k, f in enumerate(group_features):
                if runs and runs[-1][1] == f - 1:
                    runs[-1] = (runs[-1][0], f, runs[-1][2])
                else:
                    runs.append((f, f, k))

            def cut(values: Tensor, shifts: Optional[List[int]] = None) -> Tensor:
                parts = [values[bounds[first]:bounds[last + 1]] for first, last, _ in runs]
                if shifts is not None:
                    parts = [part + amount for part, amount in zip(parts, shifts)]
                return parts[0] if len(parts) == 1 else torch.cat(parts)

            nnz = sum(bounds[f + 1] - bounds[f] for f in group_features)
            num_bags = len(group_features) * batch
            if nnz == 0:
                pooled = torch.zeros(num_bags, dim, device=device)
                joined = per_group[g]
                if joined is not None and joined.requires_grad:
                    pooled = pooled + joined.sum(0)  # zeros, joined to the lookup's graph
            elif weights is None and prepared["one_per_bag"]:
                # One output per feature, and a backward that reads their gradients in place.
                parts = _GatherPieces.apply(per_group[g], cut(value_row), [batch] * len(group_features))
                for f, part in zip(group_features, parts):
                    pooled_of[f] = part
                continue
            else:
                bag = cut(bag_of_value, [(k - first) * batch for first, _, k in runs])
                if weights is None:
                    # The runs' bags in CSR over the group's positions.
                    starts = itertools.accumulate((bounds[last + 1] - bounds[first] for first, last, _ in runs),
                                                  initial=0)
                    group_offsets = [offsets[first * batch:(last + 1) * batch] + (start - bounds[first])
                                     for (first, last, _), start in zip(runs, starts)]
                    pooled = _PoolRows.apply(per_group[g], cut(value_row), bag,
                                             torch.cat(group_offsets + [offsets.new_full((1,), nnz)]))
                else:
                    vectors = _GatherRows.apply(per_group[g], cut(value_row)) * cut(weights).float().unsqueeze(1)
                    pooled = ops.segment_sum(vectors, bag, num_bags)
            # One split (its backward is one cat), not a slice per feature (each slice's
            # backward would zero-fill the whole block).
            for f, part in zip(group_features, pooled.split(batch) if batch > 0 else
                               [pooled] * len(group_features)):
                pooled_of[f] = part
        return self._finish(prepared, pooled_of)

    def _finish(self, prepared: Dict[str, Any], pooled_of: Dict[int, Tensor]) -> Dict[str, Tensor]:
        """Per feature its pooled float32 vectors ``pooled_of[f]``: the mean (combiner
        "mean") and the cast to its table's dtype."""
        batch, offsets = prepared["batch"], prepared["offsets"]
        out: Dict[str, Tensor] = {}
        for f, feature in enumerate(prepared["features"]):
            shard = self._shards[prepared["table_of_feature"][f]]
            pooled = pooled_of[f]
            if shard.config.combiner == "mean":
                bags = offsets[f * batch:(f + 1) * batch + 1]
                pooled = _mean_of_sum(pooled, bags[1:] - bags[:-1])
            dtype = shard.weight.dtype
            out[feature] = pooled if pooled.dtype == dtype else pooled.to(dtype)  # .to() costs even then
        return out

    def extra_repr(self) -> str:
        return f"tables={[t.name for t in self.tables]}, rank={self.rank}, world_size={self.world_size}"

"""TorchRec interop for :class:`~sparsekit.EmbeddingBagCollection`, duck-typed (torchrec is
never imported): its ``EmbeddingBagConfig`` taken as a table, a ``KeyedTensor``-compatible
output, and state dicts in TorchRec's names. See ``docs/torchrec.md``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Mapping, Sequence

import torch
from torch import Tensor

from ._checks import integer_argument

__all__ = ["KeyedTensor", "is_torchrec_config", "torchrec_state_dict"]

# TorchRec's DataType and PoolingType, by name.
_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
_POOLING = {"SUM": "sum", "MEAN": "mean"}


def _width(value: Any) -> Any:
    """A feature's width as an int (the project's rule: :func:`integer_argument`), None
    when it is none."""
    try:
        return integer_argument("KeyedTensor", "length_per_key", value)
    except TypeError:
        return None


class KeyedTensor:
    """TorchRec's ``KeyedTensor``: every feature's pooled ``[B, D]`` side by side in one
    ``[B, sum of D]`` tensor, ``keys()`` in order, ``length_per_key()`` their widths.

    Args:
        keys: the feature names, in column order.
        length_per_key: each feature's width.
        values: ``[B, sum(length_per_key)]``.
        key_dim: the dimension the features lie along (1).
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor, key_dim: int = 1) -> None:
        if key_dim != 1:
            raise ValueError(f"KeyedTensor: key_dim must be 1 (features side by side), got {key_dim}")
        if not isinstance(values, Tensor):
            raise TypeError(f"KeyedTensor: values must be a tensor, got {type(values).__name__}")
        widths = [_width(n) for n in length_per_key]
        if any(n is None or n < 0 for n in widths):
            raise ValueError(f"KeyedTensor: length_per_key must hold ints >= 0, got {list(length_per_key)}")
        if len(keys) != len(length_per_key) or values.dim() != 2 or values.shape[1] != sum(widths):
            raise ValueError(f"KeyedTensor: {len(keys)} keys of widths {list(length_per_key)} do not lay out values "
                             f"of shape {tuple(values.shape)}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"KeyedTensor: keys must be distinct, got {list(keys)}")
        self._keys, self._lengths, self._values = list(keys), widths, values
        self._index = {key: i for i, key in enumerate(self._keys)}

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return 1

    def device(self) -> torch.device:
        return self._values.device

    def _key_indices(self) -> Dict[str, int]:
        """Each key's place (TorchRec's regrouping of keys used more or less than once reads it)."""
        return dict(self._index)

    def record_stream(self, stream: Any) -> None:
        self._values.record_stream(stream)

    def length_per_key(self) -> List[int]:
        return self._lengths

    def offset_per_key(self) -> List[int]:
        out = [0]
        for n in self._lengths:
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._index:
            raise KeyError(f"KeyedTensor: no key {key!r}; keys: {self._keys}")
        start = self.offset_per_key()[self._index[key]]
        return self._values[:, start:start + self._lengths[self._index[key]]]

    def to_dict(self) -> Dict[str, Tensor]:
        """``{key: [B, D]}`` in key order: column views of :meth:`values` (one split)."""
        return dict(zip(self._keys, self._values.split(self._lengths, dim=1)))

    def to(self, device: Any, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(self._keys, self._lengths, self._values.to(device, non_blocking=non_blocking))

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths}, values={tuple(self._values.shape)})"


class TorchRecInit:
    """A TorchRec config's ``init_fn`` (it fills a weight in place, e.g.
    ``partial(nn.init.normal_, std=0.02)``) as a table's initializer: the rows asked for
    are a new ``[n, dim]`` float32 tensor that it fills (all of a direct table's rows at once,
    as TorchRec's weight)."""

    def __init__(self, init_fn: Any) -> None:
        self.init_fn = init_fn

    def __call__(self, keys: Tensor, dim: int) -> Tensor:
        rows = torch.empty(keys.numel(), dim, dtype=torch.float32, device=keys.device)
        with torch.no_grad():
            filled = self.init_fn(rows)
        return filled if isinstance(filled, Tensor) and filled.shape == rows.shape else rows

    def __repr__(self) -> str:
        return f"TorchRecInit({self.init_fn!r})"


def _default_init(init_fn: Any, low: float, high: float) -> bool:
    """Whether ``init_fn`` is the one TorchRec's config makes itself when given none,
    ``partial(nn.init.uniform_, a=low, b=high)`` over the config's own range: then the rows
    are drawn per key in that range instead (the same distribution, but a function of the
    key, whatever the world size, and checkpoints save only the rows that changed)."""
    return isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args \
        and set(init_fn.keywords) == {"a", "b"} and math.isclose(init_fn.keywords["a"], low) \
        and math.isclose(init_fn.keywords["b"], high)


def is_torchrec_config(config: Any) -> bool:
    """Whether ``config`` looks like TorchRec's ``EmbeddingBagConfig``."""
    return all(hasattr(config, field) for field in ("name", "embedding_dim", "num_embeddings", "feature_names"))


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


def table_from_torchrec(config: Any, table_config: Any, seeded_uniform: Any, world_size: int = 1) -> Any:
    """A ``sk.TableConfig`` for a TorchRec ``EmbeddingBagConfig``: a direct table of
    ``num_embeddings`` rows (row i is key i, as TorchRec's; under a process group of
    ``world_size`` ranks each holds ``ceil(num_embeddings / world_size)`` of them, the ids
    of its keys, so the table has TorchRec's rows however many ranks share it), its pooling as the combiner,
    its data type, and its initial rows: its ``init_fn`` where the user gave one (filling
    the rows in place, as TorchRec's weight), else uniform in ``weight_init_min`` /
    ``weight_init_max`` (TorchRec's default ``+-sqrt(1 / num_embeddings)``) drawn per key,
    also where the ``init_fn`` is the uniform one TorchRec's config makes itself.

    Raises:
        ValueError: a pooling other than SUM / MEAN, a data type other than FP32 / FP16 /
            BF16, or a field sparsekit checks (naming the table).
    """
    name = config.name
    pooling = _enum_name(getattr(config, "pooling", "SUM"))
    if pooling not in _POOLING:
        raise ValueError(f"EmbeddingBagCollection: TorchRec config {name!r}: pooling {pooling} is not supported; "
                         f"use SUM or MEAN")
    data_type = _enum_name(getattr(config, "data_type", "FP32"))
    if data_type not in _DTYPES:
        raise ValueError(f"EmbeddingBagCollection: TorchRec config {name!r}: data_type {data_type} is not supported; "
                         f"use FP32, FP16 or BF16")
    rows = config.num_embeddings
    bound = math.sqrt(1.0 / rows) if isinstance(rows, int) and rows > 0 else 0.05
    low = getattr(config, "weight_init_min", None)
    high = getattr(config, "weight_init_max", None)
    low, high = (-bound if low is None else low), (bound if high is None else high)
    import zlib  # noqa: PLC0415 - the seed rule of sparsekit's default initializer

    init_fn = getattr(config, "init_fn", None)
    initializer = TorchRecInit(init_fn) if callable(init_fn) and not _default_init(init_fn, low, high) \
        else seeded_uniform(seed=zlib.crc32(name.encode()), low=low, high=high)

    per_rank = -(-rows // world_size) if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else rows
    return table_config(name, config.embedding_dim, per_rank, list(config.feature_names), combiner=_POOLING[pooling],
                        dtype=_DTYPES[data_type], use_hashtable=False,
                        initializer=initializer)


def torchrec_state_dict(collection: Any) -> Dict[str, Tensor]:
    """``{"embedding_bags.<table>.weight": [rows, D]}``, TorchRec's state of a one-process
    collection: a direct table's weight as it is; a hash table's rows placed at their keys
    (keys must lie in ``[0, capacity)``; rows of absent keys are zeros)."""
    out: Dict[str, Tensor] = {}
    for name in collection.weights:
        shard = collection._shard(name)
        if collection.world_size != 1:
            raise ValueError("torchrec_state_dict: a collection under a process group holds a shard per rank; "
                             "gather it with sk.save_checkpoint")
        if shard.hash_table is None:
            out[f"embedding_bags.{name}.weight"] = shard.weight.detach().clone()
            continue
        keys, vectors = shard.export()
        keys = keys.long()
        if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= shard.max_vocabulary_size_per_gpu):
            raise ValueError(f"torchrec_state_dict: table {name!r} holds keys outside [0, capacity) = "
                             f"[0, {shard.max_vocabulary_size_per_gpu}); TorchRec's table has a row per key there")
        dense = torch.zeros_like(shard.weight.detach())
        dense[keys] = vectors
        out[f"embedding_bags.{name}.weight"] = dense
    return out


def load_torchrec_state_dict(collection: Any, state_dict: Mapping[str, Any]) -> None:
    """Loads TorchRec's ``embedding_bags.<table>.weight`` entries: a direct table's rows as
    they are (under a process group each rank takes the rows of the ids it owns); a hash
    table's row i as key i (every row a key, in order; one process). Every table is checked
    before any loads; nothing changes on an error."""
    prefix = "embedding_bags."
    given = {key[len(prefix):-len(".weight")]: value for key, value in state_dict.items()
             if key.startswith(prefix) and key.endswith(".weight")}
    names = list(collection.weights)
    missing, unknown = [n for n in names if n not in given], [n for n in given if n not in names]
    if missing or unknown:
        raise ValueError(f"load_torchrec_state_dict: the state's tables {sorted(given)} are not the collection's "
                         f"{names} (missing {missing}, unknown {unknown})")
    state: Dict[str, Any] = {}
    for index, name in enumerate(names):
        shard, weight = collection._shard(name), given[name]
        rows = shard.num_keys_capacity  # TorchRec's rows: a TorchRec config's num_embeddings
        if shard.hash_table is not None and collection.world_size != 1:
            raise ValueError(f"load_torchrec_state_dict: table {name!r} is a hash table sharded over "
                             f"{collection.world_size} ranks; load its keys with sk.load_checkpoint")
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != shard.embedding_vec_size \
                or weight.shape[0] > rows or (shard.hash_table is None and weight.shape[0] != rows):
            raise ValueError(f"load_torchrec_state_dict: table {name!r} takes [{rows}, "
                             f"{shard.embedding_vec_size}] rows, got "
                             f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
        key = f"shards.{index}."
        if shard.hash_table is None:
            if collection.world_size != 1:  # this rank's rows: those of the ids it owns
                ids = shard.owned_keys().cpu()
                local = shard.weight.detach().cpu().clone()
                inside = ids < rows
                local[inside] = weight.detach().cpu().to(local.dtype).index_select(0, ids[inside])
                weight = local
            state[key + "weight"] = weight
            state[key + "_extra_state"] = shard.get_extra_state()
            continue
        rows = weight.shape[0]  # a hash table takes as many keys as the state has rows
        full = torch.zeros(shard.weight.shape, dtype=weight.dtype)
        full[:rows] = weight.detach().cpu()
        state[key + "weight"] = full
        state[key + "_extra_state"] = {"keys": torch.arange(rows, dtype=shard.key_dtype),
                                       "last_seen": torch.zeros(rows, dtype=torch.int64),
                                       "count": torch.zeros(rows, dtype=torch.int64),
                                       "clock": torch.tensor(0, dtype=torch.int64)}
    collection.load_state_dict(state)

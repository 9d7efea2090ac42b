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

import hashlib
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import allocator, engine, traced
from ._checks import compile_disabled, device_argument, torch_at_least
from . import keyed, step_errors
from .checkpoint.collective import collective_device
from .fused import FusedOptimizer
from .exchange import (
    _deepcopy_sharing_group,
    _make_step_lock,
    _reduce_without_group,
    _resolve_group,
    _state_without_lock,
    _stepping,
)
from .shard import (
    KeySeededUniform,
    _check_state_dict_keys,
    _check_writable,
    _ModelParallelEmbedding,
)
from .collection_input import KeyedJagged, TableConfig
from .collection_ranks import ShardedLookup
from .collection_traced import TracedLookup
from .collection_batch import BatchReader

__all__ = ["TableConfig", "KeyedJagged", "EmbeddingBagCollection", "UnknownTableError"]

# A fused collection's compiled backward updates the weight in place; AOT autograd before
# torch 2.13 refuses that ("a leaf Variable that requires grad is being used in an in-place
# operation"), so there its forward runs eagerly (one graph break).
_FUSED_TRACES = torch_at_least(2, 13)


class UnknownTableError(KeyError, ValueError):
    """A table name the collection does not have: a ``KeyError`` (a failed look-up by
    name) and a ``ValueError`` (a bad argument, as the contract's errors are)."""

    def __str__(self) -> str:
        # KeyError's own str() is the repr of its argument (quoted); the message reads better plain.
        return str(self.args[0]) if self.args else ""


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

    def __init__(self, config: TableConfig, index: int, process_group, device, default_seed: int,
                 key_limit: Optional[int] = None) -> None:
        object.__setattr__(self, "_layer_name", f"EmbeddingBagCollection table {config.name!r}")
        # A TorchRec table's ids lie in [0, num_embeddings), which its ranks' rows may exceed
        # (ceil(num_embeddings / world_size) each): the ids past it are refused as a
        # one-process table refuses them.
        object.__setattr__(self, "_key_limit", key_limit)
        initializer = config.initializer if config.initializer is not None else KeySeededUniform(seed=default_seed)
        super().__init__(config.capacity, config.embedding_dim, config.use_hashtable, torch.int64, initializer,
                         process_group, device, config.eviction, config.admit_after, None, config.dtype, index)
        self.config = config

    @property
    def num_keys_capacity(self) -> int:
        """The keys a direct table takes: ``[0, capacity * world_size)``, or a TorchRec
        table's ``[0, num_embeddings)``."""
        limit = self.__dict__.get("_key_limit")
        whole = self.max_vocabulary_size_per_gpu * self.world_size
        return whole if limit is None else min(whole, limit)

    def _config(self) -> Dict[str, object]:
        # Named by TableConfig's fields, which the mismatch error then names.
        config = {_TABLE_FIELDS.get(key, key): value for key, value in super()._config().items()}
        return {**config, "table": self.config.name, "features": ",".join(self.config.features),
                "combiner": self.config.combiner}

    def _repr_settings(self) -> str:
        return (f"table={self.config.name!r}, features={self.config.features}, combiner={self.config.combiner!r}, "
                f"dtype={self.weight.dtype}, ")

    def _combiner(self) -> str:
        return self.config.combiner


class EmbeddingBagCollection(BatchReader, TracedLookup, ShardedLookup, nn.Module):
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
                 output: Optional[str] = None, error_mode: str = "raise") -> None:
        super().__init__()
        # One training forward at a time (see exchange._stepping); its tables' shards keep
        # locks of their own, which the collection's calls do not use.
        _make_step_lock(self)
        if isinstance(tables, TableConfig) or not isinstance(tables, (list, tuple)) or not tables \
                or not all(isinstance(t, TableConfig) or keyed.is_torchrec_config(t) for t in tables):
            raise TypeError("EmbeddingBagCollection: tables must be a non-empty list of sk.TableConfig (or TorchRec "
                            "EmbeddingBagConfig)")
        device_argument("EmbeddingBagCollection", device)
        self.process_group, self.world_size, self.rank = _resolve_group(process_group, "EmbeddingBagCollection")
        # TorchRec's configs as given (embedding_bag_configs()), and its defaults when any
        # table comes as one: weights ignored unless weighted, a KeyedTensor in config order.
        self._given_configs = list(tables)
        from_torchrec = any(not isinstance(t, TableConfig) for t in tables)
        tables = [t if isinstance(t, TableConfig) else keyed.table_from_torchrec(t, TableConfig, KeySeededUniform,
                                                                                self.world_size)
                  for t in tables]
        if is_weighted is not None and not isinstance(is_weighted, bool):
            raise TypeError(f"EmbeddingBagCollection: is_weighted must be True, False or None, got {is_weighted!r}")
        self._weighted = (not from_torchrec) if is_weighted is None else is_weighted
        if output is None:
            output = "keyed" if from_torchrec else "dict"
        if output not in ("dict", "keyed"):
            raise ValueError(f"EmbeddingBagCollection: output must be 'dict' or 'keyed', got {output!r}")
        self._output = output
        self._step_errors = step_errors.StepErrors(error_mode)
        self._read_layouts: Dict[Any, Any] = {}  # engine.read_pooled's cache of read layouts
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
        if error_mode != "raise" and self.world_size > 1:
            raise ValueError(f"EmbeddingBagCollection: error_mode={error_mode!r} is for one process; a step over "
                             "a process group reads the device anyway (its split sizes) and raises on every rank "
                             "(error_mode='raise')")
        # One step reads every table at random rows: past the TLB's reach together, they go in
        # huge pages as one large table would (allocator.huge_tables).
        huge = sum(t.capacity * t.embedding_dim * t.dtype.itemsize for t in self.tables) >= allocator.HUGE_TABLE_BYTES
        with allocator.huge_tables(huge):
            # A list, not a ModuleDict: a table may be called "items" or "a.b".
            self.shards = nn.ModuleList([
                _TableShard(t, i, self.process_group, device, seed,
                            given.num_embeddings if keyed.is_torchrec_config(given) else None)
                for i, (t, seed, given) in enumerate(zip(self.tables, _default_seeds(self.tables),
                                                         self._given_configs))])
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
            self._fused = FusedOptimizer.from_params([shard.weight for shard in self._shards], fused_params,
                                                     huge_tables=huge,
                                                     names=[f"shards.{i}.weight" for i in range(len(self._shards))])
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
        last update (eviction) start from zero state first. The settings are checked (and
        refused) before any state changes."""
        update = self._fused.update_of(list(weights))
        for shard in self._shards:
            if shard.fresh_rows is not None and any(shard.weight is w for w in weights):
                fresh = shard.fresh_rows.nonzero().squeeze(1)
                if fresh.numel():
                    self._fused.reset_rows(shard.weight, fresh)  # in place: the update's state tensors
                    shard.fresh_rows.zero_()
        return update

    # -- module plumbing ------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        return _state_without_lock(super().__getstate__())

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Copies and unpickling end here: the copy must be found by its compiled graphs too.
        super().__setstate__(state)
        # A collection pickled before these settings existed: its behaviour then.
        for name, value in (("_weighted", True), ("_output", "dict"), ("_fused", None), ("_given_configs", None),
                            ("_step_errors", step_errors.StepErrors("raise"))):
            self.__dict__.setdefault(name, value)
        self._read_layouts = {}
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
        leaf = traced.fx_leaf_call(self, kjt)
        if leaf is not None:
            return leaf
        if self.world_size == 1 and torch.compiler.is_compiling() and (self._fused is None or _FUSED_TRACES):
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
        return engine.ticking(self._shards, self.training, forward)


    def check_errors(self) -> None:
        """Raises now an error a step of ``error_mode="late"`` recorded on the device and
        has not raised yet, or one the backward's ops recorded (waits for the device)."""
        self._step_errors.check(self._raise_late)

    def _raise_late(self, values: List[int]) -> None:
        """Raises a late verdict's error, as the step that met it would have (its table and
        key named), saying it came late."""
        try:
            step_errors.raise_verdict(values, None, [], lambda flags: self._raise_for_flags(flags, None),
                                      self._direct_key_error, int)
        except (ValueError, RuntimeError) as exc:
            raise type(exc)(f"{exc} (met by an earlier step, error_mode='late': that step read its bad lookups "
                            "as zeros and left them out of its update)") from None

    def _forward(self, kjt: Any) -> Dict[str, Tensor]:
        device = self._shards[0].weight.device
        world = self.world_size
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
            self._step_errors.poll(self._raise_late)
            # The input's verdict is read with the lookup's report, in the step's one host read.
            step = engine.StepContext(prepared["features"], prepared["table_of_feature"], prepared["batch"],
                                      prepared["bounds"], prepared["offsets"], prepared["keys"], prepared["weights"],
                                      flags, self._step_errors, prepared["host_bounds"])
            engine.resolve_rows(step, self._shards, self.training, self._direct_key_error,
                                lambda bad: self._raise_for_flags(bad, prepared))
            fused = self._fused_update if self._fused is not None else None
            if self._output == "keyed":
                keys, dims = self._keyed_layout()
                return keyed.KeyedTensor(keys, dims, engine.read_pooled(step, self._shards, fused, keys,
                                                                          self._read_layouts))
            return engine.read_pooled(step, self._shards, fused, layouts=self._read_layouts)

        return self._sharded_forward(prepared, error, flags)

    def _keyed_layout(self) -> Tuple[List[str], List[int]]:
        """The keyed output's features (every table's, in config order) and their widths."""
        # Fixed by the tables' configs: kept under the key None of the layouts' cache.
        layout = self._read_layouts.get(None)
        if layout is None:
            keys = [f for table in self.tables for f in table.features]
            layout = self._read_layouts[None] = (keys, [self._shards[self._feature_table[f]].embedding_vec_size
                                                        for f in keys])
        return list(layout[0]), list(layout[1])  # copies: a KeyedTensor hands its lists to the caller

    def _keyed(self, pooled: Dict[str, Tensor], batch: int) -> "keyed.KeyedTensor":
        """The dict of a multi-rank step as the keyed output: every table's features in
        config order, a feature absent from the batch reading as zeros (as in one process)."""
        keys, dims = self._keyed_layout()
        weight = self._shards[0].weight
        parts = [pooled[f] if f in pooled else weight.new_zeros(batch, d) for f, d in zip(keys, dims)]
        return keyed.KeyedTensor(keys, dims, torch.cat(parts, dim=1))


    def extra_repr(self) -> str:
        return f"tables={[t.name for t in self.tables]}, rank={self.rank}, world_size={self.world_size}"

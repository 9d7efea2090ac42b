"""One rank's shard of a model-parallel embedding: its weight, hash table, admissions and
the plan-then-commit lookup (see :mod:`sparsekit.embedding` for the step by step). The
collection's tables are shards too. Its forward and exchange are in
:mod:`sparsekit.shard_exchange`, its stats, export and state dict in
:mod:`sparsekit.shard_state`, the checks it shares with the collection in
:mod:`sparsekit.shard_checks`.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import ops, shard_registry, traced
from ._checks import AllocationError, allocation, bool_argument, device_argument, size_argument
from .allocator import table_zeros
from .exchange import (
    _OWNER_EXCEPTION,
    _TABLE_FULL,
    _CoalescedGradMarker,
    _deepcopy_sharing_group,
    _LookupOwned,
    _LookupPieces,
    _make_step_lock,
    _reduce_without_group,
    _resolve_group,
    _sort_rows,
    _state_without_lock,
)
from .hashtable import HashTable, HashTableFullError, _grow_tables
from .shard_checks import (  # noqa: F401  (imported from here by the collection and the layers)
    _check_modes_agree,
    _check_own_weights,
    _check_writable,
    _row_layout,
    _row_layout_text,
)
from .shard_exchange import _ShardExchange
from .shard_state import _check_state_dict_keys, _ShardState, _state_dict_keys  # noqa: F401  (imported from here too)

Initializer = Callable[[Tensor, int], Tensor]
_FLOAT32_MAX = torch.finfo(torch.float32).max


class KeySeededUniform:
    """The default initializer: uniform in ``[low, high]``, a pure function of ``(seed, key, column)``.

    A key's first vector is therefore the same whatever the world size, rank, device or
    insertion order (see :func:`sparsekit.ops.key_seeded_uniform`). Give tables that should
    start independent different seeds.

    Args:
        seed: any int64 (default 0).
        low: lower bound (default -0.05).
        high: upper bound (default 0.05).
    """

    def __init__(self, seed: int = 0, low: float = -0.05, high: float = 0.05) -> None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= int(seed) < 2**63:
            raise TypeError(f"KeySeededUniform: seed must be an int in the int64 range, got {seed!r}")
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"KeySeededUniform: {name} must be a number, got {value!r}")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int beyond float64: finite, and out of range below
                finite = True
            if not finite:
                raise ValueError(f"KeySeededUniform: {name} must be finite, got {value!r}")
            # Its rows are float32: a bound past float32's largest value would give inf rows.
            if abs(value) > _FLOAT32_MAX:
                # (An int of thousands of digits has no repr: str() refuses it.)
                shown = f"an int of {value.bit_length()} bits" if isinstance(value, numbers.Integral) else repr(value)
                raise ValueError(f"KeySeededUniform: {name} must lie in float32's finite range "
                                 f"[{-_FLOAT32_MAX}, {_FLOAT32_MAX}], got {shown}")
        if low > high:
            raise ValueError(f"KeySeededUniform: low must be <= high, got low={low!r} high={high!r}")
        self.seed = int(seed)
        self.low = float(low)
        self.high = float(high)

    def __call__(self, keys: Tensor, dim: int) -> Tensor:
        """Rows for ``keys`` (int64 ``[n]``): float32 ``[n, dim]`` on the keys' device."""
        return ops.key_seeded_uniform(keys, dim, seed=self.seed, low=self.low, high=self.high)

    def __repr__(self) -> str:
        return f"KeySeededUniform(seed={self.seed}, low={self.low}, high={self.high})"


def is_embedding_variable(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a model-parallel embedding shard (a layer's ``weight``)."""
    return shard_registry.is_shard(tensor)


def _distinct_sorted_rows(rows: Tensor, bound: int) -> Tuple[Tensor, Tensor]:
    """``(distinct, position)`` of CPU int64 ``rows`` in ``[0, bound)``: the distinct rows
    ascending and each row's place among them (a bitmap while it costs less than hashing)."""
    if ops._bitmap_numbers(bound, rows.numel()):
        distinct, position, _, _ = torch.ops.sparsekit.unique_bounded(rows, bound, False)
        return distinct, position
    distinct, distinct_of_row = ops.unique(rows)
    distinct, order = _sort_rows(distinct)
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    return distinct, rank.index_select(0, distinct_of_row)


@torch.no_grad()
def _place_new_keys(shards: List["_ModelParallelEmbedding"], keys: Tensor, counts: List[int],
                    initial: List[Tensor]) -> List[int]:
    """Gives shard j's ``counts[j]`` distinct absent ``keys`` (they fit) its table's next rows in
    order, as ``HashTable.insert`` would, and writes their ``initial`` vectors there. Returns
    each table's size before; the caller scores the new rows."""
    sizes = [len(shard.hash_table) for shard in shards]
    # The vectors first: rows past a table's size are no key's, so a write that fails leaves
    # no key in a table without its vector.
    for shard, vectors, start, count in zip(shards, initial, sizes, counts):
        shard.weight[start:start + count] = vectors
    _grow_tables([shard.hash_table for shard in shards], keys, list(itertools.accumulate(counts, initial=0)))
    for shard, count in zip(shards, counts):
        shard._admitted += count
    return sizes


class _LookupPlan(NamedTuple):
    """A training lookup worked out on an owner before every rank agrees to go on."""

    keys: Tensor                   # the distinct owned keys asked for
    plan: object                   # the hash table's insert plan for the keys that get rows
    initial: Optional[Tensor]      # initial rows of the new keys
    admitted: Optional[tuple]      # (keys admitted this step, mask of keys that get rows) with admission
    pending_keys: Optional[Tensor]  # the keys still waiting that stay pending (counted), None without admission


class _ModelParallelEmbedding(_ShardState, _ShardExchange, nn.Module):
    """The shard, its hash table, and the exchange shared by both layers."""

    _layer_name = "embedding"
    # The constructor argument that sets the shard's rows, as errors name it.
    _capacity_argument = "max_vocabulary_size_per_gpu"
    _dim_argument = "embedding_vec_size"
    _initializer_argument = "embedding_initializer"

    def __init__(
        self,
        max_vocabulary_size_per_gpu: int,
        embedding_vec_size: int,
        use_hashtable: bool,
        key_dtype: torch.dtype,
        embedding_initializer: Optional[Initializer],
        process_group: Optional[dist.ProcessGroup],
        device: Optional[Union[torch.device, str]],
        eviction: Optional[str] = None,
        admit_after: int = 1,
        admission_capacity: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        owner_offset: int = 0,
    ) -> None:
        super().__init__()
        _make_step_lock(self)  # one training forward at a time (see exchange._stepping)
        name = self._layer_name
        max_vocabulary_size_per_gpu = size_argument(name, "max_vocabulary_size_per_gpu", max_vocabulary_size_per_gpu)
        embedding_vec_size = size_argument(name, "embedding_vec_size", embedding_vec_size)
        if key_dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: key_dtype must be torch.int64 or torch.int32, got {key_dtype}")
        if embedding_initializer is not None and not callable(embedding_initializer):
            raise TypeError(f"{name}: embedding_initializer must be a callable (keys, dim) -> [n, dim] "
                            f"tensor or None, got {type(embedding_initializer).__name__}")
        if eviction not in (None, "lru", "lfu"):
            raise ValueError(f"{name}: eviction must be None, 'lru' or 'lfu', got {eviction!r}")
        # Compared with int64 counts of steps: a Python int past int64 failed there, in the first
        # training forward, with a bare "OverflowError: int too big to convert".
        admit_after = size_argument(name, "admit_after", admit_after, maximum=2**63 - 1)
        default_admission = admission_capacity is None
        admission_capacity = size_argument(name, "admission_capacity", admission_capacity, optional=True)
        if default_admission:
            admission_capacity = max_vocabulary_size_per_gpu
        use_hashtable = bool_argument(name, "use_hashtable", use_hashtable)
        if not use_hashtable and (eviction is not None or admit_after != 1 or not default_admission):
            raise ValueError(f"{name}: eviction, admit_after and admission_capacity need use_hashtable=True (a "
                             "direct-mapped shard has a row for every key)")
        device_argument(name, device)
        self.max_vocabulary_size_per_gpu = max_vocabulary_size_per_gpu
        self.embedding_vec_size = embedding_vec_size
        self.eviction = eviction
        self.admit_after = admit_after
        self.admission_capacity = admission_capacity
        self._evicted = 0
        self._admitted = 0
        self.use_hashtable = use_hashtable
        self.key_dtype = key_dtype
        self.embedding_initializer = embedding_initializer if embedding_initializer is not None \
            else KeySeededUniform()
        self.process_group, self.world_size, self.rank = _resolve_group(process_group, name)
        self._config_agreed = self.world_size == 1

        shape = (max_vocabulary_size_per_gpu, embedding_vec_size)
        # Key k lives on rank uint64(k + owner_offset) % world_size (0 for the SOK layers; a
        # collection's table index, so its tables' small keys spread over the ranks).
        self.owner_offset = owner_offset
        with allocation(f"{name}: {self._capacity_argument}={max_vocabulary_size_per_gpu} x {self._dim_argument}="
                        f"{embedding_vec_size} (the local shard)", shape, dtype, device or "cpu"):
            self.weight = nn.Parameter(table_zeros(shape, dtype, device))
        self._grad_marker = _CoalescedGradMarker()
        if self.use_hashtable:
            # Rows are initialised when their key is first inserted.
            self.hash_table: Optional[HashTable] = HashTable(max_vocabulary_size_per_gpu, key_dtype=key_dtype,
                                                             device=self.weight.device, eviction=eviction)
        else:
            self.hash_table = None
        # Keys seen in training but not admitted yet, with the number of steps they were
        # seen in (their LFU count); the least recently seen are forgotten beyond
        # admission_capacity (an LRU table: 7-11 int64 per pending key, see HashTable).
        self._pending: Optional[HashTable] = None
        if admit_after > 1:
            try:
                self._pending = HashTable(admission_capacity, key_dtype=key_dtype, device=self.weight.device,
                                          eviction="lru")
            except AllocationError as error:
                raise AllocationError(f"{name}: admission_capacity={admission_capacity} (the pending admissions' "
                                      f"table): {error}") from None
        # Rows given to new keys since the optimizer last updated them: LazyAdam zeroes
        # their moments first, so a reused row never carries the evicted key's state.
        self._fresh_rows: Optional[Tensor] = None
        if eviction is not None:
            self._keep_fresh_rows()
        self._mark_weight()
        traced.register(self)
        if self.hash_table is None:
            self._initialize_direct_rows()

    @property
    def fresh_rows(self) -> Optional[Tensor]:
        """The bool ``[rows]`` flags of rows given to new keys since the optimizer last updated
        them (None without eviction): LazyAdam zeroes their moments first, then clears them."""
        return self._fresh_rows

    def _keep_fresh_rows(self) -> None:
        """Allocates the per-row flags of rows given to new keys (``_fresh_rows``) and the marker's
        ``row_since``: an evicting layer has them from the start, another once it loads a state
        with such rows pending."""
        rows, device = self.max_vocabulary_size_per_gpu, self.weight.device
        self._fresh_rows = torch.zeros(rows, dtype=torch.bool, device=device)
        self._grad_marker.row_since = torch.zeros(rows, dtype=torch.int64, device=device)

    def _initialize_direct_rows(self) -> None:
        """Gives every row of a direct (``use_hashtable=False``) table its key's initial values."""
        with torch.no_grad():
            self.weight.copy_(self.initial_rows(self.owned_keys()))

    def reset_parameters(self) -> None:
        """Puts this rank's shard back in a new layer's state, in place (``nn.Module``'s
        convention, e.g. after ``to_empty()`` from the meta device): a direct table's rows get
        their keys' initial values again; a hash table forgets every key, pending admission
        and its clock, its weight is zeroed (a row is initialised when a key is inserted),
        and the eviction / admission totals restart. The weight stays the same ``Parameter``
        (an optimizer keeps it), but optimizer state is not touched: make the optimizer
        after the reset, as with ``torch.nn`` layers. Local: no collective, every rank
        resets its own shard.
        """
        if self.hash_table is None:
            self._initialize_direct_rows()
            return
        self._rows_rebound()
        with torch.no_grad():
            self.weight.zero_()
        for table in (self.hash_table, self._pending):
            if table is not None:
                table.clear()
                table._clock = 0
        if self._fresh_rows is not None:
            self._fresh_rows.zero_()
        self._evicted = 0
        self._admitted = 0

    # -- keys, rows and initial values ------------------------------------------------------

    @property
    def num_keys_capacity(self) -> int:
        """Keys the layer can hold over all ranks; with ``use_hashtable=False`` keys lie in ``[0, this)``."""
        return self.max_vocabulary_size_per_gpu * self.world_size

    def owned_keys(self) -> Tensor:
        """With ``use_hashtable=False``: the key of every local row (int64 ``[max_vocabulary_size_per_gpu]``)."""
        rows = torch.arange(self.max_vocabulary_size_per_gpu, dtype=torch.int64, device=self.weight.device)
        return rows * self.world_size + (self.rank - self.owner_offset) % self.world_size

    def initial_rows(self, keys: Tensor) -> Tensor:
        """The initializer's rows for int64 ``keys`` ``[n]``, in the weight's dtype and device."""
        # A user's initializer gets a copy: ``keys`` may be the very tensor the table is about
        # to store, and one that changes its argument in place would change the table's keys.
        # KeySeededUniform only reads its keys.
        given = keys if type(self.embedding_initializer) is KeySeededUniform else keys.clone()
        rows = self.embedding_initializer(given, self.embedding_vec_size)
        if not isinstance(rows, Tensor) or tuple(rows.shape) != (keys.numel(), self.embedding_vec_size):
            got = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
            raise ValueError(f"{self._layer_name}: {self._initializer_argument}(keys, {self.embedding_vec_size}) "
                             f"must return a [{keys.numel()}, {self.embedding_vec_size}] tensor, got {got}")
        # Checked here, while nothing has changed: a sparse or meta tensor would only fail
        # at the write into the weight, after the table took the keys, and a complex one
        # would lose its imaginary part in the cast.
        if rows.layout != torch.strided or rows.is_complex() or (
                rows.device.type == "meta" and self.weight.device.type != "meta"):  # a meta layer's are
            raise ValueError(f"{self._layer_name}: {self._initializer_argument}(keys, {self.embedding_vec_size}) "
                             f"must return a dense real tensor with values, got a {rows.dtype} tensor of layout "
                             f"{rows.layout} on {rows.device}")
        return rows.to(device=self.weight.device, dtype=self.weight.dtype)

    def _direct_rows(self, keys: Tensor) -> Tensor:
        return torch.div(keys.long(), self.world_size, rounding_mode="floor")

    def _lookup_rows(self, keys: Tensor) -> Tensor:
        """Rows of distinct owned ``keys``: insert (and initialise) in training, find in eval."""
        if self.hash_table is None:
            return self._direct_rows(keys)
        if not self.training:
            return self.hash_table.find(keys)
        return self._commit_lookup(self._plan_lookup(keys))

    def _plan(self, keys: Tensor) -> Any:
        """What this table does for its distinct owned keys this step (may raise; changes nothing)."""
        if self.hash_table is None:
            return self._direct_rows(keys)
        if not self.training:
            return self.hash_table.find(keys)
        return self._plan_lookup(keys)

    def _commit(self, plan: Any) -> Tensor:
        """Carries out a plan of :meth:`_plan`: the rows of its keys."""
        return plan if isinstance(plan, Tensor) else self._commit_lookup(plan)

    def _combiner(self) -> str:
        """How the engine pools this table's bags: ``"sum"`` or ``"mean"``."""
        return "sum"

    def _plan_lookup(self, keys: Tensor) -> "_LookupPlan":
        """Works out a training lookup of distinct owned ``keys`` without changing anything:
        admissions, the table's insert (and its evictions) and the new keys' initial rows.
        Raises (HashTableFullError, or the initializer's error) with nothing changed."""
        table = self.hash_table
        admitted = pending_keys = None
        lookup_keys = keys
        if self._pending is not None and keys.numel() > 0:
            absent = table.find(keys) < 0
            waiting = keys[absent]
            _, seen = self._pending.scores(waiting)  # steps seen before this one, -1: never
            admit = seen.clamp(min=0) + 1 >= self.admit_after
            admitted = waiting[admit]
            pending_keys, pending_seen = waiting[~admit], seen[~admit]
            if pending_keys.numel() > self._pending.capacity:
                # More keys wait in this one step than can be counted: those already pending
                # keep their counts, then the first new ones get the places left; the rest
                # are forgotten (as the least recently seen are), to be counted afresh.
                first = torch.sort((pending_seen < 0).to(torch.uint8), stable=True).indices
                pending_keys = pending_keys[first[:self._pending.capacity].sort().values]
            # The keys that get a row this step, in their order in `keys`.
            take = ~absent
            take[absent.nonzero().squeeze(1)[admit]] = True
            lookup_keys = keys[take]
            admitted = (admitted, take)
        try:
            plan = table._plan_insert(lookup_keys, distinct=True)  # the owner's keys are distinct
        except HashTableFullError as error:
            raise HashTableFullError(f"{self._table_full(self.rank)}: {error}") from error
        initial = self.initial_rows(plan.new_keys.long()) if plan.new_keys.numel() > 0 else None
        return _LookupPlan(keys, plan, initial, admitted, pending_keys)

    @torch.no_grad()
    def _commit_lookup(self, lookup: "_LookupPlan") -> Tensor:
        """Carries out a plan of :meth:`_plan_lookup`: rows of its keys (-1: not admitted yet)."""
        table, plan = self.hash_table, lookup.plan
        num_new = plan.new_keys.numel()
        admitted = lookup.admitted[0] if lookup.pending_keys is not None else None
        try:
            rows = table._commit_insert(plan)
            if num_new > 0:
                self._initialize_new_rows(lookup)
            if admitted is not None:
                # The admitted keys leave the pending admissions as soon as they hold rows
                # (first, so their places count for the keys still waiting).
                self._pending._remove(admitted)
        except BaseException:
            # Interrupted after the table took the new keys: their rows get their vectors (a
            # reused row must not keep the evicted key's) and the admitted keys leave the
            # pending admissions before the error goes on, so the insert stays all or nothing.
            if num_new > 0 and bool((table.find(plan.new_keys[:1].to(table.key_dtype)) == plan.new_rows[:1]).all()):
                self._initialize_new_rows(lookup)
                if admitted is not None:
                    self._pending._remove(admitted)
            raise
        self._evicted += plan.victims.numel()
        self._admitted += num_new
        table.tick()
        if self._pending is not None:
            if lookup.pending_keys is not None:
                _, take = lookup.admitted
                # Planned now: an LRU insert of at most its capacity never fails.
                self._pending._commit_insert(self._pending._plan_insert(lookup.pending_keys, distinct=True))
                full = torch.full((lookup.keys.numel(),), -1, dtype=torch.int64, device=rows.device)
                rows = full.masked_scatter_(take, rows)
            self._pending.tick()
        return rows

    def _initialize_new_rows(self, lookup: "_LookupPlan") -> None:
        """The new keys' rows of ``lookup`` get their initial vectors and, with eviction, the
        flags that reset their moments; rows reused from evicted keys drop those keys'
        gradients. Idempotent: repeating it changes nothing more."""
        plan = lookup.plan
        self.weight[plan.new_rows] = lookup.initial
        if self._fresh_rows is not None:
            self._fresh_rows[plan.new_rows] = True
        if plan.victims.numel() > 0:
            self._forget_gradients(plan.new_rows)

    def _forget_gradients(self, rows: Tensor) -> None:
        """``rows`` took new keys: the old keys' gradients must not reach them. Drops those rows
        from ``weight.grad`` now and from any backward still to come (``_grad_marker.own_rows``)."""
        marker = self._grad_marker
        marker.reused(rows)
        grad = self.weight.grad
        if grad is None:
            return
        if grad.is_sparse:
            indices = grad._indices()
            keep = marker.row_since.index_select(0, indices[0]) != marker.stamp  # not given away just now
            self.weight.grad = torch.sparse_coo_tensor(indices[:, keep], grad._values()[keep], grad.shape,
                                                       is_coalesced=grad.is_coalesced(), check_invariants=False)
        else:
            grad.index_fill_(0, rows, 0)

    # -- the configuration, the owner's lookup and the one-process path ----------------------

    def _config(self) -> Dict[str, object]:
        """What every rank of the group must build alike: the exchange relies on it."""
        initializer = self.embedding_initializer
        # A KeySeededUniform by its settings; anything else by its name (a function's
        # address differs between processes).
        initializer = repr(initializer) if isinstance(initializer, KeySeededUniform) else \
            getattr(initializer, "__qualname__", type(initializer).__qualname__)
        return {"layer type": type(self).__name__, "embedding_vec_size": self.embedding_vec_size,
                "dtype": self.weight.dtype, "max_vocabulary_size_per_gpu": self.max_vocabulary_size_per_gpu,
                "use_hashtable": self.use_hashtable, "key_dtype": self.key_dtype, "eviction": self.eviction,
                "admit_after": self.admit_after, "admission_capacity": self.admission_capacity,
                "embedding_initializer": initializer}

    def _agree_on_lookup(self, recv_keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The owner's lookup of the keys it received: ``(owned_keys, inverse, rows)`` with
        ``recv_keys == owned_keys[inverse]``; in training with a hash table every rank learns of a
        failure (the dedup's too), so none is left waiting."""
        if self.hash_table is None or not self.training:
            owned_keys, owned_inverse = ops.unique(recv_keys)
            return owned_keys, owned_inverse, self._lookup_rows(owned_keys)
        error: Optional[BaseException] = None
        plan = owned_keys = owned_inverse = None
        try:
            owned_keys, owned_inverse = ops.unique(recv_keys)
            plan = self._plan_lookup(owned_keys)
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, then it is re-raised
            error = exc
        kind = 0 if error is None else (_TABLE_FULL if isinstance(error, HashTableFullError) else _OWNER_EXCEPTION)
        # Highest failing rank and its kind in one word: (rank + 1) * 4 + kind.
        # torch.full: a fill, where torch.tensor(..., device=cuda) would wait for the stream
        # (a host sync the counts in sparsekit/embedding.py do not have).
        status = torch.full((1,), 0 if error is None else (self.rank + 1) * 4 + kind, dtype=torch.int64,
                            device=self.weight.device)
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.process_group)
        word = int(status.item())
        if word == 0:
            # Every owner can do its part: only now does any table change.
            return owned_keys, owned_inverse, self._commit_lookup(plan)
        if error is not None:
            raise error
        failed_rank, failed_kind = word // 4 - 1, word % 4
        if failed_kind == _TABLE_FULL:
            # With eviction a table is "full" only for one call of more distinct keys than it holds.
            why = ("; with eviction, one call there holds more distinct keys than the table holds, so eviction "
                   "cannot make room" if self.hash_table is not None and self.hash_table.eviction is not None else "")
            raise HashTableFullError(
                f"{self._table_full(failed_rank)}{why}; nothing was inserted on that rank. Build the layer with a "
                f"larger {self._capacity_argument}")
        raise RuntimeError(f"{self._layer_name}: the lookup failed on rank {failed_rank} (see the error there); "
                           "no rank went on with this step")

    def _rows_first(self) -> bool:
        """Whether a step looks its keys up before deduplicating them (see
        :meth:`_lookup_rows_first`): one process, a CPU hash table, training, and neither
        eviction nor admission (the plans of those need the call's distinct keys)."""
        return self.world_size == 1 and self.hash_table is not None and self.training and self._pending is None \
            and self.hash_table.eviction is None and self.weight.device.type == "cpu"

    @torch.no_grad()
    def _rows_of_new_keys(self, keys: Tensor, rows: Tensor) -> Tensor:
        """``rows`` (-1 for an absent key) with the absent keys inserted as the owner's insert
        would: the next rows in order of first occurrence, with their initial vectors. Raises with
        nothing changed. CPU only."""
        host_rows = rows.numpy()
        # Positions, not a mask: the few absent keys are then picked and written back
        # without two more passes over every key.
        missing = np.flatnonzero(host_rows < 0)
        if missing.size == 0:
            return rows
        table = self.hash_table
        new_keys, new_of_missing = ops.unique(torch.from_numpy(keys.detach().numpy()[missing]))
        size, count = len(table), new_keys.numel()
        if count > table.capacity - size:
            try:
                table._plan_insert(new_keys, distinct=True)  # raises the table's own message
            except HashTableFullError as error:
                raise HashTableFullError(f"{self._table_full(self.rank)}: {error}") from error
        # Absent and distinct, without eviction: the next rows, as the table's insert gives them.
        _place_new_keys([self], new_keys, [count], [self.initial_rows(new_keys.long())])
        host_rows[missing] = new_of_missing.add_(size).numpy()  # rows is the find's own tensor
        return rows

    def _place_rows_first(self, keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """A :meth:`_rows_first` step's table work for ``keys`` [n]: found, the absent ones
        inserted, their distinct rows scored and the clock advanced. Returns ``(rows [n],
        distinct rows ascending, inverse)`` with ``rows == distinct[inverse]``."""
        table = self.hash_table
        rows = self._rows_of_new_keys(keys, table.find(keys))
        # Rows in use lie below the table's size: bounded by that, not by the whole shard.
        unique_rows, inverse = _distinct_sorted_rows(rows, len(table))
        table._score(unique_rows, None)
        table.tick()
        return rows, unique_rows, inverse

    def _lookup_rows_first(self, keys: Tensor, every_value: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """``(vectors, index)`` of ``keys`` [n] for :meth:`_rows_first`: keys found as they come
        (absent ones inserted), then their rows deduplicated and sorted (``unique_bounded``). The
        tables, scores, weight and gradient end as the general path leaves them."""
        rows, unique_rows, inverse = self._place_rows_first(keys)
        if every_value:
            return _LookupPieces.apply([rows], [0], inverse, unique_rows, [unique_rows.numel()], [self._grad_marker],
                                       [False], self.weight)[0], None
        vectors = _LookupOwned.apply(self.weight, unique_rows, unique_rows, None, True, False, self._grad_marker)
        return vectors, inverse

    # -- module plumbing --------------------------------------------------------------------

    __prepare_scriptable__ = traced._refuse_scripting

    def _mark_weight(self) -> None:
        """Registers ``weight`` as this layer's shard (:mod:`sparsekit.shard_registry`) and puts
        the coalesced-gradient hook on it; a new weight (a copy, unpickling,
        ``load_state_dict(assign=True)``) lacks both."""
        weight = self.weight
        # The layer's own Parameter, which a compiled forward compares with the one it is
        # given (functional_call's substitute); in __dict__, not registered as a parameter.
        self.__dict__["_own_weight"] = weight
        shard_registry.register(weight, self)
        # Registered once: the tensor lists its post-accumulate hooks there (None before the first).
        hooks = getattr(weight, "_post_accumulate_grad_hooks", None) or {}
        # A hook on a tensor that needs no gradient raises (a frozen weight gets none anyway).
        if weight.requires_grad and not any(hook is self._grad_marker for hook in hooks.values()):
            weight.register_post_accumulate_grad_hook(self._grad_marker)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "weight" and isinstance(value, nn.Parameter) and "_own_weight" in self.__dict__:
            self._mark_weight()  # a Parameter the user put in: the layer's own from now on, marked

    def __getstate__(self) -> Dict[str, Any]:
        return _state_without_lock(super().__getstate__())

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # copy.deepcopy and unpickling (torch.load of a whole module) end here, with a new
        # weight Parameter: deepcopy dropped its marks and neither kept its hook.
        super().__setstate__(state)
        _make_step_lock(self)  # a copy's own (a layer pickled before the lock existed gets one too)
        if self._fresh_rows is not None and self._grad_marker.row_since is None:  # pickled before it existed
            self._grad_marker.row_since = torch.zeros(self._fresh_rows.shape, dtype=torch.int64,
                                                      device=self._fresh_rows.device)
        self._mark_weight()
        traced.register(self)

    def __reduce_ex__(self, protocol):
        return _reduce_without_group(self, self._layer_name, protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> _ModelParallelEmbedding:
        """An independent copy (its own weight, tables, flags and totals) over the same
        process group; the weight keeps its marks (see :func:`_deepcopy_sharing_group`)."""
        return _deepcopy_sharing_group(self, memo)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.weight.device
        if self.hash_table is not None:
            self.hash_table = self.hash_table.to(device)
        if self._pending is not None:
            self._pending = self._pending.to(device)
        if self._fresh_rows is not None:
            # From the meta device (to_empty): no row is fresh in the empty tables.
            self._fresh_rows = (torch.zeros_like(self._fresh_rows, device=device) if self._fresh_rows.is_meta
                                else self._fresh_rows.to(device))
            since = self._grad_marker.row_since
            self._grad_marker.row_since = (torch.zeros_like(since, device=device) if since.is_meta
                                           else since.to(device))
        self._mark_weight()
        return self

    def _rows_rebound(self) -> None:
        """The hash table was just loaded or reset, so its rows may hold other keys: drops the
        gradients of lookups before (accumulated now, pending via ``forget_all``). A direct shard's
        rows are its keys' for good and keep theirs."""
        self._grad_marker.forget_all()
        self.weight.grad = None

    def _table_full(self, rank: int) -> str:
        """The lead of a full table's error: the layer, the rank and the capacity argument."""
        return (f"{self._layer_name}: the hash table of rank {rank} is full "
                f"({self._capacity_argument}={self.max_vocabulary_size_per_gpu})")

    def _repr_settings(self) -> str:
        """The front end's own settings, first in :meth:`extra_repr` (none here)."""
        return ""

    def extra_repr(self) -> str:
        return (self._repr_settings() + f"{self._capacity_argument}={self.max_vocabulary_size_per_gpu}, "
                f"{self._dim_argument}={self.embedding_vec_size}, use_hashtable={self.use_hashtable}, "
                f"key_dtype={self.key_dtype}, rank={self.rank}, world_size={self.world_size}"
                + (f", eviction={self.eviction!r}" if self.eviction else "")
                + (f", admit_after={self.admit_after}" if self.admit_after > 1 else ""))

"""One rank's shard of a model-parallel embedding: its weight, hash table, admissions,
the plan-then-commit lookup, stats, export and the SOK layers' exchange (see
:mod:`sparsekit.embedding` for the step by step). The collection's tables are shards too.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import ops, traced
from ._checks import (AllocationError, allocation, bool_argument, dense_layout, device_argument, integer_argument,
                      size_argument, tensor_integer)
from .allocator import table_zeros
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
    _LookupOwned,
    _make_step_lock,
    _LookupPieces,
    _offsets_error_flags,
    _owners,
    _reduce_without_group,
    _resolve_group,
    _sort_rows,
    _state_without_lock,
    _stepping,
    _wire_device,
)
from .hashtable import _MAX_CLOCK as _MAX_COUNT
from .hashtable import HashTable, HashTableFullError, _check_pending_of, _check_state_of, _grow_tables

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
    return bool(getattr(tensor, "sparsekit_model_parallel", False))


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


def _check_own_weights(shards: List["_ModelParallelEmbedding"], name: str, training: bool) -> None:
    """Refuses a training forward whose weight is a plain tensor put in place of the layer's
    parameter, and, while compiling, any weight but the layer's own Parameter (only the trace
    sees a ``functional_call`` substitute there)."""
    if not training:
        return
    if torch.compiler.is_compiling() and any(shard.weight is not shard._own_weight for shard in shards):
        # A Parameter put in place of the layer's own (functional_call with another model's
        # parameters): eager writes the new keys' rows into it, but the traced row op runs
        # against the module's own weight, so compiled and eager would train differently.
        raise RuntimeError(f"{name}: its weight is a parameter put in place of its own (functional_call?); a "
                           "compiled training forward writes new keys' rows into the layer's own weight: call it "
                           "eagerly (torch.compiler.disable) or in eval() mode, or pass the layer's own parameters")
    if not all(isinstance(shard.weight, nn.Parameter) for shard in shards):
        # torch.func.functional_call / nn.utils.stateless with plain tensors put in place of
        # the weight: a training step would insert its new keys into the layer's own hash
        # table and write their initial vectors into the caller's tensor, leaving the
        # layer's rows for those keys zero for good.
        raise RuntimeError(f"{name}: its weight is a plain tensor put in place of its parameter (functional_call "
                           "or torch.nn.utils.stateless?); a training forward inserts keys into the layer's own "
                           "hash table, so it needs the layer's own weight: call it in eval() mode (lookups only), "
                           "or pass the layer's parameters themselves")


def _check_writable(shards: List["_ModelParallelEmbedding"], name: str, training: bool) -> None:
    """Refuses, before anything changes, a forward whose in-place writes would fail halfway:
    under a torch.func transform, training outside inference mode on inference tables, a hash
    layer with its weight in shared memory, or a layer on the meta device."""
    weights = [shard.weight for shard in shards]
    if any(weight.is_meta for weight in weights):
        raise RuntimeError(f"{name}: its tables are on the meta device and hold no data; give them memory first "
                           "(model.to_empty(device=...), then reset_parameters() or load_state_dict)")
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"{name}: torch.func transforms (grad, vmap, functional_call under them, ...) are not "
                           "supported: the lookup's kernels read raw memory and a training step inserts keys into "
                           "the hash table; take gradients with loss.backward() or torch.autograd.grad")
    if not training or torch.is_inference_mode_enabled():
        return
    _check_own_weights(shards, name, training)
    if any(shard.hash_table is not None and shard.weight.device.type == "cpu" and shard.weight.is_shared()
           for shard in shards):
        # share_memory(), or a layer sent to another process by torch.multiprocessing: the
        # weight is shared, the hash table's count of keys is not, so two processes would
        # give the same rows to different keys.
        raise RuntimeError(f"{name}: its weight is in shared memory (share_memory(), or the layer was sent to "
                           "another process by torch.multiprocessing), but its hash table's count of keys is this "
                           "process's own: processes training it would give one row to two keys. Build the layer in "
                           "each process and shard it with a process group (as torchrun does); eval() lookups of a "
                           "shared layer that no process trains are fine")
    # Every step: one flat list and one C-level test per tensor.
    tensors = weights + [shard._fresh_rows for shard in shards if shard._fresh_rows is not None]
    for shard in shards:
        for table in (shard.hash_table, shard._pending):
            if table is not None:
                tensors += table._tensors()
    if any(map(Tensor.is_inference, tensors)):
        raise RuntimeError(f"{name}: its weight or hash table was made under torch.inference_mode(), and "
                           "inference tensors cannot be changed outside it, as a training step must; build "
                           "the layer outside inference_mode to train it (or call it in eval() mode)")


# Weight dtypes by number in a row layout code (_row_layout); any other dtype is the next number.
_LAYOUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _row_layout(weight: Tensor) -> int:
    """The weight's dtype and row width as one int64: what a rank's vectors look like on the wire."""
    dtype = _LAYOUT_DTYPES.index(weight.dtype) if weight.dtype in _LAYOUT_DTYPES else len(_LAYOUT_DTYPES)
    return dtype << 40 | weight.shape[1]


def _check_modes_agree(name: str, what: str, modes: List[int]) -> None:
    """RuntimeError on every rank when the ranks' forward modes (bit 0: train(), bit 1: records
    a backward) differ: the ranks would otherwise wait on each other's collectives until the
    group's timeout."""
    if len({mode & 1 for mode in modes}) > 1:
        evaluating = [rank for rank, mode in enumerate(modes) if not mode & 1]
        raise RuntimeError(f"{name}: rank(s) {evaluating} are in eval() mode and the others in train() mode; "
                           f"switch the {what}'s mode on every rank alike")
    if modes[0] & 1 and len({mode >> 1 for mode in modes}) > 1:
        without = [rank for rank, mode in enumerate(modes) if not mode >> 1]
        raise RuntimeError(f"{name}: rank(s) {without} run this training forward without a gradient "
                           "(torch.no_grad(), inference_mode or a frozen weight) and the others with one, whose "
                           "backward would wait for them; run it alike on every rank")


def _row_layout_text(code: int) -> str:
    dtype = code >> 40
    name = str(_LAYOUT_DTYPES[dtype]) if dtype < len(_LAYOUT_DTYPES) else "another dtype"
    return f"{name} rows of {code & ((1 << 40) - 1)}"


class _LookupPlan(NamedTuple):
    """A training lookup worked out on an owner before every rank agrees to go on."""

    keys: Tensor                   # the distinct owned keys asked for
    plan: object                   # the hash table's insert plan for the keys that get rows
    initial: Optional[Tensor]      # initial rows of the new keys
    admitted: Optional[tuple]      # (keys admitted this step, mask of keys that get rows) with admission
    pending_keys: Optional[Tensor]  # the keys still waiting that stay pending (counted), None without admission


class _CheckedExtraState(NamedTuple):
    """A layer's ``_extra_state`` that ``_check_extra_state`` found loadable: writing it cannot fail."""

    table: object              # the hash table's state, as HashTable._check_state accepted it
    pending: Optional[object]  # the pending admissions' state, likewise; None: nothing to load there
    evicted: int
    admitted: int
    fresh: Tensor              # bool [len(table's keys)], on the layer's device: moments to reset, by row


def _check_state_dict_keys(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raises, in ``nn.Module.load_state_dict``'s words, for the keys ``strict`` refuses
    (missing or unexpected) before anything is loaded; nn.Module reports them only after."""
    if not strict or not isinstance(state_dict, Mapping):
        return
    expected = _state_dict_keys(module)  # the entries a strict load needs, in order
    if expected is None:
        return  # hooks may rename, add or drop entries: torch's own check, after them, decides
    errors = []
    missing = [key for key in expected if key not in state_dict]
    if missing:
        errors.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    unexpected = [key for key in state_dict if key not in expected]
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(module).__name__,
                                                                                 "\n\t".join(errors)))


def _state_dict_keys(module: nn.Module) -> Optional[List[str]]:
    """The names ``module.state_dict()`` gives, worked out without building the entries; None
    when a module has state-dict or load hooks, which may change the names."""
    keys: List[str] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if sub._state_dict_hooks or sub._state_dict_pre_hooks or sub._load_state_dict_pre_hooks \
                or sub._load_state_dict_post_hooks:
            return None
        prefix = f"{prefix}." if prefix else ""
        keys.extend(prefix + name for name, param in sub._parameters.items() if param is not None)
        keys.extend(prefix + name for name, buffer in sub._buffers.items()
                    if buffer is not None and name not in sub._non_persistent_buffers_set)
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            keys.append(prefix + "_extra_state")
    return keys


class _ModelParallelEmbedding(nn.Module):
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

    # -- dynamic tables: stats and export -----------------------------------------------------

    def stats(self) -> Dict[str, int]:
        """``size``, ``capacity``, ``evicted``, ``admitted`` (totals since construction) and
        ``pending`` (keys seen but not admitted yet), summed over the ranks of the layer's
        process group (then a collective: every rank must call it)."""
        with _stepping(self, True):  # not across the all-reduce: a forward's collectives may hold it
            values = self._local_stats()
        return self._summed_stats(values)

    def _local_stats(self) -> List[int]:
        """This rank's ``size``, ``capacity``, ``evicted``, ``admitted`` and ``pending`` (read
        under the step lock by the callers, so no forward is halfway)."""
        size = len(self.hash_table) if self.hash_table is not None else self.max_vocabulary_size_per_gpu
        pending = len(self._pending) if self._pending is not None else 0
        return [size, self.max_vocabulary_size_per_gpu, self._evicted, self._admitted, pending]

    def _summed_stats(self, values: List[int]) -> Dict[str, int]:
        """:meth:`_local_stats` summed over the ranks (an all-reduce with a process group), as a dict."""
        if self.world_size > 1:
            totals = torch.tensor(values, dtype=torch.int64, device=self.weight.device)
            dist.all_reduce(totals, group=self.process_group)
            values = totals.tolist()
        return dict(zip(("size", "capacity", "evicted", "admitted", "pending"), values))

    def export(self, min_last_seen: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """This rank's ``(keys, vectors)``: keys of ``key_dtype`` and their rows of the shard
        (a detached copy), in row order; with ``min_last_seen``, only keys last seen at a
        table clock ``>= min_last_seen`` (the clock advances once per training forward).
        With ``use_hashtable=False``: every owned key, and ``min_last_seen`` must be None."""
        min_last_seen = integer_argument(f"{self._layer_name}.export", "min_last_seen", min_last_seen, optional=True)
        with _stepping(self, True):  # keys and rows of one moment: no forward evicts in between
            return self._export(min_last_seen)

    def _export(self, min_last_seen: Optional[int]) -> Tuple[Tensor, Tensor]:
        if self.hash_table is None:
            if min_last_seen is not None:
                raise ValueError(f"{self._layer_name}: export(min_last_seen=...) needs use_hashtable=True (a "
                                 "direct-mapped shard keeps no scores)")
            return self.owned_keys().to(self.key_dtype), self.weight.detach().clone()
        keys, rows = self.hash_table.export(min_last_seen)
        return keys, self.weight.detach().index_select(0, rows)

    # -- the exchange -----------------------------------------------------------------------

    def _key_error_flags(self, unique_keys: Tensor) -> Optional[Tensor]:
        """Device int64 scalar: _BAD_KEY when a key is outside the direct-mapped range;
        None when there is nothing to check."""
        if self.hash_table is not None or unique_keys.numel() == 0:
            return None
        keys = unique_keys.long()
        bad = ((keys < 0) | (keys >= self.num_keys_capacity)).any()
        return bad.long() * _BAD_KEY

    def _raise_for_flags(self, flags: int, unique_keys: Optional[Tensor], offsets: Optional[Tensor]) -> None:
        name = self._layer_name
        if flags & _BAD_KEY:
            keys = unique_keys.long()
            bad = keys[(keys < 0) | (keys >= self.num_keys_capacity)]
            raise ValueError(
                f"{name}: key {bad[0].item()} ({bad.numel()} distinct bad keys on rank {self.rank}) is out of range: "
                f"with use_hashtable=False keys must lie in [0, {self._capacity_argument} * world_size) = "
                f"[0, {self.num_keys_capacity}); use use_hashtable=True for arbitrary keys or raise "
                f"{self._capacity_argument}")
        if flags & _BAD_OFFSETS:
            raise ValueError(f"{name}: offsets must start at 0, never decrease and end at len(values); "
                             f"got offsets {offsets.tolist() if offsets.numel() <= 16 else offsets}")

    def _exchange(self, unique_keys: Optional[Tensor], flags: Optional[Tensor], offsets: Optional[Tensor],
                  local_error: Optional[BaseException]) -> Tuple[Tensor, Optional[Tensor]]:
        """Vectors for ``unique_keys``: ``(vectors, index)``, row ``index[i]`` (``i`` when ``index``
        is None) being that of ``unique_keys[i]``. Every rank calls this with its local outcome so
        far; an error anywhere makes every rank raise before any key moves."""
        if self.world_size == 1:
            if local_error is not None:
                raise local_error
            if flags is not None:
                self._raise_for_flags(int(flags.item()), unique_keys, offsets)
            rows = self._lookup_rows(unique_keys)
            sorted_rows, order = _sort_rows(rows)
            return _LookupOwned.apply(self.weight, rows, sorted_rows, order, True, self._may_miss(),
                                      self._grad_marker), None

        self._agree_on_config()
        device = _wire_device(self.weight, self.process_group)
        if local_error is None:
            try:
                keys_by_owner, positions, send_counts = ops.partition_by_owner(unique_keys, self.world_size)
            except BaseException as exc:  # noqa: BLE001 - out of memory here: every rank must hear of it
                local_error = exc
            if flags is None:
                flags = torch.zeros((), dtype=torch.int64, device=device)
        if local_error is not None:
            send_counts = torch.zeros(self.world_size, dtype=torch.int64, device=device)
            flags = torch.tensor(_LOCAL_EXCEPTION, dtype=torch.int64, device=device)
        # Counts, error word and train/eval mode travel together; one host read gives both
        # split-size lists and every rank's verdict.
        # Bit 1: this forward records a backward (whose all-to-all every rank must join).
        records = torch.is_grad_enabled() and self.weight.requires_grad
        mode = torch.full((self.world_size,), int(self.training) | int(records) << 1, dtype=torch.int64,
                          device=device)
        # The weight's dtype and row width, which the vectors' all-to-all relies on, travel
        # too: the configuration is compared once, and a layer converted after (.double(),
        # .half()) on one rank would have the others read its bytes as theirs, or abort.
        layout = torch.full((self.world_size,), _row_layout(self.weight), dtype=torch.int64, device=device)
        send_header = torch.stack([send_counts.to(device), flags.to(device).expand(self.world_size), mode, layout],
                                  dim=1)
        recv_header = torch.empty_like(send_header)
        dist.all_to_all_single(recv_header, send_header.contiguous(), group=self.process_group)
        header = torch.cat([send_header, recv_header]).tolist()
        send_splits = [row[0] for row in header[:self.world_size]]
        recv_splits = [row[0] for row in header[self.world_size:]]
        peer_flags = [row[1] for row in header[self.world_size:]]
        peer_modes = [row[2] for row in header[self.world_size:]]
        peer_layouts = [row[3] for row in header[self.world_size:]]
        if any(peer_flags):
            if local_error is not None:
                raise local_error
            self._raise_for_flags(peer_flags[self.rank], unique_keys, offsets)
            failed = [rank for rank, flag in enumerate(peer_flags) if flag]
            raise RuntimeError(f"{self._layer_name}: rank(s) {failed} of the process group rejected their input "
                               "(see the error on those ranks); no rank went on with this step")
        _check_modes_agree(self._layer_name, "layer", peer_modes)
        if len(set(peer_layouts)) > 1:
            shown = ", ".join(f"rank {rank}: {_row_layout_text(code)}" for rank, code in enumerate(peer_layouts))
            raise ValueError(f"{self._layer_name}: the weight's dtype or row width differs between the ranks of the "
                             f"process group ({shown}); convert the layer alike on every rank")

        recv_keys = _all_to_all_rows(keys_by_owner, recv_splits, send_splits, self.process_group)
        owned_keys, owned_inverse, rows = self._agree_on_lookup(recv_keys)
        sorted_rows, order = _sort_rows(rows)
        rank_in_sorted = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
        vectors = _LookupOwned.apply(self.weight, rows.index_select(0, owned_inverse), sorted_rows,
                                     rank_in_sorted.index_select(0, owned_inverse), False, self._may_miss(),
                                     self._grad_marker)
        received = _AllToAll.apply(vectors, send_splits, recv_splits, self.process_group)
        return received, positions

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

    def _agree_on_config(self) -> None:
        """On the first exchange: one all-gather of the configuration (see :func:`_agree_on_config`)."""
        if self._config_agreed:
            return
        _agree_on_config(self._config(), _wire_device(self.weight, self.process_group), self.process_group,
                         self.world_size, self._layer_name)
        self._config_agreed = True

    def _may_miss(self) -> bool:
        return self.hash_table is not None and (not self.training or self._pending is not None)

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

    def _embed(self, prepare: Callable[[], Tuple[Tensor, Optional[Tensor], object]],
               every_value: Callable[[Tensor, object], bool]):
        """Reads the input with ``prepare()``, dedups the keys and fetches their vectors:
        ``(keys, info, vectors, index)``, ``vectors[index[j]]`` that of ``keys[j]`` (``index`` None:
        ``vectors[j]``). Errors are shared with every rank first (:meth:`_exchange`)."""
        if torch.jit.is_tracing():
            traced.refuse_torchscript(self._layer_name)
        # The vectors are read under the lock too: a forward of another thread that evicts
        # must not give a row away between this one's lookup and its read.
        with _stepping(self, self.training):
            return self._embed_locked(prepare, every_value)

    def _embed_locked(self, prepare: Callable[[], Tuple[Tensor, Optional[Tensor], object]],
                      every_value: Callable[[Tensor, object], bool]):
        if self._rows_first():  # one process
            _check_writable([self], self._layer_name, self.training)
            keys, offsets, info = prepare()
            if offsets is not None:
                self._raise_for_flags(int(_offsets_error_flags(offsets, keys.numel()).item()), None, offsets)
            vectors, index = self._lookup_rows_first(keys, every_value(keys, info))
            return keys, info, vectors, index
        keys = offsets = info = unique_keys = inverse = flags = None
        error: Optional[BaseException] = None
        try:
            # In here: a rank that refused alone would leave the others waiting in the exchange.
            _check_writable([self], self._layer_name, self.training)
            keys, offsets, info = prepare()
            unique_keys, inverse = ops.unique(keys)
            flags = self._key_error_flags(unique_keys)
            if offsets is not None:
                offsets_flags = _offsets_error_flags(offsets, keys.numel())
                flags = offsets_flags if flags is None else flags | offsets_flags
        except BaseException as exc:  # noqa: BLE001 - folded into the counts exchange, re-raised there
            error = exc
        vectors, positions = self._exchange(unique_keys, flags, offsets, error)
        index = inverse if positions is None else positions.index_select(0, inverse)
        return keys, info, vectors, index

    def _traced_rows(self, keys: Tensor, offsets: Optional[Tensor], pad_key: Optional[int]) -> Tensor:
        """One process: the row each of ``keys`` [n] reads (-1: a pad key, or missing), with
        :meth:`_embed`'s checks and table changes but no vectors: the body of
        ``sparsekit::_layer_rows`` (:mod:`sparsekit.traced`)."""
        with _stepping(self, self.training):
            return self._traced_rows_locked(keys, offsets, pad_key)

    def _traced_rows_locked(self, keys: Tensor, offsets: Optional[Tensor], pad_key: Optional[int]) -> Tensor:
        _check_writable([self], self._layer_name, self.training)
        if offsets is not None:
            self._raise_for_flags(int(_offsets_error_flags(offsets, keys.numel()).item()), None, offsets)
        valid = None if pad_key is None else keys != pad_key
        lookup = keys if valid is None else keys[valid]
        if self._rows_first():
            rows = self._place_rows_first(lookup)[0]
        else:
            unique_keys, inverse = ops.unique(lookup)
            flags = self._key_error_flags(unique_keys)
            if flags is not None:
                self._raise_for_flags(int(flags.item()), unique_keys, None)
            rows = self._lookup_rows(unique_keys).index_select(0, inverse)
        if valid is None:
            return rows
        return torch.full(keys.shape, -1, dtype=torch.int64, device=keys.device).masked_scatter_(valid, rows)

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

    def _check_keys_tensor(self, keys: Tensor, what: str) -> Tensor:
        name = self._layer_name
        if not isinstance(keys, Tensor):
            raise TypeError(f"{name}: {what} must be a tensor, got {type(keys).__name__}")
        dense_layout(f"{name}: {what}", keys)
        if keys.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: {what} must hold int64 or int32 keys, got {keys.dtype}")
        if keys.dtype == torch.int64 and self.key_dtype == torch.int32:
            raise TypeError(f"{name}: {what} are int64 but key_dtype is torch.int32; cast them with .int() "
                            "or build the layer with key_dtype=torch.int64")
        if keys.device != self.weight.device:
            raise RuntimeError(f"{name}: {what} are on {keys.device} but the layer is on {self.weight.device}; "
                               "move them with .to(layer.weight.device)")
        return keys.to(self.key_dtype)

    # -- module plumbing --------------------------------------------------------------------

    __prepare_scriptable__ = traced._refuse_scripting

    def _mark_weight(self) -> None:
        """Puts the layer's marks on ``weight`` (``sparsekit_model_parallel``, with eviction
        ``sparsekit_fresh_rows``, and the coalesced-gradient hook); a new weight (a copy, unpickling,
        ``load_state_dict(assign=True)``) lacks them."""
        weight = self.weight
        # The layer's own Parameter, which a compiled forward compares with the one it is
        # given (functional_call's substitute); in __dict__, not registered as a parameter.
        self.__dict__["_own_weight"] = weight
        weight.sparsekit_model_parallel = True
        if self._fresh_rows is not None:
            weight.sparsekit_fresh_rows = self._fresh_rows
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

    def get_extra_state(self):
        # The hash table is module state: this rank's keys in row order with their scores,
        # the pending admissions, the eviction / admission totals and, with eviction, which
        # rows hold new keys whose moments LazyAdam has not reset yet ("fresh", bool per
        # key in row order): without it a reloaded row would hand its evicted key's moments on.
        if self.hash_table is None:
            # A direct table's rows are the keys ``row * world_size + first``: recorded, so
            # that another rank's state (files swapped) or one saved at another world size,
            # whose rows belong to other keys, is refused instead of loaded as this rank's.
            return {"direct_keys": self._direct_layout()}
        state = self.hash_table.state_dict()
        if self._pending is not None:
            state["pending"] = self._pending.state_dict()
        state["evicted"] = torch.tensor(self._evicted, dtype=torch.int64)
        state["admitted"] = torch.tensor(self._admitted, dtype=torch.int64)
        if self._fresh_rows is not None:
            state["fresh"] = self._fresh_rows[:len(self.hash_table)].clone()
        return state

    def _direct_layout(self) -> Tensor:
        """A direct table's key layout: int64 ``[world_size, first]``, row ``i`` holding key
        ``i * world_size + first`` (see :meth:`owned_keys`)."""
        return torch.tensor([self.world_size, (self.rank - self.owner_offset) % self.world_size], dtype=torch.int64)

    def _check_direct_layout(self, saved: Any) -> None:
        """ValueError unless a direct state's ``direct_keys`` is this rank's own layout."""
        name = self._layer_name
        if not isinstance(saved, Tensor) or saved.layout != torch.strided or saved.is_meta \
                or saved.dtype != torch.int64 or tuple(saved.shape) != (2,):
            got = f"a {saved.dtype} tensor of shape {tuple(saved.shape)}" if isinstance(saved, Tensor) \
                else type(saved).__name__
            raise ValueError(f"{name}: load_state_dict: '_extra_state'['direct_keys'] must be an int64 [2] tensor "
                             f"[world_size, first key], got {got}")
        saved_world, saved_first = (int(v) for v in saved.tolist())
        mine = self._direct_layout().tolist()
        if [saved_world, saved_first] != mine:
            raise ValueError(f"{name}: load_state_dict: the state's rows hold keys {saved_first}, "
                             f"{saved_first + saved_world}, {saved_first + 2 * saved_world}, ... (world size "
                             f"{saved_world}) but this rank's rows hold keys {mine[1]}, {mine[1] + mine[0]}, "
                             f"{mine[1] + 2 * mine[0]}, ... (rank {self.rank} of {self.world_size}): it was saved "
                             "by another rank or at another world size; load each rank's own state, or reshard "
                             "with save_checkpoint / load_checkpoint")

    def _check_extra_state(self, state) -> Optional[_CheckedExtraState]:
        """What :meth:`set_extra_state` would load, every part checked and nothing written;
        None: nothing to load."""
        name = self._layer_name
        if state is None:
            return None
        if not isinstance(state, dict):
            raise TypeError(f"{name}: load_state_dict: '_extra_state' must be the dict get_extra_state() "
                            f"returns, got {type(state).__name__}")
        # A direct layer's extra state holds at most its rows' key layout (empty when saved
        # before it was recorded), a hash layer's a table: loading one kind into the other
        # would pair the weight's rows with the wrong keys.
        direct_state = set(state) <= {"direct_keys"}
        if self.hash_table is None:
            if not direct_state:
                raise ValueError(f"{name}: load_state_dict: the state holds a hash table, but this layer has "
                                 "none (use_hashtable=False); build it with use_hashtable=True")
            if "direct_keys" in state:
                self._check_direct_layout(state["direct_keys"])
            return None
        if direct_state:
            raise ValueError(f"{name}: load_state_dict: the state holds no hash table (it was saved by a layer "
                             "with use_hashtable=False), but this layer's rows belong to its table's keys; "
                             "build it with use_hashtable=False")
        totals = []
        for total in ("evicted", "admitted"):
            value = tensor_integer(state.get(total, 0))
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
                raise ValueError(f"{name}: load_state_dict: '_extra_state'['{total}'] must be a non-negative "
                                 f"int below 2**62, got {value!r}")
            totals.append(value)
        # Both tables' states are checked before either table changes: a bad main table must
        # not leave the pending admissions replaced.
        checked_pending = None
        pending = state.get("pending")
        if self._pending is not None and pending is not None:
            checked_pending = _check_state_of(self._pending, pending, f"{name}: load_state_dict: "
                                              "'_extra_state'['pending'] (the pending admissions)")
        table = {key: value for key, value in state.items() if key not in ("pending", "evicted", "admitted", "fresh")}
        checked_table = _check_state_of(self.hash_table, table,
                                        f"{name}: load_state_dict: '_extra_state' (the hash table)")
        if checked_pending is not None:
            _check_pending_of(checked_table, checked_pending, f"{name}: load_state_dict: '_extra_state'['pending']")
        num_keys = checked_table.keys.numel()
        if self.world_size > 1 and num_keys > 0:
            # A rank's state holds the keys it owns: another rank's (state files swapped) or
            # one saved at another world size would sit where no lookup asks for them.
            owners = _owners(checked_table.keys, self.world_size, self.owner_offset)
            foreign = owners != self.rank
            if bool(foreign.any()):
                raise ValueError(f"{name}: load_state_dict: '_extra_state' holds keys this rank does not own (key "
                                 f"{checked_table.keys[foreign][0].item()} belongs to rank "
                                 f"{owners[foreign][0].item()} of {self.world_size}, this is rank {self.rank}): it "
                                 "was saved by another rank or at another world size; load each rank's own state, "
                                 "or reshard with save_checkpoint / load_checkpoint")
        fresh = state.get("fresh")
        if fresh is None:  # saved without eviction, or before the flags were saved: no reset pending
            fresh = torch.zeros(num_keys, dtype=torch.bool)
        elif not isinstance(fresh, Tensor) or fresh.is_meta or fresh.layout != torch.strided \
                or fresh.dtype != torch.bool or tuple(fresh.shape) != (num_keys,):
            got = f"a {fresh.dtype} tensor of shape {tuple(fresh.shape)}" if isinstance(fresh, Tensor) \
                else type(fresh).__name__
            raise ValueError(f"{name}: load_state_dict: '_extra_state'['fresh'] must be a bool [{num_keys}] tensor "
                             f"like 'keys' (the rows whose optimizer moments are reset at their next update), "
                             f"got {got}")
        return _CheckedExtraState(checked_table, checked_pending, totals[0], totals[1],
                                  fresh.to(self.weight.device))

    def set_extra_state(self, state) -> None:
        """Loads what :meth:`get_extra_state` returned: the hash table, the pending
        admissions, the totals and the rows whose moments are to be reset (a layer without
        eviction keeps none and ignores them). Everything is checked first; a state that
        raises leaves the layer as it was.

        Raises:
            ValueError, TypeError, HashTableFullError: as ``HashTable.load_state_dict`` for
                the table's or the pending admissions' state, or a bad total or ``fresh``.
        """
        self._load_extra_state(self._check_extra_state(state))

    def _rows_rebound(self) -> None:
        """The hash table was just loaded or reset, so its rows may hold other keys: drops the
        gradients of lookups before (accumulated now, pending via ``forget_all``). A direct shard's
        rows are its keys' for good and keep theirs."""
        self._grad_marker.forget_all()
        self.weight.grad = None

    def _load_extra_state(self, checked: Optional[_CheckedExtraState]) -> None:
        if checked is None:
            return
        if self._fresh_rows is None and bool(checked.fresh.any()):
            # The saved moments of those rows are still the evicted keys': LazyAdam resets
            # them at their next update. Allocated first, so a failed allocation leaves the
            # layer as it was.
            self._keep_fresh_rows()
            self._mark_weight()
        self._rows_rebound()
        if checked.pending is not None:
            self._pending._load_checked(checked.pending)
        elif self._pending is not None:
            # A state saved without pending admissions (admit_after=1) has none: the layer's
            # own would outlive the table they were counted against (load_checkpoint clears them too).
            self._pending.clear()
        self.hash_table._load_checked(checked.table)
        self._evicted, self._admitted = checked.evicted, checked.admitted
        if self._fresh_rows is not None:
            self._fresh_rows.zero_()
            self._fresh_rows[:checked.fresh.numel()] = checked.fresh

    def _check_load(self, state_dict: Mapping[str, Any], prefix: str) -> List[str]:
        """Every check of loading this shard's entries of ``state_dict``, nothing written. Raises
        for a bad extra state, or a hash layer's weight without its extra state (or the reverse);
        returns nn.Module's own messages for a weight it would not copy."""
        weight_key, extra_key = prefix + "weight", prefix + "_extra_state"
        has_weight, has_extra = weight_key in state_dict, extra_key in state_dict
        if self.hash_table is not None and has_weight != has_extra:
            given, absent = (weight_key, extra_key) if has_weight else (extra_key, weight_key)
            raise ValueError(f"{self._layer_name}: load_state_dict: the state holds {given!r} but not "
                             f"{absent!r}; a hash layer's weight rows belong to its table's keys, so both load "
                             "together or neither does")
        if has_extra and self.hash_table is not None and self.hash_table.device.type == "meta":
            # assign=True would put the weight in, but the table has no memory to rebuild
            # itself in (its check alone runs ops that the meta device cannot).
            raise RuntimeError(f"{self._layer_name}: load_state_dict into a layer on the meta device: its hash table "
                               "holds no memory to load the keys into, even with assign=True; give the layer memory "
                               "first (model.to_empty(device=...)), then load_state_dict")
        if has_extra:
            self._check_extra_state(state_dict[extra_key])
        if not has_weight:
            return []
        weight = state_dict[weight_key]
        if not torch.overrides.is_tensor_like(weight):
            return [(f'While copying the parameter named "{weight_key}", expected torch.Tensor or Tensor-like '
                     f"object from checkpoint but received {type(weight)}")]
        if weight.shape != self.weight.shape:
            return [(f"size mismatch for {weight_key}: copying a param with shape {weight.shape} from checkpoint, "
                     f"the shape in current model is {self.weight.shape}.")]
        if isinstance(weight, Tensor) and weight.layout != torch.strided:
            return [(f'While copying the parameter named "{weight_key}": the checkpoint holds a {weight.layout} '
                     "tensor; a table's weight loads from a dense (strided) one (.to_dense())")]
        if weight.is_meta and not self.weight.is_meta:
            return [(f'While copying the parameter named "{weight_key}": the checkpoint holds a meta tensor, '
                     "which has no data; load the state with real tensors (e.g. map_location='cpu')")]
        return []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # nn.Module copies the weight, then calls set_extra_state, and reports a weight it could
        # not copy only once every module was visited: everything is checked first, so a call
        # that fails leaves the layer as it was (set_extra_state checks the extra state again:
        # one more unique of the keys, on a rare call).
        if error_msgs:
            return  # the call fails already (an earlier entry): nothing here changes either
        problems = self._check_load(state_dict, prefix)
        if problems:
            error_msgs.extend(problems)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._mark_weight()  # assign=True puts a new Parameter in

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, but a call that raises changes nothing: with
        ``strict=True`` missing and unexpected keys raise before anything loads, and the
        weight and the hash table are checked together before either changes. With
        ``strict=False`` a layer whose entries are absent keeps its state; a hash layer's
        weight without its table state (or the reverse) raises ValueError.
        With state-dict or load hooks registered on it (or a submodule), which may rename,
        add or drop entries, the missing and unexpected keys are torch's own check, after
        the hooks ran."""
        _check_state_dict_keys(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

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

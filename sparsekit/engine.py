"""The one-process step of an :class:`~sparsekit.EmbeddingBagCollection`, in stages over
one :class:`StepContext`:

1. the batch, read and checked by the collection (its features, each feature's table, the
   bounds of its values);
2. :func:`resolve_rows`: stateful, outside autograd. Each value's row in its table:
   found, or, in training, its key inserted in order of first occurrence (initialised,
   admitted, evicted as the table's settings say) and scored; -1 for a key that reads as
   zeros (missing in eval, not admitted yet). Nothing changes unless every table's part
   can be done;
3. :func:`read_pooled`: one pooled read per weight dtype, ``[B, sum of dims]`` with the
   features side by side, differentiable; its backward is the last stage
   (:mod:`sparsekit.pooled`). In eval or under ``no_grad`` nothing is kept for a backward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from .exchange import _offsets_error_flags, _unique_tables
from .hashtable import HashTableFullError
from .pooled import ReadLayout, pooled_read
from .shard import KeySeededUniform, _place_new_keys
from .step_errors import StepErrors, raise_verdict
from .tables_cuda import _device_ints

__all__ = ["StepContext", "resolve_rows", "read_pooled", "initial_rows", "ticking", "read_one_table"]


@dataclass
class StepContext:
    """One forward's batch and what the stages make of it.

    ``bounds[f]:bounds[f + 1]`` are feature f's values (int64 ``[F + 1]`` on the keys'
    device; ``host_bounds`` the same as a list where the host had them for free),
    ``offsets`` the CSR bounds of every bag (feature-major, ``[F * B + 1]`` int64), ``keys``
    int64 ``[nnz]``, ``weights`` the per-value weights or None; ``flags`` the input's verdict
    (int64 scalar, 0: valid), read with the lookup's report; ``reporter`` holds the error
    word the step's ops record into instead of raising (``errors``) and reads the verdicts
    in the collection's error mode (:mod:`sparsekit.step_errors`); ``rows`` is set by
    :func:`resolve_rows`."""

    features: List[str]
    table_of_feature: List[int]
    batch: int
    bounds: Tensor
    offsets: Tensor
    keys: Tensor
    weights: Optional[Tensor]
    flags: Tensor
    reporter: StepErrors
    host_bounds: Optional[List[int]] = None
    rows: Optional[Tensor] = None

    @property
    def errors(self) -> Tensor:
        """The error word on the keys' device."""
        return self.reporter.slots(self.keys.device)

    def bounds_list(self) -> List[int]:
        """The bounds as host ints (a host read on a device, made once: only steps that meet
        new keys, evolving tables or an error need them)."""
        if self.host_bounds is None:
            self.host_bounds = self.bounds.tolist()
        return self.host_bounds


def _evolving(shard: Any, training: bool) -> bool:
    """Whether a hash table's training lookup goes through its shard's plan and commit
    (eviction or admission), rather than the collection's batched find and place."""
    return training and shard.hash_table is not None and (
        shard.hash_table.eviction is not None or shard._pending is not None)


def resolve_rows(ctx: StepContext, shards: Sequence[Any], training: bool,
                 direct_key_error: Callable[[int, int], BaseException], bad_input: Callable[[int], None]) -> Tensor:
    """Stage 2: every value's row (int64 ``[nnz]``, -1: reads as zeros), stored in
    ``ctx.rows``. Raises before anything changes: ``bad_input(flags)`` for the input's
    verdict, ``direct_key_error(table, key)`` for a key outside a direct table,
    ``HashTableFullError`` (the table's own message) when a table cannot take its new keys,
    the initializer's error, and an error an earlier step's ops recorded in ``ctx.errors``."""
    keys = ctx.keys
    tables: List[Any] = []          # the hash tables found directly, once each
    table_slot: Dict[int, int] = {}
    segment_tables: List[int] = []  # per feature: its table's place in `tables`, -1 direct, -3 resolved here
    direct_rows: List[int] = []
    for t in ctx.table_of_feature:
        shard = shards[t]
        direct_rows.append(shard.num_keys_capacity if shard.hash_table is None else 0)
        if shard.hash_table is None:
            segment_tables.append(-1)
        elif _evolving(shard, training):
            segment_tables.append(-2)
        else:
            segment_tables.append(table_slot.setdefault(t, len(tables)))
            if len(tables) < len(table_slot):
                tables.append(shard.hash_table)
    # Only direct tables: a key inside its table is its row, so the op only checks the keys
    # and they are read as rows themselves (no [nnz] copy of them written and read back).
    # One outside is reported: raised at the read below, or, in the other error modes, the
    # pooled read and the update leave it out as a bad row.
    direct_only = all(s == -1 for s in segment_tables)  # then no table is searched either
    rows, report = torch.ops.sparsekit.lookup_rows([table._slot_keys for table in tables],
                                                   [table._slot_rows for table in tables], keys, ctx.bounds,
                                                   segment_tables, direct_rows, not direct_only)
    if direct_only:
        rows = keys
    nnz = keys.numel()
    may_grow = training and any(s >= 0 or s == -2 for s in segment_tables)
    if not ctx.reporter.reads_now(may_grow):
        # Nothing below needs the host: the verdict stays on the device (errors="late" / "assert").
        ctx.reporter.defer(ctx.flags, report, ctx.bounds, keys,
                           ctx.reporter.feature_tables(ctx.table_of_feature, keys.device))
        ctx.rows = rows
        return rows
    # The step's one host read (a sync on CUDA): the input's verdict, the lookup's report and
    # the error word, which the previous step's backward may have written since its forward.
    values = ctx.reporter.read(ctx.flags, report, nnz)
    at, absent = values[1], values[2]
    raise_verdict(values, ctx.bounds_list() if at < nnz else None, ctx.table_of_feature, bad_input,
                  direct_key_error, lambda i: int(keys[i]))
    if not training:
        ctx.rows = rows
        return rows
    evolving = sorted({t for t, s in zip(ctx.table_of_feature, segment_tables) if s == -2})
    # Plan every table's part (nothing changes yet), then carry every plan out.
    growth = _plan_growth(ctx, shards, rows) if absent else None
    plans = {t: _plan_evolving(ctx, shards[t], t) for t in evolving}
    if growth is not None:
        rows = _grow(shards, rows, growth)
    for t, (plan, inverse) in plans.items():
        found = shards[t]._commit(plan).index_select(0, inverse)
        bounds, start = ctx.bounds_list(), 0
        for f, table in enumerate(ctx.table_of_feature):
            if table == t:
                count = bounds[f + 1] - bounds[f]
                rows[bounds[f]:bounds[f + 1]] = found[start:start + count]
                start += count
    if tables:
        sizes = [len(table) for table in tables]
        torch.ops.sparsekit.hash_table_touch_tables_([table._last_seen for table in tables],
                                                     [table._count for table in tables], rows, ctx.bounds,
                                                     [max(s, -1) for s in segment_tables], sizes,
                                                     [table.clock for table in tables], ctx.errors)
    ctx.rows = rows
    return rows


class _Growth:
    """The new keys of the tables found directly, planned: per table its new keys (in order
    of first occurrence) and their initial vectors, and each missing value's new key."""

    def __init__(self, tables: List[int], keys: List[Tensor], initial: List[Tensor], missing: Tensor,
                 new_of_missing: Tensor, counts: List[int]) -> None:
        self.tables, self.keys, self.initial = tables, keys, initial
        self.missing, self.new_of_missing, self.counts = missing, new_of_missing, counts


def _plan_growth(ctx: StepContext, shards: Sequence[Any], rows: Tensor) -> "_Growth":
    """The values of the directly found tables that missed: their keys, deduplicated per
    table in order of first occurrence, checked to fit, with their initial vectors."""
    missing = rows == -1
    # Where each feature's missing values start among all the missing ones (one host read).
    running = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(missing, 0, out=running[1:])
    segments = running.index_select(0, ctx.bounds).tolist()
    num_tables = len(shards)
    new_keys, new_of_missing, per_table = _unique_tables(ctx.keys[missing], segments, ctx.table_of_feature,
                                                         num_tables)
    per_table = per_table.tolist()
    growing = [t for t in range(num_tables) if per_table[t] > 0]
    starts = list(itertools.accumulate(per_table, initial=0))
    keys_of = [new_keys[starts[t]:starts[t + 1]] for t in growing]
    for t, keys in zip(growing, keys_of):
        table = shards[t].hash_table
        if keys.numel() > table.capacity - len(table):
            shards[t]._plan_lookup(keys)  # raises the table's own HashTableFullError
            raise HashTableFullError(f"{shards[t]._table_full(0)}: {keys.numel()} new keys do not fit")
    initial = initial_rows(shards, list(zip(growing, keys_of)))  # may raise: nothing has changed yet
    return _Growth(growing, keys_of, initial, missing, new_of_missing, [per_table[t] for t in growing])


@torch.no_grad()
def _grow(shards: Sequence[Any], rows: Tensor, growth: _Growth) -> Tensor:
    """Places the planned new keys (their tables' next rows, in order) and gives every
    missing value its key's row."""
    growing = [shards[t] for t in growth.tables]
    keys = torch.cat(growth.keys) if len(growth.keys) > 1 else growth.keys[0]
    sizes = _place_new_keys(growing, keys, growth.counts, growth.initial)
    # A new key's row: its table's old size plus its rank among the table's new keys.
    shift = _device_ints([size - start for size, start in zip(sizes, itertools.accumulate(growth.counts, initial=0))],
                         rows.device)
    new_rows = torch.arange(keys.numel(), device=rows.device) + ops._repeat_interleave(
        shift, _device_ints(growth.counts, rows.device), keys.numel())
    return rows.masked_scatter(growth.missing, new_rows.index_select(0, growth.new_of_missing))


def _plan_evolving(ctx: StepContext, shard: Any, table: int) -> Tuple[Any, Tensor]:
    """A table with eviction or admission: its values' distinct keys (in order of first
    occurrence) planned by its shard, and each value's place among them."""
    bounds = ctx.bounds_list()
    parts = [ctx.keys[bounds[f]:bounds[f + 1]] for f, t in enumerate(ctx.table_of_feature) if t == table]
    keys = torch.cat(parts) if len(parts) > 1 else parts[0]
    distinct, inverse = ops.unique(keys, return_inverse=True)
    return shard._plan(distinct), inverse


def initial_rows(shards: Sequence[Any], new: List[Tuple[int, Tensor]]) -> List[Tensor]:
    """The initial vectors of the new keys of each ``(table, new keys)``: one initializer
    call for every group of tables whose initializers are one :class:`KeySeededUniform`
    (same seed and range, a pure function of the key) of one dim and dtype, one per table
    otherwise."""
    groups: Dict[Any, List[int]] = {}
    for i, (t, _) in enumerate(new):
        shard = shards[t]
        init = shard.embedding_initializer
        group = (init.seed, init.low, init.high, shard.embedding_vec_size, shard.weight.dtype) \
            if type(init) is KeySeededUniform else t
        groups.setdefault(group, []).append(i)
    out: List[Optional[Tensor]] = [None] * len(new)
    for members in groups.values():
        keys = [new[i][1] for i in members]
        initial = shards[new[members[0]][0]].initial_rows(torch.cat(keys).long() if len(keys) > 1 else keys[0].long())
        for i, part in zip(members, initial.split([k.numel() for k in keys])):
            out[i] = part
    return out


# Read layouts a collection keeps (one per distinct feature list of its batches); past
# this many, the cache starts over rather than grow with inputs that keep changing.
_LAYOUTS_KEPT = 64


def read_pooled(ctx: StepContext, shards: Sequence[Any], fused: Optional[Callable[[Any], Any]],
                keyed: Optional[List[str]] = None, layouts: Optional[Dict[Any, Any]] = None) -> Any:
    """Stage 3: ``{feature: [B, dim]}`` in the order of ``ctx.features``, each in its table's
    dtype: column slices of one pooled read per weight dtype. With ``keyed`` (every
    feature of the collection, in the order of its columns; one dtype): the ``[B, sum of
    dims]`` block itself, a feature the batch lacks reading as zeros. ``layouts``: the
    caller's cache of read layouts (they follow from the batch's features, the tables'
    fixed dims and combiners, and their weights' dtypes). ``fused``: None, or a callable
    that gives the backward a fused update of the read's weights."""
    weights = None if ctx.weights is None else ctx.weights.float().contiguous()
    if keyed is not None:
        layout, members = _cached(layouts, ("keyed", tuple(ctx.features), tuple(ctx.table_of_feature)),
                                  lambda: _keyed_plan(ctx, shards, keyed))
        if not members:  # a batch of no features: zeros
            return torch.zeros(ctx.batch, layout.total_dim, dtype=shards[0].weight.dtype, device=ctx.keys.device)
        return pooled_read(layout, ctx.rows, ctx.offsets, weights, [shards[t].weight for t in members],
                           [shards[t]._grad_marker for t in members], fused, ctx.errors)
    dtypes = tuple(shards[t].weight.dtype for t in ctx.table_of_feature)  # .half() may change them
    reads = _cached(layouts, ("split", tuple(ctx.features), tuple(ctx.table_of_feature), dtypes),
                    lambda: _split_plan(ctx, shards))
    out: Dict[str, Tensor] = {}
    for members, layout, mine in reads:
        parts = pooled_read(layout, ctx.rows, ctx.offsets, weights, [shards[t].weight for t in members],
                            [shards[t]._grad_marker for t in members], fused, ctx.errors)
        out.update((ctx.features[f], part) for f, part in zip(mine, parts))
    return {feature: out[feature] for feature in ctx.features}


def _cached(layouts: Optional[Dict[Any, Any]], key: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``layouts[key]``, made by ``make()`` the first time (always, without a cache)."""
    if layouts is None:
        return make()
    value = layouts.get(key)
    if value is None:
        if len(layouts) >= _LAYOUTS_KEPT:
            layouts.clear()
        value = layouts[key] = make()
    return value


def _split_plan(ctx: StepContext, shards: Sequence[Any]) -> List[Tuple[List[int], ReadLayout, List[int]]]:
    """The reads of a dict output, one per weight dtype: the tables it reads (in the order of
    its weights), its layout, and the features it gives (in batch order)."""
    dtypes: Dict[torch.dtype, List[int]] = {}  # tables read, per weight dtype, in order of first read
    for t in ctx.table_of_feature:
        members = dtypes.setdefault(shards[t].weight.dtype, [])
        if t not in members:
            members.append(t)
    reads = []
    for members in dtypes.values():
        place = {t: j for j, t in enumerate(members)}
        feature_tables, columns, means = [], [], []
        total = 0
        for t in ctx.table_of_feature:
            j = place.get(t, -1)
            feature_tables.append(j)
            columns.append(total if j >= 0 else 0)
            means.append(int(j >= 0 and shards[t]._combiner() == "mean"))
            total += shards[t].embedding_vec_size if j >= 0 else 0
        # Each feature an output of the read (the block's columns): their gradients reach
        # its backward where they lie, with no concatenation.
        layout = ReadLayout(feature_tables, columns, means, total, split=True)
        reads.append((members, layout, [f for f, j in enumerate(feature_tables) if j >= 0]))
    return reads


def _keyed_plan(ctx: StepContext, shards: Sequence[Any], keyed: List[str]) -> Tuple[ReadLayout, List[int]]:
    """The keyed read's layout for this batch's features, and the tables it reads in the
    order of its weights."""
    dim_of = {feature: shard.embedding_vec_size for shard in shards for feature in shard.config.features}
    place = {t: j for j, t in enumerate(sorted(set(ctx.table_of_feature)))}
    start, column_of = 0, {}
    for feature in keyed:
        column_of[feature] = start
        start += dim_of[feature]
    layout = ReadLayout([place[t] for t in ctx.table_of_feature], [column_of[f] for f in ctx.features],
                        [int(shards[t]._combiner() == "mean") for t in ctx.table_of_feature], start)
    return layout, sorted(place, key=place.get)


def ticking(shards: Sequence[Any], training: bool, forward: Callable[[], Any]) -> Any:
    """``forward()``, then in training every hash table's clock (and its pending keys')
    advanced once, unless the forward advanced it (an insert with eviction or admission
    ticks): once per training forward, also for a table with no key this step."""
    clocks = [(None if s.hash_table is None else s.hash_table.clock, None if s._pending is None else s._pending.clock)
              for s in shards] if training else None
    out = forward()
    if clocks is not None:
        for shard, (table_clock, pending_clock) in zip(shards, clocks):
            if shard.hash_table is not None and shard.hash_table.clock == table_clock:
                shard.hash_table.tick()
            if shard._pending is not None and shard._pending.clock == pending_clock:
                shard._pending.tick()
    return out


def read_one_table(shard: Any, keys: Tensor, offsets: Tensor, check_offsets: bool, reporter: StepErrors,
                   direct_key_error: Callable[[int, int], BaseException], bad_input: Callable[[int], None],
                   layouts: Dict[Any, Any]) -> Tensor:
    """A single layer's one-process forward, as a one-table collection's: the bags of
    ``offsets`` (int64 ``[bags + 1]``; checked on the device with ``check_offsets``, the
    verdict read with the lookup's) over ``keys`` of ``shard``, pooled by its combiner into
    ``[bags, dim]``. Raises as :func:`resolve_rows` does, before anything changes."""
    nnz, bags = keys.numel(), offsets.numel() - 1
    flags = _offsets_error_flags(offsets, nnz) if check_offsets else torch.zeros((), dtype=torch.int64,
                                                                                 device=keys.device)
    # Every bag is one feature's: its values are all the keys ([0, nnz] once the offsets are valid).
    bounds = offsets[::bags] if bags > 0 else offsets.new_zeros(2)
    ctx = StepContext(["bags"], [0], bags, bounds, offsets, keys.long(), None, flags, reporter, None)
    resolve_rows(ctx, [shard], shard.training, direct_key_error, bad_input)
    return read_pooled(ctx, [shard], None, layouts=layouts)["bags"]

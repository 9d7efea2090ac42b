"""The collection under a process group: the owners' lookup of the batch's (table, key)
pairs (plan every table, agree through one status all-reduce, commit), the exchanges of
pairs and vectors, and the pooling of the vectors that come back. A mixin of
:class:`~sparsekit.EmbeddingBagCollection`; see ``docs/architecture.md``."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from ._checks import compile_disabled
from .engine import initial_rows
from .pooled import update_distinct_rows
from .exchange import (
    _LOCAL_EXCEPTION,
    _OWNER_EXCEPTION,
    _TABLE_FULL,
    _agree_on_config,
    _all_to_all_rows,
    _AllToAll,
    _CoalescedGradMarker,
    _GatherPieces,
    _GatherRows,
    _mean_of_sum,
    _PoolRows,
    _read_rows,
    _sort_rows,
    _table_gradients,
    _unique_tables,
    _wire_device,
)
from .hashtable import HashTableFullError, _find_in_tables, _touch_tables
from .shard import (
    _check_modes_agree,
    _place_new_keys,
    _row_layout,
    _row_layout_text,
)
from .tables_cuda import _device_ints


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


class ShardedLookup:
    """The multi-rank step of :class:`~sparsekit.EmbeddingBagCollection` (its mixin)."""

    def _sharded_forward(self, prepared: Optional[Dict[str, Any]], error: Optional[BaseException],
                         flags: Tensor) -> Any:
        """The forward under a process group, from this rank's prepared batch (or the error
        that preparing it raised, which every rank hears of before it is re-raised)."""
        num_tables, world = len(self._shards), self.world_size
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
                    if table._eviction is None and shard.fresh_rows is None \
                            and misses[i] <= table.capacity - len(table):
                        growing.append((t, rows, new_keys[i]))
            initial = initial_rows(self._shards, [(t, keys) for t, _, keys in growing])
            for (t, rows, keys_of_table), vectors in zip(growing, initial):
                plans[t] = _GrowRows(rows, keys_of_table, vectors)
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
    def _grow(self, shards: List[Any], plans: List["_GrowRows"]) -> List[Tensor]:
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

"""The one-process collection under ``torch.compile``: the rows from the opaque
``sparsekit::_collection_rows``, then a traced pooled read per table (with the fused
update in the backward graph when the collection has one). A mixin of
:class:`~sparsekit.EmbeddingBagCollection`; see :mod:`sparsekit.traced`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import ops, traced
from .exchange import (
    _mean_of_sum,
    _stepping,
)
from .shard import _check_own_weights
from .collection_input import KeyedJagged, _as_keyed_jagged


class TracedLookup:
    """The compiled forward of :class:`~sparsekit.EmbeddingBagCollection` (its mixin)."""

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
                pooled = traced.fused_tap(pooled, shard.weight, weight, rows, bags,
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

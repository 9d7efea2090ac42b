"""Reading one rank's batch for an :class:`~sparsekit.EmbeddingBagCollection`, as a mixin of
the collection: the input's checks (features, devices, offsets in one pass), each feature's
table and value bounds, and, under a process group, the batch's distinct (table, key) pairs
routed to their owners. On a device the one-process verdict stays there until the step's
one read (``engine.resolve_rows``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from . import _device, ops
from .collection_input import _INPUT, KeyedJagged, _as_keyed_jagged
from .exchange import _BAD_KEY, _BAD_OFFSETS, _offsets_error_flags, _one_per_bag, _owners, _unique_tables
from .tables_cuda import _device_ints

__all__: List[str] = []


class BatchReader:
    """The collection's reading of its input (the collection supplies ``_feature_table``,
    ``_shards``, ``_weighted``, ``world_size`` and ``training``)."""

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
        if batch_only and not _device.host_readable(offsets):
            # One process on a device: the bounds stay there, the verdict is read later with
            # the lookup's (engine.resolve_rows), so nothing here waits for the device.
            bounds = offsets[::batch] if batch > 0 else offsets.new_zeros(num_features + 1)
            return {"features": features, "batch": batch, "bounds": bounds, "host_bounds": None,
                    "offsets": offsets, "keys": values.long(), "weights": weights,
                    "table_of_feature": [self._feature_table[f] for f in features],
                    "flags": _offsets_error_flags(offsets, nnz)}
        if _device.host_readable(offsets):
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
            # Valid bounds are the offsets' every batch-th entry: that view, not a new tensor.
            device_bounds = offsets[::batch] if batch > 0 and not flags_bad_bounds else \
                torch.tensor(bounds, dtype=torch.int64)
            return {"features": features, "batch": batch, "bounds": device_bounds,
                    "host_bounds": bounds, "offsets": offsets, "keys": keys, "weights": weights,
                    "table_of_feature": table_of_feature, "flags": flags}
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
                          f"use_hashtable=False keys must lie in [0, capacity * world_size) (a TorchRec config's: "
                          f"[0, num_embeddings)) = [0, {shard.num_keys_capacity})")

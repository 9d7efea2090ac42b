"""A shard's forward, as a mixin of the shard (:class:`sparsekit.shard._ModelParallelEmbedding`):
the call's keys checked and deduplicated, then looked up on one process, or exchanged between
the ranks (counts, error words, modes and row layouts in one all-to-all; keys to their owners,
vectors back), every rank raising before any key moves when one fails. The owner's own part
is the shard's ``_agree_on_lookup``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops, traced
from ._checks import dense_layout
from .exchange import (
    _BAD_KEY,
    _BAD_OFFSETS,
    _LOCAL_EXCEPTION,
    _agree_on_config,
    _all_to_all_rows,
    _AllToAll,
    _LookupOwned,
    _offsets_error_flags,
    _sort_rows,
    _stepping,
    _wire_device,
)
from .shard_checks import _check_modes_agree, _check_writable, _row_layout, _row_layout_text


class _ShardExchange:
    """The shard's forward and exchange (see the module); uses the shard's weight, tables,
    process group and lookups."""

    def _key_error_flags(self, unique_keys: Tensor) -> Optional[Tensor]:
        """Device int64 scalar: _BAD_KEY when a key is outside the direct-mapped range;
        None when there is nothing to check."""
        if self.hash_table is not None or unique_keys.numel() == 0:
            return None
        keys = unique_keys.long()
        bad = ((keys < 0) | (keys >= self.num_keys_capacity)).any()
        return bad.long() * _BAD_KEY

    def _bad_key_error(self, unique_keys: Tensor, first: Optional[int] = None) -> ValueError:
        """The error for the keys of ``unique_keys`` (distinct, some bad) outside the direct
        table, naming ``first`` (default: the first bad one of ``unique_keys``)."""
        keys = unique_keys.long()
        bad = keys[(keys < 0) | (keys >= self.num_keys_capacity)]
        key = bad[0].item() if first is None else first
        return ValueError(
            f"{self._layer_name}: key {key} ({bad.numel()} distinct bad keys on rank {self.rank}) is out of range: "
            f"with use_hashtable=False keys must lie in [0, {self._capacity_argument} * world_size) = "
            f"[0, {self.num_keys_capacity}); use use_hashtable=True for arbitrary keys or raise "
            f"{self._capacity_argument}")

    def _raise_for_flags(self, flags: int, unique_keys: Optional[Tensor], offsets: Optional[Tensor]) -> None:
        name = self._layer_name
        if flags & _BAD_KEY:
            raise self._bad_key_error(unique_keys)
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

    def _agree_on_config(self) -> None:
        """On the first exchange: one all-gather of the configuration (see :func:`_agree_on_config`)."""
        if self._config_agreed:
            return
        _agree_on_config(self._config(), _wire_device(self.weight, self.process_group), self.process_group,
                         self.world_size, self._layer_name)
        self._config_agreed = True

    def _may_miss(self) -> bool:
        return self.hash_table is not None and (not self.training or self._pending is not None)

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

"""The exchange's pieces shared by the model-parallel layers and the collection: process
groups (and deep copies that share them), ``all_to_all_single`` with autograd, the gather /
pool / owned-lookup autograd functions, the error words every rank folds into the
exchange, and the one-time configuration agreement.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import _device, ops
from ._checks import compile_disabled

# Bits of the error word each rank folds into the counts exchange.
_BAD_KEY = 1
_BAD_OFFSETS = 2
_LOCAL_EXCEPTION = 4
# Kinds of the status word all-reduced after the owners' lookups.
_TABLE_FULL = 1
_OWNER_EXCEPTION = 2


def _resolve_group(process_group: Optional[dist.ProcessGroup],
                   where: str) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, world_size, rank); no group at all when torch.distributed is not initialised.
    Anything but a ProcessGroup or None raises TypeError, the message led by ``where``; the
    marker dist.new_group gives ranks outside the group, ValueError."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        process_group = dist.group.WORLD
    elif dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on the ranks it leaves out.
        raise ValueError(f"{where}: this rank ({dist.get_rank()}) is not a member of process_group (dist.new_group "
                         "gave it the non-member marker); build the layer only on the group's ranks")
    elif not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"{where}: process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r} "
                        f"({type(process_group).__qualname__})")
    return process_group, dist.get_world_size(process_group), dist.get_rank(process_group)


def _make_step_lock(module: torch.nn.Module) -> None:
    """Gives a layer or collection its step lock (``__init__``, and ``__setstate__`` after a
    copy or unpickling: a lock is no state, see :func:`_state_without_lock`)."""
    module.__dict__["_step_lock"] = threading.RLock()


def _state_without_lock(state: Dict[str, Any]) -> Dict[str, Any]:
    """``__getstate__``'s dict (a copy) without the step lock, which pickle and deepcopy refuse."""
    state.pop("_step_lock", None)
    return state


def _stepping(module: torch.nn.Module, training: bool):
    """The step lock of a layer or collection, held for one forward's table work, so that
    concurrent training forwards act in some serial order. Never taken in a backward (a peer's
    forward may hold it) nor while dynamo traces."""
    if torch.compiler.is_compiling() or not (training or module.world_size > 1):
        return contextlib.nullcontext()
    return module.__dict__["_step_lock"]


def _deepcopy_sharing_group(module: torch.nn.Module, memo: Dict[int, Any]) -> torch.nn.Module:
    """``copy.deepcopy`` of a layer or collection: the default copy, then ``__setstate__`` of
    the copy, but its ``process_group`` shared (a connection cannot be copied)."""
    group = module.process_group
    if group is not None:
        memo[id(group)] = group
    clone = type(module).__new__(type(module))
    memo[id(module)] = clone
    clone.__setstate__(copy.deepcopy(module.__getstate__(), memo))
    return clone


def _reduce_without_group(module: torch.nn.Module, name: str, protocol: int):
    """``__reduce_ex__`` of a layer or collection: pickling one bound to a process group raises
    naming the layer and what to do; ``copy.deepcopy`` goes through ``__deepcopy__``."""
    if module.process_group is not None:
        raise TypeError(f"{name}: a layer bound to a process group cannot be pickled (torch.save(model), pickle, "
                        "torch.multiprocessing): the group is this process's connection to the other ranks; save "
                        "it with sk.save_checkpoint, or torch.save(model.state_dict())")
    return object.__reduce_ex__(module, protocol)  # nn.Module's own (it defines none)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; its gradient goes back the way the rows came, through
    this same function, so that a ``create_graph=True`` backward is differentiable again
    (a second-order term of a multi-rank layer went missing without a word otherwise)."""

    @staticmethod
    def forward(ctx, rows: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all_rows(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _all_to_all_rows(rows: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
    out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


class _CoalescedGradMarker:
    """A post-accumulate-grad hook that puts back the coalesced flag autograd drops from the
    lookup's gradient, while the stored gradient still holds the values the lookup produced
    (it holds their storage, so a recycled address cannot fool it). Numbers given-away rows."""

    # With eviction (the shard sets row_since, int64 per row): the number of lookups that
    # gave rows to new keys so far, and for each row the number of the one that gave it its
    # key. A lookup's backward drops the rows given away after it. Class defaults too: a
    # marker unpickled from a layer saved before they existed has neither.
    stamp = 0
    row_since: Optional[Tensor] = None
    # The stamp at which every row changed hands at once (the table loaded or reset): a
    # lookup made before it drops its whole gradient.
    cleared = 0

    def __init__(self) -> None:
        self.values: Optional[Tensor] = None
        self.stamp = 0
        self.row_since = None
        self.cleared = 0

    def forget_all(self) -> None:
        """Called by a hash shard whose table was loaded or reset: every row may hold another
        key now, so no gradient of a lookup made before may land on it."""
        self.stamp += 1
        self.cleared = self.stamp

    def produced(self, values: Tensor) -> None:
        """Called by the lookup's backward with the values of the gradient it returns."""
        self.values = values

    def reused(self, rows: Tensor) -> None:
        """Called by a shard with eviction when ``rows`` take new keys (evicted keys' rows among them)."""
        self.stamp += 1
        self.row_since[rows] = self.stamp

    def lost(self, stamp: int) -> bool:
        """Whether the table was loaded or reset since a lookup at ``stamp``: its whole
        gradient is dropped, and the weight gets none from it (no optimizer step counted)."""
        return stamp < self.cleared

    def own_rows(self, rows: Tensor, values: Tensor, stamp: int, may_miss: bool) -> Tuple[Tensor, Tensor]:
        """``rows`` and ``values``, a lookup's gradient of distinct rows whose forward ran at
        ``stamp``, without missing rows (-1, when ``may_miss``) and without the rows given to
        new keys since: when a later forward before the backward (two towers over one table,
        gradient accumulation) evicted a key this lookup read and gave its row away, the
        evicted key's gradient must not land on the new key. No host sync for the second
        unless rows were given away since the forward; then one boolean selection."""
        if may_miss:
            found = rows >= 0
            rows, values = rows[found], values[found]
        if stamp == self.stamp or rows.numel() == 0:
            return rows, values
        # Not lost(stamp) (the callers drop those first): only evictions moved the stamp since.
        keep = self.row_since.index_select(0, rows) <= stamp
        return rows[keep], values[keep]

    def __call__(self, param: Tensor) -> None:
        grad, produced = param.grad, self.values
        self.values = None
        if grad is None or not grad.is_sparse or grad.is_coalesced() or produced is None:
            return
        values = grad._values()
        if (values.untyped_storage().data_ptr() == produced.untyped_storage().data_ptr()
                and values.storage_offset() == produced.storage_offset() and values.shape == produced.shape
                and values.stride() == produced.stride()):
            grad._coalesced_(True)


def _unique_tables(keys: Tensor, offsets: List[int], tables: List[int],
                   num_tables: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Distinct keys per table (``keys[offsets[s]:offsets[s + 1]]`` of table ``tables[s]``),
    table after table in order of first occurrence, ``inverse`` with ``keys ==
    unique_keys[inverse]`` and int64 ``[num_tables]`` counts; one op on every device."""
    return torch.ops.sparsekit.unique_tables(keys, offsets, tables, num_tables)


# Above this many rows torch's CPU sort beats numpy's. Tuned by benchmarks/bench_layers.py.
_NUMPY_SORT_MAX_ROWS = 50_000


def _sort_rows(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """``(sorted, order)`` of int64 ``rows``, distinct apart from repeats of -1, so any sort is
    stable; on the CPU up to ``_NUMPY_SORT_MAX_ROWS`` rows one numpy sort of
    ``row << b | position`` gives both."""
    n = rows.numel()
    if rows.device.type == "cpu" and 1 < n <= _NUMPY_SORT_MAX_ROWS:
        values = rows.detach().contiguous().numpy()
        bits = (n - 1).bit_length()
        limit = 1 << (62 - bits)
        if -limit < int(values.min()) and int(values.max()) < limit:
            packed = np.sort((values << bits) | np.arange(n, dtype=np.int64))
            return torch.from_numpy(packed >> bits), torch.from_numpy(packed & ((1 << bits) - 1))
    return torch.sort(rows)


# Bytes of rows from which a CPU shard's rows are read with sparsekit's gather, which
# prefetches rows ahead; below, index_select's lower fixed cost wins.
# Tuned by benchmarks/bench_layers.py.
_GATHER_MIN_BYTES = 256 * 1024


def _gathers(weight: Tensor, rows: Tensor) -> bool:
    """Whether ``weight[rows]`` is read with sparsekit's gather (a CPU read of more than
    ``_GATHER_MIN_BYTES``) rather than ``index_select``."""
    return weight.device.type == "cpu" and rows.numel() * weight.shape[1] * weight.element_size() > _GATHER_MIN_BYTES


class _LookupOwned(torch.autograd.Function):
    """Rows of the local shard for the keys this rank received, with a sparse weight gradient
    over ``sorted_rows`` (distinct, ascending: truly coalesced). ``grad_index`` maps the keys'
    gradients onto them: None (same rows), a permutation (a gather) or a segment sum."""

    @staticmethod
    def forward(ctx, weight: Tensor, rows: Tensor, sorted_rows: Tensor, grad_index: Tensor, distinct: bool,
                has_missing: bool, marker: _CoalescedGradMarker) -> Tensor:
        ctx.save_for_backward(sorted_rows, grad_index)
        ctx.distinct = distinct
        ctx.weight_shape = weight.shape
        ctx.has_missing = has_missing
        ctx.marker, ctx.stamp = marker, marker.stamp
        if _gathers(weight, rows):
            return ops.embedding_gather(weight, rows)  # -1 reads as zeros
        if not has_missing:
            return weight.index_select(0, rows)
        found = rows >= 0
        vectors = weight.index_select(0, torch.where(found, rows, 0))
        return vectors.masked_fill_(~found.unsqueeze(1), 0)

    @staticmethod
    @compile_disabled  # autograd calls it from compiled code too; dynamo cannot build sparse tensors
    def backward(ctx, grad: Tensor):
        sorted_rows, grad_index = ctx.saved_tensors
        if ctx.marker.lost(ctx.stamp):
            return None, None, None, None, None, None, None
        if grad_index is None:  # the rows were sorted already
            values = grad.contiguous()
        elif ctx.distinct:
            values = grad.index_select(0, grad_index)
        else:
            values = ops.segment_sum(grad.contiguous(), grad_index, sorted_rows.numel())
        sorted_rows, values = ctx.marker.own_rows(sorted_rows, values, ctx.stamp, ctx.has_missing)
        weight_grad = torch.sparse_coo_tensor(sorted_rows.unsqueeze(0), values, ctx.weight_shape,
                                              is_coalesced=True, check_invariants=False)
        ctx.marker.produced(values)
        return weight_grad, None, None, None, None, None, None


class _GatherRows(torch.autograd.Function):
    """``rows[index]``, with the gradient summed back by :func:`sparsekit.ops.segment_sum`
    (``index_select``'s own backward is a single-threaded ``index_add_`` on the CPU)."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return ops.segment_sum(grad.contiguous(), index, ctx.num_rows), None


class _GatherPieces(torch.autograd.Function):
    """``rows[index]`` cut into consecutive pieces of ``sizes`` rows, one output per piece; the
    backward is one segment sum over the pieces' gradients where they lie."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, sizes: List[int]) -> Tuple[Tensor, ...]:
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return tuple(rows.index_select(0, index).split(sizes))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (index,) = ctx.saved_tensors
        return _segment_sum_pieces(grads, index, ctx.num_rows), None, None


def _segment_sum_pieces(pieces: Sequence[Tensor], index: Tensor, num_rows: int) -> Tensor:
    """:func:`sparsekit.ops.segment_sum` of the rows of ``pieces`` taken one after the
    other: read where they lie on the CPU (``segment_sum_parts``), concatenated elsewhere."""
    if index.device.type == "cpu":
        return torch.ops.sparsekit.segment_sum_parts(list(pieces), index, num_rows)
    return ops.segment_sum(torch.cat(list(pieces)), index, num_rows)


def _table_gradients(ctx, values_all: Tensor, sorted_rows: Tensor, first_weight: int) -> List[Optional[Tensor]]:
    """Each table's coalesced sparse gradient from ``values_all``, the gradient of every
    table's distinct rows in ``sorted_rows``' order (``ctx``: ``sizes``, ``markers``,
    ``stamps``, ``may_miss``, ``weight_meta``; the weights are inputs ``first_weight`` on)."""
    # One split each (the tables' parts lie one after the other), not two slices a table.
    parts = [part if ctx.needs_input_grad[first_weight + j] else None
             for j, part in enumerate(zip(sorted_rows.split(ctx.sizes), values_all.split(ctx.sizes)))]
    return _sparse_gradients(parts, ctx.markers, ctx.stamps, ctx.may_miss, ctx.weight_meta)


def _sparse_gradients(parts: Sequence[Optional[Tuple[Tensor, Tensor]]], markers: Sequence[_CoalescedGradMarker],
                      stamps: Sequence[int], may_miss: Sequence[bool],
                      weight_meta: Sequence[Tuple[torch.Size, torch.dtype]]) -> List[Optional[Tensor]]:
    """Per table its coalesced sparse gradient from ``parts[j]``, (distinct rows ascending,
    their summed gradient rows), or None (no gradient: None, or the table lost the lookup
    since, see :class:`_CoalescedGradMarker`); ``weight_meta``: each weight's shape and dtype."""
    grads: List[Optional[Tensor]] = []
    for part, marker, stamp, miss, (shape, dtype) in zip(parts, markers, stamps, may_miss, weight_meta):
        if part is None or marker.lost(stamp):
            grads.append(None)
            continue
        rows, values = marker.own_rows(part[0], part[1], stamp, miss)
        if values.dtype != dtype:
            values = values.to(dtype)
        if rows.numel() == 0:
            # Empty splits of one buffer share its storage: tables whose gradients are empty
            # would share one (autograd accumulates a later gradient into an empty one in
            # place, and every such table then held the last one's rows). Their own, empty.
            rows, values = rows.new_empty(0), values.new_empty(values.shape)
        grads.append(torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, is_coalesced=True,
                                             check_invariants=False))
        marker.produced(values)
    return grads


def _read_rows(weight: Tensor, rows: Tensor, miss: bool, out: Optional[Tensor] = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """``weight[rows]`` in ``dtype`` (float32, or float64 where a float64 weight is read),
    rows of -1 (``miss``) read as zeros; into ``out`` if given. Large CPU reads go through
    sparsekit's prefetching gather (see ``_GATHER_MIN_BYTES``)."""
    if out is None and _gathers(weight, rows):
        return ops.embedding_gather(weight, rows).to(dtype)  # -1 reads as zeros
    found = rows >= 0 if miss else None
    index = torch.where(found, rows, 0) if miss else rows
    if out is None:
        out = weight.index_select(0, index).to(dtype)
    elif weight.dtype == torch.float32:
        torch.index_select(weight, 0, index, out=out)
    else:
        out.copy_(weight.index_select(0, index))
    return out.masked_fill_(~found.unsqueeze(1), 0) if miss else out


class _LookupPieces(torch.autograd.Function):
    """One process, one key per bag: each feature's vectors read straight from its table's
    weight; the backward sums the features' gradients straight into every table's distinct
    rows in sorted order (``sorted_position``), a coalesced sparse gradient per table."""

    @staticmethod
    def forward(ctx, value_rows: List[Tensor], tables: List[int], sorted_position: Tensor, sorted_rows: Tensor,
                sizes: List[int], markers: List[_CoalescedGradMarker], may_miss: List[bool],
                *weights: Tensor) -> Tuple[Tensor, ...]:
        ctx.save_for_backward(sorted_position, sorted_rows)
        ctx.sizes, ctx.markers, ctx.may_miss = sizes, markers, may_miss
        ctx.stamps = [marker.stamp for marker in markers]
        ctx.weight_meta = [(w.shape, w.dtype) for w in weights]
        dtype = torch.float64 if any(w.dtype == torch.float64 for w in weights) else torch.float32
        return tuple(_read_rows(weights[t], rows, may_miss[t], dtype=dtype) for rows, t in zip(value_rows, tables))

    @staticmethod
    @compile_disabled  # as _LookupOwned.backward
    def backward(ctx, *grads: Tensor):
        sorted_position, sorted_rows = ctx.saved_tensors
        values_all = _segment_sum_pieces(grads, sorted_position, sorted_rows.numel())
        return (None,) * 7 + tuple(_table_gradients(ctx, values_all, sorted_rows, 7))


class _PoolRows(torch.autograd.Function):
    """Bag sums ``out[b] = sum(rows[index[j]] for j in offsets[b]:offsets[b+1])``: the forward
    is one fused gather and sum (``embedding_bag``'s kernel), the gradient one gather and one
    segment sum."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, bag: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(index, bag)
        ctx.num_rows = rows.shape[0]
        return torch.ops.sparsekit.embedding_bag(rows, index, offsets, None, "sum", None, True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, bag = ctx.saved_tensors
        return ops.segment_sum(grad.contiguous().index_select(0, bag), index, ctx.num_rows), None, None, None


def _pool(rows: Tensor, index: Tensor, offsets: Tensor, one_per_bag: bool) -> Tensor:
    """Bag sums of ``rows[index]`` over CSR ``offsets``; ``one_per_bag``: every bag holds
    exactly one position (offsets ``0, 1, ..., n``; DLRM's one key per slot), so pooling is
    a gather and its gradient a single segment sum."""
    if one_per_bag:
        return _GatherRows.apply(rows, index)
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bag = ops._repeat_interleave(torch.arange(num_bags, device=offsets.device), lengths, index.numel())
    return _PoolRows.apply(rows, index, bag, offsets)


# 0, 1, 2, ... (read-only, grown on demand up to _COUNTING_KEPT entries, 8 MiB): what
# one-key-per-bag CSR offsets equal.
_COUNTING = np.arange(0, dtype=np.int64)
_COUNTING_KEPT = 1 << 20


def _is_counting(host: np.ndarray) -> bool:
    """Whether the host array ``host`` is ``0, 1, ..., len - 1``: one compare with a kept
    ``arange``, cheaper than diffs, masks and reductions for the offsets of one key per bag
    (DLRM's slots), checked twice a forward."""
    global _COUNTING
    if host.size > _COUNTING_KEPT:  # a batch past what is kept: an arange of its own, dropped after
        return bool(np.array_equal(host, np.arange(host.size, dtype=np.int64)))
    counting = _COUNTING
    if counting.size < host.size:
        counting = np.arange(min(max(host.size, 2 * counting.size), _COUNTING_KEPT), dtype=np.int64)
        counting.flags.writeable = False
        _COUNTING = counting  # one assignment: a thread reading the old one still reads an arange
    return bool(np.array_equal(host, counting[:host.size]))


def _one_per_bag(offsets: Tensor, nnz: int) -> bool:
    """Whether valid CSR ``offsets`` give every bag exactly one position. Decided without a
    device read: on CUDA only the shapes are looked at (False unless there are no bags)."""
    num_bags = offsets.numel() - 1
    if nnz != num_bags:
        return False
    if num_bags == 0 or not _device.host_readable(offsets):
        return num_bags == 0
    # Host values: numpy's compare costs a fraction of torch's arange + equal.
    return _is_counting(offsets.detach().numpy())


def _all_gather_bytes(data: bytes, device: torch.device, group, world_size: int, sizes: List[int]) -> List[bytes]:
    """Every rank's ``data``, whose lengths ``sizes`` gives (one all-gather of tensors padded
    to the longest)."""
    longest = max(sizes)
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t.cpu()[:size].tolist()) for t, size in zip(gathered, sizes)]


def _all_gather_bytes_sizes(size: int, device: torch.device, group, world_size: int) -> List[int]:
    """Every rank's ``size`` (one all-gather)."""
    sizes = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([size], dtype=torch.int64, device=device), group=group)
    return [int(t.item()) for t in sizes]


def _all_gather_digests(data: bytes, device: torch.device, group, world_size: int) -> List[bytes]:
    """Every rank's 16-byte digest of its ``data`` (one all-gather of a fixed size, so ranks
    with data of different lengths still meet in it)."""
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return _all_gather_bytes(digest, device, group, world_size, [len(digest)] * world_size)


def _owners(keys: Tensor, world_size: int, offset: Union[int, Tensor] = 0) -> Tensor:
    """uint64(key + offset) % world_size for int64 keys (the add wraps; ``offset`` an int or
    one per key), without unsigned tensors."""
    keys = keys.long() + offset
    # 2^64 = q * world_size + r: uint64(k) % w == (k + (k < 0) * r) mod w, all in int64 range.
    wrap = (2**64) % world_size
    return torch.remainder(torch.remainder(keys, world_size) + (keys < 0).long() * wrap, world_size)


def _wire_device(weight: Tensor, group) -> torch.device:
    """Where a layer's collectives run: its weight's device, or for tables on the meta
    device (refused, but every rank must hear of it) the group backend's device."""
    if weight.device.type != "meta":
        return weight.device
    # The peers' weights are where the group sends: CUDA where the backend serves CUDA
    # tensors (NCCL, or a default group "cpu:gloo,cuda:nccl") and the process has a GPU.
    group = group if group is not None else dist.group.WORLD
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend_config(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_on_config(config: Dict[str, object], device: torch.device, group, world_size: int, name: str,
                     what: str = "layer") -> None:
    """Whether every rank built ``config`` alike; a difference raises the same error on every
    rank, naming the setting and each rank's value, before any key moves. One all-gather of a
    digest; the settings themselves only when they differ."""
    pairs = [[str(key), str(value)] for key, value in config.items()]
    text = json.dumps(pairs).encode()
    if len(set(_all_gather_digests(text, device, group, world_size))) == 1:
        return
    sizes = _all_gather_bytes_sizes(len(text), device, group, world_size)
    per_rank = [dict(json.loads(t.decode())) for t in _all_gather_bytes(text, device, group, world_size, sizes)]
    keys = list(dict.fromkeys(key for settings in per_rank for key in settings))
    for key in keys:
        values = [settings.get(key) for settings in per_rank]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {rank}: {'(none)' if value is None else value[:200]}"
                              for rank, value in enumerate(values))
            raise ValueError(f"{name}: {key} differs between the ranks of the process group ({shown}); build "
                             f"the {what} with the same {key} on every rank")
    raise AssertionError("configurations of different text but equal settings")


def _mean_of_sum(pooled: Tensor, lengths: Tensor) -> Tensor:
    """The "mean" combiner: each bag's sum ``pooled`` ``[bags, D]`` divided by its number of
    keys ``lengths`` ``[bags]`` (missing keys count; an empty bag stays zeros)."""
    return pooled / lengths.clamp(min=1).to(pooled.dtype).unsqueeze(1)


def _offsets_error_flags(offsets: Tensor, nnz: int) -> Tensor:
    """``_BAD_OFFSETS`` (an int64 scalar on the offsets' device) unless the CSR ``offsets``
    start at 0, never decrease and end at ``nnz``; else 0. No host read on a GPU."""
    if _device.host_readable(offsets):  # numpy's checks cost a fraction of torch's small ops
        host = offsets.detach().numpy()
        # One key per bag, 0, 1, ..., nnz, is valid: one compare instead of three passes.
        bad = not (host.size == nnz + 1 and _is_counting(host)) and (
            host[0] != 0 or host[-1] != nnz or bool((host[1:] < host[:-1]).any()))
        return torch.tensor(_BAD_OFFSETS if bad else 0, dtype=torch.int64)
    bad = (offsets[0] != 0) | (offsets[-1] != nnz)
    if offsets.numel() > 1:
        bad = bad | (offsets[1:] < offsets[:-1]).any()
    return bad.long() * _BAD_OFFSETS

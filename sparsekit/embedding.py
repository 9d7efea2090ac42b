"""Model-parallel embedding layers: ``DistributedEmbedding`` and ``All2AllDenseEmbedding``.

Key ``k`` lives on rank ``uint64(k) % world_size`` of the layer's process group; each rank
holds a shard ``weight[max_vocabulary_size_per_gpu, embedding_vec_size]`` (and, with
``use_hashtable=True``, a :class:`~sparsekit.HashTable` from its keys to rows). Without a
process group the layer is one shard: a drop-in for ``nn.EmbeddingBag`` /
``nn.Embedding`` with ``sparse=True``, whose eager forward is the collection's engine over
that one table (:func:`sparsekit.engine.read_one_table`). Under a process group a step
dedups the keys, sends them to their owners (a bad input on any rank stops every rank
before a key moves), looks them up, sends the vectors back and pools them; the backward
mirrors it. Either way every rank's ``weight`` gets a coalesced sparse gradient on every
step. The stages and their host syncs: ``docs/architecture.md``.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import engine, ops, traced
from ._checks import bool_argument, compile_disabled, size_argument
from .exchange import _GatherRows, _mean_of_sum, _one_per_bag, _pool, _stepping
from .shard_checks import _check_writable
from .step_errors import StepErrors
from .shard import (  # noqa: F401  (KeySeededUniform and is_embedding_variable are public here too)
    Initializer,
    KeySeededUniform,
    _check_own_weights,
    _ModelParallelEmbedding,
    is_embedding_variable,
)

__all__ = [
    "Ragged",
    "KeySeededUniform",
    "DistributedEmbedding",
    "All2AllDenseEmbedding",
    "split_embedding_variable_from_others",
    "is_embedding_variable",
    "keep_out_of_ddp",
]


class Ragged(NamedTuple):
    """A ragged batch of keys in CSR form.

    Attributes:
        values: int64 or int32 ``[nnz]``, the keys of every bag one after the other.
        offsets: int64 or int32 ``[num_bags + 1]``; bag ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``, ``offsets[0] == 0`` and
            ``offsets[-1] == nnz``.
    """

    values: Tensor
    offsets: Tensor


def keep_out_of_ddp(model: nn.Module) -> List[str]:
    """Tells ``DistributedDataParallel`` to leave ``model``'s embedding shards alone: call it
    on the model before wrapping it (``DDP(model)``). The shards differ per rank and get
    sparse gradients, which DDP would all-reduce (and fail on). Returns the names ignored."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415 - only its helper

    ignored = [name for name, param in model.named_parameters() if is_embedding_variable(param)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return ignored


def split_embedding_variable_from_others(
    params: Iterable[Union[Tensor, Tuple[str, Tensor]]]
) -> Tuple[tuple, tuple]:
    """Splits parameters into model-parallel embedding shards and everything else.

    Embedding shards differ per rank and get sparse gradients; data-parallel machinery
    (DDP's gradient all-reduce and initial broadcast) must leave them alone. The usual
    recipe: let DDP ignore them by name, then wrap the whole model::

        from torch.nn.parallel import DistributedDataParallel as DDP

        ignored = [name for name, p in model.named_parameters() if sk.is_embedding_variable(p)]
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
        ddp_model = DDP(model)             # averages the dense gradients only
        optimizer = sk.LazyAdam(model.parameters())

    (Wrapping only the dense submodules in DDP works as well.) Scale: the exchange sums a
    key's gradient over every rank that looked it up, while DDP averages the dense
    gradients. To train exactly like one process on the global batch, take the local loss
    as a sum over the local samples divided by the global batch size, and let DDP sum::

        def sum_hook(group, bucket):
            work = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        ddp_model.register_comm_hook(None, sum_hook)

    With two optimizers::

        embedding_params, dense_params = sk.split_embedding_variable_from_others(model.parameters())

    Args:
        params: parameters, or ``(name, parameter)`` pairs as ``named_parameters()`` yields.

    Returns:
        ``(embedding_params, other_params)``: two tuples of the given items, in order.
    """
    embedding, other = [], []
    for item in params:
        tensor = item[1] if isinstance(item, tuple) else item
        (embedding if is_embedding_variable(tensor) else other).append(item)
    return tuple(embedding), tuple(other)


# ---- the layers -------------------------------------------------------------------------------


# Keys per bag below which a training step (grad enabled) of a CPU hash table without
# eviction or admission keeps the layer's own lookup, which deduplicates the keys first:
# with bags of one or two skewed keys the engine's grouping of every lookup in the backward
# costs more (bench_layers' default cell). A dense input counts its padded width.
_ENGINE_MIN_KEYS_PER_BAG = 3


def _reads_by_engine(layer: _ModelParallelEmbedding, keys: int, bags: int) -> bool:
    """Whether a layer's eager forward of ``keys`` values in ``bags`` bags is the collection
    engine's over its one table: one process, not a hash table of int32 keys (the engine's
    lookup takes int64 keys), and not short bags of a CPU hash table in training."""
    if layer.world_size != 1 or (layer.hash_table is not None and layer.key_dtype != torch.int64):
        return False
    return not (layer._rows_first() and torch.is_grad_enabled() and keys < _ENGINE_MIN_KEYS_PER_BAG * bags)


def _engine_read(layer: _ModelParallelEmbedding, prepare) -> Tensor:
    """A one-process layer's eager forward as a one-table collection's (engine.read_one_table):
    ``prepare()`` gives ``(keys, user offsets to check or None, int64 offsets)``; the bags'
    pooled vectors ``[bags, dim]`` in the table's dtype. Bad input raises before anything
    changes, with the layer's own errors."""
    if torch.jit.is_tracing():
        traced.refuse_torchscript(layer._layer_name)
    state = layer.__dict__
    if "_engine_errors" not in state:  # its error word, and the read layouts it has used
        state["_engine_errors"], state["_engine_layouts"] = StepErrors("raise"), {}
    with _stepping(layer, layer.training):
        _check_writable([layer], layer._layer_name, layer.training)
        keys, user_offsets, offsets = prepare()

        def key_error(table: int, key: int) -> ValueError:  # `key`: the input's first bad one
            return layer._bad_key_error(torch.unique(keys), key)

        return engine.ticking([layer], layer.training, lambda: engine.read_one_table(
            layer, keys, offsets, user_offsets is not None, state["_engine_errors"], key_error,
            lambda flags: layer._raise_for_flags(flags, None, offsets), state["_engine_layouts"]))


def _size_of(inputs: Any) -> Tuple[int, int]:
    """(values, bags) of a DistributedEmbedding input as given (unchecked: only to choose the
    path); a dense padded input counts its width as every bag's length."""
    def plain(t: Any) -> bool:  # a nested tensor has no sizes: the checks name it later
        return isinstance(t, Tensor) and not t.is_nested

    if isinstance(inputs, tuple) and len(inputs) == 2 and all(plain(t) for t in inputs):
        return inputs[0].numel(), max(inputs[1].numel() - 1, 0)
    if plain(inputs) and inputs.dim() == 3:
        return inputs.numel(), inputs.shape[0] * inputs.shape[1]
    return 0, 0


class DistributedEmbedding(_ModelParallelEmbedding):
    """Model-parallel pooled embedding (SOK's ``DistributedEmbedding``): ``[B, slot_num, D]``.

    Each of the ``slot_num`` feature fields of a sample is a bag of keys, pooled by
    ``combiner``. Keys are sharded over the ranks of ``process_group`` by
    ``uint64(key) % world_size``; without torch.distributed the layer is one shard.

    Args:
        combiner: ``"sum"`` or ``"mean"`` (an empty bag gives zeros; in ``eval()`` a key
            missing from the table counts as a zero vector).
        max_vocabulary_size_per_gpu: rows of this rank's shard (the hash table's capacity).
        embedding_vec_size: ``D``.
        slot_num: feature fields per sample.
        max_nnz: most keys in one bag; the padded dense input is ``[B, slot_num, <= max_nnz]``.
        max_feature_num: most keys in one sample (SOK's memory hint; checked to be positive,
            otherwise unused).
        use_hashtable: True: any int64 key, mapped to rows by a per-rank hash table filled
            in training. False: keys must lie in ``[0, max_vocabulary_size_per_gpu *
            world_size)``, local row ``key // world_size``; other keys raise.
        key_dtype: ``torch.int64`` or ``torch.int32``.
        embedding_initializer: ``(keys int64 [n], dim) -> [n, dim]`` tensor giving the first
            vector of new keys; None: :class:`KeySeededUniform` with seed 0.
        process_group: the group to shard over; None: the default group when
            torch.distributed is initialised, else no group.
        device: where the shard lives (NCCL needs this rank's GPU).
        eviction: None (a full table raises :class:`HashTableFullError`), ``"lru"`` or
            ``"lfu"``: each rank's table evicts its least recently / least frequently used
            keys to make room (see :class:`HashTable`); a reused row starts with the new
            key's initial vector and, with :class:`sparsekit.LazyAdam`, zero moments. A key's
            LFU count grows by one per training step in which any rank looks it up. Needs
            ``use_hashtable=True``.
        admit_after: a key gets a row from the ``admit_after``-th training step in which it
            is seen (default 1: at once); until then it reads as a zero vector and gets no
            update. ``eval()`` never counts.
        admission_capacity: pending keys counted exactly per rank (default
            ``max_vocabulary_size_per_gpu``); beyond it the least recently seen pending keys
            are forgotten. Memory: 7-11 int64 per pending key (2-4 slots of a key and a row,
            then key, last seen, count).

    Forward:
        ``inputs``: a :class:`Ragged` (or ``(values, offsets)`` tuple) with
        ``len(offsets) == B * slot_num + 1``, bags in row-major ``[sample][slot]`` order; or
        a dense ``[B, slot_num, n <= max_nnz]`` key tensor padded with ``pad_key`` (default
        -1, which is then not a key). Returns ``[B, slot_num, embedding_vec_size]``.

    Every rank of the group must call forward (and backward) the same number of times.
    """

    _layer_name = "DistributedEmbedding"

    def __init__(
        self,
        combiner: str,
        max_vocabulary_size_per_gpu: int,
        embedding_vec_size: int,
        slot_num: int,
        max_nnz: int,
        max_feature_num: Optional[int] = None,
        use_hashtable: bool = True,
        key_dtype: torch.dtype = torch.int64,
        embedding_initializer: Optional[Initializer] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
        eviction: Optional[str] = None,
        admit_after: int = 1,
        admission_capacity: Optional[int] = None,
    ) -> None:
        if combiner not in ("sum", "mean"):
            raise ValueError(f"DistributedEmbedding: combiner must be 'sum' or 'mean', got {combiner!r}")
        slot_num = size_argument("DistributedEmbedding", "slot_num", slot_num)
        max_nnz = size_argument("DistributedEmbedding", "max_nnz", max_nnz)
        max_feature_num = size_argument("DistributedEmbedding", "max_feature_num", max_feature_num, optional=True)
        super().__init__(max_vocabulary_size_per_gpu, embedding_vec_size, use_hashtable, key_dtype,
                         embedding_initializer, process_group, device, eviction, admit_after, admission_capacity)
        self.combiner = combiner
        self.slot_num = slot_num
        self.max_nnz = max_nnz
        self.max_feature_num = max_feature_num if max_feature_num is not None else slot_num * max_nnz


    def _config(self) -> Dict[str, object]:
        return {**super()._config(), "combiner": self.combiner, "slot_num": self.slot_num}

    def _repr_settings(self) -> str:
        return f"combiner={self.combiner!r}, slot_num={self.slot_num}, max_nnz={self.max_nnz}, "

    def forward(self, inputs: Union[Ragged, Tuple[Tensor, Tensor], Tensor], pad_key: int = -1) -> Tensor:
        # torch.compile: one process traces the lookup (sparsekit.traced); with many ranks it
        # runs eagerly, one graph break per layer (see README, torch.compile).
        leaf = traced.fx_leaf_call(self, inputs, pad_key)
        if leaf is not None:
            return leaf
        if self.world_size == 1 and torch.compiler.is_compiling():
            return self._traced_forward(inputs, pad_key)
        return self._eager_forward(inputs, pad_key)

    def _traced_forward(self, inputs, pad_key: int) -> Tensor:
        _check_own_weights([self], self._layer_name, self.training)  # the row op cannot see a substitute
        if isinstance(inputs, tuple):
            keys, user_offsets, (batch, offsets) = self._flatten(inputs, pad_key)
            rows = traced.layer_rows(keys, user_offsets, id(self), None)
            lengths = offsets[1:] - offsets[:-1]
        else:
            keys = self._check_padded(inputs, pad_key)
            batch, width = keys.shape[0], keys.shape[2]
            lengths = (keys != int(pad_key)).sum(dim=2).view(-1)
            keys = keys.reshape(-1)
            offsets = torch.arange(0, keys.numel() + 1, max(width, 1), device=keys.device) if width > 0 else \
                torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=keys.device)
            rows = traced.layer_rows(keys, None, id(self), int(pad_key))
        if self.combiner == "mean" and self.weight.dtype in (torch.float16, torch.bfloat16):
            # float32 sums of the half rows, divided before the one rounding, as eager (a
            # sum rounded to the half type first rounds twice, and two float16 rows of
            # 60000 would make a mean of inf).
            pooled = _mean_of_sum(ops._pooled_float(self.weight, rows, offsets), lengths).to(self.weight.dtype)
        else:
            pooled = ops.embedding_bag(self.weight, rows, offsets, None, "sum")
            if self.combiner == "mean":
                pooled = _mean_of_sum(pooled, lengths)
        return pooled.view(batch, self.slot_num, self.embedding_vec_size)

    def _combiner(self) -> str:
        return self.combiner

    @compile_disabled
    def _eager_forward(self, inputs: Union[Ragged, Tuple[Tensor, Tensor], Tensor], pad_key: int) -> Tensor:
        if _reads_by_engine(self, *_size_of(inputs)):
            batch = []

            def prepare():
                keys, user_offsets, (size, offsets) = self._flatten(inputs, pad_key)
                batch.append(size)
                return keys, user_offsets, offsets

            pooled = _engine_read(self, prepare)
            return pooled.view(batch[0], self.slot_num, self.embedding_vec_size)
        keys, (batch, offsets), vectors, index = self._embed(lambda: self._flatten(inputs, pad_key),
                                                             lambda keys, info: _one_per_bag(info[1], keys.numel()))
        # The offsets were checked on every rank by now, so the lengths are >= 0. No index:
        # one key per bag, each bag's vector its key's.
        if index is not None and self.combiner == "mean" and vectors.dtype in (torch.float16, torch.bfloat16):
            # A half table's bags are summed and divided in float32 and rounded once, as the
            # collection's and embedding_bag's means are: a sum rounded to the half type
            # first rounded twice, and two float16 rows of 60000 made a mean of inf.
            vectors = vectors.float()
        pooled = vectors if index is None else _pool(vectors, index, offsets, _one_per_bag(offsets, keys.numel()))
        if self.combiner == "mean":
            lengths = offsets[1:] - offsets[:-1]
            pooled = _mean_of_sum(pooled, lengths)
        # One process reads a half table's rows in float32 (and an empty batch pools into
        # float32 zeros): the output has the table's dtype on every path.
        return pooled.to(self.weight.dtype).view(batch, self.slot_num, self.embedding_vec_size)

    def _check_padded(self, inputs: Tensor, pad_key: int) -> Tensor:
        """Padded dense keys ``[B, slot_num, n <= max_nnz]`` checked (with ``pad_key``), as key_dtype."""
        name = self._layer_name
        keys = self._check_keys_tensor(inputs, "inputs")
        if keys.dim() != 3 or keys.shape[1] != self.slot_num or keys.shape[2] > self.max_nnz:
            raise ValueError(f"{name}: dense inputs must be [B, slot_num={self.slot_num}, n <= max_nnz="
                             f"{self.max_nnz}] padded with pad_key, got shape {tuple(keys.shape)}; "
                             "or pass sk.Ragged(values, offsets)")
        if isinstance(pad_key, bool) or not isinstance(pad_key, numbers.Integral):
            raise TypeError(f"{name}: pad_key must be an int, got {pad_key!r}")
        info = torch.iinfo(keys.dtype)
        if not info.min <= int(pad_key) <= info.max:
            raise ValueError(f"{name}: pad_key must be in the {keys.dtype} range of the keys "
                             f"[{info.min}, {info.max}], got {pad_key}")
        return keys

    def _flatten(self, inputs, pad_key: int) -> Tuple[Tensor, Optional[Tensor], Tuple[int, Tensor]]:
        """(keys [nnz], the user's offsets to check or None, (B, int64 offsets [B * slot_num + 1]))."""
        name = self._layer_name
        if isinstance(inputs, tuple):
            if len(inputs) != 2:
                raise TypeError(f"{name}: a tuple input must be (values, offsets), got {len(inputs)} items")
            if not (isinstance(pad_key, numbers.Integral) and not isinstance(pad_key, bool) and pad_key == -1):
                # Padding is a dense input's: in a ragged one every value is a key, -1 too.
                raise ValueError(f"{name}: pad_key applies to a dense [B, slot_num, max_nnz] input; a ragged "
                                 f"input (sk.Ragged or (values, offsets)) has no padding, so pad_key={pad_key!r} "
                                 "would be ignored: leave the padded keys out of its values, or drop pad_key")
            values = self._check_keys_tensor(inputs[0], "values")
            offsets = inputs[1]
            if not isinstance(offsets, Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
                    or offsets.dim() != 1 or offsets.layout != torch.strided:
                raise TypeError(f"{name}: offsets must be a dense 1-D int64 or int32 tensor")
            if offsets.device != values.device:
                raise RuntimeError(f"{name}: offsets are on {offsets.device} but values on {values.device}")
            if values.dim() != 1:
                raise ValueError(f"{name}: values must be 1-D [nnz], got shape {tuple(values.shape)}")
            num_bags = offsets.numel() - 1
            if num_bags < 0 or num_bags % self.slot_num != 0:
                raise ValueError(f"{name}: len(offsets) must be B * slot_num + 1 with slot_num={self.slot_num}, "
                                 f"got {offsets.numel()}")
            offsets = offsets.long()
            return values, offsets, (num_bags // self.slot_num, offsets)
        keys = self._check_padded(inputs, pad_key)
        batch = keys.shape[0]
        valid = keys != int(pad_key)
        lengths = valid.sum(dim=2).view(-1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return keys[valid], None, (batch, offsets)


class All2AllDenseEmbedding(_ModelParallelEmbedding):
    """Model-parallel unpooled embedding (SOK's ``All2AllDenseEmbedding``).

    Input ``[B, slot_num, nnz_per_slot]`` keys -> ``[B, slot_num, nnz_per_slot, D]``; with
    ``dynamic_input=True`` any 1-D ``[N]`` keys (e.g. from :func:`sparsekit.ops.unique`)
    -> ``[N, D]``. Sharding, tables, initializer and the exchange are those of
    :class:`DistributedEmbedding` (see there for the arguments).

    Every rank of the group must call forward (and backward) the same number of times.
    """

    _layer_name = "All2AllDenseEmbedding"

    def __init__(
        self,
        max_vocabulary_size_per_gpu: int,
        embedding_vec_size: int,
        slot_num: int,
        nnz_per_slot: int,
        dynamic_input: bool = False,
        use_hashtable: bool = True,
        key_dtype: torch.dtype = torch.int64,
        embedding_initializer: Optional[Initializer] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
        eviction: Optional[str] = None,
        admit_after: int = 1,
        admission_capacity: Optional[int] = None,
    ) -> None:
        slot_num = size_argument("All2AllDenseEmbedding", "slot_num", slot_num)
        nnz_per_slot = size_argument("All2AllDenseEmbedding", "nnz_per_slot", nnz_per_slot)
        dynamic_input = bool_argument("All2AllDenseEmbedding", "dynamic_input", dynamic_input)
        super().__init__(max_vocabulary_size_per_gpu, embedding_vec_size, use_hashtable, key_dtype,
                         embedding_initializer, process_group, device, eviction, admit_after, admission_capacity)
        self.slot_num = slot_num
        self.nnz_per_slot = nnz_per_slot
        self.dynamic_input = dynamic_input


    def _config(self) -> Dict[str, object]:
        return {**super()._config(), "slot_num": self.slot_num, "nnz_per_slot": self.nnz_per_slot,
                "dynamic_input": self.dynamic_input}

    def _repr_settings(self) -> str:
        return f"slot_num={self.slot_num}, nnz_per_slot={self.nnz_per_slot}, dynamic_input={self.dynamic_input}, "

    def forward(self, inputs: Tensor) -> Tensor:
        leaf = traced.fx_leaf_call(self, inputs)
        if leaf is not None:
            return leaf
        if self.world_size == 1 and torch.compiler.is_compiling():  # as DistributedEmbedding.forward
            _check_own_weights([self], self._layer_name, self.training)
            keys, _, out_shape = self._flatten(inputs)
            return ops.embedding_gather(self.weight, traced.layer_rows(keys, None, id(self), None)).view(out_shape)
        return self._eager_forward(inputs)

    @compile_disabled  # one graph break, as DistributedEmbedding.forward
    def _eager_forward(self, inputs: Tensor) -> Tensor:
        size = inputs.numel() if isinstance(inputs, Tensor) and not inputs.is_nested else 0
        if _reads_by_engine(self, size, size):  # each key a bag of its own
            shape = []

            def prepare():
                keys, _, out_shape = self._flatten(inputs)
                shape.append(out_shape)
                # Each key a bag of its own: its pooled vector is its row.
                return keys, None, torch.arange(keys.numel() + 1, device=keys.device)

            return _engine_read(self, prepare).view(shape[0])
        _, out_shape, vectors, index = self._embed(lambda: self._flatten(inputs), lambda keys, info: True)
        vectors = vectors if index is None else _GatherRows.apply(vectors, index)
        return vectors.to(self.weight.dtype).view(out_shape)  # as DistributedEmbedding's

    def _flatten(self, inputs: Tensor) -> Tuple[Tensor, None, Tuple[int, ...]]:
        """(keys [n], no offsets, the output shape)."""
        keys = self._check_keys_tensor(inputs, "inputs")
        if self.dynamic_input and keys.dim() != 1:
            raise ValueError(f"All2AllDenseEmbedding: inputs must be [N] (dynamic_input=True), "
                             f"got shape {tuple(keys.shape)}")
        if not self.dynamic_input and (keys.dim() != 3 or tuple(keys.shape[1:]) != (self.slot_num,
                                                                                      self.nnz_per_slot)):
            raise ValueError(f"All2AllDenseEmbedding: inputs must be [B, slot_num={self.slot_num}, "
                             f"nnz_per_slot={self.nnz_per_slot}] (dynamic_input=False), got shape "
                             f"{tuple(keys.shape)}")
        return keys.reshape(-1), None, tuple(keys.shape) + (self.embedding_vec_size,)

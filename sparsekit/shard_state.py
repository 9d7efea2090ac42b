"""A shard's contents read out and loaded back, as a mixin of the shard
(:class:`sparsekit.shard._ModelParallelEmbedding`): ``stats`` and ``export``, the extra state
(hash table, pending admissions, totals, rows whose moments are to be reset) and a
``load_state_dict`` that checks everything before it changes anything.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checks import integer_argument, tensor_integer
from .exchange import _owners, _stepping
from .hashtable import _MAX_CLOCK as _MAX_COUNT
from .hashtable import _check_pending_of, _check_state_of


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


class _ShardState:
    """The shard's stats, export and state dict (see the module); uses the shard's weight,
    tables, totals and step lock."""

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
            keys, vectors = self.owned_keys(), self.weight.detach()
            # A TorchRec table's last rows may hold ids past its num_embeddings: no keys.
            count = int((keys < self.num_keys_capacity).sum())
            return keys[:count].to(self.key_dtype), vectors[:count].clone()
        keys, rows = self.hash_table.export(min_last_seen)
        return keys, self.weight.detach().index_select(0, rows)

    # -- state dict: the extra state and all-or-nothing loads ---------------------------------

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

"""Loading a checkpoint: every rank gathers the rows it owns now, then all write together.

A load runs in two phases. First every rank reads every shard, keeps the keys it owns
under the current world size (``uint64(k) % M``), rebuilds what its hash tables and
pending admissions will hold, and checks it all (:mod:`sparsekit.checkpoint.reading`);
the ranks agree that every part checks out. Only then does any rank write: optimizer
state, dense parameters, then each embedding layer's rows. A fault in that second phase
on one rank makes every rank raise, so all can load again together.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..exchange import _owners
from ..hashtable import HashTableFullError, _check_pending_of, _check_state_of
from ..optim import _kept_step
from ..shard import _ModelParallelEmbedding
from .collective import OtherRankError, agree_or_raise, all_ok, check_optimizer_everywhere, ranks_differing, world
from .layout import LATEST, CheckpointDirectory, check_not_a_file, check_step
from .model_state import (check_directory_argument, compile_names_dropped, dense_state_of, initial_row_state,
                          initial_rows, layer_prefixes, model_and_layers, plain_name, wrapper_paths)
from .reading import (check_dense, check_direct_keys, check_key_range, check_moved_groups, check_part_state,
                      check_shard, first_of_each, is_lazy_adam, layer_text, load_file, read_metadata,
                      saved_layers_of)

__all__ = ["load_checkpoint"]


class _LayerRestore:
    """What one layer will receive: this rank's keys and their rows, checked before anything changes.

    ``table`` / ``pending`` are the hash table's and the pending admissions' states as
    ``HashTable._check_state`` accepted them, ``initial`` a direct layer's initial rows: all
    worked out before any rank writes, so that writing them cannot fail.
    """

    def __init__(self, layer: _ModelParallelEmbedding, keys: Tensor, weight: Tensor, state: Dict[str, Tensor],
                 scalars: Dict[str, Any], has_state: bool, dynamic: Optional[Dict[str, Any]],
                 initial_state: Dict[str, float]) -> None:
        self.layer, self.keys, self.weight, self.state = layer, keys, weight, state
        self.scalars, self.has_state, self.dynamic = scalars, has_state, dynamic
        self.initial_state = initial_state  # per-row state of the rows the load leaves without a key
        self.table: Any = None
        self.pending: Any = None
        self.initial: Optional[Tensor] = None


def _gather_layer(name: str, layer: _ModelParallelEmbedding, shards: List[Dict[str, Any]], shard_paths: List[str],
                  saved_name: str, saved_meta: Dict[str, Any],
                  optimizer: Optional[torch.optim.Optimizer]) -> _LayerRestore:
    """The saved rows of ``layer`` that this rank owns now, from every saved shard (the
    files ``shard_paths``), where the checkpoint calls the layer ``saved_name``; ``optimizer``:
    the one loading them (rows without saved state get its initial state; a LazyAdam needs
    more of the saved state, see :func:`check_part_state`)."""
    lazy_adam = is_lazy_adam(optimizer)
    # A collection's table loaded from another position is named as both.
    shown = layer_text(name, layer) if saved_name == name else f"{layer_text(name, layer)} (saved as {saved_name!r})"
    if saved_meta["embedding_vec_size"] != layer.embedding_vec_size:
        raise ValueError(f"load_checkpoint: layer {shown} was saved with {layer._dim_argument} "
                         f"{saved_meta['embedding_vec_size']} but has {layer.embedding_vec_size}")
    parts = [shard["layers"][saved_name] for shard in shards]
    for shard_path, part in zip(shard_paths, parts):
        check_part_state(shard_path, saved_name, part, layer, lazy_adam)  # the file's entry
    keys = torch.cat([part["keys"] for part in parts])
    check_key_range(name, layer, keys, "key")
    if layer.hash_table is None and keys.numel() > 0:
        check_direct_keys(name, layer, keys)  # all of them: every rank names the same key
    weight = torch.cat([part["weight"] for part in parts])
    if weight.dtype != layer.weight.dtype and weight.is_floating_point() and weight.numel() > 0:
        # Loaded across dtypes the rows are cast (as load_state_dict copies), but a finite
        # saved value past the table dtype's range would become inf: refused, by value.
        overflow = torch.isinf(weight.to(layer.weight.dtype)) & torch.isfinite(weight)
        if bool(overflow.any()):
            value = weight[overflow][0].item()
            raise ValueError(f"load_checkpoint: layer {shown} was saved as {weight.dtype} with values past "
                             f"{layer.weight.dtype}'s range (e.g. {value:g}; largest finite "
                             f"{torch.finfo(layer.weight.dtype).max:g}): they would load as inf. Load it into a "
                             f"{weight.dtype} table (or one with a wider range, as bfloat16 has)")
    state_names = sorted(set().union(*(part["state"].keys() for part in parts))) if parts else []
    # Rows without saved state (a shard whose rank's optimizer never stepped the layer) hold
    # the loading optimizer's initial state: zero moments, Adagrad's initial sums.
    initial_state = {key: initial_row_state(optimizer, layer.weight, key) for key in state_names}
    state = {}
    for key in state_names:
        template = next(part["state"][key] for part in parts if key in part["state"])
        state[key] = torch.cat([part["state"][key] if key in part["state"] else
                                template.new_full((part["keys"].numel(), *template.shape[1:]), initial_state[key])
                                for part in parts])
    scalars = next((part["scalars"] for part in parts if part["has_state"]), {})
    has_state = any(part["has_state"] for part in parts)
    if lazy_adam and has_state:
        # As LazyAdam.load_state_dict (its __setstate__) keeps it: a 0-dim float CPU tensor.
        scalars = {**scalars, "step": _kept_step(scalars["step"]).clone()}

    # Scores travel with their keys like optimizer state; a checkpoint from before dynamic
    # tables has none (zero scores).
    dynamic_parts = [part.get("dynamic") for part in parts]
    if layer.hash_table is not None:
        for field in ("last_seen", "count"):
            state["\0" + field] = torch.cat([
                d[field] if d is not None else torch.zeros(part["keys"].numel(), dtype=torch.int64)
                for d, part in zip(dynamic_parts, parts)]) if parts else torch.zeros(0, dtype=torch.int64)
    # So do pending moment resets; none in a checkpoint from before they were saved.
    fresh_parts = [(d or {}).get("fresh") for d in dynamic_parts]
    state["\0fresh"] = torch.cat([f if f is not None else torch.zeros(part["keys"].numel(), dtype=torch.bool)
                                  for f, part in zip(fresh_parts, parts)]) if parts else torch.zeros(0, dtype=torch.bool)

    # A layer replicated over several groups was saved once per replica: keep each key once.
    first = None
    if keys.numel() > 0:
        first = first_of_each(keys)
        if first is not None:
            keys, weight = keys[first], weight[first]
            state = {key: value[first] for key, value in state.items()}

    mine = _owners(keys, layer.world_size, layer.owner_offset) == layer.rank
    keys, weight = keys[mine], weight[mine]
    state = {key: value[mine] for key, value in state.items()}
    dynamic = None
    if layer.hash_table is not None:
        present = [d for d in dynamic_parts if d is not None]
        # Totals: each saved rank held its share; a replica's ranks sum to the layer's totals
        # (stats() sums a group's ranks), and each replica saved them alike. Kept by rank 0.
        replicas = max(1, len(present) // max(1, int(saved_meta["world_size"])))
        dynamic = {"last_seen": state.pop("\0last_seen"), "count": state.pop("\0count"),
                   "clock": max((int(d["clock"]) for d in present), default=0),
                   "evicted": sum(int(d["evicted"]) for d in present) // replicas if layer.rank == 0 else 0,
                   "admitted": sum(int(d["admitted"]) for d in present) // replicas if layer.rank == 0 else 0}
        pendings = [d["pending"] for d in present if d.get("pending") is not None]
        if pendings:
            pending = {field: torch.cat([p[field] for p in pendings]) for field in ("keys", "last_seen", "count")}
            check_key_range(name, layer, pending["keys"], "pending key")
            if pending["keys"].numel() > 0:
                once = first_of_each(pending["keys"])
                if once is not None:
                    pending = {field: value[once] for field, value in pending.items()}
            ours = _owners(pending["keys"], layer.world_size, layer.owner_offset) == layer.rank
            pending = {field: value[ours] for field, value in pending.items()}
            pending["clock"] = max(int(p["clock"]) for p in pendings)
            dynamic["pending"] = pending
    fresh = state.pop("\0fresh")
    if layer.fresh_rows is None and bool(fresh.any()):
        # This layer keeps no pending resets (it does not evict): the saved moments of those
        # keys are still the evicted keys', so they are reset now.
        state = {key: value.masked_fill(fresh.view((-1,) + (1,) * (value.dim() - 1)), initial_state[key])
                 for key, value in state.items()}
    if dynamic is not None:
        dynamic["fresh"] = fresh
    capacity = layer.max_vocabulary_size_per_gpu
    if layer.hash_table is not None and keys.numel() > capacity:
        raise HashTableFullError(
            f"load_checkpoint: layer {layer_text(name, layer)} on rank {layer.rank} of {layer.world_size} must hold "
            f"{keys.numel()} saved keys but {layer._capacity_argument} is {capacity}; build it with a larger "
            f"{layer._capacity_argument} or load on more ranks")
    if dynamic is not None and layer._pending is not None and "pending" in dynamic:
        waiting = dynamic["pending"]["keys"].numel()
        if waiting > layer.admission_capacity:
            # The least recently seen are forgotten, as the pending table evicts in training
            # (on a tie the smaller key goes), whatever order the saved ranks
            # listed them in. Keys descending, then a stable sort by last_seen descending.
            pending = dynamic["pending"]
            by_key = torch.sort(pending["keys"], stable=True, descending=True).indices
            by_seen = torch.sort(pending["last_seen"].index_select(0, by_key), stable=True, descending=True).indices
            keep = by_key.index_select(0, by_seen)[:layer.admission_capacity].sort().values
            dynamic["pending"] = {field: (value[keep] if isinstance(value, Tensor) else value)
                                  for field, value in dynamic["pending"].items()}
    restore = _LayerRestore(layer, keys, weight, state, scalars, has_state, dynamic, initial_state)
    _check_restore(name, restore)
    return restore


def _check_restore(name: str, restore: _LayerRestore) -> None:
    """Works out, before any rank writes, everything :func:`_apply_layer` writes that could
    fail: the tables' states (distinct keys of the layer's key dtype, capacity, scores,
    clocks) and a direct layer's initial rows (the user's initializer may raise)."""
    layer, dynamic = restore.layer, restore.dynamic
    if layer.hash_table is None:
        # Held until the write: one weight-sized tensor per direct layer for the load's length.
        with torch.no_grad():
            restore.initial = initial_rows(layer, layer.owned_keys())
        return
    # The keys fit key_dtype (checked above), so the cast is exact.
    restore.table = _check_state_of(layer.hash_table, {
        "keys": restore.keys.to(layer.key_dtype), "last_seen": dynamic["last_seen"], "count": dynamic["count"],
        "clock": dynamic["clock"]}, f"load_checkpoint: layer {name!r} (hash table)")
    pending = dynamic.get("pending")
    if layer._pending is not None and pending is not None:
        restore.pending = _check_state_of(layer._pending, {
            "keys": pending["keys"].to(layer.key_dtype), "last_seen": pending["last_seen"],
            "count": pending["count"], "clock": pending["clock"]},
            f"load_checkpoint: layer {name!r} (pending admissions)")
        _check_pending_of(restore.table, restore.pending, f"load_checkpoint: layer {name!r} (pending admissions)")


@torch.no_grad()
def _apply_layer(restore: _LayerRestore, optimizer: Optional[torch.optim.Optimizer]) -> None:
    layer = restore.layer
    device = layer.weight.device
    keys = restore.keys.to(device)
    # Everything that could fail was worked out by _check_restore before any rank wrote.
    if layer.hash_table is not None:
        dynamic = restore.dynamic
        layer._rows_rebound()
        layer.hash_table._load_checked(restore.table)
        rows = torch.arange(keys.numel(), dtype=torch.int64, device=device)
        layer.weight.zero_()
        layer._evicted, layer._admitted = dynamic["evicted"], dynamic["admitted"]
        if layer.fresh_rows is not None:
            layer.fresh_rows.zero_()
            layer.fresh_rows[rows] = dynamic["fresh"].to(device)
        if layer._pending is not None:
            if restore.pending is None:
                layer._pending.clear()
            else:
                layer._pending._load_checked(restore.pending)
    else:
        layer.weight.copy_(restore.initial)
        rows = layer._direct_rows(keys)
    layer.weight[rows] = restore.weight.to(device=device, dtype=layer.weight.dtype)
    if optimizer is None:
        return
    if not restore.has_state:
        # Saved with no state for this weight (never stepped): none now, as for a dense parameter.
        optimizer.state.pop(layer.weight, None)
        return
    # Ordinary tensors even under the caller's torch.inference_mode() (a model built there
    # keeps its inference tensors): the next step, outside it, updates them in place.
    with torch.inference_mode(False):
        state = {key: (value.clone() if isinstance(value, Tensor) else value)
                 for key, value in restore.scalars.items()}
        for key, value in restore.state.items():
            full = torch.full(layer.weight.shape, restore.initial_state[key], dtype=value.dtype, device=device)
            full[rows] = value.to(device=device, dtype=full.dtype)
            state[key] = full
    optimizer.state[layer.weight] = state


def load_checkpoint(directory: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None) -> str:
    """Loads the latest checkpoint under ``directory``; collective: every rank calls it.

    The world size may differ from the one that saved: embedding rows go to the rank that
    owns their key now, hash tables are rebuilt, weights, optimizer moments and the step
    come back, so training continues as if it had not stopped. Nothing changes on any rank
    unless every rank's part checks out (sizes, capacities, key ranges, the tables' states,
    a direct layer's initial rows): whatever raises, on any rank, every rank raises with its
    model and optimizer unchanged.

    Args:
        directory: what :func:`save_checkpoint` was given.
        model: a model built like the saved one (a DDP wrapper is looked through). The
            tables of an :class:`~sparsekit.EmbeddingBagCollection` load by name, in
            whatever order it lists them.
        optimizer: optional; built over the model's parameters like the saved one. Its
            state is replaced: a parameter the checkpoint holds no state for has none
            afterwards.
        step: the checkpoint to load, ``ckpt-NNNNNN`` (see :func:`save_checkpoint`);
            default: the one ``LATEST`` names.

    Returns:
        The path of the checkpoint loaded.

    Raises:
        FileNotFoundError: no checkpoint in ``directory`` (no ``LATEST``, or no checkpoint
            ``step``).
        NotADirectoryError: ``directory`` is a file or lies under one.
        TypeError: ``model`` is not a ``torch.nn.Module`` or ``optimizer`` not a
            ``torch.optim.Optimizer``.
        HashTableFullError: a rank's share of a layer's keys exceeds its capacity.
        ValueError: the model does not match the checkpoint (among others: a saved key
            outside the range of a layer's ``key_dtype``, a collection's table the
            checkpoint lacks), an ``optimizer`` is given but the checkpoint was saved
            without one, or the checkpoint is damaged (among others: a layer's optimizer
            state that the optimizer's next step could not use).
        OtherRankError: another rank raised (its error names the cause); a RuntimeError.
            Raised also when another rank failed after the checks, while writing (out of
            memory, a KeyboardInterrupt): this rank then holds the checkpoint, that one is
            partly loaded; load again on every rank.
        Exception: whatever a direct layer's ``embedding_initializer`` raises (it gives
            the rows the checkpoint does not hold).
    """
    group, _, _ = world()
    path = None
    restores: List[_LayerRestore] = []
    dense: Dict[str, Any] = {}
    error: Optional[BaseException] = None
    try:
        check_directory_argument("load_checkpoint", directory)
        model, layers = model_and_layers("load_checkpoint", model, optimizer)
        path = _checkpoint_to_load(directory, step)
        metadata = read_metadata(path)
        metadata["layers"] = compile_names_dropped(metadata["layers"])
        sources = saved_layers_of(layers, metadata["layers"])
        if sorted(sources.values()) != sorted(metadata["layers"]):
            raise ValueError(f"load_checkpoint: the checkpoint has embedding layers {sorted(metadata['layers'])} "
                             f"but the model has {sorted(layers)}")
        shards, shard_paths = [], []
        for shard_name in metadata["shards"]:
            shard_paths.append(os.path.join(path, shard_name))
            shards.append(load_file(shard_paths[-1]))
            if isinstance(shards[-1], dict) and isinstance(shards[-1].get("layers"), dict):
                shards[-1]["layers"] = compile_names_dropped(shards[-1]["layers"])
            check_shard(shard_paths[-1], shards[-1], metadata)
        restores = [_gather_layer(name, layer, shards, shard_paths, sources[name], metadata["layers"][sources[name]],
                                  optimizer)
                    for name, layer in layers.items()]
        dense = load_file(os.path.join(path, "dense.pt"))
        if isinstance(dense, dict) and isinstance(dense.get("model"), dict):
            dense["model"] = compile_names_dropped(dense["model"])
        check_dense(os.path.join(path, "dense.pt"), dense, dense_state_of(model, layers), optimizer, metadata,
                     layer_prefixes(model) if "" not in layers else ())
        check_moved_groups(layers, sources, metadata["layers"], dense, optimizer)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    # Nothing has been written on any rank yet: every rank raises, or every rank loads.
    agree_or_raise(group, error, "load_checkpoint")
    differing = ranks_differing(group, os.path.basename(path) + json.dumps(metadata, sort_keys=True))
    if differing:
        raise ValueError(f"load_checkpoint: rank(s) {differing} found another checkpoint in {directory!r} than rank 0 "
                         f"({os.path.basename(path)} here); every rank must load one checkpoint from a directory "
                         "that they all reach (a shared file system); nothing was changed")
    check_optimizer_everywhere(group, "load_checkpoint", optimizer)

    # The optimizer first: its own load_state_dict checks the saved state (LazyAdam: the
    # hyperparameters) before it replaces anything, so if it still refuses, nothing has
    # changed; every rank reads the same dense.pt into an optimizer built alike (checked
    # above), so they refuse alike. What follows was checked above and cannot fail.
    try:
        if optimizer is not None and dense.get("optimizer") is not None:
            with torch.inference_mode(False):  # as _apply_layer's state
                optimizer.load_state_dict(dense["optimizer"])
            # load_state_dict rebuilt the dense state; embedding shards get theirs by key.
            for restore in restores:
                optimizer.state.pop(restore.layer.weight, None)
        wrappers = wrapper_paths(model)
        named = {plain_name(key, wrappers): key for key in model.state_dict()}  # the model's own names
        model.load_state_dict({named[key]: value for key, value in dense["model"].items()}, strict=False)
        for restore in restores:
            _apply_layer(restore, optimizer)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below, then re-raised
        error = exc
    # A fault in the writing phase (out of memory, a KeyboardInterrupt) on one rank left it
    # partly loaded while the others returned as if the load had succeeded: the failing rank
    # could not load again alone (a collective), and its next collective paired with the
    # others' next step. Every rank raises instead, so every rank can load again together.
    if not all_ok(group, error is None):
        if error is not None:
            raise error
        raise OtherRankError("load_checkpoint failed on another rank while writing the loaded state (see the error "
                             "there): this rank holds the checkpoint, that rank is partly loaded; call "
                             "load_checkpoint again on every rank")
    return path


def _checkpoint_to_load(directory: str, step: Optional[int]) -> str:
    """The path of checkpoint ``step`` in ``directory``, or of the one ``LATEST`` names."""
    check_not_a_file(directory, "load_checkpoint", "give the directory that save_checkpoint was given")
    checkpoints = CheckpointDirectory(directory)
    if step is not None:
        path = checkpoints.checkpoint(check_step("load_checkpoint", step))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"load_checkpoint: no checkpoint {os.path.basename(path)} in {directory!r} "
                                    f"(it holds steps: {', '.join(map(str, checkpoints.steps())) or 'none'})")
        return path
    try:
        path = checkpoints.latest()
    except ValueError as error:
        raise ValueError(f"load_checkpoint: {error}") from None
    if path is None:
        raise FileNotFoundError(f"load_checkpoint: no checkpoint in {directory!r} (no {LATEST} file); "
                                "save one with sk.save_checkpoint")
    return path

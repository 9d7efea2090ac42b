"""Reading a checkpoint's files and checking them against the model and optimizer.

Everything here only reads and raises: a file that cannot be read, a shard or dense
state that is damaged or does not fit the model (layers, shapes, key ranges, optimizer
groups and per-row state) is a ValueError or FileNotFoundError naming the file and what
is wrong. :func:`sparsekit.checkpoint.load_checkpoint` runs these checks on every rank
before any rank changes its model, so a refused load changes nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from .._checks import out_of_memory
from ..hashtable import _MAX_CLOCK
from ..optim import LazyAdam, _kept_step, _saved_step
from ..shard import _ModelParallelEmbedding
from .model_state import FORMAT_VERSION, optimizer_param_ids, table_entry

__all__ = ["check_dense", "check_direct_keys", "check_key_range", "check_moved_groups", "check_part_state",
           "check_shard", "first_of_each", "is_lazy_adam", "layer_text", "load_file", "read_metadata",
           "saved_layers_of", "without_data"]


def load_file(path: str) -> Any:
    """A checkpoint file's contents; a file that cannot be read is named in the error."""
    try:
        with torch.inference_mode(False):  # ordinary tensors: optimizer state is updated in place later
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: {path} is missing") from None
    except Exception as exc:  # noqa: BLE001 - EOFError with no message, UnpicklingError, ...
        if out_of_memory(exc) is not None:
            raise  # the machine, not the file: the checkpoint is not damaged, and the caller's handler must see it
        detail = "it is empty" if os.path.exists(path) and os.path.getsize(path) == 0 else \
            f"{type(exc).__name__}: {exc}"
        raise ValueError(f"load_checkpoint: cannot read {path} ({detail}); the checkpoint is damaged") from exc


def read_metadata(path: str) -> Dict[str, Any]:
    """metadata.json of the checkpoint at ``path``, checked for the fields the load needs."""
    meta_path = os.path.join(path, "metadata.json")
    try:
        with open(meta_path) as meta_file:
            metadata = json.load(meta_file)
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: {meta_path} is missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"load_checkpoint: {meta_path} is not valid JSON ({exc})") from None

    def bad(what: str) -> ValueError:
        return ValueError(f"load_checkpoint: {meta_path}: {what}")

    if not isinstance(metadata, dict):
        raise bad(f"expected a JSON object, got {type(metadata).__name__}")
    if metadata.get("format") != FORMAT_VERSION:
        raise bad(f"format {metadata.get('format')!r}, this sparsekit reads {FORMAT_VERSION}")
    shards = metadata.get("shards")
    if not isinstance(shards, list) or not shards or not all(isinstance(n, str) for n in shards):
        raise bad(f"'shards' must be a non-empty list of file names, got {shards!r}")
    if any(os.path.basename(n) != n for n in shards):
        raise bad(f"'shards' must name files inside the checkpoint, got {shards!r}")
    layers = metadata.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise bad(f"'layers' must be an object of layer name -> object, got {layers!r}")
    for name, layer in layers.items():
        dim = layer.get("embedding_vec_size")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise bad(f"layer {name!r} has no valid 'embedding_vec_size' (got {dim!r})")
        if "table" in layer and not isinstance(layer["table"], str):
            raise bad(f"layer {name!r} has no valid 'table' name (got {layer['table']!r})")
        index = layer.get("optimizer_index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise bad(f"layer {name!r} has no valid 'optimizer_index' (got {index!r})")
        world_size = layer.get("world_size")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise bad(f"layer {name!r} has no valid 'world_size' (got {world_size!r})")
    return metadata


def without_data(value: Any) -> Optional[str]:
    """``"meta"`` or the layout (``"torch.sparse_coo"``, ...) of a tensor whose values a load
    cannot read as a dense tensor's; None for anything else."""
    if isinstance(value, Tensor) and (value.is_meta or value.layout != torch.strided):
        return "meta" if value.is_meta else str(value.layout)
    return None


def check_shard(shard_path: str, shard: Any, metadata: Dict[str, Any]) -> None:
    """Every layer's part of one shard is whole: keys unique, one row of the saved width each."""
    def bad(what: str) -> ValueError:
        return ValueError(f"load_checkpoint: {shard_path}: {what}; the checkpoint is damaged")

    if not isinstance(shard, dict) or not isinstance(shard.get("layers"), dict):
        raise bad("not a sparsekit shard (no 'layers' table)")
    for name, layer_meta in metadata["layers"].items():
        part = shard["layers"].get(name)
        if not isinstance(part, dict):
            raise bad(f"no entry for layer {name!r}")
        keys, weight, state = part.get("keys"), part.get("weight"), part.get("state", {})
        # A sparse or meta tensor passes the dtype and shape checks below, then fails (a meta
        # one while the rows are written, after other layers and the dense state loaded).
        dynamic_part = part.get("dynamic") if isinstance(part.get("dynamic"), dict) else {}
        pending_part = dynamic_part.get("pending") if isinstance(dynamic_part.get("pending"), dict) else {}
        for field, value in [("keys", keys), ("weight", weight),
                             *((f"state[{k!r}]", v) for k, v in (state.items() if isinstance(state, dict) else ())),
                             *((f"dynamic[{k!r}]", dynamic_part.get(k)) for k in ("last_seen", "count", "fresh")),
                             *((f"dynamic['pending'][{k!r}]", pending_part.get(k))
                               for k in ("keys", "last_seen", "count"))]:
            kind = without_data(value)
            if kind:
                raise bad(f"layer {name!r}: {field!r} is a {kind} tensor; the shard holds dense (strided) tensors "
                          "with data")
        if not isinstance(keys, Tensor) or keys.dim() != 1 or keys.dtype not in (torch.int64, torch.int32):
            raise bad(f"layer {name!r}: 'keys' must be a 1-D int64 tensor")
        dim = layer_meta["embedding_vec_size"]
        if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise bad(f"layer {name!r}: 'weight' must be a 2-D float tensor")
        if weight.shape != (keys.numel(), dim):
            raise bad(f"layer {name!r}: {keys.numel()} keys need weight rows [{keys.numel()}, {dim}], "
                      f"got {list(weight.shape)}")
        if not isinstance(state, dict) or any(not isinstance(v, Tensor) or v.shape != weight.shape
                                              for v in state.values()):
            raise bad(f"layer {name!r}: every per-row optimizer state must have the weight's shape "
                      f"{list(weight.shape)}")
        if keys.numel() and ops.unique(keys, return_inverse=False).numel() != keys.numel():
            raise bad(f"layer {name!r}: a key is saved twice")
        # The load writes these without further checks: a bad one must fail here, before anything changes.
        if not isinstance(part.get("scalars"), dict) or not isinstance(part.get("has_state"), bool):
            raise bad(f"layer {name!r}: 'scalars' must be a table and 'has_state' a bool")
        dynamic = part.get("dynamic")
        if dynamic is not None:
            if not isinstance(dynamic, dict):
                raise bad(f"layer {name!r}: 'dynamic' must be a table")
            for field in ("last_seen", "count"):
                value = dynamic.get(field)
                if not isinstance(value, Tensor) or value.dtype != torch.int64 or value.shape != keys.shape:
                    raise bad(f"layer {name!r}: dynamic '{field}' must be int64 [{keys.numel()}] like 'keys'")
            fresh = dynamic.get("fresh")
            if fresh is not None and (not isinstance(fresh, Tensor) or fresh.dtype != torch.bool
                                      or fresh.shape != keys.shape):
                raise bad(f"layer {name!r}: dynamic 'fresh' must be bool [{keys.numel()}] like 'keys'")
            for field in ("clock", "evicted", "admitted"):
                if not _is_count(dynamic.get(field)):
                    raise bad(f"layer {name!r}: dynamic '{field}' must be a non-negative int, got "
                              f"{dynamic.get(field)!r}")
            pending = dynamic.get("pending")
            if pending is not None and (not isinstance(pending, dict) or any(
                    not isinstance(pending.get(field), Tensor) or pending[field].dim() != 1
                    or pending[field].shape != pending["keys"].shape for field in ("keys", "last_seen", "count"))):
                raise bad(f"layer {name!r}: dynamic 'pending' must hold 1-D keys, last_seen and count of one length")
            if pending is not None and (pending["keys"].dtype not in (torch.int64, torch.int32) or any(
                    pending[field].dtype != torch.int64 for field in ("last_seen", "count"))
                    or not _is_count(pending.get("clock"))):
                raise bad(f"layer {name!r}: dynamic 'pending' must hold int64 keys, last_seen and count and a "
                          "non-negative int clock")


def _is_count(value: Any) -> bool:
    """A non-negative Python int (a clock or a total) below 2**62, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_CLOCK


def saved_layers_of(layers: Dict[str, _ModelParallelEmbedding], saved: Dict[str, Any]) -> Dict[str, str]:
    """For each embedding layer of the model, the saved layer it loads from.

    A table of an :class:`~sparsekit.EmbeddingBagCollection` loads from the saved table of
    its name in the collection of the same name, wherever each lists it (a table's layer
    name holds its position, ``shards.<i>``, and a collection built with its tables in
    another order must not load one table's keys into another). A checkpoint saved before
    the tables were named in its metadata loads by position, as it did; any other layer
    loads from the layer of its name.

    Raises:
        ValueError: the model's collection holds a table whose name the checkpoint lacks
            where it names its tables (tables renamed or replaced).
    """
    saved_tables: Dict[Tuple[str, str], str] = {}
    for saved_name, meta in saved.items():
        if "table" in meta:
            saved_tables[(saved_name.rpartition(".")[0], meta["table"])] = saved_name
    named_collections = {collection for collection, _ in saved_tables}

    def differ(collection: str, what: str) -> ValueError:
        parent = collection.rpartition(".")[0]
        return ValueError(
            f"load_checkpoint: {f'the collection {parent!r}' if parent else 'the collection (the model)'} was "
            f"saved with tables {_tables_in(saved, collection, lambda n: saved[n].get('table'))} but has "
            f"{_tables_in(layers, collection, lambda n: table_entry(layers[n]).get('table'))}: {what}; build "
            "the collection with the saved tables (in any order)")

    sources: Dict[str, str] = {}
    for name, layer in layers.items():
        table = table_entry(layer).get("table")
        collection = name.rpartition(".")[0]
        if table is not None and (collection, table) in saved_tables:
            sources[name] = saved_tables[(collection, table)]
        elif table is not None and (collection in named_collections or "table" in saved.get(name, {})):
            raise differ(collection, f"the checkpoint holds no table {table!r}")
        else:
            sources[name] = name
    # A saved table of a collection the model has, which no table of the model loads.
    loaded = set(sources.values())
    model_collections = {name.rpartition(".")[0] for name, layer in layers.items()
                         if table_entry(layer).get("table") is not None}
    for (collection, table), saved_name in saved_tables.items():
        if collection in model_collections and saved_name not in loaded:
            raise differ(collection, f"the model has no table {table!r}")
    return sources


def check_moved_groups(layers: Dict[str, _ModelParallelEmbedding], sources: Dict[str, str], saved: Dict[str, Any],
                        dense: Dict[str, Any], optimizer: Optional[torch.optim.Optimizer]) -> None:
    """ValueError when a collection's table loaded from another position would get another
    table's optimizer settings. Its rows and moments load by name, but the optimizer's
    groups (lr, betas, weight decay) load by position: the table's weight gets the settings
    of the saved group at its own place, which must equal those of the group its saved
    table was in (recorded as ``optimizer_index``; a checkpoint without it is not checked)."""
    if optimizer is None:
        return
    moved = [name for name, source in sources.items() if source != name]
    if not moved:
        return
    groups = dense["optimizer"]["param_groups"]  # present and well formed: check_dense raised otherwise
    saved_group = {index: g for g, group in enumerate(groups) for index in group["params"]}
    ids = optimizer_param_ids(optimizer)

    def settings(g: int) -> Dict[str, Any]:
        return {key: value for key, value in groups[g].items() if key != "params"}

    wrong = []
    for name in moved:
        source_index = saved[sources[name]].get("optimizer_index")
        place = ids.get(id(layers[name].weight))
        # The saved state numbers parameters group by group, as optimizer_param_ids does, and
        # load_state_dict hands the weight at ``place`` the settings of saved parameter ``place``.
        if source_index not in saved_group or place not in saved_group:
            continue
        if settings(saved_group[place]) != settings(saved_group[source_index]):
            table = table_entry(layers[name]).get("table", name)
            wrong.append(f"{table!r} (saved with {settings(saved_group[source_index])}, would get "
                         f"{settings(saved_group[place])})")
    if wrong:
        raise ValueError(f"load_checkpoint: the collection lists its tables in another order than when saved, and "
                         f"the optimizer's groups load by position: table(s) {', '.join(wrong)}; build the "
                         "collection with its tables in the saved order, or the optimizer's groups so that each "
                         "table sits where its saved settings are")


def _tables_in(layers: Dict[str, Any], collection: str, table_of) -> List[Any]:
    """``table_of(name)`` of the ``layers`` named ``<collection>.<i>``, by position ``i``."""
    listed = [name for name in layers if name.rpartition(".")[0] == collection]
    listed.sort(key=lambda name: (len(name), name))  # shards.2 before shards.10
    return [table_of(name) for name in listed]


def is_lazy_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a LazyAdam, or a wrapper whose ``load_state_dict`` is one's."""
    owner = getattr(getattr(optimizer, "load_state_dict", None), "__self__", None)
    return isinstance(optimizer, LazyAdam) or isinstance(owner, LazyAdam)


# LazyAdam's next update of a layer is step + 1, an int64 (sparsekit.ops.lazy_adam_).
_MAX_SAVED_STEP = 2**63 - 2


def check_part_state(shard_path: str, name: str, part: Dict[str, Any], layer: _ModelParallelEmbedding,
                      lazy_adam: bool) -> None:
    """One shard's optimizer state of layer ``name`` as the next ``optimizer.step()`` will
    read it, or ValueError naming the file, the layer and the entry. Any optimizer: per-row
    entries are dense floating-point tensors, a ``step`` is a finite integer in
    ``[0, 2**63 - 2]``. A LazyAdam (``lazy_adam``) also needs ``step``, ``exp_avg`` and
    ``exp_avg_sq``, both moments of one dtype it updates the weight with: the weight's,
    float32 or float64 (as ``LazyAdam.step`` accepts them). Else the load went through and
    the next step failed, with the model's and optimizer's state replaced."""
    def bad(what: str) -> ValueError:
        return ValueError(f"load_checkpoint: {shard_path}: layer {name!r}: {what}; the checkpoint is damaged")

    state, scalars = part["state"], part["scalars"]
    if not part["has_state"]:
        if state or scalars:
            raise bad(f"'has_state' is False but the shard holds optimizer state {sorted(state) + sorted(scalars)}")
        return
    if lazy_adam:
        missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in (scalars if key == "step" else state)]
        if missing:
            raise bad(f"the saved optimizer state lacks {missing}: LazyAdam needs 'step' (in 'scalars'), 'exp_avg' "
                      "and 'exp_avg_sq' (in 'state')")
    weight_dtype = layer.weight.dtype
    moment_dtypes = [weight_dtype] + [d for d in (torch.float32, torch.float64) if d != weight_dtype]
    for key, value in state.items():
        if value.layout != torch.strided:
            raise bad(f"the saved optimizer state {key!r} must be a dense (strided) tensor, got {value.layout}")
        if lazy_adam and key in ("exp_avg", "exp_avg_sq") and value.dtype not in moment_dtypes:
            raise bad(f"the saved optimizer state {key!r} must be floating point of a dtype LazyAdam updates a "
                      f"{weight_dtype} weight with ({', '.join(map(str, moment_dtypes))}), got {value.dtype}")
        if not (value.is_floating_point() or value.is_complex()):
            raise bad(f"the saved optimizer state {key!r} must be floating point (per-row moments), got {value.dtype}")
    if lazy_adam and state["exp_avg"].dtype != state["exp_avg_sq"].dtype:
        raise bad(f"the saved optimizer moments must share a dtype (LazyAdam updates them together), got 'exp_avg' "
                  f"{state['exp_avg'].dtype} and 'exp_avg_sq' {state['exp_avg_sq'].dtype}")
    if "step" not in scalars:
        return
    step = scalars["step"]
    value, valid = _saved_step(step)
    if valid and lazy_adam:
        value = _kept_step(step).item()  # the value LazyAdam will count from (float32 may round)
    if not valid or value > _MAX_SAVED_STEP:
        raise bad(f"the saved optimizer 'step' must be a finite integer in [0, 2**63 - 2] (the next step's count "
                  f"must fit in int64), got {step!r}")


def layer_text(name: str, layer: _ModelParallelEmbedding) -> str:
    """How a load's errors name a layer: its module name, and a collection's table by its
    table name too (``'shards.0' (table 'users')``)."""
    config = getattr(layer, "config", None)
    table = getattr(config, "name", None)
    return f"{name!r} (table {table!r})" if isinstance(table, str) else repr(name)


def check_direct_keys(name: str, layer: _ModelParallelEmbedding, keys: Tensor) -> None:
    """ValueError naming a saved key (of any rank: every rank names the same) that a direct
    layer has no row for: the smallest when one is negative, else the largest (>= its key
    capacity)."""
    capacity = layer.num_keys_capacity
    low, high = (int(bound) for bound in torch.aminmax(keys))
    if low >= 0 and high < capacity:
        return
    outside = int(((keys < 0) | (keys >= capacity)).sum()) - 1
    more = f" (and {outside} more outside that range)" if outside else ""
    fix = ("a direct layer has no row for a negative key (the checkpoint is damaged, or was saved by a layer "
           "with use_hashtable=True)" if low < 0 else
           f"build it with a larger {layer._capacity_argument} or load on more ranks")
    raise ValueError(
        f"load_checkpoint: layer {layer_text(name, layer)} (use_hashtable=False): the checkpoint holds key "
        f"{low if low < 0 else high}{more} but the layer's keys must lie in [0, {capacity}) on {layer.world_size} "
        f"ranks; {fix}")


def check_key_range(name: str, layer: _ModelParallelEmbedding, keys: Tensor, what: str) -> None:
    """ValueError unless the saved ``keys`` fit the layer's key dtype: an int32 layer would
    otherwise keep a truncated key (2**32 + 7 as 7) carrying another key's row."""
    if layer.key_dtype == torch.int64 or keys.numel() == 0:
        return
    bounds = torch.iinfo(layer.key_dtype)
    outside = (keys < bounds.min) | (keys > bounds.max)
    if outside.any():
        more = int(outside.sum()) - 1
        raise ValueError(
            f"load_checkpoint: layer {name!r} has key_dtype={layer.key_dtype} but the checkpoint holds {what} "
            f"{keys[outside][0].item()}{f' (and {more} more)' if more else ''} outside its range "
            f"[{bounds.min}, {bounds.max}]; build the layer with key_dtype=torch.int64")


def first_of_each(keys: Tensor) -> Optional[Tensor]:
    """Index of the first occurrence of each distinct key; None when the keys are distinct."""
    unique_keys, inverse = ops.unique(keys)
    if unique_keys.numel() == keys.numel():
        return None
    first = torch.full((unique_keys.numel(),), keys.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.numel()), reduce="amin")
    return first


def check_dense(dense_path: str, dense: Any, expected: Dict[str, Tensor],
                 optimizer: Optional[torch.optim.Optimizer], metadata: Dict[str, Any],
                 layer_prefixes: Tuple[str, ...] = ()) -> None:
    """The dense state fits the model (names and shapes) and the optimizer (groups and sizes).
    Entries under ``layer_prefixes`` (a shared layer's second name, which saves before the
    fix wrote into the dense state) are dropped from ``dense`` first."""
    if not isinstance(dense, dict) or not isinstance(dense.get("model"), dict):
        raise ValueError(f"load_checkpoint: {dense_path}: not a sparsekit dense state (no 'model' table)")
    if layer_prefixes:
        dense["model"] = {key: value for key, value in dense["model"].items() if not key.startswith(layer_prefixes)}
    saved = dense["model"]
    if set(saved) != set(expected):
        raise ValueError(f"load_checkpoint: dense state keys differ: missing {sorted(set(expected) - set(saved))}, "
                         f"unexpected {sorted(set(saved) - set(expected))}")
    for key, value in expected.items():
        if not isinstance(value, Tensor):
            continue  # a submodule's extra state: its own load_state_dict checks it
        if isinstance(saved[key], Tensor) and saved[key].layout != torch.strided:
            raise ValueError(f"load_checkpoint: dense {key!r} was saved as a {saved[key].layout} tensor; the "
                             "dense state holds dense (strided) tensors")
        if isinstance(saved[key], Tensor) and saved[key].is_meta:
            # It would fail inside model.load_state_dict, after the optimizer and the entries
            # before it were loaded.
            raise ValueError(f"load_checkpoint: {dense_path}: dense {key!r} is a meta tensor, which holds no data; "
                             "the checkpoint is damaged")
        if not isinstance(saved[key], Tensor) or saved[key].shape != value.shape:
            shape = list(saved[key].shape) if isinstance(saved[key], Tensor) else type(saved[key]).__name__
            raise ValueError(f"load_checkpoint: dense {key!r} was saved with shape {shape} "
                             f"but the model has {list(value.shape)}")
    saved_optimizer = dense.get("optimizer")
    if optimizer is None:
        return
    if saved_optimizer is None:
        # Loading the weights alone would leave the optimizer's moments and steps of the keys
        # it trained on whatever rows now hold other keys (and on the dense parameters).
        raise ValueError(f"load_checkpoint: {dense_path}: the checkpoint was saved without an optimizer, so it holds "
                         "no optimizer state to continue from; pass optimizer=None to load the weights only, and "
                         "start from a new optimizer (or reset this one's state)")
    groups = saved_optimizer.get("param_groups") if isinstance(saved_optimizer, dict) else None
    states = saved_optimizer.get("state", {}) if isinstance(saved_optimizer, dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
            and isinstance(states, dict) and all(isinstance(state, dict) for state in states.values())):
        raise ValueError(f"load_checkpoint: {dense_path}: the saved optimizer state is not an optimizer's "
                         "state_dict (a dict of a 'param_groups' list of dicts, each with a 'params' list, and a "
                         "'state' dict of dicts)")
    if len(groups) != len(optimizer.param_groups) or any(
            len(saved_group["params"]) != len(group["params"])
            for saved_group, group in zip(groups, optimizer.param_groups)):
        raise ValueError("load_checkpoint: the optimizer was saved with other parameter groups "
                         f"({[len(g['params']) for g in groups]} "
                         f"parameters) than it has ({[len(g['params']) for g in optimizer.param_groups]}); "
                         "build it over the same parameters in the same order")
    missing = sorted(set(optimizer.defaults) - set(groups[0]) - {"maximize", "foreach", "differentiable",
                                                                 "capturable", "fused"})
    if missing:
        raise ValueError(f"load_checkpoint: the saved optimizer state lacks {missing}: it was saved by another "
                         f"optimizer than {type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in states.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"load_checkpoint: {dense_path}: optimizer state for parameter {index!r}, "
                             f"which the optimizer does not have")
        for name, value in state.items():
            kind = without_data(value)
            if kind:
                # It would fail inside optimizer.load_state_dict or the next step, naming no file.
                raise ValueError(f"load_checkpoint: {dense_path}: optimizer state {name!r} of parameter {index} is a "
                                 f"{kind} tensor; the dense state holds dense (strided) tensors with data; the "
                                 "checkpoint is damaged")
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"load_checkpoint: optimizer state {name!r} of parameter {index} was saved with "
                                 f"shape {list(value.shape)} but the parameter has {list(params[index].shape)}")

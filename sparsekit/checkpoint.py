"""Collective, atomic, world-size-independent checkpoints of models with sharded embeddings.

Layout of ``directory``::

    LATEST                        name of the newest complete checkpoint (replaced atomically)
    ckpt-000007/
        metadata.json             format, world size, the embedding layers and their shapes (and
                                  a collection's tables' names: they load by name)
        dense.pt                  rank 0: dense parameters/buffers + their optimizer state
        shard-00000-of-00002.pt   rank r: per embedding layer, the keys it owns, their rows,
        shard-00001-of-00002.pt   their per-row optimizer state (exp_avg, ...) and the step

Each shard file maps every embedding layer's name to that rank's part: ``keys`` (int64
``[n]``), ``weight`` (``[n, dim]``), ``state`` (per-row optimizer state, each ``[n, dim]``),
``scalars`` (the rest of its optimizer state, e.g. ``step``), ``has_state`` and, for a
hash-table layer, ``dynamic``: ``last_seen`` and ``count`` (int64 ``[n]``, the keys'
scores), ``clock``, ``evicted``, ``admitted``, ``pending`` (the keys waiting for admission,
with their scores and clock) and, with eviction, ``fresh`` (bool ``[n]``: the key took an
evicted key's row since its last optimizer update, so its saved moments are still the
evicted key's and are reset at its next update). A checkpoint without ``fresh`` loads with
no reset pending; a layer without eviction that loads one resets those keys' moments at
once.

Every file is plain tensors, ints, floats and strings: ``torch.load(weights_only=True)``
reads it, nothing is unpickled as code. A save writes ``ckpt-N.tmp/`` and, once every rank
reports success, renames it to ``ckpt-N/`` and only then points ``LATEST`` at it
(``os.replace``), so a crash at any moment leaves the previous checkpoint loadable.
Older ``ckpt-*`` directories are removed after the switch.

Rows are saved by key, so a checkpoint saved on N ranks loads on M ranks: every rank reads
every shard file and keeps the keys it owns under the new world size (``uint64(k) % M``).
Hash tables are rebuilt with the saved keys in the saved row order, so loading on the same
world size restores the same rows bit for bit. The directory must be visible to every
rank (one machine or a shared file system).
"""

from __future__ import annotations

import collections
import errno
import io
import json
import numbers
import os
import re
import shutil
import uuid
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import ops
from ._checks import out_of_memory
from .exchange import _all_gather_digests, _owners
from .hashtable import _MAX_CLOCK, HashTableFullError, _check_pending_of, _check_state_of
from .optim import LazyAdam, _kept_step, _saved_step
from .shard import _ModelParallelEmbedding, is_embedding_variable

__all__ = ["save_checkpoint", "load_checkpoint"]

FORMAT_VERSION = 1
_LATEST = "LATEST"
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{6,})$")


# ---- collectives ----------------------------------------------------------------------------


def _world() -> Tuple[Optional[dist.ProcessGroup], int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def _collective_device(group) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_ok(group, ok: bool) -> bool:
    """True when ``ok`` on every rank (an all-reduce MIN); a no-op without a group."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _ranks_differing(group, text: str) -> List[int]:
    """The ranks whose ``text`` differs from rank 0's (one all-gather of 16-byte digests);
    [] on every rank when all agree, or without a group."""
    if group is None:
        return []
    digests = _all_gather_digests(text.encode(), _collective_device(group), group, dist.get_world_size(group))
    return [rank for rank, digest in enumerate(digests) if digest != digests[0]]


class OtherRankError(RuntimeError):
    """A collective save or load failed on another rank; that rank's own error names the cause."""


def _agree_or_raise(group, error: Optional[BaseException], what: str) -> None:
    """Every rank raises when any rank failed: its own error, or one naming the step."""
    if _all_ok(group, error is None):
        return
    if error is not None:
        raise error
    raise OtherRankError(f"{what} failed on another rank (see the error there); nothing was changed on this rank")


# ---- the model's pieces ---------------------------------------------------------------------


def _check_optimizer_everywhere(group, caller: str, optimizer: Any) -> None:
    """Every rank raises unless an optimizer was passed on every rank or on none (a rank
    without one would save or load no optimizer state for its rows while the others do)."""
    differing = _ranks_differing(group, "optimizer" if optimizer is not None else "none")
    if differing:
        # Rank 0 passed one exactly when this rank did and agrees with it.
        rank_zero_has = (optimizer is not None) != (dist.get_rank(group) in differing)
        raise ValueError(f"{caller}: the ranks disagree on the optimizer: rank 0 passed "
                         f"{'one' if rank_zero_has else 'None'}, rank(s) {differing} "
                         f"{'None' if rank_zero_has else 'one'}; pass the optimizer on every rank or on none; "
                         "nothing was changed")


def _check_directory_argument(caller: str, directory: Any) -> None:
    """TypeError naming ``directory`` unless it is a path (os's own error names no argument)."""
    # Not bytes: the checkpoint's own names are str, and os.path.join cannot mix the two.
    if not isinstance(directory, (str, os.PathLike)) or isinstance(os.fspath(directory), bytes):
        raise TypeError(f"{caller}: directory must be a path (str or os.PathLike of str), got "
                        f"{type(directory).__name__}")
    if os.fspath(directory) == "":
        # os's own "[Errno 2] No such file or directory: ''" named neither the call nor the argument.
        raise ValueError(f"{caller}: directory must not be an empty path (use '.' for the current directory)")


def _wrapped_attribute(module: nn.Module) -> Optional[str]:
    """The attribute through which a wrapper holds its module: DistributedDataParallel's
    "module", torch.compile's "_orig_mod" (by class name: torch keeps that class in a
    private module); None for any other module."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return "module"
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
        return "_orig_mod"
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside its wrappers: DistributedDataParallel adds "module." to every name
    and torch.compile "_orig_mod."; checkpoints carry neither, so a compiled or wrapped
    model and the plain one save and load each other's (wrapped submodules too: see
    :func:`_plain_name`)."""
    while (attribute := _wrapped_attribute(model)) is not None:
        model = getattr(model, attribute)
    return model


def _wrapper_paths(model: nn.Module) -> FrozenSet[str]:
    """The names a wrapped submodule's wrapper adds (``"tower.module"`` for a DDP-wrapped
    ``tower``, ``"emb._orig_mod"`` for a compiled ``emb``), as named_modules() and
    state_dict() spell them."""
    return frozenset(f"{name}.{attribute}" if name else attribute
                     for name, module in model.named_modules(remove_duplicate=False)
                     if (attribute := _wrapped_attribute(module)) is not None)


def _plain_name(name: str, wrappers: FrozenSet[str]) -> str:
    """``name`` without the segments of ``wrappers`` (:func:`_wrapper_paths`): the name the
    plain model gives the same module, parameter or buffer."""
    if not wrappers:
        return name
    kept, path = [], ""
    for part in name.split("."):
        path = f"{path}.{part}" if path else part
        if path not in wrappers:
            kept.append(part)
    return ".".join(kept)


def _compile_names_dropped(entries: Dict[str, Any]) -> Dict[str, Any]:
    """``entries`` under names without torch.compile's "_orig_mod" segments: checkpoints
    saved before names were made plain (:func:`_plain_name`) kept them for a compiled
    submodule."""
    return {".".join(part for part in name.split(".") if part != "_orig_mod") if isinstance(name, str) else name:
            value for name, value in entries.items()}


def _embedding_layers(model: nn.Module) -> Dict[str, _ModelParallelEmbedding]:
    wrappers = _wrapper_paths(model)
    return {_plain_name(name, wrappers): module for name, module in model.named_modules()
            if isinstance(module, _ModelParallelEmbedding)}


_OPTIMIZER_API = ("param_groups", "state", "state_dict", "load_state_dict")


def _model_and_layers(caller: str, model: Any,
                      optimizer: Any) -> Tuple[nn.Module, Dict[str, _ModelParallelEmbedding]]:
    """The model (a DDP wrapper looked through) and its embedding layers by name, once
    ``model`` and ``optimizer`` are known to be what they must be (a TypeError naming the
    argument otherwise, where their first attribute read would raise an AttributeError)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
    # Duck-typed, as torch's own code treats optimizers: a wrapper that delegates (Lightning's
    # LightningOptimizer) is no subclass.
    if optimizer is not None and not all(hasattr(optimizer, name) for name in _OPTIMIZER_API):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer (or have its "
                        f"{', '.join(_OPTIMIZER_API)}) or None, got {type(optimizer).__name__}")
    model = _unwrap(model)
    return model, _embedding_layers(model)


def _dense_state(model: nn.Module, layers: Dict[str, _ModelParallelEmbedding]) -> Dict[str, Tensor]:
    """``model.state_dict()`` without the embedding layers, under the plain model's names."""
    if "" in layers:  # the model is itself an embedding layer
        return {}
    wrappers = _wrapper_paths(model)
    prefixes = _layer_prefixes(model)
    dense = {_plain_name(key, wrappers): value for key, value in model.state_dict().items()}
    return {key: value for key, value in dense.items() if not key.startswith(prefixes)}


def _layer_prefixes(model: nn.Module) -> Tuple[str, ...]:
    """Every name of every embedding layer, with its dot: one registered twice (two towers
    sharing it) is listed by named_modules() once but is in state_dict() under both, and
    its shard is no dense state. The plain model's names (:func:`_plain_name`)."""
    wrappers = _wrapper_paths(model)
    return tuple(f"{_plain_name(name, wrappers)}." for name, module in model.named_modules(remove_duplicate=False)
                 if isinstance(module, _ModelParallelEmbedding))


def _model_layout(layers: Dict[str, _ModelParallelEmbedding], dense: Dict[str, Any]) -> str:
    """A model's embedding layers with their settings and its ``dense`` entries
    (:func:`_dense_state`) with their shapes, as text that two ranks' models built alike
    give alike."""
    return json.dumps({"layers": {name: [[str(k), str(v)] for k, v in layer._config().items()]
                                  for name, layer in layers.items()},
                       "dense": {key: list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                                 for key, value in dense.items()}},
                      sort_keys=True)


def _optimizer_param_ids(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """id(param) -> the integer key ``optimizer.state_dict()`` gives it (group order, then param order)."""
    ids: Dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            ids.setdefault(id(param), len(ids))
    return ids


# ---- save -----------------------------------------------------------------------------------


def _nearest_existing(directory: str) -> Optional[str]:
    """``directory`` if it exists, else its nearest ancestor that does (a file included); None if none."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):  # False under a file too (ENOTDIR): look at the parents
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def _file_in_the_way(directory: str) -> Optional[str]:
    """The file that ``directory`` is, or lies under, so that it cannot be a directory; None if none."""
    path = _nearest_existing(directory)
    return None if path is None or os.path.isdir(path) else path


def _check_not_a_file(directory: str, caller: str, fix: str) -> None:
    """Raises NotADirectoryError naming ``directory`` (and the file in the way) when it
    cannot be a directory; the OS error would name only ``LATEST`` under it."""
    blocker = _file_in_the_way(directory)
    if blocker is None:
        return
    where = "is a file" if blocker == os.path.abspath(directory) else f"lies under {blocker!r}, which is a file"
    raise NotADirectoryError(f"{caller}: directory {directory!r} {where}; {fix}")


def _latest_index(directory: str) -> int:
    try:
        with open(os.path.join(directory, _LATEST)) as latest:
            match = _CHECKPOINT_NAME.match(latest.read().strip())
    except FileNotFoundError:
        return 0
    return int(match.group(1)) if match else 0


def _write_file(path: str, write) -> None:
    """Writes ``path`` through ``write(file)`` and flushes it to disk. A failed write is an
    OSError naming ``path``: also one from a flush or fsync (a full disk: an errno, no file
    name), and torch.save's zip writer's, which it raises as a RuntimeError."""
    try:
        with open(path, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), path) from error
    except RuntimeError as error:
        text = str(error)
        if "PytorchStreamWriter" not in text and "inline_container" not in text:
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        raise OSError(errno.EIO, f"torch.save could not write the file ({first}); is the disk full?",
                      path) from error


def _skeleton(value: Any) -> Any:
    """``value`` with every plain dense tensor replaced by an empty one of its dtype: what
    ``torch.load(weights_only=True)`` must accept of it, without the tensors' bytes. The
    containers keep their exact types (a dict subclass is refused by weights_only)."""
    if type(value) is torch.Tensor and value.layout == torch.strided and not value.is_meta and not value.is_quantized:
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((_skeleton(k), _skeleton(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _loads_weights_only(value: Any) -> bool:
    # torch.serialization's own functions: an in-memory round trip, not the file writer
    # (torch.save) that a caller may wrap or patch and whose failures the save reports.
    buffer = io.BytesIO()
    torch.serialization.save(_skeleton(value), buffer)
    buffer.seek(0)
    try:
        torch.serialization.load(buffer, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - UnpicklingError, or whatever a refused global raises
        return False
    return True


def _check_weights_only(file_path: str, payload: Dict[str, Any]) -> None:
    """ValueError naming the entry of ``payload`` that ``torch.load(weights_only=True)``
    would refuse (a numpy scalar or a user's object in a module's extra state or in the
    optimizer's state): such a file would be written, made the latest checkpoint (the
    previous one removed) and then refused by every load as damaged."""
    if _loads_weights_only(payload):
        return
    path, value = "", payload
    while True:
        if type(value) in (dict, collections.OrderedDict):
            children = [(f"[{k!r}]", v) for k, v in value.items()]
        elif type(value) in (list, tuple):
            children = [(f"[{i}]", v) for i, v in enumerate(value)]
        else:
            break
        bad = next(((step, child) for step, child in children if not _loads_weights_only(child)), None)
        if bad is None:
            break
        path, value = path + bad[0], bad[1]
    raise ValueError(f"save_checkpoint: {os.path.basename(file_path)}: entry {path or '(the file)'} holds a "
                     f"{type(value).__module__}.{type(value).__qualname__}, which torch.load(weights_only=True) "
                     "refuses, so no load could read the checkpoint; keep plain tensors, numbers and strings "
                     "in module extra state and optimizer state (e.g. float(x) for a numpy scalar). Nothing "
                     "was committed: the previous checkpoint is kept")


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # named, as _write_file's
        raise OSError(error.errno, error.strerror or str(error), path) from error
    finally:
        os.close(fd)


def _initial_rows(layer: _ModelParallelEmbedding, keys: Tensor) -> Tensor:
    """``layer.initial_rows(keys)`` with the global RNG left where it was: a user's
    initializer that draws from it (``torch.randn``) must not move the training's stream
    (dropout, sampling) because a checkpoint was saved or loaded."""
    devices = [layer.weight.device] if layer.weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return layer.initial_rows(keys)


def _initial_row_state(optimizer: Optional[torch.optim.Optimizer], param: Tensor, key: str) -> float:
    """The value ``optimizer`` gives per-row state ``key`` of a row it has not updated yet:
    Adagrad's ``sum`` starts at its group's ``initial_accumulator_value``; every other
    optimizer's per-row state at 0 (Adam's and LazyAdam's moments, RMSprop's averages...)."""
    if isinstance(optimizer, torch.optim.Adagrad) and key == "sum":
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return float(group.get("initial_accumulator_value", 0.0))
    return 0.0


def _shard_payload(layers: Dict[str, _ModelParallelEmbedding],
                   optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    payload: Dict[str, Any] = {}
    for name, layer in layers.items():
        weight = layer.weight.detach()
        state = optimizer.state.get(layer.weight, {}) if optimizer is not None else {}
        per_row = {key: value for key, value in state.items()
                   if isinstance(value, Tensor) and value.shape == weight.shape}
        scalars = {key: value for key, value in state.items() if key not in per_row}
        if layer.hash_table is not None:
            keys, rows = layer.hash_table.export()
            keys = keys.long()
        else:
            # Only rows that moved away from their initial value or carry optimizer state
            # other than the initial one: the others are re-created by the initializer,
            # whatever the new world size.
            keys = layer.owned_keys()
            touched = (weight != _initial_rows(layer, keys)).any(dim=1)
            for key, value in per_row.items():
                touched |= (value != _initial_row_state(optimizer, layer.weight, key)).flatten(1).any(dim=1)
            rows = touched.nonzero().squeeze(1)
            keys = keys[rows]
        payload[name] = {
            "keys": keys.cpu(),
            "weight": weight[rows].cpu(),
            "state": {key: value[rows].cpu() for key, value in per_row.items()},
            "scalars": {key: value.cpu() if isinstance(value, Tensor) else value for key, value in scalars.items()},
            "has_state": bool(state),
        }
        if layer.hash_table is not None:
            payload[name]["dynamic"] = _dynamic_payload(layer)
    return payload


def _dynamic_payload(layer: _ModelParallelEmbedding) -> Dict[str, Any]:
    """A hash-table layer's scores and pending moment resets (aligned with its saved keys),
    clock, pending admissions and totals: what resharding hands on with each key."""
    table = layer.hash_table.state_dict()
    dynamic: Dict[str, Any] = {"last_seen": table["last_seen"].cpu(), "count": table["count"].cpu(),
                               "clock": layer.hash_table.clock, "evicted": layer._evicted,
                               "admitted": layer._admitted}
    if layer._pending is not None:
        pending = layer._pending.state_dict()
        dynamic["pending"] = {"keys": pending["keys"].long().cpu(), "last_seen": pending["last_seen"].cpu(),
                              "count": pending["count"].cpu(), "clock": layer._pending.clock}
    if layer._fresh_rows is not None:
        dynamic["fresh"] = layer._fresh_rows[:len(layer.hash_table)].cpu()
    return dynamic


def _dense_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module,
                           ids: Dict[int, int]) -> Dict[str, Any]:
    """``optimizer.state_dict()`` without the state of embedding shards (saved by key instead);
    ``ids``: :func:`_optimizer_param_ids` of the optimizer."""
    state_dict = optimizer.state_dict()
    embedding_ids = {ids[id(p)] for p in model.parameters() if is_embedding_variable(p) and id(p) in ids}
    state_dict["state"] = {index: value for index, value in state_dict["state"].items() if index not in embedding_ids}
    state_dict["param_groups"] = [{key: _plain(value) for key, value in group.items()}
                                  for group in state_dict["param_groups"]]
    return state_dict


def _plain(value: Any) -> Any:
    """A setting as the plain Python number that ``torch.load(weights_only=True)`` reads back:
    an LR scheduler's numpy float, or a ``Fraction``, would make ``dense.pt`` unreadable
    there (tuples such as ``betas`` element by element)."""
    if isinstance(value, (tuple, list)):  # a plain tuple or list (a namedtuple's fields stay in order)
        return (list if isinstance(value, list) else tuple)(_plain(v) for v in value)
    # By exact type: numpy's float64 is a float subclass that weights_only refuses.
    if type(value) in (bool, int, float, str) or isinstance(value, Tensor) or value is None:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def save_checkpoint(directory: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """Saves ``model`` (and ``optimizer``) under ``directory``; collective: every rank calls it.

    Each rank writes the embedding rows it owns, by key, with their optimizer state; rank 0
    writes the dense parameters, buffers and their optimizer state (identical on every rank
    under DDP). Atomic: until the new checkpoint is complete on every rank, ``LATEST`` keeps
    naming the previous one.

    Args:
        directory: a directory every rank can reach; created when missing.
        model: the model (a DDP wrapper is looked through); its
            :class:`~sparsekit.DistributedEmbedding` / :class:`~sparsekit.All2AllDenseEmbedding`
            layers are saved by key, everything else as in ``state_dict()``.
        optimizer: optional; e.g. :class:`~sparsekit.LazyAdam`. Per-row state tensors (the
            shape of the embedding weight) are saved by key, the rest (``step``) as is.

    Returns:
        The path of the checkpoint written.

    Raises:
        NotADirectoryError: ``directory`` is a file or lies under one.
        TypeError: ``model`` is not a ``torch.nn.Module`` or ``optimizer`` not a
            ``torch.optim.Optimizer``.
        ValueError: the ranks' models differ (embedding layers, their settings, or the
            dense parameters' names and shapes); nothing is written.
        OtherRankError: writing failed on another rank (its error names the cause); a
            RuntimeError.
    """
    group, world_size, rank = _world()
    layers: Dict[str, _ModelParallelEmbedding] = {}
    dense_state: Dict[str, Any] = {}
    error: Optional[BaseException] = None
    index = 0
    layout = ""
    try:
        _check_directory_argument("save_checkpoint", directory)
        model, layers = _model_and_layers("save_checkpoint", model, optimizer)
        dense_state = _dense_state(model, layers)
        layout = _model_layout(layers, dense_state)
        _check_not_a_file(directory, "save_checkpoint", "give a directory (it is created when missing)")
        index = _latest_index(directory) + 1  # every rank reads LATEST before rank 0 may change it
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below (a rank alone would hang the rest)
        error = exc
    _agree_or_raise(group, error, "save_checkpoint (reading the directory)")
    differing = _ranks_differing(group, str(index))
    if differing:
        raise RuntimeError(f"save_checkpoint: rank(s) {differing} found another latest checkpoint in {directory!r} "
                           "than rank 0; every rank must save to one directory that they all reach (a shared "
                           "file system); nothing was written")
    # Rank 0 alone writes the metadata and the dense state: a rank whose model differs
    # (another layer, dim or kind of table) would write shards no load can read.
    differing = _ranks_differing(group, layout)
    if differing:
        raise ValueError(f"save_checkpoint: rank(s) {differing} hold other embedding layers, layer settings or dense "
                         f"parameters than rank 0 (this rank's layers: {sorted(layers)}); every rank must save the "
                         "same model; nothing was written")
    _check_optimizer_everywhere(group, "save_checkpoint", optimizer)
    name = f"ckpt-{index:06d}"
    final_dir = os.path.join(directory, name)
    temp_dir = final_dir + ".tmp"

    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(temp_dir, ignore_errors=True)  # a crashed save's leftovers
            os.makedirs(temp_dir)
        except OSError as exc:
            # os's message ("[Errno 2] No such file or directory: '/a'") names no call and only the
            # part of the path it stopped at: the same OSError type, naming both.
            error = type(exc)(f"save_checkpoint: cannot create the checkpoint directory in "
                              f"{os.fspath(directory)!r}: {exc.strerror or exc} ({exc.filename!r})")
            error.errno = exc.errno
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
    _agree_or_raise(group, error, "save_checkpoint (creating the directory)")

    try:
        if not os.path.isdir(temp_dir):
            raise FileNotFoundError(f"save_checkpoint: {temp_dir!r}, which rank 0 made, is not there on rank {rank}; "
                                    "every rank must save to one directory that they all reach (a shared file "
                                    "system)")
        shard = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size,
                 "layers": _shard_payload(layers, optimizer)}
        shard_path = os.path.join(temp_dir, _shard_name(rank, world_size))
        _check_weights_only(shard_path, shard)
        _write_file(shard_path, lambda f: torch.save(shard, f))
        if rank == 0:
            param_ids = _optimizer_param_ids(optimizer) if optimizer is not None else {}
            dense = {"format": FORMAT_VERSION, "model": {k: v.cpu() if isinstance(v, Tensor) else v
                                                         for k, v in dense_state.items()},
                     "optimizer": (_dense_optimizer_state(optimizer, model, param_ids) if optimizer is not None
                                   else None)}
            _check_weights_only(os.path.join(temp_dir, "dense.pt"), dense)
            _write_file(os.path.join(temp_dir, "dense.pt"), lambda f: torch.save(dense, f))
            metadata = {
                "format": FORMAT_VERSION,
                # Tells two checkpoints of one model apart: the ranks of a load compare it.
                "id": uuid.uuid4().hex,
                "world_size": world_size,
                "has_optimizer": optimizer is not None,
                "shards": [_shard_name(r, world_size) for r in range(world_size)],
                "layers": {layer_name: {"type": type(layer).__name__,
                                        "embedding_vec_size": layer.embedding_vec_size,
                                        "max_vocabulary_size_per_gpu": layer.max_vocabulary_size_per_gpu,
                                        "use_hashtable": layer.use_hashtable,
                                        "world_size": layer.world_size,
                                        # A collection's table: loads into the table of this name.
                                        **_table_entry(layer),
                                        # Its weight's place in the optimizer's state_dict.
                                        **({"optimizer_index": param_ids[id(layer.weight)]}
                                           if id(layer.weight) in param_ids else {})}
                           for layer_name, layer in layers.items()},
            }
            _write_file(os.path.join(temp_dir, "metadata.json"),
                        lambda f: f.write(json.dumps(metadata, indent=2).encode()))
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree_or_raise(group, error, "save_checkpoint (writing the shards)")

    if rank == 0:
        try:
            _commit(directory, temp_dir, final_dir, name)
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
    _agree_or_raise(group, error, "save_checkpoint (committing)")
    return final_dir


def _table_entry(layer: _ModelParallelEmbedding) -> Dict[str, str]:
    """``{"table": name}`` for a table of an EmbeddingBagCollection, else ``{}``."""
    table = layer._config().get("table")
    return {"table": table} if isinstance(table, str) else {}


def _shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def _commit(directory: str, temp_dir: str, final_dir: str, name: str) -> None:
    """Makes the written checkpoint the latest: rename the directory, then replace LATEST."""
    _fsync_directory(temp_dir)
    shutil.rmtree(final_dir, ignore_errors=True)  # written by a save that crashed before LATEST moved
    os.replace(temp_dir, final_dir)
    _fsync_directory(directory)
    latest_temp = os.path.join(directory, _LATEST + ".tmp")
    _write_file(latest_temp, lambda f: f.write(name.encode()))
    os.replace(latest_temp, os.path.join(directory, _LATEST))
    _fsync_directory(directory)
    for entry in os.listdir(directory):
        match = _CHECKPOINT_NAME.match(entry)
        if match and entry != name:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


# ---- load -----------------------------------------------------------------------------------


def _load(path: str) -> Any:
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


def _read_metadata(path: str) -> Dict[str, Any]:
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


def _without_data(value: Any) -> Optional[str]:
    """``"meta"`` or the layout (``"torch.sparse_coo"``, ...) of a tensor whose values a load
    cannot read as a dense tensor's; None for anything else."""
    if isinstance(value, Tensor) and (value.is_meta or value.layout != torch.strided):
        return "meta" if value.is_meta else str(value.layout)
    return None


def _check_shard(shard_path: str, shard: Any, metadata: Dict[str, Any]) -> None:
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
            kind = _without_data(value)
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


def _checkpoint_dir(directory: str) -> str:
    _check_not_a_file(directory, "load_checkpoint", "give the directory that save_checkpoint was given")
    try:
        with open(os.path.join(directory, _LATEST)) as latest:
            name = latest.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: no checkpoint in {directory!r} (no {_LATEST} file); "
                                "save one with sk.save_checkpoint") from None
    if not _CHECKPOINT_NAME.match(name):
        raise ValueError(f"load_checkpoint: {os.path.join(directory, _LATEST)} names {name!r}, not a checkpoint")
    return os.path.join(directory, name)


def _saved_layers_of(layers: Dict[str, _ModelParallelEmbedding], saved: Dict[str, Any]) -> Dict[str, str]:
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
            f"{_tables_in(layers, collection, lambda n: _table_entry(layers[n]).get('table'))}: {what}; build "
            "the collection with the saved tables (in any order)")

    sources: Dict[str, str] = {}
    for name, layer in layers.items():
        table = _table_entry(layer).get("table")
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
                         if _table_entry(layer).get("table") is not None}
    for (collection, table), saved_name in saved_tables.items():
        if collection in model_collections and saved_name not in loaded:
            raise differ(collection, f"the model has no table {table!r}")
    return sources


def _check_moved_groups(layers: Dict[str, _ModelParallelEmbedding], sources: Dict[str, str], saved: Dict[str, Any],
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
    groups = dense["optimizer"]["param_groups"]  # present and well formed: _check_dense raised otherwise
    saved_group = {index: g for g, group in enumerate(groups) for index in group["params"]}
    ids = _optimizer_param_ids(optimizer)

    def settings(g: int) -> Dict[str, Any]:
        return {key: value for key, value in groups[g].items() if key != "params"}

    wrong = []
    for name in moved:
        source_index = saved[sources[name]].get("optimizer_index")
        place = ids.get(id(layers[name].weight))
        # The saved state numbers parameters group by group, as _optimizer_param_ids does, and
        # load_state_dict hands the weight at ``place`` the settings of saved parameter ``place``.
        if source_index not in saved_group or place not in saved_group:
            continue
        if settings(saved_group[place]) != settings(saved_group[source_index]):
            table = _table_entry(layers[name]).get("table", name)
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


def _is_lazy_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a LazyAdam, or a wrapper whose ``load_state_dict`` is one's."""
    owner = getattr(getattr(optimizer, "load_state_dict", None), "__self__", None)
    return isinstance(optimizer, LazyAdam) or isinstance(owner, LazyAdam)


# LazyAdam's next update of a layer is step + 1, an int64 (sparsekit.ops.lazy_adam_).
_MAX_SAVED_STEP = 2**63 - 2


def _check_part_state(shard_path: str, name: str, part: Dict[str, Any], layer: _ModelParallelEmbedding,
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


def _layer_text(name: str, layer: _ModelParallelEmbedding) -> str:
    """How a load's errors name a layer: its module name, and a collection's table by its
    table name too (``'shards.0' (table 'users')``)."""
    config = getattr(layer, "config", None)
    table = getattr(config, "name", None)
    return f"{name!r} (table {table!r})" if isinstance(table, str) else repr(name)


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
    more of the saved state, see :func:`_check_part_state`)."""
    lazy_adam = _is_lazy_adam(optimizer)
    # A collection's table loaded from another position is named as both.
    shown = _layer_text(name, layer) if saved_name == name else f"{_layer_text(name, layer)} (saved as {saved_name!r})"
    if saved_meta["embedding_vec_size"] != layer.embedding_vec_size:
        raise ValueError(f"load_checkpoint: layer {shown} was saved with {layer._dim_argument} "
                         f"{saved_meta['embedding_vec_size']} but has {layer.embedding_vec_size}")
    parts = [shard["layers"][saved_name] for shard in shards]
    for shard_path, part in zip(shard_paths, parts):
        _check_part_state(shard_path, saved_name, part, layer, lazy_adam)  # the file's entry
    keys = torch.cat([part["keys"] for part in parts])
    _check_key_range(name, layer, keys, "key")
    if layer.hash_table is None and keys.numel() > 0:
        _check_direct_keys(name, layer, keys)  # all of them: every rank names the same key
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
    initial_state = {key: _initial_row_state(optimizer, layer.weight, key) for key in state_names}
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
        first = _first_of_each(keys)
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
            _check_key_range(name, layer, pending["keys"], "pending key")
            if pending["keys"].numel() > 0:
                once = _first_of_each(pending["keys"])
                if once is not None:
                    pending = {field: value[once] for field, value in pending.items()}
            ours = _owners(pending["keys"], layer.world_size, layer.owner_offset) == layer.rank
            pending = {field: value[ours] for field, value in pending.items()}
            pending["clock"] = max(int(p["clock"]) for p in pendings)
            dynamic["pending"] = pending
    fresh = state.pop("\0fresh")
    if layer._fresh_rows is None and bool(fresh.any()):
        # This layer keeps no pending resets (it does not evict): the saved moments of those
        # keys are still the evicted keys', so they are reset now.
        state = {key: value.masked_fill(fresh.view((-1,) + (1,) * (value.dim() - 1)), initial_state[key])
                 for key, value in state.items()}
    if dynamic is not None:
        dynamic["fresh"] = fresh
    capacity = layer.max_vocabulary_size_per_gpu
    if layer.hash_table is not None and keys.numel() > capacity:
        raise HashTableFullError(
            f"load_checkpoint: layer {_layer_text(name, layer)} on rank {layer.rank} of {layer.world_size} must hold "
            f"{keys.numel()} saved keys but {layer._capacity_argument} is {capacity}; build it with a larger "
            f"{layer._capacity_argument} or load on more ranks")
    if dynamic is not None and layer._pending is not None and "pending" in dynamic:
        waiting = dynamic["pending"]["keys"].numel()
        if waiting > layer.admission_capacity:
            # The least recently seen are forgotten, as the pending table evicts in training:
            # on a tie the smaller key goes (DESIGN.md's rule), whatever order the saved ranks
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


def _check_direct_keys(name: str, layer: _ModelParallelEmbedding, keys: Tensor) -> None:
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
        f"load_checkpoint: layer {_layer_text(name, layer)} (use_hashtable=False): the checkpoint holds key "
        f"{low if low < 0 else high}{more} but the layer's keys must lie in [0, {capacity}) on {layer.world_size} "
        f"ranks; {fix}")


def _check_key_range(name: str, layer: _ModelParallelEmbedding, keys: Tensor, what: str) -> None:
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


def _check_restore(name: str, restore: _LayerRestore) -> None:
    """Works out, before any rank writes, everything :func:`_apply_layer` writes that could
    fail: the tables' states (distinct keys of the layer's key dtype, capacity, scores,
    clocks) and a direct layer's initial rows (the user's initializer may raise)."""
    layer, dynamic = restore.layer, restore.dynamic
    if layer.hash_table is None:
        # Held until the write: one weight-sized tensor per direct layer for the load's length.
        with torch.no_grad():
            restore.initial = _initial_rows(layer, layer.owned_keys())
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


def _first_of_each(keys: Tensor) -> Optional[Tensor]:
    """Index of the first occurrence of each distinct key; None when the keys are distinct."""
    unique_keys, inverse = ops.unique(keys)
    if unique_keys.numel() == keys.numel():
        return None
    first = torch.full((unique_keys.numel(),), keys.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.numel()), reduce="amin")
    return first


def _check_dense(dense_path: str, dense: Any, expected: Dict[str, Tensor],
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
            kind = _without_data(value)
            if kind:
                # It would fail inside optimizer.load_state_dict or the next step, naming no file.
                raise ValueError(f"load_checkpoint: {dense_path}: optimizer state {name!r} of parameter {index} is a "
                                 f"{kind} tensor; the dense state holds dense (strided) tensors with data; the "
                                 "checkpoint is damaged")
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"load_checkpoint: optimizer state {name!r} of parameter {index} was saved with "
                                 f"shape {list(value.shape)} but the parameter has {list(params[index].shape)}")


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
        if layer._fresh_rows is not None:
            layer._fresh_rows.zero_()
            layer._fresh_rows[rows] = dynamic["fresh"].to(device)
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


def load_checkpoint(directory: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> str:
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

    Returns:
        The path of the checkpoint loaded.

    Raises:
        FileNotFoundError: no checkpoint in ``directory``.
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
    group, _, _ = _world()
    path = None
    restores: List[_LayerRestore] = []
    dense: Dict[str, Any] = {}
    error: Optional[BaseException] = None
    try:
        _check_directory_argument("load_checkpoint", directory)
        model, layers = _model_and_layers("load_checkpoint", model, optimizer)
        path = _checkpoint_dir(directory)
        metadata = _read_metadata(path)
        metadata["layers"] = _compile_names_dropped(metadata["layers"])
        sources = _saved_layers_of(layers, metadata["layers"])
        if sorted(sources.values()) != sorted(metadata["layers"]):
            raise ValueError(f"load_checkpoint: the checkpoint has embedding layers {sorted(metadata['layers'])} "
                             f"but the model has {sorted(layers)}")
        shards, shard_paths = [], []
        for shard_name in metadata["shards"]:
            shard_paths.append(os.path.join(path, shard_name))
            shards.append(_load(shard_paths[-1]))
            if isinstance(shards[-1], dict) and isinstance(shards[-1].get("layers"), dict):
                shards[-1]["layers"] = _compile_names_dropped(shards[-1]["layers"])
            _check_shard(shard_paths[-1], shards[-1], metadata)
        restores = [_gather_layer(name, layer, shards, shard_paths, sources[name], metadata["layers"][sources[name]],
                                  optimizer)
                    for name, layer in layers.items()]
        dense = _load(os.path.join(path, "dense.pt"))
        if isinstance(dense, dict) and isinstance(dense.get("model"), dict):
            dense["model"] = _compile_names_dropped(dense["model"])
        _check_dense(os.path.join(path, "dense.pt"), dense, _dense_state(model, layers), optimizer, metadata,
                     _layer_prefixes(model) if "" not in layers else ())
        _check_moved_groups(layers, sources, metadata["layers"], dense, optimizer)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    # Nothing has been written on any rank yet: every rank raises, or every rank loads.
    _agree_or_raise(group, error, "load_checkpoint")
    differing = _ranks_differing(group, os.path.basename(path) + json.dumps(metadata, sort_keys=True))
    if differing:
        raise ValueError(f"load_checkpoint: rank(s) {differing} found another checkpoint in {directory!r} than rank 0 "
                         f"({os.path.basename(path)} here); every rank must load one checkpoint from a directory "
                         "that they all reach (a shared file system); nothing was changed")
    _check_optimizer_everywhere(group, "load_checkpoint", optimizer)

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
        wrappers = _wrapper_paths(model)
        named = {_plain_name(key, wrappers): key for key in model.state_dict()}  # the model's own names
        model.load_state_dict({named[key]: value for key, value in dense["model"].items()}, strict=False)
        for restore in restores:
            _apply_layer(restore, optimizer)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below, then re-raised
        error = exc
    # A fault in the writing phase (out of memory, a KeyboardInterrupt) on one rank left it
    # partly loaded while the others returned as if the load had succeeded: the failing rank
    # could not load again alone (a collective), and its next collective paired with the
    # others' next step. Every rank raises instead, so every rank can load again together.
    if not _all_ok(group, error is None):
        if error is not None:
            raise error
        raise OtherRankError("load_checkpoint failed on another rank while writing the loaded state (see the error "
                             "there): this rank holds the checkpoint, that rank is partly loaded; call "
                             "load_checkpoint again on every rank")
    return path

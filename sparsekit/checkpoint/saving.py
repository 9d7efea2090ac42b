"""What :func:`save_checkpoint` writes into one checkpoint: the model and optimizer payload.

Each rank writes one shard file with the embedding rows it owns, by key, their per-row
optimizer state, scalars and (hash tables) scores and pending admissions; rank 0 writes
the dense parameters and buffers with their optimizer state, and the metadata; every
rank may add files of its own (``extra``). Everything is checked to load with
``torch.load(weights_only=True)`` before it is written, and nothing becomes the latest
checkpoint unless every rank wrote its part (:mod:`sparsekit.checkpoint.layout` commits).
"""

from __future__ import annotations

import collections
import io
import json
import numbers
import os
import re
import uuid
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..shard import _ModelParallelEmbedding, is_embedding_variable
from . import layout
from .collective import agree_or_raise, check_optimizer_everywhere, ranks_differing, world
from .layout import CheckpointDirectory, check_not_a_file, check_step
from .model_state import (FORMAT_VERSION, check_directory_argument, dense_state_of, initial_row_state, initial_rows,
                          model_and_layers, model_layout, optimizer_param_ids, table_entry)

__all__ = ["save_checkpoint"]


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
            touched = (weight != initial_rows(layer, keys)).any(dim=1)
            for key, value in per_row.items():
                touched |= (value != initial_row_state(optimizer, layer.weight, key)).flatten(1).any(dim=1)
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
    if layer.fresh_rows is not None:
        dynamic["fresh"] = layer.fresh_rows[:len(layer.hash_table)].cpu()
    return dynamic


def _dense_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module,
                           ids: Dict[int, int]) -> Dict[str, Any]:
    """``optimizer.state_dict()`` without the state of embedding shards (saved by key instead);
    ``ids``: :func:`optimizer_param_ids` of the optimizer."""
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


def save_checkpoint(directory: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None, extra: Optional[Mapping[str, Any]] = None,
                    keep: Optional[int] = 1) -> str:
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
        step: the number of the checkpoint, ``ckpt-NNNNNN`` (e.g. the training step);
            default: one more than the one ``LATEST`` names (1 in a new directory). A
            checkpoint of the same number is replaced.
        extra: this rank's own files to add to the checkpoint, file name -> object (plain
            tensors, numbers, strings and containers of them, as ``torch.load(
            weights_only=True)`` reads them), written with ``torch.save`` and committed
            with the rest (e.g. a trainer's RNG state per rank). The names of different
            ranks' files must differ; they cannot be the checkpoint's own
            (``metadata.json``, ``dense.pt``, ``shard-*``).
        keep: after the switch, the number of checkpoints kept: the one written and the
            newest others (see :meth:`CheckpointDirectory.prune`); None keeps every one.

    Returns:
        The path of the checkpoint written.

    Raises:
        NotADirectoryError: ``directory`` is a file or lies under one.
        TypeError: ``model`` is not a ``torch.nn.Module`` or ``optimizer`` not a
            ``torch.optim.Optimizer``.
        ValueError: the ranks' models differ (embedding layers, their settings, or the
            dense parameters' names and shapes), or ``step``, ``extra`` or ``keep`` is
            invalid; nothing is written.
        OtherRankError: writing failed on another rank (its error names the cause); a
            RuntimeError.
    """
    group, world_size, rank = world()
    layers: Dict[str, _ModelParallelEmbedding] = {}
    dense_state: Dict[str, Any] = {}
    error: Optional[BaseException] = None
    index = 0
    model_text = ""
    try:
        check_directory_argument("save_checkpoint", directory)
        model, layers = model_and_layers("save_checkpoint", model, optimizer)
        dense_state = dense_state_of(model, layers)
        model_text = model_layout(layers, dense_state)
        check_not_a_file(directory, "save_checkpoint", "give a directory (it is created when missing)")
        checkpoints = CheckpointDirectory(directory)
        # Every rank reads LATEST before rank 0 may change it.
        index = checkpoints.next_step() if step is None else check_step("save_checkpoint", step)
        extra = _checked_extra(extra)
        for file_name, value in extra.items():  # before anything is written
            _check_weights_only(file_name, value)
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"save_checkpoint: keep must be an int >= 1 or None, got {keep!r}")
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below (a rank alone would hang the rest)
        error = exc
    agree_or_raise(group, error, "save_checkpoint (reading the directory)")
    differing = ranks_differing(group, f"{index} {keep}")
    if differing:
        raise RuntimeError(f"save_checkpoint: rank(s) {differing} found another latest checkpoint in {directory!r} "
                           "than rank 0, or were given another step or keep; every rank must save to one directory "
                           "that they all reach (a shared file system), with the same step and keep; nothing was "
                           "written")
    # Rank 0 alone writes the metadata and the dense state: a rank whose model differs
    # (another layer, dim or kind of table) would write shards no load can read.
    differing = ranks_differing(group, model_text)
    if differing:
        raise ValueError(f"save_checkpoint: rank(s) {differing} hold other embedding layers, layer settings or dense "
                         f"parameters than rank 0 (this rank's layers: {sorted(layers)}); every rank must save the "
                         "same model; nothing was written")
    check_optimizer_everywhere(group, "save_checkpoint", optimizer)
    temp_dir = checkpoints.checkpoint(index) + ".tmp"

    if rank == 0:
        try:
            checkpoints.prepare(index)
        except OSError as exc:
            # os's message ("[Errno 2] No such file or directory: '/a'") names no call and only the
            # part of the path it stopped at: the same OSError type, naming both.
            error = type(exc)(f"save_checkpoint: cannot create the checkpoint directory in "
                              f"{os.fspath(directory)!r}: {exc.strerror or exc} ({exc.filename!r})")
            error.errno = exc.errno
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
    agree_or_raise(group, error, "save_checkpoint (creating the directory)")

    try:
        if not os.path.isdir(temp_dir):
            raise FileNotFoundError(f"save_checkpoint: {temp_dir!r}, which rank 0 made, is not there on rank {rank}; "
                                    "every rank must save to one directory that they all reach (a shared file "
                                    "system)")
        shard = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size,
                 "layers": _shard_payload(layers, optimizer)}
        shard_path = os.path.join(temp_dir, _shard_name(rank, world_size))
        _check_weights_only(shard_path, shard)
        layout.write_file(shard_path, lambda f: torch.save(shard, f))
        for file_name, value in extra.items():  # checked above
            layout.write_file(os.path.join(temp_dir, file_name), lambda f, value=value: torch.save(value, f))
        if rank == 0:
            param_ids = optimizer_param_ids(optimizer) if optimizer is not None else {}
            dense = {"format": FORMAT_VERSION, "model": {k: v.cpu() if isinstance(v, Tensor) else v
                                                         for k, v in dense_state.items()},
                     "optimizer": (_dense_optimizer_state(optimizer, model, param_ids) if optimizer is not None
                                   else None)}
            _check_weights_only(os.path.join(temp_dir, "dense.pt"), dense)
            layout.write_file(os.path.join(temp_dir, "dense.pt"), lambda f: torch.save(dense, f))
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
                                        **table_entry(layer),
                                        # Its weight's place in the optimizer's state_dict.
                                        **({"optimizer_index": param_ids[id(layer.weight)]}
                                           if id(layer.weight) in param_ids else {})}
                           for layer_name, layer in layers.items()},
            }
            layout.write_file(os.path.join(temp_dir, "metadata.json"),
                              lambda f: f.write(json.dumps(metadata, indent=2).encode()))
    except BaseException as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    agree_or_raise(group, error, "save_checkpoint (writing the shards)")

    if rank == 0:
        try:
            checkpoints.commit(index, keep)
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
    agree_or_raise(group, error, "save_checkpoint (committing)")
    return checkpoints.checkpoint(index)


def _shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


_OWN_FILE = re.compile(r"^(metadata\.json|dense\.pt|shard-.*)$")


def _checked_extra(extra: Any) -> Dict[str, Any]:
    """``extra`` as a dict of plain file names (see :func:`save_checkpoint`); a TypeError or
    ValueError naming the first bad entry otherwise."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"save_checkpoint: extra must be a mapping of file name -> object, got "
                        f"{type(extra).__name__}")
    for name in extra:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError(f"save_checkpoint: extra file name {name!r} must be a plain file name")
        if _OWN_FILE.match(name) or name.endswith(".tmp"):
            raise ValueError(f"save_checkpoint: extra file name {name!r} is the checkpoint's own "
                             "(metadata.json, dense.pt, shard-*); choose another")
    return dict(extra)

"""How a model and optimizer map onto a checkpoint: names, embedding layers, dense state.

Checkpoints name every parameter and layer as the plain model does: wrappers
(DistributedDataParallel's ``module.``, torch.compile's ``_orig_mod.``) are looked
through, at the top and on submodules, so a wrapped model and the plain one save and load
each other's checkpoints. Embedding layers (model-parallel, saved by key) are told apart
from the dense state (saved by rank 0 as in ``state_dict()``), and a model's layout is
summarized as text the ranks compare before writing. Also the initial rows and per-row
optimizer state a layer's untouched rows hold, which neither save nor load stores.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch
from torch import Tensor, nn

from ..shard import _ModelParallelEmbedding

__all__ = ["FORMAT_VERSION", "check_directory_argument", "compile_names_dropped", "dense_state_of",
           "initial_row_state", "initial_rows", "layer_prefixes", "model_and_layers", "model_layout",
           "optimizer_param_ids", "plain_name", "table_entry", "unwrap", "wrapper_paths"]

# The version of the checkpoint format (metadata.json, dense.pt and shard files).
FORMAT_VERSION = 1


def check_directory_argument(caller: str, directory: Any) -> None:
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


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its wrappers: DistributedDataParallel adds "module." to every name
    and torch.compile "_orig_mod."; checkpoints carry neither, so a compiled or wrapped
    model and the plain one save and load each other's (wrapped submodules too: see
    :func:`plain_name`)."""
    while (attribute := _wrapped_attribute(model)) is not None:
        model = getattr(model, attribute)
    return model


def wrapper_paths(model: nn.Module) -> FrozenSet[str]:
    """The names a wrapped submodule's wrapper adds (``"tower.module"`` for a DDP-wrapped
    ``tower``, ``"emb._orig_mod"`` for a compiled ``emb``), as named_modules() and
    state_dict() spell them."""
    return frozenset(f"{name}.{attribute}" if name else attribute
                     for name, module in model.named_modules(remove_duplicate=False)
                     if (attribute := _wrapped_attribute(module)) is not None)


def plain_name(name: str, wrappers: FrozenSet[str]) -> str:
    """``name`` without the segments of ``wrappers`` (:func:`wrapper_paths`): the name the
    plain model gives the same module, parameter or buffer."""
    if not wrappers:
        return name
    kept, path = [], ""
    for part in name.split("."):
        path = f"{path}.{part}" if path else part
        if path not in wrappers:
            kept.append(part)
    return ".".join(kept)


def compile_names_dropped(entries: Dict[str, Any]) -> Dict[str, Any]:
    """``entries`` under names without torch.compile's "_orig_mod" segments: checkpoints
    saved before names were made plain (:func:`plain_name`) kept them for a compiled
    submodule."""
    return {".".join(part for part in name.split(".") if part != "_orig_mod") if isinstance(name, str) else name:
            value for name, value in entries.items()}


def _embedding_layers(model: nn.Module) -> Dict[str, _ModelParallelEmbedding]:
    wrappers = wrapper_paths(model)
    return {plain_name(name, wrappers): module for name, module in model.named_modules()
            if isinstance(module, _ModelParallelEmbedding)}


_OPTIMIZER_API = ("param_groups", "state", "state_dict", "load_state_dict")


def model_and_layers(caller: str, model: Any,
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
    model = unwrap(model)
    return model, _embedding_layers(model)


def dense_state_of(model: nn.Module, layers: Dict[str, _ModelParallelEmbedding]) -> Dict[str, Tensor]:
    """``model.state_dict()`` without the embedding layers, under the plain model's names."""
    if "" in layers:  # the model is itself an embedding layer
        return {}
    wrappers = wrapper_paths(model)
    prefixes = layer_prefixes(model)
    dense = {plain_name(key, wrappers): value for key, value in model.state_dict().items()}
    return {key: value for key, value in dense.items() if not key.startswith(prefixes)}


def layer_prefixes(model: nn.Module) -> Tuple[str, ...]:
    """Every name of every embedding layer, with its dot: one registered twice (two towers
    sharing it) is listed by named_modules() once but is in state_dict() under both, and
    its shard is no dense state. The plain model's names (:func:`plain_name`)."""
    wrappers = wrapper_paths(model)
    return tuple(f"{plain_name(name, wrappers)}." for name, module in model.named_modules(remove_duplicate=False)
                 if isinstance(module, _ModelParallelEmbedding))


def model_layout(layers: Dict[str, _ModelParallelEmbedding], dense: Dict[str, Any]) -> str:
    """A model's embedding layers with their settings and its ``dense`` entries
    (:func:`dense_state_of`) with their shapes, as text that two ranks' models built alike
    give alike."""
    return json.dumps({"layers": {name: [[str(k), str(v)] for k, v in layer._config().items()]
                                  for name, layer in layers.items()},
                       "dense": {key: list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                                 for key, value in dense.items()}},
                      sort_keys=True)


def optimizer_param_ids(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """id(param) -> the integer key ``optimizer.state_dict()`` gives it (group order, then param order)."""
    ids: Dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            ids.setdefault(id(param), len(ids))
    return ids


def initial_rows(layer: _ModelParallelEmbedding, keys: Tensor) -> Tensor:
    """``layer.initial_rows(keys)`` with the global RNG left where it was: a user's
    initializer that draws from it (``torch.randn``) must not move the training's stream
    (dropout, sampling) because a checkpoint was saved or loaded."""
    devices = [layer.weight.device] if layer.weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return layer.initial_rows(keys)


def initial_row_state(optimizer: Optional[torch.optim.Optimizer], param: Tensor, key: str) -> float:
    """The value ``optimizer`` gives per-row state ``key`` of a row it has not updated yet:
    Adagrad's ``sum`` starts at its group's ``initial_accumulator_value``; every other
    optimizer's per-row state at 0 (Adam's and LazyAdam's moments, RMSprop's averages...)."""
    if isinstance(optimizer, torch.optim.Adagrad) and key == "sum":
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return float(group.get("initial_accumulator_value", 0.0))
    return 0.0


def table_entry(layer: _ModelParallelEmbedding) -> Dict[str, str]:
    """``{"table": name}`` for a table of an EmbeddingBagCollection, else ``{}``."""
    table = layer._config().get("table")
    return {"table": table} if isinstance(table, str) else {}

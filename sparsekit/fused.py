"""The fused optimizer of an :class:`~sparsekit.EmbeddingBagCollection`: applied by the
backward of the collection's pooled read to the rows it touched, in the same pass, with no
gradient materialised (FBGEMM TBE's "optimizer in backward").

Built by the collection from its ``fused_params`` and exposed as ``ebc.fused_optimizer``:
a ``torch.optim.Optimizer`` over the tables' weights whose ``step()`` does nothing (the
update already happened), so LR schedulers drive it and ``state_dict()`` /
``load_state_dict()`` round-trip its state.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch import Tensor, nn

from ._checks import holds_values
from .allocator import huge_tables, table_full, table_zeros
from .pooled import FusedStep

__all__ = ["FusedOptimizer", "FUSED_OPTIMIZERS"]

# The optimizers, by the names the op takes, and the TorchRec / FBGEMM names taken for them.
FUSED_OPTIMIZERS = ("sgd", "lazy_adam", "rowwise_adagrad", "adagrad")
# FBGEMM's EmbOptimType members are taken too, by their values ("exact_row_wise_adagrad").
_ALIASES = {"exact_sgd": "sgd", "adam": "lazy_adam", "exact_rowwise_adagrad": "rowwise_adagrad",
            "exact_row_wise_adagrad": "rowwise_adagrad", "exact_adagrad": "adagrad"}
# fused_params keys, with the TorchRec spellings taken for them.
_PARAM_ALIASES = {"learning_rate": "lr"}
# Each optimizer's state entries per table.
_STATE_NAMES = {"lazy_adam": ("step", "exp_avg", "exp_avg_sq"), "rowwise_adagrad": ("sum",), "adagrad": ("sum",),
                "sgd": ()}
_SETTINGS = ("optimizer", "lr", "betas", "beta1", "beta2", "eps", "weight_decay", "initial_accumulator_value")


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        return False


def _real(where: str, name: str, value: Any, upper: Optional[float] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) \
            or value < 0 or (upper is not None and value >= upper):
        bound = f"in [0, {upper:g})" if upper is not None else ">= 0"
        raise ValueError(f"{where}: {name} must be a finite real number {bound}, got {value!r}")
    return float(value)


def _check_lr(where: str, lr: Any) -> Any:
    """A float lr, or a one-element floating-point tensor (a scheduler, or a captured step,
    changes it in place; read by the update on its device, with no host sync)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64) or lr.requires_grad \
                or not holds_values(lr):
            raise ValueError(f"{where}: a tensor lr must be a dense float32 or float64 tensor of one element, with "
                             f"data (not on the meta device), that does not require grad, got {lr.dtype} of shape "
                             f"{tuple(lr.shape)} on {lr.device}")
        if lr.device.type == "cpu" and not (bool(torch.isfinite(lr)) and bool(lr >= 0)):  # free to read
            raise ValueError(f"{where}: lr must be a finite real number >= 0, got {lr.item()!r}")
        return lr
    return _real(where, "lr", lr)


class FusedOptimizer(torch.optim.Optimizer):
    """The update a collection's backward applies to its tables.

    Args:
        params: the tables' weights (one parameter group).
        optimizer: ``"lazy_adam"`` (``lazy_adam_``'s update, moments of each row touched;
            TorchRec's ``"adam"`` means it too), ``"sgd"`` (``w -= lr * (g + weight_decay *
            w)``), ``"rowwise_adagrad"`` (FBGEMM's exact row-wise Adagrad: one float of
            state per row, the running sum of its mean squared gradient) or ``"adagrad"``
            (FBGEMM's exact Adagrad, ``torch.optim.Adagrad`` without lr decay: a running sum
            of squares per element).
        lr: a float >= 0, or a one-element float tensor (changed in place, it takes effect at
            the next backward without a host sync).
        betas, eps, weight_decay: as :class:`sparsekit.LazyAdam` (eps and weight_decay for
            the others too; weight_decay is L2 added to the gradient of the rows touched).
        initial_accumulator_value: the Adagrads' starting sum (default 0).

    State per table: LazyAdam ``step`` (an int64 tensor on the table's device),
    ``exp_avg`` and ``exp_avg_sq`` (float32, float64 for a float64 table); row-wise Adagrad
    ``sum`` (``[rows]`` float32); Adagrad ``sum`` (``[rows, dim]``); SGD none. Created at the
    table's first update, by :meth:`init_state`, or by :meth:`step` (TorchRec's way of
    initialising state); never for a table that does not require grad.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer: str = "lazy_adam", lr: Any = 1e-3,
                 betas: Any = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0) -> None:
        where = "FusedOptimizer"
        if isinstance(optimizer, enum.Enum) and isinstance(optimizer.value, str):  # FBGEMM's EmbOptimType
            optimizer = optimizer.value
        if not isinstance(optimizer, str) or _ALIASES.get(optimizer.lower(), optimizer.lower()) not in FUSED_OPTIMIZERS:
            raise ValueError(f"{where}: optimizer must be one of {list(FUSED_OPTIMIZERS)} (or TorchRec's "
                             f"{list(_ALIASES)}), got {optimizer!r}")
        name = _ALIASES.get(optimizer.lower(), optimizer.lower())
        defaults = self._checked(where, dict(optimizer=name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                             initial_accumulator_value=initial_accumulator_value))
        super().__init__(params, defaults)
        # TorchRec's KeyedOptimizer flag, set after the one group took the defaults (it is
        # not a setting of the update).
        self.defaults["_save_param_groups"] = False
        self._names: Optional[List[str]] = None

    @property
    def optimizer(self) -> str:
        """``"sgd"``, ``"lazy_adam"``, ``"rowwise_adagrad"`` or ``"adagrad"`` (kept in the parameter group,
        so ``state_dict()`` records it)."""
        return self.param_groups[0]["optimizer"]

    @staticmethod
    def _checked(where: str, group: Mapping[str, Any]) -> Dict[str, Any]:
        if group.get("optimizer") not in FUSED_OPTIMIZERS:
            raise ValueError(f"{where}: optimizer must be one of {list(FUSED_OPTIMIZERS)}, "
                             f"got {group.get('optimizer')!r}")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        return {**group, "lr": _check_lr(where, group["lr"]),
                "betas": tuple(_real(where, name, b, 1.0) for name, b in zip(("beta1", "beta2"), betas)),
                "eps": _real(where, "eps", group["eps"]), "weight_decay": _real(where, "weight_decay",
                                                                               group["weight_decay"]),
                "initial_accumulator_value": _real(where, "initial_accumulator_value",
                                                   group["initial_accumulator_value"])}

    @classmethod
    def from_params(cls, params: Iterable[nn.Parameter], fused_params: Mapping[str, Any],
                    huge_tables: bool = False, names: Optional[List[str]] = None) -> "FusedOptimizer":
        """A FusedOptimizer from a collection's ``fused_params`` (TorchRec's spelling
        ``learning_rate`` taken for ``lr``, ``beta1`` / ``beta2`` for ``betas``); with
        ``huge_tables`` its state goes in huge pages as the tables do (allocator.huge_tables);
        ``names``: the parameters' names in their module, the keys of :attr:`params`."""
        if not isinstance(fused_params, Mapping):
            raise TypeError(f"EmbeddingBagCollection: fused_params must be a dict, got {type(fused_params).__name__}")
        for alias, key in _PARAM_ALIASES.items():
            if alias in fused_params and key in fused_params:
                raise ValueError(f"EmbeddingBagCollection: fused_params gives {key} and {alias} (TorchRec's name for "
                                 f"it); give one")
        settings = {_PARAM_ALIASES.get(key, key): value for key, value in fused_params.items()}
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise ValueError(f"EmbeddingBagCollection: fused_params holds unknown settings {unknown}; it takes "
                             f"{list(_SETTINGS)} (and 'learning_rate' for lr)")
        if "beta1" in settings or "beta2" in settings:
            if "betas" in settings:
                raise ValueError("EmbeddingBagCollection: fused_params gives betas and beta1 / beta2; give one")
            settings["betas"] = (settings.pop("beta1", 0.9), settings.pop("beta2", 0.999))
        if "optimizer" not in settings:
            raise ValueError("EmbeddingBagCollection: fused_params must name its optimizer, e.g. "
                             "{'optimizer': 'lazy_adam', 'lr': 1e-3}")
        optimizer = cls(params, **settings)
        optimizer._huge_tables = huge_tables
        optimizer._names = names
        return optimizer

    # -- TorchRec's KeyedOptimizer interface (duck-typed): CombinedOptimizer([("embeddings",
    # ebc.fused_optimizer), dense]) takes it, keyed by the parameters' names.

    @property
    def params(self) -> Dict[str, Tensor]:
        """``{name: weight}`` of the tables, the names the collection gives its weights
        (``shards.<i>.weight``; ``tables.<i>`` for an optimizer built without names)."""
        weights = self.param_groups[0]["params"]
        names = self.__dict__.get("_names") or [f"tables.{i}" for i in range(len(weights))]
        return dict(zip(names, weights))

    def init_state(self, sparse_grad_parameter_names: Optional[Any] = None) -> None:
        """Creates every table's state now (it is otherwise made at a table's first update),
        so that a keyed state dict can be loaded into it in place, as TorchRec's optimizers
        allow."""
        for weight in self.param_groups[0]["params"]:
            if weight.requires_grad:  # a frozen table is never updated: no state for it
                self._state_of(weight, self.param_groups[0])

    def save_param_groups(self, save: bool) -> None:
        """Whether a TorchRec ``CombinedOptimizer`` holding this one saves the parameter groups."""
        self.defaults["_save_param_groups"] = bool(save)

    def __getstate__(self) -> Dict[str, Any]:
        # torch keeps only defaults, state and groups: the names go along (deepcopy, pickle).
        return {**super().__getstate__(), "_names": self.__dict__.get("_names")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.setdefault("_save_param_groups", False)  # pickled before it existed

    def post_load_state_dict(self) -> None:
        """Called by TorchRec's ``KeyedOptimizer.load_state_dict`` after it copied a saved
        state into this one's tensors in place: nothing is left to do."""

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if self.param_groups:
            raise ValueError("FusedOptimizer: it updates one collection's tables with one set of settings; it takes "
                             "no second parameter group")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Nothing to do: each backward of the collection already applied the update. Runs
        ``closure`` (re-evaluating the model, which updates the tables) when given. A table
        with no state yet gets it here (TorchRec's ``init_state`` makes state by a step)."""
        group = self.param_groups[0]
        if len(self.state) < sum(w.requires_grad for w in group["params"]):
            self.init_state()
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _state_of(self, weight: Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        state = self.state[weight]
        if state:
            return state
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        with huge_tables(self.__dict__.get("_huge_tables", False)):
            if self.optimizer == "lazy_adam":
                state["step"] = torch.zeros((), dtype=torch.int64, device=weight.device)
                state["exp_avg"] = table_zeros(tuple(weight.shape), dtype, weight.device)
                state["exp_avg_sq"] = table_zeros(tuple(weight.shape), dtype, weight.device)
            elif self.optimizer in ("rowwise_adagrad", "adagrad"):
                shape = (weight.shape[0],) if self.optimizer == "rowwise_adagrad" else tuple(weight.shape)
                state["sum"] = table_full(shape, group["initial_accumulator_value"], dtype, weight.device)
        return state

    def update_of(self, weights: List[Tensor]) -> FusedStep:
        """What the backward applies to ``weights`` (tables of this optimizer): the op's name,
        the group's settings (checked again: a scheduler or a hand may have changed them) and
        each table's state."""
        group = self.param_groups[0]
        settings = self._checked("FusedOptimizer", group)
        states = [self._state_of(w, group) for w in weights]
        lr = settings["lr"]
        hyper = [0.0 if isinstance(lr, Tensor) else lr, *settings["betas"], settings["eps"], settings["weight_decay"]]
        lr_tensor = None
        if isinstance(lr, Tensor):
            device = weights[0].device
            lr_tensor = lr if lr.device == device and lr.dtype in (torch.float32, torch.float64) \
                else lr.to(device=device, dtype=torch.float32)
        if self.optimizer == "lazy_adam":
            return FusedStep(self.optimizer, hyper, lr_tensor, [s["exp_avg"] for s in states],
                             [s["exp_avg_sq"] for s in states], [s["step"] for s in states])
        if self.optimizer in ("rowwise_adagrad", "adagrad"):
            return FusedStep(self.optimizer, hyper, lr_tensor, [s["sum"] for s in states], [], [])
        return FusedStep(self.optimizer, hyper, lr_tensor, [], [], [])

    def reset_rows(self, weight: Tensor, rows: Tensor) -> None:
        """Zeroes the state of ``rows`` of ``weight`` (rows given to new keys, evicting old
        ones: no state of the old key may reach the new one)."""
        state = self.state.get(weight)
        if not state:
            return
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                state[name].index_fill_(0, rows, 0)
        if "sum" in state:
            state["sum"].index_fill_(0, rows, self.param_groups[0]["initial_accumulator_value"])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then each table's state brought to the
        dtype and device the update takes (torch casts floating state to the weight's dtype,
        and keeps ``step`` where it was saved); ValueError for a state of the wrong shape,
        with the optimizer left as it was."""
        saved_state, saved_groups = dict(self.state), [dict(g) for g in self.param_groups]
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if isinstance(groups, list) and groups and isinstance(groups[0], Mapping) \
                and groups[0].get("optimizer", self.optimizer) != self.optimizer:
            raise ValueError(f"FusedOptimizer.load_state_dict: the state is {groups[0]['optimizer']!r}'s, this "
                             f"optimizer is {self.optimizer!r}")
        given = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        for index, entry in (given.items() if isinstance(given, Mapping) else ()):
            for name, value in (entry.items() if isinstance(entry, Mapping) else ()):
                if isinstance(value, Tensor) and not holds_values(value):
                    # Refused before torch's load, whose cast of it would fail naming nothing.
                    raise ValueError(f"FusedOptimizer.load_state_dict: the state {name!r} of table {index} must be "
                                     f"a dense tensor with data, got layout {value.layout} on {value.device}")
        super().load_state_dict(state_dict)
        try:
            want_names = _STATE_NAMES[self.optimizer]
            for weight, state in self.state.items():
                if not isinstance(weight, Tensor) or not any(weight is w for w in self.param_groups[0]["params"]):
                    raise ValueError(f"FusedOptimizer.load_state_dict: the state holds an entry {weight!r} for no "
                                     f"table of this optimizer ({len(self.param_groups[0]['params'])} tables)")
                if state and set(state) != set(want_names):  # an empty entry: no state yet
                    raise ValueError(f"FusedOptimizer.load_state_dict: the state of a table {tuple(weight.shape)} "
                                     f"must hold {sorted(want_names)} ({self.optimizer!r}), got {sorted(state)}")
                for name, value in list(state.items()):
                    if name == "step" and isinstance(value, Tensor) and value.numel() == 1:
                        step = value.item()
                        if not (isinstance(step, int) or (math.isfinite(step) and step == int(step))) \
                                or not 0 <= int(step) < 2 ** 63 - 1:
                            raise ValueError(f"FusedOptimizer.load_state_dict: the step of a table "
                                             f"{tuple(weight.shape)} must be a whole number in [0, 2^63 - 1), got "
                                             f"{step!r}")
                    per_row = name == "sum" and self.optimizer == "rowwise_adagrad"
                    want = () if name == "step" else (weight.shape[0],) if per_row else tuple(weight.shape)
                    if not isinstance(value, Tensor) or tuple(value.shape) != want:
                        raise ValueError(f"FusedOptimizer.load_state_dict: the state {name!r} of a table "
                                         f"{tuple(weight.shape)} must have shape {want}, got "
                                         f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
                    dtype = torch.int64 if name == "step" else (
                        torch.float64 if weight.dtype == torch.float64 else torch.float32)
                    # A copy: torch's load keeps the given tensors where it can, and a state
                    # dict taken from a live optimizer would then share its moments.
                    state[name] = value.to(device=weight.device, dtype=dtype, copy=True).contiguous()
            self.param_groups[0].update(self._checked("FusedOptimizer.load_state_dict", self.param_groups[0]))
        except BaseException:
            self.state.clear()
            self.state.update(saved_state)
            for group, saved in zip(self.param_groups, saved_groups):
                group.clear()
                group.update(saved)
            raise

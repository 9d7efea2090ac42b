"""Setting up a training run: the process group, the data, the model and its optimizer.

:func:`setup` joins the process group under ``torchrun`` (NCCL on CUDA, gloo on CPU),
:func:`make_data` opens the synthetic stream or a Criteo TSV file, :func:`build` makes
the DLRM with a sparsekit (model-parallel) or torch (replicated) embedding, its
optimizer and the DDP wrapper, and :func:`evaluate` scores the held-out samples of every
rank. A size that cannot be allocated is a :class:`FlagError` naming the flags behind it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._checks import AllocationError, allocation
from .config import DEFAULT_EVAL_SAMPLES, EMBEDDING_DTYPES, FlagError, HarnessError, TrainConfig, table_capacity
from .data import NUM_SLOTS, SyntheticCriteo
from .metrics import all_gather_1d, log_loss, roc_auc
from .model import DLRM, SparsekitSlotEmbedding, SparsekitTableEmbedding, TorchSlotEmbedding

__all__ = ["Context", "OptimizerGroup", "build", "evaluate", "logging_layer", "make_data", "setup", "table_stats"]


@dataclass
class Context:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_name: Optional[str], timeout: float = 300.0) -> Context:
    """Pick the device and, under ``torchrun`` (``WORLD_SIZE`` > 1), join the default
    process group: NCCL on CUDA, gloo on CPU. ``timeout`` (seconds) bounds every
    collective: a rank that fails and stays alive makes the others raise after it instead
    of waiting for torch's default (10 min on NCCL, 30 min on gloo)."""
    if device_name is None:
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name not in ("cpu", "cuda"):
        raise FlagError(f"--device must be cpu or cuda, got {device_name!r}")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise FlagError("--device cuda: no CUDA device is available; use --device cpu")
    # torchrun sets these; by hand, a missing or malformed one is named in one line.
    environment = {name: os.environ.get(name) for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    for name, value in environment.items():
        if value is not None and not (value.strip().isdigit()):
            raise HarnessError(f"the environment variable {name}={value!r} must be a non-negative integer "
                               "(torchrun sets it)")
    world_size = int(environment["WORLD_SIZE"] or 1)
    if world_size > 1 and not dist.is_initialized():
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise HarnessError(f"WORLD_SIZE={world_size} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                               " not set: launch the ranks with torchrun (python -m torch.distributed.run "
                               "--nproc-per-node N -m sparsekit.train ...), or set them as it does")
        if device_name == "cuda":
            torch.cuda.set_device(int(environment["LOCAL_RANK"] or 0))
        dist.init_process_group("nccl" if device_name == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1
    if device_name == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if world_size > 1 else 0)
    else:
        device = torch.device("cpu")
    return Context(rank, world_size, device)


def make_data(config: TrainConfig):
    """The run's data source: :class:`SyntheticCriteo`, or a :class:`CriteoTSV` over
    ``--data`` (raises :class:`HarnessError` naming the file when it has too few lines)."""
    if config.data == "synthetic":
        return SyntheticCriteo(config.seed, vocab_per_slot=config.vocab_per_slot)
    from .criteo import CriteoTSV

    eval_samples = config.eval_samples
    if eval_samples is None:
        eval_samples = DEFAULT_EVAL_SAMPLES
        if config.eval_data is None:  # held out from --data: a tenth of a small file
            from .criteo import LineIndex

            eval_samples = min(eval_samples, max(1, LineIndex(config.data).num_lines // 10))
    try:
        return CriteoTSV(config.data, eval_samples=eval_samples, eval_path=config.eval_data,
                         hash_seed=config.seed)
    except ValueError as error:  # its only ValueErrors: a file too short (the message names it)
        raise HarnessError(str(error)) from error


@contextlib.contextmanager
def _sized_by(flags: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Turns a failure to allocate (sparsekit's AllocationError, torch's out-of-memory
    errors) inside the block into a :class:`FlagError` naming the flags that sized
    ``shape``, the largest tensor allocated there."""
    try:
        with allocation(flags, shape, dtype, device):
            yield
    except AllocationError as error:
        raise FlagError(str(error)) from error


def logging_layer(model: nn.Module, config: TrainConfig) -> Optional[nn.Module]:
    """The sparsekit embedding whose dynamic table the log reports, or None."""
    layer = getattr(model, "embedding", None)
    if isinstance(layer, SparsekitSlotEmbedding):
        layer = layer.embedding
    elif not isinstance(layer, SparsekitTableEmbedding):
        return None
    return None if config.eviction is None and config.admit_after == 1 else layer


def table_stats(model: nn.Module, config: TrainConfig) -> str:
    """The log's table part: fill, evictions and admissions since the last line (sparsekit
    embedding with a dynamic table only; a collective under a process group)."""
    layer = logging_layer(model, config)
    if layer is None:
        return ""
    stats = layer.stats()
    last = getattr(layer, "_logged_stats", {"evicted": 0, "admitted": 0})
    layer._logged_stats = stats
    return (f"  table {stats['size']:,}/{stats['capacity']:,}  evicted +{stats['evicted'] - last['evicted']:,}"
            f"  admitted +{stats['admitted'] - last['admitted']:,}  pending {stats['pending']:,}")


def build(config: TrainConfig, context: Context):
    """The model (unwrapped), the module to train through (DDP under a process group),
    and the optimizer."""
    # Same seed on every rank: identical dense replicas before DDP even broadcasts.
    torch.manual_seed(config.seed)
    dim = config.embedding_dim
    if config.embedding == "sparsekit":
        capacity, rows_flag = table_capacity(vars(config))
        if config.tables == "per-slot":
            # The same rows in all: the capacity split evenly over the 26 tables.
            rows = max(1, capacity // NUM_SLOTS)
            dtype = EMBEDDING_DTYPES[config.embedding_dtype]
            with _sized_by(f"{rows_flag} x --embedding-dim {dim} ({NUM_SLOTS} tables of {rows} rows per rank)",
                           (rows, dim), dtype, context.device):
                embedding = SparsekitTableEmbedding(
                    rows, dim, context.device, context.world_size, config.seed, eviction=config.eviction,
                    admit_after=config.admit_after, dtype=dtype)
        else:
            with _sized_by(f"{rows_flag} x --embedding-dim {dim} (the table of each rank)",
                           (capacity, dim), torch.float32, context.device):
                embedding = SparsekitSlotEmbedding(capacity, dim, context.device, context.world_size,
                                                   config.seed, eviction=config.eviction,
                                                   admit_after=config.admit_after)
    elif config.embedding == "torch":
        if context.world_size > 1 and context.device.type == "cuda":
            raise FlagError("--embedding torch replicates nn.EmbeddingBag(sparse=True) under DDP, "
                            "and NCCL has no sparse all-reduce: run it on one process, or on CPU "
                            "(gloo), or use --embedding sparsekit")
        with _sized_by(f"--table-rows {config.table_rows} x --embedding-dim {dim} (the replicated table)",
                       (config.table_rows, dim), torch.float32, context.device):
            embedding = TorchSlotEmbedding(config.table_rows, dim, context.device)
    else:
        raise FlagError(f"--embedding must be sparsekit or torch, got {config.embedding!r}")
    # The largest dense weight: the top MLP's first layer, [128, dim + 351].
    with _sized_by(f"--embedding-dim {dim} (the dense layers)", (128, dim + NUM_SLOTS * (NUM_SLOTS + 1) // 2),
                   torch.float32, context.device):
        model = DLRM(embedding, dim, device=context.device)

    if config.embedding == "sparsekit":
        import sparsekit as sk

        optimizer = sk.LazyAdam(model.parameters(), lr=config.lr)
        # Model-parallel: every rank owns other rows and its own hash table, so DDP must
        # neither average nor broadcast them.
        sharded, _ = sk.split_embedding_variable_from_others(model.named_parameters())
        ignored = [name for name, _ in sharded]
        ignored += [f"embedding.{name}" for name, _ in embedding.named_buffers()]
    else:
        optimizer = OptimizerGroup({
            "sparse": torch.optim.SparseAdam(list(embedding.parameters()), lr=config.lr),
            "dense": torch.optim.Adam([p for n, p in model.named_parameters()
                                       if not n.startswith("embedding.")], lr=config.lr),
        })
        ignored = []

    trained: nn.Module = model
    if context.world_size > 1:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        trained = DistributedDataParallel(
            model, device_ids=[context.device.index] if context.device.type == "cuda" else None)
    return model, trained, optimizer


class OptimizerGroup:
    """Several optimizers stepped together (the torch baseline: SparseAdam + Adam)."""

    def __init__(self, optimizers: Dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()

    def state_dict(self) -> Dict[str, dict]:
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def check_state_dict(self, state: Dict[str, dict]) -> None:
        """ValueError naming the optimizer and what is wrong unless every optimizer can step
        from its part of ``state`` (torch's own load takes moments of any shape and settings
        of any type, and the step then failed with a traceback)."""
        for name, optimizer in self.optimizers.items():
            _check_adam_state(name, optimizer, state.get(name) if isinstance(state, dict) else None)

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        """Loads every optimizer's state, all checked first (:meth:`check_state_dict`)."""
        self.check_state_dict(state)
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


def _check_adam_state(name: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """A saved Adam / SparseAdam state that ``optimizer`` (built alike) can step from."""
    def bad(what: str) -> ValueError:
        return ValueError(f"the {name} optimizer's state {what}")

    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        raise bad(f"is a {type(saved).__name__}, not a dict with 'state' and 'param_groups'")
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and len(g["params"]) == len(mine["params"])
            for g, mine in zip(groups, optimizer.param_groups)):
        raise bad("has other parameter groups than the model's")
    params = {}
    for g, mine in zip(groups, optimizer.param_groups):
        for key in ("lr", "eps"):
            if isinstance(g.get(key), bool) or not isinstance(g.get(key), (int, float)):
                raise bad(f"holds {key}={g.get(key)!r}, not a number")
        params.update(zip(g["params"], mine["params"]))
    for saved_id, entry in saved["state"].items():
        param = params.get(saved_id)
        if param is None or not isinstance(entry, dict):
            raise bad(f"holds an entry {saved_id!r} for no parameter of the model")
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry.get(key)
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise bad(f"holds {key} {got} for a parameter of shape {tuple(param.shape)}")


@torch.no_grad()
def evaluate(model: nn.Module, data, config: TrainConfig, context: Context) -> Dict[str, float]:
    """AUC and log loss over the whole held-out set, gathered from every rank."""
    was_training = model.training
    model.eval()
    probabilities: List[torch.Tensor] = []
    labels: List[torch.Tensor] = []
    eval_samples = config.eval_samples if config.eval_samples is not None else DEFAULT_EVAL_SAMPLES
    for batch in data.eval_batches(eval_samples, config.batch_size, context.rank, context.world_size):
        batch = batch.to(context.device)
        probabilities.append(torch.sigmoid(model(batch.dense, batch.keys)))
        labels.append(batch.labels)
    model.train(was_training)
    all_probabilities = all_gather_1d(torch.cat(probabilities))
    all_labels = all_gather_1d(torch.cat(labels))
    return {"auc": roc_auc(all_probabilities, all_labels),
            "logloss": log_loss(all_probabilities, all_labels),
            "eval_samples": int(all_labels.numel())}

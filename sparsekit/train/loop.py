"""Training loop of the harness: setup, train, evaluate, checkpoint, resume.

Global batch semantics: ``batch_size`` is the *global* batch; rank ``r`` of ``W`` trains
on its ``batch_size / W`` rows of it (see :mod:`sparsekit.train.data`). The dense layers
are data-parallel (DDP averages their gradients), the sparsekit embedding is
model-parallel (each key lives on one rank), so the gradient of every parameter is that
of the global mean loss, whatever ``W``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pickle
import re
import shutil
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._checks import AllocationError, allocation
from ..allocator import freed_memory_kept
from ..checkpoint import _file_in_the_way, _nearest_existing, _write_file
from .data import NUM_SLOTS, SyntheticCriteo
from .metrics import all_gather_1d, log_loss, roc_auc
from .model import DLRM, SparsekitSlotEmbedding, SparsekitTableEmbedding, TorchSlotEmbedding

LATEST = "latest"
EMBEDDING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Held-out samples when --eval-samples is not given: this many of the synthetic stream, or
# of a TSV file's last lines, at most a tenth of them (see make_data).
DEFAULT_EVAL_SAMPLES = 32768
# Upper bounds of the flags (see --help). Every rank builds the arrays of the whole global
# batch (about 2.5 KB per sample on the synthetic data), so a batch of 2^20 needs some 2.5 GB
# per rank before the model's own activations.
MAX_BATCH_SIZE = 1 << 20
# The synthetic data's hidden model holds 26 x N float32 effects (float64 while drawn) and a
# sampler built in O(N) Python steps: at 2^22, about 2 GB and 10-20 s to set up.
MAX_VOCAB_PER_SLOT = 1 << 22
# Every evaluation generates the synthetic held-out samples afresh: 2^22 take about 12 s on
# one core. (From a file, --eval-samples is capped by the held-out lines instead.)
MAX_SYNTHETIC_EVAL_SAMPLES = 1 << 22
# Adam moves every parameter by about lr per step: at 1 the harness's model already learns
# nothing (AUC 0.5), and far larger steps overflow the weights to NaN.
MAX_LR = 1.0
# A week; torch keeps the process group's timeout in an int64 count of nanoseconds.
MAX_TIMEOUT = 7 * 24 * 3600.0
MIN_TIMEOUT = 1.0
# Sizes, steps and seeds reach numpy and torch as int64.
INT64_MAX = (1 << 63) - 1
# A rank's trainer state file in a step directory.
_TRAINER_FILE_NAME = re.compile(r"trainer_rank(\d+)\.pt")
# A step directory of the harness's checkpoint directory (what ``latest`` names).
_STEP_DIR_NAME = re.compile(r"step_(\d{9,})")


def _is_compressed(path: str) -> bool:
    """Whether the file starts with gzip's magic bytes (an unreadable file is left to the reader)."""
    try:
        with open(path, "rb") as file:
            return file.read(2) == b"\x1f\x8b"
    except OSError:
        return False


class HarnessError(ValueError):
    """A run that the flags, the data files or the checkpoint directory make impossible;
    ``python -m sparsekit.train`` prints the message as one line, without a traceback."""


class FlagError(HarnessError):
    """A flag's value that is out of range, found out only once the run starts (the world
    size, memory); ``python -m sparsekit.train`` reports it as an argparse error."""


class CheckpointError(HarnessError):
    """``--resume`` cannot use what ``--checkpoint-dir`` holds; the message names the
    checkpoint directory (or file) and what is wrong."""


# Integer flags: (lowest, highest, why the highest). The optional ones may be None.
_INT_FLAG_RANGES = {
    "steps": (0, INT64_MAX, "the int64 range"),
    "batch_size": (1, MAX_BATCH_SIZE, "every rank builds the arrays of the whole global batch"),
    "eval_samples": (1, INT64_MAX, "the int64 range"),
    "eval_every": (0, INT64_MAX, "the int64 range"),
    "checkpoint_every": (0, INT64_MAX, "the int64 range"),
    "embedding_dim": (1, INT64_MAX, "the int64 range"),
    "table_rows": (1, INT64_MAX, "the int64 range"),
    "vocab_per_slot": (1, MAX_VOCAB_PER_SLOT, "the synthetic data's hidden model holds 26 x N effects"),
    "keep_checkpoints": (1, INT64_MAX, "the int64 range"),
    "seed": (0, INT64_MAX, "numpy and torch take seeds in [0, 2^63)"),
    "capacity_per_rank": (1, INT64_MAX, "the int64 range"),
    "admit_after": (1, INT64_MAX, "the int64 range"),
}
_OPTIONAL_INT_FLAGS = ("eval_samples", "capacity_per_rank")


@dataclass
class TrainConfig:
    """Everything a run depends on; the command-line flags of ``python -m sparsekit.train``."""

    steps: int = 300
    batch_size: int = 1024
    device: Optional[str] = None
    embedding: str = "sparsekit"
    data: str = "synthetic"
    eval_data: Optional[str] = None
    eval_samples: Optional[int] = None
    eval_every: int = 50
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics_json: Optional[str] = None
    seed: int = 0
    embedding_dim: int = 16
    lr: float = 3e-3
    table_rows: int = 1 << 20
    vocab_per_slot: int = 20_000
    progress: bool = True
    timeout: float = 300.0
    capacity_per_rank: Optional[int] = None
    eviction: Optional[str] = None
    admit_after: int = 1
    tables: str = "shared"
    embedding_dtype: str = "fp32"
    keep_checkpoints: int = 2

    def validate(self) -> None:
        """Raises ValueError naming the flag of the first value out of range."""
        for name, (low, high, why) in _INT_FLAG_RANGES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FLAGS:
                continue
            flag = "--" + name.replace("_", "-")
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
            if value > high:
                raise ValueError(f"{flag} must be at most {high:,} ({why}), got {value!r}")
        # Written so that NaN fails too.
        if not 0 < self.lr <= MAX_LR:
            raise ValueError(f"--lr must be > 0 and at most {MAX_LR:g} (Adam moves every parameter by about "
                             f"lr per step), got {self.lr!r}")
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            # (Below a second even forming the process group times out, on every rank.)
            raise ValueError(f"--timeout must be >= {MIN_TIMEOUT:g} second and at most {MAX_TIMEOUT:.0f} (a "
                             f"week), got {self.timeout!r}")
        if self.embedding not in ("sparsekit", "torch"):
            raise ValueError(f"--embedding must be sparsekit or torch, got {self.embedding!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
        if self.eviction not in (None, "lru", "lfu"):
            raise ValueError(f"--eviction must be lru or lfu, got {self.eviction!r}")
        if self.embedding != "sparsekit" and (self.eviction or self.admit_after != 1
                                              or self.capacity_per_rank is not None):
            raise ValueError("--capacity-per-rank, --eviction and --admit-after need --embedding sparsekit")
        if self.tables not in ("shared", "per-slot"):
            raise ValueError(f"--tables must be shared or per-slot, got {self.tables!r}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"--embedding-dtype must be one of {sorted(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}")
        if self.tables == "per-slot" and self.embedding != "sparsekit":
            raise ValueError("--tables per-slot needs --embedding sparsekit")
        if self.embedding_dtype != "fp32" and self.tables != "per-slot":
            raise ValueError("--embedding-dtype bf16/fp16 needs --tables per-slot (the shared table is float32)")
        # An empty path was taken as the flag left out: the run wrote nothing and said nothing.
        for flag, value in (("--data", self.data), ("--eval-data", self.eval_data),
                            ("--checkpoint-dir", self.checkpoint_dir), ("--metrics-json", self.metrics_json)):
            if value is not None and not value:
                raise ValueError(f"{flag} must not be empty; leave the flag out for its default")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        # Found now rather than when the first checkpoint or the metrics are written.
        metrics_dir = os.path.dirname(os.path.abspath(self.metrics_json)) if self.metrics_json else None
        for flag, value, directory in (("--checkpoint-dir", self.checkpoint_dir, self.checkpoint_dir),
                                       ("--metrics-json", self.metrics_json, metrics_dir)):
            blocker = _file_in_the_way(directory) if directory else None
            if blocker:
                raise ValueError(f"{flag} {value!r}: {blocker!r} is a file, not a directory")
            # Written to after training (a resumed run may only evaluate, reading its checkpoint).
            existing = _nearest_existing(directory) if directory and not (flag == "--checkpoint-dir"
                                                                            and self.resume) else None
            if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {value!r}: {existing!r} is not writable (read-only, or no permission)")
        if self.metrics_json and os.path.isdir(self.metrics_json):
            raise ValueError(f"--metrics-json {self.metrics_json!r} is a directory; name the file to write")
        if self.metrics_json:
            # The result JSON replaces its file: never a data file or a file of the checkpoints.
            target = os.path.realpath(self.metrics_json)
            for flag, path in (("--data", self.data if self.data != "synthetic" else None),
                               ("--eval-data", self.eval_data)):
                if path and os.path.realpath(path) == target:
                    raise ValueError(f"--metrics-json {self.metrics_json!r} is the {flag} file; writing the "
                                     "result there would replace the data")
            if self.checkpoint_dir:
                checkpoints = os.path.realpath(self.checkpoint_dir)
                inside = os.path.relpath(target, checkpoints).split(os.sep)[0]
                if target == checkpoints:
                    raise ValueError(f"--metrics-json {self.metrics_json!r} is --checkpoint-dir itself; name a "
                                     "file to write")
                if os.path.commonpath([checkpoints, target]) == checkpoints and (
                        inside == LATEST or _STEP_DIR_NAME.fullmatch(inside)):
                    raise ValueError(f"--metrics-json {self.metrics_json!r} is --checkpoint-dir's {inside!r}, "
                                     "which the checkpoints own (a save replaces or prunes it); write it elsewhere")
        if self.data == "synthetic":
            if self.eval_data is not None:
                raise ValueError("--eval-data needs --data FILE (the synthetic data holds out samples of its "
                                 "own; --eval-samples sets how many)")
            if self.eval_samples is not None and self.eval_samples > MAX_SYNTHETIC_EVAL_SAMPLES:
                raise ValueError(f"--eval-samples must be at most {MAX_SYNTHETIC_EVAL_SAMPLES:,} with --data "
                                 "synthetic (every evaluation generates them afresh), "
                                 f"got {self.eval_samples!r}")
        for flag, path in (("--data", self.data if self.data != "synthetic" else None),
                           ("--eval-data", self.eval_data)):
            if path is not None and not os.path.isfile(path):
                what = ("is a directory" if os.path.isdir(path) else "is not a regular file" if os.path.exists(path)
                        else "no such file")
                raise ValueError(f"{flag} {path!r}: {what} (a Criteo TSV file, or --data synthetic)")
            if path is not None and _is_compressed(path):
                raise ValueError(f"{flag} {path!r} is gzip-compressed; decompress it first (gunzip -k), the "
                                 "reader takes the plain Criteo TSV")

    # Fields that must match between a checkpoint and the run resuming from it (with
    # --embedding sparsekit, table_rows and capacity_per_rank by the table size they give;
    # eval_samples and eval_data with --data FILE only, where they decide the lines trained on).
    RESUME_KEYS = ("embedding", "embedding_dim", "batch_size", "seed", "data", "table_rows",
                   "vocab_per_slot", "lr", "capacity_per_rank", "eviction", "admit_after", "tables",
                   "embedding_dtype", "eval_samples", "eval_data")


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


def _logging_layer(model: nn.Module, config: TrainConfig) -> Optional[nn.Module]:
    """The sparsekit embedding whose dynamic table the log reports, or None."""
    layer = getattr(model, "embedding", None)
    if isinstance(layer, SparsekitSlotEmbedding):
        layer = layer.embedding
    elif not isinstance(layer, SparsekitTableEmbedding):
        return None
    return None if config.eviction is None and config.admit_after == 1 else layer


def _table_stats(model: nn.Module, config: TrainConfig) -> str:
    """The log's table part: fill, evictions and admissions since the last line (sparsekit
    embedding with a dynamic table only; a collective under a process group)."""
    layer = _logging_layer(model, config)
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
        capacity, rows_flag = _table_capacity(vars(config))
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


# ---- checkpoints ----

def _step_dir(config: TrainConfig, step: int) -> str:
    return os.path.join(config.checkpoint_dir, f"step_{step:09d}")


def _atomic_write(path: str, write) -> None:
    """``write(file)`` into a temporary file flushed to disk, then renamed to ``path``; an
    OSError names ``path`` (the one the user gave), not the temporary file, which is removed.

    The rename goes to the file a symbolic link names (the link stays). A ``path`` that is
    no regular file (``--metrics-json /dev/null`` or ``/dev/stdout``, a FIFO) is written in
    place: renamed onto, a device node would become a regular file (as root, ``/dev/null``
    of the whole machine)."""
    target = os.path.realpath(path)
    temporary = f"{target}.tmp{os.getpid()}"
    try:
        try:
            special = not stat.S_ISREG(os.stat(target).st_mode)
        except FileNotFoundError:
            special = False
        if special:
            with open(target, "wb") as out:
                write(out)
        else:
            _write_file(temporary, write)
            os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise OSError(error.errno, error.strerror or str(error), path) from error


def _atomic_write_text(path: str, text: str) -> None:
    _atomic_write(path, lambda out: out.write(text.encode()))


def _atomic_torch_save(obj, path: str) -> None:
    _atomic_write(path, lambda out: torch.save(obj, out))


def _barrier(context: Context) -> None:
    if context.world_size > 1:
        dist.barrier()


def save(config: TrainConfig, context: Context, step: int, model: nn.Module, optimizer,
         written: Optional[List[str]] = None, logged_loss: Optional[Tuple[float, int]] = None) -> str:
    """Checkpoint the model, optimizer, step and RNG states; collective.

    The ``latest`` pointer moves only once every rank has finished writing, so an
    interrupted save leaves the previous checkpoint the one resumed from. Then the
    ``config.keep_checkpoints`` most recently written step directories are kept (see
    :func:`_prune`).

    Args:
        written: names of the step directories this run wrote, oldest first; the one
            written now is moved to its end. Pass the same list to every save of a run.
        logged_loss: the training loss summed over the steps since the last log line (the
            ranks' mean) and their number, so a resumed log's first ``train_loss`` averages
            the same steps as the uninterrupted run's.
    """
    directory = _step_dir(config, step)
    pointer = os.path.join(config.checkpoint_dir, LATEST)
    if context.is_main and _pointer_names(pointer, os.path.basename(directory)):
        # Rewriting the step `latest` names (a fresh run into an old directory): until the new
        # checkpoint is whole there is none, so the pointer goes first. A crash then leaves
        # no pointer, which --resume refuses, rather than one at a mix of the two runs.
        os.remove(pointer)
    _barrier(context)
    os.makedirs(directory, exist_ok=True)
    if config.embedding == "sparsekit":
        import sparsekit as sk

        sk.save_checkpoint(os.path.join(directory, "model"), model, optimizer)
    elif context.is_main:  # the torch baseline is fully replicated
        _atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           os.path.join(directory, "model.pt"))
    state = {
        "step": step,
        "config": {key: getattr(config, key) for key in TrainConfig.RESUME_KEYS},
        "world_size": context.world_size,
        "cpu_rng": torch.get_rng_state(),
    }
    if context.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(context.device)
    logged = getattr(_logging_layer(model, config), "_logged_stats", None)
    if logged is not None:  # the totals at the last log line: a resumed log counts on from them
        state["logged_stats"] = {key: int(logged[key]) for key in ("evicted", "admitted")}
    if logged_loss is not None:  # the loss since the last log line: a resumed log averages on from it
        state["logged_loss"] = {"sum": float(logged_loss[0]), "steps": int(logged_loss[1])}
    error: Optional[BaseException] = None
    try:
        _atomic_torch_save(state, os.path.join(directory, f"trainer_rank{context.rank}.pt"))
    except Exception as exc:  # shared below: the other ranks say it failed here, not that a peer vanished
        error = exc
    _agree(context, error, "saving the checkpoint's trainer state")
    if context.is_main:
        # An earlier run on more ranks may have written this step: its other ranks' files
        # would be read as this checkpoint's by a resume on that many ranks.
        for name in os.listdir(directory):
            match = _TRAINER_FILE_NAME.fullmatch(name)
            if match and int(match.group(1)) >= context.world_size:
                os.remove(os.path.join(directory, name))
    _barrier(context)
    if context.is_main:
        _atomic_write_text(os.path.join(config.checkpoint_dir, LATEST), os.path.basename(directory) + "\n")
    name = os.path.basename(directory)
    written = [] if written is None else written
    if name in written:  # listed once, where it was last written
        written.remove(name)
    written.append(name)
    if context.is_main:
        _prune(config.checkpoint_dir, config.keep_checkpoints, written)
    _barrier(context)
    return directory


def _prune(checkpoint_dir: str, keep: int, written: Sequence[str]) -> None:
    """Delete all but the ``keep`` most recently written step directories.

    Step numbers say nothing about age: a fresh run into a directory that an earlier,
    longer run used writes lower steps after higher ones. Newest first are: this run's
    checkpoints in the reverse order it wrote them (``written``, oldest first; its last
    is the one just written, which ``latest`` names, and is never deleted), then the
    other step directories by the modification time of the directory (when its last
    file was written), the higher step first on a tie. Only ``step_NNNNNNNNN``
    directories are considered.
    """
    order = {name: position for position, name in enumerate(written)}

    def age(name: str) -> tuple:  # larger is newer
        try:
            modified = os.stat(os.path.join(checkpoint_dir, name)).st_mtime_ns
        except OSError:  # vanished meanwhile: the oldest
            modified = -1
        return (order.get(name, -1), modified, int(name[len("step_"):]))

    newest_first = sorted(_step_dirs(checkpoint_dir), key=age, reverse=True)
    for name in newest_first[keep:]:
        if not written or name != written[-1]:
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)


def _step_dirs(checkpoint_dir: str) -> List[str]:
    """The names of the ``step_NNNNNNNNN`` directories in ``checkpoint_dir`` (none when it
    does not exist), in name order."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(name for name in os.listdir(checkpoint_dir)
                  if _STEP_DIR_NAME.fullmatch(name) and os.path.isdir(os.path.join(checkpoint_dir, name)))


def _pointer_names(pointer: str, name: str) -> bool:
    """Whether the ``latest`` file ``pointer`` exists and names step directory ``name``."""
    try:
        with open(pointer, "rb") as file:
            return file.read(256).decode("ascii", errors="replace").strip() == name
    except FileNotFoundError:
        return False


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The directory the ``latest`` pointer names, or None when there is no pointer.

    Raises:
        CheckpointError: ``latest`` cannot be read, is empty, does not hold the name of a
            step directory (``step_NNNNNNNNN``), or names one that does not exist.
    """
    path = os.path.join(checkpoint_dir, LATEST)
    try:
        with open(path, "rb") as pointer:
            content = pointer.read(256)  # a step directory's name is short; more is not one
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointError(f"--resume: cannot read {path} ({error.strerror or error}); it should hold "
                              f"the name of the newest step directory of {checkpoint_dir}") from None
    fix = (f"it should hold the name of the newest step directory (step_NNNNNNNNN) of {checkpoint_dir}; "
           "correct it, or delete it to start from step 0")
    name = content.decode("ascii", errors="replace").strip()
    if not name:
        raise CheckpointError(f"--resume: {path} is empty; {fix}")
    if not _STEP_DIR_NAME.fullmatch(name):
        raise CheckpointError(f"--resume: {path} holds {content[:40]!r}, not a step directory's name; {fix}")
    directory = os.path.join(checkpoint_dir, name)
    if not os.path.isdir(directory):
        raise CheckpointError(f"--resume: {path} names {name}, but {checkpoint_dir} has no directory {name}; "
                              f"{fix}")
    return directory


# What torch.load raised on empty, truncated, bit-flipped and foreign files (a fuzz of a
# trainer file): all mean "damaged". TypeError, AttributeError and the like stay bugs.
_DAMAGED_FILE_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, LookupError,
                        struct.error, AssertionError)


def _load_file(path: str, directory: str, **kwargs):
    """``torch.load`` of a checkpoint file; a missing or unreadable one is a CheckpointError
    naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: the checkpoint {directory} has no {os.path.basename(path)}; "
                              "it is incomplete (use an older step directory or a fresh --checkpoint-dir)")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except _DAMAGED_FILE_ERRORS as error:
        if os.path.getsize(path) == 0:
            detail = "it is empty"
        else:  # the first sentence: torch's messages go on for lines about weights_only
            detail = f"{type(error).__name__}: " + " ".join(str(error).split()).split(". ")[0][:160]
        raise CheckpointError(f"--resume: cannot read {path} ({detail}); the checkpoint is damaged") from error


def _check_trainer_state(state, path: str) -> None:
    """The fields :func:`save` writes: a non-negative int step, a dict of settings, a CPU
    RNG state; raises CheckpointError naming ``path`` and the first one missing or wrong."""
    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"--resume: {path} {what}; it was not written by sparsekit.train or is damaged")

    if not isinstance(state, dict):
        raise damaged(f"holds a {type(state).__name__}, not the trainer state (a dict)")
    missing = [key for key in ("step", "config", "cpu_rng") if key not in state]
    if missing:
        raise damaged(f"lacks {', '.join(repr(key) for key in missing)}")
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= INT64_MAX:
        raise damaged(f"holds step {step!r}, not an integer >= 0")
    if not isinstance(state["config"], dict):
        raise damaged(f"holds settings of type {type(state['config']).__name__}, not a dict")
    rng = state["cpu_rng"]
    expected = torch.get_rng_state()
    if not (isinstance(rng, torch.Tensor) and rng.dtype == expected.dtype and rng.shape == expected.shape):
        raise damaged("holds no valid CPU RNG state ('cpu_rng')")
    if "cuda_rng" in state and not (isinstance(state["cuda_rng"], torch.Tensor)
                                    and state["cuda_rng"].dtype == torch.uint8):
        raise damaged("holds no valid CUDA RNG state ('cuda_rng')")


def _table_capacity(settings: Dict) -> Tuple[int, str]:
    """The rows of each rank's sparsekit table under a run's resume settings, and the flag
    that set them (``--capacity-per-rank``, else ``--table-rows``; see :func:`build`)."""
    if settings["capacity_per_rank"] is not None:
        return settings["capacity_per_rank"], f"--capacity-per-rank {settings['capacity_per_rank']}"
    return settings["table_rows"], f"--table-rows {settings['table_rows']}"


def _flag_text(key: str, value) -> str:
    """A setting as its flag: ``--eviction 'lru'``, or ``no --eviction`` when it was left out."""
    flag = "--" + key.replace("_", "-")
    return f"no {flag}" if value is None else f"{flag} {value!r}"


def _load_trainer_state(config: TrainConfig, context: Context, directory: str) -> Dict:
    """This rank's trainer state of the checkpoint in ``directory``, checked against the
    settings of this run (see :func:`load`)."""
    # A different world size: ranks without a file of their own take rank 0's RNG state.
    # Rank 0's file says how many ranks wrote the checkpoint: a file of a rank beyond them is
    # a leftover of an earlier run on more ranks (saves since remove them), never read.
    path = os.path.join(directory, "trainer_rank0.pt")
    state = _load_file(path, directory)
    _check_trainer_state(state, path)
    own = os.path.join(directory, f"trainer_rank{context.rank}.pt")
    saved_ranks = state.get("world_size")
    if not isinstance(saved_ranks, int) or isinstance(saved_ranks, bool) or saved_ranks < 1:
        saved_ranks = None  # not recorded: every file present is taken as written with it
    # A rank the checkpoint had must find its own file (a missing one is reported by
    # _load_file); without a recorded count, a file present is taken as its own.
    if context.rank > 0 and (context.rank < saved_ranks if saved_ranks is not None else os.path.exists(own)):
        path = own
        state = _load_file(path, directory)
        _check_trainer_state(state, path)
    recorded = state["config"]
    # A key an older checkpoint lacks was its default then.
    saved = {key: recorded.get(key, getattr(TrainConfig, key)) for key in TrainConfig.RESUME_KEYS}
    now = {key: getattr(config, key) for key in TrainConfig.RESUME_KEYS}
    keys = TrainConfig.RESUME_KEYS
    # The synthetic stream does not depend on the held-out samples; a checkpoint written
    # before they were recorded is not held to them.
    keys = tuple(key for key in keys if key not in ("eval_samples", "eval_data")
                 or (now["data"] != "synthetic" and key in recorded))
    details = []
    if saved["embedding"] == now["embedding"] == "sparsekit":
        # The table's size is what must match: --capacity-per-rank N, or --table-rows N
        # without it, make the same table (--table-rows then sizes nothing else).
        keys = tuple(key for key in keys if key not in ("table_rows", "capacity_per_rank"))
        old, new = _table_capacity(saved), _table_capacity(now)
        if old[0] != new[0]:
            details.append(f"a table capacity per rank of {old[0]} ({old[1]}; now {new[0]} from {new[1]})")
    details += [f"{_flag_text(key, saved[key])} (now {'left out' if now[key] is None else repr(now[key])})"
                for key in keys if saved[key] != now[key]]
    if details:
        raise CheckpointError(f"--resume: the checkpoint {directory} was written with {', '.join(details)}; "
                              "resume with the same settings or use a fresh --checkpoint-dir")
    return state


def _agree(context: Context, error: Optional[BaseException], what: str) -> None:
    """Every rank raises when ``what`` failed on any rank: its own error, or
    ``OtherRankError`` (a rank that stopped alone would leave the others to find it gone
    in their next collective)."""
    from ..checkpoint import _agree_or_raise

    _agree_or_raise(dist.group.WORLD if context.world_size > 1 else None, error, what)


def load(config: TrainConfig, context: Context, directory: str, model: nn.Module, optimizer) -> Dict:
    """Restore a checkpoint written by :func:`save` (any world size); returns the trainer state.

    Raises:
        CheckpointError: a file is missing, damaged or lacks what :func:`save` writes, or
            the checkpoint was written with other settings.
    """
    error: Optional[BaseException] = None
    try:
        state = _load_trainer_state(config, context, directory)
    except Exception as exc:  # one rank's own trainer file: every rank raises, none waits in the load
        error = exc
    _agree(context, error, "--resume (reading the trainer state)")
    if config.embedding == "sparsekit":
        import sparsekit as sk

        try:
            sk.load_checkpoint(os.path.join(directory, "model"), model, optimizer)
        except sk.HashTableFullError as error:  # the capacity is the checkpoint's: only more ranks help
            raise CheckpointError(f"--resume: cannot load the checkpoint {directory}: {error} (here the capacity "
                                  "must stay the checkpoint's: resume on more ranks)") from error
        except (ValueError, OSError) as error:  # what it raises for a bad checkpoint
            raise CheckpointError(f"--resume: cannot load the checkpoint {directory}: {error}") from error
    else:
        model_path = os.path.join(directory, "model.pt")
        blob = _load_file(model_path, directory, map_location=context.device)
        if not (isinstance(blob, dict) and isinstance(blob.get("model"), dict)
                and isinstance(blob.get("optimizer"), dict)):
            raise CheckpointError(f"--resume: {model_path} holds no 'model' and 'optimizer' states; "
                                  "it was not written by sparsekit.train or is damaged")
        try:
            optimizer.check_state_dict(blob["optimizer"])  # before the model changes
            model.load_state_dict(blob["model"])
            optimizer.load_state_dict(blob["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:  # torch's errors for states that do not fit
            detail = f"{type(error).__name__}: " + " ".join(str(error).split())[:300]
            raise CheckpointError(f"--resume: {model_path} does not fit the model ({detail}); "
                                  "it was not written by sparsekit.train or is damaged") from error
    torch.set_rng_state(state["cpu_rng"])
    if context.device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], context.device)
    return state


# ---- the loop ----

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _global_mean(value: torch.Tensor, context: Context) -> float:
    if context.world_size > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= context.world_size
    return float(value)


def _finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def train(config: TrainConfig, log=print) -> Dict[str, float]:
    """Run the harness; returns (on every rank) the metrics of the final evaluation.

    Args:
        config: the run.
        log: where rank 0's log lines go.

    Returns:
        ``auc``, ``logloss`` (held-out), ``samples_per_s`` (global training samples per
        second of this process's training steps), ``steps``, ``world_size`` and more;
        rank 0 also writes them to ``config.metrics_json`` when set.
    """
    config.validate()
    context = setup(config.device, config.timeout)
    if config.batch_size % context.world_size:
        raise FlagError(f"--batch-size {config.batch_size} is the global batch; it must be a "
                        f"multiple of the world size {context.world_size}")
    with contextlib.ExitStack() as cleanup:  # on errors too: close the files and the progress bar
        data = make_data(config)
        if hasattr(data, "close"):
            cleanup.callback(data.close)
        return _train(config, context, data, log, cleanup)


def _train(config: TrainConfig, context: Context, data, log, cleanup: contextlib.ExitStack) -> Dict[str, float]:
    """:func:`train` once the process group and the data are set up; ``cleanup`` closes
    what it opens."""
    model, trained, optimizer = build(config, context)

    start_step = 0
    resumed_loss: Tuple[float, int] = (0.0, 0)  # the loss since the last log line before the save
    written: List[str] = []  # this run's step directories, oldest first (what save keeps)
    if config.resume:
        directory = latest_checkpoint(config.checkpoint_dir)
        steps = _step_dirs(config.checkpoint_dir) if directory is None else []
        if steps:
            # Step directories without a pointer: a save that rewrote the step `latest` named
            # was interrupted, or the pointer was deleted. Which one is whole is unknown.
            raise CheckpointError(f"--resume: {config.checkpoint_dir} holds step directories ({steps[0]} .. "
                                  f"{steps[-1]}) but no {LATEST!r} file naming the one to resume from (a save "
                                  "was interrupted, or the file was deleted); write the name of a complete step "
                                  f"directory into {os.path.join(config.checkpoint_dir, LATEST)}, or use a fresh "
                                  "--checkpoint-dir")
        if directory is None:
            if context.is_main:
                log(f"--resume: no checkpoint in {config.checkpoint_dir}, starting from step 0")
        else:
            state = load(config, context, directory, model, optimizer)
            start_step = state["step"]
            layer, logged = _logging_layer(model, config), state.get("logged_stats")
            if layer is not None and isinstance(logged, dict) and all(
                    isinstance(logged.get(key), int) for key in ("evicted", "admitted")):
                layer._logged_stats = logged  # the log's "+N since the last line" goes on as it would have
            logged_loss = state.get("logged_loss")
            if isinstance(logged_loss, dict) and isinstance(logged_loss.get("sum"), float) and isinstance(
                    logged_loss.get("steps"), int) and not isinstance(logged_loss["steps"], bool) \
                    and logged_loss["steps"] >= 0:
                resumed_loss = (logged_loss["sum"], logged_loss["steps"])  # train_loss goes on likewise
            if context.is_main:
                log(f"resumed from {directory} at step {start_step}")
                if start_step >= config.steps:
                    log(f"nothing to train: the checkpoint is at step {start_step}, --steps is {config.steps} "
                        "(the total to reach); the loaded model is evaluated")

    bar = None
    if context.is_main and config.progress:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs piped to a file).
        bar = tqdm(total=config.steps, initial=start_step, desc=f"train[{config.embedding}]",
                   unit="step", dynamic_ncols=True, mininterval=0.5, disable=None)
        cleanup.callback(bar.close)
        log = bar.write  # keep log lines above the bar
    if context.is_main:
        log(f"sparsekit.train: embedding={config.embedding} device={context.device} "
            f"world_size={context.world_size} global_batch={config.batch_size} steps={config.steps} "
            f"data={config.data}")

    loss_fn = nn.BCEWithLogitsLoss()
    # Each rank's loss summed over the steps since the last log line. After a resume it
    # starts from the ranks' mean of those sums at the save (its global mean is the same).
    interval_loss = torch.full((), resumed_loss[0], device=context.device)
    interval_steps = resumed_loss[1]
    # The steps of this process since the last log line: the rate's (interval_steps also
    # counts those trained before a resume, whose seconds are not in interval_seconds).
    rate_steps = 0
    interval_seconds = 0.0
    session_seconds = 0.0
    session_samples = 0
    metrics: Dict[str, float] = {}
    if start_step == 0 and config.eval_every:
        # The untrained model's score, so the log shows where the AUC rises from.
        untrained = evaluate(model, data, config, context)
        if config.steps == 0:
            metrics = untrained  # also the final score: no step will change the model
        if context.is_main:
            log(f"step {0:>6d}  {'':17s}  eval_auc {untrained['auc']:.4f}  "
                f"eval_logloss {untrained['logloss']:.4f}")
    model.train()
    step = start_step
    tick = time.perf_counter()
    while step < config.steps:
        batch = data.train_batch(step, config.batch_size, context.rank, context.world_size)
        batch = batch.to(context.device)
        loss = loss_fn(trained(batch.dense, batch.keys), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        interval_loss += loss.detach()
        interval_steps += 1
        rate_steps += 1
        step += 1
        session_samples += config.batch_size

        evaluate_now = step == config.steps or (config.eval_every and step % config.eval_every == 0)
        checkpoint_now = config.checkpoint_dir and (
            step == config.steps or (config.checkpoint_every and step % config.checkpoint_every == 0))
        if bar is not None and (step % 10 == 0 or evaluate_now):
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{float(loss.detach()):.4f}", refresh=False)
        if not (evaluate_now or checkpoint_now):
            continue
        # Pause the clock: evaluation and checkpoints are not training throughput.
        _synchronize(context.device)
        elapsed = time.perf_counter() - tick
        session_seconds += elapsed
        interval_seconds += elapsed
        if evaluate_now:
            # The log shows the rate since its previous line, so changes of speed show.
            samples_per_s = rate_steps * config.batch_size / interval_seconds
            train_loss = _global_mean(interval_loss / interval_steps, context)
            metrics = evaluate(model, data, config, context)
            table = _table_stats(model, config)  # collective: every rank asks
            if context.is_main:
                log(f"step {step:>6d}  train_loss {train_loss:.4f}  eval_auc {metrics['auc']:.4f}  "
                    f"eval_logloss {metrics['logloss']:.4f}  samples/s {samples_per_s:,.0f}" + table)
            interval_loss.zero_()
            interval_steps = 0
            rate_steps = 0
            interval_seconds = 0.0
        if checkpoint_now:
            logged_loss = (_global_mean(interval_loss, context), interval_steps)  # collective, as save is
            save(config, context, step, model, optimizer, written, logged_loss)
        _synchronize(context.device)
        tick = time.perf_counter()
    if bar is not None:
        bar.close()

    if start_step == config.steps == 0 and config.checkpoint_dir:
        # --steps 0: the untrained model is the end, and the end is checkpointed.
        save(config, context, 0, model, optimizer, written)
    if not metrics:  # nothing left to train (resumed at the end): evaluate what was loaded
        metrics = evaluate(model, data, config, context)
    result = {
        # An undefined score (one class in the held-out labels) is null, not JSON's invalid NaN.
        "auc": _finite_or_none(metrics["auc"]),
        "logloss": _finite_or_none(metrics["logloss"]),
        "samples_per_s": session_samples / session_seconds if session_seconds else None,
        "steps": step,
        "world_size": context.world_size,
        "embedding": config.embedding,
        "device": str(context.device),
        "batch_size": config.batch_size,
        "embedding_dim": config.embedding_dim,
        "tables": config.tables,
        "embedding_dtype": config.embedding_dtype,
        "eval_samples": metrics["eval_samples"],
        "resumed_from_step": start_step,
        "seed": config.seed,
        "data": config.data,
        # Whether freed memory is reused (python -m sparsekit.train sets it; see allocator).
        "malloc_keeps_freed_memory": freed_memory_kept(),
    }
    if context.is_main and config.metrics_json:
        directory = os.path.dirname(os.path.abspath(config.metrics_json))
        os.makedirs(directory, exist_ok=True)
        _atomic_write_text(config.metrics_json, json.dumps(result, indent=2) + "\n")
    return result

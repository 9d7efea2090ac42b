"""Training loop of the harness: setup, train, evaluate, checkpoint, resume.

Global batch semantics: ``batch_size`` is the *global* batch; rank ``r`` of ``W`` trains
on its ``batch_size / W`` rows of it (see :mod:`sparsekit.train.data`). The dense layers
are data-parallel (DDP averages their gradients), the sparsekit embedding is
model-parallel (each key lives on one rank), so the gradient of every parameter is that
of the global mean loss, whatever ``W``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .data import NUM_SLOTS, SyntheticCriteo
from .metrics import all_gather_1d, log_loss, roc_auc
from .model import DLRM, SparsekitSlotEmbedding, SparsekitTableEmbedding, TorchSlotEmbedding

LATEST = "latest"
EMBEDDING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Held-out samples when --eval-samples is not given: this many of the synthetic stream, or
# of a TSV file's last lines, at most a tenth of them (see make_data).
DEFAULT_EVAL_SAMPLES = 32768


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
        at_least = {"steps": 0, "batch_size": 1, "eval_samples": 1, "eval_every": 0, "checkpoint_every": 0,
                    "embedding_dim": 1, "table_rows": 1, "vocab_per_slot": 1, "keep_checkpoints": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if name == "eval_samples" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout!r}")
        if self.capacity_per_rank is not None and (not isinstance(self.capacity_per_rank, int)
                                                   or isinstance(self.capacity_per_rank, bool)
                                                   or self.capacity_per_rank < 1):
            raise ValueError(f"--capacity-per-rank must be an integer >= 1, got {self.capacity_per_rank!r}")
        if self.eviction not in (None, "lru", "lfu"):
            raise ValueError(f"--eviction must be lru or lfu, got {self.eviction!r}")
        if not isinstance(self.admit_after, int) or isinstance(self.admit_after, bool) or self.admit_after < 1:
            raise ValueError(f"--admit-after must be an integer >= 1, got {self.admit_after!r}")
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
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        for flag, path in (("--data", self.data if self.data != "synthetic" else None),
                           ("--eval-data", self.eval_data)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file (a Criteo TSV file, or --data synthetic)")

    # Fields that must match between a checkpoint and the run resuming from it.
    RESUME_KEYS = ("embedding", "embedding_dim", "batch_size", "seed", "data", "table_rows",
                   "vocab_per_slot", "lr", "capacity_per_rank", "eviction", "admit_after", "tables",
                   "embedding_dtype")


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
        raise ValueError(f"--device must be cpu or cuda, got {device_name!r}")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available; use --device cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        if device_name == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
    if config.data == "synthetic":
        return SyntheticCriteo(config.seed, vocab_per_slot=config.vocab_per_slot)
    from .criteo import CriteoTSV

    eval_samples = config.eval_samples
    if eval_samples is None:
        eval_samples = DEFAULT_EVAL_SAMPLES
        if config.eval_data is None:  # held out from --data: a tenth of a small file
            from .criteo import LineIndex

            eval_samples = min(eval_samples, max(1, LineIndex(config.data).num_lines // 10))
    return CriteoTSV(config.data, eval_samples=eval_samples, eval_path=config.eval_data,
                     hash_seed=config.seed)


def _table_stats(model: nn.Module, config: TrainConfig) -> str:
    """The log's table part: fill, evictions and admissions since the last line (sparsekit
    embedding with a dynamic table only; a collective under a process group)."""
    layer = getattr(model, "embedding", None)
    if isinstance(layer, SparsekitSlotEmbedding):
        layer = layer.embedding
    elif not isinstance(layer, SparsekitTableEmbedding):
        return ""
    if config.eviction is None and config.admit_after == 1:
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
    if config.embedding == "sparsekit":
        capacity = config.capacity_per_rank if config.capacity_per_rank is not None else config.table_rows
        if config.tables == "per-slot":
            # The same rows in all: the capacity split evenly over the 26 tables.
            embedding = SparsekitTableEmbedding(
                max(1, capacity // NUM_SLOTS), config.embedding_dim, context.device, context.world_size,
                config.seed, eviction=config.eviction, admit_after=config.admit_after,
                dtype=EMBEDDING_DTYPES[config.embedding_dtype])
        else:
            embedding = SparsekitSlotEmbedding(capacity, config.embedding_dim, context.device,
                                               context.world_size, config.seed, eviction=config.eviction,
                                               admit_after=config.admit_after)
    elif config.embedding == "torch":
        if context.world_size > 1 and context.device.type == "cuda":
            raise RuntimeError("--embedding torch replicates nn.EmbeddingBag(sparse=True) under DDP, "
                               "and NCCL has no sparse all-reduce: run it on one process, or on CPU "
                               "(gloo), or use --embedding sparsekit")
        embedding = TorchSlotEmbedding(config.table_rows, config.embedding_dim, context.device)
    else:
        raise ValueError(f"--embedding must be sparsekit or torch, got {config.embedding!r}")
    model = DLRM(embedding, config.embedding_dim, device=context.device)

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

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


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


def _atomic_write_text(path: str, text: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def _atomic_torch_save(obj, path: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    torch.save(obj, temporary)
    os.replace(temporary, path)


def _barrier(context: Context) -> None:
    if context.world_size > 1:
        dist.barrier()


def save(config: TrainConfig, context: Context, step: int, model: nn.Module, optimizer) -> str:
    """Checkpoint the model, optimizer, step and RNG states; collective.

    The ``latest`` pointer moves only once every rank has finished writing, so an
    interrupted save leaves the previous checkpoint the one resumed from.
    """
    directory = _step_dir(config, step)
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
    _atomic_torch_save(state, os.path.join(directory, f"trainer_rank{context.rank}.pt"))
    _barrier(context)
    if context.is_main:
        _atomic_write_text(os.path.join(config.checkpoint_dir, LATEST), os.path.basename(directory) + "\n")
        # Keep the newest --keep-checkpoints (the one just written among them).
        older = sorted(name for name in os.listdir(config.checkpoint_dir) if name.startswith("step_"))
        for name in older[:-config.keep_checkpoints]:
            if name != os.path.basename(directory):
                shutil.rmtree(os.path.join(config.checkpoint_dir, name), ignore_errors=True)
    _barrier(context)
    return directory


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The directory the ``latest`` pointer names, or None when there is none."""
    try:
        with open(os.path.join(checkpoint_dir, LATEST)) as pointer:
            name = pointer.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(checkpoint_dir, name)


def load(config: TrainConfig, context: Context, directory: str, model: nn.Module, optimizer) -> Dict:
    """Restore a checkpoint written by :func:`save` (any world size); returns the trainer state."""
    own = os.path.join(directory, f"trainer_rank{context.rank}.pt")
    # A different world size: ranks without a file of their own take rank 0's RNG state.
    state = torch.load(own if os.path.exists(own) else os.path.join(directory, "trainer_rank0.pt"),
                       weights_only=True)
    saved = state["config"]
    # A key an older checkpoint lacks was its default then.
    saved = {key: saved.get(key, getattr(TrainConfig, key)) for key in TrainConfig.RESUME_KEYS}
    mismatched = {key: (saved[key], getattr(config, key)) for key in TrainConfig.RESUME_KEYS
                  if saved[key] != getattr(config, key)}
    if mismatched:
        details = ", ".join(f"--{key.replace('_', '-')} {old!r} (now {new!r})"
                            for key, (old, new) in mismatched.items())
        raise ValueError(f"--resume: the checkpoint {directory} was written with {details}; "
                         "resume with the same settings or use a fresh --checkpoint-dir")
    if config.embedding == "sparsekit":
        import sparsekit as sk

        sk.load_checkpoint(os.path.join(directory, "model"), model, optimizer)
    else:
        blob = torch.load(os.path.join(directory, "model.pt"), map_location=context.device,
                          weights_only=True)
        model.load_state_dict(blob["model"])
        optimizer.load_state_dict(blob["optimizer"])
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
        raise ValueError(f"--batch-size {config.batch_size} is the global batch; it must be a "
                         f"multiple of the world size {context.world_size}")
    data = make_data(config)
    model, trained, optimizer = build(config, context)

    start_step = 0
    if config.resume:
        directory = latest_checkpoint(config.checkpoint_dir)
        if directory is None:
            if context.is_main:
                log(f"--resume: no checkpoint in {config.checkpoint_dir}, starting from step 0")
        else:
            state = load(config, context, directory, model, optimizer)
            start_step = state["step"]
            if context.is_main:
                log(f"resumed from {directory} at step {start_step}")

    bar = None
    if context.is_main and config.progress:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs piped to a file).
        bar = tqdm(total=config.steps, initial=start_step, desc=f"train[{config.embedding}]",
                   unit="step", dynamic_ncols=True, mininterval=0.5, disable=None)
        log = bar.write  # keep log lines above the bar
    if context.is_main:
        log(f"sparsekit.train: embedding={config.embedding} device={context.device} "
            f"world_size={context.world_size} global_batch={config.batch_size} steps={config.steps} "
            f"data={config.data}")

    loss_fn = nn.BCEWithLogitsLoss()
    interval_loss = torch.zeros((), device=context.device)
    interval_steps = 0
    interval_seconds = 0.0
    session_seconds = 0.0
    session_samples = 0
    metrics: Dict[str, float] = {}
    if start_step == 0 and config.eval_every:
        # The untrained model's score, so the log shows where the AUC rises from.
        untrained = evaluate(model, data, config, context)
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
            samples_per_s = interval_steps * config.batch_size / interval_seconds
            train_loss = _global_mean(interval_loss / interval_steps, context)
            metrics = evaluate(model, data, config, context)
            table = _table_stats(model, config)  # collective: every rank asks
            if context.is_main:
                log(f"step {step:>6d}  train_loss {train_loss:.4f}  eval_auc {metrics['auc']:.4f}  "
                    f"eval_logloss {metrics['logloss']:.4f}  samples/s {samples_per_s:,.0f}" + table)
            interval_loss.zero_()
            interval_steps = 0
            interval_seconds = 0.0
        if checkpoint_now:
            save(config, context, step, model, optimizer)
        _synchronize(context.device)
        tick = time.perf_counter()
    if bar is not None:
        bar.close()

    if not metrics:  # nothing left to train (resumed at the end): evaluate what was loaded
        metrics = evaluate(model, data, config, context)
    result = {
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
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
    }
    if context.is_main and config.metrics_json:
        directory = os.path.dirname(os.path.abspath(config.metrics_json))
        os.makedirs(directory, exist_ok=True)
        _atomic_write_text(config.metrics_json, json.dumps(result, indent=2) + "\n")
    if hasattr(data, "close"):
        data.close()
    return result

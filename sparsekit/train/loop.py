"""Training loop of the harness: train, evaluate, checkpoint, resume.

Global batch semantics: ``batch_size`` is the *global* batch; rank ``r`` of ``W`` trains
on its ``batch_size / W`` rows of it (see :mod:`sparsekit.train.data`). The dense layers
are data-parallel (DDP averages their gradients), the sparsekit embedding is
model-parallel (each key lives on one rank), so the gradient of every parameter is that
of the global mean loss, whatever ``W``. The run's settings are
:mod:`sparsekit.train.config`'s, its setup :mod:`sparsekit.train.build`'s and its
checkpoints :mod:`sparsekit.train.checkpointing`'s; their names are importable from here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..allocator import freed_memory_kept
from ..checkpoint import LATEST, CheckpointDirectory
from ..checkpoint.layout import write_file
from .build import Context, OptimizerGroup, build, evaluate, logging_layer, make_data, setup, table_stats
from .checkpointing import latest_checkpoint, load, save
from .config import (DEFAULT_EVAL_SAMPLES, EMBEDDING_DTYPES, INT64_MAX, MAX_BATCH_SIZE, MAX_LR,
                     MAX_SYNTHETIC_EVAL_SAMPLES, MAX_TIMEOUT, MAX_VOCAB_PER_SLOT, MIN_TIMEOUT, CheckpointError,
                     FlagError, HarnessError, TrainConfig)

__all__ = ["DEFAULT_EVAL_SAMPLES", "EMBEDDING_DTYPES", "INT64_MAX", "LATEST", "MAX_BATCH_SIZE", "MAX_LR",
           "MAX_SYNTHETIC_EVAL_SAMPLES", "MAX_TIMEOUT", "MAX_VOCAB_PER_SLOT", "MIN_TIMEOUT", "CheckpointError",
           "Context", "FlagError", "HarnessError", "OptimizerGroup", "TrainConfig", "build", "evaluate",
           "latest_checkpoint", "load", "make_data", "save", "setup", "train"]


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
    written: List[int] = []  # the steps of this run's checkpoints, oldest first (what save keeps)
    if config.resume:
        saved_step = latest_checkpoint(config.checkpoint_dir)
        if saved_step is None:
            if context.is_main:
                log(f"--resume: no checkpoint in {config.checkpoint_dir}, starting from step 0")
        else:
            state = load(config, context, saved_step, model, optimizer)
            directory = CheckpointDirectory(config.checkpoint_dir).checkpoint(saved_step)
            start_step = state["step"]
            layer, logged = logging_layer(model, config), state.get("logged_stats")
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
            table = table_stats(model, config)  # collective: every rank asks
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
            write_file(temporary, write)
            os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise OSError(error.errno, error.strerror or str(error), path) from error


def _atomic_write_text(path: str, text: str) -> None:
    _atomic_write(path, lambda out: out.write(text.encode()))

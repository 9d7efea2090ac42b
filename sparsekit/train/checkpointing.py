"""Checkpoints of a training run: the model, its optimizer and each rank's trainer state.

``--checkpoint-dir`` is a :class:`sparsekit.checkpoint.CheckpointDirectory`: every save is
one library checkpoint ``ckpt-NNNNNN/`` numbered by the training step, written and made
the latest by :func:`sparsekit.save_checkpoint` (collective and atomic: ``LATEST`` moves
only once every rank has written its part). Each rank's trainer state (step, settings,
RNG states, log counters) rides along in it as ``trainer_rankR.pt``; the torch baseline's
optimizers as rank 0's ``optimizer.pt``. So a model-only ``sk.load_checkpoint`` reads any
run's checkpoint. After each save the ``--keep-checkpoints`` most recently written are kept.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import sparsekit as sk

from ..checkpoint import LATEST, CheckpointDirectory
from ..checkpoint.collective import agree_or_raise
from .build import Context, logging_layer
from .config import INT64_MAX, CheckpointError, TrainConfig, table_capacity

__all__ = ["OPTIMIZER_FILE", "latest_checkpoint", "load", "save", "trainer_file"]

# The torch baseline's optimizer state (rank 0's file: every rank's optimizers are alike).
OPTIMIZER_FILE = "optimizer.pt"
# A directory of the layout before checkpoints were the library's: ``latest`` named a
# ``step_NNNNNNNNN/`` holding ``model/`` (a library checkpoint directory) and trainer files.
_OLD_POINTER = "latest"
_OLD_STEP_DIR = re.compile(r"step_(\d{9,})")


def trainer_file(rank: int) -> str:
    """The name of rank ``rank``'s trainer state file in a checkpoint."""
    return f"trainer_rank{rank}.pt"


def _barrier(context: Context) -> None:
    if context.world_size > 1:
        dist.barrier()


def save(config: TrainConfig, context: Context, step: int, model: nn.Module, optimizer,
         written: Optional[List[int]] = None, logged_loss: Optional[Tuple[float, int]] = None) -> str:
    """Checkpoint the model, optimizer, step and RNG states as ``ckpt-<step>``; collective.

    ``LATEST`` moves only once every rank has written its part, so an interrupted save
    leaves the previous checkpoint the one resumed from. Then the
    ``config.keep_checkpoints`` most recently written checkpoints are kept: this run's in
    the reverse order it wrote them, then the others by when they were written (see
    :meth:`~sparsekit.checkpoint.CheckpointDirectory.prune`).

    Args:
        written: the steps of the checkpoints this run wrote, oldest first; the one
            written now is moved to its end. Pass the same list to every save of a run.
        logged_loss: the training loss summed over the steps since the last log line (the
            ranks' mean) and their number, so a resumed log's first ``train_loss`` averages
            the same steps as the uninterrupted run's.

    Returns:
        The path of the checkpoint written.
    """
    state = {
        "step": step,
        "config": {key: getattr(config, key) for key in TrainConfig.RESUME_KEYS},
        "world_size": context.world_size,
        "cpu_rng": torch.get_rng_state(),
    }
    if context.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(context.device)
    logged = getattr(logging_layer(model, config), "_logged_stats", None)
    if logged is not None:  # the totals at the last log line: a resumed log counts on from them
        state["logged_stats"] = {key: int(logged[key]) for key in ("evicted", "admitted")}
    if logged_loss is not None:  # the loss since the last log line: a resumed log averages on from it
        state["logged_loss"] = {"sum": float(logged_loss[0]), "steps": int(logged_loss[1])}
    extra = {trainer_file(context.rank): state}
    sparse = config.embedding == "sparsekit"
    if not sparse and context.is_main:  # the torch baseline's optimizers are no torch Optimizer
        extra[OPTIMIZER_FILE] = optimizer.state_dict()
    # Looked up on the package at call time, so that a caller's wrapper of it is used.
    path = sk.save_checkpoint(config.checkpoint_dir, model, optimizer if sparse else None, step=step, extra=extra,
                              keep=None)
    written = [] if written is None else written
    if step in written:  # listed once, where it was last written
        written.remove(step)
    written.append(step)
    if context.is_main:
        CheckpointDirectory(config.checkpoint_dir).prune(config.keep_checkpoints, reversed(written))
    _barrier(context)
    return path


def latest_checkpoint(checkpoint_dir: str) -> Optional[int]:
    """The step of the checkpoint ``LATEST`` names, or None when the directory holds none.

    Raises:
        CheckpointError: ``LATEST`` is damaged or names no checkpoint; checkpoints are
            there but no ``LATEST`` (which one is whole is unknown); or the directory holds
            checkpoints of the older layout (``latest`` and ``step_NNNNNNNNN/``), which
            are not resumed.
    """
    checkpoints = CheckpointDirectory(checkpoint_dir)
    try:
        step = checkpoints.latest_step()
    except ValueError as error:
        raise CheckpointError(f"--resume: {error}") from None
    if step is not None:
        return step
    steps = checkpoints.steps()
    if steps:
        # Checkpoints without a pointer: a save that rewrote the checkpoint LATEST named was
        # interrupted, or the pointer was deleted. Which one is whole is unknown.
        raise CheckpointError(f"--resume: {checkpoint_dir} holds checkpoints (ckpt-{steps[0]:06d} .. "
                              f"ckpt-{steps[-1]:06d}) but no {LATEST!r} file naming the one to resume from (a save "
                              "was interrupted, or the file was deleted); write the name of a complete checkpoint "
                              f"into {os.path.join(checkpoint_dir, LATEST)}, or use a fresh --checkpoint-dir")
    if os.path.isdir(checkpoint_dir) and (os.path.exists(os.path.join(checkpoint_dir, _OLD_POINTER)) or any(
            _OLD_STEP_DIR.fullmatch(name) for name in os.listdir(checkpoint_dir))):
        raise CheckpointError(f"--resume: {checkpoint_dir} holds checkpoints of the older layout ('latest' and "
                              "step_NNNNNNNNN/ directories), which this version does not resume; start a fresh "
                              "--checkpoint-dir (the model of an old step_NNNNNNNNN/model directory still loads "
                              "with sparsekit.load_checkpoint)")
    return None


# What torch.load raised on empty, truncated, bit-flipped and foreign files (a fuzz of a
# trainer file): all mean "damaged". TypeError, AttributeError and the like stay bugs.
_DAMAGED_FILE_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, LookupError,
                        struct.error, AssertionError)


def _load_file(path: str, directory: str, **kwargs):
    """``torch.load`` of a checkpoint file; a missing or unreadable one is a CheckpointError
    naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: the checkpoint {directory} has no {os.path.basename(path)}; "
                              "it is incomplete (use an older checkpoint or a fresh --checkpoint-dir)")
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


def _flag_text(key: str, value) -> str:
    """A setting as its flag: ``--eviction 'lru'``, or ``no --eviction`` when it was left out."""
    flag = "--" + key.replace("_", "-")
    return f"no {flag}" if value is None else f"{flag} {value!r}"


def _load_trainer_state(config: TrainConfig, context: Context, directory: str) -> Dict:
    """This rank's trainer state of the checkpoint in ``directory``, checked against the
    settings of this run (see :func:`load`)."""
    # A different world size: ranks without a file of their own take rank 0's RNG state.
    # Rank 0's file says how many ranks wrote the checkpoint: a file of a rank beyond them
    # (a leftover an older version kept) is never read.
    path = os.path.join(directory, trainer_file(0))
    state = _load_file(path, directory)
    _check_trainer_state(state, path)
    own = os.path.join(directory, trainer_file(context.rank))
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
        old, new = table_capacity(saved), table_capacity(now)
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
    agree_or_raise(dist.group.WORLD if context.world_size > 1 else None, error, what)


def load(config: TrainConfig, context: Context, step: int, model: nn.Module, optimizer) -> Dict:
    """Restore checkpoint ``step`` written by :func:`save` (any world size); returns the
    trainer state; collective.

    Raises:
        CheckpointError: a file is missing, damaged or lacks what :func:`save` writes, or
            the checkpoint was written with other settings.
    """
    directory = CheckpointDirectory(config.checkpoint_dir).checkpoint(step)
    error: Optional[BaseException] = None
    saved_optimizer = None
    try:
        state = _load_trainer_state(config, context, directory)
        if config.embedding != "sparsekit":
            path = os.path.join(directory, OPTIMIZER_FILE)
            saved_optimizer = _load_file(path, directory, map_location=context.device)
            try:
                optimizer.check_state_dict(saved_optimizer)  # before the model changes
            except ValueError as exc:
                detail = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300]
                raise CheckpointError(f"--resume: {path} does not fit the optimizer ({detail}); it was not written "
                                      "by sparsekit.train or is damaged") from exc
    except Exception as exc:  # one rank's own files: every rank raises, none waits in the load
        error = exc
    _agree(context, error, "--resume (reading the trainer state)")
    try:
        # The torch baseline's optimizers load below: the library sees its model alone.
        sk.load_checkpoint(config.checkpoint_dir, model, optimizer if config.embedding == "sparsekit" else None,
                           step=step)
    except sk.HashTableFullError as exc:  # the capacity is the checkpoint's: only more ranks help
        raise CheckpointError(f"--resume: cannot load the checkpoint {directory}: {exc} (here the capacity "
                              "must stay the checkpoint's: resume on more ranks)") from exc
    except (ValueError, OSError) as exc:  # what it raises for a bad checkpoint
        raise CheckpointError(f"--resume: cannot load the checkpoint {directory}: {exc}") from exc
    if saved_optimizer is not None:
        optimizer.load_state_dict(saved_optimizer)  # checked above: cannot fail
    torch.set_rng_state(state["cpu_rng"])
    if context.device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], context.device)
    return state

"""The settings of a training run (the flags of ``python -m sparsekit.train``) and their checks.

:class:`TrainConfig` holds every flag; :meth:`TrainConfig.validate` refuses a value out of
range, or a combination the run cannot honour, with a ValueError naming the flag, before
anything is set up. The upper bounds of the flags are defined here with the reason for
each. :class:`HarnessError` and its subclasses are what ``python -m sparsekit.train``
prints as one line instead of a traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..checkpoint import CheckpointDirectory
from ..checkpoint.layout import file_in_the_way, nearest_existing

__all__ = ["DEFAULT_EVAL_SAMPLES", "EMBEDDING_DTYPES", "INT64_MAX", "MAX_BATCH_SIZE", "MAX_LR",
           "MAX_SYNTHETIC_EVAL_SAMPLES", "MAX_TIMEOUT", "MAX_VOCAB_PER_SLOT", "MIN_TIMEOUT", "CheckpointError",
           "FlagError", "HarnessError", "TrainConfig", "table_capacity"]

EMBEDDING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Held-out samples when --eval-samples is not given: this many of the synthetic stream, or
# of a TSV file's last lines, at most a tenth of them (see make_data).
DEFAULT_EVAL_SAMPLES = 32768
# Upper bounds of the flags (see --help). Every rank builds the arrays of the whole global
# batch (about 2.5 KB per sample on the synthetic data), so a batch of 2^20 needs some 2.5 GB
# per rank before the model's own activations.
MAX_BATCH_SIZE = 1 << 20
# The synthetic data's hidden model holds 26 x N float32 effects (float64 while drawn) and a
# sampler built in O(N) Python steps: at 2^22, some 2 GB, and a setup longer than a short run.
MAX_VOCAB_PER_SLOT = 1 << 22
# Every evaluation generates the synthetic held-out samples afresh, so its cost grows with
# them. (From a file, --eval-samples is capped by the held-out lines instead.)
MAX_SYNTHETIC_EVAL_SAMPLES = 1 << 22
# Adam moves every parameter by about lr per step: at 1 the harness's model already learns
# nothing (AUC 0.5), and far larger steps overflow the weights to NaN.
MAX_LR = 1.0
# A week; torch keeps the process group's timeout in an int64 count of nanoseconds.
MAX_TIMEOUT = 7 * 24 * 3600.0
MIN_TIMEOUT = 1.0
# Sizes, steps and seeds reach numpy and torch as int64.
INT64_MAX = (1 << 63) - 1


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
            blocker = file_in_the_way(directory) if directory else None
            if blocker:
                raise ValueError(f"{flag} {value!r}: {blocker!r} is a file, not a directory")
            # Written to after training (a resumed run may only evaluate, reading its checkpoint).
            existing = nearest_existing(directory) if directory and not (flag == "--checkpoint-dir"
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
                if os.path.commonpath([checkpoints, target]) == checkpoints and CheckpointDirectory.owns(inside):
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


def table_capacity(settings: Dict) -> Tuple[int, str]:
    """The rows of each rank's sparsekit table under a run's resume settings, and the flag
    that set them (``--capacity-per-rank``, else ``--table-rows``; see :func:`build`)."""
    if settings["capacity_per_rank"] is not None:
        return settings["capacity_per_rank"], f"--capacity-per-rank {settings['capacity_per_rank']}"
    return settings["table_rows"], f"--table-rows {settings['table_rows']}"

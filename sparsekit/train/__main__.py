"""``python -m sparsekit.train``: train the DLRM-style CTR model of the harness.

One process::

    python -m sparsekit.train --device cpu --steps 300 --batch-size 1024

Several (dense layers data-parallel, embeddings model-parallel; gloo on CPU, NCCL on GPU)::

    torchrun --nproc_per_node 2 -m sparsekit.train --device cpu --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, NoReturn, Optional

import torch.distributed as dist

from .._checks import out_of_memory
from ..allocator import keep_freed_memory
from ..checkpoint import OtherRankError
from ..hashtable import HashTableFullError
from .criteo import CriteoFormatError
from .data import NUM_SLOTS
from .config import (
    MAX_BATCH_SIZE,
    MAX_LR,
    MAX_SYNTHETIC_EVAL_SAMPLES,
    MAX_TIMEOUT,
    MAX_VOCAB_PER_SLOT,
    FlagError,
    HarnessError,
    TrainConfig,
    table_capacity,
)
from .loop import train


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, except a switch's and a None one (its help says what
    happens without the flag)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _OneLineErrors(argparse.ArgumentParser):
    """An argument error is one line naming the flag and where help is, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m sparsekit.train``; its defaults are TrainConfig's."""
    defaults = TrainConfig()
    parser = _OneLineErrors(
        prog="python -m sparsekit.train",
        description="DLRM-style CTR training on sparsekit embeddings (or nn.EmbeddingBag for comparison).",
        formatter_class=_HelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="global batch size (split evenly over the ranks; every rank builds the "
                        f"whole batch's data, so at most {MAX_BATCH_SIZE:,})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--embedding", choices=("sparsekit", "torch"), default=defaults.embedding,
                        help="sparsekit: sk.DistributedEmbedding + sk.LazyAdam; torch: "
                        "nn.EmbeddingBag(sparse=True) + SparseAdam over key mod --table-rows")
    parser.add_argument("--data", default=defaults.data,
                        help="'synthetic' (generated in memory) or the path of a Criteo TSV file")
    parser.add_argument("--eval-data", default=None,
                        help="held-out Criteo TSV file, with --data FILE (default: the last --eval-samples "
                        "lines of --data)")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="held-out samples of each evaluation (default: 32768; with --data FILE and no "
                        "--eval-data, at most a tenth of the file's lines). With --data synthetic at most "
                        f"{MAX_SYNTHETIC_EVAL_SAMPLES:,} (generated afresh at every evaluation); with "
                        "--eval-data, at most that file's lines are used")
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every,
                        help="evaluate every N steps (0: only at the end)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go (default: none are written)")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                        help="checkpoint every N steps (0: only at the end); needs --checkpoint-dir")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir (from step 0 when it "
                        "holds none)")
    parser.add_argument("--metrics-json", default=None,
                        help="write the final held-out metrics here (rank 0; default: only printed)")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds the model, the synthetic data and the feature hashing "
                        "(0 <= seed < 2^63)")
    parser.add_argument("--embedding-dim", type=int, default=defaults.embedding_dim,
                        help="embedding width (the bottom MLP's output width too)")
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help=f"Adam learning rate (all parameters), > 0 and at most {MAX_LR:g}")
    parser.add_argument("--table-rows", type=int, default=defaults.table_rows,
                        help="--embedding torch: rows of the replicated table (keys are taken modulo "
                        "this); --embedding sparsekit: the default of --capacity-per-rank")
    parser.add_argument("--vocab-per-slot", type=int, default=defaults.vocab_per_slot,
                        help="distinct values per slot of the synthetic data "
                        f"(at most {MAX_VOCAB_PER_SLOT:,})")
    parser.add_argument("--capacity-per-rank", type=int, default=None,
                        help="--embedding sparsekit only: rows of each rank's hash table, the most "
                        "distinct keys a rank holds before --eviction (default: --table-rows)")
    parser.add_argument("--eviction", choices=("lru", "lfu"), default=None,
                        help="sparsekit: evict least recently / least frequently used keys when a table "
                        "is full (default: a full table is an error)")
    parser.add_argument("--admit-after", type=int, default=defaults.admit_after,
                        help="sparsekit: a key gets a row from the K-th training step it is seen in")
    parser.add_argument("--tables", choices=("shared", "per-slot"), default=defaults.tables,
                        help="sparsekit: one sk.DistributedEmbedding for all 26 slots, or one table per slot "
                        "in an sk.EmbeddingBagCollection (each table gets a 26th of the capacity)")
    parser.add_argument("--embedding-dtype", choices=("fp32", "bf16", "fp16"), default=defaults.embedding_dtype,
                        help="dtype of the per-slot tables (pooling and the exchange stay float32)")
    parser.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints,
                        help="checkpoints kept in --checkpoint-dir (the most recently written)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (log lines only)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout,
                        help="seconds any collective may wait under torchrun: a rank that fails and "
                        "stays alive makes the others raise after this long "
                        f"(at most {MAX_TIMEOUT:.0f}, a week)")
    return parser


def parse_args(argv: Optional[List[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> TrainConfig:
    """The run ``argv`` asks for; an out-of-range flag exits with status 2 and a usage
    message naming it (argparse's ``parser.error``)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config


# What gloo / NCCL raise on a rank whose peer is gone (it stopped on an error of its own,
# or was killed) or never came back within --timeout.
_PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Timed out|timed out|Timeout|"
                        r"NCCL communicator was aborted")


def _peer_lost(error: BaseException) -> Optional[str]:
    """The first line of a collective's failure caused by another rank, or None: only with a
    process group of more than one rank, for torch.distributed's own errors (DistError) and
    gloo's RuntimeErrors that say the connection to a peer is gone; or, while the group of
    WORLD_SIZE > 1 forms, a DistError saying the rendezvous timed out."""
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        # Forming the group: a rank that stopped before joining leaves the others waiting
        # in the rendezvous until --timeout (a store or socket timeout). Not this rank's
        # own failure to form it (a port in use), which keeps its traceback.
        forming = dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        if forming and isinstance(error, getattr(dist, "DistError", ())) and _PEER_LOST.search(str(error)):
            return first
        return None
    if isinstance(error, getattr(dist, "DistError", ())) or (isinstance(error, RuntimeError)
                                                             and _PEER_LOST.search(str(error))):
        return first
    return None


def _peer_lost_message(lost: str, timeout: float) -> str:
    if not dist.is_initialized():
        return (f"rank {os.environ.get('RANK', '?')}: the process group did not form ({lost}): another rank "
                f"stopped before joining (see its own error) or did not join within --timeout ({timeout:g} s)")
    return (f"rank {dist.get_rank()}: a collective with the other ranks failed ({lost}): another rank stopped "
            f"(see its own error) or did not answer within --timeout ({timeout:g} s)")


def _fail(message: str) -> NoReturn:
    """Exit with status 1 and the message as one line on stderr (under torchrun, every
    rank that fails prints its own). With a process group the process ends at once
    (os._exit): a peer may still be inside a collective, and tearing the group down in the
    interpreter's exit aborts the process now and then ("terminate called without an
    active exception")."""
    # One write, newline included: print's two writes (text, then newline) interleave with
    # another rank's line on a shared unbuffered stderr (PYTHONUNBUFFERED=1).
    sys.stderr.write("sparsekit.train: error: " + " ".join(message.splitlines()) + "\n")
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(1)


def main(argv: Optional[List[str]] = None) -> dict:
    """Parse the flags, train, print the result JSON (rank 0) and return it.

    What the user's flags, data or files cause ends the process with one line on stderr
    and no traceback: a flag out of range (found before the run or once it starts: the
    world size, a table too large to allocate) is an argparse error with status 2; a
    malformed or too short data file, a full hash table, a checkpoint that cannot be
    resumed, exhausted memory or an unreadable path exits with status 1. Anything else
    is a bug and keeps its traceback.
    """
    parser = build_parser()
    config = parse_args(argv, parser)
    # Both back ends reuse freed memory instead of faulting in fresh pages every step
    # (see sparsekit.allocator); the result JSON says whether it took.
    keep_freed_memory()
    try:
        result = train(config)
    except FlagError as error:
        parser.error(str(error))
    except (HarnessError, CriteoFormatError) as error:  # both name the file (and line)
        _fail(str(error))
    except HashTableFullError as error:
        capacity, rows_flag = table_capacity(vars(config))
        tables = f", {NUM_SLOTS} tables of {max(1, capacity // NUM_SLOTS)} rows" if config.tables == "per-slot" else ""
        # With eviction the table is full only when one step holds more distinct keys than it.
        hint = " or pass --eviction lru|lfu" if config.eviction is None else ""
        _fail(f"{error}; here: raise {rows_flag.split()[0]} (now {capacity}{tables}){hint}")
    except OtherRankError as error:  # a checkpoint's save or load failed on another rank, which says why
        _fail(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {error}")
    except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        detail = out_of_memory(error)
        if detail is not None:
            _fail(f"out of memory: {detail}; lower --batch-size, --table-rows/--capacity-per-rank or "
                  "--embedding-dim")
        lost = _peer_lost(error)
        if lost is None:
            raise
        _fail(_peer_lost_message(lost, config.timeout))
    except OSError as error:
        # A path the user gave, or a file written under one (the writes name their file
        # also when the disk under it is full or failing). Anything else keeps its traceback.
        if error.filename is None:
            raise
        _fail(str(error))
    # The run's own rank: a one-process run is rank 0 (and logged and wrote its files as
    # such) whatever a stray RANK in the environment says.
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        # Tearing gloo down while a peer still finishes its last collective aborts that
        # peer now and then ("terminate called without an active exception"): wait for
        # every rank first. Only on success: after an error the others may never come.
        try:
            dist.barrier()
        except RuntimeError as error:  # rank 0 failed after training (writing --metrics-json)
            lost = _peer_lost(error)
            if lost is None:
                raise
            _fail(_peer_lost_message(lost, config.timeout))
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    outcome = main()
    if outcome.get("world_size", 1) > 1:
        # Every rank passed the final barrier and destroyed its group; what is left of gloo
        # (its threads, works still holding tensors) is torn down by the interpreter's exit,
        # which aborts a rank now and then ("terminate called without an active exception"),
        # as _fail says. Nothing is left to write: end the process here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

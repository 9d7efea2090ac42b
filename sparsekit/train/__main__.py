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
from typing import List, Optional

import torch.distributed as dist

from ..allocator import keep_freed_memory
from .loop import TrainConfig, train


def parse_args(argv: Optional[List[str]] = None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="python -m sparsekit.train",
        description="DLRM-style CTR training on sparsekit embeddings (or nn.EmbeddingBag for comparison).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="global batch size (split evenly over the ranks)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--embedding", choices=("sparsekit", "torch"), default=defaults.embedding,
                        help="sparsekit: sk.DistributedEmbedding + sk.LazyAdam; torch: "
                        "nn.EmbeddingBag(sparse=True) + SparseAdam over key mod --table-rows")
    parser.add_argument("--data", default=defaults.data,
                        help="'synthetic' (generated in memory) or the path of a Criteo TSV file")
    parser.add_argument("--eval-data", default=None,
                        help="held-out Criteo TSV file (default: the last --eval-samples lines of --data)")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="held-out samples of each evaluation (default: 32768; with --data FILE and no "
                        "--eval-data, at most a tenth of the file's lines)")
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every,
                        help="evaluate every N steps (0: only at the end)")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                        help="checkpoint every N steps (0: only at the end); needs --checkpoint-dir")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--metrics-json", default=None,
                        help="write the final held-out metrics here (rank 0)")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds the model, the synthetic data and the feature hashing")
    parser.add_argument("--embedding-dim", type=int, default=defaults.embedding_dim)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (all parameters)")
    parser.add_argument("--table-rows", type=int, default=defaults.table_rows,
                        help="embedding rows per rank (sparsekit: hash-table capacity per rank; "
                        "torch: rows of the replicated table)")
    parser.add_argument("--vocab-per-slot", type=int, default=defaults.vocab_per_slot,
                        help="distinct values per slot of the synthetic data")
    parser.add_argument("--capacity-per-rank", type=int, default=None,
                        help="sparsekit: hash-table rows per rank (default: --table-rows, enough for the "
                        "synthetic data)")
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
                        help="checkpoints kept in --checkpoint-dir (the newest)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (log lines only)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout,
                        help="seconds any collective may wait under torchrun: a rank that fails and "
                        "stays alive makes the others raise after this long")
    args = parser.parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config


def main(argv: Optional[List[str]] = None) -> dict:
    config = parse_args(argv)
    # Both back ends reuse freed memory instead of faulting in fresh pages every step
    # (see sparsekit.allocator); the result JSON says whether it took.
    kept = keep_freed_memory()
    result = train(config)
    result["malloc_keeps_freed_memory"] = kept
    if dist.is_initialized():
        # Tearing gloo down while a peer still finishes its last collective aborts that
        # peer now and then ("terminate called without an active exception"): wait for
        # every rank first. Only on success: after an error the others may never come.
        dist.barrier()
        dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

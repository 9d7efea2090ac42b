"""sparsekit's collection against TorchRec's fused training on the same tables: FBGEMM's
table-batched embedding (TBE, the kernel TorchRec's sharded collection runs, with the
optimizer inside its backward) against ``sk.EmbeddingBagCollection(fused_params=...)``.

    python benchmarks/bench_torchrec.py [--device cpu] [--cells 16x100k,64x100k] [--keys uniform,zipf]
                                        [--batch 1024] [--min-ids 10] [--max-ids 30] [--rounds 5] [--repeat 3]

26 tables of ``rows`` x ``dim``, one feature each, bags of 10-30 ids (bench_bags.py's
batches). Sides, from the same rows:

- training step (forward, backward of the sum of squares, the optimizer in the backward):
  exact row-wise Adagrad (TorchRec's usual fused optimizer), exact SGD and exact Adagrad,
  sparsekit's fused ``rowwise_adagrad`` / ``sgd`` / ``adagrad`` against TBE's
  ``EXACT_ROWWISE_ADAGRAD`` / ``EXACT_SGD`` / ``EXACT_ADAGRAD``;
- forward (``eval()`` under ``no_grad``): sparsekit against TBE.

Before timing, one step of each pair from the same rows must leave the same rows. Needs
torchrec's fbgemm_gpu (fbgemm-gpu-cpu on a CPU). Writes benchmarks/results/torchrec_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Dict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit as sk  # noqa: E402
from benchmarks.bench_bags import NUM_TABLES, ROWS, cycling, make_batches, run_cells  # noqa: E402
from benchmarks.common import add_round_args, fmt_ratio, ratio_stats, time_rounds, write_results  # noqa: E402

GOAL = "training step >= x1 FBGEMM TBE with the same fused optimizer"
LR = {"rowwise_adagrad": 0.01, "sgd": 0.01, "adagrad": 0.01}


def _tbe(rows: int, dim: int, optimizer: str, device: torch.device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)

    cpu = device.type == "cpu"
    location = EmbeddingLocation.HOST if cpu else EmbeddingLocation.DEVICE
    compute = ComputeDevice.CPU if cpu else ComputeDevice.CUDA
    kind = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD,
            "adagrad": EmbOptimType.EXACT_ADAGRAD}[optimizer]
    # eps as sparsekit's fused Adagrads take it, so one step leaves the same rows.
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, location, compute)] * NUM_TABLES, optimizer=kind,
        learning_rate=LR[optimizer], eps=1e-10, pooling_mode=PoolingMode.SUM,
        device=None if cpu else device)


class Pair:
    """One optimizer's two sides over the same starting rows."""

    def __init__(self, optimizer: str, dim: int, rows: int, device: torch.device) -> None:
        self.names = [f"f{i}" for i in range(NUM_TABLES)]
        self.ours = sk.EmbeddingBagCollection(
            [sk.TableConfig(f"t{i}", dim, rows, [self.names[i]], use_hashtable=False) for i in range(NUM_TABLES)],
            device=device, output="keyed", fused_params={"optimizer": optimizer, "lr": LR[optimizer], "eps": 1e-10}
            if optimizer in ("rowwise_adagrad", "adagrad") else {"optimizer": optimizer, "lr": LR[optimizer]})
        self.theirs = _tbe(rows, dim, optimizer, device)
        with torch.no_grad():
            for shard, weight in zip(self.ours.shards, self.theirs.split_embedding_weights()):
                weight.copy_(shard.weight)

    def kjt(self, batch: Dict) -> sk.KeyedJagged:
        return sk.KeyedJagged(self.names, batch["values"], lengths=batch["lengths"])

    def train_ours(self, batch: Dict) -> None:
        self.ours(self.kjt(batch)).values().square().sum().backward()

    def train_theirs(self, batch: Dict) -> None:
        self.theirs(batch["values"], batch["offsets"]).square().sum().backward()

    @torch.no_grad()
    def forward_ours(self, batch: Dict) -> None:
        self.ours(self.kjt(batch))

    @torch.no_grad()
    def forward_theirs(self, batch: Dict) -> None:
        self.theirs(batch["values"], batch["offsets"])

    def check_same_step(self, batch: Dict) -> None:
        """One training step of each side from the same rows leaves the same rows."""
        with torch.no_grad():
            torch.testing.assert_close(self.ours.eval()(self.kjt(batch)).values(),
                                       self.theirs(batch["values"], batch["offsets"]), rtol=1e-5, atol=1e-5)
        self.ours.train()
        self.train_ours(batch)
        self.train_theirs(batch)
        for name, shard, weight in zip(self.names, self.ours.shards, self.theirs.split_embedding_weights()):
            torch.testing.assert_close(shard.weight.detach(), weight, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} after one step: {m}")


def bench_cell(args, device: torch.device, dim: int, rows_name: str, kind: str) -> Dict:
    rows = ROWS[rows_name]
    batches = make_batches(rows, args.batch, (args.min_ids, args.max_ids), kind, 4, device)
    row: Dict = {"dim": dim, "rows": rows, "keys": kind, "batch": args.batch,
                 "ids_per_bag": [args.min_ids, args.max_ids]}
    line = f"{dim:>3} x {rows_name:<4} {kind:<7}"
    for optimizer in args.optimizers.split(","):
        pair = Pair(optimizer, dim, rows, device)
        pair.check_same_step(batches[0])
        times = time_rounds({"sparsekit": cycling(pair.train_ours, batches),
                             "tbe": cycling(pair.train_theirs, batches)}, device, rounds=args.rounds,
                            repeat=args.repeat)
        row[f"train_{optimizer}_s"] = {k: float(np.median(v)) for k, v in times.items()}
        row[f"train_{optimizer}_rounds"] = times
        row[f"train_{optimizer}_vs_tbe"] = ratio_stats(times["tbe"], times["sparsekit"])
        line += f" | train {optimizer} vs TBE {fmt_ratio(row[f'train_{optimizer}_vs_tbe'])}"
        if optimizer == args.optimizers.split(",")[0]:
            pair.ours.eval()
            times = time_rounds({"sparsekit": cycling(pair.forward_ours, batches),
                                 "tbe": cycling(pair.forward_theirs, batches)}, device, rounds=args.rounds,
                                repeat=args.repeat)
            row["forward_s"] = {k: float(np.median(v)) for k, v in times.items()}
            row["forward_rounds"] = times
            row["forward_vs_tbe"] = ratio_stats(times["tbe"], times["sparsekit"])
            line += f" | forward vs TBE {fmt_ratio(row['forward_vs_tbe'])}"
        del pair
        gc.collect()
    print(line, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--cells", default="16x100k,64x100k", help="dim x rows (100k, 1m)")
    parser.add_argument("--keys", default="uniform,zipf")
    parser.add_argument("--optimizers", default="rowwise_adagrad,sgd,adagrad")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--min-ids", type=int, default=10)
    parser.add_argument("--max-ids", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    add_round_args(parser, rounds=5, repeat=3)
    args = parser.parse_args()
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed, or built for another torch
        sys.exit(f"bench_torchrec.py needs torchrec's fbgemm_gpu (fbgemm-gpu-cpu on a CPU): {error}")
    device, rows = run_cells(args, bench_cell)
    path = write_results("torchrec_busy" if args.busy_core else "torchrec", device, rows,
                         extra={"threads": torch.get_num_threads(), "rounds": args.rounds, "repeat": args.repeat,
                                "goal": GOAL})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

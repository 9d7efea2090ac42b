"""Bags of many ids: EmbeddingBagCollection against 26 nn.EmbeddingBag (and TorchRec's
EmbeddingBagCollection where torchrec is installed), forward and training step.

    python benchmarks/bench_bags.py [--device cpu|cuda] [--cells 16x100k,64x100k,16x1m,64x1m]
                                    [--keys uniform,zipf] [--batch 1024] [--min-ids 10] [--max-ids 30]
                                    [--rounds 5] [--repeat 3] [--busy-core]

26 features, each its own table; bags of 10-30 uniform or Zipf(1.2) ids. Forward (eval,
no_grad) of direct and hash tables against 26 ``nn.EmbeddingBag`` and TorchRec; training
step with ``sk.LazyAdam``, the fused LazyAdam and the fused row-wise Adagrad against
``nn.EmbeddingBag(sparse=True)`` + ``SparseAdam``. Ratios: competitor time / sparsekit time
per interleaved round, median (min-max). Goal (CPU): forward >= x1.5 nn.EmbeddingBag and
>= x1 TorchRec, training step >= x1.5 torch. Writes benchmarks/results/bags_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit as sk  # noqa: E402
from benchmarks.common import add_round_args, busy_core, fmt_ratio, ratio_stats, time_rounds, write_results  # noqa: E402

NUM_TABLES = 26
GOAL = "CPU: forward >= x1.5 nn.EmbeddingBag and >= x1 TorchRec; training step >= x1.5 torch"
ROWS = {"100k": 100_000, "1m": 1_000_000}


def make_batches(rows: int, batch: int, lengths: tuple, kind: str, count: int, device) -> List[Dict]:
    """``count`` batches: per batch the values, lengths and offsets of 26 features, feature-major."""
    out = []
    for b in range(count):
        rng = np.random.default_rng([b, rows, 1 if kind == "zipf" else 0])
        length = rng.integers(lengths[0], lengths[1] + 1, size=NUM_TABLES * batch)
        n = int(length.sum())
        values = rng.integers(0, rows, size=n) if kind == "uniform" else (rng.zipf(1.2, size=n) - 1) % rows
        lengths_t = torch.from_numpy(length).to(device)
        offsets = torch.zeros(length.size + 1, dtype=torch.int64, device=device)
        offsets[1:] = lengths_t.cumsum(0)
        out.append({"values": torch.from_numpy(values).to(device), "lengths": lengths_t, "offsets": offsets,
                    "bounds": offsets[::batch].tolist()})
    return out


def cycling(fn: Callable[[Dict], None], batches: List[Dict]) -> Callable[[], None]:
    state = {"i": 0}

    def call() -> None:
        fn(batches[state["i"] % len(batches)])
        state["i"] += 1

    return call


class Sides:
    """Every side's model over one cell's tables; the collections start from the same rows."""

    def __init__(self, dim: int, rows: int, batch: int, device, train: bool, hashed: bool) -> None:
        self.names = [f"f{i}" for i in range(NUM_TABLES)]
        self.batch, self.device = batch, device

        def collection(use_hashtable: bool, fused: Optional[dict] = None) -> sk.EmbeddingBagCollection:
            return sk.EmbeddingBagCollection(
                [sk.TableConfig(f"t{i}", dim, rows, [self.names[i]], use_hashtable=use_hashtable)
                 for i in range(NUM_TABLES)], device=device, fused_params=fused)

        self.direct = collection(False)
        self.hashed = collection(True) if hashed else None
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
                                   for _ in range(NUM_TABLES)])
        with torch.no_grad():
            for bag, shard in zip(self.bags, self.direct.shards):
                bag.weight.copy_(shard.weight)
        self.torchrec = self._torchrec(dim, rows, device)
        if train:
            self.direct_opt = sk.LazyAdam(self.direct.parameters(), lr=1e-3)
            self.fused_adam = collection(False, {"optimizer": "lazy_adam", "lr": 1e-3})
            self.fused_adagrad = collection(False, {"optimizer": "rowwise_adagrad", "lr": 1e-2})
            self.bags_opt = torch.optim.SparseAdam(self.bags.parameters(), lr=1e-3)

    def _torchrec(self, dim: int, rows: int, device):
        try:
            from torchrec.modules.embedding_configs import EmbeddingBagConfig
            from torchrec.modules.embedding_modules import EmbeddingBagCollection
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        except Exception:  # noqa: BLE001 - not installed, or its native library does not load here
            return None
        self._kjt = KeyedJaggedTensor
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                                         feature_names=[self.names[i]]) for i in range(NUM_TABLES)],
                                     device=device)
        with torch.no_grad():
            for i, bag in enumerate(self.bags):
                ebc.embedding_bags[f"t{i}"].weight.copy_(bag.weight)
        return ebc.eval()

    def kjt(self, batch: Dict) -> sk.KeyedJagged:
        return sk.KeyedJagged(self.names, batch["values"], lengths=batch["lengths"])

    def bag_outputs(self, batch: Dict) -> List[torch.Tensor]:
        b, offsets, values = batch["bounds"], batch["offsets"], batch["values"]
        return [bag(values[b[f]:b[f + 1]], offsets[f * self.batch:(f + 1) * self.batch] - b[f])
                for f, bag in enumerate(self.bags)]

    # -- forward sides (eval, no_grad) ---------------------------------------------------------
    @torch.no_grad()
    def forward_direct(self, batch: Dict) -> None:
        self.direct(self.kjt(batch))

    @torch.no_grad()
    def forward_hashed(self, batch: Dict) -> None:
        self.hashed(self.kjt(batch))

    @torch.no_grad()
    def forward_bags(self, batch: Dict) -> None:
        self.bag_outputs(batch)

    @torch.no_grad()
    def forward_torchrec(self, batch: Dict) -> None:
        self.torchrec(self._kjt(keys=self.names, values=batch["values"], lengths=batch["lengths"]))

    # -- training sides --------------------------------------------------------------------------
    @staticmethod
    def _loss(outputs) -> torch.Tensor:
        return torch.cat(list(outputs), dim=1).square().sum()

    def train_lazy_adam(self, batch: Dict) -> None:
        self._loss(self.direct(self.kjt(batch)).values()).backward()
        self.direct_opt.step()
        self.direct_opt.zero_grad()

    def train_fused_adam(self, batch: Dict) -> None:
        self._loss(self.fused_adam(self.kjt(batch)).values()).backward()

    def train_fused_adagrad(self, batch: Dict) -> None:
        self._loss(self.fused_adagrad(self.kjt(batch)).values()).backward()

    def train_bags(self, batch: Dict) -> None:
        self._loss(self.bag_outputs(batch)).backward()
        self.bags_opt.step()
        self.bags_opt.zero_grad()


def check_same_pooling(sides: Sides, batch: Dict) -> None:
    """The sides pool the same numbers before anything is timed."""
    with torch.no_grad():
        ours = sides.direct.eval()(sides.kjt(batch))
        theirs = sides.bag_outputs(batch)
    for name, mine, other in zip(sides.names, ours.values(), theirs):
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def bench_cell(args, device, dim: int, rows_name: str, kind: str) -> Dict:
    rows = ROWS[rows_name]
    # Tables, the Adam moments of the three Adam sides and the torch copy, in bytes.
    table_bytes = NUM_TABLES * rows * dim * 4
    train = args.train and table_bytes * 9 <= args.memory_gib * 2**30
    sides = Sides(dim, rows, args.batch, device, train, hashed=table_bytes * 3 <= args.memory_gib * 2**30)
    batches = make_batches(rows, args.batch, (args.min_ids, args.max_ids), kind, 4, device)
    check_same_pooling(sides, batches[0])
    if sides.hashed is not None:
        sides.hashed.train()
        for batch in batches:  # every key of the batches gets its row: the forward then reads, as in eval
            with torch.no_grad():
                sides.hashed(sides.kjt(batch))
        sides.hashed.eval()
    fns = {"sk_direct": cycling(sides.forward_direct, batches), "bags": cycling(sides.forward_bags, batches)}
    if sides.hashed is not None:
        fns["sk_hashed"] = cycling(sides.forward_hashed, batches)
    if sides.torchrec is not None:
        fns["torchrec"] = cycling(sides.forward_torchrec, batches)
    times = time_rounds(fns, device, rounds=args.rounds, repeat=args.repeat)
    row: Dict = {"dim": dim, "rows": rows, "keys": kind, "batch": args.batch,
                 "ids_per_bag": [args.min_ids, args.max_ids],
                 "forward_s": {k: float(np.median(v)) for k, v in times.items()}, "forward_rounds": times,
                 "forward_vs_bags": ratio_stats(times["bags"], times["sk_direct"])}
    if "sk_hashed" in times:
        row["forward_hashed_vs_bags"] = ratio_stats(times["bags"], times["sk_hashed"])
    if "torchrec" in times:
        row["forward_vs_torchrec"] = ratio_stats(times["torchrec"], times["sk_direct"])
    line = (f"{dim:>3} x {rows_name:<4} {kind:<7} forward: sk {row['forward_s']['sk_direct'] * 1e3:7.2f} ms | "
            f"vs 26 nn.EmbeddingBag {fmt_ratio(row['forward_vs_bags'])}")
    if "forward_hashed_vs_bags" in row:
        line += f" | hash tables {fmt_ratio(row['forward_hashed_vs_bags'])}"
    if "forward_vs_torchrec" in row:
        line += f" | vs TorchRec {fmt_ratio(row['forward_vs_torchrec'])}"
    print(line, flush=True)
    if train:
        sides.direct.train()
        times = time_rounds({"lazy_adam": cycling(sides.train_lazy_adam, batches),
                             "fused_adam": cycling(sides.train_fused_adam, batches),
                             "fused_adagrad": cycling(sides.train_fused_adagrad, batches),
                             "bags": cycling(sides.train_bags, batches)}, device, rounds=args.rounds,
                            repeat=args.repeat)
        row["train_s"] = {k: float(np.median(v)) for k, v in times.items()}
        row["train_rounds"] = times
        for side in ("lazy_adam", "fused_adam", "fused_adagrad"):
            row[f"train_{side}_vs_torch"] = ratio_stats(times["bags"], times[side])
        print(f"{'':>20} training vs nn.EmbeddingBag + SparseAdam: LazyAdam "
              f"{fmt_ratio(row['train_lazy_adam_vs_torch'])} | fused LazyAdam "
              f"{fmt_ratio(row['train_fused_adam_vs_torch'])} | fused row-wise Adagrad "
              f"{fmt_ratio(row['train_fused_adagrad_vs_torch'])}", flush=True)
    del sides
    gc.collect()
    return row


def run_cells(args, bench_cell: Callable) -> Tuple[torch.device, List[Dict]]:
    """``bench_cell(args, device, dim, rows_name, kind)`` for every ``--cells`` x ``--keys``
    cell, on ``--threads`` threads (and with ``--busy-core``): the device and the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    with busy_core(args.busy_core):
        for cell in args.cells.split(","):
            dim, rows_name = cell.split("x")
            for kind in args.keys.split(","):
                rows.append(bench_cell(args, device, int(dim), rows_name, kind))
    return device, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--cells", default="16x100k,64x100k,16x1m,64x1m", help="dim x rows (100k, 1m)")
    parser.add_argument("--keys", default="uniform,zipf")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--min-ids", type=int, default=10)
    parser.add_argument("--max-ids", type=int, default=30)
    parser.add_argument("--no-train", dest="train", action="store_false", help="forward cells only")
    parser.add_argument("--memory-gib", type=float, default=16.0,
                        help="the tables a cell may hold: training sides run where ~9 copies fit")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    add_round_args(parser, rounds=5, repeat=3)
    args = parser.parse_args()
    device, rows = run_cells(args, bench_cell)
    name = "bags_busy" if args.busy_core else "bags"
    # Bags of one id are the record beside the default bags of 10-30 ids, not in place of it.
    one = (args.min_ids, args.max_ids) == (1, 1)
    path = write_results(name, device, rows,
                         extra={"threads": torch.get_num_threads(), "rounds": args.rounds, "repeat": args.repeat,
                                "goal": GOAL, "torchrec": any("forward_vs_torchrec" in r for r in rows)},
                         file_name=f"{name}_one_id" if one else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

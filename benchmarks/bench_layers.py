"""DistributedEmbedding + LazyAdam vs nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam.

    python benchmarks/bench_layers.py [--device cpu|cuda] [--batch N] [--slots N] [--nnz N] [--dim N]
                                      [--world-sizes 1,2] [--rounds 7] [--repeat 5] [--busy-core]

One training step of a pooled embedding on the same Zipf keys. World 1: both side by side
(nn.EmbeddingBag gets the keys already mapped to indices, a head start). World > 1 (CPU:
gloo on loopback): each rank runs its share of one global batch; the slowest rank's step
counts, and the exchange's bytes are counted. Ratios: torch time / sparsekit time per
round, median (min-max). Writes benchmarks/results/layers_<device>.json (``_busy`` with
--busy-core).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit as sk  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_round_args,
    busy_core,
    fmt_ratio,
    ratio_stats,
    time_rounds,
    write_results,
    zipf_keys,
)
from sparsekit import LazyAdam  # noqa: E402

NUM_BATCHES = 8  # the timed steps cycle through these


def make_batches(batch: int, slots: int, nnz: int) -> List[torch.Tensor]:
    """Padded [batch, slots, nnz] key tensors; each bag holds 1..nnz keys, pad key -1."""
    batches = []
    for index in range(NUM_BATCHES):
        keys = zipf_keys(batch * slots * nnz, seed=index).view(batch, slots, nnz)
        lengths = torch.randint(1, nnz + 1, (batch, slots, 1), generator=torch.Generator().manual_seed(index))
        keys[torch.arange(nnz).view(1, 1, nnz) >= lengths] = -1
        batches.append(keys)
    return batches


def distinct_keys(batches: List[torch.Tensor]) -> torch.Tensor:
    values = torch.cat([b[b != -1] for b in batches])
    return sk.ops.unique(values, return_inverse=False)


class Stepper:
    """Cycles through the batches, one training step per call."""

    def __init__(self, step_fn, batches):
        self.step_fn, self.batches, self.index = step_fn, batches, 0

    def __call__(self):
        self.step_fn(self.batches[self.index % len(self.batches)])
        self.index += 1


def sparsekit_step(layer, optimizer, device):
    def step(keys):
        out = layer(keys.to(device, non_blocking=True))
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def exchange_bytes(keys: torch.Tensor, world_size: int, rank: int, dim: int, itemsize: int) -> int:
    """Bytes this rank sends to other ranks in one step (forward and backward)."""
    values = keys[keys != -1]
    unique_keys = sk.ops.unique(values, return_inverse=False)
    counts = sk.ops.partition_by_owner(unique_keys, world_size)[2]
    sent_keys = int(counts.sum() - counts[rank])
    # Vectors and their gradients travel as many rows as the keys, in the other direction:
    # what this rank sends back equals what others ask of it; averaged over ranks the two match.
    header = 2 * 8 * (world_size - 1)
    return sent_keys * keys.element_size() + 2 * sent_keys * dim * itemsize + header


def check_same_pooling(layer, bag, keys: torch.Tensor, bag_input, distinct: torch.Tensor) -> None:
    """Both sides must pool the same vectors: give the batch's keys rows in the layer (the
    warm-up does as much), copy their vectors into nn.EmbeddingBag at their dense indices,
    and compare the two forwards."""
    with torch.no_grad():
        pooled = layer(keys)
        rows = layer.hash_table.find(distinct)
        present = rows >= 0
        bag.weight[:distinct.numel()][present] = layer.weight[rows[present]]
        expected = bag(*bag_input).view_as(pooled)
    if not torch.allclose(pooled, expected, rtol=1e-5, atol=1e-6):
        raise RuntimeError("DistributedEmbedding and nn.EmbeddingBag pool different vectors (max abs diff "
                           f"{float((pooled - expected).abs().max()):.3g}): not timing a wrong answer")


def bench_world_one(args, device: torch.device) -> Dict:
    batches = make_batches(args.batch, args.slots, args.nnz)
    keys = distinct_keys(batches)
    capacity = int(keys.numel()) + 16
    layer = sk.DistributedEmbedding("sum", capacity, args.dim, args.slots, args.nnz, device=device)

    # nn.EmbeddingBag on dense indices; the key -> index map is built here, untimed.
    index_of = {key: i for i, key in enumerate(keys.tolist())}
    bag_inputs = []
    for b in batches:
        flat = b.view(-1, args.nnz)
        valid = flat != -1
        indices = torch.tensor([index_of[k] for k in flat[valid].tolist()], dtype=torch.int64)
        offsets = torch.zeros(flat.shape[0], dtype=torch.int64)
        offsets[1:] = valid.sum(1).cumsum(0)[:-1]
        bag_inputs.append((indices.to(device), offsets.to(device)))
    bag = torch.nn.EmbeddingBag(capacity, args.dim, mode="sum", sparse=True, device=device)
    check_same_pooling(layer, bag, batches[0].to(device), bag_inputs[0], keys.to(device))
    torch_optimizer = torch.optim.SparseAdam(bag.parameters(), lr=1e-3)

    def torch_step(inputs):
        out = bag(*inputs)
        out.sum().backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()

    times = time_rounds({
        "sparsekit": Stepper(sparsekit_step(layer, LazyAdam(layer.parameters(), lr=1e-3), device),
                             [b.to(device) for b in batches]),
        "torch": Stepper(torch_step, bag_inputs),
    }, device, rounds=args.rounds, repeat=args.repeat)
    stats = ratio_stats(times["torch"], times["sparsekit"])
    ours, theirs = float(np.median(times["sparsekit"])), float(np.median(times["torch"]))
    nnz = sum(int((b != -1).sum()) for b in batches) / len(batches)
    row = {"world_size": 1, "batch": args.batch, "slots": args.slots, "max_nnz": args.nnz, "dim": args.dim,
           "keys_per_step": nnz, "distinct_keys_total": int(keys.numel()),
           "sparsekit_step_s": ours, "torch_embedding_bag_sparse_adam_step_s": theirs,
           "speedup_vs_torch": stats["median"], "ratio": stats, "seconds_per_round": times,
           "exchange_bytes_per_rank_per_step": 0}
    print(f"world 1: sparsekit DistributedEmbedding+LazyAdam {ours * 1e3:8.2f} ms | nn.EmbeddingBag+SparseAdam "
          f"{theirs * 1e3:8.2f} ms | {fmt_ratio(stats)} ({nnz:,.0f} keys/step)")
    return row


def _rank_main(rank: int, world_size: int, store: str, args, result_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device("cpu")
    batches = make_batches(args.batch, args.slots, args.nnz)
    capacity = int(distinct_keys(batches).numel()) // world_size * 2 + 64
    per_rank = args.batch // world_size
    local = [b[rank * per_rank:(rank + 1) * per_rank] for b in batches]
    layer = sk.DistributedEmbedding("sum", capacity, args.dim, args.slots, args.nnz, device=device)
    step = Stepper(sparsekit_step(layer, LazyAdam(layer.parameters(), lr=1e-3), device), local)
    times = time_rounds({"sparsekit": step}, device, rounds=args.rounds, repeat=args.repeat)
    seconds = torch.tensor(times["sparsekit"])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # per round, the step is as slow as the slowest rank
    sent = torch.tensor([sum(exchange_bytes(b, world_size, rank, args.dim, 4) for b in local) / len(local)],
                        dtype=torch.float64)
    dist.all_reduce(sent)
    if rank == 0:
        torch.save({"seconds": seconds.tolist(), "bytes": float(sent) / world_size}, result_path)
    dist.destroy_process_group()


def bench_world(args, world_size: int) -> Dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(world_size, os.path.join(tmp, "store"), args, result_path), nprocs=world_size)
        result = torch.load(result_path, weights_only=True)
    seconds = float(np.median(result["seconds"]))
    row = {"world_size": world_size, "batch": args.batch, "slots": args.slots, "max_nnz": args.nnz,
           "dim": args.dim, "backend": "gloo", "sparsekit_step_s": seconds,
           "seconds_per_round": {"sparsekit": result["seconds"]},
           "exchange_bytes_per_rank_per_step": result["bytes"]}
    print(f"world {world_size}: sparsekit DistributedEmbedding+LazyAdam {seconds * 1e3:8.2f} ms per step "
          f"(global batch {args.batch}, slowest rank) | {result['bytes'] / 1e3:,.1f} kB sent per rank per step")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--nnz", type=int, default=2)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated; > 1 runs on CPU with gloo")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per process (0: torch's default); on a machine shared with "
                             "other jobs, 1 avoids the spin-waiting of oversubscribed thread pools")
    add_round_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    device = torch.device(args.device)
    with busy_core(args.busy_core):
        rows = [bench_world_one(args, device) if world_size == 1 else bench_world(args, world_size)
                for world_size in (int(w) for w in args.world_sizes.split(","))]
    # World > 1 always runs on the CPU (gloo): against a CUDA world-1 step the ratio means nothing.
    if len(rows) > 1 and rows[0]["world_size"] == 1 and device.type == "cpu":
        for row in rows[1:]:
            row["step_time_vs_world_1"] = row["sparsekit_step_s"] / rows[0]["sparsekit_step_s"]
            print(f"world {row['world_size']} step time / world 1 step time: {row['step_time_vs_world_1']:.2f}")
    extra = {"threads_per_process": args.threads, "busy_core": args.busy_core, "rounds": args.rounds,
             "repeat": args.repeat}
    path = write_results("layers_busy" if args.busy_core else "layers", device, rows, extra)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

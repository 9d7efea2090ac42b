"""26 tables: EmbeddingBagCollection vs 26 DistributedEmbedding layers vs 26 nn.EmbeddingBag.

    python benchmarks/bench_collection.py [--device cpu|cuda] [--batch 4096] [--pooling 1]
                                          [--world-sizes 1,2] [--rounds 7] [--repeat 3] [--busy-core]
                                          [--threads N] [--small]

A DLRM-shaped batch: 26 features, each its own table (log-uniform capacities, dims all 16 or
cycling 16 / 64 / 128), Zipf(1.2) keys. A training step (forward, backward of the sum of
squares, optimizer) of the collection + ``sk.LazyAdam``, of 26 ``sk.DistributedEmbedding``
layers, and (world 1) of 26 ``nn.EmbeddingBag`` + ``SparseAdam``; the collection also with
bfloat16 tables. The three sides' outputs must agree before timing. Ratios are competitor
time / collection time per interleaved round, median (min-max); world 2 runs under gloo,
the slowest rank counting. Goal (CPU, world 1): >= 2x the 26 layers and >= 1.5x torch.
Writes benchmarks/results/collection_<device>.json (``_busy`` with --busy-core).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import Callable, Dict, List

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
)

NUM_TABLES = 26
GOAL = "world 1 CPU: >= 2x 26 layers, >= 1.5x torch"


def capacities(small: bool, config: str) -> List[int]:
    rng = np.random.default_rng(0)
    high = 5 if small else (7 if config == "dim16" else 6)
    return [round(10 ** x) for x in rng.uniform(3, high, NUM_TABLES)]


def dims_of(config: str) -> List[int]:
    return [16] * NUM_TABLES if config == "dim16" else [(16, 64, 128)[i % 3] for i in range(NUM_TABLES)]


def make_batches(caps: List[int], batch: int, pooling: int, count: int, seed: int = 0) -> List[torch.Tensor]:
    """``count`` batches of keys ``[NUM_TABLES, batch * pooling]`` (feature-major)."""
    out = []
    for b in range(count):
        rng = np.random.default_rng([seed, b])
        out.append(torch.from_numpy(np.stack([(rng.zipf(1.2, batch * pooling) - 1) % c for c in caps])
                                    .astype(np.int64)))
    return out


class Steps:
    """The three sides' training steps over the same batches (one batch per call, cycling)."""

    def __init__(self, caps: List[int], distinct: List[int], dims: List[int], batch: int, pooling: int,
                 device: torch.device, world_size: int, dtype: torch.dtype = torch.float32):
        self.batch, self.pooling, self.device, self.dims = batch, pooling, device, dims
        self.names = [f"f{i}" for i in range(NUM_TABLES)]
        # Hash tables hold a rank's share of the keys the run meets, with slack for an uneven share.
        local = [d * 3 // (2 * world_size) + 64 for d in distinct]
        self.collection = sk.EmbeddingBagCollection(
            [sk.TableConfig(f"t{i}", dims[i], local[i], [self.names[i]], dtype=dtype) for i in range(NUM_TABLES)],
            device=device)
        self.collection_opt = sk.LazyAdam(self.collection.parameters(), lr=1e-3)
        self.layers = torch.nn.ModuleList([sk.DistributedEmbedding("sum", local[i], dims[i], 1, pooling,
                                                                   device=device) for i in range(NUM_TABLES)])
        self.layers_opt = sk.LazyAdam(self.layers.parameters(), lr=1e-3)
        self.lengths = torch.full((NUM_TABLES * batch,), pooling, dtype=torch.int64, device=device)
        self.offsets = torch.arange(0, batch * pooling + 1, pooling, device=device)
        self.bags = None
        if world_size == 1 and dtype == torch.float32:
            self.bags = torch.nn.ModuleList([torch.nn.EmbeddingBag(caps[i], dims[i], mode="sum", sparse=True,
                                                                   device=device) for i in range(NUM_TABLES)])
            self.bags_opt = torch.optim.SparseAdam(self.bags.parameters(), lr=1e-3)

    def collection_step(self, keys: torch.Tensor) -> None:
        pooled = self.collection(sk.KeyedJagged(self.names, keys.reshape(-1), lengths=self.lengths))
        sum((v.float() ** 2).sum() for v in pooled.values()).backward()
        self.collection_opt.step()
        self.collection_opt.zero_grad()

    def layers_step(self, keys: torch.Tensor) -> None:
        loss = sum((layer(sk.Ragged(keys[i], self.offsets)) ** 2).sum() for i, layer in enumerate(self.layers))
        loss.backward()
        self.layers_opt.step()
        self.layers_opt.zero_grad()

    def torch_step(self, keys: torch.Tensor) -> None:
        loss = sum((bag(keys[i], self.offsets[:-1]) ** 2).sum() for i, bag in enumerate(self.bags))
        loss.backward()
        self.bags_opt.step()
        self.bags_opt.zero_grad()

    def loss_step(self) -> None:
        """The loss the sides above share (sum of squares of every pooled output, forward
        and backward) alone, on float32 outputs of the same shapes: what no embedding can
        save. Run as a side of its own so that its time can be set against the steps'."""
        if not hasattr(self, "_outputs"):
            self._outputs = [torch.randn(self.batch, d, device=self.device, requires_grad=True) for d in self.dims]
        for v in self._outputs:
            v.grad = None
        sum((v.float() ** 2).sum() for v in self._outputs).backward()

    def table_bytes(self) -> int:
        return sum(shard.weight.numel() * shard.weight.element_size() for shard in self.collection.shards)


def check_same_pooling(steps: Steps, keys: torch.Tensor) -> None:
    """The three sides must pool the same vectors before any is timed: the collection's
    vectors of the batch's keys (given rows by one forward) are copied into the 26 layers
    (at the rows their own forward gave the keys) and into the 26 nn.EmbeddingBag (at the
    keys, which are their indices), and the three forwards compared."""
    with torch.no_grad():
        pooled = steps.collection(sk.KeyedJagged(steps.names, keys.reshape(-1), lengths=steps.lengths))
        for i, layer in enumerate(steps.layers):
            table_keys, vectors = steps.collection.export(f"t{i}")
            layer(sk.Ragged(keys[i], steps.offsets))
            layer.weight[layer.hash_table.find(table_keys)] = vectors.float()
            got = layer(sk.Ragged(keys[i], steps.offsets)).view(steps.batch, -1)
            expected = pooled[steps.names[i]].float()
            if steps.bags is not None:
                steps.bags[i].weight[table_keys] = vectors.float()
                from_torch = steps.bags[i](keys[i], steps.offsets[:-1])
                if not torch.allclose(from_torch, expected, rtol=1e-5, atol=1e-6):
                    raise RuntimeError(f"table t{i}: the collection and nn.EmbeddingBag pool different vectors: "
                                       "not timing a wrong answer")
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"table t{i}: the collection and its DistributedEmbedding pool different "
                                   "vectors: not timing a wrong answer")


def check_same_pooling_sharded(steps: Steps, keys: torch.Tensor) -> None:
    """:func:`check_same_pooling` for one rank of a world of several: each rank exports its
    shard of every collection table, the shards are gathered, and every rank writes the
    vectors of the keys its own layer shard holds into that shard. Collective: every rank
    calls it with its own batch, and every rank raises if any rank's outputs differ."""
    with torch.no_grad():
        pooled = steps.collection(sk.KeyedJagged(steps.names, keys.reshape(-1), lengths=steps.lengths))
        world_size = dist.get_world_size()
        mismatch = []
        for i, layer in enumerate(steps.layers):
            table_keys, vectors = steps.collection.export(f"t{i}")
            gathered = [None] * world_size
            dist.all_gather_object(gathered, (table_keys, vectors.float()))
            all_keys = torch.cat([k for k, _ in gathered])
            all_vectors = torch.cat([v for _, v in gathered])
            layer(sk.Ragged(keys[i], steps.offsets))
            rows = layer.hash_table.find(all_keys)
            mine = rows >= 0
            layer.weight[rows[mine]] = all_vectors[mine]
            got = layer(sk.Ragged(keys[i], steps.offsets)).view(steps.batch, -1)
            if not torch.allclose(got, pooled[steps.names[i]].float(), rtol=1e-5, atol=1e-6):
                mismatch.append(i)
        flags = torch.tensor([len(mismatch)])
        dist.all_reduce(flags)
        if int(flags) or mismatch:
            raise RuntimeError(f"rank {dist.get_rank()}: tables {['t%d' % i for i in mismatch]} (and "
                               f"{int(flags)} in all ranks): the collection and its DistributedEmbedding "
                               "pool different vectors: not timing a wrong answer")


def distinct_per_table(batches: List[torch.Tensor]) -> List[int]:
    return [int(torch.unique(torch.cat([b[t] for b in batches])).numel()) for t in range(NUM_TABLES)]


def cycling(step: Callable[[torch.Tensor], None], batches: List[torch.Tensor]) -> Callable[[], None]:
    """A call steps on the next batch. Every batch is stepped on once first, so the timed
    calls insert no new keys and hit no first-use allocation."""
    for keys in batches:
        step(keys)
    position = [0]

    def call() -> None:
        step(batches[position[0] % len(batches)])
        position[0] += 1
    return call


def bench_world_one(args, device: torch.device, config: str) -> Dict:
    caps, dims = capacities(args.small, config), dims_of(config)
    batches = make_batches(caps, args.batch, args.pooling, 4)
    distinct = distinct_per_table(batches)
    batches = [b.to(device) for b in batches]
    fp32 = Steps(caps, distinct, dims, args.batch, args.pooling, device, 1)
    bf16 = Steps(caps, distinct, dims, args.batch, args.pooling, device, 1, torch.bfloat16)
    check_same_pooling(fp32, batches[0])
    times = time_rounds({
        "collection": cycling(fp32.collection_step, batches),
        "layers": cycling(fp32.layers_step, batches),
        "torch": cycling(fp32.torch_step, batches),
        "collection_bf16": cycling(bf16.collection_step, batches),
        "loss": fp32.loss_step,
    }, device, rounds=args.rounds, repeat=args.repeat)
    vs_layers = ratio_stats(times["layers"], times["collection"])
    # The same ratio with the shared loss's own time taken off both sides (an estimate:
    # the loss is timed apart from the steps, in the same rounds).
    vs_layers_less_loss = ratio_stats([t - loss for t, loss in zip(times["layers"], times["loss"])],
                                      [t - loss for t, loss in zip(times["collection"], times["loss"])])
    vs_torch = ratio_stats(times["torch"], times["collection"])
    bf16_vs_fp32 = ratio_stats(times["collection"], times["collection_bf16"])
    row = {"world_size": 1, "config": config, "dims": dims, "capacities": caps, "distinct_keys": distinct,
           "batch": args.batch,
           "pooling": args.pooling, "seconds_per_round": times,
           "collection_step_s": float(np.median(times["collection"])),
           "layers_step_s": float(np.median(times["layers"])), "torch_step_s": float(np.median(times["torch"])),
           "collection_bf16_step_s": float(np.median(times["collection_bf16"])),
           "loss_s": float(np.median(times["loss"])),
           "speedup_vs_26_layers": vs_layers, "speedup_vs_torch": vs_torch,
           "speedup_vs_26_layers_less_loss": vs_layers_less_loss,
           "bf16_speed_vs_fp32": bf16_vs_fp32,
           "table_bytes_fp32": fp32.table_bytes(), "table_bytes_bf16": bf16.table_bytes()}
    print(f"world 1 {config:10}: collection {row['collection_step_s'] * 1e3:7.2f} ms | vs 26 layers "
          f"{fmt_ratio(vs_layers)} | vs 26 nn.EmbeddingBag+SparseAdam {fmt_ratio(vs_torch)} | bf16 tables: "
          f"{fmt_ratio(bf16_vs_fp32)} the fp32 speed, {row['table_bytes_bf16'] / 2**20:,.0f} MiB vs "
          f"{row['table_bytes_fp32'] / 2**20:,.0f} MiB | the shared loss alone {row['loss_s'] * 1e3:.2f} ms; "
          f"without it, vs 26 layers {fmt_ratio(vs_layers_less_loss)}")
    return row


def _rank_main(rank: int, world_size: int, store: str, args, config: str, result_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    device = torch.device("cpu")
    caps, dims = capacities(args.small, config), dims_of(config)
    per_rank = args.batch // world_size
    full = make_batches(caps, args.batch, args.pooling, 4)
    batches = [b.view(NUM_TABLES, args.batch, args.pooling)[:, rank * per_rank:(rank + 1) * per_rank]
               .reshape(NUM_TABLES, -1).contiguous() for b in full]
    steps = Steps(caps, distinct_per_table(full), dims, per_rank, args.pooling, device, world_size)
    check_same_pooling_sharded(steps, batches[0])
    times = time_rounds({"collection": cycling(steps.collection_step, batches),
                         "layers": cycling(steps.layers_step, batches)},
                        device, rounds=args.rounds, repeat=args.repeat)
    slowest = {name: torch.tensor(values) for name, values in times.items()}
    for values in slowest.values():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    if rank == 0:
        torch.save({name: values.tolist() for name, values in slowest.items()}, result_path)
    dist.destroy_process_group()


def bench_world(args, world_size: int, config: str) -> Dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(world_size, os.path.join(tmp, "store"), args, config, result_path),
                 nprocs=world_size)
        times = torch.load(result_path, weights_only=True)
    vs_layers = ratio_stats(times["layers"], times["collection"])
    row = {"world_size": world_size, "config": config, "backend": "gloo", "batch": args.batch,
           "pooling": args.pooling, "seconds_per_round": times,
           "collection_step_s": float(np.median(times["collection"])),
           "layers_step_s": float(np.median(times["layers"])), "speedup_vs_26_layers": vs_layers}
    print(f"world {world_size} {config:10}: collection {row['collection_step_s'] * 1e3:7.2f} ms per step (global "
          f"batch {args.batch}, slowest rank) | vs 26 layers {fmt_ratio(vs_layers)}")
    return row


def print_table(rows: list[dict], device: torch.device) -> None:
    """One line per configuration and world size (step times: medians over rounds, per rank at
    world > 1), then the goal and whether the world-1 rows meet it."""
    print(f"\n{'config':<7} {'world':>5} | {'collection':>10} {'26 layers':>10} {'torch':>10} {'bf16':>10} (ms) | "
          f"{'vs 26 layers':<20} {'vs torch':<20} {'bf16 speed':<20} {'MiB bf16/fp32':>13}")
    for r in rows:
        ms = [f"{r[k] * 1e3:10.2f}" if k in r else f"{'-':>10}"
              for k in ("collection_step_s", "layers_step_s", "torch_step_s", "collection_bf16_step_s")]
        ratios = [f"{fmt_ratio(r[k]) if k in r else '-':<20}"
                  for k in ("speedup_vs_26_layers", "speedup_vs_torch", "bf16_speed_vs_fp32")]
        mib = "-"
        if "table_bytes_fp32" in r:
            mib = f"{r['table_bytes_bf16'] / 2**20:.1f}/{r['table_bytes_fp32'] / 2**20:.1f}"
        print(f"{r['config']:<7} {r['world_size']:>5} | {' '.join(ms)}      | {' '.join(ratios)} {mib:>13}")
    print(f"goal ({GOAL}, medians):", end="")
    for r in rows:
        if r["world_size"] == 1 and device.type == "cpu":
            met = r["speedup_vs_26_layers"]["median"] >= 2 and r["speedup_vs_torch"]["median"] >= 1.5
            print(f" {r['config']} {'met' if met else 'NOT met'};", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--pooling", type=int, default=1, help="keys per bag")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated; > 1 runs on CPU with gloo")
    parser.add_argument("--configs", default="dim16,mixed", help="dim16 (all 16) and/or mixed (16/64/128)")
    parser.add_argument("--small", action="store_true", help="capacities 10^3..10^5 (quick checks)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: torch's)")
    add_round_args(parser, rounds=7, repeat=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    device = torch.device(args.device)
    rows = []
    with busy_core(args.busy_core):
        for config in args.configs.split(","):
            for world_size in (int(w) for w in args.world_sizes.split(",")):
                if world_size == 1:
                    rows.append(bench_world_one(args, device, config))
                elif device.type == "cpu":
                    rows.append(bench_world(args, world_size, config))
    print_table(rows, device)
    # A busy-core run is a figure of its own: it must not overwrite the idle one.
    path = write_results("collection_busy" if args.busy_core else "collection", device, rows,
                         extra={"threads_per_process": args.threads, "busy_core": args.busy_core,
                                "rounds": args.rounds, "repeat": args.repeat, "goal": GOAL})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

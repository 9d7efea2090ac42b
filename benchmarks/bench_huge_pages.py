"""Tables in transparent huge pages vs 4 KiB pages, side by side in one process.

    python benchmarks/bench_huge_pages.py [--dims 16,64,128] [--threads 1] [--rounds 7] [--repeat 5] [--busy-core]

sparsekit advises huge pages for a table of 256 MiB or more (``sparsekit/allocator.py``).
This measures what that buys where tables are read at random rows: ``sk.ops.embedding_bag``
over a 1M x D table, and a ``DistributedEmbedding`` training step over a 4M x D hash table,
each built with and without the advice. Ratios: 4 KiB-page time / huge-page time per
interleaved round, median (min-max); with THP off both sides are the same. Writes
benchmarks/results/huge_pages_cpu.json (``_busy`` with --busy-core).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

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
from sparsekit import allocator  # noqa: E402

ROWS, BAGS, POOLING = 1 << 20, 16384, 20
LAYER_CAPACITY, LAYER_KEYS, BATCH, SLOTS = 1 << 22, 26 * 120_000, 1024, 26


class _HugePages:
    """Within the block, tables are made with (True) or without (False) the advice."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.saved = enabled, None

    def __enter__(self) -> None:
        self.saved = allocator.HUGE_TABLE_BYTES
        # Without: a threshold no table reaches. With: every table of two huge pages or more.
        allocator.HUGE_TABLE_BYTES = 2 * allocator._HUGE_PAGE if self.enabled else 1 << 62

    def __exit__(self, *exc) -> None:
        allocator.HUGE_TABLE_BYTES = self.saved


def bench_embedding_bag(dim: int, args) -> dict:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(ROWS, dim, generator=generator)
    rows = torch.randint(0, ROWS, (BAGS * POOLING,), generator=generator)
    offsets = torch.arange(0, BAGS * POOLING + 1, POOLING)
    tables = {}
    for name, enabled in (("huge", True), ("4k", False)):
        with _HugePages(enabled):
            tables[name] = allocator.table_zeros((ROWS, dim), torch.float32, "cpu").copy_(values)
    if not torch.equal(sk.ops.embedding_bag(tables["huge"], rows, offsets),
                       sk.ops.embedding_bag(tables["4k"], rows, offsets)):
        raise RuntimeError("the huge-page and 4 KiB tables pool different values: not timing a wrong answer")
    times = time_rounds({name: (lambda t=t: sk.ops.embedding_bag(t, rows, offsets)) for name, t in tables.items()},
                        torch.device("cpu"), rounds=args.rounds, repeat=args.repeat)
    stats = ratio_stats(times["4k"], times["huge"])
    print(f"embedding_bag 1M x {dim:<3}: huge pages {np.median(times['huge']) * 1e3:6.2f} ms, 4 KiB "
          f"{np.median(times['4k']) * 1e3:6.2f} ms: {fmt_ratio(stats)}")
    return {"what": "embedding_bag", "dim": dim, "seconds_per_round": times, "speedup": stats}


def bench_layer_step(dim: int, args) -> dict:
    steps = {}
    for name, enabled in (("huge", True), ("4k", False)):
        with _HugePages(enabled):
            layer = sk.DistributedEmbedding("sum", LAYER_CAPACITY, dim, SLOTS, 1, use_hashtable=True)
            optimizer = sk.LazyAdam(layer.parameters(), lr=1e-3)
            rng = np.random.default_rng(0)
            batches = [torch.from_numpy(rng.integers(0, LAYER_KEYS, (BATCH, SLOTS, 1))) for _ in range(8)]

            def step(keys, layer=layer, optimizer=optimizer) -> None:
                layer(keys).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            # Every key in, the moments made; the same order on both sides, so that both
            # tables place every key in the same row.
            step(torch.randperm(LAYER_KEYS, generator=torch.Generator().manual_seed(0)).view(-1, SLOTS, 1))
            steps[name] = (lambda step=step, batches=batches: [step(b) for b in batches])
    times = time_rounds(steps, torch.device("cpu"), rounds=args.rounds, repeat=args.repeat)
    stats = ratio_stats(times["4k"], times["huge"])
    print(f"layer step {LAYER_KEYS:,} keys of 4M x {dim:<3}: huge pages {np.median(times['huge']) / 8 * 1e3:6.2f} "
          f"ms, 4 KiB {np.median(times['4k']) / 8 * 1e3:6.2f} ms per step: {fmt_ratio(stats)}")
    return {"what": "layer_step", "dim": dim, "seconds_per_round": times, "speedup": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="16,64,128", help="comma-separated embedding dims")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--layer-dims", default="16,64", help="dims of the layer-step comparison ('' for none)")
    add_round_args(parser, rounds=7, repeat=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sk.keep_freed_memory()
    print(f"transparent huge pages: {allocator.huge_page_mode()}; {args.threads} thread(s)")
    rows = []
    with busy_core(args.busy_core):
        for dim in [int(d) for d in args.dims.split(",") if d]:
            rows.append(bench_embedding_bag(dim, args))
        for dim in [int(d) for d in args.layer_dims.split(",") if d]:
            rows.append(bench_layer_step(dim, args))
    extra = {"thp": allocator.huge_page_mode(), "threads": args.threads, "busy_core": args.busy_core}
    print("wrote", write_results("huge_pages_busy" if args.busy_core else "huge_pages", torch.device("cpu"), rows,
                                 extra))


if __name__ == "__main__":
    main()

"""sparsekit.HashTable insert and find throughput, with torch-only competitors side by side.

    python benchmarks/bench_hashtable.py [--device cpu|cuda] [--capacity N] [--queries Q]
                                         [--rounds 7] [--repeat 5] [--busy-core]

A grid of load factor (``len / capacity`` in {0.25, 0.5, 0.75}; the slots are at most half
occupied) x key distribution (``uniform`` int64, or ``zipf`` 1.2 streams with many
repeats), in keys per second: ``build`` (one insert), ``find`` of Q keys and
``insert_existing`` (the training-time find-or-insert). Competitors in the same process: a
sorted key array (``torch.sort`` / ``torch.searchsorted``) and, on the CPU, a Python dict.
Interleaved rounds of the best of --repeat calls; ratios median (min-max), every round in
the JSON. Writes benchmarks/results/hashtable_<device>.json (``_busy`` with --busy-core).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_round_args,
    busy_core,
    fmt_ratio,
    ratio_stats,
    time_rounds,
    write_results,
    zipf_keys,
)

ZIPF_ALPHA = 1.2
DICT_KEYS = 100_000


def spread_ranks(ranks: np.ndarray) -> torch.Tensor:
    """The rank -> key map of benchmarks.common.zipf_keys."""
    keys = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
    return torch.from_numpy(keys.copy())


def resident_and_queries(dist: str, num_resident: int, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if dist == "uniform":
        resident = sparsekit.ops.unique(
            torch.randint(-(2**63), 2**63 - 1, (num_resident + num_resident // 100 + 16,), generator=gen),
            return_inverse=False)[:num_resident]
        queries = resident[torch.randint(0, num_resident, (num_queries,), generator=gen)]
        return resident, queries
    resident = spread_ranks(np.arange(1, num_resident + 1))
    return resident, zipf_keys(num_queries, alpha=ZIPF_ALPHA, seed=1)


def sorted_array_find(sorted_keys: torch.Tensor, sorted_rows: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    pos = torch.searchsorted(sorted_keys, queries).clamp_(max=sorted_keys.numel() - 1)
    return torch.where(sorted_keys[pos] == queries, sorted_rows[pos], -1)


def bench_cell(dist: str, load: float, capacity: int, num_queries: int, device: torch.device,
               rounds: int, repeat: int) -> dict:
    num_resident = int(load * capacity)
    resident, queries = resident_and_queries(dist, num_resident, num_queries)
    resident, queries = resident.to(device), queries.to(device)
    table = sparsekit.HashTable(capacity, device=device)

    table.insert(resident)
    assert len(table) == num_resident
    rows = table.find(queries)
    hit_rate = float((rows >= 0).float().mean())
    # torch-only competitor: a sorted key array, checked against the table.
    sorted_keys, order = torch.sort(resident)
    assert torch.equal(sorted_array_find(sorted_keys, table.find(resident)[order], queries), rows)

    # build empties the table first and find sees the resident keys alone; insert_existing
    # first places the few Zipf queries outside the resident set (all untimed). Where those
    # do not fit the capacity (--queries well above --capacity), insert_existing is skipped
    # instead of failing the run with HashTableFullError after the cells before it.
    outside = int((table.find(sparsekit.ops.unique(queries, return_inverse=False)) < 0).sum())
    fns = {
        "build": lambda: table.insert(resident),
        "sort": lambda: torch.sort(resident),
        "find": lambda: table.find(queries),
        "searchsorted": lambda: sorted_array_find(sorted_keys, order, queries),
    }
    if num_resident + outside <= capacity:
        fns["insert_existing"] = lambda: table.insert(queries)
    else:
        print(f"{dist:<7} load {load:.2f}: insert_existing skipped: the queries hold {outside:,} keys besides "
              f"the {num_resident:,} resident ones, more than capacity {capacity:,} takes")
    times = time_rounds(fns, device, rounds=rounds, repeat=repeat,
                        setup={"build": table.clear, "insert_existing": lambda: table.insert(queries)})
    median = {name: float(np.median(seconds)) for name, seconds in times.items()}
    find_stats = ratio_stats(times["searchsorted"], times["find"])
    build_stats = ratio_stats(times["sort"], times["build"])

    row = {
        "distribution": dist,
        "load_factor": load,
        "capacity": capacity,
        "slots": table.num_slots,
        "slot_occupancy": num_resident / table.num_slots,
        "resident_keys": num_resident,
        "queries": num_queries,
        "query_hit_rate": hit_rate,
        "build_keys_per_s": num_resident / median["build"],
        "find_keys_per_s": num_queries / median["find"],
        "insert_existing_keys_per_s": num_queries / median["insert_existing"] if "insert_existing" in median
        else None,
        "torch_sort_build_keys_per_s": num_resident / median["sort"],
        "torch_searchsorted_find_keys_per_s": num_queries / median["searchsorted"],
        "find_speedup_vs_searchsorted": find_stats["median"],
        "build_speedup_vs_sort": build_stats["median"],
        "ratio": find_stats,
        "build_ratio": build_stats,
        "seconds_per_round": times,
    }
    dict_note = ""
    if device.type == "cpu":
        slice_keys = resident[:DICT_KEYS].tolist()
        slice_queries = queries[:DICT_KEYS].tolist()
        start = time.perf_counter()
        lookup = {k: i for i, k in enumerate(slice_keys)}
        dict_build = time.perf_counter() - start
        start = time.perf_counter()
        [lookup.get(k, -1) for k in slice_queries]
        dict_find = time.perf_counter() - start
        row["python_dict_build_keys_per_s"] = len(slice_keys) / dict_build
        row["python_dict_find_keys_per_s"] = len(slice_queries) / dict_find
        row["find_speedup_vs_dict"] = row["find_keys_per_s"] / row["python_dict_find_keys_per_s"]
        dict_note = f" | dict find {row['python_dict_find_keys_per_s'] / 1e6:6.1f} M/s"
    print(f"{dist:<7} load {load:.2f} (slots {row['slot_occupancy']:.3f} occupied): "
          f"build {row['build_keys_per_s'] / 1e6:7.1f} M/s (sort {row['torch_sort_build_keys_per_s'] / 1e6:6.1f}) | "
          f"find {row['find_keys_per_s'] / 1e6:7.1f} M/s (searchsorted "
          f"{row['torch_searchsorted_find_keys_per_s'] / 1e6:6.1f}, {fmt_ratio(find_stats)}) | "
          + (f"insert existing {row['insert_existing_keys_per_s'] / 1e6:6.1f} M/s" if "insert_existing" in median
             else "insert existing skipped") + dict_note)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--capacity", type=int, default=None, help="default 2^20 on CPU, 2^24 on CUDA")
    parser.add_argument("--queries", type=int, default=None, help="default 2^20 on CPU, 2^24 on CUDA")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for both sides (torch.set_num_threads); default torch's")
    add_round_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    capacity = args.capacity or (1 << 24 if device.type == "cuda" else 1 << 20)
    num_queries = args.queries or (1 << 24 if device.type == "cuda" else 1 << 20)
    with busy_core(args.busy_core):
        rows = [bench_cell(dist, load, capacity, num_queries, device, args.rounds, args.repeat)
                for dist in ("uniform", "zipf") for load in (0.25, 0.5, 0.75)]
    extra = {"zipf_alpha": ZIPF_ALPHA, "busy_core": args.busy_core, "rounds": args.rounds, "repeat": args.repeat}
    print("wrote", write_results("hashtable_busy" if args.busy_core else "hashtable", device, rows, extra))


if __name__ == "__main__":
    main()

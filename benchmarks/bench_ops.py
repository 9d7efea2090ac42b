"""unique vs torch.unique and segment_sum vs index_add_, side by side in one process.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--keys N] [--rows N] [--threads N]
                                   [--repeat N] [--rounds N]

Defaults: 4M int64 Zipf keys on the CPU (10M on CUDA); segment_sum of 4M x 64 float32
rows into 100k segments. The torch side of unique is the faster of sorted=True and
sorted=False, both with return_inverse and return_counts (sparsekit always computes both).
On CUDA, bytes moved per second are also given against a device-to-device copy measured
in the same run. On a shared machine, --rounds interleaves the two sides several times and
reports the median of each, so that a noisy spell hits both. Writes
benchmarks/results/ops_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit  # noqa: E402
from benchmarks.common import copy_bandwidth, time_fn, write_results, zipf_keys  # noqa: E402


def time_sides(fns: dict, device: torch.device, repeat: int, rounds: int) -> dict:
    """Seconds per call of each fn, keyed like fns: the median over `rounds` interleaved
    rounds, each a time_fn median of `repeat` calls."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_fn(fn, device, repeat=repeat))
    return {name: float(np.median(ts)) for name, ts in times.items()}


def bench_unique(device: torch.device, n: int, alpha: float, repeat: int, rounds: int) -> dict:
    keys = zipf_keys(n, alpha=alpha).to(device)
    times = time_sides({
        "ours": lambda: sparsekit.ops.unique(keys, return_inverse=True, return_counts=True),
        True: lambda: torch.unique(keys, sorted=True, return_inverse=True, return_counts=True),
        False: lambda: torch.unique(keys, sorted=False, return_inverse=True, return_counts=True),
    }, device, repeat, rounds)
    ours = times["ours"]
    theirs = {sorted_: times[sorted_] for sorted_ in (True, False)}
    best = min(theirs.values())
    num_unique = int(sparsekit.ops.unique(keys, return_inverse=False).numel())
    row = {
        "op": "unique",
        "keys": n,
        "zipf_alpha": alpha,
        "unique_keys": num_unique,
        "sparsekit_s": ours,
        "torch_unique_sorted_s": theirs[True],
        "torch_unique_unsorted_s": theirs[False],
        "speedup_vs_faster_torch": best / ours,
    }
    print(f"unique        {n:>10,} keys ({num_unique:,} distinct): sparsekit {ours * 1e3:8.2f} ms | "
          f"torch.unique sorted {theirs[True] * 1e3:8.2f} ms, unsorted {theirs[False] * 1e3:8.2f} ms | "
          f"speed-up {best / ours:5.2f}x")
    return row


def bench_segment_sum(device: torch.device, rows: int, dim: int, segments: int, bandwidth: float | None,
                      repeat: int, rounds: int) -> list:
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(rows, dim, generator=gen).to(device)
    ids = torch.randint(0, segments, (rows,), generator=gen).to(device)
    times = time_sides({
        "index_add_": lambda: torch.zeros(segments, dim, device=device).index_add_(0, ids, data),
        False: lambda: sparsekit.ops.segment_sum(data, ids, segments, deterministic=False),
        True: lambda: sparsekit.ops.segment_sum(data, ids, segments, deterministic=True),
    }, device, repeat, rounds)
    baseline = times["index_add_"]
    results = []
    for deterministic in (False, True):
        ours = times[deterministic]
        moved = data.numel() * 4 + ids.numel() * 8 + segments * dim * 4
        row = {
            "op": "segment_sum",
            "rows": rows,
            "dim": dim,
            "segments": segments,
            "deterministic": deterministic,
            "sparsekit_s": ours,
            "index_add_s": baseline,
            "speedup_vs_index_add": baseline / ours,
        }
        note = ""
        if bandwidth is not None:
            row["fraction_of_copy_bandwidth"] = moved / ours / bandwidth
            note = f" | {row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth"
        print(f"segment_sum   {rows:>10,} x {dim} -> {segments:,} (deterministic={deterministic!s:5}): sparsekit "
              f"{ours * 1e3:8.2f} ms | index_add_ {baseline * 1e3:8.2f} ms | speed-up {baseline / ours:5.2f}x{note}")
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keys", type=int, default=None, help="unique input size (4M on CPU, 10M on CUDA)")
    parser.add_argument("--zipf-alpha", type=float, default=1.2)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved measurements per side")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    keys = args.keys or (10_000_000 if device.type == "cuda" else 4_000_000)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    bandwidth = copy_bandwidth(device, 1 << 30) if device.type == "cuda" else None
    rows = [bench_unique(device, keys, args.zipf_alpha, args.repeat, args.rounds)]
    rows += bench_segment_sum(device, args.rows, args.dim, args.segments, bandwidth,
                              args.repeat, args.rounds)
    extra = {"copy_bandwidth_bytes_per_s": bandwidth} if bandwidth else None
    print("wrote", write_results("ops", device, rows, extra))


if __name__ == "__main__":
    main()

"""unique vs torch.unique and segment_sum vs index_add_, side by side in one process.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--keys N] [--distributions zipf,distinct,uniform]
                                   [--rows N] [--threads N] [--rounds 7] [--repeat 5] [--busy-core]

Defaults: 4M int64 keys on the CPU (10M on CUDA): Zipf(1.2) keys, and with
--distributions also all-distinct keys and draws from a quarter as many values (each key
~4 times); segment_sum of 4M x 64 float32 rows into 100k segments. The torch side of
unique is the faster of sorted=True and sorted=False, both with return_inverse and
return_counts (sparsekit always computes both). Each of --rounds interleaved rounds times
the best of --repeat calls per side; every ratio (torch time / sparsekit time) is given as
its median with the min-max over rounds, and the JSON keeps every round. --busy-core
keeps one core busy with a spinning process throughout. On CUDA, bytes moved per second
are also given against a device-to-device copy measured in the same run. Writes
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
from benchmarks.common import (  # noqa: E402
    add_round_args,
    busy_core,
    copy_bandwidth,
    fmt_ratio,
    ratio_stats,
    time_rounds,
    write_results,
    zipf_keys,
)


def make_keys(distribution: str, n: int, alpha: float) -> torch.Tensor:
    if distribution == "zipf":
        return zipf_keys(n, alpha=alpha)
    g = torch.Generator().manual_seed(0)
    if distribution == "distinct":
        return torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    return torch.randint(0, max(1, n // 4), (n,), generator=g) * 0x9E3779B97F4A7C15 % (2**61)  # "uniform"


def check_unique(keys: torch.Tensor, distribution: str) -> None:
    """sparsekit's unique must give torch.unique's keys and counts (in first-occurrence
    order) and an inverse that rebuilds the input, or the timing below means nothing."""
    unique_keys, inverse, counts = sparsekit.ops.unique(keys, return_inverse=True, return_counts=True)
    expected_keys, expected_counts = torch.unique(keys, sorted=True, return_counts=True)
    order = torch.argsort(unique_keys)
    if not (torch.equal(unique_keys[inverse], keys) and torch.equal(unique_keys[order], expected_keys)
            and torch.equal(counts[order], expected_counts)):
        raise RuntimeError(f"sparsekit.ops.unique disagrees with torch.unique on the {distribution} keys: "
                           "not timing a wrong answer")


def check_segment_sum(data: torch.Tensor, ids: torch.Tensor, segments: int, expected: torch.Tensor) -> None:
    """Both segment_sum paths must match index_add_ before either is timed."""
    for deterministic in (False, True):
        got = sparsekit.ops.segment_sum(data, ids, segments, deterministic=deterministic)
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"sparsekit.ops.segment_sum(deterministic={deterministic}) disagrees with "
                               f"index_add_ (max abs diff {float((got - expected).abs().max()):.3g}): "
                               "not timing a wrong answer")


def bench_unique(device: torch.device, distribution: str, n: int, alpha: float, repeat: int, rounds: int) -> dict:
    keys = make_keys(distribution, n, alpha).to(device)
    check_unique(keys, distribution)
    times = time_rounds({
        "ours": lambda: sparsekit.ops.unique(keys, return_inverse=True, return_counts=True),
        "sorted": lambda: torch.unique(keys, sorted=True, return_inverse=True, return_counts=True),
        "unsorted": lambda: torch.unique(keys, sorted=False, return_inverse=True, return_counts=True),
    }, device, rounds=rounds, repeat=repeat)
    faster_torch = [min(a, b) for a, b in zip(times["sorted"], times["unsorted"])]
    stats = ratio_stats(faster_torch, times["ours"])
    num_unique = int(sparsekit.ops.unique(keys, return_inverse=False).numel())
    row = {
        "op": "unique",
        "distribution": distribution,
        "keys": n,
        "zipf_alpha": alpha if distribution == "zipf" else None,
        "unique_keys": num_unique,
        "sparsekit_s": float(np.median(times["ours"])),
        "torch_unique_sorted_s": float(np.median(times["sorted"])),
        "torch_unique_unsorted_s": float(np.median(times["unsorted"])),
        "seconds_per_round": times,
        "speedup_vs_faster_torch": stats["median"],
        "ratio": stats,
    }
    print(f"unique {distribution:8} {n:>10,} keys ({num_unique:,} distinct): sparsekit "
          f"{row['sparsekit_s'] * 1e3:8.2f} ms | torch.unique sorted {row['torch_unique_sorted_s'] * 1e3:8.2f} ms, "
          f"unsorted {row['torch_unique_unsorted_s'] * 1e3:8.2f} ms | {fmt_ratio(stats)}")
    return row


def bench_segment_sum(device: torch.device, rows: int, dim: int, segments: int, bandwidth: float | None,
                      repeat: int, rounds: int) -> list:
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(rows, dim, generator=gen).to(device)
    ids = torch.randint(0, segments, (rows,), generator=gen).to(device)
    check_segment_sum(data, ids, segments, torch.zeros(segments, dim, device=device).index_add_(0, ids, data))
    times = time_rounds({
        "index_add_": lambda: torch.zeros(segments, dim, device=device).index_add_(0, ids, data),
        "False": lambda: sparsekit.ops.segment_sum(data, ids, segments, deterministic=False),
        "True": lambda: sparsekit.ops.segment_sum(data, ids, segments, deterministic=True),
    }, device, rounds=rounds, repeat=repeat)
    baseline = float(np.median(times["index_add_"]))
    results = []
    for deterministic in (False, True):
        stats = ratio_stats(times["index_add_"], times[str(deterministic)])
        ours = float(np.median(times[str(deterministic)]))
        moved = data.numel() * 4 + ids.numel() * 8 + segments * dim * 4
        row = {
            "op": "segment_sum",
            "rows": rows,
            "dim": dim,
            "segments": segments,
            "deterministic": deterministic,
            "sparsekit_s": ours,
            "index_add_s": baseline,
            "speedup_vs_index_add": stats["median"],
            "ratio": stats,
            "seconds_per_round": {"index_add_": times["index_add_"], "sparsekit": times[str(deterministic)]},
        }
        note = ""
        if bandwidth is not None:
            row["fraction_of_copy_bandwidth"] = moved / ours / bandwidth
            note = f" | {row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth"
        print(f"segment_sum   {rows:>10,} x {dim} -> {segments:,} (deterministic={deterministic!s:5}): sparsekit "
              f"{ours * 1e3:8.2f} ms | index_add_ {baseline * 1e3:8.2f} ms | {fmt_ratio(stats)}{note}")
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keys", type=int, default=None, help="unique input size (4M on CPU, 10M on CUDA)")
    parser.add_argument("--distributions", default="zipf",
                        help="comma-separated unique inputs: zipf, distinct, uniform (n/4 values)")
    parser.add_argument("--zipf-alpha", type=float, default=1.2)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_round_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    keys = args.keys or (10_000_000 if device.type == "cuda" else 4_000_000)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    bandwidth = copy_bandwidth(device, 1 << 30) if device.type == "cuda" else None
    with busy_core(args.busy_core):
        rows = [bench_unique(device, distribution, keys, args.zipf_alpha, args.repeat, args.rounds)
                for distribution in args.distributions.split(",")]
        rows += bench_segment_sum(device, args.rows, args.dim, args.segments, bandwidth,
                                  args.repeat, args.rounds)
    extra = {"busy_core": args.busy_core, "rounds": args.rounds, "repeat": args.repeat}
    if bandwidth:
        extra["copy_bandwidth_bytes_per_s"] = bandwidth
    print("wrote", write_results("ops_busy" if args.busy_core else "ops", device, rows, extra))


if __name__ == "__main__":
    main()

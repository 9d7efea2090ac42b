"""unique vs torch.unique and segment_sum vs index_add_, side by side in one process.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--keys N] [--rows N]

Defaults: 4M int64 Zipf keys on the CPU (10M on CUDA); segment_sum of 4M x 64 float32
rows into 100k segments. The torch side of unique is the faster of sorted=True and
sorted=False, both with return_inverse and return_counts (sparsekit always computes both).
On CUDA, bytes moved per second are also given against a device-to-device copy measured
in the same run. Writes benchmarks/results/ops_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit  # noqa: E402
from benchmarks.common import time_fn, write_results, zipf_keys  # noqa: E402


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted) of nbytes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / seconds


def bench_unique(device: torch.device, n: int, alpha: float) -> dict:
    keys = zipf_keys(n, alpha=alpha).to(device)
    ours = time_fn(lambda: sparsekit.ops.unique(keys, return_inverse=True, return_counts=True), device)
    theirs = {
        sorted_: time_fn(lambda: torch.unique(keys, sorted=sorted_, return_inverse=True, return_counts=True), device)
        for sorted_ in (True, False)
    }
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


def bench_segment_sum(device: torch.device, rows: int, dim: int, segments: int, bandwidth: float | None) -> list:
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(rows, dim, generator=gen).to(device)
    ids = torch.randint(0, segments, (rows,), generator=gen).to(device)
    baseline = time_fn(lambda: torch.zeros(segments, dim, device=device).index_add_(0, ids, data), device)
    results = []
    for deterministic in (False, True):
        ours = time_fn(lambda: sparsekit.ops.segment_sum(data, ids, segments, deterministic=deterministic), device)
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
    args = parser.parse_args()
    device = torch.device(args.device)
    keys = args.keys or (10_000_000 if device.type == "cuda" else 4_000_000)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    bandwidth = copy_bandwidth(device, 1 << 30) if device.type == "cuda" else None
    rows = [bench_unique(device, keys, args.zipf_alpha)]
    rows += bench_segment_sum(device, args.rows, args.dim, args.segments, bandwidth)
    extra = {"copy_bandwidth_bytes_per_s": bandwidth} if bandwidth else None
    print("wrote", write_results("ops", device, rows, extra))


if __name__ == "__main__":
    main()

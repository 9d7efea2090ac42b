"""Throughput of the harness's Criteo TSV reader, in lines per second.

    python benchmarks/bench_criteo_reader.py [FILE] [--lines N] [--batch-size N]

Without FILE, a Criteo-format file of --lines synthetic samples is generated in a
temporary directory. The reader (index pass, line reads, parsing, per-slot XXH3 hashing
of the 26 categorical fields, log transform) is timed over the whole file, batch by
batch as the harness reads it, on one process. Beside it, in the same run, the floor
of a pure-Python reader: reading the lines and splitting them on tabs, nothing else.
Writes benchmarks/results/criteo_reader_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_results  # noqa: E402
from sparsekit.train.criteo import benchmark_reader, write_synthetic_tsv  # noqa: E402


def split_only(path: str) -> float:
    """Lines per second of reading and tab-splitting every line."""
    start = time.perf_counter()
    lines = 0
    with open(path, "rb") as stream:
        for line in stream:
            line.rstrip(b"\r\n").split(b"\t")
            lines += 1
    return lines / (time.perf_counter() - start)


def run(path: str, batch_size: int) -> dict:
    reader = benchmark_reader(path, batch_size)
    floor = split_only(path)
    print(f"Criteo reader: {reader['lines']:,} lines in {reader['seconds']:.2f} s = "
          f"{reader['lines_per_s']:,.0f} lines/s | read+split only {floor:,.0f} lines/s "
          f"({reader['lines_per_s'] / floor:.2f}x of it)")
    return {"file_bytes": os.path.getsize(path), "batch_size": batch_size, **reader,
            "split_only_lines_per_s": floor, "fraction_of_split_only": reader["lines_per_s"] / floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", help="a Criteo TSV file (default: a generated one)")
    parser.add_argument("--lines", type=int, default=200_000, help="lines of the generated file")
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args()
    if args.path:
        row = run(args.path, args.batch_size)
    else:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "criteo.tsv")
            write_synthetic_tsv(path, args.lines)
            row = run(path, args.batch_size)
    print("wrote", write_results("criteo_reader", torch.device("cpu"), [row]))


if __name__ == "__main__":
    main()

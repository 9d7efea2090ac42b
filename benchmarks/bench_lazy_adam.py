"""LazyAdam vs torch.optim.SparseAdam, side by side in one process.

    python benchmarks/bench_lazy_adam.py [--device cpu|cuda] [--rows N] [--dim D] [--unique U]
                                         [--rounds 7] [--repeat 5] [--busy-core]

One optimizer.step() with the gradient set (default: 1M x 64 float32, 100k distinct rows),
for a coalesced gradient (the pure update) and for the uncoalesced one nn.Embedding
produces (300k lookups: SparseAdam sorts it, LazyAdam sums the duplicates). Interleaved
rounds of the best of --repeat; ratio SparseAdam time / LazyAdam time, median (min-max). On
CUDA also the update's bytes per second against a copy in the same run. Writes
benchmarks/results/lazy_adam_<device>.json (``_busy`` with --busy-core).
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
)


def make_gradient(rows: int, dim: int, unique: int, duplicates: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    touched = torch.randperm(rows, generator=gen)[:unique]
    indices = touched
    if duplicates > 1:
        indices = touched[torch.randint(0, unique, (unique * duplicates,), generator=gen)]
        indices[:unique] = touched  # every one of the `unique` rows appears
    values = torch.randn(indices.numel(), dim, generator=gen)
    grad = torch.sparse_coo_tensor(indices[None], values, (rows, dim), check_invariants=False).to(device)
    return grad.coalesce() if duplicates <= 1 else grad


def bench_case(name: str, rows: int, dim: int, unique: int, duplicates: int, device: torch.device,
               bandwidth: float | None, rounds: int, repeat: int) -> dict:
    grad = make_gradient(rows, dim, unique, duplicates, device)
    steps = {}
    for label, make_opt in (("sparsekit", sparsekit.LazyAdam), ("torch", torch.optim.SparseAdam)):
        param = torch.nn.Parameter(torch.zeros(rows, dim, device=device))
        param.grad = grad
        steps[label] = make_opt([param], lr=1e-3).step
    # Two untimed steps of each from the same (zero) weights must agree before any is timed.
    params = {}
    for label, step in steps.items():
        step()
        step()
        params[label] = step.__self__.param_groups[0]["params"][0].detach()
    if not torch.allclose(params["sparsekit"], params["torch"], rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"{name}: LazyAdam's weights differ from SparseAdam's after two steps (max abs diff "
                           f"{float((params['sparsekit'] - params['torch']).abs().max()):.3g}): "
                           "not timing a wrong answer")
    del params
    times = time_rounds(steps, device, rounds=rounds, repeat=repeat)
    stats = ratio_stats(times["torch"], times["sparsekit"])
    ours, theirs = float(np.median(times["sparsekit"])), float(np.median(times["torch"]))
    row = {
        "case": name,
        "rows": rows,
        "dim": dim,
        "unique_rows": unique,
        "gradient_entries": grad._nnz(),
        "sparsekit_s": ours,
        "torch_sparse_adam_s": theirs,
        "speedup_vs_sparse_adam": stats["median"],
        "ratio": stats,
        "seconds_per_round": times,
    }
    note = ""
    if bandwidth is not None:
        moved = unique * dim * 4 * 7  # weight, exp_avg, exp_avg_sq read + written; grad read
        row["fraction_of_copy_bandwidth"] = moved / ours / bandwidth
        note = f" | {row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth"
    print(f"{name:<11} {grad._nnz():>9,} entries, {unique:,} rows of {rows:,} x {dim}: "
          f"LazyAdam {ours * 1e3:8.2f} ms | SparseAdam {theirs * 1e3:8.2f} ms | "
          f"{fmt_ratio(stats)}{note}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--unique", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for both sides (torch.set_num_threads); default torch's")
    add_round_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 1 << 28) if device.type == "cuda" else None
    with busy_core(args.busy_core):
        rows = [bench_case(name, args.rows, args.dim, args.unique, duplicates, device, bandwidth, args.rounds,
                           args.repeat) for name, duplicates in (("coalesced", 1), ("duplicates", 3))]
    extra = {"busy_core": args.busy_core, "rounds": args.rounds, "repeat": args.repeat}
    if bandwidth is not None:
        extra["copy_bandwidth_bytes_per_s"] = bandwidth
    print("wrote", write_results("lazy_adam_busy" if args.busy_core else "lazy_adam", device, rows, extra))


if __name__ == "__main__":
    main()

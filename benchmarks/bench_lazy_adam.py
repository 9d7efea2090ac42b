"""LazyAdam vs torch.optim.SparseAdam, side by side in one process.

    python benchmarks/bench_lazy_adam.py [--device cpu|cuda] [--rows N] [--dim D] [--unique U]

Default: a 1M x 64 float32 embedding, a gradient touching 100k distinct rows. Timed: one
optimizer.step() with the gradient already set, in two cases:

* ``coalesced``: a coalesced sparse gradient (100k entries), the pure update cost.
* ``duplicates``: the uncoalesced gradient nn.Embedding(sparse=True) produces, here 300k
  lookups of the same 100k rows; SparseAdam coalesces (sorts) it, LazyAdam sums the
  duplicates with sparsekit's unique + segment_sum.

On CUDA, bytes moved per second by the fused update (weight and both moments read and
written, gradient rows read) are also given against a device-to-device copy measured in
the same run. Writes benchmarks/results/lazy_adam_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit  # noqa: E402
from benchmarks.common import copy_bandwidth, time_fn, write_results  # noqa: E402


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
               bandwidth: float | None, repeat: int) -> dict:
    grad = make_gradient(rows, dim, unique, duplicates, device)
    results = {}
    for label, make_opt in (("sparsekit_s", sparsekit.LazyAdam), ("torch_sparse_adam_s", torch.optim.SparseAdam)):
        param = torch.nn.Parameter(torch.zeros(rows, dim, device=device))
        opt = make_opt([param], lr=1e-3)
        param.grad = grad
        results[label] = time_fn(opt.step, device, warmup=1, repeat=repeat)
        del opt, param
    ours, theirs = results["sparsekit_s"], results["torch_sparse_adam_s"]
    row = {
        "case": name,
        "rows": rows,
        "dim": dim,
        "unique_rows": unique,
        "gradient_entries": grad._nnz(),
        **results,
        "speedup_vs_sparse_adam": theirs / ours,
    }
    note = ""
    if bandwidth is not None:
        moved = unique * dim * 4 * 7  # weight, exp_avg, exp_avg_sq read + written; grad read
        row["fraction_of_copy_bandwidth"] = moved / ours / bandwidth
        note = f" | {row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth"
    print(f"{name:<11} {grad._nnz():>9,} entries, {unique:,} rows of {rows:,} x {dim}: "
          f"LazyAdam {ours * 1e3:8.2f} ms | SparseAdam {theirs * 1e3:8.2f} ms | "
          f"speed-up {theirs / ours:5.2f}x{note}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--unique", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for both sides (torch.set_num_threads); default torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 1 << 28) if device.type == "cuda" else None
    rows = [
        bench_case("coalesced", args.rows, args.dim, args.unique, 1, device, bandwidth, args.repeat),
        bench_case("duplicates", args.rows, args.dim, args.unique, 3, device, bandwidth, args.repeat),
    ]
    extra = {"copy_bandwidth_bytes_per_s": bandwidth} if bandwidth is not None else None
    print("wrote", write_results("lazy_adam", device, rows, extra))


if __name__ == "__main__":
    main()

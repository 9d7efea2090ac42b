"""embedding_bag forward and backward: sparsekit vs nn.EmbeddingBag(sparse=True) vs FBGEMM.

    python benchmarks/bench_embedding.py [--device cpu|cuda] [--rows 1000000] [--dims 64]
                                         [--bags 16384] [--pooling 20] [--rounds 7] [--repeat 5]
                                         [--busy-core] [--one-process]

A 1M x 64 float32 table, 16384 bags of 20 rows (sum pooling), uniform or Zipf rows. All
candidates run side by side in --rounds interleaved rounds of the best of --repeat calls;
ratios are competitor time / sparsekit time, median (min-max), every round in the JSON.
On the CPU each dim runs in a process of its own (--one-process: all in this one); one
thread is timed in thread CPU time. Options: ``--modes sum,weighted,max``,
``--prefetch-plans`` (each CPU prefetch plan forced), the skew case (``--skew-lookups``:
one hot row against all distinct rows; ``--skip-main`` runs it alone). Also each side's
fraction of a copy's (CUDA) or ``torch.sum``'s (CPU) bandwidth in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_round_args,
    busy_core,
    copy_bandwidth,
    fmt_ratio,
    ratio_stats,
    read_bandwidth,
    time_rounds,
    write_results,
    zipf_keys,
)
from sparsekit import ops  # noqa: E402


def load_fbgemm():
    """FBGEMM's table-batched embedding modules, or None (with the reason) when not installed."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as error:  # noqa: BLE001  (any import failure means: not available)
        return None, f"{type(error).__name__}: {error}"
    return dict(
        EmbOptimType=EmbOptimType,
        SparseType=SparseType,
        EmbeddingLocation=EmbeddingLocation,
        PoolingMode=PoolingMode,
        ComputeDevice=ComputeDevice,
        Training=SplitTableBatchedEmbeddingBagsCodegen,
        Inference=IntNBitTableBatchedEmbeddingBagsCodegen,
    ), None


def make_rows(distribution: str, n: int, num_rows: int, device: torch.device) -> torch.Tensor:
    if distribution == "uniform":
        rows = torch.randint(0, num_rows, (n,), generator=torch.Generator().manual_seed(0))
    else:
        # Zipf ranks spread over the int64 range like hashed ids, folded onto the table.
        rows = torch.remainder(zipf_keys(n, seed=0), num_rows)
    return rows.to(device)


def clock_for(device: torch.device) -> Callable[[], float]:
    """Thread CPU time for one CPU thread (the work itself: unlike wall time it does not grow
    while other processes of a shared machine hold the core), wall time otherwise."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def fbgemm_modules(fbgemm, table: torch.Tensor, device: torch.device):
    num_rows, dim = table.shape
    on_gpu = device.type == "cuda"
    location = fbgemm["EmbeddingLocation"].DEVICE if on_gpu else fbgemm["EmbeddingLocation"].HOST
    compute = fbgemm["ComputeDevice"].CUDA if on_gpu else fbgemm["ComputeDevice"].CPU
    # learning_rate 0 keeps the table unchanged across timed backward passes.
    training = fbgemm["Training"](
        [(num_rows, dim, location, compute)],
        optimizer=fbgemm["EmbOptimType"].EXACT_SGD,
        learning_rate=0.0,
        pooling_mode=fbgemm["PoolingMode"].SUM,
        device=device,
    )
    with torch.no_grad():
        training.split_embedding_weights()[0].copy_(table)
    inference = None
    if not on_gpu:
        inference = fbgemm["Inference"](
            [("table", num_rows, dim, fbgemm["SparseType"].FP32, location)],
            device="cpu",
            pooling_mode=fbgemm["PoolingMode"].SUM,
            output_dtype=fbgemm["SparseType"].FP32,
        )
        inference.fill_random_weights()
        with torch.no_grad():
            inference.split_embedding_weights()[0][0].view(torch.float32).view(num_rows, -1)[:, :dim].copy_(table)
    return training, inference


# SPARSEKIT_POOL_PREFETCH's values: the two prefetch plans of the CPU pooling loops
# (csrc/cpu/prefetch_plan.h), which "sparsekit" itself chooses between by timing its calls.
PREFETCH_PLANS = ("every", "first")


def forced_plan(plan: str, table: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """sparsekit's forward with one prefetch plan forced (read by the op on each call); the
    variable is put back as it was, so that "sparsekit" keeps the caller's setting."""
    before = os.environ.get("SPARSEKIT_POOL_PREFETCH")
    os.environ["SPARSEKIT_POOL_PREFETCH"] = plan
    try:
        return ops.embedding_bag(table, rows, offsets)
    finally:
        if before is None:
            del os.environ["SPARSEKIT_POOL_PREFETCH"]
        else:
            os.environ["SPARSEKIT_POOL_PREFETCH"] = before


def training_steps(weight: torch.Tensor, reference: torch.nn.EmbeddingBag, rows: torch.Tensor, offsets: torch.Tensor,
                   grad_out: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """A forward + backward step of sparsekit's sum pooling over ``weight`` (a leaf) and of
    ``reference``, each dropping the gradient of the step before."""
    def sparsekit_step():
        weight.grad = None
        ops.embedding_bag(weight, rows, offsets).backward(grad_out)

    def torch_step():
        reference.weight.grad = None
        reference(rows, offsets).backward(grad_out)

    return sparsekit_step, torch_step


def bench_dim(args, dim: int, fbgemm, device: torch.device, copy_bytes_per_s: float | None) -> list[dict]:
    """Forward and forward + backward rows of every candidate at one embedding dim."""
    results: list[dict] = []
    nnz = args.bags * args.pooling
    offsets = torch.arange(0, nnz + 1, args.pooling, device=device)
    # One table in memory for every side (nn.EmbeddingBag's weight is a view of it): two copies
    # can sit in memory of different speed, which would time the copies, not the kernels.
    # No side writes the table.
    table = torch.randn(args.rows, dim, device=device)
    reference = torch.nn.EmbeddingBag(args.rows, dim, mode="sum", sparse=True, include_last_offset=True,
                                      _weight=table, device=device)
    weight = table.detach().requires_grad_()
    training = inference = None
    if fbgemm is not None:
        try:
            training, inference = fbgemm_modules(fbgemm, table, device)
        except Exception as error:  # noqa: BLE001
            print(f"FBGEMM modules could not be built on {device}: {error}")
    grad_out = torch.randn(args.bags, dim, device=device)
    # 1 GiB for read_bandwidth (CPU only).
    stream = torch.empty(1 << 28, dtype=torch.float32).uniform_() if device.type == "cpu" else None
    scale = torch.rand(nnz, device=device)
    reference_max = torch.nn.EmbeddingBag(args.rows, dim, mode="max", include_last_offset=True, _weight=table,
                                          device=device) if "max" in args.modes else None
    for distribution in ("uniform", "zipf"):
        rows = make_rows(distribution, nnz, args.rows, device)
        rows32, offsets32 = rows.int(), offsets.int()
        expected = reference(rows, offsets).detach()
        torch.testing.assert_close(ops.embedding_bag(table, rows, offsets), expected)

        forward = {
            "sparsekit": lambda: ops.embedding_bag(table, rows, offsets),
            "nn.EmbeddingBag": lambda: reference(rows, offsets),
        }
        if training is not None:
            torch.testing.assert_close(training(rows, offsets).detach(), expected, rtol=1e-4, atol=1e-4)
            forward["fbgemm_training"] = lambda: training(rows, offsets)
        if inference is not None:
            torch.testing.assert_close(inference(rows32, offsets32), expected, rtol=1e-4, atol=1e-4)
            forward["fbgemm_inference"] = lambda: inference(rows32, offsets32)
        if args.prefetch_plans:
            for plan in PREFETCH_PLANS:
                forward[f"sparsekit[{plan}]"] = lambda plan=plan: forced_plan(plan, table, rows, offsets)

        sparsekit_step, torch_step = training_steps(weight, reference, rows, offsets, grad_out)
        # Forward only, per extra pooling mode: (sparsekit, nn.EmbeddingBag in that mode).
        other_modes = {}
        if "weighted" in args.modes:
            other_modes["forward weighted"] = {
                "sparsekit": lambda: ops.embedding_bag(table, rows, offsets, scale),
                "nn.EmbeddingBag": lambda: reference(rows, offsets, per_sample_weights=scale)}
        if "max" in args.modes:
            other_modes["forward max"] = {
                "sparsekit": lambda: ops.embedding_bag(table, rows, offsets, mode="max"),
                "nn.EmbeddingBag": lambda: reference_max(rows, offsets)}
        for sides in other_modes.values():
            torch.testing.assert_close(sides["sparsekit"](), sides["nn.EmbeddingBag"]().detach())

        # The timed forward + backward must give nn.EmbeddingBag's gradient (summed per row).
        sparsekit_step()
        torch_step()
        ours, theirs = weight.grad.coalesce(), reference.weight.grad.coalesce()
        if not torch.equal(ours.indices(), theirs.indices()):
            raise RuntimeError(f"D={dim} {distribution}: sparsekit's embedding_bag gradient touches other rows "
                               "than nn.EmbeddingBag's: not timing a wrong answer")
        # A Zipf row's gradient sums tens of thousands of grad_out rows, in another order than
        # torch's: the rounding of such a sum grows with the sum of the terms' magnitudes,
        # which one more reference backward (of |grad_out|) gives per element.
        reference.weight.grad = None
        reference(rows, offsets).backward(grad_out.abs())
        magnitude = reference.weight.grad.coalesce().values()
        error = (ours.values() - theirs.values()).abs()
        allowed = 1e-4 + 1e-4 * theirs.values().abs() + 1e-6 * magnitude
        if bool((error > allowed).any()):
            worst = int(torch.argmax(error - allowed))
            raise RuntimeError(f"D={dim} {distribution}: sparsekit's embedding_bag gradient differs from "
                               f"nn.EmbeddingBag's by {error.flatten()[worst].item():.3g} (allowed "
                               f"{allowed.flatten()[worst].item():.3g}): not timing a wrong answer")
        weight.grad = reference.weight.grad = ours = theirs = magnitude = error = allowed = None

        step = {"sparsekit": sparsekit_step, "nn.EmbeddingBag": torch_step}
        if training is not None:
            step["fbgemm_training"] = lambda: training(rows, offsets).backward(grad_out)

        for threads in args.threads:
            torch.set_num_threads(threads)
            clock = clock_for(device)
            with torch.no_grad():
                forward_s = time_rounds(forward, device, rounds=args.rounds, repeat=args.repeat, clock=clock)
                other_s = {phase: time_rounds(sides, device, rounds=args.rounds, repeat=args.repeat, clock=clock)
                           for phase, sides in other_modes.items()}
            step_s = time_rounds(step, device, rounds=args.rounds, repeat=args.repeat, clock=clock)
            # On the CPU, the rate torch.sum streams memory on these threads: a forward that
            # reads every lookup's row from memory (uniform rows of a large table) cannot beat
            # it, so it bounds the ratio any kernel can reach there.
            read_bytes_per_s = read_bandwidth(stream, repeat=args.repeat) if stream is not None else None

            for phase, times in (("forward", forward_s), ("forward+backward", step_s), *other_s.items()):
                ratios = {name: ratio_stats(t, times["sparsekit"]) for name, t in times.items() if name != "sparsekit"}
                ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
                row = {
                    "phase": phase,
                    "distribution": distribution,
                    "rows": args.rows,
                    "dim": dim,
                    "bags": args.bags,
                    "pooling": args.pooling,
                    "threads": threads,
                    "clock": "thread_cpu_time" if clock is time.thread_time else "wall",
                    "ms": ms,
                    "speedup": {name: stats["median"] for name, stats in ratios.items()},
                    "ratio": ratios["nn.EmbeddingBag"],
                    "ratios": ratios,
                    "seconds_per_round": times,
                }
                moved = nnz * dim * 4 + nnz * 8 + (args.bags + 1) * 8 + args.bags * dim * 4
                if phase == "forward" and copy_bytes_per_s is not None:
                    row["bytes_moved"] = moved
                    row["fraction_of_copy_bandwidth"] = moved / (ms["sparsekit"] / 1e3) / copy_bytes_per_s
                if phase == "forward" and read_bytes_per_s is not None:
                    # Bytes a lookup-by-lookup read moves (Zipf rows come mostly from the caches,
                    # so there the fraction can pass 1).
                    row["bytes_moved"] = moved
                    row["read_bytes_per_s"] = read_bytes_per_s
                    row["fraction_of_read_bandwidth"] = {name: moved / (t / 1e3) / read_bytes_per_s
                                                         for name, t in ms.items()}
                results.append(row)
                shown = "  ".join(f"{name} {t:7.2f} ms" for name, t in ms.items())
                vs = "  ".join(f"{fmt_ratio(stats)} vs {name}" for name, stats in ratios.items())
                extra = ""
                if "fraction_of_copy_bandwidth" in row:
                    extra = f"  {row['fraction_of_copy_bandwidth']:.0%} of copy bandwidth"
                if "fraction_of_read_bandwidth" in row and distribution == "uniform":
                    extra = "  of torch.sum's {:.0f} GB/s: ".format(read_bytes_per_s / 1e9) + " / ".join(
                        f"{name} {share:.0%}" for name, share in row["fraction_of_read_bandwidth"].items())
                print(f"D={dim:<4} {distribution:<8} threads={threads:<3} {phase:<17} {shown}  | sparsekit {vs}{extra}")
    return results


def run_here(args, device: torch.device, fbgemm) -> dict:
    """Every dim's rows and the skew case, in this process: {"results", "copy_bytes_per_s"}."""
    copy_bytes_per_s = None
    if device.type == "cuda" and not args.skip_main and args.dims:
        copy_bytes_per_s = copy_bandwidth(device, 1 << 30, repeat=args.repeat)
        print(f"device-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s")
    results: list[dict] = []
    for dim in [] if args.skip_main else args.dims:
        results.extend(bench_dim(args, dim, fbgemm, device, copy_bytes_per_s))
    if args.skew_lookups > 0:
        results.extend(run_skew(args, device))
    return {"results": results, "copy_bytes_per_s": copy_bytes_per_s}


def parts_of(args) -> list[argparse.Namespace]:
    """The run split into one part per dim and one for the skew case (each its own process)."""
    parts = [argparse.Namespace(**{**vars(args), "dims": [dim], "skew_lookups": 0, "skip_main": False})
             for dim in ([] if args.skip_main else args.dims)]
    if args.skew_lookups > 0:
        parts.append(argparse.Namespace(**{**vars(args), "dims": [], "skip_main": True}))
    return parts


def run_in_child(part: argparse.Namespace) -> dict:
    """run_here for one part in a fresh Python process (its arguments passed as JSON)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "part.json")
        spec = json.dumps({**vars(part), "part_out": out, "busy_core": False})
        subprocess.run([sys.executable, os.path.abspath(__file__), "--part", spec], check=True)
        with open(out) as f:
            return json.load(f)


def run(args) -> None:
    device = torch.device(args.device)
    fbgemm, fbgemm_missing = load_fbgemm()
    if args.part_out:  # a child of run_in_child: its rows go back to the parent, not to results/
        with open(args.part_out, "w") as out:
            json.dump(run_here(args, device, fbgemm), out)
        return
    if fbgemm is None:
        print(f"FBGEMM not importable ({fbgemm_missing}); comparing with nn.EmbeddingBag only")
    else:
        import fbgemm_gpu

        print(f"FBGEMM {getattr(fbgemm_gpu, '__version__', '?')} found: comparing with its table-batched embedding")

    # On the CPU each dim (and the skew case) runs in a process of its own: otherwise a cell's
    # ratios depend on the cells run before it (fresh pages against memory the allocator kept).
    parts = parts_of(args)
    isolate = device.type == "cpu" and not args.one_process and len(parts) > 1
    with busy_core(args.busy_core):
        outcomes = [run_in_child(part) for part in parts] if isolate else [run_here(args, device, fbgemm)]
    results = [row for outcome in outcomes for row in outcome["results"]]

    extra = {"fbgemm": None if fbgemm is None else "fbgemm_gpu", "fbgemm_missing": fbgemm_missing,
             "threads": args.threads, "modes": args.modes, "busy_core": args.busy_core, "rounds": args.rounds,
             "repeat": args.repeat, "processes": "one per dim and one for the skew case" if isolate else "one"}
    copy_bytes_per_s = next((o["copy_bytes_per_s"] for o in outcomes if o["copy_bytes_per_s"] is not None), None)
    if copy_bytes_per_s is not None:
        extra["copy_bytes_per_s"] = copy_bytes_per_s
    print("wrote", write_results("embedding_busy" if args.busy_core else "embedding", device, results, extra))


def run_skew(args, device: torch.device) -> list[dict]:
    """Backward time of one hot row (rows = zeros) against all-distinct rows (rows = arange)."""
    n, dim = args.skew_lookups, args.skew_dim
    table = torch.randn(n, dim, device=device)
    offsets = torch.cat([torch.arange(0, n, args.pooling), torch.tensor([n])]).to(device)
    bags = offsets.shape[0] - 1
    grad_out = torch.randn(bags, dim, device=device)
    cases = {"zeros": torch.zeros(n, dtype=torch.int64, device=device),
             "arange": torch.arange(n, dtype=torch.int64, device=device)}
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        steps = {}
        for name, rows in cases.items():
            weight = table.clone().requires_grad_()
            pooled = ops.embedding_bag(weight, rows, offsets)

            def backward(weight=weight, pooled=pooled):
                return torch.autograd.grad(pooled, weight, grad_out, retain_graph=True)

            steps[name] = backward
        times = time_rounds(steps, device, rounds=args.rounds, repeat=args.repeat, clock=clock_for(device))
        stats = ratio_stats(times["zeros"], times["arange"])
        ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        results.append({"phase": "backward_skew", "lookups": n, "dim": dim, "pooling": args.pooling,
                        "threads": threads, "ms": ms, "zeros_over_arange": stats["median"], "ratio": stats,
                        "seconds_per_round": times})
        print(f"skew D={dim} lookups={n} threads={threads:<3} backward  zeros {ms['zeros']:7.2f} ms  "
              f"arange {ms['arange']:7.2f} ms  | zeros/arange {fmt_ratio(stats)}")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dims", type=lambda s: [int(d) for d in s.split(",")], default=None,
                        help="comma-separated embedding dims (default 64; on CUDA 64,128)")
    parser.add_argument("--bags", type=int, default=16384)
    parser.add_argument("--pooling", type=int, default=20, help="rows per bag")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=None,
                        help="comma-separated CPU thread counts (default on CPU: 1 and torch's default)")
    parser.add_argument("--skew-lookups", type=int, default=1 << 20,
                        help="lookups of the zeros-vs-arange backward case (0 skips it)")
    parser.add_argument("--skew-dim", type=int, default=128)
    parser.add_argument("--skip-main", action="store_true", help="run only the skew case")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["sum"],
                        help="comma-separated pooling modes: sum (forward and backward), weighted, max (forward)")
    parser.add_argument("--prefetch-plans", action="store_true",
                        help="also time the CPU forward with each prefetch plan forced (sparsekit[every], "
                             "sparsekit[first]) beside sparsekit's own choice")
    parser.add_argument("--one-process", action="store_true",
                        help="on the CPU, run every dim in this process (default: each dim, and the skew case, "
                             "in a process of its own)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: a child's arguments, as JSON
    add_round_args(parser)
    args = parser.parse_args(argv)
    if args.part is not None:
        return argparse.Namespace(**json.loads(args.part))
    args.part_out = None
    if args.threads is None:
        default = torch.get_num_threads()
        args.threads = [1, default] if args.device == "cpu" and default > 1 else [default]
    if args.dims is None:
        args.dims = [64, 128] if args.device.startswith("cuda") else [64]
    return args


def main() -> None:
    run(parse_args())


if __name__ == "__main__":
    main()

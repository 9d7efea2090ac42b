"""Where one embedding_bag forward + backward step spends its time: torch.profiler tables
of sparsekit's step and nn.EmbeddingBag's, side by side (1M x 64 table, 16384 bags of 20,
uniform rows: the bench_embedding case). Prints each side's wall time per step and the time
until the host returns (a step that returns as late as it ends is bound by the host), the
top operators by self CPU time and, on CUDA, by CUDA time, and the kernel launches and host
syncs per step.

    python benchmarks/profile_step.py [--device cuda] [--dim 64] [--steps 20]
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_embedding import training_steps  # noqa: E402
from sparsekit import ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--bags", type=int, default=16384)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    nnz = args.bags * args.pooling
    table = torch.randn(args.rows, args.dim, device=device)
    rows = torch.randint(0, args.rows, (nnz,), device=device)
    offsets = torch.arange(0, nnz + 1, args.pooling, device=device)
    grad_out = torch.randn(args.bags, args.dim, device=device)
    weight = table.detach().requires_grad_()
    reference = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True, include_last_offset=True,
                                      _weight=table, device=device)

    sparsekit_step, torch_step = training_steps(weight, reference, rows, offsets, grad_out)

    def sparsekit_forward():
        ops.embedding_bag(table, rows, offsets)

    def sparsekit_backward_only():
        weight.grad = None
        pooled = ops.embedding_bag(weight, rows, offsets)
        synchronize()
        start = time.perf_counter()
        pooled.backward(grad_out)
        synchronize()
        return time.perf_counter() - start

    for name, step in (("sparsekit", sparsekit_step), ("torch", torch_step), ("sparsekit fwd", sparsekit_forward)):
        for _ in range(5):
            step()
        synchronize()
        walls, hosts = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - start)
            synchronize()
            walls.append(time.perf_counter() - start)
        walls.sort(), hosts.sort()
        print(f"{name:14s} wall median {walls[len(walls) // 2] * 1e3:.3f} ms  host (to return) median "
              f"{hosts[len(hosts) // 2] * 1e3:.3f} ms")
    backs = sorted(sparsekit_backward_only() for _ in range(args.steps))
    print(f"sparsekit backward only (synchronised) median {backs[len(backs) // 2] * 1e3:.3f} ms")

    for name, step in (("sparsekit", sparsekit_step), ("torch", torch_step)):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=False) as prof:
            for _ in range(args.steps):
                step()
            synchronize()
        averages = prof.key_averages()
        print(f"\n===== {name}: {args.steps} steps, by self CPU time =====")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        if cuda:
            print(f"===== {name}: by self CUDA time =====")
            print(averages.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
        if not cuda:
            continue
        launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                               "cudaLaunchKernelExC", "cuLaunchKernelEx"))
        syncs = sum(e.count for e in averages if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
        print(f"{name}: kernel launches per step {launches / args.steps:.1f}, "
              f"synchronising calls / memcpys per step {syncs / args.steps:.1f}")


if __name__ == "__main__":
    main()

"""The harness's DLRM training step, compiled vs eager (one process).

    python benchmarks/bench_compile.py [--device cpu|cuda] [--batch 1024] [--steps 16]
                                       [--backend inductor] [--rounds 7] [--repeat 3] [--busy-core]

The model `python -m sparsekit.train` builds (the default synthetic data, 26 slots, dim
16), in its two sparsekit embedding modes: one shared hash table (`DistributedEmbedding`)
and one table per slot (`EmbeddingBagCollection`). A step is forward, BCE loss, backward
and `LazyAdam.step`; the compiled side runs forward and loss through
`torch.compile(fullgraph=True)` (the backward through AOT autograd; the optimizer step
stays eager, as torch's sparse optimizers do). Each side trains its own copy of the model
on the same batches; a call is `--steps` steps. Ratios are eager time / compiled time per
interleaved round (> 1: compiling pays), given as median (min-max), beside the first
compiled call's seconds (tracing and code generation). The first call's losses of the two
sides must agree before either is timed. Writes benchmarks/results/compile_<device>.json
(compile_busy_<device>.json with --busy-core).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_round_args,
    busy_core,
    fmt_ratio,
    ratio_stats,
    synchronize,
    time_rounds,
    write_results,
)
from sparsekit.train.loop import TrainConfig, build, make_data, setup  # noqa: E402


def training(config: TrainConfig, context, batches: List, steps: int, compile_backend: str | None) -> Callable:
    """A call trains `steps` steps of a fresh harness model (cycling over `batches`)."""
    model, _, optimizer = build(config, context)
    loss_fn = nn.BCEWithLogitsLoss()

    def step_loss(dense, keys, labels):
        return loss_fn(model(dense, keys), labels)

    forward = torch.compile(step_loss, backend=compile_backend, fullgraph=True) if compile_backend else step_loss
    position = [0]
    first_losses: list[float] = []  # the first call's, to check the sides against each other

    def call() -> None:
        record = not first_losses
        for _ in range(steps):
            b = batches[position[0] % len(batches)]
            position[0] += 1
            loss = forward(b.dense, b.keys, b.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if record:
                first_losses.append(float(loss))
    call.first_losses = first_losses
    return call


def bench(args, device: torch.device, tables: str) -> Dict:
    config = TrainConfig(tables=tables, batch_size=args.batch, device=device.type, progress=False)
    config.validate()
    context = setup(device.type)
    data = make_data(config)
    # Both sides train on the same 64 batches, made once.
    batches = [data.train_batch(s, args.batch, 0, 1).to(device) for s in range(64)]
    eager = training(config, context, batches, args.steps, None)
    compiled = training(config, context, batches, args.steps, args.backend)
    synchronize(device)
    start = time.perf_counter()
    compiled()  # the first call compiles
    synchronize(device)
    first_call_s = time.perf_counter() - start
    # Both models start from the same seed and train on the same batches: the first call's
    # losses must agree before either side is timed (the eager side's call is untimed too,
    # so both sides then start the timed rounds at the same batch).
    eager()
    if not np.allclose(compiled.first_losses, eager.first_losses, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"{tables}: compiled losses {compiled.first_losses} differ from eager "
                           f"{eager.first_losses}: not timing a wrong answer")
    times = time_rounds({"eager": eager, "compiled": compiled}, device, rounds=args.rounds, repeat=args.repeat)
    speedup = ratio_stats(times["eager"], times["compiled"])
    samples = args.steps * args.batch
    row = {"tables": tables, "batch": args.batch, "steps_per_call": args.steps, "backend": args.backend,
           "seconds_per_round": times, "first_compiled_call_s": first_call_s,
           "eager_samples_per_s": samples / float(np.median(times["eager"])),
           "compiled_samples_per_s": samples / float(np.median(times["compiled"])),
           "compiled_speedup": speedup}
    print(f"{tables:8} | eager {row['eager_samples_per_s']:>10,.0f} samples/s | compiled "
          f"{row['compiled_samples_per_s']:>10,.0f} samples/s | compiled / eager speed {fmt_ratio(speedup)} | "
          f"first compiled call {first_call_s:.1f} s")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16, help="training steps per timed call")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    add_round_args(parser, rounds=7, repeat=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows: List[Dict] = []
    with busy_core(args.busy_core):
        for tables in ("shared", "per-slot"):
            rows.append(bench(args, device, tables))
    path = write_results("compile_busy" if args.busy_core else "compile", device, rows,
                         {"busy_core": args.busy_core, "rounds": args.rounds, "repeat": args.repeat})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

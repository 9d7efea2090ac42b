"""Training throughput of the harness: --embedding sparsekit vs --embedding torch.

    python benchmarks/bench_train.py [--device cpu|cuda] [--batch-size N] [--steps N]

The DLRM model of ``python -m sparsekit.train`` on the same synthetic Criteo-shaped batches,
one process: ``sk.DistributedEmbedding`` + ``sk.LazyAdam`` against ``nn.EmbeddingBag(sparse=True)``
over ``key mod table_rows`` + ``SparseAdam``. A timed block is ``--steps`` training steps on
pre-generated batches (new keys keep arriving); a *harness* block generates each batch
before its step, as the harness does. Back ends alternate in rounds; ratios are torch time /
sparsekit time, median (min-max). A profile then splits a step into its stages. Without
--device: the CPU, then the GPU when there is one. Writes benchmarks/results/train_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import busy_core, fmt_ratio, ratio_stats, synchronize, write_results  # noqa: E402
from sparsekit.train.data import SyntheticCriteo  # noqa: E402
from sparsekit.train.loop import Context, TrainConfig, build  # noqa: E402

EMBEDDINGS = ("sparsekit", "torch")


class Runner:
    """One back end's model and optimizer, stepping through a list of batches."""

    def __init__(self, embedding: str, config: TrainConfig, device: torch.device, batches, source):
        config = TrainConfig(**{**config.__dict__, "embedding": embedding})
        _, self.model, self.optimizer = build(config, Context(0, 1, device))
        self.batches, self.source = batches, source
        self.batch_size, self.device = config.batch_size, device
        self.position = 0
        self.loss_fn = nn.BCEWithLogitsLoss()

    def run(self, steps: int, generate: bool = False) -> None:
        """``steps`` training steps on the next batches: pre-generated ones, or (``generate``)
        each made from the harness's data source right before its step."""
        for _ in range(steps):
            if generate:
                batch = self.source.train_batch(self.position, self.batch_size).to(self.device)
            else:
                batch = self.batches[self.position]
            self.position += 1
            loss = self.loss_fn(self.model(batch.dense, batch.keys), batch.labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()

    def profile(self, steps: int, device: torch.device) -> dict:
        """Mean seconds per step of each phase over the next `steps` batches."""
        phases = {"embedding_forward": 0.0, "rest_of_forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        marks = {}

        def before(*_):
            synchronize(device)
            marks["embedding"] = time.perf_counter()

        def after(*_):
            synchronize(device)
            phases["embedding_forward"] += time.perf_counter() - marks["embedding"]

        embedding = self.model.embedding
        hooks = [embedding.register_forward_pre_hook(before), embedding.register_forward_hook(after)]
        try:
            for _ in range(steps):
                batch = self.batches[self.position]
                self.position += 1
                synchronize(device)
                start = time.perf_counter()
                loss = self.loss_fn(self.model(batch.dense, batch.keys), batch.labels)
                synchronize(device)
                forward_end = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                synchronize(device)
                backward_end = time.perf_counter()
                self.optimizer.step()
                synchronize(device)
                phases["rest_of_forward"] += forward_end - start
                phases["backward"] += backward_end - forward_end
                phases["optimizer"] += time.perf_counter() - backward_end
        finally:
            for hook in hooks:
                hook.remove()
        phases["rest_of_forward"] -= phases["embedding_forward"]
        return {name: seconds / steps for name, seconds in phases.items()}


def bench(device: torch.device, args) -> dict:
    config = TrainConfig(batch_size=args.batch_size, embedding_dim=args.embedding_dim,
                         table_rows=args.table_rows, vocab_per_slot=args.vocab_per_slot,
                         device=device.type)
    source = SyntheticCriteo(0, vocab_per_slot=args.vocab_per_slot)
    total_steps = args.warmup + 2 * args.rounds * args.steps + args.profile_steps
    start = time.perf_counter()
    batches = [source.train_batch(step, args.batch_size).to(device) for step in range(total_steps)]
    data_seconds = (time.perf_counter() - start) / total_steps
    runners = {name: Runner(name, config, device, batches, source) for name in EMBEDDINGS}
    for runner in runners.values():  # warm-up: allocator, first inserts, lazy init
        runner.run(args.warmup)
    synchronize(device)
    seconds = {name: [] for name in EMBEDDINGS}
    harness_seconds = {name: [] for name in EMBEDDINGS}
    for _ in range(args.rounds):
        for timed, generate in ((seconds, False), (harness_seconds, True)):
            for name, runner in runners.items():
                synchronize(device)
                start = time.perf_counter()
                runner.run(args.steps, generate)
                synchronize(device)
                timed[name].append(time.perf_counter() - start)
    samples = args.steps * args.batch_size
    rate = {name: samples / statistics.median(times) for name, times in seconds.items()}
    harness_rate = {name: samples / statistics.median(times) for name, times in harness_seconds.items()}
    stats = ratio_stats(seconds["torch"], seconds["sparsekit"])
    harness_stats = ratio_stats(harness_seconds["torch"], harness_seconds["sparsekit"])
    print(f"[{device.type}] batch {args.batch_size}, dim {args.embedding_dim}, {args.steps} steps x "
          f"{args.rounds} rounds: sparsekit {rate['sparsekit']:,.0f} samples/s | torch "
          f"{rate['torch']:,.0f} samples/s | sparsekit / torch = {fmt_ratio(stats)}")
    print(f"  with each batch generated before its step, as the harness does: sparsekit "
          f"{harness_rate['sparsekit']:,.0f} samples/s | torch {harness_rate['torch']:,.0f} samples/s | "
          f"sparsekit / torch = {fmt_ratio(harness_stats)}")
    profile = {name: runner.profile(args.profile_steps, device) for name, runner in runners.items()}
    for name, phases in profile.items():
        print(f"  {name:9} ms per step: " + ", ".join(f"{phase} {t * 1e3:.2f}" for phase, t in phases.items())
              + f" | synthetic data {data_seconds * 1e3:.2f} (not timed above)")
    return {
        "batch_size": args.batch_size,
        "embedding_dim": args.embedding_dim,
        "table_rows": args.table_rows,
        "vocab_per_slot": args.vocab_per_slot,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "sparsekit_samples_per_s": rate["sparsekit"],
        "torch_samples_per_s": rate["torch"],
        "speedup_vs_torch": stats["median"],
        "ratio": stats,
        "seconds_per_round": seconds,
        "harness_sparsekit_samples_per_s": harness_rate["sparsekit"],
        "harness_torch_samples_per_s": harness_rate["torch"],
        "harness_speedup_vs_torch": harness_stats["median"],
        "harness_ratio": harness_stats,
        "harness_seconds_per_round": harness_seconds,
        "profile_seconds_per_step": profile,
        "synthetic_data_seconds_per_batch": data_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cpu, then cuda when available")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--table-rows", type=int, default=1 << 20)
    parser.add_argument("--vocab-per-slot", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile-steps", type=int, default=20, help="steps per back end in the phase profile")
    parser.add_argument("--busy-core", action="store_true", help="a spinning process on one core throughout")
    args = parser.parse_args()
    if args.device:
        devices = [torch.device(args.device)]
    else:
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        with busy_core(args.busy_core):
            row = bench(device, args)
        print("wrote", write_results("train_busy" if args.busy_core else "train", device, [row],
                                     extra={"busy_core": args.busy_core}))


if __name__ == "__main__":
    main()

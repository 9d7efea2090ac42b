"""What one training step of a collection costs the host: ops dispatched, host syncs and
device kernels per stage (forward, backward, optimizer), at 2 and 26 tables, unfused
(sparse gradients + sk.LazyAdam) and fused (the optimizer in the backward); and whether a
CUDA graph can capture the fused step and replay it as eager runs it.

    python benchmarks/step_proof.py [--device cpu|cuda] [--batch 4096] [--ids 1] [--dim 16]

Host syncs are counted with torch.cuda.set_sync_debug_mode("warn") (one warning per sync
torch sees; a sparsekit op's own device-to-host copies go through torch, so they count);
kernels with the profiler. On the CPU the syncs and kernels columns are empty. Writes
benchmarks/results/step_<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import collections
import os
import sys
import warnings
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsekit as sk  # noqa: E402
from benchmarks.common import write_results  # noqa: E402


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def measure(setup, stage, after, device: torch.device) -> Dict:
    """Ops, syncs and kernels of one call of stage(), each call between setup() and after()."""
    def once(run):
        setup()
        run()
        after()

    out: Dict = {}
    ops = Ops()
    once(lambda: _within(ops, stage))
    out["ops"] = sum(ops.count.values())
    out["op_names"] = dict(ops.count)
    if device.type != "cuda":
        return out
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def synced():
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stage()
            finally:
                torch.cuda.set_sync_debug_mode(0)

        once(synced)
    out["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once(stage)
        torch.cuda.synchronize()
    out["kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


def _within(mode: TorchDispatchMode, stage) -> None:
    with mode:
        stage()


def build(tables: int, fused: bool, device, dim: int):
    names = [f"f{i}" for i in range(tables)]
    ebc = sk.EmbeddingBagCollection([sk.TableConfig(f"t{i}", dim, 100_000, [names[i]], use_hashtable=False)
                                     for i in range(tables)], device=device,
                                    fused_params={"optimizer": "lazy_adam", "lr": 1e-3} if fused else None,
                                    output="keyed", error_mode="late")
    return names, ebc, None if fused else sk.LazyAdam(ebc.parameters(), lr=1e-3)


def proof(tables: int, fused: bool, args, device) -> Dict:
    names, ebc, opt = build(tables, fused, device, args.dim)
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((tables * args.batch,), args.ids, dtype=torch.int64)
    values = torch.randint(0, 100_000, (int(lengths.sum()),), generator=g)
    kjt = sk.KeyedJagged(names, values.to(device), lengths=lengths.to(device))
    state: Dict = {}

    def forward():
        state["loss"] = ebc(kjt).values().square().sum()  # the keyed output: one [B, sum D] block

    def backward():
        state["loss"].backward()

    def optimizer():
        if opt is not None:
            opt.step()
            opt.zero_grad()

    for _ in range(3):  # warm: every key has its row, the state exists
        forward(); backward(); optimizer()  # noqa: E702
    row = {"tables": tables, "fused": fused}
    nothing = lambda: None  # noqa: E731
    row["forward"] = measure(nothing, forward, lambda: (backward(), optimizer()), device)
    row["backward"] = measure(forward, backward, optimizer, device)
    row["optimizer"] = measure(lambda: (forward(), backward()), optimizer, nothing, device)
    if device.type == "cuda" and fused:
        row["graph"] = capture(ebc, kjt)
    return row


def capture(ebc, kjt, replays: int = 3) -> Dict:
    """A CUDA graph of the fused step (forward + backward; error_mode="late": nothing read
    back), replayed ``replays`` times against the same steps run eagerly on a copy from the
    same state: tables and optimizer state must match bit for bit."""
    def step(model):
        model(kjt).values().square().sum().backward()

    try:
        eager = copy.deepcopy(ebc)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up steps, the same on both
                step(ebc)
                step(eager)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(ebc)
        for _ in range(replays):
            graph.replay()
            step(eager)
        torch.cuda.synchronize()
        ebc.check_errors()
        state = lambda model: list(model.state_dict().values()) + [  # noqa: E731
            t for s in model.fused_optimizer.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
        equal = all(torch.equal(a, b) for a, b in zip(state(ebc), state(eager)))
        return {"captured": True, "replays": replays, "equal_to_eager": equal}
    except Exception as error:  # noqa: BLE001 - the result is the reason
        return {"captured": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--ids", type=int, default=1, help="ids per bag")
    parser.add_argument("--dim", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for fused in (False, True):
        for tables in (2, 26):
            row = proof(tables, fused, args, device)
            rows.append(row)
            cells = " | ".join(f"{stage}: {row[stage]['ops']} ops"
                               + (f", {row[stage]['syncs']} syncs, {row[stage]['kernels']} kernels"
                                  if "syncs" in row[stage] else "") for stage in ("forward", "backward", "optimizer"))
            print(f"{'fused' if fused else 'unfused':<8} {tables:>2} tables: {cells}"
                  + (f" | graph {row['graph']}" if "graph" in row else ""), flush=True)
    path = write_results("step", device, rows, extra={"batch": args.batch, "ids_per_bag": args.ids, "dim": args.dim})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""HashTable inserts that evict (eviction="lru" / "lfu") vs plain inserts, side by side.

    python -m benchmarks.bench_dynamic [--device cpu|cuda] [--capacity N] [--batch B]
                                       [--loads 0.5,0.75,1.0] [--repeat R] [--quick] [--out PATH]
                                       [--busy-core]

Goal (the dynamic-tables issue): an insert that evicts costs at most 2x a plain insert at
64k new keys per call. Each call inserts ``--batch`` never-seen keys into a table holding
``load * capacity`` keys: the plain table has room, the evicting one is full and evicts one
key per new key; both share one slot layout. Each repeat starts every side from a fresh
copy (untimed), sides interleaved; ``plan``, ``commit``, ``select`` and ``erase`` are timed
apart, and ``stream`` amortises one whole tombstone cycle. Ratios are evicting / plain per
repeat. Writes benchmarks/results/dynamic_<device>.json (``_busy`` with --busy-core).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, TypeVar

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import busy_core, ratio_stats, synchronize, write_results
from sparsekit import ops
from sparsekit.hashtable import HashTable

POLICIES = ("lru", "lfu")
SCORE_HISTORY = 1000  # clocks the pre-filled keys' last_seen is spread over
COUNT_ZIPF_ALPHA = 1.3
# The tensors that make up a HashTable's state (as HashTable.to moves them).
TABLE_TENSORS = ("_slot_keys", "_slot_rows", "_row_keys", "_last_seen", "_count")
SPREAD = np.uint64(0x9E3779B97F4A7C15)

T = TypeVar("T")


class KeySource:
    """Distinct int64 keys, never the same twice: counter ids times an odd constant mod 2^64."""

    def __init__(self, seed: int) -> None:
        self.next_id = 0
        self.rng = np.random.default_rng(seed)

    def take(self, n: int) -> torch.Tensor:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.uint64)
        self.next_id += n
        keys = (self.rng.permutation(ids) * SPREAD).view(np.int64)
        return torch.from_numpy(keys.copy())


def timed(device: torch.device, fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """fn(*args) once, and its wall time in seconds with the device synchronised around it."""
    synchronize(device)
    start = time.perf_counter()
    out = fn(*args)
    synchronize(device)
    return out, time.perf_counter() - start


def slot_count(capacity: int) -> int:
    """Slots a HashTable(capacity) allocates."""
    return HashTable(capacity, device="meta").num_slots


def prefilled(keys: torch.Tensor, last_seen: torch.Tensor, count: torch.Tensor, clock: int, rows: int,
              slots: int, device: torch.device) -> HashTable:
    """A table with ``rows`` rows over ``slots`` slots holding ``keys`` with these scores."""
    table = HashTable(rows, device=device)
    if table.num_slots != slots:  # keep the slot array of a HashTable(capacity) while adding rows
        table._slot_keys = torch.zeros(slots, dtype=torch.int64, device=device)
        table._slot_rows = torch.full((slots,), -1, dtype=torch.int64, device=device)
    table.load_state_dict({"keys": keys.to(device), "last_seen": last_seen, "count": count,
                           "clock": torch.tensor(clock, dtype=torch.int64)})
    return table


def working_copy(template: HashTable, eviction: str | None, capacity: int) -> HashTable:
    """A copy of ``template``'s state with this policy and capacity limit (same slots, same rows)."""
    table = HashTable.__new__(HashTable)
    table.__dict__.update(template.__dict__)
    for name in TABLE_TENSORS:
        setattr(table, name, getattr(template, name).clone())
    table._eviction = eviction
    table._capacity = capacity
    return table


def victim_columns(table: HashTable, policy: str) -> list[torch.Tensor]:
    """The score columns HashTable._plan_insert hands to ops.select_smallest."""
    size = len(table)
    if policy == "lru":
        return [table._last_seen[:size], table._row_keys[:size]]
    return [table._count[:size], table._last_seen[:size], table._row_keys[:size]]


def count_rebuilds(table: HashTable) -> Callable[[], int]:
    """Counts the table's tombstone rebuilds from now on; returns the counter."""
    rebuild, calls = table._rebuild, [0]

    def counted() -> None:
        calls[0] += 1
        rebuild()

    table._rebuild = counted
    return lambda: calls[0]


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def make_batch(fresh: torch.Tensor, seen: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    batch = torch.cat([fresh, seen])
    return batch[torch.randperm(batch.numel(), generator=gen)]


def bench_load(load: float, args: argparse.Namespace, device: torch.device) -> list[dict]:
    capacity, batch = args.capacity, args.batch
    num_resident = round(load * capacity)
    num_seen = round(batch * args.seen_fraction)
    num_new = batch - num_seen
    if batch > num_resident:
        print(f"load {load:.2f}: skipped, a call of {batch} keys does not fit a table full at {num_resident} keys")
        return []
    slots = slot_count(capacity)
    rows = max(capacity, num_resident + num_new)
    calls_per_cycle = slots // (4 * num_new) + 1 if num_new > 0 else 1

    source = KeySource(seed=0)
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(2)
    resident = source.take(num_resident)
    last_seen = torch.from_numpy(rng.integers(0, SCORE_HISTORY, num_resident, dtype=np.int64))
    count = torch.from_numpy(np.minimum(rng.zipf(COUNT_ZIPF_ALPHA, num_resident), 1 << 20).astype(np.int64))
    template = prefilled(resident, last_seen, count, SCORE_HISTORY, rows, slots, device)
    assert template.num_slots == slots and len(template) == num_resident

    sides: list[tuple[str, str | None, int]] = [("plain", None, rows)] + [(p, p, num_resident) for p in POLICIES]
    samples: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in sides}
    for repeat in range(args.repeat + 1):  # repeat 0 warms up and is dropped
        seen = resident[torch.randperm(num_resident, generator=gen)[:num_seen]]
        keys_cpu = make_batch(source.take(num_new), seen, gen)
        keys = keys_cpu.to(device)
        order = sides[repeat % len(sides):] + sides[:repeat % len(sides)]
        for name, eviction, limit in order:
            table = working_copy(template, eviction, limit)
            table.tick()
            plan, plan_s = timed(device, table._plan_insert, keys)
            _, commit_s = timed(device, table._commit_insert, plan)
            expected_evictions = num_new if eviction else 0
            assert plan.victims.numel() == expected_evictions and len(table) == min(limit, num_resident + num_new)
            sample = {"plan_s": plan_s, "commit_s": commit_s, "call_s": plan_s + commit_s}
            if eviction:
                # The same selection and erase alone, on the pre-call state.
                eligible = torch.ones(num_resident, dtype=torch.bool, device=device)
                eligible[template.find(keys[template.find(keys) >= 0])] = False
                columns = victim_columns(template, eviction)
                victims, select_s = timed(device, ops.select_smallest, columns, eligible, num_new)
                assert torch.equal(victims, plan.victims)
                slot_keys, slot_rows = template._slot_keys.clone(), template._slot_rows.clone()
                victim_keys = template._row_keys[victims]
                _, erase_s = timed(device, ops.hash_table_erase_, slot_keys, slot_rows, victim_keys)
                sample.update(select_s=select_s, erase_s=erase_s, find_s=plan_s - select_s,
                              evict_s=select_s + erase_s, insert_s=commit_s - erase_s)
                # The rest of one tombstone cycle: fresh batches, seen keys from the previous call.
                stream_s = plan_s + commit_s
                rebuilt_at_first_call = table._tombstones == 0
                rebuilds = count_rebuilds(table)
                previous = keys_cpu
                for _ in range(calls_per_cycle - 1):
                    more = make_batch(source.take(num_new), previous[:num_seen], gen)
                    more_on_device = more.to(device)
                    table.tick()
                    _, call_s = timed(device, table.insert, more_on_device)
                    stream_s += call_s
                    previous = more
                sample["stream_call_s"] = stream_s / calls_per_cycle
                sample["stream_rebuilds"] = float(rebuilt_at_first_call + rebuilds())
            if repeat > 0:
                for key, value in sample.items():
                    samples[name].setdefault(key, []).append(value)

    plain = samples["plain"]
    out = []
    for policy in POLICIES:
        evict = samples[policy]
        row = {
            "load": load,
            "policy": policy,
            "capacity": capacity,
            "resident_keys": num_resident,
            "evicting_table_limit": num_resident,
            "plain_table_rows": rows,
            "slots": slots,
            "slot_occupancy_before_call": num_resident / slots,
            "keys_per_call": batch,
            "new_keys_per_call": num_new,
            "evictions_per_call": num_new,
            "repeats": args.repeat,
            "plain_call_s": spread(plain["call_s"]),
            "plain_plan_s": spread(plain["plan_s"]),
            "plain_commit_s": spread(plain["commit_s"]),
            "plain_keys_per_s": batch / statistics.median(plain["call_s"]),
            "evict_call_s": spread(evict["call_s"]),
            "evict_keys_per_s": batch / statistics.median(evict["call_s"]),
            "ratio_evict_vs_plain": ratio_stats(evict["call_s"], plain["call_s"]),
            "stream_calls_per_cycle": calls_per_cycle,
            "stream_rebuilds_per_cycle": statistics.median(evict["stream_rebuilds"]),
            "stream_call_s": spread(evict["stream_call_s"]),
            "stream_keys_per_s": batch / statistics.median(evict["stream_call_s"]),
            "ratio_stream_vs_plain": ratio_stats(evict["stream_call_s"], plain["call_s"]),
        }
        for phase in ("plan", "commit", "select", "erase", "find", "evict", "insert"):
            row[f"evict_{phase}_s"] = spread(evict[f"{phase}_s"])
        out.append(row)
    return out


def print_rows(rows: list[dict]) -> None:
    ms = 1e3
    print(f"{'load':>5} {'policy':<6} {'resident':>9} {'occ':>5} | {'plain ms':>8} {'evict ms':>8} "
          f"{'ratio med [min, max]':>22} | {'stream ratio med':>16} | {'evict Mkeys/s':>13} | "
          f"{'find':>6} {'select':>6} {'erase':>6} {'insert':>6} (ms)")
    for r in rows:
        ratio, stream = r["ratio_evict_vs_plain"], r["ratio_stream_vs_plain"]
        print(f"{r['load']:5.2f} {r['policy']:<6} {r['resident_keys']:9d} {r['slot_occupancy_before_call']:5.3f} | "
              f"{r['plain_call_s']['median'] * ms:8.2f} {r['evict_call_s']['median'] * ms:8.2f} "
              f"{ratio['median']:6.2f}x [{ratio['min']:5.2f}, {ratio['max']:5.2f}] | "
              f"{stream['median']:15.2f}x | {r['evict_keys_per_s'] / 1e6:13.2f} | "
              f"{r['evict_find_s']['median'] * ms:6.2f} {r['evict_select_s']['median'] * ms:6.2f} "
              f"{r['evict_erase_s']['median'] * ms:6.2f} {r['evict_insert_s']['median'] * ms:6.2f}")


def save(rows: list[dict], device: torch.device, extra: dict, out: str | None) -> str:
    name = "dynamic_busy" if extra["busy_core"] else "dynamic"
    if out is None:
        return write_results(name, device, rows, extra)
    default_dir = common.RESULTS_DIR
    with tempfile.TemporaryDirectory() as tmp:
        common.RESULTS_DIR = tmp
        try:
            shutil.move(write_results(name, device, rows, extra), out)
        finally:
            common.RESULTS_DIR = default_dir
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--capacity", type=int, default=None,
                        help="default 2^20 on CPU, 2^24 on CUDA; 2^16 with --quick")
    parser.add_argument("--batch", type=int, default=None, help="keys per call (default 65536; 4096 with --quick)")
    parser.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.75, 1.0],
                        help="resident keys / capacity, comma-separated (default 0.5,0.75,1.0)")
    parser.add_argument("--seen-fraction", type=float, default=0.0,
                        help="fraction of each call's keys that are resident (default 0: every key new)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes for smoke runs (capacity 2^16, batch 4096)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch.set_num_threads); default torch's")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/dynamic_<device>.json)")
    parser.add_argument("--busy-core", action="store_true",
                        help="measure with a spinning process on one core (started by the benchmark)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0.0 <= args.seen_fraction < 1.0:
        parser.error("--seen-fraction must lie in [0, 1)")
    device = torch.device(args.device)
    if args.capacity is None:
        args.capacity = 1 << 16 if args.quick else (1 << 24 if device.type == "cuda" else 1 << 20)
    if args.batch is None:
        args.batch = 4096 if args.quick else 65536
    with busy_core(args.busy_core):
        rows = [row for load in args.loads for row in bench_load(load, args, device)]
    print_rows(rows)
    extra = {
        "phases": {
            "call": "plan + commit = HashTable.insert()",
            "plan": "HashTable._plan_insert: unique + find (+ eviction: select_smallest, gather victim keys)",
            "commit": "HashTable._commit_insert: (eviction: hash_table_erase_) + place new keys + row keys + scores",
            "select": "ops.select_smallest alone, same columns and state",
            "erase": "ops.hash_table_erase_ alone, same victims and slots",
            "find": "plan - select", "evict": "select + erase", "insert": "commit - erase",
            "stream_call": "mean call over one tombstone cycle (rebuild included) from the fresh state",
        },
        "load": "resident keys / capacity before the call; the lru / lfu tables are full at that many keys "
                "(their capacity limit), all sides over the slot array of a HashTable(capacity)",
        "ratio": "per repeat, evicting call (or stream_call) / the same repeat's plain call",
        "score_history_clocks": SCORE_HISTORY,
        "count_zipf_alpha": COUNT_ZIPF_ALPHA,
        "seen_fraction": args.seen_fraction,
        "busy_core": args.busy_core,
        "rounds": args.repeat,
    }
    print("wrote", save(rows, device, extra, args.out))


if __name__ == "__main__":
    main()

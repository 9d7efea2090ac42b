"""Dynamic HashTable (docs/api.md): scores, eviction, export since a clock, state.

The contract checked here:
- ``HashTable(capacity, *, key_dtype, device, eviction=None|"lru"|"lfu")``; any other
  eviction is a ValueError that names ``eviction``.
- ``clock`` starts at 0, ``tick()`` adds 1. ``insert`` and ``touch`` stamp a present key's
  ``last_seen`` with the clock and add its occurrences in the call to its ``count``; a new
  key starts with the clock / its occurrences. ``find`` never scores; ``touch`` never
  inserts. ``scores(keys) -> (last_seen, count)``, -1 for absent keys.
- With eviction an insert raises HashTableFullError only when the call holds more than
  ``capacity`` distinct keys; without it, when the new keys do not fit. Either way nothing
  changes (contents, rows, scores, clock).
- Victims: exactly as many as needed, never a key of the call, lowest (lru: last_seen;
  lfu: count, then last_seen), ties by the smaller key. New keys in order of first
  occurrence take the freed rows ascending, then ``n, n + 1, ...`` (n = size before the
  call). Rows in use are always ``0 .. len - 1``.

Thresholds crossed: select_smallest's CPU kernel cuts its entries into chunks of 2^14
(csrc/cpu), so the thread-count and select tests reach past 16384 entries (and one
100k-row table); the table rebuilds its slots once tombstones reach a quarter of them,
which the soak crosses many times.
"""

import random

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from _state import saved_and_loaded
from properties import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, examples, num_threads, sizes

import sparsekit as sk
from sparsekit.hashtable import HashTableFullError

POLICIES = [None, "lru", "lfu"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def t(values, dtype=torch.int64, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def exported(table):
    keys, rows = table.export()
    return keys.tolist(), rows.tolist()


def scores_of(table, keys, dtype=torch.int64):
    last_seen, count = table.scores(t(keys, dtype, table.device))
    assert last_seen.dtype == torch.int64 and count.dtype == torch.int64
    return list(zip(last_seen.tolist(), count.tolist()))


def evicting_insert(table, keys, dtype=torch.int64):
    """``insert(return_evicted=True)`` as plain lists: (rows, [(evicted key, row), ...])."""
    rows, evicted_keys, evicted_rows = table.insert(t(keys, dtype, table.device), return_evicted=True)
    assert evicted_keys.dtype == table.key_dtype and evicted_rows.dtype == torch.int64
    return rows.tolist(), list(zip(evicted_keys.tolist(), evicted_rows.tolist()))


def state_of(table, probe):
    """Everything a failed call must leave alone, as plain values."""
    keys, rows = table.export()
    last_seen, count = table.scores(probe)
    return (len(table), table.clock, keys.tolist(), rows.tolist(), table.find(probe).tolist(),
            last_seen.tolist(), count.tolist())


# ---- the reference ----


class ReferenceFull(Exception):
    pass


class Reference:
    """The contract in plain Python: per-row keys and scores, a key -> row dict."""

    def __init__(self, capacity, eviction):
        self.capacity, self.eviction = capacity, eviction
        self.keys, self.last_seen, self.count = [], [], []  # by row
        self.row = {}
        self.clock = 0

    def tick(self):
        self.clock += 1

    @staticmethod
    def occurrences(keys):
        occ = {}  # insertion order = order of first occurrence
        for key in keys:
            occ[key] = occ.get(key, 0) + 1
        return occ

    def victim_order(self, row):
        if self.eviction == "lru":
            return (self.last_seen[row], self.keys[row])
        return (self.count[row], self.last_seen[row], self.keys[row])

    def insert(self, keys):
        """Returns (rows, evicted pairs); raises ReferenceFull (having changed nothing)."""
        occ = self.occurrences(keys)
        new = [key for key in occ if key not in self.row]
        free = self.capacity - len(self.keys)
        if len(new) > free and (self.eviction is None or len(occ) > self.capacity):
            raise ReferenceFull
        num_evict = max(0, len(new) - free)
        victims = []
        if num_evict:
            candidates = [row for row, key in enumerate(self.keys) if key not in occ]
            victims = sorted(sorted(candidates, key=self.victim_order)[:num_evict])
        evicted = [(self.keys[row], row) for row in victims]
        for key, _ in evicted:
            del self.row[key]
        n = len(self.keys)
        targets = victims + list(range(n, n + len(new) - num_evict))
        for key, row in zip(new, targets):
            if row == len(self.keys):
                self.keys.append(None)
                self.last_seen.append(None)
                self.count.append(None)
            self.keys[row], self.last_seen[row], self.count[row] = key, self.clock, 0
            self.row[key] = row
        self.score(occ)
        return [self.row[key] for key in keys], evicted

    def score(self, occ):
        for key, times in occ.items():
            row = self.row.get(key)
            if row is not None:
                self.last_seen[row] = self.clock
                self.count[row] += times

    def touch(self, keys):
        self.score(self.occurrences(keys))
        return self.find(keys)

    def find(self, keys):
        return [self.row.get(key, -1) for key in keys]

    def scores(self, keys):
        return [(self.last_seen[self.row[k]], self.count[self.row[k]]) if k in self.row else (-1, -1) for k in keys]

    def export(self, min_last_seen=None):
        pairs = [(key, row) for row, key in enumerate(self.keys)
                 if min_last_seen is None or self.last_seen[row] >= min_last_seen]
        return [key for key, _ in pairs], [row for _, row in pairs]


# ---- streams: a list of ops, played on a table (and checked against the reference) ----


def play(table, ops, probe, reference=None, rng=None):
    """Plays ``ops`` (("tick",), ("insert"|"touch"|"find", CPU key tensor)) on ``table``.

    With a ``reference``, checks every result and the whole state after every op.
    Returns per-op records (plain values) for comparing devices and thread counts.
    """
    records = []
    probe_dev = probe.to(table.device)
    for op in ops:
        if op[0] == "tick":
            table.tick()
            if reference is not None:
                reference.tick()
            record = ("tick", table.clock)
        else:
            kind, keys = op
            listed = keys.reshape(-1).tolist()
            dev_keys = keys.to(table.device)
            if kind == "insert":
                expected = None
                if reference is not None:
                    try:
                        expected = reference.insert(listed)
                    except ReferenceFull:
                        expected = "full"
                if expected == "full":
                    before = state_of(table, probe_dev)
                    with pytest.raises(HashTableFullError):
                        table.insert(dev_keys, return_evicted=True)
                    assert state_of(table, probe_dev) == before, "a refused insert changed the table"
                    record = ("full",)
                else:
                    try:
                        rows, evicted_keys, evicted_rows = table.insert(dev_keys, return_evicted=True)
                    except HashTableFullError:
                        assert reference is None, f"insert of {listed} raised; the reference inserts it"
                        records.append(("full",) + snapshot(table, probe_dev))
                        continue
                    assert rows.shape == keys.shape and rows.dtype == torch.int64
                    assert evicted_keys.dtype == table.key_dtype and evicted_rows.dtype == torch.int64
                    record = ("insert", rows.reshape(-1).tolist(), evicted_keys.tolist(), evicted_rows.tolist())
                    if expected is not None:
                        assert record[1] == expected[0], f"rows of {listed}"
                        assert list(zip(record[2], record[3])) == expected[1], f"evicted by {listed}"
            else:
                rows = getattr(table, kind)(dev_keys)
                assert rows.shape == keys.shape and rows.dtype == torch.int64
                record = (kind, rows.reshape(-1).tolist())
                if reference is not None:
                    assert record[1] == getattr(reference, kind)(listed), f"{kind} of {listed}"
        if reference is not None:
            assert_matches_reference(table, reference, probe_dev, rng)
        records.append(record + snapshot(table, probe_dev))
    return records


def snapshot(table, probe):
    keys, rows = table.export()
    last_seen, count = table.scores(probe)
    return (len(table), table.clock, keys.tolist(), rows.tolist(), last_seen.tolist(), count.tolist())


def assert_matches_reference(table, reference, probe, rng):
    assert len(table) == len(reference.keys)
    assert table.clock == reference.clock
    keys, rows = table.export()
    assert keys.dtype == table.key_dtype and rows.dtype == torch.int64
    assert keys.tolist() == reference.keys
    assert rows.tolist() == list(range(len(reference.keys)))  # rows in use: exactly 0 .. len - 1
    listed = probe.tolist()
    last_seen, count = table.scores(probe)
    assert list(zip(last_seen.tolist(), count.tolist())) == reference.scores(listed)
    assert table.find(probe).tolist() == reference.find(listed)
    since = rng.randint(-1, reference.clock + 1)
    keys, rows = table.export(min_last_seen=since)
    assert (keys.tolist(), rows.tolist()) == reference.export(since), f"export(min_last_seen={since})"


def random_ops(rng, capacity, universe, key_dtype, steps):
    """A seeded stream: inserts (duplicates, 1-D and 2-D, sometimes more distinct keys than
    the capacity), touches, finds and ticks over ``universe`` (a list of keys)."""
    ops = []
    for _ in range(steps):
        action = rng.random()
        if action < 0.15:
            ops.append(("tick",))
            continue
        length = rng.choice([0, 1, rng.randint(1, capacity + 1), rng.randint(0, 2 * capacity + 2)])
        if rng.random() < 0.05:
            length = capacity + 1 + rng.randint(0, 3)
            keys = rng.sample(universe, min(length, len(universe)))  # (more than capacity distinct keys)
        else:
            keys = [rng.choice(universe) for _ in range(length)]
        tensor = t(keys, key_dtype)
        if len(keys) % 2 == 0 and keys and rng.random() < 0.3:
            tensor = tensor.view(2, -1)
        kind = "insert" if action < 0.7 else ("touch" if action < 0.9 else "find")
        ops.append((kind, tensor))
    return ops


def make_universe(rng, kind, capacity, key_dtype):
    lo, hi = (INT64_MIN, INT64_MAX) if key_dtype == torch.int64 else (INT32_MIN, INT32_MAX)
    if kind == "tiny":
        return [-1, 0, 1]
    if kind == "small":
        return list(range(-capacity - 2, capacity + 3))
    extremes = [lo, hi, lo + 1, hi - 1, -1, 0]
    return extremes + list({rng.randint(lo, hi) for _ in range(3 * capacity + 4)})


# ---- hand-checked cases ----


def test_lru_hand_checked():
    table = sk.HashTable(3, eviction="lru")
    assert table.clock == 0 and table.eviction == "lru"
    assert table.insert(t([10, 20, 30])).tolist() == [0, 1, 2]  # clock 0: each (0, 1)
    assert table.tick() == 1 and table.clock == 1
    assert table.insert(t([10])).tolist() == [0]                # 10: (1, 2)
    table.tick()
    assert table.touch(t([30, 99])).tolist() == [2, -1]         # 30: (2, 2); 99 not inserted
    assert table.find(t([20, 99])).tolist() == [1, -1]          # find scores nothing
    assert scores_of(table, [10, 20, 30, 99]) == [(1, 2), (0, 1), (2, 2), (-1, -1)]
    table.tick()
    # clock 3, two new keys, no free row: the two least recent are 20 (0) then 10 (1);
    # they are evicted (pairs by ascending row: 10 at row 0, 20 at row 1) and 40, 50 take
    # rows 0, 1 in order of first occurrence.
    assert evicting_insert(table, [40, 50, 40]) == ([0, 1, 0], [(10, 0), (20, 1)])
    assert exported(table) == ([40, 50, 30], [0, 1, 2])
    assert scores_of(table, [40, 50, 30, 10, 20]) == [(3, 2), (3, 1), (2, 2), (-1, -1), (-1, -1)]


def test_lru_ties_go_to_the_smaller_key_including_extremes():
    table = sk.HashTable(4, eviction="lru")
    table.insert(t([5, INT64_MAX, -3, INT64_MIN]))  # rows 0..3, all last seen at clock 0
    table.tick()
    # Four-way tie on last_seen 0: the smallest key, INT64_MIN (row 3), goes; 7 takes row 3.
    assert evicting_insert(table, [7]) == ([3], [(INT64_MIN, 3)])
    table.tick()
    # 5, MAX, -3 last seen at 0, 7 at 1: the two smallest of (0, 5), (0, MAX), (0, -3) are
    # -3 (row 2) and 5 (row 0); pairs by row: (5, 0), (-3, 2). 8 -> row 0, 9 -> row 2.
    assert evicting_insert(table, [8, 9]) == ([0, 2], [(5, 0), (-3, 2)])
    assert exported(table) == ([8, INT64_MAX, 9, 7], [0, 1, 2, 3])
    table.tick()
    # Now 8 (2), MAX (0), 9 (2), 7 (1): MAX and 7 are the least recent (a large key goes
    # when its score is lowest). INT64_MIN -> row 1, -1 -> row 3.
    assert evicting_insert(table, [INT64_MIN, -1]) == ([1, 3], [(INT64_MAX, 1), (7, 3)])
    assert exported(table) == ([8, INT64_MIN, 9, -1], [0, 1, 2, 3])
    assert scores_of(table, [8, INT64_MIN, 9, -1]) == [(2, 1), (3, 1), (2, 1), (3, 1)]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_key_of_the_call_is_never_evicted(eviction):
    table = sk.HashTable(3, eviction=eviction)
    table.insert(t([1, 2, 3]))     # clock 0: each (0, 1)
    table.tick()
    table.insert(t([2, 3, 2, 3]))  # clock 1: 2 and 3 (1, 3)
    table.tick()
    # Key 1 has the lowest score under both policies, but it is in the call: of 2 and 3
    # (tied under both), the smaller key 2 (row 1) goes and 4 takes its row.
    assert evicting_insert(table, [1, 4]) == ([0, 1], [(2, 1)])
    assert scores_of(table, [1, 4, 3, 2]) == [(2, 2), (2, 1), (1, 3), (-1, -1)]
    # A call of exactly `capacity` new keys evicts every row.
    table.tick()
    assert evicting_insert(table, [9, 8, 7]) == ([0, 1, 2], [(1, 0), (4, 1), (3, 2)])


def test_lfu_hand_checked_count_then_last_seen_then_key():
    table = sk.HashTable(3, eviction="lfu")
    assert table.insert(t([1, 2, 3, 3])).tolist() == [0, 1, 2, 2]  # clock 0: 1 (0,1), 2 (0,1), 3 (0,2)
    table.tick()
    table.touch(t([1, 1]))                                          # 1: (1, 3)
    table.tick()
    table.touch(t([2]))                                             # 2: (2, 2)
    assert scores_of(table, [1, 2, 3]) == [(1, 3), (2, 2), (0, 2)]
    table.tick()
    # clock 3: counts 3, 2, 2. The tie on count 2 between keys 2 (last seen 2) and 3 (last
    # seen 0) goes to last_seen: key 3 goes although it is the larger key.
    assert evicting_insert(table, [4]) == ([2], [(3, 2)])          # 4: (3, 1)
    table.tick()
    # clock 4: 1 (1, 3), 2 (2, 2), 4 (3, 1): LFU evicts 4, the least frequent, although it
    # is the most recent (LRU would take 1).
    assert evicting_insert(table, [5]) == ([2], [(4, 2)])
    assert exported(table) == ([1, 2, 5], [0, 1, 2])
    assert scores_of(table, [1, 2, 5]) == [(1, 3), (2, 2), (4, 1)]
    # Repeated occurrences of a present key in an insert add to its count.
    table.insert(t([5, 5, 5]))
    assert scores_of(table, [5]) == [(4, 4)]


def test_lfu_full_tie_goes_to_the_smaller_key():
    table = sk.HashTable(3, eviction="lfu")
    table.insert(t([INT64_MAX, -5, 7]))  # all (0, 1)
    table.tick()
    assert evicting_insert(table, [0]) == ([1], [(-5, 1)])
    table.tick()
    # 7 and MAX tie on (0, 1); 0 is (1, 1): 7 goes, then MAX.
    assert evicting_insert(table, [INT64_MIN, 1]) == ([0, 2], [(INT64_MAX, 0), (7, 2)])
    assert exported(table) == ([INT64_MIN, 0, 1], [0, 1, 2])


def test_new_keys_take_freed_rows_ascending_then_fresh_rows():
    table = sk.HashTable(5, eviction="lru")
    table.insert(t([100, 200, 300]))  # rows 0..2 at clock 0
    table.tick()
    table.touch(t([100]))             # 100 last seen at 1
    table.tick()
    # Size 3 of 5 and four new keys: two free rows (3, 4) and two victims, 200 (row 1) and
    # 300 (row 2). New keys in first occurrence order 9, 8, 7, 6 get rows 1, 2, 3, 4.
    assert evicting_insert(table, [9, 8, 100, 9, 7, 6]) == ([1, 2, 0, 1, 3, 4], [(200, 1), (300, 2)])
    assert exported(table) == ([100, 9, 8, 7, 6], [0, 1, 2, 3, 4])


def test_insert_without_room_needed_evicts_nothing():
    for eviction in POLICIES:
        table = sk.HashTable(4, eviction=eviction)
        rows, evicted_keys, evicted_rows = table.insert(t([3, 1]), return_evicted=True)
        assert rows.tolist() == [0, 1]
        assert evicted_keys.shape == (0,) and evicted_keys.dtype == torch.int64
        assert evicted_rows.shape == (0,) and evicted_rows.dtype == torch.int64
        assert evicting_insert(table, []) == ([], [])
        assert table.insert(t([[2, 3], [4, 2]])).tolist() == [[2, 0], [3, 2]]


@pytest.mark.parametrize("eviction", POLICIES)
def test_refused_insert_changes_nothing(eviction):
    table = sk.HashTable(3, eviction=eviction)
    table.insert(t([1, 2]))
    table.tick()
    table.touch(t([2, 2]))
    table.tick()
    probe = t([1, 2, 3, 4, 5])
    before = state_of(table, probe)
    # More distinct keys than the capacity: refused under every policy.
    with pytest.raises(HashTableFullError):
        table.insert(t([1, 3, 4, 5, 3]), return_evicted=True)
    assert state_of(table, probe) == before
    if eviction is None:
        with pytest.raises(HashTableFullError):
            table.insert(t([2, 4, 5]))  # two new keys, one free row
        assert state_of(table, probe) == before
        assert table.insert(t([4, 2])).tolist() == [2, 1]  # exactly fills it
        with pytest.raises(HashTableFullError):
            table.insert(t([5]))
    else:
        assert evicting_insert(table, [3, 4, 5]) == ([0, 1, 2], [(1, 0), (2, 1)])


def test_int32_table_evicts_int32_keys():
    for eviction in ["lru", "lfu"]:
        table = sk.HashTable(2, key_dtype=torch.int32, eviction=eviction)
        table.insert(t([INT32_MAX, INT32_MIN], torch.int32))
        table.tick()
        table.touch(t([INT32_MAX]))  # INT32_MIN is now the lowest under both policies
        table.tick()
        assert evicting_insert(table, [-1, -1], torch.int32) == ([1, 1], [(INT32_MIN, 1)])
        keys, _ = table.export()
        assert keys.dtype == torch.int32 and keys.tolist() == [INT32_MAX, -1]
        assert scores_of(table, [INT32_MAX, -1], torch.int32) == [(1, 2), (2, 2)]
        assert scores_of(table, [INT32_MAX, -1]) == [(1, 2), (2, 2)]  # int64 probes find them too
        assert table.export(min_last_seen=2)[0].dtype == torch.int32


def test_export_since_a_clock():
    table = sk.HashTable(8, eviction="lfu")
    table.insert(t([5, 6]))
    table.tick()
    table.insert(t([7]))
    table.tick()
    table.touch(t([5, 8]))
    # last seen: 5 -> 2, 6 -> 0, 7 -> 1
    for since, expected in [(None, ([5, 6, 7], [0, 1, 2])), (-3, ([5, 6, 7], [0, 1, 2])), (0, ([5, 6, 7], [0, 1, 2])),
                            (1, ([5, 7], [0, 2])), (2, ([5], [0])), (3, ([], []))]:
        keys, rows = table.export(min_last_seen=since)
        assert (keys.tolist(), rows.tolist()) == expected, since
        assert rows.dtype == torch.int64 and keys.dtype == torch.int64


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_export_is_a_snapshot_that_later_inserts_and_evictions_leave_alone(key_dtype):
    table = sk.HashTable(3, eviction="lru", key_dtype=key_dtype)
    table.insert(t([1, 2, 3], key_dtype))
    every, since = table.export(), table.export(min_last_seen=0)
    table.tick()
    table.insert(t([4, 5], key_dtype))  # evicts two keys and reuses their rows
    assert every[0].tolist() == [1, 2, 3] and every[1].tolist() == [0, 1, 2]
    assert since[0].tolist() == [1, 2, 3]


def test_scores_are_kept_without_eviction_and_find_never_scores():
    table = sk.HashTable(4)
    assert table.eviction is None
    assert scores_of(table, [1]) == [(-1, -1)]
    table.insert(t([1, 2, 1]))
    table.tick()
    table.tick()
    table.find(t([1, 2, 1, 1]))
    assert scores_of(table, [1, 2]) == [(0, 2), (0, 1)]
    assert table.touch(t([[2, 3], [2, 2]])).tolist() == [[1, -1], [1, 1]]
    assert len(table) == 2  # touch never inserts
    assert scores_of(table, [1, 2, 3]) == [(0, 2), (2, 4), (-1, -1)]
    last_seen, count = table.scores(t([[1, 3]]))
    assert last_seen.shape == (1, 2) and last_seen.tolist() == [[0, -1]] and count.tolist() == [[2, -1]]
    assert table.touch(t([])).tolist() == []


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_table_without_room_is_a_value_error_naming_capacity(capacity):
    # As the layers' own sizes: a table that can never hold a key is a mistake, not a table.
    for eviction in POLICIES:
        with pytest.raises(ValueError, match="capacity"):
            sk.HashTable(capacity, eviction=eviction)


def test_a_one_row_table_is_full_after_one_key():
    table = sk.HashTable(1)
    assert table.insert(t([])).tolist() == []
    assert table.insert(t([5])).tolist() == [0]
    with pytest.raises(HashTableFullError):
        table.insert(t([1]))
    assert len(table) == 1 and scores_of(table, [1]) == [(-1, -1)]


@pytest.mark.parametrize("bad", ["LRU", "fifo", "", 1, True])
def test_bad_eviction_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="eviction"):
        sk.HashTable(4, eviction=bad)


# ---- state ----


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_state_dict_round_trip_keeps_scores_and_clock(eviction, key_dtype):
    table = sk.HashTable(4, key_dtype=key_dtype, eviction=eviction)
    table.insert(t([40, -7, 40, 3], key_dtype))
    table.tick()
    table.touch(t([3, 3, 3], key_dtype))
    table.tick()
    table.insert(t([11], key_dtype))
    table.tick()
    state = table.state_dict()
    assert set(state) >= {"keys", "capacity", "last_seen", "count", "clock"}
    assert state["keys"].dtype == key_dtype and state["keys"].tolist() == [40, -7, 3, 11]
    assert state["last_seen"].dtype == torch.int64 and state["last_seen"].tolist() == [0, 0, 1, 2]
    assert state["count"].dtype == torch.int64 and state["count"].tolist() == [2, 1, 4, 1]
    assert state["clock"].dtype == torch.int64 and state["clock"].dim() == 0 and int(state["clock"]) == 3
    loaded = sk.HashTable(4, key_dtype=key_dtype, eviction=eviction)
    loaded.tick()
    loaded.insert(t([1, 2, 5, 6], key_dtype))
    loaded.load_state_dict(saved_and_loaded(state))
    assert loaded.clock == 3 and exported(loaded) == exported(table)
    probe = [40, -7, 3, 11, 1]
    assert scores_of(loaded, probe, key_dtype) == scores_of(table, probe, key_dtype)
    # The scores drive the next eviction the same way. lru: last seen 40 -> 0, -7 -> 0,
    # 3 -> 1, 11 -> 2: -7 and 40 go. lfu: counts 2, 1, 4, 1: -7 (last seen 0) and 11 (2) go.
    expected = ([0, 1], [(40, 0), (-7, 1)]) if eviction == "lru" else ([1, 3], [(-7, 1), (11, 3)])
    assert evicting_insert(loaded, [8, 9], key_dtype) == expected
    assert evicting_insert(table, [8, 9], key_dtype) == expected
    assert exported(loaded) == exported(table)


def test_state_without_scores_loads_with_zero_scores_and_clock():
    table = sk.HashTable(3, eviction="lru")
    for _ in range(5):
        table.tick()
    table.insert(t([9, 8]))
    state = {"keys": t([4, 5, 6]), "capacity": torch.tensor(3)}
    table.load_state_dict(saved_and_loaded(state))
    assert table.clock == 0
    assert exported(table) == ([4, 5, 6], [0, 1, 2])
    assert scores_of(table, [4, 5, 6, 9]) == [(0, 0), (0, 0), (0, 0), (-1, -1)]
    table.tick()
    table.touch(t([6]))
    assert evicting_insert(table, [7]) == ([0], [(4, 0)])  # ties at 0 go to the smaller key


def test_state_with_mismatched_scores_is_a_value_error():
    table = sk.HashTable(4, eviction="lfu")
    table.insert(t([1, 2, 3]))
    for name in ["last_seen", "count"]:
        state = table.state_dict()
        state[name] = state[name][:2]
        with pytest.raises(ValueError, match=name):
            sk.HashTable(4, eviction="lfu").load_state_dict(state)


@pytest.mark.parametrize("name, values, message", [
    ("count", [-1, 1, 1], "'count' holds a negative count"),
    # One more insert would wrap it past int64's end to a negative count, evicted first.
    ("count", [2**63 - 1, 1, 1], r"'count' holds a count of 2\*\*62 or more"),
    ("count", [1, 2**62, 1], r"'count' holds a count of 2\*\*62 or more"),
    ("last_seen", [-1, 0, 0], "'last_seen' holds a negative clock reading"),
    ("last_seen", [0, 500, 1], "'last_seen' holds a clock reading past the state's clock 1"),
])
def test_state_with_scores_no_table_can_hold_is_a_value_error(name, values, message):
    """A negative score read back as an absent key's -1 from scores(), and skewed eviction."""
    table = sk.HashTable(4, eviction="lfu")
    table.insert(t([1, 2, 3]))
    table.tick()
    state = table.state_dict()
    state[name] = t(values)
    loaded = sk.HashTable(4, eviction="lfu")
    loaded.insert(t([9]))
    with pytest.raises(ValueError, match=message):
        loaded.load_state_dict(state)
    assert loaded.export()[0].tolist() == [9] and loaded.clock == 0
    state[name] = t([1, 1, 1])  # in range (last_seen == clock: seen since the last tick)
    loaded.load_state_dict(state)
    assert loaded.scores(t([1]))[1].tolist() == [1]


@pytest.mark.parametrize("clock", [torch.tensor(2.7), torch.tensor(2.0), torch.tensor(True), -1, 1.5])
def test_state_with_a_clock_that_is_not_an_integer_is_a_value_error(clock):
    table = sk.HashTable(4, eviction="lru")
    table.insert(t([1, 2]))
    state = table.state_dict()
    state["clock"] = clock
    loaded = sk.HashTable(4, eviction="lru")
    with pytest.raises(ValueError, match="'clock' must be a non-negative int64 scalar"):
        loaded.load_state_dict(state)
    assert len(loaded) == 0 and loaded.clock == 0
    state["clock"] = torch.tensor([3], dtype=torch.int32)  # any one-element integer tensor
    loaded.load_state_dict(state)
    assert loaded.clock == 3
    state["clock"] = np.int64(4)  # and a numpy integer, as every integer argument takes
    loaded.load_state_dict(state)
    assert loaded.clock == 4


# ---- random streams against the reference ----


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("capacity, universe, key_dtype", [
    (1, "tiny", torch.int64), (2, "small", torch.int64), (5, "wide", torch.int32), (16, "small", torch.int64),
    (17, "wide", torch.int64), (64, "tiny", torch.int64), (64, "small", torch.int32), (64, "wide", torch.int64),
])
def test_seeded_streams_match_the_reference(device, eviction, capacity, universe, key_dtype):
    rng = random.Random(f"{eviction}-{capacity}-{universe}-{key_dtype}")
    keys = make_universe(rng, universe, capacity, key_dtype)
    ops = random_ops(rng, capacity, keys, key_dtype, steps=60)
    reference = Reference(capacity, eviction)
    table = sk.HashTable(capacity, key_dtype=key_dtype, device=device, eviction=eviction)
    play(table, ops[:30], t(keys, key_dtype), reference, rng)
    # Halfway, the state moves through torch.save / torch.load into another table (which
    # held other keys): the rest of the stream must go on exactly as in the reference.
    resumed = sk.HashTable(capacity, key_dtype=key_dtype, device=device, eviction=eviction)
    resumed.tick()
    resumed.insert(t(keys[:capacity], key_dtype, device))
    resumed.load_state_dict(saved_and_loaded(table.state_dict()))
    play(resumed, ops[30:], t(keys, key_dtype), reference, rng)


@st.composite
def streams(draw):
    """(capacity, eviction, key_dtype, universe, ops) drawn so that hypothesis can shrink them."""
    capacity = draw(st.integers(1, 64), label="capacity")
    eviction = draw(st.sampled_from(POLICIES), label="eviction")
    key_dtype = draw(st.sampled_from([torch.int64, torch.int32]), label="key_dtype")
    lo, hi = (INT64_MIN, INT64_MAX) if key_dtype == torch.int64 else (INT32_MIN, INT32_MAX)
    kind = draw(st.sampled_from(["tiny", "small", "wide"]), label="universe")
    if kind == "tiny":
        universe = [-1, 0, 1]
    elif kind == "small":
        universe = list(range(-capacity - 2, capacity + 3))
    else:
        universe = [lo, hi, lo + 1, hi - 1, -1, 0] + draw(
            st.lists(st.integers(lo, hi), min_size=capacity + 1, max_size=2 * capacity + 8, unique=True))
    key = st.sampled_from(universe)
    call = st.lists(key, max_size=2 * capacity + 2)
    op = st.one_of(st.just(("tick",)), st.tuples(st.sampled_from(["insert", "insert", "touch", "find"]), call))
    ops = draw(st.lists(op, min_size=1, max_size=25), label="ops")
    ops = [o if o[0] == "tick" else (o[0], t(o[1], key_dtype)) for o in ops]
    return capacity, eviction, key_dtype, universe, ops


@given(stream=streams(), seed=st.integers(0, 2**32 - 1))
@examples(10)
def test_drawn_streams_match_the_reference(stream, seed):
    capacity, eviction, key_dtype, universe, ops = stream
    table = sk.HashTable(capacity, key_dtype=key_dtype, eviction=eviction)
    play(table, ops, t(universe, key_dtype), Reference(capacity, eviction), random.Random(seed))


# ---- the same stream on other thread counts and devices ----


def big_ops(capacity, seed, key_dtype=torch.int64):
    """Fills a table of ``capacity`` rows in four batches at clocks 0..3 (lru ties galore,
    broken by key), touches a random fifth with repeats (varied lfu counts), then three
    inserts that each evict a large share, the last with keys of the table mixed in."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (INT64_MIN, INT64_MAX) if key_dtype == torch.int64 else (INT32_MIN, INT32_MAX)
    pool = torch.unique(torch.randint(lo, hi, (2 * capacity + 1000,), generator=g, dtype=torch.int64))
    pool = pool[torch.randperm(pool.numel(), generator=g)].to(key_dtype)
    first, rest = pool[:capacity], pool[capacity:]
    ops = []
    for batch in first.chunk(4):
        ops += [("insert", batch), ("tick",)]
    ops += [("touch", first[torch.randint(0, capacity, (capacity // 5,), generator=g)]), ("tick",)]
    third, fifth = capacity // 3, capacity // 5
    ops += [("insert", rest[:third]), ("tick",)]
    ops += [("insert", rest[third:third + fifth]), ("tick",)]
    mixed = torch.cat([rest[third + fifth:third + 2 * fifth], first[torch.randint(0, capacity, (fifth,), generator=g)]])
    ops += [("insert", mixed[torch.randperm(mixed.numel(), generator=g)]), ("touch", rest[:50])]
    return ops, pool


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [3000, 100_000])
def test_eviction_is_the_same_on_one_and_two_threads(eviction, capacity):
    ops, pool = big_ops(capacity, seed=capacity + len(eviction))
    old = torch.get_num_threads()
    runs = []
    for threads in [1, 2]:
        with num_threads(threads):
            runs.append(play(sk.HashTable(capacity, eviction=eviction), ops, pool))
    assert torch.get_num_threads() == old
    assert runs[0] == runs[1]
    # And both are the contract's answer (checked on the last, largest-eviction calls).
    reference = Reference(capacity, eviction)
    for op, record in zip(ops, runs[0]):
        if op[0] == "tick":
            reference.tick()
        elif op[0] == "touch":
            reference.touch(op[1].tolist())
        else:
            rows, evicted = reference.insert(op[1].tolist())
            assert record[1] == rows and list(zip(record[2], record[3])) == evicted
    length, clock, keys, rows, last_seen, count = runs[0][-1][-6:]
    assert clock == reference.clock and keys == reference.keys and rows == list(range(capacity)) and length == capacity
    assert list(zip(last_seen, count)) == reference.scores(pool.tolist())


def _cuda_and_cpu_records(ops, probe, capacity, eviction, key_dtype):
    return [play(sk.HashTable(capacity, key_dtype=key_dtype, device=device, eviction=eviction), ops, probe)
            for device in ["cpu", "cuda"]]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_cuda_matches_cpu_on_small_streams(eviction, key_dtype):
    for capacity, universe in [(1, "tiny"), (7, "small"), (64, "wide")]:
        rng = random.Random(f"cuda-{eviction}-{capacity}-{key_dtype}")
        keys = make_universe(rng, universe, capacity, key_dtype)
        ops = random_ops(rng, capacity, keys, key_dtype, steps=80)
        cpu, cuda = _cuda_and_cpu_records(ops, t(keys, key_dtype), capacity, eviction, key_dtype)
        assert cpu == cuda


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_cuda_matches_cpu_on_large_evictions(eviction, key_dtype):
    capacity = 100_000
    ops, pool = big_ops(capacity, seed=7, key_dtype=key_dtype)
    cpu, cuda = _cuda_and_cpu_records(ops, pool, capacity, eviction, key_dtype)
    assert cpu == cuda


# ---- select_smallest ----


def select_reference(columns, eligible, k):
    values = [c.tolist() for c in columns]
    chosen = [i for i, ok in enumerate(eligible.tolist()) if ok]
    chosen.sort(key=lambda i: tuple(v[i] for v in values) + (i,))
    return sorted(chosen[:k])


def make_column(kind, n, g):
    if kind == "tiny":
        return torch.randint(-1, 2, (n,), generator=g)
    if kind == "full":
        return torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g, dtype=torch.int64)
    if kind == "extremes":
        pool = torch.tensor([INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, -1, 0, 1])
        return pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    if kind == "sorted":
        return torch.sort(torch.randint(-(1 << 40), 1 << 40, (n,), generator=g)).values
    raise ValueError(kind)


# Up to 4 columns: the kernel's most (kSelectMaxColumns; 5 is refused). The explicit
# examples make sure the CI profile runs 4 columns, ties in the first three (so the fourth
# decides), across 2^14-entry chunks, on one and two threads.
@given(n=sizes(50_000), kinds=st.lists(st.sampled_from(["tiny", "full", "extremes", "sorted"]), min_size=1, max_size=4),
       density=st.sampled_from([0.0, 0.01, 0.5, 0.97, 1.0]), k_fraction=st.floats(0, 1),
       seed=st.integers(0, 2**31), threads=st.sampled_from([1, 2]))
@example(n=(1 << 14) + 1, kinds=["tiny", "extremes", "tiny", "full"], density=0.97, k_fraction=0.5, seed=4, threads=2)
@example(n=3 * (1 << 14) + 5, kinds=["tiny", "tiny", "extremes", "sorted"], density=1.0, k_fraction=0.3, seed=5,
         threads=1)
@examples(12)
def test_select_smallest_matches_sorted(device, n, kinds, density, k_fraction, seed, threads):
    g = torch.Generator().manual_seed(seed)
    columns = [make_column(kind, n, g) for kind in kinds]
    eligible = torch.rand(n, generator=g) < density if 0 < density < 1 else torch.full((n,), density == 1.0)
    k = round(k_fraction * int(eligible.sum()))
    with num_threads(threads):
        chosen = sk.ops.select_smallest([c.to(device) for c in columns], eligible.to(device), k)
    assert chosen.dtype == torch.int64 and chosen.shape == (k,)
    assert chosen.tolist() == select_reference(columns, eligible, k)


def test_select_smallest_crossing_chunks_by_hand():
    """One small entry per 2^14 chunk, all else equal: the k smallest sit in different chunks."""
    n = 5 * (1 << 14) + 3
    column = torch.full((n,), 7)
    marks = [3, (1 << 14) + 5, 2 * (1 << 14), 4 * (1 << 14) + 1, n - 1]
    column[marks] = torch.tensor([4, 2, 3, 1, 0])
    eligible = torch.ones(n, dtype=torch.bool)
    for threads in [1, 2]:
        with num_threads(threads):
            # values 0, 1, 2 sit at marks[4], marks[3], marks[1]
            assert sk.ops.select_smallest([column], eligible, 3).tolist() == [marks[1], marks[3], marks[4]]
            assert sk.ops.select_smallest([column], eligible, 6).tolist() == [0] + marks  # then the smaller index
            eligible[n - 1] = False
            assert sk.ops.select_smallest([column], eligible, 1).tolist() == [4 * (1 << 14) + 1]
            eligible[n - 1] = True


def test_select_smallest_refuses_more_than_eligible(device):
    column = torch.tensor([3, 1, 2], device=device)
    eligible = torch.tensor([True, False, True], device=device)
    assert sk.ops.select_smallest([column], eligible, 2).tolist() == [0, 2]
    assert sk.ops.select_smallest([column], eligible, 0).tolist() == []
    with pytest.raises(RuntimeError, match="eligible"):
        sk.ops.select_smallest([column], eligible, 3)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    assert sk.ops.select_smallest([empty], empty.bool(), 0).tolist() == []
    with pytest.raises(RuntimeError, match="eligible"):
        sk.ops.select_smallest([empty], empty.bool(), 1)


# ---- soak ----


def longest_occupied_run(slot_rows):
    """The longest run of non-empty slots (live or tombstone), wrapping around the end."""
    occupied = (slot_rows.cpu() != -1).tolist()
    if all(occupied):
        return len(occupied)
    start = occupied.index(False)
    best = run = 0
    for used in occupied[start:] + occupied[:start]:
        run = run + 1 if used else 0
        best = max(best, run)
    return best


def assert_probes_bounded(table):
    keys, _ = table.export()
    fresh = sk.HashTable(table.capacity)
    fresh.insert(keys)
    assert table.num_slots == fresh.num_slots
    assert longest_occupied_run(table._slot_rows) <= 4 * longest_occupied_run(fresh._slot_rows) + 64
    assert table._tombstones * 4 <= table.num_slots


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_soak_keeps_keys_findable_and_probes_bounded(eviction):
    capacity, calls = 2000, 1200
    g = torch.Generator().manual_seed(len(eviction))
    table = sk.HashTable(capacity, eviction=eviction)
    table.insert(torch.randint(INT64_MIN, INT64_MAX, (capacity,), generator=g, dtype=torch.int64))
    evictions = 0
    for call in range(calls):
        table.tick()
        keys = table.export()[0].clone()
        size_before = len(table)
        # Some keys of the table (scored again) and many new wide ones, with repeats.
        old = keys[torch.randint(0, keys.numel(), (20,), generator=g)]
        new = torch.randint(INT64_MIN, INT64_MAX, (int(torch.randint(50, 200, (1,), generator=g)),), generator=g,
                            dtype=torch.int64)
        batch = torch.cat([new, old, new[:10]])
        batch = batch[torch.randperm(batch.numel(), generator=g)]
        rows, evicted_keys, evicted_rows = table.insert(batch, return_evicted=True)
        is_new = ~torch.isin(batch, keys)
        new_keys = sk.ops.unique(batch[is_new], return_inverse=False)  # in order of first occurrence
        num_new = new_keys.numel()
        # Exactly as many victims as needed, none of them a key of the call, their rows
        # reused by the new keys in order of first occurrence.
        assert evicted_keys.numel() == num_new - (capacity - size_before)
        assert not bool(torch.isin(evicted_keys, batch).any())
        assert bool((evicted_rows[1:] > evicted_rows[:-1]).all())
        assert torch.equal(table.find(new_keys), evicted_rows)
        assert torch.equal(rows[is_new], table.find(batch[is_new]))
        assert bool((table.find(evicted_keys) == -1).all())
        assert table._tombstones * 4 <= table.num_slots
        evictions += evicted_keys.numel()
        if call % 400 == 399:
            assert_probes_bounded(table)
    assert evictions > 20 * table.num_slots  # many rebuilds
    keys, rows = table.export()
    assert len(table) == capacity and torch.equal(rows, torch.arange(capacity))
    assert torch.unique(keys).numel() == capacity
    assert torch.equal(table.find(keys), rows)
    assert_probes_bounded(table)


# ---- errors ----


def test_insert_of_the_wrong_dtype_is_a_type_error():
    table = sk.HashTable(4, eviction="lru")
    with pytest.raises(TypeError):
        table.insert(t([1, 2], torch.int32))
    with pytest.raises(TypeError):
        table.insert(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError):
        sk.HashTable(4, key_dtype=torch.int32, eviction="lfu").insert(t([1]))
    for method in ["find", "touch", "scores"]:
        with pytest.raises(TypeError):
            getattr(table, method)(torch.tensor([1.0]))
    assert len(table) == 0


@pytest.mark.parametrize("other", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_keys_on_another_device_are_refused(other):
    table = sk.HashTable(4, eviction="lru")
    table.insert(t([1, 2]))
    keys = t([3, 4], device=other)
    for method in ["insert", "find", "touch", "scores"]:
        with pytest.raises(RuntimeError, match="device") as info:
            getattr(table, method)(keys)
        assert not isinstance(info.value, HashTableFullError)
    assert exported(table) == ([1, 2], [0, 1]) and scores_of(table, [1, 2]) == [(0, 1), (0, 1)]


def test_export_bound_must_be_an_int():
    table = sk.HashTable(4, eviction="lru")
    table.insert(t([1]))
    with pytest.raises(TypeError):
        table.export(min_last_seen="x")
    with pytest.raises(TypeError):
        table.export(min_last_seen=1.5)


def test_export_bound_past_int64_selects_no_key_or_every_key():
    """Clocks are int64: a bound beyond either end compares as Python ints would (torch
    raised OverflowError converting it)."""
    table = sk.HashTable(8, eviction="lru")
    table.insert(t([1, 2]))
    table.insert(t([3]))
    for bound in (2**63, 2**70):
        keys, rows = table.export(min_last_seen=bound)
        assert keys.numel() == 0 and rows.numel() == 0
    for bound in (-2**63 - 1, -2**70):
        assert torch.equal(table.export(min_last_seen=bound)[0], table.export()[0])
    layer = sk.DistributedEmbedding("sum", 8, 4, 1, 1, eviction="lru")
    layer(torch.tensor([[[5]]]))
    assert layer.export(min_last_seen=2**70)[0].numel() == 0


# ---- the contract (docs/api.md), sentence by sentence: names, signatures, boundaries ----

def test_dynamic_table_signatures_are_the_contracts():
    """the contract (docs/api.md): ``HashTable(capacity, *, key_dtype=torch.int64, device=None, eviction=None)``,
    ``insert(keys, return_evicted=False)``, ``touch(keys)``, ``scores(keys)``,
    ``export(min_last_seen=None)``, ``tick()`` and ``clock``."""
    import inspect

    params = inspect.signature(sk.HashTable).parameters
    assert list(params) == ["capacity", "key_dtype", "device", "eviction"]
    assert params["capacity"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, default in (("key_dtype", torch.int64), ("device", None), ("eviction", None)):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default
    methods = {"insert": [("keys", inspect.Parameter.empty), ("return_evicted", False)],
               "touch": [("keys", inspect.Parameter.empty)], "find": [("keys", inspect.Parameter.empty)],
               "scores": [("keys", inspect.Parameter.empty)], "export": [("min_last_seen", None)], "tick": []}
    for method, expected in methods.items():
        got = list(inspect.signature(getattr(sk.HashTable, method)).parameters.values())[1:]
        assert [(p.name, p.default) for p in got] == expected, method
    assert issubclass(sk.HashTableFullError, RuntimeError)
    table = sk.HashTable(2)
    assert type(table.clock) is int and table.clock == 0
    assert table.tick() == 1 and table.clock == 1 and type(table.clock) is int


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_call_of_exactly_capacity_distinct_keys_evicts_every_other_key(eviction):
    """Boundary of "raises only if the call itself holds more than capacity distinct keys":
    exactly ``capacity`` (duplicates counted once) evicts all the others; one more raises
    and changes nothing, the clock included."""
    table = sk.HashTable(3, eviction=eviction)
    table.insert(torch.tensor([1, 2, 3]))
    table.tick()
    rows, evicted_keys, evicted_rows = table.insert(torch.tensor([9, 8, 9, 7, 8]), return_evicted=True)
    assert rows.tolist() == [0, 1, 0, 2, 1]
    assert evicted_keys.tolist() == [1, 2, 3] and evicted_rows.tolist() == [0, 1, 2]
    assert [s.tolist() for s in table.scores(torch.tensor([9, 8, 7]))] == [[1, 1, 1], [2, 2, 1]]
    before = table.state_dict()
    with pytest.raises(HashTableFullError):
        table.insert(torch.tensor([4, 5, 6, 4, 7]))
    after = table.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_scores_touch_and_find_keep_the_keys_shape():
    """``scores(keys)``, ``touch`` and ``find`` on a 0-d and a 2-d tensor: the keys' shape, -1
    where absent; ``touch`` adds occurrences (not 1) to a present key's count, as ``insert`` does."""
    table = sk.HashTable(4)
    table.insert(torch.tensor(5))
    table.tick()
    assert table.touch(torch.tensor([[5, 6], [5, 5]])).tolist() == [[0, -1], [0, 0]]
    last_seen, count = table.scores(torch.tensor([[5, 6]]))
    assert last_seen.tolist() == [[1, -1]] and count.tolist() == [[4, -1]]
    assert [s.shape for s in table.scores(torch.tensor(5))] == [torch.Size([]), torch.Size([])]
    assert len(table) == 1

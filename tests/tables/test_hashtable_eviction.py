"""Dynamic HashTable (docs/api.md) against a plain-Python model of the contract:
eviction order (LRU, LFU, ties by the smaller key), freed rows reused in ascending order,
the keys of the call never evicted, a call larger than the capacity changing nothing,
scores, touch, export(min_last_seen), state round trips, and a long soak with bounded
probes. Also select_smallest, the victim selection, against sorted().

Thresholds crossed (csrc/cpu/select_cpu.cpp): the CPU select cuts entries into chunks of
2^14, histograms 16 bits at a time, lists the bucket once it holds at most half the
entries; the table rebuilds once tombstones reach a quarter of the slots.
"""

import random

import pytest
import torch
from _table_model import TableModel
from hypothesis import given
from hypothesis import strategies as st
from properties import INT64_MAX, INT64_MIN, examples, num_threads

import sparsekit as sk
from sparsekit.hashtable import HashTableFullError


def assert_matches(table, model):
    keys, rows = table.export()
    assert keys.tolist() == model.keys
    assert rows.tolist() == list(range(len(model.keys)))
    last_seen, count = table.scores(keys)
    assert last_seen.tolist() == model.last_seen and count.tolist() == model.count
    assert torch.equal(table.find(keys), rows)
    assert table.clock == model.clock


def run_stream(table, model, rng, calls, universe, device):
    """Random inserts, touches and ticks on both; returns the evicted pairs seen."""
    log = []
    for _ in range(calls):
        action = rng.random()
        if action < 0.2:
            table.tick()
            model.clock += 1
            continue
        keys = [rng.randint(-universe, universe) for _ in range(rng.randint(0, 2 * table.capacity + 1))]
        if rng.random() < 0.1:
            keys += [INT64_MIN, INT64_MAX]
        tensor = torch.tensor(keys, dtype=torch.int64, device=device)
        if action < 0.3:
            assert table.touch(tensor).tolist() == model.touch(keys)
            assert_matches(table, model)
            continue
        try:
            expected, evicted = model.insert(keys)
        except HashTableFullError:
            before = table.state_dict()
            with pytest.raises(HashTableFullError):
                table.insert(tensor)
            after = table.state_dict()
            assert all(torch.equal(before[name], after[name]) for name in before)
            continue
        rows, evicted_keys, evicted_rows = table.insert(tensor, return_evicted=True)
        assert rows.tolist() == expected
        assert list(zip(evicted_keys.tolist(), evicted_rows.tolist())) == evicted
        log.append(evicted)
        assert_matches(table, model)
    return log


# ---- hand-checked cases ----


def test_lru_evicts_least_recent_then_smaller_key():
    table = sk.HashTable(3, eviction="lru")
    table.insert(torch.tensor([30, -5, 7]))        # rows 0, 1, 2 at clock 0
    table.tick()
    table.insert(torch.tensor([30]))               # 30 last seen at 1
    table.tick()
    # Two new keys need two rows: -5 and 7 (both at clock 0; -5 is the smaller key first).
    rows, keys, freed = table.insert(torch.tensor([100, 30, 101]), return_evicted=True)
    assert keys.tolist() == [-5, 7] and freed.tolist() == [1, 2]
    assert rows.tolist() == [1, 0, 2]              # new keys take the freed rows in ascending order


def test_lfu_evicts_least_frequent_then_least_recent_then_smaller_key():
    table = sk.HashTable(3, eviction="lfu")
    table.insert(torch.tensor([1, 1, 2, 3]))       # counts 2, 1, 1 at clock 0
    table.tick()
    table.touch(torch.tensor([3]))                 # 3: count 2, last seen 1
    table.tick()
    _, keys, rows = table.insert(torch.tensor([9]), return_evicted=True)
    assert keys.tolist() == [2] and rows.tolist() == [1]
    assert table.scores(torch.tensor([1, 3, 9, 2]))[1].tolist() == [2, 2, 1, -1]


def test_a_key_of_the_call_is_never_evicted():
    table = sk.HashTable(2, eviction="lru")
    table.insert(torch.tensor([INT64_MIN, INT64_MAX]))
    table.tick()
    # INT64_MIN has the lowest score and the smallest key but is in the call.
    _, keys, _ = table.insert(torch.tensor([INT64_MIN, 5]), return_evicted=True)
    assert keys.tolist() == [INT64_MAX]


def test_a_call_larger_than_the_capacity_changes_nothing():
    table = sk.HashTable(3, eviction="lfu")
    table.insert(torch.tensor([1, 2]))
    table.tick()
    before = table.state_dict()
    with pytest.raises(HashTableFullError, match="4 distinct keys, more than the table's capacity 3"):
        table.insert(torch.tensor([5, 6, 7, 8, 5]))
    after = table.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_find_never_scores_and_touch_never_inserts():
    table = sk.HashTable(4, eviction="lru")
    table.insert(torch.tensor([1, 2]))
    table.tick()
    table.find(torch.tensor([1, 3]))
    last_seen, count = table.scores(torch.tensor([1, 2, 3]))
    assert last_seen.tolist() == [0, 0, -1] and count.tolist() == [1, 1, -1]
    assert table.touch(torch.tensor([2, 2, 3])).tolist() == [1, 1, -1]
    last_seen, count = table.scores(torch.tensor([1, 2, 3]))
    assert last_seen.tolist() == [0, 1, -1] and count.tolist() == [1, 3, -1]
    assert len(table) == 2


def test_export_since_a_clock():
    table = sk.HashTable(8)
    table.insert(torch.tensor([1, 2]))
    table.tick()
    table.insert(torch.tensor([3, 1]))
    keys, rows = table.export(min_last_seen=1)
    assert keys.tolist() == [1, 3] and rows.tolist() == [0, 2]
    with pytest.raises(TypeError, match="min_last_seen"):
        table.export(min_last_seen="1")


def test_bad_policy_names_the_argument():
    with pytest.raises(ValueError, match="eviction must be None, 'lru' or 'lfu'"):
        sk.HashTable(4, eviction="fifo")


def test_int32_tables_evict_int32_keys():
    table = sk.HashTable(2, key_dtype=torch.int32, eviction="lru")
    table.insert(torch.tensor([5, 6], dtype=torch.int32))
    table.tick()
    _, keys, _ = table.insert(torch.tensor([7], dtype=torch.int32), return_evicted=True)
    assert keys.dtype == torch.int32 and keys.tolist() == [5]


def test_state_dict_round_trip_keeps_scores_and_clock():
    table = sk.HashTable(3, eviction="lfu")
    table.insert(torch.tensor([4, 4, 5]))
    table.tick()
    table.insert(torch.tensor([6]))
    state = table.state_dict()
    assert set(state) == {"keys", "capacity", "last_seen", "count", "clock"}
    copy = sk.HashTable(3, eviction="lfu")
    copy.load_state_dict(state)
    for a, b in zip(copy.scores(torch.tensor([4, 5, 6])), table.scores(torch.tensor([4, 5, 6]))):
        assert torch.equal(a, b)
    assert copy.clock == 1
    old = {"keys": state["keys"], "capacity": state["capacity"]}  # a state from before scores
    copy.load_state_dict(old)
    assert copy.clock == 0 and copy.scores(torch.tensor([4]))[1].tolist() == [0]
    with pytest.raises(ValueError, match="'count' must be int64"):
        copy.load_state_dict({**state, "count": torch.zeros(2, dtype=torch.int64)})


# ---- streams against the model ----


@pytest.mark.parametrize("eviction", ["lru", "lfu", None])
@pytest.mark.parametrize("capacity, universe", [(1, 3), (4, 10), (16, 40), (64, 1000)])
def test_random_streams_match_the_model(device, eviction, capacity, universe):
    rng = random.Random(capacity * 31 + universe)
    table = sk.HashTable(capacity, eviction=eviction, device=device)
    run_stream(table, TableModel(capacity, eviction), rng, 60, universe, device)


@given(capacity=st.integers(1, 40), universe=st.sampled_from([2, 50, 2**62]), seed=st.integers(0, 2**31),
       eviction=st.sampled_from(["lru", "lfu"]))
@examples(5)
def test_random_streams_match_the_model_property(capacity, universe, seed, eviction):
    table = sk.HashTable(capacity, eviction=eviction)
    run_stream(table, TableModel(capacity, eviction), random.Random(seed), 40, universe, "cpu")


@pytest.mark.parametrize("eviction", ["lru", "lfu", None])
@pytest.mark.parametrize("capacity, universe", [(1, 3), (4, 10), (16, 40)])
def test_distinct_inserts_of_the_layers_match_the_model(device, eviction, capacity, universe):
    # The layers insert their owner's distinct keys through _plan_insert(distinct=True) and
    # _commit_insert, whose scoring differs from insert()'s: a row an evicted key freed must
    # count its new key from 1, not go on from the old key's count.
    rng = random.Random(capacity * 17 + universe)
    table = sk.HashTable(capacity, eviction=eviction, device=device)
    model = TableModel(capacity, eviction)
    for _ in range(60):
        if rng.random() < 0.25:
            table.tick()
            model.clock += 1
            continue
        keys = list(dict.fromkeys(rng.randint(-universe, universe) for _ in range(rng.randint(0, capacity + 1))))
        try:
            expected, _ = model.insert(keys)
        except HashTableFullError:
            with pytest.raises(HashTableFullError):
                table._plan_insert(torch.tensor(keys, dtype=torch.int64, device=device), distinct=True)
            continue
        plan = table._plan_insert(torch.tensor(keys, dtype=torch.int64, device=device), distinct=True)
        assert table._commit_insert(plan).tolist() == expected
        assert_matches(table, model)


def _big_stream(eviction, threads, device="cpu"):
    """Evicting inserts on a table large enough for several select chunks and a list."""
    torch.manual_seed(0)
    table = sk.HashTable(40_000, eviction=eviction, device=device)
    evicted = []
    with num_threads(threads):
        for step in range(8):
            keys = torch.randint(0, 120_000, (20_000,)).to(device)
            evicted.append(table.insert(keys, return_evicted=True)[1].cpu())
            if step % 2:
                table.tick()
    keys, _ = table.export()
    return [e.tolist() for e in evicted], keys.cpu(), [s.cpu() for s in table.scores(keys)]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_is_the_same_on_any_thread_count(eviction):
    one, two = _big_stream(eviction, 1), _big_stream(eviction, 2)
    assert one[0] == two[0] and torch.equal(one[1], two[1])
    assert all(torch.equal(a, b) for a, b in zip(one[2], two[2]))
    assert sum(len(e) for e in one[0]) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_is_the_same_on_cuda(eviction):
    cpu, cuda = _big_stream(eviction, 2), _big_stream(eviction, 2, "cuda")
    assert cpu[0] == cuda[0] and torch.equal(cpu[1], cuda[1])
    assert all(torch.equal(a, b) for a, b in zip(cpu[2], cuda[2]))


def _longest_occupied_run(slot_rows):
    occupied = (slot_rows != -1).tolist()
    longest = run = 0
    for flag in occupied + occupied:  # the table wraps around
        run = run + 1 if flag else 0
        longest = max(longest, min(run, len(occupied)))
    return longest


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_soak_keeps_every_key_findable_and_probes_bounded(eviction):
    capacity = 2000
    table = sk.HashTable(capacity, eviction=eviction)
    generator = torch.Generator().manual_seed(1)
    for step in range(1500):
        table.insert(torch.randint(-2**62, 2**62, (300,), generator=generator))
        if step % 3 == 0:
            table.tick()
        assert table._tombstones * 4 <= table.num_slots
    keys, rows = table.export()
    assert len(table) == capacity and keys.unique().numel() == capacity
    assert torch.equal(table.find(keys), rows)
    fresh = sk.HashTable(capacity)
    fresh.insert(keys)
    assert _longest_occupied_run(table._slot_rows) <= 4 * _longest_occupied_run(fresh._slot_rows) + 64


def test_remove_compacts_rows():
    table = sk.HashTable(8, eviction="lru")
    table.insert(torch.tensor([10, 11, 12, 13, 14]))
    table.tick()
    table.touch(torch.tensor([14]))
    table._remove(torch.tensor([11, 99, 13]))
    keys, rows = table.export()
    assert sorted(keys.tolist()) == [10, 12, 14] and rows.tolist() == [0, 1, 2]
    assert torch.equal(table.find(keys), rows)
    assert table.scores(torch.tensor([14]))[0].tolist() == [1]


# ---- select_smallest ----


def _select_reference(columns, eligible, k):
    entries = [i for i in range(eligible.numel()) if eligible[i]]
    entries.sort(key=lambda i: tuple(int(c[i]) for c in columns) + (i,))
    return sorted(entries[:k])


COLUMN_KINDS = {
    "ties": lambda n, g: torch.randint(0, 3, (n,), generator=g),
    "clock": lambda n, g: torch.randint(0, 1000, (n,), generator=g),
    "wide": lambda n, g: torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g),
    "extremes": lambda n, g: torch.tensor([INT64_MIN, INT64_MAX, 0, -1])[torch.randint(0, 4, (n,), generator=g)],
}


@given(n=st.sampled_from([0, 1, 5, 100, 16383, 16384, 16385, 40000]),
       kinds=st.lists(st.sampled_from(sorted(COLUMN_KINDS)), min_size=1, max_size=3),
       density=st.sampled_from([0.0, 0.5, 1.0]), k_fraction=st.floats(0, 1), seed=st.integers(0, 2**31),
       threads=st.sampled_from([1, 2, 3]))
@examples(8)
def test_select_smallest_matches_sorted(device, n, kinds, density, k_fraction, seed, threads):
    generator = torch.Generator().manual_seed(seed)
    columns = [COLUMN_KINDS[kind](n, generator) for kind in kinds]
    eligible = torch.rand(n, generator=generator) < density
    k = int(k_fraction * int(eligible.sum()))
    expected = _select_reference(columns, eligible, k) if n <= 16385 else None
    with num_threads(threads):
        got = sk.ops.select_smallest([c.to(device) for c in columns], eligible.to(device), k).cpu()
    if expected is None:  # a faster reference: stable sorts from the last column back
        order = torch.arange(n)
        for column in reversed(columns):
            order = order[torch.sort(column[order], stable=True).indices]
        expected = torch.sort(order[eligible[order]][:k]).values.tolist()
    assert got.tolist() == expected


def test_select_smallest_refuses_more_than_eligible():
    with pytest.raises(RuntimeError, match="k=3 but only 2 of 4 entries are eligible"):
        sk.ops.select_smallest([torch.arange(4)], torch.tensor([True, False, True, False]), 3)
    with pytest.raises(RuntimeError, match="columns\\[1\\] must be int64"):
        sk.ops.select_smallest([torch.arange(4), torch.arange(4).int()], torch.ones(4, dtype=torch.bool), 1)

"""Property-based tests of sparsekit.HashTable against a Python dict model.

Thresholds crossed (sparsekit/hashtable.py, csrc/*/hashtable*): slots = the smallest power
of two >= 2 * capacity and >= 16, so capacities 0..8 share 16 slots and 2^k, 2^k + 1 sit
on either side of a doubling; CPU inserts and finds run in tasks of 4096 keys (the row
check in tasks of 16384); the full-table check runs before anything is written.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, KEY_DISTRIBUTIONS, examples, make_keys, \
    num_threads, sizes, thread_counts

import sparsekit as sk
from sparsekit.hashtable import HashTableFullError

# A table holds at least one key (HashTable(0) is refused).
CAPACITY_EDGES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097]


class DictModel:
    """The contract in plain Python: rows consecutive in first-occurrence order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows = {}

    def insert(self, keys: list):
        new = [k for k in dict.fromkeys(keys) if k not in self.rows]
        if len(self.rows) + len(new) > self.capacity:
            return None  # raises, nothing changes
        for k in new:
            self.rows[k] = len(self.rows)
        return [self.rows[k] for k in keys]

    def find(self, keys: list):
        return [self.rows.get(k, -1) for k in keys]

    def export(self):
        return list(self.rows)


def key_pool(dtype: torch.dtype):
    lo, hi = (INT64_MIN, INT64_MAX) if dtype == torch.int64 else (INT32_MIN, INT32_MAX)
    extremes = [lo, hi, -1, 0, 1, lo + 1, hi - 1, -2]
    return st.one_of(st.sampled_from(extremes), st.integers(-40, 40), st.integers(lo, hi))


@st.composite
def operations(draw, dtype: torch.dtype, capacity: int):
    keys = st.lists(key_pool(dtype), min_size=0, max_size=max(4, 2 * capacity + 3))
    op = st.one_of(
        st.tuples(st.just("insert"), keys),
        st.tuples(st.just("find"), keys),
        st.tuples(st.just("export"), st.none()),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("state_dict"), st.none()),
    )
    # Inserts are the interesting step: weight them up.
    return draw(st.lists(st.one_of(st.tuples(st.just("insert"), keys), op), min_size=1, max_size=12))


def check_export(table, model, dtype):
    keys, rows = table.export()
    assert keys.dtype == dtype and rows.dtype == torch.int64
    assert keys.cpu().tolist() == model.export()
    assert rows.cpu().tolist() == list(range(len(model.rows)))
    assert len(table) == len(model.rows)


@examples(50)
@given(data=st.data(), capacity=st.sampled_from(CAPACITY_EDGES[:-3]), dtype=st.sampled_from([torch.int64, torch.int32]),
       shape2d=st.booleans())
def test_hashtable_property_against_dict(device, data, capacity, dtype, shape2d):
    """Random insert/find/export/clear/state_dict sequences agree with the dict model; a
    full table raises HashTableFullError and changes nothing."""
    table = sk.HashTable(capacity, key_dtype=dtype, device=device)
    model = DictModel(capacity)
    assert table.num_slots == max(16, 1 << max(0, (2 * capacity - 1).bit_length()))
    for name, keys in data.draw(operations(dtype, capacity)):
        if name in ("insert", "find"):
            tensor = torch.tensor(keys, dtype=dtype, device=device)
            if shape2d and len(keys) % 2 == 0:
                tensor = tensor.view(2, -1)
            if name == "insert":
                want = model.insert(keys)
                if want is None:
                    before = table.export()
                    with pytest.raises(HashTableFullError, match="nothing was inserted"):
                        table.insert(tensor)
                    after = table.export()
                    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
                else:
                    got = table.insert(tensor)
                    assert got.shape == tensor.shape and got.dtype == torch.int64
                    assert got.flatten().cpu().tolist() == want
            else:
                got = table.find(tensor)
                assert got.flatten().cpu().tolist() == model.find(keys)
                # find accepts the other key dtype, compared as int64.
                if dtype == torch.int32:
                    assert table.find(tensor.long()).flatten().cpu().tolist() == model.find(keys)
        elif name == "export":
            check_export(table, model, dtype)
        elif name == "clear":
            table.clear()
            model.rows.clear()
        elif name == "state_dict":
            state = table.state_dict()
            assert int(state["capacity"]) == capacity
            bigger = sk.HashTable(max(capacity, len(model.rows)) + 5, key_dtype=dtype, device=device)
            bigger.load_state_dict(state)
            check_export(bigger, model, dtype)
            # The loaded table answers finds like the original.
            probe = torch.tensor(model.export() + [3, -3], dtype=dtype, device=device)
            assert torch.equal(bigger.find(probe), table.find(probe))
            table.load_state_dict(state)
        check_export(table, model, dtype)


@examples(20)
@given(n=sizes(300_000), distribution=st.sampled_from(KEY_DISTRIBUTIONS), dtype=st.sampled_from([torch.int64, torch.int32]),
       seed=st.integers(0, 2**31 - 1), threads=thread_counts, split=st.floats(0, 1), slack=st.integers(-2, 3))
def test_hashtable_property_bulk(device, n, distribution, dtype, seed, threads, split, slack):
    """Large inserts in two batches: rows are the first-occurrence ids of the whole stream
    (plain-torch reference), find == insert for present keys, -1 for absent ones, and a
    capacity just below the distinct count raises without changing anything."""
    keys = make_keys(n, distribution, seed, dtype)
    first = int(n * split)
    unique_all, inverse_all = torch.unique(keys, sorted=True, return_inverse=True)
    # Reference rows: rank of each key's first occurrence.
    first_pos = torch.full((unique_all.numel(),), n, dtype=torch.int64)
    first_pos.scatter_reduce_(0, inverse_all, torch.arange(n), "amin")
    rank = torch.empty_like(first_pos)
    rank[torch.argsort(first_pos)] = torch.arange(first_pos.numel())
    want = rank[inverse_all]
    distinct = unique_all.numel()
    capacity = max(1, distinct + slack)
    table = sk.HashTable(capacity, key_dtype=dtype, device=device)
    with num_threads(threads):
        batches = []
        for part in (keys[:first], keys[first:]):
            if capacity < distinct and len(table) + torch.unique(part).numel() > capacity:
                # Only new keys count; a batch whose new keys do not fit changes nothing.
                new = ~torch.isin(torch.unique(part), table.export()[0].cpu())
                if len(table) + int(new.sum()) > capacity:
                    before = table.export()
                    with pytest.raises(HashTableFullError):
                        table.insert(part.to(device))
                    after = table.export()
                    assert torch.equal(before[0], after[0]) and len(table) == before[0].numel()
                    return
            batches.append(table.insert(part.to(device)))
        found = table.find(keys.to(device))
        absent = table.find((keys.long() ^ 0x5A5A5A5A).to(dtype).to(device))
    assert capacity >= distinct
    a, b = batches
    assert torch.equal(torch.cat([a, b]).cpu(), want)
    assert torch.equal(found.cpu(), want)
    present = torch.isin(keys.long() ^ 0x5A5A5A5A, keys.long())
    assert bool((absent.cpu()[~present] == -1).all())
    exported, rows = table.export()
    assert torch.equal(exported.cpu(), keys[torch.sort(first_pos).values])
    assert torch.equal(rows.cpu(), torch.arange(distinct))
    assert torch.equal(table.find(exported).cpu(), torch.arange(distinct))


@pytest.mark.parametrize("capacity", CAPACITY_EDGES)
def test_hashtable_fill_to_capacity_exactly(device, capacity):
    """Every capacity edge holds exactly `capacity` keys (adversarial ones first), and one
    more raises."""
    extremes = [INT64_MIN, INT64_MAX, -1, 0, 1, INT64_MIN + 1, INT64_MAX - 1, -2]
    keys = (extremes + list(range(100, 100 + capacity)))[:capacity]
    table = sk.HashTable(capacity, device=device)
    rows = table.insert(torch.tensor(keys, dtype=torch.int64, device=device))
    assert rows.cpu().tolist() == list(range(capacity))
    with pytest.raises(HashTableFullError):
        table.insert(torch.tensor([-(10**12)], device=device))
    assert len(table) == capacity
    assert table.find(torch.tensor(keys, dtype=torch.int64, device=device)).cpu().tolist() == list(range(capacity))

"""The peers' own test cases, ported to sparsekit's HashTable and dynamic tables (docs/api.md
section 2 "HashTable" and section 3a).

The peers: NVIDIA-Merlin/HierarchicalKV (``tests/*_test.cc.cu``: find_or_insert, insert_and_evict,
find_with_missed_keys, reserved_keys, export_batch_if, save_and_load, merlin_hashtable's
basic / when_full / rehash / evict_strategy_{lru,lfu} / multi_threads) and
NVIDIA/recsys-examples ``corelib/dynamicemb/test`` (test_lru_lfu, test_lfu_scores,
test_embedding_admission, incremental_dump). Each test's docstring names the case it
follows. What they check is ported, not their code: HKV's tables are bucketed, approximate
and value-carrying, so where HKV asserts only a bound (a miss count, "some keys evicted")
sparsekit's contract is exact and the port checks the exact answer against ``TableModel``,
a plain-Python dict model of the contract (keys -> row, last_seen, count).

Sizes cross the table's thresholds: the slot count (a power of two >= 2 * capacity, at least
16), a full table, the tombstone rebuild (a quarter of the slots), the victim selection's
chunks of 2^14 rows (csrc/cpu/select_cpu.cpp), batches of all-duplicate keys, and keys that
are the kernels' sentinels (0, -1, -2, INT64_MIN, INT64_MAX) or collide in the low bits
(multiples of 2^k). CUDA cases run through the ``device`` fixture where a GPU is present.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from _table_model import TableModel
from properties import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN

import sparsekit as sk
from sparsekit.hashtable import HashTableFullError

SENTINELS = [0, -1, -2, 1, INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1]


def _t(keys, device, dtype=torch.int64):
    return torch.tensor(keys, dtype=dtype, device=device)


def assert_same(table, model):
    """The table holds exactly the model's keys, rows, scores and clock."""
    keys, rows = table.export()
    assert keys.tolist() == model.keys
    assert rows.tolist() == list(range(len(model)))
    assert len(table) == len(model) and table.clock == model.clock
    if len(model):
        last_seen, count = table.scores(keys)
        assert last_seen.tolist() == model.last_seen
        assert count.tolist() == model.count
        assert table.find(keys).tolist() == list(range(len(model)))


def insert_both(table, model, keys, device):
    """One insert on both; they must agree on rows, evicted pairs, or on raising."""
    try:
        expected = model.insert(keys)
    except HashTableFullError:
        expected = None
    if expected is None:
        with pytest.raises(HashTableFullError):
            table.insert(_t(keys, device, table.key_dtype), return_evicted=True)
        return None
    rows, evicted_keys, evicted_rows = table.insert(_t(keys, device, table.key_dtype), return_evicted=True)
    assert rows.tolist() == expected[0]
    assert list(zip(evicted_keys.tolist(), evicted_rows.tolist())) == expected[1]
    assert evicted_keys.dtype == table.key_dtype
    return expected


# -- HierarchicalKV: find_or_insert / merlin_hashtable basics ---------------------------------


def test_basic_insert_find_reinsert_clear(device):
    """HKV merlin_hashtable_test / find_or_insert_test ``test_basic``: size 0, insert KEY_NUM
    distinct keys, size == KEY_NUM, every key found, a second insert of the same keys keeps
    size and rows, ``clear`` empties the table, and the keys go back in (HKV: the same
    values; here: rows 0.. again and the clock kept)."""
    n = 3000
    keys = [key * 2**20 - 7 for key in range(n)]
    table = sk.HashTable(n, device=device)
    assert len(table) == 0
    rows = table.insert(_t(keys, device))
    assert rows.tolist() == list(range(n)) and len(table) == n
    assert table.find(_t(keys, device)).tolist() == list(range(n))
    assert table.insert(_t(keys[::-1], device)).tolist() == list(range(n))[::-1]
    assert len(table) == n
    table.tick()
    table.clear()
    assert len(table) == 0 and table.clock == 1
    assert (table.find(_t(keys, device)) == -1).all()
    assert table.export()[0].numel() == 0
    assert table.insert(_t(keys[::-1], device)).tolist() == list(range(n))
    assert table.scores(_t(keys[:3], device))[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize("load", [0.0, 0.5, 1.0])
def test_find_with_missed_keys_at_every_load(device, load):
    """HKV find_with_missed_keys_test ``test_find_when_empty`` / ``_when_full`` /
    ``_load_factor``: a find of present and absent keys at load 0, half and full returns the
    rows of the present ones and -1 (HKV: ``founds``/``missed`` indices) for the others,
    and changes nothing."""
    capacity = 1024
    table = sk.HashTable(capacity, device=device)
    present = [key << 32 for key in range(int(capacity * load))]
    if present:
        table.insert(_t(present, device))
    absent = [(key << 32) + 1 for key in range(capacity)] + [key << 32 for key in range(len(present), capacity)]
    queries = absent[: capacity // 2] + present + absent[capacity // 2:]
    random.Random(0).shuffle(queries)
    model = {key: row for row, key in enumerate(present)}
    before = table.scores(_t(present, device)) if present else None
    assert table.find(_t(queries, device)).tolist() == [model.get(key, -1) for key in queries]
    assert len(table) == len(present)
    if present:
        after = table.scores(_t(present, device))
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_reserved_keys_are_ordinary_keys(device, key_dtype):
    """HKV reserved_keys_test ``testKeyOptions``: HKV reserves the empty / reclaimed /
    locked keys at the top of the key space and refuses them; sparsekit reserves none
    (the contract (docs/api.md): every int64 is a valid key, the sentinels included), so each of them
    inserts, finds, scores, evicts and exports like any other key, beside keys that
    collide in the low bits."""
    if key_dtype == torch.int64:
        special = SENTINELS
        colliding = [j << 40 for j in range(-8, 8) if j != 0]
    else:
        special = [0, -1, -2, 1, INT32_MIN, INT32_MIN + 1, INT32_MAX, INT32_MAX - 1]
        colliding = [j << 20 for j in range(-8, 8) if j != 0]
    keys = special + colliding
    table = sk.HashTable(len(keys), key_dtype=key_dtype, device=device, eviction="lru")
    model = TableModel(len(keys), "lru")
    insert_both(table, model, keys, device)
    assert_same(table, model)
    assert table.export()[0].dtype == key_dtype
    table.tick()
    model.clock += 1
    model.touch(special[::2])
    table.touch(_t(special[::2], device, key_dtype))
    # A full table: new keys evict the least recent, sentinels included.
    insert_both(table, model, [7, 9, 11], device)
    assert_same(table, model)
    for key in special:
        assert table.find(_t([key], device, key_dtype)).item() == model.rows.get(key, -1)


def test_keys_that_collide_in_the_low_bits_fill_the_table(device):
    """HKV merlin_hashtable_test ``test_bucket_size`` / ``test_rehash_on_big_batch``:
    many keys that land in one bucket (HKV) or share their low bits (here: multiples of
    2^k for several k) fill the table to capacity, all findable, rows in order."""
    for shift in (8, 20, 32, 48):
        capacity = 2048
        keys = [(j - capacity // 2) << shift for j in range(capacity)]
        table = sk.HashTable(capacity, device=device)
        assert table.insert(_t(keys, device)).tolist() == list(range(capacity))
        assert table.find(_t(keys, device)).tolist() == list(range(capacity))
        assert table.find(_t([key + 1 for key in keys], device)).eq(-1).all()


# -- HierarchicalKV: when full, without eviction --------------------------------------------


def test_basic_when_full_raises_and_changes_nothing(device):
    """HKV merlin_hashtable_test / find_or_insert_test ``test_basic_when_full``: HKV keeps
    inserting into a full table and checks the size stays at capacity; sparsekit's
    contract (the contract (docs/api.md)) is that an insert past ``capacity`` without eviction raises and
    inserts nothing: not the keys that would fit, not the scores of the keys already
    present in the same call, not the clock."""
    capacity = 100
    table = sk.HashTable(capacity, device=device)
    model = TableModel(capacity)
    insert_both(table, model, list(range(capacity - 3)), device)
    table.tick()
    model.clock += 1
    # present keys + 4 new ones: 1 too many.
    insert_both(table, model, [5, 6, 5, -1, -2, -3, -4], device)
    assert_same(table, model)
    insert_both(table, model, [5, -1, -2, -3], device)   # exactly full
    assert_same(table, model)
    insert_both(table, model, [INT64_MIN], device)       # one more: raises
    insert_both(table, model, [5] * 50, device)          # all present: fine when full
    assert_same(table, model)


# -- HierarchicalKV: insert_and_evict ---------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_insert_and_evict_conserves_keys(device, eviction):
    """HKV insert_and_evict_test ``test_insert_and_evict_basic``: after inserting M keys and
    then N more into a table of capacity U < M + N, ``size_before + new == size_after +
    evicted``, every key ever inserted is in the table or was evicted exactly once, and no
    evicted key is one of the call's own (HKV: the evicted buffer holds real pairs)."""
    capacity = 1000
    m_keys = [3 * key for key in range(capacity * 3 // 4)]
    n_keys = [3 * key + 1 for key in range(capacity // 2 + 17)]
    table = sk.HashTable(capacity, device=device, eviction=eviction)
    table.insert(_t(m_keys, device))
    table.tick()
    size_before = len(table)
    rows, evicted_keys, evicted_rows = table.insert(_t(n_keys, device), return_evicted=True)
    assert size_before + len(n_keys) == len(table) + evicted_keys.numel()
    assert len(table) == capacity
    assert set(evicted_keys.tolist()).isdisjoint(n_keys)
    held = set(table.export()[0].tolist())
    assert held.isdisjoint(evicted_keys.tolist())
    assert held | set(evicted_keys.tolist()) == set(m_keys) | set(n_keys)
    assert sorted(evicted_rows.tolist()) == evicted_rows.tolist()
    # The evicted rows went to the first new keys (the contract (docs/api.md)).
    assert rows[: evicted_rows.numel()].tolist() == evicted_rows.tolist()


def test_insert_and_evict_after_clear_never_evicts_a_stale_key(device):
    """HKV insert_and_evict_test ``test_insert_and_evict_bugfix_no_zero_eviction``: after
    part of a full table is removed (HKV: erase; here: ``clear`` and a partial refill),
    an evicting insert reports only keys the table held, never a stale or placeholder
    key (HKV's bug reported the empty key 0)."""
    table = sk.HashTable(2048, device=device, eviction="lru")
    table.insert(_t(list(range(1, 2049)), device))
    table.clear()
    refill = list(range(5001, 6025))
    table.insert(_t(refill, device))
    table.tick()
    _, evicted_keys, evicted_rows = table.insert(_t(list(range(10000, 12048)), device), return_evicted=True)
    assert evicted_keys.numel() == 1024
    assert sorted(evicted_keys.tolist()) == refill
    assert evicted_rows.tolist() == list(range(1024))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_insert_of_more_distinct_keys_than_capacity_changes_nothing(device, eviction):
    """HKV insert_and_evict_test ``test_insert_and_evict_advanced_*`` feed batches larger than
    the free room; one batch larger than the whole table is refused by sparsekit's
    contract (the contract (docs/api.md): the call's keys are never evicted), with nothing changed:
    contents, rows, scores, clock, and the table still evicts normally afterwards."""
    capacity = 64
    table = sk.HashTable(capacity, device=device, eviction=eviction)
    model = TableModel(capacity, eviction)
    insert_both(table, model, list(range(-32, 32)), device)
    table.tick()
    model.clock += 1
    insert_both(table, model, list(range(65)), device)  # 65 distinct: raises
    insert_both(table, model, [7] * 1000 + list(range(100, 163)), device)  # 64 distinct: fits
    assert_same(table, model)


# -- HierarchicalKV: evict strategies ---------------------------------------------------------


def test_evict_strategy_lru_basic(device):
    """HKV ``test_evict_strategy_lru_basic`` (merlin_hashtable, find_or_insert, assign_score):
    base keys inserted at an early clock, test keys later; when the table is full the keys
    with the oldest scores go, the newer ones stay, and a re-touched old key survives."""
    capacity = 128
    base = list(range(1000, 1000 + capacity))
    table = sk.HashTable(capacity, device=device, eviction="lru")
    model = TableModel(capacity, "lru")
    for i in range(0, capacity, 16):          # base keys at clocks 0..7, 16 per clock
        insert_both(table, model, base[i:i + 16], device)
        table.tick()
        model.clock += 1
    table.touch(_t(base[:4], device))         # 4 of the oldest are seen again
    model.touch(base[:4])
    test = list(range(-50, -50 + 40))
    _, evicted = insert_both(table, model, test, device)
    assert [key for key, _ in evicted] == base[4:44]
    assert_same(table, model)


def test_evict_strategy_lfu_keeps_hot_keys(device):
    """HKV ``test_evict_strategy_lfu_basic`` and dynamicemb test_lru_lfu
    ``test_lru_lfu_eviction_by_frequency``: a hot subset boosted far above the rest survives
    a flood of new keys although the cold keys and the newcomers are more recent; ties of
    count go to the older, then the smaller key."""
    capacity = 128
    table = sk.HashTable(capacity, device=device, eviction="lfu")
    model = TableModel(capacity, "lfu")
    keys = list(range(1, 101))
    insert_both(table, model, keys, device)
    hot = keys[:10]
    for _ in range(20):
        table.tick()
        model.clock += 1
        model.touch(hot)
        table.touch(_t(hot, device))
    assert table.scores(_t(hot, device))[1].tolist() == [21] * 10
    for start in (100000, 200000, 300000):
        table.tick()
        model.clock += 1
        _, evicted = insert_both(table, model, list(range(start, start + 100)), device)
        assert evicted and {key for key, _ in evicted}.isdisjoint(hot)
    assert (table.find(_t(hot, device)) >= 0).all()
    assert_same(table, model)


def test_frequency_accumulates_and_find_is_const(device):
    """dynamicemb test_lru_lfu ``test_lru_lfu_frequency_accumulation``: a first insert gives
    frequency 1, each training access (insert or touch) adds one, a CONST lookup (``find``)
    reads without counting, and the timestamp (``last_seen``) never decreases. Also an
    all-duplicate batch adds its occurrences (the contract (docs/api.md))."""
    keys = _t(list(range(1000, 1100)), device)
    table = sk.HashTable(4096, device=device, eviction="lfu")
    table.insert(keys)
    assert table.scores(keys)[1].eq(1).all()
    stamps = table.scores(keys)[0]
    table.tick()
    table.touch(keys)
    table.tick()
    table.insert(keys)
    table.find(keys)
    table.find(keys)
    last_seen, count = table.scores(keys)
    assert count.eq(3).all() and (last_seen >= stamps).all() and last_seen.eq(2).all()
    table.insert(torch.full((1000,), 1000, dtype=torch.int64, device=device))
    table.touch(torch.full((7,), 1001, dtype=torch.int64, device=device))
    assert table.scores(_t([1000, 1001, 1002], device))[1].tolist() == [1003, 10, 3]
    assert len(table) == 100


def test_duplicate_keys_in_one_batch_get_one_row(device):
    """HKV find_or_insert_test ``test_find_or_insert_values_check`` (a batch with repeated
    keys gets one slot per key): an all-duplicate batch, and one mixing sentinels in
    repeats, give each key one row in order of first occurrence."""
    table = sk.HashTable(64, device=device)
    rows = table.insert(torch.full((5000,), INT64_MIN, dtype=torch.int64, device=device))
    assert rows.eq(0).all() and len(table) == 1
    keys = [INT64_MAX, -1, INT64_MAX, 0, -1, INT64_MIN, 0] * 300
    first = {INT64_MAX: 1, -1: 2, 0: 3, INT64_MIN: 0}
    assert table.insert(_t(keys, device)).tolist() == [first[key] for key in keys]
    assert len(table) == 4


# -- HierarchicalKV: rehash (here: the tombstone rebuild) and a long random run ---------------


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_rehash_after_many_evictions_keeps_every_key(device, eviction):
    """HKV ``test_rehash`` / ``test_dynamic_rehash_on_multi_threads``: the table reorganises
    its slots (HKV: grows and rehashes; here: evictions leave tombstones, rebuilt once they
    reach a quarter of the slots) and every key stays findable with its row and scores;
    keys share their low bits so probes are long."""
    capacity = 500
    table = sk.HashTable(capacity, device=device, eviction=eviction)
    model = TableModel(capacity, eviction)
    for step in range(20):
        keys = [(step * 250 + j) << 24 for j in range(250)]
        insert_both(table, model, keys + keys[:50], device)
        table.tick()
        model.clock += 1
        assert table._tombstones * 4 <= table.num_slots
    assert_same(table, model)
    everything = [j << 24 for j in range(20 * 250)]
    assert table.find(_t(everything, device)).tolist() == model.find(everything)


def _random_keys(rng, pool, n):
    if rng.random() < 0.2:
        return [rng.choice(pool)] * n
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("eviction", [None, "lru", "lfu"])
@pytest.mark.parametrize("capacity", [1, 3, 16, 17, 100])
def test_random_operations_against_the_dict_model(device, eviction, capacity):
    """HKV ``test_insert_or_assign_values_check`` / ``test_accum_or_assign_values_check`` and
    dynamicemb test_table_operation: a random mix of insert, touch, tick, find, clear and a
    state round trip, each checked against ``TableModel`` (rows, evicted pairs, scores,
    raising), with sentinel keys and keys that collide in the low bits."""
    rng = random.Random(capacity * 7 + len(str(eviction)))
    pool = SENTINELS + [j << k for k in (16, 32, 60) for j in range(-8, 8)]
    pool += [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(30)]
    pool = list(dict.fromkeys(pool))
    table = sk.HashTable(capacity, device=device, eviction=eviction)
    model = TableModel(capacity, eviction)
    for _ in range(60):
        op = rng.random()
        n = rng.choice([0, 1, 2, capacity // 2, capacity, capacity + 1, 3 * capacity])
        keys = _random_keys(rng, pool, n)
        if op < 0.55:
            insert_both(table, model, keys, device)
        elif op < 0.7:
            assert table.touch(_t(keys, device)).tolist() == model.touch(keys)
        elif op < 0.85:
            table.tick()
            model.clock += 1
        elif op < 0.93:
            assert table.find(_t(pool, device)).tolist() == model.find(pool)
        elif op < 0.96:
            table.clear()
            model.clear()
        else:
            state = table.state_dict()
            table = sk.HashTable(capacity, device=device, eviction=eviction)
            table.load_state_dict(state)
        assert_same(table, model)
    assert table.find(_t(pool, device)).tolist() == model.find(pool)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_victim_selection_across_select_chunks(device, eviction):
    """HKV ``test_evict_strategy_customized_correct_rate`` (the fraction of correctly chosen
    victims over a large table): here every victim must be exactly the model's, at a size
    whose victim selection runs over several of its 2^14-row chunks on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        capacity = 40000
        rng = random.Random(5)
        table = sk.HashTable(capacity, device=device, eviction=eviction)
        model = TableModel(capacity, eviction)
        fresh = iter(range(1, 10**9))
        for step in range(5):
            keys = [next(fresh) << 30 for _ in range(capacity // 2 if step else capacity)]
            if model.keys:
                keys += [rng.choice(model.keys) for _ in range(capacity // 4)]
            insert_both(table, model, keys, device)
            table.tick()
            model.clock += 1
            touched = [rng.choice(model.keys) for _ in range(capacity // 8)]
            assert table.touch(_t(touched, device)).tolist() == model.touch(touched)
        assert_same(table, model)
    finally:
        torch.set_num_threads(threads)


def test_find_or_insert_from_several_threads(device):
    """HKV ``test_find_or_insert_multi_threads`` / ``test_insert_or_assign_multi_threads``:
    threads inserting overlapping keys into one table at once leave every key exactly
    once, rows a bijection onto ``0 .. len - 1``, and every thread got each key's final
    row."""
    table = sk.HashTable(60000, device=device)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(-(2**40), 2**40, (6000,), generator=generator) >> 20 << 20 for _ in range(6)]
    batches = [batch.to(device) for batch in batches]
    results = [None] * len(batches)

    def work(i):
        results[i] = table.insert(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    distinct = torch.cat(batches).unique()
    keys, rows = table.export()
    assert len(table) == distinct.numel()
    assert torch.equal(keys.sort().values, distinct)
    assert torch.equal(table.find(keys), rows)
    for batch, result in zip(batches, results):
        assert torch.equal(table.find(batch), result)


# -- HierarchicalKV: export_batch_if, save_and_load; dynamicemb: incremental dump -------------


def test_export_if_last_seen_at_least(device):
    """HKV export_batch_if_test ``test_export_batch_if_with_limited_size`` and merlin
    ``test_export_batch_if`` (export the keys whose score passes a predicate): ``export
    (min_last_seen=t)`` returns exactly the keys last seen at clock >= t, in row order, and
    a bound past either end of int64 selects none or all."""
    table = sk.HashTable(300, device=device, eviction="lru")
    model = TableModel(300, "lru")
    rng = random.Random(3)
    for _ in range(12):
        keys = [rng.randrange(-500, 500) for _ in range(40)]
        insert_both(table, model, keys, device)
        touched = [rng.randrange(-500, 500) for _ in range(40)]
        table.touch(_t(touched, device))
        model.touch(touched)
        table.tick()
        model.clock += 1
    for bound in [None, -(2**70), INT64_MIN, -1, 0, 1, 5, 11, 12, 13, INT64_MAX, 2**70]:
        keys, rows = table.export(min_last_seen=bound)
        assert (keys.tolist(), rows.tolist()) == model.export(bound)


def test_incremental_dump_retouch(device):
    """dynamicemb incremental_dump ``test_lfu_incremental_dump_retouch``: a dump bounded by the
    clock of the previous dump returns exactly the keys accessed since: a re-touched key
    again, an untouched one not, and a window without accesses nothing."""
    table = sk.HashTable(1000, device=device, eviction="lfu")
    keys_a = list(range(1001, 1101))
    keys_b = list(range(1001, 1051))
    keys_c = list(range(2001, 2051))
    since = table.clock
    table.insert(_t(keys_a, device))
    table.tick()
    assert set(table.export(min_last_seen=since)[0].tolist()) == set(keys_a)
    since = table.clock
    table.touch(_t(keys_b, device))
    table.insert(_t(keys_c, device))
    table.tick()
    assert set(table.export(min_last_seen=since)[0].tolist()) == set(keys_b) | set(keys_c)
    since = table.clock
    assert table.export(min_last_seen=since)[0].numel() == 0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_save_and_load_keeps_rows_scores_and_eviction_order(device, eviction):
    """HKV save_and_load_test ``test_save_and_load_on_{lru,lfu}`` and dynamicemb
    test_lru_lfu ``test_lru_lfu_gather_scatter_roundtrip`` / ``_copy_score_blocks_roundtrip``
    (a rehash into a larger table): a state saved and loaded into a table of the same or a
    larger capacity has the same keys, rows, scores and clock, and evicts the same keys
    next (with the larger table's room counted)."""
    capacity = 200
    table = sk.HashTable(capacity, device=device, eviction=eviction)
    model = TableModel(capacity, eviction)
    rng = random.Random(11)
    for _ in range(8):
        insert_both(table, model, [rng.randrange(-300, 300) for _ in range(60)], device)
        table.tick()
        model.clock += 1
    state = table.state_dict()
    for new_capacity in (capacity, 2 * capacity):
        loaded = sk.HashTable(new_capacity, device=device, eviction=eviction)
        loaded.load_state_dict(state)
        copy = TableModel(new_capacity, eviction)
        copy.keys, copy.last_seen, copy.count = list(model.keys), list(model.last_seen), list(model.count)
        copy.rows, copy.clock = dict(model.rows), model.clock
        assert_same(loaded, copy)
        insert_both(loaded, copy, list(range(1000, 1000 + new_capacity)), device)
        assert_same(loaded, copy)
    smaller = sk.HashTable(len(model) - 1, device=device, eviction=eviction)
    smaller.insert(_t([5], device))
    with pytest.raises(HashTableFullError):
        smaller.load_state_dict(state)
    assert smaller.export()[0].tolist() == [5]


# -- dynamicemb: admission and LFU scores in a layer --------------------------------------------


def _bags(keys):
    values = torch.tensor(keys, dtype=torch.int64)
    return sk.Ragged(values, torch.arange(len(keys) + 1))


@pytest.mark.parametrize("eviction", [None, "lru", "lfu"])
@pytest.mark.parametrize("admit_after", [1, 3])
def test_admission_and_scores_against_counting(eviction, admit_after):
    """dynamicemb test_embedding_admission ``test_admission_strategy_validation`` (only keys
    seen at least ``threshold`` times hold a row, compared with naive counting) and
    test_lfu_scores ``test_lfu_score_validation`` (a key's LFU score is its count): a
    one-process layer trained on random batches against a model of the contract (docs/api.md): a key is
    admitted in the ``admit_after``-th training step it is seen in; until then it reads as
    zeros; a held key's ``count`` is the number of steps it was seen in and its ``last_seen``
    the clock of the last; eviction chooses among keys not in the step; ``eval()`` counts
    nothing; ``stats()`` totals agree."""
    capacity = 40 if eviction else 400
    layer = sk.DistributedEmbedding("sum", capacity, 4, 1, 1, eviction=eviction, admit_after=admit_after,
                                    admission_capacity=400)
    rng = random.Random(admit_after)
    held = {}       # key -> [last_seen, count]
    pending = {}    # key -> steps seen
    admitted = evicted = clock = 0
    for step in range(25):
        batch = [rng.randrange(0, 60) for _ in range(30)]
        distinct = list(dict.fromkeys(batch))
        if len(distinct) > capacity:
            continue
        if step % 7 == 6:
            layer.eval()
            out = layer(_bags(batch))
            layer.train()
            assert all(out[i].abs().sum().item() > 0 for i, key in enumerate(batch) if key in held)
            continue
        new = []
        for key in distinct:
            if key in held:
                held[key] = [clock, held[key][1] + 1]
            else:
                pending[key] = pending.get(key, 0) + 1
                if pending[key] >= admit_after:
                    new.append(key)
                    del pending[key]
        excess = len(held) + len(new) - capacity
        if excess > 0:
            candidates = [key for key in held if key not in distinct]
            if eviction == "lru":
                candidates.sort(key=lambda key: (held[key][0], key))
            else:
                candidates.sort(key=lambda key: (held[key][1], held[key][0], key))
            for key in candidates[:excess]:
                del held[key]
            evicted += excess
        for key in new:
            held[key] = [clock, 1]
        admitted += len(new)
        out = layer(_bags(batch))
        clock += 1
        assert layer.hash_table.clock == clock
        for i, key in enumerate(batch):
            assert (out[i].abs().sum().item() > 0) == (key in held), (step, key)
        keys, _ = layer.export()
        assert sorted(keys.tolist()) == sorted(held)
        last_seen, count = layer.hash_table.scores(keys)
        assert [[a, b] for a, b in zip(last_seen.tolist(), count.tolist())] == [held[key] for key in keys.tolist()]
        stats = layer.stats()
        assert (stats["size"], stats["evicted"], stats["admitted"], stats["pending"]) == \
            (len(held), evicted, admitted, len(pending))

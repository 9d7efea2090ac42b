"""The multi-table hash ops of an EmbeddingBagCollection's owner step (CPU):
hash_table_find_tables against hash_table_find table by table, hash_table_score_tables_
against HashTable's own scoring; and the collection built on them, whose tables' rows,
scores and gradients must not depend on how many tables share a step.

Thresholds crossed (keep in step with csrc/cpu/hashtable_cpu.cpp): tasks of 4096 keys
(kHashGrain) that start inside a table, span several small tables or skip empty ones, and
tables of 2^17 slots and more (the prefetching find).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from _distributed import spawn

import sparsekit as sk
from sparsekit.hashtable import HashTable, HashTableFullError, _find_in_tables, _touch_tables
from properties import examples, num_threads, thread_counts

find_tables = torch.ops.sparsekit.hash_table_find_tables
score_tables = torch.ops.sparsekit.hash_table_score_tables_


def make_tables(capacities, seed):
    """Tables filled to about half their capacity with keys drawn from a range twice as
    wide (so about half the lookups below miss), the keys of each table [n_t]."""
    g = torch.Generator().manual_seed(seed)
    tables, contents = [], []
    for capacity in capacities:
        table = HashTable(capacity)
        keys = torch.unique(torch.randint(-capacity, capacity, (capacity // 2,), generator=g))
        table.insert(keys)
        tables.append(table)
        contents.append(keys)
    return tables, g


def queries(capacities, counts, g, dtype=torch.int64):
    parts = [torch.randint(-c, c, (n,), generator=g) for c, n in zip(capacities, counts)]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return torch.cat(parts).to(dtype), offsets


@examples(15)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=1, max_size=6),
       counts=st.lists(st.sampled_from([0, 1, 17, 4095, 4096, 4097, 9_000]), min_size=6, max_size=6),
       dtype=st.sampled_from([torch.int64, torch.int32]), threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_find_tables_matches_find_table_by_table(capacities, counts, dtype, threads, seed):
    tables, g = make_tables(capacities, seed)
    counts = counts[:len(tables)]
    keys, offsets = queries(capacities, counts, g, dtype)
    with num_threads(threads):
        got = find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, offsets)
    want = torch.cat([t.find(keys[a:b]) for t, a, b in zip(tables, offsets, offsets[1:])])
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_find_tables_with_a_large_table_prefetches_and_agrees():
    tables, g = make_tables([200_000, 10], 5)  # 2^19 slots: the prefetching loop
    keys, offsets = queries([200_000, 10], [50_000, 5], g)
    got = find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, offsets)
    assert torch.equal(got, torch.cat([tables[0].find(keys[:50_000]), tables[1].find(keys[50_000:])]))


@examples(15)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000]), min_size=1, max_size=5),
       threads=thread_counts, seed=st.integers(0, 2**31 - 1), repeat=st.booleans())
def test_score_tables_matches_the_tables_own_scoring(capacities, threads, seed, repeat):
    tables, g = make_tables(capacities, seed)
    references, _ = make_tables(capacities, seed)
    for table, reference in zip(tables, references):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            table.tick()
            reference.tick()
    parts, offsets = [], [0]
    for table, reference in zip(tables, references):
        rows = torch.randint(-1, max(1, len(table)), (int(torch.randint(0, 9_000, (1,), generator=g)),),
                             generator=g)
        rows = rows[rows < len(table)]
        if not repeat:  # distinct rows (and -1s), as the owner step gives them
            rows = torch.unique(rows)
        parts.append(rows)
        offsets.append(offsets[-1] + rows.numel())
        present = rows[rows >= 0]
        distinct, counts = torch.unique(present, return_counts=True)
        reference._score(distinct, counts)
    with num_threads(threads):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], torch.cat(parts), offsets,
                     [t.clock for t in tables])
    for table, reference in zip(tables, references):
        assert torch.equal(table._last_seen, reference._last_seen)
        assert torch.equal(table._count, reference._count)


def test_score_tables_rejects_a_row_outside_its_table_and_changes_nothing():
    tables, _ = make_tables([100, 100], 1)
    before = [(t._last_seen.clone(), t._count.clone()) for t in tables]
    rows = torch.tensor([0, 1, 2, 3, 100, 5])
    with pytest.raises(RuntimeError, match=r"rows\[4\] = 100 of table 1 is outside its scores \[-1, 100\)"):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], rows, [0, 3, 6], [1, 1])
    with pytest.raises(RuntimeError, match=r"rows\[0\] = -2 of table 0"):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], torch.tensor([-2, 0]), [0, 1, 2],
                     [1, 1])
    for t, (seen, count) in zip(tables, before):
        assert torch.equal(t._last_seen, seen) and torch.equal(t._count, count)


@pytest.mark.parametrize("offsets, message", [
    ([0, 2], "offsets must hold one more entry than there are tables"),
    ([0, 1, 3], "offsets must run from 0 to 2"),
    ([1, 1, 2], "offsets must run from 0 to 2"),
])
def test_find_tables_rejects_bad_offsets(offsets, message):
    tables, _ = make_tables([10, 10], 0)
    with pytest.raises(RuntimeError, match=message):
        find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], torch.tensor([1, 2]), offsets)


def test_find_tables_rejects_decreasing_offsets_and_mismatched_lists():
    tables, _ = make_tables([10, 10, 10], 0)
    slot_keys, slot_rows = [t._slot_keys for t in tables], [t._slot_rows for t in tables]
    with pytest.raises(RuntimeError, match=r"offsets must never decrease, got offsets\[1\] = 2 > offsets\[2\] = 1"):
        find_tables(slot_keys, slot_rows, torch.tensor([1, 2]), [0, 2, 1, 2])
    with pytest.raises(RuntimeError, match="slot_keys holds 3 tables but slot_rows 2"):
        find_tables(slot_keys, slot_rows[:2], torch.tensor([1, 2]), [0, 1, 2, 2])
    with pytest.raises(RuntimeError, match="hash_table_find_tables: keys must be an int64 or int32 tensor"):
        find_tables(slot_keys, slot_rows, torch.tensor([1.0, 2.0]), [0, 1, 2, 2])


def test_find_tables_opcheck():
    tables, g = make_tables([100, 5_000], 2)
    keys, offsets = queries([100, 5_000], [30, 300], g)
    torch.library.opcheck(find_tables, ([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys,
                                        offsets))


def test_python_helpers_agree_with_the_tables():
    tables, g = make_tables([100, 300], 4)
    keys, offsets = queries([100, 300], [50, 80], g)
    rows = _find_in_tables(tables, keys, offsets)
    assert torch.equal(rows, torch.cat([tables[0].find(keys[:50]), tables[1].find(keys[50:])]))
    for t in tables:
        t.tick()
    distinct = torch.cat([torch.unique(rows[:50]), torch.unique(rows[50:])])
    sizes = [torch.unique(rows[:50]).numel()]
    _touch_tables(tables, distinct, [0, sizes[0], distinct.numel()])
    for t, part in zip(tables, (torch.unique(rows[:50]), torch.unique(rows[50:]))):
        part = part[part >= 0]
        assert bool((t._last_seen[part] == 1).all())
        assert bool((t._count[part] == 2).all())  # inserted once, touched once


# -- the collection's owner step over many tables -------------------------------------------------

def _collection(num_tables, **extra):
    configs = [sk.TableConfig(f"t{i}", 4 + 4 * (i % 2), 64, [f"f{i}"], **extra.get(i, {}))
               for i in range(num_tables)]
    return sk.EmbeddingBagCollection(configs)


def _batch(num_tables, batch, high, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, high, (num_tables * batch,), generator=g)
    return sk.KeyedJagged([f"f{i}" for i in range(num_tables)], values,
                          lengths=torch.ones(num_tables * batch, dtype=torch.int64))


class _NoGrowPlan(tuple):
    """Stands in for the collection's _GrowRows: every table plans its insert on its own."""

    def __new__(cls, *args):
        return None


def test_tables_with_and_without_new_keys_in_one_step_score_like_single_tables(monkeypatch):
    """Steps where some tables meet only known keys (scored together) and others new ones
    (placed together), against one table per collection fed the same keys that inserts
    them as a single layer does (HashTable's own insert plan)."""
    import sparsekit.collection as collection

    grow_rows = collection._GrowRows
    num_tables, batch = 5, 24
    together = _collection(num_tables)
    alone = [sk.EmbeddingBagCollection([sk.TableConfig(f"t{i}", 4 + 4 * (i % 2), 64, [f"f{i}"])])
             for i in range(num_tables)]
    for step in range(6):
        # Table i sees keys from a range that grows with the step for odd tables only.
        kjt = _batch(num_tables, batch, 40, step)
        values = kjt.values().view(num_tables, batch).clone()
        values[1::2] += 3 * step
        kjt = sk.KeyedJagged(kjt.keys(), values.reshape(-1), lengths=kjt.lengths())
        monkeypatch.setattr(collection, "_GrowRows", grow_rows)
        out = together(kjt)
        monkeypatch.setattr(collection, "_GrowRows", _NoGrowPlan)  # the single layers' insert
        for i, single in enumerate(alone):
            mine = single(sk.KeyedJagged([f"f{i}"], values[i], lengths=torch.ones(batch, dtype=torch.int64)))
            torch.testing.assert_close(out[f"f{i}"], mine[f"f{i}"], rtol=0, atol=0)
    for i, single in enumerate(alone):
        a, b = together.shards[i].hash_table, single.shards[0].hash_table
        assert len(a) == len(b) and a.clock == b.clock == 6
        assert together.stats(f"t{i}") == single.stats(f"t{i}")
        assert torch.equal(together.shards[i].weight, single.shards[0].weight)
        assert torch.equal(a._slot_keys, b._slot_keys) and torch.equal(a._slot_rows, b._slot_rows)
        keys_a, _ = together.export(f"t{i}")
        keys_b, _ = single.export(f"t{i}")
        assert torch.equal(keys_a, keys_b)
        assert torch.equal(a._last_seen[:len(a)], b._last_seen[:len(b)])
        assert torch.equal(a._count[:len(a)], b._count[:len(b)])
        recent = together.export(f"t{i}", min_last_seen=6)[0]
        assert torch.equal(recent, single.export(f"t{i}", min_last_seen=6)[0])


def test_gradients_of_many_tables_match_a_dense_reference():
    num_tables, batch = 7, 33
    ebc = _collection(num_tables)
    kjt = _batch(num_tables, batch, 50, 1)
    ebc(kjt)  # insert the keys; the second step takes the all-present path
    for shard in ebc.shards:
        shard.weight.grad = None
    out = ebc(kjt)
    grads_out = {f: torch.randn_like(v) for f, v in out.items()}
    torch.autograd.backward([out[f] for f in grads_out], [grads_out[f] for f in grads_out])
    values = kjt.values().view(num_tables, batch)
    for i, shard in enumerate(ebc.shards):
        grad = shard.weight.grad
        assert grad.is_sparse and grad.is_coalesced()
        rows = shard.hash_table.find(values[i])
        want = torch.zeros_like(shard.weight).index_add_(0, rows, grads_out[f"f{i}"])
        torch.testing.assert_close(grad.to_dense(), want)
        indices = grad._indices()[0]
        assert torch.equal(indices, torch.unique(rows))  # ascending, one entry per touched row


def test_eval_misses_and_mixed_table_kinds_in_one_step():
    """Direct, hash, admission and eviction tables side by side; eval reads absent keys as
    zeros and changes no table."""
    ebc = sk.EmbeddingBagCollection([
        sk.TableConfig("hash", 4, 64, ["a"]),
        sk.TableConfig("direct", 4, 64, ["b"], use_hashtable=False),
        sk.TableConfig("admit", 4, 64, ["c"], admit_after=2),
        sk.TableConfig("lru", 4, 8, ["d"], eviction="lru"),
    ])
    kjt = sk.KeyedJagged(["a", "b", "c", "d"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
                         lengths=torch.ones(8, dtype=torch.int64))
    ebc(kjt)
    assert ebc.stats("admit")["size"] == 0 and ebc.stats("admit")["pending"] == 2
    ebc(kjt)
    assert ebc.stats("admit")["size"] == 2
    ebc.eval()
    sizes = {name: ebc.stats(name)["size"] for name in ("hash", "admit", "lru")}
    clocks = [s.hash_table.clock for s in ebc.shards if s.hash_table is not None]
    unseen = sk.KeyedJagged(["a", "b", "c", "d"], torch.tensor([1, 99, 2, 3, 50, 6, 7, 77]),
                            lengths=torch.ones(8, dtype=torch.int64))
    out = ebc(unseen)
    assert torch.equal(out["a"][1], torch.zeros(4)) and torch.equal(out["c"][0], torch.zeros(4))
    assert torch.equal(out["d"][1], torch.zeros(4))
    assert torch.equal(out["a"][0], ebc.weights["hash"][ebc.shards[0].hash_table.find(torch.tensor([1]))[0]])
    assert {name: ebc.stats(name)["size"] for name in sizes} == sizes
    assert [s.hash_table.clock for s in ebc.shards if s.hash_table is not None] == clocks


def test_a_full_table_among_many_changes_no_table():
    ebc = sk.EmbeddingBagCollection([sk.TableConfig(f"t{i}", 4, 4 if i == 2 else 64, [f"f{i}"]) for i in range(4)])
    ebc(sk.KeyedJagged([f"f{i}" for i in range(4)], torch.tensor([0, 1, 2] * 4),
                       lengths=torch.ones(12, dtype=torch.int64)))  # every table holds keys 0, 1, 2
    state = [(s.hash_table._last_seen.clone(), s.hash_table._count.clone(), len(s.hash_table), s.hash_table.clock)
             for s in ebc.shards]
    # Table 0 meets known keys only (scored together), 1 and 3 new ones, 2 more than it holds.
    values = torch.tensor([0, 1, 2, 0, 1] + [0, 1, 2, 3, 4] + [10, 11, 12, 13, 14] + [0, 1, 2, 3, 4])
    with pytest.raises(sk.HashTableFullError, match="t2"):
        ebc(sk.KeyedJagged([f"f{i}" for i in range(4)], values, lengths=torch.ones(20, dtype=torch.int64)))
    for shard, (seen, count, size, clock) in zip(ebc.shards, state):
        table = shard.hash_table
        assert torch.equal(table._last_seen, seen) and torch.equal(table._count, count)
        assert len(table) == size and table.clock == clock


def _full_on_one_rank_worker(rank, world_size, init):
    """Rank 0 owns the odd keys of table "small" (owner uint64(key + 1) % 2): its second
    step brings three new ones to a table of two, while every table's other keys are
    present (scored together). Every rank raises and no table changes anywhere."""
    init()
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 64, ["fa"]), sk.TableConfig("small", 4, 2, ["fs"])])

    def step(a_keys, small_keys):
        return ebc(sk.KeyedJagged(["fa", "fs"], torch.tensor(a_keys + small_keys),
                                  lengths=torch.ones(len(a_keys) + len(small_keys), dtype=torch.int64)))

    step([0, 1, 2, 3], [0, 1, 0, 1])  # every owner holds one key of "small"
    state = [(s.hash_table._last_seen.clone(), s.hash_table._count.clone(), len(s.hash_table), s.hash_table.clock)
             for s in ebc.shards]
    if rank == 0:
        with pytest.raises(HashTableFullError, match="table 'small'.*full"):
            step([0, 1, 2, 3], [3, 5, 7, 0])
    else:
        with pytest.raises(HashTableFullError, match="on rank 0 a hash table is full"):
            step([0, 1, 2, 3], [1, 0, 1, 0])
    for shard, (seen, count, size, clock) in zip(ebc.shards, state):
        table = shard.hash_table
        assert torch.equal(table._last_seen, seen) and torch.equal(table._count, count)
        assert len(table) == size and table.clock == clock
    step([0, 1, 2, 3], [0, 1, 0, 1])  # the group is still in step
    assert ebc.stats("small")["size"] == 2 and ebc.stats("a")["size"] == 4


def test_a_full_table_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path):
    spawn(_full_on_one_rank_worker, 2, str(tmp_path))

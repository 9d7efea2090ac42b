"""The multi-table hash ops of an EmbeddingBagCollection's owner step (CPU):
hash_table_find_tables against hash_table_find table by table, hash_table_score_tables_
against HashTable's own scoring, hash_table_place_tables_ (and _grow_tables, its
fallback elsewhere) against HashTable's own insert; and the collection built on them, whose tables' rows,
scores and gradients must not depend on how many tables share a step.

Thresholds crossed (keep in step with csrc/cpu/hashtable_cpu.cpp): tasks of 4096 keys
(kHashGrain) that start inside a table, span several small tables or skip empty ones, and
tables of 2^17 slots and more (the prefetching find) and of 2^16 rows and more (the
prefetching scoring).

Tests of the ops themselves take the `device` fixture (on CUDA the composites of
sparsekit/tables_cuda.py); those marked "CPU only" are about the fakes (opcheck), the CPU
kernel's prefetching paths, the Python helpers' CPU paths and the collection on the CPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from _distributed import spawn

import sparsekit as sk
from sparsekit import engine
from sparsekit.hashtable import HashTable, HashTableFullError, _find_in_tables, _grow_tables, _touch_tables
from properties import KEY_DISTRIBUTIONS, examples, make_keys, num_threads, thread_counts

find_tables = torch.ops.sparsekit.hash_table_find_tables
score_tables = torch.ops.sparsekit.hash_table_score_tables_
place_tables = torch.ops.sparsekit.hash_table_place_tables_


def make_tables(capacities, seed, device="cpu"):
    """Tables filled to about half their capacity with keys drawn from a range twice as
    wide (so about half the lookups below miss), the keys of each table [n_t]."""
    g = torch.Generator().manual_seed(seed)
    tables, contents = [], []
    for capacity in capacities:
        table = HashTable(capacity, device=device)
        keys = torch.unique(torch.randint(-capacity, capacity, (capacity // 2,), generator=g)).to(device)
        table.insert(keys)
        tables.append(table)
        contents.append(keys)
    return tables, g


def queries(capacities, counts, g, dtype=torch.int64, device="cpu"):
    parts = [torch.randint(-c, c, (n,), generator=g) for c, n in zip(capacities, counts)]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return torch.cat(parts).to(dtype).to(device), offsets


@examples(15)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=1, max_size=6),
       counts=st.lists(st.sampled_from([0, 1, 17, 4095, 4096, 4097, 9_000]), min_size=6, max_size=6),
       dtype=st.sampled_from([torch.int64, torch.int32]), threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_find_tables_matches_find_table_by_table(capacities, counts, dtype, threads, seed, device):
    tables, g = make_tables(capacities, seed, device)
    counts = counts[:len(tables)]
    keys, offsets = queries(capacities, counts, g, dtype, device)
    with num_threads(threads):
        got = find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, offsets)
    want = torch.cat([t.find(keys[a:b]) for t, a, b in zip(tables, offsets, offsets[1:])])
    assert got.dtype == torch.int64 and got.device == keys.device and torch.equal(got, want)


# CPU only: the CPU kernel's prefetching loop.
def test_find_tables_with_a_large_table_prefetches_and_agrees():
    tables, g = make_tables([200_000, 10], 5)  # 2^19 slots: the prefetching loop
    keys, offsets = queries([200_000, 10], [50_000, 5], g)
    got = find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, offsets)
    assert torch.equal(got, torch.cat([tables[0].find(keys[:50_000]), tables[1].find(keys[50_000:])]))


@examples(15)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=1, max_size=5),
       threads=thread_counts, seed=st.integers(0, 2**31 - 1), order=st.sampled_from(["random", "distinct", "sorted"]))
def test_score_tables_matches_the_tables_own_scoring(capacities, threads, seed, order, device):
    """Rows in any order with repeats (atomic counts), distinct and ascending as the owner
    step gives them (plain writes), or ascending with repeats (equal neighbours: atomic)."""
    tables, g = make_tables(capacities, seed, device)
    references, _ = make_tables(capacities, seed, device)
    for table, reference in zip(tables, references):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            table.tick()
            reference.tick()
    parts, offsets = [], [0]
    for table, reference in zip(tables, references):
        rows = torch.randint(-1, max(1, len(table)), (int(torch.randint(0, 9_000, (1,), generator=g)),),
                             generator=g)
        rows = rows[rows < len(table)]
        if order == "distinct":  # distinct rows (and -1s), as the owner step gives them
            rows = torch.unique(rows)
        elif order == "sorted":
            rows = torch.sort(rows).values
        parts.append(rows)
        offsets.append(offsets[-1] + rows.numel())
        present = rows[rows >= 0]
        distinct, counts = torch.unique(present, return_counts=True)
        reference._score(distinct.to(device), counts.to(device))
    with num_threads(threads):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], torch.cat(parts).to(device), offsets,
                     [t.clock for t in tables])
    for table, reference in zip(tables, references):
        assert torch.equal(table._last_seen, reference._last_seen)
        assert torch.equal(table._count, reference._count)


def test_score_tables_rejects_a_row_outside_its_table_and_changes_nothing(device):
    tables, _ = make_tables([100, 100], 1, device)
    before = [(t._last_seen.clone(), t._count.clone()) for t in tables]
    rows = torch.tensor([0, 1, 2, 3, 100, 5], device=device)
    with pytest.raises(RuntimeError, match=r"rows\[4\] = 100 of table 1 is outside its scores \[-1, 100\)"):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], rows, [0, 3, 6], [1, 1])
    with pytest.raises(RuntimeError, match=r"rows\[0\] = -2 of table 0"):
        score_tables([t._last_seen for t in tables], [t._count for t in tables], torch.tensor([-2, 0], device=device),
                     [0, 1, 2],
                     [1, 1])
    for t, (seen, count) in zip(tables, before):
        assert torch.equal(t._last_seen, seen) and torch.equal(t._count, count)


def _table_state(table):
    return (len(table), table._slot_keys.clone(), table._slot_rows.clone(), table._row_keys.clone(),
            table._count.clone(), table._last_seen.clone())


@examples(15)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=1, max_size=6),
       fill=st.sampled_from([0.0, 0.3, 1.0]), erase=st.booleans(), dtype=st.sampled_from([torch.int64, torch.int32]),
       threads=thread_counts, seed=st.integers(0, 2**31 - 1), cpu_op=st.booleans())
def test_place_tables_matches_the_tables_own_insert(capacities, fill, erase, dtype, threads, seed, cpu_op, device):
    """New keys of several tables (some none, some filling the table to capacity, some
    into tombstones left by an erase) take the rows and scores HashTable.insert gives them:
    the op (through _grow_tables on the CPU, directly elsewhere), or the fallback."""
    tables, g = make_tables(capacities, seed, device)
    references, _ = make_tables(capacities, seed, device)
    if erase:  # tombstones, and counts of freed rows to clear (the collection's truncate path)
        for table, reference in zip(tables, references):
            for t in (table, reference):
                t._count[:len(t)] += 5
                t._remove(t._row_keys[:len(t) // 3].clone())
    for table, reference in zip(tables, references):  # stale counts in free rows: placing clears them, as _place does
        table._count[len(table):] += 7
        reference._count[len(reference):] += 7
    parts = []
    for table in tables:
        room = table.capacity - len(table)
        candidates = torch.unique(torch.randint(-4 * table.capacity - 8, 4 * table.capacity + 8,
                                                (4 * table.capacity + 16,), generator=g)).to(device)
        candidates = candidates[table.find(candidates) < 0].cpu()
        candidates = candidates[torch.randperm(candidates.numel(), generator=g)]
        parts.append(candidates[:int(room * fill)])
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part.numel())
    parts = [part.to(device) for part in parts]
    keys = torch.cat(parts).to(dtype)
    for reference, part in zip(references, parts):
        reference.insert(part.to(reference.key_dtype))
        if part.numel() > 0:  # insert scores what it places; the collection scores after placing
            rows = reference.find(part)
            reference._count[rows] = 0
            reference._last_seen[rows] = 0
    with num_threads(threads):
        if cpu_op and device.type == "cpu":
            _grow_tables(tables, keys, offsets)
        elif cpu_op:  # the op itself (_grow_tables takes the fallback on other devices)
            place_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], [t._row_keys for t in tables],
                         [t._count for t in tables], keys, offsets, [len(t) for t in tables])
            for table, a, b in zip(tables, offsets, offsets[1:]):
                table._size += b - a
        else:  # the fallback other devices take
            for table, a, b in zip(tables, offsets, offsets[1:]):
                if b > a:
                    table._place(keys[a:b], torch.arange(len(table), len(table) + b - a, device=device))
    for table, reference, part in zip(tables, references, parts):
        assert len(table) == len(reference)
        assert torch.equal(table.find(part), reference.find(part))
        assert torch.equal(table._row_keys[:len(table)], reference._row_keys[:len(reference)])
        assert torch.equal(table._count, reference._count) and torch.equal(table._last_seen, reference._last_seen)
        everything = torch.cat([reference._row_keys[:len(reference)], part.long()])
        assert torch.equal(table.find(everything), reference.find(everything))


def test_place_tables_rejects_a_table_without_room_and_changes_no_table(device):
    tables, _ = make_tables([100, 16, 100], 3, device)
    before = [_table_state(t) for t in tables]
    lists = ([t._slot_keys for t in tables], [t._slot_rows for t in tables], [t._row_keys for t in tables],
             [t._count for t in tables])
    keys = torch.arange(1000, 1000 + 3 + 9 + 2, device=device)
    sizes = [len(t) for t in tables]
    with pytest.raises(RuntimeError, match=rf"table 1 holds {sizes[1]} of its 16 rows, so its 9 new keys do not fit; "
                                           "nothing was inserted"):
        place_tables(*lists, keys, [0, 3, 12, 14], sizes)
    with pytest.raises(RuntimeError, match="table 0 holds -1 of its 100 rows"):
        place_tables(*lists, keys[:5], [0, 3, 4, 5], [-1] + sizes[1:])
    with pytest.raises(RuntimeError, match=r"one entry per table"):
        place_tables(*lists, keys[:5], [0, 3, 4, 5], sizes[:2])
    with pytest.raises(RuntimeError, match=r"offsets must run from 0 to 5"):
        place_tables(*lists, keys[:5], [0, 3, 4, 4], sizes)
    with pytest.raises(RuntimeError, match=r"row_keys\[2\] and count\[2\] must be contiguous 1-D int64"):
        place_tables(*lists[:3], lists[3][:2] + [lists[3][2].int()], keys[:5], [0, 3, 4, 5], sizes)
    with pytest.raises(RuntimeError, match="keys must be an int64 or int32 tensor"):
        place_tables(*lists, keys[:5].float(), [0, 3, 4, 5], sizes)
    for table, state in zip(tables, before):
        after = _table_state(table)
        assert after[0] == state[0] and all(torch.equal(a, b) for a, b in zip(after[1:], state[1:]))


# CPU only: the fakes of the multi-table ops accept CPU (and meta) tensors.
def test_place_tables_opcheck():
    tables, _ = make_tables([100, 5_000], 4)
    keys = torch.arange(10**6, 10**6 + 40)
    torch.library.opcheck(place_tables, ([t._slot_keys for t in tables], [t._slot_rows for t in tables],
                                         [t._row_keys for t in tables], [t._count for t in tables], keys,
                                         [0, 10, 40], [len(t) for t in tables]))


@pytest.mark.parametrize("offsets, message", [
    ([0, 2], "offsets must hold one more entry than there are tables"),
    ([0, 1, 3], "offsets must run from 0 to 2"),
    ([1, 1, 2], "offsets must run from 0 to 2"),
])
def test_find_tables_rejects_bad_offsets(offsets, message, device):
    tables, _ = make_tables([10, 10], 0, device)
    with pytest.raises(RuntimeError, match=message):
        find_tables([t._slot_keys for t in tables], [t._slot_rows for t in tables], torch.tensor([1, 2], device=device),
                    offsets)


def test_find_tables_rejects_decreasing_offsets_and_mismatched_lists(device):
    tables, _ = make_tables([10, 10, 10], 0, device)
    slot_keys, slot_rows = [t._slot_keys for t in tables], [t._slot_rows for t in tables]
    with pytest.raises(RuntimeError, match=r"offsets must never decrease, got offsets\[1\] = 2 > offsets\[2\] = 1"):
        find_tables(slot_keys, slot_rows, torch.tensor([1, 2], device=device), [0, 2, 1, 2])
    with pytest.raises(RuntimeError, match="slot_keys holds 3 tables but slot_rows 2"):
        find_tables(slot_keys, slot_rows[:2], torch.tensor([1, 2], device=device), [0, 1, 2, 2])
    with pytest.raises(RuntimeError, match="hash_table_find_tables: keys must be an int64 or int32 tensor"):
        find_tables(slot_keys, slot_rows, torch.tensor([1.0, 2.0], device=device), [0, 1, 2, 2])


# CPU only: the fakes of the multi-table ops accept CPU (and meta) tensors.
def test_find_tables_opcheck():
    tables, g = make_tables([100, 5_000], 2)
    keys, offsets = queries([100, 5_000], [30, 300], g)
    torch.library.opcheck(find_tables, ([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys,
                                        offsets))


# CPU only: the helpers' CPU paths (one op for all tables); elsewhere they go table by table.
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


class _ReportsCuda(torch.Tensor):
    """A CPU tensor whose ``.device`` says cuda: drives a helper's CUDA branch on the CPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_touch_tables_on_cuda_reads_nothing_back_per_table():
    """_touch_tables' CUDA branch scored table by table, dropping each table's -1 rows with a
    boolean mask: a host sync per table, so a collection's training step synced once more per
    table (docs/design.md: the host syncs do not depend on the number of tables). It now calls the one
    multi-table op on CUDA too (tables_cuda's composite: one sync for all tables). Counted
    here on the CPU: the data-dependent-shape ops the branch issues, each a host read on CUDA."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncingOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("nonzero", "_local_scalar_dense", "masked_select") or (
                    name in ("index", "index_put_", "index_put")
                    and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))):
                self.count += 1
            return func(*args, **(kwargs or {}))

    def touch(num_tables):
        tables = [HashTable(64) for _ in range(num_tables)]
        rows = torch.cat([t.insert(torch.arange(10)) for t in tables] + [torch.tensor([-1])])
        offsets = [10 * t for t in range(num_tables)] + [10 * num_tables + 1]  # the last table holds a -1
        for t in tables:
            t.tick()
        mode = SyncingOps()
        with mode:
            _touch_tables(tables, rows.as_subclass(_ReportsCuda), offsets)
        for t in tables:
            assert torch.equal(torch.Tensor(t._count[:10]), torch.full((10,), 2))
            assert torch.equal(torch.Tensor(t._last_seen[:10]), torch.full((10,), 1))
            assert int(t._count[10:].sum()) == 0
        return mode.count

    assert touch(2) == touch(12) == 0


# -- the collection's owner step over many tables (CPU only: the collection, not the ops) ---------

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
    import sparsekit.collection_ranks as collection

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


def test_new_keys_of_tables_sharing_an_initializer_start_as_the_initializer_gives_them():
    """Tables whose initializers are one KeySeededUniform (shared or equal, any dim and
    dtype) get their new keys' vectors from one call per group; each table's new rows must
    still be exactly its initializer's rows for its keys, as a table alone would get."""
    shared = sk.KeySeededUniform(seed=7)
    calls = []

    def custom(keys, dim):
        calls.append(keys.numel())
        return keys.double().unsqueeze(1).expand(-1, dim) / 1000

    inits = [shared, shared, sk.KeySeededUniform(seed=7), shared, sk.KeySeededUniform(seed=8), custom, custom, None]
    dtypes = [torch.float16, torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32,
              torch.float16, torch.float32]
    configs = [sk.TableConfig(f"t{i}", (4, 8, 4, 4, 4, 8, 8, 4)[i], 500, [f"f{i}"], dtype=dtypes[i],
                              initializer=init) for i, init in enumerate(inits)]
    ebc = sk.EmbeddingBagCollection(configs)
    for step in range(3):
        kjt = _batch(len(configs), 40, 300, step)
        ebc(kjt)
    assert len(calls) == 2 * 3  # the custom initializer: once per table per step, never merged
    for i, (config, shard) in enumerate(zip(configs, ebc.shards)):
        keys, vectors = ebc.export(config.name)
        init = config.initializer if config.initializer is not None else shard.embedding_initializer
        expected = init(keys, config.embedding_dim).to(config.dtype)
        assert vectors.dtype == config.dtype and torch.equal(vectors, expected), config.name


def _twin_collections():
    shared = sk.KeySeededUniform(seed=5)
    configs = [sk.TableConfig("a", 4, 300, ["fa", "fa2"]),  # two features read one table
               sk.TableConfig("b", 8, 300, ["fb"], combiner="mean", initializer=shared),
               sk.TableConfig("c", 4, 300, ["fc"], dtype=torch.bfloat16, initializer=shared),
               sk.TableConfig("d", 8, 300, ["fd"], dtype=torch.float16, combiner="mean"),
               sk.TableConfig("big", 12, 80_000, ["fbig"]),
               sk.TableConfig("small", 4, 40, ["fsmall"])]
    return [sk.EmbeddingBagCollection(configs) for _ in range(2)]


def _twin_batch(batch, step, big_range, small_range):
    g = torch.Generator().manual_seed(step)
    features = ["fa", "fb", "fsmall", "fa2", "fbig", "fc", "fd"]  # not in table order
    values = [torch.randint(0, 60, (batch,), generator=g) for _ in features]
    values[2] = torch.randint(0, small_range, (batch,), generator=g)
    values[4] = torch.randint(-big_range, big_range, (batch,), generator=g)
    # The hash tables' own sentinels are keys like any other.
    sentinels = torch.tensor([-2**63, 2**63 - 1, -1, 0, -2**63, 2**63 - 1])[:batch]
    values[4][:sentinels.numel()] = sentinels
    return sk.KeyedJagged(features, torch.cat(values), lengths=torch.ones(batch * len(features), dtype=torch.int64))


def _step_twins(ebcs, optimizers, kjt, step):
    """One training step of twin collections on ``kjt``: the first resolves its rows as the
    engine does (every table's values found together, the new keys deduplicated and placed
    together), the second forced through each table's own plan and commit (the single
    layers' insert); asserts that they end it alike (outputs, gradients, tables with rows,
    scores and clocks, weights, stats, or the same error). Returns the error's message, or
    None."""
    results = []
    for ebc, optimizer, first in zip(ebcs, optimizers, (True, False)):
        with mock.patch.object(engine, "_evolving", _BATCHED if first else _PER_TABLE):
            try:
                out = ebc(kjt)
            except HashTableFullError as error:
                results.append(str(error))
                continue
        loss = sum((v.float() * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values())
        if loss.requires_grad:  # (a step without values has nothing to differentiate)
            loss.backward()
        grads = [s.weight.grad.coalesce() if s.weight.grad is not None else None for s in ebc.shards]
        results.append((out, grads))
        optimizer.step()
        optimizer.zero_grad()
    error = None
    if isinstance(results[0], str):
        assert results[0] == results[1]
        error = results[0]
    else:
        (out_a, grads_a), (out_b, grads_b) = results
        assert list(out_a) == list(out_b)
        for feature in out_a:
            assert out_a[feature].dtype == out_b[feature].dtype
            assert torch.equal(out_a[feature], out_b[feature]), feature
        for ga, gb in zip(grads_a, grads_b):
            assert (ga is None) == (gb is None)
            if ga is not None:
                assert torch.equal(ga.indices(), gb.indices()) and torch.equal(ga.values(), gb.values())
    for config, a, b in zip(ebcs[0].tables, ebcs[0].shards, ebcs[1].shards):
        ta, tb, name = a.hash_table, b.hash_table, config.name
        assert len(ta) == len(tb) and ta.clock == tb.clock, (step, name)
        assert all(torch.equal(x, y) for x, y in zip(ta.export(), tb.export())), (step, name)
        assert torch.equal(ta._last_seen, tb._last_seen) and torch.equal(ta._count, tb._count), (step, name)
        assert torch.equal(a.weight, b.weight), (step, name)
        assert ebcs[0].stats(name) == ebcs[1].stats(name)
    return error


_BATCHED = engine._evolving


def _PER_TABLE(shard, training):  # noqa: N802 - a stand-in for engine._evolving
    return training and shard.hash_table is not None


def test_batched_rows_leave_everything_as_each_table_alone():
    """One process training hash tables finds every value at once and places each table's
    new keys together; a twin collection forced through each table's own insert must end
    every step with the same outputs, gradients, tables
    (rows, scores, clocks), weights and stats: mixed dims and dtypes, mean and sum, a table
    read by two features, tables sharing an initializer, a table far larger than the step
    (the hashed dedup of the rows), the hash tables' sentinels as keys, steps with no value,
    and a table whose new keys do not fit (both raise, nothing changes)."""
    ebcs = _twin_collections()
    optimizers = [sk.LazyAdam(ebc.parameters(), lr=0.01) for ebc in ebcs]
    # (batch, range of the big table's keys, range of the small one's: 90 overflows it)
    steps = [(25_000, 2**62, 30)] * 3 + [(7, 2**62, 30), (0, 1, 30), (5, 10, 30), (6, 10, 30), (40, 2**62, 90),
                                         (9, 2**62, 90)]
    raised = 0
    for step, (batch, big_range, small_range) in enumerate(steps):
        error = _step_twins(ebcs, optimizers, _twin_batch(batch, step, big_range, small_range), step)
        if error is not None:
            assert "table 'small'" in error
            raised += 1
    assert raised >= 1 and len(ebcs[0].shards[4].hash_table) > 70_000


@given(num_tables=st.integers(1, 5), dims=st.lists(st.sampled_from([1, 4, 16, 33]), min_size=5, max_size=5),
       capacities=st.lists(st.sampled_from([1, 7, 300, 20_000, 100_000]), min_size=5, max_size=5),
       batches=st.lists(st.sampled_from([0, 1, 3, 64, 1000, 4097]), min_size=1, max_size=3),
       distribution=st.sampled_from(KEY_DISTRIBUTIONS), shared=st.booleans(), seed=st.integers(0, 2**31))
@examples(10)
def test_batched_rows_property_matches_each_table_alone(num_tables, dims, capacities, batches, distribution, shared,
                                                      seed):
    """Drawn collections (1-5 hash tables of drawn dims, capacities from 1 key up, a table
    read by two features, float32 / bfloat16, sum / mean) on one key per bag with keys of
    every distribution (extremes and sentinels included), over several steps: the batched
    rows and each table's own insert end each step alike, full tables included."""
    configs = [sk.TableConfig(f"t{t}", dims[t], capacities[t], [f"f{t}"] + ([f"g{t}"] if shared and t == 0 else []),
                              combiner=("sum", "mean")[(seed >> t) & 1],
                              dtype=(torch.float32, torch.bfloat16)[(seed >> (t + 8)) & 1])
               for t in range(num_tables)]
    ebcs = [sk.EmbeddingBagCollection(configs) for _ in range(2)]
    optimizers = [sk.LazyAdam(ebc.parameters(), lr=0.01) for ebc in ebcs]
    features = [f for config in configs for f in config.features][::-1]
    for step, batch in enumerate(batches):
        keys = make_keys(batch * len(features), distribution, seed + step)
        kjt = sk.KeyedJagged(features, keys, lengths=torch.ones(batch * len(features), dtype=torch.int64))
        _step_twins(ebcs, optimizers, kjt, step)


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


@pytest.mark.distributed
def test_a_full_table_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path):
    spawn(_full_on_one_rank_worker, 2, str(tmp_path))


def _slots_with_free(num_slots, free, tombstones, seed):
    """Slot arrays with `free` empty slots and `tombstones` erased ones at random places,
    every other slot taken (rows >= 0), and junk keys everywhere."""
    g = torch.Generator().manual_seed(seed)
    slot_keys = torch.randint(-2**62, 2**62, (num_slots,), generator=g)
    slot_rows = torch.randperm(num_slots, generator=g)
    places = torch.randperm(num_slots, generator=g)
    slot_rows[places[:free]] = -1
    slot_rows[places[free:free + tombstones]] = -2
    return slot_keys, slot_rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_keys", [3, 20_000])  # one task, and several of kHashGrain = 4096 keys
def test_a_placing_that_runs_out_of_slots_puts_every_slot_back(threads, num_keys):
    """CPU: sizes / num_occupied are trusted; when they understate the slots in use the keys
    run out of free slots half-way, and the call raises with every table as it was (slots,
    tombstones, the free slots' keys, row_keys and count), on one thread and on several.
    (CUDA drops such keys instead: hash_table_insert_absent_'s docstring.)"""
    free = num_keys // 2
    with num_threads(threads):
        slot_keys, slot_rows = _slots_with_free(1 << 15, free, free // 3 + 1, seed=num_keys)
        keys = torch.arange(10**9, 10**9 + num_keys)
        before = slot_keys.clone(), slot_rows.clone()
        with pytest.raises(RuntimeError, match="hash_table_insert_absent_: the table has no empty slot left"):
            torch.ops.sparsekit.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.arange(num_keys), 0)
        assert torch.equal(slot_keys, before[0]) and torch.equal(slot_rows, before[1])

        # Two tables: the first has room, the second runs out; neither keeps anything.
        roomy = (torch.zeros(1 << 16, dtype=torch.int64), torch.full((1 << 16,), -1))
        tight = _slots_with_free(1 << 15, free, 0, seed=num_keys + 1)
        row_keys = [torch.full((num_keys + 5,), 7), torch.full((1 << 16,), 7)]
        count = [torch.full((num_keys + 5,), 3), torch.full((1 << 16,), 3)]
        tensors = [roomy[0], roomy[1], tight[0], tight[1], *row_keys, *count]
        before = [t.clone() for t in tensors]
        with pytest.raises(RuntimeError, match="hash_table_place_tables_: the table has no empty slot left"):
            place_tables([roomy[0], tight[0]], [roomy[1], tight[1]], row_keys, count,
                         torch.arange(10**9, 10**9 + 2 * num_keys), [0, num_keys, 2 * num_keys], [0, 0])
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))

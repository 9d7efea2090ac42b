"""The CUDA kernels of the multi-table ops (sparsekit/tables_cuda.py), tested on the CPU: each
composite is device-agnostic, so it runs here on CPU tensors against the C++ CPU kernel, bit
for bit: outputs (values, dtypes, shapes, order), in-place effects, and errors (type and
message, with nothing written). On a GPU the op tests of tests/ops/test_unique_bounded.py,
test_tables_ops.py and test_hashtable_tables.py run the composites themselves through the
dispatcher (their `device` fixture).

Where the CPU kernel's result depends on its thread count (the repeated row a lazy_adam_tables_
error names, slot positions of placed keys that collide) the comparison runs on one thread.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparsekit as sk
from sparsekit import tables_cuda
from sparsekit.hashtable import HashTable
from properties import (BOUNDED_KINDS, KEY_DISTRIBUTIONS, bounded_keys, examples, make_keys, num_threads, sizes,
                        thread_counts)

ops = torch.ops.sparsekit
OPS = ["hash_table_find_tables", "hash_table_place_tables_", "hash_table_score_tables_", "lazy_adam_tables_",
       "segment_sum_parts", "unique_bounded", "unique_tables"]


def same(a, b) -> None:
    """Tensors (or tuples of them) equal in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
        assert torch.equal(_bits(x), _bits(y))


def _bits(x):
    """Floats as their bytes: -0.0 and 0.0 differ, NaNs compare."""
    return x.contiguous().view(torch.uint8) if x.is_floating_point() and x.numel() else x


def same_error(op_call, composite_call) -> str:
    """Both calls raise the same exception type with the same message; returns it."""
    errors = []
    for call in (op_call, composite_call):
        with pytest.raises(Exception) as info:
            call()
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) is RuntimeError
    assert str(errors[0]) == str(errors[1])
    return str(errors[0])


def clone_all(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(clone_all(v) for v in value)
    return value


def test_every_op_has_a_cuda_kernel_even_without_a_gpu():
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekit::{name}", "CUDA"), name


# ---- unique_bounded ----


@examples(25)
@given(n=sizes(100_000), bound=st.one_of(st.sampled_from([0, 1, 63, 64, 65, 4096, 1_000_003]),
                                         st.integers(0, 300_000)),
       kind=st.sampled_from(BOUNDED_KINDS), dtype=st.sampled_from([torch.int64, torch.int32]),
       group=st.booleans(), two_d=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_unique_bounded_composite_matches_the_cpu_kernel(n, bound, kind, dtype, group, two_d, seed):
    keys = bounded_keys(n, bound, kind, torch.Generator().manual_seed(seed))
    keys = keys.to(dtype)
    if two_d and n % 2 == 0:
        keys = keys.view(2, n // 2).t()  # strided
    same(ops.unique_bounded(keys, bound, group), tables_cuda.unique_bounded(keys, bound, group))


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique_bounded_composite_empty(group, dtype):
    for keys in (torch.empty(0, dtype=dtype), torch.empty(3, 0, dtype=dtype)):
        same(ops.unique_bounded(keys, 10, group), tables_cuda.unique_bounded(keys, 10, group))


@pytest.mark.parametrize("call", [
    lambda m: m.unique_bounded(torch.tensor([0, 5, -2, 10]), 10),
    lambda m: m.unique_bounded(torch.tensor([0, 5, 10, -2]), 10),
    lambda m: m.unique_bounded(torch.tensor([[0, 1], [2**40, 3]]), 10, True),
    lambda m: m.unique_bounded(torch.tensor([-(2**63)], dtype=torch.int64), 10),
    lambda m: m.unique_bounded(torch.tensor([0, 2**31 - 1], dtype=torch.int32), 5),
    # A bound past int32 over int32 keys (torch wraps it to compare them): the right key named.
    lambda m: m.unique_bounded(torch.tensor([3, 7, -5], dtype=torch.int32), 2**32),
    lambda m: m.unique_bounded(torch.zeros(3, dtype=torch.int64), -1),
    lambda m: m.unique_bounded(torch.zeros(3, dtype=torch.int64), 2**40),
    lambda m: m.unique_bounded(torch.zeros(3), 5),
    lambda m: m.unique_bounded(torch.zeros(3, dtype=torch.bool), 5),
    lambda m: m.unique_bounded(torch.zeros(3, dtype=torch.int16), 5),
])
def test_unique_bounded_composite_raises_as_the_cpu_kernel(call):
    same_error(lambda: call(ops), lambda: call(tables_cuda))


# ---- unique_tables ----


@examples(25)
@given(segment_sizes=st.lists(st.sampled_from([0, 1, 5, 300, 16384, 40_000]), min_size=0, max_size=6),
       num_tables=st.integers(1, 4), distribution=st.sampled_from(KEY_DISTRIBUTIONS),
       dtype=st.sampled_from([torch.int64, torch.int32]), data=st.data())
def test_unique_tables_composite_matches_the_cpu_kernel(segment_sizes, num_tables, distribution, dtype, data):
    """Segments of one table apart, empty segments, tables without keys, every key distribution."""
    tables = data.draw(st.lists(st.integers(0, num_tables - 1), min_size=len(segment_sizes),
                                max_size=len(segment_sizes)))
    offsets = [0]
    for n in segment_sizes:
        offsets.append(offsets[-1] + n)
    keys = make_keys(offsets[-1], distribution, data.draw(st.integers(0, 2**31 - 1)), dtype)
    got = tables_cuda.unique_tables(keys, offsets, tables, num_tables)
    same(ops.unique_tables(keys, offsets, tables, num_tables), got)
    assert torch.equal(got[0][got[1]], keys)


def test_unique_tables_composite_empty_and_tableless():
    keys = torch.zeros(0, dtype=torch.int64)
    for offsets, tables, num_tables in (([0], [], 3), ([0], [], 0), ([0, 0, 0], [2, 0], 3)):
        same(ops.unique_tables(keys, offsets, tables, num_tables),
             tables_cuda.unique_tables(keys, offsets, tables, num_tables))


@pytest.mark.parametrize("call", [
    lambda m, k: m.unique_tables(k.float(), [0, 4], [0], 1),
    lambda m, k: m.unique_tables(k.view(2, 2), [0, 4], [0], 1),
    lambda m, k: m.unique_tables(k, [0, 4], [0], -1),
    lambda m, k: m.unique_tables(k, [0, 4], [0], 2**20 + 1),
    lambda m, k: m.unique_tables(k, [0, 2, 4], [0], 1),
    lambda m, k: m.unique_tables(k, [0, 3], [0], 1),
    lambda m, k: m.unique_tables(k, [1, 4], [0], 1),
    lambda m, k: m.unique_tables(k, [0, 3, 2, 4], [0, 0, 0], 1),
    lambda m, k: m.unique_tables(k, [0, 2, 4], [0, 2], 2),
    lambda m, k: m.unique_tables(k, [0, 3, 2, 4], [5, 0, 0], 1),  # the segment's table first
    lambda m, k: m.unique_tables(k, [0, 2, 4], [-1, 0], 2),
])
def test_unique_tables_composite_raises_as_the_cpu_kernel(call):
    keys = torch.arange(4)
    same_error(lambda: call(ops, keys), lambda: call(tables_cuda, keys))


# ---- segment_sum_parts ----


@examples(20)
@given(part_sizes=st.lists(st.sampled_from([0, 1, 7, 2048, 2049, 5000]), min_size=1, max_size=5),
       row_shape=st.sampled_from([(1,), (3,), (16,), (17,), (2, 3), (0,), ()]),
       num_segments=st.sampled_from([0, 1, 5, 3000]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       id_dtype=st.sampled_from([torch.int64, torch.int32]), threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_segment_sum_parts_composite_matches_the_cpu_kernel_bit_for_bit(part_sizes, row_shape, num_segments, dtype,
                                                                         id_dtype, threads, seed):
    """On the CPU segment_sum adds in position order, as segment_sum_parts does: every bit
    agrees (on CUDA the order is segment_sum's own)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, *row_shape, generator=g).to(dtype) for n in part_sizes]
    if num_segments == 0:
        ids = -torch.ones(sum(part_sizes), dtype=torch.int64)
    else:
        ids = torch.randint(-1, num_segments, (sum(part_sizes),), generator=g)
    ids = ids.to(id_dtype)
    with num_threads(threads):
        same(ops.segment_sum_parts(parts, ids, num_segments), tables_cuda.segment_sum_parts(parts, ids, num_segments))


@pytest.mark.parametrize("call", [
    lambda m, p, i: m.segment_sum_parts([], i[:0], 4),
    lambda m, p, i: m.segment_sum_parts([p[0]], i[:1], 4),
    lambda m, p, i: m.segment_sum_parts([p, p[:, :2]], i.repeat(2), 4),
    lambda m, p, i: m.segment_sum_parts([p, p.double()], i.repeat(2), 4),
    lambda m, p, i: m.segment_sum_parts([p, p[0]], i, 4),
    lambda m, p, i: m.segment_sum_parts([p, p], i, 4),
    lambda m, p, i: m.segment_sum_parts([p], i.view(2, 2), 4),
    lambda m, p, i: m.segment_sum_parts([p], i.float(), 4),
    lambda m, p, i: m.segment_sum_parts([p], i, -1),
    lambda m, p, i: m.segment_sum_parts([p], i, 3),
    lambda m, p, i: m.segment_sum_parts([p[:, :0]], i, 3),  # no columns: the ids are still checked
    lambda m, p, i: m.segment_sum_parts([p], i, 0),
    lambda m, p, i: m.segment_sum_parts([p, p[:2]], torch.tensor([0, 9, 1, -1, 7, 2]), 4),  # the largest id named
    lambda m, p, i: m.segment_sum_parts([p.long()], i, 4),
    lambda m, p, i: m.segment_sum_parts([p.long(), p.long()], i.repeat(2), 4),
])
def test_segment_sum_parts_composite_raises_as_the_cpu_kernel(call):
    parts, ids = torch.randn(4, 3), torch.tensor([0, 3, 1, -1])
    same_error(lambda: call(ops, parts, ids), lambda: call(tables_cuda, parts, ids))


def test_segment_sum_parts_composite_of_empty_ids_checks_nothing_more():
    parts = [torch.randn(0, 3), torch.randn(0, 3)]
    same(ops.segment_sum_parts(parts, torch.zeros(0, dtype=torch.int64), 5),
         tables_cuda.segment_sum_parts(parts, torch.zeros(0, dtype=torch.int64), 5))


# ---- hash tables ----


def make_tables(capacities, seed, erase=False):
    """Tables filled to about half with keys from a range twice as wide (some with tombstones)."""
    g = torch.Generator().manual_seed(seed)
    tables = []
    for capacity in capacities:
        table = HashTable(capacity)
        table.insert(torch.unique(torch.randint(-capacity, capacity, (capacity // 2,), generator=g)))
        if erase:
            table._remove(table._row_keys[:len(table) // 3].clone())
        tables.append(table)
    return tables, g


def grouped(parts):
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part.numel())
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)), offsets


@examples(20)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=0, max_size=5),
       counts=st.lists(st.sampled_from([0, 1, 17, 4096, 9_000]), min_size=5, max_size=5),
       dtype=st.sampled_from([torch.int64, torch.int32]), extremes=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_find_tables_composite_matches_the_cpu_kernel(capacities, counts, dtype, extremes, seed):
    tables, g = make_tables(capacities, seed)
    parts = []
    for table, n in zip(tables, counts):
        part = torch.randint(-table.capacity, table.capacity, (n,), generator=g)
        if extremes:
            part = torch.cat([part, make_keys(50, "extremes", seed)])
        parts.append(part)
    keys, offsets = grouped(parts)
    keys = keys.to(dtype) if dtype == torch.int64 else keys.clamp(-2**31, 2**31 - 1).to(dtype)
    args = ([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, offsets)
    same(ops.hash_table_find_tables(*args), tables_cuda.hash_table_find_tables(*args))


def _slot_arrays(tables):
    return [t._slot_keys for t in tables], [t._slot_rows for t in tables]


@pytest.mark.parametrize("change", [
    lambda s, r, k, o: (s, r[:1], k, o),
    lambda s, r, k, o: (s, r, k.float(), o),
    lambda s, r, k, o: (s, r, k.view(2, 2), o),
    lambda s, r, k, o: ([s[0].int(), s[1]], r, k, o),
    lambda s, r, k, o: (s, [r[0], r[1].int()], k, o),
    lambda s, r, k, o: ([s[0], s[1].view(-1, 2)], r, k, o),
    lambda s, r, k, o: ([s[0], s[1][:-1]], [r[0], r[1][:-1]], k, o),
    lambda s, r, k, o: ([s[0], s[1][:8]], r, k, o),
    lambda s, r, k, o: ([s[0], s[1][::2]], [r[0], r[1][::2]], k, o),
    lambda s, r, k, o: ([s[0], s[0]], [r[0], s[0]], k, o),  # one array for both
    lambda s, r, k, o: (s, r, k, o[:2]),
    lambda s, r, k, o: (s, r, k, [0, 1, 3]),
    lambda s, r, k, o: (s, r, k, [1, 1, 4]),
    lambda s, r, k, o: (s, r, k, [0, 3, 2]),
])
def test_find_tables_composite_raises_as_the_cpu_kernel(change):
    tables, _ = make_tables([10, 10], 0)
    args = change(*_slot_arrays(tables), torch.tensor([1, 2, 3, 4]), [0, 2, 4])
    same_error(lambda: ops.hash_table_find_tables(*args), lambda: tables_cuda.hash_table_find_tables(*args))


def _scores(tables):
    return [t._last_seen for t in tables], [t._count for t in tables]


@examples(20)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=0, max_size=5),
       order=st.sampled_from(["random", "distinct", "sorted", "missing"]), threads=thread_counts,
       seed=st.integers(0, 2**31 - 1))
def test_score_tables_composite_matches_the_cpu_kernel(capacities, order, threads, seed):
    """Rows with repeats, distinct ascending (the owner step's), all -1, empty tables."""
    tables, g = make_tables(capacities, seed)
    for t in tables:
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            t.tick()
    parts = []
    for table in tables:
        rows = torch.randint(-1, max(1, len(table)), (int(torch.randint(0, 9_000, (1,), generator=g)),), generator=g)
        rows = rows[rows < len(table)]
        if order == "distinct":
            rows = torch.unique(rows)
        elif order == "sorted":
            rows = torch.sort(rows).values
        elif order == "missing":
            rows = torch.full_like(rows, -1)
        parts.append(rows)
    rows, offsets = grouped(parts)
    clocks = [t.clock for t in tables]
    seen, counts = _scores(tables)
    mine = clone_all((seen, counts))
    with num_threads(threads):
        ops.hash_table_score_tables_(seen, counts, rows, offsets, clocks)
    tables_cuda.hash_table_score_tables_(*mine, rows, offsets, clocks)
    same(tuple(seen + counts), tuple(mine[0] + mine[1]))


@pytest.mark.parametrize("change", [
    lambda s, c, r, o, k: (s, c, r, o, k[:1]),
    lambda s, c, r, o, k: (s[:1], c, r, o, k),
    lambda s, c, r, o, k: (s, c, r.int(), o, k),
    lambda s, c, r, o, k: (s, c, r.view(2, 3), o, k),
    lambda s, c, r, o, k: ([s[0].int(), s[1]], c, r, o, k),
    lambda s, c, r, o, k: (s, [c[0], c[1][:5]], r, o, k),
    lambda s, c, r, o, k: (s, [c[0], c[1][::2]], r, o, k),
    lambda s, c, r, o, k: (s, c, r, [0, 6], k),
    lambda s, c, r, o, k: (s, c, r, [0, 3, 5], k),
    lambda s, c, r, o, k: (s, c, r[:3], [0, 4, 3], k),
    lambda s, c, r, o, k: (s, c, torch.tensor([0, 1, 2, 3, 100, 5]), o, k),  # outside table 1
    lambda s, c, r, o, k: (s, c, torch.tensor([-2, 1, 2, 3, 4, 5]), o, k),
    lambda s, c, r, o, k: (s, c, torch.tensor([0, 1, 100, 3, 200, -3]), o, k),  # the first bad one named
    lambda s, c, r, o, k: (s, [c[0], s[1]], r, o, k),  # a written tensor twice
    lambda s, c, r, o, k: (s, c, c[0][:6], o, k),  # rows read where counts are written
])
def test_score_tables_composite_raises_as_the_cpu_kernel_and_changes_nothing(change):
    tables, _ = make_tables([100, 100], 1)
    before = clone_all(_scores(tables))
    args = change(*_scores(tables), torch.tensor([0, 1, 2, 3, 4, 5]), [0, 3, 6], [1, 1])
    same_error(lambda: ops.hash_table_score_tables_(*args), lambda: tables_cuda.hash_table_score_tables_(*args))
    same(tuple(before[0] + before[1]), tuple(_scores(tables)[0] + _scores(tables)[1]))


def _place_lists(tables):
    return ([t._slot_keys for t in tables], [t._slot_rows for t in tables], [t._row_keys for t in tables],
            [t._count for t in tables])


def _new_keys(tables, fill, g):
    parts = []
    for table in tables:
        room = table.capacity - len(table)
        candidates = torch.unique(torch.randint(-4 * table.capacity - 8, 4 * table.capacity + 8,
                                                (4 * table.capacity + 16,), generator=g))
        candidates = candidates[table.find(candidates) < 0]
        parts.append(candidates[torch.randperm(candidates.numel(), generator=g)][:int(room * fill)])
    return grouped(parts)


@examples(20)
@given(capacities=st.lists(st.sampled_from([1, 16, 100, 5_000, 70_000]), min_size=0, max_size=5),
       fill=st.sampled_from([0.0, 0.3, 1.0]), erase=st.booleans(), dtype=st.sampled_from([torch.int64, torch.int32]),
       seed=st.integers(0, 2**31 - 1))
def test_place_tables_composite_matches_the_cpu_kernel(capacities, fill, erase, dtype, seed):
    """Rows, keys, counts and (one thread: the same probe order) slot arrays bit for bit;
    stale counts in free rows cleared, tombstones reused."""
    tables, g = make_tables(capacities, seed, erase=erase)
    for t in tables:
        t._count[len(t):] += 7
    keys, offsets = _new_keys(tables, fill, g)
    keys = keys.to(dtype)
    sizes_ = [len(t) for t in tables]
    lists = _place_lists(tables)
    mine = clone_all(lists)
    with num_threads(1):
        ops.hash_table_place_tables_(*lists, keys, offsets, sizes_)
        tables_cuda.hash_table_place_tables_(*mine, keys, offsets, sizes_)
    same(tuple(x for column in lists for x in column), tuple(x for column in mine for x in column))


@pytest.mark.parametrize("threads", [2, 4])
def test_place_tables_composite_with_threads_places_the_same_rows(threads):
    tables, g = make_tables([70_000, 5_000, 16], 3)
    keys, offsets = _new_keys(tables, 1.0, g)
    lists, sizes_ = _place_lists(tables), [len(t) for t in tables]
    mine = clone_all(lists)
    with num_threads(threads):
        ops.hash_table_place_tables_(*lists, keys, offsets, sizes_)
        tables_cuda.hash_table_place_tables_(*mine, keys, offsets, sizes_)
    same(tuple(lists[2] + lists[3]), tuple(mine[2] + mine[3]))
    everything = torch.cat([keys, torch.arange(-50, 50)])
    for t in range(len(tables)):
        for probe in (keys[offsets[t]:offsets[t + 1]], everything):
            same(ops.hash_table_find(lists[0][t], lists[1][t], probe), ops.hash_table_find(mine[0][t], mine[1][t], probe))


@pytest.mark.parametrize("change", [
    lambda L, k, o, s: (L[0], L[1], L[2], L[3], k, o, s[:2]),
    lambda L, k, o, s: (L[0], L[1][:2], L[2], L[3], k, o, s),
    lambda L, k, o, s: (*L, k.float(), o, s),
    lambda L, k, o, s: (*L, k.view(1, -1), o, s),
    lambda L, k, o, s: (*L, k, [0, 3, 4, 4], s),
    lambda L, k, o, s: (*L, k, [0, 3, 4], s),
    lambda L, k, o, s: (*L, k, [0, 4, 3, 5], s),
    lambda L, k, o, s: (L[0], [L[1][0], L[1][1].int(), L[1][2]], L[2], L[3], k, o, s),
    lambda L, k, o, s: (L[0], L[1], L[2], L[3][:2] + [L[3][2].int()], k, o, s),
    lambda L, k, o, s: (L[0], L[1], L[2], L[3][:2] + [L[3][2][:50]], k, o, s),
    lambda L, k, o, s: (L[0], L[1], [L[2][0][::2]] + L[2][1:], [L[3][0][::2]] + L[3][1:], k, o, s),
    lambda L, k, o, s: (*L, k, o, [-1] + s[1:]),
    lambda L, k, o, s: (*L, torch.arange(1000, 1014), [0, 3, 12, 14], s),  # no room in table 1 for 9 keys
    lambda L, k, o, s: (*L, k, o, s[:2] + [100]),
    lambda L, k, o, s: (L[0], L[1], L[2][:2] + [torch.zeros(300, dtype=torch.int64)],
                        L[3][:2] + [torch.zeros(300, dtype=torch.int64)], k, o, s[:2] + [256]),  # rows, no slots
    lambda L, k, o, s: (L[0], L[1], L[2][:2] + [torch.zeros(300, dtype=torch.int64)],
                        L[3][:2] + [torch.zeros(300, dtype=torch.int64)], k, o, s[:2] + [257]),
    lambda L, k, o, s: (L[0], L[1], [L[3][0]] + L[2][1:], L[3], k, o, s),  # a written array twice
    lambda L, k, o, s: (*L, L[2][0][:5], o, s),  # keys read from rows it writes
])
def test_place_tables_composite_raises_as_the_cpu_kernel_and_changes_nothing(change):
    tables, _ = make_tables([100, 16, 100], 3)
    keys = torch.arange(1000, 1005)
    lists = _place_lists(tables)
    before = clone_all(lists)
    args = change(lists, keys, [0, 3, 4, 5], [len(t) for t in tables])
    same_error(lambda: ops.hash_table_place_tables_(*args), lambda: tables_cuda.hash_table_place_tables_(*args))
    same(tuple(x for column in before for x in column), tuple(x for column in _place_lists(tables) for x in column))


# ---- lazy_adam_tables_ ----


def adam_tables(num_tables, seed, dims, counts, dtypes):
    """Per table [weight, exp_avg, exp_avg_sq, rows, grad, step, hyper] with distinct rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(num_tables):
        dim = dims[t]
        num_rows = int(torch.randint(1, 3000, (1,), generator=g))
        count = min(num_rows, counts[t])
        weight = torch.randn(num_rows, dim, generator=g).to(dtypes[t])
        exp_avg = 0.1 * torch.randn(num_rows, dim, generator=g)
        exp_avg_sq = 0.01 * torch.rand(num_rows, dim, generator=g)
        rows = torch.randperm(num_rows, generator=g)[:count]
        grad = torch.randn(count, dim, generator=g)
        step = int(torch.randint(1, 50, (1,), generator=g))
        hyper = [float(torch.rand(1, generator=g)) * 0.1, 0.9 - 0.1 * t % 0.5, 0.999 - 0.01 * t % 0.1,
                 10.0 ** -(4 + t % 5), 0.0 if t % 2 else 0.01]
        out.append([weight, exp_avg, exp_avg_sq, rows, grad, step, hyper])
    return out


def columns(tables):
    return [[t[i] for t in tables] for i in range(6)] + [[h for t in tables for h in t[6]]]


@examples(20)
@given(num_tables=st.integers(1, 5), counts=st.lists(st.sampled_from([0, 1, 3, 1023, 1025, 2999]), min_size=5,
                                                     max_size=5),
       dims=st.lists(st.sampled_from([0, 1, 3, 16, 17, 64]), min_size=5, max_size=5),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), min_size=5, max_size=5),
       strided_grad=st.booleans(), threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_lazy_adam_tables_composite_matches_the_cpu_kernel_bit_for_bit(num_tables, counts, dims, dtypes,
                                                                       strided_grad, threads, seed):
    tables = adam_tables(num_tables, seed, dims, counts, dtypes)
    if strided_grad and tables:
        grad = tables[0][4]
        tables[0][4] = torch.cat([grad, grad], 1)[:, ::2]  # the same values, not contiguous
    args = columns(tables)
    mine = clone_all(args)
    with num_threads(threads):
        ops.lazy_adam_tables_(*args)
    tables_cuda.lazy_adam_tables_(*mine)
    for a, b in zip(args[:3], mine[:3]):
        same(tuple(a), tuple(b))


def _share(args, first, second):
    """Makes args[first] and args[second] (column, table) views of one buffer that overlap by a row."""
    a, b = args[first[0]][first[1]], args[second[0]][second[1]]
    buffer = torch.zeros(a.numel() + b.numel() - a.shape[1])
    args[first[0]][first[1]] = buffer[:a.numel()].view_as(a)
    args[second[0]][second[1]] = buffer[a.numel() - a.shape[1]:].view_as(b).to(b.dtype) if b.dtype != torch.float32 \
        else buffer[a.numel() - a.shape[1]:].view_as(b)


def _bad_adam(change):
    tables = adam_tables(3, 9, dims=[3, 3, 3], counts=[4, 4, 4], dtypes=[torch.float32, torch.float16, torch.float32])
    args = columns(tables)
    change(args)
    return args


BAD_ADAM = [
    lambda a: a[1].pop(),
    lambda a: a[6].pop(),
    lambda a: a[0].__setitem__(0, a[0][0].double()),
    lambda a: a[0].__setitem__(0, a[0][0].int()),
    lambda a: a[1].__setitem__(0, a[1][0].double()),
    lambda a: a[0].__setitem__(0, a[0][0].t().contiguous().t()),
    lambda a: a[1].__setitem__(0, torch.zeros(2, 3)),
    lambda a: a[2].__setitem__(0, torch.zeros(2, 3)),
    lambda a: a[2].__setitem__(1, a[2][1].half()),  # the half table's float32 moments stand in for its weight
    lambda a: a[4].__setitem__(1, a[4][1].half()),
    lambda a: a[2].__setitem__(0, a[2][0].t().contiguous().t()),
    lambda a: a[3].__setitem__(0, a[3][0].float()),
    lambda a: a[3].__setitem__(0, a[3][0].view(2, 2)),
    lambda a: a[4].__setitem__(0, a[4][0][:3]),
    lambda a: a[4].__setitem__(2, a[4][2][:, :2]),
    lambda a: a[5].__setitem__(0, 0),
    lambda a: a[6].__setitem__(0, -1e-3),
    lambda a: a[6].__setitem__(0, float("nan")),
    lambda a: a[6].__setitem__(0, -float("nan")),
    lambda a: a[6].__setitem__(1, 1.0),
    lambda a: a[6].__setitem__(2, -0.5),
    lambda a: a[6].__setitem__(3, -1e-300),
    lambda a: a[6].__setitem__(9, float("-inf")),
    lambda a: a[3].__setitem__(0, a[3][0].int()),
    lambda a: a[3].__setitem__(0, torch.stack([a[3][0], a[3][0]], 1)[:, 0]),
    lambda a: a[4].__setitem__(0, a[0][0][:4]),  # grad a view of weight
    lambda a: a[1].__setitem__(0, a[0][0]),  # exp_avg is weight
    lambda a: a[3][2].__setitem__(1, 10**6),  # outside table 2
    lambda a: (a[3][2].__setitem__(1, -1), a[3][1].__setitem__(3, 10**6)),  # the first bad row named
    lambda a: a[3][1].__setitem__(2, int(a[3][1][0])),  # repeated
    lambda a: (a[3][2].__setitem__(3, int(a[3][2][0])), a[3][0].__setitem__(1, 10**6)),  # range before repeats
    lambda a: _share(a, (1, 0), (2, 2)),  # one table's moment overlaps another's
    lambda a: _share(a, (2, 1), (0, 2)),
    lambda a: a[4].__setitem__(2, a[0][0][:4]),  # a table reads what another writes
    lambda a: a[3].__setitem__(2, a[3][0]),  # tables may share what they only read
]


@pytest.mark.parametrize("change", BAD_ADAM)
def test_lazy_adam_tables_composite_raises_as_the_cpu_kernel_and_changes_nothing(change):
    op_args, mine = _bad_adam(change), _bad_adam(change)
    before = clone_all(op_args[:3])
    try:
        with num_threads(1):
            ops.lazy_adam_tables_(*op_args)
    except RuntimeError:
        same_error(lambda: ops.lazy_adam_tables_(*op_args), lambda: tables_cuda.lazy_adam_tables_(*mine))
        for a, b in zip(before, op_args[:3]):
            same(tuple(a), tuple(b))
        for a, b in zip(before, mine[:3]):
            same(tuple(a), tuple(b))
    else:  # allowed (shared read-only tensors): the same update
        tables_cuda.lazy_adam_tables_(*mine)
        for a, b in zip(op_args[:3], mine[:3]):
            same(tuple(a), tuple(b))


@pytest.mark.parametrize("rows, weight_rows", [
    ([5, 1, 5, 1, 3], 50),  # bitmap path: the first repeat in position order (5)
    ([9, 7, 7, 9, 3], 50),
    ([9, 7, 7, 9, 3], 200_000),  # sorted path: the smallest repeated row (7)
    ([900, 70, 900, 70], 200_000),
])
def test_lazy_adam_tables_composite_names_the_repeated_row_as_the_cpu_kernel(rows, weight_rows):
    def args():
        weight = torch.zeros(weight_rows, 2)
        return [[torch.zeros(4, 2), weight], [torch.zeros(4, 2), torch.zeros_like(weight)],
                [torch.zeros(4, 2), torch.zeros_like(weight)], [torch.arange(2), torch.tensor(rows)],
                [torch.ones(2, 2), torch.ones(len(rows), 2)], [1, 1], [0.1, 0.9, 0.99, 1e-8, 0.0] * 2]
    with num_threads(1):
        message = same_error(lambda: ops.lazy_adam_tables_(*args()), lambda: tables_cuda.lazy_adam_tables_(*args()))
    assert "rows[1] holds row" in message


def test_lazy_adam_tables_composite_with_no_tables_or_no_rows():
    tables_cuda.lazy_adam_tables_([], [], [], [], [], [], [])
    args = columns(adam_tables(2, 4, [3, 0], [0, 5], [torch.float32, torch.bfloat16]))
    mine = clone_all(args)
    ops.lazy_adam_tables_(*args)
    tables_cuda.lazy_adam_tables_(*mine)
    for a, b in zip(args[:3], mine[:3]):
        same(tuple(a), tuple(b))


def test_lazy_adam_tables_composite_equals_lazy_adam_for_float32():
    """The composite is lazy_adam_ table by table: the LazyAdam one-table path's numbers."""
    tables = adam_tables(2, 8, [4, 7], [100, 3], [torch.float32, torch.float32])
    args = columns(tables)
    alone = clone_all(args)
    tables_cuda.lazy_adam_tables_(*args)
    for t in range(2):
        sk.ops.lazy_adam_(alone[0][t], alone[1][t], alone[2][t], alone[3][t], alone[4][t], alone[5][t],
                          *alone[6][5 * t:5 * t + 5])
    for a, b in zip(args[:3], alone[:3]):
        same(tuple(a), tuple(b))

"""Every CPU kernel reads its inputs exactly within their bounds: each input is placed so
that it ends at (or begins right after) a page that faults on any access, at sizes on both
sides of the kernels' thresholds (serial and parallel paths, vector blocks and their scalar
tails). A read one element past either end crashes the test; the results are checked
against plain torch."""

import os
import sys

import pytest
import torch

import sparsekit as sk
from sparsekit import ops
from _guard import guarded

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mmap + mprotect guard pages")

SIDES = ["end", "start"]
# Below and above the block sizes and parallel grains of the kernels.
SIZES = [1, 7, 64, 1000, 70_000]


def keys_of(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 40), 1 << 40, (n,), generator=generator).remainder(max(n // 3, 1) * 7919).to(dtype)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique(side, n, dtype):
    keys = keys_of(n, dtype, n)
    got_keys, inverse, counts = ops.unique(guarded(keys, side), return_inverse=True, return_counts=True)
    assert torch.equal(got_keys[inverse], keys)
    expected, expected_counts = torch.unique(keys, return_counts=True)
    order = torch.argsort(got_keys)
    assert torch.equal(got_keys[order], expected) and torch.equal(counts[order], expected_counts)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("group", [False, True])
def test_unique_bounded(side, n, group):
    bound = 3 * n + 5
    keys = torch.randint(-1, bound, (n,), generator=torch.Generator().manual_seed(n))
    got, inverse, offsets, order = torch.ops.sparsekit.unique_bounded(guarded(keys, side), bound, group)
    assert torch.equal(got, torch.unique(keys))
    assert torch.equal(got[inverse], keys)
    if group:
        assert torch.equal(keys[order], got.repeat_interleave(offsets.diff()))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dim", [1, 16, 40])
def test_segment_sum(side, n, dim):
    generator = torch.Generator().manual_seed(n + dim)
    data = torch.randn(n, dim, generator=generator)
    segments = max(n // 4, 1)
    ids = torch.randint(-1, segments, (n,), generator=generator)
    expected = torch.zeros(segments + 1, dim).index_add_(0, torch.where(ids < 0, segments, ids), data)[:segments]
    for deterministic in (False, True):
        got = ops.segment_sum(guarded(data, side), guarded(ids, side), segments, deterministic=deterministic)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dim", [1, 16, 40, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("plan", ["every", "first"])
def test_lookups_read_the_table_within_its_rows(side, dim, dtype, plan, monkeypatch):
    # The table's first or last row touches the guard page: a vector load that runs past a
    # row's last column (or before its first) would fault there. Both prefetch plans of the
    # pooling loops (csrc/cpu/prefetch_plan.h; they differ for rows of 8 lines or more).
    monkeypatch.setenv("SPARSEKIT_POOL_PREFETCH", plan)
    num_rows = 50
    weight = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(dim)).to(dtype)
    table = guarded(weight, side)
    rows = torch.tensor([0, num_rows - 1, -1, num_rows - 1, 0, 3] * 40)
    offsets = torch.arange(0, rows.numel() + 1, 6)
    reference = torch.cat([weight.float(), torch.zeros(1, dim)])
    looked_up = torch.where(rows < 0, num_rows, rows)
    psw = torch.rand(rows.numel()).to(dtype)
    tolerance = {} if dtype in (torch.float32, torch.float64) else {"rtol": 1e-2, "atol": 1e-2}
    for mode, weights in (("sum", None), ("mean", None), ("max", None), ("sum", psw)):
        expected = torch.nn.functional.embedding_bag(looked_up, reference, offsets, mode=mode, padding_idx=num_rows,
                                                     include_last_offset=True,
                                                     per_sample_weights=None if weights is None else weights.float())
        got = ops.embedding_bag(table, guarded(rows, side), guarded(offsets, side), weights, mode=mode)
        torch.testing.assert_close(got.float(), expected, **tolerance)
    torch.testing.assert_close(ops.embedding_gather(table, guarded(rows, side)).float(), reference[looked_up])


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_hash_table_find_and_insert(side, n):
    keys = torch.unique(keys_of(3 * n, torch.int64, n))[:n]
    slots = 1 << max(4, (2 * n - 1).bit_length())
    slot_keys = guarded(torch.zeros(slots, dtype=torch.int64), side)
    slot_rows = guarded(torch.full((slots,), -1), side)
    ops.hash_table_insert_absent_(slot_keys, slot_rows, guarded(keys, side), guarded(torch.arange(n), side))
    found = ops.hash_table_find(slot_keys, slot_rows, guarded(keys, side))
    assert torch.equal(found, torch.arange(n))
    erased = ops.hash_table_erase_(slot_keys, slot_rows, guarded(keys[::2].clone(), side))
    assert torch.equal(erased, torch.arange(0, n, 2))
    assert torch.equal(ops.hash_table_find(slot_keys, slot_rows, guarded(keys, side)),
                       torch.where(torch.arange(n) % 2 == 0, -1, torch.arange(n)))
    missing = ops.hash_table_find(slot_keys, slot_rows, guarded(keys + (1 << 50), side))
    assert torch.equal(missing, torch.full((n,), -1))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", [1, 64, 65, 1000])
def test_hash_table_prefetching_paths(side, n):
    """A table of 2^17 slots or more, where find, insert and the tables' placing prefetch
    the home slot of the key 64 ahead: the key reads stop at the keys' end (n = 64 / 65: the
    first prefetch just out of reach, then just in)."""
    keys = torch.unique(keys_of(3 * n, torch.int64, n))[:n]
    n = keys.numel()
    slots = 1 << 17
    slot_keys = guarded(torch.zeros(slots, dtype=torch.int64), side)
    slot_rows = guarded(torch.full((slots,), -1), side)
    ops.hash_table_insert_absent_(slot_keys, slot_rows, guarded(keys, side), guarded(torch.arange(n), side))
    assert torch.equal(ops.hash_table_find(slot_keys, slot_rows, guarded(keys, side)), torch.arange(n))
    table = sk.HashTable(slots // 2)
    assert table._slot_keys.numel() == slots
    columns = [[table._slot_keys], [table._slot_rows], [table._row_keys], [table._count]]
    torch.ops.sparsekit.hash_table_place_tables_(*columns, guarded(keys, side), [0, n], [0])
    assert torch.equal(ops.hash_table_find(table._slot_keys, table._slot_rows, guarded(keys, side)), torch.arange(n))
    assert torch.equal(table._row_keys[:n], keys)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("dim", [1, 16, 40])
def test_lazy_adam(side, n, dim):
    num_rows = 2 * n + 3
    generator = torch.Generator().manual_seed(n + dim)
    rows = torch.randperm(num_rows, generator=generator)[:n]
    grad = torch.randn(n, dim, generator=generator)
    state = [torch.randn(num_rows, dim, generator=generator) for _ in range(3)]
    state[2] = state[2].abs()
    expected = [t.clone() for t in state]
    ops.lazy_adam_(*expected, rows, grad, 3, 0.01, 0.9, 0.999, 1e-8, 0.01)
    got = [guarded(t, side) for t in state]
    ops.lazy_adam_(*got, guarded(rows, side), guarded(grad, side), 3, 0.01, 0.9, 0.999, 1e-8, 0.01)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
def test_partition_by_owner_and_key_seeded_uniform(side, n):
    keys = keys_of(n, torch.int64, n)
    expected = ops.partition_by_owner(keys, 3)
    for got, want in zip(ops.partition_by_owner(guarded(keys, side), 3), expected):
        assert torch.equal(got, want)
    assert torch.equal(ops.key_seeded_uniform(guarded(keys, side), 5, seed=2), ops.key_seeded_uniform(keys, 5, seed=2))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
def test_select_smallest(side, n):
    generator = torch.Generator().manual_seed(n)
    columns = [torch.randint(0, 5, (n,), generator=generator), torch.randint(0, 1 << 40, (n,), generator=generator)]
    eligible = torch.rand(n, generator=generator) < 0.7
    k = int(eligible.sum()) // 2
    got = ops.select_smallest([guarded(c, side) for c in columns], guarded(eligible, side), k)
    assert torch.equal(got, ops.select_smallest(columns, eligible, k))


def test_the_guard_faults():
    # The guard is real: reading one element past the end kills a child process.
    import subprocess
    support = os.path.dirname(os.path.abspath(sys.modules[guarded.__module__].__file__))
    code = (f"import torch, sys; sys.path.insert(0, {support!r}); from _guard import guarded; "
            "t = guarded(torch.arange(10)); print(t[:10].sum().item()); "
            "print(torch.as_strided(t, (11,), (1,)).sum().item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=sk.__path__[0] + "/..")
    assert done.stdout.splitlines()[:1] == ["45"]
    assert done.returncode != 0


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", SIZES)
def test_unique_tables_and_segment_sum_parts(side, n):
    keys = keys_of(n, torch.int64, n)
    cut = n // 2
    offsets, tables = [0, cut, n], [1, 0]
    expected = torch.ops.sparsekit.unique_tables(keys, offsets, tables, 2)
    got = torch.ops.sparsekit.unique_tables(guarded(keys, side), offsets, tables, 2)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    generator = torch.Generator().manual_seed(n)
    parts = [torch.randn(cut, 40, generator=generator), torch.randn(n - cut, 40, generator=generator)]
    segments = max(n // 4, 1)
    ids = torch.randint(-1, segments, (n,), generator=generator)
    summed = torch.ops.sparsekit.segment_sum_parts([guarded(p, side) for p in parts], guarded(ids, side), segments)
    torch.testing.assert_close(summed, ops.segment_sum(torch.cat(parts), ids, segments))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_hash_table_find_tables(side, n):
    keys = torch.unique(keys_of(3 * n, torch.int64, n))[:n]
    cut = n // 2
    slot_keys, slot_rows = [], []
    for part in (keys[:cut], keys[cut:]):
        slots = 1 << max(4, (2 * part.numel()).bit_length())
        slot_keys.append(guarded(torch.zeros(slots, dtype=torch.int64), side))
        slot_rows.append(guarded(torch.full((slots,), -1), side))
        ops.hash_table_insert_absent_(slot_keys[-1], slot_rows[-1], part, torch.arange(part.numel()))
    found = torch.ops.sparsekit.hash_table_find_tables(slot_keys, slot_rows, guarded(keys, side), [0, cut, n])
    assert torch.equal(found, torch.cat([torch.arange(cut), torch.arange(n - cut)]))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lazy_adam_tables(side, dtype):
    generator = torch.Generator().manual_seed(3)
    tables = []
    for num_rows, count, dim in ((5, 5, 1), (300, 120, 17), (2000, 1025, 64)):
        weight = torch.randn(num_rows, dim, generator=generator).to(dtype)
        moments = [0.1 * torch.randn(num_rows, dim, generator=generator), torch.rand(num_rows, dim, generator=generator)]
        rows = torch.randperm(num_rows, generator=generator)[:count]
        tables.append([weight, *moments, rows, torch.randn(count, dim, generator=generator)])
    hyper = [0.01, 0.9, 0.999, 1e-8, 0.01] * 3
    expected = [[t.clone() for t in table] for table in tables]
    torch.ops.sparsekit.lazy_adam_tables_(*([table[i] for table in expected] for i in range(5)), [2, 2, 2], hyper)
    got = [[guarded(t, side) for t in table] for table in tables]
    torch.ops.sparsekit.lazy_adam_tables_(*([table[i] for table in got] for i in range(5)), [2, 2, 2], hyper)
    for g, e in zip(got, expected):
        for x, y in zip(g[:3], e[:3]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dim", [1, 16, 40])
def test_embedding_bag_argmax(side, dim):
    weight = torch.randn(50, dim, generator=torch.Generator().manual_seed(dim))
    rows = torch.tensor([0, 49, -1, 49, 0, 3] * 40)
    offsets = torch.arange(0, rows.numel() + 1, 6)
    expected = torch.ops.sparsekit.embedding_bag_argmax(weight, rows, offsets, None, True)
    got = torch.ops.sparsekit.embedding_bag_argmax(guarded(weight, side), guarded(rows, side), guarded(offsets, side),
                                                   None, True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("batch", [1, 7, 16, 17, 1000])
@pytest.mark.parametrize("n,dim", [(27, 16), (5, 3), (9, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_dots(side, batch, n, dim, dtype):
    """The harness's interaction: whole-square transposes of each block's rows and their
    scalar tails, the last block partial or not."""
    generator = torch.Generator().manual_seed(batch + n)
    vectors = torch.randn(batch, n, dim, generator=generator, dtype=dtype)
    grad = torch.randn(batch, n * (n - 1) // 2, generator=generator, dtype=dtype)
    i, j = torch.triu_indices(n, n, offset=1)
    dots = torch.ops.sparsekit._pair_dots(guarded(vectors, side))
    torch.testing.assert_close(dots, (vectors[:, i] * vectors[:, j]).sum(-1))
    full = torch.zeros(batch, n, n, dtype=dtype)
    full[:, i, j] = grad
    full[:, j, i] = grad
    got = torch.ops.sparsekit._pair_dots_backward(guarded(grad, side), guarded(vectors, side))
    torch.testing.assert_close(got, torch.bmm(full, vectors))

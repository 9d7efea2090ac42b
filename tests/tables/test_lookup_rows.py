"""lookup_rows and hash_table_touch_tables_, the one-process step's multi-table ops, against
plain Python table by table; their segment bounds are a tensor on the keys' device, so on
CUDA neither reads anything back: bad bounds are reported (lookup_rows' report[2], the
touch's error slot 0), a bad row recorded in the touch's error slot 1, and with a recorded
error nothing is scored.

Thresholds crossed (keep in step with csrc/cuda/hashtable_cuda.cu): the CUDA kernels take 32
segments per launch (kSegmentsPerLaunch), so up to 70 segments run three launches, with
empty segments at either end of a launch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparsekit as sk
from properties import examples

lookup_rows = torch.ops.sparsekit.lookup_rows
touch_tables_ = torch.ops.sparsekit.hash_table_touch_tables_
NONE = 2 ** 63 - 1


def _tables(device, seed):
    g = torch.Generator().manual_seed(seed)
    tables = []
    for _ in range(3):
        table = sk.HashTable(64, device=device)
        table.insert(torch.unique(torch.randint(0, 60, (30,), generator=g)).to(device))
        tables.append(table)
    return tables


def _reference(tables, keys, bounds, segment_tables, direct_rows):
    rows, first_bad, absent = [], len(keys), 0
    found = [dict(zip(t._row_keys[:len(t)].tolist(), range(len(t)))) for t in tables]
    for s, t in enumerate(segment_tables):
        for i in range(bounds[s], bounds[s + 1]):
            key = keys[i]
            if t >= 0:
                rows.append(found[t].get(key, -1))
                absent += key not in found[t]
            elif t == -1:
                inside = 0 <= key < direct_rows[s]
                rows.append(key if inside else -2)
                if not inside:
                    first_bad = min(first_bad, i)
            else:
                rows.append(-3)
    return rows, [first_bad, absent, 0]


@examples(25)
@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=70),
       kinds=st.lists(st.integers(-2, 2), min_size=70, max_size=70), seed=st.integers(0, 2 ** 16),
       int32=st.booleans())
def test_lookup_rows_matches_a_lookup_segment_by_segment(lengths, kinds, seed, int32, device):
    tables = _tables(device, seed)
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    keys = torch.randint(-3, 70, (bounds[-1],), generator=g)
    segment_tables = kinds[:len(lengths)]
    direct_rows = [int(torch.randint(0, 70, (1,), generator=g)) if t == -1 else 0 for t in segment_tables]
    rows, report = lookup_rows([t._slot_keys for t in tables], [t._slot_rows for t in tables],
                               keys.to(device, torch.int32 if int32 else torch.int64),
                               torch.tensor(bounds, device=device), segment_tables, direct_rows)
    want_rows, want_report = _reference(tables, keys.tolist(), bounds, segment_tables, direct_rows)
    assert rows.tolist() == want_rows
    assert report.tolist() == want_report


@examples(25)
@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=70), seed=st.integers(0, 2 ** 16),
       int32=st.booleans(), outside=st.sampled_from([0.0, 0.01, 0.5]))
def test_lookup_rows_without_rows_reports_what_it_reports_with_them(lengths, seed, int32, outside, device):
    # write_rows=False (every segment direct): the same report, and no rows written.
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    direct_rows = [int(torch.randint(0, 70, (1,), generator=g)) for _ in lengths]  # 0: every key outside
    keys = torch.randint(0, 70, (bounds[-1],), generator=g) % torch.tensor(
        [max(r, 1) for r, n in zip(direct_rows, lengths) for _ in range(n)], dtype=torch.int64)
    bad = torch.rand(keys.shape, generator=g) < outside  # outside at either end
    big = 2 ** 31 - 1 if int32 else 2 ** 40
    keys = torch.where(bad, torch.where(torch.rand(keys.shape, generator=g) < 0.5, -1, big), keys)
    args = ([], [], keys.to(device, torch.int32 if int32 else torch.int64), torch.tensor(bounds, device=device),
            [-1] * len(lengths), direct_rows)
    rows, report = lookup_rows(*args)
    no_rows, same_report = lookup_rows(*args, False)
    assert no_rows.shape == (0,) and no_rows.dtype == torch.int64
    assert same_report.tolist() == report.tolist()
    assert (report[0].item() < keys.numel()) == bool(bad.any()) or 0 in direct_rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad_at", [[], [30000], [9000, 30000], [4095, 4096], [0]])
def test_lookup_rows_finds_the_first_key_outside_across_the_parallel_chunks(bad_at, threads, device):
    # 40000 keys: several tasks of 4096 keys (kHashGrain) over 3 segments; the first key
    # outside is found whichever task meets it, with the rows written or not.
    bounds = [0, 5000, 25000, 40000]
    keys = torch.randint(0, 100, (40000,), generator=torch.Generator().manual_seed(7))
    for i in bad_at:
        keys[i] = 100 if i % 2 else -1
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for write_rows in (True, False):
            rows, report = lookup_rows([], [], keys.to(device), torch.tensor(bounds, device=device), [-1] * 3,
                                       [100] * 3, write_rows)
            assert report.tolist() == [min(bad_at, default=40000), 0, 0]
            if write_rows:
                assert torch.equal(rows.cpu(), torch.where((keys >= 0) & (keys < 100), keys, -2))
    finally:
        torch.set_num_threads(saved)


def test_lookup_rows_without_rows_refuses_a_hash_segment(device):
    table = sk.HashTable(16, device=device)
    with pytest.raises(RuntimeError, match=r"write_rows=False needs every segment direct, but segment_tables\[1\]"):
        lookup_rows([table._slot_keys], [table._slot_rows], torch.arange(6, device=device),
                    torch.tensor([0, 3, 6], device=device), [-1, 0], [10, 0], False)


@pytest.mark.parametrize("bounds", [[1, 4, 6], [0, 4, 5], [0, 5, 4], [0, 7, 6]])
def test_lookup_rows_reports_bad_bounds_and_reads_every_row_as_minus_one(bounds, device):
    table = sk.HashTable(16, device=device)
    table.insert(torch.arange(6, device=device))
    keys = torch.arange(6, device=device)
    rows, report = lookup_rows([table._slot_keys], [table._slot_rows], keys, torch.tensor(bounds, device=device),
                               [0, -1], [0, 10])
    assert rows.tolist() == [-1] * 6
    assert report.tolist() == [6, 0, 1]


@pytest.mark.parametrize("bounds, segments, match", [
    (torch.tensor([0, 6]), [0, 0], "bounds must be a 1-D int64 tensor of 3 entries"),
    (torch.tensor([0, 3, 6], dtype=torch.int32), [0, 0], "bounds must be a 1-D int64"),
    (torch.tensor([[0, 3, 6]]), [0, 0], "bounds must be a 1-D int64"),
])
def test_lookup_rows_refuses_bounds_of_the_wrong_shape_or_dtype(bounds, segments, match, device):
    table = sk.HashTable(16, device=device)
    with pytest.raises(RuntimeError, match=match):
        lookup_rows([table._slot_keys], [table._slot_rows], torch.arange(6, device=device), bounds.to(device),
                    segments, [0] * len(segments))


def _touch_setup(device):
    tables = [sk.HashTable(64, device=device) for _ in range(2)]
    rows = torch.cat([tables[0].insert(torch.arange(10, device=device)), torch.tensor([-1], device=device),
                      tables[1].insert(torch.arange(5, device=device)),
                      tables[1].find(torch.arange(5, device=device))])
    for t in tables:
        t.tick()
    return tables, rows, torch.tensor([0, 11, 21], device=device)


def _scores(tables):
    return [(t._last_seen.tolist(), t._count.tolist()) for t in tables]


def test_touch_scores_each_distinct_row_once(device):
    tables, rows, bounds = _touch_setup(device)
    touch_tables_([t._last_seen for t in tables], [t._count for t in tables], rows, bounds, [0, 1],
                  [len(t) for t in tables], [5, 9])
    assert tables[0]._last_seen[:10].tolist() == [5] * 10 and tables[0]._count[:10].tolist() == [2] * 10
    assert tables[1]._last_seen[:5].tolist() == [9] * 5 and tables[1]._count[:5].tolist() == [2] * 5
    assert tables[0]._count[10:].sum() == 0 and tables[1]._count[5:].sum() == 0


@pytest.mark.parametrize("bad", ["row", "bounds", "earlier"])
def test_touch_with_error_slots_records_instead_of_raising_and_scores_nothing(bad, device):
    tables, rows, bounds = _touch_setup(device)
    errors = torch.full((2,), NONE, device=device)
    if bad == "row":
        rows[13] = 7  # table 1 holds 5 keys
    elif bad == "bounds":
        bounds[1] = 22
    else:
        errors[0] = 3  # an earlier op of the step recorded a bad bag
    before = _scores(tables)
    touch_tables_([t._last_seen for t in tables], [t._count for t in tables], rows, bounds, [0, 1],
                  [len(t) for t in tables], [5, 9], errors)
    assert _scores(tables) == before
    assert errors.tolist() == {"row": [NONE, 13], "bounds": [0, NONE], "earlier": [3, NONE]}[bad]


@pytest.mark.parametrize("bad, match", [("row", r"rows\[13\] = 7 of table 1 is outside its rows \[-1, 5\)"),
                                        ("bounds", "from 0 to 21")])
def test_touch_without_error_slots_raises_and_scores_nothing(bad, match, device):
    tables, rows, bounds = _touch_setup(device)
    if bad == "row":
        rows[13] = 7
    else:
        bounds[1] = 22
    before = _scores(tables)
    with pytest.raises(RuntimeError, match=match):
        touch_tables_([t._last_seen for t in tables], [t._count for t in tables], rows, bounds, [0, 1],
                      [len(t) for t in tables], [5, 9])
    assert _scores(tables) == before


@pytest.mark.parametrize("errors, match", [
    (torch.full((3,), NONE), "errors must be a contiguous int64 tensor \\[2\\]"),
    (torch.full((2,), 0, dtype=torch.int32), "errors must be a contiguous int64 tensor \\[2\\]"),
])
def test_touch_refuses_error_slots_of_the_wrong_shape_or_dtype(errors, match, device):
    tables, rows, bounds = _touch_setup(device)
    before = _scores(tables)
    with pytest.raises(RuntimeError, match=match):
        touch_tables_([t._last_seen for t in tables], [t._count for t in tables], rows, bounds, [0, 1],
                      [len(t) for t in tables], [5, 9], errors.to(device))
    assert _scores(tables) == before


# CPU only: the fakes accept CPU (and meta) tensors.
def test_lookup_rows_and_touch_opcheck():
    from torch.library import opcheck

    tables = _tables("cpu", 3)
    keys = torch.randint(-3, 70, (40,), generator=torch.Generator().manual_seed(3))
    bounds = torch.tensor([0, 10, 10, 25, 40])
    args = ([t._slot_keys for t in tables], [t._slot_rows for t in tables], keys, bounds, [0, -1, 2, -2],
            [0, 30, 0, 0])
    opcheck(lookup_rows, args)
    opcheck(lookup_rows, ([], [], keys, bounds, [-1] * 4, [30, 5, 70, 0], False))
    rows, _ = lookup_rows(*args)
    rows = rows.clamp(min=-1)  # a direct segment's keys: not scored below
    opcheck(touch_tables_, ([t._last_seen for t in tables], [t._count for t in tables], rows, bounds,
                            [0, -1, 2, -1], [len(t) for t in tables], [4, 5, 6],
                            torch.full((2,), NONE)))

"""The multi-table CPU ops of an EmbeddingBagCollection step and of LazyAdam:
unique_tables against a dedup table by table in plain Python and against the
two-unique path the collection takes on other devices; lazy_adam_tables_ against
lazy_adam_ table by table, bit for bit; LazyAdam, whose float32 CPU tables go
through lazy_adam_tables_, against its one-table path; segment_sum_parts (the pooled
features' gradients summed where they lie) against segment_sum of their concatenation;
_sort_rows (the owners' rows in order for a coalesced gradient) against a stable sort.

Thresholds crossed (keep in step with csrc/cpu/unique_cpu.cpp and lazy_adam_cpu.cpp):
the inverse remap's tasks of 2^14 keys (kScanGrain) that start inside a segment, span
several or skip empty ones; tables of 0, 1 and 70,000 keys; the update's tasks of
16384 / dim rows that span several tables; _sort_rows' switch from numpy's packed
sort to torch's at 50,000 rows, and rows too large to pack.

Tests of the ops themselves take the `device` fixture (on CUDA the composites of
sparsekit/tables_cuda.py); those marked "CPU only" are about the fakes (opcheck), LazyAdam's
and the exchange's CPU paths.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

import sparsekit as sk
from sparsekit import shard_registry
from sparsekit.exchange import _NUMPY_SORT_MAX_ROWS, _sort_rows
from properties import examples, make_keys, num_threads, thread_counts

unique_tables = torch.ops.sparsekit.unique_tables


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """``torch.use_deterministic_algorithms(on)`` for the block, the old setting restored after."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on or old)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
lazy_adam_tables = torch.ops.sparsekit.lazy_adam_tables_


def reference_unique_tables(keys, offsets, tables, num_tables):
    """Table by table in Python: each table's keys in order of first occurrence over its segments."""
    distinct = [dict() for _ in range(num_tables)]
    local = []
    for s, t in enumerate(tables):
        for key in keys[offsets[s]:offsets[s + 1]].tolist():
            local.append((t, distinct[t].setdefault(key, len(distinct[t]))))
    base = [0]
    for d in distinct:
        base.append(base[-1] + len(d))
    unique_keys = torch.tensor([k for d in distinct for k in d], dtype=keys.dtype)
    inverse = torch.tensor([base[t] + i for t, i in local], dtype=torch.int64)
    return unique_keys, inverse, torch.tensor([len(d) for d in distinct], dtype=torch.int64)


def segments(sizes, tables_of):
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return offsets, tables_of


@examples(20)
@given(sizes=st.lists(st.sampled_from([0, 1, 5, 300, 16383, 16384, 16385, 40_000]), min_size=0, max_size=6),
       num_tables=st.integers(1, 4), distribution=st.sampled_from(["zipf", "extremes", "small_range",
                                                                      "all_distinct", "all_equal"]),
       dtype=st.sampled_from([torch.int64, torch.int32]), threads=thread_counts, data=st.data())
def test_unique_tables_matches_a_dedup_table_by_table(sizes, num_tables, distribution, dtype, threads, data, device):
    tables = data.draw(st.lists(st.integers(0, num_tables - 1), min_size=len(sizes), max_size=len(sizes)))
    offsets, tables = segments(sizes, tables)
    keys = make_keys(offsets[-1], distribution, data.draw(st.integers(0, 2**31 - 1)), dtype)
    with num_threads(threads):
        got = unique_tables(keys.to(device), offsets, tables, num_tables)
    assert all(g.device.type == device.type for g in got)  # cuda:0 is not torch.device("cuda")
    got = [g.cpu() for g in got]
    want = reference_unique_tables(keys, offsets, tables, num_tables)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(got[0][got[1]], keys)


def test_unique_tables_empty_and_tableless(device):
    keys = torch.zeros(0, dtype=torch.int64, device=device)
    u, inv, per = unique_tables(keys, [0], [], 3)
    assert u.numel() == 0 and inv.numel() == 0 and per.tolist() == [0, 0, 0]
    u, inv, per = unique_tables(keys, [0], [], 0)
    assert per.numel() == 0


@pytest.mark.parametrize("call, match", [
    (lambda k: unique_tables(k.float(), [0, 4], [0], 1), "keys must be an int64 or int32"),
    (lambda k: unique_tables(k.view(2, 2), [0, 4], [0], 1), "keys must be 1-D"),
    (lambda k: unique_tables(k, [0, 4], [0], -1), r"num_tables must lie in \[0, 2\^20\]"),
    (lambda k: unique_tables(k, [0, 2, 4], [0], 1), "offsets must hold one more entry than tables"),
    (lambda k: unique_tables(k, [0, 3], [0], 1), "offsets must run from 0 to 4"),
    (lambda k: unique_tables(k, [0, 3, 2, 4], [0, 0, 0], 1), r"offsets must never decrease"),
    (lambda k: unique_tables(k, [0, 2, 4], [0, 2], 2), r"tables\[1\] = 2 is not a table in \[0, 2\)"),
])
def test_unique_tables_rejects_bad_arguments_by_name(call, match, device):
    with pytest.raises(RuntimeError, match=match):
        call(torch.arange(4, device=device))


# CPU only: the fakes of the multi-table ops accept CPU (and meta) tensors.
def test_unique_tables_opcheck():
    keys = make_keys(5000, "zipf", 3)
    opcheck(unique_tables, (keys, [0, 1000, 1000, 5000], [1, 0, 1], 2))


def adam_tables(num_tables, seed, dims=None, counts=None, dtype=torch.float32, device="cpu"):
    """Per table (weight, exp_avg, exp_avg_sq, rows, grad, step, hyper) with distinct rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(num_tables):
        dim = dims[t] if dims else int(torch.randint(1, 40, (1,), generator=g))
        num_rows = int(torch.randint(1, 3000, (1,), generator=g))
        count = min(num_rows, counts[t] if counts else int(torch.randint(0, num_rows + 1, (1,), generator=g)))
        weight = torch.randn(num_rows, dim, generator=g, dtype=dtype)
        exp_avg = 0.1 * torch.randn(num_rows, dim, generator=g, dtype=dtype)
        exp_avg_sq = 0.01 * torch.rand(num_rows, dim, generator=g, dtype=dtype)
        rows = torch.randperm(num_rows, generator=g)[:count]
        grad = torch.randn(count, dim, generator=g, dtype=dtype)
        step = int(torch.randint(1, 50, (1,), generator=g))
        hyper = [float(torch.rand(1, generator=g)) * 0.1, 0.9 - 0.1 * t % 0.5, 0.999 - 0.01 * t % 0.1,
                 10.0 ** -(4 + t % 5), 0.0 if t % 2 else 0.01]
        out.append(tuple(x.to(device) for x in (weight, exp_avg, exp_avg_sq, rows, grad)) + (step, hyper))
    return out


def run_tables(tables):
    columns = [[t[i] for t in tables] for i in range(5)]
    lazy_adam_tables(*columns, [t[5] for t in tables], [h for t in tables for h in t[6]])


@examples(15)
@given(num_tables=st.integers(1, 6), counts=st.lists(st.sampled_from([0, 1, 3, 1023, 1024, 1025, 2999]),
                                                    min_size=6, max_size=6),
       dims=st.lists(st.sampled_from([1, 3, 4, 16, 17, 64]), min_size=6, max_size=6),
       threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_lazy_adam_tables_matches_lazy_adam_table_by_table_bit_for_bit(num_tables, counts, dims, threads, seed,
                                                                       device):
    fused = adam_tables(num_tables, seed, dims, counts, device=device)
    alone = [tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in t) for t in fused]
    with num_threads(threads):
        run_tables(fused)
    for weight, exp_avg, exp_avg_sq, rows, grad, step, hyper in alone:
        sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, grad, step, *hyper)
    for a, b in zip(fused, alone):
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lazy_adam_tables_half_weights_match_lazy_adams_float32_copies_bit_for_bit(dtype, device):
    """A half weight with float32 moments and gradient (a half embedding shard), beside
    float32 tables: as LazyAdam's one-table path for such a shard (float32 copies of the
    rows through lazy_adam_, rounded back to nearest)."""
    fused = adam_tables(4, 21, dims=[16, 5, 33, 1], counts=[300, 7, 2000, 1], device=device)
    for j in (0, 2, 3):
        fused[j] = (fused[j][0].to(dtype),) + fused[j][1:]
    alone = [tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in t) for t in fused]
    run_tables(fused)
    for weight, exp_avg, exp_avg_sq, rows, grad, step, hyper in alone:
        local = [t.index_select(0, rows).float() for t in (weight, exp_avg, exp_avg_sq)]
        sk.ops.lazy_adam_(*local, torch.arange(rows.numel(), device=device), grad, step, *hyper)
        for target, updated in zip((weight, exp_avg, exp_avg_sq), local):
            target.index_copy_(0, rows, updated.to(target.dtype))
    for a, b in zip(fused, alone):
        for x, y in zip(a[:3], b[:3]):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("dim", [8, 13])
def test_lazy_adam_tables_half_weights_round_trip_every_value(dim, device):
    """A float16 weight widens to float32 and rounds back in the fused step (F16C where the
    CPU has it): with lr 0 every bit pattern but NaN (zeros of both signs, subnormals, inf)
    comes back unchanged, in the 8-wide loop and its tail."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    bits = torch.cat([bits, bits.new_zeros(-bits.shape[0] % dim)])
    weight = bits.view(torch.float16).reshape(-1, dim).to(device)
    before = weight.clone()
    rows = torch.arange(weight.shape[0], device=device)
    moments = [torch.zeros(weight.shape, device=device) for _ in range(2)]
    lazy_adam_tables([weight], [moments[0]], [moments[1]], [rows], [torch.ones(weight.shape, device=device)], [1],
                     [0.0, 0.9, 0.999, 1e-8, 0.0])
    nan = torch.isnan(before)
    assert torch.equal(torch.isnan(weight), nan)
    assert torch.equal(weight[~nan].view(torch.int16), before[~nan].view(torch.int16))


def test_lazy_adam_tables_bad_row_in_one_table_changes_no_table(device):
    tables = adam_tables(4, 5, counts=[50, 50, 50, 50], device=device)
    before = [[x.clone() for x in t[:3]] for t in tables]
    tables[2][3][7] = tables[2][0].shape[0]  # one past the end
    with pytest.raises(RuntimeError, match=r"rows\[2\] holds .* outside \[0, .*nothing was updated"):
        run_tables(tables)
    for t, saved in zip(tables, before):
        for x, y in zip(t[:3], saved):
            assert torch.equal(x, y)


@pytest.mark.parametrize("change, match", [
    (lambda t: t[1].__setitem__(0, t[1][0].new_zeros(2, 3)), r"must be contiguous with the shape of exp_avgs\[0\]"),
    (lambda t: t[2].__setitem__(0, t[2][0].new_zeros(2, 3)), "exp_avg_sq .* must have the shape of weight"),
    (lambda t: t[1].__setitem__(0, t[1][0].double()), r"exp_avgs\[0\] must be float32"),
    (lambda t: t[5].__setitem__(0, 0), "step must be >= 1"),
    (lambda t: t[6].__setitem__(1, 1.0), r"beta1 must be in \[0, 1\)"),
    (lambda t: [t[i].__setitem__(0, t[i][0].double()) for i in (0, 1, 2, 4)], r"weights\[0\] must be a float32, float16 or bfloat16"),
])
def test_lazy_adam_tables_rejects_bad_arguments(change, match, device):
    tables = adam_tables(2, 9, dims=[3, 3], counts=[4, 4], device=device)
    columns = [[t[i] for t in tables] for i in range(5)] + [[t[5] for t in tables], [h for t in tables for h in t[6]]]
    # Columns: 0 weights, 1 exp_avgs, ..., 5 steps, 6 hyper (flat).
    change(columns)
    with pytest.raises(RuntimeError, match=match):
        lazy_adam_tables(*columns)


# CPU only: the fakes of the multi-table ops accept CPU (and meta) tensors.
def test_lazy_adam_tables_opcheck():
    tables = adam_tables(3, 11, counts=[10, 0, 20])
    opcheck(lazy_adam_tables, ([[t[i] for t in tables] for i in range(5)]
                               + [[t[5] for t in tables], [h for t in tables for h in t[6]]]))


def sparse_grads(params, seed, coalesced=True):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        n = int(torch.randint(0, p.shape[0] + 1, (1,), generator=g))
        rows = torch.randperm(p.shape[0], generator=g)[:n] if coalesced else \
            torch.randint(0, p.shape[0], (n,), generator=g)
        values = torch.randn(n, *p.shape[1:], generator=g, dtype=p.dtype)
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, p.shape)
        p.grad = grad.coalesce() if coalesced else grad


def one_table_path(optimizer):
    """Makes ``optimizer`` update every parameter through its one-table path."""
    optimizer._fusable = lambda param: False
    return optimizer


# CPU only: LazyAdam's CPU paths (fused and one table at a time).
@pytest.mark.parametrize("maximize", [False, True])
def test_lazy_adam_fused_tables_match_its_one_table_path(maximize):
    """Two groups with their own settings; float32 tables (fused), a float64 table and a
    column slice (one table at a time), uncoalesced gradients and a dense parameter."""
    def model(seed):
        g = torch.Generator().manual_seed(seed)
        big = torch.randn(300, 8, generator=g)
        return [torch.nn.Parameter(torch.randn(200, 16, generator=g)),
                torch.nn.Parameter(torch.randn(50, 3, generator=g)),
                torch.nn.Parameter(torch.randn(100, 4, generator=g, dtype=torch.float64)),
                torch.nn.Parameter(big[:, :5]),
                torch.nn.Parameter(torch.randn(7, 7, generator=g))]

    def run(optimizer_of):
        params = model(0)
        opt = optimizer_of([{"params": params[:3], "lr": 0.01},
                            {"params": params[3:], "lr": 0.003, "betas": (0.8, 0.99), "weight_decay": 0.1}])
        for step in range(4):
            sparse_grads(params[:4], step, coalesced=step % 2 == 0)
            params[4].grad = torch.full_like(params[4], 0.1 * step)
            opt.step()
        return params, opt

    fused, fused_opt = run(lambda groups: sk.LazyAdam(groups, maximize=maximize))
    assert fused_opt.state[fused[0]]["step"] == 4
    alone, alone_opt = run(lambda groups: one_table_path(sk.LazyAdam(groups, maximize=maximize)))
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)
    for a, b in zip(fused, alone):
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(fused_opt.state[a][name], alone_opt.state[b][name])


# CPU only: LazyAdam's fused CPU path.
def test_lazy_adam_bad_row_in_a_fused_table_changes_nothing():
    params = [torch.nn.Parameter(torch.randn(20, 4)) for _ in range(3)] + \
        [torch.nn.Parameter(torch.randn(5, 5, dtype=torch.float64))]
    opt = sk.LazyAdam(params, lr=0.1)
    sparse_grads(params, 1)
    opt.step()
    sparse_grads(params, 2)
    params[1].grad = torch.sparse_coo_tensor(torch.tensor([[3, 20]]), torch.ones(2, 4), (20, 4))
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with pytest.raises(RuntimeError, match=r"parameter 1 of group 0 names row 20, outside \[0, 20\); nothing was"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[id(p)][k])


segment_sum_parts = torch.ops.sparsekit.segment_sum_parts


@examples(15)
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 2048, 2049, 5000]), min_size=1, max_size=5),
       dim=st.sampled_from([1, 3, 16, 17, 128]), num_segments=st.sampled_from([1, 5, 3000]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       threads=thread_counts, seed=st.integers(0, 2**31 - 1))
def test_segment_sum_parts_matches_segment_sum_of_the_concatenation_bit_for_bit(sizes, dim, num_segments, dtype,
                                                                                 threads, seed, device):
    """Rows of kListRows (2048) blocks that straddle the parts' edges, empty parts,
    padding ids (-1) and every dtype. (On CUDA both deterministic: atomics add in any order.)"""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, dim, generator=g).to(dtype).to(device) for n in sizes]
    ids = torch.randint(-1, num_segments, (sum(sizes),), generator=g).to(device)
    with num_threads(threads), deterministic_algorithms(device.type != "cpu"):
        got = segment_sum_parts(parts, ids, num_segments)
        want = sk.ops.segment_sum(torch.cat(parts), ids, num_segments)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("call, match", [
    (lambda p, i: segment_sum_parts([], i[:0], 4), "data must hold at least one tensor"),
    (lambda p, i: segment_sum_parts([p, p[:, :2]], i.repeat(2), 4), r"data\[1\] .* row shape of data\[0\]"),
    (lambda p, i: segment_sum_parts([p, p.double()], i.repeat(2), 4), r"data\[1\] .* dtype"),
    (lambda p, i: segment_sum_parts([p, p], i, 4), "one entry per row of data"),
    (lambda p, i: segment_sum_parts([p], i.float(), 4), "segment_ids must be an int64 or int32"),
    (lambda p, i: segment_sum_parts([p], i, 3), "segment_ids holds 3 but num_segments is 3"),
    (lambda p, i: segment_sum_parts([p.long()], i, 4), "must be float32"),
])
def test_segment_sum_parts_rejects_bad_arguments_by_name(call, match, device):
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(4, 3, device=device), torch.tensor([0, 3, 1, -1], device=device))


# CPU only: the fakes of the multi-table ops accept CPU (and meta) tensors.
def test_segment_sum_parts_opcheck():
    parts = [torch.randn(n, 4) for n in (3, 0, 10)]
    opcheck(segment_sum_parts, (parts, torch.randint(0, 6, (13,)), 6))


# CPU only: LazyAdam's CPU paths.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lazy_adam_fused_half_shards_match_its_one_table_path(dtype):
    """Half-precision embedding shards (float32 moments) go through the fused kernel next
    to float32 tables; the same weights and moments as one table at a time."""
    def run(optimizer_of):
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(100, 16, generator=g).to(dtype)),
                  torch.nn.Parameter(torch.randn(40, 8, generator=g))]
        shard_registry.register(params[0])
        opt = optimizer_of(params)
        for step in range(3):
            sparse_grads(params, step)
            opt.step()
        return params, opt

    fused, fused_opt = run(lambda params: sk.LazyAdam(params, lr=0.01))
    assert fused_opt._fusable(fused[0]) and fused_opt.state[fused[0]]["exp_avg"].dtype == torch.float32
    alone, alone_opt = run(lambda params: one_table_path(sk.LazyAdam(params, lr=0.01)))
    for a, b in zip(fused, alone):
        assert a.dtype == b.dtype and torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fused_opt.state[a][name], alone_opt.state[b][name])


# CPU only: the exchange's CPU sort.
@examples(20)
@given(n=st.sampled_from([0, 1, 2, 3, 1023, 1024, 1025, 11_000, _NUMPY_SORT_MAX_ROWS, _NUMPY_SORT_MAX_ROWS + 1]),
       missing=st.sampled_from([0.0, 0.1, 1.0]),
       bound=st.sampled_from([1 << 20, 1 << 40, (1 << 62) - 1]), seed=st.integers(0, 2**31 - 1))
def test_sort_rows_matches_a_stable_sort(n, missing, bound, seed):
    """Distinct rows (any int64 up to 2^62, too large to pack among them) with repeats of
    -1: the rows ascending and the permutation that reads them, -1 first."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.unique(torch.randint(0, bound, (n,), generator=generator))  # distinct (a few fewer at most)
    n = rows.numel()
    rows = rows[torch.randperm(n, generator=generator)]
    rows = torch.where(torch.rand(n, generator=generator) < missing, -1, rows)
    sorted_rows, order = _sort_rows(rows)
    expected, expected_order = torch.sort(rows, stable=True)
    assert sorted_rows.dtype == order.dtype == torch.int64
    assert torch.equal(sorted_rows, expected)
    assert torch.equal(torch.sort(order).values, torch.arange(n))
    assert torch.equal(rows[order], expected)
    found = expected >= 0
    assert torch.equal(order[found], expected_order[found])

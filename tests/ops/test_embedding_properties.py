"""Property-based tests of embedding_bag and embedding_gather (hypothesis).

Every drawn case runs forward and backward and is compared with a plain-torch float64
reference (index_add segment sums, nn.functional.embedding_bag for max); on CUDA the CUDA
kernel is also compared with the CPU kernel. Errors are bounded per element by the same
computation over absolute values (a sum of n terms in a type with epsilon eps is off by at
most about n * eps * sum |terms|), so long bags and hot rows get a fair tolerance.

Thresholds crossed (keep in step with the kernels): CPU column passes (below), bag chunks
handed to threads; the backward's numbering of the distinct rows, by unique_bounded's bitmap
or, for a table of more than ``128 * nnz + 2^16`` rows (``ops._bitmap_numbers``), by the
hash-based unique and a sort ("past_bitmap" tables); CUDA 16-byte packets (D a multiple of
4 or 8) or single elements, lane groups up to a warp, bags longer than kChunk = 1024 lookups
split in pieces (long_bag_len).

CPU column passes (csrc/cpu/embedding_cpu.cpp, pool_bag_range): accumulator vectors of L
lanes (AVX-512, taken when L64 divides D: L64 = 16 float / 8 double columns; else AVX2 or
baseline: L32 = 8 / 4), blocks of 16 vectors, then one pass each of 8, 4, 2 and 1 vectors
and a scalar tail; a dim that one pass covers whole (1, 2, 4, 8 or 16 vectors) takes a bag
loop of that pass alone (pool_bag_range_one_pass: DIMS 8 to 256, every width and
accumulator type). float16/bfloat16 accumulate in float. COLUMN_PASS_DIMS reach every pass
of every width and both accumulator types (test_embedding_bag_column_passes):
- D = 127: float AVX2 8, 4, 2, 1 vectors + tail; double AVX2 16-block, 8, 4, 2, 1 + tail.
- D = 248: float AVX2 16-block, 8, 4, 2, 1 (248 % 16 = 8); double AVX-512 16-block, 8, 4, 2, 1.
- D = 496: float AVX-512 16-block, 8, 4, 2, 1; double AVX-512 16-block x3, 8, 4, 2.
(Under SPARSEKIT_CPU_CAPABILITY=avx2 or default, every dim takes the 32-byte passes; the
same three dims still reach all of them.) The drawn DIMS add 8, 32, 48, 96 and 256 to the
hypothesis cases.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from sparsekit import ops
from properties import examples, num_threads, sizes, thread_counts

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DIMS = [0, 1, 3, 8, 16, 32, 48, 64, 96, 128, 129, 256, 272]
COLUMN_PASS_DIMS = [127, 248, 496]
# Dims one pass covers whole: 1, 2, 4, 8 and 16 vectors of AVX-512 float (16 lanes) or
# double (8: 16, 64, 128 also), and of AVX2 (8 / 4 lanes: 8, 16, 32, 64, 128 float).
ONE_PASS_DIMS = [8, 16, 32, 64, 128, 256]
# Dims of the tables past the bitmap threshold (their gradients are num_rows x D dense in
# the reference: kept small).
BIG_TABLE_DIMS = [1, 3, 16]
# Unit roundoff of the accumulator (float32 for every type but float64) and of the output.
ACCUMULATOR_EPS = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24}
OUTPUT_EPS = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MAX_NNZ = 40_000


def past_bitmap_rows(nnz, delta):
    """A table size ``delta`` rows past the last one whose backward numbers its rows with the
    bitmap (delta 0: that last size; 1 and more: the hash-based unique and a sort)."""
    return ops._BOUNDED_UNIQUE_BITS_PER_KEY * nnz + (1 << 16) + delta


@st.composite
def bag_cases(draw):
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    num_rows = draw(st.sampled_from([1, 7, 300, 5000, "past_bitmap"]))
    big = num_rows == "past_bitmap"  # small batches and dims: the table has ~10^5 rows
    return dict(
        mode=mode,
        weighted=draw(st.booleans()) and mode != "max",
        dtype=draw(st.sampled_from(DTYPES)),
        dim=draw(st.sampled_from(BIG_TABLE_DIMS if big else DIMS)),
        bags=draw(sizes(64 if big else 20_000)),
        max_len=draw(st.sampled_from([0, 1, 3, 8] if big else [0, 1, 3, 8, 40])),
        long_bag_len=draw(st.sampled_from([0] if big else [0, 0, 1023, 1024, 1025, 2 * 1024 + 7, 5000])),
        num_rows=num_rows,
        past=draw(st.sampled_from([0, 1, 2, 4099])),
        missing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        hot=draw(st.sampled_from([0.0, 0.5, 1.0])),
        padding=draw(st.sampled_from([None, 0, -1, 3])),
        include_last_offset=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        threads=draw(thread_counts),
        seed=draw(st.integers(0, 2**31 - 1)),
        # The CPU pooling's prefetch plan (None: the library's own choice); see forced_plan.
        plan=draw(st.sampled_from([None, "every", "first"])),
    )


def forced_plan(plan):
    """SPARSEKIT_POOL_PREFETCH=plan for the block (read by every CPU pooling call), the
    environment put back after it: the two plans pool the same rows in the same order, and
    each must be right on its own."""
    return mock.patch.dict(os.environ, {} if plan is None else {"SPARSEKIT_POOL_PREFETCH": plan})


def make_bags(case):
    """rows [nnz], CSR offsets [bags + 1] (int64, CPU) and the table / weights of a case."""
    gen = torch.Generator().manual_seed(case["seed"])
    bags = case["bags"]
    max_len = min(case["max_len"], MAX_NNZ // max(bags, 1))
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    if bags and case["long_bag_len"]:
        lengths[int(torch.randint(0, bags, (1,), generator=gen))] = case["long_bag_len"]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    nnz = int(offsets[-1])
    num_rows = case["num_rows"]
    if num_rows == "past_bitmap":
        num_rows = past_bitmap_rows(nnz, case["past"])
    rows = torch.randint(0, num_rows, (nnz,), generator=gen)
    rows[torch.rand(nnz, generator=gen) < case["hot"]] = num_rows // 2
    rows[torch.rand(nnz, generator=gen) < case["missing"] * 0.3] = -1
    if case["padding"] is not None and num_rows > 3:
        rows[torch.rand(nnz, generator=gen) < 0.1] = case["padding"] % num_rows
    weight = torch.randn(num_rows, case["dim"], generator=gen, dtype=torch.float64).to(case["dtype"])
    psw = None
    if case["weighted"]:
        psw = (torch.rand(nnz, generator=gen, dtype=torch.float64) + 0.5).to(case["dtype"])
    grad_out = torch.randn(bags, case["dim"], generator=gen, dtype=torch.float64).to(case["dtype"])
    return rows, offsets, weight, psw, grad_out


def reference_bag(weight, rows, offsets, psw, mode, padding_row):
    """Float64 pooling with plain torch: -1 and padding rows map to an extra zero row."""
    num_rows, dim = weight.shape
    bags = offsets.shape[0] - 1
    padded = torch.cat([weight, weight.new_zeros(1, dim)])
    r = torch.where((rows == -1) | (rows == padding_row), num_rows, rows)
    if mode == "max":
        if bags == 0 or dim == 0:
            return padded.new_zeros(bags, dim) + padded.sum() * 0
        return F.embedding_bag(r, padded, offsets, mode="max", include_last_offset=True, padding_idx=num_rows)
    bag = torch.repeat_interleave(torch.arange(bags), offsets.diff(), output_size=rows.shape[0])
    valid = r != num_rows
    w = torch.ones(rows.shape[0], dtype=torch.float64) if psw is None else psw
    w = torch.where(valid, w, 0.0)
    total = padded.new_zeros(bags, dim).index_add(0, bag, padded[r] * w[:, None])
    if mode == "sum":
        return total
    denominator = w.new_zeros(bags).index_add(0, bag, w)
    return torch.where(denominator[:, None] != 0, total / denominator.clamp_min(1e-300)[:, None], 0.0)


def assert_within(ours, expected, bound, dtype, what, terms=1):
    """|ours - expected| <= (terms * eps_acc + eps_out) * (bound + 1), up to a factor 4, elementwise.

    bound is the same computation over absolute values; terms the most terms any one
    result sums (a sum of n terms rounds n - 1 times)."""
    ours, expected, bound = ours.double().cpu(), expected.double().cpu(), bound.double().cpu()
    slack = (max(terms, 1) * ACCUMULATOR_EPS[dtype] + OUTPUT_EPS[dtype]) * (bound + 1) * 4
    excess = (ours - expected).abs() - slack
    assert not (excess > 0).any(), f"{what}: off by {excess.max().item()} over the bound"


def first_occurrence(rows, padding_row):
    return [r for r in dict.fromkeys(rows.tolist()) if r != -1 and r != padding_row]


def ascending(rows, padding_row):
    return sorted(first_occurrence(rows, padding_row))


@examples(60)
@given(case=bag_cases())
def test_embedding_bag_matches_reference(device, case):
    check_bag_case(device, case)


def check_bag_case(device, case):
    with forced_plan(case.get("plan")):
        check_bag_case_under_plan(device, case)


def check_bag_case_under_plan(device, case):
    rows, offsets, weight, psw, grad_out = make_bags(case)
    mode, dtype = case["mode"], case["dtype"]
    num_rows = weight.shape[0]
    padding_idx = case["padding"] if case["padding"] is None or -num_rows <= case["padding"] < num_rows else None
    padding_row = -1 if padding_idx is None else padding_idx % num_rows
    passed_offsets = offsets if case["include_last_offset"] else offsets[:-1]
    if not case["include_last_offset"] and offsets.shape[0] == 1 and rows.shape[0] > 0:
        return  # no bag at all: nn.EmbeddingBag-style offsets cannot describe the rows

    def run(dev):
        leaf = weight.to(dev).requires_grad_()
        leaf_psw = None if psw is None else psw.to(dev).requires_grad_()
        out = ops.embedding_bag(leaf, rows.to(dev, case["index_dtype"]), passed_offsets.to(dev, case["index_dtype"]),
                                leaf_psw, mode, padding_idx, case["include_last_offset"])
        inputs = (leaf,) if leaf_psw is None else (leaf, leaf_psw)
        grads = torch.autograd.grad(out, inputs, grad_out.to(dev), allow_unused=True)
        return out.detach(), grads

    with num_threads(case["threads"]):
        out, grads = run(torch.device("cpu"))
    assert out.shape == (offsets.shape[0] - 1, weight.shape[1]) and out.dtype == dtype

    # forward against float64 torch, with a bound from the absolute values
    w64 = weight.double().requires_grad_()
    p64 = None if psw is None else psw.double().requires_grad_()
    expected = reference_bag(w64, rows, offsets, p64, mode, padding_row)
    bound = reference_bag(weight.double().abs(), rows, offsets, None if psw is None else psw.double().abs(), mode,
                          padding_row)
    longest_bag = int(offsets.diff().max()) if offsets.shape[0] > 1 else 0
    valid_rows = rows[(rows != -1) & (rows != padding_row)]
    hottest_row = int(torch.bincount(valid_rows).max()) if valid_rows.numel() else 0
    if mode == "max":
        assert torch.equal(out, expected.detach().to(dtype)), "max is a selection: exact"
    else:
        assert_within(out, expected.detach(), bound, dtype, "forward", longest_bag)

    # backward: the sparse weight gradient, one entry per distinct valid row
    g64 = grad_out.double()
    ref_grads = torch.autograd.grad(expected, (w64,) if p64 is None else (w64, p64), g64, allow_unused=True)
    grad = grads[0]
    assert grad.layout == torch.sparse_coo and grad.shape == weight.shape and grad.dtype == dtype
    # CPU: the distinct rows ascending, flagged coalesced (CUDA: first occurrence, below)
    assert grad._indices()[0].tolist() == ascending(rows, padding_row) and grad.is_coalesced()
    w_abs = weight.double().abs().requires_grad_()
    (grad_bound,) = torch.autograd.grad(
        reference_bag(w_abs, rows, offsets, None if psw is None else psw.double().abs(),
                      "sum" if mode == "max" else mode, padding_row), (w_abs,), g64.abs())
    assert_within(grad.to_dense(), ref_grads[0] if ref_grads[0] is not None else torch.zeros_like(w64), grad_bound,
                  dtype, "weight gradient", hottest_row)
    if psw is not None and dtype in (torch.float32, torch.float64) and weight.shape[1] > 0:
        bag = torch.repeat_interleave(torch.arange(offsets.shape[0] - 1), offsets.diff(), output_size=rows.shape[0])
        x = torch.cat([weight.double(), weight.new_zeros(1, weight.shape[1]).double()])[rows.clamp_min(0)].abs()
        psw_bound = (g64.abs()[bag] * (x + bound[bag])).sum(1)
        assert_within(grads[1], ref_grads[1], psw_bound, dtype, "per_sample_weights gradient",
                      longest_bag + weight.shape[1])

    if device.type == "cuda":
        cuda_out, cuda_grads = run(device)
        if mode == "max":
            assert torch.equal(cuda_out.cpu(), out), "max: CUDA and CPU select the same values"
        else:
            assert_within(cuda_out, out, bound, dtype, "CUDA forward vs CPU", longest_bag)
        assert cuda_grads[0]._indices()[0].tolist() == first_occurrence(rows, padding_row)
        assert_within(cuda_grads[0].to_dense(), grad.to_dense(), grad_bound, dtype, "CUDA weight gradient vs CPU",
                      hottest_row)
        again_out, again_grads = run(device)
        assert torch.equal(again_out, cuda_out) and torch.equal(again_grads[0]._values(), cuda_grads[0]._values())


def seeded_case(**changes):
    """A fixed bag case (the strategy's fields) for the seeded tests below."""
    case = {"mode": "sum", "weighted": False, "dtype": torch.float32, "dim": 16, "bags": 37, "max_len": 8,
            "long_bag_len": 0, "num_rows": 300, "past": 1, "missing": 0.1, "hot": 0.0, "padding": None,
            "include_last_offset": True, "index_dtype": torch.int64, "threads": 2, "seed": 12345}
    case.update(changes)
    return case


# (mode, weighted): the three pooling loops (sum and mean share one).
POOLING_LOOPS = [("sum", False), ("mean", True), ("max", False)]


@pytest.mark.parametrize("plan", ["every", "first"])
@pytest.mark.parametrize("mode, weighted", POOLING_LOOPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", COLUMN_PASS_DIMS)
def test_embedding_bag_column_passes(device, dim, dtype, mode, weighted, plan):
    """Every column pass of the CPU kernel (see the module docstring), forward and backward,
    for every pooling loop and dtype, under each prefetch plan: the drawn cases reach them
    only by chance."""
    check_bag_case(device, seeded_case(dim=dim, dtype=dtype, mode=mode, weighted=weighted, seed=dim, plan=plan))


@pytest.mark.parametrize("plan", ["every", "first"])
@pytest.mark.parametrize("padding", [None, 7])
@pytest.mark.parametrize("mode, weighted", [*POOLING_LOOPS, ("mean", False)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", ONE_PASS_DIMS)
def test_embedding_bag_one_pass_dims(device, dim, dtype, mode, weighted, padding, plan):
    """The bag loops of one column pass (pool_bag_range_one_pass; sum and mean through
    SumPass, its padding test chosen once a call), every pooling loop and dtype, with and
    without a padding row, bad rows (`past`) and missing ones, under each prefetch plan."""
    check_bag_case(device, seeded_case(dim=dim, dtype=dtype, mode=mode, weighted=weighted, padding=padding,
                                       seed=dim + 1, plan=plan))


@pytest.mark.parametrize("mode, weighted", POOLING_LOOPS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("past, hot, padding", [(0, 0.0, None), (1, 0.5, -1), (4099, 0.0, 3)])
def test_embedding_bag_gradient_past_the_bitmap_threshold(device, past, hot, padding, index_dtype, mode, weighted):
    """The backward of a table of more than 128 * nnz + 2^16 rows numbers its rows with the
    hash-based unique and a sort (past 0: the last table size that still takes the bitmap)."""
    case = seeded_case(num_rows="past_bitmap", past=past, hot=hot, padding=padding, index_dtype=index_dtype,
                       mode=mode, weighted=weighted, dim=3, seed=past + 7, bags=40, max_len=6)
    nnz = int(make_bags(case)[0].shape[0])
    assert nnz > 0 and ops._bitmap_numbers(past_bitmap_rows(nnz, past), nnz) == (past == 0)
    check_bag_case(device, case)


@st.composite
def gather_cases(draw):
    num_rows = draw(st.sampled_from([1, 7, 300, 5000, "past_bitmap"]))
    big = num_rows == "past_bitmap"
    return dict(
        dtype=draw(st.sampled_from(DTYPES)),
        dim=draw(st.sampled_from(BIG_TABLE_DIMS if big else DIMS)),
        n=draw(sizes(300)) if big else draw(sizes(60_000)),
        num_rows=num_rows,
        past=draw(st.sampled_from([0, 1, 4099])),
        missing=draw(st.sampled_from([0.0, 0.2, 1.0])),
        hot=draw(st.sampled_from([0.0, 0.9])),
        shape2d=draw(st.booleans()),
        misaligned=draw(st.booleans()),
        threads=draw(thread_counts),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@examples(30)
@given(case=gather_cases())
def test_embedding_gather_matches_reference(device, case):
    check_gather_case(device, case)


@pytest.mark.parametrize("past", [0, 1, 4099])
def test_embedding_gather_gradient_past_the_bitmap_threshold(device, past):
    n = 200
    assert ops._bitmap_numbers(past_bitmap_rows(n, past), n) == (past == 0)
    check_gather_case(device, {"dtype": torch.float32, "dim": 3, "n": n, "num_rows": "past_bitmap", "past": past,
                               "missing": 0.2, "hot": 0.0 if past else 0.9, "shape2d": past == 1,
                               "misaligned": past == 1, "threads": 2, "seed": past})


def check_gather_case(device, case):
    gen = torch.Generator().manual_seed(case["seed"])
    num_rows, dim, n = case["num_rows"], case["dim"], case["n"]
    if num_rows == "past_bitmap":
        num_rows = past_bitmap_rows(n, case["past"])
    big = torch.randn(num_rows, dim + 3, generator=gen, dtype=torch.float64).to(case["dtype"])
    weight = big[:, 1:dim + 1] if case["misaligned"] else big[:, :dim].contiguous()
    rows = torch.randint(0, num_rows, (n,), generator=gen)
    rows[torch.rand(n, generator=gen) < case["hot"]] = 0
    rows[torch.rand(n, generator=gen) < case["missing"]] = -1
    if case["shape2d"] and n % 2 == 0:
        rows = rows.view(2, n // 2)
    grad_out = torch.randn(*rows.shape, dim, generator=gen, dtype=torch.float64).to(case["dtype"])

    def run(dev):
        leaf = weight.to(dev).requires_grad_()
        out = ops.embedding_gather(leaf, rows.to(dev))
        (grad,) = torch.autograd.grad(out, leaf, grad_out.to(dev))
        return out.detach(), grad

    with num_threads(case["threads"]):
        out, grad = run(torch.device("cpu"))
    padded = torch.cat([weight, weight.new_zeros(1, dim)])
    assert torch.equal(out, padded[torch.where(rows == -1, num_rows, rows)])
    flat = rows.reshape(-1)
    assert grad._indices()[0].tolist() == ascending(flat, None) and grad.is_coalesced()
    expected = torch.zeros(num_rows + 1, dim, dtype=torch.float64).index_add(
        0, torch.where(flat == -1, num_rows, flat), grad_out.reshape(flat.shape[0], dim).double())[:num_rows]
    bound = torch.zeros(num_rows + 1, dim, dtype=torch.float64).index_add(
        0, torch.where(flat == -1, num_rows, flat), grad_out.reshape(flat.shape[0], dim).double().abs())[:num_rows]
    hottest = int(torch.bincount(flat[flat >= 0]).max()) if (flat >= 0).any() else 0
    assert_within(grad.to_dense(), expected, bound, case["dtype"], "gather gradient", hottest)
    if device.type == "cuda":
        cuda_out, cuda_grad = run(device)
        assert torch.equal(cuda_out.cpu(), out), "gather copies rows: bit-identical"
        assert cuda_grad._indices()[0].tolist() == first_occurrence(flat, None)
        assert_within(cuda_grad.to_dense(), grad.to_dense(), bound, case["dtype"], "CUDA gather gradient vs CPU",
                      hottest)

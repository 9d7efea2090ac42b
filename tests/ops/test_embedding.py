"""embedding_bag and embedding_gather: forward against torch, autograd, fakes and errors."""

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _grad import Densify

from sparsekit import ops
from _guard import guarded

# opcheck's test utilities. Before torch 2.13, AOT tracing with dynamic shapes cannot tell
# that the sparse gradient's row indices and values (both sized by unique's data-dependent
# count) have one length, and fails on a guard inside torch's sparse_coo_tensor; eager
# backward, and torch.compile of the layers (their sparse backward runs eagerly), are
# unaffected. The check runs from torch 2.13 on.
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor") + (
    ("test_aot_dispatch_dynamic",) if _TORCH >= (2, 13) else ())

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def random_bags(num_rows, bags, max_len, *, missing=0.0, seed=0):
    """Random CSR bags (some empty); a `missing` fraction of the rows is -1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.randint(0, num_rows, (int(offsets[-1]),), generator=gen)
    if missing:
        rows[torch.rand(rows.shape, generator=gen) < missing] = -1
    return rows, offsets


def torch_reference(weight, rows, offsets, per_sample_weights=None, mode="sum", padding_idx=None,
                    include_last_offset=True):
    """nn.EmbeddingBag semantics in float64, -1 rows (and padding_idx) mapped to a padding row so they are skipped.

    Weighted mean (not offered by torch) is pooled by hand: sum(w_i * row_i) / sum(w_i)."""
    weight = weight.double().cpu()
    rows, offsets = rows.long().cpu(), offsets.long().cpu()
    if not include_last_offset:
        offsets = torch.cat([offsets, torch.tensor([rows.shape[0]])])
    padded = torch.cat([weight, torch.zeros(1, weight.shape[1], dtype=torch.float64)])
    pad = weight.shape[0]
    if padding_idx is not None:
        rows = torch.where(rows == padding_idx % weight.shape[0], pad, rows)
    rows = torch.where(rows == -1, pad, rows)
    psw = None if per_sample_weights is None else per_sample_weights.double().cpu()
    if mode == "mean" and psw is not None:
        bags = offsets.shape[0] - 1
        bag = torch.repeat_interleave(torch.arange(bags), offsets.diff())
        valid_w = torch.where(rows == pad, 0.0, psw)
        total = torch.zeros(bags, weight.shape[1], dtype=torch.float64).index_add_(
            0, bag, padded[rows] * valid_w[:, None]
        )
        denominator = torch.zeros(bags, dtype=torch.float64).index_add_(0, bag, valid_w)
        return torch.where(denominator[:, None] != 0, total / denominator.clamp_min(1e-300)[:, None], 0.0)
    return F.embedding_bag(
        rows, padded, offsets, mode=mode, per_sample_weights=psw, include_last_offset=True, padding_idx=pad
    )


# ---- embedding_bag forward ----


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 7, 64, 127])
def test_embedding_bag_matches_torch(device, mode, weighted, dim):
    weight = torch.randn(50, dim, device=device)
    rows, offsets = random_bags(50, 40, 9, missing=0.1, seed=dim)
    rows, offsets = rows.to(device), offsets.to(device)
    psw = torch.rand(rows.shape[0], device=device) + 0.1 if weighted else None
    out = ops.embedding_bag(weight, rows, offsets, psw, mode)
    assert out.shape == (40, dim) and out.dtype == torch.float32 and out.device == weight.device
    torch.testing.assert_close(out.double().cpu(), torch_reference(weight, rows, offsets, psw, mode),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 16, 48, 256, 272, 528])
def test_embedding_bag_dims_of_whole_and_partial_vectors(device, dtype, dim):
    # Dims of whole 64-byte vectors of accumulators take the CPU's AVX-512 loops (with the
    # first line of a row prefetched 32 lookups ahead, into the next bags), the others the
    # AVX2 ones; 256 and 272 float32 columns cross the 16-register block of one pass. Bags
    # long enough that the prefetch runs past several of them; -1 rows and a padding row.
    weight = torch.randn(300, dim, device=device).to(dtype)
    rows, offsets = random_bags(300, 64, 70, missing=0.05, seed=dim)
    rows[::17] = 7
    rows, offsets = rows.to(device), offsets.to(device)
    psw = (torch.rand(rows.shape[0], device=device) + 0.5).to(dtype)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    for mode, weights in [("sum", None), ("mean", None), ("max", None), ("sum", psw), ("mean", psw)]:
        for padding_idx in [None, 7]:
            out = ops.embedding_bag(weight, rows, offsets, weights, mode, padding_idx=padding_idx)
            expected = torch_reference(weight, rows, offsets, weights, mode, padding_idx=padding_idx)
            torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 16, 32, 24])
def test_embedding_bag_widens_every_half_value_exactly(device, dtype, dim):
    # Every one of the 65536 bit patterns (zeros of both signs, subnormals, normals, inf,
    # NaN) as a table row element: a bag of one row widens it to float32 and rounds it back,
    # which gives the value itself unless the widening is wrong (a sum starts from +0, so
    # -0 comes back as +0, as in nn.EmbeddingBag: values compare, not bits). float16 widens by F16C in
    # the AVX2 (dims 8, 24) and AVX-512 (16, 32) loops and by integer vector operations in
    # the baseline loops (test_cpu_capability.py runs this under each); 24 also has a tail.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    bits = torch.cat([bits, bits.new_zeros(-bits.shape[0] % dim)])
    weight = bits.view(dtype).reshape(-1, dim).to(device)
    rows = torch.arange(weight.shape[0], device=device)
    offsets = torch.arange(weight.shape[0] + 1, device=device)
    nan = torch.isnan(weight.cpu())
    for weights, mode in [(None, "sum"), (torch.ones(rows.shape[0], dtype=dtype, device=device), "sum"),
                          (None, "mean"), (None, "max")]:
        out = ops.embedding_bag(weight, rows, offsets, weights, mode).cpu()
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out[~nan].double(), weight.cpu()[~nan].double())


def test_embedding_bag_many_bags_split_across_threads(device):
    weight = torch.randn(500, 32, device=device)
    rows, offsets = random_bags(500, 3000, 12, missing=0.05, seed=21)
    rows, offsets = rows.to(device), offsets.to(device)
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, mode="mean").double().cpu(),
                               torch_reference(weight, rows, offsets, None, "mean"), rtol=1e-5, atol=1e-5)
    many = torch.randint(-1, 500, (60000,), device=device)
    narrow = weight[:, :4].contiguous()
    gathered = ops.embedding_gather(narrow, many)
    torch.testing.assert_close(gathered, torch.where((many == -1)[:, None], 0.0, narrow[many.clamp_min(0)]))


def test_embedding_bag_matches_nn_embedding_bag_without_missing_rows(device):
    weight = torch.randn(30, 16, device=device)
    rows, offsets = random_bags(30, 25, 6, seed=3)
    rows, offsets = rows.to(device), offsets.to(device)
    psw = torch.rand(rows.shape[0], device=device)
    for mode, weights in [("sum", None), ("mean", None), ("sum", psw)]:
        expected = F.embedding_bag(rows, weight, offsets[:-1], mode=mode, per_sample_weights=weights)
        torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, weights, mode), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_dtypes(device, dtype, mode):
    weight = torch.randn(40, 24, device=device).to(dtype)
    rows, offsets = random_bags(40, 30, 8, missing=0.1, seed=5)
    rows, offsets = rows.to(device), offsets.to(device)
    psw = (torch.rand(rows.shape[0], device=device) + 0.5).to(dtype)
    for weights in [None, psw]:
        out = ops.embedding_bag(weight, rows, offsets, weights, mode)
        assert out.dtype == dtype
        tol = {torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(out.double().cpu(), torch_reference(weight, rows, offsets, weights, mode),
                                   rtol=tol, atol=tol)


def test_embedding_bag_skips_missing_rows_and_pools_empty_bags_to_zero(device):
    weight = torch.arange(12, dtype=torch.float32, device=device).view(6, 2)
    rows = torch.tensor([1, -1, 3, -1, -1, 5], device=device)
    offsets = torch.tensor([0, 3, 3, 5, 6], device=device)  # bag 1 empty, bag 2 only -1
    expected_sum = torch.tensor([[8.0, 10.0], [0, 0], [0, 0], [10.0, 11.0]])
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets).cpu(), expected_sum)
    # mean divides by the 2 valid rows of bag 0, not by its 3 entries
    expected_mean = torch.tensor([[4.0, 5.0], [0, 0], [0, 0], [10.0, 11.0]])
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, mode="mean").cpu(), expected_mean)
    psw = torch.tensor([2.0, 7.0, 1.0, 7.0, 7.0, 0.0], device=device)
    # weighted mean: (2 * row1 + 1 * row3) / 3; bag 3 has weight sum 0 -> zeros
    expected_weighted = torch.tensor([[(2 * 2 + 6) / 3, (2 * 3 + 7) / 3], [0, 0], [0, 0], [0, 0]])
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, psw, "mean").cpu(), expected_weighted)


def test_embedding_bag_empty_inputs(device):
    weight = torch.randn(5, 3, device=device)
    empty_rows = torch.empty(0, dtype=torch.int64, device=device)
    out = ops.embedding_bag(weight, empty_rows, torch.zeros(1, dtype=torch.int64, device=device))
    assert out.shape == (0, 3)
    out = ops.embedding_bag(weight, empty_rows, torch.zeros(5, dtype=torch.int64, device=device), mode="mean")
    assert out.shape == (4, 3) and not out.any()
    assert ops.embedding_bag(torch.randn(0, 3, device=device), torch.full((2,), -1, device=device),
                             torch.tensor([0, 2], device=device)).abs().sum() == 0


def test_embedding_bag_duplicate_rows_in_a_bag(device):
    weight = torch.randn(4, 8, device=device)
    rows = torch.tensor([2, 2, 2, 0], device=device)
    offsets = torch.tensor([0, 4], device=device)
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets)[0], 3 * weight[2] + weight[0])


@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_embedding_bag_int32_indices(device, rows_dtype, offsets_dtype):
    weight = torch.randn(20, 12, device=device)
    rows, offsets = random_bags(20, 10, 5, missing=0.2, seed=7)
    expected = ops.embedding_bag(weight, rows.to(device), offsets.to(device), mode="mean")
    out = ops.embedding_bag(weight, rows.to(device, rows_dtype), offsets.to(device, offsets_dtype), mode="mean")
    torch.testing.assert_close(out, expected)


def test_embedding_bag_strided_weight(device):
    table = torch.randn(30, 40, device=device)
    weight = table[:, 4:36]  # rows 40 apart, columns dense
    rows, offsets = random_bags(30, 12, 5, seed=9)
    rows, offsets = rows.to(device), offsets.to(device)
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets),
                               ops.embedding_bag(weight.contiguous(), rows, offsets))
    transposed = torch.randn(16, 30, device=device).t()  # columns strided
    torch.testing.assert_close(ops.embedding_bag(transposed, rows, offsets),
                               ops.embedding_bag(transposed.contiguous(), rows, offsets))


# ---- embedding_bag errors ----


def test_embedding_bag_rejects_bad_offsets(device):
    weight = torch.randn(5, 4, device=device)
    rows = torch.tensor([0, 1, 2], device=device)
    for bad in ([1, 2, 3], [0, 2, 1, 3], [0, 3, 2], [0, 1, 4], [0, 1], [0, 2]):
        with pytest.raises(RuntimeError, match="embedding_bag: offsets must be non-decreasing"):
            ops.embedding_bag(weight, rows, torch.tensor(bad, device=device))
    with pytest.raises(RuntimeError, match="offsets must be 1-D"):
        ops.embedding_bag(weight, rows, torch.empty(0, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match="embedding_bag: offsets must be non-decreasing"):
        ops.embedding_bag(weight, rows[:0], torch.tensor([2], device=device))
    with pytest.raises(RuntimeError, match="offsets must be an int64 or int32"):
        ops.embedding_bag(weight, rows, torch.tensor([0.0, 3.0], device=device))


def test_embedding_bag_offsets_error_hints_at_include_last_offset(device):
    weight = torch.randn(8, 4, device=device)
    rows = torch.tensor([4, 2, 7], device=device)
    nn_style = torch.tensor([0, 2], device=device)  # nn.EmbeddingBag: 2 bags, [4, 2] and [7]
    with pytest.raises(RuntimeError, match="pass include_last_offset=False"):
        ops.embedding_bag(weight, rows, nn_style)
    out = ops.embedding_bag(weight, rows, nn_style, include_last_offset=False)
    torch.testing.assert_close(out, ops.embedding_bag(weight, rows, torch.tensor([0, 2, 3], device=device)))
    torch.testing.assert_close(out, F.embedding_bag(rows, weight, nn_style, mode="sum"))
    for bad in ([1, 2], [0, 4], [0, 2, 1]):
        with pytest.raises(RuntimeError, match="every offset <= nnz == 3"):
            ops.embedding_bag(weight, rows, torch.tensor(bad, device=device), include_last_offset=False)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    assert ops.embedding_bag(weight, rows[:0], empty, include_last_offset=False).shape == (0, 4)
    with pytest.raises(RuntimeError, match="got no bag"):
        ops.embedding_bag(weight, rows, empty, include_last_offset=False)


@pytest.mark.parametrize("bad_row", [-2, 5, INT64_MIN, INT64_MAX])
def test_embedding_bag_rejects_out_of_range_rows(device, bad_row):
    weight = torch.randn(5, 8, device=device)
    rows = torch.tensor([0, bad_row, 1], device=device)
    offsets = torch.tensor([0, 2, 3], device=device)
    with pytest.raises(RuntimeError, match=f"embedding_bag: rows holds {bad_row} but weight has 5 rows"):
        ops.embedding_bag(weight, rows, offsets)
    # the error is a host-side check: the device stays usable
    torch.testing.assert_close(ops.embedding_bag(weight, rows[:1], torch.tensor([0, 1], device=device)), weight[:1])


@pytest.mark.parametrize("bad_row", [INT64_MIN, INT64_MAX, -(1 << 40), 1 << 40])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_extreme_rows_ahead_of_the_pooling_loops(device, bad_row, index_dtype):
    # The CPU pooling loops prefetch the row 16-32 lookups ahead without testing it; an id
    # far outside the table there must cost nothing but the error (named at its position),
    # and -1 / padding rows ahead must not disturb the results, in every mode.
    if index_dtype == torch.int32:
        bad_row = max(min(bad_row, 2**31 - 1), -(2**31))
    weight = torch.randn(100, 16, device=device)
    nnz = 400
    rows = torch.randint(0, 100, (nnz,), generator=torch.Generator().manual_seed(5))
    rows[::7] = -1
    offsets = torch.arange(0, nnz + 1, 4)
    scale = torch.rand(nnz, generator=torch.Generator().manual_seed(6))
    for padding_idx in (None, 3):
        for mode, weighted in (("sum", False), ("mean", False), ("max", False), ("sum", True)):
            psw = scale if weighted else None
            # The reference: row 100 (zeros, torch's padding row) stands for every skipped lookup.
            skip = (rows < 0) | (rows == (-1 if padding_idx is None else padding_idx))
            expected = F.embedding_bag(torch.where(skip, 100, rows), torch.cat([weight.cpu(), torch.zeros(1, 16)]),
                                       offsets[:-1], mode=mode, per_sample_weights=psw, padding_idx=100)
            got = ops.embedding_bag(weight, rows.to(device, index_dtype), offsets.to(device),
                                    None if psw is None else psw.to(device), mode=mode, padding_idx=padding_idx)
            torch.testing.assert_close(got.cpu(), expected)
            bad = rows.clone()
            bad[100] = bad_row
            bad[250] = bad_row
            with pytest.raises(RuntimeError, match=rf"rows holds {bad_row} but weight has 100 rows \(at rows\[100\]"):
                ops.embedding_bag(weight, bad.to(device, index_dtype), offsets.to(device),
                                  None if psw is None else psw.to(device), mode=mode, padding_idx=padding_idx)


@pytest.mark.skipif(sys.platform != "linux", reason="mmap + mprotect guard page")
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dim", [16, 40, 64])
def test_pooling_loops_read_no_id_past_the_end(index_dtype, dim):
    # The CPU pooling loops prefetch the row 16-32 lookups ahead and stop where the last
    # lookup comes into reach: below, around and above that distance, in every mode, the
    # ids end at a guard page, and the results and the first bad position are right.
    weight = torch.randn(100, dim)
    padded = torch.cat([weight, torch.zeros(1, dim)])
    for nnz in (1, 5, 15, 16, 17, 31, 32, 33, 63, 200):
        generator = torch.Generator().manual_seed(nnz)
        rows = torch.randint(-1, 100, (nnz,), generator=generator)
        # Bags of 0-3 lookups, the last ones possibly empty.
        cuts = torch.sort(torch.randint(0, nnz + 1, (max(nnz // 2, 1),), generator=generator)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.full((2,), nnz)])
        scale = torch.rand(nnz, generator=generator)
        guarded_rows = guarded(rows.to(index_dtype))
        for mode, psw in (("sum", None), ("mean", None), ("max", None), ("sum", scale)):
            expected = F.embedding_bag(torch.where(rows < 0, 100, rows), padded, offsets, mode=mode,
                                       per_sample_weights=psw, padding_idx=100, include_last_offset=True)
            for last in (True, False):
                got = ops.embedding_bag(weight, guarded_rows, guarded(offsets if last else offsets[:-1]), psw,
                                        mode=mode, include_last_offset=last)
                torch.testing.assert_close(got, expected)
            if nnz >= 33:
                bad = rows.to(index_dtype).clone()
                bad[nnz - 1] = 100
                bad[nnz - 33] = -7
                with pytest.raises(RuntimeError, match=rf"rows holds -7 but weight has 100 rows \(at rows\[{nnz - 33}\]"):
                    ops.embedding_bag(weight, guarded(bad), offsets, psw, mode=mode)


def test_embedding_bag_rejects_bad_arguments(device):
    weight = torch.randn(5, 4, device=device)
    rows = torch.tensor([0, 1, 2], device=device)
    offsets = torch.tensor([0, 3], device=device)
    with pytest.raises(RuntimeError, match="weight must be float32, float64, float16 or bfloat16"):
        ops.embedding_bag(weight.long(), rows, offsets)
    with pytest.raises(RuntimeError, match="weight must be 2-D"):
        ops.embedding_bag(weight[0], rows, offsets)
    with pytest.raises(RuntimeError, match="rows must be an int64 or int32"):
        ops.embedding_bag(weight, rows.float(), offsets)
    with pytest.raises(RuntimeError, match="rows must be 1-D"):
        ops.embedding_bag(weight, rows.view(3, 1), offsets)
    with pytest.raises(RuntimeError, match="per_sample_weights is Double but weight is Float"):
        ops.embedding_bag(weight, rows, offsets, torch.ones(3, dtype=torch.float64, device=device))
    with pytest.raises(RuntimeError, match=r"per_sample_weights must be 1-D \[nnz\]"):
        ops.embedding_bag(weight, rows, offsets, torch.ones(2, device=device))
    with pytest.raises(RuntimeError, match='mode must be "sum", "mean" or "max"'):
        ops.embedding_bag(weight, rows, offsets, mode="min")
    with pytest.raises(RuntimeError, match='per_sample_weights is only supported for mode="sum" or "mean"'):
        ops.embedding_bag(weight, rows, offsets, torch.ones(3, device=device), "max")
    with pytest.raises(RuntimeError, match=r"padding_idx must lie in \[-num_rows, num_rows\)"):
        ops.embedding_bag(weight, rows, offsets, padding_idx=5)


# ---- embedding_bag autograd ----


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_gradcheck(device, mode):
    weight = torch.randn(9, 5, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([1, 2, -1, 2, 5, 1, 3, -1, 8], device=device)
    offsets = torch.tensor([0, 3, 3, 7, 8, 9], device=device)  # an empty bag and an all-missing bag
    psw = (torch.rand(9, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda w, p: ops.embedding_bag(Densify.apply(w), rows, offsets, p, mode),
                                    (weight, psw))
    assert torch.autograd.gradcheck(lambda w: ops.embedding_bag(Densify.apply(w), rows, offsets, None, mode),
                                    (weight,))


# nn.EmbeddingBag has no weighted mean; gradcheck covers that one.
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_embedding_bag_sparse_gradient_matches_nn_embedding_bag(device, mode, weighted):
    num_rows, dim = 40, 6
    rows, offsets = random_bags(num_rows, 30, 8, seed=11)
    rows, offsets = rows.to(device), offsets.to(device)
    table = torch.randn(num_rows, dim, device=device)
    psw = torch.rand(rows.shape[0], device=device) if weighted else None
    grad_out = torch.randn(30, dim, device=device)

    reference = torch.nn.EmbeddingBag(num_rows, dim, mode=mode, sparse=True, include_last_offset=True).to(device)
    with torch.no_grad():
        reference.weight.copy_(table)
    reference(rows, offsets, per_sample_weights=psw).backward(grad_out)

    weight = table.clone().requires_grad_()
    ops.embedding_bag(weight, rows, offsets, psw, mode).backward(grad_out)
    grad = weight.grad
    assert grad.layout == torch.sparse_coo and grad.shape == (num_rows, dim)
    # aggregated: one entry per distinct row; on the CPU ascending and flagged coalesced, on
    # CUDA in order of first occurrence
    cpu = device.type == "cpu"
    distinct_rows = sorted(set(rows.tolist())) if cpu else list(dict.fromkeys(rows.tolist()))
    assert grad._indices()[0].tolist() == distinct_rows
    (direct,) = torch.autograd.grad(ops.embedding_bag(weight, rows, offsets, psw, mode), weight, grad_out)
    assert direct.is_coalesced() == cpu
    torch.testing.assert_close(direct.to_dense(), grad.to_dense())
    # summed in lookup order: bit-identical run to run
    (again,) = torch.autograd.grad(ops.embedding_bag(weight, rows, offsets, psw, mode), weight, grad_out)
    assert torch.equal(again._values(), direct._values()) and torch.equal(again._indices(), direct._indices())
    torch.testing.assert_close(grad.to_dense(), reference.weight.grad.to_dense(), rtol=1e-5, atol=1e-5)


def test_embedding_bag_sparse_gradient_drops_missing_rows(device):
    weight = torch.randn(6, 3, device=device, requires_grad=True)
    rows = torch.tensor([-1, 4, -1, 4, 0], device=device)
    offsets = torch.tensor([0, 2, 5], device=device)
    ops.embedding_bag(weight, rows, offsets).sum().backward()
    grad = weight.grad
    # the -1 lookups leave no entry; ascending on the CPU, first-occurrence order on CUDA
    expected = {4: [2.0] * 3, 0: [1.0] * 3}
    order = [0, 4] if device.type == "cpu" else [4, 0]
    assert grad._indices()[0].tolist() == order
    torch.testing.assert_close(grad._values().cpu(), torch.tensor([expected[r] for r in order]))


def test_embedding_bag_per_sample_weight_gradient_matches_torch(device):
    rows, offsets = random_bags(25, 20, 6, seed=13)
    rows, offsets = rows.to(device), offsets.to(device)
    table = torch.randn(25, 10, device=device)
    psw = torch.rand(rows.shape[0], device=device)
    grad_out = torch.randn(20, 10, device=device)
    expected_psw = psw.clone().requires_grad_()
    F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=expected_psw,
                    include_last_offset=True).backward(grad_out)
    ours = psw.clone().requires_grad_()
    ops.embedding_bag(table, rows, offsets, ours).backward(grad_out)
    torch.testing.assert_close(ours.grad, expected_psw.grad)


def test_embedding_bag_weighted_mean_gradients_match_reference(device):
    rows, offsets = random_bags(25, 20, 6, missing=0.2, seed=15)
    rows, offsets = rows.to(device), offsets.to(device)
    table = torch.randn(25, 10, dtype=torch.float64, device=device)
    psw = torch.rand(rows.shape[0], dtype=torch.float64, device=device) + 0.1
    grad_out = torch.randn(20, 10, dtype=torch.float64)
    ref_table, ref_psw = table.clone().requires_grad_(), psw.clone().requires_grad_()
    torch_reference(ref_table, rows, offsets, ref_psw, "mean").backward(grad_out)
    our_table, our_psw = table.clone().requires_grad_(), psw.clone().requires_grad_()
    ops.embedding_bag(our_table, rows, offsets, our_psw, "mean").backward(grad_out.to(device))
    torch.testing.assert_close(our_psw.grad, ref_psw.grad)
    torch.testing.assert_close(our_table.grad.to_dense(), ref_table.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_embedding_bag_half_gradient(device, dtype):
    rows, offsets = random_bags(30, 20, 6, missing=0.1, seed=17)
    rows, offsets = rows.to(device), offsets.to(device)
    table = torch.randn(30, 16, device=device)
    grad_out = torch.randn(20, 16, device=device)
    half = table.to(dtype).requires_grad_()
    ops.embedding_bag(half, rows, offsets, mode="mean").backward(grad_out.to(dtype))
    full = table.clone().requires_grad_()
    ops.embedding_bag(full, rows, offsets, mode="mean").backward(grad_out)
    assert half.grad.dtype == dtype
    torch.testing.assert_close(half.grad.to_dense().float(), full.grad.to_dense(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_embedding_bag_half_weighted_mean_per_sample_weight_gradient(device, dtype):
    """The per-sample-weight gradient of a weighted mean is (weight[r_i] - out[b]) . g / S_b:
    with a half table it was taken against the output rounded to the half type, and the
    difference, small where a bag's rows are alike, was off by ~8% of the largest gradient in
    bfloat16 (~1% in float16). Against the float64 gradient of the same half values it is
    now within the half type's own rounding of the result."""
    g = torch.Generator().manual_seed(5)
    bags, per_bag, num_rows, dim = 40, 100, 100, 16
    table = (1.0 + 0.1 * torch.rand(num_rows, dim, generator=g)).to(dtype)  # rows alike: w - mean cancels
    rows = torch.randint(0, num_rows, (bags * per_bag,), generator=g)
    offsets = torch.arange(0, bags * per_bag + 1, per_bag)
    psw = (torch.rand(bags * per_bag, generator=g) + 0.5).to(dtype)
    ours = psw.clone().to(device).requires_grad_()
    ops.embedding_bag(table.to(device), rows.to(device), offsets.to(device), ours, "mean").backward(
        torch.ones(bags, dim, dtype=dtype, device=device))
    reference = psw.double().requires_grad_()
    bag = torch.arange(bags).repeat_interleave(per_bag)
    sums = torch.zeros(bags, dim, dtype=torch.float64).index_add(0, bag, table.double()[rows] * reference[:, None])
    weights = torch.zeros(bags, dtype=torch.float64).index_add(0, bag, reference)
    (sums / weights[:, None]).sum().backward()
    assert ours.grad.dtype == dtype
    error = (ours.grad.cpu().double() - reference.grad).abs().max().item()
    assert error <= 0.005 * reference.grad.abs().max().item()


def test_embedding_bag_opcheck(device):
    weight = torch.randn(12, 8, device=device, requires_grad=True)
    rows = torch.tensor([3, -1, 3, 7, 0, 11], device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    psw = torch.rand(6, device=device, requires_grad=True)
    for args in [(weight, rows, offsets, None, "sum"), (weight, rows, offsets, psw, "mean"),
                 (weight, rows.int(), offsets.int(), psw, "sum")]:
        torch.library.opcheck(torch.ops.sparsekit.embedding_bag.default, args, test_utils=OPCHECK_TESTS)


# ---- embedding_gather ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_embedding_gather_matches_indexing(device, dtype):
    weight = torch.randn(30, 20, device=device).to(dtype)
    rows = torch.randint(-1, 30, (4, 7), device=device)
    out = ops.embedding_gather(weight, rows)
    assert out.shape == (4, 7, 20) and out.dtype == dtype
    padded = torch.cat([weight, weight.new_zeros(1, 20)])
    torch.testing.assert_close(out, padded[torch.where(rows == -1, 30, rows)], rtol=0, atol=0)


def test_embedding_gather_int32_empty_and_strided(device):
    weight = torch.randn(10, 6, device=device)
    rows = torch.tensor([9, -1, 0, 9], device=device)
    torch.testing.assert_close(ops.embedding_gather(weight, rows.int()), ops.embedding_gather(weight, rows))
    assert ops.embedding_gather(weight, rows[:0]).shape == (0, 6)
    assert ops.embedding_gather(weight, torch.empty(3, 0, dtype=torch.int64, device=device)).shape == (3, 0, 6)
    strided = torch.randn(10, 9, device=device)[:, 1:7]
    torch.testing.assert_close(ops.embedding_gather(strided, rows), ops.embedding_gather(strided.contiguous(), rows))


@pytest.mark.parametrize("bad_row", [-2, 10, INT64_MIN, INT64_MAX])
def test_embedding_gather_rejects_out_of_range_rows(device, bad_row):
    weight = torch.randn(10, 4, device=device)
    with pytest.raises(RuntimeError, match=f"embedding_gather: rows holds {bad_row} but weight has 10 rows"):
        ops.embedding_gather(weight, torch.tensor([1, bad_row], device=device))
    torch.testing.assert_close(ops.embedding_gather(weight, torch.tensor([1], device=device)), weight[1:2])
    with pytest.raises(RuntimeError, match="rows must be an int64 or int32"):
        ops.embedding_gather(weight, torch.tensor([1.0], device=device))
    with pytest.raises(RuntimeError, match="weight must be float32, float64, float16 or bfloat16"):
        ops.embedding_gather(weight.int(), torch.tensor([1], device=device))


def test_embedding_gather_gradient(device):
    weight = torch.randn(8, 3, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([[2, -1], [7, 2], [0, 0]], device=device)
    assert torch.autograd.gradcheck(lambda w: ops.embedding_gather(Densify.apply(w), rows), (weight,))
    grad_out = torch.randn(3, 2, 3, dtype=torch.float64, device=device)
    ops.embedding_gather(weight, rows).backward(grad_out)
    assert weight.grad.layout == torch.sparse_coo
    # ascending on the CPU, first-occurrence order on CUDA
    assert weight.grad._indices()[0].tolist() == ([0, 2, 7] if device.type == "cpu" else [2, 7, 0])
    expected = torch.zeros(8, 3, dtype=torch.float64, device=device)
    expected.index_add_(0, torch.tensor([2, 7, 2, 0, 0], device=device), grad_out.view(6, 3)[[0, 2, 3, 4, 5]])
    torch.testing.assert_close(weight.grad.to_dense(), expected)


def test_embedding_gather_opcheck(device):
    weight = torch.randn(12, 8, device=device, requires_grad=True)
    for rows in [torch.tensor([3, -1, 3, 7], device=device), torch.tensor([[1, 2], [2, -1]], device=device).int()]:
        torch.library.opcheck(torch.ops.sparsekit.embedding_gather.default, (weight, rows), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widening_gather_rounds_each_rows_gradient_once(device, dtype):
    """The traced collection's internal gather of a half table into float32: the rows'
    float32 values, -1 as zeros, and a gradient summed in float32 and rounded once."""
    weight = torch.randn(12, 8, device=device).to(dtype).requires_grad_()
    rows = torch.tensor([3, -1, 3, 7, 3], device=device)
    out = torch.ops.sparsekit._embedding_gather_float(weight, rows)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.where(rows.unsqueeze(1) >= 0, weight.detach()[rows.clamp(min=0)].float(), 0))
    grad_out = torch.randn(5, 8, device=device)
    out.backward(grad_out)
    expected = torch.zeros(12, 8, device=device).index_add_(0, torch.tensor([3, 3, 7, 3], device=device),
                                                            grad_out[[0, 2, 3, 4]])
    assert weight.grad.dtype == dtype and torch.equal(weight.grad.to_dense(), expected.to(dtype))
    torch.library.opcheck(torch.ops.sparsekit._embedding_gather_float.default, (weight, rows), test_utils=OPCHECK_TESTS)
    # Differentiable twice, as embedding_gather: d/d(grad_out) of <grad_weight, v> is v[rows].
    grad_out = torch.randn(5, 8, device=device, requires_grad=True)
    (grad_weight,) = torch.autograd.grad(torch.ops.sparsekit._embedding_gather_float(weight, rows), weight, grad_out,
                                         create_graph=True)
    probe = torch.randn(12, 8, device=device).to(dtype).float()  # the gradient is of the half type
    (second,) = torch.autograd.grad((grad_weight.to_dense().float() * probe).sum(), grad_out)
    assert torch.equal(second, torch.where(rows.unsqueeze(1) >= 0, probe[rows.clamp(min=0)], 0))


def test_embedding_bag_compiles(device):
    weight = torch.randn(12, 8, device=device)
    rows = torch.tensor([3, -1, 3, 7, 0, 11], device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)

    def pooled_then_gathered(w, r, o):
        return ops.embedding_bag(w, r, o, mode="mean") + ops.embedding_gather(w, r[:3])

    compiled = torch.compile(pooled_then_gathered, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(weight, rows, offsets), pooled_then_gathered(weight, rows, offsets))



# ---- max mode, padding_idx, include_last_offset ----


@pytest.mark.parametrize("dim", [1, 7, 64, 127])
@pytest.mark.parametrize("padding_idx", [None, 3, -2])
def test_embedding_bag_max_and_padding_match_torch(device, dim, padding_idx):
    weight = torch.randn(50, dim, device=device)
    rows, offsets = random_bags(50, 40, 9, missing=0.1, seed=dim)
    rows[::5] = 3  # plenty of padding lookups
    rows, offsets = rows.to(device), offsets.to(device)
    for mode in ["sum", "mean", "max"]:
        for include_last_offset in [True, False]:
            o = offsets if include_last_offset else offsets[:-1]
            out = ops.embedding_bag(weight, rows, o, None, mode, padding_idx, include_last_offset)
            expected = torch_reference(weight, rows, o, None, mode, padding_idx, include_last_offset)
            torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)


def test_embedding_bag_max_matches_nn_embedding_bag_forward_and_gradient(device):
    torch.manual_seed(0)
    weight = torch.randn(30, 16, device=device)
    weight[7] = weight[5]  # ties between rows: the first valid lookup in bag order wins
    rows, offsets = random_bags(30, 25, 6, seed=3)
    rows[:4] = torch.tensor([5, 7, 7, 5])
    offsets[1] = max(int(offsets[1]), 4)
    offsets = torch.maximum(offsets, offsets[1] * (torch.arange(offsets.shape[0]) >= 1))
    rows, offsets = rows.to(device), offsets.to(device)
    grad_out = torch.randn(offsets.shape[0] - 1, 16, device=device)
    reference = weight.clone().requires_grad_()
    expected = F.embedding_bag(rows, reference, offsets, mode="max", include_last_offset=True)
    expected.backward(grad_out)
    ours = weight.clone().requires_grad_()
    out = ops.embedding_bag(ours, rows, offsets, mode="max")
    assert torch.equal(out, expected.detach())
    out.backward(grad_out)
    assert ours.grad.layout == torch.sparse_coo
    distinct_rows = list(dict.fromkeys(rows.tolist()))  # first-occurrence order on CUDA, ascending on the CPU
    assert ours.grad._indices()[0].tolist() == (sorted(distinct_rows) if device.type == "cpu" else distinct_rows)
    torch.testing.assert_close(ours.grad.to_dense(), reference.grad)


def test_embedding_bag_max_edge_cases(device):
    weight = torch.tensor([[1.0, -5.0], [float("nan"), 2.0], [-3.0, -1.0], [0.5, 9.0]], device=device)
    rows = torch.tensor([0, 2, -1, 1, 0, -1, -1, 3], device=device)
    offsets = torch.tensor([0, 2, 5, 5, 7, 8], device=device)  # an empty bag and an all -1 bag
    out = ops.embedding_bag(weight, rows, offsets, mode="max").cpu()
    expected = F.embedding_bag(torch.where(rows == -1, 4, rows).cpu(), torch.cat([weight.cpu(), torch.zeros(1, 2)]),
                               offsets.cpu(), mode="max", include_last_offset=True, padding_idx=4)
    torch.testing.assert_close(out, expected, equal_nan=True)
    assert torch.isnan(out[1, 0]) and out[2].eq(0).all() and out[3].eq(0).all()
    # negative maxima stay negative (the accumulator is not started at zero)
    torch.testing.assert_close(out[0], torch.tensor([1.0, -1.0]))
    positions = torch.ops.sparsekit.embedding_bag_argmax(weight, rows, offsets).cpu()
    assert positions.tolist() == [[0, 1], [3, 3], [-1, -1], [-1, -1], [7, 7]]


@pytest.mark.parametrize("dim", [1, 3, 16, 24, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_embedding_bag_max_follows_nn_embedding_bag_on_nan_and_inf(device, dim, threads):
    # nn.EmbeddingBag's max (CPU and CUDA) takes a bag's first valid row, then only strictly
    # larger values: a NaN wins only when it comes first, ties keep the earlier row. Dims
    # cover the vector loops (16, 64), AVX2's passes and the scalar tail (1, 3, 24).
    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(40, dim, generator=gen).round()  # small integers: many ties
    special = torch.rand(40, dim, generator=gen)
    weight[special < 0.15] = float("nan")
    weight[(special >= 0.15) & (special < 0.2)] = float("inf")
    weight[(special >= 0.2) & (special < 0.25)] = -float("inf")
    rows = torch.randint(0, 40, (600,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(0, 7, (120,), generator=gen).cumsum(0)])
    rows = rows[: int(offsets[-1])]
    expected, _, _, max_rows = torch.ops.aten._embedding_bag(weight, rows, offsets[:-1], mode=2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.embedding_bag(weight.to(device), rows.to(device), offsets.to(device), mode="max").cpu()
        positions = torch.ops.sparsekit.embedding_bag_argmax(weight.to(device), rows.to(device),
                                                             offsets.to(device)).cpu()
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)
    # The arg-max (where the gradient goes) is torch's max_indices, an empty bag's -1 aside.
    picked = torch.where(positions >= 0, rows[positions.clamp_min(0)], -1)
    lengths = offsets.diff()
    assert torch.equal(picked[lengths > 0], max_rows[lengths > 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [1, 3, 16, 24, 64, 100])
def test_embedding_bag_mean_divides_like_nn_embedding_bag_bit_for_bit(device, dtype, dim):
    # A division, not a multiplication by the reciprocal (1 ulp off a quarter of the time).
    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(1000, dim, generator=gen, dtype=dtype)
    rows = torch.randint(0, 1000, (5000,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(1, 12, (600,), generator=gen).cumsum(0)])
    rows = rows[: int(offsets[-1])]
    rows[::7] = 5  # padding_idx: not counted
    expected = F.embedding_bag(rows, weight, offsets, mode="mean", include_last_offset=True, padding_idx=5)
    out = ops.embedding_bag(weight.to(device), rows.to(device), offsets.to(device), mode="mean", padding_idx=5).cpu()
    if device.type == "cpu":
        assert torch.equal(out, expected)
    else:  # the same division; the CUDA sums may add in another order
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_embedding_bag_padding_row_past_int32_spares_int32_rows(device, mode):
    """A padding row past int32 (a table of 2^32 + 5 empty rows) is no int32 row: row 4,
    which that padding row wraps to in int32, keeps its gradient entry."""
    weight = torch.zeros(2**32 + 5, 0, device=device, requires_grad=True)  # D = 0: no memory
    rows = torch.tensor([4, 1], dtype=torch.int32, device=device)
    ops.embedding_bag(weight, rows, torch.tensor([0, 2], device=device), None, mode, padding_idx=-1).sum().backward()
    assert sorted(weight.grad._indices()[0].tolist()) == [1, 4]


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_padding_row_gets_no_gradient(device, mode):
    weight = torch.randn(6, 3, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([2, 5, 1, 5, 5, 0, 2], device=device)
    offsets = torch.tensor([0, 3, 5, 7], device=device)  # bag 1 holds only padding
    out = ops.embedding_bag(weight, rows, offsets, None, mode, padding_idx=-1)
    assert out[1].eq(0).all()
    if mode == "mean":
        torch.testing.assert_close(out[0], (weight[2] + weight[1]) / 2)
    out.sum().backward()
    assert 5 not in weight.grad._indices()[0].tolist()
    assert weight.grad._indices()[0].tolist() == ([0, 1, 2] if device.type == "cpu" else [2, 1, 0])
    psw = (torch.rand(7, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    if mode != "max":
        assert torch.autograd.gradcheck(
            lambda w, p: ops.embedding_bag(Densify.apply(w), rows, offsets, p, mode, 5), (weight, psw))
        reference = torch.nn.functional.embedding_bag(rows, weight, offsets, mode="sum", per_sample_weights=psw,
                                                      padding_idx=5, include_last_offset=True)
        if mode == "sum":
            torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, psw, mode, 5), reference)
    else:
        assert torch.autograd.gradcheck(
            lambda w: ops.embedding_bag(Densify.apply(w), rows, offsets, None, mode, 5), (weight,))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [True, False])
def test_embedding_bag_gradcheck_all_modes(device, mode, include_last_offset):
    weight = torch.randn(9, 5, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([1, 2, -1, 2, 5, 1, 3, -1, 8], device=device)
    offsets = torch.tensor([0, 3, 3, 7, 8, 9], device=device)
    if not include_last_offset:
        offsets = offsets[:-1]
    assert torch.autograd.gradcheck(
        lambda w: ops.embedding_bag(Densify.apply(w), rows, offsets, None, mode, None, include_last_offset),
        (weight,))


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False), ("mean", True),
                                            ("max", False)])
def test_embedding_bag_gradients_bit_identical_run_to_run(device, mode, weighted):
    gen = torch.Generator().manual_seed(4)
    nnz = 20000
    # One hot row (a long group), many cold ones, missing rows and one long bag.
    rows = torch.where(torch.rand(nnz, generator=gen) < 0.5, 0, torch.randint(-1, 500, (nnz,), generator=gen))
    offsets = torch.cat([torch.tensor([0]), torch.arange(10000, nnz + 1, 7), torch.tensor([nnz])]).unique()
    rows, offsets = rows.to(device), offsets.to(device)
    weight = torch.randn(500, 33, device=device, requires_grad=True)
    psw = (torch.rand(nnz, generator=gen) + 0.1).to(device).requires_grad_() if weighted else None
    grad_out = torch.randn(offsets.shape[0] - 1, 33, device=device)
    results = []
    for _ in range(3):
        inputs = (weight,) if psw is None else (weight, psw)
        grads = torch.autograd.grad(ops.embedding_bag(weight, rows, offsets, psw, mode), inputs, grad_out)
        results.append([grads[0]._values(), grads[0]._indices()] + list(grads[1:]))
    for again in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], again))


def test_embedding_bag_opcheck_new_arguments(device):
    weight = torch.randn(12, 8, device=device, requires_grad=True)
    rows = torch.tensor([3, -1, 3, 7, 0, 11], device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    psw = torch.rand(6, device=device, requires_grad=True)
    for args in [(weight, rows, offsets, None, "max", None, True), (weight, rows, offsets, psw, "mean", 3, True),
                 (weight, rows, offsets[:-1], psw, "sum", -1, False), (weight, rows, offsets[:-1], None, "max", 7, False)]:
        torch.library.opcheck(torch.ops.sparsekit.embedding_bag.default, args, test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.sparsekit.embedding_bag_argmax.default, (weight, rows, offsets, 3, True),
                          test_utils=OPCHECK_TESTS)


# ---- zero-width tables, misaligned tables, first-bad-position errors ----


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_zero_width_weight_forward_and_backward(device, mode):
    weight = torch.randn(5, 0, device=device, requires_grad=True)
    rows = torch.tensor([0, 4, -1, 2], device=device)
    offsets = torch.tensor([0, 1, 4], device=device)
    out = ops.embedding_bag(weight, rows, offsets, mode=mode)
    assert out.shape == (2, 0)
    out.sum().backward()
    assert weight.grad.shape == (5, 0)
    gathered = ops.embedding_gather(weight, rows.view(2, 2))
    assert gathered.shape == (2, 2, 0)
    (grad,) = torch.autograd.grad(gathered.sum(), weight)
    assert grad.shape == (5, 0) and grad._indices()[0].tolist() == ([0, 2, 4] if device.type == "cpu" else [0, 4, 2])


def test_zero_width_weight_still_checks_rows_and_offsets(device):
    weight = torch.randn(5, 0, device=device)
    with pytest.raises(RuntimeError, match="embedding_bag: rows holds 9 but weight has 5 rows"):
        ops.embedding_bag(weight, torch.tensor([0, 9], device=device), torch.tensor([0, 2], device=device))
    with pytest.raises(RuntimeError, match="embedding_gather: rows holds 9 but weight has 5 rows"):
        ops.embedding_gather(weight, torch.tensor([0, 9], device=device))
    with pytest.raises(RuntimeError, match="embedding_bag: offsets must be non-decreasing"):
        ops.embedding_bag(weight, torch.tensor([0, 1], device=device), torch.tensor([0, 2, 1], device=device))


def error_message(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value).splitlines()[0]


def test_errors_name_the_first_bad_position_offsets_before_rows(device):
    weight = torch.randn(10, 4, device=device)
    nnz = 50000
    rows = torch.randint(0, 10, (nnz,))
    rows[[777, 30000, 49999]] = torch.tensor([12, -5, 99])
    offsets = torch.arange(0, nnz + 1, 5)
    messages = {}
    for dev in {torch.device("cpu"), torch.device(device)}:
        r, o = rows.to(dev), offsets.to(dev)
        bad_offsets = o.clone()
        bad_offsets[[4000, 6000]] = bad_offsets[[4000, 6000]] + 7  # bag 4000 is the first broken
        messages[dev.type] = [
            error_message(lambda: ops.embedding_bag(weight.to(dev), r, o)),
            error_message(lambda: ops.embedding_bag(weight.to(dev), r, o, mode="max")),
            error_message(lambda: ops.embedding_bag(weight.to(dev), r, bad_offsets)),
            error_message(lambda: ops.embedding_bag(weight.to(dev)[:, :0], r, bad_offsets)),
            error_message(lambda: ops.embedding_gather(weight.to(dev), r.view(100, 500))),
        ]
    cpu = messages["cpu"]
    assert "rows holds 12 but weight has 10 rows (at rows[777], the first bad entry)" in cpu[0]
    assert cpu[1] == cpu[0]
    assert "bag 4000 is offsets[4000] == 20007 to offsets[4001] == 20005 (the first bad bag)" in cpu[2]
    assert cpu[3] == cpu[2]
    assert "rows holds 12 but weight has 10 rows (at rows.flatten()[777]" in cpu[4]
    for other in messages.values():
        assert other == cpu


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_misaligned_weight_views(device, mode):
    big = torch.randn(40, 70, dtype=torch.float64, device=device)
    rows, offsets = random_bags(40, 30, 7, missing=0.1, seed=23)
    rows, offsets = rows.to(device), offsets.to(device)
    grad_out = torch.randn(30, 32, dtype=torch.float64, device=device)
    for dtype in [torch.float32, torch.float16]:
        table = big.to(dtype)
        views = [table[:, 1:33], table[3:, 5:37], table.t()[:32].t(), table[:, 1:65:2]]
        for view in views:
            view_rows = rows.clamp_max(view.shape[0] - 1)
            leaf = view.detach().requires_grad_()
            out = ops.embedding_bag(leaf, view_rows, offsets, mode=mode)
            dense = view.contiguous().requires_grad_()
            expected = ops.embedding_bag(dense, view_rows, offsets, mode=mode)
            assert torch.equal(out, expected)
            out.backward(grad_out.to(dtype))
            expected.backward(grad_out.to(dtype))
            assert torch.equal(leaf.grad.to_dense(), dense.grad.to_dense())
            gathered = ops.embedding_gather(leaf, view_rows)
            assert torch.equal(gathered, ops.embedding_gather(dense, view_rows))
            (grad,) = torch.autograd.grad(gathered, leaf, grad_out.to(dtype)[: 1].expand(view_rows.shape[0], 32))
            (grad_dense,) = torch.autograd.grad(ops.embedding_gather(dense, view_rows), dense,
                                                grad_out.to(dtype)[:1].expand(view_rows.shape[0], 32))
            assert torch.equal(grad.to_dense(), grad_dense.to_dense())


# ---- argument types ----


@pytest.mark.parametrize("kwargs, message", [
    (dict(include_last_offset=None), "include_last_offset must be a bool, got None"),
    (dict(include_last_offset=0), "include_last_offset must be a bool, got 0"),
    (dict(include_last_offset=1.0), "include_last_offset must be a bool, got 1.0"),
    (dict(padding_idx=True), "padding_idx must be an int or None, got True"),
    (dict(padding_idx=1.0), "padding_idx must be an int or None, got 1.0"),
    (dict(mode=None), "mode must be a str, got None"),
    (dict(mode=0), "mode must be a str, got 0"),
])
def test_embedding_bag_refuses_mistyped_arguments(device, kwargs, message):
    """The dispatcher reads None or 0 as include_last_offset=False (nn.EmbeddingBag offsets:
    another number of bags) and True as padding_idx=1; torch's F.embedding_bag raises
    TypeError for them, and so does the wrapper, naming the argument."""
    weight = torch.randn(5, 3, device=device)
    rows, offsets = torch.tensor([0, 1, 1, 4], device=device), torch.tensor([0, 2, 4], device=device)
    with pytest.raises(TypeError, match=f"embedding_bag: {message}"):
        ops.embedding_bag(weight, rows, offsets, **kwargs)
    # The right types still work, numpy integers and int tensors included.
    assert ops.embedding_bag(weight, rows, offsets, include_last_offset=False).shape == (3, 3)
    torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, padding_idx=np.int64(1)),
                               ops.embedding_bag(weight, rows, offsets, padding_idx=1))


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_embedding_bag_padding_idx_range_checked_by_kernel_and_fake(dev):
    weight = torch.ones(3, 2, device=dev)
    rows, offsets = torch.zeros(3, dtype=torch.long, device=dev), torch.tensor([0, 3], device=dev)
    for padding_idx in (3, -4):
        with pytest.raises(RuntimeError, match=r"embedding_bag: padding_idx must lie in \[-num_rows, num_rows\) = "
                                               rf"\[-3, 3\), got {padding_idx}"):
            ops.embedding_bag(weight, rows, offsets, padding_idx=padding_idx)
        with pytest.raises(RuntimeError, match="embedding_bag: padding_idx must lie in"):
            torch.ops.sparsekit.embedding_bag_argmax(weight, rows, offsets, padding_idx, True)
    assert ops.embedding_bag(weight, rows, offsets, padding_idx=-3).shape == (1, 2)


# ---- double backward ----


def plain_pool(weight, rows, offsets, per_sample_weights, mode, padding_idx, include_last_offset):
    """Sum / mean pooling in plain differentiable torch (every derivative of it is torch's own)."""
    rows, offsets = rows.long(), offsets.long()
    if not include_last_offset:
        offsets = torch.cat([offsets, offsets.new_full((1,), rows.shape[0])])
    bags = offsets.shape[0] - 1
    bag = torch.repeat_interleave(torch.arange(bags, device=rows.device), offsets.diff())
    valid = rows >= 0
    if padding_idx is not None:
        valid &= rows != padding_idx % weight.shape[0]
    scale = valid.to(weight.dtype) if per_sample_weights is None else torch.where(valid, per_sample_weights, 0.0)
    total = weight.new_zeros(bags, weight.shape[1]).index_add(0, bag, weight[rows.clamp_min(0)] * scale[:, None])
    if mode == "sum":
        return total
    denominator = scale.new_zeros(bags).index_add(0, bag, scale)
    return torch.where(denominator[:, None] != 0, total / torch.where(denominator != 0, denominator, 1)[:, None], 0.0)


DOUBLE_BACKWARD_ROWS = [0, 1, -1, 1, 4, 2, 5, 2]  # a missing row, repeated rows, row 2 as padding
DOUBLE_BACKWARD_OFFSETS = [0, 3, 3, 6, 8]  # an empty bag


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False), ("mean", True),
                                            ("max", False)])
@pytest.mark.parametrize("padding_idx, include_last_offset", [(None, True), (2, False)])
def test_embedding_bag_double_backward_gradgradcheck(device, mode, weighted, padding_idx, include_last_offset):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    psw = (torch.rand(8, dtype=torch.float64, generator=gen) + 0.5).to(device).requires_grad_()
    rows = torch.tensor(DOUBLE_BACKWARD_ROWS, device=device)
    offsets = torch.tensor(DOUBLE_BACKWARD_OFFSETS, device=device)
    offsets = offsets if include_last_offset else offsets[:-1]
    inputs = (weight, psw) if weighted else (weight,)

    def pooled(w, *p):
        return ops.embedding_bag(Densify.apply(w), rows, offsets, p[0] if p else None, mode, padding_idx,
                                 include_last_offset)

    assert torch.autograd.gradgradcheck(pooled, inputs)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_double_backward_matches_plain_torch(device, mode, weighted):
    """Second derivatives (in grad_output, weight and per_sample_weights) equal those of a
    plain-torch pooling, and create_graph=True leaves the first-order gradients unchanged
    bit for bit (the weight's still a sparse COO tensor)."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    psw = (torch.rand(8, dtype=torch.float64, generator=gen) + 0.5).to(device).requires_grad_() if weighted else None
    grad_out = torch.randn(4, 3, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    rows = torch.tensor(DOUBLE_BACKWARD_ROWS, device=device)
    offsets = torch.tensor(DOUBLE_BACKWARD_OFFSETS, device=device)
    inputs = (weight, psw) if weighted else (weight,)
    results = []
    for pool in (ops.embedding_bag, plain_pool):
        first = torch.autograd.grad(pool(weight, rows, offsets, psw, mode, 2, True), inputs, grad_out,
                                    create_graph=True)
        dense = [g.to_dense() if g.is_sparse else g for g in first]
        penalty = sum((g * g.detach().cos()).sum() for g in dense)  # not linear: every second derivative counts
        second = torch.autograd.grad(penalty, (grad_out,) + inputs, allow_unused=True, materialize_grads=True)
        results.append((first, [g.to_dense() if g.is_sparse else g for g in second]))
    (first, second), (want_first, want_second) = results
    assert first[0].layout == torch.sparse_coo
    for got, want in zip(first, want_first):
        torch.testing.assert_close(got.to_dense() if got.is_sparse else got, want)
    for got, want in zip(second, want_second):
        torch.testing.assert_close(got, want)
    plain = torch.autograd.grad(ops.embedding_bag(weight, rows, offsets, psw, mode, 2, True), inputs, grad_out)
    assert torch.equal(first[0]._indices(), plain[0]._indices()) and torch.equal(first[0]._values(), plain[0]._values())
    assert all(torch.equal(a, b) for a, b in zip(first[1:], plain[1:]))


def test_embedding_bag_double_backward_of_the_issue(device):
    """The reported case: the per-sample-weight gradient differentiated again, in sum and mean."""
    for mode in ("sum", "mean"):
        weight = torch.randn(5, 3, device=device, requires_grad=True)
        psw = torch.rand(4, device=device, requires_grad=True)
        rows, offsets = torch.tensor([0, 1, 1, 4], device=device), torch.tensor([0, 2, 4], device=device)
        grads = []
        for pool in (ops.embedding_bag, plain_pool):
            out = pool(weight, rows, offsets, psw, mode, None, True)
            grad_psw, _ = torch.autograd.grad(out.pow(2).sum(), [psw, weight], create_graph=True)
            second = torch.autograd.grad(grad_psw.sum(), [psw, weight])
            grads.append([g.to_dense() if g.is_sparse else g for g in second])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32, other summation orders


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_embedding_bag_double_backward_half_types(device, dtype):
    weight = torch.randn(6, 4, device=device).to(dtype).requires_grad_()
    psw = (torch.rand(8, device=device) + 0.5).to(dtype).requires_grad_()
    rows = torch.tensor(DOUBLE_BACKWARD_ROWS, device=device)
    offsets = torch.tensor(DOUBLE_BACKWARD_OFFSETS, device=device)
    out = ops.embedding_bag(weight, rows, offsets, psw, "mean", 2)
    # A constant grad_output: one sparse second-order contribution to the weight (torch cannot
    # add two half sparse gradients: "cadd_sparse" not implemented for 'Half', see docs/design.md).
    grad_out = torch.randn(4, 4, device=device)
    _, grad_psw = torch.autograd.grad(out, [weight, psw], grad_out.to(dtype), create_graph=True)
    second_psw, second_weight = torch.autograd.grad(grad_psw.float().pow(2).sum(), [psw, weight])
    assert second_psw.dtype == dtype and second_weight.dtype == dtype and second_weight.layout == torch.sparse_coo
    reference = [t.detach().double().requires_grad_() for t in (weight, psw)]
    ref_out = plain_pool(reference[0], rows, offsets, reference[1], "mean", 2, True)
    _, ref_psw = torch.autograd.grad(ref_out, reference, grad_out.to(dtype).double(), create_graph=True)
    want_psw, want_weight = torch.autograd.grad(ref_psw.pow(2).sum(), [reference[1], reference[0]])
    tol = 5e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(second_psw.double(), want_psw, rtol=tol, atol=tol)
    torch.testing.assert_close(second_weight.to_dense().double(), want_weight, rtol=tol, atol=tol)


def test_embedding_gather_double_backward(device):
    weight = torch.randn(8, 3, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([[2, -1], [7, 2], [0, 0]], device=device)
    assert torch.autograd.gradgradcheck(lambda w: ops.embedding_gather(Densify.apply(w), rows), (weight,))
    out = ops.embedding_gather(weight, rows)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), weight, create_graph=True)
    assert grad.layout == torch.sparse_coo
    (second,) = torch.autograd.grad(grad.to_dense().pow(2).sum(), weight)
    # grad[r] = 2 * n_r * weight[r] (n_r lookups of row r): d/dw sum(grad^2) = 8 * n_r^2 * weight[r].
    counts = torch.tensor([2, 0, 2, 0, 0, 0, 0, 1], dtype=torch.float64, device=device)
    torch.testing.assert_close(second.to_dense(), 8 * counts[:, None] ** 2 * weight.detach())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_third_derivative_matches_plain_torch(mode):
    """Under create_graph=True the second-order pass records plain torch ops, so a third
    derivative follows (it is not silently zero)."""
    weight = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    psw = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    rows, offsets = torch.tensor([0, 1, 1, 4]), torch.tensor([0, 2, 4])
    results = []
    for pool in (ops.embedding_bag, plain_pool):
        out = pool(weight, rows, offsets, psw, mode, None, True)
        (grad_psw,) = torch.autograd.grad(out.pow(2).sum(), psw, create_graph=True)
        (second,) = torch.autograd.grad(grad_psw.pow(2).sum(), psw, create_graph=True)
        results.append((second.detach(),) + torch.autograd.grad(second.sum(), [psw, weight]))
    (got_second, got_psw, got_weight), (want_second, want_psw, want_weight) = results
    torch.testing.assert_close(got_second, want_second)
    assert got_psw.abs().max() > 0
    torch.testing.assert_close(got_psw, want_psw)
    torch.testing.assert_close(got_weight.to_dense(), want_weight)


def test_forward_mode_ad_is_refused_not_silently_dropped():
    # register_autograd is reverse mode only: torch dropped the tangent without a word
    # (unpack_dual(out).tangent None; torch.func.jvp / jacfwd gave zeros).
    import torch.autograd.forward_ad as fwAD

    w = torch.randn(5, 2)
    rows, offsets = torch.tensor([0, 3, -1, 3]), torch.tensor([0, 2, 4])
    ids = torch.tensor([0, 1, 0])
    calls = {
        "segment_sum": lambda d: ops.segment_sum(d, ids, 2),
        "segment_mean": lambda d: ops.segment_mean(d, ids, 2),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: forward-mode AD is not supported"):
            torch.func.jvp(call, (torch.randn(3),), (torch.ones(3),))
        with pytest.raises(RuntimeError, match=f"{name}: forward-mode AD is not supported"):
            torch.func.jacfwd(call)(torch.randn(3))
    with fwAD.dual_level():
        dual = fwAD.make_dual(w, torch.ones(5, 2))
        with pytest.raises(RuntimeError, match="embedding_bag: forward-mode AD is not supported \\(weight"):
            ops.embedding_bag(dual, rows, offsets)
        with pytest.raises(RuntimeError, match="embedding_gather: forward-mode AD is not supported"):
            ops.embedding_gather(dual, rows)
        psw = fwAD.make_dual(torch.ones(4), torch.ones(4))
        with pytest.raises(RuntimeError, match="embedding_bag: forward-mode AD is not supported \\(per_sample"):
            ops.embedding_bag(w, rows, offsets, psw)
        # Inside a dual level, arguments without a tangent are ordinary calls.
        assert torch.equal(ops.embedding_bag(w, rows, offsets), ops.embedding_gather(w, torch.tensor([[0, 3], [3, -1]])).sum(1))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_weighted_bags_whose_weights_sum_to_zero_match_plain_torch(device, mode):
    # Mean of a bag whose weights sum to zero (and of one whose only weight is 0) is zeros
    # (the contract); its gradients are then zero too. Against a plain-torch pooling.
    weight = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([1, 2, 3, 4, 0])
    offsets = torch.tensor([0, 2, 4, 5])
    psw = torch.tensor([0.5, -0.5, 1.0, 2.0, 0.0], dtype=torch.float64)
    grad_out = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    bag = torch.tensor([0, 0, 1, 1, 2])
    ref_w, ref_p = weight.clone().requires_grad_(), psw.clone().requires_grad_()
    summed = torch.zeros(3, 3, dtype=torch.float64).index_add(0, bag, ref_w[rows] * ref_p[:, None])
    if mode == "mean":
        total = torch.zeros(3, dtype=torch.float64).index_add(0, bag, ref_p)
        nonzero = total != 0
        summed = torch.where(nonzero[:, None], summed / torch.where(nonzero, total, 1)[:, None], 0)
    summed.backward(grad_out)
    our_w, our_p = weight.to(device).requires_grad_(), psw.to(device).requires_grad_()
    out = ops.embedding_bag(our_w, rows.to(device), offsets.to(device), our_p, mode)
    out.backward(grad_out.to(device))
    torch.testing.assert_close(out.detach().cpu(), summed.detach())
    torch.testing.assert_close(our_w.grad.to_dense().cpu(), ref_w.grad)
    torch.testing.assert_close(our_p.grad.cpu(), ref_p.grad)

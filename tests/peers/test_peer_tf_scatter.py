"""The peers' own test cases, ported to sparsekit's ops.

TensorFlow: ``tensorflow/python/kernel_tests/math_ops/segment_reduction_ops_test.py``
(``unsorted_segment_sum`` / ``_mean``, ``segment_sum`` / ``_mean``, ``sparse_segment_*``),
``array_ops/unique_op_test.py`` (``unique``, ``unique_with_counts``) and
``nn_ops/embedding_ops_test.py`` (``embedding_lookup``, ``embedding_lookup_sparse`` with
the combiners and weights). pytorch_scatter (rusty1s/pytorch_scatter):
``test/test_segment.py``, ``test_scatter.py``, ``test_gather.py``,
``test_zero_tensors.py`` and ``test_broadcasting.py``.

Each test's docstring names the peer test it follows. Where the peer's semantics differ
from sparsekit's contract (docs/api.md, docs/design.md), the test
checks our side and that a refused input gets an error naming the op and the argument:

- ``segment_sum`` is TF's *unsorted* segment sum: ``segment_ids`` is 1-D ``[N]`` (TF also
  takes ids shaped like a prefix of ``data``), int64 or int32 (TF also int16); sorted ids
  are one case of it, so TF's "not increasing" / "must be >= 0" refusals of the sorted
  ops do not apply (negative ids are dropped, unsorted ids summed); data is
  float32/float64/float16/bfloat16 (TF also ints and complex).
- ``unique`` takes int64 / int32 keys (TF also bool, float, string) read flattened (no
  ``axis``).
- ``embedding_bag`` has ``mode`` sum / mean / max (TF's ``sqrtn`` is refused); ``-1`` is a
  missing key, skipped (TF's ``safe_embedding_lookup_sparse`` prunes ids ``< 0``, plain
  ``embedding_lookup_sparse`` raises); a weighted mean whose weights sum to zero gives zeros.
"""

import numpy as np
import pytest
import torch
from _grad import Densify

import sparsekit as sk
from sparsekit import ops

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# TF's assertAllCloseAccordingToType tolerances.
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def tf_input(shape, dtype, device):
    """TF's ``_input``: 1, 2, ... in ``shape``, scaled by 1e-5 for bfloat16; and its float64 copy."""
    values = torch.arange(1, int(np.prod(shape)) + 1, dtype=torch.float64).reshape(shape)
    if dtype == torch.bfloat16:
        values = values * 1e-5
    data = values.to(dtype).to(device)
    return data, data.double().cpu()


def np_segment_reduce(ids, x, num_segments, mean=False):
    """TF's ``_segmentReduce`` for sum / mean, in float64: empty segments are zeros, ids < 0 dropped."""
    x = x.double().cpu().numpy()
    out = np.zeros((int(num_segments),) + x.shape[1:])
    count = np.zeros(int(num_segments))
    for i, s in enumerate(np.asarray(ids).ravel()):
        if s >= 0:
            out[s] += x[i]
            count[s] += 1
    if mean:
        out /= np.maximum(count, 1).reshape((-1,) + (1,) * (x.ndim - 1))
    return torch.from_numpy(out)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-3)


# ---- TensorFlow: segment_reduction_ops_test.py --------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inner", [1, 2, 3, 32])
def test_tf_unsorted_segment_values(device, dtype, inner):
    """UnsortedSegmentTest.testValues: unsorted ids into 12 segments (several empty), for the
    inner sizes that take different GPU paths; sum and mean."""
    ids = torch.tensor([0, 4, 0, 8, 3, 8, 4, 7, 7, 3], device=device)
    data, x = tf_input((10, inner), dtype, device)
    for mean in (False, True):
        out = ops.segment_sum(data, ids, 12, reduce="mean" if mean else "sum")
        assert out.shape == (12, inner) and out.dtype == dtype
        close(out, np_segment_reduce(ids.cpu(), x, 12, mean), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inner", [1, 2, 3, 32])
def test_tf_sorted_segment_values(device, dtype, inner):
    """SegmentReductionOpTest.testValues: sorted ids ``i // 3``, num_segments the last id + 1."""
    ids = torch.arange(10, device=device) // 3
    data, x = tf_input((10, inner), dtype, device)
    close(ops.segment_sum(data, ids, 4), np_segment_reduce(ids.cpu(), x, 4), dtype)
    close(ops.segment_mean(data, ids, 4), np_segment_reduce(ids.cpu(), x, 4, mean=True), dtype)


def test_tf_segment_ids_valid_and_holes(device):
    """SegmentReductionOpTest.testSegmentIdsValid / testSegmentIdsGreaterThanZero /
    testSegmentIdsHole; and testSegmentIdsInvalid2/3, whose unsorted ids the sorted op refuses,
    are an unsorted sum here."""
    data, x = tf_input((4, 4), torch.float32, device)
    out = ops.segment_sum(data, torch.tensor([0, 0, 0, 1], device=device), 2)
    assert out.cpu().tolist() == [[15, 18, 21, 24], [13, 14, 15, 16]]
    for ids in ([1, 1, 2, 2], [0, 0, 3, 3], [0, 1, 0, 1], [0, 1, 2, 0]):
        num_segments = max(ids) + 1
        for mean in (False, True):
            out = ops.segment_sum(data, torch.tensor(ids, device=device), num_segments,
                                  reduce="mean" if mean else "sum")
            assert torch.equal(out.double().cpu(), np_segment_reduce(ids, x, num_segments, mean))


def test_tf_segment_ids_must_be_one_dimensional(device):
    """SegmentReductionOpTest.testSegmentIdsShape and UnsortedSegmentTest.testValues with ids
    reshaped to [5, 2]: TF sums over a prefix of data's dims; sparsekit takes [N] ids and
    names the argument. Flattening both gives TF's answer."""
    ids = torch.tensor([0, 4, 0, 8, 3, 8, 4, 7, 7, 3], device=device).view(5, 2)
    data, x = tf_input((5, 2, 3), torch.float32, device)
    with pytest.raises(RuntimeError, match=r"segment_sum: segment_ids must be 1-D \[N\], got shape \[5, 2\]"):
        ops.segment_sum(data, ids, 12)
    out = ops.segment_sum(data.view(10, 3), ids.view(-1), 12)
    close(out, np_segment_reduce(ids.view(-1).cpu(), x.view(10, 3), 12), torch.float32)


def test_tf_segment_ids_size_mismatch(device):
    """SegmentReductionOpTest.testSegmentIdsSize: ids and data rows must agree."""
    for op in ("segment_sum", "segment_mean"):
        with pytest.raises(RuntimeError, match=rf"{op}: segment_ids has 2 entries but data has 4 rows"):
            getattr(ops, op)(torch.ones(4, 4, device=device), torch.tensor([0, 1], device=device), 2)


@pytest.mark.parametrize("num_segments", [np.int32(12), np.int64(12), "tensor_int32", "tensor_int64"])
def test_tf_num_segments_types(device, num_segments):
    """UnsortedSegmentTest.testNumSegmentsTypes: num_segments as an int32 / int64 scalar (a
    0-d integer tensor is an int, docs/design.md); a bool, a float or a [1] tensor is refused."""
    if isinstance(num_segments, str):
        num_segments = torch.tensor(12, dtype=torch.int32 if num_segments.endswith("32") else torch.int64)
    ids = torch.tensor([0, 4, 0, 8, 3, 8, 4, 7, 7, 3], device=device)
    data, x = tf_input((10, 2), torch.float32, device)
    for reduce in ("sum", "mean"):
        out = ops.segment_sum(data, ids, num_segments, reduce=reduce)
        close(out, np_segment_reduce(ids.cpu(), x, 12, reduce == "mean"), torch.float32)
    for bad in (True, 12.0, torch.tensor([12])):
        with pytest.raises(TypeError, match="segment_sum: num_segments must be an int"):
            ops.segment_sum(data, ids, bad)


@pytest.mark.parametrize("id_dtype", [torch.int16, torch.int32, torch.int64, torch.uint8])
def test_tf_indices_types(device, id_dtype):
    """UnsortedSegmentTest.testIndicesTypes: int32 and int64 ids; TF's int16 (and uint8) are
    refused, naming segment_ids and the dtype."""
    ids = torch.tensor([0, 4, 0, 8, 3, 8, 4, 7, 7, 3], dtype=id_dtype, device=device)
    data, x = tf_input((10, 2), torch.float32, device)
    if id_dtype in (torch.int32, torch.int64):
        close(ops.segment_sum(data, ids, 12), np_segment_reduce(ids.long().cpu(), x, 12), torch.float32)
    else:
        for op in ("segment_sum", "segment_mean"):
            with pytest.raises(RuntimeError, match=rf"{op}: segment_ids must be an int64 or int32 tensor"):
                getattr(ops, op)(data, ids, 12)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.bool])
def test_tf_non_float_data_refused(device, dtype):
    """SegmentReductionOpTest.testValues for int32 / int64 / complex data: sparsekit sums
    floating types only and names data and its dtype."""
    data = torch.ones(4, 2, device=device).to(dtype)
    for op in ("segment_sum", "segment_mean"):
        with pytest.raises(RuntimeError, match=rf"{op}: data must be float32, float64, float16 or bfloat16"):
            getattr(ops, op)(data, torch.tensor([0, 0, 1, 1], device=device), 2)


def test_tf_gradients_float64_gradcheck(device):
    """UnsortedSegmentTest.testGradientsTFGradients / testGradientsGradientTape and
    SegmentReductionOpTest.testGradient: numerical vs analytical Jacobian in float64, ids
    with -1 (dropped), num_segments = max id + 3 (empty segments at the end); twice."""
    ids = torch.tensor([0, 4, 0, -1, 3, -1, 4, 7, 7, 3], device=device)
    num_segments = 7 + 3
    data = tf_input((10, 2), torch.float64, device)[0].requires_grad_()
    for reduce in ("sum", "mean"):
        def fn(x, reduce=reduce):
            return ops.segment_sum(x, ids, num_segments, reduce=reduce)
        assert torch.autograd.gradcheck(fn, (data,))
        assert torch.autograd.gradgradcheck(fn, (data,))
    sorted_ids = torch.tensor([0, 1, 2, 2], device=device)
    data = tf_input((4, 4), torch.float64, device)[0].requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ops.segment_mean(x, sorted_ids, 3), (data,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tf_gradients_low_precision(device, dtype):
    """UnsortedSegmentTest.testGradientsGradientTape for float16 / bfloat16: the gradient of a
    sum is a gather of the output's gradient (exact), of a mean that divided by the count."""
    ids = torch.tensor([0, 4, 0, -1, 3, -1, 4, 7, 7, 3], device=device)
    count = torch.tensor([2, 0, 0, 2, 2, 0, 0, 2, 0, 0], dtype=torch.float64)
    grad_out = torch.arange(20, dtype=torch.float64).view(10, 2)
    for reduce in ("sum", "mean"):
        data = tf_input((10, 2), dtype, device)[0].requires_grad_()
        ops.segment_sum(data, ids, 10, reduce=reduce).backward(grad_out.to(dtype).to(device))
        scale = 1 / count.clamp(min=1) if reduce == "mean" else torch.ones(10, dtype=torch.float64)
        want = torch.where((ids.cpu() >= 0)[:, None], (grad_out * scale[:, None])[ids.cpu().clamp(min=0)], 0.0)
        assert data.grad.dtype == dtype
        close(data.grad, want, dtype)


def test_tf_gradient_matches_sorted_segment_sum(device):
    """UnsortedSegmentTest.testGradientMatchesSegmentSum: on sorted contiguous ids the
    unsorted op's gradient is the sorted op's, ``grad[ids]``."""
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 3, 4, 5], device=device)
    for dtype in (torch.float16, torch.float32, torch.float64):
        data = tf_input((9, 2), dtype, device)[0].requires_grad_()
        grad_out = torch.randn(6, 2, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
        ops.segment_sum(data, ids, 6).backward(grad_out)
        assert torch.equal(data.grad, grad_out[ids])


@pytest.mark.parametrize("bad", [2, 7, 1676240524292489355])
def test_tf_bad_indices(device, bad):
    """UnsortedSegmentTest.testBadIndices and SegmentReductionOpTest.testInvalidIds: an id
    >= num_segments raises, naming segment_ids, the id and num_segments (on CUDA too)."""
    for op in ("segment_sum", "segment_mean"):
        with pytest.raises(RuntimeError, match=rf"{op}: segment_ids holds {bad} but num_segments is 2"):
            getattr(ops, op)(torch.tensor([[17.0]], device=device), torch.tensor([bad], device=device), 2)
    # SparseSegmentReductionOpTest.testSegmentWithNumSegmentsInvalid1: ids [0, 1, 3, 5], 5 segments.
    with pytest.raises(RuntimeError, match=r"segment_ids holds 5 but num_segments is 5"):
        ops.segment_sum(torch.ones(4, 4, device=device), torch.tensor([0, 1, 3, 5], device=device), 5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_tf_empty_second_dimension(device, dtype, id_dtype):
    """UnsortedSegmentTest.testEmptySecondDimension: [2, 0] data gives [2, 0] zeros, and a
    gradient of the same shape."""
    data = torch.zeros(2, 0, dtype=dtype, device=device, requires_grad=True)
    ids = torch.tensor([0, 1], dtype=id_dtype, device=device)
    for reduce in ("sum", "mean"):
        out = ops.segment_sum(data, ids, 2, reduce=reduce)
        assert out.shape == (2, 0) and out.dtype == dtype
        out.sum().backward()
        assert data.grad.shape == (2, 0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_tf_drop_negatives(device, dtype):
    """UnsortedSegmentTest.testDropNegatives: ids 8 replaced by -1 drop those rows, and
    segment 8 stays zero; any negative id is padding (-2**63 too)."""
    ids = torch.tensor([0, 4, 0, 8, 3, 8, 4, 7, 7, 3])
    data, x = tf_input((10, 2), dtype, device)
    want = np_segment_reduce(ids, x, 12)
    want[8:] = 0
    for pad in (-1, -7, -(2**63)):
        dropped = torch.where(ids == 8, pad, ids).to(device)
        close(ops.segment_sum(data, dropped, 12), want, dtype)


def test_tf_all_negatives(device):
    """UnsortedSegmentTest.testAllNegatives: every id negative gives zeros (sum and mean,
    num_segments 2 or 0), and a zero gradient."""
    data = torch.ones(2, 1, device=device, requires_grad=True)
    ids = torch.tensor([-1, -1], dtype=torch.int32, device=device)
    for reduce in ("sum", "mean"):
        assert torch.equal(ops.segment_sum(data, ids, 2, reduce=reduce).cpu(), torch.zeros(2, 1))
        out = ops.segment_sum(data, ids, 0, reduce=reduce)
        assert out.shape == (0, 1)
        (grad,) = torch.autograd.grad(out.sum(), data)
        assert torch.equal(grad.cpu(), torch.zeros(2, 1))


def test_tf_bad_num_segments(device):
    """UnsortedSegmentTest.testBadNumSegments and SparseSegmentReductionOpTest
    .testSegmentWithNumSegmentsInvalid2: a num_segments too large to allocate is an
    AllocationError (a MemoryError) naming it; a negative one names it too."""
    data, ids = torch.ones(3, device=device), torch.zeros(3, dtype=torch.int64, device=device)
    for op in ("segment_sum", "segment_mean"):
        with pytest.raises(MemoryError, match=rf"{op}: num_segments=8327099846119777499 \(the output\)"):
            getattr(ops, op)(data, ids, 8327099846119777499)
        with pytest.raises(RuntimeError, match=rf"{op}: num_segments must be >= 0, got -2"):
            getattr(ops, op)(data, ids, -2)
        with pytest.raises(ValueError, match=rf"{op}: num_segments must fit in int64"):
            getattr(ops, op)(data, ids, 2**63)


def test_tf_data_must_have_rank_one(device):
    """SegmentReductionOpTest.testDataInvalid and testSegmentScalarIdiRaisesInvalidArgumentError:
    scalar data is refused."""
    for op in ("segment_sum", "segment_mean"):
        with pytest.raises(RuntimeError, match=rf"{op}: data must have at least one dimension"):
            getattr(ops, op)(torch.tensor(10.0, device=device), torch.tensor([], dtype=torch.int64, device=device), 1)


@pytest.mark.parametrize("dtype", FLOATS)
def test_tf_nan_propagation(device, dtype):
    """SegmentReductionOpTest.testNaNPropagation (for the sum and mean sparsekit has): a NaN
    row makes its column NaN, the other columns stay exact; inf - inf is NaN."""
    data = torch.tensor([[1.0, 2.0], [float("nan"), 3.0], [3.0, 1.0]], dtype=dtype, device=device)
    ids = torch.zeros(3, dtype=torch.int64, device=device)
    total = ops.segment_sum(data, ids, 1).float().cpu()
    mean = ops.segment_mean(data, ids, 1).float().cpu()
    assert torch.isnan(total[0, 0]) and total[0, 1] == 6.0
    assert torch.isnan(mean[0, 0]) and mean[0, 1] == 2.0
    inf = torch.tensor([float("inf"), float("-inf")], dtype=dtype, device=device)
    assert torch.isnan(ops.segment_sum(inf, ids[:2], 1).float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("inner", [1, 3, 32])
def test_tf_sparse_segment_values(device, dtype, inner):
    """SparseSegmentReductionOpTest.testValues: ``sparse_segment_sum(data, indices,
    segment_ids) == segment_sum(data[indices], segment_ids)``, segment i holding i + 1
    lookups; both as gather + segment_sum and as embedding_bag over CSR offsets."""
    g = torch.Generator().manual_seed(inner)
    segment_ids = torch.tensor([i for i in range(20) for _ in range(i + 1)])
    indices = torch.randint(0, 400, (len(segment_ids),), generator=g)
    data, x = tf_input((400, inner), dtype, device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(segment_ids).cumsum(0)])
    for mean in (False, True):
        want = np_segment_reduce(segment_ids, x[indices], 20, mean)
        gathered = ops.embedding_gather(data, indices.to(device))
        close(ops.segment_sum(gathered, segment_ids.to(device), 20, reduce="mean" if mean else "sum"), want, dtype)
        for index_dtype in (torch.int32, torch.int64):
            pooled = ops.embedding_bag(data, indices.to(index_dtype).to(device), offsets.to(index_dtype).to(device),
                                       mode="mean" if mean else "sum")
            close(pooled, want, dtype)


def test_tf_sparse_segment_holes_num_segments_and_empty(device):
    """SparseSegmentReductionOpTest.testSegmentIdsHole / testWithNumSegments /
    testSegmentIdsGreaterThanZero / testWithEmptySegments(WithNumSegments): empty segments
    are zeros, including trailing ones and a call with no lookups at all."""
    data, x = tf_input((10, 4), torch.float32, device)
    indices = torch.tensor([8, 3, 0, 9])
    for segment_ids in ([0, 2, 2, 2], [1, 2, 2, 2]):
        for num_segments in (3, 5):
            for mean in (False, True):
                got = ops.segment_sum(ops.embedding_gather(data, indices.to(device)),
                                      torch.tensor(segment_ids, device=device), num_segments,
                                      reduce="mean" if mean else "sum")
                assert torch.equal(got.double().cpu(), np_segment_reduce(segment_ids, x[indices], num_segments, mean))
    empty = torch.empty(0, 4, device=device)
    for reduce in ("sum", "mean"):
        for num_segments in (0, 5):
            out = ops.segment_sum(empty, torch.empty(0, dtype=torch.int64, device=device), num_segments, reduce=reduce)
            assert torch.equal(out.cpu(), torch.zeros(num_segments, 4))
        out = ops.embedding_bag(data, torch.empty(0, dtype=torch.int64, device=device),
                                torch.zeros(6, dtype=torch.int64, device=device), mode=reduce)
        assert torch.equal(out.cpu(), torch.zeros(5, 4))


def test_tf_sparse_segment_indices_invalid(device):
    """SparseSegmentReductionOpTest.testIndicesInvalid1/2: an index >= the row count raises,
    naming the first bad position; -1 is sparsekit's missing key, skipped (TF raises)."""
    data = tf_input((10, 4), torch.float32, device)[0]
    offsets = torch.tensor([0, 1, 2, 4], device=device)
    with pytest.raises(RuntimeError, match=r"embedding_bag: rows holds 10 but weight has 10 rows \(at rows\[3\]"):
        ops.embedding_bag(data, torch.tensor([8, 3, 0, 10], device=device), offsets)
    with pytest.raises(RuntimeError, match=r"embedding_gather: rows holds 10 but weight has 10 rows"):
        ops.embedding_gather(data, torch.tensor([8, 3, 0, 10], device=device))
    out = ops.embedding_bag(data, torch.tensor([8, -1, 0, 9], device=device), offsets)
    assert torch.equal(out[1].cpu(), torch.zeros(4))
    assert torch.equal(out[2].cpu(), (data[0] + data[9]).cpu())


@pytest.mark.parametrize("inner", [1, 2, 3, 32])
@pytest.mark.parametrize("single_output", [False, True])
def test_tf_sparse_segment_gradient_explicit(device, inner, single_output):
    """SparseSegmentReductionOpTest.testGradientExplicit / testGradientExplicitSingleOutput /
    testGradientV2Explicit(SingleOutput): the weight gradient of a sum / mean pooling is
    ``xgrad[index] += ygrad[segment] * weight[segment]`` (weight 1, or 1 / count), and our
    sparse gradient holds exactly TF's V2 pair: the distinct indices, ascending on the CPU,
    with their summed rows."""
    segment_ids = [0, 1, 2, 2, 2]
    indices = [0] * 5 if single_output else [8, 3, 0, 9, 3]
    rows_in_table = 1 if single_output else 10
    ygrad = torch.arange(1, 3 * inner + 1, dtype=torch.float32).view(3, inner)
    offsets = torch.tensor([0, 1, 2, 5], device=device)
    for mode in ("sum", "mean"):
        scale = [1.0, 1.0, 1.0] if mode == "sum" else [1.0, 1.0, 1 / 3]
        want = torch.zeros(rows_in_table, inner)
        for segment, index in zip(segment_ids, indices):
            want[index] += ygrad[segment] * scale[segment]
        weight = torch.randn(rows_in_table, inner, device=device, requires_grad=True)
        ops.embedding_bag(weight, torch.tensor(indices, device=device), offsets, mode=mode).backward(ygrad.to(device))
        grad = weight.grad
        assert grad.layout == torch.sparse_coo
        torch.testing.assert_close(grad.to_dense().cpu(), want)
        unique_indices = sorted(set(indices))
        assert grad._nnz() == len(unique_indices)
        if device.type == "cpu":
            assert grad._indices()[0].tolist() == unique_indices
            torch.testing.assert_close(grad._values().cpu(), want[unique_indices])


def test_tf_sparse_segment_gradcheck(device):
    """SparseSegmentReductionOpTest.testGradient / testGradientWithEmptySegmentsAtEnd:
    float64 gradcheck of gather + segment sum / mean, with empty trailing segments."""
    g = torch.Generator().manual_seed(3)
    data = torch.randn(10, 4, dtype=torch.float64, generator=g).to(device).requires_grad_()
    indices = torch.randint(0, 10, (4,), generator=g).to(device)
    segment_ids = torch.tensor([0, 1, 2, 2], device=device)
    for num_segments in (3, 5):
        for reduce in ("sum", "mean"):
            assert torch.autograd.gradcheck(
                lambda w, n=num_segments, r=reduce: ops.segment_sum(
                    ops.embedding_gather(Densify.apply(w), indices), segment_ids, n, reduce=r), (data,))


# ---- TensorFlow: unique_op_test.py ------------------------------------------------------------


def reference_unique(keys):
    """Distinct keys in order of first occurrence and their counts, with numpy."""
    flat = keys.flatten().cpu().numpy()
    values, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return values[order], counts[order]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("high", [10, 100_000])
def test_tf_unique_random(device, dtype, high):
    """UniqueTest.testInt32 / testInt32OutIdxInt64 and UniqueWithCountsTest.testInt32: 7000
    draws; ``x == y[idx]``, as many keys as np.unique, each count the key's occurrences;
    the keys keep their dtype, inverse and counts are int64."""
    g = torch.Generator().manual_seed(high)
    x = torch.randint(2, high, (7000,), generator=g).to(dtype).to(device)
    y, idx, count = ops.unique(x, return_counts=True)
    assert y.dtype == dtype and idx.dtype == torch.int64 and count.dtype == torch.int64
    assert idx.shape == x.shape and torch.equal(y[idx], x)
    values, counts = reference_unique(x)
    assert y.cpu().tolist() == values.tolist() and count.cpu().tolist() == counts.tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tf_unique_ordered_by_appearance(device, dtype):
    """UniqueTest.testOrderedByAppearance / UniqueWithCountsTest.testOrderedByAppearance:
    TF's exact expected keys, indices and counts."""
    x = torch.tensor([3, 5, 3, 4, 1, 4, 9, 8, 6, 3, 5, 7, 8, 8, 4, 6, 4, 2, 5, 6], dtype=dtype, device=device)
    y, idx, count = ops.unique(x, return_counts=True)
    assert y.cpu().tolist() == [3, 5, 4, 1, 9, 8, 6, 7, 2]
    assert idx.cpu().tolist() == [0, 1, 0, 2, 3, 2, 4, 5, 6, 0, 1, 7, 5, 5, 2, 6, 2, 8, 1, 6]
    assert count.cpu().tolist() == [3, 3, 4, 1, 1, 3, 3, 1, 1]
    # The torch.unique return convention of the wrapper.
    assert torch.equal(ops.unique(x, return_inverse=False), y)
    only_counts = ops.unique(x, return_inverse=False, return_counts=True)
    assert len(only_counts) == 2 and torch.equal(only_counts[1], count)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tf_unique_empty(device, dtype):
    """UniqueTest.testEmpty / UniqueWithCountsTest.testEmpty: three empty outputs."""
    y, idx, count = ops.unique(torch.empty(0, dtype=dtype, device=device), return_counts=True)
    assert y.shape == idx.shape == count.shape == (0,) and y.dtype == dtype


def test_tf_unique_multi_dimensional_is_flattened(device):
    """UniqueTest.testInt32Axis: TF's axis variant has no counterpart; keys of any shape are
    read flattened (row-major, also for a transposed view) and inverse keeps their shape."""
    x = torch.tensor([[1, 0, 0], [1, 0, 0], [2, 0, 0]], device=device)
    y, idx, count = ops.unique(x, return_counts=True)
    assert y.cpu().tolist() == [1, 0, 2] and count.cpu().tolist() == [2, 6, 1]
    assert idx.shape == (3, 3) and torch.equal(y[idx], x)
    y, idx = ops.unique(x.t())
    assert y.cpu().tolist() == [1, 2, 0] and torch.equal(y[idx], x.t())


def test_tf_unique_extreme_keys(device):
    """Every int64 is a key (DESIGN.md), the hash table's sentinels included."""
    x = torch.tensor([0, -1, 2**63 - 1, -(2**63), 0, -(2**63), -1], device=device)
    y, idx, count = ops.unique(x, return_counts=True)
    assert y.cpu().tolist() == [0, -1, 2**63 - 1, -(2**63)] and count.cpu().tolist() == [2, 2, 1, 2]
    assert torch.equal(y[idx], x)


@pytest.mark.parametrize("keys", [torch.tensor([True, False]), torch.tensor([0.0, 1.0, float("nan")]),
                                  torch.tensor([1, 2], dtype=torch.int16)])
def test_tf_unique_other_dtypes_refused(device, keys):
    """UniqueTest.testBool / UniqueWithCountsTest.testFloat: TF takes bool and float keys;
    sparsekit's keys are int64 / int32 and the error names keys and the cast."""
    with pytest.raises(RuntimeError, match=r"unique: keys must be an int64 or int32 tensor of keys, got \w+; "
                                           r"cast it with \.long\(\)"):
        ops.unique(keys.to(device))


# ---- TensorFlow: embedding_ops_test.py --------------------------------------------------------


def reference_lookup_sparse(weight, rows, offsets, weights, combiner):
    """TF's embedding_lookup_sparse (with safe_embedding_lookup_sparse's pruning of ids < 0):
    sum of w * row; mean divides by the sum of the weights (zeros where it is 0)."""
    weight = weight.double().cpu()
    out = torch.zeros(len(offsets) - 1, weight.shape[1], dtype=torch.float64)
    for b in range(len(offsets) - 1):
        total = 0.0
        for i in range(offsets[b], offsets[b + 1]):
            if rows[i] < 0:
                continue
            w = 1.0 if weights is None else float(weights[i])
            out[b] += w * weight[rows[i]]
            total += w
        if combiner == "mean":
            out[b] = out[b] / total if total != 0 else 0.0
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tf_embedding_lookup_sparse_combiners(device, dtype, combiner, weighted):
    """EmbeddingLookupSparseTest.testEmbeddingLookupSparse (combiners sum and mean, with and
    without weights) and SafeEmbeddingLookupSparseTest (ids < 0 pruned with their weights,
    an empty bag gives zeros)."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(12, 5, generator=g).to(dtype).to(device)
    rows = [0, 1, 2, 0, -1, 5, 11, 11, 3]
    offsets = [0, 2, 2, 5, 6, 9]   # bags [0, 1], [], [2, 0, -1], [5], [11, 11, 3]
    weights = torch.tensor([2.0, 0.5, 1.0, 3.0, 7.0, 1.5, 0.25, 0.25, 4.0]).to(dtype) if weighted else None
    out = ops.embedding_bag(weight, torch.tensor(rows, device=device), torch.tensor(offsets, device=device),
                            None if weights is None else weights.to(device), mode=combiner)
    assert out.shape == (5, 5) and out.dtype == dtype
    want = reference_lookup_sparse(weight, rows, offsets, weights, combiner)
    torch.testing.assert_close(out.double().cpu(), want, rtol=RTOL[dtype] * 10, atol=RTOL[dtype] * 10)


def test_tf_embedding_lookup_sparse_sqrtn_refused(device):
    """EmbeddingLookupSparseTest with combiner "sqrtn": not in sparsekit's modes (DESIGN.md:
    sum and mean; docs/design.md: max); the error names mode and the modes there are. The layers
    refuse it as combiner."""
    weight = torch.randn(4, 3, device=device)
    with pytest.raises(RuntimeError, match=r'embedding_bag: mode must be "sum", "mean" or "max", got "sqrtn"'):
        ops.embedding_bag(weight, torch.tensor([0, 1], device=device), torch.tensor([0, 2], device=device),
                          mode="sqrtn")
    with pytest.raises(ValueError, match=r"DistributedEmbedding: combiner must be 'sum' or 'mean', got 'sqrtn'"):
        sk.DistributedEmbedding("sqrtn", 16, 4, 1, 2)


def test_tf_embedding_lookup_sparse_zero_weight_sum(device):
    """EmbeddingLookupSparseTest with weights that cancel: TF's mean divides by zero;
    sparsekit's documented choice is zeros and a zero gradient (docs/design.md, embedding_bag)."""
    weight = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    psw = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64, device=device, requires_grad=True)
    out = ops.embedding_bag(weight, torch.tensor([1, 2, 3], device=device), torch.tensor([0, 2, 3], device=device),
                            psw, mode="mean")
    assert torch.equal(out[0].cpu(), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(out[1], weight[3].detach())
    out.sum().backward()
    assert torch.equal(psw.grad.cpu(), torch.zeros(3, dtype=torch.float64))
    assert weight.grad.to_dense()[1:3].abs().sum() == 0


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_tf_embedding_lookup_sparse_gradcheck(device, combiner):
    """EmbeddingLookupSparseTest.testGradientsEmbeddingLookupSparse: float64 gradcheck of the
    pooled lookup in the table and in the weights, with a -1 id and an empty bag."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=g).to(device).requires_grad_()
    psw = (torch.rand(6, dtype=torch.float64, generator=g) + 0.5).to(device).requires_grad_()
    rows = torch.tensor([0, 1, 5, 0, -1, 2], device=device)
    offsets = torch.tensor([0, 2, 2, 5, 6], device=device)
    assert torch.autograd.gradcheck(
        lambda w, p: ops.embedding_bag(Densify.apply(w), rows, offsets, p, mode=combiner), (weight, psw))


def test_tf_embedding_lookup_shapes(device):
    """EmbeddingLookupTest.testSimple / testHigherRank: ``embedding_lookup(params, ids)`` has
    shape ``ids.shape + [dim]`` for ids of any rank (a scalar too), -1 gives zeros."""
    weight = torch.arange(40.0, device=device).view(10, 4)
    for ids in (torch.tensor(3), torch.tensor([1, 9, 1]), torch.tensor([[[1, 2]], [[3, -1]]]),
                torch.empty(0, 3, dtype=torch.int64)):
        ids = ids.to(device)
        out = ops.embedding_gather(weight, ids)
        assert out.shape == tuple(ids.shape) + (4,)
        want = torch.where((ids >= 0).unsqueeze(-1), weight[ids.clamp(min=0)], 0.0)
        assert torch.equal(out, want)


def test_tf_layer_combiners_match_lookup_sparse(device):
    """EmbeddingLookupSparseTest through the layer (SOK's combiners): a DistributedEmbedding's
    sum / mean over padded and ragged input equal the table rows pooled by hand, padding
    not counted in the mean, an empty bag zeros."""
    for combiner in ("sum", "mean"):
        emb = sk.DistributedEmbedding(combiner, 100, 4, 2, 3, device=device)
        keys = torch.tensor([[[5, 7, -1], [-1, -1, -1]], [[5, 5, 9], [11, -1, -1]]], device=device)
        out = emb(keys)
        rows = emb.hash_table.find(keys.flatten())
        vectors = torch.where((rows >= 0).unsqueeze(1), emb.weight.detach()[rows.clamp(min=0)], 0.0).view(2, 2, 3, 4)
        valid = (keys >= 0).sum(-1, keepdim=True)
        want = vectors.sum(2)
        if combiner == "mean":
            want = want / valid.clamp(min=1)
        torch.testing.assert_close(out, want)
        ragged = sk.Ragged(torch.tensor([5, 7, 5, 5, 9, 11], device=device), torch.tensor([0, 2, 2, 5, 6], device=device))
        torch.testing.assert_close(emb(ragged), want)


# ---- pytorch_scatter: test_segment.py / test_scatter.py / test_gather.py ----------------------

# test_segment.py's `tests` with a 1-D index over dim 0 (our segment layout), and
# test_scatter.py's unsorted index over dim 0, with their expected add / mean / max.
SCATTER_CASES = [
    {"src": [1, 2, 3, 4, 5, 6], "index": [0, 0, 1, 1, 1, 3], "indptr": [0, 2, 5, 5, 6],
     "add": [3, 12, 0, 6], "mean": [1.5, 4, 0, 6], "max": [2, 5, 0, 6]},
    {"src": [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]], "index": [0, 0, 1, 1, 1, 3], "indptr": [0, 2, 5, 5, 6],
     "add": [[4, 6], [21, 24], [0, 0], [11, 12]], "mean": [[2, 3], [7, 8], [0, 0], [11, 12]],
     "max": [[3, 4], [9, 10], [0, 0], [11, 12]]},
    {"src": [[1, 2], [5, 6], [3, 4], [7, 8], [9, 10], [11, 12]], "index": [0, 1, 0, 1, 1, 3], "indptr": None,
     "add": [[4, 6], [21, 24], [0, 0], [11, 12]], "mean": [[2, 3], [7, 8], [0, 0], [11, 12]], "max": None},
    {"src": [[[1, 1], [3, 3]], [[2, 2], [4, 4]]], "index": [0, 0], "indptr": [0, 2],
     "add": [[[3, 3], [7, 7]]], "mean": [[[1.5, 1.5], [3.5, 3.5]]], "max": None},
]


@pytest.mark.parametrize("case", range(len(SCATTER_CASES)))
@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_segment_coo_and_scatter_forward(device, case, dtype):
    """pytorch_scatter test_segment.py::test_forward (segment_coo) and
    test_scatter.py::test_forward, reductions add and mean: segment_sum / segment_mean over
    a (sorted or unsorted) index, empty segments zero."""
    test = SCATTER_CASES[case]
    src = torch.tensor(test["src"], dtype=dtype, device=device)
    index = torch.tensor(test["index"], device=device)
    num_segments = len(test["add"])
    assert torch.equal(ops.segment_sum(src, index, num_segments), torch.tensor(test["add"], dtype=dtype, device=device))
    assert torch.equal(ops.segment_mean(src, index, num_segments),
                       torch.tensor(test["mean"], dtype=dtype, device=device))


@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.parametrize("reduce", ["add", "mean", "max"])
def test_scatter_segment_csr_forward(device, case, reduce):
    """pytorch_scatter test_segment.py::test_forward (segment_csr): an embedding_bag over
    the rows in order is a CSR segment reduction; an empty segment gives 0 (max too)."""
    test = SCATTER_CASES[case]
    src = torch.tensor(test["src"], dtype=torch.float32, device=device)
    src = src if src.dim() == 2 else src.unsqueeze(1)
    indptr = torch.tensor(test["indptr"], device=device)
    mode = "sum" if reduce == "add" else reduce
    out = ops.embedding_bag(src, torch.arange(src.shape[0], device=device), indptr, mode=mode)
    want = torch.tensor(test[reduce], dtype=torch.float32, device=device)
    assert torch.equal(out, want if want.dim() == 2 else want.unsqueeze(1))


@pytest.mark.parametrize("case", range(len(SCATTER_CASES)))
def test_scatter_backward_gradcheck(device, case):
    """pytorch_scatter test_segment.py::test_backward / test_scatter.py::test_backward:
    float64 gradcheck of add and mean."""
    test = SCATTER_CASES[case]
    src = torch.tensor(test["src"], dtype=torch.float64, device=device).requires_grad_()
    index = torch.tensor(test["index"], device=device)
    for reduce in ("sum", "mean"):
        assert torch.autograd.gradcheck(lambda x, r=reduce: ops.segment_sum(x, index, len(test["add"]), reduce=r),
                                        (src,))
    if test["indptr"] is not None and src.dim() == 2:
        indptr = torch.tensor(test["indptr"], device=device)
        rows = torch.arange(src.shape[0], device=device)
        for mode in ("sum", "mean", "max"):
            assert torch.autograd.gradcheck(lambda x, m=mode: ops.embedding_bag(Densify.apply(x), rows, indptr, mode=m),
                                            (src,))


@pytest.mark.parametrize("case", [1, 2])
def test_scatter_non_contiguous(device, case):
    """pytorch_scatter test_scatter.py::test_non_contiguous / test_segment.py::
    test_non_contiguous_segment: a transposed copy of src, and a strided index, give the
    same sums."""
    test = SCATTER_CASES[case]
    src = torch.tensor(test["src"], dtype=torch.float32, device=device)
    src = src.t().contiguous().t()
    assert not src.is_contiguous()
    index = torch.tensor(test["index"], device=device).repeat_interleave(2)[::2]
    assert not index.is_contiguous()
    assert torch.equal(ops.segment_sum(src, index, 4), torch.tensor(test["add"], dtype=torch.float32, device=device))
    assert torch.equal(ops.segment_mean(src, index, 4), torch.tensor(test["mean"], dtype=torch.float32, device=device))


def test_scatter_gather(device):
    """pytorch_scatter test_gather.py: gather_coo(src, index) is ``src.index_select(0, index)``
    and gather_csr(src, indptr) repeats row i ``indptr[i + 1] - indptr[i]`` times."""
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], device=device)
    index = torch.tensor([0, 0, 1, 1, 1, 3], device=device)
    assert torch.equal(ops.embedding_gather(src, index), src.index_select(0, index))
    indptr = torch.tensor([0, 2, 5, 5, 6], device=device)
    csr_index = torch.repeat_interleave(torch.arange(4, device=device), indptr.diff())
    assert torch.equal(ops.embedding_gather(src, csr_index), src.index_select(0, index))


@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_zero_elements(device, dtype):
    """pytorch_scatter test_zero_tensors.py::test_zero_elements: src [0, 0, 0, 16], empty
    index, dim_size 0: forward and backward keep the shapes (segment, gather)."""
    x = torch.randn(0, 0, 0, 16, device=device).to(dtype).requires_grad_()
    index = torch.empty(0, dtype=torch.int64, device=device)
    for reduce in ("sum", "mean"):
        out = ops.segment_sum(x, index, 0, reduce=reduce)
        assert out.shape == (0, 0, 0, 16)
        out.backward(torch.randn_like(out))
        assert x.grad.shape == (0, 0, 0, 16)
    weight = torch.randn(0, 16, device=device).to(dtype).requires_grad_()
    out = ops.embedding_gather(weight, index)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert weight.grad.shape == (0, 16)
    out = ops.embedding_bag(weight, index, torch.zeros(1, dtype=torch.int64, device=device))
    assert out.shape == (0, 16)


def test_scatter_broadcasting(device):
    """pytorch_scatter test_broadcasting.py: a 1-D index over dim 2 of a [B, C, H, W] src
    (broadcast over the other dims) is a segment sum of ``src.movedim(2, 0)`` (a strided
    view) with [C, ...] rows; output [B, C, H, W]."""
    g = torch.Generator().manual_seed(0)
    B, C, H, W = 4, 3, 8, 8
    src = torch.randn(B, C, H, W, generator=g).to(device)
    index = torch.randint(0, H, (H,), generator=g).to(device)
    for reduce in ("sum", "mean"):
        out = ops.segment_sum(src.movedim(2, 0), index, H, reduce=reduce).movedim(0, 2)
        assert out.shape == (B, C, H, W)
        want = torch.zeros(B, C, H, W, device=device).index_add_(2, index, src)
        if reduce == "mean":
            want = want / torch.bincount(index, minlength=H).clamp(min=1).view(1, 1, H, 1)
        torch.testing.assert_close(out, want)

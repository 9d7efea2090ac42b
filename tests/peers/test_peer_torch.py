"""PyTorch's own test cases for the ops sparsekit stands in for, ported to sparsekit.

Each test follows a test of pytorch/pytorch (named in its docstring): test/nn/test_embedding.py
for ``nn.EmbeddingBag`` / ``F.embedding_bag`` / ``nn.Embedding``, test/test_sort_and_select.py
for ``torch.unique``, test/test_scatter_gather_ops.py and test/test_torch.py for
``index_add_`` / ``scatter_add_`` / ``scatter_reduce_``, and the OpInfo sample inputs of
``torch.testing._internal.common_methods_invocations``. They check what the PyTorch test
checks, where DESIGN.md promises torch's behaviour; where sparsekit deliberately differs
(``-1`` is a missing row, CSR offsets by default, per_sample_weights with mean, a sparse
gradient in every mode, stricter offsets) the test checks the documented behaviour and a
clear error instead.

The reference is PyTorch itself, computed on the CPU in float64 (so half-type results are
compared against the exact value, not against torch's own half rounding, which sparsekit's
float32 accumulation beats).
"""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from _grad import Densify

from sparsekit import ops

# Tolerances against a float64 reference, per weight dtype (sums of a few values of
# magnitude <= 10; half types round the result once).
TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.float16: {"atol": 2e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1e-1, "rtol": 2e-2},
}
WEIGHT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]


def dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


def assert_close_to(actual, expected, dtype, scale=1.0):
    tol = {key: value * scale for key, value in TOL[dtype].items()}
    torch.testing.assert_close(dense(actual).double().cpu(), dense(expected).double().cpu(), **tol)


# ---- nn.EmbeddingBag's known example ----

# weight = arange(1, 11).view(5, 2); input = [3, 1, 1, 1, 4, 0];
# nn.EmbeddingBag offsets [0, 0, 3, 3, 6]: bags [], [3, 1, 1], [], [1, 4, 0], [].
KNOWN_ROWS = [3, 1, 1, 1, 4, 0]
KNOWN_OFFSETS = [0, 0, 3, 3, 6]
KNOWN_GRAD_OUTPUT = [[99, 99], [1, 2], [99, 99], [3, 4], [99, 99]]
KNOWN = {
    "sum": ([[0, 0], [13, 16], [0, 0], [13, 16], [0, 0]], [[3, 4], [5, 8], [0, 0], [1, 2], [3, 4]], 1),
    "mean": ([[0, 0], [13, 16], [0, 0], [13, 16], [0, 0]], [[3, 4], [5, 8], [0, 0], [1, 2], [3, 4]], 3),
    "max": ([[0, 0], [7, 8], [0, 0], [9, 10], [0, 0]], [[0, 0], [0, 0], [0, 0], [1, 2], [3, 4]], 1),
}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_known_example_with_empty_bags(device, mode, dtype, include_last_offset):
    """test_embedding.py TestEmbeddingNNDeviceType._test_EmbeddingBag (test_embedding_bag_device,
    test_embedding_bag_half, test_embedding_bag_bfloat16): the 5 x 2 example with empty bags,
    every weight / index / offset dtype, output and (sparse) weight gradient; in both offset
    conventions (sparsekit's CSR default is nn.EmbeddingBag's offsets with nnz appended)."""
    for rows_dtype, offsets_dtype in itertools.product(INDEX_DTYPES, INDEX_DTYPES):
        expected_output, expected_grad, denominator = KNOWN[mode]
        weight = torch.arange(1, 11, device=device).view(5, 2).to(dtype).requires_grad_()
        rows = torch.tensor(KNOWN_ROWS, device=device, dtype=rows_dtype)
        offsets = KNOWN_OFFSETS + ([len(KNOWN_ROWS)] if include_last_offset else [])
        offsets = torch.tensor(offsets, device=device, dtype=offsets_dtype)
        out = ops.embedding_bag(weight, rows, offsets, mode=mode, include_last_offset=include_last_offset)
        out.backward(torch.tensor(KNOWN_GRAD_OUTPUT, device=device, dtype=dtype))
        assert out.dtype == dtype and out.shape == (5, 2)
        expected = torch.tensor(expected_output, dtype=torch.float64) / denominator
        assert_close_to(out, expected, dtype)
        assert weight.grad.is_sparse and weight.grad.shape == weight.shape and weight.grad.dtype == dtype
        assert_close_to(weight.grad, torch.tensor(expected_grad, dtype=torch.float64) / denominator, dtype)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("rows_dtype,offsets_dtype", list(itertools.product(INDEX_DTYPES, INDEX_DTYPES)))
def test_all_empty_bags(device, mode, rows_dtype, offsets_dtype):
    """_test_EmbeddingBag "test all empty bags" and test_embedding_bag_empty_input: no lookups,
    several empty bags: zeros out, an all-zero gradient of the weight's shape."""
    weight = torch.randn(4, 3, device=device, requires_grad=True)
    rows = torch.tensor([], device=device, dtype=rows_dtype)
    for offsets, bags, include_last_offset in (([0], 1, False), ([0, 0], 2, False), ([0, 0, 0, 0], 4, False),
                                               ([0], 0, True), ([0, 0, 0, 0], 3, True)):
        weight.grad = None
        out = ops.embedding_bag(weight, rows, torch.tensor(offsets, device=device, dtype=offsets_dtype), mode=mode,
                                include_last_offset=include_last_offset)
        assert out.shape == (bags, 3)
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert weight.grad.shape == weight.shape
        assert torch.equal(dense(weight.grad), torch.zeros_like(weight))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows_dtype,offsets_dtype", list(itertools.product(INDEX_DTYPES, INDEX_DTYPES)))
@pytest.mark.parametrize("trainable_scale", [False, True])
def test_empty_per_sample_weights_and_offsets(device, dtype, rows_dtype, offsets_dtype, trainable_scale):
    """test_EmbeddingBag_empty_per_sample_weights_and_offsets (pytorch#46572): empty input and
    per_sample_weights, five empty bags; zeros out, a zero weight gradient, an empty
    per_sample_weights gradient."""
    weight = torch.arange(1, 11, device=device).view(5, 2).to(dtype).requires_grad_()
    rows = torch.tensor([], device=device, dtype=rows_dtype)
    offsets = torch.tensor([0, 0, 0, 0, 0], device=device, dtype=offsets_dtype)
    psw = torch.randn(0, device=device, dtype=dtype).requires_grad_(trainable_scale)
    out = ops.embedding_bag(weight, rows, offsets, psw, include_last_offset=False)
    assert out.shape == (5, 2) and torch.equal(out, torch.zeros_like(out))
    out.backward(torch.randn_like(out))
    assert torch.equal(dense(weight.grad), torch.zeros_like(weight))
    if trainable_scale:
        assert psw.grad is not None and psw.grad.shape == (0,)


def reference_bags(rows, weight, offsets, mode, per_sample_weights, include_last_offset):
    """test_embedding.py's _embedding_bag_reference_impl, in float64 on the CPU: every bag pooled
    by narrow + sum / mean / max, an empty bag zeros."""
    rows = rows.long().cpu()
    offsets = offsets.long().cpu().tolist()
    if not include_last_offset:
        offsets = offsets + [rows.shape[0]]
    if per_sample_weights is None:
        per_sample_weights = torch.ones(rows.shape, dtype=weight.dtype)
    embeddings = weight.index_select(0, rows) * per_sample_weights.unsqueeze(1)
    bags = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end == start:
            bags.append(weight.new_zeros(weight.shape[1]))
        elif mode == "sum":
            bags.append(embeddings[start:end].sum(0))
        elif mode == "mean":
            bags.append(embeddings[start:end].sum(0) / (end - start))
        else:
            bags.append(embeddings[start:end].max(0)[0])
    return torch.stack(bags)


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_per_sample_weights_and_new_offsets(device, mode, weighted, dtype, include_last_offset):
    """test_EmbeddingBag_per_sample_weights_and_new_offsets (and _and_offsets): forward, weight
    and per_sample_weights gradients against the narrow-and-pool reference, both offset
    conventions."""
    for rows_dtype, offsets_dtype in itertools.product(INDEX_DTYPES, INDEX_DTYPES):
        weight = torch.arange(1, 11, device=device).view(5, 2).to(dtype).requires_grad_()
        rows = torch.tensor(KNOWN_ROWS, device=device, dtype=rows_dtype)
        offsets = KNOWN_OFFSETS + ([len(KNOWN_ROWS)] if include_last_offset else [])
        offsets = torch.tensor(offsets, device=device, dtype=offsets_dtype)
        psw = torch.randn(rows.shape, device=device, dtype=dtype, requires_grad=True) if weighted else None
        reference_weight = weight.detach().double().cpu().requires_grad_()
        reference_psw = psw.detach().double().cpu().requires_grad_() if weighted else None
        expected = reference_bags(rows, reference_weight, offsets, mode, reference_psw, include_last_offset)
        out = ops.embedding_bag(weight, rows, offsets, psw, mode=mode, include_last_offset=include_last_offset)
        assert_close_to(out, expected, dtype)
        grad = torch.randn(expected.shape, dtype=dtype)
        out.backward(grad.to(device))
        expected.backward(grad.double())
        assert_close_to(weight.grad, reference_weight.grad, dtype)
        if weighted:
            assert_close_to(psw.grad, reference_psw.grad, dtype)


def check_against_embedding(device, num_rows, dim, bags, length, mode, dtype, rows_dtype, weighted=False,
                            trainable=False, seed=0):
    """_test_EmbeddingBag_vs_Embedding: bags of constant length against nn.Embedding + a reduction
    (float64 on the CPU), forward, weight and per_sample_weights gradients."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen).to(dtype)
    rows = torch.randint(num_rows, (bags, length), generator=gen, dtype=rows_dtype)
    offsets = torch.arange(0, bags, dtype=rows_dtype) * length
    grad_output = torch.rand(bags, dim, generator=gen).to(dtype)
    reference_weight = weight.double().clone().requires_grad_()
    lookups = F.embedding(rows.long(), reference_weight)
    psw = reference_psw = None
    if weighted:
        scale = torch.randn(bags, length, generator=gen).softmax(-1).to(dtype)
        psw = scale.reshape(-1).to(device).clone().requires_grad_(trainable)
        reference_psw = scale.double().clone().requires_grad_(trainable)
        expected = (lookups * reference_psw.unsqueeze(-1)).sum(1)
    else:
        expected = {"sum": lambda: lookups.sum(1), "mean": lambda: lookups.mean(1),
                    "max": lambda: lookups.max(1)[0]}[mode]()
    weight = weight.to(device).clone().requires_grad_()
    out = ops.embedding_bag(weight, rows.reshape(-1).to(device), offsets.to(device), psw, mode=mode,
                            include_last_offset=False)
    assert_close_to(out, expected, dtype)
    out.backward(grad_output.to(device))
    expected.backward(grad_output.double())
    assert weight.grad.is_sparse
    # A row's gradient sums up to bags * length values.
    assert_close_to(weight.grad, reference_weight.grad, dtype, scale=max(1.0, bags * length / 8))
    if weighted and trainable:
        assert_close_to(psw.grad.view(bags, length), reference_psw.grad, dtype)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows_dtype", INDEX_DTYPES)
def test_embedding_bag_vs_embedding(device, mode, dtype, rows_dtype):
    """_test_EmbeddingBag's "compare EmbeddingBag vs Embedding + Sum/Mean, for constant bag
    length": every size in {1, 2}^4 and a random one."""
    for seed, sizes in enumerate(list(itertools.product([1, 2], repeat=4)) + [(37, 13, 21, 17)]):
        check_against_embedding(device, *sizes, mode, dtype, rows_dtype, seed=seed)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("trainable", [False, True])
def test_per_sample_weights_and_no_offsets(device, dtype, rows_dtype, trainable):
    """test_EmbeddingBag_per_sample_weights_and_no_offsets: weighted sum against Embedding * weights,
    a simple case, B * L > 1000, a large table and a large dim."""
    for seed, sizes in enumerate(((2, 3, 5, 7), (2, 5, 53, 23), (101, 5, 3, 7), (2, 101, 3, 7))):
        check_against_embedding(device, *sizes, "sum", dtype, rows_dtype, weighted=True, trainable=trainable,
                                seed=seed)


# ---- padding_idx ----

PADDING_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", PADDING_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("allpad", [False, True])
def test_embedding_bag_1d_padding_idx(device, dtype, mode, include_last_offset, allpad):
    """test_embedding_bag_1D_padding_idx: random 1-D bags (one empty, one full) with every row
    used as padding_idx (and None), against torch's 2-D embedding_bag of the same bags padded
    with padding_idx; forward and weight gradient."""
    rng = random.Random(hash((mode, include_last_offset, allpad)) & 0xFFFF)
    num_words, dim, num_bags, longest = 100, 3, 10, 10
    empty_bag = rng.randrange(num_bags)
    full_bag = (empty_bag + 1 + rng.randrange(num_bags - 1)) % num_bags
    rows, starts = [], []
    for bag in range(num_bags):
        starts.append(len(rows))
        size = longest if bag == full_bag else 0 if bag == empty_bag else rng.randint(1, longest - 1)
        rows += [1 if allpad else rng.randrange(num_words) for _ in range(size)]
    ends = starts[1:] + [len(rows)]
    offsets = starts + ([len(rows)] if include_last_offset else [])
    gen = torch.Generator().manual_seed(len(rows))
    for padding_idx in sorted(set(rows))[:6] + [None]:
        padded_row = padding_idx if padding_idx is not None else num_words
        words = num_words if padding_idx is not None else num_words + 1
        rows_2d = torch.tensor([rows[s:e] + [padded_row] * (longest - (e - s)) for s, e in zip(starts, ends)])
        weight = torch.randn(words, dim, generator=gen).to(dtype)
        reference_weight = weight.double().clone().requires_grad_()
        expected = F.embedding_bag(rows_2d, reference_weight, padding_idx=padded_row, mode=mode)
        weight = weight.to(device).clone().requires_grad_()
        out = ops.embedding_bag(weight, torch.tensor(rows, device=device, dtype=torch.int64),
                                torch.tensor(offsets, device=device), mode=mode, padding_idx=padding_idx,
                                include_last_offset=include_last_offset)
        assert_close_to(out, expected, dtype)
        out.sum().backward()
        expected.sum().backward()
        assert_close_to(weight.grad, reference_weight.grad, dtype, scale=4)


@pytest.mark.parametrize("dtype", PADDING_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("allpad", [False, True])
@pytest.mark.parametrize("num_bags", [1, 10])
def test_embedding_bag_2d_padding_idx(device, dtype, mode, allpad, num_bags):
    """test_embedding_bag_2D_padding_idx: full bags of 10 (one of a single repeated row), every
    row used as padding_idx, against F.embedding + a masked reduction (an all-padding bag
    gives zeros)."""
    gen = torch.Generator().manual_seed(num_bags + 2 * allpad)
    num_words, dim, length = 10, 3, 10
    rows = torch.ones(num_bags, length, dtype=torch.int64) if allpad else \
        torch.randint(0, num_words, (num_bags, length), generator=gen)
    if num_bags > 1 and not allpad:
        rows[3] = rows[3][0]
    for padding_idx in sorted(set(rows.flatten().tolist())):
        weight = torch.randn(num_words, dim, generator=gen).to(dtype)
        reference_weight = weight.double().clone().requires_grad_()
        lookups = F.embedding(rows, reference_weight, padding_idx=padding_idx)
        keep = rows.ne(padding_idx).double().unsqueeze(-1)
        if mode == "max":
            expected = lookups.masked_fill(rows.unsqueeze(-1) == padding_idx, -float("inf")).amax(1)
        else:
            expected = (lookups * keep).sum(1)
            if mode == "mean":
                expected = expected / keep.sum(1)
        if mode != "sum":
            expected = expected.masked_fill(rows.eq(padding_idx).all(-1).unsqueeze(-1), 0)
        weight = weight.to(device).clone().requires_grad_()
        out = ops.embedding_bag(weight, rows.reshape(-1).to(device),
                                torch.arange(0, num_bags * length + 1, length, device=device), mode=mode,
                                padding_idx=padding_idx)
        assert_close_to(out, expected, dtype)
        out.sum().backward()
        expected.sum().backward()
        assert_close_to(weight.grad, reference_weight.grad, dtype, scale=4)


def test_include_last_offset_with_padding_idx(device):
    """TestEmbeddingNN.test_embeddingbag_include_last_offset (pytorch#89677): mean, padding_idx=61
    not looked up, include_last_offset=True, offsets [0, 3, 4]. torch also reads [0, 3, 3] over
    4 lookups as the same bags (its last bag runs to nnz whatever offsets[-1] says); sparsekit
    checks CSR offsets and refuses that one, with a hint at the other convention (docs/design.md,
    embedding_bag)."""
    weight = torch.randn(100, 3, device=device)
    rows = torch.tensor([0, 1, 2, 3], device=device)
    expected = torch.stack([weight[0:3].mean(0), weight[3]])
    out = ops.embedding_bag(weight, rows, torch.tensor([0, 3, 4], device=device), mode="mean", padding_idx=61)
    torch.testing.assert_close(out, expected)
    with pytest.raises(RuntimeError, match="offsets.*include_last_offset=False"):
        ops.embedding_bag(weight, rows, torch.tensor([0, 3, 3], device=device), mode="mean", padding_idx=61)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_row_unchanged_by_backward_and_double_backward(device, mode):
    """test_embedding_padding_idx's gradient part, on embedding_bag: after backward, and after a
    backward through the gradient (torch.autograd.grad then backward of grad.sum() + out.sum()),
    weight + weight.grad leaves the padding row as it was; 1, 2 and 1000 padding lookups."""
    for count in (1, 2, 1000):
        for others in ([], [1, 3], [2]):
            weight = torch.randn(5, 2, device=device, requires_grad=True)
            rows = torch.tensor(others + [0] * count, device=device)
            offsets = torch.tensor([0, rows.shape[0]], device=device)
            before = weight[0].detach().clone()
            ops.embedding_bag(weight, rows, offsets, mode=mode, padding_idx=0).sum().backward()
            assert torch.equal((weight + dense(weight.grad))[0], before)
            weight.grad = None
            total = ops.embedding_bag(weight, rows, offsets, mode=mode, padding_idx=0).sum()
            (grad,) = torch.autograd.grad(total, [weight], retain_graph=True)
            (grad.sum() + total).backward()
            assert torch.equal((weight + dense(weight.grad))[0], before)


def test_padding_idx_range(device):
    """test_embedding_bag_padding_idx_error: padding_idx in [-num_rows, num_rows) is accepted
    (negative counts from the end), anything else raises naming padding_idx."""
    weight = torch.rand(4, 3, device=device)
    rows = torch.tensor([1, 3, 2, 0, 2, 1], device=device)
    offsets = torch.tensor([0, 3, 6], device=device)
    for padding_idx in range(-6, 6):
        if -4 <= padding_idx < 4:
            expected = F.embedding_bag(rows.view(2, 3), weight, padding_idx=padding_idx, mode="sum")
            torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, padding_idx=padding_idx), expected)
        else:
            with pytest.raises(RuntimeError, match="padding_idx must lie in"):
                ops.embedding_bag(weight, rows, offsets, padding_idx=padding_idx)


# ---- errors ----


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows_dtype", INDEX_DTYPES)
def test_out_of_bounds_rows(device, mode, dtype, rows_dtype):
    """test_embedding_bag_out_of_bounds_idx: a row past the table raises on every device (torch
    checks only on the CPU), naming rows; -1 is sparsekit's missing key and is skipped (torch
    raises for it: a documented difference), any other negative row raises."""
    weight = torch.randn(10, 2, device=device, dtype=dtype)
    offsets = torch.tensor([0, 2], device=device)
    for padding_idx in (None, 0):
        for bad in ([11, 8], [-2, 1]):
            with pytest.raises(RuntimeError, match=r"embedding_bag: rows holds .* but weight has 10 rows"):
                ops.embedding_bag(weight, torch.tensor(bad, device=device, dtype=rows_dtype), offsets, mode=mode,
                                  padding_idx=padding_idx)
        out = ops.embedding_bag(weight, torch.tensor([-1, 1], device=device, dtype=rows_dtype), offsets, mode=mode)
        torch.testing.assert_close(out, weight[1:2])


def test_dimension_errors(device):
    """test_embedding_bag_dimension_errors and test_embedding_scalar_weight_error: a rows, offsets
    or weight of the wrong rank raises naming the argument (sparsekit takes 1-D rows only)."""
    weight = torch.zeros(2, 6, dtype=torch.float64, device=device)
    five_d = torch.full((2, 0, 0, 6, 6), 0, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="embedding_bag: rows must be 1-D"):
        ops.embedding_bag(weight, five_d, five_d)
    with pytest.raises(RuntimeError, match="embedding_bag: offsets must be 1-D"):
        ops.embedding_bag(weight, torch.full((2,), 1, device=device), five_d)
    for bad_weight in (torch.zeros(2, 2, 2, dtype=torch.float64, device=device), torch.tensor(1.0, device=device),
                       torch.tensor(1.0, device=device).reshape(1, 1, 1)):
        with pytest.raises(RuntimeError, match="embedding_bag: weight must be 2-D"):
            ops.embedding_bag(bad_weight, torch.full((2,), 0, device=device), torch.zeros(2, dtype=torch.int64,
                                                                                         device=device),
                              include_last_offset=False)
        with pytest.raises(RuntimeError, match="embedding_gather: weight must be 2-D"):
            ops.embedding_gather(bad_weight, torch.zeros(2, 2, dtype=torch.int64, device=device))


@pytest.mark.parametrize("rows_dtype,offsets_dtype", list(itertools.product(INDEX_DTYPES, INDEX_DTYPES)))
def test_per_sample_weights_failures(device, rows_dtype, offsets_dtype):
    """test_EmbeddingBag_per_sample_weights_failures: a per_sample_weights of another dtype than
    the weight, or of another length than the rows, raises naming per_sample_weights (on every
    device; torch checks the dtype on the CPU only); mode="max" refuses it. Weighted mean is a
    sparsekit addition (torch refuses it) and is accepted."""
    weight = torch.randn(5, 2, device=device)
    rows = torch.tensor([3, 1, 1, 1, 4, 0], device=device, dtype=rows_dtype)
    offsets = torch.tensor([0, 0, 3, 3, 6], device=device, dtype=offsets_dtype)
    with pytest.raises(RuntimeError, match="per_sample_weights is Double but weight is Float"):
        ops.embedding_bag(weight, rows, offsets, torch.randn(6, dtype=torch.double, device=device),
                          include_last_offset=False)
    for bad in (torch.randn(5, device=device), torch.randn(6, 1, device=device)):
        with pytest.raises(RuntimeError, match=r"per_sample_weights must be 1-D \[nnz\]"):
            ops.embedding_bag(weight, rows, offsets, bad, include_last_offset=False)
    with pytest.raises(RuntimeError, match="per_sample_weights is only supported for mode=\"sum\" or \"mean\""):
        ops.embedding_bag(weight, rows, offsets, torch.randn(6, device=device), mode="max", include_last_offset=False)
    ops.embedding_bag(weight, rows, offsets, torch.rand(6, device=device), mode="mean", include_last_offset=False)


def test_illegal_offsets(device):
    """_test_EmbeddingBag's "illegal input combos": offsets[0] != 0 and an offset past nnz raise,
    naming offsets (torch checks them on the CPU only)."""
    weight = torch.randn(10, 20, device=device)
    rows = torch.ones(12, dtype=torch.int64, device=device)
    for bad in ([1, 4, 8], [0, 4, 100], [0, 8, 4]):
        with pytest.raises(RuntimeError, match="embedding_bag: offsets must be non-decreasing"):
            ops.embedding_bag(weight, rows, torch.tensor(bad, device=device), include_last_offset=False)


# ---- layouts ----


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows_dtype,offsets_dtype", list(itertools.product(INDEX_DTYPES, INDEX_DTYPES)))
def test_non_contiguous_weight(device, dtype, rows_dtype, offsets_dtype):
    """test_embedding_bag_non_contiguous_weight: a column slice (and a transposed table) pools as
    its contiguous copy, in every mode."""
    table = torch.randn(3, 4, dtype=dtype, device=device)
    rows = torch.tensor([0, 1, 2], dtype=rows_dtype, device=device)
    offsets = torch.tensor([0, 2], dtype=offsets_dtype, device=device)
    for weight in (table[:, :3], torch.randn(4, 3, dtype=dtype, device=device).t()):
        assert not weight.is_contiguous()
        for mode in ("sum", "mean", "max"):
            got = ops.embedding_bag(weight, rows, offsets, mode=mode, include_last_offset=False)
            want = ops.embedding_bag(weight.contiguous(), rows, offsets, mode=mode, include_last_offset=False)
            assert torch.equal(got, want)


@pytest.mark.parametrize("bag_use_grad,per_sample_weights_use_grad", list(itertools.product([True, False], repeat=2)))
def test_per_sample_weights_grad(device, bag_use_grad, per_sample_weights_use_grad):
    """test_embedding_bag_per_sample_weights_grad: softmax-ed per_sample_weights, the table and
    the weights each requiring grad or not; the output requires grad when either does and its
    backward fills exactly those."""
    weight = torch.rand(256, 256, device=device, requires_grad=bag_use_grad)
    rows = torch.arange(1, 5, device=device).expand(3, -1)
    scores = torch.rand(3, 4, device=device, requires_grad=per_sample_weights_use_grad)
    out = ops.embedding_bag(weight, rows.reshape(-1), torch.tensor([0, 4, 8, 12], device=device),
                            F.softmax(scores, dim=-1).reshape(-1))
    expected = F.embedding_bag(rows, weight.detach(), mode="sum", per_sample_weights=F.softmax(scores.detach(), -1))
    torch.testing.assert_close(out, expected)
    assert out.requires_grad == (bag_use_grad or per_sample_weights_use_grad)
    if out.requires_grad:
        out.sum().backward()
        assert (weight.grad is not None) == bag_use_grad
        assert (scores.grad is not None) == per_sample_weights_use_grad


# ---- OpInfo sample inputs ----


def _op_info(name):
    from torch.testing._internal.common_methods_invocations import op_db
    return next(op for op in op_db if op.name == name and op.variant_test_name == "")


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_opinfo_embedding_bag_samples(device, dtype):
    """OpInfo nn.functional.embedding_bag (sample_inputs_embedding_bag, as test_ops.py runs it):
    every sample without max_norm / scale_grad_by_freq (not offered), a 2-D input as CSR bags
    of its row length; forward, weight and per_sample_weights gradients against torch in
    float64."""
    samples = list(_op_info("nn.functional.embedding_bag").sample_inputs("cpu", dtype, requires_grad=True))
    checked = 0
    for sample in samples:
        kwargs = dict(sample.kwargs)
        if "max_norm" in kwargs or "scale_grad_by_freq" in kwargs:
            continue
        kwargs.pop("sparse", None)
        rows, psw = sample.args[0], kwargs.get("per_sample_weights")
        mode = kwargs.get("mode", "mean")
        reference_weight = sample.input.detach().double().clone().requires_grad_()
        reference_psw = None if psw is None else psw.detach().double().clone().requires_grad_()
        expected = F.embedding_bag(rows, reference_weight, **{**kwargs, "per_sample_weights": reference_psw})
        if rows.dim() == 2:
            offsets, include_last_offset = torch.arange(0, rows.numel() + 1, rows.shape[1]), True
        else:
            offsets, include_last_offset = kwargs["offsets"], kwargs.get("include_last_offset", False)
        weight = sample.input.detach().to(device).clone().requires_grad_()
        flat_psw = None if psw is None else psw.detach().reshape(-1).to(device).clone().requires_grad_()
        out = ops.embedding_bag(weight, rows.reshape(-1).to(device), offsets.to(device), flat_psw, mode=mode,
                                padding_idx=kwargs.get("padding_idx"), include_last_offset=include_last_offset)
        assert_close_to(out, expected, dtype)
        grad = torch.randn(expected.shape).to(dtype)
        out.backward(grad.to(device))
        wanted = torch.autograd.grad(expected, [reference_weight] + ([reference_psw] if psw is not None else []),
                                     grad.double())
        assert_close_to(weight.grad, wanted[0], dtype)
        if psw is not None:
            assert_close_to(flat_psw.grad.reshape(psw.shape), wanted[1], dtype)
        checked += 1
    assert checked >= 30


# ---- nn.Embedding (embedding_gather) ----


def test_embedding_sparse_basic(device):
    """TestEmbeddingNN.test_embedding_sparse_basic: a 2-D lookup's weight gradient is sparse with
    the weight's shape."""
    weight = torch.randn(10, 20, device=device, requires_grad=True)
    rows = torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]], device=device)
    out = ops.embedding_gather(weight, rows)
    assert out.shape == (2, 4, 20)
    torch.testing.assert_close(out, F.embedding(rows, weight.detach()))
    out.sum().backward()
    assert weight.grad.is_sparse and weight.grad.shape == weight.shape


def test_embedding_sparse_empty_tensor(device):
    """TestEmbeddingNN.test_embedding_sparse_empty_tensor: a 0 x 0 table with no lookups, and a
    zero-width table, give a sparse gradient of the weight's shape."""
    weight = torch.randn(0, 0, device=device, requires_grad=True)
    ops.embedding_gather(weight, torch.tensor([], dtype=torch.int64, device=device)).sum().backward()
    assert weight.grad.is_sparse and weight.grad.shape == weight.shape
    weight = torch.randn(10, 0, device=device, requires_grad=True)
    out = ops.embedding_gather(weight, torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]], device=device))
    assert out.shape == (2, 4, 0)
    out.sum().backward()
    assert weight.grad.is_sparse and weight.grad.shape == weight.shape


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_embedding_backward(device, dtype):
    """TestEmbeddingNNDeviceType.test_embedding_backward: the sparse gradient of one lookup of
    rows [7, 1, 3] holds those rows with ones (sparsekit's is aggregated: one entry per row,
    ascending on the CPU), and accumulates over backward calls, including after the rows
    change (not float16 on the CPU, where torch cannot add two sparse tensors)."""
    weight = torch.randn(10, 3, device=device, dtype=dtype, requires_grad=True)
    rows = torch.tensor([7, 1, 3], device=device)
    ops.embedding_gather(weight, rows).sum().backward()
    grad = weight.grad.coalesce()
    assert grad.indices().tolist() == [[1, 3, 7]]
    assert torch.equal(grad.values(), torch.ones(3, 3, dtype=dtype, device=device))
    if dtype == torch.float16 and device.type == "cpu":
        return  # torch has no sparse + sparse for float16 on the CPU (nn.Embedding(sparse=True) neither)
    ops.embedding_gather(weight, rows).sum().backward()
    ops.embedding_gather(weight, torch.tensor([8, 1, 3], device=device)).sum().backward()
    expected = torch.zeros(10, 3, dtype=dtype)
    expected[[1, 3]] = 3
    expected[7] = 2
    expected[8] = 1
    assert torch.equal(weight.grad.to_dense().cpu(), expected)


def test_embedding_dense_grad(device):
    """TestEmbeddingNNDeviceType.test_embedding_dense_grad: gradcheck and gradgradcheck of a 2-D
    lookup in float64 (the sparse gradient densified for the checkers); a 12 x 3 table
    instead of torch's 20 x 20 keeps the numerical Jacobians small."""

    weight = torch.randn(12, 3, dtype=torch.float64, device=device, requires_grad=True)
    rows = torch.tensor([[0, 1, 1, 2], [3, 5, 7, 11]], device=device)
    assert torch.autograd.gradcheck(lambda w: ops.embedding_gather(Densify.apply(w), rows), (weight,))
    assert torch.autograd.gradgradcheck(lambda w: ops.embedding_gather(Densify.apply(w), rows), (weight,))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_opinfo_embedding_samples(device, dtype):
    """OpInfo nn.functional.embedding (sample_inputs_embedding): the samples without padding_idx,
    max_norm or scale_grad_by_freq (embedding_gather has none of them), forward and weight
    gradient against F.embedding."""
    checked = 0
    for sample in _op_info("nn.functional.embedding").sample_inputs("cpu", dtype, requires_grad=True):
        if any(key in sample.kwargs for key in ("padding_idx", "max_norm", "scale_grad_by_freq")):
            continue
        rows = sample.args[0]
        reference_weight = sample.input.detach().double().clone().requires_grad_()
        expected = F.embedding(rows, reference_weight)
        weight = sample.input.detach().to(device).clone().requires_grad_()
        out = ops.embedding_gather(weight, rows.to(device))
        assert out.shape == expected.shape
        assert_close_to(out, expected, dtype)
        grad = torch.randn(expected.shape).to(dtype)
        out.backward(grad.to(device))
        expected.backward(grad.double())
        assert_close_to(weight.grad, reference_weight.grad, dtype)
        checked += 1
    assert checked >= 3


# ---- torch.unique ----


def first_occurrence(values):
    seen = {}
    for value in values:
        seen.setdefault(value, len(seen))
    return list(seen)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_unique_with_expects(device, dtype):
    """test_sort_and_select.py test_unique (_test_unique_with_expects): contiguous and sliced keys,
    every return_inverse / return_counts combination (the tuple's length and order), a higher
    rank view; torch's sorted answer is sparsekit's up to order (first occurrence here)."""
    keys = torch.tensor([1, 2, 3, 2, 8, 5, 2, 3], dtype=dtype, device=device)
    sliced = torch.empty(16, dtype=dtype, device=device)[::2].copy_(keys)
    expected_unique = torch.tensor([1, 2, 3, 8, 5], dtype=dtype)
    expected_inverse = torch.tensor([0, 1, 2, 1, 3, 4, 1, 2])
    expected_counts = torch.tensor([1, 3, 2, 1, 1])
    for x in (keys, sliced):
        for return_inverse, return_counts in itertools.product([True, False], repeat=2):
            result = ops.unique(x, return_inverse=return_inverse, return_counts=return_counts)
            result = (result,) if isinstance(result, torch.Tensor) else result
            assert len(result) == 1 + return_inverse + return_counts
            assert torch.equal(result[0].cpu(), expected_unique)
            if return_inverse:
                assert torch.equal(result[1].cpu(), expected_inverse)
            if return_counts:
                assert torch.equal(result[-1].cpu(), expected_counts)
        unique, inverse, counts = ops.unique(x.view(2, 2, 2), return_inverse=True, return_counts=True)
        assert torch.equal(unique.cpu(), expected_unique)
        assert torch.equal(inverse.cpu(), expected_inverse.view(2, 2, 2))
        assert torch.equal(counts.cpu(), expected_counts)
        sorted_unique, sorted_inverse, sorted_counts = torch.unique(x, return_inverse=True, return_counts=True)
        assert sorted(unique.tolist()) == sorted_unique.tolist()
        assert torch.equal(unique[inverse.view(-1)], sorted_unique[sorted_inverse])
        assert dict(zip(unique.tolist(), counts.tolist())) == dict(zip(sorted_unique.tolist(), sorted_counts.tolist()))


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_unique_scalar_and_empty(device, dtype):
    """_test_unique_scalar_empty: a 0-d key gives [key], a 0-d inverse and [1]; a (0, 0, 3) tensor
    gives empty unique keys and counts and an inverse of its shape."""
    unique, inverse, counts = ops.unique(torch.tensor(0, dtype=dtype, device=device), return_inverse=True,
                                         return_counts=True)
    assert unique.dtype == dtype and unique.tolist() == [0]
    assert inverse.shape == () and inverse.dtype == torch.int64 and inverse.item() == 0
    assert counts.tolist() == [1] and counts.dtype == torch.int64
    unique, inverse, counts = ops.unique(torch.zeros((0, 0, 3), dtype=dtype, device=device), return_inverse=True,
                                         return_counts=True)
    assert unique.shape == (0,) and unique.dtype == dtype
    assert inverse.shape == (0, 0, 3) and inverse.dtype == torch.int64
    assert counts.shape == (0,) and counts.dtype == torch.int64


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_opinfo_unique_samples(device, dtype):
    """OpInfo unique (sample_inputs_unique): every sample of the flattened form (dim=None; the
    per-slice dim form is not offered), against torch.unique: the same set of keys (in order
    of first occurrence), the inverse mapping back to the keys, the same counts."""
    checked = 0
    for sample in _op_info("unique").sample_inputs("cpu", dtype):
        if sample.kwargs.get("dim") is not None:
            continue
        keys = sample.input.to(device)
        unique, inverse, counts = ops.unique(keys, return_inverse=True, return_counts=True)
        torch_unique, torch_counts = torch.unique(sample.input, return_counts=True)
        assert unique.tolist() == first_occurrence(sample.input.reshape(-1).tolist())
        assert inverse.shape == keys.shape
        assert torch.equal(unique[inverse], keys)
        assert dict(zip(unique.tolist(), counts.tolist())) == dict(zip(torch_unique.tolist(), torch_counts.tolist()))
        checked += 1
    assert checked >= 50


def test_unique_refuses_non_key_dtypes(device):
    """test_unique runs every dtype; sparsekit's keys are int64 / int32 only, and any other dtype
    is refused naming keys (docs/api.md)."""
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.float32):
        with pytest.raises(RuntimeError, match="unique: keys must be an int64 or int32"):
            ops.unique(torch.tensor([1, 0], device=device).to(dtype))


# ---- index_add_ / scatter_add_ / scatter_reduce_ (segment_sum, segment_mean) ----


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("ids_dtype", INDEX_DTYPES)
def test_segment_sum_index_add_identity(device, dtype, ids_dtype):
    """test_torch.py test_index_add's help(): adding [N, ...] rows at arange(N) into zeros gives the
    rows back (and their negation with alpha=-1), N <= 16 and > 16, 1-D to 4-D, a transposed
    (non-contiguous) source and non-contiguous ids."""
    for size in ([16], [16, 16], [16, 16, 16], [32], [32, 32], [32, 32, 32], [33, 5, 2, 3]):
        data = torch.randn(size, device=device).to(dtype)
        ids = torch.arange(size[0], dtype=ids_dtype, device=device)
        assert torch.equal(ops.segment_sum(data, ids, size[0]), data)
        assert torch.equal(ops.segment_sum(-data, ids, size[0]), -data)
        assert torch.equal(ops.segment_mean(data, ids, size[0]), data)
        strided_ids = torch.arange(2 * size[0], dtype=ids_dtype, device=device)[::2] // 2
        assert torch.equal(ops.segment_sum(data, strided_ids, size[0]), data)
        if len(size) > 1:
            transposed = data.transpose(0, 1).contiguous().transpose(0, 1)
            assert torch.equal(ops.segment_sum(transposed, ids, size[0]), data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_sum_matches_index_add_scatter_add_and_scatter_reduce_mean(device, dtype):
    """test_scatter_gather_ops.py (scatter_add_, scatter_reduce_ "mean" with include_self=False):
    random ids with negative (dropped) ones, against index_add_ and scatter_add_ bit for bit
    (float32 equals a one-thread index_add_, docs/design.md) and scatter_reduce_'s mean."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(1000, 7, generator=gen).to(dtype)
    ids = torch.randint(-3, 50, (1000,), generator=gen)
    kept = ids >= 0
    by_index_add = torch.zeros(50, 7, dtype=dtype).index_add_(0, ids[kept], data[kept])
    by_scatter_add = torch.zeros(50, 7, dtype=dtype).scatter_add_(0, ids[kept, None].expand(-1, 7), data[kept])
    by_scatter_mean = torch.zeros(50, 7, dtype=dtype).scatter_reduce_(0, ids[kept, None].expand(-1, 7), data[kept],
                                                                      "mean", include_self=False)
    got = ops.segment_sum(data.to(device), ids.to(device), 50).cpu()
    if device.type == "cpu":
        assert torch.equal(got, by_index_add) and torch.equal(got, by_scatter_add)
    else:
        torch.testing.assert_close(got, by_index_add)
    torch.testing.assert_close(ops.segment_mean(data.to(device), ids.to(device), 50).cpu(), by_scatter_mean)

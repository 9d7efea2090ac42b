"""The training harness's pairwise interaction on the CPU (``sparsekit::_pair_dots`` and its
backward, csrc/cpu/interaction_cpu.cpp): against plain-torch references in float64, across
batches that cross the kernels' sample blocks (16, 8 or 4 samples by instruction set and
dtype, see test_cpu_capability.py for the lower ones) and parallel grains, vector counts and
widths that cross the 4-pair and 8-column groups and the transposes' whole squares, strided
inputs and thread counts; their errors; and the model's use of them."""

import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekit.train.model import _PairDots

from properties import examples, num_threads

_ops = torch.ops.sparsekit


def reference_dots(vectors: torch.Tensor) -> torch.Tensor:
    n = vectors.shape[1]
    i, j = torch.triu_indices(n, n, offset=1)
    wide = vectors.double()
    return (wide[:, i] * wide[:, j]).sum(-1)


def reference_backward(grad: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    n = vectors.shape[1]
    i, j = torch.triu_indices(n, n, offset=1)
    full = grad.new_zeros(grad.shape[0], n, n, dtype=torch.float64)
    full[:, i, j] = grad.double()
    full[:, j, i] = grad.double()
    return torch.bmm(full, vectors.double())


def magnitude(tensor: torch.Tensor) -> float:
    return max(1.0, float(tensor.abs().max())) if tensor.numel() else 1.0


def tolerance(dtype: torch.dtype, terms: int) -> dict:
    eps = torch.finfo(dtype).eps
    return {"rtol": 0, "atol": 4 * eps * max(terms, 1)}


@examples(40)
@given(batch=st.one_of(st.sampled_from([0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 33, 64, 255, 257]),
                       st.integers(0, 300)),
       n=st.one_of(st.sampled_from([0, 1, 2, 3, 5, 17, 27, 28]), st.integers(0, 40)),
       dim=st.one_of(st.sampled_from([0, 1, 4, 7, 8, 9, 16, 17, 33]), st.integers(0, 40)),
       dtype=st.sampled_from([torch.float32, torch.float64]), strided=st.booleans(),
       threads=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pair_dots_and_backward_match_plain_torch(batch, n, dim, dtype, strided, threads, seed):
    g = torch.Generator().manual_seed(seed)
    pairs = n * (n - 1) // 2
    if strided:  # vectors a transposed view, grad a column slice of a wider tensor
        vectors = torch.randn(batch, dim, n, generator=g, dtype=dtype).transpose(1, 2)
        grad = torch.randn(batch, pairs + 5, generator=g, dtype=dtype)[:, 2:pairs + 2]
    else:
        vectors = torch.randn(batch, n, dim, generator=g, dtype=dtype)
        grad = torch.randn(batch, pairs, generator=g, dtype=dtype)
    with num_threads(threads):
        dots = _ops._pair_dots(vectors)
        grad_vectors = _ops._pair_dots_backward(grad, vectors)
    assert dots.shape == (batch, pairs) and dots.dtype == dtype
    assert grad_vectors.shape == (batch, n, dim) and grad_vectors.dtype == dtype
    scale = magnitude(vectors) ** 2
    torch.testing.assert_close(dots.double(), reference_dots(vectors), **tolerance(dtype, int(dim * scale)))
    scale = magnitude(vectors) * magnitude(grad)
    torch.testing.assert_close(grad_vectors.double(), reference_backward(grad, vectors),
                               **tolerance(dtype, int(n * scale)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_dots_do_not_depend_on_the_thread_count(dtype):
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(1027, 27, 16, generator=g, dtype=dtype)
    grad = torch.randn(1027, 351, generator=g, dtype=dtype)
    results = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            results.append((_ops._pair_dots(vectors), _ops._pair_dots_backward(grad, vectors)))
    for dots, grads in results[1:]:
        assert torch.equal(dots, results[0][0]) and torch.equal(grads, results[0][1])


def test_pair_dots_of_one_sample_by_hand():
    vectors = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    assert _ops._pair_dots(vectors).tolist() == [[11.0, 17.0, 39.0]]
    grad = torch.tensor([[1.0, 10.0, 100.0]])
    # dV[0] = 1 V[1] + 10 V[2]; dV[1] = 1 V[0] + 100 V[2]; dV[2] = 10 V[0] + 100 V[1]
    assert _ops._pair_dots_backward(grad, vectors).tolist() == [[[53.0, 64.0], [501.0, 602.0], [310.0, 420.0]]]


@pytest.mark.parametrize("call,message", [
    (lambda: _ops._pair_dots(torch.ones(2, 3)), r"_pair_dots: vectors must be 3-D \[batch, n, dim\], got shape"),
    (lambda: _ops._pair_dots(torch.ones(2, 3, 4, dtype=torch.float16)),
     "_pair_dots: vectors must be float32 or float64, got Half"),
    (lambda: _ops._pair_dots(torch.ones(2, 3, 4, dtype=torch.int64)),
     "_pair_dots: vectors must be float32 or float64, got Long"),
    (lambda: _ops._pair_dots_backward(torch.ones(2, 4), torch.ones(2, 3, 4)),
     r"_pair_dots_backward: grad must be \[batch, n \* \(n - 1\) / 2\] = \[2, 3\]"),
    (lambda: _ops._pair_dots_backward(torch.ones(3, 3), torch.ones(2, 3, 4)),
     r"_pair_dots_backward: grad must be \[batch, n \* \(n - 1\) / 2\] = \[2, 3\]"),
    (lambda: _ops._pair_dots_backward(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, 4)),
     r"_pair_dots_backward: grad must have the dtype of vectors \(Float\), got Double"),
    (lambda: _ops._pair_dots_backward(torch.ones(2, 3), torch.ones(2, 3)),
     r"_pair_dots_backward: vectors must be 3-D"),
])
def test_pair_dots_refuse_bad_arguments_naming_them(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels read the memory with sysinfo")
def test_pair_dots_refuse_outputs_and_scratch_larger_than_the_machine():
    """The pairs' count comes from n alone, so zero-size vectors can ask for terabytes: the
    output, and the per-task scratch of a block's lanes (16x one sample's pairs with
    AVX-512), are checked against the machine's memory and swap before anything is
    allocated (where Linux overcommits, the first write would get the process killed)."""
    import sparsekit._C
    from sparsekit._checks import HOST_MEMORY_BYTES

    limit = HOST_MEMORY_BYTES
    vector_bytes = {"avx512": 64, "avx2": 32}.get(sparsekit._C.cpu_features().split()[0], 16)

    def vectors_for(pairs, batch):
        n = math.ceil((1 + math.sqrt(1 + 8 * pairs)) / 2)
        return torch.empty(batch, n, 0)

    # One sample: its output (4 bytes a pair) fits, a block's scratch (a lane each) does not.
    with pytest.raises(RuntimeError, match=r"^_pair_dots: the scratch of its sample blocks \(n = \d+, dim = 0\) "
                                           r"cannot be allocated \(\d+ bytes .*more than this machine's"):
        _ops._pair_dots(vectors_for(2 * limit // vector_bytes, 1))
    # A million samples: the output does not fit, each task's scratch does.
    with num_threads(4), pytest.raises(RuntimeError, match=r"^_pair_dots: the output \(\[1000000, n \* \(n - 1\) / 2 "
                                                           r"= \d+\]\) cannot be allocated \(\d+ bytes .*more than"):
        _ops._pair_dots(vectors_for(limit // 1_000_000 + 1, 1_000_000))


def test_pair_dots_pass_opcheck():
    g = torch.Generator().manual_seed(1)
    vectors = torch.randn(19, 6, 5, generator=g)
    grad = torch.randn(19, 15, generator=g)
    torch.library.opcheck(_ops._pair_dots.default, (vectors,))
    torch.library.opcheck(_ops._pair_dots_backward.default, (grad, vectors))


def _indices(n):
    pairs = torch.triu_indices(n, n, offset=1)
    return (pairs[0] * n + pairs[1]).unsqueeze(0), (pairs[1] * n + pairs[0]).unsqueeze(0)


def test_the_models_interaction_uses_the_kernels_on_the_cpu_and_twice_differentiates():
    """_PairDots takes the kernels for float32 / float64 CPU vectors (gradcheck in float64),
    and torch's ops for a backward under create_graph (gradgradcheck), for float16 and off
    the CPU."""
    upper, lower = _indices(5)
    vectors = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: _PairDots.apply(v, upper, lower), (vectors,))
    assert torch.autograd.gradgradcheck(lambda v: _PairDots.apply(v, upper, lower), (vectors,))
    half = torch.randn(3, 5, 4).to(torch.bfloat16).requires_grad_()
    out = _PairDots.apply(half, upper, lower)
    torch.testing.assert_close(out.double(), reference_dots(half.detach()), rtol=2e-2, atol=2e-2)
    out.sum().backward()
    assert half.grad.shape == half.shape

"""unique_bounded (CPU kernel; on CUDA the composite of sparsekit/tables_cuda.py): the sorted unique of keys in [-1, bound) that numbers the rows of
embedding gradients, against torch.unique; and the row gradients built on it, against a
dense reference, on both of its paths (bitmap, and hash + sort for a table far larger than
its lookups).

Thresholds crossed (keep in step with csrc/cpu/unique_bounded_cpu.cpp): key pieces of
2^15 (several workers, and as many parts of the counting sort), word blocks of 2^12 words
(bounds past 2^18 bits) and blocks of 2^12 distinct keys in the offsets, the word boundary
at multiples of 64, -1 at bit 0; and _BOUNDED_UNIQUE_BITS_PER_KEY in ops.py.

Tests of the op itself take the `device` fixture; those marked "CPU only" are about the CPU
kernel's threads, the fake (opcheck) or the CPU's row gradients.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekit import ops
from properties import BOUNDED_KINDS, bounded_keys, examples, num_threads, sizes, thread_counts

unique_bounded = torch.ops.sparsekit.unique_bounded
BOUNDS = [0, 1, 63, 64, 65, 4096 * 64 - 1, 4096 * 64, 4096 * 64 + 1, 1_000_003]


def check(keys: torch.Tensor, bound: int, group: bool = True) -> None:
    got = unique_bounded(keys, bound, group)
    assert all(t.device == keys.device for t in got)
    got_keys, got_inverse, got_offsets, got_order = (t.cpu() for t in got)
    keys = keys.cpu()
    want_keys, want_inverse, want_counts = torch.unique(keys.reshape(-1), sorted=True, return_inverse=True,
                                                        return_counts=True)
    assert got_keys.dtype == keys.dtype and torch.equal(got_keys, want_keys)
    assert got_inverse.dtype == torch.int64 and got_inverse.shape == keys.shape
    assert torch.equal(got_inverse.reshape(-1), want_inverse)
    if group:
        # offsets: CSR bounds of each key's positions; order: positions by key, stably
        assert torch.equal(got_offsets, torch.cat([torch.zeros(1, dtype=torch.int64), want_counts.cumsum(0)]))
        assert torch.equal(got_order, torch.sort(want_inverse, stable=True).indices)
    else:
        assert got_offsets.numel() == 0 and got_order.numel() == 0


@examples(20)
@given(n=sizes(300_000), bound=st.one_of(st.sampled_from(BOUNDS), st.integers(0, 2_000_000)),
       kind=st.sampled_from(BOUNDED_KINDS),
       dtype=st.sampled_from([torch.int64, torch.int32]), group=st.booleans(), threads=thread_counts,
       seed=st.integers(0, 2**31 - 1))
def test_unique_bounded_matches_torch(n, bound, kind, dtype, group, threads, seed, device):
    keys = bounded_keys(n, bound, kind, torch.Generator().manual_seed(seed))
    with num_threads(threads):
        check(keys.to(dtype).to(device), bound, group)


# CPU only: the CPU kernel's thread counts.
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_unique_bounded_same_result_for_every_thread_count(threads):
    keys = torch.randint(-1, 300_000, (200_001,), generator=torch.Generator().manual_seed(3))
    with num_threads(1):
        expected = unique_bounded(keys, 300_000, True)
    with num_threads(threads):
        got = unique_bounded(keys, 300_000, True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_unique_bounded_shapes_and_noncontiguous(device):
    keys = torch.randint(-1, 50, (30, 7), generator=torch.Generator().manual_seed(1)).to(device).t()
    check(keys, 50)
    check(keys, 50, group=False)
    check(torch.empty(0, dtype=torch.int64, device=device), 10)
    check(torch.empty(0, dtype=torch.int32, device=device), 0, group=False)


@pytest.mark.parametrize("bad", [-2, 10, 2**40, -(2**63)])
@pytest.mark.parametrize("position", [0, 70_000, 199_999])
def test_unique_bounded_rejects_keys_out_of_range(bad, position, device):
    keys = torch.randint(-1, 10, (200_000,))
    keys[position] = bad
    keys = keys.to(device)
    with pytest.raises(RuntimeError, match=rf"keys must lie in \[-1, bound\) = \[-1, 10\), got {bad} at position "
                                           rf"{position}"):
        unique_bounded(keys, 10)


@pytest.mark.parametrize("bound", [-1, 2**40])
def test_unique_bounded_rejects_bad_bound(bound, device):
    with pytest.raises(RuntimeError, match="bound must lie in"):
        unique_bounded(torch.zeros(3, dtype=torch.int64, device=device), bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool])
def test_unique_bounded_rejects_non_key_dtypes(dtype, device):
    with pytest.raises(RuntimeError, match="keys must be an int64 or int32 tensor"):
        unique_bounded(torch.zeros(3, dtype=dtype, device=device), 5)


# CPU only: the fake accepts CPU (and meta) keys, as the op's other callers do.
def test_unique_bounded_opcheck():
    keys = torch.randint(-1, 100, (1000,))
    torch.library.opcheck(unique_bounded, (keys, 100, True))
    torch.library.opcheck(unique_bounded, (keys, 100, False))
    torch.library.opcheck(unique_bounded, (keys[:0], 100, True))


def dense_row_gradient(num_rows, dim, rows, offsets, grad_out, psw):
    bag = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff(), output_size=rows.numel())
    valid = rows >= 0
    scale = torch.ones(rows.numel(), dtype=torch.float64) if psw is None else psw.double()
    contributions = grad_out.double()[bag] * torch.where(valid, scale, 0.0)[:, None]
    return torch.zeros(num_rows, dim, dtype=torch.float64).index_add(0, rows.clamp(min=0), contributions)


# CPU only below: the CPU's coalesced row gradients (on CUDA rows come in order of first occurrence).
@pytest.mark.parametrize("dim", [4, 16, 17, 64])
@pytest.mark.parametrize("num_rows, nnz", [(1_000, 5_000), (400_000, 2_000), (400_000, 0), (70_000, 3)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_row_gradient_is_coalesced_on_both_paths(dim, num_rows, nnz, weighted, threads):
    # (400_000, 2_000) and (70_000, 3): a table past 128 bits of bitmap per lookup (+ 2^16),
    # numbered by the hash-based unique and a sort; the others by the bitmap.
    g = torch.Generator().manual_seed(dim + nnz)
    rows = torch.randint(-1, num_rows, (nnz,), generator=g)
    rows[: nnz // 3] = rows[nnz // 3: 2 * (nnz // 3)]  # repeats
    bags = max(1, nnz // 4)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(0, nnz + 1, (bags - 1,), generator=g)
                         .sort().values, torch.tensor([nnz])])
    psw = torch.rand(nnz, generator=g) if weighted else None
    weight = torch.zeros(num_rows, dim, requires_grad=True)
    grad_out = torch.randn(bags, dim, generator=g)
    with num_threads(threads):
        (grad,) = torch.autograd.grad(ops.embedding_bag(weight, rows, offsets, psw), weight, grad_out)
    indices = grad._indices()[0]
    assert grad.is_coalesced()
    assert indices.tolist() == sorted(set(rows[rows >= 0].tolist()))
    expected = dense_row_gradient(num_rows, dim, rows, offsets, grad_out, psw)
    torch.testing.assert_close(grad._values().double(), expected[indices], rtol=1e-5, atol=1e-5)


def test_embedding_gather_gradient_on_a_large_table():
    num_rows = 500_000
    rows = torch.tensor([[7, -1, 499_999], [7, 0, -1]])
    weight = torch.zeros(num_rows, 3, requires_grad=True)
    grad_out = torch.arange(18, dtype=torch.float32).reshape(2, 3, 3)
    (grad,) = torch.autograd.grad(ops.embedding_gather(weight, rows), weight, grad_out)
    assert grad.is_coalesced() and grad._indices()[0].tolist() == [0, 7, 499_999]
    expected = torch.stack([grad_out[1, 1], grad_out[0, 0] + grad_out[1, 0], grad_out[0, 2]])
    torch.testing.assert_close(grad._values(), expected)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads /proc")
def test_a_key_out_of_range_does_not_keep_the_bitmaps():
    """The bitmaps of a large bound (here 3 x 256 MiB) are freed after the call, also when a
    key out of range raises after they were written."""
    with num_threads(1):
        before = _resident_bytes()
        with pytest.raises(RuntimeError, match="keys must lie in"):
            torch.ops.sparsekit.unique_bounded(torch.tensor([1, -5]), 2**31, False)
        assert _resident_bytes() - before < 64 << 20

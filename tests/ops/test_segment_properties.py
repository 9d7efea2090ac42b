"""Property-based tests of segment_sum / segment_mean against plain-torch references.

Thresholds crossed (csrc/cpu/segment_cpu.cpp, csrc/cuda/segment_cuda.cu):
- CPU: one thread below N * D = 2^15; rows listed in blocks of 2048 positions; segment
  ranges cut at quantiles of a sample taken every N / 4096 ids; column blocks of 16 lanes
  when there are fewer segment ranges than threads (few segments, wide rows).
- CUDA: 64-row tiles and fan-in 32 (spans 64, 2048, 65536) in deterministic mode; runs of
  up to 16 rows per thread (N * D / 2^18) on the atomic path; 16-byte packs when D allows.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples, num_threads, sizes, thread_counts

import sparsekit as sk

DATA_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ID_DISTRIBUTIONS = ["uniform", "zipf", "sorted", "one_segment", "mostly_padding", "runs"]
# Trailing shapes: narrow rows, the 16-lane edges, the widths the CPU sums with a
# compile-time row width (16, 32, 64 and 128 float32), and 2-D trailing dims.
TRAILING_SHAPES = [(), (0,), (1,), (3,), (15,), (16,), (17,), (32,), (33,), (64,), (128,), (2, 8), (3, 0, 2)]
# Rows x columns per example, so that large N comes with narrow rows (runtime).
MAX_ELEMENTS = 1 << 21


def make_ids(n: int, num_segments: int, distribution: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[n] segment ids in [-3, num_segments) (negative: padding, dropped)."""
    g = torch.Generator().manual_seed(seed)
    if num_segments == 0:
        return torch.randint(-3, 0, (n,), generator=g).to(dtype)
    if distribution == "uniform":
        ids = torch.randint(0, num_segments, (n,), generator=g)
    elif distribution == "zipf":
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
        ids = (torch.floor(u.pow(-1 / 0.3)) - 1).clamp_max(num_segments - 1).to(torch.int64)
    elif distribution == "sorted":
        ids = torch.sort(torch.randint(0, num_segments, (n,), generator=g)).values
    elif distribution == "one_segment":
        ids = torch.full((n,), int(torch.randint(0, num_segments, (1,), generator=g)), dtype=torch.int64)
    elif distribution == "mostly_padding":
        ids = torch.randint(0, num_segments, (n,), generator=g)
        ids[torch.rand(n, generator=g) < 0.9] = -1
    elif distribution == "runs":
        # Pooling bags: runs of equal ids of random lengths, in order.
        ids = torch.sort(torch.randint(0, num_segments, (max(1, n // 7 + 1),), generator=g)).values
        ids = ids.repeat_interleave(7)[:n]
    else:
        raise ValueError(distribution)
    # A sprinkle of padding ids of every negative flavour.
    drop = torch.rand(n, generator=g) < 0.05
    ids[drop] = torch.randint(-3, 0, (int(drop.sum()),), generator=g)
    return ids.to(dtype)


def make_data(n: int, trailing: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn((n,) + trailing, generator=g, dtype=torch.float64).to(dtype)


def reference_sum(data: torch.Tensor, ids: torch.Tensor, num_segments: int, dtype: torch.dtype) -> torch.Tensor:
    """index_add_ over the rows with a valid id, in `dtype`."""
    ids = ids.long()
    valid = ids >= 0
    out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=dtype)
    return out.index_add_(0, ids[valid], data[valid].to(dtype))


def reference_position_order(data: torch.Tensor, ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """What the CPU kernel computes: each segment summed in position order in the
    accumulator type (float32 for half types), rounded once. On one thread index_add_
    adds the rows in position order, one rounding per add."""
    acc = torch.float64 if data.dtype == torch.float64 else torch.float32
    with num_threads(1):
        return reference_sum(data, ids, num_segments, acc).to(data.dtype)


def tolerance(dtype: torch.dtype, ids: torch.Tensor) -> dict:
    """Summation error of the largest segment (m rows of N(0, 1) terms: ~eps * m), plus
    the final rounding to dtype."""
    eps = {torch.float64: 2**-52, torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    acc_eps = min(eps, 2**-23)
    valid = ids[ids >= 0].long()
    m = int(torch.bincount(valid).max()) if valid.numel() else 0
    return dict(rtol=2 * eps, atol=2 * eps + 4 * acc_eps * max(1, m))


@st.composite
def segment_problems(draw, max_size: int = 1_000_000):
    n = draw(sizes(max_size))
    trailing = draw(st.sampled_from(TRAILING_SHAPES))
    width = 1
    for d in trailing:
        width *= d
    if n * width > MAX_ELEMENTS:
        trailing = (MAX_ELEMENTS // n,) if MAX_ELEMENTS // n > 1 else ()
    num_segments = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 2047, 2048, 2049]),
                                  st.integers(1, max(1, 2 * n))))
    distribution = draw(st.sampled_from(ID_DISTRIBUTIONS))
    id_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    dtype = draw(st.sampled_from(DATA_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    data = make_data(n, trailing, dtype, seed)
    ids = make_ids(n, num_segments, distribution, seed, id_dtype)
    return data, ids, num_segments


@examples(30)
@given(problem=segment_problems(), threads=thread_counts, deterministic=st.booleans())
def test_segment_sum_property_matches_index_add(device, problem, threads, deterministic):
    """segment_sum == index_add_ of the valid rows (float64 reference within rounding);
    on the CPU bit for bit the position-order sum, and bit-identical on 1..4 threads."""
    data, ids, num_segments = problem
    with num_threads(threads):
        got = sk.ops.segment_sum(data.to(device), ids.to(device), num_segments, deterministic=deterministic)
    assert got.dtype == data.dtype and got.shape == (num_segments,) + tuple(data.shape[1:])
    want = reference_sum(data, ids, num_segments, torch.float64)
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(data.dtype, ids))
    if device.type == "cpu":
        assert torch.equal(got, reference_position_order(data, ids, num_segments))
        with num_threads(1):
            one = sk.ops.segment_sum(data, ids, num_segments, deterministic=not deterministic)
        assert torch.equal(got, one)
    else:
        cpu = sk.ops.segment_sum(data, ids, num_segments)
        torch.testing.assert_close(got.cpu().double(), cpu.double(), **tolerance(data.dtype, ids))


@examples(6)
@given(problem=segment_problems(max_size=300_000), threads=thread_counts)
def test_segment_sum_property_thread_invariant(problem, threads):
    """CPU: deterministic=True and the default give the same bits on 1, 2, 3 and 4 threads."""
    data, ids, num_segments = problem
    results = []
    for t in sorted({1, 2, threads, 4}):
        with num_threads(t):
            results.append(sk.ops.segment_sum(data, ids, num_segments))
            results.append(sk.ops.segment_sum(data, ids, num_segments, deterministic=True))
    for r in results[1:]:
        assert torch.equal(r, results[0])


@examples(5)
@given(problem=segment_problems(max_size=100_000))
def test_segment_sum_property_cuda_deterministic_run_to_run(device, problem):
    """CUDA deterministic=True: bit-identical run to run, close to the CPU kernel."""
    if device.type != "cuda":
        pytest.skip("CUDA deterministic path (the CPU kernel is covered by the thread test)")
    data, ids, num_segments = problem
    first = sk.ops.segment_sum(data.to(device), ids.to(device), num_segments, deterministic=True)
    for _ in range(2):
        again = sk.ops.segment_sum(data.to(device), ids.to(device), num_segments, deterministic=True)
        assert torch.equal(first, again)
    cpu = sk.ops.segment_sum(data, ids, num_segments)
    torch.testing.assert_close(first.cpu().double(), cpu.double(), **tolerance(data.dtype, ids))
    # Segments shorter than a 64-row tile are plain left-to-right sums: the CPU's bits.
    counts = torch.bincount(ids[ids >= 0].long(), minlength=num_segments)
    short = counts < 64
    assert torch.equal(first.cpu()[short], cpu[short])


@examples(15)
@given(problem=segment_problems(max_size=200_000), threads=thread_counts, deterministic=st.booleans())
def test_segment_mean_property(device, problem, threads, deterministic):
    """segment_mean == float64 sum / count (empty segments 0); half types within rounding."""
    data, ids, num_segments = problem
    with num_threads(threads):
        got = sk.ops.segment_mean(data.to(device), ids.to(device), num_segments, deterministic=deterministic)
    assert got.dtype == data.dtype and got.shape == (num_segments,) + tuple(data.shape[1:])
    total = reference_sum(data, ids, num_segments, torch.float64)
    valid = ids.long() >= 0
    counts = torch.bincount(ids.long()[valid], minlength=num_segments).to(torch.float64).clamp_min(1)
    want = total / counts.view((-1,) + (1,) * (data.dim() - 1))
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(data.dtype, ids))
    assert segment_mean_reduce_matches(data.to(device), ids.to(device), num_segments, got, deterministic)


def segment_mean_reduce_matches(data, ids, num_segments, got, deterministic) -> bool:
    again = sk.ops.segment_reduce(data, ids, num_segments, reduce="mean", deterministic=deterministic)
    if data.device.type == "cuda" and not deterministic:
        return torch.allclose(again.double(), got.double(), rtol=1e-2, atol=1e-2)
    return torch.equal(again, got)


@examples(15)
@given(n=sizes(50_000), num_segments=st.integers(1, 3000), trailing=st.sampled_from([(), (1,), (5,), (16,), (2, 3)]),
       distribution=st.sampled_from(ID_DISTRIBUTIONS), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]), mean=st.booleans())
def test_segment_gradient_property(device, n, num_segments, trailing, distribution, seed, dtype, mean):
    """d segment_sum / d data gathers grad_out[id] (zero for dropped rows); segment_mean
    divides it by the segment's count."""
    data = make_data(n, trailing, dtype, seed).to(device).requires_grad_()
    ids = make_ids(n, num_segments, distribution, seed, torch.int64)
    op = sk.ops.segment_mean if mean else sk.ops.segment_sum
    out = op(data, ids.to(device), num_segments)
    grad_out = make_data(num_segments, trailing, dtype, seed + 7).to(device)
    (grad,) = torch.autograd.grad(out, data, grad_out)
    valid = ids >= 0
    want = torch.zeros((n,) + trailing, dtype=dtype)
    scale = torch.ones(num_segments, dtype=dtype)
    if mean:
        scale = 1 / torch.bincount(ids[valid], minlength=num_segments).to(dtype).clamp_min(1)
    per_row = grad_out.cpu() * scale.view((-1,) + (1,) * len(trailing))
    want[valid] = per_row[ids[valid]]
    torch.testing.assert_close(grad.cpu(), want, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("dim", [1, 16, 33, 64, 128])
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_segment_sum_column_blocks_few_segments(device, dim, threads):
    """Fewer segments than threads: the CPU cuts columns into 16-lane blocks instead (64
    and 128 columns into blocks of 32 or 64 that it sums at a compile-time width, each a
    strided part of the rows)."""
    data = make_data(40_000, (dim,), torch.float32, dim)
    ids = make_ids(40_000, 1, "uniform", dim, torch.int64)
    with num_threads(threads):
        got = sk.ops.segment_sum(data.to(device), ids.to(device), 1)
    if device.type == "cpu":
        assert torch.equal(got, reference_position_order(data, ids, 1))
    # 40,000 float32 terms summed one after the other drift from the exact sum by ~1e-3
    # (sqrt(n) roundings of partial sums ~sqrt(n) large); the CPU's order is checked exactly above.
    torch.testing.assert_close(got.cpu().double(), reference_sum(data, ids, 1, torch.float64), rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("mean", [False, True])
def test_segment_gradient_no_segments_all_padding(device, mean):
    """Every id is padding and num_segments == 0: the output is [0, D] and the gradient of
    data is all zeros (regression: the backward index_selected row 0 of the empty gradient)."""
    data = torch.randn(3, 2, device=device, requires_grad=True)
    op = sk.ops.segment_mean if mean else sk.ops.segment_sum
    out = op(data, torch.tensor([-1, -2, -1], device=device), 0)
    assert out.shape == (0, 2)
    (grad,) = torch.autograd.grad(out.sum(), data)
    assert torch.equal(grad.cpu(), torch.zeros(3, 2))


def test_segment_mean_counts_past_2_pow_24():
    """One segment of 2^25 + 1 rows whose float32 sum is exact (alternating +-1, then one
    2^25): the mean is 2^25 / (2^25 + 1) ~ 1. Regression: the count was a float32 sum of
    ones, which stalls at 2^24 on the CPU (a left-to-right sum): the mean came out 2.0.
    Counts are exact int64 now."""
    device = torch.device("cpu")
    n = 1 << 25
    data = torch.ones(n + 1)
    data[1:n:2] = -1
    data[n] = float(n)
    ids = torch.zeros(n + 1, dtype=torch.int64)
    got = sk.ops.segment_mean(data.to(device), ids.to(device), 1, deterministic=True)
    torch.testing.assert_close(got.cpu(), torch.tensor([n / (n + 1)]), rtol=1e-6, atol=0)

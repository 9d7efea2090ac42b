"""Property-based tests of key_seeded_uniform: a pure function of (seed, key, column).

Thresholds crossed (csrc/cpu/initializer_cpu.cpp, csrc/cuda/initializer_cuda.cu): CPU
tasks of max(1, 4096 / dim) keys; CUDA grid capped at 65535 blocks of 256 (grid-stride
beyond 2^24 values); dim 0 and N 0 short-cuts; the overflow branch of the range (finite
bounds more than DBL_MAX apart).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import INT64_MAX, INT64_MIN, KEY_DISTRIBUTIONS, examples, make_keys, num_threads, sizes, \
    thread_counts

import sparsekit as sk

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DIMS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 8, 16, 17, 64, 128, 255, 256, 257, 300]), st.integers(0, 300))
BOUNDS = st.one_of(
    st.just((-0.05, 0.05)),
    st.tuples(st.floats(-1e3, 1e3), st.floats(0, 1e3)).map(lambda t: (t[0], t[0] + t[1])),
    st.sampled_from([(0.0, 0.0), (-1.0, -1.0), (1e-300, 2e-300), (-1e308, 1e308), (-1.7976931348623157e308,
                     1.7976931348623157e308), (0.0, 1.7976931348623157e308)]),
)
SEEDS = st.one_of(st.sampled_from([0, 1, -1, INT64_MIN, INT64_MAX]), st.integers(INT64_MIN, INT64_MAX))


def in_bounds(values: torch.Tensor, low: float, high: float) -> bool:
    """Within [low, high] as the dtype rounds them (rounding is monotonic)."""
    lo = torch.tensor(low, dtype=torch.float64).to(values.dtype)
    hi = torch.tensor(high, dtype=torch.float64).to(values.dtype)
    return bool(((values >= lo) & (values <= hi)).all())


@examples(30)
@given(n=sizes(200_000), dim=DIMS, distribution=st.sampled_from(KEY_DISTRIBUTIONS),
       key_dtype=st.sampled_from([torch.int64, torch.int32]), dtype=st.sampled_from(DTYPES), seed=SEEDS,
       bounds=BOUNDS, data_seed=st.integers(0, 2**31 - 1), threads=thread_counts)
def test_key_seeded_uniform_property(device, n, dim, distribution, key_dtype, dtype, seed, bounds, data_seed, threads):
    """Shape, dtype, finite values in [low, high]; a row depends only on (seed, key): the
    same key gives the same row at any position, in any batch, order and thread count; an
    int32 key gives the row of the equal int64 key; CUDA equals the CPU bit for bit."""
    n = min(n, max(1, 2_000_000 // max(dim, 1)))  # runtime: at most ~2M values
    low, high = bounds
    keys = make_keys(n, distribution, data_seed, key_dtype)
    if max(abs(low), abs(high)) > torch.finfo(dtype).max:
        # Bounds the dtype cannot hold would give inf values: refused.
        with pytest.raises(RuntimeError, match="low and high must lie in"):
            sk.ops.key_seeded_uniform(keys.to(device), dim, seed=seed, low=low, high=high, dtype=dtype)
        return
    with num_threads(threads):
        out = sk.ops.key_seeded_uniform(keys.to(device), dim, seed=seed, low=low, high=high, dtype=dtype)
    assert out.shape == (n, dim) and out.dtype == dtype and out.device.type == device.type
    assert bool(out.isfinite().all())
    assert in_bounds(out, low, high)
    out = out.cpu()
    if n == 0 or dim == 0:
        return
    # Same key, same row, wherever it stands: rows of equal keys are equal.
    _, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.int64).scatter_reduce_(0, inverse, torch.arange(n),
                                                                                        "amin")
    assert torch.equal(out, out[first[inverse]])
    # Another batch: a shuffled, sliced subset on one thread gives the same rows.
    g = torch.Generator().manual_seed(data_seed)
    pick = torch.randperm(n, generator=g)[: max(1, n // 3)]
    with num_threads(1):
        again = sk.ops.key_seeded_uniform(keys[pick], dim, seed=seed, low=low, high=high, dtype=dtype)
    assert torch.equal(again, out[pick])
    if key_dtype == torch.int32:
        wide = sk.ops.key_seeded_uniform(keys[pick].long(), dim, seed=seed, low=low, high=high, dtype=dtype)
        assert torch.equal(wide, again)
    # Column j does not depend on dim: a narrower table is a prefix.
    narrow = sk.ops.key_seeded_uniform(keys[pick], dim // 2, seed=seed, low=low, high=high, dtype=dtype)
    assert torch.equal(narrow, out[pick][:, : dim // 2])
    if device.type == "cuda":
        assert torch.equal(out, sk.ops.key_seeded_uniform(keys, dim, seed=seed, low=low, high=high, dtype=dtype))


@examples(6)
@given(seed=SEEDS, other=SEEDS, keys=st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=50, unique=True))
def test_key_seeded_uniform_seeds_and_keys_differ(device, seed, other, keys):
    """Different seeds give different tables, different keys different rows (16 float64
    columns: a collision would take a 2^-53-per-value coincidence)."""
    t = torch.tensor(keys, device=device)
    a = sk.ops.key_seeded_uniform(t, 16, seed=seed, dtype=torch.float64).cpu()
    if seed != other:
        b = sk.ops.key_seeded_uniform(t, 16, seed=other, dtype=torch.float64).cpu()
        assert not bool((a == b).all(dim=1).any())
    assert torch.unique(a, dim=0).shape[0] == len(keys)


@examples(4)
@given(dim=st.integers(1, 64), seed=SEEDS)
def test_key_seeded_uniform_uniformity(dim, seed):
    """200k values fill [low, high) evenly: every tenth holds 10% +- 1% of them."""
    keys = torch.arange(200_000 // dim + 1)
    out = sk.ops.key_seeded_uniform(keys, dim, seed=seed, low=-3.0, high=5.0, dtype=torch.float64)
    hist = torch.histc(out, bins=10, min=-3.0, max=5.0) / out.numel()
    assert bool(((hist - 0.1).abs() < 0.01).all())


@pytest.mark.parametrize("low,high", [(-1e308, 1e308), (-1.7976931348623157e308, 1.7976931348623157e308),
                                      (-1.7976931348623157e308, 0.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_key_seeded_uniform_regression_width_overflow(device, low, high, dtype):
    """Regression: with finite bounds more than DBL_MAX apart, high - low was inf and every
    value came out inf (NaN where the draw was 0). Only float64 holds such bounds; the other
    dtypes refuse them."""
    keys = torch.tensor([INT64_MIN, -1, 0, 1, INT64_MAX] + list(range(2, 500)), device=device)
    if dtype != torch.float64:
        with pytest.raises(RuntimeError, match="low and high must lie in"):
            sk.ops.key_seeded_uniform(keys, 33, seed=3, low=low, high=high, dtype=dtype)
        return
    out = sk.ops.key_seeded_uniform(keys, 33, seed=3, low=low, high=high, dtype=dtype)
    assert not bool(out.isnan().any())
    assert in_bounds(out.cpu(), low, high)
    wide = sk.ops.key_seeded_uniform(keys, 33, seed=3, low=low, high=high, dtype=torch.float64).cpu()
    assert bool(wide.isfinite().all())
    # Both halves of the range are used.
    assert bool((wide < 0).any()) and bool((wide > low / 2 + high / 2).any())

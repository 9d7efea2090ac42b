"""key_seeded_uniform: the default embedding initializer, a pure function of (seed, key, column)."""

from fractions import Fraction

import pytest
import torch

import sparsekit as sk

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MASK64 = 2**64 - 1


def mix_key(x: int) -> int:
    """splitmix64's finalizer on Python ints, as csrc/common.h defines mix_key."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def reference_row(key: int, dim: int, seed: int, low: float, high: float) -> list:
    state = mix_key((key & MASK64) ^ mix_key(seed))
    row = []
    for column in range(dim):
        h = mix_key(state + (column + 1) * 0x9E3779B97F4A7C15)
        unit = Fraction(h >> 11, 2**53)
        width = high - low  # a double, as the kernel computes it
        row.append(float(Fraction(width) * unit + Fraction(low)))  # one correct rounding: fma
    return row


def test_matches_python_reference(device):
    keys = [INT64_MIN, INT64_MAX, -1, 0, 1, 123456789, -987654321]
    out = sk.ops.key_seeded_uniform(torch.tensor(keys, device=device), 5, seed=7, dtype=torch.float64)
    expected = torch.tensor([reference_row(k, 5, 7, -0.05, 0.05) for k in keys], dtype=torch.float64)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def test_row_depends_only_on_seed_and_key(device):
    keys = torch.tensor([3, -1, 3, INT64_MIN, 42], device=device)
    full = sk.ops.key_seeded_uniform(keys, 8)
    assert torch.equal(full[0], full[2])
    # Another order and another batch give the same row for the same key.
    alone = sk.ops.key_seeded_uniform(keys.flip(0)[:3], 8)
    assert torch.equal(alone, full.flip(0)[:3])
    # A wider row starts with the narrower one.
    assert torch.equal(sk.ops.key_seeded_uniform(keys, 12)[:, :8], full)
    assert not torch.equal(sk.ops.key_seeded_uniform(keys, 8, seed=1), full)


def test_int32_keys_give_the_rows_of_equal_int64_keys(device):
    keys = torch.tensor([-(2**31), 2**31 - 1, -1, 0, 17], dtype=torch.int32, device=device)
    assert torch.equal(sk.ops.key_seeded_uniform(keys, 4), sk.ops.key_seeded_uniform(keys.long(), 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtypes_are_the_rounded_float64_rows(device, dtype):
    keys = torch.arange(-20, 20, device=device)
    out = sk.ops.key_seeded_uniform(keys, 6, low=-1.0, high=3.0, dtype=dtype)
    assert out.dtype == dtype and out.shape == (40, 6)
    exact = sk.ops.key_seeded_uniform(keys, 6, low=-1.0, high=3.0, dtype=torch.float64)
    if dtype in (torch.float32, torch.float64):
        assert torch.equal(out, exact.to(dtype))
    else:  # through float32, as the kernels convert
        assert torch.equal(out, exact.float().to(dtype))


def test_distribution_is_uniform_in_bounds():
    out = sk.ops.key_seeded_uniform(torch.arange(20_000), 16, seed=3)
    assert out.min() >= -0.05 and out.max() <= 0.05
    assert abs(out.mean().item()) < 1e-3
    assert abs(out.std().item() - 0.1 / 12**0.5) < 1e-3
    # Neighbouring keys and columns are not correlated.
    flat = out.double()
    assert abs(torch.corrcoef(torch.stack([flat[:-1, 0], flat[1:, 0]]))[0, 1].item()) < 0.03
    assert abs(torch.corrcoef(torch.stack([flat[:, 0], flat[:, 1]]))[0, 1].item()) < 0.03
    histogram = torch.histc(out.float(), bins=10, min=-0.05, max=0.05)
    assert (histogram / out.numel() - 0.1).abs().max() < 0.01


def test_empty(device):
    assert sk.ops.key_seeded_uniform(torch.empty(0, dtype=torch.long, device=device), 4).shape == (0, 4)
    assert sk.ops.key_seeded_uniform(torch.arange(3, device=device), 0).shape == (3, 0)


def test_opcheck(device):
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 5], device=device)
    torch.library.opcheck(torch.ops.sparsekit.key_seeded_uniform.default, (keys, 3, 0, -0.05, 0.05, None))
    torch.library.opcheck(torch.ops.sparsekit.key_seeded_uniform.default,
                          (keys[:0], 3, 9, -1.0, 1.0, torch.float64))


def test_bad_input_raises(device):
    keys = torch.arange(4, device=device)
    with pytest.raises(RuntimeError, match="key_seeded_uniform: keys must be an int64 or int32"):
        sk.ops.key_seeded_uniform(keys.float(), 2)
    with pytest.raises(RuntimeError, match="key_seeded_uniform: keys must be 1-D"):
        sk.ops.key_seeded_uniform(keys.view(2, 2), 2)
    with pytest.raises(RuntimeError, match="key_seeded_uniform: dim must be >= 0"):
        sk.ops.key_seeded_uniform(keys, -1)
    with pytest.raises(RuntimeError, match="key_seeded_uniform: need finite low <= high"):
        sk.ops.key_seeded_uniform(keys, 2, low=1.0, high=0.0)
    with pytest.raises(RuntimeError, match="key_seeded_uniform: dtype must be"):
        sk.ops.key_seeded_uniform(keys, 2, dtype=torch.int64)


@pytest.mark.parametrize("dtype, low, high", [(torch.float16, 1e5, 2e5), (torch.float16, -7e4, 0.0),
                                             (torch.bfloat16, 0.0, 1e39), (torch.float32, -1.7e308, 1.7e308)])
def test_bounds_the_dtype_cannot_hold_raise(device, dtype, low, high):
    """Bounds outside the dtype's finite range would give inf rows."""
    keys = torch.arange(4, device=device)
    for where in (keys, keys.to("meta")):
        with pytest.raises(RuntimeError, match="key_seeded_uniform: low and high must lie in"):
            sk.ops.key_seeded_uniform(where, 2, low=low, high=high, dtype=dtype)
    # The dtype's whole finite range is allowed, and every value stays finite.
    largest = torch.finfo(dtype).max
    rows = sk.ops.key_seeded_uniform(torch.arange(4096, device=device), 64, low=-largest, high=largest, dtype=dtype)
    assert torch.isfinite(rows).all() and rows.dtype == dtype


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(seed=1.5), TypeError, "seed must be an int in the int64 range"),
    (dict(seed=True), TypeError, "seed must be an int in the int64 range"),
    (dict(seed=2**63), TypeError, "seed must be an int in the int64 range"),
    (dict(low="0"), TypeError, "low must be a number"),
    (dict(high=float("nan")), ValueError, "high must be finite"),
    (dict(low=float("-inf")), ValueError, "low must be finite"),
    (dict(low=0.5, high=0.1), ValueError, "low must be <= high"),
    (dict(low=-1e39), ValueError, "low must lie in float32's finite range"),
    (dict(high=1.7e308), ValueError, "high must lie in float32's finite range"),
])
def test_key_seeded_uniform_initializer_checks_its_arguments_when_built(kwargs, error, message):
    """A bad initializer is refused where it is made, not at a layer's first lookup."""
    with pytest.raises(error, match=f"KeySeededUniform: {message}"):
        sk.KeySeededUniform(**kwargs)


def test_key_seeded_uniform_initializer_takes_numpy_numbers():
    np = pytest.importorskip("numpy")
    init = sk.KeySeededUniform(np.int64(-2**63), np.float32(-0.25), 0.25)
    assert init.seed == -2**63 and init.low == -0.25
    assert torch.equal(init(torch.tensor([3]), 2), sk.KeySeededUniform(-2**63, -0.25, 0.25)(torch.tensor([3]), 2))

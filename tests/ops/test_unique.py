import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import KEY_DISTRIBUTIONS, examples, make_keys, num_threads, sizes, thread_counts

import sparsekit as sk

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def reference_unique(keys: torch.Tensor):
    """First-occurrence unique in plain Python."""
    first = {}
    inverse = []
    for k in keys.flatten().tolist():
        inverse.append(first.setdefault(k, len(first)))
    uniq = list(first)
    counts = [0] * len(uniq)
    for i in inverse:
        counts[i] += 1
    return (
        torch.tensor(uniq, dtype=keys.dtype),
        torch.tensor(inverse, dtype=torch.int64).view(keys.shape),
        torch.tensor(counts, dtype=torch.int64),
    )


def check_against_reference(keys: torch.Tensor):
    got = torch.ops.sparsekit.unique(keys)
    want = reference_unique(keys.cpu())
    for g, w in zip(got, want):
        assert g.device == keys.device
        assert g.dtype == w.dtype
        assert torch.equal(g.cpu(), w)


CASES = {
    "small": [3, 1, 3, 2, 1, 1, 7],
    "all_duplicate": [42] * 1000,
    "adversarial": [INT64_MIN, INT64_MAX, -1, 0, 0, -1, INT64_MAX, INT64_MIN, 5, -1],
    "single": [INT64_MIN],
    "negative": [-5, -3, -5, -1, -3],
}


@pytest.mark.parametrize("case", list(CASES))
def test_unique_cases(device, case):
    check_against_reference(torch.tensor(CASES[case], dtype=torch.int64, device=device))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique_random_many_duplicates(device, dtype):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-500, 500, (20_000,), generator=gen).to(dtype)
    check_against_reference(keys.to(device))


def test_unique_int32_extremes(device):
    keys = torch.tensor([-(2**31), 2**31 - 1, -1, 0, -(2**31)], dtype=torch.int32, device=device)
    check_against_reference(keys)


def test_unique_large_matches_torch(device):
    """Against torch.unique on a larger input with int64 keys spread over the whole range."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(INT64_MIN, INT64_MAX, (5_000,), generator=gen)
    keys = base[torch.randint(0, 5_000, (200_000,), generator=gen)].to(device)
    uniq, inverse, counts = torch.ops.sparsekit.unique(keys)
    assert torch.equal(uniq[inverse], keys)
    ref_uniq, ref_counts = torch.unique(keys, return_counts=True)
    order = torch.argsort(uniq)
    assert torch.equal(uniq[order], ref_uniq)
    assert torch.equal(counts[order], ref_counts)
    # First-occurrence order: the first position of each unique key increases.
    first = torch.full((uniq.numel(),), keys.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=device), "amin")
    assert bool((first[1:] > first[:-1]).all())


def test_unique_multidim_and_noncontiguous(device):
    keys = torch.tensor([[1, 2, 3], [3, 2, 9]], device=device).t()  # non-contiguous [3, 2]
    uniq, inverse, _counts = torch.ops.sparsekit.unique(keys)
    assert inverse.shape == keys.shape
    assert torch.equal(uniq[inverse], keys)
    check_against_reference(keys)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique_empty(device, dtype):
    keys = torch.empty(0, dtype=dtype, device=device)
    uniq, inverse, counts = torch.ops.sparsekit.unique(keys)
    assert uniq.shape == (0,) and uniq.dtype == dtype
    assert inverse.shape == (0,) and inverse.dtype == torch.int64
    assert counts.shape == (0,)


def test_unique_deterministic_across_threads(device):
    keys = torch.randint(0, 3_000, (300_000,), generator=torch.Generator().manual_seed(2)).to(device)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.sparsekit.unique(keys)
    finally:
        torch.set_num_threads(threads)
    many = torch.ops.sparsekit.unique(keys)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: compares the CUDA kernel with the CPU kernel")
def test_unique_cuda_matches_cpu():
    device = torch.device("cuda")
    keys = torch.randint(-100_000, 100_000, (1_000_000,), generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.ops.sparsekit.unique(keys.to(device)), torch.ops.sparsekit.unique(keys)):
        assert torch.equal(a.cpu(), b)


def test_unique_wrapper_returns(device):
    keys = torch.tensor([4, 4, 2], device=device)
    assert torch.equal(sk.ops.unique(keys, return_inverse=False).cpu(), torch.tensor([4, 2]))
    _uniq, inverse = sk.ops.unique(keys)
    assert torch.equal(inverse.cpu(), torch.tensor([0, 0, 1]))
    _uniq, counts = sk.ops.unique(keys, return_inverse=False, return_counts=True)
    assert torch.equal(counts.cpu(), torch.tensor([2, 1]))
    _uniq, inverse, counts = sk.ops.unique(keys, return_counts=True)
    assert torch.equal(counts.cpu(), torch.tensor([2, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_unique_rejects_non_key_dtypes(device, dtype):
    with pytest.raises(RuntimeError, match="unique: keys must be an int64 or int32"):
        torch.ops.sparsekit.unique(torch.zeros(4, device=device).to(dtype))
    # The op (and the CUDA context) still works afterwards.
    check_against_reference(torch.tensor([1, 1], device=device))


def test_unique_opcheck(device):
    for keys in [torch.tensor([5, 1, 5, INT64_MIN], device=device), torch.empty(0, dtype=torch.int64, device=device),
                 torch.tensor([[1, 2], [2, 1]], dtype=torch.int32, device=device)]:
        torch.library.opcheck(torch.ops.sparsekit.unique.default, (keys,))


def torch_unique_first_occurrence(keys: torch.Tensor):
    """First-occurrence unique from plain torch ops (sorted unique, then reordered by each
    key's first position): the reference for inputs too large for the Python one."""
    flat = keys.reshape(-1)
    sorted_keys, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
    first = torch.full((sorted_keys.numel(),), flat.numel(), dtype=torch.int64, device=flat.device)
    first.scatter_reduce_(0, inverse, torch.arange(flat.numel(), device=flat.device), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return sorted_keys[order], rank[inverse].view(keys.shape), counts[order]


def assert_unique_equal(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("seed", range(6))
def test_unique_regression_table_growth_mid_chunk(device, seed):
    """Regression: a hot range plus a long tail of wide keys made the CPU sketch
    underestimate, the chunk table grew mid-probe, and keys whose home slot had been
    computed under the old mask were added twice (13,525 "unique" keys of 13,500)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.cat([torch.randint(-500, 500, (50_000,), generator=g),
                      torch.randint(INT64_MIN, INT64_MAX, (12_500,), generator=g)])
    keys = keys[torch.randperm(keys.numel(), generator=g)].to(device)
    for threads in (1, 2):
        with num_threads(threads):
            got = torch.ops.sparsekit.unique(keys)
        assert got[0].numel() == 13_500
        assert_unique_equal(got, torch_unique_first_occurrence(keys))


@pytest.mark.parametrize("slow_first", [True, False])
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_unique_uneven_work_is_split_between_threads(device, slow_first, threads):
    """One half of the input is slow (distinct wide keys: a table miss each), the other
    fast (one hot key). The CPU threads on the fast half run out of work first and take
    the back half of the slow range, again and again, each piece deduped in a table of
    its own (sized from the input's estimate) and merged in order: the result is still
    exactly first-occurrence unique."""
    g = torch.Generator().manual_seed(threads)
    slow = torch.randint(INT64_MIN, INT64_MAX, (600_000,), generator=g)
    slow[7::7] = slow[:-7:7].clone()  # repeats inside the slow half, across pieces
    fast = torch.full((600_000,), -3)
    keys = torch.cat([slow, fast] if slow_first else [fast, slow]).to(device)
    with num_threads(threads):
        got = torch.ops.sparsekit.unique(keys)
    assert_unique_equal(got, torch_unique_first_occurrence(keys))


def mostly_distinct_keys(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "wide":  # distinct int64 keys, extremes included
        keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
        keys[:4] = torch.tensor([INT64_MIN, INT64_MAX, -1, 0])
        return keys
    if kind == "repeats":  # each key ~2x, repeats near and far
        return torch.randint(0, n // 2, (n,), generator=g) * 1_000_003
    if kind == "hot_and_distinct":  # one bucket holds a third of the keys, mostly one key
        keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
        keys[torch.randperm(n, generator=g)[: n // 3]] = 12345
        return keys
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)  # "int32"


@pytest.mark.parametrize("n", [2**18 - 1, 2**18, 300_001, 1_100_000])
@pytest.mark.parametrize("kind", ["wide", "repeats", "hot_and_distinct", "int32"])
@pytest.mark.parametrize("threads", [1, 3])
def test_unique_mostly_distinct_keys(device, n, kind, threads):
    """From 2^18 keys, mostly distinct keys take the CPU's partitioned path (buckets by
    hash, one cached table per bucket, ids from first occurrences per block): the sizes
    straddle its threshold and the block and bucket counts; a hot key fills one bucket
    with few distinct keys (its table sized from a guess, grown when the guess is low)."""
    keys = mostly_distinct_keys(kind, n, seed=n + threads).to(device)
    with num_threads(threads):
        got = torch.ops.sparsekit.unique(keys)
    assert_unique_equal(got, torch_unique_first_occurrence(keys))


def _unmix(hashes):
    """Keys whose sparsekit hash (the splitmix64 finalizer, csrc/common.h) is `hashes`."""
    mask = (1 << 64) - 1

    def unshift(y, s):
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x

    keys = []
    for h in hashes:
        z = unshift(h, 31)
        z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & mask
        z = unshift(z, 27)
        z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & mask
        z = unshift(z, 30)
        keys.append(z - (1 << 64) if z >= 1 << 63 else z)
    return torch.tensor(keys, dtype=torch.int64)


@pytest.mark.parametrize("threads", [1, 2])
def test_unique_keys_whose_hashes_share_their_high_bits(device, threads):
    """Adversarial keys: every hash has the same top 16 bits, so the partitioned CPU path
    puts all 300k (distinct, some repeated) keys in one bucket, whose table grows from the
    even-spread guess to 2^20 slots; the result is still exact."""
    import random

    rng = random.Random(threads)
    hashes = [(0xABCD << 48) | rng.getrandbits(48) for _ in range(300_000)]
    keys = _unmix(hashes)
    keys = torch.cat([keys, keys[::7]])[torch.randperm(keys.numel() + keys[::7].numel(),
                                                       generator=torch.Generator().manual_seed(threads))]
    with num_threads(threads):
        got = torch.ops.sparsekit.unique(keys.to(device))
    assert_unique_equal(got, torch_unique_first_occurrence(keys.to(device)))


@examples(12)
@given(n=sizes(), distribution=st.sampled_from(KEY_DISTRIBUTIONS), dtype=st.sampled_from([torch.int64, torch.int32]),
       seed=st.integers(0, 2**31 - 1), threads=thread_counts)
def test_unique_property_matches_torch(device, n, distribution, dtype, seed, threads):
    """unique == plain-torch first-occurrence unique (keys, order, inverse, counts) for any
    size, distribution, dtype and thread count; CUDA equals the CPU kernel bit for bit."""
    keys = make_keys(n, distribution, seed, dtype)
    want = torch_unique_first_occurrence(keys)
    with num_threads(threads):
        got = torch.ops.sparsekit.unique(keys.to(device))
    assert_unique_equal(got, want)
    if device.type == "cuda":
        assert_unique_equal(got, torch.ops.sparsekit.unique(keys))


@examples(4)
@given(rows=st.integers(0, 300), cols=st.integers(0, 5), distribution=st.sampled_from(KEY_DISTRIBUTIONS),
       seed=st.integers(0, 2**31 - 1), transpose=st.booleans())
def test_unique_property_shapes(device, rows, cols, distribution, seed, transpose):
    """Keys of any 2-D shape, contiguous or not, are read flattened; inverse keeps the shape."""
    keys = make_keys(rows * cols, distribution, seed).view(rows, cols)
    if transpose:
        keys = keys.t()
    got = torch.ops.sparsekit.unique(keys.to(device))
    assert_unique_equal(got, torch_unique_first_occurrence(keys))

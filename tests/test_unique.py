import pytest
import torch

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
    uniq, inverse, counts = torch.ops.sparsekit.unique(keys)
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


def test_unique_cuda_matches_cpu(device):
    if device.type != "cuda":
        pytest.skip("CUDA kernel against the CPU kernel")
    keys = torch.randint(-100_000, 100_000, (1_000_000,), generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.ops.sparsekit.unique(keys.to(device)), torch.ops.sparsekit.unique(keys)):
        assert torch.equal(a.cpu(), b)


def test_unique_wrapper_returns(device):
    keys = torch.tensor([4, 4, 2], device=device)
    assert torch.equal(sk.ops.unique(keys, return_inverse=False).cpu(), torch.tensor([4, 2]))
    uniq, inverse = sk.ops.unique(keys)
    assert torch.equal(inverse.cpu(), torch.tensor([0, 0, 1]))
    uniq, counts = sk.ops.unique(keys, return_inverse=False, return_counts=True)
    assert torch.equal(counts.cpu(), torch.tensor([2, 1]))
    uniq, inverse, counts = sk.ops.unique(keys, return_counts=True)
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

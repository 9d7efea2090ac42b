"""partition_by_owner: the stable counting sort that routes keys to their owner ranks."""

import numpy as np
import pytest
import torch

import sparsekit as sk

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
ADVERSARIAL = [INT64_MIN, INT64_MAX, -1, 0, 1, -2, INT64_MIN + 1, INT64_MAX - 1]


def reference_partition(keys: torch.Tensor, world_size: int):
    """Pure torch/numpy: owners from the unsigned key, a stable sort, positions by inversion."""
    unsigned = keys.cpu().long().numpy().view(np.uint64)
    owners = torch.from_numpy((unsigned % np.uint64(world_size)).astype(np.int64))
    order = torch.sort(owners, stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(len(order))
    counts = torch.bincount(owners, minlength=world_size)
    return keys.cpu()[order], positions, counts


def check_against_reference(keys: torch.Tensor, world_size: int):
    keys_by_owner, positions, counts = sk.ops.partition_by_owner(keys, world_size)
    expected_keys, expected_positions, expected_counts = reference_partition(keys, world_size)
    assert keys_by_owner.dtype == keys.dtype and keys_by_owner.device == keys.device
    assert positions.dtype == torch.int64 and counts.dtype == torch.int64
    assert counts.shape == (world_size,)
    torch.testing.assert_close(keys_by_owner.cpu(), expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(positions.cpu(), expected_positions, rtol=0, atol=0)
    torch.testing.assert_close(counts.cpu(), expected_counts, rtol=0, atol=0)
    assert torch.equal(keys_by_owner[positions], keys)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 64, 5000])
@pytest.mark.parametrize("n", [0, 1, 37, 50_000])
def test_matches_reference(device, world_size, n):
    generator = torch.Generator().manual_seed(world_size * 1000 + n)
    keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=generator)
    keys[: min(n, len(ADVERSARIAL))] = torch.tensor(ADVERSARIAL[: min(n, len(ADVERSARIAL))])
    check_against_reference(keys.to(device), world_size)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_duplicates_and_adversarial_keys_stay_in_input_order(device, world_size):
    keys = torch.tensor(ADVERSARIAL * 5 + [5, 5, 5, -1, -1], device=device)
    check_against_reference(keys, world_size)
    keys_by_owner, _, counts = sk.ops.partition_by_owner(keys, world_size)
    # Within one owner's bucket the keys keep input order (stability), duplicates included.
    start = 0
    for owner, count in enumerate(counts.tolist()):
        bucket = keys_by_owner[start : start + count].cpu()
        mine = [k for k in keys.cpu().tolist() if (k % 2**64) % world_size == owner]
        assert bucket.tolist() == mine
        start += count


def test_int32_keys_own_like_the_equal_int64_keys(device):
    keys32 = torch.tensor([-(2**31), 2**31 - 1, -1, 0, 3, -7, 12, 12], dtype=torch.int32, device=device)
    for world_size in (2, 3, 5):
        check_against_reference(keys32, world_size)
        _, positions32, counts32 = sk.ops.partition_by_owner(keys32, world_size)
        _, positions64, counts64 = sk.ops.partition_by_owner(keys32.long(), world_size)
        assert torch.equal(positions32, positions64) and torch.equal(counts32, counts64)


def test_non_contiguous_keys(device):
    keys = torch.arange(-50, 50, device=device)[::3]
    assert not keys.is_contiguous()
    check_against_reference(keys, 4)


def test_many_chunks_on_many_threads():
    # More keys than one chunk per thread, so the per-thread histograms are merged.
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        keys = torch.randint(-1000, 1000, (100_000,), generator=torch.Generator().manual_seed(1))
        check_against_reference(keys, 3)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("world_size", [1, 3])
def test_opcheck(device, world_size):
    keys = torch.tensor(ADVERSARIAL + [4, 4, 9], device=device)
    torch.library.opcheck(torch.ops.sparsekit.partition_by_owner.default, (keys, world_size))
    torch.library.opcheck(torch.ops.sparsekit.partition_by_owner.default, (keys[:0], world_size))


def test_bad_input_raises(device):
    keys = torch.arange(6, device=device)
    with pytest.raises(RuntimeError, match="partition_by_owner: keys must be an int64 or int32"):
        sk.ops.partition_by_owner(keys.float(), 2)
    with pytest.raises(RuntimeError, match="partition_by_owner: keys must be 1-D"):
        sk.ops.partition_by_owner(keys.view(2, 3), 2)
    with pytest.raises(RuntimeError, match="partition_by_owner: world_size must be in"):
        sk.ops.partition_by_owner(keys, 0)
    # Near 2^31 ranks the counts alone would take 16 GiB (on an overcommitting machine, a
    # process killed for touching them): the bound is 2^24.
    for world_size in (2**24 + 1, 2**31 - 1, 2**31):
        with pytest.raises(RuntimeError, match=r"partition_by_owner: world_size must be in \[1, 2\^24\]"):
            sk.ops.partition_by_owner(keys, world_size)


@pytest.mark.parametrize("world_size, n", [(2**24, 5), (100_000, 40_000), (30_000, 70_000)])
def test_many_ranks_few_keys(device, world_size, n):
    # More ranks than keys: fewer histogram chunks than threads, the same sort.
    generator = torch.Generator().manual_seed(n)
    keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=generator)
    check_against_reference(keys.to(device), world_size)

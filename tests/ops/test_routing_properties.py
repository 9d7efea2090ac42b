"""Property-based tests of partition_by_owner against a stable argsort by owner.

Thresholds crossed (csrc/cpu/routing_cpu.cpp, csrc/cuda/routing_cuda.cu): CPU chunks of
>= 2^14 keys, one per thread; CUDA per-block shared histograms up to 4096 owners (global
atomics beyond), radix sort over ceil(log2(world_size)) bits, world size 1 short-cut.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import KEY_DISTRIBUTIONS, examples, make_keys, num_threads, sizes, thread_counts

import sparsekit as sk

WORLD_SIZES = st.one_of(st.integers(1, 9), st.sampled_from([16, 63, 64, 65, 1023, 4095, 4096, 4097, 100_003]))


def reference_partition(keys: torch.Tensor, world_size: int):
    """Owner = uint64(key) % world_size, then a stable argsort by owner."""
    unsigned = keys.long().numpy().view(np.uint64)
    owners = torch.from_numpy((unsigned % np.uint64(world_size)).astype(np.int64))
    order = torch.sort(owners, stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel())
    return keys[order], positions, torch.bincount(owners, minlength=world_size)


@examples(30)
@given(n=sizes(1_000_000), distribution=st.sampled_from(KEY_DISTRIBUTIONS), dtype=st.sampled_from([torch.int64, torch.int32]),
       seed=st.integers(0, 2**31 - 1), world_size=WORLD_SIZES, threads=thread_counts)
def test_partition_property_matches_stable_argsort(device, n, distribution, dtype, seed, world_size, threads):
    """keys_by_owner, positions and counts equal the stable-argsort reference for any size,
    key distribution, dtype, world size and thread count; CUDA equals the CPU kernel."""
    keys = make_keys(n, distribution, seed, dtype)
    with num_threads(threads):
        keys_by_owner, positions, counts = sk.ops.partition_by_owner(keys.to(device), world_size)
    want_keys, want_positions, want_counts = reference_partition(keys, world_size)
    assert keys_by_owner.dtype == dtype and positions.dtype == torch.int64 and counts.dtype == torch.int64
    assert counts.shape == (world_size,)
    assert torch.equal(keys_by_owner.cpu(), want_keys)
    assert torch.equal(positions.cpu(), want_positions)
    assert torch.equal(counts.cpu(), want_counts)
    assert torch.equal(keys_by_owner[positions].cpu(), keys)
    if dtype == torch.int32:
        # An int32 key is owned like the equal int64 key.
        wide = sk.ops.partition_by_owner(keys.long().to(device), world_size)
        assert torch.equal(wide[0].cpu(), keys_by_owner.cpu().long())
        assert torch.equal(wide[1], positions) and torch.equal(wide[2], counts)


@examples(4)
@given(n=st.integers(1 << 14, 5 << 14), seed=st.integers(0, 2**31 - 1), world_size=st.integers(2, 9))
def test_partition_property_thread_invariant(n, seed, world_size):
    """CPU: the same outputs on 1..4 threads (chunk split points move with the count)."""
    keys = make_keys(n, "zipf", seed)
    results = []
    for threads in (1, 2, 3, 4):
        with num_threads(threads):
            results.append(sk.ops.partition_by_owner(keys, world_size))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", [2, 3, 4096, 4097])
def test_partition_chunk_edges(device, world_size):
    """Sizes on either side of the 2^14-key chunk edge, keys all owned by one rank but the
    last, so every chunk's histogram is lopsided."""
    for n in [(1 << 14) - 1, 1 << 14, (1 << 14) + 1, (2 << 14) + 1, (4 << 14) - 1]:
        keys = torch.arange(n, dtype=torch.int64) * world_size
        keys[-1] = world_size - 1
        got = sk.ops.partition_by_owner(keys.to(device), world_size)
        for g, w in zip(got, reference_partition(keys, world_size)):
            assert torch.equal(g.cpu(), w)

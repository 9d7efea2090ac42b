"""``partition_by_owner``, the routing step of the model-parallel layers
(``csrc/cpu/routing_cpu.cpp``, ``csrc/cuda/routing_cuda.cu``), and its fake."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._checks import index_dtype, tensor_arguments
from ._common import _integer, _ops


def partition_by_owner(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Bucket keys by the rank that owns them: a stable counting sort by ``uint64(key) % world_size``.

    This is the routing step of the model-parallel layers: ``keys_by_owner`` is ready for
    ``all_to_all_single`` with ``counts`` as the send split sizes, and ``positions``
    brings the answers back into input order.

    Args:
        keys: int64 or int32 ``[N]``; every value is a valid key (negative ones own by
            their unsigned value, so ``-1 % 2 == 1``).
        world_size: number of ranks, in ``[1, 2^24]``.

    Returns:
        ``(keys_by_owner, positions, counts)``: ``keys_by_owner`` (keys' dtype, ``[N]``)
        holds rank 0's keys, then rank 1's, ..., each rank's in input order;
        ``positions`` (int64 ``[N]``) with ``keys_by_owner[positions[i]] == keys[i]``;
        ``counts`` (int64 ``[world_size]``) keys per owner. No host synchronisation.
    """
    tensor_arguments("partition_by_owner", keys=keys)
    return _ops.partition_by_owner(keys, _integer("partition_by_owner", "world_size", world_size))


@torch.library.register_fake("sparsekit::partition_by_owner")
def _partition_by_owner_fake(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    index_dtype("partition_by_owner", "keys", keys, "tensor of keys")
    torch._check(keys.dim() == 1, lambda: "partition_by_owner: keys must be 1-D [N]")
    torch._check(1 <= world_size <= 2**24,
                 lambda: f"partition_by_owner: world_size must be in [1, 2^24], got {world_size}")
    return (
        keys.new_empty(keys.shape),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty((world_size,), dtype=torch.int64),
    )

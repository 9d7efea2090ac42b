"""Typed wrappers, fake (meta) kernels and autograd for ``torch.ops.sparsekit.*``.

Every op has a CPU and a CUDA kernel compiled into ``sparsekit._C``; the fakes below
let ``torch.compile`` trace them, with data-dependent output sizes taken from
``torch.library.get_ctx().new_dynamic_size()``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the kernels)

_ops = torch.ops.sparsekit


# ---- routing ----


def partition_by_owner(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Bucket keys by the rank that owns them: a stable counting sort by ``uint64(key) % world_size``.

    This is the routing step of the model-parallel layers: ``keys_by_owner`` is ready for
    ``all_to_all_single`` with ``counts`` as the send split sizes, and ``positions``
    brings the answers back into input order.

    Args:
        keys: int64 or int32 ``[N]``; every value is a valid key (negative ones own by
            their unsigned value, so ``-1 % 2 == 1``).
        world_size: number of ranks, ``>= 1``.

    Returns:
        ``(keys_by_owner, positions, counts)``: ``keys_by_owner`` (keys' dtype, ``[N]``)
        holds rank 0's keys, then rank 1's, ..., each rank's in input order;
        ``positions`` (int64 ``[N]``) with ``keys_by_owner[positions[i]] == keys[i]``;
        ``counts`` (int64 ``[world_size]``) keys per owner. No host synchronisation.
    """
    return _ops.partition_by_owner(keys, world_size)


@torch.library.register_fake("sparsekit::partition_by_owner")
def _partition_by_owner_fake(keys: Tensor, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    torch._check(keys.dim() == 1, lambda: "partition_by_owner: keys must be 1-D [N]")
    return (
        keys.new_empty(keys.shape),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty((world_size,), dtype=torch.int64),
    )


# ---- initializer ----


def key_seeded_uniform(
    keys: Tensor,
    dim: int,
    *,
    seed: int = 0,
    low: float = -0.05,
    high: float = 0.05,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Initial embedding rows, uniform in ``[low, high]`` and seeded by the key.

    Row ``i`` is a pure function of ``(seed, keys[i])`` (column ``j`` of ``(seed, key,
    j)``), computed with integer hashing and one correctly rounded fma, so a key gets
    the same first vector on every rank, world size, device and insertion order.

    Args:
        keys: int64 or int32 ``[N]`` (an int32 key gives the row of the equal int64 key).
        dim: columns per row, ``>= 0``.
        seed: any int64; different seeds give independent tables.
        low: lower bound.
        high: upper bound, ``>= low``.
        dtype: floating dtype of the result, float32 when None.

    Returns:
        ``[N, dim]`` tensor of ``dtype`` on the keys' device.
    """
    return _ops.key_seeded_uniform(keys, dim, seed, low, high, dtype)


@torch.library.register_fake("sparsekit::key_seeded_uniform")
def _key_seeded_uniform_fake(
    keys: Tensor, dim: int, seed: int, low: float, high: float, dtype: Optional[torch.dtype] = None
) -> Tensor:
    torch._check(keys.dim() == 1, lambda: "key_seeded_uniform: keys must be 1-D [N]")
    return keys.new_empty((keys.shape[0], dim), dtype=dtype if dtype is not None else torch.float32)

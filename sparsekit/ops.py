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

_INT_KEY_DTYPES = (torch.int64, torch.int32)


# ---- unique ----


@torch.library.register_fake("sparsekit::unique")
def _unique_fake(keys: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    torch._check(keys.dtype in _INT_KEY_DTYPES, lambda: f"unique: keys must be int64 or int32, got {keys.dtype}")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (
        keys.new_empty(num_unique),
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty(num_unique, dtype=torch.int64),
    )


def unique(
    keys: Tensor, return_inverse: bool = True, return_counts: bool = False
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Distinct keys in order of first occurrence (hash-based; deterministic on every device).

    Args:
        keys: int64 or int32 tensor of any shape (read flattened). Every value is a valid
            key, including INT64_MIN, INT64_MAX, -1 and 0.
        return_inverse: also return ``inverse`` (int64, shape of ``keys``) with
            ``keys == unique_keys[inverse]``.
        return_counts: also return ``counts`` (int64 ``[U]``), occurrences of each unique key.

    Returns:
        ``unique_keys`` (``[U]``, dtype of ``keys``), then ``inverse`` and/or ``counts`` when
        asked, in that order (the ``torch.unique`` convention); a bare tensor when neither is.
    """
    unique_keys, inverse, counts = _ops.unique(keys)
    out = (unique_keys,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out


# ---- segment_sum / segment_mean ----


@torch.library.register_fake("sparsekit::segment_sum")
def _segment_sum_fake(data: Tensor, segment_ids: Tensor, num_segments, deterministic: bool = False) -> Tensor:
    torch._check(data.dim() >= 1, lambda: "segment_sum: data must have at least one dimension")
    torch._check(segment_ids.dim() == 1, lambda: "segment_sum: segment_ids must be 1-D")
    torch._check(segment_ids.shape[0] == data.shape[0], lambda: "segment_sum: segment_ids and data lengths differ")
    return data.new_empty((num_segments,) + tuple(data.shape[1:]))


def _segment_sum_setup_context(ctx, inputs, output) -> None:
    _, segment_ids, _, _ = inputs
    ctx.save_for_backward(segment_ids)


def _segment_sum_backward(ctx, grad: Tensor):
    (segment_ids,) = ctx.saved_tensors
    # d out[s] / d data[i] is 1 exactly when segment_ids[i] == s; dropped rows get zeros.
    valid = segment_ids >= 0
    picked = grad.index_select(0, torch.where(valid, segment_ids, 0))
    mask = valid.view((-1,) + (1,) * (grad.dim() - 1))
    return torch.where(mask, picked, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None, None


torch.library.register_autograd(
    "sparsekit::segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup_context
)


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """TensorFlow ``unsorted_segment_sum``: ``out[s] = sum(data[i] for i with segment_ids[i] == s)``.

    Args:
        data: ``[N, ...]`` float32, float64, float16 or bfloat16 (half types accumulate in float32).
        segment_ids: ``[N]`` int64 or int32. Negative ids are dropped (padding); an id
            ``>= num_segments`` raises.
        num_segments: number of output rows.
        deterministic: bit-identical results run to run. The CPU kernel always is; on CUDA
            this switches from atomics to a sort-based reduction.

    Returns:
        ``[num_segments, ...]`` of ``data``'s dtype, zeros for empty segments.
        Differentiable in ``data``.
    """
    return _ops.segment_sum(data, segment_ids, num_segments, deterministic)


def segment_mean(data: Tensor, segment_ids: Tensor, num_segments: int, deterministic: bool = False) -> Tensor:
    """Like :func:`segment_sum`, divided by the number of rows in each segment (empty -> 0).

    Args and returns as :func:`segment_sum`. Differentiable in ``data``.
    """
    totals = _ops.segment_sum(data, segment_ids, num_segments, deterministic)
    # Counts in float32 at least: float16 cannot count past 2048 exactly.
    count_dtype = torch.promote_types(data.dtype, torch.float32)
    ones = torch.ones(segment_ids.shape[0], dtype=count_dtype, device=data.device)
    counts = _ops.segment_sum(ones, segment_ids, num_segments, deterministic).clamp_(min=1)
    return (totals.to(count_dtype) / counts.view((-1,) + (1,) * (data.dim() - 1))).to(data.dtype)


def segment_reduce(
    data: Tensor, segment_ids: Tensor, num_segments: int, reduce: str = "sum", deterministic: bool = False
) -> Tensor:
    """:func:`segment_sum` (``reduce="sum"``) or :func:`segment_mean` (``reduce="mean"``)."""
    if reduce == "sum":
        return segment_sum(data, segment_ids, num_segments, deterministic)
    if reduce == "mean":
        return segment_mean(data, segment_ids, num_segments, deterministic)
    raise ValueError(f"segment_reduce: reduce must be 'sum' or 'mean', got {reduce!r}")


# ---- hashtable / lazy_adam ----


@torch.library.register_fake("sparsekit::hash_table_find")
def _hash_table_find_fake(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    torch._check(keys.dtype in _INT_KEY_DTYPES, lambda: f"hash_table_find: keys must be int64 or int32, got {keys.dtype}")
    torch._check(slot_keys.dtype == torch.int64 and slot_rows.dtype == torch.int64,
                 lambda: "hash_table_find: slot_keys and slot_rows must be int64")
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.register_fake("sparsekit::hash_table_insert_absent_")
def _hash_table_insert_absent_fake(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor, rows: Tensor) -> None:
    torch._check(keys.dtype in _INT_KEY_DTYPES,
                 lambda: f"hash_table_insert_absent_: keys must be int64 or int32, got {keys.dtype}")
    torch._check(rows.dtype == torch.int64, lambda: "hash_table_insert_absent_: rows must be int64")
    return None


def hash_table_find(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor) -> Tensor:
    """Rows of ``keys`` in an open-addressing table (see :class:`sparsekit.HashTable`).

    Args:
        slot_keys: int64 ``[S]``, ``S`` a power of two: the key held by each slot.
        slot_rows: int64 ``[S]``: the row held by each slot, ``-1`` where the slot is empty.
        keys: int64 or int32 keys of any shape, on the table's device. int32 keys are
            compared as int64.

    Returns:
        int64 rows with the shape of ``keys``, ``-1`` where a key is absent.
    """
    return _ops.hash_table_find(slot_keys, slot_rows, keys)


def hash_table_insert_absent_(slot_keys: Tensor, slot_rows: Tensor, keys: Tensor, rows: Tensor) -> None:
    """Places keys that are distinct and absent from the table, in place.

    The caller guarantees distinctness and absence (not checked) and that the table stays
    at most half full (at most ``S / 2`` keys), which keeps probing short and guarantees
    an empty slot; a table with no empty slot left or a negative row raises. On CUDA this
    syncs with the host once, to read the error flag.

    Args:
        slot_keys: int64 ``[S]``, written in place.
        slot_rows: int64 ``[S]``, written in place (``-1`` marks an empty slot).
        keys: int64 or int32 ``[n]`` keys, distinct and absent.
        rows: int64 ``[n]`` rows ``>= 0``; the slot of ``keys[i]`` gets ``rows[i]``.
    """
    _ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, rows)


@torch.library.register_fake("sparsekit::lazy_adam_")
def _lazy_adam_fake(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor, step: int,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0) -> None:
    torch._check(exp_avg.shape == weight.shape and exp_avg_sq.shape == weight.shape,
                 lambda: "lazy_adam_: exp_avg and exp_avg_sq must have the shape of weight")
    torch._check(rows.dim() == 1, lambda: "lazy_adam_: rows must be 1-D")
    return None


def lazy_adam_(
    weight: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    rows: Tensor,
    grad: Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Lazy Adam in place: only ``rows`` of the weight and of both moments change.

    For each row ``r = rows[i]`` with gradient ``g = grad[i]``::

        g += weight_decay * w[r]
        m[r] = b1 * m[r] + (1 - b1) * g          # computed as m += (1 - b1) * (g - m)
        v[r] = b2 * v[r] + (1 - b2) * g * g      # computed as v += (1 - b2) * (g * g - v)
        w[r] -= lr * sqrt(1 - b2**step) / (1 - b1**step) * m[r] / (sqrt(v[r]) + eps)

    the update of ``torch.optim.SparseAdam`` (plus weight decay). float32 and float64
    compute in the parameter dtype, one rounding per operation as SparseAdam does, so the
    moments match it bit for bit; float16 and bfloat16 compute in float32. A row outside
    ``[0, R)`` raises and nothing is written (on CUDA: one host sync to read the check).

    Args:
        weight: ``[R, ...]`` contiguous float32/float64/float16/bfloat16, updated in place.
        exp_avg: first moment, weight's shape and dtype, updated in place.
        exp_avg_sq: second moment, weight's shape and dtype, updated in place.
        rows: int64 or int32 ``[u]`` **distinct** row indices (distinctness is not checked;
            aggregate duplicates first, as :class:`sparsekit.LazyAdam` does).
        grad: ``[u, ...]`` gradient rows, weight's dtype.
        step: the step number after incrementing (``>= 1``), for the bias correction.
        lr: learning rate ``>= 0``.
        beta1: first-moment decay in ``[0, 1)``.
        beta2: second-moment decay in ``[0, 1)``.
        eps: denominator term ``>= 0``.
        weight_decay: L2 penalty ``>= 0`` added to the gradient of the touched rows.
    """
    _ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay)


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

"""The sparse COO weight gradient of a lookup: the distinct rows it read (numbered with
``unique`` or ``unique_bounded``) and each row's summed gradient. Also what lets a traced
backward make the data-dependent sizes this needs under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .._checks import torch_at_least
from ._common import _ops
from ._unique_bounded import _bitmap_numbers


# torch from 2.13 compiles a lookup's traced backward with data-dependent sizes in the
# default mode. Before, inductor cannot lower its slices of such a size, and max mode's
# backward guards on one: failures dynamo does not fall back on, where torch's own refusal
# of the sizes (DynamicOutputShapeException) makes it run the frame eagerly. So torch
# before 2.13 keeps that refusal.
_SIZES_IN_DEFAULT_MODE = torch_at_least(2, 13)


def _traced_fake_mode(tensor: Tensor) -> Any:
    """The fake mode tracing ``tensor`` where :func:`_allow_dynamic_sizes` applies (torch
    from 2.13, compiling), else None: an eager backward pays no search for one (torch from
    2.13 says it is compiling while AOT autograd traces a compiled backward)."""
    if not _SIZES_IN_DEFAULT_MODE or not torch.compiler.is_compiling():
        return None
    return torch._guards.detect_fake_mode(tensor)


def _allow_dynamic_sizes(tensor: Tensor) -> None:
    """Lets the ops' fakes make data-dependent sizes for the rest of the compilation whose
    fake mode traces ``tensor`` (a lookup's backward). ``torch.compile`` allows them only
    under ``fullgraph=True`` or ``capture_dynamic_output_shape_ops``: in its default mode
    AOT autograd's trace of the backward (where a graph cannot break) would fail on the
    distinct rows' count, and dynamo would run the whole frame eagerly, the dense layers
    too, saying nothing. The backward's graph is then the one ``fullgraph=True`` compiles.
    For the rest of the compilation: inductor compiles the backward at the first
    ``backward()`` and runs the fakes again then. (torch keeps the permission in the shape
    environment's settings; were they to move, the default mode would run eagerly.)"""
    mode = torch._guards.detect_fake_mode(tensor)
    env = getattr(mode, "shape_env", None)
    settings = getattr(env, "settings", None)
    if settings is None or getattr(settings, "allow_dynamic_output_shape_ops", True):
        return
    try:
        env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True)
    except (TypeError, AttributeError):  # another torch's layout: as without this
        pass


# Whether the lookup backward being traced may make data-dependent sizes: not when its
# weight gets a gradient from another lookup of the same trace (see _first_lookup_of).
_SIZES_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("sparsekit_sizes_allowed", default=True)


@contextlib.contextmanager
def _first_lookup_of(weight_id: int, rows: Tensor):
    """Around a lookup's backward: traced, whether its weight (``id`` of the forward's
    weight) already had a lookup's backward traced in this trace. A weight with two sparse
    gradients cannot be compiled (AOT autograd's fake dispatch fails adding them); its
    second backward raises torch's refusal of data-dependent sizes, so that outside
    ``fullgraph=True`` dynamo runs the frame eagerly, as without
    :func:`_allow_dynamic_sizes`, instead of failing inside torch."""
    env = getattr(_traced_fake_mode(rows), "shape_env", None)
    if env is None:
        yield
        return
    seen = env.__dict__.setdefault("_sparsekit_lookup_weights", set())
    token = _SIZES_ALLOWED.set(weight_id not in seen)
    seen.add(weight_id)
    try:
        yield
    finally:
        _SIZES_ALLOWED.reset(token)


def _number_rows(rows: Tensor, num_rows: int, group: bool) -> Tuple[Tensor, Tensor, Optional[Tensor],
                                                                     Optional[Tensor], int, bool]:
    """:func:`_number_rows_of` (traced, from torch 2.13: with data-dependent sizes allowed,
    see :func:`_allow_dynamic_sizes`, unless :func:`_first_lookup_of` says no)."""
    if _traced_fake_mode(rows) is not None:
        if not _SIZES_ALLOWED.get():
            # The refusal dynamo falls back on (the permission may already stand for this
            # compilation, given to the weight's first lookup).
            raise torch._subclasses.fake_tensor.DynamicOutputShapeException(torch.ops.sparsekit.unique_bounded.default)
        _allow_dynamic_sizes(rows)
    return _number_rows_of(rows, num_rows, group)


def _number_rows_of(rows: Tensor, num_rows: int, group: bool) -> Tuple[Tensor, Tensor, Optional[Tensor],
                                                                       Optional[Tensor], int, bool]:
    """The distinct rows of ``rows`` (values in ``[-1, num_rows)``) for a sparse gradient:
    ``(keys, inverse, offsets, order, skip, coalesced)``, ``rows == keys[inverse]``;
    ``keys[:skip]`` is the missing row -1 (``skip`` 0 or 1). With ``group``, the lookups
    grouped by row: ``order[offsets[u]:offsets[u + 1]]`` (ascending) read row ``keys[u]``;
    else ``offsets`` and ``order`` are None.

    On the CPU ``keys`` ascend (``coalesced``). ``unique_bounded`` numbers them with a
    bitmap of the table's rows and groups the lookups with a counting sort (cheaper than
    hashing them and sorting, see ``_bitmap_numbers``); for a table far larger than
    its lookups ``unique`` numbers them and a sort of the distinct rows puts them in order.
    On CUDA ``unique`` numbers them in order of first occurrence. Except on the eager
    bitmap path, a leading -1 marker makes the -1 lookups group 0 whatever the batch holds
    (``skip`` is 1), sliced off with it without a data-dependent mask or a host read of the
    data (no extra host sync on CUDA, no graph break); off the bitmap path a stable sort
    groups them."""
    nnz = rows.shape[0]
    # Traced (fake tensors): torch before 2.13 says is_compiling() False while AOT autograd
    # traces a compiled graph's backward, so the fake mode is looked for too.
    eager = not torch.compiler.is_compiling() and torch._guards.detect_fake_mode(rows) is None
    bitmap = (rows.device.type == "cpu" and isinstance(nnz, int) and isinstance(num_rows, int)
              and _bitmap_numbers(num_rows, nnz))
    if bitmap and eager:
        keys, inverse, offsets, order = torch.ops.sparsekit.unique_bounded(rows, num_rows, group)
        skip = int(keys.numel() > 0 and bool(keys[0] < 0))
        return (keys, inverse, offsets, order, skip, True) if group else (keys, inverse, None, None, skip, True)
    marker = torch.full((1,), -1, dtype=rows.dtype, device=rows.device)
    if bitmap:
        # The marker is position 0: first in group 0 (the counting sort is stable).
        keys, inverse, offsets, order = torch.ops.sparsekit.unique_bounded(torch.cat([marker, rows]), num_rows, group)
        if not group:
            return keys, inverse[1:], None, None, 1, True
        return keys, inverse[1:], torch.cat([offsets[:1], offsets[1:] - 1]), order[1:] - 1, 1, True
    keys, inverse, counts = _ops.unique(torch.cat([marker, rows]))
    inverse = inverse[1:]
    coalesced = rows.device.type == "cpu"
    if coalesced:
        # Ascending, as the bitmap gives them (the same gradient eager and traced); the
        # marker sorts first, so the -1 group stays group 0.
        by_key = torch.from_numpy(np.argsort(keys.numpy(), kind="stable")) if eager else \
            torch.sort(keys, stable=True).indices
        rank = torch.empty_like(by_key).index_copy_(0, by_key, torch.arange(by_key.shape[0]))
        keys, inverse, counts = keys.index_select(0, by_key), rank.index_select(0, inverse), \
            counts.index_select(0, by_key)
    if not group:
        return keys, inverse, None, None, 1, coalesced
    # Group 0 counted the marker once.
    group_ends = torch.cumsum(counts, 0) - 1
    order = torch.sort(inverse, stable=True).indices
    return keys, inverse, torch.cat([group_ends.new_zeros(1), group_ends]), order, 1, coalesced


def _sparse_row_gradient(source: Tensor, source_index: Tensor, rows: Tensor, num_rows: int,
                         scale: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The sparse ``[num_rows, D]`` gradient ``sum_i scale[i] * source[source_index[i]]`` into row ``rows[i]``.

    Lookup ``i`` of row ``rows[i]`` contributes ``source[source_index[i]]`` (its bag's
    grad_output, or its own), times ``scale[i]`` when given; lookups of row -1 contribute
    nothing. The result, of ``dtype`` (default ``source``'s: the values are cast before the
    sparse tensor is built, which inductor can compile, where it cannot cast a sparse
    tensor), has one entry per distinct row (summed); on the CPU the rows
    ascend and it is flagged coalesced, on CUDA they are in order of first occurrence (see
    :func:`_number_rows`).

    The per-lookup rows are never materialised (``[nnz, D]`` would cost more than the
    whole forward): the lookups are grouped row by row, and ``embedding_bag`` sums each
    group straight out of ``source`` as one CSR bag per row, writing each output row once.
    Sums run in lookup order (on CUDA a long group is cut into fixed chunks combined in a
    fixed order), so the gradient is bit-identical run to run on every device.
    """
    dim = source.shape[1]
    keys, _, offsets, order, skip, coalesced = _number_rows(rows, num_rows, group=True)
    grouped_scale = None if scale is None else scale.index_select(0, order)
    # The -1 lookups (group 0, order[:offsets[1]], when skip is 1) read source index -1,
    # which embedding_bag skips without a load: they are never gathered, only stepped over.
    grouped_index = source_index.index_select(0, order)
    if skip:
        grouped_index = torch.where(torch.arange(order.shape[0], device=order.device) < offsets[1], -1,
                                    grouped_index)
    summed = _ops.embedding_bag(source, grouped_index, offsets, grouped_scale, "sum")
    if dtype is not None:
        summed = summed.to(dtype)
    return torch.sparse_coo_tensor(keys[skip:].to(torch.int64).unsqueeze(0), summed[skip:], (num_rows, dim),
                                   is_coalesced=coalesced, check_invariants=False)

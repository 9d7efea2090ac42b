"""No CPU op, and no training step of a layer, keeps memory from one call to the next.

glibc's count of bytes in use (``mallinfo2().uordblks``) is read after warm-up calls and
again after many more, twice: a kernel that loses a block per call shows as that block's
size per call in both windows. torch's own unboxing of a ``str`` argument lost 48 bytes per call of
``embedding_bag`` (see ``StrArg`` in csrc/torch_api.h); each lost block could pin the top of
the heap above the call's output, so that a loop of calls with 8 MiB outputs grew by 8 MiB
a call. Where the C library is not glibc there is nothing to read and the tests skip.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

import sparsekit as sk
from sparsekit import ops


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _bytes_in_use():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: mallinfo2().uordblks


BYTES_IN_USE = _bytes_in_use()
pytestmark = pytest.mark.skipif(BYTES_IN_USE is None, reason="no glibc mallinfo2 to read")

WARMUP, CALLS = 200, 3000
# Bytes per call allowed: the interpreter's own bookkeeping moves the count by a fraction
# of a byte per call; a lost block is 16 bytes or more.
LIMIT = 2.0


def grown_per_call(call, calls: int = CALLS) -> float:
    """Bytes in use gained per call, the smaller of two windows of ``calls`` calls after
    the warm-up: caches that settle once (a dict resized, an allocator's pool) show in the
    first window only, a block lost per call in both."""
    for _ in range(WARMUP):
        call()
    gained = []
    for _ in range(2):
        before = BYTES_IN_USE()
        for _ in range(calls):
            call()
        gained.append((BYTES_IN_USE() - before) / calls)
    return min(gained)


def _op_calls():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 16, generator=g)
    rows = torch.randint(-1, 1000, (200,), generator=g)
    offsets = torch.arange(0, 201, 20)
    keys = torch.randint(-50, 50, (300,), generator=g)
    scale = torch.rand(200, generator=g)
    table = weight.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(table), torch.zeros_like(table)
    updated = torch.arange(0, 1000, 7)
    grad = torch.randn(updated.numel(), 16, generator=g)
    return {
        "unique": lambda: ops.unique(keys),
        "unique_bounded": lambda: torch.ops.sparsekit.unique_bounded(rows.clamp(min=0), 1000),
        "segment_sum": lambda: ops.segment_sum(weight[:200], rows, 1000),
        "embedding_bag sum": lambda: ops.embedding_bag(weight, rows, offsets),
        "embedding_bag mean": lambda: ops.embedding_bag(weight, rows, offsets, scale, "mean", 3),
        "embedding_bag max": lambda: ops.embedding_bag(weight, rows, offsets, mode="max"),
        "embedding_bag nn offsets": lambda: ops.embedding_bag(weight, rows, offsets[:-1], include_last_offset=False),
        "embedding_gather": lambda: ops.embedding_gather(weight, rows),
        "lazy_adam_": lambda: torch.ops.sparsekit.lazy_adam_(table, exp_avg, exp_avg_sq, updated, grad, 3, 0.01, 0.9,
                                                             0.999, 1e-8, 0.0),
        "key_seeded_uniform": lambda: torch.ops.sparsekit.key_seeded_uniform(keys, 16, 0, -0.05, 0.05, None),
        "partition_by_owner": lambda: torch.ops.sparsekit.partition_by_owner(keys, 2),
    }


@pytest.mark.parametrize("name", sorted(_op_calls()))
def test_cpu_op_keeps_nothing(name):
    call = _op_calls()[name]
    assert grown_per_call(call) < LIMIT, name


def test_training_step_keeps_nothing():
    """A DistributedEmbedding step (lookup of known keys, backward, LazyAdam) on the same
    batch again and again: the table gains no key, so nothing may grow."""
    torch.manual_seed(0)
    layer = sk.DistributedEmbedding("sum", 4096, 16, 4, 1, use_hashtable=True)
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.01)
    keys = torch.randint(0, 1 << 40, (256, 4, 1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        layer(keys).sum().backward()
        optimizer.step()

    assert grown_per_call(step) < LIMIT


def test_collection_step_keeps_nothing():
    """An EmbeddingBagCollection step over two tables of different dims and dtypes (the
    multi-table ops, whose list arguments are unboxed on every call), backward and
    LazyAdam, on the same batch again and again."""
    torch.manual_seed(0)
    collection = sk.EmbeddingBagCollection([
        sk.TableConfig("users", 16, 4096, ["user_id"]),
        sk.TableConfig("items", 32, 4096, ["item_id", "last_item"], dtype=torch.bfloat16),
    ])
    optimizer = sk.LazyAdam(collection.parameters(), lr=0.01)
    batch = 64
    lengths = torch.randint(0, 4, (3 * batch,))
    values = torch.randint(0, 1 << 40, (int(lengths.sum()),))
    features = sk.KeyedJagged(["user_id", "item_id", "last_item"], values, lengths=lengths)

    def step():
        optimizer.zero_grad(set_to_none=True)
        sum(pooled.float().sum() for pooled in collection(features).values()).backward()
        optimizer.step()

    assert grown_per_call(step, calls=1000) < LIMIT

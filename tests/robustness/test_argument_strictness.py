"""Arguments that the CPU kernels refuse are refused on every path: by the fake kernels
(what torch.compile and FakeTensorMode run), and by the Python wrappers, the hash table,
the Criteo reader and the harness's resume check, each with an error naming the argument."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import sparsekit as sk
from sparsekit.train.criteo import CriteoFormatError, CriteoTSV
from sparsekit.train.data import NUM_DENSE, NUM_SLOTS
from sparsekit.train.loop import CheckpointError, TrainConfig, train

from _state import assert_equal_nested

ops = torch.ops.sparsekit
L = torch.int64


def _map(value, convert):
    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(item, convert) for item in value)
    return value


def _run_fake(op, args):
    """``op`` under FakeTensorMode (a shape environment lets the data-dependent fakes run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            return op(*_map(args, mode.from_tensor))


# ---- the fakes refuse what the CPU kernels refuse ---------------------------------------------
# Each case: the op, a function making fresh arguments (some ops write in place), and a
# pattern that both the kernel's message and the fake's match.


def _slots(n=16):
    return torch.zeros(n, dtype=L), torch.full((n,), -1, dtype=L)


_KEYS = [1, 2, 3]


def _keys(dtype=L):
    return torch.tensor(_KEYS, dtype=dtype)


def _adam(weight=None, exp_avg=None, exp_avg_sq=None, rows=None, grad=None, step=1):
    return (torch.zeros(4, 2) if weight is None else weight, torch.zeros(4, 2) if exp_avg is None else exp_avg,
            torch.zeros(4, 2) if exp_avg_sq is None else exp_avg_sq,
            torch.tensor([0, 1]) if rows is None else rows, torch.ones(2, 2) if grad is None else grad,
            step, 0.1, 0.9, 0.999, 1e-8, 0.0)


_HYPER = [0.1, 0.9, 0.999, 1e-8, 0.0]


def _adam_tables(weight=None, exp_avg=None, rows=None, grad=None, steps=(1,), hyper=_HYPER):
    return ([torch.zeros(4, 2) if weight is None else weight], [torch.zeros(4, 2) if exp_avg is None else exp_avg],
            [torch.zeros(4, 2)], [torch.tensor([0, 1]) if rows is None else rows],
            [torch.ones(2, 2) if grad is None else grad], list(steps), list(hyper))


def _place(row_keys=None, sizes=(0,), keys=None, offsets=(0, 3), slots=16, rows=4):
    slot_keys, slot_rows = _slots(slots)
    return ([slot_keys], [slot_rows], [torch.zeros(rows, dtype=L) if row_keys is None else row_keys],
            [torch.zeros(rows, dtype=L)], _keys() if keys is None else keys, list(offsets), list(sizes))


def _score(last_seen=None, count=None, rows=None, offsets=(0, 3), tables=1):
    return ([torch.zeros(4, dtype=L) if last_seen is None else last_seen] + [torch.zeros(4, dtype=L)] * (tables - 1),
            [torch.zeros(4, dtype=L) if count is None else count] + [torch.zeros(4, dtype=L)] * (tables - 1),
            torch.tensor([0, 1, 2]) if rows is None else rows, list(offsets), [1] * tables)


_FLOAT8 = torch.float8_e4m3fn
_BOOL = torch.ones(3, dtype=torch.bool)

REFUSED = {
    # select_smallest
    "select_smallest float column": (ops.select_smallest, lambda: ([torch.ones(3)], _BOOL, 1),
                                     r"select_smallest: columns\[0\] must be int64 \[3\]"),
    "select_smallest int32 column": (ops.select_smallest, lambda: ([torch.arange(3).int()], _BOOL, 1),
                                     r"select_smallest: columns\[0\] must be int64 \[3\]"),
    "select_smallest column length": (ops.select_smallest, lambda: ([torch.arange(4)], _BOOL, 1),
                                      r"select_smallest: columns\[0\] must be int64 \[3\]"),
    "select_smallest 2-D column": (ops.select_smallest, lambda: ([torch.arange(3).view(3, 1)], _BOOL, 1),
                                   r"select_smallest: columns\[0\] must be int64 \[3\]"),
    "select_smallest second column": (ops.select_smallest, lambda: ([torch.arange(3), torch.ones(3)], _BOOL, 1),
                                      r"select_smallest: columns\[1\] must be int64 \[3\]"),
    "select_smallest no column": (ops.select_smallest, lambda: ([], _BOOL, 1),
                                  r"select_smallest: columns must hold 1 to 4 tensors, got 0"),
    "select_smallest 5 columns": (ops.select_smallest, lambda: ([torch.arange(3)] * 5, _BOOL, 1),
                                  r"select_smallest: columns must hold 1 to 4 tensors, got 5"),
    "select_smallest 2-D eligible": (ops.select_smallest, lambda: ([torch.arange(3)], _BOOL.view(3, 1), 1),
                                     r"select_smallest: eligible must be a 1-D bool tensor"),
    "select_smallest int eligible": (ops.select_smallest, lambda: ([torch.arange(3)], _BOOL.long(), 1),
                                     r"select_smallest: eligible must be a 1-D bool tensor"),
    "select_smallest k > n": (ops.select_smallest, lambda: ([torch.arange(3)], _BOOL, 4),
                              r"select_smallest: k=4 but .*only 3"),
    # unique_tables
    "unique_tables offsets from 1": (ops.unique_tables, lambda: (_keys(), [1, 1, 3], [0, 1], 2),
                                     r"unique_tables: offsets must run from 0 to 3, got 1 \.\. 3"),
    "unique_tables offsets short of keys": (ops.unique_tables, lambda: (_keys(), [0, 1, 2], [0, 1], 2),
                                            r"unique_tables: offsets must run from 0 to 3, got 0 \.\. 2"),
    "unique_tables offsets past keys": (ops.unique_tables, lambda: (_keys(), [0, 1, 4], [0, 1], 2),
                                        r"unique_tables: offsets must run from 0 to 3, got 0 \.\. 4"),
    "unique_tables offsets decrease": (ops.unique_tables, lambda: (_keys(), [0, 2, 1, 3], [0, 1, 0], 2),
                                       r"unique_tables: offsets must never decrease, got offsets\[1\] = 2 > "
                                       r"offsets\[2\] = 1"),
    "unique_tables table too large": (ops.unique_tables, lambda: (_keys(), [0, 1, 3], [0, 2], 2),
                                      r"unique_tables: tables\[1\] = 2 is not a table in \[0, 2\)"),
    "unique_tables negative table": (ops.unique_tables, lambda: (_keys(), [0, 1, 3], [-1, 0], 2),
                                     r"unique_tables: tables\[0\] = -1 is not a table in \[0, 2\)"),
    "unique_tables negative num_tables": (ops.unique_tables, lambda: (_keys(), [0, 3], [0], -1),
                                          r"unique_tables: num_tables must lie in \[0, 2\^20\], got -1"),
    "unique_tables num_tables too large": (ops.unique_tables, lambda: (_keys(), [0, 3], [0], 2**20 + 1),
                                           r"unique_tables: num_tables must lie in \[0, 2\^20\], got 1048577"),
    # unique_bounded
    "unique_bounded negative bound": (ops.unique_bounded, lambda: (_keys(), -1, False),
                                      r"unique_bounded: bound must lie in \[0, 2\^40\), got -1"),
    "unique_bounded bound too large": (ops.unique_bounded, lambda: (_keys(), 2**40, True),
                                       r"unique_bounded: bound must lie in \[0, 2\^40\), got 1099511627776"),
    # segment_sum (float8 passed the fake's is_floating_point)
    "segment_sum float8 data": (ops.segment_sum, lambda: (torch.ones(3).to(_FLOAT8), torch.zeros(3, dtype=L), 2,
                                                          False),
                                r"segment_sum: data must be float32, float64, float16 or bfloat16"),
    # segment_sum_parts
    "segment_sum_parts mixed dtypes": (ops.segment_sum_parts,
                                       lambda: ([torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)],
                                                torch.zeros(4, dtype=L), 2),
                                       r"segment_sum_parts: data\[1\] .*the dtype and row shape of data\[0\]"),
    "segment_sum_parts integer parts": (ops.segment_sum_parts,
                                        lambda: ([torch.ones(2, 3, dtype=L)], torch.zeros(2, dtype=L), 2),
                                        r"segment_sum_parts: data must be float32, float64, float16 or bfloat16"),
    "segment_sum_parts float8 parts": (ops.segment_sum_parts,
                                       lambda: ([torch.ones(2, 3).to(_FLOAT8)], torch.zeros(2, dtype=L), 2),
                                       r"segment_sum_parts: data must be float32, float64, float16 or bfloat16"),
    "segment_sum_parts trailing shapes": (ops.segment_sum_parts,
                                          lambda: ([torch.ones(2, 3), torch.ones(2, 4)], torch.zeros(4, dtype=L), 2),
                                          r"segment_sum_parts: data\[1\] .*the dtype and row shape of data\[0\]"),
    "segment_sum_parts ranks": (ops.segment_sum_parts,
                                lambda: ([torch.ones(2, 3), torch.ones(2, 3, 1)], torch.zeros(4, dtype=L), 2),
                                r"segment_sum_parts: data\[1\] .*the dtype and row shape of data\[0\]"),
    "segment_sum_parts 0-d later part": (ops.segment_sum_parts,
                                         lambda: ([torch.ones(2), torch.ones(())], torch.zeros(3, dtype=L), 2),
                                         r"segment_sum_parts: data\[1\]"),
    "segment_sum_parts float ids": (ops.segment_sum_parts, lambda: ([torch.ones(2, 3)], torch.zeros(2), 2),
                                    r"segment_sum_parts: segment_ids must be an int64 or int32 tensor"),
    "segment_sum_parts negative num_segments": (ops.segment_sum_parts,
                                                lambda: ([torch.ones(2, 3)], torch.zeros(2, dtype=L), -1),
                                                r"segment_sum_parts: num_segments must be >= 0, got -1"),
    # key_seeded_uniform
    "key_seeded_uniform float8_e4m3fn": (ops.key_seeded_uniform,
                                         lambda: (_keys(), 2, 0, -0.05, 0.05, torch.float8_e4m3fn),
                                         r"key_seeded_uniform: dtype must be float32, float64, float16 or bfloat16"),
    "key_seeded_uniform float8_e5m2": (ops.key_seeded_uniform, lambda: (_keys(), 2, 0, -0.05, 0.05, torch.float8_e5m2),
                                       r"key_seeded_uniform: dtype must be float32, float64, float16 or bfloat16"),
    "key_seeded_uniform complex": (ops.key_seeded_uniform, lambda: (_keys(), 2, 0, -0.05, 0.05, torch.complex64),
                                   r"key_seeded_uniform: dtype must be float32, float64, float16 or bfloat16"),
    # hash_table_find / insert / erase: the slot arrays
    "hash_table_find 12 slots": (ops.hash_table_find, lambda: (*_slots(12), _keys()),
                                 r"hash_table_find: the slot count must be a power of two .* got 12"),
    "hash_table_find no slots": (ops.hash_table_find, lambda: (*_slots(0), _keys()),
                                 r"hash_table_find: the slot count must be a power of two .* got 0"),
    "hash_table_find slot lengths": (ops.hash_table_find, lambda: (_slots(16)[0], _slots(8)[1], _keys()),
                                     r"hash_table_find: slot_keys has 16 slots but slot_rows has 8"),
    "hash_table_find 2-D slots": (ops.hash_table_find, lambda: (*(s.view(4, 4) for s in _slots()), _keys()),
                                  r"hash_table_find: slot_keys and slot_rows must be 1-D"),
    "hash_table_find strided slots": (ops.hash_table_find,
                                      lambda: (torch.zeros(32, dtype=L)[::2], _slots()[1], _keys()),
                                      r"hash_table_find: slot_keys and slot_rows must be contiguous"),
    "hash_table_insert_absent_ 12 slots": (ops.hash_table_insert_absent_,
                                           lambda: (*_slots(12), _keys(), torch.arange(3), None),
                                           r"hash_table_insert_absent_: the slot count must be a power of two"),
    "hash_table_insert_absent_ more keys than slots": (ops.hash_table_insert_absent_,
                                                       lambda: (*_slots(16), torch.arange(17), torch.arange(17), None),
                                                       r"hash_table_insert_absent_: 17 keys cannot fit in a table of "
                                                       r"16 slots"),
    "hash_table_insert_absent_ negative num_occupied": (ops.hash_table_insert_absent_,
                                                        lambda: (*_slots(16), _keys(), torch.arange(3), -1),
                                                        r"hash_table_insert_absent_: num_occupied must lie in "
                                                        r"\[0, 16\], got -1"),
    "hash_table_insert_absent_ num_occupied too large": (ops.hash_table_insert_absent_,
                                                         lambda: (*_slots(16), _keys(), torch.arange(3), 17),
                                                         r"hash_table_insert_absent_: num_occupied must lie in "
                                                         r"\[0, 16\], got 17"),
    "hash_table_insert_absent_ keys do not fit": (ops.hash_table_insert_absent_,
                                                  lambda: (*_slots(16), _keys(), torch.arange(3), 15),
                                                  r"hash_table_insert_absent_: 3 keys do not fit in the 1 empty "
                                                  r"slots"),
    "hash_table_erase_ 12 slots": (ops.hash_table_erase_, lambda: (*_slots(12), _keys()),
                                   r"hash_table_erase_: the slot count must be a power of two .* got 12"),
    "hash_table_erase_ int32 slot_keys": (ops.hash_table_erase_, lambda: (_slots()[0].int(), _slots()[1], _keys()),
                                          r"hash_table_erase_: slot_keys must be int64"),
    "hash_table_erase_ int32 slot_rows": (ops.hash_table_erase_, lambda: (_slots()[0], _slots()[1].int(), _keys()),
                                          r"hash_table_erase_: slot_rows must be int64"),
    # the multi-table hash ops
    "hash_table_find_tables float keys": (ops.hash_table_find_tables,
                                          lambda: ([_slots()[0]], [_slots()[1]], _keys(torch.float32), [0, 3]),
                                          r"hash_table_find_tables: keys must be an int64 or int32 tensor"),
    "hash_table_find_tables 12 slots": (ops.hash_table_find_tables,
                                        lambda: ([_slots(12)[0]], [_slots(12)[1]], _keys(), [0, 3]),
                                        r"hash_table_find_tables: table 0: the slot count must be a power of two .* got 12"),
    "hash_table_find_tables offsets short of keys": (ops.hash_table_find_tables,
                                                     lambda: ([_slots()[0]], [_slots()[1]], _keys(), [0, 2]),
                                                     r"hash_table_find_tables: offsets must run from 0 to 3, "
                                                     r"got 0 \.\. 2"),
    "hash_table_find_tables offsets from 1": (ops.hash_table_find_tables,
                                              lambda: ([_slots()[0]] * 2, [_slots()[1]] * 2, _keys(), [1, 2, 3]),
                                              r"hash_table_find_tables: offsets must run from 0 to 3, got 1 \.\. 3"),
    "hash_table_find_tables offsets decrease": (ops.hash_table_find_tables,
                                                lambda: ([_slots()[0]] * 3, [_slots()[1]] * 3, _keys(), [0, 2, 1, 3]),
                                                r"hash_table_find_tables: offsets must never decrease, "
                                                r"got offsets\[1\] = 2 > offsets\[2\] = 1"),
    "hash_table_score_tables_ int32 rows": (ops.hash_table_score_tables_,
                                            lambda: _score(rows=torch.tensor([0, 1, 2], dtype=torch.int32)),
                                            r"hash_table_score_tables_: rows must be 1-D int64"),
    "hash_table_score_tables_ 2-D rows": (ops.hash_table_score_tables_,
                                          lambda: _score(rows=torch.tensor([[0], [1], [2]])),
                                          r"hash_table_score_tables_: rows must be 1-D int64"),
    "hash_table_score_tables_ float last_seen": (ops.hash_table_score_tables_,
                                                 lambda: _score(last_seen=torch.zeros(4)),
                                                 r"hash_table_score_tables_: last_seen\[0\] and count\[0\] must be "
                                                 r"contiguous 1-D int64 tensors of one length"),
    "hash_table_score_tables_ score lengths": (ops.hash_table_score_tables_,
                                               lambda: _score(count=torch.zeros(5, dtype=L)),
                                               r"hash_table_score_tables_: last_seen\[0\] and count\[0\] must be "
                                               r"contiguous 1-D int64 tensors of one length"),
    "hash_table_score_tables_ strided count": (ops.hash_table_score_tables_,
                                               lambda: _score(count=torch.zeros(8, dtype=L)[::2]),
                                               r"hash_table_score_tables_: last_seen\[0\] and count\[0\] must be "
                                               r"contiguous"),
    "hash_table_score_tables_ offsets short of rows": (ops.hash_table_score_tables_,
                                                       lambda: _score(offsets=(0, 2)),
                                                       r"hash_table_score_tables_: offsets must run from 0 to 3, "
                                                       r"got 0 \.\. 2"),
    "hash_table_score_tables_ offsets decrease": (ops.hash_table_score_tables_,
                                                  lambda: _score(offsets=(0, 2, 1, 3), tables=3),
                                                  r"hash_table_score_tables_: offsets must never decrease"),
    "hash_table_place_tables_ float keys": (ops.hash_table_place_tables_, lambda: _place(keys=_keys(torch.float32)),
                                            r"hash_table_place_tables_: keys must be an int64 or int32 tensor"),
    "hash_table_place_tables_ 2-D keys": (ops.hash_table_place_tables_, lambda: _place(keys=_keys().view(3, 1)),
                                          r"hash_table_place_tables_: keys must be 1-D"),
    "hash_table_place_tables_ offsets short of keys": (ops.hash_table_place_tables_, lambda: _place(offsets=(0, 2)),
                                                       r"hash_table_place_tables_: offsets must run from 0 to 3, "
                                                       r"got 0 \.\. 2"),
    "hash_table_place_tables_ 12 slots": (ops.hash_table_place_tables_, lambda: _place(slots=12),
                                          r"hash_table_place_tables_: table 0: the slot count must be a power of two .* got 12"),
    "hash_table_place_tables_ int32 row_keys": (ops.hash_table_place_tables_,
                                                lambda: _place(row_keys=torch.zeros(4, dtype=torch.int32)),
                                                r"hash_table_place_tables_: row_keys\[0\] and count\[0\] must be "
                                                r"contiguous 1-D int64 tensors of one length"),
    "hash_table_place_tables_ row_keys length": (ops.hash_table_place_tables_,
                                                 lambda: _place(row_keys=torch.zeros(5, dtype=L)),
                                                 r"hash_table_place_tables_: row_keys\[0\] and count\[0\] must be "
                                                 r"contiguous 1-D int64 tensors of one length"),
    "hash_table_place_tables_ negative size": (ops.hash_table_place_tables_, lambda: _place(sizes=(-1,)),
                                               r"hash_table_place_tables_: table 0 holds -1 of its 4 rows, so its 3 "
                                               r"new keys do not fit"),
    "hash_table_place_tables_ rows do not fit": (ops.hash_table_place_tables_, lambda: _place(sizes=(2,)),
                                                 r"hash_table_place_tables_: table 0 holds 2 of its 4 rows, so its 3 "
                                                 r"new keys do not fit"),
    "hash_table_place_tables_ slots do not fit": (ops.hash_table_place_tables_,
                                                  lambda: _place(sizes=(15,), rows=40),
                                                  r"hash_table_place_tables_: 3 keys do not fit in the 1 empty slots"),
    # lazy_adam_ / lazy_adam_tables_
    "lazy_adam_ strided weight": (ops.lazy_adam_, lambda: _adam(weight=torch.zeros(2, 4).t()),
                                  r"lazy_adam_: weight, exp_avg and exp_avg_sq must be contiguous"),
    "lazy_adam_ strided exp_avg_sq": (ops.lazy_adam_, lambda: _adam(exp_avg_sq=torch.zeros(2, 4).t()),
                                      r"lazy_adam_: weight, exp_avg and exp_avg_sq must be contiguous"),
    "lazy_adam_tables_ float64 weight": (ops.lazy_adam_tables_,
                                         lambda: _adam_tables(weight=torch.zeros(4, 2, dtype=torch.float64)),
                                         r"lazy_adam_tables_: weights\[0\] must be a float32, float16 or bfloat16"),
    "lazy_adam_tables_ half moments": (ops.lazy_adam_tables_,
                                       lambda: _adam_tables(weight=torch.zeros(4, 2).half(),
                                                            exp_avg=torch.zeros(4, 2).half()),
                                       r"lazy_adam_tables_: exp_avgs\[0\] must be float32"),
    "lazy_adam_tables_ weight shape": (ops.lazy_adam_tables_, lambda: _adam_tables(weight=torch.zeros(4, 3)),
                                       r"lazy_adam_tables_: weights\[0\] .* must be contiguous with the shape of "
                                       r"exp_avgs\[0\]"),
    "lazy_adam_tables_ strided weight": (ops.lazy_adam_tables_, lambda: _adam_tables(weight=torch.zeros(2, 4).t()),
                                         r"lazy_adam_tables_: weights\[0\] .* must be contiguous with the shape of "
                                         r"exp_avgs\[0\]"),
    "lazy_adam_tables_ int32 rows": (ops.lazy_adam_tables_,
                                     lambda: _adam_tables(rows=torch.tensor([0, 1], dtype=torch.int32)),
                                     r"lazy_adam_tables_: rows\[0\] must be a contiguous int64 tensor"),
    "lazy_adam_tables_ step 0": (ops.lazy_adam_tables_, lambda: _adam_tables(steps=(0,)),
                                 r"lazy_adam_tables_: table 0: step must be >= 1"),
    "lazy_adam_tables_ negative lr": (ops.lazy_adam_tables_, lambda: _adam_tables(hyper=[-0.1] + _HYPER[1:]),
                                      r"lazy_adam_tables_: table 0: lr must be >= 0"),
    "lazy_adam_tables_ beta1 1": (ops.lazy_adam_tables_, lambda: _adam_tables(hyper=[0.1, 1.0] + _HYPER[2:]),
                                  r"lazy_adam_tables_: table 0: beta1 must be in \[0, 1\)"),
    "lazy_adam_tables_ nan weight_decay": (ops.lazy_adam_tables_,
                                           lambda: _adam_tables(hyper=_HYPER[:4] + [float("nan")]),
                                           r"lazy_adam_tables_: table 0: weight_decay must be >= 0"),
    "lazy_adam_tables_ float64 grad": (ops.lazy_adam_tables_,
                                       lambda: _adam_tables(grad=torch.ones(2, 2, dtype=torch.float64)),
                                       r"lazy_adam_tables_: table 0: exp_avg \(.*\) and grad \(.*\) must have the "
                                       r"dtype of weight"),
    "lazy_adam_tables_ grad rows": (ops.lazy_adam_tables_, lambda: _adam_tables(grad=torch.ones(3, 2)),
                                    r"lazy_adam_tables_: table 0: grad must have shape \[u, \.\.\.\] = \[2, 2\] "
                                    r"\(one row of gradient per entry of rows\), got \[3, 2\]"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_fake_refuses_what_the_cpu_kernel_refuses(case):
    """The fake raises the kernel's error type, naming the same argument: under
    torch.compile a bad call fails while tracing, not only when the graph first runs."""
    op, make_args, pattern = REFUSED[case]
    with pytest.raises(RuntimeError, match=pattern):
        op(*make_args())
    with pytest.raises(RuntimeError, match=pattern):
        _run_fake(op, make_args())


# Calls at the edge of what the kernels take: the fakes must not refuse them.
ACCEPTED = {
    "select_smallest k == n": (ops.select_smallest, lambda: ([torch.arange(3), torch.arange(3)], _BOOL, 3)),
    "select_smallest 4 columns, k 0": (ops.select_smallest, lambda: ([torch.arange(3)] * 4, _BOOL, 0)),
    "unique_tables empty segments": (ops.unique_tables, lambda: (_keys(), [0, 0, 3, 3], [1, 0, 1], 2)),
    "unique_tables no keys": (ops.unique_tables, lambda: (torch.zeros(0, dtype=L), [0], [], 0)),
    "unique_tables 2^20 tables": (ops.unique_tables, lambda: (_keys(), [0, 3], [2**20 - 1], 2**20)),
    "unique_bounded bound 0, no keys": (ops.unique_bounded, lambda: (torch.zeros(0, dtype=L), 0, True)),
    "unique_bounded bound 2^20": (ops.unique_bounded, lambda: (_keys(), 2**20, False)),
    "segment_sum_parts one 1-D part": (ops.segment_sum_parts, lambda: ([torch.ones(3)], torch.zeros(3, dtype=L), 1)),
    "segment_sum_parts empty parts": (ops.segment_sum_parts,
                                      lambda: ([torch.ones(0, 2).half(), torch.ones(2, 2).half()],
                                               torch.zeros(2, dtype=torch.int32), 1)),
    "key_seeded_uniform bfloat16": (ops.key_seeded_uniform, lambda: (_keys(), 2, 0, -1.0, 1.0, torch.bfloat16)),
    "hash_table_insert_absent_ exact fit": (ops.hash_table_insert_absent_,
                                            lambda: (*_slots(16), _keys(), torch.arange(3), 13)),
    "hash_table_find 1 slot": (ops.hash_table_find, lambda: (*_slots(1), _keys(torch.int32))),
    "hash_table_place_tables_ exact fit": (ops.hash_table_place_tables_, lambda: _place(sizes=(1,))),
    "hash_table_score_tables_ two tables": (ops.hash_table_score_tables_, lambda: _score(offsets=(0, 0, 3), tables=2)),
    "lazy_adam_tables_ bfloat16 weight": (ops.lazy_adam_tables_,
                                          lambda: _adam_tables(weight=torch.zeros(4, 2).bfloat16())),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_the_fake_takes_what_the_cpu_kernel_takes(case):
    op, make_args = ACCEPTED[case]
    real = op(*make_args())
    fake = _run_fake(op, make_args())
    if real is None:  # an op in place
        assert fake is None
        return
    for r, f in zip(*((out if isinstance(out, tuple) else (out,)) for out in (real, fake))):
        assert r.dtype == f.dtype and r.dim() == f.dim()
        assert all(not isinstance(s, int) or s == t for s, t in zip(f.shape, r.shape))


_MULTI_TABLE = {
    "unique_tables": lambda d: (ops.unique_tables, (_keys().to(d), [0, 3], [0], 1)),
    "segment_sum_parts": lambda d: (ops.segment_sum_parts, ([torch.ones(3, 2, device=d)], torch.zeros(3, dtype=L,
                                                                                                     device=d), 2)),
    "hash_table_find_tables": lambda d: (ops.hash_table_find_tables,
                                         ([_slots()[0].to(d)], [_slots()[1].to(d)], _keys().to(d), [0, 3])),
    "hash_table_score_tables_": lambda d: (ops.hash_table_score_tables_, _map(_score(), lambda t: t.to(d))),
    "hash_table_place_tables_": lambda d: (ops.hash_table_place_tables_, _map(_place(), lambda t: t.to(d))),
    "lazy_adam_tables_": lambda d: (ops.lazy_adam_tables_, _map(_adam_tables(), lambda t: t.to(d))),
}


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build of torch")
@pytest.mark.parametrize("name", sorted(_MULTI_TABLE))
def test_the_multi_table_ops_trace_and_run_on_cuda(name):
    """Their CUDA kernels are composites of the per-table CUDA ops (sparsekit/tables_cuda.py):
    the fakes trace CUDA tensors as they trace CPU ones (outputs on the inputs' device, with
    the CPU fake's dtypes and ranks; they used to refuse CUDA), and with a GPU the op runs
    and gives the CPU kernel's results."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FakeTensorMode(shape_env=ShapeEnv()):
            op, args = _MULTI_TABLE[name]("cuda")
            fake = op(*args)
            op, args = _MULTI_TABLE[name]("cpu")
            fake_cpu = op(*args)
    if fake is None:
        assert fake_cpu is None
    else:
        for f, c in zip(*((out if isinstance(out, tuple) else (out,)) for out in (fake, fake_cpu))):
            assert f.device.type == "cuda" and f.dtype == c.dtype and f.dim() == c.dim()
    if torch.cuda.is_available():
        op, cuda_args = _MULTI_TABLE[name]("cuda")
        op, cpu_args = _MULTI_TABLE[name]("cpu")
        got, expected = op(*cuda_args), op(*cpu_args)
        got, expected = (cuda_args, cpu_args) if got is None else (got, expected)  # in place: the arguments
        if name != "hash_table_place_tables_":  # its slots may differ where keys collide (the rows do not)
            assert_equal_nested(_map(got, lambda t: t.cpu()), expected)


def test_segment_sum_parts_refuses_a_0d_first_part_clearly():
    """A 0-d data[0] has no row shape (the kernel's message was torch's "HeaderOnlyArrayRef:
    invalid slice"); the kernel and the fake name the argument."""
    with pytest.raises(RuntimeError, match=r"segment_sum_parts: data\[0\] must have at least one dimension"):
        _run_fake(ops.segment_sum_parts, ([torch.ones(())], torch.zeros(1, dtype=L), 2))
    with pytest.raises(RuntimeError, match=r"segment_sum_parts: data\[0\] must have at least one dimension"):
        ops.segment_sum_parts([torch.ones(())], torch.zeros(1, dtype=L), 2)


def test_meta_tensors_reach_the_same_checks():
    """A meta tensor runs the fake too (without a shape environment)."""
    with pytest.raises(RuntimeError, match=r"select_smallest: k=4 but .*only 3"):
        ops.select_smallest([torch.arange(3, device="meta")], _BOOL.to("meta"), 4)
    with pytest.raises(RuntimeError, match=r"unique_tables: offsets must run from 0 to 3"):
        ops.unique_tables(_keys().to("meta"), [0, 2], [0], 1)
    with pytest.raises(RuntimeError, match=r"key_seeded_uniform: dtype must be float32"):
        ops.key_seeded_uniform(_keys().to("meta"), 2, 0, -0.05, 0.05, torch.float8_e4m3fn)


def _never_run(graph, example_inputs):
    """A torch.compile backend whose graphs return a placeholder without running the ops:
    an error can then only come from tracing (the fakes)."""
    return lambda *args: (torch.zeros(2, dtype=L),)


@pytest.mark.parametrize("columns, k, pattern", [
    ([torch.ones(3)], 2, r"select_smallest: columns\[0\] must be int64"),
    ([torch.arange(3)], 4, r"select_smallest: k=4 but .*only 3"),
])
def test_the_wrapper_refuses_while_torch_compile_traces(columns, k, pattern):
    torch._dynamo.reset()

    @torch.compile(backend=_never_run, fullgraph=True)
    def pick(columns, eligible):
        return sk.ops.select_smallest(columns, eligible, k)

    try:
        with pytest.raises(Exception, match=pattern):
            pick(columns, _BOOL)
    finally:
        torch._dynamo.reset()


# ---- key_seeded_uniform: bounds beyond float64 ------------------------------------------------


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(low=-10**400), r"key_seeded_uniform: low must be finite and lie in torch\.float32's finite range "
                         r"\[-3\.4028234663852886e\+38, 3\.4028234663852886e\+38\], got -1e\+400"),
    (dict(high=10**400, dtype=torch.float16), r"key_seeded_uniform: high must be finite and lie in torch\.float16's "
                                              r"finite range \[-65504\.0, 65504\.0\], got 1e\+400"),
    (dict(low=-(10**5000), dtype=torch.float64), r"key_seeded_uniform: low must be finite .*got -1e\+5000"),
    (dict(low=np.int64(0), high=10**309), r"key_seeded_uniform: high must be finite"),
])
def test_key_seeded_uniform_names_a_bound_beyond_float64(kwargs, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        sk.ops.key_seeded_uniform(torch.tensor([1, 2]), 3, **kwargs)


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max, reason="longdouble is float64 here")
def test_key_seeded_uniform_names_a_long_double_beyond_float64():
    with pytest.raises(RuntimeError, match=r"key_seeded_uniform: high must be finite and lie in"):
        sk.ops.key_seeded_uniform(torch.tensor([1, 2]), 3, high=np.longdouble("1e400"))


def test_key_seeded_uniform_still_takes_large_ints_within_range():
    rows = sk.ops.key_seeded_uniform(torch.tensor([1, 2]), 3, low=-(10**300), high=10**300, dtype=torch.float64)
    assert rows.dtype == torch.float64 and bool(rows.isfinite().all())
    with pytest.raises(RuntimeError, match=r"key_seeded_uniform: need finite low <= high"):
        sk.ops.key_seeded_uniform(torch.tensor([1, 2]), 3, low=float("-inf"))


# ---- HashTable: bool flags -----------------------------------------------------------------


@pytest.mark.parametrize("flag", [1, 0, None, "yes", np.bool_(True), torch.tensor(True)])
def test_hash_table_insert_refuses_a_flag_that_is_not_a_bool(flag):
    table = sk.HashTable(8)
    with pytest.raises(TypeError, match=r"HashTable\.insert: return_evicted must be a bool, got"):
        table.insert(torch.tensor([1, 2]), return_evicted=flag)
    assert len(table) == 0 and table.find(torch.tensor([1])).item() == -1  # nothing inserted


def test_hash_table_insert_takes_bools():
    table = sk.HashTable(2, eviction="lru")
    assert table.insert(torch.tensor([1, 2]), return_evicted=False).tolist() == [0, 1]
    table.tick()
    rows, evicted_keys, evicted_rows = table.insert(torch.tensor([3]), return_evicted=True)
    assert rows.tolist() == [0] and evicted_keys.tolist() == [1] and evicted_rows.tolist() == [0]


# ---- Criteo reader: plain decimal counts --------------------------------------------------------


def _criteo_line(count):
    dense = ["5", "", "-1", "0"] + [""] * (NUM_DENSE - 4)
    dense[1] = count
    return "\t".join(["1"] + dense + ["68fd1e64"] * NUM_SLOTS)


@pytest.mark.parametrize("count", ["1_000", "+5", " 5", "5 ", "\v5", "1__0", "-", "+-1", "--1", "0x10", "1e3"])
def test_criteo_reader_refuses_counts_that_are_not_plain_decimals(tmp_path, count):
    """int() reads "1_000", "+5" and " 5"; Criteo's counts are plain decimals (maybe negative)."""
    path = tmp_path / "day.tsv"
    good = _criteo_line("3")
    path.write_text("\n".join([good, good, _criteo_line(count), good]) + "\n")
    source = CriteoTSV(str(path), eval_samples=0)
    with pytest.raises(CriteoFormatError, match=r"day\.tsv:3: integer feature I2 is not an integer: b'.*'; a count is a "
                                                 r"plain decimal integer"):
        source.train_batch(0, 4)


@pytest.mark.parametrize("count, value", [("7", 7), ("-1", -1), ("-0", 0), ("007", 7), ("", 0),
                                          ("1" + "0" * 20, 1e20), ("-" + "0" * 5000 + "7", -7)])
def test_criteo_reader_takes_plain_decimals(tmp_path, count, value):
    path = tmp_path / "day.tsv"
    path.write_text(_criteo_line(count) + "\n")
    batch = CriteoTSV(str(path), eval_samples=0).train_batch(0, 1)
    assert batch.dense[0, 1].item() == pytest.approx(math.log1p(max(value, 0)), rel=1e-6)


# ---- harness: resume by the table's size --------------------------------------------------------

_TINY = dict(steps=4, batch_size=128, eval_samples=512, eval_every=0, embedding_dim=8, table_rows=1 << 16,
             vocab_per_slot=2000, lr=1e-2, device="cpu", progress=False)


def _tiny(**overrides) -> TrainConfig:
    return TrainConfig(**{**_TINY, **overrides})


@pytest.mark.parametrize("tables", ["shared", "per-slot"])
def test_resume_takes_the_same_capacity_from_either_flag(tmp_path, tables):
    """--table-rows N and --capacity-per-rank N make the same sparsekit table: a checkpoint
    written with one resumes with the other, to the uninterrupted result."""
    straight = train(_tiny(tables=tables, table_rows=8192))
    train(_tiny(tables=tables, steps=2, table_rows=8192, checkpoint_dir=str(tmp_path / "a")))
    resumed = train(_tiny(tables=tables, capacity_per_rank=8192, checkpoint_dir=str(tmp_path / "a"), resume=True))
    assert resumed["resumed_from_step"] == 2 and resumed["logloss"] == straight["logloss"]
    # And back: written with --capacity-per-rank (--table-rows then unused), resumed with --table-rows.
    train(_tiny(tables=tables, steps=2, capacity_per_rank=8192, table_rows=123, checkpoint_dir=str(tmp_path / "b")))
    resumed = train(_tiny(tables=tables, table_rows=8192, checkpoint_dir=str(tmp_path / "b"), resume=True))
    assert resumed["resumed_from_step"] == 2 and resumed["logloss"] == straight["logloss"]


def test_resume_still_refuses_another_capacity(tmp_path):
    train(_tiny(steps=2, table_rows=8192, checkpoint_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"was written with a table capacity per rank of 8192 \(--table-rows "
                                              r"8192; now 4096 from --capacity-per-rank 4096\); resume with"):
        train(_tiny(capacity_per_rank=4096, checkpoint_dir=str(tmp_path), resume=True))
    with pytest.raises(CheckpointError, match=r"was written with a table capacity per rank of 8192 \(--table-rows "
                                              r"8192; now 65536 from --table-rows 65536\), --seed 0 \(now 1\);"):
        train(_tiny(seed=1, checkpoint_dir=str(tmp_path), resume=True))


def test_resume_with_torch_embedding_compares_table_rows(tmp_path):
    train(_tiny(embedding="torch", steps=2, table_rows=8192, checkpoint_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"was written with --table-rows 8192 \(now 4096\)"):
        train(_tiny(embedding="torch", table_rows=4096, checkpoint_dir=str(tmp_path), resume=True))


@pytest.mark.parametrize("bound", [-10**400, 10**5000, 3.5e38], ids=["-1e400", "1e5000", "3.5e38"])
def test_key_seeded_uniform_initializer_refuses_bounds_beyond_float32_by_name(bound):
    """A bound past float32's range (an int beyond float64 included, which math.isfinite
    cannot take and repr cannot show past 4300 digits) is a ValueError naming it."""
    low, high = (bound, 0.0) if bound < 0 else (0.0, bound)
    name = "low" if bound < 0 else "high"
    with pytest.raises(ValueError, match=f"KeySeededUniform: {name} must lie in float32's finite range"):
        sk.KeySeededUniform(0, low, high)


_W, _ROWS, _OFFSETS = torch.randn(4, 2), torch.tensor([0, 1]), torch.tensor([0, 1, 2])
_SLOTS = torch.full((8,), -1, dtype=L)


@pytest.mark.parametrize("call, named", [
    (lambda bad: sk.ops.unique(bad), "unique: keys"),
    (lambda bad: sk.ops.segment_sum(bad, _ROWS, 2), "segment_sum: data"),
    (lambda bad: sk.ops.segment_sum(torch.randn(2, 3), bad, 2), "segment_sum: segment_ids"),
    (lambda bad: sk.ops.segment_mean(bad, _ROWS, 2), "segment_mean: data"),
    (lambda bad: sk.ops.partition_by_owner(bad, 2), "partition_by_owner: keys"),
    (lambda bad: sk.ops.key_seeded_uniform(bad, 3), "key_seeded_uniform: keys"),
    (lambda bad: sk.ops.embedding_bag(bad, _ROWS, _OFFSETS), "embedding_bag: weight"),
    (lambda bad: sk.ops.embedding_bag(_W, bad, _OFFSETS), "embedding_bag: rows"),
    (lambda bad: sk.ops.embedding_bag(_W, _ROWS, bad), "embedding_bag: offsets"),
    (lambda bad: sk.ops.embedding_gather(bad, _ROWS), "embedding_gather: weight"),
    (lambda bad: sk.ops.embedding_gather(_W, bad), "embedding_gather: rows"),
    (lambda bad: sk.ops.select_smallest([_ROWS], bad, 1), "select_smallest: eligible"),
    (lambda bad: sk.ops.select_smallest([bad], torch.ones(2, dtype=torch.bool), 1), r"select_smallest: columns\[0\]"),
    (lambda bad: sk.ops.lazy_adam_(_W, bad, _W.clone(), _ROWS, torch.ones(2, 2), 1, 0.1, 0.9, 0.99, 1e-8),
     "lazy_adam_: exp_avg"),
    (lambda bad: sk.ops.hash_table_find(_SLOTS, _SLOTS.clone(), bad), "hash_table_find: keys"),
    (lambda bad: sk.ops.hash_table_erase_(_SLOTS, bad, _ROWS), "hash_table_erase_: slot_rows"),
])
@pytest.mark.parametrize("bad", [None, [0, 1]])
def test_a_wrapper_names_an_argument_that_is_no_tensor(call, named, bad):
    """None or a list for a tensor argument: the dispatcher's own messages named no
    argument ("Not yet supported ScalarType 46"), or an attribute read raised first."""
    with pytest.raises(TypeError, match=rf"{named} must be a torch.Tensor, got {type(bad).__name__}"):
        call(bad)
    assert torch.equal(_SLOTS, torch.full((8,), -1, dtype=L))


@pytest.mark.parametrize("bad", [[1.0, 1.0], np.ones(2, dtype=np.float32)])
def test_embedding_bag_names_per_sample_weights_that_are_no_tensor(bad):
    """None is its default; a list or array reached the dispatcher ("Expected a value of type
    'Optional[Tensor]'")."""
    with pytest.raises(TypeError, match=r"embedding_bag: per_sample_weights must be a torch.Tensor, got "
                                        r"(list|numpy.ndarray)"):
        sk.ops.embedding_bag(_W, _ROWS, _OFFSETS, bad)


_BUILDERS = {
    "DistributedEmbedding": lambda device: sk.DistributedEmbedding("sum", 4, 2, 1, 2, device=device),
    "All2AllDenseEmbedding": lambda device: sk.All2AllDenseEmbedding(4, 2, 1, 1, device=device),
    "HashTable": lambda device: sk.HashTable(4, device=device),
    "EmbeddingBagCollection": lambda device: sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 4, ["f"])],
                                                                     device=device),
}


@pytest.mark.parametrize("builder", sorted(_BUILDERS))
@pytest.mark.parametrize("device, error, pattern", [
    ("nodevice", ValueError, r"device='nodevice' is not a device"),
    (1.5, TypeError, r"device must be a torch.device, a string, an int or None, got 1.5 \(float\)"),
    (True, TypeError, r"device must be .* got True \(bool\)"),
])
def test_a_layer_or_table_names_a_bad_device(builder, device, error, pattern):
    with pytest.raises(error, match=f"{builder}: {pattern}"):
        _BUILDERS[builder](device)


@pytest.mark.parametrize("builder", sorted(_BUILDERS))
def test_a_cuda_device_without_cuda_is_named(builder):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for device in ("cuda", "cuda:1", 0, torch.device("cuda")):
        with pytest.raises(RuntimeError, match=f"{builder}: device=.* but CUDA is not available"):
            _BUILDERS[builder](device)


@pytest.mark.parametrize("builder", sorted(_BUILDERS))
@pytest.mark.parametrize("device", ["hpu", "xpu", "mps", "privateuseone", "xla"])
def test_a_backend_this_process_lacks_is_named(builder, device):
    """torch refuses these with an AssertionError, a ModuleNotFoundError or a
    NotImplementedError from inside an allocation, naming no argument."""
    try:
        torch.empty(0, device=device)
    except Exception:  # noqa: BLE001
        pass
    else:
        pytest.skip(f"this process has a {device} device")
    with pytest.raises(RuntimeError, match=f"{builder}: device='{device}' is not available in this process"):
        _BUILDERS[builder](device)


def test_hash_table_to_a_backend_this_process_lacks_is_named_and_keeps_the_table():
    table = sk.HashTable(4)
    table.insert(torch.tensor([5]))
    for device in ("hpu", "xpu", "privateuseone"):
        with pytest.raises(RuntimeError, match=f"HashTable.to: device='{device}' is not available"):
            table.to(device)
    assert table.find(torch.tensor([5])).tolist() == [0]


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_layers_and_tables_take_the_devices_torch_takes(device):
    for build in _BUILDERS.values():
        build(device)


@pytest.mark.parametrize("device, error, pattern", [
    (torch.float16, TypeError, r"HashTable.to: device must be a torch.device, a string or an int, got torch.float16"),
    (None, TypeError, r"HashTable.to: device must be .* got None"),
    ("bogus", ValueError, r"HashTable.to: device='bogus' is not a device"),
])
def test_hash_table_to_names_what_is_not_a_device(device, error, pattern):
    table = sk.HashTable(4)
    table.insert(torch.tensor([5]))
    with pytest.raises(error, match=pattern):
        table.to(device)
    assert table.find(torch.tensor([5])).tolist() == [0]


def test_sizes_take_numpy_integers_and_refuse_other_types_with_type_errors():
    """Sizes and counts of the layers, HashTable and TableConfig: NumPy integers are ints (as
    nn.EmbeddingBag and nn.Linear take them); a str, float or bool is a TypeError naming the
    argument; an int out of range a ValueError."""
    layer = sk.DistributedEmbedding("sum", np.int64(10), np.int32(4), np.int64(2), np.int64(3),
                                    admit_after=np.int64(2), admission_capacity=np.int16(5), max_feature_num=np.int8(6))
    assert all(type(v) is int for v in (layer.max_vocabulary_size_per_gpu, layer.embedding_vec_size, layer.slot_num))
    assert sk.All2AllDenseEmbedding(np.uint8(10), 4, np.int64(1), np.int64(2)).nnz_per_slot == 2
    assert sk.HashTable(np.int64(10)).capacity == 10
    assert sk.HashTable(3).export(min_last_seen=np.int64(0))[0].numel() == 0
    for make, error, message in [
        (lambda: sk.DistributedEmbedding("sum", "10", 4, 1, 1), TypeError,
         r"DistributedEmbedding: max_vocabulary_size_per_gpu must be an int, got '10' \(str\)"),
        (lambda: sk.DistributedEmbedding("sum", 10, 4.0, 1, 1), TypeError,
         r"DistributedEmbedding: embedding_vec_size must be an int, got 4.0 \(float\)"),
        (lambda: sk.DistributedEmbedding("sum", 10, 4, 1, 1, admit_after=True), TypeError,
         "DistributedEmbedding: admit_after must be an int, got True"),
        (lambda: sk.DistributedEmbedding("sum", 10, 4, 1, 1, admission_capacity=0), ValueError,
         "DistributedEmbedding: admission_capacity must be a positive int or None, got 0"),
        (lambda: sk.All2AllDenseEmbedding(10, 4, 0, 1), ValueError,
         "All2AllDenseEmbedding: slot_num must be a positive int, got 0"),
        (lambda: sk.HashTable(2.0), TypeError, r"HashTable: capacity must be an int, got 2.0 \(float\)"),
        (lambda: sk.HashTable(-1), ValueError, "HashTable: capacity must be a positive int, got -1"),
        (lambda: sk.HashTable(0), ValueError, "HashTable: capacity must be a positive int, got 0"),
        (lambda: sk.DistributedEmbedding("sum", 10, 4, 1, 1).export(min_last_seen="a"), TypeError,
         "DistributedEmbedding.export: min_last_seen must be an int or None, got 'a'"),
    ]:
        with pytest.raises(error, match="^" + message):
            make()


@pytest.mark.parametrize("value", [torch.tensor([3]), torch.tensor([[3]]), torch.tensor([2**63], dtype=torch.uint64)])
def test_an_integer_argument_is_not_a_tensor_of_one_element(value):
    """A 0-d integer tensor passes as an int; a tensor of shape [1] (or [1, 1]) does not, as a
    numpy array of shape [1] does not: a TypeError naming the argument, not torch's overflow
    error for a uint64 past int64."""
    with pytest.raises(TypeError, match=r"HashTable: capacity must be an int, got tensor"):
        sk.HashTable(value)
    with pytest.raises(TypeError, match=r"hash_value: seed must be an int, got tensor"):
        sk.hashing.hash_value("a", seed=value)
    assert sk.HashTable(torch.tensor(3)).capacity == 3
    assert sk.hashing.hash_value("a", seed=torch.tensor(2**64 - 1, dtype=torch.uint64)) == \
        sk.hashing.hash_value("a", seed=-1)


def test_in_place_wrappers_refuse_inference_tensors_outside_inference_mode_and_write_nothing():
    """torch's in-place ops refuse to update an inference tensor outside inference mode; the
    kernels, which such a tensor reaches with no autograd key in front, wrote it silently."""
    with torch.inference_mode():
        weight, exp_avg, exp_avg_sq = torch.randn(10, 4), torch.zeros(10, 4), torch.zeros(10, 4)
        slot_keys = torch.zeros(16, dtype=torch.int64)
        slot_rows = torch.full((16,), -1, dtype=torch.int64)
    before = [t.clone() for t in (weight, exp_avg, exp_avg_sq, slot_keys, slot_rows)]
    with pytest.raises(RuntimeError, match=r"lazy_adam_: weight was made under torch.inference_mode\(\)"):
        sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, torch.tensor([1]), torch.ones(1, 4), 1, 0.1, 0.9, 0.999,
                          1e-8, 0.0)
    with pytest.raises(RuntimeError, match=r"hash_table_insert_absent_: slot_keys was made under"):
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.tensor([5]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"hash_table_erase_: slot_rows was made under"):
        sk.ops.hash_table_erase_(slot_keys, slot_rows, torch.tensor([5]))
    for old, new in zip(before, (weight, exp_avg, exp_avg_sq, slot_keys, slot_rows)):
        assert torch.equal(old, new)
    with torch.inference_mode():  # inside inference mode they are ordinary in-place updates
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.tensor([5]), torch.tensor([0]))
        sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, torch.tensor([1]), torch.ones(1, 4), 1, 0.1, 0.9, 0.999,
                          1e-8, 0.0)
    assert sk.ops.hash_table_find(slot_keys, slot_rows, torch.tensor([5])).tolist() == [0]


@pytest.mark.parametrize("build", [
    lambda v: sk.DistributedEmbedding("sum", 16, 4, 2, 3, admit_after=v),
    lambda v: sk.All2AllDenseEmbedding(16, 4, 2, 3, admit_after=v),
    lambda v: sk.TableConfig("t", 4, 16, ["f"], admit_after=v),
], ids=["DistributedEmbedding", "All2AllDenseEmbedding", "TableConfig"])
@pytest.mark.parametrize("value", [2**63, 2**64, 10**30])
def test_admit_after_beyond_int64_is_refused_where_it_is_given(build, value):
    """admit_after is compared with int64 step counts: one past int64 was taken by the
    constructors and then failed in the first training forward with a bare "OverflowError:
    int too big to convert"."""
    with pytest.raises(ValueError, match=r"admit_after must be at most 9223372036854775807"):
        build(value)
    build(2**63 - 1)  # the largest int64 is a (never-reached) admission threshold


@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
def test_lazy_adam_refuses_a_setting_beyond_float64_where_it_is_given(name):
    """A Python int past float64 passed the >= 0 check, and the first step died with a bare
    "OverflowError: int too large to convert to float" after creating optimizer state."""
    param = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=rf"LazyAdam: invalid .*{name} .*float64 can hold"):
        sk.LazyAdam([param], **{name: 10**400})
    opt = sk.LazyAdam([param])
    opt.param_groups[0][name] = 10**400  # edited later: refused by the step's checks, state untouched
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match=rf"LazyAdam.step .*{name}"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(param, torch.zeros(2))
    with pytest.raises(ValueError, match=r"LazyAdam: invalid learning rate lr -<an int of \d+ bits>"):
        sk.LazyAdam([param], lr=-10**5000)  # too long for a decimal string


def test_save_checkpoint_names_an_empty_or_uncreatable_directory(tmp_path):
    model = sk.DistributedEmbedding("sum", 16, 4, 2, 3)
    for call in (sk.save_checkpoint, sk.load_checkpoint):
        with pytest.raises(ValueError, match=rf"{call.__name__}: directory must not be an empty path"):
            call("", model)
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"save_checkpoint: directory .* is a file"):
        sk.save_checkpoint(str(blocked / "sub"), model)
    with pytest.raises(FileNotFoundError, match=r"save_checkpoint: cannot create the checkpoint directory in "
                                                r"'/proc/self/nonexistent/x'"):
        sk.save_checkpoint("/proc/self/nonexistent/x", model)

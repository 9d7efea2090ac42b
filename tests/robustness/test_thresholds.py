"""Every size threshold / algorithm switch of the CPU kernels and of the Python layer's
size-based choices, run at boundary - 1, boundary, boundary + 1 and well past it, with
adversarial keys (INT64_MIN / INT64_MAX / -1 / 0, all equal, all distinct, multiples of a
power of two, Zipf, keys whose hashes collide in the low bits -- one home slot, with the
probe wrapping round the table's end -- or in the high bits -- one partition bucket),
at 1 and 2 (sometimes 3) threads, against plain-torch references.

The property tests (tests/support/properties.py) draw sizes near these edges; here each edge is hit
exactly, once, deterministically. Thresholds (file:line, value) -> test:

unique (csrc/cpu/unique_cpu.cpp)
  :44  kMinChunk 2^16 keys per initial range (2 ranges from 2^17 at 2 threads)  test_unique_sizes
  :51  kMinSketched 2^14 (length-sized tables below, HyperLogLog estimate above)  test_unique_sizes
  :54  kSampleBlock 64, every 16th / 64th block sampled               test_unique_fooled_sketch
  :57  kMinPartitioned 2^18 with 4 * expected > n (partitioned path)  test_unique_sizes
  :59  kScanGrain 2^14 (merge blocks, count walk, inverse remap)      test_unique_sizes
  :260/:266 table fill 3/4 (growth) / sized at 60%; rehash          test_unique_fooled_sketch
  :432/:434 kClaimBlock 2^13, kMinSplit 2^16; :481 splits iff 4 * expected <= n  test_unique_sizes
  :559 int32 ids below 2^31 keys (the int64 path is not testable here)
unique_partitioned.h
  :44-45 kBucketKeys 2^15, bucket bits 1..12 (3 -> 4 bits at n = 2^18 + 8)  test_unique_partitioned_bucket_bits
  :47-48 4 blocks per thread, at most 64                            test_unique_partitioned_bucket_bits (3 threads)
  :126/:188 bucket table growth past the even-spread guess           test_unique_partitioned_one_bucket
  :232 pass E grain 2^16
unique_tables (unique_cpu.cpp:572-694): scratch table 16 slots up to 9 keys, remap grain 2^14  test_unique_tables
unique_bounded (unique_bounded_cpu.cpp)
  :38  kKeyGrain 2^15 (workers, counting-sort parts)                test_unique_bounded_boundaries
  :44  kWordGrain 2^12 words (bound + 1 > 2^18 bits), word edges at 64  test_unique_bounded_boundaries
  :40/:42 kCountBlock 64, kScatterAhead 16 (group)
ops._bitmap_numbers (ops._number_rows, shard._distinct_sorted_rows, optim._sum_repeated_rows):
  bitmap iff rows <= 128 * nnz + 2^16                               test_row_gradient_bitmap_vs_hash, test_distinct_sorted_rows,
                                                                    test_repeated_rows_are_summed_alike_on_both_paths
ops/_embedding_backward.py _lookup_dots chunks of 2^20 // D lookups                 test_per_sample_weight_gradient_chunks
segment_sum (csrc/cpu/segment_cpu.cpp)
  :242 one thread below n * D < 2^15                                test_segment_sum_boundaries
  :41  kLanes 16 (add_row tail), :63 float16 blocks of 64 (+ F16C 8)  test_segment_sum_boundaries
  :43  kListRows 2048, :45 kSampleIds 4096                           test_segment_sum_boundaries
  :249 column blocks when segment ranges < threads (one hot segment)  test_segment_sum_boundaries
  accumulate_unit_of_width: float32 widths 16 / 32 / 64 / 128 at compile time, others not
                                                                    test_segment_sum_property_matches_index_add,
                                                                    test_segment_sum_column_blocks_few_segments
embedding_bag / gather (csrc/cpu/embedding_cpu.cpp)
  :687 AVX-512 iff D % (64 / sizeof(acc)) == 0; passes of 16/8/4/2/1 vectors + tail
                                                                    test_embedding_bag_dims (and under avx2 / default)
  gather: prefetch_distance by row bytes (64, 256); pooling: 256 / lines of the column pass
  ahead, in [16, 64] (1-4 lines 64, 8 lines 32, 16 lines 16); every loop
  split where the last lookup comes into reach (nnz - distance)    test_embedding_bag_dims, test_pooling_loops_read_no_id_past_the_end
  :714 bag chunks of 2^16 accumulated elements (long bags)           test_embedding_bag_long_bags
  :286 kStreamOutputBytes 4 MiB of output in whole 64-byte rows: streaming stores
                                                                    test_embedding_bag_streamed_outputs
  :100-102 prefetch plans (prefetch_plan.h): the first line 16 ahead for passes of >= 8 lines;
  chosen by timing for >= 32 MiB of rows on >= 2 threads; :670-671 skewed rows (> 8 repeats
  in 256 sampled lookups) keep every line                           test_embedding_bag_prefetch_plans,
                                                                    test_embedding_bag_chosen_prefetch_plans
                                                                    (and csrc/test/prefetch_plan_test.cpp)
  :946 gather chunks of 2^18 bytes                                   test_embedding_gather_chunks
lazy_adam (csrc/cpu/lazy_adam_cpu.cpp)
  :30/:43 SSE2 widths 4 / 2 with scalar tails                        test_lazy_adam_dims
  :158 strictly ascending rows pass the repeated-row check unsorted  test_op_repeated_rows_raise_and_write_nothing
  :160 repeated-row check by bitmap iff R <= 128 * u + 2^16, else sort  test_lazy_adam_repeat_check_paths
  :163/:187 check grain 2^14, :245 update grain 16384 / D            test_lazy_adam_grains
  :128 prefetch 32 / (lines of a row) rows ahead, in [4, 32]        test_guard_pages.py::test_lazy_adam (n 1000)
  :407 tables: grain 16384 / max D, half rows widened 8 at a time    test_lazy_adam_tables
select_smallest (csrc/cpu/select_cpu.cpp, csrc/select.h)
  :163 chunks of 2^14, at most 4 * threads; :166 list once bucket * 2 <= n  test_select_smallest_boundaries
  select.h:32 16-bit digits (a bucket spanning 2^16 vs 2^16 + 1 values), :72 narrower last digit
hash table (csrc/cpu/hashtable_cpu.cpp, sparsekit/hashtable.py)
  :18  kHashGrain 4096 keys; :28 find and place prefetch from 2^17 slots (capacity 2^15 + 1),
  :25  64 keys ahead; :32 score prefetch from 2^16 rows; hashtable.py:44 slots >= 2 * capacity, >= 16  test_hash_table_boundaries
  (the key reads 64 ahead stop at the keys' end: test_guard_pages.py::test_hash_table_prefetching_paths)
  hashtable.py:409 rebuild once tombstones * 4 > slots                test_hash_table_eviction_model
partition_by_owner (csrc/cpu/routing_cpu.cpp)
  :20  2^14 keys per chunk, chunks <= 4 n / world_size; world_size 1 path  test_partition_by_owner
exchange.py:145/:162 numpy packed sort up to 50,000 rows and |value| < 2^(62 - bits)  test_sort_rows
exchange.py:173 _GATHER_MIN_BYTES 256 KiB (sparsekit gather vs index_select)  test_layer_gather_threshold
parallel.h:35/:60 inline when n <= grain or one thread; :183 scan blocks of 2^12 columns;
  :152 chunk shares of 1/workers, the back half stolen  test_parallel.py::test_every_chunk_runs_once_whoever_takes_it
  (group_by_key with more than 4096 distinct keys: test_unique_bounded_boundaries)
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import sparsekit as sk
from sparsekit import exchange, ops, shard

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.fixture(params=[1, 2])
def threads(request):
    torch.set_num_threads(request.param)
    return request.param


# ---- helpers ----------------------------------------------------------------------------

_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(keys: np.ndarray) -> np.ndarray:
    """sparsekit's key hash (csrc/common.h mix_key), vectorised."""
    z = keys.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def unmix(hashes: np.ndarray) -> np.ndarray:
    """Keys whose hash is ``hashes`` (mix_key is a bijection)."""
    def unshift(y, s):
        x = y.copy()
        for _ in range(64 // s + 1):
            x = y ^ (x >> np.uint64(s))
        return x

    h = np.asarray(hashes, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = unshift(h, 31) * np.uint64(pow(_C2, -1, 1 << 64))
        z = unshift(z, 27) * np.uint64(pow(_C1, -1, 1 << 64))
        z = unshift(z, 30)
    return z.view(np.int64)


def low_colliding(n: int, seed: int, low_bits: int = 20) -> torch.Tensor:
    """n distinct keys whose hashes end in low_bits one bits: one home slot (the last) in any
    table of up to 2^low_bits slots, so probes run long and wrap round to slot 0."""
    rng = np.random.default_rng(seed)
    high = np.unique(rng.integers(0, 1 << (64 - low_bits), 2 * n, dtype=np.uint64))[:n]
    keys = unmix((high << np.uint64(low_bits)) | np.uint64((1 << low_bits) - 1))
    assert ((mix(keys) & np.uint64((1 << low_bits) - 1)) == np.uint64((1 << low_bits) - 1)).all()
    return torch.from_numpy(keys.copy())[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def high_colliding(n: int, seed: int, high_bits: int = 16) -> torch.Tensor:
    """n distinct keys whose hashes share their top high_bits bits: one partition bucket."""
    rng = np.random.default_rng(seed)
    low = np.unique(rng.integers(0, 1 << (64 - high_bits), 2 * n, dtype=np.uint64))[:n]
    keys = unmix((np.uint64(0xABCD) << np.uint64(64 - high_bits)) | low)
    return torch.from_numpy(keys.copy())[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def key_cases(n: int, seed: int):
    """Adversarial int64 key sets of length n."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
    cases = {
        "all_int64_min": torch.full((n,), INT64_MIN),
        "extremes": torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1, -2])[torch.randint(0, 6, (n,), generator=g)],
        "all_distinct": torch.randperm(n, generator=g) * 7919 - n,
        "pow2_multiples": torch.randint(0, max(1, n // 3), (n,), generator=g) << 40,
        "zipf": u.pow(-5.0).floor().clamp_max(2**40).long() * -7046029254386353131,
        "half_repeated": rand[torch.randint(0, max(1, n // 2), (n,), generator=g)],
        "mixed_wide": torch.cat([torch.randint(-500, 500, (n - n // 5,), generator=g), rand[: n // 5]])[
            torch.randperm(n, generator=g)],
    }
    if n >= 8:
        collide = low_colliding(min(1500, n // 4), seed)
        keys = rand.clone()
        at = torch.randperm(n, generator=g)[: 2 * collide.numel()]
        keys[at] = torch.cat([collide, collide])
        cases["low_hash_collisions"] = keys
    return cases


def unique_reference(keys: torch.Tensor):
    """torch.unique (sorted), re-mapped to order of first occurrence."""
    flat = keys.reshape(-1)
    s, inv, cnt = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
    first = torch.full((s.numel(),), flat.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(flat.numel()), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return s[order], rank[inv].reshape(keys.shape), cnt[order]


def assert_unique(keys: torch.Tensor, what: str) -> None:
    got = ops.unique(keys, return_inverse=True, return_counts=True)
    want = unique_reference(keys)
    for name, a, b in zip(("unique_keys", "inverse", "counts"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name} differs"


# ---- unique -----------------------------------------------------------------------------

UNIQUE_SIZES = [(1 << 14) - 1, 1 << 14, (1 << 14) + 1,  # kMinSketched
                (1 << 17) - 1, 1 << 17, (1 << 17) + 1,  # 2 initial ranges at 2 threads (kMinChunk)
                (1 << 18) - 1, 1 << 18, (1 << 18) + 1]  # kMinPartitioned


@pytest.mark.parametrize("n", UNIQUE_SIZES)
def test_unique_sizes(n, threads):
    for name, keys in key_cases(n, seed=n).items():
        assert_unique(keys, f"n={n} {name} threads={threads}")


def test_unique_three_ranges_and_int32():
    """3 threads: 3 initial ranges from 3 * 2^16 keys; int32 keys on both paths."""
    torch.set_num_threads(3)
    for n in (3 * (1 << 16) - 1, 3 * (1 << 16), (1 << 18) + 1):
        g = torch.Generator().manual_seed(n)
        assert_unique(torch.randint(-50_000, 50_000, (n,), generator=g), f"repeated n={n}")
        keys32 = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
        keys32[:4] = torch.tensor([-(2**31), 2**31 - 1, -1, 0], dtype=torch.int32)
        assert_unique(keys32, f"int32 n={n}")


@pytest.mark.parametrize("threads_", [1, 2, 3])
def test_unique_partitioned_bucket_bits(threads_):
    """Bucket bits go 3 -> 4 between n = 2^18 + 7 and 2^18 + 8 (n >> bits > 2^15), 4 -> 5 at
    2^19 + 16; blocks of positions: 4 per thread (12 at 3 threads, not a power of two)."""
    torch.set_num_threads(threads_)
    for n in ((1 << 18) + 7, (1 << 18) + 8, (1 << 19) + 15, (1 << 19) + 16):
        g = torch.Generator().manual_seed(n)
        keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
        keys[torch.randint(0, n, (n // 10,), generator=g)] = keys[: n // 10].clone()  # some repeats
        keys[-3:] = torch.tensor([INT64_MIN, INT64_MAX, -1])
        assert_unique(keys, f"n={n}")


def test_unique_partitioned_one_bucket(threads):
    """Distinct keys whose hashes share the top 16 bits all land in one bucket: its table
    grows far past the even-spread guess."""
    keys = high_colliding((1 << 18) + 1, seed=threads)
    keys = torch.cat([keys, keys[::9]])
    assert_unique(keys, "one bucket")


@pytest.mark.parametrize("n", [(1 << 17) + 1, (1 << 18) + 1])
def test_unique_fooled_sketch(n, threads):
    """The distinct-count estimate reads blocks of 64 keys every 1024: make those blocks one
    key and the rest distinct (estimate ~1: tables grow many times, splits allowed), and the
    reverse (estimate ~n: the partitioned path with one key repeated)."""
    pos = torch.arange(n)
    sampled = (pos % 1024) < 64
    distinct = torch.randperm(n, generator=torch.Generator().manual_seed(n)) * 7919 + 11
    assert_unique(torch.where(sampled, torch.tensor(INT64_MIN), distinct), "sample all equal")
    assert_unique(torch.where(sampled, distinct, torch.tensor(-1)), "sample all distinct")


def test_unique_probe_wraps_round_the_table(threads):
    """Keys hashing to one home slot, the table's last: every probe wraps to slot 0."""
    for n in (15, 16, 17, 2000):
        keys = low_colliding(n, seed=n)
        assert_unique(torch.cat([keys, keys.flip(0)[: n // 2], keys[:1]]), f"n={n}")


# ---- unique_tables ----------------------------------------------------------------------

def unique_tables_reference(keys, offsets, tables, num_tables):
    per = [dict() for _ in range(num_tables)]
    values = keys.tolist()
    for s, t in enumerate(tables):
        for i in range(offsets[s], offsets[s + 1]):
            per[t].setdefault(values[i], len(per[t]))
    base = [0]
    for d in per:
        base.append(base[-1] + len(d))
    inverse = [0] * len(values)
    for s, t in enumerate(tables):
        for i in range(offsets[s], offsets[s + 1]):
            inverse[i] = base[t] + per[t][values[i]]
    return (torch.tensor([k for d in per for k in d], dtype=keys.dtype), torch.tensor(inverse, dtype=torch.int64),
            torch.tensor([len(d) for d in per], dtype=torch.int64))


@pytest.mark.parametrize("segments, tables, num_tables", [
    ([(1 << 14) - 1], [0], 1), ([1 << 14], [0], 1), ([(1 << 14) + 1], [0], 2),  # remap grain
    ([0, 1, 9, 10, 11, 16, 17], [0, 1, 2, 3, 4, 5, 6], 8),  # scratch table 16 -> 32 slots at 10 keys
    ([5000, 3000, 5000, 3385], [1, 0, 1, 2], 3),  # a table over two segments, out of order
    ([8192, 8193, 1, 0], [2, 2, 0, 1], 3),
])
def test_unique_tables(segments, tables, num_tables, threads):
    offsets = np.concatenate([[0], np.cumsum(segments)]).tolist()
    n = offsets[-1]
    for name, keys in key_cases(n, seed=n + len(segments)).items():
        got = torch.ops.sparsekit.unique_tables(keys, offsets, tables, num_tables)
        want = unique_tables_reference(keys, offsets, tables, num_tables)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"{name} {segments}"
    keys32 = torch.randint(-3, 3, (n,), dtype=torch.int32)
    got = torch.ops.sparsekit.unique_tables(keys32, offsets, tables, num_tables)
    assert all(torch.equal(a, b) for a, b in zip(got, unique_tables_reference(keys32, offsets, tables, num_tables)))


# ---- unique_bounded and the row numbering of embedding gradients --------------------------

def check_bounded(keys, bound, group):
    got = torch.ops.sparsekit.unique_bounded(keys, bound, group)
    s, inv, cnt = torch.unique(keys.reshape(-1), sorted=True, return_inverse=True, return_counts=True)
    assert torch.equal(got[0], s) and torch.equal(got[1].reshape(-1), inv)
    if group:
        assert torch.equal(got[2], torch.cat([torch.zeros(1, dtype=torch.int64), cnt.cumsum(0)]))
        assert torch.equal(got[3], torch.sort(inv, stable=True).indices)


@pytest.mark.parametrize("n", [1, (1 << 15) - 1, 1 << 15, (1 << 15) + 1, 3 * (1 << 15) + 7])
def test_unique_bounded_boundaries(n, threads):
    g = torch.Generator().manual_seed(n)
    for bound in (0, 1, 63, 64, 65, (1 << 18) - 2, (1 << 18) - 1, 1 << 18, (1 << 18) + 1):
        edges = torch.tensor(sorted({v for v in (-1, 0, 62, 63, 64, bound - 64, bound - 2, bound - 1)
                                     if -1 <= v < bound}))
        cases = [edges[torch.randint(0, edges.numel(), (n,), generator=g)],
                 torch.randint(-1, max(bound, 0), (n,), generator=g),
                 torch.full((n,), bound - 1)]
        for c, keys in enumerate(cases):
            dtype = torch.int32 if (c + bound) % 2 else torch.int64
            check_bounded(keys.to(dtype), bound, group=(c + n) % 2 == 0 or bound > 1 << 17)


@pytest.mark.parametrize("mode, weighted, padding_idx", [
    ("sum", False, None), ("sum", True, -1), ("mean", False, 0), ("mean", True, None), ("max", False, -1)])
def test_row_gradient_bitmap_vs_hash(mode, weighted, padding_idx, threads):
    """ops._bitmap_numbers: the bitmap (unique_bounded) numbers a gradient's rows while the table has
    at most 128 * nnz + 2^16 rows, else the hash + sort path: both give the same coalesced,
    ascending sparse gradient as a dense reference."""
    for nnz in (1, 5):
        boundary = 128 * nnz + (1 << 16)
        for num_rows in (boundary - 1, boundary, boundary + 1):
            g = torch.Generator().manual_seed(num_rows)
            weight = torch.randn(num_rows, 3, generator=g, dtype=torch.float64)
            rows = torch.randint(-1, 50, (nnz,), generator=g)
            rows[0] = num_rows - 1
            if nnz > 2:
                rows[1:3] = torch.tensor([-1, 0])
            offsets = torch.tensor([0, nnz // 2, nnz])
            psw = torch.randn(nnz, generator=g, dtype=torch.float64) if weighted else None
            check_bag_gradient(weight, rows, offsets, psw, mode, padding_idx)


def check_bag_gradient(weight, rows, offsets, psw, mode, padding_idx):
    num_rows, dim = weight.shape
    w1 = weight.clone().requires_grad_()
    p1 = psw.clone().requires_grad_() if psw is not None else None
    out = ops.embedding_bag(w1, rows, offsets, p1, mode, padding_idx)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad(out, [w1] + ([p1] if p1 is not None else []), grad_out)
    # reference: dense, plain torch
    w2 = weight.clone().requires_grad_()
    p2 = psw.clone().requires_grad_() if psw is not None else None
    valid = rows >= 0
    if padding_idx is not None:
        valid &= rows != padding_idx % num_rows
    safe = torch.where(valid, rows, 0)
    bags = offsets.numel() - 1
    bag = torch.repeat_interleave(torch.arange(bags), offsets.diff())
    if mode == "max":
        pooled = [w2[safe[(bag == b) & valid]].max(0).values if bool(((bag == b) & valid).any())
                  else w2[0] * 0 for b in range(bags)]
        want = torch.stack(pooled)
    else:
        scale = valid.to(w2.dtype) if p2 is None else torch.where(valid, p2, 0)
        want = w2.new_zeros(bags, dim).index_add(0, bag, w2[safe] * scale.unsqueeze(1))
        if mode == "mean":
            d = scale.new_zeros(bags).index_add(0, bag, scale)
            want = torch.where((d != 0).unsqueeze(1), want / torch.where(d != 0, d, 1).unsqueeze(1), 0)
    want_grads = torch.autograd.grad(want, [w2] + ([p2] if p2 is not None else []), grad_out)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    gw = grads[0]
    assert gw.is_sparse and gw.is_coalesced()
    idx = gw._indices()[0]
    assert bool((idx[1:] > idx[:-1]).all())
    torch.testing.assert_close(gw.to_dense(), want_grads[0], rtol=1e-9, atol=1e-9)
    if p1 is not None:
        torch.testing.assert_close(grads[1], want_grads[1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_per_sample_weight_gradient_chunks(mode):
    """ops/_embedding_backward.py (_lookup_dots): the per-sample-weight gradient gathers rows in chunks of 2^20 // D."""
    torch.set_num_threads(2)
    dim = 512
    chunk = (1 << 20) // dim
    for nnz in (chunk - 1, chunk, chunk + 1):
        g = torch.Generator().manual_seed(nnz)
        weight = torch.randn(300, dim, generator=g, dtype=torch.float64)
        rows = torch.randint(-1, 300, (nnz,), generator=g)
        offsets = torch.cat([torch.tensor([0]), torch.sort(torch.randint(0, nnz + 1, (30,), generator=g)).values,
                             torch.tensor([nnz])])
        check_bag_gradient(weight, rows, offsets, torch.randn(nnz, generator=g, dtype=torch.float64), mode, None)


def test_distinct_sorted_rows():
    """shard.py:98: the same threshold in the layers' row numbering."""
    for threads_ in (1, 2):
        torch.set_num_threads(threads_)
        for n in (1, 7):
            boundary = 128 * n + (1 << 16)
            for bound in (boundary - 1, boundary, boundary + 1):
                g = torch.Generator().manual_seed(bound)
                rows = torch.cat([torch.tensor([bound - 1, 0]), torch.randint(0, bound, (n,), generator=g)])
                distinct, position = shard._distinct_sorted_rows(rows, bound)
                want, want_position = torch.unique(rows, sorted=True, return_inverse=True)
                assert torch.equal(distinct, want) and torch.equal(position, want_position)


# ---- segment_sum ------------------------------------------------------------------------

def segment_reference(data, ids, num_segments, dtype):
    out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=torch.float64)
    valid = ids >= 0
    return out.index_add_(0, ids[valid].long(), data[valid].double()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segment_sum_boundaries(dtype, threads):
    """Integer-valued data: every sum is exact, so the kernel must match bit for bit."""
    g = torch.Generator().manual_seed(3)
    dims = (1, 15, 16, 17, 33) if dtype == torch.float32 else (7, 8, 9, 63, 64, 65)
    for dim in dims:
        sizes = {(1 << 15) // dim - 1, (1 << 15) // dim, (1 << 15) // dim + 1, 2047, 2048, 2049, 4097}
        for n in sorted(sizes):
            data = torch.randint(-8, 8, (n, dim), generator=g).to(dtype)
            for num_segments, ids in (
                    (1, torch.zeros(n, dtype=torch.int64)),  # one segment: column blocks
                    (3, torch.where(torch.rand(n, generator=g) < 0.3, INT64_MIN, 2)),  # dropped + one hot
                    (1000, torch.randint(-1, 1000, (n,), generator=g)),
                    (1000, (torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-9).pow(-2).floor().long()
                            - 1) % 1000)):  # Zipf
                id_dtype = torch.int32 if (n + num_segments) % 2 else torch.int64
                ids_c = ids.clamp(-(2**31), 2**31 - 1).to(id_dtype)
                got = ops.segment_sum(data, ids_c, num_segments)
                want = segment_reference(data, ids_c, num_segments, dtype)
                assert torch.equal(got, want), (dim, n, num_segments, id_dtype)


def test_segment_sum_parts_boundaries(threads):
    g = torch.Generator().manual_seed(4)
    for dim in (1, 16, 17):
        for sizes in ([0, 5, 2047], [2048, 2049], [(1 << 15) // dim, 1, 0, 3]):
            parts = [torch.randint(-4, 4, (s, dim), generator=g).float() for s in sizes]
            ids = torch.randint(-1, 100, (sum(sizes),), generator=g)
            got = torch.ops.sparsekit.segment_sum_parts(parts, ids, 100)
            assert torch.equal(got, segment_reference(torch.cat(parts), ids, 100, torch.float32))


# ---- embedding_bag / embedding_gather ---------------------------------------------------

EMBEDDING_DIMS = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 127, 128, 129, 255, 256,
                  257, 384, 513]


def bag_reference(weight, rows, offsets, psw, mode, padding_row):
    w = weight.double()
    out = torch.zeros(offsets.numel() - 1, w.shape[1], dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        r = rows[offsets[b]:offsets[b + 1]].long()
        valid = (r >= 0) & (r != padding_row)
        if not bool(valid.any()):
            continue
        x = w[r[valid]]
        if psw is not None:
            x = x * psw[offsets[b]:offsets[b + 1]].double()[valid].unsqueeze(1)
        if mode == "max":
            out[b] = x.max(0).values
        elif mode == "sum":
            out[b] = x.sum(0)
        else:
            d = valid.sum() if psw is None else psw[offsets[b]:offsets[b + 1]].double()[valid].sum()
            out[b] = x.sum(0) / d if d != 0 else 0
    return out


def embedding_bag_dims(dtypes):
    g = torch.Generator().manual_seed(5)
    for dtype in dtypes:
        for dim in EMBEDDING_DIMS:
            weight = torch.randint(-8, 8, (300, dim + 3), generator=g).to(dtype)[:, 1:dim + 1]  # strided rows
            lengths = torch.randint(0, 40, (12,), generator=g)
            lengths[:3] = torch.tensor([0, 1, 120])  # empty, single, longer than every prefetch distance
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            nnz = int(offsets[-1])
            rows = torch.randint(-1, 300, (nnz,), generator=g).to(torch.int32 if dim % 2 else torch.int64)
            psw = torch.randint(-3, 4, (nnz,), generator=g).to(dtype)
            padding = 5 if dim % 3 == 0 else None
            for mode, weights in (("sum", None), ("sum", psw), ("mean", None), ("mean", psw), ("max", None)):
                got = ops.embedding_bag(weight, rows, offsets, weights, mode, padding)
                want = bag_reference(weight, rows, offsets, weights, mode, -7 if padding is None else padding)
                if mode == "mean":
                    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
                    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol)
                else:
                    assert torch.equal(got, want.to(dtype)), (dtype, dim, mode, weights is not None)


def test_embedding_bag_dims():
    """Vector passes of 16/8/4/2/1 accumulators and the scalar tail, the AVX-512 choice (D a
    multiple of 16 float32 / 8 float64 columns), the prefetch distances by row bytes. One
    thread: these few bags make one task whatever the thread count (the long-bag and
    gather tests below split tasks)."""
    torch.set_num_threads(1)
    embedding_bag_dims([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@pytest.mark.skipif(os.environ.get("SPARSEKIT_CPU_CAPABILITY") is not None, reason="already in a child")
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_instantiations_under_lower_capability(capability):
    """The AVX2 and baseline instantiations of the pooling loops (both prefetch plans), and
    popcnt's and F16C's fallbacks, at the same boundaries, in a child process."""
    if sk._C.cpu_features() == "default":
        pytest.skip("this CPU has nothing above baseline x86-64")
    env = dict(os.environ, SPARSEKIT_CPU_CAPABILITY=capability)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, torch; sys.path.insert(0, {here!r}); import test_thresholds as t\n"
            "torch.set_num_threads(1)\n"
            "t.embedding_bag_dims([torch.float32, torch.float16, torch.float64])\n"
            "import os; os.environ['SPARSEKIT_POOL_PREFETCH'] = 'first'\n"
            "t.embedding_bag_dims([torch.float32, torch.float16, torch.float64])\n"
            "del os.environ['SPARSEKIT_POOL_PREFETCH']\n"
            "t.test_lazy_adam_tables(1)\n"
            "torch.set_num_threads(2)\n"
            "t.test_unique_bounded_boundaries((1 << 15) + 1, 2)\n"
            "t.test_embedding_bag_long_bags(2)\n"
            "t.test_embedding_bag_streamed_outputs(2)\n"
            "print('ok', __import__('sparsekit')._C.cpu_features())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split()[:2] == ["ok", "avx2" if capability == "avx2" else "default"]


def test_embedding_bag_long_bags(threads):
    """Chunks of about 2^16 accumulated elements per task: bags longer than that alone."""
    g = torch.Generator().manual_seed(6)
    for dim in (16, 17):
        for bag_length in ((1 << 16) // dim - 1, (1 << 16) // dim, (1 << 16) // dim + 1, 70_000):
            weight = torch.randint(-4, 4, (5000, dim), generator=g).float()
            rows = torch.randint(-1, 5000, (3 * bag_length,), generator=g)
            starts = torch.arange(3) * bag_length
            got = ops.embedding_bag(weight, rows, starts, None, "sum", None, False)
            want = torch.stack([weight[r[r >= 0]].sum(0) for r in rows.view(3, bag_length)])
            assert torch.equal(got, want), (dim, bag_length)


def test_embedding_bag_streamed_outputs(threads):
    """Outputs of at least kStreamOutputBytes (4 MiB) whose rows are whole 64-byte lines
    (float32 D % 16 == 0, float64 D % 8 == 0) are written with streaming stores: one bag
    below, at and past the threshold, every pooling mode, bags with no valid row (zeros
    written), against torch's embedding_bag. D = 100 (400-byte rows) and float16 stay on
    cached stores at any size."""
    g = torch.Generator().manual_seed(11)
    threshold = 4 << 20
    for dtype, dim in ((torch.float32, 128), (torch.float32, 64), (torch.float64, 64), (torch.float32, 100),
                       (torch.float16, 128)):
        weight = torch.randn(3000, dim, generator=g).to(dtype)
        row_bytes = dim * weight.element_size()
        for bags in (threshold // row_bytes - 1, threshold // row_bytes, threshold // row_bytes + 1):
            lengths = torch.randint(0, 4, (bags,), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            nnz = int(offsets[-1])
            rows = torch.randint(-1, 3000, (nnz,), generator=g)
            scale = torch.rand(nnz, generator=g).to(dtype)
            # torch has no -1 rows: the reference skips them as its padding row 0.
            ref_rows = torch.where(rows < 0, 0, rows)
            for mode, weights in (("sum", None), ("sum", scale), ("mean", None), ("max", None)):
                got = ops.embedding_bag(weight, rows, offsets, weights, mode, 0)
                want = torch.nn.functional.embedding_bag(
                    ref_rows, weight.double(), offsets, mode=mode, include_last_offset=True, padding_idx=0,
                    per_sample_weights=None if weights is None else weights.double())
                torch.testing.assert_close(got.double(), want, rtol=1e-2 if dtype == torch.float16 else 1e-5,
                                           atol=1e-2 if dtype == torch.float16 else 1e-5,
                                           msg=f"{dtype} D={dim} bags={bags} {mode}")


@pytest.mark.parametrize("plan", ["every", "first"])
def test_embedding_bag_prefetch_plans(plan, monkeypatch):
    """Both prefetch plans of the pooling loops (csrc/cpu/prefetch_plan.h), forced by
    SPARSEKIT_POOL_PREFETCH: every line of a row ahead, or only the first line of the passes
    of 8 lines or more (float32 D >= 128, float64 D >= 64, half types D >= 256). Every dim,
    dtype and mode of test_embedding_bag_dims, against the reference."""
    monkeypatch.setenv("SPARSEKIT_POOL_PREFETCH", plan)
    torch.set_num_threads(1)
    embedding_bag_dims([torch.float32, torch.float64, torch.float16, torch.bfloat16])


def test_embedding_bag_chosen_prefetch_plans(monkeypatch):
    """Calls that read at least kPlanMinBytes (32 MiB) of rows of 8 lines or more on two
    threads time themselves and take the plan their PlanChooser picks, the first calls
    alternating and later ones probing the other plan: 40 calls of each kind below, at and
    past the threshold, uniform rows and skewed ones (which keep every line), with -1 and
    padding rows, each equal to the same call with every line forced (the plans pool the
    same rows in the same order); two calls with a bad row among them raise."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(13)
    threshold = 32 << 20
    for dtype, dim in ((torch.float32, 128), (torch.float64, 64), (torch.float32, 256)):
        # 50000 rows: 256 sampled uniform lookups repeat ~0.7 times, far below the skew
        # test's 8, so the uniform calls go to the chooser.
        weight = torch.randn(50000, dim, generator=g).to(dtype)
        row_bytes = dim * weight.element_size()
        for nnz in (threshold // row_bytes - 1, threshold // row_bytes, threshold // row_bytes + 20):
            uniform = torch.randint(-1, 50000, (nnz,), generator=g)
            skewed = torch.where(torch.rand(nnz, generator=g) < 0.5, 7, uniform)
            offsets = torch.cat([torch.arange(0, nnz, 20), torch.tensor([nnz])])
            for rows in (uniform, skewed):
                monkeypatch.setenv("SPARSEKIT_POOL_PREFETCH", "every")
                want = ops.embedding_bag(weight, rows, offsets, None, "sum", 3)
                monkeypatch.delenv("SPARSEKIT_POOL_PREFETCH")
                for call in range(40):
                    if call in (3, 21):
                        # A bad row mid-stream (during the warm-up, then once the plan is
                        # chosen) raises and names its place; the calls after it still agree
                        # (a failed call records no timing: run_embedding_bag).
                        bad = rows.clone()
                        bad[nnz // 2] = 50000
                        with pytest.raises(RuntimeError, match=rf"rows holds 50000 but weight has 50000 rows "
                                                               rf"\(at rows\[{nnz // 2}\]"):
                            ops.embedding_bag(weight, bad, offsets, None, "sum", 3)
                    got = ops.embedding_bag(weight, rows, offsets, None, "sum", 3)
                    assert torch.equal(got, want), (dtype, dim, nnz, call)


def test_embedding_gather_chunks(threads):
    """Gather chunks of 2^18 bytes of rows; rows of -1 read as zeros."""
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16):
        for dim in (1, 16, 17, 65, 129):
            chunk = (1 << 18) // (dim * torch.tensor([], dtype=dtype).element_size())
            weight = torch.randn(1000, dim + 2, generator=g).to(dtype)[:, 1:dim + 1]
            for n in (chunk - 1, chunk, chunk + 1):
                rows = torch.randint(-1, 1000, (n,), generator=g)
                got = ops.embedding_gather(weight, rows.to(torch.int32 if n % 2 else torch.int64))
                want = torch.where((rows >= 0).unsqueeze(1), weight[rows.clamp(min=0)], torch.zeros((), dtype=dtype))
                assert torch.equal(got, want), (dtype, dim, n)


# ---- lazy_adam --------------------------------------------------------------------------

HYPER = dict(step=3, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def adam_reference(w, m, v, rows, grad, step, lr, beta1, beta2, eps, weight_decay):
    w, m, v = w.double().clone(), m.double().clone(), v.double().clone()
    r = rows.long()
    g = grad.double() + weight_decay * w[r]
    m[r] = m[r] + (g - m[r]) * (1 - beta1)
    v[r] = v[r] + (g * g - v[r]) * (1 - beta2)
    w[r] = w[r] - lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step) * m[r] / (v[r].sqrt() + eps)
    return w, m, v


def check_adam(num_rows, n, dim, dtype, seed, rows_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_rows, dim, generator=g).to(dtype)
    m = (torch.randn(num_rows, dim, generator=g) * 0.1).to(dtype)
    v = (torch.rand(num_rows, dim, generator=g) * 0.1).to(dtype)
    rows = torch.cat([torch.tensor([num_rows - 1, 0]), torch.randperm(num_rows - 2, generator=g)[:max(n - 2, 0)] + 1])
    rows = rows[:n][torch.randperm(n, generator=g)].to(rows_dtype)  # distinct, with the first and last row
    grad = torch.randn(n, dim, generator=g).to(dtype)
    want = adam_reference(w, m, v, rows, grad, **HYPER)
    got = [w.clone(), m.clone(), v.clone()]
    ops.lazy_adam_(*got, rows, grad, *HYPER.values())
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[rows.long()] = False
    for a, b, old in zip(got, want, (w, m, v)):
        torch.testing.assert_close(a.double(), b.to(dtype).double(), rtol=tol, atol=tol)
        assert torch.equal(a[untouched], old[untouched])
    return w, m, v, rows, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_lazy_adam_dims(dtype, threads):
    """SSE2 lanes of 4 floats / 2 doubles and the scalar tail."""
    for dim in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17):
        check_adam(50, 20, dim, dtype, seed=dim, rows_dtype=torch.int32 if dim % 2 else torch.int64)


def test_lazy_adam_repeat_check_paths(threads):
    """lazy_adam_cpu.cpp:134: the repeated-row check uses a bitmap of the rows while R <=
    128 * u + 2^16, else a sorted copy: both accept distinct rows, refuse a repeat (writing
    nothing) and refuse a row out of range."""
    for n in (2, 3, 1000):
        boundary = 128 * n + (1 << 16)
        for num_rows in (boundary - 1, boundary, boundary + 1):
            w, m, v, rows, grad = check_adam(num_rows, n, 2, torch.float32, seed=num_rows)
            for bad_rows, message in ((torch.cat([rows[:-1], rows[:1]]), "more than once"),
                                      (torch.cat([rows[:-1], torch.tensor([num_rows])]), "outside"),
                                      (torch.cat([rows[:-1], torch.tensor([INT64_MIN])]), "outside")):
                state = [w.clone(), m.clone(), v.clone()]
                with pytest.raises(RuntimeError, match=message):
                    ops.lazy_adam_(*state, bad_rows, grad, *HYPER.values())
                assert all(torch.equal(a, b) for a, b in zip(state, (w, m, v)))


def test_lazy_adam_grains(threads):
    """Update tasks of 16384 / D rows, check tasks of 2^14 rows; a repeat across tasks."""
    for dim in (1, 4):
        for n in (16384 // dim - 1, 16384 // dim, 16384 // dim + 1, 2 * 16384 + 1):
            w, m, v, rows, grad = check_adam(n + 100, n, dim, torch.float32, seed=n)
            state = [w.clone(), m.clone(), v.clone()]
            with pytest.raises(RuntimeError, match="more than once"):
                ops.lazy_adam_(*state, torch.cat([rows[:-1], rows[:1]]), grad, *HYPER.values())


def test_lazy_adam_tables(threads):
    """lazy_adam_tables_ equals lazy_adam_ on float32 copies rounded back, table by table,
    bit for bit: half rows widened 8 at a time plus a tail; tasks of 16384 / max D rows that
    cut across tables."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(8)
    cases = [[(50, dim, dtype, 20), (30, 5, torch.float32, 0), (1, 2, dtype, 1)]
             for dtype in (torch.float32, torch.float16, torch.bfloat16) for dim in (1, 7, 8, 9, 17)]
    cases += [[(20000, 1, torch.float32, 16383), (5, 1, torch.float16, 2), (20000, 1, torch.bfloat16, 16385)],
              [(5000, 4, torch.float32, 4095), (5000, 1, torch.float16, 4097)]]
    for specs in cases:
        weights, exp_avgs, exp_avg_sqs, rows, grads, originals = [], [], [], [], [], []
        for num_rows, dim, dtype, n in specs:
            w = torch.randn(num_rows, dim, generator=g).to(dtype)
            originals.append(w)
            weights.append(w.clone())
            exp_avgs.append(torch.randn(num_rows, dim, generator=g) * 0.1)
            exp_avg_sqs.append(torch.rand(num_rows, dim, generator=g) * 0.1)
            rows.append(torch.randperm(num_rows, generator=g)[:n])
            grads.append(torch.randn(n, dim, generator=g))
        steps = [t + 1 for t in range(len(specs))]
        hyper = [x for t in range(len(specs)) for x in (0.01 * (t + 1), 0.9, 0.999, 1e-8, 0.01 * t)]
        wants = []
        for t in range(len(specs)):
            w32, m, v = originals[t].float().clone(), exp_avgs[t].clone(), exp_avg_sqs[t].clone()
            ops.lazy_adam_(w32, m, v, rows[t], grads[t], steps[t], *hyper[5 * t:5 * t + 5])
            wants.append((w32.to(originals[t].dtype), m, v))
        torch.ops.sparsekit.lazy_adam_tables_(weights, exp_avgs, exp_avg_sqs, rows, grads, steps, hyper)
        for t in range(len(specs)):
            assert torch.equal(weights[t], wants[t][0]), specs[t]
            assert torch.equal(exp_avgs[t], wants[t][1]) and torch.equal(exp_avg_sqs[t], wants[t][2]), specs[t]


# ---- select_smallest --------------------------------------------------------------------

def select_reference(columns, eligible, k):
    idx = np.nonzero(eligible)[0]
    order = np.lexsort([idx] + [c[idx] for c in reversed(columns)])
    return np.sort(idx[order[:k]])


def select_column(kind, n, rng):
    if kind == "extremes":
        return rng.choice(np.array([INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, -1, 0, 1], dtype=np.int64), n)
    if kind == "equal":
        return np.full(n, -3, dtype=np.int64)
    if kind == "full":
        return rng.integers(INT64_MIN, INT64_MAX, n, dtype=np.int64, endpoint=True)
    if kind in ("span_2^16", "span_2^16+1"):
        # a clock column over an aligned block of exactly 2^16 values (min and max present):
        # one 16-bit digit; one value more crosses into the next block: a 17-bit bucket,
        # a 16-bit digit and then a 1-bit one
        span = (1 << 16) + (kind == "span_2^16+1")
        col = (5 << 16) + rng.integers(0, span, n, dtype=np.int64)
        col[: min(n, 2)] = [5 << 16, (5 << 16) + span - 1][: min(n, 2)]
        return col
    if kind == "low_bits":  # 20 varying low bits under a fixed prefix: a 16-bit digit, then 4
        return -(2**62) + rng.integers(0, 1 << 20, n, dtype=np.int64)
    if kind == "pow2":
        return rng.integers(0, 8, n, dtype=np.int64) << np.int64(60)
    raise ValueError(kind)


@pytest.mark.parametrize("n", [1, (1 << 14) - 1, 1 << 14, (1 << 14) + 1, 8 * (1 << 14) + 5])
def test_select_smallest_boundaries(n, threads):
    rng = np.random.default_rng(n)
    for kinds in (["extremes"], ["equal"], ["span_2^16"], ["span_2^16+1"], ["low_bits"], ["full"],
                  ["equal", "span_2^16+1"], ["pow2", "extremes", "low_bits", "equal"]):
        columns = [select_column(kind, n, rng) for kind in kinds]
        for density in (1.0, 0.3):
            eligible = rng.random(n) < density
            num_eligible = int(eligible.sum())
            for k in sorted({k for k in (0, 1, num_eligible // 2, num_eligible - 1, num_eligible)
                             if 0 <= k <= num_eligible}):
                got = ops.select_smallest([torch.from_numpy(c) for c in columns], torch.from_numpy(eligible), k)
                assert np.array_equal(got.numpy(), select_reference(columns, eligible, k)), (kinds, density, k)


# ---- hash table -------------------------------------------------------------------------

SENTINELS = torch.tensor([INT64_MIN, INT64_MAX, -1, -2, 0, 1])


@pytest.mark.parametrize("capacity", [8, 1 << 15, (1 << 15) + 1, (1 << 16) - 1, 1 << 16])
def test_hash_table_boundaries(capacity, threads):
    """Slots: a power of two >= 2 * capacity (find prefetches from 2^17 slots, i.e.
    capacity 2^15 + 1); scores prefetched from 2^16 rows; inserts and finds in tasks of
    4096 keys. Keys: the sentinels, keys hashing to one slot, random."""
    g = torch.Generator().manual_seed(capacity)
    table = sk.HashTable(capacity)
    keys = torch.cat([SENTINELS, low_colliding(min(capacity // 4, 1500), seed=capacity, low_bits=17),
                      torch.randint(INT64_MIN, INT64_MAX, (capacity,), generator=g)])
    keys = torch.unique(keys)[:capacity]
    keys = keys[torch.randperm(keys.numel(), generator=g)]
    model, occurrences = {}, {}
    for part in (keys[:4095], keys[4095:8191], keys[8191:12288], keys[12288:]):
        if part.numel() == 0:
            continue
        part = torch.cat([part, part[: part.numel() // 3]])
        rows = table.insert(part)
        for key in part.tolist():
            model.setdefault(key, len(model))
            occurrences[key] = occurrences.get(key, 0) + 1
        assert torch.equal(rows, torch.tensor([model[k] for k in part.tolist()]))
    assert len(table) == len(model)
    probe = torch.cat([keys, torch.randint(INT64_MIN, INT64_MAX, (4097,), generator=g),
                       low_colliding(40, seed=capacity + 1, low_bits=17)])
    assert torch.equal(table.find(probe), torch.tensor([model.get(k, -1) for k in probe.tolist()]))
    small = keys[(keys >= -(2**31)) & (keys < 2**31)]
    assert torch.equal(table.find(small.int()), table.find(small))  # int32 keys compare as int64
    last_seen, count = table.scores(keys)
    assert bool((last_seen == 0).all())
    assert count.tolist() == [occurrences[k] for k in keys.tolist()]
    exported_keys, exported_rows = table.export()
    assert sorted(zip(exported_keys.tolist(), exported_rows.tolist())) == sorted(model.items())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity, steps, batch, pool_size", [(16, 60, 10, 60), ((1 << 14) + 1, 4, 12_000, 40_000)])
def test_hash_table_eviction_model(policy, capacity, steps, batch, pool_size, threads):
    """Against a plain-Python model of the contract (docs/api.md): victims never of the call, lowest score
    (lfu: count, then last_seen), ties to the smaller key; new keys take freed rows
    ascending, then n, n + 1, ...; the slots are rebuilt once tombstones pass a quarter
    (capacity 16: every 9 evictions); select_smallest over more than 2^14 rows."""
    rng = np.random.default_rng(capacity)
    collide = low_colliding(300, seed=capacity, low_bits=12).numpy()
    pool = np.unique(np.concatenate([SENTINELS.numpy(), collide,
                                     rng.integers(INT64_MIN, INT64_MAX, pool_size, dtype=np.int64)]))
    table = sk.HashTable(capacity, eviction=policy)
    model = {}  # key -> [row, last_seen, count]
    for _ in range(steps):
        clock = table.tick()
        keys = pool[rng.integers(0, pool.size, batch)]
        rows, evicted_keys, evicted_rows = table.insert(torch.from_numpy(keys), return_evicted=True)
        occurrences = {}
        for key in keys.tolist():
            occurrences[key] = occurrences.get(key, 0) + 1
        new = [key for key in occurrences if key not in model]
        for key, occ in occurrences.items():
            if key in model:
                model[key][1] = clock
                model[key][2] += occ
        size = len(model)
        num_evict = max(0, len(new) - (capacity - size))
        candidates = sorted(((v[1], k) if policy == "lru" else (v[2], v[1], k))
                            for k, v in model.items() if k not in occurrences)
        victims = sorted((model[c[-1]][0], c[-1]) for c in candidates[:num_evict])
        for _, key in victims:
            del model[key]
        free_rows = [row for row, _ in victims] + list(range(size, size + len(new) - num_evict))
        for key, row in zip(new, free_rows):
            model[key] = [row, clock, occurrences[key]]
        assert torch.equal(rows, torch.tensor([model[k][0] for k in keys.tolist()]))
        assert evicted_rows.tolist() == [row for row, _ in victims]
        assert evicted_keys.tolist() == [key for _, key in victims]
    present = torch.tensor(list(model))
    assert torch.equal(table.find(present), torch.tensor([v[0] for v in model.values()]))
    last_seen, count = table.scores(present)
    assert last_seen.tolist() == [v[1] for v in model.values()] and count.tolist() == [v[2] for v in model.values()]


# ---- partition_by_owner -----------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, (1 << 14) - 1, 1 << 14, (1 << 14) + 1, (1 << 15) + 1])
def test_partition_by_owner(n, threads):
    g = torch.Generator().manual_seed(n)
    for world_size in sorted({1, 2, 3, 7, 1 << 14, max(1, 2 * n), 2 * n + 1, 1 << 24}):
        if world_size > 1 << 20 and n > 1:
            continue
        for keys in (SENTINELS[torch.randint(0, 6, (n,), generator=g)],
                     torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g),
                     torch.randint(0, 4, (n,), generator=g) * world_size,  # every key to rank 0
                     torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)):
            by_owner, positions, counts = ops.partition_by_owner(keys, world_size)
            owner = torch.from_numpy((keys.long().numpy().view(np.uint64) % np.uint64(world_size)).astype(np.int64))
            order = torch.sort(owner, stable=True).indices
            want_positions = torch.empty_like(order)
            want_positions[order] = torch.arange(n)
            assert torch.equal(by_owner, keys[order]) and torch.equal(positions, want_positions)
            assert torch.equal(counts, torch.bincount(owner, minlength=world_size))


# ---- Python-layer switches --------------------------------------------------------------

def test_sort_rows():
    """exchange.py:145/:162: numpy's packed sort for 2..50,000 rows whose values lie strictly
    within +-2^(62 - bits) (bits: a position's width), torch.sort otherwise."""
    g = torch.Generator().manual_seed(9)
    for n in (1, 2, 3, 49_999, 50_000, 50_001):
        limit = 1 << (62 - max(n - 1, 0).bit_length())
        for low, high in ((-1, n), (-limit + 1, limit - 1), (-limit, limit - 1), (-limit + 1, limit),
                          (INT64_MIN, INT64_MAX)):
            values = torch.unique(torch.cat([torch.tensor([low, high]), torch.randint(low, high, (n,), generator=g)]))
            values = values[torch.randperm(values.numel(), generator=g)][:n]
            values[: min(2, values.numel() // 3)] = -1  # missing keys repeat
            got, order = exchange._sort_rows(values)
            assert torch.equal(got, torch.sort(values).values) and torch.equal(values[order], got)
            assert torch.equal(torch.sort(order).values, torch.arange(values.numel()))


@pytest.mark.parametrize("distinct", [1023, 1024, 1025])
def test_layer_gather_threshold(distinct):
    """exchange.py:173: a CPU shard reads its rows with sparsekit's gather above 256 KiB of
    rows (1024 rows of 64 float32), with index_select below; in training and in eval with
    unseen keys (rows of -1), forward and gradient against the layer's own table."""
    torch.set_num_threads(2)
    dim = 64
    g = torch.Generator().manual_seed(distinct)
    layer = sk.DistributedEmbedding("sum", 2 * distinct, dim, 1, 2)
    keys = torch.randint(-(2**62), 2**62, (distinct,), generator=g)
    keys[:3] = torch.tensor([INT64_MIN, INT64_MAX, 0])  # (-1 is the layer's pad key)
    batch = keys[torch.randperm(distinct, generator=g)].view(-1, 1, 1)
    batch = torch.cat([batch, batch.flip(0)], -1)  # two keys per bag: every key twice
    out = layer(batch)
    rows = layer.hash_table.find(batch.reshape(-1))
    want = layer.weight.detach()[rows].view(-1, 2, dim).sum(1).view(out.shape)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    target = torch.randn(out.shape, generator=g)
    (out * target).sum().backward()
    dense = torch.zeros(layer.weight.shape).index_add_(0, rows, target.view(-1, dim).repeat_interleave(2, 0))
    torch.testing.assert_close(layer.weight.grad.to_dense(), dense, rtol=0, atol=1e-5)
    layer.eval()
    unseen = torch.cat([batch[..., :1], torch.randint(2**62, INT64_MAX, batch[..., 1:].shape, generator=g)], -1)
    out = layer(unseen)
    want = layer.weight.detach()[layer.hash_table.find(unseen[..., 0].reshape(-1))].view(out.shape)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)

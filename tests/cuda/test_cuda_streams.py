"""CUDA streams: every op launched on a non-default stream gives what it gives on the
default stream, and unique past 2^30 positions (the 64-bit position path) on a big GPU.

How a wrong stream would show: the side stream first sleeps, then writes the op's inputs
(fresh clones). An op whose kernels went to another stream than the current one would
read those inputs before they exist (or free its scratch too early) and disagree.
"""

import pytest
import torch

import sparsekit as sk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: CUDA stream tests need one")

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SLEEP_CYCLES = 20_000_000  # ~10 ms: long enough for a misplaced kernel to overtake


def on_side_stream(fn, *inputs):
    """fn(*clones of inputs) on a fresh stream, behind a sleep on that stream; returns its
    result once the default stream has waited for it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        out = fn(*clones)
    torch.cuda.current_stream().wait_stream(side)
    # Keep the clones alive until the default stream is past the side stream's work.
    for t in clones:
        if isinstance(t, torch.Tensor):
            t.record_stream(torch.cuda.current_stream())
    return out, clones


def on_default_stream(fn, *inputs):
    clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    return fn(*clones), clones


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu(), b.cpu())
    else:
        assert a == b


def keys(n=300_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(INT64_MIN, INT64_MAX, (5_000,), generator=g)
    out = base[torch.randint(0, 5_000, (n,), generator=g)]
    out[:4] = torch.tensor([INT64_MIN, INT64_MAX, -1, 0])
    return out.cuda()


def compare(fn, *inputs):
    side, side_inputs = on_side_stream(fn, *inputs)
    torch.cuda.synchronize()
    default, default_inputs = on_default_stream(fn, *inputs)
    torch.cuda.synchronize()
    assert_same(side, default)
    assert_same(side_inputs, default_inputs)  # in-place ops changed them alike


def test_stream_unique():
    compare(lambda k: torch.ops.sparsekit.unique(k), keys())


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stream_segment_sum(deterministic, dtype):
    g = torch.Generator().manual_seed(1)
    n = 200_000
    data = torch.randn(n, 16, generator=g).to(dtype).cuda()
    ids = torch.randint(-1, 5_000, (n,), generator=g).cuda()
    if deterministic:
        compare(lambda d, i: sk.ops.segment_sum(d, i, 5_000, deterministic=True), data, ids)
    else:
        # Atomics: the order (and so the last bits) may differ run to run; the sums agree.
        side, _ = on_side_stream(lambda d, i: sk.ops.segment_sum(d, i, 5_000), data, ids)
        torch.cuda.synchronize()
        default = sk.ops.segment_sum(data, ids, 5_000)
        torch.testing.assert_close(side.float(), default.float(), rtol=1e-2, atol=1e-2)
        exact = sk.ops.segment_sum(data, ids, 5_000, deterministic=True)
        torch.testing.assert_close(side.float(), exact.float(), rtol=1e-2, atol=1e-2)


def test_stream_segment_sum_out_of_range_raises():
    """The range check's host read is on the current stream too: a bad id still raises."""
    data = torch.randn(1_000, 4).cuda()
    ids = torch.arange(1_000).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        late = ids.clone()
        with pytest.raises(RuntimeError, match="segment_ids holds 999"):
            sk.ops.segment_sum(data, late, 999)
    torch.cuda.synchronize()


def test_stream_segment_sum_backward():
    data = torch.randn(50_000, 8).cuda()
    ids = torch.randint(-1, 700, (50_000,)).cuda()

    def grad_of(d, i):
        d = d.requires_grad_()
        out = sk.ops.segment_mean(d, i, 700, deterministic=True)
        return torch.autograd.grad(out, d, torch.ones_like(out))[0]

    compare(grad_of, data, ids)


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_stream_hash_table(key_dtype):
    batch = keys(100_000, seed=2) if key_dtype == torch.int64 else keys(100_000, seed=2).to(torch.int32)

    def run(k):
        table = sk.HashTable(20_000, key_dtype=key_dtype, device="cuda")
        rows = table.insert(k)
        again = table.insert(k.flip(0))
        found = table.find(torch.cat([k[:1000], k[:1000] ^ 12345]))
        exported = table.export()
        return rows, again, found, exported

    compare(run, batch)


def test_stream_hash_table_raw_ops():
    slot_keys = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")
    slot_rows = torch.full((1 << 16,), -1, dtype=torch.int64, device="cuda")
    new_keys = torch.unique(keys(40_000, seed=3))[:30_000]
    new_rows = torch.arange(new_keys.numel(), device="cuda")

    def run(sk_keys, sk_rows, k, r):
        sk.ops.hash_table_insert_absent_(sk_keys, sk_rows, k, r)
        return sk.ops.hash_table_find(sk_keys, sk_rows, k)

    side, side_inputs = on_side_stream(run, slot_keys, slot_rows, new_keys, new_rows)
    torch.cuda.synchronize()
    default, _ = on_default_stream(run, slot_keys, slot_rows, new_keys, new_rows)
    # Slot layouts may differ (concurrent inserts claim slots in any order); the rows do not.
    assert_same(side, default)
    assert torch.equal(side.cpu(), new_rows.cpu())
    assert int((side_inputs[1] >= 0).sum()) == new_keys.numel()


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_stream_embedding_bag(mode, weighted):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(10_000, 64, generator=g).cuda()
    rows = torch.randint(-1, 10_000, (100_000,), generator=g).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                         torch.sort(torch.randint(0, 100_000, (4_999,), generator=g)).values,
                         torch.tensor([100_000])]).cuda()
    psw = torch.rand(100_000, generator=g).cuda() if weighted else None

    def run(w, r, o, p):
        w = w.requires_grad_()
        out = sk.ops.embedding_bag(w, r, o, p, mode=mode)
        (grad,) = torch.autograd.grad(out, w, torch.ones_like(out))
        return out, grad.coalesce().indices(), grad.coalesce().values()

    compare(run, weight, rows, offsets, psw)


def test_stream_embedding_gather():
    weight = torch.randn(5_000, 24).cuda()
    rows = torch.randint(-1, 5_000, (64, 300)).cuda()
    compare(lambda w, r: sk.ops.embedding_gather(w, r), weight, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_lazy_adam(dtype):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(50_000, 32, generator=g).to(dtype).cuda()
    exp_avg = torch.zeros_like(weight)
    exp_avg_sq = torch.zeros_like(weight)
    rows = torch.randperm(50_000, generator=g)[:20_000].cuda()
    grad = torch.randn(20_000, 32, generator=g).to(dtype).cuda()

    def run(w, m, v, r, gr):
        sk.ops.lazy_adam_(w, m, v, r, gr, 3, 0.01, 0.9, 0.999, 1e-8, 0.01)
        return w, m, v

    compare(run, weight, exp_avg, exp_avg_sq, rows, grad)


@pytest.mark.parametrize("world_size", [3, 4096, 5000])
def test_stream_partition_by_owner(world_size):
    compare(lambda k: sk.ops.partition_by_owner(k, world_size), keys(200_000, seed=6))


def test_stream_key_seeded_uniform():
    compare(lambda k: sk.ops.key_seeded_uniform(k, 77, seed=9, dtype=torch.float16), keys(50_000, seed=7))


# ---- unique past 2^30 positions ----

BIG_N = (1 << 30) + (1 << 20)


def unique_bytes_needed(n: int) -> int:
    """Peak bytes of the int64-position path plus the check: keys, the 2^ceil(log2(2n))
    slot table, slot_of, first_rank and inverse (8 bytes each), and torch.unique's sort
    afterwards (about 4 more copies of the keys)."""
    slots = 16
    while slots < 2 * n:
        slots <<= 1
    ours = 8 * n + 8 * slots + 3 * 8 * n
    reference = 8 * n + 8 * n + 4 * 8 * n
    return max(ours, reference) + (1 << 30)


@pytest.mark.slow
def test_unique_beyond_2_pow_30_positions():
    """unique on > 2^30 int64 keys (the 64-bit position path): counts and keys equal
    torch.unique's, and keys first seen past position 2^30 come last, in order."""
    free, _ = torch.cuda.mem_get_info()
    need = unique_bytes_needed(BIG_N)
    if free < need:
        pytest.skip(f"needs ~{need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    n = BIG_N
    keys_gpu = torch.randint(-500_000, 500_000, (n,), device="cuda", dtype=torch.int64)
    # Two keys seen only past 2^30 (and past every other first occurrence).
    late_a, late_b = (1 << 30) + 12_345, n - 1
    keys_gpu[late_a] = INT64_MAX
    keys_gpu[late_b] = INT64_MIN
    uniq, inverse, counts = torch.ops.sparsekit.unique(keys_gpu)
    assert inverse.shape == (n,) and inverse.dtype == torch.int64
    num_unique = uniq.numel()
    assert uniq[-2].item() == INT64_MAX and uniq[-1].item() == INT64_MIN
    assert inverse[late_a].item() == num_unique - 2 and inverse[late_b].item() == num_unique - 1
    assert counts[-2].item() == 1 and counts[-1].item() == 1
    assert counts.sum().item() == n
    # keys == uniq[inverse] on a sample spread over the whole range, the tail included.
    sample = torch.cat([torch.randint(0, n, (1 << 20,), device="cuda"),
                        torch.arange(n - (1 << 16), n, device="cuda")])
    assert torch.equal(uniq[inverse[sample]], keys_gpu[sample])
    del inverse
    torch.cuda.empty_cache()
    ref_keys, ref_counts = torch.unique(keys_gpu, sorted=True, return_counts=True)
    order = torch.argsort(uniq)
    assert torch.equal(uniq[order], ref_keys)
    assert torch.equal(counts[order], ref_counts)

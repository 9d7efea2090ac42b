"""Every CUDA kernel at least once, on small inputs: the selection that
scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck, synccheck,
initcheck). Each test names the kernels it reaches; together they cover every file in
csrc/cuda/. On the CPU the same tests check the CPU kernels against plain torch, so the
selection cannot rot between GPU sessions.

    csrc/cuda/unique_cuda.cu       test_unique_kernels
    csrc/cuda/segment_cuda.cu      test_segment_sum_atomic_kernels, test_segment_sum_deterministic_kernels
    csrc/cuda/hashtable_cuda.cu    test_hash_table_kernels, test_hash_table_eviction_kernels (erase, tombstones)
    csrc/cuda/select_cuda.cu       test_select_kernels, test_hash_table_eviction_kernels
    csrc/cuda/embedding_cuda.cu    test_embedding_kernels (bag, long-bag pieces + combine, arg-max, gather)
    csrc/cuda/lazy_adam_cuda.cu    test_lazy_adam_kernels
    csrc/cuda/routing_cuda.cu      test_routing_kernels
    csrc/cuda/initializer_cuda.cu  test_initializer_kernels
    csrc/cuda/pooled_cuda.cu       test_pooled_kernels (read)
    csrc/cuda/pooled_backward_cuda.cu  test_pooled_kernels (codes + radix sort, grad rows, the three updates)
    csrc/cuda/hashtable_cuda.cu    test_lookup_rows_kernels (lookup_rows, its check-only mode, touch: check + score)
    csrc/cuda/verdict_cuda.cu      test_record_verdict_kernel
    all of them, through a layer   test_layer_step, test_collection_step (dynamic tables, bf16, mixed dims)
"""

import pytest
import torch

import sparsekit as sk

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique_kernels(device, dtype):
    """Position table insert (atomicCAS/atomicMin), first-occurrence scan, output and counts."""
    g = _seeded(0)
    for n in (0, 1, 1000, 70_000):
        keys = torch.randint(-300, 300, (n,), generator=g)
        if dtype == torch.int64 and n:
            keys[: min(n, 4)] = torch.tensor([INT64_MIN, INT64_MAX, -1, 0])[: min(n, 4)]
        keys = keys.to(dtype)
        uniq, inverse, counts = torch.ops.sparsekit.unique(keys.to(device))
        cpu_uniq, cpu_inverse, cpu_counts = torch.ops.sparsekit.unique(keys)
        assert torch.equal(uniq.cpu(), cpu_uniq) and torch.equal(inverse.cpu(), cpu_inverse)
        assert torch.equal(counts.cpu(), cpu_counts)
        assert torch.equal(cpu_uniq[cpu_inverse], keys)
        assert torch.equal(torch.sort(cpu_uniq).values, torch.unique(keys))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_segment_sum_atomic_kernels(device, dtype):
    """Atomic segment sum: narrow rows, wide rows split over gridDim.y, partial tiles, dropped ids."""
    g = _seeded(1)
    for n, dim, segments in ((0, 4, 3), (1, 1, 1), (1000, 3, 17), (5000, 1100, 40)):
        data = torch.randn(n, dim, generator=g).to(dtype)
        ids = torch.randint(-1, segments, (n,), generator=g)
        out = sk.ops.segment_sum(data.to(device), ids.to(device), segments)
        keep = ids >= 0
        want = torch.zeros(segments, dim, dtype=torch.float64).index_add_(0, ids[keep], data[keep].double())
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
        torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol * max(1.0, n / max(segments, 1)))


def test_segment_sum_deterministic_kernels(device):
    """Sort-based deterministic sum, with one segment longer than a tree level (> 2048 rows)."""
    g = _seeded(2)
    ids = torch.cat([torch.zeros(5000, dtype=torch.int64), torch.randint(-1, 50, (3000,), generator=g)])
    data = torch.randn(ids.numel(), 8, generator=g)
    first = sk.ops.segment_sum(data.to(device), ids.to(device), 50, deterministic=True)
    again = sk.ops.segment_sum(data.to(device), ids.to(device), 50, deterministic=True)
    assert torch.equal(first, again)
    keep = ids >= 0
    want = torch.zeros(50, 8, dtype=torch.float64).index_add_(0, ids[keep], data[keep].double())
    torch.testing.assert_close(first.cpu().double(), want, rtol=1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="segment_sum"):
        sk.ops.segment_sum(data.to(device), torch.full_like(ids, 50).to(device), 50)


def test_hash_table_kernels(device):
    """find, insert of absent keys, the row check; a full table raising changes nothing."""
    table = sk.HashTable(1000, device=device)
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 42, 42, -7], device=device)
    rows = table.insert(keys)
    assert rows.cpu().tolist() == [0, 1, 2, 3, 4, 4, 5]
    assert table.find(torch.tensor([0, 5, -7, INT64_MIN], device=device)).cpu().tolist() == [3, -1, 5, 0]
    more = torch.arange(10_000, 10_900, device=device)
    assert torch.equal(table.insert(more).cpu(), torch.arange(6, 906))
    with pytest.raises(RuntimeError):
        table.insert(torch.arange(20_000, 21_000, device=device))
    assert len(table) == 906
    exported_keys, exported_rows = table.export()
    assert torch.equal(table.find(exported_keys), exported_rows)


def test_select_kernels(device):
    """Radix select: min/max and histogram passes over 1-3 columns, ties, compaction."""
    g = _seeded(8)
    for n, k in ((0, 0), (1, 1), (5000, 700), (70_000, 65_536)):
        columns = [torch.randint(0, 4, (n,), generator=g), torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g),
                   torch.randint(-5, 5, (n,), generator=g)]
        eligible = torch.rand(n, generator=g) < 0.97
        k = min(k, int(eligible.sum()))
        for width in (1, 2, 3):
            want = sk.ops.select_smallest(columns[:width], eligible, k)
            got = sk.ops.select_smallest([c.to(device) for c in columns[:width]], eligible.to(device), k)
            assert torch.equal(got.cpu(), want)


def test_hash_table_eviction_kernels(device):
    """Evicting inserts (select, erase to tombstones, inserts into tombstones, the rebuild)
    give the CPU's rows, victims and scores."""
    tables = [sk.HashTable(300, eviction=policy, device=dev) for policy in ("lru", "lfu") for dev in ("cpu", device)]
    g = _seeded(9)
    for step in range(40):
        keys = torch.randint(-400, 400, (250,), generator=g)
        results = [t.insert(keys.to(t.device), return_evicted=True) for t in tables]
        for t in tables:
            t.tick()
        for cpu, other in ((results[0], results[1]), (results[2], results[3])):
            assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, other))
    for cpu, other in ((tables[0], tables[1]), (tables[2], tables[3])):
        keys, rows = cpu.export()
        assert torch.equal(other.find(keys.to(device)).cpu(), rows)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.scores(keys), other.scores(keys.to(device))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding_kernels(device, dtype):
    """Pooled forward (sum, mean, max, weighted), the long-bag pieces and their combine (a
    bag of 3000 lookups), the arg-max, gather, their sparse backward, and the row check."""
    g = _seeded(3)
    weight = torch.randn(300, 40, generator=g).to(dtype)
    rows = torch.randint(-1, 300, (3500,), generator=g)
    offsets = torch.cat([torch.tensor([0, 3000]),
                         torch.sort(torch.randint(3000, 3501, (63,), generator=g)).values, torch.tensor([3500])])
    psw = torch.rand(3500, generator=g).to(dtype)
    # One output gradient for both devices: the two weight gradients then sum the same terms
    # (in another order), and the tolerance need not cover the outputs' own rounding.
    grad_out = torch.randn(offsets.numel() - 1, 40, generator=g)
    for mode, weights in (("sum", None), ("mean", None), ("max", None), ("sum", psw), ("mean", psw)):
        outs = []
        for dev in ("cpu", device):
            w = weight.clone().to(dev).requires_grad_()
            out = sk.ops.embedding_bag(w, rows.to(dev), offsets.to(dev),
                                       None if weights is None else weights.to(dev), mode)
            out.float().backward(grad_out.to(dev))
            outs.append((out.float().cpu(), w.grad.to_dense().float().cpu()))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=tol, atol=tol)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=tol, atol=tol)
    w = weight.to(device).requires_grad_()
    gathered = sk.ops.embedding_gather(w, rows.to(device))
    gathered.float().sum().backward()
    want = torch.where((rows >= 0).unsqueeze(1), weight[rows.clamp_min(0)], 0)
    assert torch.equal(gathered.cpu(), want)
    with pytest.raises(RuntimeError, match="embedding_bag"):
        sk.ops.embedding_bag(weight.to(device), torch.tensor([0, 300], device=device),
                             torch.tensor([0, 2], device=device))


def test_lazy_adam_kernels(device):
    """The fused update against torch.optim.SparseAdam, and the row check."""
    g = _seeded(4)
    weight = torch.randn(100, 16, generator=g)
    rows = torch.randperm(100, generator=g)[:30]
    grad = torch.randn(30, 16, generator=g)
    reference = weight.clone().requires_grad_()
    opt = torch.optim.SparseAdam([reference], lr=0.01)
    reference.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, (100, 16)).coalesce()
    opt.step()
    w, m, v = weight.to(device), torch.zeros(100, 16, device=device), torch.zeros(100, 16, device=device)
    sk.ops.lazy_adam_(w, m, v, rows.to(device), grad.to(device), 1, 0.01, 0.9, 0.999, 1e-8)
    torch.testing.assert_close(w.cpu(), reference.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="lazy_adam_"):
        sk.ops.lazy_adam_(w, m, v, torch.tensor([100], device=device), grad[:1].to(device), 2, 0.01, 0.9, 0.999, 1e-8)


def test_routing_kernels(device):
    """Owner histogram, stable scatter by owner, positions."""
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 5, 6, 7, 5], device=device)
    by_owner, positions, counts = sk.ops.partition_by_owner(keys, 3)
    owners = torch.tensor([(k % 2**64) % 3 for k in keys.tolist()])
    order = torch.sort(owners, stable=True).indices
    assert torch.equal(by_owner.cpu(), keys.cpu()[order])
    assert torch.equal(by_owner[positions], keys)
    assert torch.equal(counts.cpu(), torch.bincount(owners, minlength=3))


def test_initializer_kernels(device):
    """Key-seeded uniform rows: the same bits on every device."""
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 123], device=device)
    rows = sk.ops.key_seeded_uniform(keys, 33, seed=7)
    assert torch.equal(rows.cpu(), sk.ops.key_seeded_uniform(keys.cpu(), 33, seed=7))
    assert float(rows.abs().max()) <= 0.05


def test_layer_step(device):
    """A DistributedEmbedding + LazyAdam training step on one process: every kernel family in turn."""
    torch.manual_seed(0)
    emb = sk.DistributedEmbedding("mean", max_vocabulary_size_per_gpu=1000, embedding_vec_size=8,
                                  slot_num=3, max_nnz=2, device=device)
    opt = sk.LazyAdam(emb.parameters(), lr=0.01)
    keys = torch.randint(-50, 50, (16, 3, 2), generator=_seeded(5)).to(device)
    for _ in range(2):
        out = emb(keys)
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert out.shape == (16, 3, 8) and bool(torch.isfinite(out).all())


def test_collection_step(device):
    """An EmbeddingBagCollection + LazyAdam step: mixed dims, a bf16 table, eviction and
    admission, on this device against the CPU."""
    def build(dev):
        torch.manual_seed(0)
        return sk.EmbeddingBagCollection([
            sk.TableConfig("a", 8, 40, ["x", "y"], eviction="lru"),
            sk.TableConfig("b", 4, 100, ["z"], dtype=torch.bfloat16, admit_after=2),
            sk.TableConfig("c", 8, 64, ["w"], use_hashtable=False),
        ], device=dev)

    outputs = []
    for dev in ("cpu", device):
        ebc = build(dev)
        opt = sk.LazyAdam(ebc.parameters(), lr=0.01)
        g = _seeded(10)
        for _ in range(4):
            lengths = torch.randint(0, 3, (4 * 16,), generator=g)
            values = torch.randint(0, 60, (int(lengths.sum()),), generator=g)
            kjt = sk.KeyedJagged(["x", "y", "z", "w"], values.to(dev), lengths=lengths.to(dev))
            out = ebc(kjt)
            sum(v.float().square().sum() for v in out.values()).backward()
            opt.step()
            opt.zero_grad()
        outputs.append({f: v.detach().float().cpu() for f, v in out.items()})
    for feature in outputs[0]:
        torch.testing.assert_close(outputs[1][feature], outputs[0][feature], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pooled_kernels(device, dtype):
    """pooled_read (16-byte packets and single columns), pooled_read_backward and the three
    fused updates, on this device against the CPU kernels."""
    g = _seeded(21)
    dims, rows_of = [16, 3, 8], [50, 7, 30]
    weights = [torch.randn(r, d, generator=g).to(dtype) for r, d in zip(rows_of, dims)]
    tables, columns, means, total, batch = [0, 1, 2, -1, 0], [0, 16, 19, 0, 27], [0, 1, 0, 0, 1], 43, 9
    lengths = torch.randint(0, 5, (len(tables) * batch,), generator=g)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    rows = torch.cat([torch.randint(-1, rows_of[max(tables[bag // batch], 0)], (int(n),), generator=g)
                      for bag, n in enumerate(lengths.tolist())])
    psw = torch.rand(rows.numel(), generator=g)
    grad = torch.randn(batch, total, generator=g).to(dtype)
    on = [w.to(device) for w in weights]
    args = (rows.to(device), offsets.to(device), psw.to(device), tables, columns, means)
    out = torch.ops.sparsekit.pooled_read(on, *args, total)
    expected = torch.ops.sparsekit.pooled_read(weights, rows, offsets, psw, tables, columns, means, total)
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1e-2, atol=1e-3)
    def split(block):
        return [block[:, c:c + dims[t]] if t >= 0 else block.new_empty(0) for t, c in zip(tables, columns)]

    got = torch.ops.sparsekit.pooled_read_backward(split(grad.to(device)), on, rows.to(device), offsets.to(device),
                                                   psw.to(device), tables, means)
    want = torch.ops.sparsekit.pooled_read_backward(split(grad), weights, rows, offsets, psw, tables, means)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-5, atol=1e-6)
    # The whole block with each feature's columns: the views made in the op.
    blocked = torch.ops.sparsekit.pooled_read_backward([grad.to(device)], on, rows.to(device), offsets.to(device),
                                                       psw.to(device), tables, means, None, columns)
    assert torch.equal(blocked[0], got[0]) and torch.equal(blocked[1], got[1])
    torch.testing.assert_close(blocked[2], got[2], rtol=1e-6, atol=1e-7)
    for optimizer in ("sgd", "lazy_adam", "rowwise_adagrad", "adagrad"):
        results = []
        for dev, ws in ((device, on), ("cpu", weights)):
            ws = [w.clone() for w in ws]
            state = torch.float64 if dtype == torch.float64 else torch.float32
            s1 = [] if optimizer == "sgd" else [torch.zeros(w.shape[:1] if optimizer == "rowwise_adagrad" else w.shape,
                                                            dtype=state, device=dev) for w in ws]
            s2 = [torch.zeros(w.shape, dtype=state, device=dev) for w in ws] if optimizer == "lazy_adam" else []
            steps = [torch.zeros((), dtype=torch.int64, device=dev) for _ in ws] if optimizer == "lazy_adam" else []
            # The device takes the whole block with its columns, the CPU the per-feature views.
            grads, grad_columns = ([grad.to(dev)], columns) if dev == device else (split(grad), [])
            torch.ops.sparsekit.pooled_read_update_(ws, s1, s2, steps, grads, rows.to(dev), offsets.to(dev),
                                                    psw.to(dev), tables, means, optimizer,
                                                    [0.05, 0.9, 0.999, 1e-6, 0.01], None, None, grad_columns)
            results.append([w.cpu().float() for w in ws])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_lookup_rows_kernels(device):
    """lookup_rows over hash, direct and caller-resolved segments, and the scoring of each
    distinct row once, on this device against the CPU: 3 segments, and 70 (three launches of
    32 segments, some empty), their bounds a tensor on the device."""
    g = _seeded(22)
    for lengths in ([20, 15, 15], [0, 3, 1, 0, 2] * 14):
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        kinds = [[0, -1, -2][s % 3] for s in range(len(lengths))]
        direct = [30 if k == -1 else 0 for k in kinds]
        keys = torch.randint(-5, 60, (bounds[-1],), generator=g)
        results = []
        for dev in ("cpu", device):
            table = sk.HashTable(64, device=dev)
            table.insert(torch.arange(0, 40, 3, device=dev))
            table.tick()
            on = torch.tensor(bounds, device=dev)
            rows, report = torch.ops.sparsekit.lookup_rows([table._slot_keys], [table._slot_rows], keys.to(dev), on,
                                                           kinds, direct)
            errors = torch.full((2,), 2 ** 63 - 1, device=dev)
            torch.ops.sparsekit.hash_table_touch_tables_([table._last_seen], [table._count], rows, on,
                                                         [max(k, -1) for k in kinds], [len(table)], [7], errors)
            # The check-only mode over the same keys, every segment direct.
            no_rows, direct_report = torch.ops.sparsekit.lookup_rows([], [], keys.to(dev), on, [-1] * len(lengths),
                                                                     [30] * len(lengths), False)
            assert no_rows.numel() == 0
            results.append((rows.cpu(), report.cpu(), errors.cpu(), table._last_seen.cpu(), table._count.cpu(),
                            direct_report.cpu()))
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_record_verdict_kernel(device):
    """record_verdict_ (one thread): a clean record takes a bad verdict, naming the first bad
    key's table and value through strided bounds; a record holding an error keeps it; the
    error word is emptied; the clean flag stays on the device. Against the CPU."""
    none = 2 ** 63 - 1
    cases = [([0] * 4 + [none, none] + [0] * 3, 0, [5, 0, 0], [none, none]),    # a bad key at 5
             ([0] * 4 + [none, none] + [0] * 3, 2, [9, 0, 0], [3, none]),       # bad offsets, a word entry
             ([2, 9, 0, 0, none, none, 0, 0, 9], 0, [1, 0, 0], [none, none]),   # an earlier error stays
             ([0] * 4 + [none, none] + [0] * 3, 0, [9, 4, 0], [none, none])]    # clean
    for record, flags, report, errors in cases:
        results = []
        for dev in ("cpu", device):
            bounds = torch.tensor([0, 0, 0, 3, 3, 9, 9, 9], device=dev)[::2]  # [0, 0, 3, 9]
            r, e = torch.tensor(record, device=dev), torch.tensor(errors, device=dev)
            clean = torch.zeros(1, dtype=torch.bool, device=dev)
            torch.ops.sparsekit.record_verdict_(r, e, clean, torch.tensor(flags, device=dev),
                                                torch.tensor(report, device=dev), bounds,
                                                torch.arange(100, 109, device=dev), torch.tensor([4, 7, 2], device=dev))
            results.append((r.cpu(), e.cpu(), clean.cpu()))
        for a, b in zip(*results):
            assert torch.equal(a, b), (record, a, b)

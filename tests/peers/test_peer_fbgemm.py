"""FBGEMM's own table-batched-embedding (TBE) CPU test cases, ported to sparsekit.

Each test follows a test of pytorch/FBGEMM's fbgemm_gpu/test/tbe/training/ (named in its
docstring): forward_test.py (``ForwardTest.execute_forward_`` and its ``test_forward_cpu_*``
cases) and backward_sgd_test.py / backward_adagrad_common.py (``execute_backward_sgd_``:
``feature_table_map`` with a replicated table, ``long_segments``, weighted SUM, MEAN). FBGEMM
checks its fused ``SplitTableBatchedEmbeddingBagsCodegen`` against one ``nn.EmbeddingBag`` per
table with the same weights; here the fused module is :class:`sparsekit.EmbeddingBagCollection`
(world size 1, CPU; direct tables, where row == key, and hash tables, whose rows are mapped
back to keys through ``export``) and ``sparsekit.ops.embedding_bag``.

The reference is plain torch in float32: ``F.embedding_bag(mode="sum", per_sample_weights=...)``
per feature, divided by the bag's length for a ``mean`` table (the collection's documented
convention: "the weighted sum divided by the bag's length"; FBGEMM only allows weights with SUM).
Checked: the pooled outputs (shape, dtype, values), the weights' (sparse) gradients densified,
the per-sample weights' gradient, one SGD step (FBGEMM's EXACT_SGD) and one ``LazyAdam`` step
against ``torch.optim.SparseAdam``.
"""

import random

import pytest
import torch
import torch.nn.functional as F

import sparsekit as sk

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 8e-3, "rtol": 8e-3},   # FBGEMM's fp16 tolerance
    torch.bfloat16: {"atol": 5e-2, "rtol": 2e-2},
}


def _case(seed, T, Ds, Es, B, L, *, weighted=False, combiner="sum", dtype=torch.float32, hashed=False,
          index_dtype=torch.int64, feature_table_map=None, fixed_length=True, long_segments=False,
          use_offsets=False, features_listed=None, weight_dtype=torch.float32):
    """Build a collection of T tables (dims Ds, rows Es), a feature-major KeyedJagged of B
    samples with bags of L keys (0..L when not fixed_length), and the plain-torch reference
    tables (float32 leaves). Returns everything the checks need."""
    g = torch.Generator().manual_seed(seed)
    feature_table_map = list(range(T)) if feature_table_map is None else feature_table_map
    features = [f"f{i}" for i in range(len(feature_table_map))]
    table_features = [[f for f, t in zip(features, feature_table_map) if t == table] for table in range(T)]
    configs = [sk.TableConfig(f"t{t}", Ds[t], max(Es[t], 1), table_features[t], combiner=combiner, dtype=dtype,
                              use_hashtable=hashed) for t in range(T)]
    ebc = sk.EmbeddingBagCollection(configs)
    listed = list(range(len(features))) if features_listed is None else features_listed
    keys = [features[i] for i in listed]
    table_of = [feature_table_map[i] for i in listed]
    if fixed_length:
        lengths = torch.full((len(keys) * B,), L, dtype=torch.int64)
    else:
        lengths = torch.randint(0, L + 1, (len(keys) * B,), generator=g)
    values = []
    for i, t in enumerate(table_of):
        n = int(lengths[i * B:(i + 1) * B].sum())
        v = torch.randint(0, Es[t], (n,), generator=g)
        if long_segments and n:
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i * B:(i + 1) * B].cumsum(0)[:-1]])
            v[starts[lengths[i * B:(i + 1) * B] > 0]] = 0   # x[:, 0] = 0: one very long segment of row 0
        values.append(v)
    values = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    weights = torch.randn(values.numel(), generator=g).to(weight_dtype).requires_grad_() if weighted else None
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    if use_offsets:
        kjt = sk.KeyedJagged(keys, values.to(index_dtype), offsets=offsets.to(index_dtype), weights=weights)
    else:
        kjt = sk.KeyedJagged(keys, values.to(index_dtype), lengths=lengths.to(index_dtype), weights=weights)
    if not hashed:
        with torch.no_grad():
            for t in range(T):
                ebc.weights[f"t{t}"].copy_(torch.randn(Es[t], Ds[t], generator=g).to(dtype))
    else:
        # Every key present before the checked step (a hash table places keys on first sight).
        warm = torch.cat([torch.arange(Es[t]) for t in range(T)])
        warm_lengths = torch.tensor([Es[t] for t in range(T)])
        ebc(sk.KeyedJagged([table_features[t][0] for t in range(T)], warm, lengths=warm_lengths))
    reference = [_dense_table(ebc, t, Es[t], Ds[t], hashed).float().requires_grad_() for t in range(T)]
    grad_outputs = {k: torch.randn(B, Ds[t], generator=g).to(dtype).float() for k, t in zip(keys, table_of)}
    return {"ebc": ebc, "kjt": kjt, "keys": keys, "table_of": table_of, "offsets": offsets, "values": values, "weights": weights,
                "reference": reference, "grad_outputs": grad_outputs, "B": B, "Ds": Ds, "Es": Es, "T": T, "dtype": dtype,
                "hashed": hashed, "combiner": combiner}


def _rows_of_keys(ebc, t, hashed, E):
    """(keys, rows): where each key of table t lives in the local shard."""
    if not hashed:
        keys = torch.arange(E)
        return keys, keys
    keys, _ = ebc.export(f"t{t}")
    return keys, ebc.shards[t].hash_table.find(keys)


def _dense_table(ebc, t, E, D, hashed):
    """Table t as a dense [E, D] tensor indexed by key (zeros for absent keys)."""
    weight = ebc.weights[f"t{t}"].detach()
    keys, rows = _rows_of_keys(ebc, t, hashed, E)
    out = torch.zeros(E, D, dtype=weight.dtype)
    out[keys] = weight[rows]
    return out


def _dense_grad(ebc, t, E, D, hashed):
    grad = ebc.weights[f"t{t}"].grad
    assert grad is not None, f"table t{t} got no gradient"
    assert grad.is_sparse, f"table t{t}: gradient should be sparse (nn.EmbeddingBag(sparse=True))"
    grad = grad.to_dense().float()
    keys, rows = _rows_of_keys(ebc, t, hashed, E)
    out = torch.zeros(E, D)
    out[keys] = grad[rows]
    return out


def _run_and_check(c, weight_grad=True):
    ebc, kjt, B, dtype = c["ebc"], c["kjt"], c["B"], c["dtype"]
    out = ebc(kjt)
    assert list(out) == c["keys"]
    weights = c["weights"]
    ref_weights = None if weights is None else weights.detach().float().requires_grad_()
    loss, ref_loss = 0.0, 0.0
    for i, (key, t) in enumerate(zip(c["keys"], c["table_of"])):
        bounds = c["offsets"][i * B:(i + 1) * B + 1]
        start, end = int(bounds[0]), int(bounds[-1])
        psw = None if ref_weights is None else ref_weights[start:end]
        ref = F.embedding_bag(c["values"][start:end], c["reference"][t], (bounds - start)[:-1], mode="sum",
                              per_sample_weights=psw)
        if c["combiner"] == "mean":
            ref = ref / (bounds[1:] - bounds[:-1]).clamp(min=1).unsqueeze(1).float()
        assert out[key].shape == (B, c["Ds"][t]) and out[key].dtype == dtype
        torch.testing.assert_close(out[key].float(), ref.to(dtype).float(), **TOL[dtype])
        loss = loss + (out[key].float() * c["grad_outputs"][key]).sum()
        ref_loss = ref_loss + (ref * c["grad_outputs"][key]).sum()
    loss.backward()
    ref_loss.backward()
    grad_tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 3e-2}
    for t in sorted(set(c["table_of"])):
        expected = c["reference"][t].grad
        expected = torch.zeros_like(c["reference"][t]) if expected is None else expected
        torch.testing.assert_close(_dense_grad(ebc, t, c["Es"][t], c["Ds"][t], c["hashed"]), expected, **grad_tol)
    for t in set(range(c["T"])) - set(c["table_of"]):
        assert ebc.weights[f"t{t}"].grad is None, f"table t{t}, not in the batch, got a gradient"
    if weights is not None and weights.numel():
        torch.testing.assert_close(weights.grad.float(), ref_weights.grad,
                                   **(grad_tol if weights.dtype in (torch.float32, torch.float64) and
                                      dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}))
    return out


def _fbgemm_sizes(rng, max_T=10):
    """ForwardTest.test_forward_cpu_*: T in [1, 10], D, B, L with T * B * L * D <= 2048."""
    T = rng.randint(1, max_T)
    D = rng.randint(2, min(256, 2048 // T))
    B = rng.randint(1, max(1, min(128, 2048 // T // D)))
    L = rng.randint(0, max(0, min(20, 2048 // T // D // B)))
    D = (D + 15) // 16 * 4      # FBGEMM's CPU rounding of D
    return T, D, B, L


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("hashed", [False, True])
def test_forward_cpu_fp32(seed, pooling, hashed):
    """forward_test.py ForwardTest.test_forward_cpu_fp32: T tables of one dim, E = 10**log_E rows,
    fixed bag length L (0 included), SUM (weighted or not) or MEAN; outputs and gradients."""
    rng = random.Random(seed)
    T, D, B, L = _fbgemm_sizes(rng)
    E = 10 ** rng.randint(1, 3)
    weighted = pooling == "sum" and rng.random() < 0.5
    c = _case(seed, T, [D] * T, [E] * T, B, L, weighted=weighted, combiner=pooling, hashed=hashed,
              index_dtype=rng.choice([torch.int32, torch.int64]))
    _run_and_check(c)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hashed", [False, True])
def test_forward_cpu_mixed_dims(seed, hashed):
    """forward_test.py ForwardTest.execute_forward_ with mixed=True: per-table D in
    round_up([0.25 D, D), 4) and E in [0.5 E, 2 E); tables of one dim pool together here."""
    rng = random.Random(100 + seed)
    T, D, B, L = _fbgemm_sizes(rng)
    D = max(D, 16)
    Ds = [max(4, (rng.randint(D // 4, D - 1) + 3) // 4 * 4) for _ in range(T)]
    Es = [rng.randint(50, 200) for _ in range(T)]
    c = _case(seed, T, Ds, Es, B, max(L, 1), weighted=rng.random() < 0.5, combiner=rng.choice(["sum", "mean"]),
              hashed=hashed, fixed_length=False)
    _run_and_check(c)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_offsets", [False, True])
def test_forward_weighted_index_dtypes(weighted, combiner, index_dtype, use_offsets):
    """forward_test.py ForwardTest.execute_forward_ (weighted, int32 / int64 indices and
    offsets from get_table_batched_offsets_from_dense): every combination, variable lengths
    with empty bags. Weighted MEAN (FBGEMM rejects it) checks sparsekit's documented
    convention: the weighted sum divided by the bag's length."""
    c = _case(7, 3, [8, 4, 8], [30, 1, 17], 5, 4, weighted=weighted, combiner=combiner, index_dtype=index_dtype,
              use_offsets=use_offsets, fixed_length=False)
    _run_and_check(c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hashed", [False, True])
def test_forward_half_weights(dtype, hashed):
    """forward_test.py ForwardTest.test_forward_gpu_no_cache_fp16 (weights_precision=FP16,
    output in the weights' dtype, tolerance 8e-3), here on the CPU: float16 / bfloat16 tables,
    float32 pooling, output in the table's dtype; half per-sample weights too."""
    c = _case(3, 4, [8, 8, 16, 4], [40, 5, 40, 1], 6, 5, weighted=True, dtype=dtype, hashed=hashed,
              fixed_length=False, weight_dtype=dtype)
    _run_and_check(c)


@pytest.mark.parametrize("L", [0, 3])
@pytest.mark.parametrize("hashed", [False, True])
def test_empty_bags_and_all_empty_batch(L, hashed):
    """forward_test.py with L = 0 (every bag empty: zero outputs, empty sparse gradients) and
    backward_sgd_test.py's empty bags among full ones (lengths drawn in [0, L])."""
    c = _case(11, 3, [4, 8, 4], [10, 10, 3], 4, L, combiner="mean" if L else "sum", hashed=hashed,
              fixed_length=L == 0)
    out = _run_and_check(c)
    if L == 0:
        assert all(v.abs().sum() == 0 for v in out.values())
        assert all(c["ebc"].weights[f"t{t}"].grad._nnz() == 0 for t in range(3))


@pytest.mark.parametrize("hashed", [False, True])
def test_tables_of_one_row_and_batch_of_one(hashed):
    """forward_test.py ForwardTest.execute_forward_ at its smallest: E = 1 (every index 0),
    B = 1, duplicates of the only row in one bag."""
    c = _case(5, 3, [4, 4, 8], [1, 1, 1], 1, 6, weighted=True, hashed=hashed)
    _run_and_check(c)


@pytest.mark.parametrize("long_segments", [False, True])
@pytest.mark.parametrize("hashed", [False, True])
def test_backward_sgd_feature_table_map(long_segments, hashed):
    """backward_sgd_test.py BackwardSGDTest.execute_backward_sgd_: feature_table_map with the
    table T // 2 read by two features (bs.insert(table_to_replicate, ...)), long_segments
    (x[:, 0] = 0), then one EXACT_SGD step (torch.optim.SGD on the sparse gradient) against
    weight - lr * grad of the per-table reference."""
    T = 4
    feature_table_map = list(range(T))
    feature_table_map.insert(T // 2, T // 2)
    c = _case(13, T, [8, 8, 4, 8], [50, 20, 30, 5], 6, 5, weighted=True, hashed=hashed,
              feature_table_map=feature_table_map, long_segments=long_segments)
    _run_and_check(c)
    lr = 0.05
    torch.optim.SGD(c["ebc"].parameters(), lr=lr).step()
    for t in range(T):
        expected = (c["reference"][t] - lr * c["reference"][t].grad).detach()
        torch.testing.assert_close(_dense_table(c["ebc"], t, c["Es"][t], c["Ds"][t], hashed), expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hashed", [False, True])
def test_large_T_subset_and_lazy_adam(hashed):
    """backward_adagrad_common.py / backward_optimizers_test.py (many tables, one fused update)
    with T = 60 tables of mixed dims, only some of whose features the batch lists, in another
    order than the tables; then LazyAdam (two steps) against torch.optim.SparseAdam per table.
    Tables the batch does not list get no gradient and stay unchanged."""
    rng = random.Random(17)
    T = 60
    Ds = [rng.choice([4, 8, 12]) for _ in range(T)]
    Es = [rng.choice([1, 3, 20]) for _ in range(T)]
    listed = rng.sample(range(T), 35)
    c = _case(17, T, Ds, Es, 3, 3, weighted=True, combiner="mean", hashed=hashed, fixed_length=False,
              features_listed=listed)
    before = [_dense_table(c["ebc"], t, Es[t], Ds[t], hashed) for t in range(T)]
    _run_and_check(c)
    optimizer = sk.LazyAdam(c["ebc"].parameters(), lr=0.01)
    reference = [torch.nn.Parameter(r.detach().clone()) for r in c["reference"]]
    for t in range(T):
        if t in listed:
            grad = c["reference"][t].grad
            reference[t].grad = (torch.zeros_like(reference[t]) if grad is None else grad).to_sparse().coalesce()
    ref_optimizer = torch.optim.SparseAdam([p for t, p in enumerate(reference) if t in listed], lr=0.01)
    optimizer.step()
    ref_optimizer.step()
    for t in range(T):
        got = _dense_table(c["ebc"], t, Es[t], Ds[t], hashed)
        if t in listed:
            torch.testing.assert_close(got, reference[t].detach(), atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(got, before[t])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_table_lazy_adam_steps(dtype):
    """backward_optimizers_test.py with weights_precision=FP16 (float32 optimizer state):
    three LazyAdam steps on a half table against SparseAdam on a float32 copy rounded to the
    table's dtype after every step."""
    g = torch.Generator().manual_seed(2)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 8, 10, ["x"], dtype=dtype, use_hashtable=False)])
    with torch.no_grad():
        ebc.weights["a"].copy_(torch.randn(10, 8, generator=g).to(dtype))
    reference = torch.nn.Parameter(ebc.weights["a"].detach().float().clone())
    optimizer, ref_optimizer = sk.LazyAdam(ebc.parameters(), lr=0.01), torch.optim.SparseAdam([reference], lr=0.01)
    for _ in range(3):
        values = torch.randint(0, 10, (12,), generator=g)
        out = ebc(sk.KeyedJagged(["x"], values, lengths=torch.tensor([4, 0, 8])))["x"]
        ref = F.embedding_bag(values, reference, torch.tensor([0, 4, 4]), mode="sum")
        grad_output = torch.randn(3, 8, generator=g).to(dtype).float()
        (out.float() * grad_output).sum().backward()
        (ref * grad_output).sum().backward()
        reference.grad = reference.grad.to_sparse().coalesce()
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        with torch.no_grad():
            reference.copy_(reference.to(dtype).float())
    torch.testing.assert_close(ebc.weights["a"].detach().float(), reference.detach(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_embedding_bag_tbe_layout(mode, index_dtype, dtype):
    """forward_test.py's TBE input layout on sk.ops.embedding_bag: one table's [B * L] indices
    with CSR offsets (int32 / int64), per-sample weights in SUM, empty bags; MEAN divides by
    the bag's length (unweighted), as nn.EmbeddingBag(mode="mean")."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(20, 8, generator=g).to(dtype).requires_grad_()
    lengths = torch.tensor([3, 0, 1, 5, 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    psw = torch.randn(rows.numel(), generator=g) if mode == "sum" else None
    out = sk.ops.embedding_bag(weight, rows.to(index_dtype), offsets.to(index_dtype),
                               per_sample_weights=None if psw is None else psw.to(dtype), mode=mode)
    reference = weight.detach().float().requires_grad_()
    ref = F.embedding_bag(rows, reference, offsets[:-1], mode=mode,
                          per_sample_weights=None if psw is None else psw.to(dtype).float())
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), **TOL[dtype])
    grad_output = torch.randn(5, 8, generator=g).to(dtype)
    out.backward(grad_output)
    ref.backward(grad_output.float())
    assert weight.grad.is_sparse
    torch.testing.assert_close(weight.grad.to_dense().float(), reference.grad,
                               **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}))

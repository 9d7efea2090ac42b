"""EmbeddingBagCollection against plain torch on drawn configurations: 1-6 tables of
mixed dims (tables of one dim pool together), float32 and bfloat16, hash or direct rows,
sum or mean, features sharing tables, empty bags and empty features, per-value weights,
batch sizes 0..40, int32 and int64 values, 1-3 micro-batches whose gradients accumulate
before they are read; forward values and every table's gradient, on every device."""

import zlib

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from properties import examples

import sparsekit as sk


@st.composite
def configurations(draw):
    num_tables = draw(st.integers(1, 6))
    tables, features = [], []
    for t in range(num_tables):
        dim = draw(st.sampled_from([1, 3, 4, 8]))
        shared = draw(st.integers(1, 2))
        names = [f"f{t}_{i}" for i in range(shared)]
        features += names
        tables.append(dict(name=f"t{t}", dim=dim, features=names, combiner=draw(st.sampled_from(["sum", "mean"])),
                           dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
                           direct=draw(st.booleans())))
    order = draw(st.permutations(features))
    used = order[:draw(st.integers(1, len(order)))]  # a batch may leave features out
    batch = draw(st.sampled_from([0, 1, 7, 40]))
    weighted = draw(st.booleans())
    int32 = draw(st.booleans())
    micro_batches = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    return tables, list(used), batch, weighted, int32, micro_batches, seed


def _initial(table, keys):
    return sk.KeySeededUniform(seed=zlib.crc32(table["name"].encode()))(keys, table["dim"]).to(table["dtype"]).float()


# Three tables of one dim; the second micro-batch gives keys to tables that had empty
# gradients in the first (the empty gradients once shared one buffer's storage).
@example(config=([dict(name=f"t{t}", dim=1, features=[f"f{t}_0"], combiner="sum", dtype=torch.float32, direct=False)
           for t in range(3)], ["f0_0", "f1_0", "f2_0"], 7, False, False, 2, 0))
@given(config=configurations())
@examples(10)
def test_collection_matches_plain_torch(config, device):
    tables, used, batch, weighted, int32, micro_batches, seed = config
    g = torch.Generator().manual_seed(seed)
    ebc = sk.EmbeddingBagCollection([
        sk.TableConfig(t["name"], t["dim"], 64, t["features"], combiner=t["combiner"], dtype=t["dtype"],
                       use_hashtable=not t["direct"]) for t in tables], device=device)
    table_of = {f: t for t in tables for f in t["features"]}
    grads = {t["name"]: {} for t in tables}
    for micro_batch in range(micro_batches):
        # A later micro-batch may leave out features (and so tables) an earlier one had, or
        # hold no keys at all; an earlier one may miss tables a later one has.
        features = used if micro_batch == 0 else [f for f in used if torch.rand((), generator=g) < 0.5]
        most = int(torch.randint(1, 5, (), generator=g)) if micro_batches > 1 else 4
        lengths = torch.randint(0, most, (len(features) * batch,), generator=g)
        values = torch.randint(0, 64, (int(lengths.sum()),), generator=g)
        if int32:
            values = values.int()
        weights = torch.rand(values.numel(), generator=g) if weighted else None
        kjt = sk.KeyedJagged(features, values.to(device), lengths=lengths.to(device),
                             weights=None if weights is None else weights.to(device))
        out = ebc(kjt)
        assert list(out) == features

        offsets = kjt.offsets().cpu()
        for f, feature in enumerate(features):
            table = table_of[feature]
            rows = []
            for b in range(batch):
                lo, hi = int(offsets[f * batch + b]), int(offsets[f * batch + b + 1])
                keys = values[lo:hi].long()
                scale = weights[lo:hi] if weighted else torch.ones(hi - lo)
                pooled = (_initial(table, keys) * scale.unsqueeze(1)).sum(0)
                denominator = max(1, hi - lo) if table["combiner"] == "mean" else 1
                rows.append(pooled / denominator)
                for key, w in zip(keys.tolist(), scale.tolist()):
                    grads[table["name"]][key] = grads[table["name"]].get(key, 0.0) + w / denominator
            expected = (torch.stack(rows) if rows else torch.zeros(0, table["dim"])).to(table["dtype"])
            assert out[feature].dtype == table["dtype"] and out[feature].shape == (batch, table["dim"])
            tolerance = dict(rtol=1e-2, atol=1e-3) if table["dtype"] == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
            assert out[feature].device.type == device.type  # (cuda:0 is not the fixture's cuda)
            torch.testing.assert_close(out[feature].cpu(), expected, **tolerance)

        loss = sum((v.float().sum() for v in out.values()), torch.zeros((), device=device))
        if loss.requires_grad:
            loss.backward()
    for table in tables:
        grad = ebc.weights[table["name"]].grad
        want = grads[table["name"]]
        if grad is None:
            assert not want
            continue
        grad = grad.coalesce().cpu()
        shard = ebc.shards[int(table["name"][1:])]
        keys = (shard.owned_keys() if shard.hash_table is None else shard.hash_table.export()[0]).cpu()
        got = {}
        for row, value in zip(grad.indices()[0].tolist(), grad.values().float()):
            got[int(keys[row])] = value
        assert set(got) == set(want)
        for key, value in want.items():
            tolerance = 2e-2 if table["dtype"] == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got[key], torch.full((table["dim"],), value), rtol=tolerance, atol=tolerance)


@examples(20)
@given(num_features=st.integers(1, 5), batch=st.sampled_from([0, 1, 3, 17]), weighted=st.booleans(),
       int32=st.booleans(), by_offsets=st.booleans(), seed=st.integers(0, 2**31))
def test_keyed_jagged_per_key_views_slice_the_feature_major_layout(num_features, batch, weighted, int32,
                                                                    by_offsets, seed):
    """kjt[key], to_dict(), length_per_key() and offset_per_key() against slicing the
    feature-major lengths and values by hand."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.int32 if int32 else torch.int64
    lengths = torch.randint(0, 4, (num_features * batch,), generator=g).to(dtype)
    nnz = int(lengths.sum())
    values = torch.randint(-5, 50, (nnz,), generator=g).to(dtype)
    weights = torch.rand(nnz, generator=g) if weighted else None
    keys = [f"f{i}" for i in range(num_features)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.long().cumsum(0)]).to(dtype)
    kjt = sk.KeyedJagged(keys, values, offsets=offsets, weights=weights) if by_offsets else \
        sk.KeyedJagged(keys, values, lengths=lengths, weights=weights)
    per_feature = lengths.long().view(num_features, batch).sum(1).tolist() if batch else [0] * num_features
    assert kjt.length_per_key() == per_feature
    assert kjt.offset_per_key() == [0] + torch.tensor(per_feature, dtype=torch.int64).cumsum(0).tolist()
    views = kjt.to_dict()
    assert list(views) == keys
    start = 0
    for f, key in enumerate(keys):
        view, end = kjt[key], start + per_feature[f]
        for got in (view, views[key]):
            assert got.keys() == [key]
            assert torch.equal(got.values(), values[start:end])
            assert got.lengths().tolist() == lengths[f * batch:(f + 1) * batch].tolist()
            assert got.offsets().tolist() == [0] + lengths[f * batch:(f + 1) * batch].long().cumsum(0).tolist()
            assert (got.weights_or_none() is None) == (weights is None)
            if weights is not None:
                assert torch.equal(got.weights(), weights[start:end])
        start = end


@given(dims=st.lists(st.sampled_from([1, 4, 8]), min_size=1, max_size=5),
       batches=st.lists(st.tuples(st.permutations(range(5)), st.integers(0, 5), st.integers(0, 2**31)),
                        min_size=1, max_size=8))
@examples(10)
def test_a_keyed_output_follows_each_batchs_features(dims, batches, device):
    # The keyed layout of each distinct feature list is kept across calls: batches naming
    # other features, in other orders, must each get their own (zeros for a feature left out).
    configs = [sk.TableConfig(f"t{t}", dim, 32, [f"f{t}"], combiner="mean" if t % 2 else "sum")
               for t, dim in enumerate(dims)]
    keyed = sk.EmbeddingBagCollection(configs, device=device, output="keyed").eval()
    plain = sk.EmbeddingBagCollection(configs, device=device).eval()
    plain.load_state_dict(keyed.state_dict())
    for order, count, seed in batches:
        g = torch.Generator().manual_seed(seed)
        features = [f"f{t}" for t in order if t < len(dims)][:count]
        lengths = torch.randint(0, 4, (len(features) * 3,), generator=g)
        values = torch.randint(0, 32, (int(lengths.sum()),), generator=g)
        kjt = sk.KeyedJagged(features, values.to(device), lengths=lengths.to(device))
        out, expected = keyed(kjt), plain(kjt)
        assert out.keys() == [f"f{t}" for t in range(len(dims))]
        for t, dim in enumerate(dims):
            want = expected.get(f"f{t}", torch.zeros(3 if features else 0, dim, device=device))
            torch.testing.assert_close(out[f"f{t}"], want, rtol=0, atol=0)

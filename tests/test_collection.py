"""EmbeddingBagCollection, TableConfig and KeyedJagged (DESIGN.md section 3b): pooled
lookups against plain torch, mixed dims and dtypes, shared tables, empty features,
weights, TorchRec-shaped input, errors, per-table dynamic tables and checkpoints, and
world sizes 1, 2 and 4 equal to one process."""

import zlib

import pytest
import torch
from _distributed import spawn

import sparsekit as sk
from sparsekit.hashtable import HashTableFullError

BATCH = 8
STEPS = 4


def tables():
    return [
        sk.TableConfig("users", 4, 64, ["user"]),
        sk.TableConfig("items", 8, 64, ["item", "last_item"], combiner="mean"),           # shared by 2 features
        sk.TableConfig("ids", 4, 64, ["id"], use_hashtable=False),                        # direct rows
        sk.TableConfig("half", 8, 64, ["cat"], dtype=torch.bfloat16),
        sk.TableConfig("odd", 5, 64, ["odd"]),
    ]


def batch(step, batch_size=BATCH, features=("user", "item", "last_item", "id", "cat", "odd"), weighted=False):
    """A deterministic KeyedJagged: bag lengths 0..3, keys from small per-feature pools."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 4, (len(features) * batch_size,), generator=g)
    if "item" in features:  # an empty feature this step
        i = features.index("item")
        lengths[i * batch_size:(i + 1) * batch_size] = 0 if step == 2 else lengths[i * batch_size:(i + 1) * batch_size]
    values = []
    for f, feature in enumerate(features):
        n = int(lengths[f * batch_size:(f + 1) * batch_size].sum())
        high = 64 if feature == "id" else 40
        keys = torch.randint(0, high, (n,), generator=g)
        if feature != "id":
            keys = keys * 1_000_003 - 2**62  # wide, negative hashed-like keys
        values.append(keys)
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return sk.KeyedJagged(list(features), values, lengths=lengths, weights=weights)


def initial(table, keys):
    return sk.KeySeededUniform(seed=zlib.crc32(table.encode()))(keys, {"users": 4, "items": 8, "ids": 4,
                                                                      "half": 8, "odd": 5}[table])


def reference_forward(kjt):
    """Plain torch: every key's first vector (in the table's dtype), pooled in float32."""
    owner = {"user": "users", "item": "items", "last_item": "items", "id": "ids", "cat": "half", "odd": "odd"}
    dtypes = {"half": torch.bfloat16}
    offsets = kjt.offsets()
    out = {}
    for f, feature in enumerate(kjt.keys()):
        table = owner[feature]
        dtype = dtypes.get(table, torch.float32)
        rows = []
        for b in range(BATCH):
            lo, hi = offsets[f * BATCH + b], offsets[f * BATCH + b + 1]
            keys = kjt.values()[lo:hi]
            vectors = initial(table, keys).to(dtype).float()
            if kjt.weights_or_none() is not None:
                vectors = vectors * kjt.weights_or_none()[lo:hi].unsqueeze(1)
            pooled = vectors.sum(0)
            if table == "items":
                pooled = pooled / max(1, hi - lo)
            rows.append(pooled)
        out[feature] = torch.stack(rows).to(dtype)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_plain_torch(weighted):
    ebc = sk.EmbeddingBagCollection(tables())
    kjt = batch(0, weighted=weighted)
    out = ebc(kjt)
    expected = reference_forward(kjt)
    assert list(out) == kjt.keys()
    for feature in out:
        assert out[feature].dtype == expected[feature].dtype and out[feature].shape[0] == BATCH
        torch.testing.assert_close(out[feature], expected[feature], rtol=1e-6, atol=1e-7)


def test_backward_gives_each_table_a_sparse_gradient_summed_over_its_features():
    ebc = sk.EmbeddingBagCollection(tables())
    kjt = batch(1)
    out = ebc(kjt)
    sum(v.float().sum() for v in out.values()).backward()
    grad = ebc.weights["items"].grad
    assert grad.is_sparse and grad.is_coalesced()
    # Every row's gradient: (1 / bag length) summed over every occurrence in both features.
    keys, rows = ebc.export("items")
    expected = torch.zeros(len(keys))
    offsets, values = kjt.offsets(), kjt.values()
    for f, feature in enumerate(kjt.keys()):
        if feature not in ("item", "last_item"):
            continue
        for b in range(BATCH):
            lo, hi = int(offsets[f * BATCH + b]), int(offsets[f * BATCH + b + 1])
            for key in values[lo:hi].tolist():
                expected[keys.tolist().index(key)] += 1 / (hi - lo)
    dense = grad.to_dense()[: len(keys), 0]
    torch.testing.assert_close(dense, expected)


@pytest.mark.parametrize("weighted", [False, True])
def test_one_key_per_bag_matches_plain_torch_forward_and_backward(weighted):
    """Every bag holds one key (DLRM's slots): pooling takes its gather path."""
    g = torch.Generator().manual_seed(7)
    features = ["user", "item", "last_item", "id", "cat", "odd"]
    values = torch.randint(0, 40, (len(features) * BATCH,), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    kjt = sk.KeyedJagged(features, values, lengths=torch.ones(len(features) * BATCH, dtype=torch.int64),
                         weights=weights)
    ebc = sk.EmbeddingBagCollection(tables())
    out = ebc(kjt)
    expected = reference_forward(kjt)
    for feature in out:
        torch.testing.assert_close(out[feature], expected[feature], rtol=1e-6, atol=1e-7)
    sum((v.float() * (i + 1)).sum() for i, v in enumerate(out.values())).backward()
    keys, _ = ebc.export("items")
    grad = ebc.weights["items"].grad
    assert grad.is_sparse and grad.is_coalesced()
    want = torch.zeros(len(keys))
    for f in (1, 2):  # item, last_item read "items"; output f scaled by f + 1
        for b in range(BATCH):
            j = f * BATCH + b
            want[keys.tolist().index(int(values[j]))] += (f + 1) * (1.0 if weights is None else float(weights[j]))
    torch.testing.assert_close(grad.to_dense()[:len(keys), 0], want)


def test_torchrec_shaped_input_is_accepted():
    class TorchRecLike:  # KeyedJaggedTensor's methods, nothing of sparsekit
        def __init__(self, kjt):
            self._kjt = kjt

        def keys(self):
            return self._kjt.keys()

        def values(self):
            return self._kjt.values()

        def lengths(self):
            return self._kjt.lengths()

        def offsets(self):
            return self._kjt.offsets()

        def weights_or_none(self):
            return None

    ebc = sk.EmbeddingBagCollection(tables())
    kjt = batch(3)
    a, b = ebc(kjt), ebc(TorchRecLike(kjt))
    assert all(torch.equal(a[f], b[f]) for f in a)


def test_a_subset_of_features_and_offsets_input():
    ebc = sk.EmbeddingBagCollection(tables())
    kjt = batch(4, features=("cat", "user"))
    again = sk.KeyedJagged(kjt.keys(), kjt.values(), offsets=kjt.offsets())
    out = ebc(again)
    assert list(out) == ["cat", "user"]
    assert torch.equal(out["user"], ebc(kjt)["user"])


def test_errors_name_what_is_wrong():
    ebc = sk.EmbeddingBagCollection(tables())
    with pytest.raises(ValueError, match=r"no table reads feature\(s\) \['price'\]"):
        ebc(sk.KeyedJagged(["price"], torch.tensor([1]), lengths=torch.ones(BATCH, dtype=torch.int64)[:1]))
    with pytest.raises(ValueError, match="do not split into 2 features"):
        ebc(sk.KeyedJagged(["user", "cat"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0])))
    with pytest.raises(ValueError, match="key 64 of table 'ids' is out of range"):
        ebc(sk.KeyedJagged(["id"], torch.tensor([64]), lengths=torch.tensor([1])))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        ebc(sk.KeyedJagged(["user"], torch.tensor([1, 2]), offsets=torch.tensor([0, 3])))
    # Lengths that sum to len(values) but one is negative, or offsets past the end in the
    # middle: the same clear error (not repeat_interleave's), with or without weights.
    for weights in (None, torch.ones(2)):
        with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
            ebc(sk.KeyedJagged(["user"], torch.tensor([1, 2]), lengths=torch.tensor([2, 1, -1]), weights=weights))
        with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
            ebc(sk.KeyedJagged(["user"], torch.tensor([1, 2]), offsets=torch.tensor([0, 7, 1, 2]), weights=weights))
    assert ebc.stats("users")["size"] == 0
    with pytest.raises(TypeError, match="sk.KeyedJagged"):
        ebc(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="read by tables 'a' and 'b'"):
        sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 8, ["x"]), sk.TableConfig("b", 4, 8, ["x"])])
    with pytest.raises(TypeError, match="dtype must be"):
        sk.TableConfig("a", 4, 8, ["x"], dtype=torch.float64)
    with pytest.raises(ValueError, match="features must be a non-empty list"):
        sk.TableConfig("a", 4, 8, "x")
    with pytest.raises(KeyError, match="no table 'nope'"):
        ebc.stats("nope")


def test_per_table_eviction_stats_and_export():
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("small", 4, 3, ["a"], eviction="lru"),
                                     sk.TableConfig("big", 4, 100, ["b"], admit_after=2)])
    for step in range(3):
        keys = torch.tensor([10 * step, 10 * step + 1, 5, 6])
        ebc(sk.KeyedJagged(["a", "b"], keys, lengths=torch.tensor([2, 2])))
    small, big = ebc.stats("small"), ebc.stats("big")
    # Steps 0, 1, 2 bring keys (0, 1), (10, 11), (20, 21): step 1 evicts 0 (the smaller of
    # two keys last seen at clock 0), step 2 evicts 1 (clock 0) and 10 (clock 1, < 11).
    assert small["size"] == 3 and small["evicted"] == 3
    assert big["admitted"] == 2 and big["pending"] == 0  # 5 and 6, seen in 3 steps
    keys, vectors = ebc.export("small")
    assert keys.tolist() == [20, 21, 11]
    assert vectors.shape == (3, 4)
    with pytest.raises(HashTableFullError):
        ebc(sk.KeyedJagged(["a"], torch.tensor([100, 101, 102, 103]), lengths=torch.tensor([4])))


def test_bf16_table_trains_close_to_float32():
    def run(dtype):
        ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 16, 256, ["f"], dtype=dtype,
                                                        initializer=lambda k, d: torch.ones(k.numel(), d) * 0.25)])
        optimizer = sk.LazyAdam(ebc.parameters(), lr=0.01)
        for step in range(20):
            g = torch.Generator().manual_seed(step)
            keys = torch.randint(0, 200, (64,), generator=g)
            out = ebc(sk.KeyedJagged(["f"], keys, lengths=torch.full((16,), 4)))["f"]
            target = torch.randn(16, 16, generator=g)
            ((out.float() - target) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.state[ebc.weights["t"]]["exp_avg"].dtype == torch.float32
        keys, vectors = ebc.export("t")
        return dict(zip(keys.tolist(), vectors.float()))

    full, half = run(torch.float32), run(torch.bfloat16)
    assert full.keys() == half.keys()
    worst = max((full[k] - half[k]).abs().max().item() for k in full)
    assert worst < 0.02  # bf16 keeps ~3 significant digits of values near 0.25


def _train(ebc, steps, rank, world_size, global_batch, weighted=False):
    """Trains on this rank's slice of global batches; the loss sums over the local samples,
    so the ranks' gradients add up to the one-process gradient."""
    optimizer = sk.LazyAdam(ebc.parameters(), lr=0.05)
    outputs = []
    per = global_batch // world_size
    for step in range(steps):
        kjt = batch(step, global_batch, weighted=weighted)
        out = ebc(_rank_slice(kjt, rank, world_size))
        g = torch.Generator().manual_seed(step)
        loss = 0
        for feature, value in out.items():
            target = torch.randn(global_batch, value.shape[1], generator=g)[rank * per:(rank + 1) * per]
            loss = loss + (value.float() * target).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append({f: v.detach().float() for f, v in out.items()})
    return outputs, optimizer


def _rank_slice(kjt, rank, world_size):
    """This rank's samples of a feature-major batch of world_size * BATCH samples."""
    features = kjt.keys()
    total = kjt.lengths().numel() // len(features)
    per = total // world_size
    lengths, values, weights = [], [], []
    offsets = kjt.offsets()
    for f in range(len(features)):
        lo, hi = f * total + rank * per, f * total + (rank + 1) * per
        lengths.append(kjt.lengths()[lo:hi])
        values.append(kjt.values()[offsets[lo]:offsets[hi]])
        if kjt.weights_or_none() is not None:
            weights.append(kjt.weights_or_none()[offsets[lo]:offsets[hi]])
    return sk.KeyedJagged(features, torch.cat(values), lengths=torch.cat(lengths),
                          weights=torch.cat(weights) if weights else None)


def _world_worker(rank, world_size, init, out_dir):
    init()
    ebc = sk.EmbeddingBagCollection(tables())
    # A bad input on the last rank: every rank raises, nothing changes, the group stays in step.
    # A key out of range; lengths with a negative one that still sum to len(values).
    good = sk.KeyedJagged(["id"], torch.tensor([1]), lengths=torch.tensor([1]))
    for bad, message in ((sk.KeyedJagged(["id"], torch.tensor([64 * world_size]), lengths=torch.tensor([1])),
                          "out of range"),
                         (sk.KeyedJagged(["user"], torch.tensor([1, 2]), lengths=torch.tensor([2, 1, -1])),
                          "offsets must start at 0, never decrease")):
        if rank == world_size - 1:
            with pytest.raises(ValueError, match=message):
                ebc(bad)
        else:
            with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{world_size - 1}\] of the process group rejected"):
                ebc(good)
    assert ebc.stats("users")["size"] == 0
    outputs, optimizer = _train(ebc, STEPS, rank, world_size, BATCH * world_size, weighted=True)
    sk.save_checkpoint(out_dir, ebc, optimizer)
    torch.save(outputs, f"{out_dir}/outputs-{rank}.pt")


@pytest.mark.parametrize("world_size", [2, 4])
def test_world_sizes_match_one_process_and_checkpoints_reshard(tmp_path, world_size):
    spawn(_world_worker, world_size, str(tmp_path), str(tmp_path))
    # One process on the same global batches, sliced the same way per rank.
    reference = sk.EmbeddingBagCollection(tables())
    ref_outputs, _ = _train(reference, STEPS, 0, 1, BATCH * world_size, weighted=True)
    for rank in range(world_size):
        outputs = torch.load(tmp_path / f"outputs-{rank}.pt")
        per = BATCH
        for step in range(STEPS):
            for feature, value in outputs[step].items():
                expected = ref_outputs[step][feature][rank * per:(rank + 1) * per]
                tolerance = dict(rtol=2e-2, atol=2e-3) if feature == "cat" else dict(rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(value, expected, **tolerance, msg=lambda m: f"{feature} {step}: {m}")
    # The world_size checkpoint loads into one process: every table's keys and vectors.
    restored = sk.EmbeddingBagCollection(tables())
    optimizer = sk.LazyAdam(restored.parameters(), lr=0.05)
    sk.load_checkpoint(str(tmp_path), restored, optimizer)
    for table in ("users", "items", "half"):
        keys, vectors = restored.export(table)
        ref_keys, ref_vectors = reference.export(table)
        assert sorted(keys.tolist()) == sorted(ref_keys.tolist())
        got = dict(zip(keys.tolist(), vectors.float()))
        for key, vector in zip(ref_keys.tolist(), ref_vectors.float()):
            torch.testing.assert_close(got[key], vector, rtol=2e-2 if table == "half" else 1e-5, atol=1e-5)
    kjt = batch(9)
    restored.eval()
    reference.eval()
    a, b = restored(kjt), reference(kjt)
    torch.testing.assert_close(a["user"], b["user"], rtol=1e-5, atol=1e-6)

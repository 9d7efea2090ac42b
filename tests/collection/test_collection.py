"""EmbeddingBagCollection, TableConfig and KeyedJagged (docs/api.md): pooled
lookups against plain torch, mixed dims and dtypes, shared tables, empty features,
weights, TorchRec-shaped input, errors (bad inputs, TorchRec-like or not, get the same
checks and change nothing; bad table configs and names), per-table dynamic tables and
checkpoints, and world sizes 1, 2 and 4 equal to one process."""

import copy
import datetime
import glob
import json
import os
import re
import time
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cuda import count_host_syncs
from _distributed import spawn
from _state import assert_equal_nested

import sparsekit as sk
from sparsekit.collection import UnknownTableError
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
def test_a_batch_of_empty_bags_still_gives_outputs_that_train(dtype, training):
    """No feature holds a key: the outputs are zeros that still require grad (as
    nn.EmbeddingBag's do), the backward gives every table an empty sparse gradient and the
    optimizer's step changes no weight."""
    collection = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 8, ["f"], dtype=dtype),
                                            sk.TableConfig("u", 8, 8, ["g"], dtype=dtype, combiner="mean")])
    collection.train(training)
    optimizer = sk.LazyAdam(collection.parameters(), lr=0.1)
    before = [p.detach().clone() for p in collection.parameters()]
    out = collection(sk.KeyedJagged(["f", "g"], torch.empty(0, dtype=torch.int64), lengths=torch.zeros(6, dtype=torch.int64)))
    assert {name: (tuple(v.shape), v.dtype) for name, v in out.items()} == {"f": ((3, 4), dtype), "g": ((3, 8), dtype)}
    assert all(v.requires_grad and not v.detach().any() for v in out.values())
    sum(v.float().sum() for v in out.values()).backward()
    for weight in collection.parameters():
        assert weight.grad.is_sparse and weight.grad._nnz() == 0
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(collection.parameters(), before))
    with torch.no_grad():
        out = collection(sk.KeyedJagged(["f", "g"], torch.empty(0, dtype=torch.int64), lengths=torch.zeros(6, dtype=torch.int64)))
    assert not any(v.requires_grad for v in out.values())


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
    with pytest.raises(TypeError, match="features must be a non-empty list"):
        sk.TableConfig("a", 4, 8, "x")
    with pytest.raises(KeyError, match="no table 'nope'"):
        ebc.stats("nope")


# -- bad input: the same checks for sk.KeyedJagged and TorchRec-like objects ------------------


@pytest.mark.parametrize("offsets, valid", [
    ([0, 1, 2, 3, 4], True),    # one key per bag: the rows-first path
    ([0, 0, 2, 3, 4], True),    # as many keys as bags, one bag empty and one of two
    ([0, 2, 1, 3, 4], False),   # decreasing
    ([1, 2, 3, 4, 4], False),   # not starting at 0
    ([0, 1, 2, 3, 5], False),   # past the end
    ([0, 1, 2, 3, 3], False),   # short of the end
    ([0, 1, 2, 1, 4], False),   # one step back between bags of one key
    ([0, 2**63 - 1, -2, 3, 4], False),  # differences that wrap in int64 (2**63 - 1, then -2**63 - 1)
])
def test_offsets_near_one_key_per_bag_are_pooled_or_refused(offsets, valid):
    """The offsets' checks and the one-key-per-bag test share one pass over the host
    values: inputs that pass for one key per bag, or just fail, pool as plain torch or
    raise the offsets' error with no table changed."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("users", 4, 64, ["user"]), sk.TableConfig("odd", 5, 64, ["odd"])])
    values = torch.tensor([5, 6, 7, 8])
    kjt = sk.KeyedJagged(["user", "odd"], values, offsets=torch.tensor(offsets))
    if not valid:
        with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
            ebc(kjt)
        assert ebc.stats("users")["size"] == 0 and ebc.stats("odd")["size"] == 0
        return
    out = ebc(kjt)
    for f, (feature, table, dim) in enumerate((("user", "users", 4), ("odd", "odd", 5))):
        want = torch.stack([initial(table, values[offsets[b]:offsets[b + 1]]).sum(0) if offsets[b + 1] > offsets[b]
                            else torch.zeros(dim) for b in (2 * f, 2 * f + 1)])
        torch.testing.assert_close(out[feature], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_lengths_whose_offsets_wrap_are_refused_and_change_nothing(weighted, training):
    """Lengths of 2**63 - 1 make offsets that wrap in int64 ([0, 2**63 - 1, -2, 3, ...],
    inside the first feature: its bounds 0, 3, 6 are in order) but still start at 0 and end
    at len(values), one more than the last: refused as decreasing offsets before any table
    changes, in training and eval, with and without weights, for a mean table too."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("users", 4, 64, ["user"]),
                                     sk.TableConfig("odd", 5, 64, ["odd"], combiner="mean")])
    ebc(sk.KeyedJagged(["user", "odd"], torch.tensor([5, 6, 7, 8, 9, 10]), lengths=torch.ones(6, dtype=torch.int64)))
    ebc.train(training)
    before = snapshot(ebc)
    scores = [(s.hash_table.clock, s.hash_table._last_seen.clone(), s.hash_table._count.clone()) for s in ebc.shards]
    big = 2**63 - 1
    kjt = sk.KeyedJagged(["user", "odd"], torch.tensor([5, 6, 11, 7, 8, 12]),
                         lengths=torch.tensor([big, big, 5, 1, 1, 1]), weights=torch.ones(6) if weighted else None)
    assert kjt.offsets().tolist() == [0, big, -2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
        ebc(kjt)
    assert_unchanged(ebc, before)
    for shard, (clock, seen, count) in zip(ebc.shards, scores):
        assert shard.hash_table.clock == clock
        assert torch.equal(shard.hash_table._last_seen, seen) and torch.equal(shard.hash_table._count, count)


def torchrec_like(**methods):
    """An object with only the given KeyedJaggedTensor methods, each returning its value."""
    return type("TorchRecLike", (), {name: (lambda self, value=value: value) for name, value in methods.items()})()


def snapshot(ebc):
    """Everything a failed call must leave as it was: weights, every table's stats and export."""
    names = [t.name for t in ebc.tables]
    return ({name: w.detach().clone() for name, w in ebc.weights.items()}, {name: ebc.stats(name) for name in names},
            {name: tuple(t.clone() for t in ebc.export(name)) for name in names})


def assert_unchanged(ebc, before):
    weights, stats, exports = snapshot(ebc)
    assert stats == before[1]
    for name in weights:
        assert torch.equal(weights[name], before[0][name]), name
        assert all(torch.equal(a, b) for a, b in zip(exports[name], before[2][name])), name


def trained_collection():
    """A collection after one training step (tables not empty, clocks advanced)."""
    ebc = sk.EmbeddingBagCollection(tables())
    ebc(batch(0))
    return ebc


VALUES = torch.tensor([1, 2])
GOOD = {"keys": ["user"], "values": VALUES, "offsets": torch.tensor([0, 1, 2])}  # B = 2
# (the KeyedJagged argument, a bad value, the error, its message after the argument's name)
BAD_PARTS = [
    ("weights", torch.tensor([1 + 1j, 2 + 0j]), TypeError, "must be a float tensor"),
    ("weights", torch.tensor([1, 2]), TypeError, "must be a float tensor"),
    ("weights", torch.tensor([True, False]), TypeError, "must be a float tensor"),
    ("weights", [1.0, 2.0], TypeError, "must be a float tensor .* got a list"),
    # A packed float4 is a float dtype that does not convert to float32.
    *([("weights", torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), TypeError,
        "must be a float tensor")] if hasattr(torch, "float4_e2m1fn_x2") else []),
    ("weights", torch.ones(3), ValueError, r"must be \[nnz\] = \[2\]"),
    ("weights", torch.ones(2, 1), ValueError, r"must be \[nnz\] = \[2\]"),
    ("offsets", torch.tensor([0.0, 1.7, 2.0]), TypeError, "must be an int64 or int32 tensor"),
    ("offsets", torch.tensor([False, True, True]), TypeError, "must be an int64 or int32 tensor"),
    ("offsets", torch.tensor([0, 1, 2], dtype=torch.uint8), TypeError, "must be an int64 or int32 tensor"),
    ("offsets", torch.tensor([0, 1, 2], dtype=torch.int16), TypeError, "must be an int64 or int32 tensor"),
    ("offsets", [0, 1, 2], TypeError, "must be an int64 or int32 tensor .* got a list"),
    ("offsets", torch.tensor([0, 1, 2, 2, 2]).view(5, 1), ValueError, r"must be 1-D .* got shape \(5, 1\)"),
    ("offsets", torch.tensor(0), ValueError, r"must be 1-D .* got shape \(\)"),
    ("offsets", torch.zeros(0, dtype=torch.int64), ValueError, "must hold .* got an empty tensor"),
    ("lengths", torch.tensor([1.0, 1.0]), TypeError, "must be an int64 or int32 tensor"),
    ("lengths", torch.tensor([True, True]), TypeError, "must be an int64 or int32 tensor"),
    ("lengths", torch.tensor([1, 1], dtype=torch.uint8), TypeError, "must be an int64 or int32 tensor"),
    ("lengths", torch.tensor([1, 1], dtype=torch.int16), TypeError, "must be an int64 or int32 tensor"),
    ("lengths", [1, 1], TypeError, "must be an int64 or int32 tensor .* got a list"),
    ("lengths", torch.tensor([[1, 1]]), ValueError, r"must be 1-D .* got shape \(1, 2\)"),
    ("values", torch.tensor([1.0, 2.0]), TypeError, "must be an int64 or int32 tensor"),
    ("values", [1, 2], TypeError, "must be an int64 or int32 tensor"),
    ("values", torch.tensor([[1, 2]]), ValueError, r"must be 1-D \[nnz\]"),
    ("keys", "user", TypeError, "must be a list of feature names"),
    ("keys", [0], TypeError, "must be a list of feature names"),
    ("keys", {"user"}, TypeError, "must be a list of feature names .* got a set"),  # no fixed order
    ("keys", frozenset(["user"]), TypeError, "must be a list of feature names"),
    # Sparse layouts pass the dtype checks; named before any op (and table) sees them.
    ("values", torch.tensor([1, 2]).to_sparse(), TypeError, r"must be a dense \(strided\) tensor, got a sparse_coo"),
    ("offsets", torch.tensor([0, 1, 2]).to_sparse(), TypeError, r"must be a dense \(strided\) tensor"),
    ("lengths", torch.tensor([1, 1]).to_sparse(), TypeError, r"must be a dense \(strided\) tensor"),
    ("weights", torch.ones(2).to_sparse(), TypeError, r"must be a dense \(strided\) tensor, got a sparse_coo"),
    ("weights", torch.ones(1, 2).to_sparse_csr(), TypeError,
     r"must be a dense \(strided\) tensor, got a sparse_csr"),
]
METHOD = {"keys": "keys", "values": "values", "lengths": "lengths", "offsets": "offsets",
          "weights": "weights_or_none"}


def _parts(arg, bad):
    parts = dict(GOOD, **{arg: bad})
    if arg == "lengths":
        del parts["offsets"]
    return parts


@pytest.mark.parametrize("arg, bad, error, message", BAD_PARTS)
def test_keyed_jagged_rejects_a_bad_part_naming_it(arg, bad, error, message):
    with pytest.raises(error, match=f"^KeyedJagged: {arg} {message}"):
        sk.KeyedJagged(**_parts(arg, bad))


@pytest.mark.parametrize("arg, bad, error, message", BAD_PARTS)
def test_torchrec_like_input_gets_the_same_checks_and_changes_nothing(arg, bad, error, message):
    """Not cast (complex weights lost their imaginary part, float offsets were truncated),
    no AttributeError or IndexError: the error names the input's method."""
    ebc = trained_collection()
    before = snapshot(ebc)
    parts = _parts(arg, bad)
    duck = torchrec_like(**{METHOD[name]: value for name, value in parts.items()})
    with pytest.raises(error, match=rf"^EmbeddingBagCollection: the input's {METHOD[arg]}\(\) {message}"):
        ebc(duck)
    assert_unchanged(ebc, before)


def test_torchrec_like_input_of_every_accepted_kind_matches_keyed_jagged():
    ebc = sk.EmbeddingBagCollection(tables())
    kjt = batch(5, weighted=True)
    expected = ebc(kjt)
    keys, values, weights = kjt.keys(), kjt.values(), kjt.weights_or_none()
    for duck in (torchrec_like(keys=tuple(keys), values=values, offsets=kjt.offsets().int(),
                               weights_or_none=weights.double()),
                 torchrec_like(keys=keys, values=values, lengths=kjt.lengths().int(), weights_or_none=weights),
                 # offsets() that returns None (TorchRec's offsets_or_none style): lengths() is read
                 torchrec_like(keys=keys, values=values, offsets=None, lengths=kjt.lengths(),
                               weights_or_none=weights)):
        out = ebc(duck)
        assert list(out) == keys
        for feature in out:
            torch.testing.assert_close(out[feature], expected[feature], rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match=r"the input's offsets\(\) and lengths\(\) returned None"):
        ebc(torchrec_like(keys=keys, values=values, offsets=None, lengths=None))
    with pytest.raises(TypeError, match=r"has neither offsets\(\) nor lengths\(\)"):
        ebc(torchrec_like(keys=keys, values=values))


def test_keyed_jagged_lengths_and_offsets_must_agree():
    lengths = torch.tensor([2, 0, 1])
    both = sk.KeyedJagged(["user"], torch.tensor([1, 2, 3]), lengths=lengths, offsets=torch.tensor([0, 2, 2, 3]))
    assert torch.equal(both.lengths(), lengths) and both.stride() == 3
    ebc = sk.EmbeddingBagCollection(tables())
    alone = sk.KeyedJagged(["user"], torch.tensor([1, 2, 3]), lengths=lengths)
    assert torch.equal(ebc(both)["user"], ebc(alone)["user"])
    for offsets in (torch.tensor([0, 1, 2, 3]),           # other lengths, same total
                    torch.tensor([0, 2, 2]),              # one bag short
                    torch.tensor([1, 3, 3, 4]),           # the same differences, not from 0
                    torch.tensor([0, 2, 2, 3], dtype=torch.int32) + 1):
        with pytest.raises(ValueError, match="KeyedJagged: lengths and offsets disagree"):
            sk.KeyedJagged(["user"], torch.tensor([1, 2, 3]), lengths=lengths, offsets=offsets)
    # int32 and int64 that agree are fine.
    sk.KeyedJagged(["user"], torch.tensor([1, 2, 3]), lengths=lengths.int(), offsets=torch.tensor([0, 2, 2, 3]))


def test_an_input_on_the_wrong_device_is_named():
    """The error names the tensor on the wrong device and its device (it named values')."""
    ebc = trained_collection()
    before = snapshot(ebc)
    meta = torch.device("meta")
    cases = [(sk.KeyedJagged(["user"], VALUES.to(meta), lengths=torch.tensor([1, 1])), "values"),
             (sk.KeyedJagged(["user"], VALUES, lengths=torch.tensor([1, 1], device=meta)), "lengths"),
             (sk.KeyedJagged(["user"], VALUES, offsets=torch.tensor([0, 1, 2], device=meta)), "offsets"),
             (sk.KeyedJagged(["user"], VALUES, lengths=torch.tensor([1, 1]), weights=torch.ones(2, device=meta)),
              "weights"),
             (torchrec_like(keys=["user"], values=VALUES, offsets=torch.tensor([0, 1, 2], device=meta)),
              r"offsets\(\)"),
             (torchrec_like(keys=["user"], values=VALUES, offsets=torch.tensor([0, 1, 2]),
                            weights_or_none=torch.ones(2, device=meta)), r"weights_or_none\(\)")]
    for kjt, name in cases:
        with pytest.raises(RuntimeError, match=f"the input's {name} is on meta but the collection is on cpu"):
            ebc(kjt)
    assert_unchanged(ebc, before)


@pytest.mark.parametrize("training", [True, False])
def test_weights_made_under_inference_mode_are_refused_before_any_table_changes(training):
    """Weights that autograd cannot save for backward (inference tensors, as a data loader
    under inference_mode makes) were refused by autograd only after a training step had
    put its keys in the tables; under no_grad / inference_mode they are fine."""
    ebc = trained_collection().train(training)
    before = snapshot(ebc)
    with torch.inference_mode():
        weights = torch.ones(3)
    kjt = sk.KeyedJagged(["user"], torch.tensor([100, 101, 102]), lengths=torch.tensor([2, 1]), weights=weights)
    with pytest.raises(RuntimeError, match=r"the input's weights was made under torch.inference_mode\(\)"):
        ebc(kjt)
    assert_unchanged(ebc, before)
    with torch.no_grad():
        ebc.eval()(kjt)
    with torch.inference_mode():
        ebc.eval()(kjt)
    # Frozen tables (a trained embedding under a new dense top): nothing saves the weights.
    ebc.requires_grad_(False).train(training)(kjt)


def test_float8_weights_pool_as_their_float32_values():
    ebc = trained_collection().eval()
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    weights = torch.tensor([0.5, 2.0, -1.5]).to(torch.float8_e4m3fn)
    got = ebc(sk.KeyedJagged(["user"], values, lengths=lengths, weights=weights))["user"]
    expected = ebc(sk.KeyedJagged(["user"], values, lengths=lengths, weights=weights.float()))["user"]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("first", ["one key elsewhere", "every bag empty"])
def test_tables_with_empty_gradients_accumulate_their_own_next_gradients(first):
    """Two tables of one dim both got an empty gradient (a micro-batch without their keys,
    or, on a rank, without keys it owns): the empty parts of one buffer shared its storage,
    autograd added the next micro-batches into them in place, and table a ended with
    table b's gradient."""
    def kjt(features, values, lengths):
        return sk.KeyedJagged(features, torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths))
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 2, 5, ["fa"]), sk.TableConfig("b", 2, 6, ["fb"]),
                                     sk.TableConfig("c", 3, 6, ["fc"])])
    batch = kjt(["fa", "fb", "fc"], [9], [0, 0, 1]) if first == "one key elsewhere" else \
        kjt(["fa", "fb"], [], [0, 0, 0, 0])
    sum(v.sum() for v in ebc(batch).values()).backward()
    assert ebc.weights["a"].grad._nnz() == ebc.weights["b"].grad._nnz() == 0
    ebc(kjt(["fa"], [1], [1]))["fa"].sum().backward()          # key 1 in table a, once
    ebc(kjt(["fb"], [7, 7, 7], [3]))["fb"].sum().backward()    # key 7 in table b, three times
    row_a = ebc.export("a")[0].tolist().index(1)
    row_b = ebc.export("b")[0].tolist().index(7)
    assert torch.equal(ebc.weights["a"].grad.to_dense(), torch.zeros(5, 2).index_fill_(0, torch.tensor([row_a]), 1))
    assert torch.equal(ebc.weights["b"].grad.to_dense(), torch.zeros(6, 2).index_fill_(0, torch.tensor([row_b]), 3))


def test_unknown_table_name_is_a_key_error_and_a_value_error():
    ebc = trained_collection()
    before = snapshot(ebc)
    for call in (lambda name: ebc.stats(name), lambda name: ebc.export(name), lambda name: ebc.export(name, 0)):
        for name in ("nope", "Users", ["users"], None):
            with pytest.raises(UnknownTableError,
                               match=r"^EmbeddingBagCollection: no table .*; tables: \['users', 'items', 'ids', "
                                     r"'half', 'odd'\]$") as info:
                call(name)
            assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert_unchanged(ebc, before)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"eviction": "LRU"}, ValueError, r"eviction must be None, 'lru' or 'lfu' \(lower case\), got 'LRU'"),
    ({"eviction": 1}, TypeError, "eviction must be None, 'lru' or 'lfu', got 1"),
    ({"admit_after": 0}, ValueError, "admit_after must be a positive int, got 0"),
    ({"admit_after": -3}, ValueError, "admit_after must be a positive int, got -3"),
    ({"admit_after": 1.5}, TypeError, r"admit_after must be an int, got 1.5 \(float\)"),
    ({"admit_after": True}, TypeError, "admit_after must be an int, got True"),
    ({"admit_after": "2"}, TypeError, "admit_after must be an int, got '2'"),
    ({"use_hashtable": "no"}, TypeError, "use_hashtable must be True or False, got 'no'"),
    ({"use_hashtable": 0}, TypeError, "use_hashtable must be True or False, got 0"),
    ({"use_hashtable": None}, TypeError, "use_hashtable must be True or False, got None"),
    ({"use_hashtable": False, "eviction": "lru"}, ValueError, "eviction and admit_after need use_hashtable=True"),
    ({"use_hashtable": False, "admit_after": 2}, ValueError, "eviction and admit_after need use_hashtable=True"),
    ({"dtype": torch.float16, "initializer": sk.KeySeededUniform(0, 1e5, 2e5)}, ValueError,
     r"the initializer's bounds \(low=100000.0, high=200000.0\) must lie in torch.float16's finite range"),
    ({"dtype": torch.bfloat16, "initializer": sk.KeySeededUniform(0, -3.4e38, 0.0)}, ValueError,
     "the initializer's bounds .* must lie in torch.bfloat16's finite range"),
])
def test_table_config_checks_its_fields_where_it_is_built(kwargs, error, message):
    with pytest.raises(error, match="^TableConfig 't': " + message):
        sk.TableConfig("t", 4, 8, ["x"], **kwargs)


@pytest.mark.parametrize("args, error, message", [
    (("t", 4.0, 8, ["x"]), TypeError, r"TableConfig 't': embedding_dim must be an int, got 4.0 \(float\)"),
    (("t", True, 8, ["x"]), TypeError, "TableConfig 't': embedding_dim must be an int, got True"),
    (("t", 4, "8", ["x"]), TypeError, "TableConfig 't': capacity must be an int, got '8'"),
    (("t", 4, torch.tensor([8, 9]), ["x"]), TypeError, "TableConfig 't': capacity must be an int"),
    (("t", 0, 8, ["x"]), ValueError, "TableConfig 't': embedding_dim must be a positive int, got 0"),
    (("t", 4, -1, ["x"]), ValueError, "TableConfig 't': capacity must be a positive int, got -1"),
    ((7, 4, 8, ["x"]), TypeError, r"TableConfig: name must be a non-empty str, got 7 \(int\)"),
    (("", 4, 8, ["x"]), ValueError, "TableConfig: name must be a non-empty str, got ''"),
    (("t", 4, 8, [3]), TypeError, "TableConfig 't': features must be a non-empty list of feature names"),
    (("t", 4, 8, {"x"}), TypeError, "TableConfig 't': features must be a non-empty list of feature names"),
    (("t", 4, 8, []), ValueError, "TableConfig 't': features must be a non-empty list of feature names"),
    (("t", 4, 8, [""]), ValueError, "TableConfig 't': features must be a non-empty list of feature names"),
])
def test_table_config_wrong_types_are_type_errors_and_bad_values_value_errors(args, error, message):
    with pytest.raises(error, match="^" + message):
        sk.TableConfig(*args)


def test_table_config_takes_numpy_integers_as_ints_and_the_collection_leaves_the_config_as_it_is():
    config = sk.TableConfig("t", np.int64(4), np.int32(8), ["x"], admit_after=np.int64(2))
    assert (config.embedding_dim, config.capacity, config.admit_after) == (4, 8, 2)
    assert all(type(v) is int for v in (config.embedding_dim, config.capacity, config.admit_after))
    config.capacity = np.int64(16)  # edited after it was built: checked and read again by the collection
    ebc = sk.EmbeddingBagCollection([config])
    assert type(ebc.tables[0].capacity) is int and ebc.tables[0].capacity == 16
    assert type(config.capacity) is np.int64
    out = ebc(sk.KeyedJagged(["x"], torch.tensor([5, 6]), lengths=torch.tensor([1, 1])))
    assert out["x"].shape == (2, 4)


def test_half_tables_take_a_key_seeded_uniform_up_to_their_largest_value():
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 8, 16, ["x"], dtype=torch.float16,
                                                    initializer=sk.KeySeededUniform(0, -65504.0, 65504.0))])
    out = ebc(sk.KeyedJagged(["x"], torch.arange(10), lengths=torch.ones(10, dtype=torch.int64)))["x"]
    assert torch.isfinite(out).all() and torch.isfinite(ebc.shards[0].weight).all()


def test_a_table_config_changed_after_it_was_built_is_checked_by_the_collection():
    for field, value, error in (("admit_after", 0, ValueError), ("admit_after", True, TypeError),
                                ("eviction", "LRU", ValueError), ("use_hashtable", "no", TypeError)):
        config = sk.TableConfig("t", 4, 8, ["x"])
        setattr(config, field, value)
        with pytest.raises(error, match=f"^TableConfig 't': {field} must be"):
            sk.EmbeddingBagCollection([config])
    good = [sk.TableConfig("a", 4, 8, ["x"], eviction="lfu", admit_after=3),
            sk.TableConfig("b", 4, 8, ["y"], use_hashtable=False)]
    ebc = sk.EmbeddingBagCollection(good)
    assert ebc.shards[0].hash_table.eviction == "lfu" and ebc.shards[0].admit_after == 3
    assert ebc.shards[1].hash_table is None


def test_a_config_edited_after_the_build_changes_nothing_built():
    """The collection keeps copies of its configs: editing one afterwards (combiner, dtype,
    capacity, features) neither half-changes the tables nor the pooling."""
    config = sk.TableConfig("t", 4, 8, ["x"])
    ebc = sk.EmbeddingBagCollection([config])
    kjt = sk.KeyedJagged(["x"], torch.tensor([1, 2, 3]), lengths=torch.tensor([3]))
    want = ebc(kjt)["x"]
    config.combiner, config.dtype, config.capacity, config.features = "mean", torch.bfloat16, 2, ["y"]
    config.features.append("z")
    out = ebc(kjt)["x"]
    assert out.dtype == torch.float32 and torch.equal(out, want)
    assert ebc.tables[0].combiner == "sum" and ebc.tables[0].features == ["x"] and ebc.tables[0] is not config


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


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
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


def _bad_name_worker(rank, world_size, init, store_path):
    # Not init(): a short timeout, so a rank left waiting fails the test in seconds, not minutes.
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=15))
    ebc = sk.EmbeddingBagCollection(tables())
    ebc(_rank_slice(batch(0, BATCH * world_size), rank, world_size))
    before = snapshot(ebc)
    # Rank 1 names no table; rank 0 a good one: both raise at once, neither waits in the stats' all-reduce.
    started = time.monotonic()
    if rank == 1:
        with pytest.raises(UnknownTableError, match=r"no table 'nope'; tables: \['users'"):
            ebc.stats("nope")
    else:
        with pytest.raises(RuntimeError, match=r"EmbeddingBagCollection.stats\('users'\) failed on another rank"):
            ebc.stats("users")
    assert time.monotonic() - started < 10
    # Two good names that differ: the sums would mix two tables, so every rank raises.
    with pytest.raises(ValueError, match="the ranks asked for different tables"):
        ebc.stats("users" if rank == 0 else "items")
    # A TorchRec-like input with float offsets on rank 1: every rank raises, nothing changes.
    if rank == 1:
        with pytest.raises(TypeError, match=r"the input's offsets\(\) must be an int64 or int32 tensor"):
            ebc(torchrec_like(keys=["user"], values=VALUES, offsets=torch.tensor([0.0, 1.7, 2.0])))
    else:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of the process group rejected"):
            ebc(sk.KeyedJagged(["user"], VALUES, lengths=torch.tensor([1, 1])))
    # The group is still in step: the same stats on every rank.
    assert_unchanged(ebc, before)


@pytest.mark.distributed
def test_an_unknown_table_name_on_one_rank_raises_on_every_rank(tmp_path):
    spawn(_bad_name_worker, 2, str(tmp_path), str(tmp_path / "store"))


def test_a_full_table_error_names_table_configs_capacity():
    collection = sk.EmbeddingBagCollection([sk.TableConfig("a", 2, 1, ["f"])])
    with pytest.raises(sk.HashTableFullError,
                       match=r"table 'a': the hash table of rank 0 is full \(capacity=1\)") as raised:
        collection(sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1])))
    assert "max_vocabulary_size_per_gpu" not in str(raised.value)


# ---- ranks that own none of a step's keys ----

def _sparse_tables_model():
    # Two dims, so two blocks: a rank can owe rows of one and none of the other.
    return sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 64, ["f"]), sk.TableConfig("a", 3, 64, ["g"])])


def _step_batch(step, rank, world_size, empty_rank=None):
    # Table t reads key 7 only for three steps, then 16 new keys; table a 16 keys a step.
    # empty_rank (if any) holds no sample: its share goes to the others.
    t_keys = [7] * 16 if step < 3 else list(range(100, 116))
    a_keys = list(range(1000, 1016))
    ranks = [r for r in range(world_size) if r != empty_rank]
    mine = [i for i in range(16) if rank in ranks and ranks[i % len(ranks)] == rank]
    keys = [t_keys[i] for i in mine] + [a_keys[i] for i in mine]
    return sk.KeyedJagged(["f", "g"], torch.tensor(keys, dtype=torch.long),
                          lengths=torch.ones(len(keys), dtype=torch.long))


def _train_sparse_tables(rank, world_size, empty_rank=None):
    torch.manual_seed(0)
    model = _sparse_tables_model()
    dense = torch.nn.Parameter(torch.ones(2))  # in the loss, not stepped (no DDP here)
    optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
    for step in range(4):
        out = model(_step_batch(step, rank, world_size, empty_rank))
        ((out["f"].sum(0) + out["g"].sum(0)[:2]) * dense).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    tables = {}
    for name in ("t", "a"):
        keys, vectors = model.export(name)
        tables.update({(name, int(k)): v.clone() for k, v in zip(keys, vectors)})
    return tables, {name: float(optimizer.state[model.weights[name]]["step"]) for name in ("t", "a")}


def _empty_owner_worker(rank, world_size, init, result_dir):
    init()
    tables, steps = _train_sparse_tables(rank, world_size, empty_rank=world_size - 1)
    torch.save((tables, steps), f"{result_dir}/rank{rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_owning_none_of_a_steps_keys_trains_as_one_process(tmp_path, world_size):
    # A rank that owns none of a table's keys in a step (and, on the last rank, holds no
    # sample at all) used to leave the table without a gradient: LazyAdam skipped the step
    # there (wrong bias correction later) and, with no key owned at all, the rank's
    # backward skipped the exchange, so the others waited in it until gloo's timeout.
    spawn(_empty_owner_worker, world_size, str(tmp_path), str(tmp_path))
    expected, expected_steps = _train_sparse_tables(0, 1)
    merged = {}
    for rank in range(world_size):
        tables, steps = torch.load(f"{tmp_path}/rank{rank}.pt")
        assert steps == expected_steps == {"t": 4.0, "a": 4.0}
        merged.update(tables)
    assert merged.keys() == expected.keys()
    for key, vector in expected.items():
        torch.testing.assert_close(merged[key], vector, rtol=1e-5, atol=1e-6)


def _listed_empty_run(rank, world_size, other_dim):
    """Two steps: table a's feature listed with empty bags, then read (key 7, rank 0 only);
    table b read every step. Returns a's step count and this rank's vector of key 7."""
    model = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 16, ["fa"]), sk.TableConfig("b", other_dim, 16, ["fb"])])
    optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
    batches = [sk.KeyedJagged(["fa", "fb"], torch.tensor([5]), lengths=torch.tensor([0, 1])),
               sk.KeyedJagged(["fa", "fb"], torch.tensor([7, 5] if rank == 0 else [5]),
                              lengths=torch.tensor([1, 1] if rank == 0 else [0, 1]))]
    for step, kjt in enumerate(batches):
        optimizer.zero_grad()
        out = model(kjt)
        sum(v.sum() for v in out.values()).backward()
        if step == 0:
            grad = model.weights["a"].grad
            assert grad is not None and grad.is_sparse and grad._nnz() == 0
        optimizer.step()
    keys, vectors = model.export("a")
    return float(optimizer.state[model.weights["a"]]["step"]), vectors[keys == 7].clone()


def _listed_empty_worker(rank, world_size, init, result_dir):
    init()
    torch.save([_listed_empty_run(rank, world_size, other_dim) for other_dim in (4, 8)],
               f"{result_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_a_table_listed_with_empty_bags_counts_its_step_at_every_world_size(tmp_path):
    """As nn.EmbeddingBag(sparse=True) + SparseAdam: a call with no lookups still gives an
    empty gradient and counts the step. It used to depend on the other tables' dims (one
    process: only when no table of the same dim had keys) and on the world size (several:
    only when some rank had a key of the table), so a's later update differed."""
    spawn(_listed_empty_worker, 2, str(tmp_path), str(tmp_path))
    for index, other_dim in enumerate((4, 8)):
        step, vector = _listed_empty_run(0, 1, other_dim)
        assert step == 2.0
        for rank in range(2):
            rank_step, rank_vector = torch.load(f"{tmp_path}/rank{rank}.pt")[index]
            assert rank_step == 2.0
            if rank_vector.numel():
                torch.testing.assert_close(rank_vector, vector, rtol=0, atol=0)


def _state_dropped_worker(rank, world_size, init, directory):
    init()
    model = _sparse_tables_model()
    optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
    out = model(_step_batch(3, rank, world_size))
    (out["f"].sum() + out["g"].sum()).backward()
    optimizer.step()
    if rank == 1:
        del optimizer.state[model.weights["t"]]  # as a checkpoint from a rank that never stepped t
    sk.save_checkpoint(directory, model, optimizer)


@pytest.mark.distributed
def test_a_checkpoint_shard_without_optimizer_state_loads_with_zero_moments(tmp_path):
    # Resharding such a checkpoint raised KeyError('exp_avg') on every rank.
    spawn(_state_dropped_worker, 2, str(tmp_path), str(tmp_path))
    model = _sparse_tables_model()
    optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
    sk.load_checkpoint(str(tmp_path), model, optimizer)
    state = optimizer.state[model.weights["t"]]
    moments = state["exp_avg"][:len(model._shard("t").hash_table)]
    assert (moments.abs().sum(1) > 0).sum() == 8 and (moments.abs().sum(1) == 0).sum() == 8


def _config_mismatch_worker(rank, world_size, init):
    init()
    long = "user_history_item_embedding_table_for_ranking_v2_"  # 49 characters: they differ past 48
    users = sk.KeyedJagged(["u"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    cases = [
        # One table more on rank 1: settings one rank lacks (a gather of unequal sizes aborted gloo).
        ([sk.TableConfig("users", 4, 8, ["u"])] + ([sk.TableConfig("items", 4, 8, ["i"])] if rank else []),
         users, r"tables differs .*rank 0: users, rank 1: users,items"),
        # Named by TableConfig's fields (they were the single layers' argument names).
        ([sk.TableConfig("users", 4 + rank, 8, ["u"])], users,
         r"users.embedding_dim differs .*rank 0: 4, rank 1: 5\); build the collection with the same "
         r"users.embedding_dim on every rank"),
        ([sk.TableConfig("users", 4, 8 + rank, ["u"])], users, r"users.capacity differs .*rank 0: 8, rank 1: 9"),
        ([sk.TableConfig("users", 4, 8, ["u"], initializer=sk.KeySeededUniform(seed=rank))], users,
         r"users.initializer differs .*rank 0: KeySeededUniform"),
        # Names and features that differ only past their 48th character, listed in another
        # order on rank 1: the check compared 48 characters and let the tables mix.
        ([sk.TableConfig(long + s, 4, 8, [long + s]) for s in (("a", "b") if rank == 0 else ("b", "a"))],
         sk.KeyedJagged([long + "a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
         rf"tables differs .*rank 0: {long}a,{long}b, rank 1: {long}b,{long}a"),
    ]
    for tables, kjt, message in cases:
        ebc = sk.EmbeddingBagCollection(tables)
        for _ in range(2):  # the same error on every rank, every time; nothing hangs or aborts
            with pytest.raises(ValueError, match=message):
                ebc(kjt)
    # An input with no feature on rank 1 in training: its output would hold nothing to call
    # backward on while rank 0's backward waited for it; both raise instead.
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("users", 4, 8, ["u"])])
    if rank == 1:
        with pytest.raises(ValueError, match="the input names no feature"):
            ebc(sk.KeyedJagged([], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64)))
    else:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of the process group rejected"):
            ebc(users)
    # Named features with B = 0 is the empty batch that trains; the group is still in step.
    empty = sk.KeyedJagged(["u"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64))
    sum(v.sum() for v in ebc(users if rank == 0 else empty).values()).backward()
    with torch.no_grad():  # no backward to wait for: an input without features is fine
        assert ebc(sk.KeyedJagged([], torch.zeros(0, dtype=torch.int64),
                                  lengths=torch.zeros(0, dtype=torch.int64)) if rank else users).keys() <= {"u"}


@pytest.mark.distributed
def test_ranks_built_differently_or_given_no_features_all_raise(tmp_path):
    spawn(_config_mismatch_worker, 2, str(tmp_path))


class _VariableBatch:
    """A TorchRec KeyedJaggedTensor with a batch size per feature (VBE): fa has 1 sample,
    fb 3; the 4 bags split evenly into 2 features, so B = 2 would misread them."""

    def keys(self):
        return ["fa", "fb"]

    def values(self):
        return torch.tensor([10, 20, 21, 22])

    def lengths(self):
        return torch.tensor([1, 1, 1, 1])

    def offsets(self):
        return torch.tensor([0, 1, 2, 3, 4])

    def weights_or_none(self):
        return None

    def variable_stride_per_key(self):
        return True

    def stride_per_key(self):
        return [1, 3]

    def stride(self):
        return 3


def _two_tables():
    return sk.EmbeddingBagCollection([sk.TableConfig("a", 2, 16, ["fa"]), sk.TableConfig("b", 2, 16, ["fb"])])


def test_a_variable_batch_per_feature_input_without_inverse_indices_is_refused():
    model = _two_tables()
    with pytest.raises(ValueError, match=r"variable_stride_per_key\(\) is True \(batch sizes per feature \[1, 3\]\)"):
        model(_VariableBatch())
    assert model.stats("a")["size"] == 0 and model.stats("b")["size"] == 0


def test_an_input_whose_stride_disagrees_with_its_lengths_is_refused():
    class Uniform(_VariableBatch):
        def variable_stride_per_key(self):
            return False

    with pytest.raises(ValueError, match=r"stride\(\) is 3 but lengths\(\)/offsets\(\) give 4 bags for 2 features, "
                                         r"a batch of 2"):
        _two_tables()(Uniform())

    class Agreeing(Uniform):
        def stride(self):
            return 2

    assert {k: tuple(v.shape) for k, v in _two_tables()(Agreeing()).items()} == {"fa": (2, 2), "fb": (2, 2)}

    # An integer stride in any form is compared (a 0-d tensor or a NumPy integer was let through).
    for wrong in (torch.tensor(3), np.int64(3), torch.tensor([3], dtype=torch.int32)):
        class Other(Uniform):
            def stride(self, wrong=wrong):
                return wrong

        model = _two_tables()
        with pytest.raises(ValueError, match=r"stride\(\) is 3 but"):
            model(Other())
        assert model.stats("a")["size"] == 0


# ---- tables listed in another order: checkpoints load them by name, state dicts refuse ----

_NAMED = {"users": lambda: sk.TableConfig("users", 4, 32, ["user"]),
          "items": lambda: sk.TableConfig("items", 4, 32, ["item"]),
          "ids": lambda: sk.TableConfig("ids", 4, 32, ["id"], use_hashtable=False),
          "tags": lambda: sk.TableConfig("tags", 3, 32, ["tag"])}
_SAVED_ORDER = ["users", "items", "ids", "tags"]


def _named_collection(order, names=None):
    tables = [_NAMED[name]() for name in order]
    for table, name in zip(tables, names or order):
        table.name = name
    return sk.EmbeddingBagCollection(tables)


def _named_step(ebc, optimizer, step, rank=0, world_size=1):
    """One training step on 8 samples (this rank's share), one key per feature each."""
    g = torch.Generator().manual_seed(step)
    keys = {"user": torch.randint(-20, 20, (8,), generator=g), "item": torch.randint(-20, 20, (8,), generator=g),
            "id": torch.randint(0, 32, (8,), generator=g), "tag": torch.randint(0, 20, (8,), generator=g) * 1_000_003}
    mine = slice(rank, None, world_size)
    kjt = sk.KeyedJagged(list(keys), torch.cat([k[mine] for k in keys.values()]),
                         lengths=torch.ones(4 * len(range(8)[mine]), dtype=torch.long))
    out = ebc(kjt)
    sum(value.sum() * (i + 1) for i, value in enumerate(out.values())).backward()
    optimizer.step()
    optimizer.zero_grad()
    return out


def _by_key(ebc, optimizer):
    """{(table, key): [vector, exp_avg, exp_avg_sq]} of the keys this rank holds (a direct
    table's trained keys) and {table: step}: what a load by name must hand each table."""
    rows_of, steps = {}, {}
    for name in ebc._by_name:
        shard = ebc._shard(name)
        if shard.hash_table is None:
            keys, rows = shard.owned_keys(), torch.arange(shard.weight.shape[0])
        else:
            keys, rows = shard.hash_table.export()
        state = optimizer.state.get(shard.weight) or {}
        steps[name] = float(state["step"]) if state else None
        for key, row in zip(keys.tolist(), rows.tolist()):
            entry = [shard.weight[row].detach().clone()] + [state[m][row].clone() for m in ("exp_avg", "exp_avg_sq")
                                                            if state]
            if shard.hash_table is not None or (len(entry) > 1 and bool(entry[2].any())):
                rows_of[(name, key)] = entry
    return rows_of, steps


def _assert_same_by_key(got, expected):
    assert sorted(got[0]) == sorted(expected[0]) and got[1] == expected[1]
    for key, values in expected[0].items():
        for value, want in zip(got[0][key], values):
            assert torch.equal(value, want), key


@pytest.mark.parametrize("order", [["items", "users", "ids", "tags"], ["tags", "ids", "items", "users"]])
def test_a_checkpoint_loads_a_collections_tables_by_name_in_any_order(tmp_path, order):
    """The tables were saved by position (shards.<i>): a collection listing users and items
    the other way round loaded users' keys, vectors and moments into items, silently."""
    saved = _named_collection(_SAVED_ORDER)
    saved_optimizer = sk.LazyAdam(saved.parameters(), lr=0.1)
    for step in range(2):
        _named_step(saved, saved_optimizer, step)
    sk.save_checkpoint(str(tmp_path), saved, saved_optimizer)
    loaded = _named_collection(order)
    optimizer = sk.LazyAdam(loaded.parameters(), lr=0.1)
    _named_step(loaded, optimizer, 7)  # state to replace
    sk.load_checkpoint(str(tmp_path), loaded, optimizer)
    _assert_same_by_key(_by_key(loaded, optimizer), _by_key(saved, saved_optimizer))
    for name in _SAVED_ORDER:
        assert loaded.stats(name) == saved.stats(name)
    # Training goes on as if nothing had happened.
    out, expected = _named_step(loaded, optimizer, 2), _named_step(saved, saved_optimizer, 2)
    for feature, value in expected.items():
        assert torch.equal(out[feature], value), feature
    _assert_same_by_key(_by_key(loaded, optimizer), _by_key(saved, saved_optimizer))


def test_reordered_tables_get_their_own_optimizer_settings_or_are_refused(tmp_path):
    """Rows and moments load by table name, the optimizer's groups by position. With a group
    per table built in the collection's order, a reordered collection would hand each table
    another's lr, silently: refused, nothing changed. Groups that still line up load: every
    table in one group (beside a dense group), or a group per table built by table name."""
    lr = {"users": 0.5, "items": 0.001, "ids": 0.02, "tags": 0.1}
    reordered = ["items", "users", "ids", "tags"]

    def by_position(order):
        ebc = _named_collection(order)
        return ebc, sk.LazyAdam([{"params": [ebc.weights[name]], "lr": lr[name]} for name in order])

    def by_name(order):
        ebc = _named_collection(order)
        return ebc, sk.LazyAdam([{"params": [ebc.weights[name]], "lr": lr[name]} for name in _SAVED_ORDER])

    def tables_apart(order):
        ebc = _named_collection(order)
        ebc.register_parameter("dense", torch.nn.Parameter(torch.zeros(3)))
        return ebc, sk.LazyAdam([{"params": [ebc.dense], "lr": 0.3},
                                 {"params": [ebc.weights[name] for name in order], "lr": 0.1}])

    for build, refused in ((by_position, True), (by_name, False), (tables_apart, False)):
        directory = tmp_path / build.__name__
        saved, saved_optimizer = build(_SAVED_ORDER)
        _named_step(saved, saved_optimizer, 0)
        sk.save_checkpoint(str(directory), saved, saved_optimizer)
        loaded, optimizer = build(reordered)
        _named_step(loaded, optimizer, 7)
        if refused:
            before = _by_key(loaded, optimizer)
            with pytest.raises(ValueError, match=r"another order than when saved, and the optimizer's groups load by "
                                                 r"position: table\(s\) 'items' \(saved with \{'lr': 0.001"):
                sk.load_checkpoint(str(directory), loaded, optimizer)
            _assert_same_by_key(_by_key(loaded, optimizer), before)
            continue
        settings = [{k: v for k, v in group.items() if k != "params"} for group in saved_optimizer.param_groups]
        sk.load_checkpoint(str(directory), loaded, optimizer)
        assert [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] == settings
        _assert_same_by_key(_by_key(loaded, optimizer), _by_key(saved, saved_optimizer))


def test_a_damaged_entry_of_a_reordered_table_is_named_as_the_file_holds_it(tmp_path):
    saved = _named_collection(_SAVED_ORDER)
    saved_optimizer = sk.LazyAdam(saved.parameters(), lr=0.1)
    _named_step(saved, saved_optimizer, 0)
    sk.save_checkpoint(str(tmp_path), saved, saved_optimizer)
    (path,) = glob.glob(os.path.join(str(tmp_path), "ckpt-*", "shard-*.pt"))
    shard = torch.load(path, weights_only=True)
    shard["layers"]["shards.1"]["state"].pop("exp_avg_sq")  # items, saved second
    torch.save(shard, path)
    loaded = _named_collection(["items", "users", "ids", "tags"])
    with pytest.raises(ValueError, match=r"layer 'shards.1': the saved optimizer state lacks \['exp_avg_sq'\]"):
        sk.load_checkpoint(str(tmp_path), loaded, sk.LazyAdam(loaded.parameters(), lr=0.1))


def test_a_checkpoint_of_other_tables_or_without_table_names_loads_as_before_or_is_refused(tmp_path):
    saved = _named_collection(_SAVED_ORDER)
    saved_optimizer = sk.LazyAdam(saved.parameters(), lr=0.1)
    _named_step(saved, saved_optimizer, 0)
    sk.save_checkpoint(str(tmp_path), saved, saved_optimizer)
    # A table renamed (or replaced): refused, naming both lists of tables; nothing changed.
    renamed = _named_collection(_SAVED_ORDER, ["users", "goods", "ids", "tags"])
    optimizer = sk.LazyAdam(renamed.parameters(), lr=0.1)
    before = _by_key(renamed, optimizer)
    with pytest.raises(ValueError, match=r"load_checkpoint: the collection \(the model\) was saved with tables "
                                         r"\['users', 'items', 'ids', 'tags'\] but has \['users', 'goods', 'ids', "
                                         r"'tags'\]: the checkpoint holds no table 'goods'"):
        sk.load_checkpoint(str(tmp_path), renamed, optimizer)
    _assert_same_by_key(_by_key(renamed, optimizer), before)
    # A table fewer or one more: the same error naming the table (it listed positions,
    # 'shards.0' ... 'shards.3', of which the model's 'shards.0' was another table).
    for order, missing in ((["items", "ids", "tags"], "the model has no table 'users'"),
                           (["users", "items", "ids"], "the model has no table 'tags'")):
        fewer = _named_collection(order)
        with pytest.raises(ValueError, match=rf"was saved with tables \['users', 'items', 'ids', 'tags'\] but has "
                                             rf"{re.escape(str(order))}: {missing}"):
            sk.load_checkpoint(str(tmp_path), fewer)
    more = sk.EmbeddingBagCollection([_NAMED[name]() for name in _SAVED_ORDER] + [sk.TableConfig("new", 4, 8, ["n"])])
    with pytest.raises(ValueError, match=r"but has \['users', 'items', 'ids', 'tags', 'new'\]: the checkpoint holds "
                                         r"no table 'new'"):
        sk.load_checkpoint(str(tmp_path), more)
    # A checkpoint saved before the tables were named in its metadata loads by position.
    folder = tmp_path / (tmp_path / "LATEST").read_text()
    metadata = json.loads((folder / "metadata.json").read_text())
    for layer in metadata["layers"].values():
        del layer["table"]
    (folder / "metadata.json").write_text(json.dumps(metadata))
    loaded = _named_collection(_SAVED_ORDER)
    optimizer = sk.LazyAdam(loaded.parameters(), lr=0.1)
    sk.load_checkpoint(str(tmp_path), loaded, optimizer)
    _assert_same_by_key(_by_key(loaded, optimizer), _by_key(saved, saved_optimizer))


def _state_of(ebc):
    return copy.deepcopy({"state": ebc.state_dict(), "stats": {name: ebc.stats(name) for name in ebc._by_name}})


def test_a_state_dict_of_tables_in_another_order_is_refused_and_changes_nothing(tmp_path):
    """state_dict() names tables by position: g.load_state_dict(e.state_dict()) of the same
    tables listed otherwise put one table's keys and vectors in the other, silently."""
    saved = _named_collection(_SAVED_ORDER)
    _named_step(saved, sk.LazyAdam(saved.parameters(), lr=0.1), 0)
    state = saved.state_dict()
    torch.save(state, tmp_path / "state.pt")
    message = (r"EmbeddingBagCollection: load_state_dict: the state holds tables \['users', 'items', 'ids', 'tags'\] "
               r"\(in that order\) but this collection has \['items', 'users', 'ids', 'tags'\]")
    for given in (state, torch.load(tmp_path / "state.pt", weights_only=True)):
        swapped = _named_collection(["items", "users", "ids", "tags"])
        _named_step(swapped, sk.LazyAdam(swapped.parameters(), lr=0.1), 5)
        before = _state_of(swapped)
        with pytest.raises(ValueError, match=message):
            swapped.load_state_dict(given)
        assert_equal_nested(_state_of(swapped), before)
    # Inside a model too (nn.Module's own load visits the collection before its tables).
    with pytest.raises(ValueError, match=message):
        torch.nn.ModuleDict({"ebc": swapped}).load_state_dict(torch.nn.ModuleDict({"ebc": saved}).state_dict())
    assert_equal_nested(_state_of(swapped), before)
    # The same order loads; so does a state saved before the names were recorded.
    same = _named_collection(_SAVED_ORDER)
    same.load_state_dict(state)
    assert_equal_nested(_state_of(same), _state_of(saved))
    old = copy.copy(state)
    old._metadata = copy.deepcopy(state._metadata)
    del old._metadata[""]["tables"]
    same = _named_collection(_SAVED_ORDER)
    same.load_state_dict(old)
    assert_equal_nested(_state_of(same), _state_of(saved))


def _named_save_worker(rank, world_size, init, directory):
    init()
    ebc = _named_collection(_SAVED_ORDER)
    optimizer = sk.LazyAdam(ebc.parameters(), lr=0.1)
    for step in range(2):
        _named_step(ebc, optimizer, step, rank, world_size)
    sk.save_checkpoint(directory, ebc, optimizer)
    torch.save(_by_key(ebc, optimizer), f"{directory}/saved-{rank}.pt")
    # A rank's own state dict, into a collection listing the tables otherwise: refused here too.
    swapped = _named_collection(["items", "users", "ids", "tags"])
    with pytest.raises(ValueError, match=r"the state holds tables \['users', 'items', 'ids', 'tags'\]"):
        swapped.load_state_dict(ebc.state_dict())


def _named_load_worker(rank, world_size, init, directory):
    init()
    ebc = _named_collection(["items", "users", "tags", "ids"])  # every table at another position
    optimizer = sk.LazyAdam(ebc.parameters(), lr=0.1)
    sk.load_checkpoint(directory, ebc, optimizer)
    torch.save(_by_key(ebc, optimizer), f"{directory}/loaded-{rank}.pt")


@pytest.mark.distributed
def test_a_checkpoint_loads_tables_by_name_across_world_sizes(tmp_path):
    """A table's key lives on rank uint64(key + position) % world_size: moved to another
    position, its keys move to other ranks, with their vectors and moments."""
    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    spawn(_named_save_worker, 2, str(tmp_path), directory)
    saved = [torch.load(f"{directory}/saved-{rank}.pt") for rank in range(2)]
    merged = ({**saved[0][0], **saved[1][0]}, saved[0][1])
    spawn(_named_load_worker, 2, str(tmp_path), directory)
    positions = {"items": 0, "users": 1, "tags": 2, "ids": 3}
    loaded = {}
    for rank in range(2):
        rows_of, steps = torch.load(f"{directory}/loaded-{rank}.pt")
        assert steps == merged[1]
        assert all(((key + positions[table]) % 2**64) % 2 == rank for table, key in rows_of)
        loaded.update(rows_of)
    _assert_same_by_key((loaded, merged[1]), merged)
    # And into one process, the tables listed otherwise again.
    ebc = _named_collection(["tags", "ids", "users", "items"])
    optimizer = sk.LazyAdam(ebc.parameters(), lr=0.1)
    sk.load_checkpoint(directory, ebc, optimizer)
    _assert_same_by_key(_by_key(ebc, optimizer), merged)


def test_a_tables_load_and_initializer_errors_name_the_table_and_its_config_fields(tmp_path):
    """A collection's table is named by its table name and TableConfig's fields (capacity,
    embedding_dim, initializer), not the SOK layer's arguments."""
    batch = sk.KeyedJagged(["u"], torch.arange(5), lengths=torch.ones(5, dtype=torch.long))
    saved = sk.EmbeddingBagCollection([sk.TableConfig("users", 4, 100, ["u"])])
    saved(batch)
    sk.save_checkpoint(str(tmp_path), saved)
    for config, error, message in [
        (sk.TableConfig("users", 4, 2, ["u"]), HashTableFullError,
         r"layer 'shards.0' \(table 'users'\) on rank 0 of 1 must hold 5 saved keys but capacity is 2; build it "
         "with a larger capacity or load on more ranks"),
        (sk.TableConfig("users", 4, 2, ["u"], use_hashtable=False), ValueError,
         r"layer 'shards.0' \(table 'users'\) \(use_hashtable=False\).*build it with a larger capacity"),
        (sk.TableConfig("users", 8, 100, ["u"]), ValueError,
         r"layer 'shards.0' \(table 'users'\) was saved with embedding_dim 4 but has 8")]:
        with pytest.raises(error, match=message):
            sk.load_checkpoint(str(tmp_path), sk.EmbeddingBagCollection([config]))
    bad = sk.EmbeddingBagCollection([sk.TableConfig("users", 4, 100, ["u"], initializer=lambda k, d: torch.zeros(1))])
    with pytest.raises(ValueError, match=r"^EmbeddingBagCollection table 'users': initializer\(keys, 4\) must "
                                         r"return a \[5, 4\] tensor, got \(1,\)"):
        bad(batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_table_with_a_dense_gradient_steps_in_float32(dtype):
    """A dense gradient of a half table (an L2 term over its weight, alone or added to a
    lookup's sparse one) failed in torch's Adam against the shard's float32 moments, after
    the parameters before it were updated. It is Adam in float32 on the widened weight,
    rounded to nearest once, as torch.optim.Adam on a float32 copy is."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 8, ["f"], dtype=dtype)])
    linear = torch.nn.Linear(4, 1)
    weight = ebc.weights["t"]
    optimizer = sk.LazyAdam(list(linear.parameters()) + list(ebc.parameters()), lr=0.01, weight_decay=0.1)
    kjt = sk.KeyedJagged(["f"], torch.tensor([1, 3, 3]), lengths=torch.tensor([2, 1]))
    linear(ebc(kjt)["f"].float()).sum().backward()
    (1e-1 * weight.float().pow(2).sum()).backward()  # the sparse gradient becomes a dense one
    assert weight.grad.layout == torch.strided and weight.grad.dtype == dtype
    wide = weight.detach().float().clone().requires_grad_()
    wide.grad = weight.grad.float()
    reference = torch.optim.Adam([wide], lr=0.01, weight_decay=0.1)
    for _ in range(2):
        optimizer.step()
        reference.step()
        assert torch.equal(weight.detach(), wide.detach().to(dtype))
        assert torch.equal(optimizer.state[weight]["exp_avg"], reference.state[wide]["exp_avg"])
        wide.data.copy_(weight.detach().float())  # the reference goes on from the rounded weight
    assert optimizer.state[weight]["step"].item() == 2


def test_a_float64_shard_pools_with_float32_tables_of_its_dim():
    """One process, one key per bag: a shard made float64 (.double(), or a state loaded with
    assign=True) read its rows in float64 beside float32 ones of the same dim group, and the
    backward's one segment sum over them refused the mix."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 64, ["a"]), sk.TableConfig("u", 4, 64, ["b"])])
    ebc.shards[0].double()
    kjt = sk.KeyedJagged(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    out = ebc(kjt)
    assert out["a"].dtype == torch.float64 and out["b"].dtype == torch.float32
    (out["a"].sum() + 2 * out["b"].sum()).backward()
    assert ebc.weights["t"].grad.dtype == torch.float64 and ebc.weights["u"].grad.dtype == torch.float32
    assert torch.equal(ebc.weights["t"].grad.to_dense().sum(0), torch.full((4,), 2.0, dtype=torch.float64))
    assert torch.equal(ebc.weights["u"].grad.to_dense().sum(0), torch.full((4,), 4.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_host_syncs_per_step_do_not_grow_with_the_number_of_tables_on_cuda():
    """A forward and backward whose keys are all in the tables make as many host syncs with
    12 tables of two dims as with 2 (docs/design.md: "the host syncs do not depend on the number of
    tables"). The optimizer is not counted: on CUDA LazyAdam updates one table at a time."""
    def syncs(num_tables):
        torch.manual_seed(0)
        features = [f"f{t}" for t in range(num_tables)]
        ebc = sk.EmbeddingBagCollection([sk.TableConfig(f"t{t}", 8 if t % 2 else 16, 1000, [features[t]])
                                         for t in range(num_tables)], device="cuda")
        opt = sk.LazyAdam(ebc.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(1, 3, (num_tables * 32,), generator=g)
        values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
        kjt = sk.KeyedJagged(features, values.cuda(), lengths=lengths.cuda())

        def forward_backward():
            out = ebc(kjt)
            sum(v.sum() for v in out.values()).backward()

        for _ in range(2):  # places the keys, then warms the allocator and CUB's scratch sizes
            forward_backward()
            opt.step()
            opt.zero_grad()
        return count_host_syncs(forward_backward)

    few, many = syncs(2), syncs(12)
    assert few == many, (few, many)


def test_step_paths_build_no_device_tensor_from_pageable_memory():
    """torch.tensor(list, device=cuda) (or .to(cuda) of a CPU tensor) is a host sync on
    CUDA (a pageable copy waits for the stream); the collection's and the layers' per-step
    paths built a dozen small index tensors that way, syncs their documented counts leave
    out. They go through tables_cuda._device_ints (pinned memory, non_blocking) or torch.full.
    Checked on the source, since this machine may have no GPU to count them."""
    import ast
    import inspect

    from sparsekit import collection, collection_batch, collection_ranks, engine, pooled, shard, tables_cuda

    step = {collection: {"_forward"}, collection_batch: {"_prepare"},
            collection_ranks: {"_sort_table_rows", "_sharded_forward", "_owner_lookup", "_plan_tables", "_grow",
                               "_pool"},
            engine: {"resolve_rows", "_plan_growth", "_grow", "_plan_evolving", "read_pooled"},
            pooled: {"backward", "_rows_still_owned", "_traced_gradients", "pooled_read"},
            shard: {"_agree_on_lookup"}}
    found, scanned = [], set()
    for module, names in step.items():
        for fn in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in names):
                continue
            scanned.add((module.__name__, fn.name))
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                if name == "torch.tensor" and any(k.arg == "device" for k in node.keywords) and not (
                        node.args and ast.unparse(node.args[0]) == "_LOCAL_EXCEPTION"):  # an error path
                    found.append((module.__name__, fn.name, node.lineno))
                elif name.endswith("_sequence_position.to"):
                    found.append((module.__name__, fn.name, node.lineno))
    assert not found, found
    # Every path named was read (one that moved elsewhere would pass unread).
    assert scanned == {(m.__name__, n) for m, names in step.items() for n in names}
    values = tables_cuda._device_ints([3, -1, 2**40], torch.device("cpu"))
    assert values.dtype == torch.int64 and values.tolist() == [3, -1, 2**40]


def test_tables_whose_names_share_a_crc32_start_independent():
    """The default seed is the name's CRC-32, which 'plumless' and 'buckeroo' share: their
    keys started with identical vectors. Colliding names get seeds of their own; every
    other table keeps its CRC-32 seed."""
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("plumless", 8, 100, ["a"]),
                                     sk.TableConfig("buckeroo", 8, 100, ["b"]),
                                     sk.TableConfig("users", 8, 100, ["u"])])
    keys = torch.arange(5)
    out = ebc(sk.KeyedJagged(["a", "b", "u"], torch.cat([keys, keys, keys]), lengths=torch.ones(15, dtype=torch.int64)))
    assert not torch.equal(out["a"], out["b"])
    assert torch.equal(out["u"], sk.KeySeededUniform(seed=zlib.crc32(b"users"))(keys, 8))
    # The seeds depend on the names only: another collection of the same tables agrees.
    again = sk.EmbeddingBagCollection([sk.TableConfig("buckeroo", 8, 100, ["b"]),
                                       sk.TableConfig("plumless", 8, 100, ["a"])])
    out2 = again(sk.KeyedJagged(["a", "b"], torch.cat([keys, keys]), lengths=torch.ones(10, dtype=torch.int64)))
    assert torch.equal(out2["a"], out["a"]) and torch.equal(out2["b"], out["b"])


def test_keyed_jagged_has_torchrecs_per_key_views():
    """TorchRec's KeyedJaggedTensor methods a TorchRec user reaches for: kjt[key] and
    to_dict() (a feature's bags, offsets from 0), length_per_key(), offset_per_key(),
    weights() and to(device)."""
    kjt = sk.KeyedJagged(["user", "item"], torch.tensor([7, 8, 9, 3]), lengths=torch.tensor([2, 0, 1, 1]),
                         weights=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert kjt.length_per_key() == [2, 2] and kjt.offset_per_key() == [0, 2, 4]
    item = kjt["item"]
    assert item.keys() == ["item"] and item.values().tolist() == [9, 3]
    assert item.lengths().tolist() == [1, 1] and item.offsets().tolist() == [0, 1, 2]
    assert item.weights().tolist() == [3.0, 4.0]
    assert list(kjt.to_dict()) == ["user", "item"] and kjt.to_dict()["user"].lengths().tolist() == [2, 0]
    with pytest.raises(KeyError, match="no feature 'price'"):
        kjt["price"]
    with pytest.raises(ValueError, match="no weights"):
        sk.KeyedJagged(["user"], torch.tensor([1]), lengths=torch.tensor([1])).weights()
    moved = kjt.to("cpu")
    assert moved.keys() == kjt.keys() and torch.equal(moved.values(), kjt.values())
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("u", 4, 50, ["user"]), sk.TableConfig("i", 4, 50, ["item"])])
    assert torch.equal(ebc(kjt)["item"], ebc(item)["item"])
    empty = sk.KeyedJagged(["a", "b"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64))
    assert empty.length_per_key() == [0, 0] and empty["b"].offsets().tolist() == [0]


# ---- the contract (docs/api.md), sentence by sentence: signatures, output order and dtypes, boundaries ----

def test_collection_signatures_are_the_contracts():
    import inspect

    def described(obj):
        return [(p.name, p.default, p.kind is inspect.Parameter.KEYWORD_ONLY)
                for p in inspect.signature(obj).parameters.values() if p.name != "self"]

    empty = inspect.Parameter.empty
    assert described(sk.TableConfig) == [
        ("name", empty, False), ("embedding_dim", empty, False), ("capacity", empty, False),
        ("features", empty, False), ("combiner", "sum", False), ("dtype", torch.float32, False),
        ("use_hashtable", True, False), ("eviction", None, False), ("admit_after", 1, False),
        ("initializer", None, False)]
    assert described(sk.KeyedJagged) == [("keys", empty, False), ("values", empty, False), ("lengths", None, False),
                                         ("offsets", None, False), ("weights", None, False)]
    assert described(sk.EmbeddingBagCollection) == [("tables", empty, False), ("process_group", None, False),
                                                    ("device", None, False), ("fused_params", None, False),
                                                    ("is_weighted", None, False), ("output", None, False),
                                                    ("error_mode", "raise", False)]
    assert described(sk.EmbeddingBagCollection.stats) == [("table_name", empty, False)]
    assert described(sk.EmbeddingBagCollection.export) == [("table_name", empty, False),
                                                           ("min_last_seen", None, False)]
    config = sk.TableConfig("t", 4, 8, ["f"])
    assert (config.combiner, config.dtype, config.use_hashtable, config.eviction, config.admit_after,
            config.initializer) == ("sum", torch.float32, True, None, 1, None)


def test_outputs_follow_the_input_s_key_order_in_each_table_s_dtype_also_for_no_samples():
    ebc = sk.EmbeddingBagCollection([
        sk.TableConfig("a", 4, 16, ["f", "g"]),
        sk.TableConfig("b", 3, 16, ["h"], combiner="mean", dtype=torch.bfloat16),
        sk.TableConfig("c", 2, 16, ["k"], dtype=torch.float16)])
    for batch in (2, 0):
        lengths = torch.ones(3 * batch, dtype=torch.int64)
        values = torch.arange(3 * batch, dtype=torch.int64)
        for make in (lambda: sk.KeyedJagged(["k", "h", "f"], values, lengths=lengths),
                     lambda: sk.KeyedJagged(["k", "h", "f"], values, offsets=torch.arange(3 * batch + 1))):
            out = ebc(make())
            assert list(out) == ["k", "h", "f"]
            assert [(v.dtype, tuple(v.shape)) for v in out.values()] == [
                (torch.float16, (batch, 2)), (torch.bfloat16, (batch, 3)), (torch.float32, (batch, 4))]
    assert ebc.export("b")[1].dtype == torch.bfloat16
    assert all(isinstance(w, torch.nn.Parameter) and sk.is_embedding_variable(w) for w in ebc.weights.values())
    assert [w.dtype for w in ebc.weights.values()] == [torch.float32, torch.bfloat16, torch.float16]


def test_a_table_shared_by_two_features_with_different_weights_matches_plain_torch():
    """Two features of one table, weighted differently, bags of 0-3 keys: forward and the
    table's (summed) gradient against nn.functional.embedding_bag on the exported rows."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 64, ["f", "g"], combiner="sum")])
    lengths = torch.tensor([2, 0, 3, 1, 2, 1])
    values = torch.tensor([1, 2, 3, 1, 2, 2, 1, 5, 3])
    weights = torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.25, 4.0, 1.5, 2.0])
    kjt = sk.KeyedJagged(["f", "g"], values, lengths=lengths, weights=weights)
    with torch.no_grad():
        ebc(kjt)  # every key gets its row
    rows = ebc.shards[0].hash_table.find(values)
    reference = ebc.weights["a"].detach().clone().requires_grad_(True)
    out = ebc(kjt)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    expected = torch.nn.functional.embedding_bag(rows, reference, offsets[:-1], mode="sum",
                                                 per_sample_weights=weights)
    torch.testing.assert_close(torch.cat([out["f"], out["g"]]), expected)
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    (torch.cat([out["f"], out["g"]]) * grad).sum().backward()
    (expected * grad).sum().backward()
    torch.testing.assert_close(ebc.weights["a"].grad.to_dense(), reference.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_key_per_bag_large_reads(dtype):
    """One process, one key per bag, reads of several hundred KiB of rows: training and
    eval with unseen keys (zeros) against the exported table, and the table's gradient."""
    dim = 16
    batch = 3 * 256 * 1024 // (dim * torch.tensor([], dtype=dtype).element_size())
    g = torch.Generator().manual_seed(13)
    collection = sk.EmbeddingBagCollection([sk.TableConfig("t", dim, 4 * batch, ["a", "b"], dtype=dtype)])
    keys = torch.randint(-2**62, 2**62, (2 * batch,), generator=g)
    unseen = torch.randint(-2**62, 2**62, (2 * batch,), generator=g)
    ones = torch.ones(2 * batch, dtype=torch.int64)
    for step, values in enumerate([keys, torch.where(torch.arange(2 * batch) % 2 == 0, keys, unseen)]):
        if step == 1:
            collection.eval()
        out = collection(sk.KeyedJagged(["a", "b"], values, lengths=ones))
        exported_keys, vectors = collection.export("t")
        table = dict(zip(exported_keys.tolist(), vectors.float()))
        zero = torch.zeros(dim)
        for f, feature in enumerate(["a", "b"]):
            expected = torch.stack([table.get(k, zero) for k in values[f * batch:(f + 1) * batch].tolist()])
            torch.testing.assert_close(out[feature].float(), expected, rtol=0, atol=0)
        if step == 0:
            target = torch.randn(2 * batch, dim, generator=g)
            (torch.cat([out["a"], out["b"]]).float() * target).sum().backward()
            # The exported keys are in row order (row r holds exported_keys[r]).
            row_of = {k: r for r, k in enumerate(exported_keys.tolist())}
            rows = torch.tensor([row_of[k] for k in keys.tolist()])
            grad = collection.weights["t"].grad
            dense = torch.zeros(grad.shape).index_add_(0, rows, target)
            # (a bfloat16 table's gradient is rounded to bfloat16)
            torch.testing.assert_close(grad.to_dense(), dense.to(dtype), rtol=0, atol=0)

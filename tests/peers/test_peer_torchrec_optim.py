"""TorchRec's and torch.optim's own test cases, ported to sparsekit's collection, KeyedJagged and LazyAdam.

Each test follows a test of pytorch/torchrec or pytorch/pytorch (named in its docstring):
torchrec/sparse/tests/test_jagged_tensor.py for ``KeyedJaggedTensor`` (key lookup,
``to_dict``, lengths vs offsets, empty inputs, ``length_per_key`` / ``offset_per_key``,
weights), torchrec/modules/tests/test_embedding_modules.py for ``EmbeddingBagCollection``
(output shapes and order, shared tables, shared features, weighted, duplicate table names,
the meta device), and test/test_optim.py with the ``OptimizerInfo`` inputs of
torch/testing/_internal/common_optimizers.py for ``torch.optim.SparseAdam`` / ``Adam``
(settings, error inputs, the sparse Rosenbrock, state dicts, hooks, named parameters).

They check what the peer test checks where docs/api.md or docs/design.md promise
the peer's behaviour. Where sparsekit deliberately differs (a ``Dict[str, Tensor]`` output
rather than a ``KeyedTensor``, a feature read by one table only, no meta-device forward, no
tensor ``lr``) the test checks the documented behaviour and a clear error instead. TorchRec is
not installed: :class:`TorchRecKJT` is a stand-in with exactly the ``KeyedJaggedTensor``
methods the collection reads. References are plain torch: ``nn.EmbeddingBag`` per table over
direct-mapped tables (row ``k`` holds key ``k`` in one process), ``torch.optim.SparseAdam``,
``torch.optim.Adam`` and a hand-written lazy Adam.
"""

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import sparsekit as sk

torch.set_num_threads(min(2, torch.get_num_threads()))


class TorchRecKJT:
    """A stand-in for ``torchrec.KeyedJaggedTensor`` (nothing of sparsekit): its constructors
    ``from_lengths_sync`` / ``from_offsets_sync`` and the methods TorchRec users and the
    collection call, with TorchRec's own semantics (offsets derived from lengths and the
    reverse, int32 kept, ``stride`` = bags // keys, ``variable_stride_per_key`` False)."""

    def __init__(self, keys, values, weights=None, lengths=None, offsets=None, stride=None):
        self._keys, self._values, self._weights = list(keys), values, weights
        self._lengths, self._offsets = lengths, offsets
        bags = (lengths.numel() if lengths is not None else offsets.numel() - 1)
        self._stride = stride if stride is not None else (bags // len(self._keys) if self._keys else 0)

    @classmethod
    def from_lengths_sync(cls, keys, values, lengths, weights=None):
        return cls(keys, values, weights=weights, lengths=lengths)

    @classmethod
    def from_offsets_sync(cls, keys, values, offsets, weights=None):
        return cls(keys, values, weights=weights, offsets=offsets)

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def weights_or_none(self):
        return self._weights

    def lengths(self):
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def offsets(self):
        if self._offsets is None:
            self._offsets = torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0).to(
                self._lengths.dtype)])
        return self._offsets

    def stride(self):
        return self._stride

    def variable_stride_per_key(self):
        return False

    def length_per_key(self):
        b = self._stride
        return [int(self.lengths()[i * b:(i + 1) * b].sum()) for i in range(len(self._keys))]

    def offset_per_key(self):
        out = [0]
        for length in self.length_per_key():
            out.append(out[-1] + length)
        return out


# The batch of TorchRec's test_unweighted / test_shared_tables:
#     0       1        2  <-- batch
# 0   [0,1] None    [2]
# 1   [3]    [4]    [5,6,7]
# ^ feature
VALUES = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
OFFSETS = torch.tensor([0, 2, 2, 3, 4, 5, 8])
# TorchRec's test_weighted batch: features f1, f3 (table t1) and f2 (table t2), batch 2.
W_VALUES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7])
W_OFFSETS = torch.tensor([0, 2, 4, 6, 8, 10, 12])
W_WEIGHTS = torch.tensor([0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7])


def reference_pool(ebc, table, feature_index, kjt, mean=False):
    """``nn.EmbeddingBag`` over a direct table's weight (row k holds key k), for one feature."""
    batch = kjt.stride()
    offsets = kjt.offsets().long()[feature_index * batch:(feature_index + 1) * batch + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    weights = kjt.weights_or_none()
    bag = nn.EmbeddingBag.from_pretrained(ebc.weights[table].detach().float(), freeze=True, mode="sum")
    psw = None if weights is None else weights[start:end].float()
    pooled = bag(kjt.values()[start:end].long(), offsets[:-1] - start, per_sample_weights=psw)
    if mean:  # TableConfig: "the weighted sum divided by the bag's length"
        pooled = pooled / (offsets[1:] - offsets[:-1]).clamp(min=1).unsqueeze(1)
    return pooled


# ---- torchrec/modules/tests/test_embedding_modules.py ----


def test_unweighted_two_tables_give_each_feature_its_tables_dim_in_key_order():
    """EmbeddingBagCollectionTest.test_unweighted: two tables of dims 3 and 4, batch 3 with an
    empty bag; TorchRec's KeyedTensor is [3, 7] with offset_per_key [0, 3, 7], ours a dict of
    [3, 3] and [3, 4] in the input's key order, equal to nn.EmbeddingBag per table."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t1", 3, 10, ["f1"], use_hashtable=False),
                                     sk.TableConfig("t2", 4, 10, ["f2"], use_hashtable=False)])
    kjt = sk.KeyedJagged(["f1", "f2"], VALUES, offsets=OFFSETS)
    pooled = ebc(kjt)
    assert list(pooled) == ["f1", "f2"]
    assert pooled["f1"].shape == (3, 3) and pooled["f2"].shape == (3, 4)
    # The KeyedTensor layout: values() is the features' outputs side by side.
    assert torch.cat([pooled["f1"], pooled["f2"]], 1).shape == (3, 7)
    torch.testing.assert_close(pooled["f1"], reference_pool(ebc, "t1", 0, kjt))
    torch.testing.assert_close(pooled["f2"], reference_pool(ebc, "t2", 1, kjt))
    assert torch.equal(pooled["f1"][1], torch.zeros(3))  # the empty bag


def test_shared_table_serves_both_features():
    """EmbeddingBagCollectionTest.test_shared_tables: one table read by f1 and f2 gives
    both [3, 3] outputs (TorchRec: [3, 6], offset_per_key [0, 3, 6]) from the same rows."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t1", 3, 10, ["f1", "f2"], use_hashtable=False)])
    kjt = sk.KeyedJagged(["f1", "f2"], VALUES, offsets=OFFSETS)
    pooled = ebc(kjt)
    assert list(pooled) == ["f1", "f2"] and all(v.shape == (3, 3) for v in pooled.values())
    torch.testing.assert_close(pooled["f1"], reference_pool(ebc, "t1", 0, kjt))
    torch.testing.assert_close(pooled["f2"], reference_pool(ebc, "t1", 1, kjt))
    # The same key in two features reads the same row.
    same = sk.KeyedJagged(["f1", "f2"], torch.tensor([5, 5]), lengths=torch.tensor([1, 1]))
    out = ebc(same)
    assert torch.equal(out["f1"], out["f2"])


def test_a_feature_read_by_two_tables_is_refused_naming_both():
    """EmbeddingBagCollectionTest.test_shared_features: TorchRec names the outputs f1@t1 and
    f1@t2; sparsekit's output is keyed by feature, so a feature reads one table (DESIGN 3b,
    the collection's docstring) and two tables naming it raise ValueError naming both."""
    with pytest.raises(ValueError, match=r"feature 'f1' is read by tables 't1' and 't2'"):
        sk.EmbeddingBagCollection([sk.TableConfig("t1", 3, 10, ["f1"]), sk.TableConfig("t2", 4, 10, ["f1"])])


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_weighted_features_of_shared_and_single_tables(combiner):
    """EmbeddingBagCollectionTest.test_weighted: f1 and f3 read t1 (dim 3), f2 reads t2
    (dim 4), with per-value weights; TorchRec's [2, 10] with offset_per_key [0, 3, 6, 10] is
    our three outputs in key order, each the weighted nn.EmbeddingBag (mean: the weighted
    sum over the bag's length, as TableConfig documents)."""
    ebc = sk.EmbeddingBagCollection([
        sk.TableConfig("t1", 3, 10, ["f1", "f3"], use_hashtable=False, combiner=combiner),
        sk.TableConfig("t2", 4, 10, ["f2"], use_hashtable=False, combiner=combiner)])
    kjt = sk.KeyedJagged(["f1", "f3", "f2"], W_VALUES, offsets=W_OFFSETS, weights=W_WEIGHTS)
    pooled = ebc(kjt)
    assert list(pooled) == ["f1", "f3", "f2"]
    assert [v.shape[1] for v in pooled.values()] == [3, 3, 4] and all(v.shape[0] == 2 for v in pooled.values())
    for f, (feature, table) in enumerate([("f1", "t1"), ("f3", "t1"), ("f2", "t2")]):
        torch.testing.assert_close(pooled[feature], reference_pool(ebc, table, f, kjt, mean=combiner == "mean"))


def test_duplicate_table_names_fail():
    """EmbeddingBagCollectionTest.test_duplicate_config_name_fails: ValueError."""
    with pytest.raises(ValueError, match="table names must be distinct"):
        sk.EmbeddingBagCollection([sk.TableConfig("t1", 3, 10, ["f1"]), sk.TableConfig("t1", 4, 10, ["f2"])])


@pytest.mark.parametrize("how", ["argument", "context"])
def test_meta_device_from_argument_or_context_then_materialized(how):
    """EmbeddingBagCollectionTest.test_device (and test_forward_with_meta_device): a
    collection built on the meta device, by argument or under ``with torch.device("meta")``,
    has its weights there; its forward is refused with a clear error (docs/design.md: tables on
    the meta device hold no data) and after ``to_empty`` + ``reset_parameters`` it is a new
    collection (nn.Module's convention)."""
    def tables():
        return [sk.TableConfig("t1", 3, 10, ["f1"]), sk.TableConfig("t2", 4, 10, ["f2"], use_hashtable=False)]
    if how == "argument":
        ebc = sk.EmbeddingBagCollection(tables(), device="meta")
    else:
        with torch.device("meta"):
            ebc = sk.EmbeddingBagCollection(tables())
    assert all(w.device.type == "meta" for w in ebc.weights.values())
    kjt = sk.KeyedJagged(["f1", "f2"], VALUES, offsets=OFFSETS)
    with pytest.raises(RuntimeError, match="meta device"):
        ebc(kjt)
    ebc = ebc.to_empty(device="cpu")
    ebc.reset_parameters()
    fresh = sk.EmbeddingBagCollection(tables())(kjt)
    out = ebc(kjt)
    assert all(torch.equal(out[k], fresh[k]) for k in fresh)


def test_default_device_is_cpu():
    """EmbeddingBagCollectionTest.test_device, last case: without a device the weights are on the CPU."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t1", 3, 10, ["f1"])])
    assert ebc.weights["t1"].device == torch.device("cpu")


# ---- torchrec/sparse/tests/test_jagged_tensor.py ----


def test_key_lookup_and_to_dict_give_each_features_bags_and_weights():
    """TestKeyedJaggedTensor.test_key_lookup and test_to_dict: int32 offsets, with weights."""
    weights = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5])
    kjt = sk.KeyedJagged(["index_0", "index_1"], torch.arange(1, 9), offsets=OFFSETS.int(), weights=weights)
    for views in ({k: kjt[k] for k in kjt.keys()}, kjt.to_dict()):
        j0, j1 = views["index_0"], views["index_1"]
        assert j0.lengths().tolist() == [2, 0, 1] and j0.values().tolist() == [1, 2, 3]
        assert j0.weights().tolist() == [1.0, 0.5, 1.5]
        assert j1.lengths().tolist() == [1, 1, 3] and j1.values().tolist() == [4, 5, 6, 7, 8]
        assert j1.weights().tolist() == [1.0, 0.5, 1.0, 1.0, 1.5]
        assert j1.offsets().tolist() == [0, 1, 2, 5]
    assert list(kjt.to_dict()) == ["index_0", "index_1"]


def test_lengths_and_offsets_describe_the_same_input():
    """TestKeyedJaggedTensor.test_length_vs_offset: from_offsets_sync and from_lengths_sync
    of the same bags agree on lengths() and offsets(), and pool alike."""
    offsets = torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8], dtype=torch.int32)
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3], dtype=torch.int32)
    by_offsets = sk.KeyedJagged(["index_0", "index_1"], VALUES, offsets=offsets)
    by_lengths = sk.KeyedJagged(["index_0", "index_1"], VALUES, lengths=lengths)
    assert torch.equal(by_offsets.lengths(), by_lengths.lengths())
    assert torch.equal(by_offsets.offsets().long(), by_lengths.offsets().long())
    assert by_offsets.stride() == by_lengths.stride() == 4
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 10, ["index_0", "index_1"])])
    a, b = ebc(by_offsets), ebc(by_lengths)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_empty_inputs():
    """TestKeyedJaggedTensor.test_empty and test_empty_to_dict: a key with no values gives an
    empty view; KeyedJaggedTensor.empty() (no keys) gives {} from to_dict() and stride 0;
    the collection pools an empty batch to [0, dim] outputs, and no keys to {}."""
    one = sk.KeyedJagged(["index_0"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64))
    j0 = one["index_0"]
    assert j0.values().numel() == 0 and j0.lengths().numel() == 0 and j0.offsets().tolist() == [0]
    two = sk.KeyedJagged(["index_0", "index_1"], torch.zeros(0, dtype=torch.int64),
                         lengths=torch.zeros(0, dtype=torch.int64))
    views = two.to_dict()
    assert list(views) == ["index_0", "index_1"] and all(v.values().numel() == 0 for v in views.values())
    assert two.length_per_key() == [0, 0] and two.offset_per_key() == [0, 0, 0]
    empty = sk.KeyedJagged([], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int32))
    assert empty.to_dict() == {} and empty.stride() == 0
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 3, 10, ["index_0", "index_1"])])
    assert ebc(empty) == {}
    out = ebc(two)
    assert list(out) == ["index_0", "index_1"] and all(v.shape == (0, 3) for v in out.values())


def test_length_and_offset_per_key():
    """TestKeyedJaggedTensor.test_permute (its offset_per_key / lengths arithmetic, on the
    unpermuted input): lengths [0, 2, 0 | 1, 1, 1 | 0, 3, 0] of three keys."""
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0], dtype=torch.int32)
    kjt = sk.KeyedJagged(["index_0", "index_1", "index_2"], torch.arange(1, 9), lengths=lengths)
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [2, 3, 3] and kjt.offset_per_key() == [0, 2, 5, 8]
    assert kjt["index_1"].values().tolist() == [3, 4, 5] and kjt["index_2"].lengths().tolist() == [0, 3, 0]


def test_a_repeated_key_reads_the_same_bags_by_index_and_by_to_dict():
    """TestKeyedJaggedTensor.test_permute_duplicates makes a KeyedJaggedTensor with a key
    listed more than once; TorchRec's kjt[key] and to_dict() then both give its last bags
    ({key: index} keeps the last). sparsekit's two views must agree with each other and
    with TorchRec (the collection itself refuses such an input)."""
    kjt = sk.KeyedJagged(["a", "b", "a"], torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 0, 2, 1, 1, 1]))
    by_index, by_dict = kjt["a"], kjt.to_dict()["a"]
    assert by_index.values().tolist() == by_dict.values().tolist() == [5, 6]
    assert by_index.lengths().tolist() == by_dict.lengths().tolist() == [1, 1]
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 3, 10, ["a", "b"])])
    with pytest.raises(ValueError, match="names a feature twice"):
        ebc(kjt)


def test_integer_lengths_and_offsets_only():
    """TestJaggedTensor.test_float_lengths_offsets_throws: float lengths or offsets are
    refused (TorchRec: AssertionError; here TypeError naming the argument)."""
    with pytest.raises(TypeError, match="lengths must be an int64 or int32 tensor"):
        sk.KeyedJagged(["a"], torch.arange(7), lengths=torch.tensor([3.0, 4.0]))
    with pytest.raises(TypeError, match="offsets must be an int64 or int32 tensor"):
        sk.KeyedJagged(["a"], torch.arange(7), offsets=torch.tensor([0.0, 3.0, 7.0]))


def test_to_keeps_every_part():
    """TestJaggedTensor.test_to: to(device) keeps offsets, lengths, values and weights."""
    kjt = sk.KeyedJagged(["a"], torch.tensor([5, 10, 15]), offsets=torch.tensor([0, 2, 2, 3]),
                         weights=torch.tensor([5.0, 10.0, 15.0]))
    moved = kjt.to(torch.device("cpu"))
    for method in ("offsets", "lengths", "values", "weights"):
        assert torch.equal(getattr(moved, method)(), getattr(kjt, method)())


# ---- a TorchRec KeyedJaggedTensor stand-in into the collection ----


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("build", ["from_lengths_sync", "from_offsets_sync"])
def test_torchrec_kjt_stand_in_matches_keyed_jagged(weighted, build):
    """The documented promise (docs/api.md): an object with TorchRec's KeyedJaggedTensor methods is
    accepted as sk.KeyedJagged is, with int32 lengths/offsets as TorchRec keeps them, and
    gives the same outputs and gradients."""
    def make():
        return sk.EmbeddingBagCollection([
            sk.TableConfig("t1", 3, 64, ["f1", "f3"], combiner="mean"),
            sk.TableConfig("t2", 4, 64, ["f2"], dtype=torch.bfloat16)])
    weights = W_WEIGHTS if weighted else None
    lengths = (W_OFFSETS[1:] - W_OFFSETS[:-1]).int()
    keys = ["f1", "f3", "f2"]
    ours = sk.KeyedJagged(keys, W_VALUES, offsets=W_OFFSETS, weights=weights)
    if build == "from_lengths_sync":
        theirs = TorchRecKJT.from_lengths_sync(keys, W_VALUES, lengths, weights=weights)
    else:
        theirs = TorchRecKJT.from_offsets_sync(keys, W_VALUES, W_OFFSETS.int(), weights=weights)
    assert theirs.length_per_key() == ours.length_per_key() and theirs.offset_per_key() == ours.offset_per_key()
    a, b = make(), make()
    out_a, out_b = a(ours), b(theirs)
    assert list(out_b) == keys
    for k in keys:
        assert out_a[k].dtype == out_b[k].dtype and torch.equal(out_a[k], out_b[k])
    sum(v.float().square().sum() for v in out_a.values()).backward()
    sum(v.float().square().sum() for v in out_b.values()).backward()
    for name in ("t1", "t2"):
        assert torch.equal(a.weights[name].grad.to_dense(), b.weights[name].grad.to_dense())


def test_torchrec_kjt_stand_in_with_variable_batch_or_wrong_stride_is_refused():
    """TorchRec's variable batch per feature (variable_stride_per_key() True) without its
    inverse indices, and a stride() that disagrees with the bags, are refused naming the method."""
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 3, 10, ["f1", "f2"])])
    wrong = TorchRecKJT.from_offsets_sync(["f1", "f2"], VALUES, OFFSETS)
    wrong._stride = 2
    with pytest.raises(ValueError, match=r"stride\(\) is 2"):
        ebc(wrong)
    variable = TorchRecKJT.from_offsets_sync(["f1", "f2"], VALUES, OFFSETS)
    variable.variable_stride_per_key = lambda: True
    variable.stride_per_key = lambda: [3, 3]
    with pytest.raises(ValueError, match=r"variable_stride_per_key\(\) is True"):
        ebc(variable)


# ---- training: EmbeddingBagCollection + LazyAdam vs nn.EmbeddingBag + SparseAdam ----


def test_collection_with_lazy_adam_trains_as_embedding_bags_with_sparse_adam():
    """TorchRec's train loop over an EBC with a sparse optimizer, against plain torch: per
    table an nn.EmbeddingBag(sparse=True) (shared by its features) and SparseAdam. Steps
    list a subset of the features (one table absent in step 2) and empty bags; weights,
    per-table step counts and outputs follow the reference."""
    rows, batch = 20, 4
    ebc = sk.EmbeddingBagCollection([
        sk.TableConfig("t1", 3, rows, ["f1", "f3"], use_hashtable=False, combiner="mean"),
        sk.TableConfig("t2", 4, rows, ["f2"], use_hashtable=False),
        sk.TableConfig("t3", 2, rows, ["f4"], use_hashtable=False)])
    table_of = {"f1": "t1", "f3": "t1", "f2": "t2", "f4": "t3"}
    ref = {name: nn.EmbeddingBag(rows, w.shape[1], mode="mean" if name == "t1" else "sum", sparse=True)
           for name, w in ebc.weights.items()}
    with torch.no_grad():
        for name, bag in ref.items():
            bag.weight.copy_(ebc.weights[name])
    opt = sk.LazyAdam(ebc.parameters(), lr=0.05)
    ref_opt = torch.optim.SparseAdam([bag.weight for bag in ref.values()], lr=0.05)
    gen = torch.Generator().manual_seed(1)
    counted = {name: 0 for name in ref}
    for step in range(5):
        keys = ["f1", "f3", "f2"] if step != 2 else ["f2", "f1"]
        lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        kjt = sk.KeyedJagged(keys, values, lengths=lengths)
        out = ebc(kjt)
        assert list(out) == keys
        target = {k: torch.randn(out[k].shape, generator=gen) for k in keys}
        opt.zero_grad()
        sum((out[k] * target[k]).sum() for k in keys).backward()
        opt.step()
        offsets = kjt.offsets()
        ref_opt.zero_grad()
        loss = 0
        for f, k in enumerate(keys):
            o = offsets[f * batch:(f + 1) * batch + 1]
            pooled = ref[table_of[k]](values[o[0]:o[-1]], o[:-1] - o[0])
            torch.testing.assert_close(out[k], pooled.detach(), rtol=1e-6, atol=1e-6)
            loss = loss + (pooled * target[k]).sum()
        loss.backward()
        ref_opt.step()
        for name in {table_of[k] for k in keys}:
            counted[name] += 1
        for name, bag in ref.items():
            torch.testing.assert_close(ebc.weights[name], bag.weight, rtol=1e-5, atol=1e-6)
            state = opt.state.get(ebc.weights[name])
            assert (int(state["step"].item()) if state else 0) == counted[name] == \
                int(ref_opt.state[bag.weight].get("step", 0) if bag.weight in ref_opt.state else 0)
    assert counted["t3"] == 0 and ebc.weights["t3"] not in opt.state  # f4 was never listed


# ---- torch.optim: OptimizerInfo inputs of SparseAdam / Adam ----


def sparse_step_pairs(kwargs, steps=4, seed=0):
    """nn.Embedding(sparse=True) trained by SparseAdam and by LazyAdam with ``kwargs`` on the
    same lookups (with repeated ids: uncoalesced gradients); returns both weights and states."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(16, 5, generator=gen)
    out = []
    for cls in (torch.optim.SparseAdam, sk.LazyAdam):
        emb = nn.Embedding(16, 5, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(start)
        opt = cls(emb.parameters(), **kwargs)
        g = torch.Generator().manual_seed(seed + 1)
        for _ in range(steps):
            ids = torch.randint(0, 16, (12,), generator=g)
            target = torch.randn(12, 5, generator=g)
            opt.zero_grad()
            (emb(ids) * target).sum().backward()
            opt.step()
        out.append((emb.weight.detach(), opt.state[emb.weight]))
    return out


@pytest.mark.parametrize("kwargs", [{}, {"lr": 0.01}, {"maximize": True}, {"lr": 0.01, "betas": (0.5, 0.9),
                                                                           "eps": 1e-3}],
                         ids=["default", "non-default lr", "maximize", "betas and eps"])
def test_sparse_adam_optim_inputs(kwargs):
    """common_optimizers.optim_inputs_func_sparseadam (default, non-default lr, maximize;
    plus betas/eps) as test_optim's correctness checks run them: LazyAdam on sparse
    gradients is SparseAdam (moments bit for bit up to the duplicate rows' summation order,
    docs/design.md), step counted per parameter."""
    (ref_weight, ref_state), (weight, state) = sparse_step_pairs(kwargs)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    assert int(state["step"].item()) == int(ref_state["step"]) == 4


def test_sparse_adam_tensor_lr():
    """optim_inputs_func_sparseadam's "Tensor lr": LazyAdam on sparse gradients with a tensor
    lr is SparseAdam with that lr; get_error_inputs_for_all_optims' 2-element tensor lr raises."""
    (ref_weight, ref_state), (weight, state) = sparse_step_pairs({"lr": torch.tensor(0.001)})
    torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lr"):
        sk.LazyAdam([nn.Parameter(torch.randn(3, 2))], lr=torch.tensor([0.001, 0.001]))


def rosenbrock(tensor):
    x, y = tensor
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


@pytest.mark.parametrize("maximize", [False, True])
def test_rosenbrock_sparse(maximize):
    """test_optim.TestOptimRenewed.test_rosenbrock_sparse: a 1-D parameter whose sparse
    gradient names one coordinate twice (uncoalesced: x/4 and 3x/4), SparseAdam vs LazyAdam."""
    results = []
    for cls in (torch.optim.SparseAdam, sk.LazyAdam):
        param = nn.Parameter(torch.tensor([1.5, 1.5], dtype=torch.float64))
        opt = cls([param], lr=1e-3, maximize=maximize)
        for i in range(20):
            opt.zero_grad()
            rosenbrock(param).backward()
            grad = param.grad.clone()
            if i % 2 == 0:
                index, values = [[0, 0]], torch.stack([grad[0] / 4.0, grad[0] - grad[0] / 4.0])
            else:
                index, values = [[1, 1]], torch.stack([grad[1] - grad[1] / 4.0, grad[1] / 4.0])
            param.grad = torch.sparse_coo_tensor(torch.tensor(index), values, (2,), check_invariants=True)
            opt.step()
        results.append(param.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-14)
    assert not torch.equal(results[0], torch.tensor([1.5, 1.5], dtype=torch.float64))


@pytest.mark.parametrize("kwargs", [{}, {"lr": 0.01}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True}],
                         ids=["default", "non-default lr", "nonzero weight_decay", "maximize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_optim_inputs_on_dense_parameters(kwargs, dtype):
    """common_optimizers.optim_inputs_func_adam (its CPU configs without amsgrad, which
    LazyAdam lacks): dense gradients get torch.optim.Adam's numbers bit for bit (docs/design.md)."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(4, 3, generator=gen, dtype=dtype), torch.randn(3, generator=gen, dtype=dtype)]
    grads = [[torch.randn_like(s) for s in start] for _ in range(3)]
    finals = []
    for cls in (torch.optim.Adam, sk.LazyAdam):
        params = [nn.Parameter(s.clone()) for s in start]
        opt = cls(params, **kwargs)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        finals.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_sparse_adam_weight_decay_is_l2_on_touched_rows_only():
    """DESIGN's lazy_adam_ formula with weight_decay (SparseAdam has none): g += wd * w_r on
    the rows of the gradient; other rows keep weights and moments."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(10, 3, generator=gen)
    param = nn.Parameter(weight.clone())
    opt = sk.LazyAdam([param], lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)
    m, v, w = torch.zeros(10, 3, dtype=torch.float64), torch.zeros(10, 3, dtype=torch.float64), weight.double()
    for step in range(1, 4):
        rows = torch.tensor([1, 4, 7]) if step != 2 else torch.tensor([4, 9])
        grad = torch.randn(rows.numel(), 3, generator=gen)
        param.grad = torch.sparse_coo_tensor(rows[None], grad, (10, 3), check_invariants=True).coalesce()
        opt.step()
        g = grad.double() + 0.3 * w[rows]
        m[rows] = 0.8 * m[rows] + 0.2 * g
        v[rows] = 0.99 * v[rows] + 0.01 * g * g
        w[rows] -= 0.1 * math.sqrt(1 - 0.99**step) / (1 - 0.8**step) * m[rows] / (v[rows].sqrt() + 1e-6)
        torch.testing.assert_close(param.detach().double(), w, rtol=1e-5, atol=1e-6)
    assert torch.equal(param.detach()[[0, 2, 3]], weight[[0, 2, 3]])
    assert torch.equal(opt.state[param]["exp_avg"][[0, 2, 3]], torch.zeros(3, 3))


def test_error_inputs_for_all_optims():
    """common_optimizers.get_error_inputs_for_all_optims and optim_error_inputs_func_sparseadam
    (CPU): a bare tensor, duplicate parameters (a warning in a group, ValueError across
    groups), names given to some parameters only, beta1 = 1, weight_decay < 0, sparse
    parameters alone or in a group."""
    p, q = nn.Parameter(torch.randn(1, 1)), nn.Parameter(torch.randn(1, 1))
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        sk.LazyAdam(p)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        sk.LazyAdam([p, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        sk.LazyAdam([{"params": p}, {"params": p}])
    with pytest.raises(ValueError, match="with/without names"):
        sk.LazyAdam([("weight", p), q])
    with pytest.raises(ValueError, match="with/without names"):
        sk.LazyAdam([{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}])
    with pytest.raises(ValueError, match="betas"):
        sk.LazyAdam([p], lr=1e-2, betas=(1.0, 0.0))
    with pytest.raises(ValueError, match="weight_decay"):
        sk.LazyAdam([p], lr=1e-2, weight_decay=-1)
    sparse = torch.zeros(3, layout=torch.sparse_coo)
    for params in ([sparse], [{"params": [sparse]}]):
        with pytest.raises(ValueError, match="sparse parameters"):
            sk.LazyAdam(params)


def test_state_dict_deterministic_and_round_trip_with_weights_only():
    """test_optim.test_state_dict_deterministic / test_save_load_equality_with_weights_only:
    an optimizer loaded from another's state_dict (saved and read back with
    weights_only=True) over equal but distinct parameters continues it exactly, and both
    state dicts are then equal."""
    emb = nn.EmbeddingBag(12, 4, sparse=True)
    lin = nn.Linear(4, 1)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    opt = sk.LazyAdam(model.parameters(), lr=0.05, weight_decay=0.01)
    ids, offsets = torch.tensor([1, 2, 3, 3, 7]), torch.tensor([0, 2])

    def step(m, o):
        o.zero_grad()
        m["lin"](m["emb"](ids, offsets)).square().sum().backward()
        o.step()
    for _ in range(2):
        step(model, opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    clone = copy.deepcopy(model)
    opt_c = sk.LazyAdam(clone.parameters(), lr=0.5)
    opt_c.load_state_dict(saved)
    assert opt_c.param_groups[0]["lr"] == 0.05
    for _ in range(2):
        step(model, opt)
        step(clone, opt_c)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))
    sd, sd_c = opt.state_dict(), opt_c.state_dict()
    assert sd["param_groups"] == sd_c["param_groups"]
    for key in sd["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][key][name], sd_c["state"][key][name])


def test_load_nontensor_step_and_a_sparse_adam_state():
    """test_optim.test_load_nontensor_step (a plain-number step loads and counts on) and a
    SparseAdam state (int steps, no weight_decay) loaded into LazyAdam continues it."""
    emb = nn.Embedding(10, 3, sparse=True)
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    ids = torch.tensor([1, 4, 4, 8])
    ref.zero_grad()
    emb(ids).sum().backward()
    ref.step()
    state = ref.state_dict()
    assert isinstance(state["state"][0]["step"], int)
    opt = sk.LazyAdam(emb.parameters())
    opt.load_state_dict(state)
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["lr"] == 0.1
    before = emb.weight.detach().clone()
    twin = nn.Embedding(10, 3, sparse=True)
    with torch.no_grad():
        twin.weight.copy_(before)
    twin_ref = torch.optim.SparseAdam(twin.parameters(), lr=0.1)
    twin_ref.load_state_dict(copy.deepcopy(state))
    for module, optimizer in ((emb, opt), (twin, twin_ref)):
        optimizer.zero_grad()
        module(ids).sum().backward()
        optimizer.step()
    torch.testing.assert_close(emb.weight, twin.weight, rtol=1e-6, atol=1e-7)
    assert int(opt.state[emb.weight]["step"].item()) == 2


def test_named_parameters_state_dict_round_trip():
    """test_optim's named-parameter cases (torch >= 2.6): parameters given by name keep
    'param_names' in the groups and the state dict, which loads into an optimizer made
    with or without names."""
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(10, 3, sparse=True), "lin": nn.Linear(3, 1)})
    opt = sk.LazyAdam(model.named_parameters(), lr=0.1)
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    opt.zero_grad()
    model["lin"](model["emb"](ids, offsets)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["emb.weight", "lin.weight", "lin.bias"]
    for named in (True, False):
        clone = copy.deepcopy(model)
        other = sk.LazyAdam(clone.named_parameters() if named else clone.parameters())
        other.load_state_dict(copy.deepcopy(sd))
        assert int(other.state[clone["emb"].weight]["step"].item()) == 1


def test_step_and_load_state_dict_hooks():
    """test_optim.test_step_all_hooks, test_load_state_dict_pre_hook_and_prepend and
    test_load_state_dict_post_hook_and_prepend: hooks run in torch's order, a pre-hook's
    returned state is the one loaded."""
    param = nn.Parameter(torch.randn(4, 2))
    param.grad = torch.randn(4, 2)
    opt = sk.LazyAdam([param], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("step pre"))
    opt.register_step_post_hook(lambda *_: calls.append("step post"))
    opt.step()
    assert calls == ["step pre", "step post"]
    other = sk.LazyAdam([nn.Parameter(param.detach().clone())], lr=0.5)
    calls.clear()

    def pre(optimizer, state):
        calls.append("pre")
        state = copy.deepcopy(state)
        state["param_groups"][0]["lr"] = 0.25
        return state
    other.register_load_state_dict_pre_hook(pre)
    other.register_load_state_dict_pre_hook(lambda *_: calls.append("pre first"), prepend=True)
    other.register_load_state_dict_post_hook(lambda *_: calls.append("post"))
    other.register_load_state_dict_post_hook(lambda *_: calls.append("post first"), prepend=True)
    other.load_state_dict(opt.state_dict())
    assert calls == ["pre first", "pre", "post first", "post"]
    assert other.param_groups[0]["lr"] == 0.25


def test_step_without_gradients_is_a_noop_and_closure_loss_is_returned():
    """test_optim.test_step_is_noop_when_params_have_no_grad and the closure contract."""
    param = nn.Parameter(torch.randn(3, 2))
    opt = sk.LazyAdam([param])
    before = param.detach().clone()
    opt.step()
    assert torch.equal(param, before) and len(opt.state) == 0

    def closure():
        opt.zero_grad()
        loss = param.square().sum()
        loss.backward()
        return loss
    assert torch.equal(opt.step(closure), before.square().sum())


def test_zero_grad_keeping_a_sparse_gradient_counts_the_step_as_sparse_adam():
    """test_optim.test_zero_grad semantics with set_to_none=False: the sparse gradient is
    emptied, a step then moves no row and both SparseAdam and LazyAdam count it."""
    counts = []
    for cls in (torch.optim.SparseAdam, sk.LazyAdam):
        emb = nn.Embedding(10, 3, sparse=True)
        opt = cls(emb.parameters())
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert emb.weight.grad is not None and emb.weight.grad._nnz() == 0
        before = emb.weight.detach().clone()
        opt.step()
        assert torch.equal(emb.weight, before)
        counts.append(int(torch.as_tensor(opt.state[emb.weight]["step"]).item()))
    assert counts == [2, 2]


@pytest.mark.parametrize("grad_kind", ["coalesced", "uncoalesced", "dense"])
def test_grads_are_never_inplaced_into(grad_kind):
    """test_optim.test_grads_are_never_inplaced_into: weight decay and maximize must not
    write into the gradient (every path: the fused sparse one, the summed repeated rows,
    dense Adam)."""
    params = [nn.Parameter(torch.randn(10, 4)), nn.Parameter(torch.randn(12, 4))]
    for p in params:
        if grad_kind == "dense":
            p.grad = torch.randn_like(p)
        else:
            grad = torch.sparse_coo_tensor(torch.tensor([[3, 1, 3, 7]]), torch.randn(4, 4), p.shape, check_invariants=True)
            p.grad = grad.coalesce() if grad_kind == "coalesced" else grad
    saved = [p.grad.clone() for p in params]
    opt = sk.LazyAdam(params, lr=0.1, weight_decay=0.2, maximize=True)
    opt.step()
    opt.step()
    for before, p in zip(saved, params):
        assert torch.equal(before.to_dense(), p.grad.to_dense())


def test_deepcopy_copies_all_public_attrs_and_prints():
    """test_optim.test_deepcopy_copies_all_public_attrs and test_optimizer_can_be_printed."""
    param = nn.Parameter(torch.randn(3, 2))
    param.grad = torch.randn(3, 2)
    opt = sk.LazyAdam([param], lr=0.1)
    opt.step()
    clone = copy.deepcopy(opt)
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(clone) if not k.startswith("_")}
    assert "LazyAdam" in repr(opt) and "lr: 0.1" in repr(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clone.step()

"""TorchRec's own EmbeddingBagCollection test cases, run against sk.EmbeddingBagCollection.

Each test follows a test of pytorch/torchrec (named in its docstring):
torchrec/modules/tests/test_embedding_modules.py (``EmbeddingBagCollectionTest``), the
collection cases of torchrec/modules/tests/test_fused_embedding_modules.py
(``FusedEmbeddingBagCollectionTest``: TorchRec's fused optimizer is sparsekit's
``fused_params``), and the ``KeyedTensor`` / ``KeyedJaggedTensor`` behaviours those tests lean
on (torchrec/sparse/tests/test_keyed_tensor.py, test_keyed_jagged_tensor.py). The collection
is built from TorchRec's own ``EmbeddingBagConfig`` objects and fed TorchRec's own
``KeyedJaggedTensor``; where the upstream test checks shapes only, the numbers are also
checked against TorchRec's ``EmbeddingBagCollection`` holding the same rows (loaded through
``load_torchrec_state_dict``). The contract is docs/torchrec.md and docs/api.md.

Left out, outside that contract: a feature read by two tables (``test_shared_features``,
``test_shared_tables_shared_features``: TorchRec's ``f1@t1`` keys; sparsekit reads a feature
from one table), a forward on the meta device (``test_forward_with_meta_device``),
TorchScript (``test_scripting`` and ``test_fx``'s ``torch.jit.script``: refused by design),
``fuse_embedding_optimizer`` module replacement, ``KeyedTensor`` with ``key_dim=0``, pytree /
string forms, and ``test_unweighted_batchsize_1_shared`` (two configs both named ``t1``,
which ``test_duplicate_config_name_fails`` says TorchRec's collection refuses).

Needs torchrec and fbgemm-gpu-cpu: without them the module is skipped.
"""

from collections import OrderedDict
from functools import partial

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")

import torchrec.optim  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.fx import symbolic_trace  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

import sparsekit as sk  # noqa: E402

POOLINGS = [PoolingType.SUM, PoolingType.MEAN]

# The batch of EmbeddingBagCollectionTest.test_unweighted / test_shared_tables (from offsets):
#      0      1     2    <-- batch
# f1  [0,1]  []    [2]
# f2  [3]    [4]   [5,6,7]
IDS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
OFFSETS = torch.tensor([0, 2, 2, 3, 4, 5, 8])
# test_weighted's batch: f1 and f3 read t1 (dim 3), f2 reads t2 (dim 4); batch 2.
W_KEYS = ["f1", "f3", "f2"]
W_IDS = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7])
W_OFFSETS = torch.tensor([0, 2, 4, 6, 8, 10, 12])
W_WEIGHTS = torch.tensor([0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7])
# FusedEmbeddingBagCollectionTest.test_unweighted's batch (from lengths), empty bags included:
# f1 [0,1] [] [2] | f2 [3] [4] [5,6,7] | f3 [] [8] []
F_IDS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
F_LENGTHS = torch.tensor([2, 0, 1, 1, 1, 3, 0, 1, 0])
# The rows test_state_dict_manual / test_weighted / test_optimizer_fusion load (two rows per table).
ROWS = [torch.tensor([[1.0] * 4, [2.0] * 4]), torch.tensor([[4.0] * 4, [8.0] * 4]),
        torch.tensor([[16.0] * 4, [32.0] * 4])]
SGD = {"optimizer": "sgd", "lr": 0.02}  # the FusedEmbeddingBagCollection tests' SGD(lr=0.02)


def _config(name, dim, rows, features, pooling=PoolingType.SUM, **kwargs):
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(features),
                              pooling=pooling, **kwargs)


def _weighted_configs(pooling=PoolingType.SUM):
    """test_weighted's tables: t1 (dim 3) read by f1 and f3, t2 (dim 4) read by f2."""
    return [_config("t1", 3, 10, ["f1", "f3"], pooling), _config("t2", 4, 10, ["f2"], pooling)]


def _weighted_batch():
    return KeyedJaggedTensor.from_offsets_sync(keys=W_KEYS, values=W_IDS, offsets=W_OFFSETS, weights=W_WEIGHTS)


def _pair(configs, is_weighted=False, **kwargs):
    """sparsekit's collection and TorchRec's over the same configs, TorchRec's rows loaded into ours."""
    theirs = EmbeddingBagCollection(tables=configs, is_weighted=is_weighted)
    ours = sk.EmbeddingBagCollection(configs, is_weighted=is_weighted, **kwargs)
    ours.load_torchrec_state_dict(theirs.state_dict())
    return ours, theirs


def _assert_same_keyed(ours, theirs):
    """Ours is a KeyedTensor-compatible object equal to TorchRec's: keys, widths, offsets,
    values, ``[key]`` and ``to_dict()``."""
    assert isinstance(ours, sk.KeyedTensor)
    assert ours.keys() == theirs.keys()
    assert ours.length_per_key() == theirs.length_per_key() and ours.offset_per_key() == theirs.offset_per_key()
    assert ours.values().shape == theirs.values().shape and ours.values().dtype == theirs.values().dtype
    torch.testing.assert_close(ours.values(), theirs.values())
    ours_dict = ours.to_dict()
    assert list(ours_dict) == list(theirs.to_dict())
    for key in theirs.keys():
        torch.testing.assert_close(ours[key], theirs[key])
        torch.testing.assert_close(ours_dict[key], theirs[key])


def _rows_state(names):
    return OrderedDict((f"embedding_bags.{name}.weight", ROWS[i].clone()) for i, name in enumerate(names))


# ---- torchrec/modules/tests/test_embedding_modules.py: EmbeddingBagCollectionTest ----


@pytest.mark.parametrize("pooling", POOLINGS)
def test_unweighted(pooling):
    """EmbeddingBagCollectionTest.test_unweighted (SUM upstream; MEAN too): tables of dims 3
    and 4 (configs carrying an ``init_fn``), batch 3 with an empty bag, from offsets: a
    KeyedTensor of [3, 7], keys [f1, f2], offset_per_key [0, 3, 7]; with TorchRec's rows, its
    numbers, and the empty bag pools to zeros."""
    configs = [_config("t1", 3, 10, ["f1"], pooling, init_fn=partial(torch.nn.init.normal_, mean=0.0, std=1.5)),
               _config("t2", 4, 10, ["f2"], pooling, init_fn=partial(torch.nn.init.uniform_, a=-0.036, b=0.036))]
    features = KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=IDS, offsets=OFFSETS)
    pooled = sk.EmbeddingBagCollection(configs)(features)
    assert isinstance(pooled, sk.KeyedTensor)
    assert pooled.values().size() == (3, 7)
    assert pooled.keys() == ["f1", "f2"] and pooled.offset_per_key() == [0, 3, 7]
    ours, theirs = _pair(configs)
    pooled = ours(features)
    _assert_same_keyed(pooled, theirs(features))
    assert torch.equal(pooled["f1"][1], torch.zeros(3))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_shared_tables(pooling):
    """EmbeddingBagCollectionTest.test_shared_tables: one table read by f1 and f2 gives a
    KeyedTensor of [3, 6], keys [f1, f2], offset_per_key [0, 3, 6], TorchRec's numbers; the
    same id in both features reads the same row."""
    configs = [_config("t1", 3, 10, ["f1", "f2"], pooling)]
    ours, theirs = _pair(configs)
    features = KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=IDS, offsets=OFFSETS)
    pooled = ours(features)
    assert pooled.values().size() == (3, 6)
    assert pooled.keys() == ["f1", "f2"] and pooled.offset_per_key() == [0, 3, 6]
    _assert_same_keyed(pooled, theirs(features))
    same = ours(KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([5, 5]),
                                                    lengths=torch.tensor([1, 1])))
    assert torch.equal(same["f1"], same["f2"])


def test_weighted():
    """EmbeddingBagCollectionTest.test_weighted: ``is_weighted=True``, f1 and f3 share t1, f2
    reads t2, per-value weights: a KeyedTensor of [2, 10], keys [f1, f3, f2], offset_per_key
    [0, 3, 6, 10], TorchRec's weighted sums; the accessors answer as TorchRec's."""
    configs = _weighted_configs()
    ours, theirs = _pair(configs, is_weighted=True)
    assert ours.is_weighted() is True and theirs.is_weighted() is True
    assert ours.embedding_bag_configs() == theirs.embedding_bag_configs() == configs
    pooled = ours(_weighted_batch())
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"] and pooled.offset_per_key() == [0, 3, 6, 10]
    _assert_same_keyed(pooled, theirs(_weighted_batch()))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_weighted_input_into_an_unweighted_collection(pooling):
    """EmbeddingBagCollectionTest.test_weighted's batch through TorchRec's default
    ``is_weighted=False``: the weights are ignored, as TorchRec ignores them (TorchRec's MEAN
    pooling takes no weights at all, so weighted MEAN has no peer to mirror)."""
    ours, theirs = _pair(_weighted_configs(pooling))
    assert ours.is_weighted() is False and theirs.is_weighted() is False
    pooled = ours(_weighted_batch())
    _assert_same_keyed(pooled, theirs(_weighted_batch()))
    unweighted = KeyedJaggedTensor.from_offsets_sync(keys=W_KEYS, values=W_IDS, offsets=W_OFFSETS)
    assert torch.equal(pooled.values(), ours(unweighted).values())


def test_fx():
    """EmbeddingBagCollectionTest.test_fx: ``torchrec.fx.symbolic_trace`` of the weighted
    collection itself, then the graph run on test_weighted's batch: [2, 10], keys [f1, f3, f2],
    offset_per_key [0, 3, 6, 10] (its ``torch.jit.script(gm)`` is left out: TorchScript is
    refused by design)."""
    ours, theirs = _pair(_weighted_configs(), is_weighted=True)
    gm = symbolic_trace(ours)
    pooled = gm(_weighted_batch())
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"] and pooled.offset_per_key() == [0, 3, 6, 10]
    _assert_same_keyed(pooled, theirs(_weighted_batch()))


def test_fx_with_the_collection_inside_a_model():
    """EmbeddingBagCollectionTest.test_fx one level down (the form docs/torchrec.md promises):
    a module holding the collection traces with it as one ``call_module`` node, and the graph
    gives test_fx's KeyedTensor, equal to the eager one and to TorchRec's."""

    class Model(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.ebc = ebc

        def forward(self, features):
            return self.ebc(features)

    ours, theirs = _pair(_weighted_configs(), is_weighted=True)
    gm = symbolic_trace(Model(ours))
    assert [node.target for node in gm.graph.nodes if node.op == "call_module"] == ["ebc"]
    pooled = gm(_weighted_batch())
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"] and pooled.offset_per_key() == [0, 3, 6, 10]
    _assert_same_keyed(pooled, theirs(_weighted_batch()))
    assert torch.equal(pooled.values(), ours(_weighted_batch()).values())


def test_duplicate_config_name_fails():
    """EmbeddingBagCollectionTest.test_duplicate_config_name_fails: two configs named t1
    raise ValueError, as TorchRec's collection does."""
    configs = [_config("t1", 3, 10, ["f1"]), _config("t1", 4, 10, ["f2"])]
    with pytest.raises(ValueError):
        EmbeddingBagCollection(tables=configs)
    with pytest.raises(ValueError):
        sk.EmbeddingBagCollection(configs)


def test_device():
    """EmbeddingBagCollectionTest.test_device: the meta device from the argument and from a
    ``with torch.device("meta")`` block, and the CPU by default, reported by ``device`` and
    held by the table's weight (sparsekit's ``weights["t1"]`` for TorchRec's
    ``embedding_bags["t1"].weight``)."""
    configs = [_config("t1", 3, 10, ["f1"])]
    ebc = sk.EmbeddingBagCollection(configs, device=torch.device("meta"))
    assert ebc.device == torch.device("meta") and ebc.weights["t1"].device == torch.device("meta")
    with torch.device("meta"):
        ebc = sk.EmbeddingBagCollection(configs)
    assert ebc.device == torch.device("meta") and ebc.weights["t1"].device == torch.device("meta")
    ebc = sk.EmbeddingBagCollection(configs)
    assert ebc.device == torch.device("cpu") == EmbeddingBagCollection(tables=configs).device
    assert ebc.weights["t1"].device == torch.device("cpu")


# ---- torchrec/modules/tests/test_fused_embedding_modules.py: FusedEmbeddingBagCollectionTest ----


def test_fused_unweighted():
    """FusedEmbeddingBagCollectionTest.test_unweighted: three dim-4 tables with SGD(lr=0.02)
    fused, a batch from lengths with empty bags: keys [f1, f2, f3], each ``[key]`` [stride, 4],
    the empty bags (f1[1], f3[0], f3[2]) zeros; TorchRec's numbers on the same rows."""
    configs = [_config(f"t{i}", 4, 10, [f"f{i}"]) for i in (1, 2, 3)]
    ours, theirs = _pair(configs, fused_params=SGD)
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=F_IDS, lengths=F_LENGTHS)
    pooled = ours(features)
    assert pooled.keys() == ["f1", "f2", "f3"]
    assert all(pooled[key].shape == (features.stride(), 4) for key in ("f1", "f2", "f3"))
    for key, bag in (("f1", 1), ("f3", 0), ("f3", 2)):
        torch.testing.assert_close(pooled[key][bag], torch.zeros(4))
    _assert_same_keyed(pooled, theirs(features))


def test_fused_unweighted_batchsize_1_one_table():
    """FusedEmbeddingBagCollectionTest.test_unweighted_batchsize_1_one_table: one table read
    by f1 and f2, a batch of one: keys [f1, f2], each [1, 4]."""
    ours, theirs = _pair([_config("t1", 4, 10, ["f1", "f2"])], fused_params=SGD)
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 3]),
                                                   lengths=torch.tensor([2, 1]))
    pooled = ours(features)
    assert pooled.keys() == ["f1", "f2"] and features.stride() == 1
    assert pooled["f1"].shape == (1, 4) and pooled["f2"].shape == (1, 4)
    _assert_same_keyed(pooled, theirs(features))


def test_fused_shared_tables():
    """FusedEmbeddingBagCollectionTest.test_shared_tables: one table read by f1 and f2, batch
    3 from lengths: keys [f1, f2], each [3, 4], f1's empty bag zeros."""
    ours, theirs = _pair([_config("t1", 4, 10, ["f1", "f2"])], fused_params=SGD)
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=IDS,
                                                   lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    pooled = ours(features)
    assert pooled.keys() == ["f1", "f2"]
    assert pooled["f1"].shape == (3, 4) and pooled["f2"].shape == (3, 4)
    torch.testing.assert_close(pooled["f1"][1], torch.zeros(4))
    _assert_same_keyed(pooled, theirs(features))


def test_fused_state_dict():
    """FusedEmbeddingBagCollectionTest.test_state_dict: a collection's state loads back into
    it, its own ``state_dict()`` and its TorchRec-named one (``embedding_bags.<table>.weight``),
    which TorchRec's collection also loads (strict) with the same rows."""
    configs = [_config(f"t{i}", 4, 2, [f"f{i}"]) for i in (1, 2, 3)]
    ebc = sk.EmbeddingBagCollection(configs, fused_params=SGD)
    ebc.load_state_dict(ebc.state_dict())
    named = ebc.torchrec_state_dict()
    assert list(named) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight", "embedding_bags.t3.weight"]
    ebc.load_torchrec_state_dict(named)
    theirs = EmbeddingBagCollection(tables=configs)
    theirs.load_state_dict(named)
    for key, value in theirs.state_dict().items():
        assert torch.equal(value, named[key]) and torch.equal(ebc.torchrec_state_dict()[key], value)


def test_fused_state_dict_manual():
    """FusedEmbeddingBagCollectionTest.test_state_dict_manual: TorchRec's state of three
    two-row tables (rows of 1 / 2, 4 / 8, 16 / 32) loads (``load_torchrec_state_dict`` for
    TorchRec's ``load_state_dict``), saves back the same, and pools the test's exact sums."""
    configs = [_config(f"t{i}", 4, 2, [f"f{i}"]) for i in (1, 2, 3)]
    ebc = sk.EmbeddingBagCollection(configs, fused_params=SGD)
    state = _rows_state(["t1", "t2", "t3"])
    ebc.load_torchrec_state_dict(state)
    saved = ebc.torchrec_state_dict()
    for key, value in state.items():
        torch.testing.assert_close(saved[key], value)
    # f1 [0,1] [] [0] | f2 [0] [1] [0,1] | f3 [] [] [0]
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"],
                                                   values=torch.tensor([0, 1, 0, 0, 1, 0, 1, 0]),
                                                   lengths=torch.tensor([2, 0, 1, 1, 1, 2, 0, 0, 1]))
    pooled = ebc(features)

    def rows(*values):
        return torch.tensor([[v] * 4 for v in values], dtype=torch.float32)

    torch.testing.assert_close(pooled["f1"], rows(3, 0, 1))
    torch.testing.assert_close(pooled["f2"], rows(4, 8, 12))
    torch.testing.assert_close(pooled["f3"], rows(0, 0, 16))


def test_fused_weighted():
    """FusedEmbeddingBagCollectionTest.test_weighted: ``is_weighted=True`` over rows 1 / 2 and
    4 / 8 with weights 1, 2, 3 | 5, 7, 11, 13: f1 pools [5, 0, 3], f2 [20, 56, 4*11 + 8*13]."""
    configs = [_config("t1", 4, 2, ["f1"]), _config("t2", 4, 2, ["f2"])]
    ebc = sk.EmbeddingBagCollection(configs, fused_params=SGD, is_weighted=True)
    ebc.load_torchrec_state_dict(_rows_state(["t1", "t2"]))
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 0, 0, 1, 0, 1]),
                                                   weights=torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 11.0, 13.0]),
                                                   lengths=torch.tensor([2, 0, 1, 1, 1, 2]))
    pooled = ebc(features)
    torch.testing.assert_close(pooled["f1"], torch.tensor([[5.0] * 4, [0.0] * 4, [3.0] * 4]))
    torch.testing.assert_close(pooled["f2"], torch.tensor([[20.0] * 4, [56.0] * 4, [4.0 * 11 + 8 * 13] * 4]))


@pytest.mark.parametrize("optimizer, reference", [
    ("sgd", torch.optim.SGD),
    ("adagrad", torch.optim.Adagrad),
    ("rowwise_adagrad", torchrec.optim.RowWiseAdagrad),
    pytest.param(EmbOptimType.EXACT_SGD, torch.optim.SGD, id="EmbOptimType.EXACT_SGD"),
    pytest.param(EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad, id="EmbOptimType.EXACT_ADAGRAD"),
    pytest.param(EmbOptimType.EXACT_ROWWISE_ADAGRAD, torchrec.optim.RowWiseAdagrad,
                 id="EmbOptimType.EXACT_ROWWISE_ADAGRAD"),
])
def test_optimizer_fusion(optimizer, reference):
    """FusedEmbeddingBagCollectionTest.test_optimizer_fusion: a fused collection (here
    ``fused_params`` with ``learning_rate=0.1``) and TorchRec's unfused collection with the
    same optimizer over its parameters, both from test_optimizer_fusion's rows, agree on the
    tables after one and after two steps of ``values().sum()``; the fused optimizer's state
    dict loads back."""
    configs = [_config("table_0", 4, 2, ["feature_0"]), _config("table_1", 4, 2, ["feature_1"])]
    ours = sk.EmbeddingBagCollection(configs, fused_params={"optimizer": optimizer, "learning_rate": 0.1})
    theirs = EmbeddingBagCollection(tables=configs)
    state = _rows_state(["table_0", "table_1"])
    ours.load_torchrec_state_dict(state)
    theirs.load_state_dict(state)
    # feature_0 [] [0] [0,1] | feature_1 [1] [0,1] []
    features = KeyedJaggedTensor.from_lengths_sync(keys=["feature_0", "feature_1"],
                                                   values=torch.tensor([0, 0, 1, 1, 0, 1]),
                                                   lengths=torch.tensor([0, 1, 2, 1, 2, 0]))
    opt = reference(theirs.parameters(), lr=0.1)
    for _ in range(2):
        torch.cat(list(ours(features).to_dict().values()), dim=1).sum().backward()
        opt.zero_grad()
        torch.cat(list(theirs(features).to_dict().values()), dim=1).sum().backward()
        opt.step()
        for key, value in theirs.state_dict().items():
            torch.testing.assert_close(ours.torchrec_state_dict()[key], value)
    ours.fused_optimizer.load_state_dict(ours.fused_optimizer.state_dict())


@pytest.mark.parametrize("pooling, weighted", [(PoolingType.SUM, False), (PoolingType.MEAN, False),
                                               (PoolingType.SUM, True)])
def test_unfused_gradients_and_step(pooling, weighted):
    """test_optimizer_fusion's unfused side: without ``fused_params`` the collection's tables
    get (sparse) gradients equal to TorchRec's dense ones, and ``torch.optim.SGD`` over either
    collection's parameters moves the same rows the same way (test_weighted's tables and batch)."""
    ours, theirs = _pair(_weighted_configs(pooling), is_weighted=weighted)
    project = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    (ours(_weighted_batch()).values() * project).sum().backward()
    (theirs(_weighted_batch()).values() * project).sum().backward()
    for name in ("t1", "t2"):
        torch.testing.assert_close(ours.weights[name].grad.to_dense(), theirs.embedding_bags[name].weight.grad)
    torch.optim.SGD(ours.parameters(), lr=0.1).step()
    torch.optim.SGD(theirs.parameters(), lr=0.1).step()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.torchrec_state_dict()[key], value)


# ---- torchrec/sparse/tests/test_keyed_tensor.py: TestKeyedTensor ----


def test_keyed_tensor_key_lookup_and_to_dict_dim_1():
    """TestKeyedTensor.test_key_lookup_dim_1 and test_to_dict_dim_1: widths 1 and 2 side by
    side (key_dim 1): ``kt[key]`` and ``to_dict()`` give each tensor back, and the layout is
    TorchRec's ``KeyedTensor.from_tensor_list``'s; the collection's output keeps the same
    promise."""
    tensors = [torch.tensor([[1.0, 1.0]]).T, torch.tensor([[2.0, 2.0], [3.0, 3.0]]).T]
    keys = ["dense_0", "dense_1"]
    kt = sk.KeyedTensor(keys, [1, 2], torch.cat(tensors, dim=1))
    theirs = KeyedTensor.from_tensor_list(keys, tensors, key_dim=1)
    assert kt.key_dim() == theirs.key_dim() == 1
    assert kt.keys() == theirs.keys() and kt.length_per_key() == theirs.length_per_key()
    assert kt.offset_per_key() == theirs.offset_per_key() and torch.equal(kt.values(), theirs.values())
    as_dict = kt.to_dict()
    for key, tensor in zip(keys, tensors):
        assert torch.equal(kt[key], tensor) and torch.equal(as_dict[key], tensor)
    pooled = sk.EmbeddingBagCollection(_weighted_configs())(_weighted_batch())
    for key, value in pooled.to_dict().items():
        assert torch.equal(pooled[key], value)


def test_keyed_tensor_regroup_single_kt():
    """TestKeyedTensor.test_regroup_single_kt: TorchRec's ``KeyedTensor.regroup`` of the
    collection's output into [f2, f1] and [f3] gives the column blocks laid side by side,
    equal to regrouping TorchRec's own output."""
    ours, theirs = _pair(_weighted_configs())
    groups = [["f2", "f1"], ["f3"]]
    pooled = ours(_weighted_batch())
    grouped = KeyedTensor.regroup([pooled], groups)
    expected = KeyedTensor.regroup([theirs(_weighted_batch())], groups)
    assert len(grouped) == 2
    torch.testing.assert_close(grouped[0], torch.cat([pooled["f2"], pooled["f1"]], dim=1))
    torch.testing.assert_close(grouped[1], pooled["f3"])
    for got, want in zip(grouped, expected):
        torch.testing.assert_close(got, want)


def test_keyed_tensor_regroup_multiple_kt():
    """TestKeyedTensor.test_regroup_multiple_kt: the collection's output regrouped together
    with a TorchRec ``KeyedTensor`` of dense features, groups mixing both."""
    ours = sk.EmbeddingBagCollection(_weighted_configs())
    pooled = ours(_weighted_batch())
    dense = [torch.randn(2, 4), torch.randn(2, 8)]
    dense_kt = KeyedTensor.from_tensor_list(["dense_0", "dense_1"], dense, key_dim=1)
    grouped = KeyedTensor.regroup([dense_kt, pooled], [["dense_0", "f2", "f3"], ["dense_1", "f1"]])
    torch.testing.assert_close(grouped[0], torch.cat([dense[0], pooled["f2"], pooled["f3"]], dim=1))
    torch.testing.assert_close(grouped[1], torch.cat([dense[1], pooled["f1"]], dim=1))


def test_keyed_tensor_regroup_of_keys_used_more_or_less_than_once():
    """TestKeyedTensor's regroup cases whose groups leave a key out or use one twice (TorchRec's
    other path, which reads ``_key_indices()``), as a dict too, and through
    ``KTRegroupAsDict``: equal to regrouping TorchRec's own output."""
    from torchrec.modules.regroup import KTRegroupAsDict  # noqa: PLC0415

    ours, theirs = _pair(_weighted_configs())
    pooled, reference = ours(_weighted_batch()), theirs(_weighted_batch())
    for groups in ([["f2"]], [["f1", "f2"], ["f2", "f3"]]):
        for got, want in zip(KeyedTensor.regroup([pooled], groups), KeyedTensor.regroup([reference], groups)):
            torch.testing.assert_close(got, want)
    got = KeyedTensor.regroup_as_dict([pooled], [["f3"], ["f1", "f2"]], ["x", "y"])
    want = KeyedTensor.regroup_as_dict([reference], [["f3"], ["f1", "f2"]], ["x", "y"])
    assert list(got) == ["x", "y"] and all(torch.equal(got[k], want[k]) for k in want)
    module = KTRegroupAsDict(groups=[["f1"], ["f2", "f3"]], keys=["a", "b"])
    got = module([pooled])
    torch.testing.assert_close(got["b"], torch.cat([pooled["f2"], pooled["f3"]], dim=1))


# ---- torchrec/sparse/tests/test_keyed_jagged_tensor.py: the inputs the collection takes ----


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_length_vs_offset(id_dtype):
    """TestKeyedJaggedTensor.test_length_vs_offset: the same weighted bags as
    ``from_offsets_sync`` and ``from_lengths_sync`` with int32 offsets / lengths (and int64 or
    int32 ids) pool to the same KeyedTensor, TorchRec's."""
    configs = [_config("t0", 3, 10, ["index_0"]), _config("t1", 4, 10, ["index_1"])]
    ours, theirs = _pair(configs, is_weighted=True)
    ids = torch.arange(1, 9, dtype=id_dtype)
    weights = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5])
    offsets = torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8], dtype=torch.int32)
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3], dtype=torch.int32)
    by_offsets = KeyedJaggedTensor.from_offsets_sync(keys=["index_0", "index_1"], values=ids, offsets=offsets,
                                                     weights=weights)
    by_lengths = KeyedJaggedTensor.from_lengths_sync(keys=["index_0", "index_1"], values=ids, lengths=lengths,
                                                     weights=weights)
    pooled = ours(by_offsets)
    assert pooled.values().shape == (4, 7)
    assert torch.equal(pooled.values(), ours(by_lengths).values())
    _assert_same_keyed(pooled, theirs(by_lengths))


@pytest.mark.parametrize("weighted", [False, True])
def test_permute(weighted):
    """TestKeyedJaggedTensor.test_permute / test_permute_w_weights: the batch and its
    ``permute`` (features in another order than the configs, int32 lengths) give the same
    KeyedTensor, in config order, TorchRec's."""
    configs = [_config("t0", 3, 10, ["index_0", "index_2"]), _config("t1", 4, 10, ["index_1"])]
    ours, theirs = _pair(configs, is_weighted=weighted)
    weights = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5]) if weighted else None
    features = KeyedJaggedTensor.from_lengths_sync(keys=["index_0", "index_1", "index_2"], values=torch.arange(1, 9),
                                                   lengths=torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0],
                                                                        dtype=torch.int32), weights=weights)
    permuted = features.permute([1, 2, 0])
    assert permuted.keys() == ["index_1", "index_2", "index_0"]
    pooled = ours(permuted)
    assert pooled.keys() == ["index_0", "index_2", "index_1"]
    assert torch.equal(pooled.values(), ours(features).values())
    _assert_same_keyed(pooled, theirs(permuted))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_missing_features_read_as_zeros(pooling):
    """test_weighted's collection given a batch without f3 (and one with f1 alone): the keyed
    output still holds every configured feature in config order, the absent ones zeros, equal
    to TorchRec's output for the batch with those features' bags empty (TorchRec's own
    collection raises KeyError on the absent feature; docs/torchrec.md: it reads as zeros)."""
    ours, theirs = _pair(_weighted_configs(pooling))
    lacking = KeyedJaggedTensor.from_lengths_sync(keys=["f2", "f1"], values=torch.tensor([3, 4, 5, 1, 2, 7]),
                                                  lengths=torch.tensor([2, 1, 2, 1]))
    padded = KeyedJaggedTensor.from_lengths_sync(keys=["f2", "f1", "f3"], values=torch.tensor([3, 4, 5, 1, 2, 7]),
                                                 lengths=torch.tensor([2, 1, 2, 1, 0, 0]))
    pooled = ours(lacking)
    assert not pooled["f3"].any()
    _assert_same_keyed(pooled, theirs(padded))
    alone = ours(KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=torch.tensor([1, 2]),
                                                     lengths=torch.tensor([1, 1])))
    assert alone.keys() == ["f1", "f3", "f2"] and alone.values().shape == (2, 10)
    assert not alone["f3"].any() and not alone["f2"].any()
    _assert_same_keyed(alone, theirs(KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2", "f3"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1, 0, 0, 0, 0]))))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_every_bag_empty(pooling):
    """The empty bags of FusedEmbeddingBagCollectionTest.test_unweighted across a whole batch
    (no ids at all, int32 offsets): zeros of [3, 10] in config order, as TorchRec's."""
    ours, theirs = _pair(_weighted_configs(pooling))
    features = KeyedJaggedTensor.from_offsets_sync(keys=["f2", "f1", "f3"], values=torch.zeros(0, dtype=torch.int64),
                                                   offsets=torch.zeros(10, dtype=torch.int32))
    pooled = ours(features)
    assert pooled.values().shape == (3, 10) and not pooled.values().any()
    _assert_same_keyed(pooled, theirs(features))

"""TorchRec interop: its EmbeddingBagConfig taken duck-typed, a KeyedTensor-compatible output
in config order, is_weighted's semantics, state dicts in TorchRec's names both ways, DDP's
ignore list; and, where torchrec installs, its own modules side by side (a DLRM with the
collection dropped in, outputs and state dicts against TorchRec's EmbeddingBagCollection)."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import pytest
import torch

import sparsekit as sk


class PoolingType(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"


@dataclass
class EmbeddingBagConfig:
    """TorchRec's config, as far as the collection reads it (no torchrec import)."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    pooling: PoolingType = PoolingType.SUM
    init_fn: Optional[Callable[[torch.Tensor], Any]] = None


def _configs():
    return [EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="t1", feature_names=["f1", "f3"]),
            EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name="t2", feature_names=["f2"],
                               pooling=PoolingType.MEAN, weight_init_min=-0.5, weight_init_max=0.5)]


def _kjt(keys, weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return sk.KeyedJagged(keys, values, lengths=lengths, weights=weights)


def _reference(ebc, kjt, weighted):
    """{feature: [B, D]} by plain torch from the collection's own rows (direct tables)."""
    out = {}
    batch = kjt.stride()
    offsets, values = kjt.offsets(), kjt.values()
    weights = kjt.weights_or_none()
    for f, feature in enumerate(kjt.keys()):
        config = next(c for c in ebc.embedding_bag_configs() if feature in c.feature_names)
        table = ebc.weights[config.name].detach()
        rows = []
        for b in range(batch):
            s, e = int(offsets[f * batch + b]), int(offsets[f * batch + b + 1])
            v = table[values[s:e]]
            if weighted and weights is not None:
                v = v * weights[s:e].unsqueeze(1)
            pooled = v.sum(0)
            if config.pooling == PoolingType.MEAN and e > s:
                pooled = pooled / (e - s)
            rows.append(pooled)
        out[feature] = torch.stack(rows)
    return out


def test_torchrec_configs_build_direct_tables_with_torchrec_init_and_a_keyed_output():
    ebc = sk.EmbeddingBagCollection(_configs())
    assert ebc.embedding_bag_configs() == _configs() and ebc.is_weighted() is False
    assert ebc.device == torch.device("cpu")
    assert ebc.weights["t1"].shape == (50, 4) and ebc.weights["t2"].shape == (30, 8)
    bound = math.sqrt(1 / 50)
    assert ebc.weights["t1"].abs().max() <= bound and ebc.weights["t1"].abs().max() > bound / 2
    assert ebc.weights["t2"].abs().max() <= 0.5 and ebc.weights["t2"].abs().max() > 0.25
    # The input's keys in another order than the configs': the output follows the configs.
    kjt = _kjt(["f2", "f1", "f3"], weighted=True)
    out = ebc(kjt)
    assert isinstance(out, sk.KeyedTensor)
    assert out.keys() == ["f1", "f3", "f2"] and out.length_per_key() == [4, 4, 8]
    assert out.offset_per_key() == [0, 4, 8, 16] and out.values().shape == (3, 16)
    expected = _reference(ebc, kjt, weighted=False)  # unweighted: the weights are ignored
    for key in out.keys():
        torch.testing.assert_close(out[key], expected[key])
        torch.testing.assert_close(out.to_dict()[key], expected[key])


def test_is_weighted_applies_the_weights_and_a_dict_output_can_be_asked_for():
    ebc = sk.EmbeddingBagCollection(_configs(), is_weighted=True, output="dict")
    kjt = _kjt(["f1", "f2", "f3"], weighted=True)
    out = ebc(kjt)
    assert isinstance(out, dict) and list(out) == ["f1", "f2", "f3"]
    for key, value in _reference(ebc, kjt, weighted=True).items():
        torch.testing.assert_close(out[key], value)


def test_a_keyed_output_trains_and_missing_features_read_as_zeros():
    ebc = sk.EmbeddingBagCollection(_configs(), fused_params={"optimizer": "rowwise_adagrad", "lr": 0.1})
    before = ebc.weights["t1"].detach().clone()
    out = ebc(_kjt(["f1"]))
    assert out.values().shape == (3, 16) and not out["f2"].any() and not out["f3"].any()
    out.values().square().sum().backward()
    assert not torch.equal(before, ebc.weights["t1"].detach())


@pytest.mark.parametrize("keys", [["f2", "f1"], ["f3"], ["f1", "f2", "f3"]])
def test_a_keyed_output_with_features_missing_gets_each_gradient_from_its_own_columns(keys):
    """The keyed block holds every configured feature's columns; a batch lacking some reads
    each present feature's gradient from its own columns, not from a packed split."""
    ebc = sk.EmbeddingBagCollection(_configs())
    kjt = _kjt(keys, seed=3)
    out = ebc(kjt)
    project = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(1))
    (out.values() * project).sum().backward()
    weights = {name: w.detach().clone().requires_grad_(True) for name, w in ebc.weights.items()}
    reference = _reference_with(weights, kjt)
    columns = {"f1": (0, 4), "f3": (4, 8), "f2": (8, 16)}
    loss = sum((reference[k] * project[:, columns[k][0]:columns[k][1]]).sum() for k in keys)
    loss.backward()
    for name, weight in ebc.weights.items():
        got = weight.grad.to_dense() if weight.grad is not None else torch.zeros_like(weight)
        torch.testing.assert_close(got, weights[name].grad if weights[name].grad is not None
                                   else torch.zeros_like(weight))


def _reference_with(weights, kjt):
    tables = {"f1": ("t1", "sum"), "f3": ("t1", "sum"), "f2": ("t2", "mean")}
    out = {}
    for key, jagged in kjt.to_dict().items():
        table, mode = tables[key]
        out[key] = torch.nn.functional.embedding_bag(jagged.values(), weights[table], jagged.offsets()[:-1],
                                                     mode=mode, include_last_offset=False)
    return out


def test_sk_table_configs_keep_the_dict_output_and_applied_weights():
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 30, ["f"], use_hashtable=False)])
    assert ebc.is_weighted() is True
    out = ebc(_kjt(["f"], weighted=True))
    assert isinstance(out, dict)
    torch.testing.assert_close(out["f"], _reference_sk(ebc, _kjt(["f"], weighted=True)))


def _reference_sk(ebc, kjt):
    table, offsets, values, weights = ebc.weights["t"].detach(), kjt.offsets(), kjt.values(), kjt.weights()
    return torch.stack([(table[values[s:e]] * weights[s:e].unsqueeze(1)).sum(0)
                        for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())])


@pytest.mark.parametrize("case, match", [
    (dict(pooling=PoolingType.NONE), "pooling NONE is not supported"),
    (dict(data_type=DataType.INT8), "data_type INT8 is not supported"),
])
def test_unsupported_torchrec_settings_are_refused(case, match):
    config = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"], **case)
    with pytest.raises(ValueError, match=match):
        sk.EmbeddingBagCollection([config])


def test_a_keyed_output_needs_one_dtype():
    configs = _configs()
    configs[1].data_type = DataType.BF16
    with pytest.raises(ValueError, match="output='keyed'.*needs one dtype"):
        sk.EmbeddingBagCollection(configs)
    assert isinstance(sk.EmbeddingBagCollection(configs, output="dict")(_kjt(["f1", "f2"])), dict)


def test_torchrec_state_dicts_load_and_save_both_ways():
    """A TorchRec EBC's state (embedding_bags.<table>.weight) loads into direct tables row for
    row and into hash tables as keys 0..rows-1; saving gives it back."""
    source = sk.EmbeddingBagCollection(_configs())
    state = {f"embedding_bags.{name}.weight": torch.randn(w.shape) for name, w in source.weights.items()}
    source.load_torchrec_state_dict(state)
    assert all(torch.equal(source.torchrec_state_dict()[k], v) for k, v in state.items())
    hashed = sk.EmbeddingBagCollection([sk.TableConfig("t1", 4, 64, ["f1", "f3"]),
                                        sk.TableConfig("t2", 8, 30, ["f2"], combiner="mean")], output="keyed")
    hashed.load_torchrec_state_dict(state)
    saved = hashed.torchrec_state_dict()
    assert torch.equal(saved["embedding_bags.t1.weight"][:50], state["embedding_bags.t1.weight"])
    assert torch.equal(saved["embedding_bags.t2.weight"], state["embedding_bags.t2.weight"])
    hashed.eval()
    source.eval()
    kjt = _kjt(["f1", "f2", "f3"])
    torch.testing.assert_close(hashed(kjt).values(), source(kjt).values())
    with pytest.raises(ValueError, match="missing"):
        hashed.load_torchrec_state_dict({"embedding_bags.t1.weight": state["embedding_bags.t1.weight"]})


def _world_two_load_worker(rank, world_size, init, state):
    reference = sk.EmbeddingBagCollection(_configs())
    reference.load_torchrec_state_dict(state)
    kjt = _kjt(["f1", "f2", "f3"])
    expected = reference.eval()(kjt).values()
    init()
    ebc = sk.EmbeddingBagCollection(_configs()).eval()
    assert [tuple(w.shape) for w in ebc.weights.values()] == [(25, 4), (15, 8)]  # TorchRec's rows over 2 ranks
    ebc.load_torchrec_state_dict(state)
    torch.testing.assert_close(ebc(kjt).values(), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out of range"):  # id 50 of a 50-row table, on every rank
        ebc(sk.KeyedJagged(["f1"], torch.tensor([50]), lengths=torch.tensor([1])))
    hashed = sk.EmbeddingBagCollection([sk.TableConfig("t1", 4, 64, ["f1", "f3"]), sk.TableConfig("t2", 8, 30, ["f2"])])
    with pytest.raises(ValueError, match="hash table sharded over 2 ranks"):
        hashed.load_torchrec_state_dict(state)
    odd = sk.EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f1"])])
    assert odd.weights["t"].shape[0] == 3  # ids 5 (rank 1's row 2) lies past the table
    odd(sk.KeyedJagged(["f1"], torch.tensor([4]), lengths=torch.tensor([1])))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        odd(sk.KeyedJagged(["f1"], torch.tensor([5]), lengths=torch.tensor([1])))
    keys, vectors = odd.export("t")  # rank 1's third row holds no id
    assert keys.tolist() == ([0, 2, 4] if rank == 0 else [1, 3]) and vectors.shape == (len(keys), 4)


def test_under_a_process_group_torchrec_configs_keep_their_rows_and_load_their_state(tmp_path):
    """At world 2 a TorchRec config's num_embeddings rows are spread over the ranks (not
    num_embeddings per rank), an id past them is refused, and each rank loads the rows of
    the ids it owns: the pooled numbers are the one-process ones."""
    from _distributed import spawn  # noqa: PLC0415 - tests/support, on the path in the test run

    state = {"embedding_bags.t1.weight": torch.randn(50, 4), "embedding_bags.t2.weight": torch.randn(30, 8)}
    spawn(_world_two_load_worker, 2, str(tmp_path), state)


def test_a_torchrec_init_fn_fills_the_table_as_torchrecs_does():
    """EmbeddingBagConfig.init_fn fills TorchRec's weight in place: it fills sparsekit's
    rows too (also after reset_parameters)."""
    configs = _configs()
    configs[0].init_fn = functools.partial(torch.nn.init.constant_, val=0.5)
    configs[1].init_fn = functools.partial(torch.nn.init.normal_, std=3.0)
    ebc = sk.EmbeddingBagCollection(configs)
    assert torch.equal(ebc.weights["t1"], torch.full((50, 4), 0.5))
    assert 2.0 < float(ebc.weights["t2"].std()) < 4.0
    with torch.no_grad():
        ebc.weights["t1"].zero_()
    ebc.reset_parameters()
    assert torch.equal(ebc.weights["t1"], torch.full((50, 4), 0.5))


def test_torchrecs_own_default_init_fn_draws_per_id_as_no_init_fn():
    """TorchRec's config sets init_fn = partial(uniform_, a=min, b=max) when given none: that
    one draws the same per-id rows as no init_fn (a function of the id, not of torch's RNG)."""
    configs, defaulted = _configs(), _configs()
    for config in defaulted:
        bound = math.sqrt(1.0 / config.num_embeddings)
        low = config.weight_init_min if config.weight_init_min is not None else -bound
        high = config.weight_init_max if config.weight_init_max is not None else bound
        config.init_fn = functools.partial(torch.nn.init.uniform_, a=low, b=high)
    plain, default = sk.EmbeddingBagCollection(configs), sk.EmbeddingBagCollection(defaulted)
    assert all(torch.equal(plain.weights[n], default.weights[n]) for n in ("t1", "t2"))


def test_keyed_tensor_checks_its_layout_and_gives_torchrecs_key_indices():
    kt = sk.KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).view(2, 5))
    assert kt._key_indices() == {"a": 0, "b": 1} and kt.device() == torch.device("cpu")
    for lengths, match in (([-1, 6], "ints >= 0"), ([2.5, 2.5], "ints >= 0"), (torch.tensor([2.5, 2.5]), "ints >= 0"),
                           ([2, 2], "do not lay out")):
        with pytest.raises(ValueError, match=match):
            sk.KeyedTensor(["a", "b"], lengths, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="distinct"):
        sk.KeyedTensor(["a", "a"], [2, 3], torch.zeros(2, 5))


def test_keep_out_of_ddp_names_the_embedding_shards():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.add_module("ebc", sk.EmbeddingBagCollection(_configs()))
    assert sorted(sk.keep_out_of_ddp(model)) == ["ebc.shards.0.weight", "ebc.shards.1.weight"]
    assert sorted(model._ddp_params_and_buffers_to_ignore) == ["ebc.shards.0.weight", "ebc.shards.1.weight"]


@pytest.mark.peer
def test_torchrec_dlrm_trains_with_the_collection_dropped_in():
    """torchrec.models.dlrm.DLRM with sk.EmbeddingBagCollection built from TorchRec's own
    configs, no glue: it trains (the loss falls), and sparsekit and TorchRec's collection
    pool the same numbers from the same rows."""
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    configs = [TorchRecConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
               for i in range(3)]
    ours = sk.EmbeddingBagCollection(configs)
    theirs = EmbeddingBagCollection(configs)
    ours.load_torchrec_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (3 * 16,), generator=g)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(3)], values=torch.randint(0, 100, (int(lengths.sum()),),
                                                                                     generator=g), lengths=lengths)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())
    model = DLRM(embedding_bag_collection=ours, dense_in_features=4, dense_arch_layer_sizes=[8],
                 over_arch_layer_sizes=[8, 1])
    dense = torch.randn(16, 4, generator=g)
    target = torch.rand(16, generator=g).round()
    optimizer = sk.LazyAdam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7


def test_torchrec_fx_traces_a_dlrm_with_the_collection_dropped_in():
    """torchrec.fx.symbolic_trace (TorchRec's inference and train pipelines trace the model)
    keeps the collection as one module call: the traced DLRM gives the eager numbers."""
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    import torchrec.fx
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    configs = [TorchRecConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
               for i in range(3)]
    model = DLRM(embedding_bag_collection=sk.EmbeddingBagCollection(configs), dense_in_features=4,
                 dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1]).eval()
    traced = torchrec.fx.symbolic_trace(model)
    assert any(node.op == "call_module" and node.target.endswith("embedding_bag_collection")
               for node in traced.graph.nodes)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (3 * 8,), generator=g)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(3)], values=torch.randint(0, 100, (int(lengths.sum()),),
                                                                                     generator=g), lengths=lengths)
    dense = torch.randn(8, 4, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(traced(dense, kjt), model(dense, kjt), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "lazy_adam", "adagrad", "sgd"])
def test_the_fused_optimizer_is_keyed_by_parameter_name_as_torchrecs(optimizer):
    """KeyedOptimizer's interface, duck-typed: ``params`` by the collection's parameter
    names, ``init_state()`` makes every table's state (a step does too), and
    ``save_param_groups``."""
    ebc = sk.EmbeddingBagCollection(_configs(), fused_params={"optimizer": optimizer, "lr": 0.1})
    fused = ebc.fused_optimizer
    assert fused.params == dict(ebc.named_parameters())
    assert fused.defaults["_save_param_groups"] is False and "_save_param_groups" not in fused.param_groups[0]
    fused.init_state()
    assert set(fused.state) == set(fused.params.values())
    fresh = sk.EmbeddingBagCollection(_configs(), fused_params={"optimizer": optimizer, "lr": 0.1}).fused_optimizer
    fresh.step()
    assert {k: sorted(v) for k, v in fresh.state_dict()["state"].items()} == \
        {k: sorted(v) for k, v in fused.state_dict()["state"].items()}
    fused.save_param_groups(True)
    assert fused.defaults["_save_param_groups"] is True
    frozen = sk.EmbeddingBagCollection(_configs(), fused_params={"optimizer": optimizer, "lr": 0.1})
    frozen.shards[1].weight.requires_grad_(False)
    frozen.fused_optimizer.step()
    assert set(frozen.fused_optimizer.state) == {frozen.shards[0].weight}  # a frozen table gets no state


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "lazy_adam"])
def test_torchrecs_combined_optimizer_takes_the_fused_optimizer(optimizer):
    """CombinedOptimizer([("ebc", ebc.fused_optimizer), dense]) as TorchRec users combine
    their fused and dense optimizers: keyed state dict by parameter name, init_state, and a
    load that puts the saved state back in place."""
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    ebc = sk.EmbeddingBagCollection(_configs(), fused_params={"optimizer": optimizer, "lr": 0.1})
    dense = torch.nn.Linear(16, 1)
    combined = CombinedOptimizer([("ebc", ebc.fused_optimizer),
                                  KeyedOptimizerWrapper(dict(dense.named_parameters()),
                                                        lambda params: torch.optim.Adam(params, lr=0.1))])
    combined.init_state()
    keys = set(combined.state_dict()["state"])
    assert {f"ebc.{name}" for name, _ in ebc.named_parameters()} | {"weight", "bias"} == keys

    def step(seed):
        kjt = _kjt(["f1", "f2", "f3"], seed=seed)
        dense(ebc(kjt).values()).square().sum().backward()
        combined.step()
        combined.zero_grad()

    step(0)
    saved = {k: {n: v.clone() for n, v in s.items()} for k, s in combined.state_dict()["state"].items()}
    step(1)
    combined.load_state_dict({"state": saved})
    for key, state in saved.items():
        for name, value in state.items():
            torch.testing.assert_close(combined.state_dict()["state"][key][name], value, rtol=0, atol=0)
    for name, weight in ebc.named_parameters():  # in the tensors the next update reads
        for key, value in saved[f"ebc.{name}"].items():
            torch.testing.assert_close(ebc.fused_optimizer.state[weight][key], value, rtol=0, atol=0)

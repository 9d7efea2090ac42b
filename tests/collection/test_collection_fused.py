"""The collection's one-process engine: the fused optimizer against the unfused path on drawn
configurations (tables, rows, scores and optimizer state after several steps, LazyAdam bit
for bit in float32), the ops a step dispatches (the same at 2 and 26 tables), an eval
forward that prepares no backward, and the fused optimizer's interface (state_dict round
trip, schedulers, tensor lr, refusals)."""

from __future__ import annotations

import collections
import copy
import enum

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples
from torch.utils._python_dispatch import TorchDispatchMode

import sparsekit as sk


@st.composite
def configurations(draw):
    num_tables = draw(st.integers(1, 5))
    tables, features = [], []
    for t in range(num_tables):
        names = [f"f{t}_{i}" for i in range(draw(st.integers(1, 2)))]
        features += names
        kind = draw(st.sampled_from(["hash", "hash", "direct", "lru", "admit"]))
        tables.append(dict(name=f"t{t}", dim=draw(st.sampled_from([1, 4, 16, 33])), features=names,
                           combiner=draw(st.sampled_from(["sum", "mean"])), kind=kind,
                           capacity=draw(st.sampled_from([16, 64]))))
    return dict(tables=tables, features=features, batch=draw(st.sampled_from([1, 5, 24])),
                max_len=draw(st.sampled_from([1, 3, 12])), weighted=draw(st.booleans()),
                steps=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**31)),
                optimizer=draw(st.sampled_from(["lazy_adam", "sgd"])))


def _decay(config):
    # torch's SGD decays every row of a dense gradient; the fused update, lazily, the rows read.
    return 0.01 if config["optimizer"] == "lazy_adam" else 0.0


def _collection(config, fused, device):
    tables = [sk.TableConfig(t["name"], t["dim"], t["capacity"], t["features"], combiner=t["combiner"],
                             use_hashtable=t["kind"] != "direct", eviction="lru" if t["kind"] == "lru" else None,
                             admit_after=2 if t["kind"] == "admit" else 1) for t in config["tables"]]
    fused_params = {"optimizer": config["optimizer"], "lr": 0.05, "weight_decay": _decay(config)} if fused else None
    return sk.EmbeddingBagCollection(tables, device=device, fused_params=fused_params)


def _batches(config, device):
    g = torch.Generator().manual_seed(config["seed"])
    capacity = {f: t["capacity"] for t in config["tables"] for f in t["features"]}
    # At most a table's capacity of distinct keys per step; across steps more only where it
    # evicts (each step's keys a half capacity further on): another table would be full.
    evicts = {f: t["kind"] == "lru" for t in config["tables"] for f in t["features"]}
    out = []
    for step in range(config["steps"]):
        keys = [f for f in config["features"] if torch.rand((), generator=g) < 0.8] or config["features"][:1]
        lengths = torch.randint(0, config["max_len"] + 1, (len(keys) * config["batch"],), generator=g)
        values = []
        for f, key in enumerate(keys):
            n = int(lengths[f * config["batch"]:(f + 1) * config["batch"]].sum())
            first = step * (capacity[key] // 2) if evicts[key] else 0
            values.append(first + torch.randint(0, capacity[key], (n,), generator=g))
        values = torch.cat(values)
        weights = torch.rand(values.numel(), generator=g) if config["weighted"] else None
        out.append(sk.KeyedJagged(keys, values.to(device), lengths=lengths.to(device),
                                  weights=None if weights is None else weights.to(device)))
    return out


def _loss(out):
    return sum((value * torch.linspace(-1, 1, value.shape[1], device=value.device)).sum() for value in out.values())


@examples(10)
@given(config=configurations())
def test_fused_and_unfused_steps_leave_the_same_tables(config, device):
    """Several training steps with the optimizer in the backward and with sparse gradients
    plus the same optimizer after: the same rows, keys, scores and state; LazyAdam bit for
    bit (float32), SGD to rounding (torch's SGD adds the decay on the dense gradient)."""
    fused, plain = _collection(config, True, device), _collection(config, False, device)
    if config["optimizer"] == "lazy_adam":
        optimizer = sk.LazyAdam(plain.parameters(), lr=0.05, weight_decay=_decay(config))
    else:
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    for kjt in _batches(config, device):
        for model in (fused, plain):
            out = model(kjt)
            _loss(out).backward()
        optimizer.step()
        optimizer.zero_grad()
    exact = config["optimizer"] == "lazy_adam"
    for table in config["tables"]:
        name = table["name"]
        a, b = fused.export(name), plain.export(name)
        assert torch.equal(a[0], b[0]), name
        if exact:
            assert torch.equal(a[1], b[1]), name
        else:
            torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
        assert fused.stats(name) == plain.stats(name)
        if table["kind"] != "direct":
            ta, tb = fused._shard(name).hash_table, plain._shard(name).hash_table
            assert torch.equal(ta.scores(a[0])[0], tb.scores(b[0])[0]) and torch.equal(ta.scores(a[0])[1],
                                                                                      tb.scores(b[0])[1])
        assert fused.weights[name].grad is None
    if exact:
        for pa, pb in zip(fused.parameters(), plain.parameters()):
            state_a, state_b = fused.fused_optimizer.state.get(pa), optimizer.state.get(pb)
            assert bool(state_a) == bool(state_b)
            if state_a:
                assert int(state_a["step"]) == int(state_b["step"])
                assert torch.equal(state_a["exp_avg"], state_b["exp_avg"])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _steady_step_ops(num_tables, hashed, fused, output="dict"):
    names = [f"f{i}" for i in range(num_tables)]
    ebc = sk.EmbeddingBagCollection(
        [sk.TableConfig(f"t{i}", 16, 1000, [names[i]], use_hashtable=hashed) for i in range(num_tables)],
        fused_params={"optimizer": "rowwise_adagrad", "lr": 0.01} if fused else None, output=output)
    g = torch.Generator().manual_seed(0)
    batch = 32

    def kjt():
        lengths = torch.randint(1, 4, (num_tables * batch,), generator=g)
        return sk.KeyedJagged(names, torch.randint(0, 8, (int(lengths.sum()),), generator=g), lengths=lengths)

    def joined(out):
        return out.values() if output == "keyed" else torch.cat(list(out.values()), dim=1)

    for _ in range(6):  # every key of 0..7 has its row after these
        joined(ebc(kjt())).sum().backward()
    batch_input = kjt()
    counts = {}
    with _Ops() as mode:
        out = ebc(batch_input)
    counts["forward"] = mode.ops
    loss = joined(out).square().sum()
    with _Ops() as mode:
        loss.backward()
    counts["backward"] = mode.ops
    ebc.eval()
    with torch.no_grad(), _Ops() as mode:
        ebc(batch_input)
    counts["eval"] = mode.ops
    return counts


@pytest.mark.parametrize("hashed", [True, False])
def test_a_steady_step_dispatches_the_same_ops_at_2_and_26_tables(hashed):
    """A steady-state step (every key already has its row) of 2 and of 26 tables dispatches
    the same ops: forward and eval a bounded handful, the fused backward one update (plus the
    cat of the loss's input); nothing runs once per table."""
    two, many = _steady_step_ops(2, hashed, True), _steady_step_ops(26, hashed, True)
    for stage in ("forward", "eval"):
        assert sum(two[stage].values()) == sum(many[stage].values()), (stage, two[stage], many[stage])
        assert sum(many[stage].values()) <= 20, many[stage]
    assert many["backward"]["sparsekit.pooled_read_update_"] == 1
    # Beside the update: the loss's own ops (its square and sum, the cat's split into the
    # features' slices, which the engine takes where they lie).
    backward = [sum(n for op, n in counts["backward"].items() if op != "aten.slice") for counts in (two, many)]
    assert backward[0] == backward[1] <= 8, many["backward"]


@pytest.mark.parametrize("hashed", [True, False])
def test_a_keyed_step_dispatches_the_same_ops_at_2_and_26_tables(hashed):
    """With a keyed output the fused backward passes the output's gradient whole, with each
    feature's columns: every op counted, slices included, the same at 2 and 26 tables."""
    two, many = _steady_step_ops(2, hashed, True, "keyed"), _steady_step_ops(26, hashed, True, "keyed")
    for stage in ("forward", "backward", "eval"):
        assert two[stage] == many[stage], (stage, two[stage], many[stage])
        assert sum(many[stage].values()) <= 20, many[stage]
    # The update and the loss's own ops (square, sum); no slice.
    assert many["backward"]["sparsekit.pooled_read_update_"] == 1
    assert sum(many["backward"].values()) <= 8 and "aten.slice" not in many["backward"], many["backward"]


def test_an_eval_forward_prepares_no_backward():
    """eval() under no_grad: rows found, one pooled read; no sort, dedup or grouping of rows
    (the preparation of a backward), nothing written to the tables."""
    counts = _steady_step_ops(26, True, False)["eval"]
    assert counts["sparsekit.pooled_read"] == 1 and counts["sparsekit.lookup_rows"] == 1
    prepared = [op for op in counts if any(word in op for word in ("sort", "unique", "touch", "place", "segment"))]
    assert not prepared, counts


def _simple(fused_params, device="cpu"):
    return sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 50, ["f"]), sk.TableConfig("b", 8, 50, ["g"])],
                                     device=device, fused_params=fused_params)


def _kjt(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 6,), generator=g)
    return sk.KeyedJagged(["f", "g"], torch.randint(0, 40, (int(lengths.sum()),), generator=g).to(device),
                          lengths=lengths.to(device))


@pytest.mark.parametrize("optimizer", ["lazy_adam", "sgd", "rowwise_adagrad", "adam", "exact_rowwise_adagrad",
                                       "adagrad", "exact_adagrad"])
def test_fused_optimizer_state_dict_round_trips(optimizer):
    """Train, save the collection and its fused optimizer, load both into a new pair, and the
    next steps agree bit for bit with the original's."""
    params = {"optimizer": optimizer, "learning_rate": 0.03}
    first = _simple(params)
    for seed in range(3):
        _loss(first(_kjt(seed))).backward()
    second = _simple(params)
    second.load_state_dict(first.state_dict())
    second.fused_optimizer.load_state_dict(first.fused_optimizer.state_dict())
    for seed in range(3, 6):
        for model in (first, second):
            _loss(model(_kjt(seed))).backward()
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


def test_a_scheduler_and_a_tensor_lr_drive_the_fused_update():
    """LR schedulers set the fused optimizer's lr between backwards; a tensor lr changed in
    place acts the same, with the same numbers."""
    float_lr = _simple({"optimizer": "sgd", "lr": 0.1})
    tensor_lr = _simple({"optimizer": "sgd", "lr": torch.tensor(0.1)})
    scheduler = torch.optim.lr_scheduler.StepLR(float_lr.fused_optimizer, step_size=1, gamma=0.5)
    for seed in range(4):
        for model in (float_lr, tensor_lr):
            _loss(model(_kjt(seed))).backward()
        float_lr.fused_optimizer.step()
        scheduler.step()
        tensor_lr.fused_optimizer.param_groups[0]["lr"].mul_(0.5)
    assert all(torch.equal(a, b) for a, b in zip(float_lr.parameters(), tensor_lr.parameters()))
    assert float_lr.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)


@pytest.mark.parametrize("params, error, match", [
    ({"lr": 0.1}, ValueError, "must name its optimizer"),
    ({"optimizer": "adadelta"}, ValueError, "optimizer must be one of"),
    ({"optimizer": "sgd", "momentum": 0.9}, ValueError, r"unknown settings \['momentum'\]"),
    ({"optimizer": "sgd", "lr": -1.0}, ValueError, "lr must be a finite real number >= 0"),
    ({"optimizer": "lazy_adam", "betas": (0.9, 1.0)}, ValueError, r"beta2 must be a finite real number in \[0, 1\)"),
    ({"optimizer": "sgd", "lr": torch.tensor([0.1, 0.2])}, ValueError, "a tensor lr must be"),
    ({"optimizer": "sgd", "lr": torch.tensor(0.1, device="meta")}, ValueError, "not on the meta device"),
    ({"optimizer": "sgd", "lr": torch.tensor(float("nan"))}, ValueError, "lr must be a finite real number"),
    ({"optimizer": "sgd", "lr": 10 ** 400}, ValueError, "lr must be a finite real number >= 0"),
    ({"optimizer": "sgd", "lr": 0.1, "learning_rate": 0.5}, ValueError, "gives lr and learning_rate"),
    ("sgd", TypeError, "fused_params must be a dict"),
])
def test_bad_fused_params_are_refused_naming_the_setting(params, error, match):
    with pytest.raises(error, match=match):
        _simple(params)


def test_the_fused_optimizer_leaves_no_gradient_and_steps_nothing():
    model = _simple({"optimizer": "lazy_adam", "lr": 0.01})
    before = [p.detach().clone() for p in model.parameters()]
    out = model(_kjt(0))
    after_forward = [p.detach().clone() for p in model.parameters()]
    _loss(out).backward()
    assert all(p.grad is None for p in model.parameters())
    changed = [not torch.equal(a, b) for a, b in zip(after_forward, model.parameters())]
    assert all(changed)
    snapshot = [p.detach().clone() for p in model.parameters()]
    assert model.fused_optimizer.step() is None
    assert all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))
    del before


def test_a_penalty_gradient_and_weight_gradient_flow_through_the_read():
    """create_graph=True (a gradient penalty) and per-value weights that require a gradient:
    the unfused read's backward is torch's differentiable ops there, against plain torch."""
    model = sk.EmbeddingBagCollection([sk.TableConfig("a", 3, 20, ["f"], combiner="mean", use_hashtable=False)])
    values = torch.tensor([1, 2, 2, 5, 7])
    lengths = torch.tensor([2, 0, 3])
    scale = torch.rand(5, requires_grad=True)
    out = model(sk.KeyedJagged(["f"], values, lengths=lengths, weights=scale))["f"]
    weight = model.weights["a"]
    (grad,) = torch.autograd.grad((out ** 2).sum(), weight, create_graph=True)
    (grad.to_dense() ** 2).sum().backward()
    reference_weight = weight.detach().clone().requires_grad_()
    reference_scale = scale.detach().clone().requires_grad_()
    vectors = reference_weight[values] * reference_scale.unsqueeze(1)
    bag = torch.tensor([0, 0, 2, 2, 2])
    pooled = torch.zeros(3, 3).index_add(0, bag, vectors) / lengths.clamp(min=1).unsqueeze(1)
    (ref_grad,) = torch.autograd.grad((pooled ** 2).sum(), reference_weight, create_graph=True)
    (ref_grad ** 2).sum().backward()
    torch.testing.assert_close(scale.grad, reference_scale.grad, rtol=1e-5, atol=1e-6)


def test_fused_adagrad_trains_as_torch_optim_adagrad_on_the_sparse_gradients():
    """The fused "adagrad" (FBGEMM's EXACT_ADAGRAD) against the unfused path with
    torch.optim.Adagrad on the same sparse gradients: the same tables, to rounding."""
    fused = _simple({"optimizer": "adagrad", "lr": 0.05, "eps": 1e-8})
    plain = _simple(None)
    plain.load_state_dict(fused.state_dict())
    optimizer = torch.optim.Adagrad(plain.parameters(), lr=0.05, eps=1e-8)
    for seed in range(4):
        _loss(fused(_kjt(seed))).backward()
        _loss(plain(_kjt(seed))).backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


class EmbOptimType(enum.Enum):
    """FBGEMM's enum, as far as fused_params reads it (its members' values)."""

    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    EXACT_SGD = "exact_sgd"


@pytest.mark.parametrize("given, name", [(EmbOptimType.EXACT_ROWWISE_ADAGRAD, "rowwise_adagrad"),
                                         ("exact_row_wise_adagrad", "rowwise_adagrad"),
                                         (EmbOptimType.EXACT_SGD, "sgd")])
def test_fbgemms_optimizer_enum_and_its_values_name_the_fused_optimizer(given, name):
    assert _simple({"optimizer": given, "learning_rate": 0.1}).fused_optimizer.optimizer == name


def _trained(optimizer):
    model = _simple({"optimizer": optimizer, "lr": 0.1})
    _loss(model(_kjt(0))).backward()
    return model


@pytest.mark.parametrize("optimizer, damage, match", [
    ("lazy_adam", lambda state: state.pop("step"), r"must hold \['exp_avg', 'exp_avg_sq', 'step'\]"),
    ("lazy_adam", lambda state: state.pop("exp_avg"), "must hold"),
    ("lazy_adam", lambda state: state.update(step=torch.tensor(-4)), "whole number in"),
    ("lazy_adam", lambda state: state.update(step=torch.tensor(2.5)), "whole number in"),
    ("lazy_adam", lambda state: state.update(step=torch.tensor(float("nan"))), "whole number in"),
    ("lazy_adam", lambda state: state.update(exp_avg=torch.zeros(50, 4, device="meta")), "dense tensor with data"),
    ("rowwise_adagrad", lambda state: state.update(sum=torch.zeros(50, 4).to_sparse()), "dense tensor with data"),
    ("rowwise_adagrad", lambda state: state.update(extra=torch.zeros(1)), r"must hold \['sum'\]"),
])
def test_a_damaged_fused_state_is_refused_at_load_with_nothing_changed(optimizer, damage, match):
    model = _trained(optimizer)
    saved = copy.deepcopy(model.fused_optimizer.state_dict())
    damaged = copy.deepcopy(saved)
    damage(damaged["state"][0])
    with pytest.raises(ValueError, match=match):
        model.fused_optimizer.load_state_dict(damaged)
    after = model.fused_optimizer.state_dict()
    for index, state in saved["state"].items():
        assert all(torch.equal(value, after["state"][index][name]) for name, value in state.items())


def test_a_fused_state_for_no_table_is_refused_at_load():
    model = _trained("sgd")
    state = model.fused_optimizer.state_dict()
    state["state"][5] = {}
    with pytest.raises(ValueError, match="for no table"):
        model.fused_optimizer.load_state_dict(state)


def test_a_backward_refusing_its_settings_changes_no_state():
    """Settings are checked before the backward touches anything: the rows an eviction gave
    to new keys keep their old moments and stay marked fresh; a first backward that fails
    makes no state."""
    model = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 2, ["f"], eviction="lru")],
                                      fused_params={"optimizer": "lazy_adam", "lr": 0.1})
    model(sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1])))["f"].sum().backward()
    out = model(sk.KeyedJagged(["f"], torch.tensor([3]), lengths=torch.tensor([1])))  # evicts a key, reuses its row
    state, extra = copy.deepcopy(model.fused_optimizer.state_dict()), copy.deepcopy(model.state_dict())
    model.fused_optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be"):
        out["f"].sum().backward()
    assert all(torch.equal(v, model.fused_optimizer.state_dict()["state"][0][k]) for k, v in state["state"][0].items())
    assert torch.equal(extra["shards.0._extra_state"]["fresh"], model.state_dict()["shards.0._extra_state"]["fresh"])
    fresh = _simple({"optimizer": "lazy_adam", "lr": torch.tensor(0.1)})
    out = fresh(_kjt(1))
    fresh.fused_optimizer.param_groups[0]["lr"].fill_(float("nan"))
    with pytest.raises(ValueError, match="lr must be a finite real number"):
        _loss(out).backward()
    assert fresh.fused_optimizer.state_dict()["state"] == {}

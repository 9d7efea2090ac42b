"""State that must travel and state that must stay: a reused row's pending Adam reset
through checkpoints (resharded too) and state_dict round trips (docs/api.md),
deep copies of the layers and the collection that keep their weights' marks, and
``load_state_dict`` calls that raise with nothing changed (layers and the collection,
strict or not)."""

import copy
import glob
import io

import pytest
import torch
from _distributed import spawn
from _state import assert_equal_nested, saved_and_loaded
from torch import nn

import sparsekit as sk
from sparsekit import shard_registry

DIM = 2
LR = 0.1
BETA1 = 0.9


def T(*values):
    return torch.tensor(values, dtype=torch.int64)


def R(*keys):
    return sk.Ragged(T(*keys), T(0, len(keys)))


# ---- models: a layer of each kind, or a one-table collection ------------------------------------


def _build(kind, capacity=2, eviction="lru", dim=DIM, dtype=torch.float32, **kwargs):
    if kind == "distributed":
        return sk.DistributedEmbedding("sum", capacity, dim, 1, 8, eviction=eviction, **kwargs)
    if kind == "dense":
        return sk.All2AllDenseEmbedding(capacity, dim, 1, 1, dynamic_input=True, eviction=eviction, **kwargs)
    return sk.EmbeddingBagCollection([sk.TableConfig("t", dim, capacity, ["f"], eviction=eviction, dtype=dtype,
                                                     **kwargs)])


def _loss(model, keys):
    """Every key's vector summed (one bag, or one row per key): each key's gradient is ones."""
    if isinstance(model, sk.EmbeddingBagCollection):
        return model(sk.KeyedJagged(["f"], T(*keys), lengths=T(len(keys))))["f"].float().sum()
    if isinstance(model, sk.DistributedEmbedding):
        return model(R(*keys)).sum()
    return model(T(*keys)).sum()


def _shard(model):
    return model.shards[0] if isinstance(model, sk.EmbeddingBagCollection) else model


def _train(model, optimizer, keys):
    _loss(model, keys).backward()
    optimizer.step()
    optimizer.zero_grad()


def _by_key(model, optimizer, keys):
    """The weight rows, moments and step of ``keys`` (present on this rank)."""
    shard = _shard(model)
    rows = shard.hash_table.find(T(*keys))
    assert (rows >= 0).all()
    state = optimizer.state[shard.weight]
    return {"weight": shard.weight.detach()[rows].float(), "exp_avg": state["exp_avg"][rows],
            "exp_avg_sq": state["exp_avg_sq"][rows], "step": state["step"]}


def _evict_without_a_step(kind):
    """A capacity-2 LRU model whose key 10 was evicted for key 12 by a training forward with
    no optimizer step after it: row 0 holds 12 with 10's moments, to be reset at 12's first
    update; row 1 holds 11, trained, whose moments must stay."""
    model = _build(kind)
    optimizer = sk.LazyAdam(model.parameters(), lr=LR)
    for _ in range(3):
        _train(model, optimizer, [10, 11])
    _train(model, optimizer, [11])   # 10 is now the least recently used
    with torch.no_grad():
        _loss(model, [12])           # evicts 10: row 0 goes to 12
    assert _shard(model).hash_table.export()[0].tolist() == [12, 11]
    return model, optimizer


def _first_update_reference(kind):
    """Key 12's and 11's state after the step that follows the eviction, without any round trip."""
    model, optimizer = _evict_without_a_step(kind)
    _train(model, optimizer, [12, 11])
    return _by_key(model, optimizer, [12, 11])


def _assert_fresh_start(after, reference):
    """Key 12's moments are those of a first Adam update with gradient ones (plain Adam:
    m = (1 - beta1) * g, nothing of key 10 in them), and everything matches the run that
    never left memory."""
    torch.testing.assert_close(after["exp_avg"][0], torch.full((DIM,), 1 - BETA1))
    assert_equal_nested(after, reference)


# ---- 1. a reused row's pending moment reset survives saving and loading -------------------------


@pytest.mark.parametrize("kind", ["distributed", "dense", "collection"])
@pytest.mark.parametrize("via", ["state_dict", "checkpoint"])
def test_pending_moment_reset_survives_a_round_trip(kind, via, tmp_path):
    reference = _first_update_reference(kind)
    model, optimizer = _evict_without_a_step(kind)
    loaded = _build(kind)
    loaded_optimizer = sk.LazyAdam(loaded.parameters(), lr=LR)
    if via == "state_dict":
        loaded.load_state_dict(saved_and_loaded(model.state_dict()))
        loaded_optimizer.load_state_dict(saved_and_loaded(optimizer.state_dict()))
    else:
        directory = str(tmp_path / "ckpt")
        sk.save_checkpoint(directory, model, optimizer)
        sk.load_checkpoint(directory, loaded, loaded_optimizer)
    assert _shard(loaded)._fresh_rows[:2].tolist() == [True, False]
    _train(loaded, loaded_optimizer, [12, 11])
    _assert_fresh_start(_by_key(loaded, loaded_optimizer, [12, 11]), reference)


def test_a_state_saved_without_pending_resets_loads_with_none_pending(tmp_path):
    """States and checkpoints from before the flags were saved still load: no reset pending."""
    model, optimizer = _evict_without_a_step("distributed")
    state = model.state_dict()
    del state["_extra_state"]["fresh"]
    loaded = _build("distributed")
    loaded._fresh_rows[0] = True
    loaded.load_state_dict(state)
    assert not loaded._fresh_rows.any()
    assert loaded.hash_table.export()[0].tolist() == [12, 11]

    directory = str(tmp_path / "ckpt")
    sk.save_checkpoint(directory, model, optimizer)
    for path in glob.glob(str(tmp_path / "ckpt" / "ckpt-*" / "shard-*.pt")):
        shard = torch.load(path, weights_only=True)
        del shard["layers"][""]["dynamic"]["fresh"]
        torch.save(shard, path)
    loaded = _build("distributed")
    loaded._fresh_rows[0] = True
    sk.load_checkpoint(directory, loaded, sk.LazyAdam(loaded.parameters(), lr=LR))
    assert not loaded._fresh_rows.any()


def test_a_bad_pending_reset_entry_is_refused_with_nothing_changed():
    model, _ = _evict_without_a_step("distributed")
    target = _build("distributed")
    target(R(5))
    before = copy.deepcopy(target.state_dict())
    for bad in (torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.bool)):
        state = model.state_dict()
        state["_extra_state"]["fresh"] = bad
        with pytest.raises(ValueError, match=r"'_extra_state'\['fresh'\] must be a bool \[2\] tensor"):
            target.load_state_dict(state)
        assert_equal_nested(target.state_dict(), before)


def test_a_layer_without_eviction_resets_the_moments_when_it_loads_the_checkpoint(tmp_path):
    """It keeps no pending resets, so the saved moments of a reused row (the evicted key's)
    are reset as the checkpoint loads."""
    reference = _first_update_reference("distributed")
    model, optimizer = _evict_without_a_step("distributed")
    directory = str(tmp_path / "ckpt")
    sk.save_checkpoint(directory, model, optimizer)
    loaded = _build("distributed", eviction=None)
    loaded_optimizer = sk.LazyAdam(loaded.parameters(), lr=LR)
    sk.load_checkpoint(directory, loaded, loaded_optimizer)
    assert not loaded_optimizer.state[loaded.weight]["exp_avg"][0].any()
    assert loaded_optimizer.state[loaded.weight]["exp_avg"][1].all()
    _train(loaded, loaded_optimizer, [12, 11])
    _assert_fresh_start(_by_key(loaded, loaded_optimizer, [12, 11]), reference)


def _resharded_worker(rank, world_size, init, directory, kind):
    reference = _first_update_reference(kind)
    init()
    model = _build(kind)
    optimizer = sk.LazyAdam(model.parameters(), lr=LR)
    sk.load_checkpoint(directory, model, optimizer)
    # Key 12 (saved at row 0, fresh) is rank 0's, key 11 (saved at row 1) rank 1's: each now at
    # its rank's row 0, and only 12's reset is pending.
    mine = [12, 11][rank]
    assert _shard(model).hash_table.export()[0].tolist() == [mine]
    assert _shard(model)._fresh_rows[0].item() == (mine == 12)
    _train(model, optimizer, [mine])
    after = _by_key(model, optimizer, [mine])
    assert_equal_nested(after, {name: (value[rank:rank + 1] if value.dim() else value)
                                 for name, value in reference.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["distributed", "collection"])
def test_pending_moment_resets_travel_with_their_keys_when_resharded(kind, tmp_path):
    model, optimizer = _evict_without_a_step(kind)
    directory = str(tmp_path / "ckpt")
    sk.save_checkpoint(directory, model, optimizer)
    spawn(_resharded_worker, 2, str(tmp_path), directory, kind)


# ---- 2. deep copies keep the weights' marks and are independent -------------------------------

COPIED = [("distributed", None, torch.float32), ("distributed", "lru", torch.float32),
          ("dense", None, torch.float32), ("dense", "lru", torch.float32),
          ("collection", None, torch.float32), ("collection", "lfu", torch.float32),
          ("collection", None, torch.bfloat16), ("collection", "lru", torch.bfloat16)]
# With capacity 2 and eviction, [3] evicts 1 and 3 takes 1's row (and must not take its moments).
COPY_STEPS = [[1, 2], [1, 2], [3], [3, 2]]


def _snapshot(model):
    shards = [_shard(model)] if not isinstance(model, sk.EmbeddingBagCollection) else list(model.shards)
    return {"state": copy.deepcopy(model.state_dict()), "stats": [shard.stats() for shard in shards],
            "fresh": [shard._fresh_rows.clone() if shard._fresh_rows is not None else None for shard in shards]}


@pytest.mark.parametrize("kind, eviction, dtype", COPIED)
def test_a_deep_copy_keeps_the_marks_and_trains_like_the_original(kind, eviction, dtype):
    capacity = 2 if eviction else 4
    original = _build(kind, capacity, eviction, dtype=dtype) if kind == "collection" else \
        _build(kind, capacity, eviction)
    _loss(original, [1, 2])   # the copy starts with keys in its table
    clone = copy.deepcopy(original)

    original_shard, clone_shard = _shard(original), _shard(clone)
    assert sk.is_embedding_variable(clone_shard.weight)
    assert sk.split_embedding_variable_from_others(clone.parameters()) == ((clone_shard.weight,), ())
    assert clone_shard.hash_table is not original_shard.hash_table
    assert clone_shard.weight.data_ptr() != original_shard.weight.data_ptr()
    if eviction is not None:
        assert shard_registry.fresh_rows(clone_shard.weight) is clone_shard.fresh_rows
        assert clone_shard._fresh_rows is not original_shard._fresh_rows
    if kind == "collection":
        assert clone.weights["t"] is clone_shard.weight and clone._by_name["t"] is clone_shard

    # Training the copy leaves the original as it was.
    before = _snapshot(original)
    clone_optimizer = sk.LazyAdam(clone.parameters(), lr=LR)
    for keys in COPY_STEPS:
        _loss(clone, keys).backward()
        assert clone_shard.weight.grad.is_coalesced()   # the gradient hook came along
        clone_optimizer.step()
        clone_optimizer.zero_grad()
    assert_equal_nested(_snapshot(original), before)

    # The original trained alike ends alike, moments (float32 for a bfloat16 table) included.
    optimizer = sk.LazyAdam(original.parameters(), lr=LR)
    for keys in COPY_STEPS:
        _train(original, optimizer, keys)
    assert_equal_nested(_snapshot(clone), _snapshot(original))
    ours, theirs = clone_optimizer.state[clone_shard.weight], optimizer.state[original_shard.weight]
    assert ours["exp_avg"].dtype == torch.float32
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(ours[name], theirs[name]), name
    if eviction is not None:  # 3's two updates on 1's row started from zero moments (gradient ones)
        row = clone_shard.hash_table.find(T(3))
        torch.testing.assert_close(ours["exp_avg"][row], torch.full((1, DIM), (1 - BETA1) * (1 + BETA1)))


def test_a_whole_layer_through_torch_save_keeps_its_gradient_hook():
    layer = _build("distributed", 4, None)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _loss(loaded, [1, 2]).backward()
    assert sk.is_embedding_variable(loaded.weight) and loaded.weight.grad.is_coalesced()


def test_a_conversion_that_replaces_the_weight_keeps_the_marks():
    layer = _build("distributed", 2, "lru")
    weight = layer.weight
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        layer.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert layer.weight is not weight
    assert sk.is_embedding_variable(layer.weight) and shard_registry.fresh_rows(layer.weight) is layer.fresh_rows
    _loss(layer, [1, 2]).backward()
    assert layer.weight.grad.is_coalesced()


def _deepcopy_worker(rank, world_size, init):
    init()
    for kind in ("distributed", "collection"):
        original = _build(kind, 4, "lru")
        _loss(original, [1, 2, 3])
        clone = copy.deepcopy(original)
        assert clone.process_group is original.process_group
        assert sk.is_embedding_variable(_shard(clone).weight)
        for model in (clone, original):
            optimizer = sk.LazyAdam(model.parameters(), lr=LR)
            for keys in ([1, 4], [5, 2 + rank]):
                _train(model, optimizer, keys)
        assert_equal_nested(_snapshot(clone), _snapshot(original))


@pytest.mark.distributed
def test_a_deep_copy_under_a_process_group_shares_the_group(tmp_path):
    spawn(_deepcopy_worker, 2, str(tmp_path))


# ---- 3. a load_state_dict that raises changes nothing -----------------------------------------


def _trained(kind, capacity, dim=DIM, keys=(7, 8), eviction=None):
    model = _build(kind, capacity, eviction, dim=dim)
    _loss(model, list(keys))
    return model


@pytest.mark.parametrize("kind", ["distributed", "dense", "collection"])
@pytest.mark.parametrize("capacity, dim", [(20, DIM), (10, DIM + 1)])
def test_a_load_of_another_shape_changes_nothing(kind, capacity, dim):
    source = _trained(kind, 10, keys=(1, 2, 3))
    target = _trained(kind, capacity, dim)
    before = _snapshot(target)
    with pytest.raises(RuntimeError, match=r"size mismatch for (shards\.0\.)?weight"):
        target.load_state_dict(source.state_dict())
    assert_equal_nested(_snapshot(target), before)
    # Still the same model: key 1 reads as missing in eval, as before the call.
    target.eval()
    assert not _loss(target, [1]).item()


def _collection(dims=(DIM, DIM), keys=(1, 2, 3)):
    model = sk.EmbeddingBagCollection([sk.TableConfig("a", dims[0], 10, ["fa"]),
                                       sk.TableConfig("b", dims[1], 10, ["fb"])])
    model(sk.KeyedJagged(["fa", "fb"], T(*keys, *keys), lengths=T(len(keys), len(keys))))
    return model


def _duplicate_keys_of_b(state):
    state["shards.1._extra_state"]["keys"][1] = state["shards.1._extra_state"]["keys"][0]


def _wider_b(state):
    state["shards.1.weight"] = torch.zeros(10, DIM + 1)


@pytest.mark.parametrize("damage, error, message", [
    (_wider_b, RuntimeError, r"size mismatch for shards\.1\.weight"),
    (_duplicate_keys_of_b, ValueError, r"table 'b'.*the saved keys are not distinct"),
])
def test_a_collection_with_one_bad_table_loads_no_table(damage, error, message):
    state = copy.deepcopy(_collection().state_dict())
    damage(state)
    target = _collection(keys=(7, 8))
    before = _snapshot(target)
    with pytest.raises(error, match=message):
        target.load_state_dict(state)
    assert_equal_nested(_snapshot(target), before)


def test_int64_keys_into_an_int32_layer_change_nothing():
    source = _trained("distributed", 10, keys=(1, 2, 3))
    target = sk.DistributedEmbedding("sum", 10, DIM, 1, 8, key_dtype=torch.int32)
    target(sk.Ragged(torch.tensor([7, 8], dtype=torch.int32), T(0, 2)))
    before = _snapshot(target)
    with pytest.raises(TypeError, match="key_dtype"):
        target.load_state_dict(source.state_dict())
    assert_equal_nested(_snapshot(target), before)


@pytest.mark.parametrize("kind", ["distributed", "collection"])
def test_strict_key_errors_raise_before_anything_loads(kind):
    source = _trained(kind, 10, keys=(1, 2, 3))
    target = _trained(kind, 10)
    before = _snapshot(target)
    prefix = "shards.0." if kind == "collection" else ""
    unexpected = {**source.state_dict(), "surplus": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "surplus"'):
        target.load_state_dict(unexpected)
    without_table = {key: value for key, value in source.state_dict().items() if key != prefix + "_extra_state"}
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "{prefix}_extra_state"'):
        target.load_state_dict(without_table)
    assert_equal_nested(_snapshot(target), before)
    target.load_state_dict(source.state_dict())
    assert_equal_nested(_snapshot(target)["state"], _snapshot(source)["state"])


@pytest.mark.parametrize("kind", ["distributed", "collection"])
@pytest.mark.parametrize("entry", ["weight", "_extra_state"])
def test_strict_false_refuses_half_a_hash_layer(kind, entry):
    """The weight's rows are the table's keys' rows: one without the other would pair them wrongly."""
    source = _trained(kind, 10, keys=(1, 2, 3))
    target = _trained(kind, 10)
    before = _snapshot(target)
    prefix = "shards.0." if kind == "collection" else ""
    half = {key: value for key, value in source.state_dict().items() if key != prefix + entry}
    with pytest.raises(ValueError, match="both load together or neither does"):
        target.load_state_dict(half, strict=False)
    assert_equal_nested(_snapshot(target), before)


def test_strict_false_loads_the_tables_present_and_keeps_the_others():
    source, target = _collection(), _collection(keys=(7, 8))
    untouched = _snapshot(target)["state"]
    only_a = {key: value for key, value in source.state_dict().items() if key.startswith("shards.0.")}
    result = target.load_state_dict(only_a, strict=False)
    assert result.missing_keys == ["shards.1.weight", "shards.1._extra_state"] and not result.unexpected_keys
    now = _snapshot(target)["state"]
    for key in ("shards.0.weight", "shards.0._extra_state"):
        assert_equal_nested(now[key], source.state_dict()[key], key)
    for key in ("shards.1.weight", "shards.1._extra_state"):
        assert_equal_nested(now[key], untouched[key], key)


def test_a_layer_in_a_model_keeps_its_state_when_the_call_fails():
    """Whichever entry fails, the layer's or one loaded before it, the layer writes nothing."""
    def model(keys):
        return nn.ModuleDict({"dense": nn.Linear(3, 2), "emb": _trained("distributed", 10, keys=keys)})

    source, target = model((1, 2, 3)), model((7, 8))
    before = copy.deepcopy(target["emb"].state_dict())
    state = source.state_dict()
    state["dense.weight"] = torch.zeros(4, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for dense\.weight"):
        target.load_state_dict(state)
    assert_equal_nested(target["emb"].state_dict(), before)


def test_assign_keeps_the_marks():
    model, optimizer = _evict_without_a_step("distributed")
    loaded = _build("distributed")
    loaded.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    assert sk.is_embedding_variable(loaded.weight) and shard_registry.fresh_rows(loaded.weight) is loaded.fresh_rows
    loaded_optimizer = sk.LazyAdam(loaded.parameters(), lr=LR)
    loaded_optimizer.load_state_dict(optimizer.state_dict())
    _train(loaded, loaded_optimizer, [12, 11])
    _assert_fresh_start(_by_key(loaded, loaded_optimizer, [12, 11]), _first_update_reference("distributed"))


# ---- forwards that would fail halfway are refused before anything changes ---------------------------


@pytest.mark.parametrize("eviction", [None, "lru"])
@pytest.mark.parametrize("kind", ["layer", "collection"])
def test_a_torch_func_transform_is_refused_with_the_tables_unchanged(kind, eviction):
    if kind == "layer":
        model = sk.DistributedEmbedding("sum", 100, 4, 1, 1, eviction=eviction)
        warm, new = torch.tensor([[[1]], [[2]]]), torch.tensor([[[7]]])
    else:
        model = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 100, ["f"], eviction=eviction)])
        warm = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
        new = sk.KeyedJagged(["f"], torch.tensor([7]), lengths=torch.tensor([1]))
    model(warm)
    before = _snapshot(model)

    def loss(params):
        out = torch.func.functional_call(model, params, (new,))
        return (out if kind == "layer" else out["f"]).sum()

    with pytest.raises(RuntimeError, match="torch.func transforms .* are not supported"):
        torch.func.grad(loss)(dict(model.named_parameters()))
    assert_equal_nested(_snapshot(model), before)


@pytest.mark.parametrize("eviction", [None, "lru"])
@pytest.mark.parametrize("kind", ["layer", "collection"])
def test_training_a_model_built_under_inference_mode_is_refused_with_the_tables_unchanged(kind, eviction):
    with torch.inference_mode():
        if kind == "layer":
            model = sk.DistributedEmbedding("sum", 100, 4, 1, 1, eviction=eviction)
            keys = torch.tensor([[[1]], [[2]]])
        else:
            model = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 100, ["f"], eviction=eviction)])
            keys = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match=r"made under torch.inference_mode\(\)"):
        model(keys)
    tables = [model.hash_table] if kind == "layer" else [shard.hash_table for shard in model._shards]
    assert all(len(table) == 0 and table.find(torch.tensor([1, 2])).tolist() == [-1, -1] for table in tables)
    with torch.inference_mode():  # where it was made, it still looks keys up
        model.eval()(keys)


@pytest.mark.parametrize("eviction, admit_after", [(None, 1), ("lru", 1), ("lfu", 2)])
def test_to_empty_turns_a_meta_layer_and_collection_into_empty_real_ones(eviction, admit_after):
    """nn.Module.to_empty, the usual way from a meta-device model to a real one: the tables
    (which hold no data on meta) come back empty on the new device, then train."""
    layer = sk.DistributedEmbedding("sum", 100, 4, 1, 1, device="meta", eviction=eviction, admit_after=admit_after)
    collection = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 100, ["f"]),
                                            sk.TableConfig("b", 8, 50, ["g"], eviction=eviction,
                                                           admit_after=admit_after)], device="meta")
    for model in (layer.to_empty(device="cpu"), collection.to_empty(device="cpu")):
        shards = [model] if model is layer else list(model._shards)
        for shard in shards:
            assert shard.weight.device.type == "cpu" and len(shard.hash_table) == 0
            assert all(t.device.type == "cpu" for t in shard.hash_table._tensors())
            with torch.no_grad():
                shard.weight.zero_()
        optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
        for _ in range(admit_after):
            if model is layer:
                loss = model(torch.tensor([[[1]], [[2]]])).sum()
            else:
                loss = sum(v.sum() for v in model(sk.KeyedJagged(["f", "g"], torch.tensor([1, 2]),
                                                                 lengths=torch.tensor([1, 1]))).values())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        # The layer's one table holds both keys; each of the collection's tables one.
        assert [len(shard.hash_table) for shard in shards] == ([2] if model is layer else [1, 1])


@pytest.mark.parametrize("eviction, admit_after", [(None, 1), ("lru", 1), ("lfu", 2)])
def test_reset_parameters_gives_a_trained_model_a_new_ones_state(eviction, admit_after):
    """reset_parameters (nn.Module's convention, e.g. after to_empty): each shard ends equal
    to a freshly built one (weights, tables, clocks, totals), in place, and trains again."""
    def build(device="cpu"):
        return (sk.DistributedEmbedding("sum", 100, 4, 1, 1, device=device, eviction=eviction,
                                        admit_after=admit_after),
                sk.DistributedEmbedding("sum", 100, 4, 1, 1, device=device, use_hashtable=False),
                sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 100, ["f"], use_hashtable=False),
                                           sk.TableConfig("b", 8, 50, ["g"], eviction=eviction,
                                                          admit_after=admit_after)], device=device))

    def train(model, steps):
        optimizer = sk.LazyAdam(model.parameters(), lr=0.1)
        for step in range(steps):
            if isinstance(model, sk.EmbeddingBagCollection):
                loss = sum(v.sum() for v in model(sk.KeyedJagged(["f", "g"], torch.tensor([1 + step, 2, 3]),
                                                                 lengths=torch.tensor([1, 1, 1, 0]))).values())
            else:
                loss = model(torch.tensor([[[1 + step]], [[2]]])).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    for trained, new in zip(build(), build()):
        train(trained, 3)
        weights = [p for p in trained.parameters()]
        trained.reset_parameters()
        assert [p for p in trained.parameters()] == weights  # the same Parameters, in place
        torch.testing.assert_close(trained.state_dict(), new.state_dict(), rtol=0, atol=0)
        train(trained, 2)
        train(new, 2)
        torch.testing.assert_close(trained.state_dict(), new.state_dict(), rtol=0, atol=0)

    # From the meta device: to_empty leaves a direct table's rows uninitialised; the reset
    # gives them their initial values.
    for empty, new in zip(build("meta"), build()):
        empty.to_empty(device="cpu")
        empty.reset_parameters()
        torch.testing.assert_close(empty.state_dict(), new.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("training", [True, False])
def test_a_forward_on_the_meta_device_says_to_give_the_tables_memory(training):
    layer = sk.DistributedEmbedding("sum", 100, 4, 1, 1, device="meta").train(training)
    collection = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 10, ["f"])], device="meta").train(training)
    with pytest.raises(RuntimeError, match=r"DistributedEmbedding: its tables are on the meta device .*to_empty"):
        layer(torch.tensor([[[1]]]))
    with pytest.raises(RuntimeError, match=r"EmbeddingBagCollection: its tables are on the meta device"):
        collection(sk.KeyedJagged(["f"], torch.tensor([1]), lengths=torch.tensor([1])))


def test_strict_load_runs_the_modules_load_hooks_before_the_key_check():
    """A pre-hook that migrates an old layout (renamed entries) loads, as for nn.Linear; the
    strict check without hooks names the same keys as state_dict() and builds no entry."""
    from sparsekit.shard import _state_dict_keys
    for module in [sk.DistributedEmbedding("sum", 100, 4, 1, 2, eviction="lru", admit_after=2),
                   sk.All2AllDenseEmbedding(10, 4, 1, 1, use_hashtable=False),
                   sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 10, ["f"]),
                                              sk.TableConfig("b", 8, 10, ["g"], use_hashtable=False)]),
                   torch.nn.Sequential(sk.DistributedEmbedding("sum", 100, 4, 1, 2), torch.nn.Linear(2, 2))]:
        assert _state_dict_keys(module) == list(module.state_dict().keys())
    trained = sk.DistributedEmbedding("sum", 100, 4, 1, 2)
    trained(torch.tensor([[[1, 2]]]))
    old = {"old_" + key: value for key, value in trained.state_dict().items()}

    def migrate(module, state_dict, prefix, *args):
        for key in [k for k in state_dict if k.startswith(prefix + "old_")]:
            state_dict[prefix + key[len(prefix) + 4:]] = state_dict.pop(key)

    for make in (lambda: sk.DistributedEmbedding("sum", 100, 4, 1, 2),
                 lambda: sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 100, ["f"])])):
        fresh = make()
        source = trained if isinstance(fresh, sk.DistributedEmbedding) else None
        if source is None:
            source = make()
            source(sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1])))
            old = {"old_" + key: value for key, value in source.state_dict().items()}
        fresh.register_load_state_dict_pre_hook(migrate)
        result = fresh.load_state_dict(old)
        assert not result.missing_keys and not result.unexpected_keys
        assert_equal_nested(fresh.state_dict(), source.state_dict())
        old = {"old_" + key: value for key, value in trained.state_dict().items()}


def test_a_hash_layer_in_shared_memory_refuses_to_train_and_still_looks_up():
    """share_memory() shared the weight but not the hash table's count of keys: a training
    step in another process gave rows it had filled to other keys here. A direct table
    (no hash table) trains shared, as nn.EmbeddingBag does."""
    batch = torch.tensor([[[1, 2]]])
    layer = sk.DistributedEmbedding("sum", 10, 4, 1, 2)
    layer(batch)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 10, ["f"])])
    kjt = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    ebc(kjt)
    for model, call in ((layer, lambda: layer(batch)), (ebc, lambda: ebc(kjt))):
        model.share_memory()
        state = copy.deepcopy(model.state_dict())
        with pytest.raises(RuntimeError, match="weight is in shared memory .* processes training it would give one "
                                               "row to two keys"):
            call()
        assert_equal_nested(model.state_dict(), state)
        model.eval()
        call()
    direct = sk.DistributedEmbedding("sum", 10, 4, 1, 2, use_hashtable=False).share_memory()
    direct(batch).sum().backward()


def test_repr_shows_the_settings_that_tell_layers_apart():
    assert repr(sk.DistributedEmbedding("mean", 10, 4, 2, 3)).startswith(
        "DistributedEmbedding(combiner='mean', slot_num=2, max_nnz=3, max_vocabulary_size_per_gpu=10, "
        "embedding_vec_size=4, use_hashtable=True")
    assert repr(sk.All2AllDenseEmbedding(10, 4, 2, 3)).startswith(
        "All2AllDenseEmbedding(slot_num=2, nnz_per_slot=3, dynamic_input=False, max_vocabulary_size_per_gpu=10")
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 10, ["f", "g"], combiner="mean", dtype=torch.bfloat16)])
    assert "_TableShard(table='a', features=['f', 'g'], combiner='mean', dtype=torch.bfloat16, capacity=10, " \
           "embedding_dim=4, use_hashtable=True" in repr(ebc)

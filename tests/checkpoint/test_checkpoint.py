"""save_checkpoint / load_checkpoint: resharding across world sizes, exact continuation,
atomic writes, weights_only files."""

from __future__ import annotations

import copy
import glob
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsekit as sk
import sparsekit.checkpoint as checkpoint_module
from sparsekit import HashTableFullError, LazyAdam

from _distributed import spawn
from _state import assert_equal_nested

DIM = 3
SLOTS = 2
NNZ = 3
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
DIRECT_KEYS = 20
STEPS_BEFORE = 2
STEPS_AFTER = 2
PAD = 123  # pad key of the pooled input, never a key of the pool


def key_pool() -> torch.Tensor:
    wide = torch.randint(-(2**63), 2**63 - 1, (12,), generator=torch.Generator().manual_seed(3))
    return torch.cat([torch.tensor([-(2**63), 2**63 - 1, -1, 0, 4, 9]), wide])


HASH_ROWS = len(key_pool()) + 2


class Model(nn.Module):
    """A hash-table pooled embedding, a direct-mapped dense embedding, a dense top and a buffer."""

    def __init__(self, hash_rows: int = HASH_ROWS):
        super().__init__()
        self.pooled = sk.DistributedEmbedding("mean", hash_rows, DIM, SLOTS, NNZ)
        self.direct = sk.All2AllDenseEmbedding(DIRECT_KEYS, DIM, SLOTS, NNZ, use_hashtable=False)
        self.top = nn.Linear(2 * SLOTS * DIM, 1)
        with torch.no_grad():
            self.top.weight.copy_(torch.linspace(-0.5, 0.5, 2 * SLOTS * DIM))
            self.top.bias.zero_()
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, pooled_keys, direct_keys):
        self.steps_seen += 1
        pooled = self.pooled(pooled_keys, pad_key=PAD)
        features = torch.cat([pooled.flatten(1), self.direct(direct_keys).sum(2).flatten(1)], 1)
        return self.top(features).squeeze(1)


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    pool = key_pool()
    pooled = pool[torch.randint(0, len(pool), (GLOBAL_BATCH, SLOTS, NNZ), generator=generator)]
    direct = torch.randint(0, DIRECT_KEYS, (GLOBAL_BATCH, SLOTS, NNZ), generator=generator)
    labels = torch.randn(GLOBAL_BATCH, generator=generator)
    pooled[:, :, -1][torch.rand(GLOBAL_BATCH, SLOTS, generator=generator) < 0.5] = PAD
    return pooled, direct, labels


def train(model, optimizer, steps, rank=0, world_size=1):
    """Steps of sum-of-squares / global batch; dense gradients summed over ranks. Returns the outputs."""
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    outputs = []
    for step in steps:
        pooled, direct, labels = batch(step)
        out = model(pooled[local], direct[local])
        loss = ((out - labels[local]) ** 2).sum() / GLOBAL_BATCH
        loss.backward()
        if world_size > 1:
            for param in model.top.parameters():
                dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


def make(hash_rows: int = HASH_ROWS):
    model = Model(hash_rows)
    return model, LazyAdam(model.parameters(), lr=0.02)


def reference_run():
    """One process, no group: outputs of every step and the final model."""
    model, optimizer = make()
    outputs = train(model, optimizer, range(STEPS_BEFORE + STEPS_AFTER))
    return model, optimizer, outputs


def check_continuation(model, optimizer, reference, rank, world_size):
    """Steps after the checkpoint and the final state per key equal the uninterrupted run."""
    ref_model, ref_optimizer, ref_outputs = reference
    per_rank = GLOBAL_BATCH // world_size
    outputs = train(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, world_size)
    for out, ref_out in zip(outputs, ref_outputs[STEPS_BEFORE:]):
        torch.testing.assert_close(out, ref_out[rank * per_rank:(rank + 1) * per_rank], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.top.weight, ref_model.top.weight, rtol=1e-5, atol=1e-6)
    assert int(model.steps_seen) == int(ref_model.steps_seen) == STEPS_BEFORE + STEPS_AFTER

    keys, rows = model.pooled.hash_table.export()
    ref_keys, _ = ref_model.pooled.hash_table.export()
    assert set(keys.tolist()) == {k for k in ref_keys.tolist() if (k % 2**64) % world_size == rank}
    ref_rows = ref_model.pooled.hash_table.find(keys)
    direct_keys = model.direct.owned_keys()
    direct_rows = torch.arange(len(direct_keys))[direct_keys < DIRECT_KEYS]
    direct_keys = direct_keys[direct_keys < DIRECT_KEYS]
    for layer, ref_layer, mine, theirs in ((model.pooled, ref_model.pooled, rows, ref_rows),
                                           (model.direct, ref_model.direct, direct_rows, direct_keys)):
        state, ref_state = optimizer.state[layer.weight], ref_optimizer.state[ref_layer.weight]
        assert state["step"].item() == ref_state["step"].item() == STEPS_BEFORE + STEPS_AFTER
        torch.testing.assert_close(layer.weight[mine], ref_layer.weight[theirs], rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key][mine], ref_state[key][theirs], rtol=1e-5, atol=1e-6)


# ---- multi-rank: save at 2, load at 3 and 1 -------------------------------------------------


def _save_worker(rank, world_size, init, directory):
    reference = reference_run()
    init()
    model, optimizer = make()
    train(model, optimizer, range(STEPS_BEFORE), rank, world_size)
    path = sk.save_checkpoint(directory, model, optimizer)
    assert os.path.basename(path) == "ckpt-000001"
    check_continuation(model, optimizer, reference, rank, world_size)

    # A later save that fails on one rank: every rank raises, the first checkpoint stays.
    original = checkpoint_module.layout.write_file

    def failing_write(path, write):
        if rank == 1 and "shard-" in os.path.basename(path):
            raise OSError("simulated disk failure")
        original(path, write)

    checkpoint_module.layout.write_file = failing_write
    try:
        with pytest.raises((OSError, RuntimeError), match="simulated disk failure|failed on another rank"):
            sk.save_checkpoint(directory, model, optimizer)
    finally:
        checkpoint_module.layout.write_file = original
    dist.barrier()
    with open(os.path.join(directory, "LATEST")) as latest:
        assert latest.read() == "ckpt-000001"


def _load_worker(rank, world_size, init, directory):
    reference = reference_run()
    init()
    model, optimizer = make()
    sk.load_checkpoint(directory, model, optimizer)
    assert int(model.steps_seen) == STEPS_BEFORE
    check_continuation(model, optimizer, reference, rank, world_size)


def _load_too_small_worker(rank, world_size, init, directory):
    init()
    model, optimizer = make(hash_rows=4)  # too few rows for this rank's share of the keys
    before = model.top.weight.detach().clone()
    with pytest.raises((HashTableFullError, RuntimeError), match="must hold .* saved keys|failed on another rank"):
        sk.load_checkpoint(directory, model, optimizer)
    assert torch.equal(model.top.weight, before) and len(model.pooled.hash_table) == 0  # nothing changed


@pytest.mark.distributed
def test_save_at_2_load_at_3_and_1(tmp_path):
    directory = str(tmp_path / "ckpt")
    spawn(_save_worker, 2, str(tmp_path), directory)
    for path in glob.glob(os.path.join(directory, "ckpt-000001", "*.pt")):
        torch.load(path, weights_only=True)  # no pickled code anywhere
    with open(os.path.join(directory, "ckpt-000001", "metadata.json")) as meta:
        assert json.load(meta)["world_size"] == 2
    assert sorted(os.listdir(os.path.join(directory, "ckpt-000001"))) == [
        "dense.pt", "metadata.json", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]

    spawn(_load_worker, 3, str(tmp_path), directory)
    spawn(_load_too_small_worker, 3, str(tmp_path), directory)

    # One process, no group at all.
    model, optimizer = make()
    sk.load_checkpoint(directory, model, optimizer)
    check_continuation(model, optimizer, reference_run(), 0, 1)


# ---- one process ---------------------------------------------------------------------------


def snapshot(model, optimizer):
    keys, rows = model.pooled.hash_table.export()
    return {
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "keys": keys.clone(),
        "state": {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()},
        "steps_seen": int(model.steps_seen),
    }


def assert_same(model, optimizer, expected):
    now = snapshot(model, optimizer)
    assert torch.equal(now["keys"], expected["keys"])  # same rows, bit for bit
    assert now["steps_seen"] == expected["steps_seen"]
    for name, weight in expected["weights"].items():
        assert torch.equal(now["weights"][name], weight), name
        for key, value in expected["state"][name].items():
            assert torch.equal(now["state"][name][key], value), (name, key)


def test_round_trip_is_exact_and_failed_saves_keep_the_previous_checkpoint(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        sk.load_checkpoint(directory, *make())
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError, match="save_checkpoint: directory .*a_file' is a file"):
        sk.save_checkpoint(str(tmp_path / "a_file"), *make())
    model, optimizer = make()
    train(model, optimizer, range(2))
    sk.save_checkpoint(directory, model, optimizer)
    first = snapshot(model, optimizer)
    fresh, fresh_optimizer = make()
    sk.load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same(fresh, fresh_optimizer, first)

    train(model, optimizer, range(2, 4))
    original_write = checkpoint_module.layout.write_file

    # A crash while writing the files: LATEST still names the first checkpoint.
    def crash_on_dense(path, write):
        if path.endswith("dense.pt"):
            raise KeyboardInterrupt("simulated crash mid-save")
        original_write(path, write)

    monkeypatch.setattr(checkpoint_module.layout, "write_file", crash_on_dense)
    with pytest.raises(KeyboardInterrupt):
        sk.save_checkpoint(directory, model, optimizer)
    fresh, fresh_optimizer = make()
    sk.load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same(fresh, fresh_optimizer, first)

    # A crash after the new directory is in place but before LATEST moves.
    def crash_on_latest(path, write):
        if os.path.basename(path).startswith("LATEST"):
            raise KeyboardInterrupt("simulated crash before LATEST")
        original_write(path, write)

    monkeypatch.setattr(checkpoint_module.layout, "write_file", crash_on_latest)
    with pytest.raises(KeyboardInterrupt):
        sk.save_checkpoint(directory, model, optimizer)
    assert os.path.isdir(os.path.join(directory, "ckpt-000002"))
    fresh, fresh_optimizer = make()
    sk.load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same(fresh, fresh_optimizer, first)

    # The next save completes and replaces both the leftovers and the old checkpoint.
    monkeypatch.setattr(checkpoint_module.layout, "write_file", original_write)
    second = snapshot(model, optimizer)
    assert sk.save_checkpoint(directory, model, optimizer).endswith("ckpt-000002")
    assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000002"]
    fresh, fresh_optimizer = make()
    sk.load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same(fresh, fresh_optimizer, second)


def test_model_mismatch_and_no_optimizer(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, optimizer = make()
    train(model, optimizer, range(1))
    sk.save_checkpoint(directory, model)  # weights only
    fresh, fresh_optimizer = make()
    sk.load_checkpoint(directory, fresh)  # an optimizer is refused: see test_a_checkpoint_without_optimizer_...
    torch.testing.assert_close(fresh.top.weight, model.top.weight, rtol=0, atol=0)
    assert len(fresh_optimizer.state) == 0

    other = nn.ModuleDict({"renamed": sk.DistributedEmbedding("sum", 8, DIM, SLOTS, NNZ)})
    with pytest.raises(ValueError, match="embedding layers"):
        sk.load_checkpoint(directory, other)
    wider = Model()
    wider.direct = sk.All2AllDenseEmbedding(DIRECT_KEYS, DIM + 1, SLOTS, NNZ, use_hashtable=False)
    with pytest.raises(ValueError, match="embedding_vec_size"):
        sk.load_checkpoint(directory, wider)


def test_direct_layer_saves_only_trained_rows(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, optimizer = make()
    train(model, optimizer, range(1))
    sk.save_checkpoint(directory, model, optimizer)
    shard = torch.load(os.path.join(directory, "ckpt-000001", "shard-00000-of-00001.pt"), weights_only=True)
    direct = shard["layers"]["direct"]
    touched = set(batch(0)[1].unique().tolist())
    assert set(direct["keys"].tolist()) == touched
    assert set(direct["state"]) == {"exp_avg", "exp_avg_sq"} and direct["scalars"]["step"].item() == 1


def test_a_bare_layer_is_a_model(tmp_path):
    layer = sk.DistributedEmbedding("sum", 8, DIM, 1, 2)
    optimizer = LazyAdam(layer.parameters(), lr=0.1)
    layer(torch.tensor([[[5, -9]]])).sum().backward()
    optimizer.step()
    sk.save_checkpoint(str(tmp_path), layer, optimizer)
    fresh = sk.DistributedEmbedding("sum", 8, DIM, 1, 2)
    fresh_optimizer = LazyAdam(fresh.parameters(), lr=0.1)
    sk.load_checkpoint(str(tmp_path), fresh, fresh_optimizer)
    assert fresh.hash_table.export()[0].tolist() == [5, -9]
    assert torch.equal(fresh.weight, layer.weight)
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"], optimizer.state[layer.weight]["exp_avg"])


def _saved(tmp_path):
    """A one-process checkpoint of a trained model; returns (directory, its ckpt folder, the model state)."""
    directory = str(tmp_path / "ckpt")
    model, optimizer = make()
    train(model, optimizer, range(2))
    sk.save_checkpoint(directory, model, optimizer)
    return directory, os.path.join(directory, "ckpt-000001"), snapshot(model, optimizer)


def _load_is_refused_and_changes_nothing(directory, message):
    """A model trained past the checkpoint refuses to load it (ValueError matching
    ``message``) and keeps every tensor and counter of the model and its optimizer."""
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=message):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)


def _rewrite_shard(folder, change):
    path = os.path.join(folder, "shard-00000-of-00001.pt")
    shard = torch.load(path, weights_only=True)
    change(shard["layers"]["pooled"], shard)
    torch.save(shard, path)


def _drop_last_row(part, shard):
    part["weight"] = part["weight"][:-1]


def _duplicate_a_key(part, shard):
    part["keys"][1] = part["keys"][0]


def _wrong_width(part, shard):
    part["weight"] = torch.cat([part["weight"], part["weight"][:, :1]], 1)


def _no_layer_entry(part, shard):
    del shard["layers"]["pooled"]


def _negative_clock(part, shard):
    part["dynamic"]["clock"] = -1


def _nan_step(part, shard):
    part["scalars"]["step"] = torch.tensor(float("nan"))


def _integer_moments(part, shard):
    part["state"]["exp_avg"] = part["state"]["exp_avg"].long()


def _huge_clock(part, shard):
    part["dynamic"]["clock"] = 2**63 - 1


def _no_exp_avg_sq(part, shard):
    part["state"].pop("exp_avg_sq")


def _no_step(part, shard):
    part["scalars"].pop("step")


def _half_moments(part, shard):
    part["state"]["exp_avg"] = part["state"]["exp_avg"].half()


def _complex_moments(part, shard):
    part["state"]["exp_avg"] = part["state"]["exp_avg"].to(torch.complex64)


def _moments_of_two_dtypes(part, shard):
    part["state"]["exp_avg"] = part["state"]["exp_avg"].double()


def _step_past_int64(part, shard):
    part["scalars"]["step"] = torch.tensor(1e30)


def _state_without_has_state(part, shard):
    part["has_state"] = False


@pytest.mark.parametrize("damage, message", [
    (lambda folder: open(os.path.join(folder, "shard-00000-of-00001.pt"), "w").close(),
     r"shard-00000-of-00001.pt \(it is empty\)"),
    (lambda folder: open(os.path.join(folder, "metadata.json"), "w").write("{not json"),
     r"metadata.json is not valid JSON"),
    (lambda folder: open(os.path.join(folder, "metadata.json"), "w").write("[1, 2]"),
     r"metadata.json: expected a JSON object"),
    (lambda folder: _edit_metadata(folder, lambda m: m.pop("layers")), r"metadata.json: 'layers' must be"),
    (lambda folder: _edit_metadata(folder, lambda m: m.update(shards=[])), r"metadata.json: 'shards' must be"),
    (lambda folder: _edit_metadata(folder, lambda m: m.update(shards=["../x.pt"])), r"inside the checkpoint"),
    (lambda folder: _rewrite_shard(folder, _drop_last_row), r"keys need weight rows"),
    (lambda folder: _rewrite_shard(folder, _duplicate_a_key), r"a key is saved twice"),
    (lambda folder: _rewrite_shard(folder, _wrong_width), r"keys need weight rows"),
    (lambda folder: _rewrite_shard(folder, _no_layer_entry), r"no entry for layer 'pooled'"),
    # Found by the hash table's own load, after the dense state had been loaded.
    (lambda folder: _rewrite_shard(folder, _negative_clock), r"dynamic 'clock' must be a non-negative int"),
    (lambda folder: _rewrite_shard(folder, _huge_clock), r"dynamic 'clock' must be a non-negative int"),
    # Loaded before, and the next optimizer.step() failed ("cannot convert float NaN to integer").
    (lambda folder: _rewrite_shard(folder, _nan_step), r"layer 'pooled': the saved optimizer 'step' must be a finite"),
    (lambda folder: _rewrite_shard(folder, _integer_moments), r"optimizer state 'exp_avg' must be floating point"),
    # Loaded before, and the next LazyAdam.step() failed: "lacks ['exp_avg_sq']", "'exp_avg' must
    # be a dense torch.float32 or torch.float64 tensor", "step must fit in int64".
    (lambda folder: _rewrite_shard(folder, _no_exp_avg_sq),
     r"shard-00000-of-00001.pt: layer 'pooled': the saved optimizer state lacks \['exp_avg_sq'\]"),
    (lambda folder: _rewrite_shard(folder, _no_step), r"layer 'pooled': the saved optimizer state lacks \['step'\]"),
    (lambda folder: _rewrite_shard(folder, _half_moments),
     (r"layer 'pooled': the saved optimizer state 'exp_avg' must be floating point of a dtype LazyAdam updates a "
      r"torch.float32 weight with \(torch.float32, torch.float64\), got torch.float16")),
    (lambda folder: _rewrite_shard(folder, _complex_moments),
     r"'exp_avg' must be floating point of a dtype LazyAdam updates .* got torch.complex64"),
    (lambda folder: _rewrite_shard(folder, _moments_of_two_dtypes),
     r"moments must share a dtype .* got 'exp_avg' torch.float64 and 'exp_avg_sq' torch.float32"),
    (lambda folder: _rewrite_shard(folder, _step_past_int64),
     r"layer 'pooled': the saved optimizer 'step' must be a finite integer in \[0, 2\*\*63 - 2\]"),
    (lambda folder: _rewrite_shard(folder, _state_without_has_state), r"'has_state' is False but the shard holds"),
])
def test_damaged_checkpoints_name_the_file_and_change_nothing(tmp_path, damage, message):
    """Each kind of damage raises an error naming the file and what is wrong, and the model
    and optimizer loading it are left exactly as they were."""
    directory, folder, _ = _saved(tmp_path)
    damage(folder)
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)


def _edit_metadata(folder, change):
    path = os.path.join(folder, "metadata.json")
    with open(path) as meta:
        metadata = json.load(meta)
    change(metadata)
    with open(path, "w") as meta:
        json.dump(metadata, meta)


def test_dense_and_optimizer_mismatches_change_nothing(tmp_path):
    """A dense parameter of another shape, or an optimizer over other parameters, is found
    before anything is written (torch's own load would have overwritten some parameters)."""
    directory, _, _ = _saved(tmp_path)
    model, optimizer = make()
    model.top = nn.Linear(2 * SLOTS * DIM, 2)
    optimizer = LazyAdam(model.parameters(), lr=0.02)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"dense 'top.weight' was saved with shape \[1, 12\]"):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)

    model, _ = make()
    fewer = LazyAdam([model.top.weight], lr=0.02)
    with pytest.raises(ValueError, match="other parameter groups"):
        sk.load_checkpoint(directory, model, fewer)
    model, _ = make()
    with pytest.raises(ValueError, match="saved by another optimizer"):
        sk.load_checkpoint(directory, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _dense_mismatch_on_rank_1_worker(rank, world_size, init, directory):
    init()
    model, optimizer = make()
    if rank == 1:
        model.top = nn.Linear(2 * SLOTS * DIM, 2)
        optimizer = LazyAdam(model.parameters(), lr=0.02)
    before = snapshot(model, optimizer)
    expected = "dense 'top.weight'" if rank == 1 else "failed on another rank"
    with pytest.raises(Exception, match=expected):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)


@pytest.mark.distributed
def test_a_mismatch_on_one_rank_raises_on_every_rank(tmp_path):
    directory, _, _ = _saved(tmp_path)
    spawn(_dense_mismatch_on_rank_1_worker, 2, str(tmp_path), directory)


def test_a_compiled_model_and_the_plain_one_load_each_others_checkpoints(tmp_path):
    """torch.compile wraps the model in an OptimizedModule ("_orig_mod." names): the
    checkpoint looks through it as through DDP."""
    def build():
        torch.manual_seed(0)
        return nn.ModuleDict({"ebc": sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 8, ["f"])]),
                              "top": nn.Linear(2, 1)})
    trained = build()
    trained["ebc"](sk.KeyedJagged(["f"], torch.tensor([3, 5]), lengths=torch.tensor([1, 1])))
    sk.save_checkpoint(str(tmp_path / "compiled"), torch.compile(trained))
    sk.save_checkpoint(str(tmp_path / "plain"), trained)
    for source, target in (("compiled", build()), ("plain", torch.compile(build()))):
        sk.load_checkpoint(str(tmp_path / source), target)
        plain = getattr(target, "_orig_mod", target)
        assert torch.equal(plain["ebc"].export("t")[0].sort().values, torch.tensor([3, 5]))
        assert torch.equal(plain["top"].weight, trained["top"].weight)


def test_a_table_loaded_into_another_dtype_is_cast_unless_it_would_overflow(tmp_path):
    """float32 rows past float16's range (65504) loaded as inf without a word; now refused,
    with nothing changed. Rows that fit load cast to the table's dtype (bfloat16 has
    float32's range), as load_state_dict copies across dtypes."""
    def collection(dtype):
        init = sk.KeySeededUniform(low=7e4, high=8e4) if dtype == torch.float32 else None
        return sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 8, ["f"], dtype=dtype, initializer=init)])
    kjt = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    saved = collection(torch.float32)
    saved(kjt)
    sk.save_checkpoint(str(tmp_path), saved)
    half = collection(torch.float16)
    half(sk.KeyedJagged(["f"], torch.tensor([9]), lengths=torch.tensor([1])))
    before = [t.clone() for t in half.export("t")]
    with pytest.raises(ValueError, match=r"layer .*'t'.* was saved as torch.float32 with values past "
                                         r"torch.float16's range \(e.g. 7\d{4}"):
        sk.load_checkpoint(str(tmp_path), half)
    assert all(torch.equal(a, b) for a, b in zip(before, half.export("t")))
    bf16 = collection(torch.bfloat16)
    sk.load_checkpoint(str(tmp_path), bf16)
    keys, rows = saved.export("t")
    loaded_keys, loaded_rows = bf16.export("t")
    assert torch.equal(loaded_keys, keys) and torch.equal(loaded_rows, rows.to(torch.bfloat16))


def _aliased_layer_worker(rank, world_size, init, directory, phase):
    """One layer registered under two names (two towers sharing it)."""
    init()
    torch.manual_seed(0)
    layer = sk.DistributedEmbedding("sum", 32, DIM, 1, 2)
    model = nn.ModuleDict({"a": layer, "b": layer, "top": nn.Linear(DIM, 1)})
    optimizer = LazyAdam(model.parameters(), lr=0.1)
    keys = torch.arange(12).view(6, 1, 2)[rank * 3:(rank + 1) * 3] + (0 if phase == "save" else 100)
    (model["top"](model["a"](keys).sum(1)).sum() + model["b"](keys).sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    owned = os.path.join(os.path.dirname(directory), f"keys_{rank}.pt")
    if phase == "save":
        sk.save_checkpoint(directory, model, optimizer)
        torch.save(layer.hash_table.export()[0].sort().values, owned)
        return
    sk.load_checkpoint(directory, model, optimizer)  # rank 1 refused rank 0's shard, saved as dense state
    assert torch.equal(layer.hash_table.export()[0].sort().values, torch.load(owned, weights_only=True))
    assert float(optimizer.state[layer.weight]["step"]) == 1


def test_a_checkpoint_whose_dense_state_holds_a_shared_layers_second_name_loads(tmp_path):
    """Saves before the fix wrote a shared layer's second name ('b.weight', 'b._extra_state')
    into dense.pt; such a checkpoint still loads (one process: those entries are dropped)."""
    layer = sk.DistributedEmbedding("sum", 32, DIM, 1, 2)
    model = nn.ModuleDict({"a": layer, "b": layer, "top": nn.Linear(DIM, 1)})
    layer(torch.arange(6).view(3, 1, 2))
    sk.save_checkpoint(str(tmp_path), model)
    dense_path = tmp_path / (tmp_path / "LATEST").read_text() / "dense.pt"
    dense = torch.load(dense_path, weights_only=True)
    old = model.state_dict()
    dense["model"].update({"b.weight": old["b.weight"], "b._extra_state": old["b._extra_state"]})
    torch.save(dense, dense_path)
    fresh_layer = sk.DistributedEmbedding("sum", 32, DIM, 1, 2)
    fresh = nn.ModuleDict({"a": fresh_layer, "b": fresh_layer, "top": nn.Linear(DIM, 1)})
    sk.load_checkpoint(str(tmp_path), fresh)
    assert torch.equal(fresh_layer.hash_table.export()[0].sort().values, torch.arange(6))
    assert torch.equal(fresh["top"].weight, model["top"].weight)


@pytest.mark.distributed
def test_a_layer_registered_under_two_names_saves_and_loads_on_every_rank(tmp_path):
    """named_modules() lists a shared layer once, state_dict() under both names: the second
    name's shard went into dense.pt, and a load at world 2 refused it on rank 1 only, after
    that rank's optimizer state was replaced (rank 0 then waited in its next collective)."""
    directory = str(tmp_path / "ckpt")
    spawn(_aliased_layer_worker, 2, str(tmp_path), directory, "save")
    dense = torch.load(os.path.join(directory, "ckpt-000001", "dense.pt"), weights_only=True)
    assert not [key for key in dense["model"] if key.startswith(("a.", "b."))], list(dense["model"])
    spawn(_aliased_layer_worker, 2, str(tmp_path), directory, "load")


def test_an_optimizer_state_the_optimizer_refuses_changes_nothing(tmp_path):
    """LazyAdam's load refuses a saved learning rate < 0; the model's dense state was loaded before it."""

    def damage(optimizer_state):
        optimizer_state["param_groups"][0]["lr"] = -1.0
        return optimizer_state

    _load_refuses_a_damaged_optimizer_state(tmp_path, damage, r"invalid learning rate lr -1.0")


def _load_refuses_a_damaged_optimizer_state(tmp_path, damage, message):
    """A checkpoint whose dense.pt optimizer entry is ``damage(entry)``: a trained model and
    optimizer refuse it with ``message`` and stay as they were."""
    directory, folder, _ = _saved(tmp_path)
    dense_path = os.path.join(folder, "dense.pt")
    dense = torch.load(dense_path, weights_only=True)
    dense["optimizer"] = damage(dense["optimizer"])
    torch.save(dense, dense_path)
    _load_is_refused_and_changes_nothing(directory, message)


@pytest.mark.parametrize("damage", [
    lambda optimizer_state: "not a state_dict",
    lambda optimizer_state: {**optimizer_state, "state": ["not", "a", "dict"]},
    lambda optimizer_state: {**optimizer_state, "state": {0: "not a dict"}},
    lambda optimizer_state: {**optimizer_state, "param_groups": ["not a dict"]},
    lambda optimizer_state: {**optimizer_state, "param_groups": [{**optimizer_state["param_groups"][0], "params": 7}]},
])
def test_a_saved_optimizer_state_of_the_wrong_shape_is_refused_and_changes_nothing(tmp_path, damage):
    """A dense.pt whose optimizer entry is not a state_dict's shape is a ValueError naming
    the file (its checks had read it with .get and .items and raised an AttributeError)."""
    _load_refuses_a_damaged_optimizer_state(
        tmp_path, damage, r"dense.pt: the saved optimizer state is not an optimizer's state_dict")


@pytest.mark.parametrize("call", [sk.save_checkpoint, sk.load_checkpoint])
def test_a_model_or_optimizer_of_the_wrong_type_is_named(tmp_path, call):
    directory, _, _ = _saved(tmp_path)
    model, optimizer = make()
    name = call.__name__
    with pytest.raises(TypeError, match=rf"{name}: model must be a torch.nn.Module, got OrderedDict"):
        call(directory, model.state_dict(), optimizer)
    with pytest.raises(TypeError, match=rf"{name}: optimizer must be a torch.optim.Optimizer \(or have its "
                                        r"param_groups, state, state_dict, load_state_dict\) or None, got dict"):
        call(directory, model, optimizer.state_dict())
    assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000001"]


    for bad, kind in ((5, "int"), (directory.encode(), "bytes")):  # bytes: os.path.join could not mix them
        with pytest.raises(TypeError, match=rf"{name}: directory must be a path \(str or os.PathLike of str\), "
                                            rf"got {kind}"):
            call(bad, model, optimizer)


def _optimizer_on_one_rank_worker(rank, world_size, init, directory, call):
    init()
    model, optimizer = make()
    if call == "load":
        sk.save_checkpoint(directory, model, optimizer)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"the ranks disagree on the optimizer: rank 0 passed one, rank\(s\) \[1\] "
                                         r"None; pass the optimizer on every rank or on none"):
        getattr(sk, f"{call}_checkpoint")(directory, model, optimizer if rank == 0 else None)
    assert_same(model, optimizer, before)
    assert sorted(os.listdir(directory)) == (["LATEST", "ckpt-000001"] if call == "load" else [])


@pytest.mark.distributed
@pytest.mark.parametrize("call", ["save", "load"])
def test_an_optimizer_passed_on_some_ranks_only_raises_on_every_rank(tmp_path, call):
    """No rank raised: a save wrote rank 0's choice in the metadata and the other ranks'
    rows with or without their moments, so a later load continued some keys with zeroed
    moments (or refused every optimizer); a load left the ranks' dense Adam states apart."""
    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    spawn(_optimizer_on_one_rank_worker, 2, str(tmp_path), directory, call)


class _DelegatingOptimizer:
    """An optimizer wrapper that is no torch.optim.Optimizer subclass (as Lightning's is)."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


class _WithExtraState(nn.Module):
    """A submodule whose extra state is a dict (no tensor, no shape) in the dense state."""

    def __init__(self):
        super().__init__()
        self.note = {"epoch": 3}

    def get_extra_state(self):
        return dict(self.note)

    def set_extra_state(self, state):
        self.note = dict(state)


def test_a_wrapped_optimizer_and_a_dict_extra_state_save_and_load(tmp_path):
    """The optimizer is duck-typed (param_groups, state, state_dict, load_state_dict), and a
    dense entry that is not a tensor is saved and loaded as it is."""
    model, optimizer = make()
    model.extra = _WithExtraState()
    optimizer = LazyAdam(model.parameters(), lr=0.02)
    train(model, optimizer, range(2))
    sk.save_checkpoint(str(tmp_path), model, _DelegatingOptimizer(optimizer))
    restored, restored_optimizer = make()
    restored.extra = _WithExtraState()
    restored.extra.note = {}
    restored_optimizer = LazyAdam(restored.parameters(), lr=0.02)
    sk.load_checkpoint(str(tmp_path), restored, _DelegatingOptimizer(restored_optimizer))
    assert restored.extra.note == {"epoch": 3}
    assert torch.equal(torch.stack(train(restored, restored_optimizer, range(2, 4))),
                       torch.stack(train(model, optimizer, range(2, 4))))


def test_a_direct_layer_initializer_that_raises_changes_nothing(tmp_path):
    """A direct layer's rows the checkpoint lacks come from its initializer: it runs before
    anything is written, not after the dense state and the layers before it were loaded."""
    directory, _, _ = _saved(tmp_path)
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)

    def broken(keys, dim):
        raise RuntimeError("simulated initializer failure")

    model.direct.embedding_initializer = broken
    with pytest.raises(RuntimeError, match="simulated initializer failure"):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)


def test_a_file_in_place_of_the_directory_is_named(tmp_path):
    """Both calls name their argument and the file in the way, not the LATEST file under it."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    model, optimizer = make()
    train(model, optimizer, range(1))
    before = snapshot(model, optimizer)
    with pytest.raises(NotADirectoryError, match=r"load_checkpoint: directory .*a_file' is a file; give the directory"):
        sk.load_checkpoint(str(a_file), model, optimizer)
    with pytest.raises(NotADirectoryError,
                       match=r"load_checkpoint: directory .*a_file/sub' lies under .*a_file', which is a file"):
        sk.load_checkpoint(str(a_file / "sub"), model, optimizer)
    with pytest.raises(NotADirectoryError,
                       match=r"save_checkpoint: directory .*a_file/sub/deeper' lies under .*a_file', which is a file"):
        sk.save_checkpoint(str(a_file / "sub" / "deeper"), model, optimizer)
    assert a_file.read_text() == "x"
    assert_same(model, optimizer, before)


# ---- key dtypes: int64 keys do not load into int32 layers ------------------------------------


def _keyed_model(key_dtype=torch.int64, admit_after=1):
    """A hash-table layer of ``key_dtype`` beside a dense layer, under one LazyAdam."""
    model = nn.ModuleDict({"emb": sk.DistributedEmbedding("sum", 8, DIM, 1, 1, key_dtype=key_dtype,
                                                          admit_after=admit_after),
                           "lin": nn.Linear(2, 2)})
    return model, LazyAdam(model.parameters(), lr=0.1)


def _keyed_step(model, optimizer, keys):
    emb = model["emb"]
    out = emb(torch.tensor([[[key]] for key in keys], dtype=emb.key_dtype)).sum() + model["lin"](torch.ones(1, 2)).sum()
    out.backward()
    optimizer.step()
    optimizer.zero_grad()


def _keyed_snapshot(model, optimizer):
    """Everything a load could change: parameters, the layer's tables and totals, the optimizer."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "stats": model["emb"].stats()})


@pytest.mark.parametrize("saved_keys, named", [
    ([2**32 + 7], 2**32 + 7),         # loaded as key 7 with the vector of 2**32 + 7
    ([2**32 + 7, 7], 2**32 + 7),      # collide once truncated: raised after the dense state was loaded
    ([5, -(2**31) - 1], -(2**31) - 1),
])
def test_int64_keys_outside_int32_do_not_load_into_an_int32_layer(tmp_path, saved_keys, named):
    _assert_int32_load_refused(tmp_path, [saved_keys], rf"load_checkpoint: layer 'emb' has key_dtype=torch.int32 "
                                                       rf"but the checkpoint holds key {named} outside its range")


def _assert_int32_load_refused(tmp_path, steps, message, admit_after=1):
    """A checkpoint of an int64 layer trained on ``steps`` (lists of keys) does not load into
    an int32 layer that has trained one step: ValueError matching ``message``, nothing changed."""
    source, source_optimizer = _keyed_model(admit_after=admit_after)
    for keys in steps:
        _keyed_step(source, source_optimizer, keys)
    sk.save_checkpoint(str(tmp_path), source, source_optimizer)
    model, optimizer = _keyed_model(torch.int32, admit_after=admit_after)
    _keyed_step(model, optimizer, [3])
    before = _keyed_snapshot(model, optimizer)
    with pytest.raises(ValueError, match=message):
        sk.load_checkpoint(str(tmp_path), model, optimizer)
    assert_equal_nested(_keyed_snapshot(model, optimizer), before)
    return source


def test_int64_keys_inside_int32_load_into_an_int32_layer(tmp_path):
    keys = [7, -(2**31), 2**31 - 1]
    source, source_optimizer = _keyed_model()
    _keyed_step(source, source_optimizer, keys)
    sk.save_checkpoint(str(tmp_path), source, source_optimizer)
    model, optimizer = _keyed_model(torch.int32)
    sk.load_checkpoint(str(tmp_path), model, optimizer)
    loaded_keys, _ = model["emb"].hash_table.export()
    assert loaded_keys.dtype == torch.int32 and loaded_keys.tolist() == keys
    assert torch.equal(model["emb"].weight, source["emb"].weight)
    assert torch.equal(optimizer.state[model["emb"].weight]["exp_avg"],
                       source_optimizer.state[source["emb"].weight]["exp_avg"])


def test_a_pending_key_outside_int32_does_not_load_into_an_int32_layer(tmp_path):
    source = _assert_int32_load_refused(
        tmp_path, [[5], [5], [5, 2**33]],  # 5 is admitted, 2**33 waits
        rf"layer 'emb' has key_dtype=torch.int32 but the checkpoint holds pending key {2**33} outside its range",
        admit_after=3)
    assert source["emb"].stats()["pending"] == 1


def _int32_on_rank_1_worker(rank, world_size, init, directory):
    init()
    model, optimizer = _keyed_model(torch.int32 if rank == 1 else torch.int64)
    before = _keyed_snapshot(model, optimizer)
    expected = r"key 4294967303 outside its range" if rank == 1 else "failed on another rank"
    with pytest.raises((ValueError, RuntimeError), match=expected):
        sk.load_checkpoint(directory, model, optimizer)
    assert_equal_nested(_keyed_snapshot(model, optimizer), before)


@pytest.mark.distributed
def test_an_out_of_range_key_on_one_rank_raises_on_every_rank(tmp_path):
    directory = str(tmp_path / "ckpt")
    source, source_optimizer = _keyed_model()
    _keyed_step(source, source_optimizer, [2**32 + 7, 7, 8])
    sk.save_checkpoint(directory, source, source_optimizer)
    spawn(_int32_on_rank_1_worker, 2, str(tmp_path), directory)


# ---- nn.Module and HashTable state dicts -----------------------------------------------------


def _duplicate_main_key(extra):
    extra["keys"][1] = extra["keys"][0]


def _bad_total(extra):
    extra["evicted"] = torch.tensor([1.0, 2.0])


def _bad_pending_scores(extra):
    extra["pending"]["last_seen"] = extra["pending"]["last_seen"].float()


@pytest.mark.parametrize("damage, message", [
    (_duplicate_main_key, r"DistributedEmbedding: load_state_dict: '_extra_state' \(the hash table\): "
                          r"HashTable.load_state_dict: the saved keys are not distinct"),
    (_bad_total, r"DistributedEmbedding: load_state_dict: '_extra_state'\['evicted'\] must be a non-negative int"),
    (_bad_pending_scores, r"DistributedEmbedding: load_state_dict: '_extra_state'\['pending'\] \(the pending "
                          r"admissions\): .*'last_seen' must be int64"),
])
def test_a_layer_load_state_dict_that_raises_changes_nothing(damage, message):
    """The pending admissions were loaded before the main table's keys were checked, and
    the weight before either (nn.Module copies parameters before set_extra_state)."""
    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 1, admit_after=3)
    for step in range(3):
        layer(torch.tensor([[[1]], [[2]], [[3 + step]]]))
    assert layer.stats() == {"size": 2, "capacity": 16, "evicted": 0, "admitted": 2, "pending": 3}
    before = copy.deepcopy({"state": layer.state_dict(), "stats": layer.stats()})
    bad = copy.deepcopy(before["state"])
    bad["weight"] = torch.ones_like(bad["weight"])
    bad["_extra_state"]["pending"]["keys"] = torch.tensor([11, 12, 13])
    damage(bad["_extra_state"])
    with pytest.raises((ValueError, TypeError), match=message):
        layer.load_state_dict(bad)
    assert_equal_nested({"state": layer.state_dict(), "stats": layer.stats()}, before)

    # The same state undamaged loads (pending keys and weight included).
    good = copy.deepcopy(before["state"])
    good["_extra_state"]["pending"]["keys"] = torch.tensor([11, 12, 13])
    layer.load_state_dict(good)
    assert layer.state_dict()["_extra_state"]["pending"]["keys"].tolist() == [11, 12, 13]


@pytest.mark.parametrize("entry", ["keys", "last_seen", "count", "clock"])
def test_hash_table_load_state_dict_of_a_meta_tensor(entry):
    table = sk.HashTable(8)
    table.insert(torch.tensor([4, 5]))
    before = copy.deepcopy(table.state_dict())
    state = {"keys": torch.tensor([1, 2, 3]), "last_seen": torch.zeros(3, dtype=torch.int64),
             "count": torch.ones(3, dtype=torch.int64), "clock": torch.tensor(2)}
    state[entry] = torch.empty(state[entry].shape, dtype=state[entry].dtype, device="meta")
    with pytest.raises(ValueError, match=rf"HashTable.load_state_dict: '{entry}' is a meta tensor, which holds "
                                         "no data"):
        table.load_state_dict(state)
    assert_equal_nested(table.state_dict(), before)
    assert len(table) == 2 and table.clock == 0


def _directories_differ_worker(rank, world_size, init, tmp_dir):
    init()
    model, optimizer = make()
    train(model, optimizer, range(1))
    # A file in place of the directory on rank 1 only: rank 0 waited in the save's first
    # collective until the group's timeout, since rank 1 raised before it.
    a_file = os.path.join(tmp_dir, "a_file")
    target = a_file if rank == 1 else os.path.join(tmp_dir, "shared")
    expected = "is a file" if rank == 1 else "failed on another rank"
    with pytest.raises((NotADirectoryError, RuntimeError), match=expected):
        sk.save_checkpoint(target, model, optimizer)
    # Directories of one name that are not one directory (rank 1 sees a stale copy of
    # another run): every rank refuses to load, before anything changes.
    sk.save_checkpoint(os.path.join(tmp_dir, "shared"), model, optimizer)
    before = snapshot(model, optimizer)
    directory = os.path.join(tmp_dir, "shared" if rank == 0 else "stale")
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] found another checkpoint in .* than rank 0"):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)
    # And a save where the ranks read different latest checkpoints writes nothing.
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] found another latest checkpoint"):
        sk.save_checkpoint(os.path.join(tmp_dir, "shared" if rank == 0 else "empty"), model, optimizer)
    assert sorted(os.listdir(os.path.join(tmp_dir, "shared"))) == ["LATEST", "ckpt-000001"]


def _models_differ_on_save_worker(rank, world_size, init, directory):
    init()
    model, optimizer = make()
    sk.save_checkpoint(directory, model, optimizer)  # ckpt-000001, alike on both ranks
    variants = [
        lambda m: setattr(m, "pooled", sk.DistributedEmbedding("mean", HASH_ROWS, DIM + 1, SLOTS, NNZ)),
        lambda m: setattr(m, "direct", sk.All2AllDenseEmbedding(DIRECT_KEYS, DIM, SLOTS, NNZ)),  # hashed
        lambda m: setattr(m, "extra", sk.DistributedEmbedding("sum", 8, DIM, 1, 1)),
        lambda m: setattr(m, "top", nn.Linear(2 * SLOTS * DIM, 2)),
    ]
    for change in variants:
        model, optimizer = make()
        if rank == 1:
            change(model)
            optimizer = LazyAdam(model.parameters(), lr=0.02)
        with pytest.raises(ValueError, match=r"save_checkpoint: rank\(s\) \[1\] hold other embedding layers, "
                                             r"layer settings or dense parameters than rank 0"):
            sk.save_checkpoint(directory, model, optimizer)
        assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000001"]


@pytest.mark.distributed
def test_a_save_whose_ranks_models_differ_raises_on_every_rank_and_writes_nothing(tmp_path):
    """Rank 0 alone writes the metadata and the dense state: a rank built otherwise (a dim,
    a direct layer hashed, a layer more, a dense shape) wrote shards that no load could
    read, and LATEST named them."""
    spawn(_models_differ_on_save_worker, 2, str(tmp_path), str(tmp_path / "ckpt"))


@pytest.mark.distributed
def test_ranks_that_do_not_share_the_checkpoint_directory_all_raise(tmp_path):
    open(tmp_path / "a_file", "w").close()
    model, optimizer = make()  # a checkpoint of another run, as rank 1's "stale" copy
    train(model, optimizer, range(2))
    sk.save_checkpoint(str(tmp_path / "stale"), model, optimizer)
    spawn(_directories_differ_worker, 2, str(tmp_path), str(tmp_path))


# ---- optimizer state: what LazyAdam's next step reads, and nothing left of the old ----------


def _rewrite_layer(directory, layer, change):
    """``change(part)`` on ``layer``'s part of every shard of the latest checkpoint."""
    with open(os.path.join(directory, "LATEST")) as latest:
        folder = os.path.join(directory, latest.read())
    for path in sorted(glob.glob(os.path.join(folder, "shard-*.pt"))):
        shard = torch.load(path, weights_only=True)
        change(shard["layers"][layer])
        torch.save(shard, path)


@pytest.mark.parametrize("change", [
    lambda part: part["scalars"].update(step=int(part["scalars"]["step"])),        # a number
    lambda part: part["scalars"].update(step=part["scalars"]["step"].long()),      # an int64 tensor
    lambda part: part["scalars"].update(step=part["scalars"]["step"].reshape(1)),  # one element, 1-D
    lambda part: part["state"].update({k: v.double() for k, v in part["state"].items()}),  # float64 moments
])
def test_a_saved_state_lazy_adam_accepts_loads_as_it_keeps_it_and_continues(tmp_path, change):
    """What LazyAdam.load_state_dict accepts (a step as a number or a one-element tensor,
    float64 moments of a float32 weight) loads as a state its next step takes (an int64
    step was loaded as it was, and the step raised), and continues as the checkpoint does."""
    directory, _, _ = _saved(tmp_path)
    expected, expected_optimizer = make()
    sk.load_checkpoint(directory, expected, expected_optimizer)
    _rewrite_layer(directory, "pooled", change)
    model, optimizer = make()
    sk.load_checkpoint(directory, model, optimizer)
    step = optimizer.state[model.pooled.weight]["step"]
    assert step.dim() == 0 and step.dtype in (torch.float32, torch.float64) and step.item() == STEPS_BEFORE
    torch.testing.assert_close(torch.stack(train(model, optimizer, range(2, 4))),
                               torch.stack(train(expected, expected_optimizer, range(2, 4))), rtol=1e-6, atol=1e-7)


def _one_table(dtype):
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 8, ["f"],
                                                    dtype=torch.float32 if dtype == torch.float64 else dtype)])
    ebc = ebc.double() if dtype == torch.float64 else ebc
    return ebc, LazyAdam(ebc.parameters(), lr=0.1)


def _one_table_step(ebc, optimizer, keys):
    out = ebc(sk.KeyedJagged(["f"], torch.tensor(keys), lengths=torch.ones(len(keys), dtype=torch.long)))
    out["f"].float().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("weight, moments, loads", [
    (torch.float16, torch.float16, True), (torch.float16, torch.float32, True), (torch.float16, torch.float64, True),
    (torch.float16, torch.bfloat16, False), (torch.bfloat16, torch.float16, False),
    (torch.float64, torch.float64, True), (torch.float64, torch.float32, True), (torch.float64, torch.float16, False),
])
def test_a_tables_moments_load_in_exactly_the_dtypes_lazy_adam_updates_it_with(tmp_path, weight, moments, loads):
    """LazyAdam updates a weight with moments of its dtype, float32 or float64 (both alike);
    others loaded, and its next step raised with the model and optimizer replaced."""
    saved, saved_optimizer = _one_table(weight)
    _one_table_step(saved, saved_optimizer, [1, 2])
    sk.save_checkpoint(str(tmp_path), saved, saved_optimizer)
    _rewrite_layer(str(tmp_path), "shards.0", lambda part: part["state"].update(
        {key: value.to(moments) for key, value in part["state"].items()}))
    model, optimizer = _one_table(weight)
    _one_table_step(model, optimizer, [5])
    before = _keyed_snapshot_of(model, optimizer)
    if loads:
        sk.load_checkpoint(str(tmp_path), model, optimizer)
        assert optimizer.state[model.weights["t"]]["exp_avg"].dtype == moments
        _one_table_step(model, optimizer, [1, 3])
        return
    allowed = ", ".join(map(str, [weight] + [d for d in (torch.float32, torch.float64) if d != weight]))
    with pytest.raises(ValueError, match=rf"shard-00000-of-00001.pt: layer 'shards.0': the saved optimizer state "
                                         rf"'exp_avg' must be floating point of a dtype LazyAdam updates a {weight} "
                                         rf"weight with \({allowed}\), got {moments}"):
        sk.load_checkpoint(str(tmp_path), model, optimizer)
    assert_equal_nested(_keyed_snapshot_of(model, optimizer), before)


def _keyed_snapshot_of(model, optimizer):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def test_a_wrapped_lazy_adam_gets_lazy_adams_checks(tmp_path):
    directory, folder, _ = _saved(tmp_path)
    _rewrite_shard(folder, _no_exp_avg_sq)
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"layer 'pooled': the saved optimizer state lacks \['exp_avg_sq'\]"):
        sk.load_checkpoint(directory, model, _DelegatingOptimizer(optimizer))
    assert_same(model, optimizer, before)


def test_a_checkpoint_without_optimizer_refuses_an_optimizer_and_changes_nothing(tmp_path):
    """The weights alone loaded into a trained optimizer, which kept its moments and steps:
    key 100 took key 300's row, and with it key 300's exp_avg and step."""
    directory = str(tmp_path / "ckpt")
    saved, saved_optimizer = make()
    train(saved, saved_optimizer, range(2))
    sk.save_checkpoint(directory, saved)  # no optimizer
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"dense.pt: the checkpoint was saved without an optimizer, so it holds no "
                                         r"optimizer state to continue from; pass optimizer=None"):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)
    sk.load_checkpoint(directory, model)  # the weights only, as asked
    assert torch.equal(model.top.weight, saved.top.weight)


def _partly_stepped_model():
    model = nn.ModuleDict({"emb": sk.DistributedEmbedding("sum", 8, DIM, 1, 1), "lin": nn.Linear(2, 2),
                           "idle": nn.Linear(2, 2)})
    return model, LazyAdam(model.parameters(), lr=0.1)


def _partly_stepped_step(model, optimizer, key=None, idle=False):
    out = model["lin"](torch.ones(1, 2)).sum()
    if key is not None:
        out = out + model["emb"](torch.tensor([[[key]]])).sum()
    if idle:
        out = out + model["idle"](torch.ones(1, 2)).sum()
    out.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_parameters_saved_without_optimizer_state_load_without_any(tmp_path):
    """An embedding layer and a dense layer the saved optimizer never stepped: the loading
    optimizer keeps no state for them (its own moments and step would go on, on rows that
    now hold other keys), so the next step is their first, as in the saved run."""
    saved, saved_optimizer = _partly_stepped_model()
    saved["emb"](torch.tensor([[[100]]]))  # key 100 takes row 0 but is never stepped
    _partly_stepped_step(saved, saved_optimizer)
    sk.save_checkpoint(str(tmp_path), saved, saved_optimizer)
    model, optimizer = _partly_stepped_model()
    _partly_stepped_step(model, optimizer, key=300, idle=True)  # key 300 in row 0, with moments
    sk.load_checkpoint(str(tmp_path), model, optimizer)
    assert model["emb"].hash_table.export()[0].tolist() == [100]
    for param in (model["emb"].weight, model["idle"].weight, model["idle"].bias):
        assert not optimizer.state.get(param)
    for run in ((model, optimizer), (saved, saved_optimizer)):
        _partly_stepped_step(*run, key=100, idle=True)
    assert_equal_nested(_keyed_snapshot_of(model, optimizer), _keyed_snapshot_of(saved, saved_optimizer))


def _damaged_checkpoints_save_worker(rank, world_size, init, tmp_dir):
    init()
    model, optimizer = make()
    train(model, optimizer, range(STEPS_BEFORE), rank, world_size)
    sk.save_checkpoint(os.path.join(tmp_dir, "a"), model, optimizer)
    sk.save_checkpoint(os.path.join(tmp_dir, "c"), model, optimizer)
    sk.save_checkpoint(os.path.join(tmp_dir, "b"), model)  # no optimizer


def _damaged_checkpoints_load_worker(rank, world_size, init, tmp_dir):
    init()
    model, optimizer = make()
    train(model, optimizer, range(5, 6), rank, world_size)
    before = snapshot(model, optimizer)
    for name, message in (
            ("a", r"shard-00001-of-00002.pt: layer 'pooled': the saved optimizer state lacks \['exp_avg_sq'\]"),
            ("b", r"the checkpoint was saved without an optimizer"),
            ("c", r"layer 'direct' \(use_hashtable=False\): the checkpoint holds key -5 but")):
        # Every rank reads every file: each names the cause, none just "failed on another rank".
        with pytest.raises(ValueError, match=message):
            sk.load_checkpoint(os.path.join(tmp_dir, name), model, optimizer)
        assert_same(model, optimizer, before)


@pytest.mark.distributed
def test_damaged_or_optimizerless_checkpoints_raise_on_every_rank_and_change_nothing(tmp_path):
    spawn(_damaged_checkpoints_save_worker, 2, str(tmp_path), str(tmp_path))

    def damage(name, change):
        path = os.path.join(str(tmp_path), name, "ckpt-000001", "shard-00001-of-00002.pt")
        shard = torch.load(path, weights_only=True)
        change(shard["layers"])
        torch.save(shard, path)

    damage("a", lambda layers: layers["pooled"]["state"].pop("exp_avg_sq"))
    damage("c", lambda layers: layers["direct"]["keys"].__setitem__(0, -5))
    spawn(_damaged_checkpoints_load_worker, 2, str(tmp_path), str(tmp_path))


@pytest.mark.parametrize("keys, named", [([-5], -5), ([-5, 30], -5), ([-5, -7], -7), ([25, 30, 21], 30)])
def test_a_direct_layer_names_the_saved_key_it_has_no_row_for(tmp_path, keys, named):
    """A negative key was named as keys.max(), a valid key: the smallest key below 0 is
    named, else the largest above the range."""
    directory, _, _ = _saved(tmp_path)
    _rewrite_layer(directory, "direct", lambda part: part["keys"].__setitem__(slice(len(keys)), torch.tensor(keys)))
    model, optimizer = make()
    train(model, optimizer, range(5, 6))
    before = snapshot(model, optimizer)
    more = len(keys) - 1
    with pytest.raises(ValueError, match=rf"layer 'direct' \(use_hashtable=False\): the checkpoint holds key {named}"
                                         rf"{f' [(]and {more} more outside that range[)]' if more else ''} but the "
                                         rf"layer's keys must lie in \[0, {DIRECT_KEYS}\) on 1 ranks; "
                                         + ("a direct layer has no row for a negative key" if named < 0 else
                                            "build it with a larger max_vocabulary_size_per_gpu")):
        sk.load_checkpoint(directory, model, optimizer)
    assert_same(model, optimizer, before)


# ---- optimizers other than LazyAdam, settings, wrapped submodules, modes ---------------------


def _adagrad_model():
    torch.manual_seed(0)
    model = nn.ModuleDict({"hashed": sk.DistributedEmbedding("sum", 32, 4, 1, 2),
                           "direct": sk.DistributedEmbedding("sum", 40, 4, 1, 2, use_hashtable=False)})
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)


def _adagrad_step(model, optimizer, keys):
    keys = torch.tensor(keys).view(-1, 1, 2)
    (model["hashed"](keys).pow(2).sum() + model["direct"](keys).pow(2).sum()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_rows_without_a_saved_key_get_the_optimizers_initial_state(tmp_path):
    """Adagrad's sums start at initial_accumulator_value, not 0: a key first seen after the
    resume trains as in the uninterrupted run (the rows no saved key held got zeros)."""
    reference, ref_optimizer = _adagrad_model()
    model, optimizer = _adagrad_model()
    for m, o in ((reference, ref_optimizer), (model, optimizer)):
        _adagrad_step(m, o, [[1, 2]])
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    loaded, loaded_optimizer = _adagrad_model()
    sk.load_checkpoint(str(tmp_path), loaded, loaded_optimizer)
    for m, o in ((reference, ref_optimizer), (loaded, loaded_optimizer)):
        _adagrad_step(m, o, [[5, 1], [7, 2]])  # 5 and 7 are new
    for name in ("hashed", "direct"):
        keys = torch.tensor([1, 2, 5, 7])
        rows = [(reference[name].hash_table.find(keys) if name == "hashed" else keys),
                (loaded[name].hash_table.find(keys) if name == "hashed" else keys)]
        assert torch.equal(loaded[name].weight[rows[1]], reference[name].weight[rows[0]])
        assert torch.equal(loaded_optimizer.state[loaded[name].weight]["sum"][rows[1]],
                           ref_optimizer.state[reference[name].weight]["sum"][rows[0]])
    # Only the direct rows that moved or whose sums left the initial value were saved.
    shard = torch.load(glob.glob(str(tmp_path / "ckpt-*" / "shard-*"))[0], weights_only=True)
    assert sorted(shard["layers"]["direct"]["keys"].tolist()) == [1, 2]


def test_a_full_table_loaded_into_a_larger_one_gives_the_new_rows_adagrads_initial_sums(tmp_path):
    """No row of a full table is free, so the saved rows say nothing of the initial state:
    the loading optimizer's initial_accumulator_value gives it."""
    def build(capacity):
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": sk.DistributedEmbedding("sum", capacity, 4, 1, 2)})
        return model, torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)
    model, optimizer = build(4)
    model["emb"](torch.tensor([[[1, 2]], [[3, 4]]])).pow(2).sum().backward()
    optimizer.step()
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    loaded, loaded_optimizer = build(8)
    sk.load_checkpoint(str(tmp_path), loaded, loaded_optimizer)
    sums = loaded_optimizer.state[loaded["emb"].weight]["sum"]
    assert torch.equal(sums[:4], optimizer.state[model["emb"].weight]["sum"])
    assert torch.all(sums[4:] == 0.1)


@pytest.mark.parametrize("lr", ["numpy", "fraction"])
def test_settings_an_lr_scheduler_makes_save_as_plain_numbers(tmp_path, lr):
    """A scheduler's numpy float (or a Fraction) lr, which LazyAdam takes: the checkpoint
    loads with weights_only (it was called damaged) and continues with the same lr."""
    import fractions

    import numpy as np

    model, optimizer = make()
    train(model, optimizer, range(1))
    value = np.float64(0.015) if lr == "numpy" else fractions.Fraction(3, 200)
    optimizer.param_groups[0]["lr"] = value
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    loaded, loaded_optimizer = make()
    sk.load_checkpoint(str(tmp_path), loaded, loaded_optimizer)
    assert type(loaded_optimizer.param_groups[0]["lr"]) is float
    assert loaded_optimizer.param_groups[0]["lr"] == float(value)


def test_a_model_built_under_inference_mode_loads_a_checkpoint(tmp_path):
    """Serving: the model and the load under torch.inference_mode(), no optimizer."""
    model, optimizer = make()
    train(model, optimizer, range(STEPS_BEFORE))
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    with torch.inference_mode():
        served = Model()
        sk.load_checkpoint(str(tmp_path), served)
        pooled, direct, _ = batch(STEPS_BEFORE)
        served.eval()
        model.eval()
        assert torch.equal(served(pooled, direct), model(pooled, direct))


def test_a_load_under_inference_mode_gives_state_a_step_can_update(tmp_path):
    """Under torch.inference_mode() the loaded state was inference tensors: the next step
    updated the embedding rows, then failed on the step counter."""
    model, optimizer = make()
    train(model, optimizer, range(STEPS_BEFORE))
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    reference, ref_optimizer = make()
    sk.load_checkpoint(str(tmp_path), reference, ref_optimizer)
    loaded, loaded_optimizer = make()
    with torch.inference_mode():
        sk.load_checkpoint(str(tmp_path), loaded, loaded_optimizer)
    assert not any(v.is_inference() for state in loaded_optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))
    train(loaded, loaded_optimizer, range(STEPS_BEFORE, STEPS_BEFORE + 1))
    train(reference, ref_optimizer, range(STEPS_BEFORE, STEPS_BEFORE + 1))
    assert torch.equal(loaded.pooled.weight, reference.pooled.weight)


class _Towers(nn.Module):
    def __init__(self, compiled):
        super().__init__()
        torch.manual_seed(0)
        self.emb = sk.DistributedEmbedding("sum", 32, 4, 2, 3)
        self.top = nn.Sequential(nn.Linear(8, 1))
        if compiled:  # compiled parts, not the whole model
            self.emb = torch.compile(self.emb, backend="eager")
            self.top = torch.compile(self.top, backend="eager")

    def forward(self, keys):
        return self.top(self.emb(keys).flatten(1))


@pytest.mark.parametrize("saved, loaded", [(True, False), (False, True)])
def test_a_model_with_compiled_submodules_saves_and_loads_as_the_plain_one(tmp_path, saved, loaded):
    """Compiling a submodule adds "_orig_mod." inside the names: the checkpoint names the
    plain model's layers and dense entries, so either model loads the other's."""
    model = _Towers(saved)
    optimizer = LazyAdam(model.parameters(), lr=0.1)
    model(torch.tensor([[[1, 2, 3], [4, 5, 6]]])).sum().backward()
    optimizer.step()
    path = sk.save_checkpoint(str(tmp_path), model, optimizer)
    with open(os.path.join(path, "metadata.json")) as file:
        assert list(json.load(file)["layers"]) == ["emb"]
    assert sorted(torch.load(os.path.join(path, "dense.pt"), weights_only=True)["model"]) == ["top.0.bias",
                                                                                            "top.0.weight"]
    other = _Towers(loaded)
    other_optimizer = LazyAdam(other.parameters(), lr=0.1)
    sk.load_checkpoint(str(tmp_path), other, other_optimizer)
    plain = [m._orig_mod if hasattr(m, "_orig_mod") else m for m in (model.emb, other.emb, model.top, other.top)]
    assert torch.equal(plain[0].weight, plain[1].weight)
    assert torch.equal(plain[2][0].weight, plain[3][0].weight)


def test_saving_a_layer_whose_initializer_draws_from_the_global_rng_leaves_the_rng_alone(tmp_path):
    """The save compares a direct layer's rows with its initial ones: a torch.randn
    initializer moved the training's random stream (dropout, sampling) at every save."""
    layer = sk.DistributedEmbedding("sum", 100, 4, 1, 2, use_hashtable=False,
                                    embedding_initializer=lambda keys, dim: torch.randn(keys.numel(), dim) * 0.01)
    model = nn.ModuleDict({"emb": layer})
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    sk.save_checkpoint(str(tmp_path), model)
    sk.load_checkpoint(str(tmp_path), model)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("world_size", ["missing", "two", 0, True])
def test_a_layer_without_a_valid_world_size_in_metadata_is_named(tmp_path, world_size):
    model = nn.ModuleDict({"emb": sk.DistributedEmbedding("sum", 32, 4, 1, 2)})
    path = sk.save_checkpoint(str(tmp_path), model)
    meta_path = os.path.join(path, "metadata.json")
    with open(meta_path) as file:
        metadata = json.load(file)
    if world_size == "missing":
        del metadata["layers"]["emb"]["world_size"]
    else:
        metadata["layers"]["emb"]["world_size"] = world_size
    with open(meta_path, "w") as file:
        json.dump(metadata, file)
    with pytest.raises(ValueError, match=r"metadata.json: layer 'emb' has no valid 'world_size'"):
        sk.load_checkpoint(str(tmp_path), model)


def test_a_checkpoint_that_kept_compile_names_still_loads(tmp_path):
    """Checkpoints saved before names were made plain kept "_orig_mod" for a compiled
    submodule (layers 'emb._orig_mod', dense 'top._orig_mod.0.weight'): they still load,
    into the compiled model as into the plain one."""
    model = _Towers(False)
    path = sk.save_checkpoint(str(tmp_path), model)
    with open(os.path.join(path, "metadata.json")) as file:
        metadata = json.load(file)
    metadata["layers"] = {"emb._orig_mod": metadata["layers"]["emb"]}
    with open(os.path.join(path, "metadata.json"), "w") as file:
        json.dump(metadata, file)
    for name in glob.glob(os.path.join(path, "shard-*")):
        shard = torch.load(name, weights_only=True)
        shard["layers"] = {"emb._orig_mod": shard["layers"]["emb"]}
        torch.save(shard, name)
    dense = torch.load(os.path.join(path, "dense.pt"), weights_only=True)
    dense["model"] = {key.replace("top.", "top._orig_mod."): value for key, value in dense["model"].items()}
    torch.save(dense, os.path.join(path, "dense.pt"))
    for compiled in (True, False):
        other = _Towers(compiled)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        sk.load_checkpoint(str(tmp_path), other)
        emb = other.emb._orig_mod if compiled else other.emb
        top = other.top._orig_mod if compiled else other.top
        assert torch.equal(emb.weight, model.emb.weight) and torch.equal(top[0].weight, model.top[0].weight)


@pytest.mark.parametrize("where", ["extra_state", "dense_optimizer_state", "shard_optimizer_state"])
def test_a_save_that_weights_only_could_not_load_raises_and_keeps_the_previous_checkpoint(tmp_path, where):
    """A numpy scalar (or any object torch.load(weights_only=True) refuses) in a module's
    extra state or in the optimizer's state: the save raises naming the entry, before it is
    committed, where it made the unreadable checkpoint the latest and removed the good one."""
    import numpy as np

    model, optimizer = make()
    model.extra = _WithExtraState()
    train(model, optimizer, range(2))
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    if where == "extra_state":
        model.extra.note = {"epoch": np.int64(4)}
        named = "['epoch']"
    elif where == "dense_optimizer_state":
        optimizer.state[model.top.weight]["note"] = np.float64(1.5)
        named = "['note']"
    else:
        optimizer.state[model.pooled.weight]["note"] = np.float64(1.5)
        named = "['scalars']['note']"
    with pytest.raises(ValueError, match=r"weights_only.*previous checkpoint is kept") as raised:
        sk.save_checkpoint(str(tmp_path), model, optimizer)
    assert named in str(raised.value) and "numpy" in str(raised.value)
    assert (tmp_path / "LATEST").read_text() == "ckpt-000001"
    restored, restored_optimizer = make()
    restored.extra = _WithExtraState()
    sk.load_checkpoint(str(tmp_path), restored, restored_optimizer)
    assert restored.extra.note == {"epoch": 3}


def _as_meta(tensor):
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


@pytest.mark.parametrize("entry", ["weight", "exp_avg", "keys", "last_seen", "step", "sparse step", "dense",
                                   "dense optimizer", "sparse weight"])
def test_a_meta_or_sparse_tensor_in_a_checkpoint_is_named_and_changes_nothing(tmp_path, entry):
    """A meta tensor passed every check and failed while the rows were written, after the
    optimizer and the dense state had loaded and the layer's table was replaced and its
    weight zeroed; a sparse one failed in torch naming no file. Both are refused first."""
    directory, folder, _ = _saved(tmp_path)
    if entry == "dense":
        path = os.path.join(folder, "dense.pt")
        dense = torch.load(path, weights_only=True)
        dense["model"]["top.weight"] = _as_meta(dense["model"]["top.weight"])
        torch.save(dense, path)
        message = r"dense.pt: dense 'top.weight' is a meta tensor"
    elif entry == "dense optimizer":
        path = os.path.join(folder, "dense.pt")
        dense = torch.load(path, weights_only=True)
        state = next(iter(dense["optimizer"]["state"].values()))
        state["exp_avg"] = _as_meta(state["exp_avg"])
        torch.save(dense, path)
        message = r"dense.pt: optimizer state 'exp_avg' of parameter \d+ is a meta tensor"
    else:
        def damage(part, shard):
            if entry == "weight":
                part["weight"] = _as_meta(part["weight"])
            elif entry == "exp_avg":
                part["state"]["exp_avg"] = _as_meta(part["state"]["exp_avg"])
            elif entry == "keys":
                part["keys"] = _as_meta(part["keys"])
            elif entry == "last_seen":
                part["dynamic"]["last_seen"] = part["dynamic"]["last_seen"].to_sparse()
            elif entry == "step":
                part["scalars"]["step"] = _as_meta(torch.as_tensor(part["scalars"]["step"]))
            elif entry == "sparse step":
                part["scalars"]["step"] = torch.as_tensor(part["scalars"]["step"]).reshape(1).to_sparse()
            else:
                part["weight"] = part["weight"].to_sparse()
        _rewrite_shard(folder, damage)
        message = (r"shard-00000-of-00001.pt: layer 'pooled': .*(is a (meta|torch.sparse_coo) tensor"
                   r"|'step' must be a finite integer)")
    _load_is_refused_and_changes_nothing(directory, message)


def test_a_direct_row_whose_moments_moved_but_not_its_weight_keeps_them(tmp_path):
    """A step at lr 0 (the first step of a linear warmup) moves a direct row's Adam moments
    but not its weight: the checkpoint must still hold the row, or the load gives it zero
    moments and training no longer continues as it would have."""
    def build():
        model = nn.ModuleDict({"emb": sk.All2AllDenseEmbedding(8, 2, 1, 2, use_hashtable=False)})
        return model, LazyAdam(model.parameters(), lr=0.0)
    model, optimizer = build()
    model["emb"](torch.tensor([[[1, 5]]])).pow(2).sum().backward()
    optimizer.step()
    state = optimizer.state[model["emb"].weight]
    assert state["exp_avg"][[1, 5]].abs().sum() > 0  # the moments moved
    sk.save_checkpoint(str(tmp_path), model, optimizer)
    loaded, loaded_optimizer = build()
    sk.load_checkpoint(str(tmp_path), loaded, loaded_optimizer)
    assert torch.equal(loaded["emb"].weight, model["emb"].weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded_optimizer.state[loaded["emb"].weight][key], state[key]), key


def test_numbered_checkpoints_extra_files_and_keep(tmp_path):
    """step= numbers the checkpoint, extra= adds a rank's own files to it (committed with
    the rest), keep= how many stay; load_checkpoint(step=) reads an older one."""
    directory = str(tmp_path)
    model, optimizer = make()
    train(model, optimizer, range(2))
    first = snapshot(model, optimizer)
    path = sk.save_checkpoint(directory, model, optimizer, step=10, extra={"trainer.pt": {"step": torch.tensor(10)}},
                              keep=None)
    assert path.endswith("ckpt-000010")
    assert torch.load(os.path.join(path, "trainer.pt"), weights_only=True)["step"].item() == 10
    train(model, optimizer, range(2, 4))
    second = snapshot(model, optimizer)
    sk.save_checkpoint(directory, model, optimizer, step=20, keep=None)
    checkpoints = sk.checkpoint.CheckpointDirectory(directory)
    assert checkpoints.steps() == [10, 20] and checkpoints.latest_step() == 20
    fresh, fresh_optimizer = make()
    assert sk.load_checkpoint(directory, fresh, fresh_optimizer, step=10).endswith("ckpt-000010")
    assert_same(fresh, fresh_optimizer, first)
    sk.load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same(fresh, fresh_optimizer, second)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint ckpt-000015 in .* \(it holds steps: 10, 20\)"):
        sk.load_checkpoint(directory, fresh, step=15)
    # Without step=, the next number after LATEST's; keep=1 (the default) leaves that one.
    assert sk.save_checkpoint(directory, model, optimizer).endswith("ckpt-000021")
    assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000021"]
    for extra, error in (({"dense.pt": 1}, ValueError), ({"a/b.pt": 1}, ValueError), ([("x", 1)], TypeError),
                         ({"x.pt": object()}, ValueError)):
        with pytest.raises(error):
            sk.save_checkpoint(directory, model, optimizer, extra=extra)
    assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000021"]


def test_checkpoint_directory_prunes_the_oldest_and_never_the_latest(tmp_path):
    checkpoints = sk.checkpoint.CheckpointDirectory(str(tmp_path))
    assert checkpoints.latest() is None and checkpoints.steps() == [] and checkpoints.next_step() == 1
    for step, modified in ((5, 3_000), (9, 1_000), (7, 2_000)):
        os.mkdir(checkpoints.checkpoint(step))
        os.utime(checkpoints.checkpoint(step), (modified, modified))
    (tmp_path / "LATEST").write_text("ckpt-000009")
    assert checkpoints.next_step() == 10
    # Newest: the steps named first, then by modification time; LATEST's is kept anyway.
    assert checkpoints.prune(1, newest_first=(7,)) == [5]
    assert checkpoints.steps() == [7, 9]
    assert checkpoints.owns("LATEST") and checkpoints.owns("ckpt-000007.tmp") and not checkpoints.owns("notes.txt")
    (tmp_path / "LATEST").write_text("ckpt-000008")
    with pytest.raises(ValueError, match="LATEST names ckpt-000008, but"):
        checkpoints.latest()

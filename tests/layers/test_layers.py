"""DistributedEmbedding and All2AllDenseEmbedding: one process, and model-parallel on spawned
gloo groups of 1 to 4 ranks checked against a one-process run of the same global batch."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsekit as sk
from sparsekit import HashTableFullError, LazyAdam

from _distributed import spawn
from _state import assert_equal_nested

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
DIM = 4
SLOTS = 3
MAX_NNZ = 4
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 3
DIRECT_KEYS = 30  # use_hashtable=False layers see keys in [0, DIRECT_KEYS)
PAD = 7  # the pad key of the padded-dense configs that also use negative keys


def key_pool() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    wide = torch.randint(INT64_MIN, INT64_MAX, (20,), generator=generator)
    pool = torch.cat([torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1, -2, 5, 8, 13]), wide])
    return pool[pool != PAD]


# ---- batches ------------------------------------------------------------------------------


def ragged_batch(step: int, pool: torch.Tensor, batch: int = GLOBAL_BATCH):
    """(values, offsets) of batch * SLOTS bags of 0..MAX_NNZ keys drawn from pool."""
    generator = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, MAX_NNZ + 1, (batch * SLOTS,), generator=generator)
    values = pool[torch.randint(0, len(pool), (int(lengths.sum()),), generator=generator)]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return values, offsets


def padded(values, offsets, pad_key):
    """The ragged batch as a dense [B, SLOTS, MAX_NNZ] tensor padded with pad_key."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    dense = torch.full((len(lengths), MAX_NNZ), pad_key, dtype=torch.int64)
    for bag, length in enumerate(lengths):
        dense[bag, :length] = values[offsets[bag]:offsets[bag] + length]
    return dense.view(-1, SLOTS, MAX_NNZ)


def ragged_slice(values, offsets, first_sample, end_sample):
    first, end = offsets[first_sample * SLOTS], offsets[end_sample * SLOTS]
    return sk.Ragged(values[first:end], offsets[first_sample * SLOTS:end_sample * SLOTS + 1] - first)


# ---- the configurations checked against a one-process run ---------------------------------

# name -> (layer kind, layer kwargs, input format)
CONFIGS = {
    "sum_hash_ragged": ("distributed", dict(combiner="sum", use_hashtable=True), "ragged"),
    "mean_hash_padded": ("distributed", dict(combiner="mean", use_hashtable=True), "padded"),
    "mean_direct_padded": ("distributed", dict(combiner="mean", use_hashtable=False), "padded_default"),
    "dense_hash": ("dense", dict(use_hashtable=True), "dense"),
    "dense_direct_dynamic": ("dense", dict(use_hashtable=False, dynamic_input=True), "dynamic"),
    # Admission counts steps per key at its owner, and LFU counts steps too: both are the
    # same whatever the world size (the table has room, so nothing is evicted).
    "sum_hash_admit_lfu": ("distributed", dict(combiner="sum", use_hashtable=True, admit_after=2, eviction="lfu"),
                           "ragged"),
    "dense_hash_admit_lru": ("dense", dict(use_hashtable=True, admit_after=3, eviction="lru"), "dense"),
}


def build(kind, kwargs, world_size, process_group=None, capacity=None):
    pool_size = len(key_pool())
    if kwargs["use_hashtable"]:
        rows = capacity or pool_size + 4  # room for every key even on one rank
    else:
        rows = -(-DIRECT_KEYS // world_size)
    common = dict(process_group=process_group, eviction=kwargs.get("eviction"),
                  admit_after=kwargs.get("admit_after", 1))
    if kind == "distributed":
        return sk.DistributedEmbedding(kwargs["combiner"], rows, DIM, SLOTS, MAX_NNZ,
                                       use_hashtable=kwargs["use_hashtable"], **common)
    return sk.All2AllDenseEmbedding(rows, DIM, SLOTS, MAX_NNZ, dynamic_input=kwargs.get("dynamic_input", False),
                                    use_hashtable=kwargs["use_hashtable"], **common)


def pool_for(fmt):
    if fmt in ("padded_default", "dynamic"):
        return torch.arange(DIRECT_KEYS)
    return key_pool()


def global_input(fmt, step, world_size):
    """Per-rank inputs of one step: a list of world_size local inputs, and the one-process input."""
    pool = pool_for(fmt)
    if fmt == "dynamic":
        parts = []
        for rank in range(world_size):
            generator = torch.Generator().manual_seed(50 * step + rank)
            parts.append(sk.ops.unique(pool[torch.randint(0, len(pool), (9,), generator=generator)],
                                       return_inverse=False))
        return parts, torch.cat(parts)
    values, offsets = ragged_batch(step, pool)
    per_rank = GLOBAL_BATCH // world_size
    if fmt == "ragged":
        whole = sk.Ragged(values, offsets)
        return [ragged_slice(values, offsets, r * per_rank, (r + 1) * per_rank) for r in range(world_size)], whole
    if fmt == "dense":
        dense = pool[torch.randint(0, len(pool), (GLOBAL_BATCH, SLOTS, MAX_NNZ),
                                   generator=torch.Generator().manual_seed(step))]
    else:
        dense = padded(values, offsets, PAD if fmt == "padded" else -1)
    return [dense[r * per_rank:(r + 1) * per_rank] for r in range(world_size)], dense


def forward(layer, fmt, inputs):
    if fmt == "padded":
        return layer(inputs, pad_key=PAD)
    return layer(inputs)


def local_rows(out_global, fmt, rank, world_size, local_inputs):
    if fmt == "dynamic":
        start = sum(len(part) for part in local_inputs[:rank])
        return out_global[start:start + len(local_inputs[rank])]
    per_rank = GLOBAL_BATCH // world_size
    return out_global[rank * per_rank:(rank + 1) * per_rank]


def train_reference(kind, kwargs, fmt, world_size):
    """One process, no group, the global batch: per-step outputs and the trained layer."""
    layer = build(kind, kwargs, 1) if kwargs["use_hashtable"] else _direct_reference(kind, kwargs)
    optimizer = LazyAdam(layer.parameters(), lr=0.01)
    outputs = []
    for step in range(STEPS):
        _, whole = global_input(fmt, step, world_size)
        out = forward(layer, fmt, whole)
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(77 + step))
        (out * target).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return layer, optimizer, outputs


def _direct_reference(kind, kwargs):
    layer = build(kind, kwargs, 1)
    assert layer.max_vocabulary_size_per_gpu == DIRECT_KEYS
    return layer


def check_matches_reference(name, reference, rank, world_size, process_group=None):
    """The layer on this rank's part of each batch against the one-process ``reference``
    (``train_reference``, run before joining the group)."""
    kind, kwargs, fmt = CONFIGS[name]
    ref, ref_optimizer, ref_outputs = reference
    layer = build(kind, kwargs, world_size, process_group)
    assert layer.world_size == world_size and layer.rank == rank
    optimizer = LazyAdam(layer.parameters(), lr=0.01)
    for step in range(STEPS):
        local_inputs, _ = global_input(fmt, step, world_size)
        out = forward(layer, fmt, local_inputs[rank])
        expected = local_rows(ref_outputs[step], fmt, rank, world_size, local_inputs)
        torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} step {step}: {m}")
        full_target = torch.randn(ref_outputs[step].shape, generator=torch.Generator().manual_seed(77 + step))
        (out * local_rows(full_target, fmt, rank, world_size, local_inputs)).sum().backward()
        assert layer.weight.grad.is_sparse  # every rank, every step, even with no rows
        optimizer.step()
        optimizer.zero_grad()

    # The same keys, weights and optimizer state per key as the one-process run.
    ref_state, state = ref_optimizer.state[ref.weight], optimizer.state[layer.weight]
    assert state["step"].item() == ref_state["step"].item() == STEPS
    if layer.use_hashtable:
        keys, rows = layer.hash_table.export()
        ref_keys, _ = ref.hash_table.export()
        mine = {k for k in ref_keys.tolist() if (k % 2**64) % world_size == rank}
        assert set(keys.tolist()) == mine, name
        ref_rows = ref.hash_table.find(keys)
        # Scores (last seen, steps seen) do not depend on the world size either.
        for score, ref_score in zip(layer.hash_table.scores(keys), ref.hash_table.scores(keys)):
            assert torch.equal(score, ref_score), name
    else:
        keys = layer.owned_keys()
        rows = torch.arange(len(keys))
        keep = keys < DIRECT_KEYS
        keys, rows = keys[keep], rows[keep]
        ref_rows = keys
    for attr, mine_, theirs in (("weight", layer.weight.detach(), ref.weight.detach()),
                                ("exp_avg", state["exp_avg"], ref_state["exp_avg"]),
                                ("exp_avg_sq", state["exp_avg_sq"], ref_state["exp_avg_sq"])):
        torch.testing.assert_close(mine_[rows], theirs[ref_rows], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {attr}: {m}")

    # eval(): lookups only; keys never seen read as zero vectors and are not inserted.
    layer.eval()
    ref.eval()
    local_inputs, whole = global_input(fmt, STEPS, world_size)
    if layer.use_hashtable:
        unseen = 123456789
        local_inputs = [_with_unseen_key(x, fmt, unseen) for x in local_inputs]
        whole = _concat_ragged(local_inputs) if fmt == "ragged" else torch.cat(local_inputs)
    size_before = len(layer.hash_table) if layer.use_hashtable else None
    with torch.no_grad():
        ref_out = forward(ref, fmt, whole)
        out = forward(layer, fmt, local_inputs[rank])
    torch.testing.assert_close(out, local_rows(ref_out, fmt, rank, world_size, local_inputs), rtol=1e-5, atol=1e-6)
    if layer.use_hashtable:
        assert len(layer.hash_table) == size_before
        assert (layer.hash_table.find(torch.tensor([unseen])) == -1).all()
    layer.train()
    ref.train()


def _with_unseen_key(inputs, fmt, unseen):
    if fmt == "ragged":
        values, offsets = inputs
        return sk.Ragged(torch.cat([torch.tensor([unseen]), values]), torch.cat([offsets[:1], offsets[1:] + 1]))
    out = inputs.clone()
    out.view(-1)[0] = unseen
    return out


def _concat_ragged(parts):
    values = torch.cat([p.values for p in parts])
    offsets, shift = [torch.zeros(1, dtype=torch.int64)], 0
    for part in parts:
        offsets.append(part.offsets[1:] + shift)
        shift += len(part.values)
    return sk.Ragged(values, torch.cat(offsets))


# ---- one process, no group ----------------------------------------------------------------


@pytest.mark.parametrize("one_per_bag", [False, True], ids=["ragged", "one-key-per-bag"])
@pytest.mark.parametrize("combiner", ["mean", "sum"])
def test_single_process_matches_embedding_bag(one_per_bag, combiner):
    """No process group: a drop-in for nn.EmbeddingBag(sparse=True) + SparseAdam (one key
    per bag, as DLRM's slots: the pooling's gather path)."""
    pool = key_pool()
    layer = sk.DistributedEmbedding(combiner, 64, DIM, SLOTS, MAX_NNZ)
    optimizer = LazyAdam(layer.parameters(), lr=0.01)
    torch_bag = nn.EmbeddingBag(64, DIM, mode=combiner, sparse=True)
    torch_optimizer = torch.optim.SparseAdam(torch_bag.parameters(), lr=0.01)
    key_to_index = {}
    for step in range(STEPS):
        values, offsets = ragged_batch(step, pool)
        if one_per_bag:
            values = values[torch.randint(0, values.numel(), (GLOBAL_BATCH * SLOTS,),
                                          generator=torch.Generator().manual_seed(step))]
            offsets = torch.arange(values.numel() + 1)
        out = layer(sk.Ragged(values, offsets))
        # nn.EmbeddingBag over the same vectors: a key gets a row, and its key-seeded
        # first vector, on first sight.
        for key in values.tolist():
            if key not in key_to_index:
                key_to_index[key] = len(key_to_index)
                with torch.no_grad():
                    torch_bag.weight[key_to_index[key]] = sk.ops.key_seeded_uniform(torch.tensor([key]), DIM)[0]
        indices = torch.tensor([key_to_index[k] for k in values.tolist()], dtype=torch.int64)
        expected = torch_bag(indices, offsets[:-1]).view(GLOBAL_BATCH, SLOTS, DIM)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        (out * target).sum().backward()
        (expected * target).sum().backward()
        optimizer.step()
        torch_optimizer.step()
        optimizer.zero_grad()
        torch_optimizer.zero_grad()


def test_layout_and_flags():
    layer = sk.DistributedEmbedding("sum", 10, DIM, SLOTS, MAX_NNZ)
    assert layer.weight.shape == (10, DIM) and sk.is_embedding_variable(layer.weight)
    assert not sk.is_embedding_variable(layer.weight.detach().clone())
    dense = nn.Linear(3, 1)
    model = nn.ModuleDict({"emb": layer, "dense": dense})
    embedding, other = sk.split_embedding_variable_from_others(model.parameters())
    assert embedding == (layer.weight,) and set(map(id, other)) == {id(dense.weight), id(dense.bias)}
    named_embedding, _ = sk.split_embedding_variable_from_others(model.named_parameters())
    assert named_embedding == (("emb.weight", layer.weight),)
    # The hash table is module state.
    layer(sk.Ragged(torch.tensor([5, -3, 5]), torch.tensor([0, 1, 3, 3])))
    state = layer.state_dict()
    fresh = sk.DistributedEmbedding("sum", 10, DIM, SLOTS, MAX_NNZ)
    fresh.load_state_dict(state)
    assert fresh.hash_table.export()[0].tolist() == [5, -3]
    assert torch.equal(fresh.weight, layer.weight)


def test_key_seeded_initializer_and_custom_initializer():
    keys = torch.tensor([[[3, 9, -1, -1]] * SLOTS])
    first = sk.All2AllDenseEmbedding(50, DIM, SLOTS, 4)(keys)
    other = sk.All2AllDenseEmbedding(50, DIM, SLOTS, 4)(keys.flip(-1))
    torch.testing.assert_close(first, other.flip(2), rtol=0, atol=0)
    torch.testing.assert_close(first[0, 0, 0], sk.ops.key_seeded_uniform(torch.tensor([3]), DIM)[0], rtol=0, atol=0)

    def ones_times_key(k, dim):
        return k.double().unsqueeze(1).expand(-1, dim) * torch.ones(dim, dtype=torch.float64)

    layer = sk.All2AllDenseEmbedding(50, DIM, SLOTS, 4, embedding_initializer=ones_times_key)
    assert torch.equal(layer(keys)[0, 0, :2], torch.tensor([[3.0] * DIM, [9.0] * DIM]))
    direct = sk.All2AllDenseEmbedding(50, DIM, 1, 1, use_hashtable=False, embedding_initializer=ones_times_key)
    assert torch.equal(direct.weight[:, 0], torch.arange(50.0))
    with pytest.raises(ValueError, match=r"embedding_initializer\(keys, 4\) must return a \[2, 4\] tensor"):
        sk.All2AllDenseEmbedding(50, DIM, 1, 2, embedding_initializer=lambda k, d: torch.zeros(3))(
            torch.tensor([[[1, 2]]]))


def test_single_process_errors():
    direct = sk.DistributedEmbedding("sum", 5, DIM, 1, 2, use_hashtable=False)
    with pytest.raises(ValueError, match=r"key 5 .* out of range.*\[0, 5\)"):
        direct(torch.tensor([[[1, 5]]]))
    with pytest.raises(ValueError, match=r"key -3 .* out of range"):
        direct(sk.Ragged(torch.tensor([-3]), torch.tensor([0, 1])))
    table = sk.DistributedEmbedding("sum", 2, DIM, 1, 4)
    table(torch.tensor([[[1, 2, -1, -1]]]))
    with pytest.raises(HashTableFullError, match="do not fit"):
        table(torch.tensor([[[3, 1, -1, -1]]]))
    assert len(table.hash_table) == 2
    with pytest.raises(ValueError, match="dense inputs must be"):
        table(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"len\(offsets\) must be B \* slot_num \+ 1"):
        sk.DistributedEmbedding("sum", 5, DIM, 2, 2)(sk.Ragged(torch.tensor([1]), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        table((torch.tensor([1, 2]), torch.tensor([0, 3])))
    with pytest.raises(TypeError, match="key_dtype is torch.int32"):
        sk.DistributedEmbedding("sum", 5, DIM, 1, 2, key_dtype=torch.int32)(torch.tensor([[[1, 2]]]))
    with pytest.raises(ValueError, match="combiner must be 'sum' or 'mean'"):
        sk.DistributedEmbedding("max", 5, DIM, 1, 2)
    with pytest.raises(ValueError, match="inputs must be"):
        sk.All2AllDenseEmbedding(5, DIM, 2, 2, dynamic_input=True)(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("make, message", [
    (lambda: sk.All2AllDenseEmbedding(50, DIM, 1, 1, dynamic_input="no"),
     r"All2AllDenseEmbedding: dynamic_input must be a bool, got 'no' \(str\)"),
    (lambda: sk.All2AllDenseEmbedding(50, DIM, 1, 1, use_hashtable="no"),
     r"All2AllDenseEmbedding: use_hashtable must be a bool, got 'no'"),
    (lambda: sk.DistributedEmbedding("sum", 10, DIM, 1, 1, use_hashtable=1),
     r"DistributedEmbedding: use_hashtable must be a bool, got 1 \(int\)"),
    (lambda: sk.DistributedEmbedding("sum", 10, DIM, 1, 1, max_feature_num=True),
     r"DistributedEmbedding: max_feature_num must be an int or None, got True"),
    (lambda: sk.DistributedEmbedding("sum", 10, DIM, 1, 1, process_group="x"),
     r"DistributedEmbedding: process_group must be a torch.distributed.ProcessGroup or None, got 'x'"),
    (lambda: sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"])], process_group=object()),
     r"EmbeddingBagCollection: process_group must be a torch.distributed.ProcessGroup or None"),
])
def test_layer_arguments_of_the_wrong_type_raise_naming_them(make, message):
    # Not read by their truth value: use_hashtable="no" would otherwise build a hash table.
    with pytest.raises((TypeError, ValueError), match=message):
        make()


@pytest.mark.parametrize("pad_key, error, message", [
    (None, TypeError, "pad_key must be an int, got None"), (1.5, TypeError, "pad_key must be an int, got 1.5"),
    (True, TypeError, "pad_key must be an int, got True"), (2**63, ValueError, "pad_key must be in the torch.int64"),
    (2**31, ValueError, "pad_key must be in the torch.int32")])
def test_bad_pad_key_raises_naming_it_and_changes_nothing(pad_key, error, message):
    key_dtype = torch.int32 if "int32" in message else torch.int64
    layer = sk.DistributedEmbedding("sum", 8, DIM, 1, 2, key_dtype=key_dtype)
    keys = torch.tensor([[[1, 2]], [[3, -1]]], dtype=key_dtype)
    layer(keys)
    before = layer.hash_table.export()
    with pytest.raises(error, match=f"DistributedEmbedding: {message}"):
        layer(torch.tensor([[[4, 5]]], dtype=key_dtype), pad_key=pad_key)
    after = layer.hash_table.export()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("pad_key", [2, 0, None, True])
def test_a_pad_key_with_a_ragged_input_is_refused_not_ignored(pad_key):
    """A ragged input has no padding: pad_key=2 looked key 2 up as a key without a word.
    The default (-1, also given explicitly) is fine; -1 is then an ordinary key."""
    layer = sk.DistributedEmbedding("sum", 8, DIM, 1, 2)
    ragged = sk.Ragged(torch.tensor([1, 2, -1]), torch.tensor([0, 2, 3]))
    before = layer.hash_table.export()
    for inputs in (ragged, tuple(ragged)):
        with pytest.raises(ValueError, match=r"DistributedEmbedding: pad_key applies to a dense .* a ragged input "
                                             r"\(sk.Ragged or \(values, offsets\)\) has no padding"):
            layer(inputs, pad_key=pad_key)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.hash_table.export()))
    layer(ragged, pad_key=-1)
    assert len(layer.hash_table) == 3


def test_int32_keys_and_empty_batches():
    layer = sk.DistributedEmbedding("mean", 10, DIM, 2, 3, key_dtype=torch.int32)
    out = layer(torch.tensor([[[4, -1, -1], [-1, -1, -1]]], dtype=torch.int32))
    torch.testing.assert_close(out[0, 0], sk.ops.key_seeded_uniform(torch.tensor([4]), DIM)[0])
    assert torch.equal(out[0, 1], torch.zeros(DIM))
    empty = layer(sk.Ragged(torch.empty(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)))
    assert empty.shape == (0, 2, DIM)
    empty.sum().backward()
    assert layer.weight.grad.is_sparse and layer.weight.grad._nnz() == 0


# ---- model-parallel on gloo ----------------------------------------------------------------


def _layers_worker(rank, world_size, init):
    # One-process references first: once the group exists, layers shard over it by default.
    references = {name: train_reference(*CONFIGS[name], world_size) for name in CONFIGS}
    init()
    for name in CONFIGS:
        check_matches_reference(name, references[name], rank, world_size)
    if world_size > 1:
        # A given group (here: all ranks) instead of the default one.
        group = dist.new_group(list(range(world_size)))
        check_matches_reference("sum_hash_ragged", references["sum_hash_ragged"], rank, world_size,
                                process_group=group)
        _check_errors_agree(rank, world_size)


def _check_errors_agree(rank, world_size):
    """A bad input or a full table on one rank: every rank raises, none hangs, and the next step works."""
    last = world_size - 1
    direct = sk.DistributedEmbedding("sum", 4, DIM, 1, 2, use_hashtable=False)  # keys in [0, 4 * world_size)
    good = torch.tensor([[[0, 1]]])
    bad = torch.tensor([[[1, 4 * world_size]]]) if rank == last else good
    if rank == last:
        with pytest.raises(ValueError, match=rf"key {4 * world_size} .* out of range"):
            direct(bad)
    else:
        with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{last}\] of the process group rejected their input"):
            direct(bad)
    shape_bad = torch.tensor([[1, 2]]) if rank == 0 else good
    with pytest.raises((ValueError, RuntimeError), match="dense inputs must be|rank\\(s\\) \\[0\\]"):
        direct(shape_bad)
    direct(good).sum().backward()  # the group is still in step
    if rank == 0:
        direct.eval()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] are in eval\(\) mode"):
        direct(good)
    direct.train()

    table = sk.DistributedEmbedding("sum", 3, DIM, 1, 4)  # 3 rows per rank
    table(torch.tensor([[[0, 1, -1, -1]]]))
    sizes = len(table.hash_table)
    # Rank 0 sends owner 0 four new keys: owner 0's table (3 rows) overflows.
    # The other ranks send a new key to owner 1, which inserts it before hearing of owner
    # 0's failure: the failed step must take it back out.
    many = torch.tensor([[[world_size * k for k in range(10, 14)]]]) if rank == 0 else \
        torch.tensor([[[100 * world_size + 1, -1, -1, -1]]])
    keys_before = table.hash_table.export()[0]
    with pytest.raises(HashTableFullError, match="full|do not fit"):
        table(many)
    assert len(table.hash_table) == sizes  # nothing inserted anywhere
    assert torch.equal(table.hash_table.export()[0], keys_before)
    assert table.hash_table.find(torch.tensor([100 * world_size + 1])).item() == -1
    table(torch.tensor([[[2, -1, -1, -1]]])).sum().backward()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_model_parallel_matches_one_process(tmp_path, world_size):
    spawn(_layers_worker, world_size, str(tmp_path))


def _large_lookup_worker(rank, world_size, init, dim):
    """Lookups of thousands of rows (above the size from which a CPU shard reads its rows
    with sparsekit's gather, 256 KiB), in training and in eval with unseen keys, against the
    layer's own exported table: pooled sums, zeros for unseen keys, and the gradient."""
    from sparsekit.exchange import _GATHER_MIN_BYTES

    if world_size > 1:
        init()
    g = torch.Generator().manual_seed(11)
    keys_per_rank = 3 * _GATHER_MIN_BYTES // (dim * 4)  # well above the threshold
    layer = sk.DistributedEmbedding("sum", 2 * keys_per_rank, dim, 1, 2)
    pool = torch.randint(-2**62, 2**62, (keys_per_rank * world_size,), generator=g)
    batches = [pool[torch.randperm(pool.numel(), generator=g)].view(world_size, -1, 1, 2)[rank] for _ in range(2)]
    unseen = torch.randint(-2**62, 2**62, batches[0].shape, generator=g)
    # eval: half the keys of each bag unseen (found + missing rows, the gather's zeros)
    for step, keys in enumerate(batches + [torch.cat([batches[0][..., :1], unseen[..., 1:]], -1)]):
        if step == 2:
            layer.eval()
        out = layer(keys)
        exported = [layer.export()] if world_size == 1 else [None] * world_size
        if world_size > 1:
            dist.all_gather_object(exported, layer.export())
        table = {}
        for owned_keys, vectors in exported:
            table.update(zip(owned_keys.tolist(), vectors.float()))
        zero = torch.zeros(dim)
        expected = torch.stack([sum((table.get(k, zero) for k in bag.tolist()), zero)
                                for bag in keys.view(-1, 2)]).view(out.shape)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        if step < 2:
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step + rank))
            (out * target).sum().backward()
            if world_size == 1:  # (over ranks the owner sums every rank's lookups)
                rows = layer.hash_table.find(keys.reshape(-1))
                dense = torch.zeros(layer.weight.shape).index_add_(0, rows, target.view(-1, dim).repeat_interleave(2, 0))
                torch.testing.assert_close(layer.weight.grad.to_dense(), dense, rtol=0, atol=1e-5)
            layer.weight.grad = None


@pytest.mark.parametrize("dim", [16, 64])
def test_large_lookups_match_the_exported_table(dim):
    _large_lookup_worker(0, 1, None, dim)


@pytest.mark.distributed
def test_large_lookups_over_two_ranks_match_the_exported_tables(tmp_path):
    spawn(_large_lookup_worker, 2, str(tmp_path), 16)


@pytest.mark.parametrize("layer_type", ["DistributedEmbedding", "All2AllDenseEmbedding"])
def test_one_process_full_table_raises_naming_the_layer_and_changes_nothing(layer_type):
    layer = sk.DistributedEmbedding("sum", 4, DIM, 1, 3) if layer_type == "DistributedEmbedding" else \
        sk.All2AllDenseEmbedding(4, DIM, 1, 3)
    shape = (1, 1, 3)
    layer(torch.tensor([10, 11, 10]).view(shape)).sum().backward()
    table = layer.hash_table
    before = (len(table), table.clock, table.export(), layer.weight.detach().clone(), table._count.clone())
    with pytest.raises(HashTableFullError, match=rf"{layer_type}: the hash table of rank 0 is full \("
                                                 r"max_vocabulary_size_per_gpu=4\)"):
        layer(torch.tensor([12, 13, 14]).view(shape))
    after = (len(table), table.clock, table.export(), layer.weight.detach(), table._count)
    assert after[:2] == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(after[2] + after[3:], before[2] + before[3:]))
    layer(torch.tensor([12, 11, 13]).view(shape))  # two new keys fit: the step goes on
    assert len(table) == 4 and table.clock == before[1] + 1


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_rows_first_lookup_leaves_everything_as_the_general_path(monkeypatch, key_dtype):
    """One process training a CPU hash table looks keys up before deduplicating them; a
    twin layer forced onto the general path (dedup, owner insert, row sort) must end every
    step with the same outputs, gradients, table (rows, scores, clock) and weights: small
    and empty batches, repeats, a table far larger than the call (the hash fallback of the
    row dedup) and batches of mostly new keys (the bitmap)."""
    from sparsekit.shard import _ModelParallelEmbedding

    general = _ModelParallelEmbedding._rows_first
    layers = [sk.DistributedEmbedding("sum", 90_000, DIM, 1, 2, key_dtype=key_dtype) for _ in range(2)]
    optimizers = [LazyAdam(layer.parameters(), lr=0.01) for layer in layers]
    g = torch.Generator().manual_seed(3)
    high = 2**31 - 1 if key_dtype == torch.int32 else 2**62
    batches = [torch.randint(-high, high, (35_000, 1, 2), generator=g), torch.randint(0, 9, (3, 1, 2), generator=g),
               torch.zeros(0, 1, 2, dtype=torch.int64), torch.randint(-high, high, (4, 1, 2), generator=g)]
    batches.append(torch.cat([batches[3], batches[0][:5], batches[1]]).flip(0))  # rows out of order, repeats
    for keys in batches:
        keys = keys.to(key_dtype)
        outs = []
        for layer, optimizer, rows_first in zip(layers, optimizers, (True, False)):
            monkeypatch.setattr(_ModelParallelEmbedding, "_rows_first",
                                general if rows_first else (lambda self: False))
            out = layer(keys)
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(keys.numel()))
            (out * target).sum().backward()
            outs.append((out.detach(), layer.weight.grad.coalesce()))
            optimizer.step()
            optimizer.zero_grad()
        (out_a, grad_a), (out_b, grad_b) = outs
        assert torch.equal(out_a, out_b)
        assert torch.equal(grad_a.indices(), grad_b.indices()) and torch.equal(grad_a.values(), grad_b.values())
        a, b = layers[0].hash_table, layers[1].hash_table
        assert len(a) == len(b) and a.clock == b.clock
        assert all(torch.equal(x, y) for x, y in zip(a.export(), b.export()))
        assert torch.equal(a._last_seen, b._last_seen) and torch.equal(a._count, b._count)
        assert torch.equal(layers[0].weight, layers[1].weight)
        assert layers[0].stats() == layers[1].stats()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["all2all", "one key per bag", "bags"])
def test_one_process_lookup_keeps_the_tables_dtype(monkeypatch, kind, dtype):
    """One process training a CPU hash table (the rows-first lookup) returned float32 for
    a float16 / bfloat16 / float64 layer (All2AllDenseEmbedding always, DistributedEmbedding
    with one key per bag), and every path returned float32 for an empty batch; a float64
    layer's rows were read through float32. Each path now gives the table's dtype, and the
    rows-first and general paths the same numbers."""
    from sparsekit.shard import _ModelParallelEmbedding

    general = _ModelParallelEmbedding._rows_first

    def make():
        if kind == "all2all":
            return sk.All2AllDenseEmbedding(64, DIM, 2, 3).to(dtype)
        return sk.DistributedEmbedding("sum", 64, DIM, 2, 1 if kind == "one key per bag" else 3).to(dtype)
    layers = [make() for _ in range(2)]
    optimizers = [LazyAdam(layer.parameters(), lr=0.01) for layer in layers]
    width = 1 if kind == "one key per bag" else 3
    g = torch.Generator().manual_seed(5)
    for batch in (4, 0, 3, 4):
        keys = torch.randint(0, 20, (batch, 2, width), generator=g)
        outs = []
        for layer, optimizer, rows_first in zip(layers, optimizers, (True, False)):
            monkeypatch.setattr(_ModelParallelEmbedding, "_rows_first", general if rows_first else (lambda self: False))
            out = layer(keys)
            assert out.dtype == dtype
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(batch)).to(dtype)
            (out * target).sum().backward()
            outs.append(out.detach())
            optimizer.step()
            optimizer.zero_grad()
            assert layer.eval()(keys).dtype == dtype
            layer.train()
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(layers[0].weight, layers[1].weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_half_layer_mean_sums_in_float32_and_rounds_once(dtype, compiled):
    """A float16 / bfloat16 DistributedEmbedding with combiner "mean" rounded each bag's sum
    to the half type before dividing it (eager and compiled): two float16 rows of 60000 made
    a mean of inf, and long bags were an ulp off the once-rounded mean in about a third of
    their elements. Bags are summed and divided in float32 and rounded once, as the
    collection's, embedding_bag's and segment_mean's means are."""
    layer = sk.DistributedEmbedding("mean", 64, DIM, slot_num=2, max_nnz=40).to(dtype)
    g = torch.Generator().manual_seed(3)
    keys = torch.randint(-1, 30, (3, 2, 40), generator=g)  # -1: the pad key
    keys[0, 0] = -1
    keys[0, 0, :2] = torch.tensor([100, 101])  # bag (0, 0): two keys of its own
    layer(keys)  # inserts the keys
    big = 60000.0 if dtype == torch.float16 else 1e38  # float16: a sum past its range
    with torch.no_grad():
        layer.weight[layer.hash_table.find(torch.tensor([100, 101]))] = big
    forward = torch.compile(layer, backend="aot_eager") if compiled else layer
    out = forward(keys)
    weight = layer.weight.detach()
    expected = torch.empty_like(out)
    for b in range(3):
        for s in range(2):
            k = keys[b, s][keys[b, s] >= 0]
            expected[b, s] = (weight[layer.hash_table.find(k)].double().sum(0) / len(k)).to(dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out[0, 0], torch.full((DIM,), big).to(dtype))
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert layer.weight.grad.dtype == dtype


def _check_grad_modes_agree(rank, world_size, init):
    """A training forward that records no backward on one rank (torch.no_grad(),
    inference_mode, a frozen weight) while the others record one: the others waited in their
    backward's all-to-all until the group's timeout, or gloo aborted the process at the next
    forward. Every rank now raises at the forward, and the group stays in step."""
    init()
    last = world_size - 1
    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 2)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 16, ["a"]), sk.TableConfig("u", 3, 16, ["b"])])
    kjt = sk.KeyedJagged(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]))
    keys = torch.tensor([[[1, 2]], [[3, 5]]])
    for how in ("no_grad", "inference_mode", "frozen"):
        for module, call in ((layer, lambda: layer(keys)), (ebc, lambda: ebc(kjt))):
            context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
            if rank == last and how == "frozen":
                module.requires_grad_(False)
            with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{last}\] run this training forward without a "
                                                   r"gradient \(torch.no_grad\(\), inference_mode or a frozen weight\)"):
                with (context() if rank == last and context else contextlib.nullcontext()):
                    call()
            module.requires_grad_(True)
    # Alike on every rank: no_grad forwards (warming the tables) and training steps work.
    with torch.no_grad():
        layer(keys)
        ebc(kjt)
    layer(keys).sum().backward()
    sum(v.sum() for v in ebc(kjt).values()).backward()
    # eval() forwards may differ in grad mode: no backward follows them.
    layer.eval()
    with (torch.no_grad() if rank == last else contextlib.nullcontext()):
        layer(keys)


@pytest.mark.distributed
def test_grad_modes_agree_across_ranks(tmp_path):
    spawn(_check_grad_modes_agree, 2, str(tmp_path))


# ---- DDP on the dense part -----------------------------------------------------------------


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = sk.DistributedEmbedding("sum", DIRECT_KEYS, DIM, SLOTS, MAX_NNZ, use_hashtable=False)
        self.top = nn.Linear(SLOTS * DIM, 1)
        with torch.no_grad():
            self.top.weight.copy_(torch.linspace(-1, 1, SLOTS * DIM))
            self.top.bias.fill_(0.1)

    def forward(self, keys):
        return self.top(self.embedding(keys).flatten(1)).squeeze(1)


def sum_gradients_hook(process_group, bucket):
    """DDP comm hook that sums gradients over ranks instead of averaging them."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _ddp_worker(rank, world_size, init):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(model, batches, optimizer, forward_model):
        losses = []
        for keys, labels in batches:
            loss = ((forward_model(keys) - labels) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    pool = torch.arange(DIRECT_KEYS)
    steps = []
    for step in range(STEPS):
        values, offsets = ragged_batch(step, pool)
        labels = torch.randn(GLOBAL_BATCH, generator=torch.Generator().manual_seed(step))
        steps.append((padded(values, offsets, -1), labels))
    reference = TinyModel()
    run(reference, steps, LazyAdam(reference.parameters(), lr=0.01), reference)

    init()
    model = TinyModel()  # per-rank embedding shards, identical dense layer
    initial_shard = model.embedding.weight.detach().clone()
    ignored = [name for name, p in model.named_parameters() if sk.is_embedding_variable(p)]
    assert ignored == ["embedding.weight"]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DDP(model)
    ddp.register_comm_hook(None, sum_gradients_hook)
    assert torch.equal(model.embedding.weight, initial_shard)  # DDP broadcast no shard
    per_rank = GLOBAL_BATCH // world_size
    local = [(keys[rank * per_rank:(rank + 1) * per_rank], labels[rank * per_rank:(rank + 1) * per_rank])
             for keys, labels in steps]
    run(model, local, LazyAdam(model.parameters(), lr=0.01), ddp)

    torch.testing.assert_close(model.top.weight, reference.top.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.top.bias, reference.top.bias, rtol=1e-5, atol=1e-6)
    keys = model.embedding.owned_keys()
    keep = keys < DIRECT_KEYS
    torch.testing.assert_close(model.embedding.weight[keep], reference.embedding.weight[keys[keep]],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_ddp_on_the_dense_part_ignores_embeddings(tmp_path):
    spawn(_ddp_worker, 2, str(tmp_path))


# ---- ranks that disagree on the configuration ----------------------------------------------


def _config_mismatch_worker(rank, world_size, init):
    init()
    keys = torch.tensor([[[0, 1]], [[2, 3]]])
    cases = [
        ("embedding_vec_size", lambda: sk.DistributedEmbedding("sum", 16, DIM + rank, 1, 2),
         rf"embedding_vec_size differs .*rank 0: {DIM}, rank 1: {DIM + 1}"),
        ("max_vocabulary_size_per_gpu",
         lambda: sk.DistributedEmbedding("sum", 8 + rank, DIM, 1, 2, use_hashtable=False),
         r"max_vocabulary_size_per_gpu differs .*rank 0: 8, rank 1: 9"),
        ("use_hashtable", lambda: sk.DistributedEmbedding("sum", 8, DIM, 1, 2, use_hashtable=rank == 0),
         r"use_hashtable differs .*rank 0: True, rank 1: False"),
        ("combiner", lambda: sk.DistributedEmbedding(["sum", "mean"][rank], 8, DIM, 1, 2),
         r"combiner differs .*rank 0: sum, rank 1: mean"),
        ("key_dtype", lambda: sk.All2AllDenseEmbedding(8, DIM, 1, 2, key_dtype=[torch.int64, torch.int32][rank]),
         r"key_dtype differs .*rank 0: torch.int64, rank 1: torch.int32"),
        # Another layer type: settings one rank has and the other lacks (a gather of unequal
        # sizes aborted gloo before).
        ("layer type", lambda: sk.DistributedEmbedding("sum", 8, DIM, 1, 2) if rank == 0 else
         sk.All2AllDenseEmbedding(8, DIM, 1, 2),
         r"layer type differs .*rank 0: DistributedEmbedding, rank 1: All2AllDenseEmbedding"),
        ("admission_capacity", lambda: sk.DistributedEmbedding("sum", 8, DIM, 1, 2, admit_after=2,
                                                               admission_capacity=16 + rank),
         r"admission_capacity differs .*rank 0: 16, rank 1: 17"),
        ("embedding_initializer", lambda: sk.DistributedEmbedding(
            "sum", 8, DIM, 1, 2, embedding_initializer=sk.KeySeededUniform(seed=rank)),
         r"embedding_initializer differs .*rank 0: KeySeededUniform\(seed=0, .*rank 1: KeySeededUniform\(seed=1"),
    ]
    for name, build, message in cases:
        layer = build()
        inputs = keys.to(layer.key_dtype)
        # The same error on every rank, every time, and nothing hangs or aborts.
        for _ in range(2):
            with pytest.raises(ValueError, match=message):
                layer(inputs)
    # The group is still in step: a layer built alike works.
    sk.DistributedEmbedding("sum", 8, DIM, 1, 2)(keys).sum().backward()
    # A layer converted on one rank after its first step (the configuration was compared
    # then): its vectors' dtype rides on every step's header, so every rank raises.
    for build, convert, dtype in ((lambda: sk.DistributedEmbedding("sum", 8, DIM, 1, 2), "double", "float64"),
                                  (lambda: sk.All2AllDenseEmbedding(8, DIM, 1, 2), "bfloat16", "bfloat16")):
        layer = build()
        layer(keys).sum().backward()
        before = layer.weight.detach().clone()
        if rank == 1:
            getattr(layer, convert)()
        with pytest.raises(ValueError, match=rf"dtype or row width differs .*rank 0: torch.float32 rows of {DIM}, "
                                             rf"rank 1: torch.{dtype} rows of {DIM}\); convert the layer alike"):
            layer(keys)
        torch.testing.assert_close(layer.weight.detach().float(), before.to(layer.weight.dtype).float())
        getattr(layer, convert)()  # alike on every rank: it works again
        layer(keys).float().sum().backward()


def _foreign_state_worker(rank, world_size, init, directory):
    init()
    keys = torch.tensor([[[0, 1, 2, 3]], [[4, 5, 6, 7]]])
    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 4)
    layer(keys).sum().backward()
    torch.save(layer.state_dict(), f"{directory}/state{rank}.pt")
    dist.barrier()
    fresh = sk.DistributedEmbedding("sum", 16, DIM, 1, 4)
    before = {name: value.clone() for name, value in fresh.state_dict().items() if isinstance(value, torch.Tensor)}
    other = torch.load(f"{directory}/state{1 - rank}.pt", weights_only=True)
    with pytest.raises(ValueError, match=rf"holds keys this rank does not own \(key \d+ belongs to rank {1 - rank} "
                                         rf"of 2, this is rank {rank}\)"):
        fresh.load_state_dict(other)
    after = fresh.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert len(fresh.hash_table) == 0
    fresh.load_state_dict(torch.load(f"{directory}/state{rank}.pt", weights_only=True))  # its own loads
    layer.eval()
    fresh.eval()
    torch.testing.assert_close(fresh(keys), layer(keys), rtol=0, atol=0)


@pytest.mark.distributed
def test_a_layer_refuses_another_rank_s_state(tmp_path):
    """Two ranks' state_dict files swapped: the keys would sit on a rank that does not own
    them, and their trained vectors would be lost without a word."""
    spawn(_foreign_state_worker, 2, str(tmp_path), str(tmp_path))


def _foreign_direct_state_worker(rank, world_size, init, directory):
    init()
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group
    keys = torch.arange(4 * world_size).view(-1, 1, 1)[rank::world_size]
    layer = sk.DistributedEmbedding("sum", 4, DIM, 1, 1, use_hashtable=False)
    optimizer = LazyAdam(layer.parameters(), lr=0.5)
    layer(keys).sum().backward()
    optimizer.step()
    torch.save(layer.state_dict(), f"{directory}/direct{rank}.pt")
    dist.barrier()
    other = (rank + 1) % world_size
    # Another rank's state, and a one-process layer's of the same shape: its rows are other keys.
    for state, saved in ((torch.load(f"{directory}/direct{other}.pt", weights_only=True), rf"keys {other}, "),
                         (sk.DistributedEmbedding("sum", 4, DIM, 1, 1, use_hashtable=False,
                                                  process_group=groups[rank]).state_dict(), r"keys 0, 1, 2")):
        fresh = sk.DistributedEmbedding("sum", 4, DIM, 1, 1, use_hashtable=False)
        before = fresh.weight.detach().clone()
        with pytest.raises(ValueError, match=rf"the state's rows hold {saved}.* but this rank's rows hold keys {rank}, "
                                             rf".*\(rank {rank} of {world_size}\): it was saved by another rank"):
            fresh.load_state_dict(state)
        assert torch.equal(fresh.weight, before)
    # Its own state loads; so does one saved before the layout was recorded (an empty extra state).
    fresh = sk.DistributedEmbedding("sum", 4, DIM, 1, 1, use_hashtable=False)
    fresh.load_state_dict(torch.load(f"{directory}/direct{rank}.pt", weights_only=True))
    assert torch.equal(fresh.weight, layer.weight)
    fresh.load_state_dict({"weight": layer.weight.detach() * 2, "_extra_state": {}})
    assert torch.equal(fresh.weight, layer.weight * 2)
    # A collection's direct table (its rows' first key depends on the table's index too).
    tables = [sk.TableConfig("h", DIM, 4, ["a"]), sk.TableConfig("d", DIM, 4, ["b"], use_hashtable=False)]
    source = sk.EmbeddingBagCollection(tables)
    torch.save(source.state_dict(), f"{directory}/collection{rank}.pt")
    dist.barrier()
    state = torch.load(f"{directory}/collection{other}.pt", weights_only=True)
    state = {key: value for key, value in state.items() if key.startswith("shards.1.")}
    with pytest.raises(ValueError, match=r"it was saved by another rank or at another world size"):
        sk.EmbeddingBagCollection(tables).load_state_dict(state, strict=False)


@pytest.mark.distributed
def test_a_direct_layer_refuses_another_rank_s_state(tmp_path):
    """A direct layer's rows are the keys row * world_size + its first key, which its state
    did not record: another rank's state file, or a one-process layer's of the same shape,
    loaded without a word and its rows answered for other keys (world 3)."""
    spawn(_foreign_direct_state_worker, 3, str(tmp_path), str(tmp_path))


def test_a_direct_state_s_key_layout_is_checked():
    layer = sk.DistributedEmbedding("sum", 4, DIM, 1, 1, use_hashtable=False)
    state = layer.state_dict()
    assert torch.equal(state["_extra_state"]["direct_keys"], torch.tensor([1, 0]))
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([1, 0, 0]), [1, 0]):
        with pytest.raises(ValueError, match=r"'_extra_state'\['direct_keys'\] must be an int64 \[2\] tensor"):
            layer.load_state_dict({**state, "_extra_state": {"direct_keys": bad}})
    with pytest.raises(ValueError, match=r"the state's rows hold keys 1, 4, 7, \.\.\. \(world size 3\)"):
        layer.load_state_dict({**state, "_extra_state": {"direct_keys": torch.tensor([3, 1])}})
    # Kinds are still told apart: a direct state into a hash layer and the reverse.
    with pytest.raises(ValueError, match="the state holds no hash table"):
        sk.DistributedEmbedding("sum", 4, DIM, 1, 1).load_state_dict(state)
    hashed = sk.DistributedEmbedding("sum", 4, DIM, 1, 1)
    hashed(torch.tensor([[[3]]]))
    with pytest.raises(ValueError, match="the state holds a hash table, but this layer has none"):
        layer.load_state_dict(hashed.state_dict())


def _non_member_worker(rank, world_size, init):
    init()
    group = dist.new_group([1])  # every rank calls new_group; rank 0 gets the non-member marker
    builds = (lambda: sk.DistributedEmbedding("sum", 8, DIM, 1, 1, process_group=group),
              lambda: sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"])], process_group=group))
    for build in builds:
        if rank == 0:
            with pytest.raises(ValueError, match=r"this rank \(0\) is not a member of process_group"):
                build()
        else:
            build()


@pytest.mark.distributed
def test_a_rank_outside_the_layer_s_group_is_told_so(tmp_path):
    """It had been a TypeError about the int -100 (torch's non-member marker)."""
    spawn(_non_member_worker, 2, str(tmp_path))


@pytest.mark.distributed
def test_ranks_that_disagree_on_the_configuration_all_raise(tmp_path):
    spawn(_config_mismatch_worker, 2, str(tmp_path))


def test_a_failing_initializer_leaves_the_table_as_it_was():
    """Insert + initialise is one transaction: an initializer that raises or returns the
    wrong shape takes the step's new keys back out; the keys get proper rows next time."""
    mode = {"fail": None}

    def initializer(keys, dim):
        if mode["fail"] == "raise":
            raise RuntimeError("initializer failed")
        if mode["fail"] == "shape":
            return torch.zeros(keys.numel(), dim + 1)
        return sk.ops.key_seeded_uniform(keys, dim)

    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 3, embedding_initializer=initializer)
    layer(torch.tensor([[[1, 2, -1]]]))
    keys_before = layer.hash_table.export()[0]
    for fail, error in (("raise", RuntimeError), ("shape", ValueError)):
        mode["fail"] = fail
        with pytest.raises(error):
            layer(torch.tensor([[[2, 3, 4]]]))
        assert torch.equal(layer.hash_table.export()[0], keys_before)
    mode["fail"] = None
    out = layer(torch.tensor([[[3, 4, -1]]]))
    want = sk.ops.key_seeded_uniform(torch.tensor([3, 4]), DIM).sum(0)
    torch.testing.assert_close(out[0, 0], want)


_BAD_INITIAL_ROWS = {
    "sparse": lambda keys, dim: torch.zeros(keys.numel(), dim).to_sparse(),
    "meta": lambda keys, dim: torch.zeros(keys.numel(), dim, device="meta"),
    "complex": lambda keys, dim: torch.ones(keys.numel(), dim, dtype=torch.complex64),
}


def _tables_state(tables, model):
    return [(t.export()[0].tolist(), t.clock, [s.tolist() for s in t.scores(torch.arange(1, 9))], len(t))
            for t in tables] + [model.weight.detach().clone() if hasattr(model, "weight") else None]


@pytest.mark.parametrize("output", sorted(_BAD_INITIAL_ROWS))
@pytest.mark.parametrize("kind", ["lru", "admit", "collection_lru", "collection_admit", "plain"])
def test_an_initializer_output_the_weight_cannot_take_raises_naming_it_with_nothing_changed(kind, output):
    """A sparse or meta tensor of the right shape passed the shape check and failed at the
    write into the weight, after the table took the keys (tables with eviction or
    admission: their keys half inserted, without rows); a complex one lost its imaginary
    part. Refused by name before anything changes."""
    kwargs = {"eviction": "lru"} if kind.endswith("lru") else {"admit_after": 2} if kind.endswith("admit") else {}
    if kind.startswith("collection"):
        model = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"], **kwargs)])
        shard = model.shards[0]
        def step(keys): return model(sk.KeyedJagged(["f"], torch.tensor(keys), lengths=torch.ones(len(keys), dtype=torch.int64)))
    else:
        model = shard = sk.DistributedEmbedding("sum", 8, DIM, 1, 2, **kwargs)
        def step(keys): return model(torch.tensor([[keys]]))
    step([1, 2])
    step([1, 2])
    if "admit" in kind:
        step([3, 4])  # pending: their second sight below admits them
    tables = [shard.hash_table] + ([shard._pending] if shard._pending is not None else [])
    before, stats = _tables_state(tables, shard), shard.stats()
    shard.embedding_initializer = _BAD_INITIAL_ROWS[output]
    with pytest.raises(ValueError, match=r"(embedding_)?initializer\(keys, 4\) must return a dense real tensor"):
        step([3, 4])
    after = _tables_state(tables, shard)
    assert after[:-1] == before[:-1] and torch.equal(after[-1], before[-1]) and shard.stats() == stats


def _bad_initializer_on_one_rank_worker(rank, world_size, init):
    init()
    model = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"], eviction="lru")])
    kjt = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    model(kjt)
    if rank == 0:
        model.shards[0].embedding_initializer = _BAD_INITIAL_ROWS["sparse"]
    keys = model.shards[0].hash_table.export()[0].tolist()
    with pytest.raises((ValueError, RuntimeError), match=r"initializer\(keys|on rank 0"):
        model(sk.KeyedJagged(["f"], torch.tensor([60, 61, 62, 63]), lengths=torch.tensor([2, 2])))
    assert model.shards[0].hash_table.export()[0].tolist() == keys


@pytest.mark.distributed
def test_a_bad_initializer_output_on_one_rank_raises_on_every_rank_with_nothing_changed(tmp_path):
    """It raised on that rank after the ranks agreed to go on, with its table changed, and
    the other rank waited in the vectors' all-to-all until the group's timeout."""
    spawn(_bad_initializer_on_one_rank_worker, 2, str(tmp_path))


# ---- the coalesced-gradient mark --------------------------------------------------------------


def test_weight_gradient_stays_marked_coalesced_on_the_normal_path(monkeypatch):
    """One lookup per step: the stored gradient is the lookup's own, marked coalesced, so
    LazyAdam does not sum its rows again."""
    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 3)
    opt = sk.LazyAdam(layer.parameters(), lr=0.1)
    layer(torch.tensor([[[1, 2, 1]], [[2, 3, -1]]])).sum().backward()
    assert layer.weight.grad.is_coalesced()
    calls = []
    real_unique = sk.ops.unique
    monkeypatch.setattr(sk.ops, "unique", lambda *a, **k: calls.append(1) or real_unique(*a, **k))
    opt.step()
    assert calls == []


def test_weight_gradient_mark_cannot_go_stale():
    """After a backward that never reaches .grad (torch.autograd.grad), the next backward
    accumulates into an existing uncoalesced gradient: the sum must not be marked
    coalesced (with duplicate rows LazyAdam would race), and LazyAdam's update equals
    SparseAdam's on the coalesced sum. The marker holds the values it produced, so their
    memory cannot be recycled while it compares."""
    import gc
    import weakref

    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 3)
    keys = torch.tensor([[[1, 2, 1]], [[2, 3, -1]]])
    (free_grad,) = torch.autograd.grad(layer(keys).sum(), layer.weight)
    produced = weakref.ref(layer._grad_marker.values)
    del free_grad
    gc.collect()
    assert produced() is not None  # held by the marker: its address cannot be reused
    for _ in range(3):
        torch.empty(64, DIM)  # allocations that would like to reuse freed memory

    duplicate = torch.sparse_coo_tensor(torch.tensor([[5, 5]]), torch.ones(2, DIM), (16, DIM))
    layer.weight.grad = duplicate
    layer(keys).sum().backward()
    assert not layer.weight.grad.is_coalesced()
    reference = torch.nn.Parameter(layer.weight.detach().clone())
    reference.grad = layer.weight.grad.coalesce()
    opt, ref_opt = sk.LazyAdam([layer.weight], lr=0.1), torch.optim.SparseAdam([reference], lr=0.1)
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(layer.weight.detach(), reference.detach(), rtol=1e-6, atol=1e-7)


def test_state_of_a_hash_layer_and_of_a_direct_layer_do_not_load_into_each_other():
    hashed = sk.DistributedEmbedding("sum", 8, DIM, 1, 3)
    hashed(sk.Ragged(torch.tensor([7, 3, 1]), torch.tensor([0, 3])))
    direct = sk.DistributedEmbedding("sum", 8, DIM, 1, 3, use_hashtable=False)
    for source, target, message in ((hashed, direct, "holds a hash table, but this layer has none"),
                                    (direct, hashed, "holds no hash table")):
        weight, keys = target.weight.detach().clone(), target.export()[0]
        with pytest.raises(ValueError, match=f"DistributedEmbedding: load_state_dict: the state {message}"):
            target.load_state_dict(source.state_dict())
        assert torch.equal(target.weight, weight) and torch.equal(target.export()[0], keys)
    # Each kind still loads its own kind.
    again = sk.DistributedEmbedding("sum", 8, DIM, 1, 3)
    again.load_state_dict(hashed.state_dict())
    assert torch.equal(again.export()[0], hashed.export()[0])
    sk.DistributedEmbedding("sum", 8, DIM, 1, 3, use_hashtable=False).load_state_dict(direct.state_dict())


@pytest.mark.parametrize("eviction", [None, "lru"])
def test_an_initializer_that_changes_its_keys_does_not_change_the_table(eviction):
    def meddling(keys, dim):
        out = torch.ones(keys.numel(), dim)
        keys.add_(1000)
        return out

    layer = sk.DistributedEmbedding("sum", 8, DIM, 1, 3, embedding_initializer=meddling, eviction=eviction)
    for _ in range(2):
        layer(sk.Ragged(torch.tensor([5, 6]), torch.tensor([0, 2])))
    assert sorted(layer.export()[0].tolist()) == [5, 6]
    sk.DistributedEmbedding("sum", 8, DIM, 1, 3, eviction=eviction).load_state_dict(layer.state_dict())
    collection = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"], initializer=meddling)])
    for _ in range(2):
        collection(sk.KeyedJagged(["f"], torch.tensor([5, 6]), lengths=torch.tensor([1, 1])))
    assert sorted(collection.export("t")[0].tolist()) == [5, 6]


# ---- second order: a gradient penalty through the exchange ----

_PENALTY_KEYS = torch.tensor([[[1, 2, -1], [3, -1, -1]], [[4, 5, 6], [1, -1, -1]],
                              [[7, 2, -1], [8, 9, -1]], [[3, 3, -1], [10, -1, -1]]])


def _penalty_lin_grad(kind, keys):
    """The dense layer's gradient of loss + |d loss / d table|^2 (a gradient penalty: the
    table's gradient taken with create_graph=True, then differentiated again)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 1)
    if kind == "collection":
        table = sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 100, ["f", "g"])])
        lengths = (keys >= 0).sum(-1).t().reshape(-1)  # feature-major: every sample's f, then g
        values = keys.transpose(0, 1)[keys.transpose(0, 1) >= 0]
        out = table(sk.KeyedJagged(["f", "g"], values, lengths=lengths))
        features = torch.cat([out["f"], out["g"]], dim=1)
        weight = table.weights["t"]
    else:
        table = sk.DistributedEmbedding("sum", 100, 4, 2, 3)
        features = table(keys).flatten(1)
        weight = table.weight
    loss = (lin(features) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, weight, create_graph=True)
    (loss + (grad.to_dense() ** 2).sum()).backward()
    return lin.weight.grad


def _penalty_worker(rank, world_size, init, result_dir):
    init()
    for kind in ("distributed", "collection"):
        grad = _penalty_lin_grad(kind, _PENALTY_KEYS[rank * 2:(rank + 1) * 2]).clone()
        dist.all_reduce(grad)  # each rank holds its own samples' share, as under DDP
        if rank == 0:
            torch.save(grad, f"{result_dir}/{kind}.pt")


@pytest.mark.distributed
def test_a_gradient_penalty_through_the_exchange_equals_one_process(tmp_path):
    """create_graph=True through a multi-rank layer: the exchange's backward is itself
    differentiable. It was not, and the penalty's second-order terms were silently lost
    (the table's gradient did not require grad) at world size 2 only."""
    spawn(_penalty_worker, 2, str(tmp_path), str(tmp_path))
    for kind in ("distributed", "collection"):
        alone = _penalty_lin_grad(kind, _PENALTY_KEYS)
        torch.testing.assert_close(torch.load(f"{tmp_path}/{kind}.pt"), alone, rtol=1e-5, atol=1e-6)


def test_functional_call_with_a_plain_weight_refuses_a_training_forward_and_looks_up_in_eval():
    """torch.func.functional_call with a plain tensor for the weight: a training step would
    insert the keys into the layer's own table and write their initial vectors into the
    caller's tensor, leaving the layer's rows zero for good. It is refused, with nothing
    changed; in eval() the substitute is read as the weight."""
    from torch.func import functional_call
    keys = torch.tensor([[[1, 2, -1], [3, -1, -1]]])
    for layer in (sk.DistributedEmbedding("sum", 10, 2, 2, 3),
                  sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 10, ["f"])])):
        is_collection = isinstance(layer, sk.EmbeddingBagCollection)
        batch = sk.KeyedJagged(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])) if is_collection \
            else keys
        name = "shards.0.weight" if is_collection else "weight"
        substitute = torch.zeros(10, 2)
        with pytest.raises(RuntimeError, match="plain tensor put in place of its parameter"):
            functional_call(layer, {name: substitute}, (batch,))
        assert torch.equal(substitute, torch.zeros(10, 2))
        assert (layer.stats("t") if is_collection else layer.stats())["size"] == 0
        layer(batch)  # the layer's own weight: keys inserted
        layer.eval()
        substitute = torch.arange(20.0).view(10, 2)
        out = functional_call(layer, {name: substitute}, (batch,))
        out = out["f"] if is_collection else out
        assert out.abs().sum() > 0 and not torch.equal(out, (layer(batch)["f"] if is_collection else layer(batch)))


def test_assign_into_a_layer_on_the_meta_device_says_to_give_it_memory_first():
    """with torch.device("meta"): build, then load_state_dict(assign=True), as for
    nn.EmbeddingBag: a hash layer's table has no memory to rebuild in; a clear error, the
    layer unchanged, and the documented route (to_empty, then load) works."""
    keys = torch.tensor([[[1, 2, -1], [3, -1, -1]]])
    source = sk.DistributedEmbedding("sum", 10, 2, 2, 3)
    source(keys)
    with torch.device("meta"):
        layer = sk.DistributedEmbedding("sum", 10, 2, 2, 3)
    with pytest.raises(RuntimeError, match=r"on the meta device: .*model.to_empty\(device=...\)\), then load_state_dict"):
        layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.weight.is_meta and layer.hash_table.device.type == "meta"
    layer.to_empty(device="cpu")
    layer.load_state_dict(source.state_dict())
    assert torch.equal(layer(keys), source(keys))


def _one_rank_refuses_worker(rank, world_size, init):
    init()
    torch.manual_seed(0)
    layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 2)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 16, ["f"])])
    kjt = sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    keys = torch.tensor([[[1, 2]], [[3, -1]]])
    layer(keys)
    ebc(kjt)
    state = copy.deepcopy((layer.state_dict(), ebc.state_dict()))
    # A plain tensor in place of the weight (functional_call) on rank 1 only: its own
    # refusal was raised before the exchange, and rank 0 waited there until the timeout.
    for model, call in ((layer, lambda m: m(keys)), (ebc, lambda m: m(kjt))):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match="plain tensor put in place of its parameter" if rank == 1 else
                           "rank\\(s\\) \\[1\\] of the process group rejected"):
            if rank == 1:
                torch.func.functional_call(model, params, (keys if model is layer else kjt,))
            else:
                call(model)
    # Tables on the meta device on rank 1 only: refused there, and its collectives ran on meta.
    meta_layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 2, device="meta" if rank == 1 else None)
    meta_ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 16, ["f"])], device="meta" if rank == 1 else None)
    for model, call in ((meta_layer, lambda m: m(keys)), (meta_ebc, lambda m: m(kjt))):
        with pytest.raises(RuntimeError, match="on the meta device and hold no data" if rank == 1 else
                           "rank\\(s\\) \\[1\\] of the process group rejected"):
            call(model)
    # A KeyboardInterrupt (or any BaseException) from an initializer on rank 1 only: the
    # other rank waited, and a later collective then aborted it (gloo's size mismatch).
    def interrupted(k, dim):
        raise KeyboardInterrupt

    for model, call in ((layer, lambda m: m(torch.tensor([[[7, 8]], [[9, -1]]]))),
                        (ebc, lambda m: m(sk.KeyedJagged(["f"], torch.tensor([7, 8]), lengths=torch.tensor([1, 1]))))):
        shard = model if model is layer else model.shards[0]
        initializer = shard.embedding_initializer
        if rank == 1:
            shard.embedding_initializer = interrupted
        with pytest.raises(KeyboardInterrupt if rank == 1 else RuntimeError):
            call(model)
        shard.embedding_initializer = initializer
    assert_equal_nested((layer.state_dict(), ebc.state_dict()), state)
    layer(keys)  # the ranks are still in step
    ebc(kjt)
    assert ebc.stats("t")["size"] == 2  # a collective after the interrupt: keys 1 and 2 only
    # A collection converted on one rank after its first step trained on with tables that
    # differed between the ranks (the layers refused it already, just above).
    mixed = sk.EmbeddingBagCollection([sk.TableConfig("a", DIM, 16, ["f"]), sk.TableConfig("b", DIM, 16, ["g"])])
    two = sk.KeyedJagged(["f", "g"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    mixed(two)
    if rank == 1:
        mixed.shards[1].half()
    state = copy.deepcopy(mixed.state_dict())
    with pytest.raises(ValueError, match=r"table 'b''s weight dtype or row width differs between the ranks of the "
                                         rf"process group \(rank 0: torch.float32 rows of {DIM}, rank 1: "
                                         rf"torch.float16 rows of {DIM}\); convert the collection alike"):
        mixed(two)
    assert_equal_nested(mixed.state_dict(), state)
    mixed.shards[1].float()
    mixed(two)
    # Pickling a model bound to the group named only pickle's ProcessGroup type; deepcopy works.
    for model, name in ((layer, "DistributedEmbedding"), (mixed, "EmbeddingBagCollection")):
        with pytest.raises(TypeError, match=f"^{name}: a layer bound to a process group cannot be pickled"):
            pickle.dumps(model)
        assert copy.deepcopy(model).process_group is model.process_group


@pytest.mark.distributed
def test_a_refusal_or_a_base_exception_on_one_rank_raises_on_every_rank(tmp_path):
    spawn(_one_rank_refuses_worker, 2, str(tmp_path))


def test_torchscript_is_refused_clearly():
    # Tracing used to fail its own check, raise AttributeError in eval or, unchecked, replay
    # the traced batch's rows; scripting failed on a ForwardRef in Ragged.
    import warnings

    keys = torch.randint(0, 50, (4, 3, 2))
    layer = sk.DistributedEmbedding("sum", 100, 4, 3, 2)
    for train in (True, False):
        layer.train(train)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="DistributedEmbedding: torch.jit.trace / torch.jit.script are not"):
                torch.jit.trace(layer, (keys,), check_trace=False)
    assert len(layer.hash_table) == 0  # refused before any key went in
    modules = [layer, sk.All2AllDenseEmbedding(100, 4, 3, 2),
               sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 100, ["a"])]),
               torch.nn.Sequential(sk.DistributedEmbedding("sum", 100, 4, 3, 2))]
    for module in modules:
        with pytest.raises(RuntimeError, match="torch.jit.trace / torch.jit.script are not supported"):
            torch.jit.script(module)


@pytest.mark.parametrize("layer_type", ["distributed", "all2all"])
def test_eval_reads_a_missing_key_as_zeros(layer_type):
    """In eval() a key the table does not hold reads as a zero vector (and a present key as
    its key-seeded first vector), whatever the row the table holds first: plain torch."""
    if layer_type == "distributed":
        layer = sk.DistributedEmbedding("sum", 16, DIM, 1, 2)
    else:
        layer = sk.All2AllDenseEmbedding(16, DIM, 1, 1, dynamic_input=True)
    present = torch.tensor([5, -3])
    layer(sk.Ragged(present, torch.arange(3)) if layer_type == "distributed" else present)  # training: inserted
    layer.eval()
    keys = torch.tensor([5, 123, -3, 77])
    with torch.no_grad():
        out = layer(sk.Ragged(keys, torch.arange(5)) if layer_type == "distributed" else keys).reshape(4, DIM)
    expected = sk.ops.key_seeded_uniform(keys, DIM)
    expected[1] = 0
    expected[3] = 0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(layer.hash_table) == 2  # eval inserted nothing


@pytest.mark.parametrize("kwargs", [dict(), dict(use_hashtable=False), dict(eviction="lru"), dict(eviction="lfu")],
                         ids=["hash", "direct", "lru", "lfu"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("backward", ["summed", "each", "reversed"])
def test_two_forwards_then_backward_accumulate_as_nn_embedding_bag(kwargs, combiner, backward):
    """Gradient accumulation over two micro-batches with no step in between (one backward of
    the summed loss, or one backward each in either order): the layer keeps no per-step
    state on itself that the second forward overwrites, so the weight's gradient is
    nn.EmbeddingBag's over the same rows."""
    layer = sk.DistributedEmbedding(combiner, 64, DIM, 1, 3, **kwargs)
    g = torch.Generator().manual_seed(0)
    batches = []
    for low, high in ((0, 30), (10, 50)):
        lengths = torch.randint(0, 4, (6,), generator=g)
        batches.append((torch.randint(low, high, (int(lengths.sum()),), generator=g),
                        torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])))
    scales = [torch.randn(6, 1, DIM, generator=g) for _ in batches]
    losses = [(layer(sk.Ragged(*b)) * s).sum() for b, s in zip(batches, scales)]
    if backward == "summed":
        (losses[0] + losses[1]).backward()
    else:
        for loss in (losses if backward == "each" else losses[::-1]):
            loss.backward()
    keys, _ = layer.export()
    rows = layer.hash_table.find(keys) if layer.hash_table is not None else keys
    row_of = dict(zip(keys.tolist(), rows.tolist()))
    reference = nn.EmbeddingBag(64, DIM, mode=combiner)
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
    sum(((reference(torch.tensor([row_of[k] for k in v.tolist()], dtype=torch.int64), o[:-1]).view(6, 1, DIM)
          * s).sum() for (v, o), s in zip(batches, scales))).backward()
    torch.testing.assert_close(layer.weight.grad.to_dense(), reference.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
def test_one_key_per_bag_offsets_are_checked_by_one_compare(offsets_dtype):
    """Offsets 0, 1, ..., nnz (one key per bag) pass the layer's checks with one compare
    against a kept arange, which grows with the batch; counting offsets that stop short
    of, or run past, len(values), and other offsets, still go through the full checks."""
    from sparsekit import exchange
    from sparsekit.exchange import _offsets_error_flags, _one_per_bag

    # The kept arange grows, then serves smaller batches; past what it keeps, a batch's own.
    for n in (1, 5, 3000, 7, 70_000, 2, 3, exchange._COUNTING_KEPT + 5):
        counting = torch.arange(n + 1, dtype=offsets_dtype)
        assert _one_per_bag(counting, n) and int(_offsets_error_flags(counting, n)) == 0
        assert int(_offsets_error_flags(counting, n + 1)) != 0  # ends before len(values)
        assert int(_offsets_error_flags(counting[:-1], n)) != 0  # ends before len(values) too
        if n < 3:
            continue
        assert exchange._COUNTING.size <= exchange._COUNTING_KEPT
        broken = counting.clone()
        broken[n // 2 + 1] = broken[n // 2]  # an empty bag: valid, but not one key per bag
        assert int(_offsets_error_flags(broken, n)) == 0 and not _one_per_bag(broken, n)
        broken[n // 2 + 1] = broken[n // 2] - 1  # decreasing
        assert int(_offsets_error_flags(broken, n)) != 0
    layer = sk.DistributedEmbedding("sum", 100, DIM, 2, 1)
    keys = torch.tensor([3, 4, 5, 6])
    pooled = layer(sk.Ragged(keys, torch.arange(5, dtype=offsets_dtype)))
    torch.testing.assert_close(pooled.view(4, DIM), layer.weight[layer.hash_table.find(keys)])
    with pytest.raises(ValueError, match="offsets must start at 0"):
        layer(sk.Ragged(torch.tensor([3, 4, 5]), torch.arange(5, dtype=offsets_dtype)))


def test_a_shard_is_known_by_the_registry_not_by_attributes_on_its_parameter():
    """The layer's weight carries nothing of sparsekit's; copies, pickles and an assigned
    weight are shards through the registry, and a layer that goes away leaves no entry."""
    import copy
    import gc
    import io
    import weakref

    from sparsekit import shard_registry

    layer = sk.DistributedEmbedding("sum", 10, DIM, SLOTS, MAX_NNZ, eviction="lru")
    assert not [name for name in vars(layer.weight) if "sparsekit" in name]
    assert shard_registry.fresh_rows(layer.weight) is layer.fresh_rows
    for other in (copy.deepcopy(layer), torch.load(_saved(layer, io.BytesIO()), weights_only=False)):
        assert sk.is_embedding_variable(other.weight) and not sk.is_embedding_variable(layer.weight.detach())
        assert shard_registry.fresh_rows(other.weight) is other.fresh_rows is not layer.fresh_rows
    layer.load_state_dict(layer.state_dict(), assign=True)
    assert sk.is_embedding_variable(layer.weight)
    weight = weakref.ref(layer.weight)
    del layer
    gc.collect()
    assert weight() is None


def _saved(module, buffer):
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer

"""Dynamic tables in the layers: eviction, admission, stats, export, LazyAdam moments of
reused rows, checkpoints, and multi-rank runs equal to one process (docs/api.md)."""

import pytest
import torch
import torch.distributed as dist

import sparsekit as sk
from sparsekit import shard_registry
from sparsekit.hashtable import HashTableFullError

from _distributed import spawn

DIM = 4


def _layer(capacity, **kwargs):
    return sk.All2AllDenseEmbedding(capacity, DIM, 1, 1, dynamic_input=True, **kwargs)


def _step(layer, optimizer, keys):
    out = layer(torch.tensor(keys))
    out.sum().backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return out.detach()


def test_defaults_change_nothing():
    layer = _layer(4)
    assert layer.eviction is None and layer.admit_after == 1
    layer(torch.tensor([1, 2, 3, 4]))
    with pytest.raises(HashTableFullError):
        layer(torch.tensor([5]))
    assert len(layer.hash_table) == 4


@pytest.mark.parametrize("bad, match", [
    (dict(eviction="fifo"), "eviction"), (dict(admit_after=0), "admit_after"),
    (dict(admission_capacity=0), "admission_capacity"),
    (dict(eviction="lru", use_hashtable=False), "use_hashtable"),
    (dict(admission_capacity=3, use_hashtable=False), "admission_capacity need use_hashtable=True"),
])
def test_bad_arguments_name_themselves(bad, match):
    with pytest.raises(ValueError, match=match):
        _layer(4, **bad)


def test_lru_layer_evicts_least_recent_and_reuses_rows_with_initial_vectors():
    layer = _layer(3, eviction="lru")
    _step(layer, None, [10, 11, 12])     # clock 0
    _step(layer, None, [11, 12])          # clock 1: 10 is the least recent
    out = _step(layer, None, [20])        # evicts 10, 20 takes its row 0
    keys, vectors = layer.export()
    assert keys.tolist() == [20, 11, 12]
    initial = sk.KeySeededUniform()(torch.tensor([20]), DIM)
    assert torch.equal(out, initial) and torch.equal(vectors[0], initial[0])
    assert layer.stats() == {"size": 3, "capacity": 3, "evicted": 1, "admitted": 4, "pending": 0}
    assert layer.hash_table.clock == 3
    # Incremental export: keys seen at clock >= 1.
    assert sorted(layer.export(min_last_seen=2)[0].tolist()) == [20]


def test_lfu_counts_steps_not_occurrences():
    layer = sk.DistributedEmbedding("sum", 2, DIM, 1, 8, eviction="lfu")
    layer(torch.tensor([[[1, 1, 1, 1, 2, -1, -1, -1]]]))   # one step: both counted once
    layer(torch.tensor([[[2, -1, -1, -1, -1, -1, -1, -1]]]))
    assert layer.hash_table.scores(torch.tensor([1, 2]))[1].tolist() == [1, 2]
    layer(torch.tensor([[[3, -1, -1, -1, -1, -1, -1, -1]]]))  # evicts 1 (count 1 < 2)
    assert sorted(layer.export()[0].tolist()) == [2, 3]


def test_reused_row_starts_with_zero_moments():
    layer = _layer(2, eviction="lru")
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
    for _ in range(3):
        _step(layer, optimizer, [1, 2])
    row_of_1 = layer.hash_table.find(torch.tensor([1])).item()
    _step(layer, optimizer, [2])
    _step(layer, optimizer, [3])          # 1 is evicted, 3 takes its row
    assert layer.hash_table.find(torch.tensor([3])).item() == row_of_1
    # A fresh layer that only ever saw key 3 for one step gives the same row and moments.
    fresh = _layer(2, eviction="lru")
    fresh_optimizer = sk.LazyAdam(fresh.parameters(), lr=0.1)
    for _ in range(4):
        fresh.train()
        fresh(torch.tensor([2])).sum().backward()
        fresh_optimizer.step()
        fresh_optimizer.zero_grad()
    _step(fresh, fresh_optimizer, [3])
    state, fresh_state = optimizer.state[layer.weight], fresh_optimizer.state[fresh.weight]
    fresh_row = fresh.hash_table.find(torch.tensor([3])).item()
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name][row_of_1], fresh_state[name][fresh_row])
    assert torch.equal(layer.weight[row_of_1], fresh.weight[fresh_row])


def test_a_reused_row_forgets_infinite_moments():
    """Moments were reset by multiplying with a 0/1 mask: an evicted key's inf second
    moment became NaN (inf * 0) for the key taking its row, and so did its weight."""
    layer = sk.All2AllDenseEmbedding(1, 2, 1, 1, dynamic_input=True, eviction="lru")
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.01)
    (layer(torch.tensor([1])) * 1e20).sum().backward()    # exp_avg_sq overflows to inf
    optimizer.step()
    optimizer.zero_grad()
    assert torch.isinf(optimizer.state[layer.weight]["exp_avg_sq"][0]).all()
    layer(torch.tensor([2])).sum().backward()             # key 2 takes key 1's row
    optimizer.step()
    state = optimizer.state[layer.weight]
    assert torch.isfinite(layer.weight[0]).all()
    assert torch.equal(state["exp_avg"][0], torch.full((2,), 0.1))
    assert torch.equal(state["exp_avg_sq"][0], torch.full((2,), 0.001))


def test_a_dense_gradient_resets_a_reused_rows_moments():
    """A dense gradient (an L2 term over the whole weight) updated a reused row with the
    evicted key's moments and left its fresh flag set."""
    def run(keys):
        layer = sk.All2AllDenseEmbedding(1, 2, 1, 1, dynamic_input=True, eviction="lru")
        optimizer = sk.LazyAdam(layer.parameters(), lr=0.01)
        for key in keys:
            (layer(torch.tensor([key])).sum() + 1e-3 * layer.weight.pow(2).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
        return layer, optimizer
    reused, optimizer = run([1, 1, 1, 2])
    fresh, fresh_optimizer = run([2])
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(optimizer.state[reused.weight][name][0], fresh_optimizer.state[fresh.weight][name][0])
    assert not shard_registry.fresh_rows(reused.weight).any()


def test_admission_after_k_steps():
    layer = _layer(8, admit_after=3)
    assert torch.equal(_step(layer, None, [5, 6]), torch.zeros(2, DIM))  # seen once
    assert layer.stats()["pending"] == 2
    layer.eval()
    layer(torch.tensor([5]))  # eval never counts
    layer.train()
    assert torch.equal(_step(layer, None, [5]), torch.zeros(1, DIM))     # seen twice
    out = _step(layer, None, [5, 6])                                     # 5: third step
    assert torch.equal(out[0], sk.KeySeededUniform()(torch.tensor([5]), DIM)[0])
    assert torch.equal(out[1], torch.zeros(DIM))
    assert layer.stats() == {"size": 1, "capacity": 8, "evicted": 0, "admitted": 1, "pending": 1}
    # A key that is not admitted gets no update.
    layer.weight.grad = None
    layer(torch.tensor([7, 8])).sum().backward()
    assert layer.weight.grad._nnz() == 0


def test_admission_forgets_least_recent_pending_keys():
    layer = _layer(8, admit_after=2, admission_capacity=2)
    _step(layer, None, [1])
    _step(layer, None, [2])
    _step(layer, None, [3])   # 1 is forgotten
    assert layer.stats()["pending"] == 2
    _step(layer, None, [1])   # counted from scratch: not admitted
    assert layer.hash_table.find(torch.tensor([1])).item() == -1
    _step(layer, None, [3])   # second step for 3
    assert layer.hash_table.find(torch.tensor([3])).item() >= 0


def test_one_call_larger_than_capacity_raises_and_changes_nothing():
    layer = _layer(2, eviction="lru")
    _step(layer, None, [1, 2])
    before = layer.hash_table.state_dict()
    with pytest.raises(HashTableFullError, match="capacity"):
        layer(torch.tensor([3, 4, 5]))
    after = layer.hash_table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert layer.stats()["evicted"] == 0


def test_state_dict_round_trip_keeps_scores_pending_and_totals():
    layer = _layer(3, eviction="lfu", admit_after=2)
    for keys in ([1, 2], [1, 2, 3], [4], [4, 5], [5, 6, 1]):
        _step(layer, None, keys)
    state = layer.state_dict()
    copy = _layer(3, eviction="lfu", admit_after=2)
    copy.load_state_dict(state)
    assert copy.stats() == layer.stats()
    keys = torch.tensor([1, 2, 3, 4, 5, 6])
    for a, b in zip(copy.hash_table.scores(keys), layer.hash_table.scores(keys)):
        assert torch.equal(a, b)
    assert copy.hash_table.clock == layer.hash_table.clock
    assert torch.equal(_step(copy, None, [7, 1]), _step(layer, None, [7, 1]))


def test_a_state_without_pending_admissions_clears_the_layer_s_own():
    """A state saved by a layer without admission (no 'pending' entry) loads as no key pending:
    the layer's own pending keys were counted against the table the load replaces."""
    source = _layer(8)
    _step(source, None, [1, 2])
    layer = _layer(8, admit_after=2)
    _step(layer, None, [7, 1])  # 7 and 1 pending, seen once
    layer.load_state_dict(source.state_dict())
    assert layer.stats()["pending"] == 0
    assert len(layer._pending) == 0
    _step(layer, None, [7])  # seen once since the load: still waiting
    assert layer.export()[0].tolist() == [1, 2]


def _damage_pending(pending, damage):
    """A layer's saved pending admissions (keys 8 and 50 pending, 9 in the table), damaged."""
    if damage == "key_in_table":
        pending["keys"] = torch.tensor([9, 50])
    else:
        pending["count"] = torch.tensor([1, 0])


@pytest.mark.parametrize("via", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("damage, message", [("key_in_table", "key 9 is both pending admission and in the table"),
                                             ("count_0", "a pending key's count .* must be at least 1, got 0")])
def test_damaged_pending_admissions_are_refused_with_nothing_changed(tmp_path, via, damage, message):
    """A key pending and in the table at once, or a pending key seen in no step, loaded and
    skewed the stats and the admission count."""
    layer = _layer(4, admit_after=2)
    for keys in ([9], [9], [8, 50]):
        _step(layer, None, keys)
    fresh = _layer(4, admit_after=2)
    _step(fresh, None, [3])
    stats = fresh.stats()
    if via == "state_dict":
        state = layer.state_dict()
        _damage_pending(state["_extra_state"]["pending"], damage)
        with pytest.raises(ValueError, match=message):
            fresh.load_state_dict(state)
    else:
        sk.save_checkpoint(str(tmp_path), layer)
        path = tmp_path / "ckpt-000001" / "shard-00000-of-00001.pt"
        shard = torch.load(path, weights_only=True)
        _damage_pending(next(iter(shard["layers"].values()))["dynamic"]["pending"], damage)
        torch.save(shard, path)
        with pytest.raises(ValueError, match=message):
            sk.load_checkpoint(str(tmp_path), fresh)
    assert fresh.stats() == stats and fresh._pending.export()[0].tolist() == [3]


STEPS = [[1, 2, 3, 4], [5, 6, 1, 2], [7, 8, 9, 1], [2, 3, 10, 11], [12, 1, 5, 13], [6, 7, 14, 15]]


def _train(layer, optimizer, steps, rank=0, world_size=1):
    outs = []
    for keys in steps:
        mine = keys[rank::world_size]
        outs.append(_step(layer, optimizer, mine))
    return outs


def _dynamic_worker(rank, world_size, init, policy, tmp_dir):
    # Per-rank capacity 3 on 2 ranks vs... one process with the same per-owner tables is
    # not the same model; compare against a one-process run of a layer whose table per
    # owner has the same capacity: with world_size ranks, owner r holds keys k % world == r.
    init()
    layer = _layer(3, eviction=policy, admit_after=2)
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.05)
    _train(layer, optimizer, STEPS, rank, world_size)
    stats = layer.stats()
    sk.save_checkpoint(tmp_dir, layer, optimizer)
    keys, vectors = layer.export()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (keys.tolist(), vectors.tolist(), layer.hash_table.scores(keys)[0].tolist(),
                                      layer.hash_table.scores(keys)[1].tolist()))
    if rank == 0:
        torch.save({"stats": stats, "tables": gathered}, f"{tmp_dir}/result.pt")


def _shard_of(keys, vectors, owner, world_size):
    return {k: v for k, v in zip(keys, vectors) if k % world_size == owner}


@pytest.mark.distributed
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_two_ranks_checkpoint_reshards_scores_to_one(tmp_path, policy):
    spawn(_dynamic_worker, 2, str(tmp_path), policy, str(tmp_path))
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["stats"]["capacity"] == 6
    # Load the two-rank checkpoint into one process with room for both shards: every
    # key keeps its vector and scores.
    layer = _layer(6, eviction=policy, admit_after=2)
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.05)
    sk.load_checkpoint(str(tmp_path), layer, optimizer)
    stats = layer.stats()
    assert {k: stats[k] for k in ("evicted", "admitted", "pending", "size")} == \
        {k: result["stats"][k] for k in ("evicted", "admitted", "pending", "size")}
    for keys, vectors, last_seen, count in result["tables"]:
        rows = layer.hash_table.find(torch.tensor(keys, dtype=torch.int64))
        assert (rows >= 0).all()
        assert torch.equal(layer.weight.detach()[rows], torch.tensor(vectors))
        got_last, got_count = layer.hash_table.scores(torch.tensor(keys, dtype=torch.int64))
        assert got_last.tolist() == last_seen and got_count.tolist() == count


# ---- the collection's clocks ----

def _evicting_and_roomy(kind):
    """A layer of capacity 2 with LRU eviction and its twin with room for every key, same
    initial vectors; a call reads one key per bag."""
    def build(capacity, eviction):
        if kind == "collection":
            return sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, capacity, ["f"], eviction=eviction)])
        if kind == "distributed":
            return sk.DistributedEmbedding("sum", capacity, DIM, 1, 1, eviction=eviction)
        return _layer(capacity, eviction=eviction)

    def call(layer, keys):
        if kind == "collection":
            return layer(_one_key_per_bag("f", keys))["f"]
        if kind == "distributed":
            return layer(torch.tensor(keys).view(-1, 1, 1)).view(len(keys), DIM)
        return layer(torch.tensor(keys))

    def vectors(layer, keys):
        found, values = layer.export("t") if kind == "collection" else layer.export()
        return torch.stack([values[found == k][0] for k in keys])

    return build(2, "lru"), build(8, None), call, vectors


@pytest.mark.parametrize("kind", ["all2all", "distributed", "collection"])
@pytest.mark.parametrize("backward_each", [False, True])
def test_an_evicted_key_s_gradient_does_not_reach_the_key_that_takes_its_row(kind, backward_each):
    """Two lookups before one optimizer step (two towers over one table, or micro-batches of
    gradient accumulation): the second one's new key evicts a key the first one read and
    takes its row. The first one's gradient for the evicted key is dropped, whether its
    backward comes after the eviction or was accumulated in weight.grad before it: the new
    key trains as in a table with room for both."""
    evicting, roomy, call, vectors = _evicting_and_roomy(kind)
    results = []
    for layer in (evicting, roomy):
        optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
        first = (call(layer, [1, 2]) * torch.tensor([[5.0], [3.0]])).sum()
        if backward_each:
            first.backward()
        second = -call(layer, [3]).sum()  # evicting: 1 and 2 were seen alike, the smaller key goes
        (second if backward_each else first + second).backward()
        optimizer.step()
        results.append((vectors(layer, [2, 3]), optimizer))
    stats = [layer.stats("t") if kind == "collection" else layer.stats() for layer in (evicting, roomy)]
    assert stats[0]["evicted"] == 1 and stats[1]["evicted"] == 0
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    # And the new key's Adam moments are its own.
    (evicting_weight,), (roomy_weight,) = (list(layer.parameters()) for layer in (evicting, roomy))
    row, roomy_row = (int(layer_table.find(torch.tensor([3])).item()) for layer_table in
                      ((evicting.shards[0] if kind == "collection" else evicting).hash_table,
                       (roomy.shards[0] if kind == "collection" else roomy).hash_table))
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(results[0][1].state[evicting_weight][name][row],
                           results[1][1].state[roomy_weight][name][roomy_row])


def test_a_row_given_away_by_a_forward_without_grad_leaves_the_earlier_forward_s_gradient():
    """A training forward under no_grad evicts key 1, which an earlier forward read, and
    gives its row to key 3: the earlier forward's backward has no entry for that row at all
    (an entry of zeros would still move key 3 through weight decay)."""
    layer = _layer(2, eviction="lru")
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1, weight_decay=0.5)
    first = layer(torch.tensor([1, 2])).sum()
    with torch.no_grad():
        layer(torch.tensor([3]))
    row_of_3 = int(layer.hash_table.find(torch.tensor([3])).item())
    vector_of_3 = layer.weight[row_of_3].detach().clone()
    first.backward()
    assert row_of_3 not in layer.weight.grad.coalesce().indices()[0].tolist()
    optimizer.step()
    assert torch.equal(layer.weight[row_of_3], vector_of_3)


def test_a_layer_pickled_before_the_gradient_numbering_trains(tmp_path):
    """A layer saved whole (torch.save of the module) before its marker numbered the rows
    it gives away loads and evicts."""
    layer = _layer(2, eviction="lru")
    marker = layer._grad_marker
    del marker.__dict__["stamp"], marker.__dict__["row_since"]  # as an older sparsekit pickled it
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    optimizer = sk.LazyAdam(loaded.parameters(), lr=0.1)
    for keys in ([1, 2], [3], [4, 1]):
        _step(loaded, optimizer, keys)
    assert loaded.stats()["evicted"] == 3


def _evicted_gradient_worker(rank, world_size, init):
    init()
    for kind in ("all2all", "distributed", "collection"):
        for backward_each in (False, True):
            evicting, roomy, call, vectors = _evicting_and_roomy(kind)
            results = []
            for layer in (evicting, roomy):
                optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
                # Each shard (key % 2) holds two of the keys 2..5 ...
                weights = torch.tensor([[5.0], [3.0]]) if rank == 0 else torch.tensor([[2.0], [7.0]])
                first = (call(layer, [2, 3] if rank == 0 else [4, 5]) * weights).sum()
                if backward_each:
                    first.backward()
                # ... and takes a new key from the other rank: 6 evicts 2 on rank 0, 7 evicts 3.
                second = -call(layer, [7] if rank == 0 else [6]).sum()
                (second if backward_each else first + second).backward()
                optimizer.step()
                results.append((layer, optimizer))
            stats = [layer.stats("t") if kind == "collection" else layer.stats() for layer in (evicting, roomy)]
            assert (stats[0]["evicted"], stats[1]["evicted"]) == (2, 0), (kind, stats)
            kept = [4, 6] if rank == 0 else [5, 7]
            torch.testing.assert_close(vectors(evicting, kept), vectors(roomy, kept), rtol=0, atol=0,
                                       msg=lambda m: f"{kind}, backward_each={backward_each}: {m}")
            tables = [(layer.shards[0] if kind == "collection" else layer).hash_table for layer, _ in results]
            rows = [table.find(torch.tensor(kept)) for table in tables]
            (evicting_weight,), (roomy_weight,) = (list(layer.parameters()) for layer, _ in results)
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(results[0][1].state[evicting_weight][name][rows[0]],
                                   results[1][1].state[roomy_weight][name][rows[1]]), (kind, backward_each, name)


@pytest.mark.distributed
def test_an_evicted_key_s_gradient_does_not_reach_its_successor_across_ranks(tmp_path):
    """The test above at world size 2 (gloo): each shard gives the row of a key that the
    first lookup read on both ranks to a key that another rank asks for, and the first
    lookup's gradient comes back to the owner through the exchange after that."""
    spawn(_evicted_gradient_worker, 2, str(tmp_path))


def _replicas_worker(rank, world_size, init, directory):
    init()
    group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    layer = sk.DistributedEmbedding("sum", 6, DIM, 1, 1, eviction="lru", process_group=group)
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
    for step in range(4):  # each replica sees the same keys: 5 new ones a step, 12 rows in all
        keys = torch.arange(step * 5, step * 5 + 10).view(10, 1, 1)[(rank % 2) * 5:(rank % 2 + 1) * 5]
        layer(keys).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    before = layer.stats()
    assert before["evicted"] > 0
    sk.save_checkpoint(directory, layer, optimizer)
    fresh = sk.DistributedEmbedding("sum", 6, DIM, 1, 1, eviction="lru", process_group=group)
    sk.load_checkpoint(directory, fresh)
    assert fresh.stats() == before
    if rank == 0:
        torch.save(before, f"{directory}/stats.pt")


@pytest.mark.distributed
def test_two_replicas_checkpoint_their_totals_once(tmp_path):
    """Two replicas of a layer (groups [0, 1] and [2, 3]) each save their ranks' shares of
    evicted / admitted: a load sums one replica's worth (it took the largest single rank's
    share, about half), at the saved layout and in one process."""
    directory = str(tmp_path / "ckpt")
    spawn(_replicas_worker, 4, str(tmp_path), directory)
    before = torch.load(f"{directory}/stats.pt")
    alone = sk.DistributedEmbedding("sum", 12, DIM, 1, 1, eviction="lru")
    sk.load_checkpoint(directory, alone)
    stats = alone.stats()
    assert (stats["evicted"], stats["admitted"]) == (before["evicted"], before["admitted"])


def _clock_collection():
    return sk.EmbeddingBagCollection([sk.TableConfig("a", 2, 2, ["f"], eviction="lru"),
                                      sk.TableConfig("b", 2, 4, ["g"], eviction="lfu", admit_after=2)])


def _one_key_per_bag(feature, keys):
    return sk.KeyedJagged([feature], torch.tensor(keys, dtype=torch.long),
                          lengths=torch.ones(len(keys), dtype=torch.long))


_CLOCK_STEPS = [[0], [0], [0], [0], [0], [1]]


def test_collection_ticks_every_table_once_per_training_forward():
    # Also a table none of whose features has a key this step, and its pending keys' clock;
    # eval does not tick. As DistributedEmbedding, which ticks on every rank every step.
    collection = _clock_collection()
    for _ in range(3):
        collection(_one_key_per_bag("f", [1]))
    assert [(s.hash_table.clock, None if s._pending is None else s._pending.clock) for s in collection.shards] \
        == [(3, None), (3, 3)]
    collection.eval()
    collection(_one_key_per_bag("f", [1]))
    assert [s.hash_table.clock for s in collection.shards] == [3, 3]


def _clock_worker(rank, world_size, init, directory):
    init()
    collection = _clock_collection()
    for keys in _CLOCK_STEPS:
        collection(_one_key_per_bag("f", keys if rank == 0 else []))  # rank 1's batches are empty
    assert collection.shards[0].hash_table.clock == len(_CLOCK_STEPS)
    sk.save_checkpoint(directory, collection)


@pytest.mark.distributed
def test_collection_clocks_agree_across_ranks_so_resharding_keeps_lru_order(tmp_path):
    # Rank 0 sees every key, rank 1 none: with clocks ticking only where a table had keys,
    # the resharded scores mixed ages and LRU evicted key 1, the most recently used.
    spawn(_clock_worker, 2, str(tmp_path), str(tmp_path))
    loaded = _clock_collection()
    sk.load_checkpoint(str(tmp_path), loaded)
    loaded(_one_key_per_bag("f", [7]))
    scratch = _clock_collection()
    for keys in _CLOCK_STEPS + [[7]]:
        scratch(_one_key_per_bag("f", keys))
    assert sorted(loaded.export("a")[0].tolist()) == sorted(scratch.export("a")[0].tolist()) == [1, 7]


# ---- admission counting at the capacity ----

def _ragged(keys):
    return sk.Ragged(torch.tensor(keys, dtype=torch.long), torch.arange(len(keys) + 1))


def test_a_load_with_fewer_pending_places_forgets_by_the_eviction_rule(tmp_path):
    """More pending keys than the loading layer's admission_capacity: the least recently
    seen are forgotten and, on a tie, the smaller key, as the pending table evicts (they
    were kept in the order the saved ranks listed them: keys 1 and 5 here)."""
    saved = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=2, admission_capacity=4)
    saved(sk.Ragged(torch.tensor([5, 1, 9, 3]), torch.tensor([0, 4])))
    sk.save_checkpoint(str(tmp_path), saved)
    loaded = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=2, admission_capacity=2)
    sk.load_checkpoint(str(tmp_path), loaded)
    assert sorted(loaded._pending.export()[0].tolist()) == [5, 9]


def test_a_load_with_fewer_pending_places_keeps_the_most_recently_seen(tmp_path):
    """DESIGN: beyond admission_capacity the least recently seen pending keys are forgotten;
    here keys 5 and 1 were last seen a step before 9 and 3, so a load with two places keeps
    9 and 3 (whatever the keys' order)."""
    saved = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=3, admission_capacity=4)
    saved(_ragged([5, 1]))
    saved(_ragged([9, 3]))
    sk.save_checkpoint(str(tmp_path), saved)
    loaded = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=3, admission_capacity=2)
    sk.load_checkpoint(str(tmp_path), loaded)
    assert sorted(loaded._pending.export()[0].tolist()) == [3, 9]


def test_admitted_keys_free_their_pending_places_before_the_step_counts_new_ones():
    # Key 2 is admitted in step 3 while key 3 arrives: 1 and 3 then pend, 2 <= capacity, so
    # key 1 must still be counted (it was forgotten, and not admitted on its second step).
    layer = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=2, admission_capacity=2)
    for keys in ([1], [2], [2, 3]):
        layer(_ragged(keys))
    assert sorted(layer._pending.export()[0].tolist()) == [1, 3]
    layer(_ragged([1]))
    assert layer.hash_table.find(torch.tensor([1, 2])).min() >= 0
    assert layer.stats()["pending"] == 1


@pytest.mark.parametrize("collection", [False, True])
def test_more_keys_waiting_in_one_step_than_admission_capacity_forgets_some_instead_of_raising(collection):
    # DESIGN: beyond admission_capacity the least recently seen pending keys are forgotten.
    # Already pending keys keep their counts; the first new ones take the places left.
    if collection:
        layer = sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 2, ["f"], admit_after=3)])
        step = lambda keys: layer(sk.KeyedJagged(["f"], torch.tensor(keys), lengths=torch.ones(len(keys),  # noqa: E731
                                                                                                dtype=torch.long)))
        pending = lambda: sorted(layer.shards[0]._pending.export()[0].tolist())  # noqa: E731
    else:
        layer = sk.DistributedEmbedding("sum", 10, 2, 1, 1, admit_after=3, admission_capacity=2)
        step = lambda keys: layer(_ragged(keys))  # noqa: E731
        pending = lambda: sorted(layer._pending.export()[0].tolist())  # noqa: E731
    step([9])
    step([1, 2, 3, 9])
    assert pending() == [1, 9]
    step([9])  # its third step: admitted
    assert pending() == [1]


@pytest.mark.parametrize("how", ["load_state_dict", "reset_parameters", "load_checkpoint"])
@pytest.mark.parametrize("kind", ["all2all", "collection"])
def test_a_lookup_s_gradient_does_not_reach_rows_a_load_or_reset_gave_to_other_keys(tmp_path, how, kind):
    """A forward, then the table loaded (or reset and refilled), then the backward: the rows
    the forward read may hold other keys now, so its gradient lands nowhere, and one already
    accumulated in weight.grad is dropped; the loaded keys keep their vectors through the
    step. (The gradient of keys 1, 2 trained keys 7, 8 of the loaded state.)"""
    def build():
        if kind == "collection":
            return sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 8, ["f"])])
        return _layer(8)

    def call(layer, keys):
        if kind == "collection":
            return layer(_one_key_per_bag("f", keys))["f"]
        return layer(torch.tensor(keys))

    source = build()
    call(source, [7, 8])
    if how == "load_checkpoint":
        sk.save_checkpoint(str(tmp_path), source)
    layer = build()
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
    weight = next(layer.parameters())
    call(layer, [3]).sum().backward()  # accumulated before the load: rows of the old keys
    pending = call(layer, [1, 2]).sum()
    if how == "load_state_dict":
        layer.load_state_dict(source.state_dict())
    elif how == "load_checkpoint":
        sk.load_checkpoint(str(tmp_path), layer)
    else:
        layer.reset_parameters()
        call(layer, [7, 8])
    before = weight.detach().clone()
    assert weight.grad is None
    pending.backward()
    assert weight.grad is None  # not even an empty gradient: no optimizer step is counted
    optimizer.step()
    assert torch.equal(weight.detach(), before) and weight not in optimizer.state


def _overflowing_call_worker(rank, world_size, init):
    init()
    layer = sk.DistributedEmbedding("sum", 4, 2, 1, 10, eviction="lru")
    with pytest.raises(HashTableFullError, match=r"the hash table of rank 1 is full \(max_vocabulary_size_per_gpu=4\)"
                                                 r"(; with eviction, one call there holds more distinct keys|: HashTable)"):
        layer(torch.arange(1, 20, 2).view(1, 1, 10))  # ten keys, all owned by rank 1


@pytest.mark.distributed
def test_an_evicting_table_overflowed_by_one_call_is_named_so_on_every_rank(tmp_path):
    """With eviction a table is full only for one call of more distinct keys than it holds:
    the other ranks said only "is full", which an evicting table never is otherwise."""
    spawn(_overflowing_call_worker, 2, str(tmp_path))


def test_a_layer_without_eviction_resets_the_moments_of_rows_an_evicting_state_gave_away():
    """An evicting layer saved after a key took an evicted key's row, before the optimizer
    updated it: a layer without eviction that loads it (state_dict route, optimizer loaded
    apart) gives that key fresh moments at its first update, as load_checkpoint does."""
    def build(eviction):
        layer = _layer(2, eviction=eviction)
        return layer, sk.LazyAdam(layer.parameters(), lr=0.1)

    source, optimizer = build("lru")
    for _ in range(2):
        _step(source, optimizer, [1, 2])
    source(torch.tensor([3]))  # evicts key 1: key 3 takes its row, no update yet
    layer, loaded = build(None)
    layer.load_state_dict(source.state_dict())
    loaded.load_state_dict(optimizer.state_dict())
    _step(layer, loaded, [3])
    row = layer.hash_table.find(torch.tensor([3]))
    grad = torch.ones(DIM)  # d(sum)/d(row): (1 - beta1) * grad is the first moment of a fresh key
    assert torch.allclose(loaded.state[layer.weight]["exp_avg"][row[0]], 0.1 * grad)
    assert torch.allclose(loaded.state[layer.weight]["exp_avg_sq"][row[0]], 0.001 * grad)
    # Key 2 kept its row and its moments went on.
    assert not torch.allclose(loaded.state[layer.weight]["exp_avg"][layer.hash_table.find(torch.tensor([2]))[0]],
                              torch.zeros(DIM))


def test_admitted_keys_get_their_gradients_with_pending_keys_in_the_batch():
    """With admission on, a batch mixes admitted keys (rows 0, 1, ...) and pending ones (-1):
    every admitted row, row 0 included, gets its gradient (plain torch: the sum of the
    output gradients of its lookups); the pending keys none."""
    layer = _layer(8, admit_after=2)
    _step(layer, None, [10, 20])                       # seen once: pending
    layer.weight.grad = None
    keys = torch.tensor([10, 20, 30, 10])              # 10, 20 admitted now; 30 pending
    out = layer(keys)
    grad_out = torch.arange(1.0, 1.0 + 4 * DIM).view(4, DIM)
    out.backward(grad_out)
    rows = layer.hash_table.find(torch.tensor([10, 20]))
    assert rows.tolist() == [0, 1]
    expected = torch.zeros(8, DIM)
    expected[0] = grad_out[0] + grad_out[3]
    expected[1] = grad_out[1]
    torch.testing.assert_close(layer.weight.grad.to_dense(), expected, rtol=0, atol=0)


def test_a_dense_gradient_of_an_evicted_keys_row_does_not_reach_the_key_that_takes_it():
    """A dense gradient accumulated before a forward that evicts a key (an L2 term over the
    weight, then another micro-batch) loses the evicted key's row: the new key starts from
    its initializer's vector, with no state of the old key."""
    layer = _layer(2, eviction="lru")
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)
    layer(torch.tensor([1, 2]))
    layer(torch.tensor([2]))                            # key 1 is now the least recent
    (layer.weight ** 2).sum().backward()                # a dense gradient on every row
    row_of_1 = int(layer.hash_table.find(torch.tensor([1])))
    with torch.no_grad():
        layer(torch.tensor([3]))                        # evicts 1; 3 takes its row
    assert int(layer.hash_table.find(torch.tensor([3]))) == row_of_1
    assert torch.equal(layer.weight.grad[row_of_1], torch.zeros(DIM))
    optimizer.step()
    torch.testing.assert_close(layer.weight.detach()[row_of_1], sk.KeySeededUniform()(torch.tensor([3]), DIM)[0],
                               rtol=0, atol=0)


def test_a_pending_key_moved_by_an_admission_keeps_its_own_count():
    """Admitting a key removes it from the pending keys (the last pending row moves into its
    place): the moved key keeps its own count of steps, and is admitted at its own k-th step."""
    layer = _layer(8, admit_after=3)
    _step(layer, None, [1])          # 1: seen once
    _step(layer, None, [2])          # 2: once
    _step(layer, None, [1])          # 1: twice
    _step(layer, None, [1])          # 1: third step, admitted; 2 moves into 1's pending place
    assert torch.equal(_step(layer, None, [2]), torch.zeros(1, DIM))      # 2: twice, still pending
    out = _step(layer, None, [2])                                          # 2: third step
    assert torch.equal(out[0], sk.KeySeededUniform()(torch.tensor([2]), DIM)[0])


def test_a_pending_key_moved_by_an_admission_keeps_its_own_last_sight():
    """Which pending key is forgotten (the least recently seen) does not change when an
    admission moves a pending key to another place."""
    layer = _layer(8, admit_after=3, admission_capacity=3)
    for keys in ([1], [3], [2], [3], [1]):   # last seen: 3 at step 4, 2 at step 3; 1 twice
        _step(layer, None, keys)
    _step(layer, None, [1])                  # 1 admitted; 2 moves into its pending place
    _step(layer, None, [8, 9])               # one pending key must go: 2 (seen at step 3), not 3
    out = _step(layer, None, [3])            # 3: its third step, still counted
    assert torch.equal(out[0], sk.KeySeededUniform()(torch.tensor([3]), DIM)[0])
    assert int(layer.hash_table.find(torch.tensor([2]))) == -1


# ---- the contract (docs/api.md), sentence by sentence: the layers' arguments, clocks and stats ----

@pytest.mark.parametrize("cls", [sk.DistributedEmbedding, sk.All2AllDenseEmbedding])
def test_layers_take_eviction_admit_after_and_admission_capacity_with_the_contract_s_defaults(cls):
    import inspect

    params = inspect.signature(cls).parameters
    assert params["eviction"].default is None and params["admit_after"].default == 1
    assert params["admission_capacity"].default is None
    for method, names in (("stats", []), ("export", [("min_last_seen", None)])):
        got = list(inspect.signature(getattr(cls, method)).parameters.values())[1:]
        assert [(p.name, p.default) for p in got] == names
    layer = sk.DistributedEmbedding("sum", 5, DIM, 1, 1) if cls is sk.DistributedEmbedding else cls(5, DIM, 1, 1)
    assert layer.admission_capacity == 5  # default: the layer's capacity
    assert set(layer.stats()) >= {"size", "capacity", "evicted", "admitted", "pending"}


def test_every_training_forward_ticks_even_without_keys_and_eval_never_does():
    """"the layers tick once per training forward": a batch of 0 samples and a batch of
    padding only tick too (else clocks, hence LRU order, would depend on the batches);
    ``eval()`` never ticks nor counts."""
    layer = sk.DistributedEmbedding("sum", 4, DIM, 1, 2, eviction="lru", admit_after=2)
    layer(torch.tensor([[[1, 2]]]))
    layer(torch.full((1, 1, 2), -1))
    layer(torch.empty(0, 1, 2, dtype=torch.int64))
    assert layer.hash_table.clock == 3 and layer._pending.clock == 3
    layer.eval()
    layer(torch.tensor([[[1, 3]]]))
    assert layer.hash_table.clock == 3 and layer.stats()["pending"] == 2
    assert layer._pending.scores(torch.tensor([1, 3]))[1].tolist() == [1, -1]


def test_admit_after_one_gives_every_new_key_a_row_at_once_and_counts_it_admitted():
    layer = _layer(4)
    out = _step(layer, None, [3, 4, 3])
    assert (out.abs().sum(1) > 0).all()
    assert layer.stats() == {"size": 2, "capacity": 4, "evicted": 0, "admitted": 2, "pending": 0}


def _both_ranks_see_one_key_worker(rank, world_size, init, directory):
    init()
    layer = sk.DistributedEmbedding("sum", 4, DIM, 1, 2, eviction="lfu", admit_after=2)
    keys = torch.tensor([[[5, 6]]])  # every rank looks up both keys in each step
    first = layer(keys)
    stats = [layer.stats()]
    second = layer(keys)
    stats.append(layer.stats())
    layer(keys)
    owned = layer.hash_table.scores(torch.tensor([5, 6]))[1].tolist()
    torch.save({"first": first.abs().sum().item(), "second": bool((second.abs().sum(-1) > 0).all()),
                "stats": stats, "counts": owned}, f"{directory}/rank{rank}.pt")


@pytest.mark.distributed
def test_counts_are_per_step_not_per_rank_and_stats_are_summed_over_ranks(tmp_path):
    """"a key's LFU count grows by 1 per training step in which any rank looks it up",
    admission counts steps, not ranks, and ``stats()`` sums the ranks' shards."""
    spawn(_both_ranks_see_one_key_worker, 2, str(tmp_path), str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in results:
        assert result["first"] == 0 and result["second"]  # admitted at the 2nd step, not the 1st
        assert result["stats"][0] == {"size": 0, "capacity": 8, "evicted": 0, "admitted": 0, "pending": 2}
        assert result["stats"][1] == {"size": 2, "capacity": 8, "evicted": 0, "admitted": 2, "pending": 0}
    # Key 5 lives on rank 1, key 6 on rank 0: each counted once per step since its admission.
    assert results[0]["counts"] == [-1, 2] and results[1]["counts"] == [2, -1]

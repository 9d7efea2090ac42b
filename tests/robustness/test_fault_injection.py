"""Faults in the middle of an operation (an allocation failure, a KeyboardInterrupt between two
writes): the hash table is left as it was (or, where docs/design.md says so, finished), never with
its size, slots and rows disagreeing."""

import pytest
import torch

import sparsekit as sk
from sparsekit import ops
from sparsekit.hashtable import HashTable

from _distributed import spawn


def T(*values):
    return torch.tensor(values, dtype=torch.int64)


def _consistent(table):
    n = len(table)
    return torch.equal(table.find(table._row_keys[:n]), torch.arange(n)) and int((table._slot_rows >= 0).sum()) == n


def _fail_call(monkeypatch, owner, name, k, error, after=False):
    """owner.name raises ``error`` at its k-th call (after doing its work when ``after``)."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k and not after:
            raise error
        out = real(*args, **kwargs)
        if calls["n"] == k:
            raise error
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory (injected)"), KeyboardInterrupt()])
def test_an_evicting_insert_that_fails_while_placing_changes_nothing(monkeypatch, error):
    table = HashTable(4, eviction="lru")
    table.insert(T(10, 11, 12, 13)); table.tick()
    table.insert(T(12, 13)); table.tick()
    before = table.state_dict()
    _fail_call(monkeypatch, ops, "hash_table_insert_absent_", 1, error)
    with pytest.raises(type(error)):
        table.insert(T(20, 21))
    monkeypatch.undo()
    after = table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _consistent(table)
    # and the next insert is that of a table that never saw the failure
    fresh = HashTable(4, eviction="lru")
    fresh.load_state_dict(before)
    assert torch.equal(table.insert(T(30, 31, 32)), fresh.insert(T(30, 31, 32)))
    assert torch.equal(table.export()[0], fresh.export()[0])


def test_a_one_process_step_interrupted_after_placing_its_keys_leaves_the_table_usable(monkeypatch):
    layer = sk.DistributedEmbedding("sum", 8, 2, 1, 4)
    layer(sk.Ragged(T(1, 2), T(0, 1, 2)))
    _fail_call(monkeypatch, torch.ops.sparsekit, "hash_table_place_tables_", 1, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        layer(sk.Ragged(T(3, 4), T(0, 1, 2)))
    monkeypatch.undo()
    assert _consistent(layer.hash_table) and len(layer.hash_table) == 2
    layer(sk.Ragged(T(3, 4), T(0, 1, 2))).sum().backward()
    assert layer.hash_table.find(T(1, 2, 3, 4)).tolist() == [0, 1, 2, 3]


def test_an_evicting_step_interrupted_after_its_insert_gives_the_new_key_its_own_vector(monkeypatch):
    layer = sk.DistributedEmbedding("sum", 2, 2, 1, 4, eviction="lru")
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.5)
    for keys in ([10, 11], [10, 11], [11]):
        layer(sk.Ragged(T(*keys), T(0, len(keys)))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    _fail_call(monkeypatch, HashTable, "_commit_insert", 1, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        layer(sk.Ragged(T(12), T(0, 1)))
    monkeypatch.undo()
    row = int(layer.hash_table.find(T(12)))
    assert row >= 0
    assert torch.equal(layer.weight.detach()[row], layer.initial_rows(T(12))[0])
    assert bool(layer._fresh_rows[row])


def test_clear_and_remove_interrupted_between_writes_leave_a_consistent_table(monkeypatch):
    table = HashTable(8)
    table.insert(T(1, 2, 3))
    real_fill = table._slot_rows.fill_
    calls = {"n": 0}

    def fill(value):
        real_fill(value)
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt

    table._slot_rows.fill_ = fill
    with pytest.raises(KeyboardInterrupt):
        table.clear()
    del table._slot_rows.fill_
    assert len(table) == 0 and _consistent(table)

    pending = HashTable(8, eviction="lru")
    pending.insert(T(1, 2, 3, 4, 5, 6))
    _fail_call(monkeypatch, ops, "hash_table_erase_", 2, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        pending._remove(T(2, 3))
    monkeypatch.undo()
    assert _consistent(pending) and sorted(pending.export()[0].tolist()) == [1, 4, 5, 6]


def test_an_admitted_key_whose_step_fails_after_the_insert_leaves_the_pending_admissions(monkeypatch):
    # Out of memory writing the new row's vector, after the table took the admitted key: the
    # key must not stay pending too (a state every load refuses as damaged, which no later
    # step repaired: a checkpoint saved afterwards could not be loaded).
    from sparsekit.shard import _ModelParallelEmbedding

    layer = sk.DistributedEmbedding("sum", 8, 2, 1, 4, admit_after=2)
    layer(sk.Ragged(T(5), T(0, 1)))
    _fail_call(monkeypatch, _ModelParallelEmbedding, "_initialize_new_rows", 1,
               torch.OutOfMemoryError("CPU out of memory (injected)"))
    with pytest.raises(torch.OutOfMemoryError):
        layer(sk.Ragged(T(5), T(0, 1)))
    monkeypatch.undo()
    assert int(layer.hash_table.find(T(5))) >= 0 and int(layer._pending.find(T(5))) < 0
    assert _consistent(layer.hash_table) and _consistent(layer._pending)
    fresh = sk.DistributedEmbedding("sum", 8, 2, 1, 4, admit_after=2)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.export()[0], layer.export()[0])


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CPU out of memory (injected)"), MemoryError("injected"),
    # torch's CPU allocator raises a plain RuntimeError
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")])
def test_load_checkpoint_out_of_memory_is_not_called_a_damaged_checkpoint(monkeypatch, tmp_path, error):
    layer = sk.DistributedEmbedding("sum", 8, 2, 1, 4)
    layer(sk.Ragged(T(1, 2), T(0, 1, 2)))
    sk.save_checkpoint(str(tmp_path), layer)
    target = sk.DistributedEmbedding("sum", 8, 2, 1, 4)
    _fail_call(monkeypatch, torch, "load", 1, error)
    with pytest.raises(type(error)) as raised:
        sk.load_checkpoint(str(tmp_path), target)
    assert type(raised.value) is type(error)
    monkeypatch.undo()
    sk.load_checkpoint(str(tmp_path), target)
    assert torch.equal(target.export()[1], layer.export()[1])


def _fault_on_one_rank_worker(rank, world_size, init, where):
    import time

    from sparsekit import collection_ranks

    init()
    torch.manual_seed(0)
    if where == "partition_by_owner":
        module = sk.DistributedEmbedding("sum", 32, 2, 1, 4)
        owner, name = ops, "partition_by_owner"
    elif where == "unique":  # the owner's dedup of the keys it received (the second unique of the step)
        module = sk.DistributedEmbedding("sum", 32, 2, 1, 4)
        owner, name = ops, "unique"
    else:  # the collection owner's dedup of the pairs it received
        module = sk.EmbeddingBagCollection([sk.TableConfig("t", 2, 32, ["f"])])
        owner, name = collection_ranks, "_unique_tables"

    def step():
        keys = T(*range(rank * 8, rank * 8 + 8))
        if isinstance(module, sk.EmbeddingBagCollection):
            return module(sk.KeyedJagged(["f"], keys, lengths=torch.ones(8, dtype=torch.int64)))["f"]
        return module(sk.Ragged(keys, torch.arange(9)))

    step().sum().backward()
    real = getattr(owner, name)
    calls = {"n": 0}
    # ops.unique: the second call is the owner's dedup (the first the local one); the
    # collection's owner dedup is the only _unique_tables call of collection_ranks.
    k = 2 if where == "unique" else 1

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k:
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        return real(*args, **kwargs)

    if rank == 1:
        setattr(owner, name, failing)
    start = time.monotonic()
    try:
        with pytest.raises(torch.OutOfMemoryError if rank == 1 else RuntimeError):
            step()
    finally:
        setattr(owner, name, real)
    assert time.monotonic() - start < 10  # not the group's timeout
    tables = [module.hash_table] if isinstance(module, sk.DistributedEmbedding) else [module._shards[0].hash_table]
    assert all(_consistent(t) for t in tables)
    step().sum().backward()  # and the next step works on both ranks


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["partition_by_owner", "unique", "unique_tables"])
def test_out_of_memory_on_one_rank_before_the_lookup_agreement_raises_on_every_rank(tmp_path, where):
    spawn(_fault_on_one_rank_worker, 2, str(tmp_path), where)


def test_an_insert_whose_rebuild_is_interrupted_changes_nothing(monkeypatch):
    """The tombstone rebuild ends an insert: interrupted there (it re-places the live keys,
    then re-raises), the insert that raised had kept its new key, scored, where docs/design.md
    says a failing insert inserts nothing."""
    table = HashTable(4, eviction="lru")
    table.insert(T(0, 1, 2, 3))
    key = 4
    while (table._tombstones + 1) * 4 <= table.num_slots:  # until the next evicting insert rebuilds
        table.tick()
        table.insert(T(key))
        key += 1
    table.tick()
    before = table.state_dict()
    calls = _fail_call(monkeypatch, HashTable, "_place_live_keys", 1, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        table.insert(T(key))
    monkeypatch.undo()
    assert calls["n"] >= 1  # the rebuild ran
    after = table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _consistent(table) and int(table.find(T(key))) == -1


def test_the_insert_s_rollback_bookkeeping_reads_no_data_dependent_size():
    """What an insert keeps to undo itself must not cost a host sync on CUDA (docs/design.md: an
    insert syncs twice, unique's size and the count of new keys, placement none): a
    boolean-mask selection there (a nonzero) had added a third. Checked on the CPU by the
    ops _commit_insert dispatches: none whose output size depends on the data."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DataDependent(TorchDispatchMode):
        hits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            masks = args[1] if name.startswith("aten.index.Tensor") else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks or ()) or \
                    name.split(".")[1] in ("nonzero", "masked_select", "_local_scalar_dense"):
                self.hits.append(name)
            return func(*args, **(kwargs or {}))

    for eviction in (None, "lru"):
        table = HashTable(12, eviction=eviction)
        table.insert(torch.arange(10))
        table.tick()
        plan = table._plan_insert(torch.arange(5, 12 if eviction is None else 15))
        with DataDependent() as mode:
            table._commit_insert(plan)
        assert mode.hits == [], eviction
        assert _consistent(table)


def test_the_placement_elsewhere_than_the_cpu_is_taken_back_out_too(monkeypatch):
    """_grow_tables outside the CPU (CUDA) places table by table: interrupted after a table's
    slots took the keys but before its size did, the keys had stayed at rows past len(table)
    (only the CPU branch was rolled back). Keys whose ``device`` reads "cuda" take that branch
    here, on the CPU (torch.arange's device dropped)."""
    import types

    import sparsekit.hashtable as hashtable_module

    class CudaLooking(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def device(self):
            return torch.device("cuda")

    shim = types.ModuleType("torch_shim")
    shim.__dict__.update(torch.__dict__)
    shim.arange = lambda *args, device=None, **kwargs: torch.arange(*args, **kwargs)
    first, second = HashTable(8), HashTable(8)
    first.insert(T(1, 2))
    second.insert(T(5))
    keys = torch.Tensor._make_subclass(CudaLooking, T(3, 4, 6))
    monkeypatch.setattr(hashtable_module, "torch", shim)
    _fail_call(monkeypatch, ops, "hash_table_insert_absent_", 1, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        hashtable_module._grow_tables([first, second], keys, [0, 2, 3])
    monkeypatch.undo()
    assert (len(first), len(second)) == (2, 1) and _consistent(first) and _consistent(second)
    assert first.find(T(3, 4)).tolist() == [-1, -1] and second.find(T(6)).tolist() == [-1]
    assert first.insert(T(7)).tolist() == [2]


def _load_fault_on_one_rank_worker(rank, world_size, init, directory):
    """A fault in load_checkpoint's writing phase on rank 1 (after every check passed): every
    rank raises (rank 0 had returned as if loaded, so the "load again" docs/failures.md advises was a
    collective rank 0 never joined); loading again on every rank then gives the checkpoint."""
    import time

    from sparsekit.checkpoint import loading as checkpoint

    init()
    torch.manual_seed(0)
    layer = sk.DistributedEmbedding("sum", 16, 2, 1, 4, eviction="lru", admit_after=2)
    optimizer = sk.LazyAdam(layer.parameters(), lr=0.1)

    def step(seed):
        keys = (torch.arange(6) * 3 + seed + rank) % 20
        layer(sk.Ragged(keys, torch.arange(7))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for seed in range(3):
        step(seed)
    sk.save_checkpoint(directory, layer, optimizer)
    saved_keys, saved_vectors = layer.export()
    saved_moments = optimizer.state[layer.weight]["exp_avg"][:len(layer.hash_table)].clone()
    for seed in range(3, 5):
        step(seed)
    real = checkpoint._apply_layer
    if rank == 1:
        checkpoint._apply_layer = lambda *args: (_ for _ in ()).throw(torch.OutOfMemoryError("CPU out of memory (injected)"))
    start = time.monotonic()
    try:
        with pytest.raises(torch.OutOfMemoryError if rank == 1 else checkpoint.OtherRankError):
            sk.load_checkpoint(directory, layer, optimizer)
    finally:
        checkpoint._apply_layer = real
    assert time.monotonic() - start < 10
    assert _consistent(layer.hash_table) and _consistent(layer._pending)
    sk.load_checkpoint(directory, layer, optimizer)
    keys, vectors = layer.export()
    assert torch.equal(keys, saved_keys) and torch.equal(vectors, saved_vectors)
    assert torch.equal(optimizer.state[layer.weight]["exp_avg"][:len(layer.hash_table)], saved_moments)
    step(5)


@pytest.mark.distributed
def test_a_fault_while_load_checkpoint_writes_on_one_rank_raises_on_every_rank(tmp_path):
    spawn(_load_fault_on_one_rank_worker, 2, str(tmp_path), str(tmp_path / "ckpt"))

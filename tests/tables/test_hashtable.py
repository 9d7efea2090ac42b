import io

import pytest
import torch
from _cuda import count_host_syncs

import sparsekit as sk

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
ADVERSARIAL = [INT64_MIN, INT64_MAX, -1, 0]


class DictTable:
    """The reference: a Python dict with the same row-assignment rule."""

    def __init__(self):
        self.rows = {}

    def insert(self, keys):
        return [self.rows.setdefault(k, len(self.rows)) for k in keys]

    def find(self, keys):
        return [self.rows.get(k, -1) for k in keys]


def snapshot(table: sk.HashTable, probe: torch.Tensor):
    keys, rows = table.export()
    return len(table), keys.cpu().clone(), rows.cpu().clone(), table.find(probe).cpu().clone()


def assert_same_snapshot(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x, y)


# ---- the raw ops ----


def empty_slots(num_slots, device):
    return (torch.zeros(num_slots, dtype=torch.int64, device=device),
            torch.full((num_slots,), -1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_ops_insert_then_find(device, key_dtype):
    slot_keys, slot_rows = empty_slots(64, device)
    lo, hi = (INT64_MIN, INT64_MAX) if key_dtype == torch.int64 else (-(2**31), 2**31 - 1)
    keys = torch.tensor([lo, hi, -1, 0, 7, 12345], dtype=key_dtype, device=device)
    rows = torch.tensor([10, 3, 0, 5, 1, 2], device=device)
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, rows)
    assert int((slot_rows >= 0).sum()) == 6
    probe = torch.tensor([[hi, 8], [0, lo]], dtype=key_dtype, device=device)
    assert torch.equal(sk.ops.hash_table_find(slot_keys, slot_rows, probe).cpu(), torch.tensor([[3, -1], [5, 10]]))
    # int32 keys compare equal to int64 keys of the same value.
    assert torch.equal(sk.ops.hash_table_find(slot_keys, slot_rows, keys.long()).cpu(), rows.cpu())


def test_ops_find_empty_and_empty_table(device):
    slot_keys, slot_rows = empty_slots(16, device)
    keys = torch.tensor(ADVERSARIAL, device=device)
    assert torch.equal(sk.ops.hash_table_find(slot_keys, slot_rows, keys).cpu(), torch.full((4,), -1))
    out = sk.ops.hash_table_find(slot_keys, slot_rows, torch.empty(0, 3, dtype=torch.int64, device=device))
    assert out.shape == (0, 3) and out.dtype == torch.int64
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys[:0], keys[:0])
    assert bool((slot_rows == -1).all())


def test_ops_colliding_keys_probe(device):
    """Many keys in a small table: probe sequences run long and wrap around the end."""
    slot_keys, slot_rows = empty_slots(16, device)
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1, 2, 3, 4], device=device)
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.arange(8, device=device))
    assert torch.equal(sk.ops.hash_table_find(slot_keys, slot_rows, keys).cpu(), torch.arange(8))
    assert torch.equal(sk.ops.hash_table_find(slot_keys, slot_rows, keys + 100).cpu()[4:], torch.full((4,), -1))


def test_ops_opcheck(device):
    slot_keys, slot_rows = empty_slots(32, device)
    keys = torch.tensor([5, INT64_MIN, -1, 0], device=device)
    torch.library.opcheck(torch.ops.sparsekit.hash_table_insert_absent_,
                          (slot_keys.clone(), slot_rows.clone(), keys, torch.arange(4, device=device)))
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.arange(4, device=device))
    torch.library.opcheck(torch.ops.sparsekit.hash_table_find,
                          (slot_keys, slot_rows, torch.tensor([[0, 9], [5, -1]], device=device)))
    torch.library.opcheck(torch.ops.sparsekit.hash_table_find,
                          (slot_keys, slot_rows, torch.tensor([0, 9], dtype=torch.int32, device=device)))


def test_ops_bad_inputs(device):
    slot_keys, slot_rows = empty_slots(16, device)
    keys = torch.tensor([1, 2], device=device)
    with pytest.raises(RuntimeError, match="power of two"):
        sk.ops.hash_table_find(slot_keys[:12], slot_rows[:12], keys)
    with pytest.raises(RuntimeError, match="slot_keys must be int64"):
        sk.ops.hash_table_find(slot_keys.int(), slot_rows, keys)
    with pytest.raises(RuntimeError, match="must match"):
        sk.ops.hash_table_find(slot_keys, slot_rows[:8], keys)
    with pytest.raises(RuntimeError, match="keys must be an int64 or int32"):
        sk.ops.hash_table_find(slot_keys, slot_rows, keys.float())
    with pytest.raises(RuntimeError, match="one row per key"):
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.tensor([0], device=device))
    with pytest.raises(RuntimeError, match="rows must be int64"):
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.tensor([0, 1], dtype=torch.int32,
                                                                                  device=device))
    with pytest.raises(RuntimeError, match="rows must be >= 0"):
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.tensor([0, -3], device=device))
    assert bool((slot_rows == -1).all()), "a rejected insert must leave the table unchanged"
    # Overfilling the slot array (the op's contract is at most half full) raises instead of hanging.
    full_keys, full_rows = empty_slots(16, device)
    sk.ops.hash_table_insert_absent_(full_keys, full_rows, torch.arange(16, device=device),
                                     torch.arange(16, device=device))
    with pytest.raises(RuntimeError, match="cannot fit|no empty slot|do not fit"):
        sk.ops.hash_table_insert_absent_(full_keys, full_rows, torch.tensor([99], device=device),
                                         torch.tensor([16], device=device))
    # ...and a find of a missing key in that full slot array ends too.
    found = sk.ops.hash_table_find(full_keys, full_rows, torch.tensor([99, 3], device=device))
    assert found.cpu().tolist() == [-1, 3]
    if device.type != "cpu":
        with pytest.raises(RuntimeError, match="must be on the table's device"):
            sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys.cpu(), torch.arange(2))


# ---- the HashTable class ----


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_table_against_dict(device, key_dtype):
    gen = torch.Generator().manual_seed(0)
    table = sk.HashTable(3000, key_dtype=key_dtype, device=device)
    ref = DictTable()
    extremes = ADVERSARIAL if key_dtype == torch.int64 else [-(2**31), 2**31 - 1, -1, 0]
    for step in range(6):
        batch = torch.randint(-2000, 2000, (700,), generator=gen)
        if step == 2:
            batch = torch.cat([batch[:300], torch.tensor(extremes * 3), batch[300:]])
        batch = batch.to(key_dtype)
        got = table.insert(batch.to(device))
        assert got.dtype == torch.int64 and got.device.type == device.type
        assert got.cpu().tolist() == ref.insert(batch.tolist())
        assert len(table) == len(ref.rows)
        probe = torch.randint(-2500, 2500, (500,), generator=gen).to(key_dtype)
        assert table.find(probe.to(device)).cpu().tolist() == ref.find(probe.tolist())
    keys, rows = table.export()
    assert keys.dtype == key_dtype
    assert keys.cpu().tolist() == list(ref.rows)
    assert torch.equal(rows.cpu(), torch.arange(len(ref.rows)))


def test_table_rows_first_occurrence(device):
    table = sk.HashTable(100, device=device)
    rows = table.insert(torch.tensor([[30, 10], [30, 20], [INT64_MIN, 10]], device=device))
    assert torch.equal(rows.cpu(), torch.tensor([[0, 1], [0, 2], [3, 1]]))
    rows = table.insert(torch.tensor([20, -1, 0, -1, INT64_MAX, 30], device=device))
    assert torch.equal(rows.cpu(), torch.tensor([2, 4, 5, 4, 6, 0]))
    assert len(table) == 7
    assert table.insert(torch.empty(0, dtype=torch.int64, device=device)).shape == (0,)
    assert len(table) == 7


def test_table_adversarial_keys_only(device):
    table = sk.HashTable(4, device=device)
    keys = torch.tensor(ADVERSARIAL, device=device)
    assert torch.equal(table.insert(keys).cpu(), torch.arange(4))
    assert torch.equal(table.find(keys.flip(0)).cpu(), torch.tensor([3, 2, 1, 0]))
    assert torch.equal(table.find(torch.tensor([1, -2, INT64_MIN + 1], device=device)).cpu(), torch.full((3,), -1))


def test_table_capacity_exact_and_overflow(device):
    table = sk.HashTable(10, device=device)
    table.insert(torch.tensor([1, 2, 3, 1], device=device))
    probe = torch.tensor([1, 2, 3, 4, 5, 100, 101], device=device)
    assert torch.equal(table.insert(torch.arange(100, 107, device=device)).cpu(), torch.arange(3, 10))
    assert len(table) == 10  # exactly full
    # Known keys still work when full.
    assert torch.equal(table.insert(torch.tensor([100, 1], device=device)).cpu(), torch.tensor([3, 0]))
    before = snapshot(table, probe)
    with pytest.raises(sk.HashTableFullError, match=r"1 new keys.*holds 10 of its capacity 10"):
        table.insert(torch.tensor([100, 5, 1], device=device))
    assert_same_snapshot(before, snapshot(table, probe))
    assert isinstance(sk.HashTableFullError("x"), RuntimeError)


def test_table_overflow_leaves_partial_table_unchanged(device):
    table = sk.HashTable(5, device=device)
    table.insert(torch.tensor([7, 8], device=device))
    probe = torch.arange(0, 20, device=device)
    before = snapshot(table, probe)
    with pytest.raises(sk.HashTableFullError, match="4 new keys"):
        table.insert(torch.tensor([1, 2, 7, 3, 4], device=device))
    assert_same_snapshot(before, snapshot(table, probe))
    assert torch.equal(table.insert(torch.tensor([1, 2, 3], device=device)).cpu(), torch.tensor([2, 3, 4]))


def test_table_clear(device):
    table = sk.HashTable(8, device=device)
    table.insert(torch.tensor([5, 6, 7], device=device))
    table.clear()
    assert len(table) == 0
    assert torch.equal(table.find(torch.tensor([5, 6, 7], device=device)).cpu(), torch.full((3,), -1))
    assert torch.equal(table.insert(torch.tensor([7, 5], device=device)).cpu(), torch.tensor([0, 1]))
    assert table.capacity == 8


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
def test_table_state_dict_round_trip(device, key_dtype):
    table = sk.HashTable(50, key_dtype=key_dtype, device=device)
    keys = torch.tensor([9, -1, 0, 2**31 - 1, -(2**31), 9, 44], dtype=key_dtype, device=device)
    table.insert(keys)
    buffer = io.BytesIO()
    torch.save(table.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    restored = sk.HashTable(20, key_dtype=key_dtype, device=device)  # another capacity works
    restored.insert(torch.tensor([123], dtype=key_dtype, device=device))  # replaced by the load
    restored.load_state_dict(state)
    assert len(restored) == len(table)
    assert torch.equal(restored.find(keys).cpu(), table.find(keys).cpu())
    assert torch.equal(restored.export()[0].cpu(), table.export()[0].cpu())
    assert int(restored.find(torch.tensor([123], dtype=key_dtype, device=device))) == -1
    too_small = sk.HashTable(3, key_dtype=key_dtype, device=device)
    with pytest.raises(sk.HashTableFullError, match="capacity 3"):
        too_small.load_state_dict(state)
    assert len(too_small) == 0


def test_table_state_dict_bad(device):
    table = sk.HashTable(8, key_dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="no 'keys'"):
        table.load_state_dict({})
    with pytest.raises(ValueError, match="not distinct"):
        table.load_state_dict({"keys": torch.tensor([1, 2, 1], dtype=torch.int32)})
    with pytest.raises(TypeError, match="key_dtype"):
        table.load_state_dict({"keys": torch.tensor([1, 2])})


def test_table_to(device):
    table = sk.HashTable(16, device=device)
    keys = torch.tensor(ADVERSARIAL + [3, 4], device=device)
    table.insert(keys)
    assert table.to(device) is table
    moved = table.to("cpu")
    assert moved.device.type == "cpu" and len(moved) == len(table) and moved.capacity == 16
    assert torch.equal(moved.find(keys.cpu()), torch.arange(6))
    # A moved copy is independent of the original.
    moved.insert(torch.tensor([77]))
    assert len(moved) == 7
    if device.type != "cpu":
        assert len(table) == 6
        back = moved.to(device)
        assert back.device == table.device
        assert torch.equal(back.find(keys).cpu(), torch.arange(6))


def test_table_bad_inputs(device):
    with pytest.raises(ValueError, match="capacity"):
        sk.HashTable(-1)
    with pytest.raises(TypeError, match="key_dtype"):
        sk.HashTable(4, key_dtype=torch.float32)
    table = sk.HashTable(4, key_dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="cast them"):
        table.insert(torch.tensor([1, 2], device=device))
    with pytest.raises(TypeError, match="int64 or int32"):
        table.find(torch.tensor([1.0], device=device))
    if device.type != "cpu":
        with pytest.raises(RuntimeError, match="move them"):
            table.find(torch.tensor([1], dtype=torch.int32))


def test_table_large_load(device):
    """A table filled to capacity with spread-out keys: all found, misses stay misses."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(INT64_MIN, INT64_MAX, (20_000,), generator=gen)
    keys = sk.ops.unique(keys, return_inverse=False)
    table = sk.HashTable(keys.numel(), device=device)
    assert table.num_slots >= 2 * keys.numel()
    assert torch.equal(table.insert(keys.to(device)).cpu(), torch.arange(keys.numel()))
    assert torch.equal(table.find(keys.to(device)).cpu(), torch.arange(keys.numel()))
    misses = keys[:1000] ^ 1
    in_table = torch.isin(misses, keys)
    found = table.find(misses.to(device)).cpu()
    assert bool((found[~in_table] == -1).all())


@pytest.mark.parametrize("pass_occupied", [False, True])
def test_raw_insert_that_does_not_fit_writes_nothing_on_every_device(device, pass_occupied):
    """A raw insert whose keys do not all fit in the empty slots raises before writing, so
    the table is the same (untouched) on CPU and CUDA; so does a negative row."""
    slot_keys = torch.zeros(16, dtype=torch.int64, device=device)
    slot_rows = torch.full((16,), -1, dtype=torch.int64, device=device)
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.arange(10, device=device),
                                     torch.arange(10, device=device), 0 if pass_occupied else None)
    before = slot_keys.clone(), slot_rows.clone()
    with pytest.raises(RuntimeError, match="7 keys do not fit in the 6 empty slots"):
        sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.arange(100, 107, device=device),
                                         torch.arange(10, 17, device=device), 10 if pass_occupied else None)
    assert torch.equal(slot_keys, before[0]) and torch.equal(slot_rows, before[1])
    if not pass_occupied or device.type == "cpu":
        with pytest.raises(RuntimeError, match="rows must be >= 0"):
            sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.tensor([200, 201], device=device),
                                             torch.tensor([11, -1], device=device), 10 if pass_occupied else None)
        assert torch.equal(slot_keys, before[0]) and torch.equal(slot_rows, before[1])
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.arange(100, 106, device=device),
                                     torch.arange(10, 16, device=device), 10 if pass_occupied else None)
    rows = sk.ops.hash_table_find(slot_keys, slot_rows, torch.cat([torch.arange(10), torch.arange(100, 106)]).to(device))
    assert torch.equal(rows.cpu(), torch.arange(16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_hash_table_insert_host_syncs_on_cuda():
    """HashTable.insert syncs exactly as documented: unique's size and the count of new keys."""
    table = sk.HashTable(1 << 12, device="cuda")
    table.insert(torch.arange(100, device="cuda"))  # warm up (allocator, CUB temp sizes)
    assert count_host_syncs(lambda: table.insert(torch.arange(50, 300, device="cuda"))) == 2


def test_erase_select_and_score_ops_opcheck(device):
    """opcheck (schema, fake kernel, aliasing of the in-place arguments) of the ops that
    the other opcheck tests leave out: erase, the eviction's selection and the tables'
    scoring."""
    slot_keys, slot_rows = empty_slots(32, device)
    keys = torch.tensor([5, INT64_MIN, -1, 0], device=device)
    sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, keys, torch.arange(4, device=device))
    torch.library.opcheck(torch.ops.sparsekit.hash_table_erase_,
                          (slot_keys.clone(), slot_rows.clone(), torch.tensor([5, 7, 0], device=device)))
    columns = [torch.tensor([5, 1, 3, 1, 9], device=device), torch.tensor([10, 20, 30, 5, 1], device=device)]
    eligible = torch.tensor([True, True, True, True, False], device=device)
    for k in (0, 2, 4):
        torch.library.opcheck(torch.ops.sparsekit.select_smallest, (columns, eligible, k))
    if device == "cpu" or torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::hash_table_score_tables_",
                                                                         "CUDA"):
        last_seen = [torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int64,
                                                                                   device=device)]
        count = [t.clone() for t in last_seen]
        torch.library.opcheck(torch.ops.sparsekit.hash_table_score_tables_,
                              (last_seen, count, torch.tensor([0, 3, 3, -1, 2], device=device), [0, 3, 5], [7, 2]))


def test_one_table_inserted_into_from_two_threads_gives_every_key_its_own_row():
    # The kernels release the GIL and insert plans its rows from len(table) before placing
    # them: two threads at once gave two keys one row (25k of 1.5M here), without a word.
    import copy
    import pickle
    import threading

    table = sk.HashTable(400_000)
    batches = [[torch.randint(0, 1 << 50, (2000,), generator=torch.Generator().manual_seed(1000 * t + i))
                for i in range(80)] for t in range(2)]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [threading.Thread(target=lambda b=b: [table.insert(k) for k in b]) for b in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(old)
    every_key = torch.cat([k for b in batches for k in b])
    rows = table.find(every_key)
    assert len(table) == torch.unique(every_key).numel()
    assert bool((rows >= 0).all())
    assert torch.unique(rows).numel() == len(table)
    # The lock is no state: copies and pickles still work, each with a lock of its own.
    for clone in (copy.deepcopy(table), pickle.loads(pickle.dumps(table)), copy.copy(table)):
        assert torch.equal(clone.find(every_key), rows)
        assert clone._lock is not table._lock


def test_a_table_call_still_compiles_whole_with_its_lock():
    # Dynamo cannot enter the table's RLock ("Unsupported context manager"): with the lock
    # taken under torch.compile, fullgraph=True refused table.find and the default mode
    # broke the graph, where the call compiled whole before the lock.
    import torch._dynamo

    table = sk.HashTable(64)
    table.insert(torch.arange(10))

    def lookup(keys):
        return table.find(keys) + 1

    keys = torch.tensor([3, 11, 0])
    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(lookup, fullgraph=True, backend="eager")(keys), lookup(keys))
        torch._dynamo.reset()
        assert torch._dynamo.explain(lookup)(keys).graph_break_count == 0
    finally:
        torch._dynamo.reset()

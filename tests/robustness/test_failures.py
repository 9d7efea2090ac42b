"""Failure behaviour across the package: errors that name what is wrong."""

import subprocess
import sys

import pytest
import torch

import sparsekit as sk

HUGE = [2**40, 2**62]


@pytest.mark.parametrize("size", HUGE)
def test_sizes_too_large_to_allocate_name_the_argument_and_bytes(size):
    with pytest.raises(MemoryError, match=rf"HashTable: capacity={size} .*bytes .*cannot be allocated"):
        sk.HashTable(size)
    with pytest.raises(RuntimeError, match=rf"DistributedEmbedding: max_vocabulary_size_per_gpu={size} .*bytes"):
        sk.DistributedEmbedding("sum", size, 16, 1, 1)
    with pytest.raises(MemoryError, match=rf"All2AllDenseEmbedding: max_vocabulary_size_per_gpu={size} .*bytes"):
        sk.All2AllDenseEmbedding(size, 16, 1, 1, use_hashtable=False)


@pytest.mark.parametrize("size", HUGE)
def test_sizes_too_large_name_the_argument_the_user_gave(size):
    """A collection's table named the layers' embedding_vec_size, and a huge
    admission_capacity the pending table's "HashTable: capacity"."""
    with pytest.raises(MemoryError, match=rf"table 't': capacity=4 x embedding_dim={size} \(the local shard\)"):
        sk.EmbeddingBagCollection([sk.TableConfig("t", size, 4, ["f"])])
    with pytest.raises(MemoryError, match=rf"DistributedEmbedding: admission_capacity={size} \(the pending "
                                          r"admissions' table\): HashTable: capacity="):
        sk.DistributedEmbedding("sum", 8, 4, 1, 1, admit_after=2, admission_capacity=size)


@pytest.mark.parametrize("size", HUGE)
def test_op_outputs_too_large_name_the_argument(size):
    with pytest.raises(MemoryError, match=rf"segment_sum: num_segments={size} .*bytes"):
        sk.ops.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size)
    for mean in (lambda: sk.ops.segment_mean(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size),
                 lambda: sk.ops.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size, reduce="mean")):
        with pytest.raises(MemoryError,
                           match=rf"^segment_mean: num_segments={size} .*bytes"):  # it had named segment_sum
            mean()
    with pytest.raises(MemoryError, match=rf"key_seeded_uniform: 1 keys x dim={size} .*bytes"):
        sk.ops.key_seeded_uniform(torch.tensor([1]), size)
    # Also torch's type for running out of memory, so a loop's handler for it still catches it.
    with pytest.raises(torch.OutOfMemoryError, match=rf"segment_sum: num_segments={size} .*bytes") as info:
        sk.ops.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size)
    assert isinstance(info.value, (MemoryError, RuntimeError))
    # Ordinary errors still pass through unchanged.
    with pytest.raises(RuntimeError, match="segment_sum") as info:
        sk.ops.segment_sum(torch.ones(3, 2), torch.full((3,), 5), 2)
    assert not isinstance(info.value, MemoryError)


def test_a_host_tensor_larger_than_the_machine_is_refused_before_it_is_allocated(monkeypatch):
    """Where Linux overcommits memory (vm.overcommit_memory=1, the GPU machine) a 4 TiB host
    tensor was granted, and the pass that zeroed it got the pytest worker killed: a host
    size is now checked against the machine's memory and swap first, in the wrappers and in
    the kernels."""
    import sparsekit._checks as checks

    monkeypatch.setattr(checks, "HOST_MEMORY_BYTES", 1 << 20)
    ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(MemoryError, match=r"^segment_sum: num_segments=1000000 \(the output\): needs a \[1000000, 2\] "
                                          r".* on cpu, more than this machine's 1,048,576 bytes \(1.0 MiB\) of memory "
                                          r"and swap, which cannot be allocated"):
        sk.ops.segment_sum(torch.ones(3, 2), ids, 1_000_000)
    with pytest.raises(MemoryError, match=r"^HashTable: capacity=100000 .*more than this machine's"):
        sk.HashTable(100_000)
    assert sk.ops.segment_sum(torch.ones(3, 2), ids, 1000).shape == (1000, 2)  # within the limit
    monkeypatch.undo()
    if sys.platform.startswith("linux"):  # the kernels' own check reads the memory with sysinfo
        with pytest.raises(RuntimeError, match=r"^segment_sum: num_segments=1099511627776 \(the output\) cannot be "
                                               r"allocated \(8796093022208 bytes \(8.0 TiB\), more than this machine's \d+ bytes \(\d+\.\d [GT]iB\) "
                                               r"of memory and swap\); choose a smaller value"):
            torch.ops.sparsekit.segment_sum(torch.ones(3, 2), ids, 2**40, False)
        with pytest.raises(RuntimeError, match=r"^key_seeded_uniform: dim=1099511627776 for 1 keys \(the output\) "
                                               r"cannot be allocated \(4398046511104 bytes \(4.0 TiB\), more than"):
            torch.ops.sparsekit.key_seeded_uniform(torch.tensor([1]), 2**40, 0, -0.05, 0.05, None)


@pytest.mark.parametrize("state", [None, [1, 2], "keys"])
def test_hash_table_load_state_dict_of_the_wrong_type(state):
    table = sk.HashTable(4)
    table.insert(torch.tensor([7]))
    with pytest.raises(TypeError, match="HashTable.load_state_dict: expected the dict"):
        table.load_state_dict(state)
    assert table.find(torch.tensor([7])).item() == 0


# ---- the fakes apply the kernels' checks ---------------------------------------------------

L = torch.long


def _mixed(dev):
    """Calls with one tensor argument on ``dev`` and the rest on the CPU."""
    return {
        "segment_sum data": lambda: sk.ops.segment_sum(torch.ones(3, 2, device=dev), torch.zeros(3, dtype=L), 2),
        "segment_sum ids": lambda: sk.ops.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=L, device=dev), 2),
        "embedding_bag rows": lambda: sk.ops.embedding_bag(torch.ones(3, 2), torch.zeros(3, dtype=L, device=dev),
                                                           torch.tensor([0, 3])),
        "embedding_bag offsets": lambda: sk.ops.embedding_bag(torch.ones(3, 2), torch.zeros(3, dtype=L),
                                                              torch.tensor([0, 3], device=dev)),
        "embedding_bag weights": lambda: sk.ops.embedding_bag(torch.ones(3, 2), torch.zeros(3, dtype=L),
                                                              torch.tensor([0, 3]), torch.ones(3, device=dev)),
        "embedding_gather rows": lambda: sk.ops.embedding_gather(torch.ones(3, 2), torch.zeros(3, dtype=L, device=dev)),
        "embedding_gather weight": lambda: sk.ops.embedding_gather(torch.ones(3, 2, device=dev), torch.zeros(3, dtype=L)),
        "lazy_adam_ moment": lambda: sk.ops.lazy_adam_(torch.ones(3, 2), torch.zeros(3, 2), torch.zeros(3, 2, device=dev),
                                                       torch.tensor([0]), torch.ones(1, 2), 1, 0.1, 0.9, 0.99, 1e-8),
        "hash_table_insert_absent_ keys": lambda: sk.ops.hash_table_insert_absent_(
            torch.zeros(16, dtype=L), torch.full((16,), -1), torch.tensor([1], device=dev), torch.tensor([0])),
        "hash_table_find keys": lambda: sk.ops.hash_table_find(torch.zeros(16, dtype=L), torch.full((16,), -1),
                                                               torch.tensor([1], device=dev)),
    }


@pytest.mark.parametrize("case", list(_mixed("meta")))
def test_fakes_refuse_mixed_devices(case):
    """A meta argument routes the call to the fake kernel, which must refuse a mix of
    devices as the real kernels do, instead of returning uninitialised or meta tensors."""
    with pytest.raises(RuntimeError, match=r"is on (meta|cpu) but .* is on (cpu|meta)"):
        _mixed("meta")[case]()


def _bad_arguments(dev):
    """Bad calls that every kernel, real or fake, must refuse."""
    return {
        "partition_by_owner world_size": lambda: sk.ops.partition_by_owner(torch.tensor([1], device=dev), 2**40),
        "partition_by_owner float keys": lambda: sk.ops.partition_by_owner(torch.ones(2, device=dev), 2),
        "unique float keys": lambda: sk.ops.unique(torch.ones(3, device=dev)),
        "segment_sum int data": lambda: sk.ops.segment_sum(torch.ones(3, 2, dtype=L, device=dev),
                                                           torch.zeros(3, dtype=L, device=dev), 2),
        "segment_sum float ids": lambda: sk.ops.segment_sum(torch.ones(3, 2, device=dev), torch.zeros(3, device=dev), 2),
        "segment_sum lengths": lambda: sk.ops.segment_sum(torch.ones(3, 2, device=dev),
                                                          torch.zeros(2, dtype=L, device=dev), 2),
        "key_seeded_uniform dim": lambda: sk.ops.key_seeded_uniform(torch.tensor([1], device=dev), -1),
        "key_seeded_uniform bounds": lambda: sk.ops.key_seeded_uniform(torch.tensor([1], device=dev), 2, low=1.0,
                                                                       high=0.0),
        "key_seeded_uniform int dtype": lambda: sk.ops.key_seeded_uniform(torch.tensor([1], device=dev), 2,
                                                                          dtype=torch.int32),
        "lazy_adam_ step": lambda: sk.ops.lazy_adam_(*_adam_args(dev), 0, 0.1, 0.9, 0.99, 1e-8),
        "lazy_adam_ beta1": lambda: sk.ops.lazy_adam_(*_adam_args(dev), 1, 0.1, 1.0, 0.99, 1e-8),
        "lazy_adam_ grad shape": lambda: sk.ops.lazy_adam_(*_adam_args(dev)[:4], torch.ones(1, 3, device=dev),
                                                           1, 0.1, 0.9, 0.99, 1e-8),
        "embedding_bag int weight": lambda: sk.ops.embedding_bag(torch.ones(3, 2, dtype=L, device=dev),
                                                                 torch.zeros(3, dtype=L, device=dev),
                                                                 torch.tensor([0, 3], device=dev)),
        "embedding_bag float rows": lambda: sk.ops.embedding_bag(torch.ones(3, 2, device=dev), torch.zeros(3, device=dev),
                                                                 torch.tensor([0, 3], device=dev)),
        "embedding_bag max weighted": lambda: sk.ops.embedding_bag(
            torch.ones(3, 2, device=dev), torch.zeros(3, dtype=L, device=dev), torch.tensor([0, 3], device=dev),
            torch.ones(3, device=dev), mode="max"),
        "embedding_gather float rows": lambda: sk.ops.embedding_gather(torch.ones(3, 2, device=dev),
                                                                       torch.zeros(3, device=dev)),
    }


def _adam_args(dev):
    return (torch.ones(3, 2, device=dev), torch.zeros(3, 2, device=dev), torch.zeros(3, 2, device=dev),
            torch.tensor([0], device=dev), torch.ones(1, 2, device=dev))


@pytest.mark.parametrize("case", list(_bad_arguments("cpu")))
@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_fakes_apply_the_kernels_checks(case, dev):
    """The same bad call raises on the real CPU kernel and on the fake (meta)."""
    op = case.split()[0]
    with pytest.raises(RuntimeError, match=op):
        _bad_arguments(dev)[case]()


def _update_args(weight, exp_avg, exp_avg_sq, rows, grad):
    return (weight, exp_avg, exp_avg_sq, rows, grad, 1, 0.1, 0.9, 0.999, 1e-8, 0.0)


@pytest.mark.parametrize("alias", ["exp_avg is weight", "exp_avg_sq is exp_avg", "grad is a view of weight",
                                   "grad overlaps exp_avg_sq", "rows is a view of exp_avg", "rows is a view of weight"])
def test_lazy_adam_refuses_arguments_that_share_memory(alias):
    """The update writes weight and the moments in place while it reads rows and grad: shared
    memory would be read after it was written (a silently wrong step, or, for rows, an update
    sent out of bounds: a crash). Nothing is written."""
    weight, exp_avg, exp_avg_sq = torch.randn(6, 4), torch.zeros(6, 4), torch.zeros(6, 4)
    rows, grad = torch.tensor([1, 3]), torch.randn(2, 4)
    if alias.startswith("rows"):
        # Two int64 row ids in the last row of the written tensor (its bytes reread as int64).
        rows = (exp_avg if alias.endswith("exp_avg") else weight).view(torch.int64)[5]
        rows.copy_(torch.tensor([5, 1]))
    elif alias == "exp_avg is weight":
        exp_avg = weight
    elif alias == "exp_avg_sq is exp_avg":
        exp_avg_sq = exp_avg
    elif alias == "grad is a view of weight":
        grad = weight[2:4]
    else:
        grad = exp_avg_sq[4:6]
    before = [t.clone() for t in (weight, exp_avg, exp_avg_sq)]
    with pytest.raises(RuntimeError, match="lazy_adam_: .* share memory"):
        torch.ops.sparsekit.lazy_adam_(*_update_args(weight, exp_avg, exp_avg_sq, rows, grad))
    assert all(torch.equal(a, b) for a, b in zip(before, (weight, exp_avg, exp_avg_sq)))
    # Disjoint slices of one buffer are fine.
    buffer = torch.zeros(3, 6, 4)
    buffer[0] = torch.randn(6, 4)
    torch.ops.sparsekit.lazy_adam_(*_update_args(buffer[0], buffer[1], buffer[2], rows, torch.randn(2, 4)))


def test_lazy_adam_tables_refuses_moments_that_share_memory():
    weight = torch.randn(6, 4).half()
    exp_avg, exp_avg_sq = torch.zeros(6, 4), torch.zeros(6, 4)
    grad = weight[1:2].float()
    torch.ops.sparsekit.lazy_adam_tables_([weight], [exp_avg], [exp_avg_sq], [torch.tensor([1])], [grad], [1],
                                          [0.1, 0.9, 0.999, 1e-8, 0.0])
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.sparsekit.lazy_adam_tables_([weight], [exp_avg], [exp_avg], [torch.tensor([1])], [grad], [2],
                                              [0.1, 0.9, 0.999, 1e-8, 0.0])


def test_lazy_adam_refuses_a_gradient_marked_coalesced_with_a_repeated_row():
    """The fused tables update would update the row twice (and two threads could race on it)."""
    weight = torch.nn.Parameter(torch.zeros(6, 3))
    optimizer = sk.LazyAdam([weight], lr=0.1)
    weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.ones(2, 3), (6, 3), is_coalesced=True)
    with pytest.raises(RuntimeError, match="row 1 more than once"):
        optimizer.step()
    assert torch.equal(weight.detach(), torch.zeros(6, 3)) and not optimizer.state[weight]


@pytest.mark.parametrize("repeated", [[2, 1, 2], [1, 2, 2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lazy_adam_refuses_a_repeated_row_before_any_parameter_changes(dtype, repeated):
    """float64 parameters take the update parameter by parameter (not the fused tables
    update): a later gradient marked coalesced with a repeated row must still be refused
    before the first parameter or any step counter changes, the repeat apart or next to
    itself ([1, 2, 2]: never descending)."""
    first, second = (torch.nn.Parameter(torch.zeros(6, 3, dtype=dtype)) for _ in range(2))
    optimizer = sk.LazyAdam([first, second], lr=0.1)
    first.grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3, dtype=dtype), (6, 3))
    second.grad = torch.sparse_coo_tensor(torch.tensor([repeated]), torch.ones(3, 3, dtype=dtype), (6, 3),
                                          is_coalesced=True)
    with pytest.raises(RuntimeError, match=r"parameter 1 of group 0 is marked coalesced but holds row 2 more than "
                                           r"once .*nothing was updated"):
        optimizer.step()
    assert torch.equal(first.detach(), torch.zeros(6, 3, dtype=dtype)) and not optimizer.state[first]
    assert torch.equal(second.detach(), torch.zeros(6, 3, dtype=dtype)) and not optimizer.state[second]
    # Distinct rows out of order under the flag are used as they are.
    second.grad = torch.sparse_coo_tensor(torch.tensor([[3, 1]]), torch.ones(2, 3, dtype=dtype), (6, 3),
                                          is_coalesced=True)
    optimizer.step()
    assert int(optimizer.state[first]["step"]) == 1 and int(optimizer.state[second]["step"]) == 1
    assert (second.detach()[[1, 3]] != 0).all() and (second.detach()[[0, 2, 4, 5]] == 0).all()


def test_lazy_adam_tables_refuses_tensors_shared_between_tables():
    rows, hyper = [torch.tensor([1]), torch.tensor([2])], [0.1, 0.9, 0.999, 1e-8, 0.0] * 2
    w0, w1, m0, v0, v1 = (torch.zeros(6, 3) for _ in range(5))
    with pytest.raises(RuntimeError, match=r"lazy_adam_tables_: weights\[0\] and exp_avgs\[1\] share memory"):
        # Table 1's first moment is table 0's weight.
        torch.ops.sparsekit.lazy_adam_tables_([w0, w1], [m0, w0], [v0, v1], rows, [torch.ones(1, 3)] * 2, [1, 1],
                                              hyper)
    assert not w0.any() and not w1.any()
    with pytest.raises(RuntimeError, match=r"lazy_adam_tables_: weights\[0\] and rows\[1\] share memory"):
        # Table 1's rows lie in table 0's weight.
        inside = w0.view(-1)[:2].view(torch.int64)
        inside.copy_(torch.tensor([2]))
        before = w0.clone()
        torch.ops.sparsekit.lazy_adam_tables_([w0, w1], [m0, torch.zeros(6, 3)], [v0, v1], [rows[0], inside],
                                              [torch.ones(1, 3)] * 2, [1, 1], hyper)
    assert torch.equal(w0, before) and not w1.any()
    # One rows tensor for two tables is only read: fine.
    torch.ops.sparsekit.lazy_adam_tables_([torch.zeros(6, 3), torch.zeros(6, 3)], [torch.zeros(6, 3), torch.zeros(6, 3)],
                                          [torch.zeros(6, 3), torch.zeros(6, 3)], [rows[0], rows[0]],
                                          [torch.ones(1, 3)] * 2, [1, 1], hyper)


# ---- the wrappers check argument types ------------------------------------------------------
# The dispatcher reads True as the int 1 and None or 0 as a bool, so a mistyped argument
# would silently pick another behaviour; every sk.ops wrapper raises TypeError naming it.


def _mistyped(dev):
    keys = torch.tensor([3, 1, 3], device=dev)
    table = (torch.zeros(8, dtype=L, device=dev), torch.full((8,), -1, device=dev))
    return {
        "unique: return_inverse must be a bool, got None": lambda: sk.ops.unique(keys, return_inverse=None),
        "unique: return_counts must be a bool, got 1": lambda: sk.ops.unique(keys, return_counts=1),
        "select_smallest: k must be an int, got True": lambda: sk.ops.select_smallest(
            [torch.arange(4, device=dev)], torch.ones(4, dtype=torch.bool, device=dev), True),
        "select_smallest: k must be an int, got 1.0": lambda: sk.ops.select_smallest(
            [torch.arange(4, device=dev)], torch.ones(4, dtype=torch.bool, device=dev), 1.0),
        "partition_by_owner: world_size must be an int, got True": lambda: sk.ops.partition_by_owner(keys, True),
        "key_seeded_uniform: dim must be an int, got True": lambda: sk.ops.key_seeded_uniform(keys, True),
        "key_seeded_uniform: seed must be an int, got False": lambda: sk.ops.key_seeded_uniform(keys, 2, seed=False),
        "key_seeded_uniform: low must be a float, got True": lambda: sk.ops.key_seeded_uniform(keys, 2, low=True),
        "key_seeded_uniform: high must be a float, got None": lambda: sk.ops.key_seeded_uniform(keys, 2, high=None),
        "key_seeded_uniform: dtype must be a torch.dtype or None, got 'float32'": lambda: sk.ops.key_seeded_uniform(
            keys, 2, dtype="float32"),
        "lazy_adam_: step must be an int, got True": lambda: sk.ops.lazy_adam_(*_adam_args(dev), True, 0.1, 0.9,
                                                                               0.99, 1e-8),
        "lazy_adam_: lr must be a float, got True": lambda: sk.ops.lazy_adam_(*_adam_args(dev), 1, True, 0.9,
                                                                              0.99, 1e-8),
        "lazy_adam_: weight_decay must be a float, got None": lambda: sk.ops.lazy_adam_(
            *_adam_args(dev), 1, 0.1, 0.9, 0.99, 1e-8, None),
        "hash_table_insert_absent_: num_occupied must be an int or None, got True": lambda: (
            sk.ops.hash_table_insert_absent_(*table, torch.tensor([3], device=dev), torch.tensor([0], device=dev),
                                             True)),
    }


@pytest.mark.parametrize("case", list(_mistyped("cpu")))
@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_wrappers_refuse_mistyped_arguments(case, dev):
    """Real kernel or fake (meta), the same TypeError, raised before anything runs."""
    with pytest.raises(TypeError, match=case.replace("(", r"\(").replace(")", r"\)")):
        _mistyped(dev)[case]()


def test_wrappers_still_take_integer_and_real_types():
    import numpy as np
    keys = torch.tensor([3, 1, 3])
    assert sk.ops.partition_by_owner(keys, np.int32(2))[2].tolist() == [0, 3]
    assert torch.equal(sk.ops.key_seeded_uniform(keys, np.int64(2), seed=np.uint8(1), low=-1, high=np.float32(1)),
                       sk.ops.key_seeded_uniform(keys, 2, seed=1, low=-1.0, high=1.0))
    picked = sk.ops.select_smallest([torch.tensor([5, 1, 3])], torch.ones(3, dtype=torch.bool), torch.tensor(2))
    assert picked.tolist() == [1, 2]


@pytest.mark.parametrize("size", HUGE)
def test_raw_ops_name_the_argument_of_an_output_too_large(size):
    """The raw ops (not the sk.ops wrappers, which raise AllocationError) name the argument too."""
    with pytest.raises(RuntimeError, match=rf"segment_sum: num_segments={size} \(the output\) cannot be allocated"):
        torch.ops.sparsekit.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size, False)
    with pytest.raises(RuntimeError, match=rf"key_seeded_uniform: dim={size} for 1 keys \(the output\) cannot be"):
        torch.ops.sparsekit.key_seeded_uniform(torch.tensor([1]), size, 0, -0.05, 0.05, None)


@pytest.mark.parametrize("size", HUGE)
def test_segment_sum_parts_names_itself_in_the_shared_kernel_s_errors(size):
    """segment_sum_parts shares segment_sum's kernel; its range and allocation errors said
    "segment_sum"."""
    parts = [torch.ones(3, 2), torch.ones(2, 2)]
    with pytest.raises(RuntimeError, match=r"^segment_sum_parts: segment_ids holds 7 but num_segments is 3"):
        torch.ops.sparsekit.segment_sum_parts(parts, torch.tensor([0, 1, 2, 7, 0]), 3)
    with pytest.raises(RuntimeError, match=rf"^segment_sum_parts: num_segments={size} \(the output\) cannot be"):
        torch.ops.sparsekit.segment_sum_parts(parts, torch.zeros(5, dtype=torch.long), size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_segment_sum_too_large_counts_its_float32_accumulator(dtype):
    """A float16/bfloat16 segment sum adds in a float32 buffer of the output's shape: the
    error counts both (2 + 4 bytes a value), not the output's 2 alone."""
    size = 2**40
    with pytest.raises(MemoryError, match=rf"needs a \[{size}, 2\] {dtype} tensor of 4,398,046,511,104 bytes "
                                                 r"\(4.0 TiB\) and its float32 accumulator, 13,194,139,533,312 bytes "
                                                 r"\(12.0 TiB\) in all,"):
        sk.ops.segment_sum(torch.ones(3, 2, dtype=dtype), torch.zeros(3, dtype=torch.long), size)


@pytest.mark.parametrize("num_tables", [2**20 + 1, 2**40, 2**62])
def test_unique_tables_bounds_the_table_count(num_tables):
    with pytest.raises(RuntimeError, match=r"unique_tables: num_tables must lie in \[0, 2\^20\]"):
        torch.ops.sparsekit.unique_tables(torch.tensor([1, 2]), [0, 2], [0], num_tables)


_MIXED_META = {
    "select_smallest": lambda: torch.ops.sparsekit.select_smallest(
        [torch.arange(4).to("meta")], torch.ones(4, dtype=torch.bool), 2),
    "segment_sum_parts": lambda: torch.ops.sparsekit.segment_sum_parts(
        [torch.ones(4, 3), torch.ones(2, 3, device="meta")], torch.zeros(6, dtype=torch.long), 3),
    "hash_table_find_tables": lambda: torch.ops.sparsekit.hash_table_find_tables(
        [torch.full((8,), -1, device="meta")], [torch.full((8,), -1)], torch.tensor([1]), [0, 1]),
    "lazy_adam_tables_": lambda: torch.ops.sparsekit.lazy_adam_tables_(
        [torch.zeros(6, 3)], [torch.zeros(6, 3, device="meta")], [torch.zeros(6, 3)], [torch.tensor([1])],
        [torch.ones(1, 3)], [1], [0.1, 0.9, 0.999, 1e-8, 0.0]),
}


@pytest.mark.parametrize("op", sorted(_MIXED_META))
def test_a_meta_tensor_among_cpu_ones_raises_naming_it(op):
    """A meta tensor sends the call to the op's fake: it must name the device mismatch, not
    return uninitialised memory on the CPU (or, in place, do nothing)."""
    with pytest.raises(RuntimeError, match=rf"{op}: \w+\[\d\] is on meta but \w+(\[\d\])? is on cpu"):
        _MIXED_META[op]()


@pytest.mark.parametrize("op", ["insert keys", "insert rows", "erase keys"])
def test_hash_table_ops_refuse_inputs_that_share_memory_with_the_slots(op):
    """The insert and the erase write the slots while they read the keys (and rows): a view
    of the slots among them changed under the op (keys inserted at the wrong rows, or lost)."""
    slot_keys, slot_rows = torch.arange(16) * 1000 + 7, torch.full((16,), -1)
    before = slot_keys.clone(), slot_rows.clone()
    with pytest.raises(RuntimeError, match="shares memory with the table's slot_keys or slot_rows"):
        if op == "insert keys":
            sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, slot_keys[:8], torch.arange(8))
        elif op == "insert rows":
            sk.ops.hash_table_insert_absent_(slot_keys, slot_rows, torch.arange(8), slot_rows[8:])
        else:
            sk.ops.hash_table_erase_(slot_keys, slot_rows, slot_keys[:4])
    assert torch.equal(slot_keys, before[0]) and torch.equal(slot_rows, before[1])


def test_multi_table_hash_ops_refuse_a_written_tensor_given_twice():
    """One tensor as last_seen and count (or one table listed twice) would be written by two
    roles at once: a silently wrong score, or two keys given one row."""
    scores = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"hash_table_score_tables_: last_seen\[0\] and count\[0\] share memory"):
        torch.ops.sparsekit.hash_table_score_tables_([scores], [scores], torch.tensor([1, 1]), [0, 2], [5])
    assert not scores.any()
    table = sk.HashTable(8)
    tensors = [table._slot_keys, table._slot_rows, table._row_keys, table._count]
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=r"hash_table_place_tables_: (\w+)\[0\] and \1\[1\] share memory"):
        torch.ops.sparsekit.hash_table_place_tables_(*([t, t] for t in tensors), torch.tensor([3, 4]), [0, 1, 2],
                                                     [0, 0])
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    # Tables of their own pass.
    other = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    torch.ops.sparsekit.hash_table_score_tables_([scores, other[0]], [scores.clone(), other[1]],
                                                 torch.tensor([1, 2]), [0, 1, 2], [5, 6])


_SCRATCH_AFTER_OOM = """
import faulthandler, resource, torch, sparsekit
faulthandler.enable()
op = torch.ops.sparsekit.unique_bounded
keys = torch.tensor([0, 3, -1, 3, 7])
want = op(keys, 1000, True)  # this thread keeps a small scratch
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
try:
    # 1 GiB bitmaps, a few of them: refused by the address-space limit (within the machine's
    # memory, which the kernel checks first)
    op(keys, 2**33, False)
except RuntimeError as error:
    print("raised", error)
for _ in range(3):
    assert all(torch.equal(a, b) for a, b in zip(op(keys, 1000, True), want))
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_failed_scratch_allocation_leaves_the_next_call_working():
    """A kernel's kept scratch whose growth fails (out of memory) must not keep its old size
    with no memory behind it: the next, smaller call of the thread segfaulted."""
    done = subprocess.run([sys.executable, "-c", _SCRATCH_AFTER_OOM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised unique_bounded: bound=8589934592" in done.stdout and "out of memory for" in done.stdout
    assert done.stdout.rstrip().endswith("ok")


_SCRATCH_KEPT_AFTER_FAILURE = """
import ctypes, gc, resource, sys, torch, sparsekit as sk
torch.set_num_threads(1)
trim = ctypes.CDLL("libc.so.6").malloc_trim
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
keys = torch.randperm(20_000_000)
sk.ops.unique(keys[:1000])
gc.collect(); trim(0); base = status("VmRSS")
# Room for the inverse and unique's 320 MB of scratch, not for the unique keys after them.
resource.setrlimit(resource.RLIMIT_AS, ((status("VmSize") << 10) + (600 << 20), resource.RLIM_INFINITY))
try:
    sk.ops.unique(keys, return_inverse=True)
    failed = False
except RuntimeError:
    failed = True
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
for _ in range(10):
    sk.ops.unique(torch.randint(0, 100, (1000,)))
gc.collect(); trim(0)
print(int(failed), (status("VmRSS") - base) >> 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_unique_call_that_fails_does_not_keep_its_large_scratch():
    """unique's partitioned path trims its scratch (16 bytes a key, freed above 256 MiB) on
    its last line: a call that raised on the way (an allocation refused) kept 312 MiB for
    the thread's life. The trim now runs on the way out by an error too."""
    done = subprocess.run([sys.executable, "-c", _SCRATCH_KEPT_AFTER_FAILURE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    failed, kept_mib = (int(v) for v in done.stdout.split()[-2:])
    if not failed:
        pytest.skip("the address-space limit did not refuse the call on this machine")
    assert kept_mib < 128, f"a unique call that raised left {kept_mib} MiB of scratch resident"


def test_table_states_with_sparse_tensors_or_huge_clocks_are_refused_before_anything_changes():
    """A sparse tensor passes dtype and shape checks, and the load cleared the table before
    the copy failed; a clock near int64's end made a later insert fail after placing keys."""
    table = sk.HashTable(8)
    table.insert(torch.tensor([10, 20]))
    for state, message in (({"keys": torch.tensor([1, 2]), "last_seen": torch.tensor([0, 1]).to_sparse()},
                            r"'last_seen' is a torch.sparse_coo tensor"),
                           ({"keys": torch.tensor([1, 2]).to_sparse()}, r"'keys' is a torch.sparse_coo tensor"),
                           ({"keys": torch.tensor([1, 2]), "clock": 2**63 - 1}, r"'clock' must be .* below 2\*\*62"),
                           ({"keys": torch.tensor([1, 2]), "clock": 2**64}, r"'clock' must be .* below 2\*\*62")):
        with pytest.raises(ValueError, match=message):
            table.load_state_dict(state)
        assert torch.equal(table.export()[0], torch.tensor([10, 20]))
    layer = sk.DistributedEmbedding("sum", 8, 4, 1, 1)
    layer(sk.Ragged(torch.tensor([10, 20]), torch.tensor([0, 1, 2])))
    state = layer.state_dict()
    before = layer.weight.detach().clone()
    for entry, value, message in (("_extra_state", dict(state["_extra_state"], evicted=2**64), "below 2\\*\\*62"),
                                  ("weight", state["weight"].to_sparse(), "torch.sparse_coo tensor")):
        with pytest.raises((ValueError, RuntimeError), match=message):
            layer.load_state_dict(dict(state, **{entry: value}))
        assert torch.equal(layer.weight.detach(), before) and len(layer.hash_table) == 2


def test_layer_inputs_in_a_sparse_layout_are_named():
    layer = sk.DistributedEmbedding("sum", 8, 4, 1, 1)
    with pytest.raises(TypeError, match="values must be a dense \\(strided\\) tensor"):
        layer(sk.Ragged(torch.tensor([1, 2]).to_sparse(), torch.tensor([0, 1, 2])))
    with pytest.raises(TypeError, match="offsets must be a dense 1-D int64 or int32 tensor"):
        layer(sk.Ragged(torch.tensor([1, 2]), torch.tensor([0, 1, 2]).to_sparse()))
    assert len(layer.hash_table) == 0


def test_hash_table_ops_refuse_one_tensor_for_both_slot_arrays():
    """slot_keys and slot_rows as one tensor: an insert wrote keys over rows (the table was
    silently corrupt); every raw table op now names it and writes nothing."""
    slots = torch.full((8,), -1, dtype=torch.long)
    calls = {"hash_table_insert_absent_": (slots, slots, torch.tensor([1]), torch.tensor([0])),
             "hash_table_erase_": (slots, slots, torch.tensor([1])),
             "hash_table_find": (slots, slots, torch.tensor([1]))}
    for op, args in calls.items():
        with pytest.raises(RuntimeError, match=f"{op}: slot_keys and slot_rows share memory"):
            getattr(torch.ops.sparsekit, op)(*args)
        assert torch.equal(slots, torch.full((8,), -1, dtype=torch.long))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_every_op_names_an_argument_given_in_a_sparse_layout(layout):
    """The kernels take dense tensors; a sparse one met the dispatcher's "Could not run ...
    'SparseCPU' backend" naming no argument. Now a TypeError names it, for the typed
    wrappers, the raw torch.ops and the tables alike, and nothing changes."""
    def sparse(t):
        return t.to_sparse() if layout == "coo" else t.reshape(1, -1).to_sparse_csr()

    keys = torch.tensor([1, 2, 3])
    table = sk.HashTable(8)
    table.insert(torch.tensor([7]))
    weight = torch.zeros(4, 2)
    calls = [
        (lambda: sk.ops.unique(sparse(keys)), "unique: keys"),
        (lambda: torch.ops.sparsekit.unique(sparse(keys)), "unique: keys"),
        (lambda: torch.ops.sparsekit.segment_sum(sparse(torch.ones(3)), keys, 4, False), "segment_sum: data"),
        (lambda: sk.ops.embedding_bag(weight, sparse(torch.tensor([1, 2])), torch.tensor([0, 2])),
         "embedding_bag: rows"),
        (lambda: table.find(sparse(keys)), "HashTable.find: keys"),
        (lambda: table.insert(sparse(keys)), "HashTable.insert: keys"),
        (lambda: torch.ops.sparsekit.lazy_adam_(weight, torch.zeros(4, 2), torch.zeros(4, 2), torch.tensor([1]),
                                                sparse(torch.ones(2)).to(torch.float32), 1, 0.1, 0.9, 0.99, 1e-8, 0.0),
         "lazy_adam_: grad"),
    ]
    for call, named in calls:
        with pytest.raises(TypeError, match=f"{named} must be a dense \\(strided\\) tensor"):
            call()
    assert len(table) == 1 and torch.equal(weight, torch.zeros(4, 2))


def test_segment_mean_without_columns_needs_no_counts():
    """D = 0: segment_sum returns [num_segments, 0] for any num_segments, and so does the
    mean (it had allocated int64 counts of num_segments + 1 and overflowed at 2**62)."""
    ids = torch.tensor([0, 1, 0, 1])
    for num_segments in (3, 2**40, 2**62):
        assert sk.ops.segment_mean(torch.randn(4, 0), ids, num_segments).shape == (num_segments, 0)
    torch.testing.assert_close(sk.ops.segment_mean(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), ids, 3),
                               torch.tensor([[2.0], [3.0], [0.0]]))


_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("case", ["unique", "raw unique", "segment_sum data"])
def test_a_contiguous_copy_too_large_says_so_with_its_shape(case):
    """A stride-0 view of 2^46 elements (2^49 bytes: more than any address space) copied to
    a contiguous one inside a kernel: the stable shim said only "API call failed at ops.h";
    the error gives the copy's shape and torch's reason, and is not blamed on an argument
    that sized an output (segment_sum's num_segments=3 is not the culprit)."""
    huge = 2**46
    keys = torch.zeros(1, dtype=torch.int64).expand(huge)
    calls = {
        "unique": lambda: sk.ops.unique(keys),
        "raw unique": lambda: torch.ops.sparsekit.unique(keys),
        "segment_sum data": lambda: sk.ops.segment_sum(torch.zeros(1, 1).expand(huge, 1), keys, 3),
    }
    # torch's reason where its shim keeps it (2.13 does); 2.10's does not, and the op says so.
    reason = r".*can't allocate memory" if _TORCH >= (2, 13) else \
        r"(.*can't allocate memory|out of memory \(this torch does not say why\))"
    with pytest.raises(RuntimeError, match=rf"a contiguous copy of an input: cannot allocate a \[{huge}(, 1)?\] "
                                           rf"(Long|Float) tensor on cpu: {reason}") as error:
        calls[case]()
    assert "num_segments" not in str(error.value)


@pytest.mark.parametrize("kind", ["nested", "quantized"])
def test_nested_and_quantized_tensors_are_named(kind):
    """Nested and quantized tensors have the strided layout, so the sparse-layout checks let
    them through to torch's "Internal error: NestedTensorImpl doesn't support sizes" or the
    dispatcher's "Could not run ... 'QuantizedCPU' backend" (segment_mean's naming
    segment_sum), naming no argument. A TypeError names it, and nothing changes."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])
        quant = torch.quantize_per_tensor(torch.ones(4, 3), 0.1, 0, torch.qint8)
    table = sk.HashTable(8)
    table.insert(torch.tensor([7]))
    layer = sk.DistributedEmbedding("sum", 8, 2, 1, 2)
    weight = layer.weight.detach().clone()
    ids = torch.tensor([0, 1, 0, 1])
    if kind == "nested":
        calls = [
            (lambda: sk.ops.unique(nested), "unique: keys"),
            (lambda: sk.ops.hash_table_find(torch.zeros(16, dtype=torch.long), torch.full((16,), -1), nested),
             "hash_table_find: keys"),
            (lambda: table.find(nested), "HashTable.find: keys"),
            (lambda: table.insert(nested), "HashTable.insert: keys"),
            (lambda: layer(sk.Ragged(nested, torch.tensor([0, 1, 3]))), "DistributedEmbedding: values"),
            (lambda: layer(torch.nested.nested_tensor([torch.tensor([[1]]), torch.tensor([[2, 3]])])),
             "DistributedEmbedding: inputs"),
            (lambda: sk.KeyedJagged(["f"], nested, lengths=torch.tensor([1, 2])), "KeyedJagged: values"),
        ]
    else:
        calls = [
            (lambda: sk.ops.segment_sum(quant, ids, 2), "segment_sum: data"),
            (lambda: sk.ops.segment_mean(quant, ids, 2), "segment_mean: data"),
            (lambda: torch.ops.sparsekit.segment_sum(quant, ids, 2, False), "segment_sum: data"),
            (lambda: sk.ops.embedding_gather(quant, torch.tensor([0])), "embedding_gather: weight"),
            (lambda: torch.ops.sparsekit.embedding_bag(quant, torch.tensor([0]), torch.tensor([0, 1]), None, "sum",
                                                       None, True), "embedding_bag: weight"),
        ]
    for call, named in calls:
        with pytest.raises(TypeError, match=f"{named} must be a plain tensor, got a {kind}"):
            call()
    assert len(table) == 1 and torch.equal(layer.weight, weight) and len(layer.hash_table) == 0

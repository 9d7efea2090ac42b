"""Failure behaviour across the package: errors that name what is wrong."""

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
def test_op_outputs_too_large_name_the_argument(size):
    with pytest.raises(MemoryError, match=rf"segment_sum: num_segments={size} .*bytes"):
        sk.ops.segment_sum(torch.ones(3, 2), torch.zeros(3, dtype=torch.long), size)
    with pytest.raises(MemoryError, match=rf"key_seeded_uniform: 1 keys x dim={size} .*bytes"):
        sk.ops.key_seeded_uniform(torch.tensor([1]), size)
    # Ordinary errors still pass through unchanged.
    with pytest.raises(RuntimeError, match="segment_sum") as info:
        sk.ops.segment_sum(torch.ones(3, 2), torch.full((3,), 5), 2)
    assert not isinstance(info.value, MemoryError)


@pytest.mark.parametrize("state", [None, [1, 2], "keys"])
def test_hash_table_load_state_dict_of_the_wrong_type(state):
    table = sk.HashTable(4)
    table.insert(torch.tensor([7]))
    with pytest.raises(TypeError, match="HashTable.load_state_dict: expected the dict"):
        table.load_state_dict(state)
    assert table.find(torch.tensor([7])).item() == 0

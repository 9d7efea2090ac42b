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

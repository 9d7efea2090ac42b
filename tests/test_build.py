import glob
import os

import torch

import sparsekit


def test_extension_runs_threads():
    """at::parallel_for runs threads only in code compiled with OpenMP: the library must link it."""
    (library,) = glob.glob(os.path.join(os.path.dirname(sparsekit.__file__), "_C*.so"))
    with open(library, "rb") as f:
        assert b"libgomp" in f.read(), "sparsekit._C was built without -fopenmp: its CPU kernels run on one thread"


def test_every_op_has_a_cpu_kernel():
    ops = ["unique", "segment_sum", "hash_table_find", "hash_table_insert_absent_", "hash_table_erase_", "embedding_bag",
           "embedding_bag_argmax", "embedding_gather", "lazy_adam_", "partition_by_owner", "key_seeded_uniform",
           "select_smallest"]
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekit::{op}", "CPU")]
    assert not missing

"""Shared fixtures, hypothesis profiles and markers of the test suite.

The tests are grouped by feature (ops, tables, layers, collection, optim, checkpoint,
compile, train, cuda, peers, robustness, package); the helpers they share live in
tests/support and are imported by module name (``from _distributed import spawn``).
Markers a module cannot forget are set here from where a test lives and what it is: see
pytest_collection_modifyitems. ``scripts/test.sh --quick`` deselects the costly kinds.
"""

import os
import sys

# The helpers of tests/support, importable from every feature folder. Processes started by
# multiprocessing's spawn (the gloo ranks of _distributed.spawn) inherit this sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# pytest-xdist workers (and the processes tests spawn) outnumber the cores, and OpenMP
# threads that spin while they wait (libgomp's default) then starve the ones with work:
# test_no_leaks.py::test_collection_step_keeps_nothing took 52 s instead of 2.3 s as one of
# two processes on the 2-core VM. Passive threads sleep. Set before torch loads libgomp,
# which reads it once (scripts/gpu_check.sh sets it for the whole run too).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# SPARSEKIT_TEST_DEVICES=cuda (or cpu) restricts the device fixture, as scripts/gpu_check.sh
# does to spend its GPU time on the CUDA cases.
if os.environ.get("SPARSEKIT_TEST_DEVICES"):
    DEVICES = [d for d in DEVICES if d in os.environ["SPARSEKIT_TEST_DEVICES"].split(",")]

# Property-based tests (hypothesis). "ci" is the default: derandomized (the same examples
# every run, so CI is reproducible) and small enough for a few minutes in all. "thorough"
# (`pytest --hypothesis-profile=thorough`) draws 100x as many, with random seeds; "dev"
# is random with the CI budget. A test's own budget is `examples(k)`: k in "ci", 100 k
# under "thorough".
# "ci-gpu", the default when CUDA is among the devices: the examples of "ci", but a failing
# one is reported as drawn, not shrunk. Shrinking re-runs a failing test hundreds of times
# at sizes up to 10^6 keys, for up to hypothesis's 5-minute cap (a unique or
# partition_by_owner property that fails only past 10^5 keys: about a minute on the 2-core
# CPU VM, more with CUDA and the CPU reference on a shared GPU machine), so under
# scripts/gpu_check.sh's per-test timeout the worker is killed mid-shrink and the failure
# lost. Passing tests draw the same examples either way; `SPARSEKIT_HYPOTHESIS_PROFILE=ci`
# shrinks on a GPU too.
_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", max_examples=10, derandomize=True, **_COMMON)
settings.register_profile("ci-gpu", max_examples=10, derandomize=True,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON)
settings.register_profile("dev", max_examples=10, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("SPARSEKIT_HYPOTHESIS_PROFILE", "ci-gpu" if "cuda" in DEVICES else "ci"))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every op test runs on the CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)


# Markers that follow from a test's folder or kind, so that no module has to repeat them:
# the folder of the GPU-only tests, the ported peer suites, hypothesis's @given tests and the
# modules of drawn cases (*_properties.py).
_FOLDER_MARKS = {"cuda": "cuda", "peers": "peer"}

# "heavy": what the quick tier (scripts/test.sh --quick) leaves out besides the slow,
# property, distributed, peer and GPU tests. Each costs seconds, not milliseconds: torch.compile,
# a child interpreter or pytest, a training run, large sizes or many thread counts. Whole
# modules, then single tests (module::function, every parametrization). CI runs them all.
_HEAVY_MODULES = {
    "test_compile.py", "test_cpu_capability.py", "test_benchmarks.py", "test_parallel.py",
    "test_thresholds.py", "test_no_leaks.py", "test_allocator.py", "test_guard_pages.py",
    "test_threads.py", "test_train.py",
}
_HEAVY_TESTS = {
    "test_checkpoint.py::test_a_compiled_model_and_the_plain_one_load_each_others_checkpoints",
    "test_checkpoint.py::test_round_trip_is_exact_and_failed_saves_keep_the_previous_checkpoint",
    "test_collection.py::test_one_key_per_bag_large_reads",
    "test_embedding.py::test_embedding_bag_dims_of_whole_and_partial_vectors",
    "test_embedding.py::test_embedding_bag_double_backward_gradgradcheck",
    "test_embedding.py::test_embedding_bag_gradcheck",
    "test_embedding.py::test_embedding_bag_gradcheck_all_modes",
    "test_embedding.py::test_embedding_bag_opcheck",
    "test_embedding.py::test_embedding_bag_opcheck_new_arguments",
    "test_hashing.py::test_deterministic_across_processes",
    "test_segment.py::test_deterministic_tree_above_one_level",
    "test_unique.py::test_unique_keys_whose_hashes_share_their_high_bits",
    "test_unique.py::test_unique_mostly_distinct_keys",
    "test_unique.py::test_unique_uneven_work_is_split_between_threads",
    "test_unique_bounded.py::test_cpu_row_gradient_is_coalesced_on_both_paths",
    "test_lazy_adam.py::test_lazy_adam_dense_matches_torch_adam_bit_for_bit_on_every_dtype",
    "test_build.py::test_cpu_kernels_run_on_several_threads",
    "test_loading.py::test_unbuilt_source_tree_says_so",
    "test_argument_strictness.py::test_resume_takes_the_same_capacity_from_either_flag",
    "test_failures.py::test_a_failed_scratch_allocation_leaves_the_next_call_working",
    "test_failures.py::test_a_unique_call_that_fails_does_not_keep_its_large_scratch",
    "test_dynamic_table.py::test_eviction_is_the_same_on_one_and_two_threads",
    "test_dynamic_table.py::test_soak_keeps_keys_findable_and_probes_bounded",
    "test_hashtable_eviction.py::test_eviction_is_the_same_on_any_thread_count",
    "test_hashtable_eviction.py::test_soak_keeps_every_key_findable_and_probes_bounded",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        folder = item.path.parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
        if module.endswith("_properties.py") or getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker("property")
        callspec = getattr(item, "callspec", None)
        if callspec is not None and str(callspec.params.get("device", "")) == "cuda":
            item.add_marker("cuda")
        function = getattr(item, "originalname", None) or item.name
        if module in _HEAVY_MODULES or f"{module}::{function}" in _HEAVY_TESTS:
            item.add_marker("heavy")

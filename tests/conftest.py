import os

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

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", max_examples=10, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=10, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("SPARSEKIT_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every op test runs on the CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)

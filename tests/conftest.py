import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every op test runs on the CPU, and on CUDA when a GPU is present."""
    return torch.device(request.param)

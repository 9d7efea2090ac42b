"""sparsekit: hash-table embeddings, unique / segment-sum kernels and model-parallel
embedding layers for PyTorch, on CPU and CUDA."""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import _C  # noqa: F401  (registers torch.ops.sparsekit.* kernels)
from . import hashing, ops

__version__ = "0.1.0"

__all__ = ["hashing", "ops"]

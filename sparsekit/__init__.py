"""sparsekit: hash-table embeddings, unique / segment-sum kernels and model-parallel
embedding layers for PyTorch, on CPU and CUDA."""

from . import _C  # noqa: F401  (registers torch.ops.sparsekit.* kernels)
from . import ops
from .hashtable import HashTable, HashTableFullError
from .optim import LazyAdam

__version__ = "0.1.0"

__all__ = [
    "ops",
    "HashTable",
    "HashTableFullError",
    "LazyAdam",
]

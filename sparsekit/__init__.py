"""sparsekit: hash-table embeddings, unique / segment-sum kernels and model-parallel
embedding layers for PyTorch, on CPU and CUDA."""

import torch  # noqa: F401  (loads libtorch before the extension links against it)

from ._loading import load_library

_C = load_library()  # registers torch.ops.sparsekit.* kernels, or says clearly why it cannot
from . import hashing, ops
from . import tables_cuda  # noqa: F401  (CUDA kernels of the multi-table ops, as composites)
from .allocator import keep_freed_memory
from .hashtable import HashTable, HashTableFullError
from .optim import LazyAdam
from .checkpoint import load_checkpoint, save_checkpoint
from .collection import EmbeddingBagCollection, KeyedJagged, TableConfig, UnknownTableError
from .fused import FusedOptimizer
from .keyed import KeyedTensor
from .embedding import (
    All2AllDenseEmbedding,
    DistributedEmbedding,
    KeySeededUniform,
    Ragged,
    is_embedding_variable,
    keep_out_of_ddp,
    split_embedding_variable_from_others,
)

__version__ = "0.1.0"

__all__ = [
    "hashing",
    "ops",
    "HashTable",
    "HashTableFullError",
    "LazyAdam",
    "Ragged",
    "KeySeededUniform",
    "DistributedEmbedding",
    "All2AllDenseEmbedding",
    "split_embedding_variable_from_others",
    "is_embedding_variable",
    "save_checkpoint",
    "load_checkpoint",
    "TableConfig",
    "KeyedJagged",
    "EmbeddingBagCollection",
    "UnknownTableError",
    "FusedOptimizer",
    "KeyedTensor",
    "keep_out_of_ddp",
    "keep_freed_memory",
]

"""Fakes of the training harness's feature interaction (``sparsekit::_pair_dots``, internal,
CPU only: ``csrc/cpu/interaction_cpu.cpp``)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.register_fake("sparsekit::_pair_dots")
def _pair_dots_fake(vectors: Tensor) -> Tensor:
    n = vectors.shape[1]
    return vectors.new_empty(vectors.shape[0], n * (n - 1) // 2)


@torch.library.register_fake("sparsekit::_pair_dots_backward")
def _pair_dots_backward_fake(grad: Tensor, vectors: Tensor) -> Tensor:
    return vectors.new_empty(vectors.shape)

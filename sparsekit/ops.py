"""Typed wrappers, fake (meta) kernels and autograd for ``torch.ops.sparsekit.*``.

Every op has a CPU and a CUDA kernel compiled into ``sparsekit._C``; the fakes below
let ``torch.compile`` trace them, with data-dependent output sizes taken from
``torch.library.get_ctx().new_dynamic_size()``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the kernels)

_ops = torch.ops.sparsekit

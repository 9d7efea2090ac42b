"""Kernels that ``sparsekit.ops`` registers for every op of the compiled library, on
dispatch keys the C++ side leaves alone: a refusal naming the argument for sparse and
quantized tensors, and the version-counter bump of the ops that write in place.
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch import Tensor

from .._checks import dense_layout
from ._common import _ops


# The kernels take dense (strided) tensors. A sparse one passes the wrappers' dtype and
# shape checks, and the dispatcher's own "Could not run 'sparsekit::...' with arguments
# from the 'SparseCPU' backend" names no argument: a kernel for the sparse dispatch keys
# of every op names it instead (for torch.ops.sparsekit.* and every caller alike).
_SPARSE_KEYS = ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA")
# The same for quantized tensors (strided, so they pass the layout checks), whose
# dispatcher message ("... from the 'QuantizedCPU' backend") names none either.
_QUANTIZED_KEYS = ("QuantizedCPU", "QuantizedCUDA")


def _refusing_sparse(op: str, names: List[str]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for name, value in list(zip(names, args)) + list(kwargs.items()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, Tensor):
                    dense_layout(f"{op}: {name}", item)
        raise TypeError(f"{op}: the arguments must be dense (strided), unquantized tensors")
    return kernel


def _marking_writes(op_name: str, written: List[int]):
    """The autograd view/in-place kernel of an op that writes arguments in place: runs the
    kernel, then marks what it wrote as modified, as torch's own in-place ops do, so that a
    backward that saved one of them before raises ("modified by an inplace operation")
    instead of using the new values (the dispatcher does not do it for ops defined in C++;
    torch.library.custom_op registers the same). Only after a call that succeeded: a
    refused call changed nothing."""
    overload = getattr(_ops, op_name).default
    after = torch._C._after_ADInplaceOrView_keyset

    def kernel(keyset, *args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = overload.redispatch(keyset & after, *args, **kwargs)
        tensors = []
        for i in written:
            arg = args[i] if i < len(args) else None
            tensors.extend(arg if isinstance(arg, (list, tuple)) else [arg] if isinstance(arg, Tensor) else [])
        if tensors:
            torch.autograd.graph.increment_version(tensors)
        return result
    return kernel


_sparse_library = torch.library.Library("sparsekit", "IMPL")


def _register_kernels() -> None:
    """Registers both kernels for the compiled library's ops: those defined when this runs
    (sparsekit._C's), not the Python-defined ones, whose names start with an underscore."""
    for name in sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                       if n.startswith("sparsekit::") and not n.startswith("sparsekit::_")):
        schema = getattr(_ops, name).default._schema
        for key in _SPARSE_KEYS + _QUANTIZED_KEYS:
            _sparse_library.impl(name, _refusing_sparse(name, [a.name for a in schema.arguments]), key)
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if written:
            _sparse_library.impl(name, _marking_writes(name, written), "ADInplaceOrView", with_keyset=True)


_register_kernels()

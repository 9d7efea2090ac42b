"""CPU tensors that end (or begin) at a page that faults on any access: a kernel reading one
element past either end of its input crashes the test instead of reading stray memory."""

import ctypes
import mmap
import os

import torch

_PAGE = mmap.PAGESIZE
# The mappings stay alive with their tensors (torch.frombuffer keeps the buffer), and a
# guard page is never given back its access: its mapping goes when the tensor does.


def guarded(values: torch.Tensor, side: str = "end") -> torch.Tensor:
    """A contiguous CPU copy of ``values`` whose last byte is followed (``side="end"``) or
    whose first byte is preceded (``side="start"``) by an inaccessible page."""
    if side not in ("end", "start"):
        raise ValueError(f"side must be 'end' or 'start', got {side!r}")
    values = values.contiguous()
    size = values.numel() * values.element_size()
    data_pages = max(1, (size + _PAGE - 1) // _PAGE)
    buffer = mmap.mmap(-1, (data_pages + 1) * _PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    guard_page = data_pages if side == "end" else 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(address + guard_page * _PAGE), ctypes.c_size_t(_PAGE), 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    offset = data_pages * _PAGE - size if side == "end" else _PAGE
    if values.numel() == 0:
        return values.clone()
    out = torch.frombuffer(buffer, dtype=values.dtype, count=values.numel(), offset=offset)
    out.copy_(values.reshape(-1))
    return out.view(values.shape)

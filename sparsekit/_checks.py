"""Checks shared by the ops, the hash table and the layers."""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import re
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch

# Messages of torch's allocators (CPU, CUDA) and of its size arithmetic.
_ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "storage size calculation overflowed",
                        "tried to allocate", "overflow when unpacking")


# torch's CPU allocator (c10/core/impl/alloc_cpu.cpp) fails with a plain RuntimeError, not
# torch.OutOfMemoryError: "[enforce fail at alloc_cpu.cpp:N] err == 0. DefaultCPUAllocator:
# can't allocate memory: you tried to allocate N bytes. Error code 12 (...)" (POSIX), "not
# enough memory" on Windows. Only this message counts; any other RuntimeError stays a bug.
_CPU_ALLOCATOR_FAILURE = re.compile(
    r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate \d+ bytes[^\n]*")


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is ``major.minor`` or newer (its release, not a local suffix)."""
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def compile_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, made at the first call: applied at import it imports
    ``torch._dynamo``, which doubles the time of ``import sparsekit``."""
    disabled: Optional[Callable[..., Any]] = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # What torch.compiler.disable marks, so that dynamo breaks the graph here as for the
    # disabled function itself instead of tracing into this wrapper.
    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call


def out_of_memory(error: BaseException) -> Optional[str]:
    """The message of an allocation failure (the harness prints it; a checkpoint load passes
    the error on instead of calling the file damaged), or None when ``error`` is not one."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):  # MemoryError: sparsekit's and numpy's too
        return str(error)
    if isinstance(error, RuntimeError):
        match = _CPU_ALLOCATOR_FAILURE.search(str(error))
        if match:
            return match.group(0)
    return None


class AllocationError(MemoryError, torch.OutOfMemoryError):
    """A tensor sized by an argument cannot be allocated: a MemoryError and, like torch's
    own allocation failures, a RuntimeError; also a torch.OutOfMemoryError, so a training
    loop's ``except torch.OutOfMemoryError`` (torch's type for a device out of memory)
    catches it as it caught the error it replaces."""


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        size /= 1024
        if size < 1024 or unit == "EiB":
            return f"{count:,} bytes ({size:,.1f} {unit})"
    raise AssertionError("unreachable")


def _host_memory_bytes() -> Optional[int]:
    """This machine's memory and swap in bytes (None where unknown). A larger host tensor can
    never be filled: where Linux overcommits, malloc grants it and the first write gets the
    process killed instead of raising."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total if total > 0 else None


HOST_MEMORY_BYTES = _host_memory_bytes()  # read once: under torch.compile a constant, not a call


def _on_host(device) -> bool:
    if device is None:
        return torch.get_default_device().type == "cpu"
    return torch.device(device).type == "cpu"


@contextlib.contextmanager
def allocation(what: Union[str, Callable[[], str]], shape: Sequence[int], dtype: torch.dtype,
               device, accumulator: bool = False) -> Iterator[None]:
    """Turns an allocation failure inside the block into an error that names what was being
    allocated (``what``: the argument that sized it) and the bytes it would need.

    Args:
        what: e.g. ``"HashTable: capacity=1099511627776 (2 slot arrays)"``, or a function
            that makes it, called only on a failure: under ``torch.compile`` a size traced
            as a SymInt must not be formatted on the way (that pins it to one value, and
            every other size would compile a graph of its own).
        shape: the shape of the largest tensor allocated.
        dtype: its dtype.
        device: where it goes.
        accumulator: a float16/bfloat16 result is summed in a float32 buffer of the same
            shape first (segment sums): its bytes count too.
    """
    with_accumulator = accumulator and dtype in (torch.float16, torch.bfloat16)

    def numel() -> int:  # only where the sizes may be read: not while torch.compile traces them
        count = 1
        for size in shape:
            count *= int(size)
        return count

    def failure(reason: str = "") -> AllocationError:
        count = numel()
        needed = count * dtype.itemsize
        tensors = f"a {list(shape)} {dtype} tensor of {_bytes(needed)}"
        if with_accumulator:
            needed += count * 4
            tensors += f" and its float32 accumulator, {_bytes(needed)} in all,"
        where = "the default device" if device is None else str(device)
        described = what() if callable(what) else what
        return AllocationError(f"{described}: needs {tensors} on {where}{reason}, which cannot be allocated; choose a "
                               "smaller value")

    # A host tensor larger than the machine is refused before it is allocated (see
    # _host_memory_bytes). Sizes traced under torch.compile or by a fake mode (SymInts) are
    # not read: that would pin them (dynamo passes SymInts as ints, hence is_compiling).
    limit = HOST_MEMORY_BYTES
    if (limit is not None and not torch.compiler.is_compiling() and all(type(size) is int for size in shape)
            and _on_host(device)):
        if numel() * (dtype.itemsize + (4 if with_accumulator else 0)) > limit:
            raise failure(f", more than this machine's {_bytes(limit)} of memory and swap")
    try:
        yield
    except (RuntimeError, MemoryError, TypeError) as error:
        if not (isinstance(error, (MemoryError, torch.OutOfMemoryError))
                or any(marker in str(error).lower() for marker in _ALLOCATION_FAILURES)):
            raise
        if "a contiguous copy of an input" in str(error):
            raise  # a kernel's copy of a strided input (its message gives the shape), not this tensor
        raise failure() from error


# ---- argument types -------------------------------------------------------------------------


def type_name(value: Any) -> str:
    """``value``'s type for an error message: ``float``, ``numpy.bool`` ..."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def is_bool(value: Any) -> bool:
    """A Python or numpy bool, or a bool tensor (whose ``__index__`` would read it as 0 or 1)."""
    return isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def tensor_integer(value: Any) -> Any:
    """A one-element integer tensor with a value (not bool, floating, complex or meta: its
    item would be truncated, be a bool, or could not be read) as a Python int; anything else
    as it is, for the caller's own check to name. For saved states and duck-typed inputs
    that may hold a tensor where an int belongs."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        return int(value.item())
    return value


def as_index(value: Any) -> int:
    """``operator.index(value)``, for tensors only 0-d ones (torch also reads any tensor of
    one element, which a numpy array of shape [1] is not), also those torch cannot read as an
    int64: a uint64 one past 2^63 - 1 gives its value (torch raised a RuntimeError), a meta
    one a TypeError (it holds no value).

    Raises:
        TypeError: as ``operator.index``, a tensor that is not 0-d, or a 0-d tensor on the
            meta device.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise TypeError(f"a {value.dim()}-d tensor of shape {list(value.shape)} is not one integer")
        if value.device.type == "meta":
            raise TypeError("a tensor on the meta device holds no value")
        if value.dtype == torch.uint64:
            return int(value.view(torch.int64)) % 2**64
    return operator.index(value)


def integer_argument(where: str, name: str, value: Any, optional: bool = False) -> Any:
    """``value`` as an int: a Python or numpy integer, an integer 0-d tensor or a traced
    SymInt; never a bool (True is not the int 1). None passes when ``optional``.

    Raises:
        TypeError: ``"{where}: {name} must be an int, got ..."``.
    """
    if type(value) is int or isinstance(value, torch.SymInt) or (optional and value is None):
        return value
    if not is_bool(value):
        try:
            return as_index(value)
        except TypeError:
            pass
    kind = "an int or None" if optional else "an int"
    hint = "; convert a bool with int() explicitly" if is_bool(value) else ""
    raise TypeError(f"{where}: {name} must be {kind}, got {value!r} ({type_name(value)}){hint}")


def size_argument(where: str, name: str, value: Any, minimum: int = 1, optional: bool = False,
                  maximum: Any = None) -> Any:
    """A size or count as a Python int: :func:`integer_argument`'s types (NumPy integers
    too, as ``nn.Linear`` takes them; never a bool or a float), then at least ``minimum``.
    None passes when ``optional``.

    Raises:
        TypeError: not an integer (``"{where}: {name} must be an int, got ..."``).
        ValueError: below ``minimum`` (``"{where}: {name} must be a positive int, got ..."``,
            or ``a non-negative int`` for ``minimum`` 0), or above ``maximum`` when given.
    """
    value = integer_argument(where, name, value, optional)
    if value is not None and not isinstance(value, torch.SymInt) and value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{where}: {name} must be {kind}{' or None' if optional else ''}, got {value!r}")
    if maximum is not None and value is not None and not isinstance(value, torch.SymInt) and value > maximum:
        raise ValueError(f"{where}: {name} must be at most {maximum}, got {value!r}")
    return value


def bool_argument(where: str, name: str, value: Any) -> bool:
    """``value`` as a bool: a Python or numpy bool only (a string such as ``"no"`` or an int
    would otherwise be read by its truth value).

    Raises:
        TypeError: ``"{where}: {name} must be a bool, got ..."``.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{where}: {name} must be a bool, got {value!r} ({type_name(value)})")


def device_argument(where: str, value: Any) -> Any:
    """``value`` (None, a ``torch.device``, a string or an int, as torch takes them) checked
    as a device that this process has: an unknown name or a CUDA device without CUDA
    raises naming ``where`` and the argument, not torch's bare message from deep inside
    an allocation. Returns ``value`` unchanged.

    Raises:
        TypeError / ValueError / RuntimeError: ``"{where}: device ..."``.
    """
    if value is None:
        return value
    if is_bool(value) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(f"{where}: device must be a torch.device, a string, an int or None, got {value!r} "
                        f"({type_name(value)})")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"{where}: device={value!r} is not a device ({error})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{where}: device={value!r} but CUDA is not available in this process "
                               "(no GPU, or a CPU-only torch)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"{where}: device={value!r} but this process sees "
                               f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type not in ("cpu", "meta"):
        # Another backend torch names (xpu, mps, hpu, xla, privateuseone, ...): torch's own
        # refusal of one this process lacks is an AssertionError, a ModuleNotFoundError or a
        # NotImplementedError from deep inside the first allocation, naming no argument.
        try:
            torch.empty(0, device=device)
        except Exception as error:  # noqa: BLE001 (any of torch's refusals, named below)
            reason = str(error).split("\n", 1)[0] or type(error).__name__
            raise RuntimeError(f"{where}: device={value!r} is not available in this process ({reason})") from None
    return value


def memory_span(tensor: torch.Tensor) -> Tuple[int, int]:
    """The bytes ``[begin, end)`` a non-empty strided tensor spans, from its first element
    to its last whatever the strides in between (the kernel's conservative test)."""
    begin = tensor.data_ptr()
    if tensor.is_contiguous():  # the common case, without a loop over the strides
        return begin, begin + tensor.numel() * tensor.element_size()
    low = high = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return begin + low * tensor.element_size(), begin + (high + 1) * tensor.element_size()


# ---- argument checks of the fake (meta) kernels ------------------------------------------
# The fakes run instead of the C++ kernels whenever an argument is a meta tensor (and under
# torch.compile); these apply the checks the C++ headers apply, with the same messages, so
# a mixed-device or ill-typed call raises the same way on every path.

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


def same_device(op: str, **tensors) -> None:
    """Every given tensor (None skipped; a list stands for its items, named ``name[i]``) is on
    the device of the first one. The fakes call it too: a meta tensor among CPU ones sends
    the call to the fake, which must raise rather than return an output of the CPU's."""
    present = []
    for name, value in tensors.items():
        if isinstance(value, (list, tuple)):
            present.extend((f"{name}[{i}]", t) for i, t in enumerate(value) if t is not None)
        elif value is not None:
            present.append((name, value))
    if not present:
        return
    first_name, first = present[0]
    for name, tensor in present[1:]:
        if tensor.device != first.device:
            raise RuntimeError(f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}; "
                               "move every tensor argument to one device")


def index_dtype(op: str, name: str, tensor: torch.Tensor, what: str = "tensor") -> None:
    """``tensor`` is int64 or int32 (the C++ check_key_tensor / check_index_tensor)."""
    if tensor.dtype not in INDEX_DTYPES:
        raise RuntimeError(f"{op}: {name} must be an int64 or int32 {what}, got {tensor.dtype}")


def tensor_arguments(op: str, **named: Any) -> None:
    """TypeError naming the first of ``named`` (argument name -> value) that is not a
    tensor: a list or None would otherwise reach the dispatcher, whose messages name no
    argument ("Not yet supported ScalarType 46"), or an attribute read first."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type_name(value)}")
        plain_tensor(f"{op}: {name}", value)


def plain_tensor(what: str, tensor: torch.Tensor) -> None:
    """TypeError for a nested or a quantized tensor (``what`` names it, ``"op: name"``). Both
    have the strided layout, so :func:`dense_layout` alone let them through to torch's
    "Internal error: NestedTensorImpl doesn't support sizes" or the dispatcher's "Could not
    run ... 'QuantizedCPU' backend", naming no argument (and the layers' errors came after
    a table had been read)."""
    if tensor.is_nested:
        raise TypeError(f"{what} must be a plain tensor, got a nested tensor; pass a padded tensor "
                        "(.to_padded_tensor()) or its components")
    if tensor.is_quantized:
        raise TypeError(f"{what} must be a plain tensor, got a quantized {tensor.dtype} one; use .dequantize()")


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is dense (strided) and has values to read (not on the meta device):
    what a setting or a saved state given as a tensor must be before it is read or cast."""
    return tensor.layout == torch.strided and tensor.device.type != "meta"


def dense_layout(what: str, tensor: torch.Tensor) -> None:
    """TypeError unless ``tensor`` is dense (strided); ``what`` names it (``"op: name"``). A
    sparse tensor passes dtype and shape checks, then fails deep in an op (the dispatcher's
    "Could not run ... SparseCPU", naming no argument), or after a table changed."""
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} must be a dense (strided) tensor, got a {tensor.layout} one; use .to_dense()")
    plain_tensor(what, tensor)


def float_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` is float32, float64, float16 or bfloat16."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {tensor.dtype}")


def shown(value: Any) -> Any:
    """``value`` for a message: a traced size (a SymInt, as the fakes see sizes) by the value
    it was traced with, where it has one."""
    node = getattr(value, "node", None)
    if isinstance(value, torch.SymInt) and node is not None and node.has_hint():
        return node.hint
    return value


def shape_of(tensor: torch.Tensor) -> list:
    """``tensor``'s shape for a message (:func:`shown` sizes)."""
    return [shown(size) for size in tensor.shape]


def hash_table_slots(op: str, slot_keys: torch.Tensor, slot_rows: torch.Tensor) -> None:
    """The slot arrays of one table (the C++ check_hash_table_slots): int64, 1-D, one length,
    a power of two, contiguous. ``op`` names a table of a multi-table op as the kernel does
    (``"hash_table_find_tables: table 3"``)."""
    for name, tensor in (("slot_keys", slot_keys), ("slot_rows", slot_rows)):
        if tensor.dtype != torch.int64:
            raise RuntimeError(f"{op}: {name} must be int64, got {tensor.dtype}")
    torch._check(slot_keys.dim() == 1 and slot_rows.dim() == 1,
                 lambda: f"{op}: slot_keys and slot_rows must be 1-D [S], got shapes {shape_of(slot_keys)} and "
                         f"{shape_of(slot_rows)}")
    slots = slot_keys.shape[0]
    torch._check(slots == slot_rows.shape[0],
                 lambda: f"{op}: slot_keys has {shown(slots)} slots but slot_rows has {shown(slot_rows.shape[0])}; "
                         "they must match")
    torch._check(slots > 0 and (slots & (slots - 1)) == 0,
                 lambda: f"{op}: the slot count must be a power of two (index = hash & (S - 1)), got {shown(slots)}")
    torch._check(slot_keys.is_contiguous() and slot_rows.is_contiguous(),
                 lambda: f"{op}: slot_keys and slot_rows must be contiguous")


def csr_offsets(op: str, offsets: Sequence[int], n) -> None:
    """CSR bounds over ``n`` entries (the C++ check_table_offsets, after its length check):
    ``offsets[0] == 0``, ``offsets[-1] == n``, never decreasing."""
    def message() -> str:
        return f"{op}: offsets must run from 0 to {shown(n)}, got {shown(offsets[0])} .. {shown(offsets[-1])}"

    torch._check(offsets[0] == 0, message)
    torch._check(offsets[-1] == n, message)
    for i in range(len(offsets) - 1):
        torch._check(offsets[i] <= offsets[i + 1],
                     lambda: f"{op}: offsets must never decrease, got offsets[{i}] = {shown(offsets[i])} > "
                             f"offsets[{i + 1}] = {shown(offsets[i + 1])}")

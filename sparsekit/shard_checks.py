"""Checks of a shard's forward made before any table changes, shared by the SOK layers and
the collection: the weight is the layer's own and can be written, and the ranks agree on
train / eval mode and on the weight's row layout (dtype and width) before the exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .shard import _ModelParallelEmbedding


def _check_own_weights(shards: List["_ModelParallelEmbedding"], name: str, training: bool) -> None:
    """Refuses a training forward whose weight is a plain tensor put in place of the layer's
    parameter, and, while compiling, any weight but the layer's own Parameter (only the trace
    sees a ``functional_call`` substitute there)."""
    if not training:
        return
    if torch.compiler.is_compiling() and any(shard.weight is not shard._own_weight for shard in shards):
        # A Parameter put in place of the layer's own (functional_call with another model's
        # parameters): eager writes the new keys' rows into it, but the traced row op runs
        # against the module's own weight, so compiled and eager would train differently.
        raise RuntimeError(f"{name}: its weight is a parameter put in place of its own (functional_call?); a "
                           "compiled training forward writes new keys' rows into the layer's own weight: call it "
                           "eagerly (torch.compiler.disable) or in eval() mode, or pass the layer's own parameters")
    if not all(isinstance(shard.weight, nn.Parameter) for shard in shards):
        # torch.func.functional_call / nn.utils.stateless with plain tensors put in place of
        # the weight: a training step would insert its new keys into the layer's own hash
        # table and write their initial vectors into the caller's tensor, leaving the
        # layer's rows for those keys zero for good.
        raise RuntimeError(f"{name}: its weight is a plain tensor put in place of its parameter (functional_call "
                           "or torch.nn.utils.stateless?); a training forward inserts keys into the layer's own "
                           "hash table, so it needs the layer's own weight: call it in eval() mode (lookups only), "
                           "or pass the layer's parameters themselves")


def _check_writable(shards: List["_ModelParallelEmbedding"], name: str, training: bool) -> None:
    """Refuses, before anything changes, a forward whose in-place writes would fail halfway:
    under a torch.func transform, training outside inference mode on inference tables, a hash
    layer with its weight in shared memory, or a layer on the meta device."""
    weights = [shard.weight for shard in shards]
    if any(weight.is_meta for weight in weights):
        raise RuntimeError(f"{name}: its tables are on the meta device and hold no data; give them memory first "
                           "(model.to_empty(device=...), then reset_parameters() or load_state_dict)")
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"{name}: torch.func transforms (grad, vmap, functional_call under them, ...) are not "
                           "supported: the lookup's kernels read raw memory and a training step inserts keys into "
                           "the hash table; take gradients with loss.backward() or torch.autograd.grad")
    if not training or torch.is_inference_mode_enabled():
        return
    _check_own_weights(shards, name, training)
    if any(shard.hash_table is not None and shard.weight.device.type == "cpu" and shard.weight.is_shared()
           for shard in shards):
        # share_memory(), or a layer sent to another process by torch.multiprocessing: the
        # weight is shared, the hash table's count of keys is not, so two processes would
        # give the same rows to different keys.
        raise RuntimeError(f"{name}: its weight is in shared memory (share_memory(), or the layer was sent to "
                           "another process by torch.multiprocessing), but its hash table's count of keys is this "
                           "process's own: processes training it would give one row to two keys. Build the layer in "
                           "each process and shard it with a process group (as torchrun does); eval() lookups of a "
                           "shared layer that no process trains are fine")
    # Every step: one flat list and one C-level test per tensor.
    tensors = weights + [shard._fresh_rows for shard in shards if shard._fresh_rows is not None]
    for shard in shards:
        for table in (shard.hash_table, shard._pending):
            if table is not None:
                tensors += table._tensors()
    if any(map(Tensor.is_inference, tensors)):
        raise RuntimeError(f"{name}: its weight or hash table was made under torch.inference_mode(), and "
                           "inference tensors cannot be changed outside it, as a training step must; build "
                           "the layer outside inference_mode to train it (or call it in eval() mode)")


# Weight dtypes by number in a row layout code (_row_layout); any other dtype is the next number.
_LAYOUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _row_layout(weight: Tensor) -> int:
    """The weight's dtype and row width as one int64: what a rank's vectors look like on the wire."""
    dtype = _LAYOUT_DTYPES.index(weight.dtype) if weight.dtype in _LAYOUT_DTYPES else len(_LAYOUT_DTYPES)
    return dtype << 40 | weight.shape[1]


def _check_modes_agree(name: str, what: str, modes: List[int]) -> None:
    """RuntimeError on every rank when the ranks' forward modes (bit 0: train(), bit 1: records
    a backward) differ: the ranks would otherwise wait on each other's collectives until the
    group's timeout."""
    if len({mode & 1 for mode in modes}) > 1:
        evaluating = [rank for rank, mode in enumerate(modes) if not mode & 1]
        raise RuntimeError(f"{name}: rank(s) {evaluating} are in eval() mode and the others in train() mode; "
                           f"switch the {what}'s mode on every rank alike")
    if modes[0] & 1 and len({mode >> 1 for mode in modes}) > 1:
        without = [rank for rank, mode in enumerate(modes) if not mode >> 1]
        raise RuntimeError(f"{name}: rank(s) {without} run this training forward without a gradient "
                           "(torch.no_grad(), inference_mode or a frozen weight) and the others with one, whose "
                           "backward would wait for them; run it alike on every rank")


def _row_layout_text(code: int) -> str:
    dtype = code >> 40
    name = str(_LAYOUT_DTYPES[dtype]) if dtype < len(_LAYOUT_DTYPES) else "another dtype"
    return f"{name} rows of {code & ((1 << 40) - 1)}"

"""The one-process lookups as ``torch.compile`` sees them: no graph break.

Which row each key reads depends on the data and changes the tables, so it cannot be
traced, but its result has the input's size. So a compiled one-process layer calls
``sparsekit::_layer_rows``, an opaque op with an ordered side effect (never dropped,
merged or reordered) that resolves the rows eagerly, then the traced pooled read
(:func:`sparsekit.ops.embedding_bag`). Many ranks need all-to-alls of data-dependent sizes:
there the forward stays one graph break. The op finds its layer by ``id`` in a registry the
layers join in ``__init__`` and ``__setstate__``.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch
from torch import Tensor
from torch.fx import Proxy

_LAYERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def refuse_torchscript(name: str) -> None:
    """TorchScript (``torch.jit.trace`` / ``torch.jit.script``) cannot hold a layer's lookup:
    which row a key reads is Python work on the hash table that changes it. Tracing a layer
    failed with "Graphs differed across invocations" (training) or an AttributeError
    (eval), and a trace kept with ``check_trace=False`` replayed the rows of the traced
    batch (an IndexError, or wrong vectors, on another batch); scripting failed on a
    ``ForwardRef`` in ``Ragged``. A clear refusal instead, naming what works."""
    raise RuntimeError(f"{name}: torch.jit.trace / torch.jit.script are not supported (a lookup's rows come from "
                       "the hash table in Python, which a TorchScript graph cannot replay); use torch.compile or "
                       "eager mode")


def fx_leaf_call(module: Any, *args: Any) -> Any:
    """Under ``torch.fx`` symbolic tracing (``torchrec.fx`` too: TorchRec's inference and
    pipelines trace models): the module's call as one ``call_module`` node, as a leaf module
    gives, since which rows a key reads cannot be traced; None otherwise. The traced graph
    calls the module itself at run time (a traced root: :func:`call_traced_root`)."""
    proxy = None
    for arg in args:  # a Proxy, or a Proxy in a (values, offsets) pair / sk.Ragged
        for part in arg if isinstance(arg, tuple) else (arg,):
            if isinstance(part, Proxy):
                proxy = part
    if proxy is None:
        return None
    path = proxy.tracer.path_of_module(module)
    if not path:  # the traced root itself: the graph calls it, found by its id when the graph runs
        return proxy.tracer.create_proxy("call_function", call_traced_root, (id(module),) + tuple(args), {})
    return proxy.tracer.create_proxy("call_module", path, tuple(args), {})


def call_traced_root(layer_id: int, *args: Any) -> Any:
    """The call a graph traced from a layer or a collection itself (the tracer's root) makes:
    that module's, which must still exist."""
    return _layer(layer_id)(*args)


def _refuse_scripting(self: Any) -> None:
    """``__prepare_scriptable__`` of the layers and the collection (``torch.jit.script`` calls it first)."""
    refuse_torchscript(type(self).__name__)


def register(layer: Any) -> None:
    """Lets :func:`layer_rows` find ``layer`` by its ``id`` (a later object at a dead one's
    address replaces it)."""
    _LAYERS[id(layer)] = layer


def _layer(layer_id: int) -> Any:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError("sparsekit: a compiled or traced graph calls a sparsekit layer that no longer exists; "
                           "trace or compile the model again (torch._dynamo.reset() first for a compiled one)")
    return layer


@torch.library.custom_op("sparsekit::_layer_rows", mutates_args=())
def layer_rows(keys: Tensor, offsets: Optional[Tensor], layer: int, pad_key: Optional[int]) -> Tensor:
    """``[n]`` int64: the row of the layer's shard each of ``keys`` [n] reads (-1: none:
    a pad key, or a key missing in eval or not admitted yet), with the training step's
    changes to the tables made (see the layers' ``_traced_rows``). ``offsets``: the user's
    CSR offsets, checked here (they need the data)."""
    return _layer(layer)._traced_rows(keys, offsets, pad_key)


@layer_rows.register_fake
def _layer_rows_fake(keys: Tensor, offsets: Optional[Tensor], layer: int, pad_key: Optional[int]) -> Tensor:
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.custom_op("sparsekit::_collection_rows", mutates_args=())
def collection_rows(values: Tensor, offsets: Tensor, features: List[int], layer: int) -> List[Tensor]:
    """For each table the input's ``features`` read (the collection's feature numbers), in
    table order: the rows of its features' values in the table (``[nnz]`` int64: its values'
    rows first, in order, -1 for a missing key and after them), its features' bags as CSR
    offsets over those (``[len(its features) * B + 1]``, the -1 tail in the last bag: the
    kernels skip -1), and the values' positions in ``values`` (``[nnz]``, -1 in the tail);
    with the training step's changes to the tables made (see
    ``EmbeddingBagCollection._traced_rows``). Sizes the trace knows: an op whose output
    size depends on the data is a graph break unless the user sets
    ``capture_dynamic_output_shape_ops``."""
    return _layer(layer)._traced_rows(values, offsets, features)


@collection_rows.register_fake
def _collection_rows_fake(values: Tensor, offsets: Tensor, features: List[int], layer: int) -> List[Tensor]:
    collection = _layer(layer)
    names = list(collection._feature_table)
    batch = (offsets.numel() - 1) // max(len(features), 1)
    out = []
    for members in collection._tables_of([names[i] for i in features])[1]:
        out += [values.new_empty(values.shape, dtype=torch.int64), offsets.new_empty(len(members) * batch + 1),
                values.new_empty(values.shape, dtype=torch.int64)]
    return out


@torch.library.custom_op("sparsekit::_fused_tap", mutates_args=())
def fused_tap(pooled: Tensor, weight: Tensor, written: Tensor, rows: Tensor, offsets: Tensor, scale: Optional[Tensor],
              layer: int, table: int, features: int, mean: bool) -> Tensor:
    """A copy of ``pooled``, one table's pooled bags (``[F * B, dim]`` over CSR ``offsets``
    of ``rows``) read from its detached weight; its backward applies the collection's fused
    optimizer to the rows read (:func:`fused_update`) through ``written``, the weight
    detached (``weight`` itself only makes the output require grad), so a compiled step
    updates the table in its backward graph as the eager backward does."""
    return pooled.clone()


@fused_tap.register_fake
def _fused_tap_fake(pooled: Tensor, weight: Tensor, written: Tensor, rows: Tensor, offsets: Tensor,
                    scale: Optional[Tensor], layer: int, table: int, features: int, mean: bool) -> Tensor:
    return torch.empty_like(pooled)


def _fused_tap_setup(ctx: Any, inputs: Any, output: Tensor) -> None:
    _, _, written, rows, offsets, scale, ctx.layer, ctx.table, ctx.features, ctx.mean = inputs
    ctx.save_for_backward(written, rows, offsets, scale)


def _fused_tap_backward(ctx: Any, grad: Tensor) -> Any:
    written, rows, offsets, scale = ctx.saved_tensors
    torch.ops.sparsekit._fused_update(written, grad, rows, offsets, scale, ctx.layer, ctx.table, ctx.features,
                                      ctx.mean)
    return grad, None, None, None, None, None, None, None, None, None


fused_tap.register_autograd(_fused_tap_backward, setup_context=_fused_tap_setup)


@torch.library.custom_op("sparsekit::_fused_update", mutates_args=("weight",))
def fused_update(weight: Tensor, grad: Tensor, rows: Tensor, offsets: Tensor, scale: Optional[Tensor], layer: int,
                 table: int, features: int, mean: bool) -> None:
    """The collection's fused update of ``weight`` (its table ``table``'s rows, or the copy
    a compiled graph hands over and writes back) from ``grad``, the gradient of the
    table's pooled bags; the optimizer state is the collection's (``_traced_update``)."""
    _layer(layer)._traced_update(weight, grad, rows, offsets, scale, table, features, mean)


@fused_update.register_fake
def _fused_update_fake(weight: Tensor, grad: Tensor, rows: Tensor, offsets: Tensor, scale: Optional[Tensor],
                       layer: int, table: int, features: int, mean: bool) -> None:
    return None


def _ordered(name: str) -> None:
    """Marks ``name`` as having an ordered side effect (the tables it changes)."""
    torch.library._register_effectful_op(name, torch._library.effects.EffectType.ORDERED)


for _name in ("sparsekit::_layer_rows", "sparsekit::_collection_rows"):
    _ordered(_name)

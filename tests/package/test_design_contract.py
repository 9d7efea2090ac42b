"""docs/api.md 1-3 checked literally: the public names' signatures (parameter
names, defaults, keyword-only markers) as the contract writes them, every op's kernels
(CPU, CUDA when built with it, a Python fake), ``torch.library.opcheck`` of the ops only
the layers reach, and bit-reproducibility of every op and layer under
``torch.use_deterministic_algorithms(True)`` on several thread counts."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import sparsekit as sk
from sparsekit import _build_info

_EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KW = inspect.Parameter.KEYWORD_ONLY

# (name, default) per parameter in order; a name prefixed "*" is keyword-only. Extra
# trailing parameters with defaults are additions the contract allows (section 3a's
# eviction / admission, LazyAdam's maximize); the listed ones must come first, as written.
_DESIGN_SIGNATURES = {
    "ops.unique": [("keys", _EMPTY), ("return_inverse", True), ("return_counts", False)],
    "ops.segment_sum": [("data", _EMPTY), ("segment_ids", _EMPTY), ("num_segments", _EMPTY),
                        ("deterministic", False)],
    "ops.embedding_bag": [("weight", _EMPTY), ("rows", _EMPTY), ("offsets", _EMPTY), ("per_sample_weights", None),
                          ("mode", "sum"), ("padding_idx", None), ("include_last_offset", True)],
    "ops.embedding_gather": [("weight", _EMPTY), ("rows", _EMPTY)],
    "ops.lazy_adam_": [("weight", _EMPTY), ("exp_avg", _EMPTY), ("exp_avg_sq", _EMPTY), ("rows", _EMPTY),
                       ("grad", _EMPTY), ("step", _EMPTY), ("lr", _EMPTY), ("beta1", _EMPTY), ("beta2", _EMPTY),
                       ("eps", _EMPTY), ("weight_decay", 0.0)],
    "HashTable": [("capacity", _EMPTY), ("*key_dtype", torch.int64), ("*device", None)],
    "HashTable.find": [("self", _EMPTY), ("keys", _EMPTY)],
    "HashTable.insert": [("self", _EMPTY), ("keys", _EMPTY)],
    "HashTable.export": [("self", _EMPTY)],
    "HashTable.clear": [("self", _EMPTY)],
    "HashTable.state_dict": [("self", _EMPTY)],
    "HashTable.load_state_dict": [("self", _EMPTY), ("state_dict", _EMPTY)],
    "HashTable.to": [("self", _EMPTY), ("device", _EMPTY)],
    "DistributedEmbedding": [("combiner", _EMPTY), ("max_vocabulary_size_per_gpu", _EMPTY),
                             ("embedding_vec_size", _EMPTY), ("slot_num", _EMPTY), ("max_nnz", _EMPTY),
                             ("max_feature_num", None), ("use_hashtable", True), ("key_dtype", torch.int64),
                             ("embedding_initializer", None), ("process_group", None), ("device", None)],
    "DistributedEmbedding.forward": [("self", _EMPTY), ("inputs", _EMPTY), ("pad_key", -1)],
    "All2AllDenseEmbedding": [("max_vocabulary_size_per_gpu", _EMPTY), ("embedding_vec_size", _EMPTY),
                              ("slot_num", _EMPTY), ("nnz_per_slot", _EMPTY), ("dynamic_input", False),
                              ("use_hashtable", True), ("key_dtype", torch.int64), ("embedding_initializer", None),
                              ("process_group", None), ("device", None)],
    "LazyAdam": [("params", _EMPTY), ("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0)],
    "save_checkpoint": [("directory", _EMPTY), ("model", _EMPTY), ("optimizer", None)],
    "load_checkpoint": [("directory", _EMPTY), ("model", _EMPTY), ("optimizer", None)],
    "split_embedding_variable_from_others": [("params", _EMPTY)],
    "Ragged": [("values", _EMPTY), ("offsets", _EMPTY)],
}


def _public(name):
    target = sk
    for part in name.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize("name", sorted(_DESIGN_SIGNATURES))
def test_public_signatures_are_the_designs(name):
    """docs/api.md 2 and 3: names, order, defaults and keyword-only markers."""
    params = list(inspect.signature(_public(name)).parameters.values())
    want = _DESIGN_SIGNATURES[name]
    assert len(params) >= len(want), (name, params)
    for param, (spelled, default) in zip(params, want):
        assert param.name == spelled.lstrip("*"), (name, param, spelled)
        assert param.kind == (_KW if spelled.startswith("*") else _POS), (name, param)
        assert param.default == default and type(param.default) is type(default), (name, param, default)
    # Anything beyond the contract's parameters is optional (an addition, not a requirement).
    assert all(p.default is not _EMPTY or p.kind is inspect.Parameter.VAR_KEYWORD for p in params[len(want):]), \
        (name, params)


def test_segment_sum_reduce_is_keyword_only_and_capacity_is_a_property():
    """``segment_sum(..., reduce="mean")`` (section 2) and ``capacity`` / ``len(table)``."""
    reduce = inspect.signature(sk.ops.segment_sum).parameters["reduce"]
    assert reduce.kind is _KW and reduce.default == "sum"
    table = sk.HashTable(7)
    table.insert(torch.tensor([3, 3, 9]))
    assert table.capacity == 7 and len(table) == 2
    assert sk.ops.lazy_adam_(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.tensor([1]),
                             torch.ones(1, 1), 1, 0.1, 0.9, 0.999, 1e-8) is None  # "-> ()"


def _kernel_ops():
    """The ops sparsekit._C defines (internal Python-defined ones start with '_')."""
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("sparsekit::") and not n.startswith("sparsekit::_"))


def test_every_op_has_a_cpu_kernel_a_python_fake_and_a_cuda_kernel_when_built_with_cuda():
    """Section 2: 'Every op has a CPU kernel ..., a CUDA kernel, a fake (meta) kernel
    registered in Python'. test_build lists a hand-picked dozen; this walks the dispatcher."""
    from torch._library.simple_registry import singleton
    ops = _kernel_ops()
    assert {"unique", "segment_sum", "hash_table_find", "embedding_bag", "embedding_gather", "lazy_adam_"} <= set(ops)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert [op for op in ops if not has(f"sparsekit::{op}", "CPU")] == []
    assert [op for op in ops if singleton.find(f"sparsekit::{op}").fake_impl.kernel is None] == []
    if getattr(_build_info, "CUDA_VERSION", None):
        assert [op for op in ops if not has(f"sparsekit::{op}", "CUDA")] == []
    # Differentiable ops register their autograd (torch.library.register_autograd).
    for op in ("segment_sum", "embedding_bag", "embedding_gather", "segment_sum_parts"):
        assert has(f"sparsekit::{op}", "Autograd"), op


@pytest.mark.parametrize("training", [True, False])
def test_the_ops_only_layers_reach_pass_opcheck(training):
    """Section 2: opcheck coverage of every op, including ``sparsekit::_layer_rows`` and
    ``sparsekit::_collection_rows`` that only a (compiled) layer calls."""
    layer = sk.DistributedEmbedding("sum", 100, 4, 2, 3).train(training)
    keys = torch.tensor([1, 2, 3, 4, 5, 6, -1, 8])
    offsets = torch.tensor([0, 2, 4, 6, 8])
    torch.library.opcheck(torch.ops.sparsekit._layer_rows.default, (keys, offsets, id(layer), None))
    torch.library.opcheck(torch.ops.sparsekit._layer_rows.default, (keys, None, id(layer), -1))
    tables = [sk.TableConfig("t0", 4, 100, ["a", "b"]), sk.TableConfig("t1", 4, 100, ["c"])]
    ebc = sk.EmbeddingBagCollection(tables).train(training)
    values = torch.arange(12)
    torch.library.opcheck(torch.ops.sparsekit._collection_rows.default,
                          (values, torch.arange(0, 13, 2), [0, 1, 2], id(ebc)))


@contextlib.contextmanager
def _deterministic_on_threads(threads):
    old_flag, old_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    old_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_flag, warn_only=old_warn_only)
        torch.set_num_threads(old_threads)


def _every_op_and_layer(device):
    """Outputs of every public op (forward and gradients) and of both layers trained a few
    steps with LazyAdam; inputs drawn from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    out = {}
    keys = torch.randint(-40, 40, (3000,), generator=g).to(device)
    out["unique"] = sk.ops.unique(keys, return_counts=True)
    data = torch.randn(6000, 8, generator=g).to(device)
    ids = torch.randint(-1, 200, (6000,), generator=g).to(device)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        d = data.to(dtype).requires_grad_()
        s = sk.ops.segment_sum(d, ids, 200)
        (grad,) = torch.autograd.grad(s.float().square().sum(), d)
        out[f"segment_sum {dtype}"] = (s.detach(), grad, sk.ops.segment_mean(data.to(dtype), ids, 200))
    weight = torch.randn(300, 16, generator=g).to(device).requires_grad_()
    rows = torch.randint(-1, 300, (6000,), generator=g).to(device)
    offsets = torch.sort(torch.randint(0, 6001, (401,), generator=g)).values
    offsets[0], offsets[-1] = 0, 6000
    offsets = offsets.to(device)
    psw = torch.rand(6000, generator=g).to(device)
    for mode in ("sum", "mean", "max"):
        pooled = sk.ops.embedding_bag(weight, rows, offsets, None if mode == "max" else psw, mode)
        (grad,) = torch.autograd.grad(pooled.square().sum(), weight)
        grad = grad.coalesce()
        out[f"embedding_bag {mode}"] = (pooled.detach(), grad.indices(), grad.values())
    gathered = sk.ops.embedding_gather(weight, rows)
    (grad,) = torch.autograd.grad(gathered.square().sum(), weight)
    out["embedding_gather"] = (gathered.detach(), grad.coalesce().values())
    w, m, v = (torch.randn(300, 16, generator=g).to(device) for _ in range(3))
    v = v.abs()
    sk.ops.lazy_adam_(w, m, v, torch.randperm(300, generator=g)[:100].to(device),
                      torch.randn(100, 16, generator=g).to(device), 3, 0.01, 0.9, 0.999, 1e-8, 0.01)
    out["lazy_adam_"] = (w, m, v)
    table = sk.HashTable(3000, device=device)
    out["HashTable"] = (table.insert(keys), table.find(keys.flip(0)), *table.export())
    dense = torch.randint(-1, 200, (32, 3, 4), generator=g).to(device)
    for name, layer, batch in (
            ("DistributedEmbedding", sk.DistributedEmbedding("mean", 500, 8, 3, 4, device=device), dense),
            ("All2AllDenseEmbedding", sk.All2AllDenseEmbedding(500, 8, 3, 4, device=device), dense.abs())):
        optimizer = sk.LazyAdam(layer.parameters(), lr=0.01)
        for _ in range(3):
            y = layer(batch)
            optimizer.zero_grad()
            y.square().sum().backward()
            optimizer.step()
        out[name] = (y.detach(), layer.weight.detach().clone(), *layer.hash_table.export())
    return out


def _bits(tensor):
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8) if tensor.is_floating_point() else tensor.cpu()


def test_every_op_and_layer_is_bit_reproducible_under_use_deterministic_algorithms(device):
    """Section 2, Determinism: run twice on 1 and 2 threads, compare bits."""
    for threads in (1, 2):
        with _deterministic_on_threads(threads):
            first, second = _every_op_and_layer(device), _every_op_and_layer(device)
        for name in first:
            for a, b in zip(first[name], second[name]):
                assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (name, threads)

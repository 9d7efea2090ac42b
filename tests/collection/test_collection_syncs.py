"""The host reads of a one-process collection step on a device, counted on the CPU.

sparsekit._device.emulate_device() makes the step's Python take its GPU branches with CPU
tensors; the modes below count what would wait for the device there: a read of values
(tolist, numpy, item, bool/int of a tensor), an op whose output size depends on values
(nonzero, masked_select, unique, boolean-mask indexing, repeat_interleave without its size),
and each sparsekit op whose CUDA kernel reads back under the arguments given (the table in
_SYNCING_OPS, from the kernels' own contracts). A steady-state training step (every key has
its row) makes one read, the same at 2 and 26 tables; the GPU branches compute what the CPU
ones do, step after step, on drawn configurations.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given
from properties import examples
from torch.utils._python_dispatch import TorchDispatchMode

import sparsekit as sk
from sparsekit._device import emulate_device
from test_collection_fused import _batches, _collection, _loss, configurations

# The sparsekit ops of a step whose CUDA kernels read nothing back, given these arguments
# (csrc/cuda: the error slots, lookup_rows' device-side report); any other sparsekit op
# counts as one read.
_SYNCING_OPS = {
    "lookup_rows": lambda args: False,
    "record_verdict_": lambda args: False,
    "hash_table_touch_tables_": lambda args: len(args) < 8 or args[7] is None,
    "pooled_read": lambda args: len(args) < 9 or args[8] is None,
    "pooled_read_update_": lambda args: len(args) < 14 or args[13] is None,
}
_DATA_SIZED = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "equal",
               "_local_scalar_dense", "bincount"}


class _HostReads(TorchDispatchMode):
    """Counts the reads at the dispatcher: data-sized aten ops and syncing sparsekit ops."""

    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace == "sparsekit":
            if _SYNCING_OPS.get(name, lambda args: True)(args):
                self.reads[f"sparsekit.{name}"] += 1
        elif name in _DATA_SIZED:
            self.reads[name] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.reads[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            self.reads[f"{name} (mask)"] += 1
        return func(*args, **(kwargs or {}))


class _PythonReads:
    """Counts the reads that never reach the dispatcher (tolist, numpy, cpu), by wrapping
    those methods of torch.Tensor: a TorchFunctionMode would miss them in a backward."""

    def __init__(self):
        self.reads = collections.Counter()
        self._saved = {}

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            method = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, method))
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)

    def _counting(self, name, method):
        def counted(tensor, *args, **kwargs):
            self.reads[name] += 1
            return method(tensor, *args, **kwargs)
        return counted


def _reads(run):
    """What run() reads back, with the GPU branches taken."""
    with emulate_device(), _PythonReads() as python, _HostReads() as dispatch:
        run()
    return python.reads + dispatch.reads


def _steady(num_tables, hashed, optimizer, error_mode="raise"):
    names = [f"f{i}" for i in range(num_tables)]
    ebc = sk.EmbeddingBagCollection(
        [sk.TableConfig(f"t{i}", 16, 1000, [names[i]], use_hashtable=hashed) for i in range(num_tables)],
        fused_params={"optimizer": optimizer, "lr": 0.01}, error_mode=error_mode)
    g = torch.Generator().manual_seed(0)

    def kjt():
        lengths = torch.randint(1, 4, (num_tables * 32,), generator=g)
        return sk.KeyedJagged(names, torch.randint(0, 8, (int(lengths.sum()),), generator=g), lengths=lengths)

    for _ in range(6):  # every key of 0..7 has its row after these
        sum(v.sum() for v in ebc(kjt()).values()).backward()
    return ebc, kjt()


@pytest.mark.parametrize("optimizer", ["sgd", "lazy_adam", "rowwise_adagrad"])
@pytest.mark.parametrize("hashed", [True, False])
def test_a_steady_fused_step_reads_the_device_once_at_2_and_26_tables(hashed, optimizer):
    for num_tables in (2, 26):
        ebc, batch = _steady(num_tables, hashed, optimizer)
        reads = _reads(lambda: _loss(ebc(batch)).backward())
        assert sum(reads.values()) == 1 and reads["tolist"] == 1, (num_tables, reads)


def test_an_eval_forward_reads_the_device_once():
    ebc, batch = _steady(26, True, "sgd")
    ebc.eval()
    with torch.no_grad():
        reads = _reads(lambda: ebc(batch))
    assert sum(reads.values()) == 1, reads


@examples(10)
@given(config=configurations())
def test_the_gpu_branches_leave_the_tables_the_cpu_branches_do(config):
    """Step after step (new keys, evicting and admitting tables, weights, empty bags), the
    fused step with the GPU branches taken leaves the same outputs, rows, scores and
    optimizer state as with the CPU's, bit for bit."""
    host, device = _collection(config, True, "cpu"), _collection(config, True, "cpu")
    for kjt in _batches(config, "cpu"):
        out_host = host(kjt)
        _loss(out_host).backward()
        with emulate_device():
            out_device = device(kjt)
            _loss(out_device).backward()
        for key in out_host:
            assert torch.equal(out_host[key], out_device[key]), key
    for table in config["tables"]:
        a, b = host.export(table["name"]), device.export(table["name"])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), table["name"]
        assert host.stats(table["name"]) == device.stats(table["name"])
    assert torch.equal(torch.cat([s.flatten().float() for s in _fused_state(host)]),
                       torch.cat([s.flatten().float() for s in _fused_state(device)]))


def _fused_state(ebc):
    state = ebc.fused_optimizer.state_dict()["state"]
    return [t for entry in state.values() for t in entry.values() if isinstance(t, torch.Tensor)] or [torch.zeros(1)]


@pytest.mark.parametrize("emulated", [False, True])
def test_bad_offsets_raise_before_any_table_changes_on_either_branch(emulated):
    ebc, _ = _steady(3, True, "sgd")
    before = [t.clone() for t in ebc.state_dict().values() if isinstance(t, torch.Tensor)]
    bad = sk.KeyedJagged(["f0", "f1", "f2"], torch.tensor([100, 101, 102, 103]),
                         offsets=torch.tensor([0, 3, 1, 4]))
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
        if emulated:
            with emulate_device():
                ebc(bad)
        else:
            ebc(bad)
    after = [t for t in ebc.state_dict().values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_an_error_an_earlier_step_recorded_raises_at_the_next_forward_once():
    """The error word is read with the next step's verdict: an error the previous backward
    recorded there raises once, then the word is empty again."""
    ebc, batch = _steady(2, True, "sgd")
    _loss(ebc(batch)).backward()
    ebc._step_errors.slots(torch.device("cpu"))[1] = 5  # as a fused update meeting a bad lookup would
    with pytest.raises(RuntimeError, match=r"earlier step's pooled read or fused update met bad input \(bag "):
        ebc(batch)
    _loss(ebc(batch)).backward()


@pytest.mark.parametrize("layer", ["bags", "dense"])
@pytest.mark.parametrize("hashed", [True, False])
def test_a_one_process_layer_reads_the_device_once_per_forward_as_a_one_table_collection(layer, hashed):
    """The SOK layers' one-process forward is the engine's: an eval forward, and a steady
    training forward, each make the one read of the lookup's verdict (the layer's own
    exchange made one per stage: the dedup, the offsets' verdict, the keys' check). A CPU
    hash table's training forward of bags under three keys keeps the layer's own lookup."""
    if layer == "bags":
        module = sk.DistributedEmbedding("mean", 64, 4, 3, 5, use_hashtable=hashed)
        lengths = torch.tensor([3, 4, 3, 5, 3, 3])
        batch = sk.Ragged(torch.arange(int(lengths.sum())) % 11, torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                            lengths.cumsum(0)]))
    else:
        module = sk.All2AllDenseEmbedding(64, 4, 3, 2, use_hashtable=hashed)
        batch = torch.tensor([[[1, 2], [3, 4], [5, 6]], [[7, 1], [2, 3], [4, 5]]])
    module(batch).sum().backward()  # every key has its row after this
    if not (hashed and layer == "dense"):
        reads = _reads(lambda: module(batch))
        assert sum(reads.values()) == 1 and reads["tolist"] == 1, reads
    module.eval()
    with torch.no_grad():
        reads = _reads(lambda: module(batch))
    assert sum(reads.values()) == 1, reads

"""torch.fx symbolic tracing (what TorchRec's inference and pipelines do to a model): the
collection and both layers become one ``call_module`` node each, called at run time, so a
traced model looks keys up, grows its tables and trains as the eager one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from torch import nn

import sparsekit as sk


class _Model(nn.Module):
    def __init__(self, output: str, hashed: bool) -> None:
        super().__init__()
        self.ebc = sk.EmbeddingBagCollection(
            [sk.TableConfig("t0", 4, 64, ["a", "b"], use_hashtable=hashed), sk.TableConfig("t1", 4, 64, ["c"])],
            output=output)
        self.bag = sk.DistributedEmbedding("mean", 64, 4, 2, 3, use_hashtable=hashed)
        self.dense = sk.All2AllDenseEmbedding(64, 4, 2, 1, use_hashtable=hashed)
        self.output = output

    def forward(self, kjt, values, offsets, ids):
        pooled = self.ebc(kjt)
        pooled = pooled.values() if self.output == "keyed" else torch.cat([pooled[f] for f in ("a", "b", "c")], 1)
        bags = self.bag(sk.Ragged(values, offsets)).flatten(1) + self.bag((values, offsets)).flatten(1)
        return torch.cat([pooled, bags, self.dense(ids).flatten(1)], 1)


def _batch(g: torch.Generator, batch: int = 3):
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    keys = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    kjt = sk.KeyedJagged(["a", "b", "c"], keys, lengths=lengths)
    bag_lengths = torch.randint(0, 4, (2 * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), bag_lengths.cumsum(0)])
    values = torch.randint(0, 40, (int(offsets[-1]),), generator=g)
    return kjt, values, offsets, torch.randint(0, 40, (batch, 2, 1), generator=g)


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("output", ["dict", "keyed"])
def test_a_traced_model_calls_each_embedding_module_and_trains_as_eager(output, hashed):
    torch.manual_seed(0)
    eager = _Model(output, hashed)
    traced = torch.fx.symbolic_trace(copy.deepcopy(eager))
    called = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert called == ["ebc", "bag", "bag", "dense"], called
    opt_eager = sk.LazyAdam(eager.parameters(), lr=0.05)
    opt_traced = sk.LazyAdam(traced.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = _batch(g)
        outs = []
        for model, opt in ((eager, opt_eager), (traced, opt_traced)):
            out = model(*batch)
            out.square().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for (name, ours), (_, theirs) in zip(eager.state_dict().items(), traced.state_dict().items()):
        if isinstance(ours, torch.Tensor):
            torch.testing.assert_close(theirs, ours, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    if hashed:
        assert len(traced.ebc.shards[0].hash_table) == len(eager.ebc.shards[0].hash_table) > 0


def test_a_traced_model_refuses_bad_input_as_the_eager_one():
    model = torch.fx.symbolic_trace(_Model("dict", hashed=False))
    kjt, values, offsets, ids = _batch(torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="out of range|outside"):
        model(kjt, values, offsets, torch.full_like(ids, 1000))


def test_a_collection_or_layer_traced_as_the_root_is_one_call_of_it():
    """TorchRec traces a collection itself (its own test_fx): the graph is one call of the
    live module, giving what it gives; once the module is gone the graph says so."""
    g = torch.Generator().manual_seed(5)
    kjt, values, offsets, ids = _batch(g)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t0", 4, 64, ["a", "b"], use_hashtable=False),
                                     sk.TableConfig("t1", 4, 64, ["c"])], output="keyed")
    layer = sk.DistributedEmbedding("sum", 64, 4, 2, 3, use_hashtable=False)
    traced_ebc, traced_layer = torch.fx.symbolic_trace(ebc), torch.fx.symbolic_trace(layer)
    assert sum(node.op == "call_function" for node in traced_ebc.graph.nodes) == 1
    torch.testing.assert_close(traced_ebc(kjt).values(), ebc(kjt).values(), rtol=0, atol=0)
    torch.testing.assert_close(traced_layer((values, offsets)), layer((values, offsets)), rtol=0, atol=0)
    del layer
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        traced_layer((values, offsets))

"""torch.compile of whole models: each sparsekit layer's forward is one graph break (it
runs eagerly: its sizes depend on the data), the dense parts compile, and a compiled
training step (forward, backward, LazyAdam) follows the eager one."""

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.train.model import DLRM, SparsekitSlotEmbedding, SparsekitTableEmbedding

BATCH, SLOTS, DIM = 64, 4, 8


class TwoLayers(nn.Module):
    """Dense layers around a DistributedEmbedding and an EmbeddingBagCollection, both
    called straight from this forward."""

    def __init__(self):
        super().__init__()
        self.bottom = nn.Linear(3, DIM)
        self.embedding = sk.DistributedEmbedding("sum", 10_000, DIM, SLOTS, 1, use_hashtable=True)
        self.collection = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, 1000, ["a", "b"])])
        self.top = nn.Linear(DIM * (SLOTS + 3), 1)

    def forward(self, dense, keys, values, lengths):
        vectors = self.embedding(keys.unsqueeze(2))  # [B, SLOTS, 1] -> [B, SLOTS, DIM]
        pooled = self.collection(sk.KeyedJagged(["a", "b"], values, lengths=lengths))
        parts = [torch.relu(self.bottom(dense)), vectors.flatten(1), pooled["a"], pooled["b"]]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def _inputs(step):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (2 * BATCH,), generator=g)
    return (torch.randn(BATCH, 3, generator=g), torch.randint(0, 500, (BATCH, SLOTS), generator=g),
            torch.randint(0, 800, (int(lengths.sum()),), generator=g), lengths)


def test_each_layer_is_at_most_one_graph_break():
    torch.manual_seed(0)
    explained = torch._dynamo.explain(TwoLayers())(*_inputs(0))
    reasons = [str(b.reason).split("\n")[0] for b in explained.break_reasons]
    # At most one break per layer (dynamo may resume after the first without another), and
    # only at the layers: the dense parts compile.
    assert 1 <= explained.graph_break_count <= 2, reasons
    assert all("disable" in reason for reason in reasons), reasons


def _train(model, forward, steps, labels):
    optimizer = sk.LazyAdam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = nn.functional.binary_cross_entropy_with_logits(forward(*_inputs(step)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_training_follows_eager():
    torch.manual_seed(0)
    torch._dynamo.reset()
    eager = TwoLayers()
    twin = copy.deepcopy(eager)
    labels = torch.rand(BATCH, generator=torch.Generator().manual_seed(9)).round()
    want = _train(eager, eager, 4, labels)
    got = _train(twin, torch.compile(twin, backend="aot_eager"), 4, labels)
    assert got == pytest.approx(want, abs=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("embedding, backend", [("shared", "inductor"), ("per-slot", "aot_eager")])
def test_compiled_dlrm_step(embedding, backend):
    """The harness's model compiled whole (inductor: the default backend, C++ codegen on
    the CPU) trains like the eager one."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    cpu = torch.device("cpu")
    layer = SparsekitSlotEmbedding(50_000, 8, cpu) if embedding == "shared" else SparsekitTableEmbedding(2000, 8, cpu)
    eager = DLRM(layer, 8, bottom=(16,), top=(16,))
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend=backend)
    g = torch.Generator().manual_seed(3)
    dense, labels = torch.randn(BATCH, 13, generator=g), torch.rand(BATCH, generator=g).round()
    opt_a, opt_b = sk.LazyAdam(eager.parameters(), lr=1e-2), sk.LazyAdam(twin.parameters(), lr=1e-2)
    for step in range(3):
        keys = torch.randint(0, 1000, (BATCH, 26), generator=torch.Generator().manual_seed(step))
        losses = []
        for model, optimizer in ((eager, opt_a), (compiled, opt_b)):
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, keys), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], abs=1e-5)

"""Eviction and gradients, on drawn sequences: several training lookups of an evicting
table (LRU or LFU, capacity 1-5, keys from a small range so rows change hands often)
before one optimizer step, each lookup's backward run at once or later. The gradient
that reaches a row is the sum over the lookups made since its key got that row (the
lookups of an evicted key, or of the row's earlier holders, contribute nothing: DESIGN
3a, "no state of the old key leaks into the new one"). The reference tracks which key
holds a row after each lookup from the table's own export and sums the lookups' weights
by hand."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples

import sparsekit as sk

DIM = 3


@st.composite
def sequences(draw):
    capacity = draw(st.integers(1, 5))
    lookups = []
    for _ in range(draw(st.integers(1, 5))):
        distinct = draw(st.lists(st.integers(0, 9), min_size=1, max_size=capacity, unique=True))
        keys = draw(st.lists(st.sampled_from(distinct), min_size=len(distinct), max_size=len(distinct) + 3))
        keys = distinct + keys[len(distinct):]  # every drawn key at least once
        keys = draw(st.permutations(keys))
        weights = draw(st.lists(st.integers(-3, 3), min_size=len(keys), max_size=len(keys)))
        lookups.append((list(keys), weights, draw(st.booleans())))  # backward at once?
    return draw(st.sampled_from(["lru", "lfu"])), capacity, draw(st.sampled_from(["all2all", "collection"])), lookups


def _build(kind, capacity, eviction):
    if kind == "collection":
        return sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, capacity, ["f"], eviction=eviction)])
    return sk.All2AllDenseEmbedding(capacity, DIM, 1, 1, dynamic_input=True, eviction=eviction)


def _lookup(layer, kind, keys):
    if kind == "collection":
        kjt = sk.KeyedJagged(["f"], torch.tensor(keys), lengths=torch.ones(len(keys), dtype=torch.long))
        return layer(kjt)["f"]
    return layer(torch.tensor(keys))


@given(sequences())
@examples(25)
def test_a_row_s_gradient_sums_the_lookups_since_its_key_took_it(sequence):
    eviction, capacity, kind, lookups = sequence
    layer = _build(kind, capacity, eviction)
    weight = layer.weights["t"] if kind == "collection" else layer.weight
    pending = []
    holder_since = {}  # row -> (key, index of the lookup from which it holds the row)
    for index, (keys, weights, at_once) in enumerate(lookups):
        loss = (_lookup(layer, kind, keys) * torch.tensor(weights, dtype=torch.float32).unsqueeze(1)).sum()
        found, _ = layer.export("t") if kind == "collection" else layer.export()
        table = layer.shards[0].hash_table if kind == "collection" else layer.hash_table
        rows = table.find(found)
        holders = {int(r): int(k) for r, k in zip(rows.tolist(), found.tolist())}
        holder_since = {r: holder_since[r] if holder_since.get(r, (None,))[0] == k else (k, index)
                        for r, k in holders.items()}
        if at_once:
            loss.backward()
        else:
            pending.append(loss)
    if pending:
        sum(pending).backward()
    expected = torch.zeros(weight.shape[0])
    for row, (key, since) in holder_since.items():
        expected[row] = sum(w for keys, weights, _ in lookups[since:] for k, w in zip(keys, weights) if k == key)
    grad = weight.grad.to_dense() if weight.grad is not None else torch.zeros_like(weight)
    torch.testing.assert_close(grad, expected.unsqueeze(1).expand_as(grad), rtol=0, atol=0)

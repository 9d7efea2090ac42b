"""A one-process SOK layer is a one-table collection: on the same rows and the same bags,
``DistributedEmbedding`` and ``All2AllDenseEmbedding`` give what
``sk.EmbeddingBagCollection`` gives (outputs, gradients, the keys their hash tables take),
step after step, for direct and hash tables, sums and means, empty bags and repeated keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples

import sparsekit as sk

DIM = 4


def _pair(combiner: str, hashed: bool, slots: int, capacity: int = 64):
    layer = sk.DistributedEmbedding(combiner, capacity, DIM, slots, 8, use_hashtable=hashed,
                                    embedding_initializer=sk.KeySeededUniform(seed=3))
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", DIM, capacity, [f"s{i}" for i in range(slots)],
                                                    combiner=combiner, use_hashtable=hashed,
                                                    initializer=sk.KeySeededUniform(seed=3))])
    with torch.no_grad():
        ebc.shards[0].weight.copy_(layer.weight)
    return layer, ebc


def _as_kjt(values: torch.Tensor, lengths: torch.Tensor, batch: int, slots: int) -> sk.KeyedJagged:
    """The layer's batch-major bags (sample b, slot s: bag b * slots + s) as a feature-major KJT."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    order = [b * slots + s for s in range(slots) for b in range(batch)]
    parts = [values[offsets[i]:offsets[i + 1]] for i in order]
    return sk.KeyedJagged([f"s{i}" for i in range(slots)], torch.cat(parts) if parts else values[:0],
                          lengths=lengths[order] if order else lengths)


def _rows_by_key(table):
    """The rows of a hash table's keys in key order (every row of a direct table: None)."""
    if table is None:
        return slice(None)
    keys, rows = table.export()
    return rows[keys.argsort()]


@examples(10)
@given(combiner=st.sampled_from(["sum", "mean"]), hashed=st.booleans(), slots=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_distributed_embedding_trains_as_a_one_table_collection(combiner, hashed, slots, seed):
    layer, ebc = _pair(combiner, hashed, slots)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        batch = int(torch.randint(0, 4, (), generator=g))
        lengths = torch.randint(0, 4, (batch * slots,), generator=g)
        values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        ours = layer(sk.Ragged(values, offsets))
        theirs = ebc(_as_kjt(values, lengths, batch, slots))
        want = torch.stack([theirs[f"s{i}"] for i in range(slots)], 1) if batch else ours.new_zeros(0, slots, DIM)
        torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
        layer.zero_grad()
        ebc.zero_grad()
        ours.square().sum().backward()
        if batch:
            want.square().sum().backward()
        a, b = layer.weight.grad, ebc.shards[0].weight.grad
        if a is None or b is None:
            assert (a is None or a._nnz() == 0) and (b is None or b._nnz() == 0)
        else:
            # A hash table's rows follow first occurrence, which differs between the layer's
            # sample-major bags and the collection's feature-major ones: compared by key.
            ra, rb = _rows_by_key(layer.hash_table), _rows_by_key(ebc.shards[0].hash_table)
            torch.testing.assert_close(a.to_dense()[ra], b.to_dense()[rb], rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for w in (layer.weight, ebc.shards[0].weight):
                if w.grad is not None:
                    w.sub_(0.1 * w.grad.to_dense())
    if hashed:
        assert torch.equal(layer.hash_table.export()[0].sort().values, ebc.export("t")[0].sort().values)
        assert layer.hash_table.clock == ebc.shards[0].hash_table.clock


@pytest.mark.parametrize("hashed", [False, True])
def test_all2all_dense_embedding_reads_each_key_as_its_own_bag(hashed):
    layer = sk.All2AllDenseEmbedding(64, DIM, 2, 3, use_hashtable=hashed)
    keys = torch.tensor([[[1, 5, 1], [2, 2, 9]], [[5, 7, 7], [1, 0, 3]]])
    out = layer(keys)
    rows = keys.flatten() if not hashed else layer.hash_table.find(keys.flatten())
    assert torch.equal(out, layer.weight.detach()[rows].view(2, 2, 3, DIM))
    out.square().sum().backward()
    want = torch.zeros_like(layer.weight).index_add_(0, rows, 2 * out.detach().view(-1, DIM))
    torch.testing.assert_close(layer.weight.grad.to_dense(), want)
    assert layer.weight.grad.is_coalesced()


def test_a_bad_direct_key_is_named_in_input_order_and_changes_nothing():
    layer = sk.DistributedEmbedding("sum", 40, DIM, 1, 5, use_hashtable=False)
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"key 70 \(2 distinct bad keys on rank 0\) is out of range"):
        layer(sk.Ragged(torch.tensor([3, 70, -3, 70]), torch.tensor([0, 4])))
    assert torch.equal(layer.weight.detach(), before)

"""TorchRec's variable batch per feature (VBE): stride_per_key() bags per feature and the
inverse indices mapping each sample of the batch to its bag. The collection's output and
gradients equal those of the feature's bags selected by the inverse indices, as TorchRec's
EmbeddingBagCollection gives; where torchrec installs, against TorchRec itself."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

import sparsekit as sk


class VariableBatchKJT:
    """TorchRec's VBE KeyedJaggedTensor, as far as the collection reads it."""

    def __init__(self, keys: List[str], values, lengths, strides: List[int], inverse, weights=None,
                 inverse_keys: Optional[List[str]] = None):
        self._keys, self._values, self._lengths, self._strides = keys, values, lengths, strides
        self._inverse = None if inverse is None else (inverse_keys or keys, inverse)
        self._weights = weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=torch.long), self._lengths.long().cumsum(0)])

    def weights_or_none(self):
        return self._weights

    def variable_stride_per_key(self):
        return True

    def stride_per_key(self):
        return self._strides

    def stride(self):
        return max(self._strides)

    def inverse_indices_or_none(self):
        return self._inverse


def _random_vbe(keys, strides, batch, seed, weighted=False, rows=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (sum(strides),), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    inverse = torch.stack([torch.randint(0, max(s, 1), (batch,), generator=g) for s in strides])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return VariableBatchKJT(keys, values, lengths, strides, inverse, weights)


def _expanded(kjt: VariableBatchKJT) -> sk.KeyedJagged:
    """The same batch written out bag by bag: feature f's sample b is its bag inverse[f][b]."""
    offsets = kjt.offsets().tolist()
    first = [sum(kjt._strides[:f]) for f in range(len(kjt._keys))]
    values, lengths, weights = [], [], []
    for f in range(len(kjt._keys)):
        for bag in kjt._inverse[1][f].tolist():
            s, e = offsets[first[f] + bag], offsets[first[f] + bag + 1]
            values.append(kjt._values[s:e])
            lengths.append(e - s)
            if kjt._weights is not None:
                weights.append(kjt._weights[s:e])
    empty = kjt._values[:0]
    return sk.KeyedJagged(kjt._keys, torch.cat([empty] + values), lengths=torch.tensor(lengths, dtype=torch.long),
                          weights=torch.cat([kjt._weights[:0]] + weights) if kjt._weights is not None else None)


def _pair(**kwargs):
    configs = [sk.TableConfig("a", 4, 40, ["fa"], use_hashtable=False),
               sk.TableConfig("b", 8, 40, ["fb", "fc"], combiner="mean", use_hashtable=False)]
    a = sk.EmbeddingBagCollection(configs, **kwargs)
    b = sk.EmbeddingBagCollection(configs, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("strides, batch", [([2, 5, 1], 6), ([6, 6, 6], 6), ([1, 1, 1], 3), ([3, 0, 2], 0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_variable_batch_pools_and_trains_as_its_expanded_batch(strides, batch, weighted):
    if batch == 0 and any(strides):
        strides = [0, 0, 0]
    kjt = _random_vbe(["fa", "fb", "fc"], strides, batch, seed=sum(strides) + batch, weighted=weighted)
    ours, reference = _pair(is_weighted=weighted)
    got, want = ours(kjt), reference(_expanded(kjt))
    assert list(got) == list(want)
    for key in got:
        assert got[key].shape == (batch, 4 if key == "fa" else 8)
        torch.testing.assert_close(got[key], want[key])
    sum(v.square().sum() for v in got.values()).backward()
    sum(v.square().sum() for v in want.values()).backward()
    for name in ("a", "b"):
        g1, g2 = ours.weights[name].grad, reference.weights[name].grad
        if g2 is None:
            assert g1 is None or g1.coalesce().values().abs().sum() == 0
            continue
        torch.testing.assert_close(g1.to_dense(), g2.to_dense())


def test_keys_of_the_inverse_indices_may_come_in_another_order():
    kjt = _random_vbe(["fa", "fb", "fc"], [2, 3, 4], 5, seed=1)
    shuffled = VariableBatchKJT(kjt._keys, kjt._values, kjt._lengths, kjt._strides,
                                kjt._inverse[1][[2, 0, 1]], inverse_keys=["fc", "fa", "fb"])
    ours, reference = _pair()
    got, want = ours(shuffled), reference(_expanded(kjt))
    for key in got:
        torch.testing.assert_close(got[key], want[key])


@pytest.mark.parametrize("change, match", [
    (dict(inverse=None), r"variable_stride_per_key\(\) is True \(batch sizes per feature \[2, 3, 4\]\) but "
                         r"inverse_indices_or_none\(\) is None"),
    (dict(strides=[2, 3]), r"stride_per_key\(\) must give one batch size >= 0 per feature \(3\)"),
    (dict(strides=[2, 3, 5]), r"lengths\(\)/offsets\(\) give 9 bags but stride_per_key\(\) \[2, 3, 5\] sums to 10"),
    (dict(inverse=torch.full((3, 5), 3)), r"inverse_indices_or_none\(\) for feature 'fa' must lie in \[0, 2\)"),
    (dict(inverse=torch.zeros(3, 5)), r"inverse_indices_or_none\(\)\[1\] must be an int64 or int32 tensor"),
    (dict(inverse=torch.zeros(2, 5, dtype=torch.long)), r"names 3 features but its tensor has 2 rows"),
    (dict(inverse_keys=["fa", "fb", "fx"]), r"has no row for the features \['fc'\]"),
])
def test_a_bad_variable_batch_is_refused_naming_the_method_and_changes_nothing(change, match):
    base = _random_vbe(["fa", "fb", "fc"], [2, 3, 4], 5, seed=2)
    args = dict(keys=base._keys, values=base._values, lengths=base._lengths, strides=base._strides,
                inverse=base._inverse[1], inverse_keys=None)
    args.update(change)
    kjt = VariableBatchKJT(**args)
    model = sk.EmbeddingBagCollection([sk.TableConfig("a", 4, 40, ["fa"]), sk.TableConfig("b", 8, 40, ["fb", "fc"])])
    with pytest.raises((ValueError, TypeError), match=match):
        model(kjt)
    assert model.stats("a")["size"] == 0 and model.stats("b")["size"] == 0


def test_torchrec_variable_batch_matches_torchrec_collection():
    """TorchRec's own VBE KeyedJaggedTensor through TorchRec's EmbeddingBagCollection and
    through sparsekit's built from the same configs and state: the same KeyedTensor."""
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    configs = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=40, feature_names=["f0", "f2"]),
               EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"])]
    theirs = EmbeddingBagCollection(configs)
    ours = sk.EmbeddingBagCollection(configs)
    ours.load_torchrec_state_dict(theirs.state_dict())
    mine = _random_vbe(["f0", "f1", "f2"], [3, 1, 4], 6, seed=3)
    kjt = KeyedJaggedTensor(keys=mine._keys, values=mine._values, lengths=mine._lengths,
                            stride_per_key_per_rank=[[s] for s in mine._strides],
                            inverse_indices=(mine._keys, mine._inverse[1]))
    assert kjt.variable_stride_per_key()
    want, got = theirs(kjt), ours(kjt)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values())

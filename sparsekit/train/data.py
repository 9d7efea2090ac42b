"""Criteo-shaped batches and the synthetic data source of the training harness.

A *global batch* is what one optimizer step consumes over all ranks; rank ``r`` of
``W`` trains on rows ``[r*B/W, (r+1)*B/W)`` of it. Which samples form global batch
``step`` depends only on the seed and ``step``, never on the world size, so runs on 1,
2 or 4 processes see the same data in the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Tuple

import numpy as np
import torch

NUM_DENSE = 13
NUM_SLOTS = 26

# Independent numpy streams, keyed together with the seed.
_HIDDEN_STREAM, _TRAIN_STREAM, _EVAL_STREAM = 0, 1, 2


@dataclass
class Batch:
    """One rank's share of a global batch.

    Attributes:
        dense: float32 ``[B, 13]``, already ``log(1 + max(x, 0))``-transformed.
        keys: int64 ``[B, 26]``, one categorical key per slot.
        labels: float32 ``[B]``, 0 or 1.
    """

    dense: torch.Tensor
    keys: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.dense.to(device, non_blocking=True), self.keys.to(device, non_blocking=True),
                     self.labels.to(device, non_blocking=True))


def rank_slice(global_size: int, rank: int, world_size: int) -> slice:
    """Rows of a global batch that belong to ``rank``: contiguous, sizes differing by at most 1."""
    base, extra = divmod(global_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """DLRM's dense-feature transform ``log(1 + max(x, 0))`` as float32."""
    return np.log1p(np.maximum(raw, 0)).astype(np.float32)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 on uint64 arrays (wrapping arithmetic); no fixed point at 0."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def hurwitz_zeta(s: float, q: np.ndarray) -> np.ndarray:
    """``sum(n >= 0) (q + n)^-s`` for ``s > 1`` and each ``q > 0``, float64: 24 terms summed,
    the rest by Euler-Maclaurin to the ninth derivative (relative error ~1e-15)."""
    q = np.asarray(q, dtype=np.float64)
    head = 24
    total = np.zeros_like(q)
    for n in range(head):
        total += (q + n) ** -s
    x = q + head
    total += x ** (1.0 - s) / (s - 1.0) + 0.5 * x ** -s
    # - B_2k / (2k)! * f^(2k-1)(x) for f(n) = (q + n)^-s: rising products of s times powers.
    rising, term_power = s, -s - 1.0
    for k, bernoulli in enumerate((1.0 / 6.0, -1.0 / 30.0, 1.0 / 42.0, -1.0 / 30.0, 5.0 / 66.0), start=1):
        total += bernoulli / math.factorial(2 * k) * rising * x ** term_power
        rising *= (s + 2 * k - 1) * (s + 2 * k)
        term_power -= 2.0
    return total


class FoldedZipf:
    """Draws of ``(Z - 1) mod vocab`` for numpy's Zipf-distributed ``Z = rng.zipf(alpha)``
    (``P(Z = z) ~ z^-alpha`` for ``1 <= z <= 2^63 - 1``: numpy draws again above): the
    rank ``k`` in ``[0, vocab)`` has a probability proportional to
    ``sum(j >= 0, k + 1 + j vocab < 2^63) (k + 1 + j vocab)^-alpha``, a difference of two
    Hurwitz zeta values. Drawn by Walker's alias method from one uniform per draw, where
    numpy's rejection loop spends two or more and a power each. (numpy's own values above
    2^53 are doubles, all even: at an ``alpha`` near 1, where a good part of its draws lie
    there, its folded frequencies lean to even values; this law does not.)

    Args:
        alpha: the Zipf exponent, > 1.
        vocab: the ranks' count, >= 1.
    """

    def __init__(self, alpha: float, vocab: int):
        if not alpha > 1.0:
            raise ValueError(f"FoldedZipf: alpha must be > 1, got {alpha}")
        if vocab < 1:
            raise ValueError(f"FoldedZipf: vocab must be >= 1, got {vocab}")
        self.vocab = vocab
        first = np.arange(1, vocab + 1, dtype=np.float64) / vocab
        # Terms per rank up to 2^63 - 1, the largest value numpy's zipf returns.
        terms = np.array([((1 << 63) - 1 - k) // vocab + 1 for k in range(1, vocab + 1)], dtype=np.float64)
        weights = hurwitz_zeta(alpha, first) - hurwitz_zeta(alpha, first + terms)
        self.probabilities = weights / weights.sum()
        # Vose's construction: every column of height 1 holds its own rank up to ``keep``
        # and the rank ``alias`` above it.
        scaled = self.probabilities * vocab
        self.keep = np.ones(vocab)
        self.alias = np.arange(vocab, dtype=np.int64)
        small = [int(i) for i in np.flatnonzero(scaled < 1.0)]
        large = [int(i) for i in np.flatnonzero(scaled >= 1.0)]
        while small and large:
            low, high = small.pop(), large[-1]
            self.keep[low], self.alias[low] = scaled[low], high
            scaled[high] -= 1.0 - scaled[low]
            if scaled[high] < 1.0:
                small.append(large.pop())
        # What is left holds (up to rounding) exactly one column's mass: keeps its rank.

    def draw(self, rng: np.random.Generator, size: Tuple[int, ...]) -> np.ndarray:
        """int64 ranks of shape ``size``: a column from a uniform's integer part, its own
        rank or its alias from the fractional part."""
        scaled = rng.random(size) * self.vocab
        column = np.minimum(scaled.astype(np.int64), self.vocab - 1)
        return np.where(scaled - column < self.keep[column], column, self.alias[column])


class SyntheticCriteo:
    """Criteo-shaped samples drawn from a hidden logistic model, generated in memory.

    Each of the 26 slots holds one categorical value whose rank within the slot is Zipf
    distributed (``P(rank = k) ~ (k + 1)^-zipf_alpha``, folded into ``vocab_per_slot``
    values: :class:`FoldedZipf`, the law of numpy's ``(rng.zipf(zipf_alpha) - 1) %
    vocab_per_slot``); the value's key is a 64-bit mix of ``(seed, slot, rank)`` spread over the
    whole int64 range, as hashed ids are. Dense features are log-normal counts, 10 %
    missing (0), transformed like Criteo's. The label is Bernoulli(sigmoid(logit)) with

        logit = bias + sum_slot effect[slot, rank_slot] + w . (dense - 1.5)

    where ``effect`` and ``w`` are drawn once from the seed. A model that learns the
    per-key effects of the frequent keys reaches a held-out AUC well above 0.7;
    :meth:`oracle_auc` gives the ceiling (the AUC of the hidden probabilities).

    Args:
        seed: everything (hidden model, train and eval streams) is a function of it.
        vocab_per_slot: distinct values per slot.
        zipf_alpha: Zipf exponent of the value ranks (> 1).
    """

    def __init__(self, seed: int = 0, *, vocab_per_slot: int = 20_000, zipf_alpha: float = 1.2):
        if not zipf_alpha > 1.0:
            raise ValueError(f"SyntheticCriteo: zipf_alpha must be > 1, got {zipf_alpha}")
        if vocab_per_slot < 1:
            raise ValueError(f"SyntheticCriteo: vocab_per_slot must be >= 1, got {vocab_per_slot}")
        self.seed = seed
        self.vocab_per_slot = vocab_per_slot
        self.zipf_alpha = zipf_alpha
        rng = np.random.default_rng([seed, _HIDDEN_STREAM])
        # Slots differ in how informative they are, as Criteo's do.
        slot_scale = rng.uniform(0.05, 0.6, size=(NUM_SLOTS, 1))
        self._effects = (rng.standard_normal((NUM_SLOTS, vocab_per_slot)) * slot_scale).astype(np.float32)
        self._dense_weight = (rng.standard_normal(NUM_DENSE) * 0.4).astype(np.float32)
        self._dense_log_mean = rng.uniform(0.0, 3.0, size=NUM_DENSE)
        self._bias = np.float32(-1.5)
        seed_salt = np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
        self._slot_salt = _mix64(np.arange(NUM_SLOTS, dtype=np.uint64) ^ seed_salt).reshape(1, NUM_SLOTS)
        self._ranks = FoldedZipf(zipf_alpha, vocab_per_slot)
        # Where each slot's effects start in the flat table.
        self._effect_base = np.arange(NUM_SLOTS, dtype=np.int64) * vocab_per_slot

    def keys_of(self, ranks: np.ndarray) -> np.ndarray:
        """int64 keys ``[N, 26]`` of value ranks ``[N, 26]``."""
        return _mix64(ranks.astype(np.uint64) ^ self._slot_salt).view(np.int64)

    def raw(self, stream: int, index: int, size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Samples ``index`` of ``stream`` (one global batch) before any slicing.

        Returns:
            ``(raw_dense int64 [size, 13] with -1 for missing, ranks int64 [size, 26],
            labels float32 [size], probabilities float32 [size])``.
        """
        rng = np.random.default_rng([self.seed, stream, index])
        ranks = self._ranks.draw(rng, (size, NUM_SLOTS))
        raw_dense = np.floor(np.exp(rng.standard_normal((size, NUM_DENSE)) * 1.2
                                    + self._dense_log_mean)).astype(np.int64)
        raw_dense[rng.random((size, NUM_DENSE)) < 0.1] = -1
        logit = self._bias + self._effects.ravel()[ranks + self._effect_base].sum(axis=1)
        logit += (dense_transform(raw_dense) - 1.5) @ self._dense_weight
        probabilities = (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        labels = (rng.random(size) < probabilities).astype(np.float32)
        return raw_dense, ranks, labels, probabilities

    def _batch(self, stream: int, index: int, global_size: int, rank: int, world_size: int) -> Batch:
        raw_dense, ranks, labels, _ = self.raw(stream, index, global_size)
        rows = rank_slice(global_size, rank, world_size)
        return Batch(torch.from_numpy(dense_transform(raw_dense[rows])),
                     torch.from_numpy(self.keys_of(ranks[rows])),
                     torch.from_numpy(labels[rows].copy()))

    def train_batch(self, step: int, global_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        """This rank's slice of global training batch ``step``."""
        return self._batch(_TRAIN_STREAM, step, global_size, rank, world_size)

    def eval_batches(self, num_samples: int, global_size: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        """This rank's slices of the held-out set: ``num_samples`` samples from a stream
        disjoint from training, in global batches of ``global_size``."""
        for index, start in enumerate(range(0, num_samples, global_size)):
            yield self._batch(_EVAL_STREAM, index, min(global_size, num_samples - start), rank, world_size)

    def oracle_auc(self, num_samples: int, global_size: int) -> float:
        """Held-out AUC of the hidden model's own probabilities: the best any model can do."""
        from .metrics import roc_auc

        scores, labels = [], []
        for index, start in enumerate(range(0, num_samples, global_size)):
            _, _, batch_labels, probabilities = self.raw(_EVAL_STREAM, index,
                                                         min(global_size, num_samples - start))
            scores.append(torch.from_numpy(probabilities))
            labels.append(torch.from_numpy(batch_labels))
        return roc_auc(torch.cat(scores), torch.cat(labels))

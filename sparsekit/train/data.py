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


_INT64_MAX = float(np.iinfo(np.int64).max)


def zipf_draws(rng: np.random.Generator, alpha: float, size: Tuple[int, ...]) -> np.ndarray:
    """``rng.zipf(alpha, size)``, the same values and the same generator state after, drawn
    vectorised: about twice as fast as numpy's one-at-a-time rejection loop.

    numpy draws each value by Devroye's rejection method, a pair of uniforms per try, until
    a try is accepted. The values are therefore the accepted tries in order: this draws the
    pairs in bulk, keeps the first ``n`` accepted, and leaves ``rng`` exactly as far on as
    numpy's loop would (the pairs after the last accepted one are given back). numpy's loop
    takes its powers from the C library's ``pow``; the few whose last bits matter are taken
    from it here too (``math.pow``), the rest from numpy's vectorised ``power``.
    """
    n = int(np.prod(size))
    if not 1.0 < alpha < 1025.0:  # numpy's own fast paths and errors
        return rng.zipf(alpha, size=size)
    am1 = alpha - 1.0
    b = 2.0 ** am1
    u_min = _INT64_MAX ** -am1
    out = np.empty(n, dtype=np.int64)
    bit_generator = rng.bit_generator
    start = bit_generator.state
    filled = consumed = 0
    while filled < n:
        need = n - filled
        tries = need + need // 2 + 64  # about 72 % of tries are accepted at alpha 1.2
        pairs = rng.random(2 * tries).reshape(tries, 2)
        u, v = pairs[:, 0] * u_min + (1.0 - pairs[:, 0]), pairs[:, 1]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            power = np.power(u, -1.0 / am1)
            x = np.floor(power)
            # numpy's loop calls the C library's pow, its vectorised power may differ in the
            # last bits (numpy >= 2.4): where those bits could move floor() (a power near an
            # integer, or above 2^52 where every bit is in the value), pow decides.
            near = np.flatnonzero(np.minimum(power - x, x + 1.0 - power) <= power * 1e-13)
            x[near] = [math.floor(math.pow(float(value), -1.0 / am1)) for value in u[near]]
            t = np.power(1.0 + 1.0 / x, am1)
            lhs, rhs = v * x * (t - 1.0) / (b - 1.0), t / b
            accepted = (x <= _INT64_MAX) & (x >= 1.0) & (lhs <= rhs)
            close = np.flatnonzero((np.abs(lhs - rhs) <= np.abs(rhs) * 1e-13) & (x <= _INT64_MAX) & (x >= 1.0))
        for i in close:  # a test that the last bits of t could turn: with pow's t, as numpy does
            xi = float(x[i])
            ti = math.pow(1.0 + 1.0 / xi, am1)
            accepted[i] = float(v[i]) * xi * (ti - 1.0) / (b - 1.0) <= ti / b
        taken = np.flatnonzero(accepted)[:need]
        out[filled:filled + taken.size] = x[taken]
        filled += taken.size
        consumed += 2 * (int(taken[-1]) + 1) if filled == n else 2 * tries
    bit_generator.state = start
    bit_generator.advance(consumed)
    return out.reshape(size)


class SyntheticCriteo:
    """Criteo-shaped samples drawn from a hidden logistic model, generated in memory.

    Each of the 26 slots holds one categorical value whose rank within the slot is Zipf
    distributed (``P(rank = k) ~ (k + 1)^-zipf_alpha``, folded into ``vocab_per_slot``
    values); the value's key is a 64-bit mix of ``(seed, slot, rank)`` spread over the
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
        if zipf_alpha <= 1.0:
            raise ValueError(f"SyntheticCriteo: zipf_alpha must be > 1, got {zipf_alpha}")
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
        ranks = (zipf_draws(rng, self.zipf_alpha, (size, NUM_SLOTS)) - 1) % self.vocab_per_slot
        raw_dense = np.floor(np.exp(rng.standard_normal((size, NUM_DENSE)) * 1.2
                                    + self._dense_log_mean)).astype(np.int64)
        raw_dense[rng.random((size, NUM_DENSE)) < 0.1] = -1
        logit = self._bias + self._effects[np.arange(NUM_SLOTS), ranks].sum(axis=1)
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

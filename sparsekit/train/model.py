"""The harness's DLRM-style CTR model and its two interchangeable embedding back ends."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .data import NUM_DENSE, NUM_SLOTS


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by a constant."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _native_pair_dots(vectors: Tensor) -> bool:
    """Whether sparsekit's CPU kernels compute the pair dots of ``vectors``."""
    return vectors.device.type == "cpu" and vectors.dtype in (torch.float32, torch.float64)


class _PairDots(torch.autograd.Function):
    """The dot products of the vector pairs ``i < j`` of each sample: ``[B, n, d]`` ->
    ``[B, n (n - 1) / 2]``, pairs in ``triu_indices`` order.

    On the CPU (float32, float64) sparsekit's kernels (``sparsekit::_pair_dots`` and its
    backward): a sample per vector lane, the upper triangle only, 5x torch's batched product
    for the harness's 1024 x 27 x 16 (3x for the backward). Elsewhere, and for a backward
    that is itself differentiated (``create_graph=True``), torch's ops. Forward: one batched
    product ``V V^T`` and a gather of its upper triangle along each flattened ``[n * n]``
    row. Backward: the pairs' gradient scattered into both triangles of one ``[n, n]``
    matrix ``S`` per sample, and ``dV = S V``: one batched product, where autograd through
    ``bmm(V, V^T)`` takes two (``dZ V`` and ``dZ^T V``) after a scatter-add into zeros.
    """

    @staticmethod
    def forward(ctx, vectors: Tensor, upper: Tensor, lower: Tensor) -> Tensor:
        ctx.save_for_backward(vectors, upper, lower)
        if _native_pair_dots(vectors):
            return torch.ops.sparsekit._pair_dots(vectors)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.gather(products.flatten(1), 1, upper.expand(products.shape[0], -1))

    @staticmethod
    def backward(ctx, grad: Tensor):
        vectors, upper, lower = ctx.saved_tensors
        if _native_pair_dots(vectors) and grad.dtype == vectors.dtype and not torch.is_grad_enabled():
            return torch.ops.sparsekit._pair_dots_backward(grad, vectors), None, None
        batch, n = vectors.shape[0], vectors.shape[1]
        symmetric = grad.new_zeros(batch, n * n)
        symmetric.scatter_(1, upper.expand(batch, -1), grad)
        symmetric.scatter_(1, lower.expand(batch, -1), grad)
        return torch.bmm(symmetric.view(batch, n, n), vectors), None, None


class SparsekitSlotEmbedding(nn.Module):
    """One key per slot through ``sk.DistributedEmbedding`` (combiner "sum", hash table,
    key-seeded initialisation), model-parallel under ``torch.distributed``.

    Each rank's loss is the mean over its own share of the global batch. DDP averages
    the dense gradients over ranks, but the embedding's backward exchange *sums* the
    contributions of all ranks at each key's owner; scaling the embedding gradient by
    ``1 / world_size`` makes both gradients those of the global mean loss, so a run on
    any world size follows the one-process run.

    Args:
        capacity_per_rank: rows of the local shard (``max_vocabulary_size_per_gpu``).
        dim: embedding width.
        device: where the shard lives.
        world_size: processes of the default group (1 without one).
        seed: seed of the key-seeded initializer (a key's first vector depends on it and
            on the key alone).
        eviction: None, "lru" or "lfu" (the table's policy when it is full).
        admit_after: training steps a key must be seen in before it gets a row.
    """

    def __init__(self, capacity_per_rank: int, dim: int, device: torch.device, world_size: int = 1,
                 seed: int = 0, eviction: Optional[str] = None, admit_after: int = 1):
        super().__init__()
        import sparsekit as sk

        self._ragged = sk.Ragged
        self.embedding = sk.DistributedEmbedding(
            "sum", capacity_per_rank, dim, NUM_SLOTS, 1, use_hashtable=True,
            embedding_initializer=sk.KeySeededUniform(seed), device=device, eviction=eviction,
            admit_after=admit_after)
        self.grad_scale = 1.0 / world_size

    def forward(self, keys: Tensor) -> Tensor:
        """int64 keys ``[B, 26]`` -> ``[B, 26, dim]``."""
        batch = keys.shape[0]
        # One key per bag as CSR: no pad key, so every int64 (-1 included) is a real key.
        offsets = torch.arange(batch * NUM_SLOTS + 1, dtype=torch.int64, device=keys.device)
        vectors = self.embedding(self._ragged(keys.reshape(-1), offsets))
        if self.grad_scale != 1.0 and torch.is_grad_enabled():
            vectors = _ScaleGrad.apply(vectors, self.grad_scale)
        return vectors


class SparsekitTableEmbedding(nn.Module):
    """One table per slot (26 tables) through ``sk.EmbeddingBagCollection``: one fused
    exchange per step for all of them, tables of any ``dtype`` (the vectors reach the
    model as float32). The gradient is scaled as in :class:`SparsekitSlotEmbedding`.

    Args:
        capacity_per_table: hash-table rows of each table on each rank.
        dim, device, world_size, seed, eviction, admit_after: as for
            :class:`SparsekitSlotEmbedding` (each table gets the policy).
        dtype: the tables' dtype (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, capacity_per_table: int, dim: int, device: torch.device, world_size: int = 1,
                 seed: int = 0, eviction: Optional[str] = None, admit_after: int = 1,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        import sparsekit as sk

        self._keyed_jagged = sk.KeyedJagged
        self.features = [f"slot{i}" for i in range(NUM_SLOTS)]
        self.embedding = sk.EmbeddingBagCollection(
            [sk.TableConfig(feature, dim, capacity_per_table, [feature], dtype=dtype, eviction=eviction,
                            admit_after=admit_after, initializer=sk.KeySeededUniform(seed))
             for feature in self.features], device=device)
        self.grad_scale = 1.0 / world_size

    def forward(self, keys: Tensor) -> Tensor:
        """int64 keys ``[B, 26]`` -> float32 ``[B, 26, dim]``."""
        batch = keys.shape[0]
        # Feature-major, one key per bag.
        lengths = torch.ones(batch * NUM_SLOTS, dtype=torch.int64, device=keys.device)
        pooled = self.embedding(self._keyed_jagged(self.features, keys.t().reshape(-1), lengths=lengths))
        vectors = torch.stack([pooled[feature] for feature in self.features], dim=1).float()
        if self.grad_scale != 1.0 and torch.is_grad_enabled():
            vectors = _ScaleGrad.apply(vectors, self.grad_scale)
        return vectors

    def stats(self) -> dict:
        """The tables' stats, summed (a collective per table under a process group)."""
        total: dict = {}
        for feature in self.features:
            for key, value in self.embedding.stats(feature).items():
                total[key] = total.get(key, 0) + value
        return total


class TorchSlotEmbedding(nn.Module):
    """The same layer on stock PyTorch: one ``nn.EmbeddingBag(sparse=True)`` table of
    ``num_rows`` rows shared by all slots, key ``k`` stored in row ``k mod num_rows``
    (floor modulo, so negative keys land in range too). The keys are already 64-bit
    hashes, salted per slot, so the modulo spreads them evenly; distinct keys that
    share a row collide, which the hash-table path never does. Data-parallel (one full
    replica per rank) under DDP.

    Args:
        num_rows: table rows.
        dim: embedding width.
        device: where the table lives.
    """

    def __init__(self, num_rows: int, dim: int, device: torch.device):
        super().__init__()
        self.num_rows = num_rows
        self.bag = nn.EmbeddingBag(num_rows, dim, mode="sum", sparse=True, device=device)
        # sparsekit's default initialiser's range, so both back ends start alike.
        nn.init.uniform_(self.bag.weight, -0.05, 0.05)

    def forward(self, keys: Tensor) -> Tensor:
        """int64 keys ``[B, 26]`` -> ``[B, 26, dim]``."""
        rows = torch.remainder(keys, self.num_rows).reshape(-1, 1)
        # (Not view(B, 26, -1): a rank's last evaluation batch may hold no sample.)
        return self.bag(rows).view(keys.shape[0], keys.shape[1], self.bag.embedding_dim)


def _mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    layers: List[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_activation or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM-style CTR model: bottom MLP over the dense features, one embedding per slot,
    pairwise dot products of all 27 vectors, top MLP to one logit.

    Args:
        embedding: maps int64 keys ``[B, 26]`` to ``[B, 26, dim]``.
        dim: embedding width (the bottom MLP's output width too).
        bottom: hidden sizes of the bottom MLP.
        top: hidden sizes of the top MLP.
        device: where the dense layers live (the embedding is built on its own device).
    """

    def __init__(self, embedding: nn.Module, dim: int, bottom: Tuple[int, ...] = (64, 32),
                 top: Tuple[int, ...] = (128, 64), device: torch.device = None):
        super().__init__()
        self.embedding = embedding
        self.bottom = _mlp((NUM_DENSE, *bottom, dim), last_activation=True).to(device)
        num_vectors = NUM_SLOTS + 1
        pairs = torch.triu_indices(num_vectors, num_vectors, offset=1, device=device)
        # Each pair's position in a flattened [27 * 27] products row, and its mirror's
        # (_PairDots). A gather along that row costs a quarter of products[:, rows, cols],
        # whose backward is an accumulating index_put with a sort; the values are the same.
        self.register_buffer("pair_index", (pairs[0] * num_vectors + pairs[1]).unsqueeze(0), persistent=False)
        self.register_buffer("mirror_index", (pairs[1] * num_vectors + pairs[0]).unsqueeze(0), persistent=False)
        self.top = _mlp((dim + pairs.shape[1], *top, 1), last_activation=False).to(device)

    def forward(self, dense: Tensor, keys: Tensor) -> Tensor:
        """float32 dense ``[B, 13]`` and int64 keys ``[B, 26]`` -> logits ``[B]``."""
        bottom = self.bottom(dense)
        vectors = torch.cat([bottom.unsqueeze(1), self.embedding(keys)], dim=1)
        interactions = _PairDots.apply(vectors, self.pair_index, self.mirror_index)
        return self.top(torch.cat([bottom, interactions], dim=1)).squeeze(1)

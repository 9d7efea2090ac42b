"""Evaluation metrics of the harness: ROC AUC and log loss, and their global versions."""

from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted one half).

    Args:
        scores: ``[N]`` float predictions (any monotone scale: probabilities or logits).
        labels: ``[N]`` 0/1 labels.

    Returns:
        The AUC, or ``nan`` when only one class is present or a score is NaN (a diverged
        model: NaN sorts above every number, so its scores would rank as the best).
    """
    scores = scores.detach().reshape(-1).double().cpu()
    positive = labels.detach().reshape(-1).cpu() > 0.5
    num_positive = int(positive.sum())
    num_negative = positive.numel() - num_positive
    if num_positive == 0 or num_negative == 0 or bool(scores.isnan().any()):
        return math.nan
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    # Tied scores share the mean of the 1-based ranks they span.
    mean_rank = (ends - counts.double() + 1 + ends) / 2
    positive_rank_sum = mean_rank[inverse][positive[order]].sum().item()
    return (positive_rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative)


def log_loss(probabilities: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``[N]`` against 0/1 labels ``[N]``."""
    p = probabilities.detach().reshape(-1).double().cpu().clamp(eps, 1 - eps)
    y = labels.detach().reshape(-1).double().cpu()
    if p.numel() == 0:
        return math.nan
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def all_gather_1d(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor of any length from every rank, in rank order.

    Without an initialised process group this returns ``values`` unchanged. The result
    is on ``values.device`` (the device the backend communicates on).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    world_size = dist.get_world_size()
    length = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    lengths: List[torch.Tensor] = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    sizes = [int(size) for size in lengths]
    # all_gather needs equal shapes: pad to the longest, then cut each part back.
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])

"""Agreement across ranks for collective calls (checkpoint saves and loads, and callers).

A collective call must end alike on every rank: a rank that raised alone would leave the
others waiting in their next collective. :func:`agree_or_raise` is the one protocol:
each step's outcome is all-reduced, and every rank raises when any rank failed (its own
error, or :class:`OtherRankError` naming the step). :func:`ranks_differing` compares a
text across ranks with one all-gather of digests. Without a process group every function
is a local no-op (one rank agrees with itself).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..exchange import _all_gather_digests

__all__ = ["OtherRankError", "agree_or_raise", "all_ok", "check_optimizer_everywhere", "collective_device",
           "ranks_differing", "world"]


def world() -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """The default process group (None without one), the world size and this rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def collective_device(group) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ok(group, ok: bool) -> bool:
    """True when ``ok`` on every rank (an all-reduce MIN); a no-op without a group."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def ranks_differing(group, text: str) -> List[int]:
    """The ranks whose ``text`` differs from rank 0's (one all-gather of 16-byte digests);
    [] on every rank when all agree, or without a group."""
    if group is None:
        return []
    digests = _all_gather_digests(text.encode(), collective_device(group), group, dist.get_world_size(group))
    return [rank for rank, digest in enumerate(digests) if digest != digests[0]]


class OtherRankError(RuntimeError):
    """A collective save or load failed on another rank; that rank's own error names the cause."""


def agree_or_raise(group, error: Optional[BaseException], what: str) -> None:
    """Every rank raises when any rank failed: its own error, or one naming the step."""
    if all_ok(group, error is None):
        return
    if error is not None:
        raise error
    raise OtherRankError(f"{what} failed on another rank (see the error there); nothing was changed on this rank")


def check_optimizer_everywhere(group, caller: str, optimizer: Any) -> None:
    """Every rank raises unless an optimizer was passed on every rank or on none (a rank
    without one would save or load no optimizer state for its rows while the others do)."""
    differing = ranks_differing(group, "optimizer" if optimizer is not None else "none")
    if differing:
        # Rank 0 passed one exactly when this rank did and agrees with it.
        rank_zero_has = (optimizer is not None) != (dist.get_rank(group) in differing)
        raise ValueError(f"{caller}: the ranks disagree on the optimizer: rank 0 passed "
                         f"{'one' if rank_zero_has else 'None'}, rank(s) {differing} "
                         f"{'None' if rank_zero_has else 'one'}; pass the optimizer on every rank or on none; "
                         "nothing was changed")

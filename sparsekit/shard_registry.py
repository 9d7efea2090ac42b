"""Which tensors are embedding shards, and the table each belongs to: the one way LazyAdam,
the checks and the DDP helpers learn of a table from its weight, with nothing stored on the
Parameter. Weights are held weakly by identity and their owners by weak reference, so a
layer that goes away leaves nothing behind.

The owner's side of the interface is its ``fresh_rows`` (None, or the bool ``[rows]``
flags of rows given to new keys since the optimizer last updated them).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["register", "is_shard", "fresh_rows"]

_OWNERS = WeakIdKeyDictionary()


def register(weight: Tensor, owner: Any = None) -> None:
    """Marks ``weight`` as an embedding shard of ``owner`` (None: a shard with no table state)."""
    _OWNERS[weight] = _no_owner if owner is None else weakref.ref(owner)


def _no_owner() -> None:
    return None


def _owner_ref(tensor: Tensor) -> Optional[Callable[[], Any]]:
    return _OWNERS.get(tensor) if isinstance(tensor, Tensor) else None


def is_shard(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a registered embedding shard whose owner (if any) is alive."""
    ref = _owner_ref(tensor)
    return ref is not None and (ref is _no_owner or ref() is not None)


def fresh_rows(tensor: Tensor) -> Optional[Tensor]:
    """The owner's flags of rows given to new keys, or None (no owner, no eviction)."""
    ref = _owner_ref(tensor)
    owner = None if ref is None else ref()
    return None if owner is None else owner.fresh_rows

"""TorchRec's variable batch per feature (a VBE ``KeyedJaggedTensor``) as one batch.

Such an input holds ``stride_per_key()[f]`` bags for feature ``f``, and its
``inverse_indices_or_none()`` says, for every sample of the full batch, which of the
feature's bags it uses. TorchRec's ``EmbeddingBagCollection`` pools each feature's own bags
and then selects rows by those indices; pooling the selected bags gives the same output
and, as the selection's backward sums the rows' gradients, the same gradients. So the input
is expanded here to ``B = inverse_indices.shape[1]`` bags per feature and the collection
reads it as any other batch.
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

_OWNER = "EmbeddingBagCollection: the input's "


def _inverse_indices(kjt: Any, keys: Sequence[str], strides: List[int]) -> Tensor:
    """The ``[len(keys), B]`` int64 rows of ``inverse_indices_or_none()`` in the order of
    ``keys``, each checked to lie in ``[0, stride of its feature)``."""
    got = kjt.inverse_indices_or_none() if callable(getattr(kjt, "inverse_indices_or_none", None)) else None
    if got is None:
        raise ValueError(f"{_OWNER}variable_stride_per_key() is True (batch sizes per feature {strides}) but "
                         "inverse_indices_or_none() is None: a variable batch per feature needs the "
                         "inverse indices that map each sample of the batch to its bag (TorchRec's VBE input)")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise TypeError(f"{_OWNER}inverse_indices_or_none() must return (keys, tensor [features, B]), got "
                        f"{type(got).__name__}")
    names, indices = got
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int64, torch.int32) or indices.dim() != 2:
        raise TypeError(f"{_OWNER}inverse_indices_or_none()[1] must be an int64 or int32 tensor [features, B], "
                        f"got {type(indices).__name__ if not isinstance(indices, Tensor) else (indices.dtype, tuple(indices.shape))}")
    names = list(names)
    if indices.shape[0] != len(names):
        raise ValueError(f"{_OWNER}inverse_indices_or_none() names {len(names)} features but its tensor has "
                         f"{indices.shape[0]} rows")
    position = {name: i for i, name in enumerate(names)}
    missing = [key for key in keys if key not in position]
    if missing:
        raise ValueError(f"{_OWNER}inverse_indices_or_none() has no row for the features {missing}")
    rows = indices[torch.tensor([position[key] for key in keys], dtype=torch.long, device=indices.device)].long()
    if rows.numel():
        low = rows.amin(dim=1).tolist()
        high = rows.amax(dim=1).tolist()
        for key, stride, lo, hi in zip(keys, strides, low, high):
            if lo < 0 or hi >= stride:
                raise ValueError(f"{_OWNER}inverse_indices_or_none() for feature {key!r} must lie in "
                                 f"[0, {stride}) (its batch size), got [{lo}, {hi}]")
    return rows


def expand(kjt: Any, keys: Sequence[str], lengths: Optional[Tensor], offsets: Optional[Tensor],
           values: Tensor, weights: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(values, offsets, weights)`` of the same input with ``B`` bags per feature, bag
    ``b`` of feature ``f`` being the feature's bag ``inverse_indices[f][b]``.

    Raises:
        ValueError, TypeError: strides that do not match the lengths, missing or
            out-of-range inverse indices, each naming the input's method.
    """
    if not all(isinstance(key, str) for key in keys):
        raise TypeError(f"{_OWNER}keys() must be a list of feature names (str), got {list(keys)!r}")
    if not callable(getattr(kjt, "stride_per_key", None)):
        raise TypeError(f"{_OWNER}variable_stride_per_key() is True but it has no stride_per_key()")
    strides = [int(s) for s in kjt.stride_per_key()]
    if len(strides) != len(keys) or any(s < 0 for s in strides):
        raise ValueError(f"{_OWNER}stride_per_key() must give one batch size >= 0 per feature ({len(keys)}), "
                         f"got {strides}")
    for name, tensor in (("values()", values), ("lengths()", lengths), ("offsets()", offsets)):
        if tensor is not None and (not isinstance(tensor, Tensor) or tensor.dtype not in (torch.int64, torch.int32)
                                   or tensor.dim() != 1):
            raise TypeError(f"{_OWNER}{name} must be a 1-D int64 or int32 tensor")
    if weights is not None and (not isinstance(weights, Tensor) or weights.shape != values.shape):
        raise ValueError(f"{_OWNER}weights_or_none() must be a tensor shaped as values() [{values.numel()}]")
    if offsets is None:
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths.long(), 0, out=offsets[1:])
    offsets = offsets.long()
    if offsets.numel() != sum(strides) + 1:
        raise ValueError(f"{_OWNER}lengths()/offsets() give {offsets.numel() - 1} bags but stride_per_key() "
                         f"{strides} sums to {sum(strides)}")
    ends_right = offsets.numel() > 0 and int(offsets[0]) == 0 and int(offsets[-1]) == values.numel()
    if not ends_right or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{_OWNER}lengths()/offsets() must be lengths >= 0 summing to values().numel() "
                         f"({values.numel()})")
    rows = _inverse_indices(kjt, keys, strides)
    device = offsets.device
    rows = rows.to(device)
    first_bag = torch.tensor([0] + strides[:-1], dtype=torch.long, device=device).cumsum(0)
    bags = (rows + first_bag.unsqueeze(1)).reshape(-1)  # [F * B], feature-major
    starts = offsets[bags]
    sizes = offsets[bags + 1] - starts
    new_offsets = torch.zeros(bags.numel() + 1, dtype=torch.long, device=device)
    torch.cumsum(sizes, 0, out=new_offsets[1:])
    # Value j of new bag i is the old value starts[i] + (j - new_offsets[i]).
    shift = (starts - new_offsets[:-1]).repeat_interleave(sizes)
    index = torch.arange(shift.numel(), dtype=torch.long, device=device) + shift
    return values[index], new_offsets, (weights[index] if weights is not None else None)

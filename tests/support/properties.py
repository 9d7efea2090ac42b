"""Shared hypothesis strategies for the property-based tests: sizes that cross the
kernels' thresholds, key distributions that stress hashing, and thread counts.

The thresholds (keep in step with the kernels):
- unique CPU: chunks of >= 2^16 keys per thread, distinct-count sketch from 2^14 keys,
  sampled blocks of 64 keys every 16th block, parallel grain 2^14, table growth when the
  sketch underestimates; CUDA: per-tile count table, 2^30 positions.
- segment_sum CPU: segment ranges cut at sampled quantiles, column blocks when segments
  are fewer than threads; CUDA: 2048-row tree levels in deterministic mode.
- hash table: slots a power of two >= 2 * capacity, at least 16.
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import settings
from hypothesis import strategies as st

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# Sizes from 0 to ~10^6, weighted towards the edges of every threshold above.
_EDGES = [0, 1, 2, 15, 16, 17, 63, 64, 65, 1023, 1024, 2047, 2048, 2049, 4096,
          (1 << 14) - 1, 1 << 14, (1 << 14) + 1, (1 << 16) - 1, 1 << 16, (1 << 16) + 1,
          (1 << 17) + 3, 3 << 16, (1 << 18) + 7, 1 << 19, 1_000_000]


def examples(k: int) -> settings:
    """A test's example budget: k under the CI profile, scaled with the active profile."""
    scale = max(1, settings.default.max_examples // 10)
    return settings(max_examples=k * scale)


def sizes(max_size: int = 1_000_000) -> st.SearchStrategy[int]:
    """A length in [0, max_size]: a threshold edge, near one, or anything."""
    edges = [e for e in _EDGES if e <= max_size]
    return st.one_of(
        st.sampled_from(edges),
        st.builds(lambda e, d: max(0, min(max_size, e + d)), st.sampled_from(edges), st.integers(-3, 3)),
        st.integers(0, max_size),
    )


thread_counts = st.integers(1, 4)

KEY_DISTRIBUTIONS = ["all_equal", "all_distinct", "zipf", "clustered", "extremes", "small_range",
                     "mixed_wide", "sorted"]


def make_keys(n: int, distribution: str, seed: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[n]`` keys of ``dtype`` drawn from a named distribution (a pure function of its args)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (INT64_MIN, INT64_MAX) if dtype == torch.int64 else (INT32_MIN, INT32_MAX)
    if distribution == "all_equal":
        value = int(torch.randint(-5, 5, (1,), generator=g))
        keys = torch.full((n,), value, dtype=torch.int64)
    elif distribution == "all_distinct":
        keys = torch.randperm(n, generator=g) * 7919 - n
    elif distribution == "zipf":
        # Ranks ~ Zipf(1.2) over a large vocabulary, mapped to scattered keys.
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
        ranks = torch.floor(u.pow(-1 / 0.2)).clamp_max(1 << 40).to(torch.int64)
        keys = ranks * -7046029254386353131 if dtype == torch.int64 else ranks * 40503
    elif distribution == "clustered":
        centers = torch.randint(-(1 << 20), 1 << 20, (max(1, n // 1000 + 1),), generator=g)
        keys = centers[torch.randint(0, centers.numel(), (n,), generator=g)] + torch.randint(0, 8, (n,), generator=g)
    elif distribution == "extremes":
        pool = torch.tensor([lo, hi, -1, 0, 1, lo + 1, hi - 1, -2], dtype=torch.int64)
        keys = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    elif distribution == "small_range":
        keys = torch.randint(-500, 500, (n,), generator=g)
    elif distribution == "mixed_wide":
        # The shape of input that exposed the table-growth bug: a small hot range plus a
        # fifth as many draws from the whole key range, shuffled.
        wide = n // 5
        keys = torch.cat([torch.randint(-500, 500, (n - wide,), generator=g),
                          torch.randint(lo, hi, (wide,), generator=g)])
        keys = keys[torch.randperm(n, generator=g)]
    elif distribution == "sorted":
        keys = torch.sort(torch.randint(-(1 << 30), 1 << 30, (n,), generator=g)).values
    else:
        raise ValueError(distribution)
    if dtype == torch.int32:
        keys = keys.clamp(lo, hi) if distribution != "zipf" else keys
        keys = keys.to(torch.int32)
    return keys.to(dtype)


BOUNDED_KINDS = ["uniform", "hot", "missing", "edges", "sorted"]


def bounded_keys(n: int, bound: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """``n`` int64 row numbers in ``[-1, bound)`` (``-1``: a missing row) for the bounded
    unique: uniform, ``hot`` (70% on one row), ``missing`` (half -1), ``edges`` (only -1, 0,
    the last row and both sides of 64-bit word boundaries) or ``sorted``."""
    keys = torch.randint(-1, bound, (n,), generator=generator) if bound > 0 else torch.full((n,), -1)
    if kind == "hot" and bound > 1:
        keys[torch.rand(n, generator=generator) < 0.7] = bound // 2
    elif kind == "missing":
        keys[torch.rand(n, generator=generator) < 0.5] = -1
    elif kind == "edges":
        values = (-1, 0, 62, 63, 64, 127, 128, bound - 1, bound - 64)
        edges = torch.tensor(sorted({v for v in values if -1 <= v < bound}))
        keys = edges[torch.randint(0, edges.numel(), (n,), generator=generator)]
    elif kind == "sorted":
        keys = keys.sort().values
    return keys


@contextlib.contextmanager
def num_threads(n: int):
    """Runs the block with ``torch.set_num_threads(n)``, restoring the old count after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)

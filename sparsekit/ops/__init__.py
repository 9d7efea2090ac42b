# ruff: noqa: F401  (the package re-exports every name of its modules, private ones included)
"""Typed wrappers, fake (meta) kernels and autograd for ``torch.ops.sparsekit.*``.

Every op has a CPU and a CUDA kernel compiled into ``sparsekit._C`` (a few internal ones
are composites of others: ``sparsekit.tables_cuda`` on CUDA, ``_embedding_gather_float``
here); the fakes let ``torch.compile`` trace them, with data-dependent output sizes taken
from ``torch.library.get_ctx().new_dynamic_size()``. One private module per op family, as
``csrc/`` has one source per family; everything is used through this package
(``sparsekit.ops.X``), and importing it registers every fake, autograd formula and
dispatch kernel. See ``docs/api.md`` for the contract of each op.
"""

# First: registers its kernels for the ops sparsekit._C defines, before any op is added here.
from ._dispatch import _QUANTIZED_KEYS, _SPARSE_KEYS, _marking_writes, _refusing_sparse, _sparse_library

from ._common import _check_not_inference, _choice, _flag, _integer, _ops, _real, _refuse_forward_ad
from ._unique import _unique_fake, _unique_tables_fake, unique
from ._unique_bounded import _BOUNDED_UNIQUE_BITS_PER_KEY, _bitmap_numbers, _unique_bounded_fake
from ._segment import (
    _deterministic,
    _following_deterministic_algorithms,
    _segment_counts,
    _segment_rows_gradient,
    _segment_sum_backward,
    _segment_sum_fake,
    _segment_sum_parts_backward,
    _segment_sum_parts_fake,
    _segment_sum_parts_setup_context,
    _segment_sum_setup_context,
    segment_mean,
    segment_reduce,
    segment_sum,
)
from ._hashtable import (
    _hash_table_erase_fake,
    _hash_table_find_fake,
    _hash_table_find_tables_fake,
    _hash_table_insert_absent_fake,
    _hash_table_place_tables_fake,
    _hash_table_score_tables_fake,
    _hash_table_touch_tables_fake,
    _lookup_rows_fake,
    hash_table_erase_,
    hash_table_find,
    hash_table_insert_absent_,
)
from ._select import _select_smallest_fake, select_smallest
from ._lazy_adam import _check_in_place_update, _check_lazy_adam_args, _lazy_adam_fake, _lazy_adam_tables_fake
from ._lazy_adam import lazy_adam_
from ._routing import _partition_by_owner_fake, partition_by_owner
from ._initializer import _check_bound_fits_float64, _key_seeded_uniform_fake, key_seeded_uniform
from ._bags import _bag_index, _csr_offsets, _padding_row, _repeat_interleave
from ._embedding import (
    _check_embedding_bag_shapes,
    _embedding_bag_argmax_fake,
    _embedding_bag_fake,
    _embedding_gather_fake,
    embedding_bag,
    embedding_gather,
)
from ._sparse_gradient import (
    _SIZES_ALLOWED,
    _SIZES_IN_DEFAULT_MODE,
    _allow_dynamic_sizes,
    _first_lookup_of,
    _number_rows,
    _number_rows_of,
    _sparse_row_gradient,
    _traced_fake_mode,
)
from ._double_backward import _LookupGradient, _LookupSpec, _lookup_gradients, _reference_pool, _rows_of
from ._embedding_backward import (
    _embedding_bag_backward,
    _embedding_bag_backward_of,
    _embedding_bag_setup_context,
    _embedding_gather_backward,
    _embedding_gather_backward_of,
    _embedding_gather_setup_context,
    _lookup_dots,
    _max_gradient,
)
from ._embedding_float import (
    _embedding_gather_float,
    _embedding_gather_float_backward,
    _embedding_gather_float_fake,
    _embedding_gather_float_setup_context,
    _pooled_float,
)
from ._interaction import _pair_dots_backward_fake, _pair_dots_fake

__all__ = [
    "unique",
    "segment_sum",
    "segment_mean",
    "segment_reduce",
    "hash_table_find",
    "hash_table_insert_absent_",
    "hash_table_erase_",
    "select_smallest",
    "lazy_adam_",
    "partition_by_owner",
    "key_seeded_uniform",
    "embedding_bag",
    "embedding_gather",
]

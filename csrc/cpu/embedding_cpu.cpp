// CPU kernels of embedding_bag (pooled lookup over CSR bags) and embedding_gather
// (unpooled lookup); the pooling loops themselves are in pool_loops.h.
// 32-byte vector arguments of the pooling loops' always_inline helpers never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"
#include "cpu/pool_loops.h"

namespace sparsekit {
namespace {

/// True when embedding_bag writes `out` ([bags, dim] of float32 or float64) with streaming
/// stores: every row starts on a 64-byte boundary, so every vector store is aligned, and
/// out is larger than kStreamOutputBytes, a size that the caches would not keep anyway
/// while the call streams far more table rows through them.
bool stream_output(const Tensor& out, int64_t dim) {
  const ScalarType type = out.scalar_type();
  const int64_t row_bytes = dim * static_cast<int64_t>(out.element_size());
  return (type == kFloat || type == kDouble) && row_bytes % 64 == 0 &&
         reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 64 == 0 &&
         out.numel() * static_cast<int64_t>(out.element_size()) >= kStreamOutputBytes;
}

/// Asks Linux to back a large, freshly allocated output with transparent huge pages before
/// its first touch: big CPU tensors are fresh mmaps, and a page fault per 4 KiB can cost
/// more than the pooling. A hint only: any failure is ignored.
void advise_huge_pages(const Tensor& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out.const_data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(out.numel()) * out.element_size();
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = end & ~(kHugePage - 1);
  if (last >= first + 2 * kHugePage) {
    (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#else
  (void)out;
#endif
}


}  // namespace

Tensor embedding_bag_cpu(const Tensor& weight_in, const Tensor& rows_in, const Tensor& offsets_in,
                             const std::optional<Tensor>& per_sample_weights_in, StrArg mode,
                             std::optional<int64_t> padding_idx, bool include_last_offset) {
  const BagMode bag_mode = parse_bag_mode(mode.value);
  const BagInputs in = prepare_bag_inputs(weight_in, rows_in, offsets_in, per_sample_weights_in, bag_mode,
                                          padding_idx, include_last_offset);
  const Tensor &weight = in.weight, &rows = in.rows, &offsets = in.offsets;
  const Tensor& per_sample_weights = in.per_sample_weights;
  const int64_t nnz = in.nnz, bags = in.bags, dim = in.dim, padding_row = in.padding_row;
  Tensor out = empty({bags, dim}, weight.scalar_type(), weight.device());
  if (bags == 0) {
    check_offsets_without_bags(offsets, nnz, include_last_offset);
    return out;
  }
  advise_huge_pages(out);

  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "embedding_bag_cpu", [&] {
    SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_cpu_rows", [&] {
      BagProblem<scalar_t, index_t> problem{
          weight.const_data_ptr<scalar_t>(),
          weight.stride(0),
          weight.size(0),
          dim,
          rows.const_data_ptr<index_t>(),
          offsets.const_data_ptr<int64_t>(),
          offsets.size(0),
          bags,
          nnz,
          padding_row,
          per_sample_weights.defined() ? per_sample_weights.const_data_ptr<scalar_t>() : nullptr,
          bag_mode,
          out.mutable_data_ptr<scalar_t>(),
          stream_output(out, dim),
          PrefetchPlan::kEveryLine,  // run_embedding_bag's choice
          &first_bad_bag,
          &first_bad_position};
      run_embedding_bag(problem, bags);
    });
  });
  raise_first_bag_error(first_bad_bag.load(), first_bad_position.load(), offsets, rows, bags, weight.size(0),
                        include_last_offset);
  return out;
}

namespace {

/// Arg-max positions of bags [first_bag, last_bag): for each column, the lookup (an index
/// into rows) whose value is the bag's maximum under pool_rows<kMax>'s rule, -1 for a bag
/// without a valid lookup. Scalar: it serves only max mode's backward.
template <typename scalar_t, typename index_t>
void argmax_bag_range(const BagProblem<scalar_t, index_t>& p, int64_t* positions, int64_t first_bag,
                      int64_t last_bag) {
  using acc_t = acc_type<scalar_t>;
  const int64_t dim = p.dim;
  std::vector<acc_t> best(static_cast<size_t>(dim));
  for (int64_t bag = first_bag; bag < last_bag; ++bag) {
    const int64_t begin = p.offsets[bag];
    const int64_t end = bag_end(p.offsets, p.num_offsets, bag, p.nnz);
    int64_t* out_row = positions + bag * dim;
    for (int64_t c = 0; c < dim; ++c) out_row[c] = -1;
    if (bag_offsets_bad(bag, p.bags, begin, end, p.nnz)) {
      record_first_bad(p.first_bad_bag, bag);
      continue;
    }
    bool first = true;
    for (int64_t k = begin; k < end; ++k) {
      const index_t row = p.rows[k];
      if (!lookup_valid(row, p.num_rows, p.padding_row, k, p.first_bad_position)) continue;
      const scalar_t* src = p.weight + static_cast<int64_t>(row) * p.row_stride;
      for (int64_t c = 0; c < dim; ++c) {
        const acc_t v = load_widened<acc_t>(src + c);
        if (first || v > best[c]) {
          best[c] = v;
          out_row[c] = k;
        }
      }
      first = false;
    }
  }
}

}  // namespace

Tensor embedding_bag_argmax_cpu(const Tensor& weight_in, const Tensor& rows_in,
                                    const Tensor& offsets_in, std::optional<int64_t> padding_idx,
                                    bool include_last_offset) {
  const BagInputs in = prepare_bag_inputs(weight_in, rows_in, offsets_in, std::nullopt, BagMode::kMax,
                                          padding_idx, include_last_offset);
  const Tensor &weight = in.weight, &rows = in.rows, &offsets = in.offsets;
  const int64_t nnz = in.nnz, bags = in.bags, dim = in.dim, padding_row = in.padding_row;
  Tensor positions = empty({bags, dim}, kLong, rows.device());
  if (bags == 0) {
    check_offsets_without_bags(offsets, nnz, include_last_offset);
    return positions;
  }
  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "embedding_bag_argmax_cpu", [&] {
    SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_argmax_cpu_rows", [&] {
      BagProblem<scalar_t, index_t> problem{weight.const_data_ptr<scalar_t>(),
                                            weight.stride(0),
                                            weight.size(0),
                                            dim,
                                            rows.const_data_ptr<index_t>(),
                                            offsets.const_data_ptr<int64_t>(),
                                            offsets.size(0),
                                            bags,
                                            nnz,
                                            padding_row,
                                            nullptr,
                                            BagMode::kMax,
                                            nullptr,
                                            false,
                                            PrefetchPlan::kEveryLine,
                                            &first_bad_bag,
                                            &first_bad_position};
      int64_t* positions_ptr = positions.mutable_data_ptr<int64_t>();
      const int64_t per_bag = std::max<int64_t>(1, (nnz / bags + 1) * dim);
      const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 16) / per_bag);
      parallel_chunks(bags, chunk, [&](int64_t begin, int64_t end) {
        argmax_bag_range(problem, positions_ptr, begin, end);
      });
    });
  });
  raise_first_bag_error(first_bad_bag.load(), first_bad_position.load(), offsets, rows, bags, weight.size(0),
                        include_last_offset);
  return positions;
}

namespace {

template <typename index_t>
void gather_row_range(const char* weight, int64_t row_stride_bytes, int64_t num_rows, int64_t row_bytes,
                      const index_t* rows, int64_t n, char* out, int64_t begin, int64_t end,
                      std::atomic<int64_t>* first_bad_position) {
  const int lines = prefetch_lines(row_bytes);
  const int64_t distance = prefetch_distance(row_bytes);
  const auto prefetch_row = [lines](uintptr_t at) SPARSEKIT_ALWAYS_INLINE_LAMBDA { prefetch_row_lines(at, lines); };
  for_each_prefetching(weight, row_stride_bytes, rows, n, begin, end, distance, prefetch_row, [&](int64_t i) {
    const index_t row = rows[i];
    char* dst = out + i * row_bytes;
    if (row_in_range(row, num_rows)) {
      std::memcpy(dst, weight + static_cast<int64_t>(row) * row_stride_bytes, row_bytes);
    } else {
      if (row != index_t(-1)) record_first_bad(first_bad_position, i);
      std::memset(dst, 0, row_bytes);
    }
  });
}

}  // namespace

Tensor embedding_gather_cpu(const Tensor& weight_in, const Tensor& rows_in) {
  check_embedding_gather_args(weight_in, rows_in);
  const Tensor weight = rows_stride_ready(weight_in);
  const Tensor rows = as_contiguous(rows_in);
  const int64_t n = rows.numel();
  const int64_t dim = weight.size(1);
  std::vector<int64_t> out_shape(rows.sizes().begin(), rows.sizes().end());
  out_shape.push_back(dim);
  Tensor out = empty(out_shape, weight.scalar_type(), weight.device());
  if (n == 0) return out;
  advise_huge_pages(out);

  const int64_t element = weight.element_size();
  const int64_t row_bytes = dim * element;
  const char* weight_ptr = static_cast<const char*>(weight.const_data_ptr());
  char* out_ptr = static_cast<char*>(out.mutable_data_ptr());
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(row_bytes, 1));
  SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_gather_cpu", [&] {
    const index_t* rows_ptr = rows.const_data_ptr<index_t>();
    parallel_chunks(n, chunk, [&](int64_t begin, int64_t end) {
      gather_row_range(weight_ptr, weight.stride(0) * element, weight.size(0), row_bytes, rows_ptr, n, out_ptr, begin,
                       end, &first_bad_position);
    });
  });
  raise_first_gather_error(first_bad_position.load(), rows, weight.size(0));
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("embedding_bag", TORCH_BOX(&embedding_bag_cpu));
  m.impl("embedding_bag_argmax", TORCH_BOX(&embedding_bag_argmax_cpu));
  m.impl("embedding_gather", TORCH_BOX(&embedding_gather_cpu));
}

}  // namespace sparsekit

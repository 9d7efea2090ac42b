// unsorted_segment_sum on the CPU. Units of (segment range x column block) each scan all ids
// in position order, so every output element is summed by one thread in position order:
// bit-identical for any thread count, no atomics. Segment ranges hold about equal row counts
// (cut at sampled quantiles, so hot Zipf segments do not load one thread); column blocks
// only when there are too few segments to go round.
#include "cpu/half_rows.h"
#include "cpu/parallel.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "segment.h"

namespace sparsekit {
namespace {

// Rows ahead whose output slice and data are prefetched: covers a miss to memory at the
// rate rows are added.
constexpr int64_t kPrefetchRows = 16;
// Bytes prefetched per row and stream; the hardware prefetcher follows a wider row once
// it has started.
constexpr int64_t kMaxPrefetchBytes = 256;
constexpr int64_t kCacheLine = 64;
// Columns added per block: a 64-byte line of float32, four SSE or one AVX-512 add.
constexpr int64_t kLanes = 16;
// Positions whose rows a unit lists at a time (the list stays in L1).
constexpr int64_t kListRows = 2048;
// Ids sampled to cut the segment ranges: enough for quantiles within a few percent.
constexpr int64_t kSampleIds = 4096;

/// @brief out[0, width) += row[0, width). The fixed-size inner block and __restrict (the
/// row and the output never overlap) let the compiler emit vector adds.
template <typename scalar_t, typename acc_t>
inline void add_row(acc_t* __restrict out, const scalar_t* __restrict row, int64_t width) {
  int64_t c = 0;
  for (; c + kLanes <= width; c += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) out[c + k] += static_cast<acc_t>(row[c + k]);
  }
  for (; c < width; ++c) out[c] += static_cast<acc_t>(row[c]);
}

/// @brief add_row for float16 rows: widened a block at a time with F16C where the CPU has
/// it (half_rows.h), not by a scalar c10::Half conversion per element.
template <>
inline void add_row<Half, float>(float* __restrict out, const Half* __restrict row, int64_t width) {
  constexpr int64_t kBlock = 4 * kLanes;
  float wide[kBlock];
  for (int64_t c = 0; c < width; c += kBlock) {
    const int64_t n = std::min(kBlock, width - c);
    widen_half(row + c, wide, n);
    for (int64_t k = 0; k < n; ++k) out[c + k] += wide[k];
  }
}

inline void prefetch_bytes(const void* p, int64_t bytes, bool for_write) {
  const char* line = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += kCacheLine) {
    if (for_write) {
      __builtin_prefetch(line + b, 1, 3);
    } else {
      __builtin_prefetch(line + b, 0, 0);  // non-temporal: the row is read once
    }
  }
}

/// @brief Adds rows of data[n, dim] into acc[(id - seg_begin), col_begin:col_end] for ids in
/// [seg_begin, seg_end), in position order. acc has row stride acc_stride. kWidth: the
/// width col_end - col_begin when known at compile time (0: not), so add_row unrolls.
/// @return the largest id seen (every unit scans all ids, so the range check is free here).
template <int64_t kWidth, typename scalar_t, typename acc_t, typename index_t>
int64_t accumulate_unit(const scalar_t* data, const index_t* ids, int64_t n, int64_t dim, int64_t seg_begin,
                        int64_t seg_end, int64_t col_begin, int64_t col_end, acc_t* acc, int64_t acc_stride) {
  const int64_t width = kWidth != 0 ? kWidth : col_end - col_begin;
  // One unsigned compare tests both ends of the range, and sends negative ids out.
  const uint64_t seg_count = static_cast<uint64_t>(seg_end - seg_begin);
  const int64_t out_bytes = std::min<int64_t>(width * static_cast<int64_t>(sizeof(acc_t)), kMaxPrefetchBytes);
  const int64_t row_bytes = std::min<int64_t>(width * static_cast<int64_t>(sizeof(scalar_t)), kMaxPrefetchBytes);
  auto out_row = [&](int64_t i) { return acc + (static_cast<int64_t>(ids[i]) - seg_begin) * acc_stride; };
  auto data_row = [&](int64_t i) { return data + i * dim + col_begin; };

  int64_t max_id = -1;
  std::vector<int32_t> rows(std::min(n, kListRows));
  for (int64_t block = 0; block < n; block += kListRows) {
    const int64_t block_end = std::min(n, block + kListRows);
    int64_t count = 0;
    for (int64_t i = block; i < block_end; ++i) {
      const int64_t id = static_cast<int64_t>(ids[i]);
      max_id = std::max(max_id, id);
      rows[count] = static_cast<int32_t>(i - block);
      count += static_cast<uint64_t>(id - seg_begin) < seg_count;
    }
    for (int64_t r = 0; r < count; ++r) {
      if (r + kPrefetchRows < count) {
        const int64_t ahead = block + rows[r + kPrefetchRows];
        prefetch_bytes(out_row(ahead), out_bytes, /*for_write=*/true);
        prefetch_bytes(data_row(ahead), row_bytes, /*for_write=*/false);
      }
      const int64_t i = block + rows[r];
      add_row(out_row(i), data_row(i), width);
    }
  }
  return max_id;
}

/// @brief accumulate_unit with the width a compile-time constant for float32 rows of 16,
/// 32, 64 or 128 columns (the embedding widths): over a run-time width, add_row keeps its
/// pointers and counters on the stack.
template <typename scalar_t, typename acc_t, typename index_t>
int64_t accumulate_unit_of_width(const scalar_t* data, const index_t* ids, int64_t n, int64_t dim,
                                 int64_t seg_begin, int64_t seg_end, int64_t col_begin, int64_t col_end, acc_t* acc,
                                 int64_t acc_stride) {
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    switch (col_end - col_begin) {
      case 16:
        return accumulate_unit<16>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end, acc, acc_stride);
      case 32:
        return accumulate_unit<32>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end, acc, acc_stride);
      case 64:
        return accumulate_unit<64>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end, acc, acc_stride);
      case 128:
        return accumulate_unit<128>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end, acc, acc_stride);
      default:
        break;
    }
  }
  return accumulate_unit<0>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end, acc, acc_stride);
}

/// @brief The rows of data as consecutive parts: rows [starts[p], starts[p + 1]) are the
/// rows of parts[p] (a list of gradients summed as if concatenated, with no copy).
template <typename scalar_t>
struct RowParts {
  std::vector<const scalar_t*> parts;
  std::vector<int64_t> starts;
};

/// @brief One unit of work: segments [seg_begin, seg_end) x columns [col_begin, col_end),
/// the parts in order (so rows are added in position order whatever the split).
/// float32/float64 accumulate in the output; float16/bfloat16 in a float32 scratch slice.
/// @return the largest id seen.
template <typename scalar_t, typename index_t>
int64_t run_unit(const RowParts<scalar_t>& data, const index_t* ids, int64_t dim, int64_t seg_begin,
                 int64_t seg_end, int64_t col_begin, int64_t col_end, scalar_t* out) {
  using acc_t = acc_type<scalar_t>;
  auto each_part = [&](acc_t* acc, int64_t acc_stride) {
    int64_t max_id = -1;
    for (size_t p = 0; p < data.parts.size(); ++p) {
      const int64_t begin = data.starts[p];
      max_id = std::max(max_id, accumulate_unit_of_width<scalar_t, acc_t, index_t>(
                                    data.parts[p], ids + begin, data.starts[p + 1] - begin, dim, seg_begin, seg_end,
                                    col_begin, col_end, acc, acc_stride));
    }
    return max_id;
  };
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    return each_part(out + seg_begin * dim + col_begin, dim);
  } else {
    const int64_t width = col_end - col_begin;
    std::vector<acc_t> acc((seg_end - seg_begin) * width, acc_t(0));
    const int64_t max_id = each_part(acc.data(), width);
    for (int64_t s = seg_begin; s < seg_end; ++s) {
      for (int64_t c = 0; c < width; ++c) {
        out[s * dim + col_begin + c] = static_cast<scalar_t>(acc[(s - seg_begin) * width + c]);
      }
    }
    return max_id;
  }
}

/// @brief Cuts [0, num_segments) into at most `parts` ranges holding about as many rows
/// each, from quantiles of a sample of the ids. Returns the range edges (first 0, last
/// num_segments, increasing). A segment is never cut, so one holding many rows yields
/// fewer ranges.
template <typename index_t>
std::vector<int64_t> balanced_segment_edges(const index_t* ids, int64_t n, int64_t num_segments, int64_t parts) {
  std::vector<int64_t> sample;
  const int64_t stride = std::max<int64_t>(1, n / kSampleIds);
  for (int64_t i = 0; i < n; i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id >= 0) sample.push_back(std::min(id, num_segments - 1));
  }
  std::vector<int64_t> edges{0};
  // The quantiles by selection, each in what the previous one left above it: O(parts * n)
  // instead of a sort, and the same edges: a sort costs more than the sum on small inputs
  // (a DistributedEmbedding slot's gradient).
  auto rest = sample.begin();
  for (int64_t p = 1; p < parts && !sample.empty(); ++p) {
    // A range starts at the segment holding its first quantile.
    const auto quantile = sample.begin() + static_cast<int64_t>(sample.size()) * p / parts;
    std::nth_element(rest, quantile, sample.end());
    rest = quantile;
    const int64_t edge = *quantile;
    if (edge > edges.back()) edges.push_back(edge);
  }
  edges.push_back(num_segments);
  return edges;
}

/// @brief The sum of rows data[i] into out[ids[i]], data given as parts of consecutive
/// rows (contiguous, one dtype and row shape; `shape` is the row shape with any first size);
/// `op` names the calling op in its errors.
Tensor segment_sum_rows(const char* op, const std::vector<Tensor>& data, const Tensor& ids_in, int64_t num_segments,
                        std::vector<int64_t> shape) {
  const Tensor ids = as_contiguous(ids_in);
  const int64_t n = ids.numel();
  int64_t dim = 1;
  for (size_t d = 1; d < shape.size(); ++d) dim *= shape[d];
  shape[0] = num_segments;
  const ScalarType out_dtype = data.empty() ? kFloat : data[0].scalar_type();
  Tensor out = allocate_host_or_fail(
      op, "num_segments=" + std::to_string(num_segments) + " (the output)",
      static_cast<double>(num_segments) * static_cast<double>(dim) * static_cast<double>(element_size(out_dtype)),
      [&] { return zeros(shape, out_dtype, ids.device()); });
  if (n == 0) return out;

  SK_DISPATCH_INDEX_TYPES(ids.scalar_type(), "segment_sum_cpu_ids", [&] {
    const index_t* id_ptr = ids.mutable_data_ptr<index_t>();
    if (dim == 0 || num_segments == 0) {
      // No unit runs, so the ids are checked here.
      const int64_t max_id = *std::max_element(id_ptr, id_ptr + n);
      SK_CHECK(max_id < num_segments, segment_id_range_message(max_id, num_segments, op));
      return;
    }

    const int64_t threads = n * dim < inline_below(1 << 15) ? 1 : num_threads();
    const std::vector<int64_t> seg_edges =
        threads == 1 ? std::vector<int64_t>{0, num_segments}
                     : balanced_segment_edges(id_ptr, n, num_segments, threads);
    const int64_t seg_ranges = static_cast<int64_t>(seg_edges.size()) - 1;
    // Column blocks of whole 16-lane groups (a cache line of float32), only for threads the
    // segment ranges leave idle.
    const int64_t col_blocks = std::max<int64_t>(1, std::min<int64_t>(threads / seg_ranges, dim / kLanes));
    auto col_edge = [&](int64_t cb) { return cb == col_blocks ? dim : (dim / kLanes) * cb / col_blocks * kLanes; };
    const int64_t units = col_blocks * seg_ranges;

    std::vector<int64_t> max_ids(units, -1);
    SK_DISPATCH_FLOATING_TYPES(data[0].scalar_type(), "segment_sum_cpu", [&] {
      RowParts<scalar_t> parts;
      parts.starts.push_back(0);
      for (const Tensor& part : data) {
        parts.parts.push_back(part.const_data_ptr<scalar_t>());
        parts.starts.push_back(parts.starts.back() + part.size(0));
      }
      scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
      parallel_for(0, units, 1, [&](int64_t u_begin, int64_t u_end) {
        for (int64_t u = u_begin; u < u_end; ++u) {
          const int64_t cb = u % col_blocks, sr = u / col_blocks;
          max_ids[u] = run_unit<scalar_t, index_t>(parts, id_ptr, dim, seg_edges[sr], seg_edges[sr + 1],
                                                   col_edge(cb), col_edge(cb + 1), out_ptr);
        }
      });
    });
    const int64_t max_id = *std::max_element(max_ids.begin(), max_ids.end());
    SK_CHECK(max_id < num_segments, segment_id_range_message(max_id, num_segments, op));
  });
  return out;
}

Tensor segment_sum_cpu(const Tensor& data_in, const Tensor& ids_in, int64_t num_segments,
                       bool /*deterministic: always true on the CPU*/) {
  check_segment_sum_args(data_in, ids_in, num_segments);
  SK_CHECK(data_in.device().is_cpu(), "segment_sum: expected CPU tensors, got ", data_in.device());
  return segment_sum_rows("segment_sum", {as_contiguous(data_in)}, ids_in, num_segments, data_in.sizes().vec());
}

/// @brief segment_sum of the rows of several tensors taken one after the other, without
/// concatenating them: data[0]'s rows are positions 0.., data[1]'s follow, ... The same
/// sums in the same order as segment_sum(torch.cat(data), ...), bit for bit.
Tensor segment_sum_parts_cpu(const std::vector<Tensor>& data_in, const Tensor& ids, int64_t num_segments) {
  const char* op = "segment_sum_parts";
  SK_CHECK(!data_in.empty(), op, ": data must hold at least one tensor");
  // Before the parts' row shapes (sizes().slice(1)) are read: a 0-d tensor has none.
  SK_CHECK(data_in[0].dim() >= 1, op, ": data[0] must have at least one dimension [rows, ...], got a scalar");
  std::vector<Tensor> data;
  int64_t rows = 0;
  for (size_t p = 0; p < data_in.size(); ++p) {
    const Tensor& part = data_in[p];
    SK_CHECK(part.dim() == data_in[0].dim() && part.scalar_type() == data_in[0].scalar_type() &&
                 same_sizes(part.sizes().slice(1), data_in[0].sizes().slice(1)) && part.device().is_cpu(),
             op, ": data[", p, "] (", part.scalar_type(), " ", part.sizes(), " on ", part.device(),
             ") must be a CPU tensor with the dtype and row shape of data[0] (", data_in[0].scalar_type(), " ",
             data_in[0].sizes(), ")");
    data.push_back(as_contiguous(part));
    rows += part.size(0);
  }
  check_index_tensor(ids, op, "segment_ids");
  SK_CHECK(ids.dim() == 1 && ids.size(0) == rows, op, ": segment_ids must be 1-D with one entry per row of data (",
           rows, "), got shape ", ids.sizes());
  SK_CHECK(ids.device().is_cpu(), op, ": segment_ids must be a CPU tensor, got ", ids.device());
  SK_CHECK(num_segments >= 0, op, ": num_segments must be >= 0, got ", num_segments);
  SK_CHECK(is_floating(data[0].scalar_type()), op, ": data must be float32, float64, float16 or bfloat16, got ",
           data[0].scalar_type());
  return segment_sum_rows(op, data, ids, num_segments, data[0].sizes().vec());
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("segment_sum", TORCH_BOX(&segment_sum_cpu));
  m.impl("segment_sum_parts", TORCH_BOX(&segment_sum_parts_cpu));
}

}  // namespace sparsekit

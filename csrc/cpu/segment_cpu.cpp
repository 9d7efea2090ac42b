// unsorted_segment_sum on the CPU.
//
// The work is split into units of (segment range x column block). Every unit scans all
// ids in position order and adds the rows that fall in its segment range, restricted to
// its columns. So each output element is summed by exactly one thread, in position
// order: the result is bit-identical whatever the thread count (deterministic=True is
// free on the CPU), no atomics are needed, and for wide rows the column split balances
// the threads even when a few segments hold most rows (Zipf ids).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "segment.h"

namespace sparsekit {
namespace {

constexpr int64_t kPrefetchDistance = 8;

template <typename scalar_t>
struct Accumulator {
  using type = scalar_t;
};
template <>
struct Accumulator<at::Half> {
  using type = float;
};
template <>
struct Accumulator<at::BFloat16> {
  using type = float;
};

template <typename index_t>
int64_t max_segment_id(const index_t* ids, int64_t n) {
  return at::parallel_reduce(
      0, n, 1 << 16, int64_t{-1},
      [&](int64_t begin, int64_t end, int64_t acc) {
        for (int64_t i = begin; i < end; ++i) acc = std::max<int64_t>(acc, ids[i]);
        return acc;
      },
      [](int64_t a, int64_t b) { return std::max(a, b); });
}

/// @brief Adds rows of data[n, dim] into acc[(id - seg_begin), col_begin:col_end] for ids in
/// [seg_begin, seg_end), in position order. acc has row stride acc_stride.
template <typename scalar_t, typename acc_t, typename index_t>
void accumulate_unit(const scalar_t* data, const index_t* ids, int64_t n, int64_t dim, int64_t seg_begin,
                     int64_t seg_end, int64_t col_begin, int64_t col_end, acc_t* acc, int64_t acc_stride) {
  const int64_t width = col_end - col_begin;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchDistance < n) {
      const int64_t ahead = ids[i + kPrefetchDistance];
      if (ahead >= seg_begin && ahead < seg_end) {
        __builtin_prefetch(acc + (ahead - seg_begin) * acc_stride, 1);
      }
    }
    const int64_t id = ids[i];
    if (id < seg_begin || id >= seg_end) continue;
    acc_t* out = acc + (id - seg_begin) * acc_stride;
    const scalar_t* row = data + i * dim + col_begin;
    for (int64_t c = 0; c < width; ++c) out[c] += static_cast<acc_t>(row[c]);
  }
}

/// @brief One unit of work: segments [seg_begin, seg_end) x columns [col_begin, col_end).
/// float32/float64 accumulate in the output; float16/bfloat16 in a float32 scratch slice.
template <typename scalar_t, typename index_t>
void run_unit(const scalar_t* data, const index_t* ids, int64_t n, int64_t dim, int64_t seg_begin,
              int64_t seg_end, int64_t col_begin, int64_t col_end, scalar_t* out) {
  using acc_t = typename Accumulator<scalar_t>::type;
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    accumulate_unit<scalar_t, acc_t, index_t>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end,
                                              out + seg_begin * dim + col_begin, dim);
  } else {
    const int64_t width = col_end - col_begin;
    std::vector<acc_t> acc((seg_end - seg_begin) * width, acc_t(0));
    accumulate_unit<scalar_t, acc_t, index_t>(data, ids, n, dim, seg_begin, seg_end, col_begin, col_end,
                                              acc.data(), width);
    for (int64_t s = seg_begin; s < seg_end; ++s) {
      for (int64_t c = 0; c < width; ++c) {
        out[s * dim + col_begin + c] = static_cast<scalar_t>(acc[(s - seg_begin) * width + c]);
      }
    }
  }
}

at::Tensor segment_sum_cpu(const at::Tensor& data_in, const at::Tensor& ids_in, int64_t num_segments,
                           bool /*deterministic: always true on the CPU*/) {
  check_segment_sum_args(data_in, ids_in, num_segments);
  TORCH_CHECK(data_in.device().is_cpu(), "segment_sum: expected CPU tensors, got ", data_in.device());
  const at::Tensor data = data_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = data.size(0);
  const int64_t dim = n > 0 ? data.numel() / n : 1;
  std::vector<int64_t> out_shape = data.sizes().vec();
  out_shape[0] = num_segments;
  at::Tensor out = at::zeros(out_shape, data.options());
  if (n == 0) return out;

  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "segment_sum_cpu_ids", [&] {
    const index_t* id_ptr = ids.data_ptr<index_t>();
    const int64_t max_id = max_segment_id(id_ptr, n);
    TORCH_CHECK(max_id < num_segments, segment_id_range_message(max_id, num_segments));
    if (dim == 0 || num_segments == 0) return;

    const int64_t threads = at::get_num_threads();
    const bool tiny = n * dim < (1 << 15) || threads == 1;
    // Column blocks of >= 16 elements (a cache line of float32), then segment ranges.
    const int64_t col_blocks = tiny ? 1 : std::max<int64_t>(1, std::min<int64_t>(threads, dim / 16));
    const int64_t seg_ranges =
        tiny ? 1 : std::min<int64_t>(num_segments, (threads + col_blocks - 1) / col_blocks);
    const int64_t units = col_blocks * seg_ranges;

    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, data.scalar_type(), "segment_sum_cpu", [&] {
      const scalar_t* data_ptr = data.data_ptr<scalar_t>();
      scalar_t* out_ptr = out.data_ptr<scalar_t>();
      at::parallel_for(0, units, 1, [&](int64_t u_begin, int64_t u_end) {
        for (int64_t u = u_begin; u < u_end; ++u) {
          const int64_t cb = u % col_blocks, sr = u / col_blocks;
          run_unit<scalar_t, index_t>(data_ptr, id_ptr, n, dim, num_segments * sr / seg_ranges,
                                      num_segments * (sr + 1) / seg_ranges, dim * cb / col_blocks,
                                      dim * (cb + 1) / col_blocks, out_ptr);
        }
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("segment_sum", &segment_sum_cpu);
}

}  // namespace sparsekit

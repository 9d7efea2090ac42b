// select_smallest on the CPU: the radix select of csrc/select.h, each pass a parallel
// loop over fixed chunks of the entries (per-chunk histograms, minima and counts, merged
// in chunk order, so the result never depends on the thread count).
#include <algorithm>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "select.h"

namespace sparsekit {
namespace {

constexpr int64_t kSelectGrain = 1 << 14;

struct Chunks {
  int64_t n;
  int64_t count;
  int64_t begin(int64_t chunk) const { return chunk * n / count; }

  template <typename F>
  void each(const F& f) const {
    at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      for (int64_t chunk = first; chunk < last; ++chunk) f(chunk, begin(chunk), begin(chunk + 1));
    });
  }
};

}  // namespace

/// @brief Indices (ascending) of the k lexicographically smallest eligible entries of
/// int64 columns; whole-tuple ties go to the smaller index.
/// @param columns 1 to 4 int64 [n] tensors, compared in order (column 0 first).
/// @param eligible bool [n]: only these entries may be chosen.
/// @param k how many to choose; at most the number of eligible entries.
/// @return int64 [k], ascending.
at::Tensor select_smallest_cpu(at::TensorList columns, const at::Tensor& eligible, int64_t k) {
  check_select_args(columns, eligible, k);
  const int64_t n = eligible.size(0);
  std::vector<at::Tensor> columns_c;
  SelectColumns cols{};
  cols.num_columns = static_cast<int>(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    columns_c.push_back(columns[c].contiguous());
    cols.data[c] = columns_c.back().data_ptr<int64_t>();
  }
  const at::Tensor eligible_c = eligible.contiguous();
  const bool* ok = eligible_c.data_ptr<bool>();
  const Chunks chunks{n, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4,
                                                                (n + kSelectGrain - 1) / kSelectGrain))};
  std::vector<int64_t> per_chunk(chunks.count * 2);

  chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
    int64_t count = 0;
    for (int64_t i = begin; i < end; ++i) count += ok[i];
    per_chunk[chunk] = count;
  });
  int64_t num_eligible = 0;
  for (int64_t chunk = 0; chunk < chunks.count; ++chunk) num_eligible += per_chunk[chunk];
  TORCH_CHECK(k <= num_eligible, "select_smallest: k=", k, " but only ", num_eligible, " of ", n,
              " entries are eligible");
  at::Tensor out = at::empty({k}, eligible.options().dtype(at::kLong));
  if (k == 0) return out;

  SelectState state;
  state.need = k;
  state.bucket = num_eligible;
  state.settle(cols.num_columns);
  std::vector<int64_t> histograms;
  std::vector<uint64_t> extremes(chunks.count * 2);
  while (!state.done) {
    if (state.wants_min_max()) {
      chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
        uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
        for (int64_t i = begin; i < end; ++i) {
          if (!ok[i] || state.classify(cols, i) != 0) continue;
          const uint64_t v = ordered_bits(cols.data[state.column][i]);
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        extremes[2 * chunk] = lo;
        extremes[2 * chunk + 1] = hi;
      });
      uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
      for (int64_t chunk = 0; chunk < chunks.count; ++chunk) {
        lo = std::min(lo, extremes[2 * chunk]);
        hi = std::max(hi, extremes[2 * chunk + 1]);
      }
      state.step_min_max(lo, hi, cols.num_columns);
      continue;
    }
    const int bins = 1 << state.digit_bits();
    histograms.assign(chunks.count * bins, 0);
    chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
      int64_t* histogram = histograms.data() + chunk * bins;
      for (int64_t i = begin; i < end; ++i) {
        if (ok[i] && state.classify(cols, i) == 0) ++histogram[state.digit(cols, i)];
      }
    });
    for (int64_t chunk = 1; chunk < chunks.count; ++chunk) {
      for (int b = 0; b < bins; ++b) histograms[b] += histograms[chunk * bins + b];
    }
    state.step_histogram(histograms.data(), cols.num_columns);
  }

  // Compaction: every less entry, then the first `need` bucket entries by index.
  chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
    int64_t less = 0, bucket = 0;
    for (int64_t i = begin; i < end; ++i) {
      if (!ok[i]) continue;
      const int side = state.classify(cols, i);
      less += side < 0;
      bucket += side == 0;
    }
    per_chunk[2 * chunk] = less;
    per_chunk[2 * chunk + 1] = bucket;
  });
  int64_t less_before = 0, bucket_before = 0;
  for (int64_t chunk = 0; chunk < chunks.count; ++chunk) {
    const int64_t less = per_chunk[2 * chunk], bucket = per_chunk[2 * chunk + 1];
    per_chunk[2 * chunk] = less_before;
    per_chunk[2 * chunk + 1] = bucket_before;
    less_before += less;
    bucket_before += bucket;
  }
  int64_t* out_ptr = out.data_ptr<int64_t>();
  const int64_t need = state.need;
  chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
    int64_t less = per_chunk[2 * chunk], bucket = per_chunk[2 * chunk + 1];
    for (int64_t i = begin; i < end; ++i) {
      if (!ok[i]) continue;
      const int side = state.classify(cols, i);
      if (side < 0) {
        out_ptr[less + std::min(bucket, need)] = i;
        ++less;
      } else if (side == 0) {
        if (bucket < need) out_ptr[less + bucket] = i;
        ++bucket;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("select_smallest", &select_smallest_cpu);
}

}  // namespace sparsekit

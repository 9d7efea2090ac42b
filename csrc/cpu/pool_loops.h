#pragma once
// The pooling loops of embedding_bag and of the collection's pooled read (embedding_cpu.cpp,
// pooled_cpu.cpp): a bag's rows summed (or averaged, weighted, maxed) a block of columns at a
// time in vector registers, the rows prefetched ahead. Memory-latency bound on tables larger
// than the cache: each lookup is a random row.
// The loops are written once (always_inline templates) and instantiated for AVX-512, for
// AVX2+FMA+F16C and for a baseline CPU, picked at run time (cpu_isa): the .so is built
// without -march flags and stays portable. The vector loads and stores are in vector_io.h.
#include "cpu/cpu_features.h"
#include "cpu/parallel.h"
#include "cpu/prefetch_plan.h"
#include "cpu/vector_io.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "embedding.h"

namespace sparsekit {
namespace {

// 32-byte vector arguments of the always_inline helpers never cross a real call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

// embedding_gather's copy loop: lookups prefetched ahead (enough to cover DRAM latency, few
// enough that the lines are still cached when used) and lines per row (the hardware
// prefetchers take the rest). Tuned by benchmarks/bench_embedding.py.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kPrefetchDistanceOneLine = 32;
constexpr int64_t kPrefetchDistanceFewLines = 24;
constexpr int64_t kMaxPrefetchLines = 4;

// The pooling loops prefetch every line of the row's pass, last line first,
// kPoolLinesInFlight / lines lookups ahead within [kMinPoolDistance, kMaxPoolDistance]: at
// most 16 KiB in flight. Every line, because the hardware prefetchers start too late on a
// random row. Tuned by benchmarks/bench_embedding.py.
constexpr int64_t kPoolLinesInFlight = 256;
constexpr int64_t kMinPoolDistance = 16;
constexpr int64_t kMaxPoolDistance = 64;

// The other prefetch plan (prefetch_plan.h): the first line only, for passes of at least
// kFirstLinePlanLines lines. Multi-threaded calls reading at least kPlanMinBytes time
// themselves and let a PlanChooser pick; shorter calls cannot tell the plans apart.
// Tuned by benchmarks/bench_embedding.py.
constexpr int64_t kFirstLineDistance = 16;
constexpr int kFirstLinePlanLines = 8;
constexpr int64_t kPlanMinBytes = int64_t{32} << 20;

/// The widest vector instructions the pooling loops use (cpu_features.h: the CPU's,
/// lowered by SPARSEKIT_CPU_CAPABILITY so that the tests run every instantiation on one
/// machine).
SPARSEKIT_ALWAYS_INLINE Isa cpu_isa() {
#if SPARSEKIT_X86_DISPATCH
  return kCpuFeatures.isa;
#else
  return Isa::kBaseline;
#endif
}

// embedding_bag writes a pooled output of at least this size with streaming stores: a
// cached store reads its line first, and a large output leaves the caches before the call
// ends anyway; smaller ones stay cached for the next layer. Tuned by bench_embedding.py.
constexpr int64_t kStreamOutputBytes = int64_t{4} << 20;

/// Lines of a row_bytes-long row worth prefetching by hand, 1..kMaxPrefetchLines.
inline int prefetch_lines(int64_t row_bytes) {
  return static_cast<int>(std::clamp<int64_t>((row_bytes + 63) / 64, 1, kMaxPrefetchLines));
}

/// Lookups ahead to prefetch for rows of row_bytes bytes (embedding_gather).
inline int64_t prefetch_distance(int64_t row_bytes) {
  return row_bytes <= 64 ? kPrefetchDistanceOneLine
         : row_bytes <= kMaxPrefetchLines * 64 ? kPrefetchDistanceFewLines
                                               : kPrefetchDistance;
}

/// Prefetches lines [0, lines) of the row at `at` (embedding_gather, lines <= 4). `lines`
/// is loop-invariant, so its tests predict perfectly.
SPARSEKIT_ALWAYS_INLINE void prefetch_row_lines(uintptr_t at, int lines) {
  if (lines > 0) __builtin_prefetch(reinterpret_cast<const char*>(at), 0, 3);
  if (lines > 1) __builtin_prefetch(reinterpret_cast<const char*>(at + 64), 0, 3);
  if (lines > 2) __builtin_prefetch(reinterpret_cast<const char*>(at + 128), 0, 3);
  if (lines > 3) __builtin_prefetch(reinterpret_cast<const char*>(at + 192), 0, 3);
}

/// Prefetches kLines lines of the row at `at`, last line first (the pooling loops; see
/// kPoolLinesInFlight). The count is a compile-time constant: a loop over a run-time
/// count is markedly slower.
template <int kLines>
SPARSEKIT_ALWAYS_INLINE void prefetch_row_lines_back(uintptr_t at) {
#pragma GCC unroll 32
  for (int l = kLines - 1; l >= 0; --l) __builtin_prefetch(reinterpret_cast<const char*>(at + 64 * l), 0, 3);
}

/// The address of row `row` for a prefetch, whatever the id: computed in uintptr_t, where
/// any id (-1, or one far outside the table) wraps harmlessly, since a prefetch never faults.
template <typename index_t>
SPARSEKIT_ALWAYS_INLINE const char* wrapped_row(const char* base, index_t row, int64_t row_stride_bytes) {
  return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +
                                       static_cast<uint64_t>(static_cast<int64_t>(row)) *
                                           static_cast<uint64_t>(row_stride_bytes));
}

/// Calls step(k) for k in [begin, end) of lookups rows[0, nnz), with prefetch_row(at)
/// prefetching the row `distance` lookups on (`at`: its address, see wrapped_row) while that
/// lookup exists: the range is split where the last lookup comes into reach, so the position
/// needs no clamp, and the row no range select. The prefetch runs past a bag into the next
/// ones: the flat rows are read in order.
template <typename index_t, typename Prefetch, typename Step>
SPARSEKIT_ALWAYS_INLINE void for_each_prefetching(const char* base, int64_t row_stride_bytes, const index_t* rows,
                                                  int64_t nnz, int64_t begin, int64_t end, int64_t distance,
                                                  Prefetch&& prefetch_row, Step&& step) {
  const int64_t unclamped = std::clamp<int64_t>(nnz - distance, begin, end);
  int64_t k = begin;
  for (; k < unclamped; ++k) {
    prefetch_row(reinterpret_cast<uintptr_t>(wrapped_row(base, rows[k + distance], row_stride_bytes)));
    step(k);
  }
  for (; k < end; ++k) step(k);
}

/// Shared, read-only description of one embedding_bag call.
template <typename scalar_t, typename index_t>
struct BagProblem {
  const scalar_t* weight;
  int64_t row_stride;  // elements between consecutive rows of weight
  int64_t num_rows;
  int64_t dim;
  const index_t* rows;
  const int64_t* offsets;
  int64_t num_offsets;  // bags + 1 with include_last_offset, else bags (the last bag ends at nnz)
  int64_t bags;
  int64_t nnz;
  int64_t padding_row;                 // skipped like -1; -1 when there is none
  const scalar_t* per_sample_weights;  // nullptr: every row weighs 1
  BagMode mode;
  scalar_t* out;  // bag b's row at out + (b - out_first_bag) * out_stride
  bool stream_out;  // write out with streaming stores where the instantiation has them
  PrefetchPlan plan;  // for the passes of at least kFirstLinePlanLines lines
  std::atomic<int64_t>* first_bad_bag;       // kNoBadPosition until a bag breaks the offsets contract
  std::atomic<int64_t>* first_bad_position;  // kNoBadPosition until rows holds a bad row
  // The output's layout: 0 means dim (embedding_bag's contiguous [bags, dim]); the pooled
  // read of a collection writes a feature's bags as columns of a wider [B, sum of dims].
  int64_t out_stride = 0;
  int64_t out_first_bag = 0;
  // float32 per-sample weights in place of per_sample_weights (the pooled read's, for tables
  // of any dtype: a weight rounded to a half table's dtype would change the sums).
  const float* per_sample_weights_f32 = nullptr;

  SPARSEKIT_ALWAYS_INLINE int64_t out_row_stride() const { return out_stride != 0 ? out_stride : dim; }
  SPARSEKIT_ALWAYS_INLINE scalar_t* out_row(int64_t bag) const {
    return out + (bag - out_first_bag) * out_row_stride();
  }
};

/// The divisor of a mean: the bag's pooled rows, or (kMeanOfLength, the collection's
/// combiner) its whole length, skipped rows included.
template <typename acc_t>
SPARSEKIT_ALWAYS_INLINE acc_t mean_divisor(BagMode mode, int64_t valid, int64_t length) {
  return static_cast<acc_t>(mode == BagMode::kMeanOfLength ? length : valid);
}

/// Where bag `bag` ends: offsets[bag + 1], or nnz for the last bag of [bags] offsets.
SPARSEKIT_ALWAYS_INLINE int64_t bag_end(const int64_t* offsets, int64_t num_offsets, int64_t bag, int64_t nnz) {
  return bag + 1 < num_offsets ? offsets[bag + 1] : nnz;
}

template <typename index_t>
SPARSEKIT_ALWAYS_INLINE bool row_in_range(index_t row, int64_t num_rows) {
  return static_cast<uint64_t>(static_cast<int64_t>(row)) < static_cast<uint64_t>(num_rows);
}

// Out of line: the error path must not act as a memory barrier inside the hot loops. Keeps
// the smallest position recorded, so the error names the first bad entry whatever the
// thread schedule (the CUDA kernels do the same with atomicMin).
__attribute__((noinline, cold)) void record_first_bad(std::atomic<int64_t>* first, int64_t position) {
  int64_t seen = first->load(std::memory_order_relaxed);
  while (position < seen && !first->compare_exchange_weak(seen, position, std::memory_order_relaxed)) {
  }
}

/// True when `row` is looked up: in range and not the padding row. A row outside the table
/// other than -1 is recorded as an error.
template <typename index_t>
SPARSEKIT_ALWAYS_INLINE bool lookup_valid(index_t row, int64_t num_rows, int64_t padding_row, int64_t position,
                                          std::atomic<int64_t>* first_bad_position) {
  if (C10_UNLIKELY(!row_in_range(row, num_rows))) {
    if (row != index_t(-1)) record_first_bad(first_bad_position, position);
    return false;
  }
  return static_cast<int64_t>(row) != padding_row;
}

/// kVecs kBytes-wide vectors of accumulators: the columns [col, col + kVecs * kLanes) of a
/// bag, held in registers while the bag's rows stream by.
template <typename scalar_t, int kVecs, int kBytes, bool kVectorIsa>
struct VectorColumns {
  using acc_t = acc_type<scalar_t>;
  using vec = typename AccVec<acc_t, kBytes>::type;
  static constexpr int kLanes = AccVec<acc_t, kBytes>::kLanes;
  /// Cache lines of a row these columns span (prefetched by pool_rows).
  static constexpr int kLines = std::max<int>(1, (kVecs * kLanes * static_cast<int>(sizeof(scalar_t)) + 63) / 64);
  /// Columns these accumulators hold.
  static constexpr int64_t kWidth = int64_t{kVecs} * kLanes;

  SPARSEKIT_ALWAYS_INLINE static vec load(const scalar_t* src) {
    vec v;
    if constexpr (kVectorIsa && std::is_same_v<scalar_t, Half>) {
      load_into_f16c(v, src);
    } else {
      load_into(v, src);
    }
    return v;
  }
  vec acc[kVecs];

  SPARSEKIT_ALWAYS_INLINE VectorColumns() { clear(); }
  SPARSEKIT_ALWAYS_INLINE void clear() {
    for (int i = 0; i < kVecs; ++i) acc[i] = vec{};
  }
  SPARSEKIT_ALWAYS_INLINE void add(const scalar_t* src) {
    for (int i = 0; i < kVecs; ++i) acc[i] += load(src + i * kLanes);
  }
  SPARSEKIT_ALWAYS_INLINE void add(const scalar_t* src, acc_t w) {
    for (int i = 0; i < kVecs; ++i) acc[i] += w * load(src + i * kLanes);
  }
  SPARSEKIT_ALWAYS_INLINE void assign(const scalar_t* src) {
    for (int i = 0; i < kVecs; ++i) acc[i] = load(src + i * kLanes);
  }
  // nn.EmbeddingBag's max (CPU and CUDA): after the first valid row (assign), only a
  // strictly larger value replaces the running maximum, so a NaN wins only when it comes
  // first and ties keep the earlier row.
  SPARSEKIT_ALWAYS_INLINE void max(const scalar_t* src) {
    for (int i = 0; i < kVecs; ++i) {
      const vec v = load(src + i * kLanes);
      acc[i] = v > acc[i] ? v : acc[i];
    }
  }
  /// Writes the pooled columns, divided by *divisor when it is given (mean); with `stream`
  /// (dst aligned to the vector size), as streaming stores when the elements are the
  /// accumulator type (float32, float64) and the instantiation targets AVX2 or AVX-512.
  SPARSEKIT_ALWAYS_INLINE void store(scalar_t* dst, const acc_t* divisor, bool stream) {
    for (int i = 0; i < kVecs; ++i) {
      const vec v = divisor != nullptr ? acc[i] / *divisor : acc[i];
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        if constexpr (kVectorIsa) {
          if (stream) {
            stream_vector(dst + i * kLanes, v);
            continue;
          }
        }
        std::memcpy(dst + i * kLanes, &v, sizeof(v));
      } else {
        for (int l = 0; l < kLanes; ++l) dst[i * kLanes + l] = static_cast<scalar_t>(v[l]);
      }
    }
  }
};

/// Fewer columns than one vector holds: the ragged end of a dim that is not a multiple of
/// the vector width.
template <typename scalar_t>
struct TailColumns {
  using acc_t = acc_type<scalar_t>;
  static constexpr int kMax = AccVec<acc_t, 64>::kLanes;
  static constexpr int kLines = 1;  // fewer columns than one 64-byte vector
  acc_t acc[kMax];
  int64_t width;

  SPARSEKIT_ALWAYS_INLINE explicit TailColumns(int64_t width_) : width(width_) { clear(); }
  SPARSEKIT_ALWAYS_INLINE void clear() {
    for (int i = 0; i < kMax; ++i) acc[i] = acc_t(0);
  }
  SPARSEKIT_ALWAYS_INLINE void add(const scalar_t* src) {
    for (int64_t i = 0; i < width; ++i) acc[i] += load_widened<acc_t>(src + i);
  }
  SPARSEKIT_ALWAYS_INLINE void add(const scalar_t* src, acc_t w) {
    for (int64_t i = 0; i < width; ++i) acc[i] += w * load_widened<acc_t>(src + i);
  }
  SPARSEKIT_ALWAYS_INLINE void assign(const scalar_t* src) {
    for (int64_t i = 0; i < width; ++i) acc[i] = load_widened<acc_t>(src + i);
  }
  SPARSEKIT_ALWAYS_INLINE void max(const scalar_t* src) {
    for (int64_t i = 0; i < width; ++i) {
      const acc_t v = load_widened<acc_t>(src + i);
      if (v > acc[i]) acc[i] = v;
    }
  }
  SPARSEKIT_ALWAYS_INLINE void store(scalar_t* dst, const acc_t* divisor, bool /*stream: whole vectors only*/) {
    for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<scalar_t>(divisor != nullptr ? acc[i] / *divisor : acc[i]);
  }
};

/// Calls step(k) for the lookups [begin, end) of a column pass of kLines lines, prefetching
/// the rows ahead with the call's plan: every line kPoolLinesInFlight / kLines lookups ahead
/// (within [kMinPoolDistance, kMaxPoolDistance]), or, for passes of kFirstLinePlanLines lines
/// or more under the first-line plan, the first line kFirstLineDistance ahead; each plan a
/// loop of its own. `base` addresses the pass's first column of row 0.
template <int kLines, typename index_t, typename Step>
SPARSEKIT_ALWAYS_INLINE void pool_lookups(bool first_line_plan, const char* base, int64_t row_stride_bytes,
                                          const index_t* rows, int64_t nnz, int64_t begin, int64_t end,
                                          Step&& step) {
  constexpr int64_t kDistance =
      std::clamp<int64_t>(kPoolLinesInFlight / kLines, kMinPoolDistance, kMaxPoolDistance);
  // Lambdas, inlined: handed a pointer to the function, GCC found it free of side effects
  // and dropped the call, prefetches and all, in every loop but the sum's.
  const auto every_line = [](uintptr_t at) SPARSEKIT_ALWAYS_INLINE_LAMBDA { prefetch_row_lines_back<kLines>(at); };
  if constexpr (kLines >= kFirstLinePlanLines) {
    if (first_line_plan) {
      const auto first_line = [](uintptr_t at) SPARSEKIT_ALWAYS_INLINE_LAMBDA { prefetch_row_lines_back<1>(at); };
      for_each_prefetching(base, row_stride_bytes, rows, nnz, begin, end, kFirstLineDistance, first_line, step);
      return;
    }
  }
  for_each_prefetching(base, row_stride_bytes, rows, nnz, begin, end, kDistance, every_line, step);
}

/// Sum and mean of one column pass over a bag's rows, with the call's values held in its own
/// members: built once per call where one pass covers the dim (pool_bag_range_one_pass), so
/// the bag loop reloads nothing through the problem. kPadded: a padding row is skipped
/// (without one, the range test alone finds every skipped row). A lean loop (few live
/// registers, so nothing the loop needs is spilled), one test for a skipped row, the count of
/// pooled rows derived from the skipped ones afterwards; the rows ahead are prefetched
/// unchecked (for_each_prefetching).
template <bool kPadded, typename scalar_t, typename index_t>
struct SumPass {
  const scalar_t* weight;
  int64_t row_stride;
  int64_t row_stride_bytes;
  int64_t num_rows;
  const index_t* rows;
  int64_t nnz;
  int64_t padding_row;
  std::atomic<int64_t>* first_bad_position;
  BagMode mode;
  bool mean;
  bool stream;
  bool first_line_plan;

  SPARSEKIT_ALWAYS_INLINE explicit SumPass(const BagProblem<scalar_t, index_t>& p)
      : weight(p.weight),
        row_stride(p.row_stride),
        row_stride_bytes(p.row_stride * static_cast<int64_t>(sizeof(scalar_t))),
        num_rows(p.num_rows),
        rows(p.rows),
        nnz(p.nnz),
        padding_row(p.padding_row),
        first_bad_position(p.first_bad_position),
        mode(p.mode),
        mean(p.mode == BagMode::kMean || p.mode == BagMode::kMeanOfLength),
        stream(p.stream_out),
        first_line_plan(p.plan == PrefetchPlan::kFirstLine) {}

  /// Pools the columns of `columns` (from col on) over rows[begin, end) into out_row, with
  /// the prefetches of pool_rows.
  template <typename Columns>
  SPARSEKIT_ALWAYS_INLINE void operator()(int64_t begin, int64_t end, int64_t col, Columns columns,
                                          scalar_t* out_row) const {
    const scalar_t* const weight_col = weight + col;
    const char* const base = reinterpret_cast<const char*>(weight_col);
    int64_t skipped = 0;
    const auto step = [&](int64_t k) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
      const index_t row = rows[k];
      if (C10_UNLIKELY(!row_in_range(row, num_rows) || (kPadded && static_cast<int64_t>(row) == padding_row))) {
        lookup_valid(row, num_rows, padding_row, k, first_bad_position);
        ++skipped;
        return;
      }
      columns.add(weight_col + static_cast<int64_t>(row) * row_stride);
    };
    pool_lookups<Columns::kLines>(first_line_plan, base, row_stride_bytes, rows, nnz, begin, end, step);
    // Mean divides by the number of pooled rows, as a division (see pool_rows); a bag with
    // none keeps the zeros it started with.
    using acc_t = acc_type<scalar_t>;
    const int64_t valid = (end - begin) - skipped;
    const acc_t divisor = mean_divisor<acc_t>(mode, valid, end - begin);
    columns.store(out_row + col, mean && divisor > acc_t(0) ? &divisor : nullptr, stream);
  }
};

/// Pools the columns held by `columns` (starting at col) over rows[begin, end) of one bag
/// and writes them to out_row. It prefetches the lines of these columns (Columns::kLines)
/// kPoolLinesInFlight / kLines lookups ahead (at most kMaxPoolDistance), running on into the
/// next bags: every pass over a wide row prefetches its own columns.
template <bool kWeighted, bool kMax, int kBytes, typename Columns, typename scalar_t, typename index_t>
SPARSEKIT_ALWAYS_INLINE void pool_rows(const BagProblem<scalar_t, index_t>& p, int64_t begin, int64_t end,
                                       int64_t col, Columns columns, scalar_t* out_row) {
  if constexpr (!kWeighted && !kMax) {
    // Sum and mean (SumPass), its padding test chosen here. Inlined by force: out of line,
    // the accumulators go through the stack.
    p.padding_row < 0 ? SumPass<false, scalar_t, index_t>(p)(begin, end, col, columns, out_row)
                      : SumPass<true, scalar_t, index_t>(p)(begin, end, col, columns, out_row);
  } else {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* const weight = p.weight;
    const int64_t row_stride = p.row_stride;
    const int64_t num_rows = p.num_rows;
    const index_t* const rows = p.rows;
    const scalar_t* const sample_weights = p.per_sample_weights;
    const float* const sample_weights_f32 = p.per_sample_weights_f32;
    // The prefetches address the row's columns from col on.
    const char* const base = reinterpret_cast<const char*>(weight + col);
    const int64_t row_stride_bytes = row_stride * static_cast<int64_t>(sizeof(scalar_t));
    // Locals, not loads through p: the cold error call could otherwise force reloads.
    const int64_t padding_row = p.padding_row;
    std::atomic<int64_t>* const first_bad_position = p.first_bad_position;
    acc_t weight_sum = 0;
    int64_t valid = 0;
    // Weighted sums and max: every lookup tested and counted; prefetched as the sum is.
    const auto step = [&](int64_t k) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
      const index_t row = rows[k];
      if (!lookup_valid(row, num_rows, padding_row, k, first_bad_position)) return;
      const scalar_t* src = weight + static_cast<int64_t>(row) * row_stride + col;
      if constexpr (kMax) {
        // A bag with no valid row keeps the zeros it started with.
        valid == 0 ? columns.assign(src) : columns.max(src);
      } else {
        const acc_t w = sample_weights_f32 != nullptr ? static_cast<acc_t>(sample_weights_f32[k])
                                                      : load_widened<acc_t>(sample_weights + k);
        weight_sum += w;
        columns.add(src, w);
      }
      ++valid;
    };
    pool_lookups<Columns::kLines>(p.plan == PrefetchPlan::kFirstLine, base, row_stride_bytes, rows, p.nnz, begin, end,
                                  step);
    // Mean divides by the number of valid rows (weighted: by their weights' sum), as a
    // division: a multiplication by the reciprocal is 1 ulp off nn.EmbeddingBag a quarter of
    // the time. A bag with no valid row keeps the zeros it started with; a weighted one whose
    // valid weights sum to zero pools to zeros too.
    const acc_t divisor = p.mode == BagMode::kMeanOfLength ? static_cast<acc_t>(end - begin)
                          : kWeighted                       ? weight_sum
                                                            : static_cast<acc_t>(valid);
    const bool divide = (p.mode == BagMode::kMean && valid > 0) || (p.mode == BagMode::kMeanOfLength && end > begin);
    if (divide && divisor == acc_t(0)) columns.clear();
    columns.store(out_row + col, divide && divisor != acc_t(0) ? &divisor : nullptr, p.stream_out);
  }
}

/// The bags [first_bag, last_bag) of a dim that one pass of Columns covers whole: the bag
/// loop with that pass alone, no choice among the passes per bag.
template <bool kWeighted, bool kMax, int kBytes, typename Columns, typename scalar_t, typename index_t>
SPARSEKIT_ALWAYS_INLINE void pool_bag_range_one_pass(const BagProblem<scalar_t, index_t>& p, int64_t first_bag,
                                                     int64_t last_bag) {
  const int64_t* const offsets = p.offsets;
  const int64_t num_offsets = p.num_offsets;
  const int64_t nnz = p.nnz;
  const int64_t bags = p.bags;
  constexpr int64_t dim = Columns::kWidth;
  // pool(begin, end, out_row) pools one bag.
  const auto each_bag = [&](const auto& pool) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
    const int64_t out_stride = p.out_row_stride();
    scalar_t* out_row = p.out_row(first_bag);
    for (int64_t bag = first_bag; bag < last_bag; ++bag, out_row += out_stride) {
      const int64_t begin = offsets[bag];
      const int64_t end = bag_end(offsets, num_offsets, bag, nnz);
      if (C10_UNLIKELY(bag_offsets_bad(bag, bags, begin, end, nnz))) {
        record_first_bad(p.first_bad_bag, bag);
        for (int64_t j = 0; j < dim; ++j) out_row[j] = scalar_t(0);
        continue;
      }
      pool(begin, end, out_row);
    }
  };
  if constexpr (!kWeighted && !kMax) {
    // Sum and mean: the call's values taken once, not once a bag (short bags pay for it).
    const auto sum_bags = [&](const auto& sum) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
      each_bag([&](int64_t begin, int64_t end, scalar_t* out_row)
                   SPARSEKIT_ALWAYS_INLINE_LAMBDA { sum(begin, end, 0, Columns(), out_row); });
    };
    p.padding_row < 0 ? sum_bags(SumPass<false, scalar_t, index_t>(p)) : sum_bags(SumPass<true, scalar_t, index_t>(p));
  } else {
    each_bag([&](int64_t begin, int64_t end, scalar_t* out_row) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, 0, Columns(), out_row);
    });
  }
}

template <bool kWeighted, bool kMax, int kBytes, bool kVectorIsa, typename scalar_t, typename index_t>
SPARSEKIT_ALWAYS_INLINE void pool_bag_range(const BagProblem<scalar_t, index_t>& p, int64_t first_bag,
                                            int64_t last_bag) {
  constexpr int64_t kLanes = AccVec<acc_type<scalar_t>, kBytes>::kLanes;
  // Sixteen accumulator vectors per pass (AVX2: 128 float or 64 double columns, the whole
  // register file; AVX-512: 256 or 128, half of it); the adds take the rows straight from memory, so no register is needed
  // for the loads. Wider dims take several passes over a bag, the later ones hitting L1.
  constexpr int64_t kBlock = 16 * kLanes;
  const int64_t dim = p.dim;
  // A dim of one pass (1, 2, 4, 8 or 16 vectors): its own bag loop.
  const auto one_pass = [&](auto vecs) SPARSEKIT_ALWAYS_INLINE_LAMBDA {
    using Columns = VectorColumns<scalar_t, decltype(vecs)::value, kBytes, kVectorIsa>;
    pool_bag_range_one_pass<kWeighted, kMax, kBytes, Columns>(p, first_bag, last_bag);
  };
  switch (dim / kLanes * (dim % kLanes == 0)) {
    case 1: return one_pass(std::integral_constant<int, 1>{});
    case 2: return one_pass(std::integral_constant<int, 2>{});
    case 4: return one_pass(std::integral_constant<int, 4>{});
    case 8: return one_pass(std::integral_constant<int, 8>{});
    case 16: return one_pass(std::integral_constant<int, 16>{});
    default: break;
  }
  for (int64_t bag = first_bag; bag < last_bag; ++bag) {
    const int64_t begin = p.offsets[bag];
    const int64_t end = bag_end(p.offsets, p.num_offsets, bag, p.nnz);
    scalar_t* out_row = p.out_row(bag);
    if (bag_offsets_bad(bag, p.bags, begin, end, p.nnz)) {
      record_first_bad(p.first_bad_bag, bag);
      for (int64_t j = 0; j < dim; ++j) out_row[j] = scalar_t(0);
      continue;
    }
    if (dim == 0) {
      // No column pass reads the rows: check them here, whatever the width.
      for (int64_t k = begin; k < end; ++k) lookup_valid(p.rows[k], p.num_rows, p.padding_row, k, p.first_bad_position);
      continue;
    }
    int64_t col = 0;
    for (; col + kBlock <= dim; col += kBlock) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, VectorColumns<scalar_t, 16, kBytes, kVectorIsa>(), out_row);
    }
    // The rest in passes of 8, 4, 2 and 1 vectors, then a scalar tail.
    if (col + 8 * kLanes <= dim) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, VectorColumns<scalar_t, 8, kBytes, kVectorIsa>(), out_row);
      col += 8 * kLanes;
    }
    if (col + 4 * kLanes <= dim) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, VectorColumns<scalar_t, 4, kBytes, kVectorIsa>(), out_row);
      col += 4 * kLanes;
    }
    if (col + 2 * kLanes <= dim) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, VectorColumns<scalar_t, 2, kBytes, kVectorIsa>(), out_row);
      col += 2 * kLanes;
    }
    if (col + kLanes <= dim) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, VectorColumns<scalar_t, 1, kBytes, kVectorIsa>(), out_row);
      col += kLanes;
    }
    if (col < dim) {
      pool_rows<kWeighted, kMax, kBytes>(p, begin, end, col, TailColumns<scalar_t>(dim - col), out_row);
    }
  }
}

template <bool kWeighted, bool kMax, typename scalar_t, typename index_t>
SPARSEKIT_TARGET_AVX512 void pool_bag_range_avx512(const BagProblem<scalar_t, index_t>& p, int64_t first_bag,
                                                   int64_t last_bag) {
  pool_bag_range<kWeighted, kMax, 64, true>(p, first_bag, last_bag);
  if (p.stream_out) stores_done();
}

template <bool kWeighted, bool kMax, typename scalar_t, typename index_t>
SPARSEKIT_TARGET_AVX2 void pool_bag_range_avx2(const BagProblem<scalar_t, index_t>& p, int64_t first_bag,
                                               int64_t last_bag) {
  pool_bag_range<kWeighted, kMax, 32, true>(p, first_bag, last_bag);
  if (p.stream_out) stores_done();
}

template <bool kWeighted, bool kMax, typename scalar_t, typename index_t>
void pool_bag_range_baseline(const BagProblem<scalar_t, index_t>& p, int64_t first_bag, int64_t last_bag) {
  pool_bag_range<kWeighted, kMax, 32, false>(p, first_bag, last_bag);
}

/// The chooser of the calls with rows of `row_bytes`: 8-15 lines, 16 or more.
PlanChooser& plan_chooser(int64_t row_bytes) {
  static PlanChooser choosers[2];
  return choosers[row_bytes >= 16 * 64 ? 1 : 0];
}

/// True when rows[0, nnz) look skewed: more than kSkewedRepeats repeats among kSkewSample
/// lookups spread over the call. Such calls read many rows from the caches, where the
/// first-line plan loses: they keep every line and stay out of the chooser's timings.
template <typename index_t>
bool rows_look_skewed(const index_t* rows, int64_t nnz) {
  constexpr int kSkewSample = 256;
  constexpr int kSkewedRepeats = 8;
  std::array<int64_t, kSkewSample> sample;
  for (int i = 0; i < kSkewSample; ++i) sample[i] = static_cast<int64_t>(rows[nnz / kSkewSample * i]);
  std::sort(sample.begin(), sample.end());
  int repeats = 0;
  for (int i = 1; i < kSkewSample; ++i) repeats += sample[i] == sample[i - 1];
  return repeats > kSkewedRepeats;
}

/// Pools bags [begin, end) of p with the widest vector instructions the CPU and the dim allow:
/// AVX-512 when whole 64-byte vectors of accumulators cover the dim (16 float32 columns);
/// AVX2's passes of 8, 4, 2 and 1 vectors serve other dims better than a scalar tail.
template <typename scalar_t, typename index_t>
void pool_bag_range_dispatch(const BagProblem<scalar_t, index_t>& p, int64_t begin, int64_t end) {
  const bool weighted = p.per_sample_weights != nullptr || p.per_sample_weights_f32 != nullptr;
  const bool max = p.mode == BagMode::kMax;
  const Isa isa = cpu_isa();
  if (isa == Isa::kAvx512 && p.dim % AccVec<acc_type<scalar_t>, 64>::kLanes == 0) {
    max        ? pool_bag_range_avx512<false, true>(p, begin, end)
    : weighted ? pool_bag_range_avx512<true, false>(p, begin, end)
               : pool_bag_range_avx512<false, false>(p, begin, end);
  } else if (isa >= Isa::kAvx2) {
    max        ? pool_bag_range_avx2<false, true>(p, begin, end)
    : weighted ? pool_bag_range_avx2<true, false>(p, begin, end)
               : pool_bag_range_avx2<false, false>(p, begin, end);
  } else {
    max        ? pool_bag_range_baseline<false, true>(p, begin, end)
    : weighted ? pool_bag_range_baseline<true, false>(p, begin, end)
               : pool_bag_range_baseline<false, false>(p, begin, end);
  }
}

template <typename scalar_t, typename index_t>
void pool_bags(const BagProblem<scalar_t, index_t>& p, int64_t bags, int64_t chunk) {
  parallel_chunks(bags, chunk, [&](int64_t begin, int64_t end) { pool_bag_range_dispatch(p, begin, end); });
}

/// Pools every bag of p with the prefetch plan SPARSEKIT_POOL_PREFETCH forces or, for a call
/// that reads at least kPlanMinBytes of rows of kFirstLinePlanLines lines or more on two or
/// more threads, rows that do not look skewed, the one its PlanChooser picks, timed for the
/// chooser (prefetch_plan.h). Every other call prefetches every line.
template <typename scalar_t, typename index_t>
void run_embedding_bag(BagProblem<scalar_t, index_t> p, int64_t bags) {
  // About 64K accumulated elements per chunk: far more work than taking a chunk costs.
  const int64_t per_bag = std::max<int64_t>(1, (p.nnz / std::max<int64_t>(bags, 1) + 1) * p.dim);
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 16) / per_bag);
  const int64_t row_bytes = p.dim * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t bytes = p.nnz * row_bytes;
  p.plan = PrefetchPlan::kEveryLine;
  PlanChooser* chooser = nullptr;
  if (row_bytes >= kFirstLinePlanLines * 64) {
    if (const std::optional<PrefetchPlan> forced = forced_prefetch_plan()) {
      p.plan = *forced;
    } else if (bytes >= kPlanMinBytes && chunk_workers(bags, chunk) >= 2 && !rows_look_skewed(p.rows, p.nnz)) {
      chooser = &plan_chooser(row_bytes);
      p.plan = chooser->pick();
    }
  }
  if (chooser == nullptr) {
    pool_bags(p, bags, chunk);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  pool_bags(p, bags, chunk);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  // A call that met a bad row or offset raises: its time says nothing of the plan.
  if (p.first_bad_bag->load() == kNoBadPosition && p.first_bad_position->load() == kNoBadPosition) {
    chooser->record(p.plan, seconds.count() / static_cast<double>(bytes));
  }
}

}  // namespace
}  // namespace sparsekit

#pragma once
// The pooled read's lookups grouped by row, which its gradient (pooled_read_backward) and its
// fused update (pooled_read_update_) both need: each lookup checked and given a code, then
// the distinct rows and, per row, its lookups in position order. Defined in pooled_rows_cpu.cpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "pooled.h"

namespace sparsekit {

/// A call's rows, offsets and per-sample weights made contiguous, and their data (psw_ptr
/// null without weights).
struct LookupInputs {
  Tensor rows, offsets, psw;
  const int64_t* rows_ptr;
  const int64_t* offsets_ptr;
  const float* psw_ptr;

  LookupInputs(const Tensor& rows_in, const Tensor& offsets_in, const std::optional<Tensor>& psw_in)
      : rows(as_contiguous(rows_in)),
        offsets(as_contiguous(offsets_in)),
        psw(psw_in.has_value() ? as_contiguous(*psw_in) : Tensor()),
        rows_ptr(rows.const_data_ptr<int64_t>()),
        offsets_ptr(offsets.const_data_ptr<int64_t>()),
        psw_ptr(psw_in.has_value() ? psw.const_data_ptr<float>() : nullptr) {}
};

/// @brief Reports the first bad bag and the first bad lookup a pass recorded: into `errors`
/// when the caller gives it (see pooled.h), else raised (the bag first).
void report_pooled_errors(const char* op, int64_t bad_bag, int64_t bad_position, const PooledLayout& layout,
                          const int64_t* offsets, const int64_t* rows, const std::optional<Tensor>& errors);

/// @brief With no bag, offsets must be [0] and there must be no lookup (else bag 0 is bad).
void check_no_bags(const char* op, const PooledLayout& layout, const int64_t* offsets,
                   const std::optional<Tensor>& errors);

/// The lookups of a call, checked: each one's code (-1: skipped), the address of its bag's
/// output gradient row, and its bag's length for a mean feature (else 0).
struct IndexedLookups {
  // Written for every lookup in a valid bag (the others have code -1 and are never read):
  // left uninitialised rather than filled first.
  std::unique_ptr<int64_t[]> grad_at;
  std::unique_ptr<int64_t[]> mean_length;  // null when no feature is a mean
  Tensor codes;
  std::vector<int64_t> bases;  // each table's first code, then the codes' bound
  // Per table, the position ranges [begin, end) that hold its lookups: its features' values
  // (all of [0, nnz) for every table when some bag is bad: those bounds are not to be trusted).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> spans;
};

/// @brief Checks offsets and rows (raising for the first bad bag or lookup, before the
/// caller changes anything; with `errors`, recording them there and leaving them out) and
/// gives every lookup its code, its bag's gradient row and its mean's length.
IndexedLookups index_lookups(const char* op, const PooledLayout& layout, const int64_t* offsets, const int64_t* rows,
                             const std::vector<Tensor>& grads, const Device& device,
                             const std::optional<Tensor>& errors);

/// The distinct rows a call's lookups read, table after table and ascending within a table
/// (rank r is the r-th of them), where each table's rows lie in a values block whose rows are
/// their table's dim wide, and each row's lookups in position order: slots [start[r],
/// start[r + 1]) are rank r's (lookups in no valid bag are left out). A slot holds the
/// lookup's gradient row and, where a mean or a weight scales it, the lookup itself: read in
/// slot order, neither is then a random read of the per-lookup arrays.
struct RowGroups {
  Tensor distinct;                   // int64 [U]: the rows' codes
  std::vector<int64_t> table_first;  // [T + 1]: table t's rows are ranks [table_first[t], table_first[t + 1])
  std::vector<int64_t> value_start;  // [T + 1]: where table t's rows start in the values block
  std::vector<int64_t> start;        // [U + 1]
  std::vector<int64_t> source;       // the address of each slot's output-gradient row
  std::vector<int64_t> order;        // each slot's lookup, or empty when no lookup is scaled
};

/// @brief Groups the lookups by row (`op` names the caller in an out-of-memory error). The
/// result does not depend on the thread count.
RowGroups group_rows(const char* op, const IndexedLookups& lookups, const PooledLayout& layout, bool scaled);

/// Four float32 lanes: SSE registers on any x86-64, NEON on arm64 (GCC's vector extension).
typedef float Float4 __attribute__((vector_size(16)));

/// @brief g[0, dim) = the sum of float32 rows (at the addresses source[first, last)), each
/// column's in slot order from 0, as a plain loop adds them (the same numbers): 32 columns'
/// running sums at a time stay in registers, where a loop over g sends each sum to memory and
/// back once a row.
inline void sum_float_rows(float* g, int64_t dim, const int64_t* source, int64_t first, int64_t last) {
  const auto at = [source](int64_t q, int64_t j) {
    Float4 v;
    std::memcpy(&v, reinterpret_cast<const float*>(source[q]) + j, sizeof(v));
    return v;
  };
  int64_t j = 0;
  for (; j + 32 <= dim; j += 32) {
    Float4 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
    for (int64_t q = first; q < last; ++q) {
      a0 += at(q, j), a1 += at(q, j + 4), a2 += at(q, j + 8), a3 += at(q, j + 12);
      a4 += at(q, j + 16), a5 += at(q, j + 20), a6 += at(q, j + 24), a7 += at(q, j + 28);
    }
    const Float4 sums[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    std::memcpy(g + j, sums, sizeof(sums));
  }
  for (; j + 4 <= dim; j += 4) {
    Float4 a = {};
    for (int64_t q = first; q < last; ++q) a += at(q, j);
    std::memcpy(g + j, &a, sizeof(a));
  }
  for (; j < dim; ++j) {
    float a = 0.0f;
    for (int64_t q = first; q < last; ++q) a += reinterpret_cast<const float*>(source[q])[j];
    g[j] = a;
  }
}

/// @brief g[0, dim) = the summed output gradient of rank r's lookups, in lookup order: each
/// its bag's gradient columns, divided by the bag's length for a mean feature, then times its
/// per-sample weight (the backward of the forward's weighted sum, then mean).
template <typename acc_t, typename grad_t>
inline void sum_row(acc_t* g, int64_t dim, const RowGroups& groups, int64_t r, const IndexedLookups& lookups,
                    const float* psw) {
  const int64_t first = groups.start[r], last = groups.start[r + 1];
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<grad_t, float>) {
    if (groups.order.empty()) {
      sum_float_rows(g, dim, groups.source.data(), first, last);
      return;
    }
  }
  std::fill(g, g + dim, acc_t(0));
  if (groups.order.empty()) {
    for (int64_t q = first; q < last; ++q) {
      const grad_t* src = reinterpret_cast<const grad_t*>(groups.source[q]);
      for (int64_t j = 0; j < dim; ++j) g[j] += static_cast<acc_t>(src[j]);
    }
    return;
  }
  const int64_t* mean_length = lookups.mean_length.get();
  for (int64_t q = first; q < last; ++q) {
    const int64_t k = groups.order[q];
    const grad_t* src = reinterpret_cast<const grad_t*>(groups.source[q]);
    const int64_t bag_length = mean_length != nullptr ? mean_length[k] : 0;
    if (bag_length == 0 && psw == nullptr) {
      for (int64_t j = 0; j < dim; ++j) g[j] += static_cast<acc_t>(src[j]);
      continue;
    }
    const acc_t length = static_cast<acc_t>(bag_length);
    const acc_t w = psw != nullptr ? static_cast<acc_t>(psw[k]) : acc_t(1);
    for (int64_t j = 0; j < dim; ++j) {
      acc_t x = static_cast<acc_t>(src[j]);
      if (bag_length != 0) x = x / length;
      if (psw != nullptr) x = x * w;
      g[j] += x;
    }
  }
}

/// Whether some lookup's gradient is scaled: a mean feature's, or any with per-sample weights.
inline bool lookups_scaled(const PooledLayout& layout, const float* psw) {
  return psw != nullptr ||
         std::any_of(layout.feature_means.begin(), layout.feature_means.end(), [](int64_t m) { return m != 0; });
}

/// Table of rank r (table_first is ascending, [T + 1]).
inline int64_t table_of_rank(const RowGroups& groups, int64_t r) {
  return std::upper_bound(groups.table_first.begin(), groups.table_first.end(), r) - groups.table_first.begin() - 1;
}

/// Rows per task of a loop over distinct rows: about 64 KiB of rows.
inline int64_t row_grain(const PooledLayout& layout) {
  const int64_t widest = std::max<int64_t>(1, *std::max_element(layout.table_dims.begin(), layout.table_dims.end()));
  return std::max<int64_t>(1, 16384 / widest);
}

}  // namespace sparsekit

// CPU kernels of the collection's pooled read (pooled_read), its gradient grouped by row
// (pooled_read_backward) and the fused optimizer step that applies that gradient in place
// (pooled_read_update_); the layout is described in pooled.h. Each distinct row sums its
// lookups' output gradients in position order, so the sums, and the updates made of them,
// do not depend on the thread count.
// 32-byte vector arguments of the pooling loops' always_inline helpers never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu/adam_row.h"
#include "cpu/grouping.h"
#include "cpu/half_rows.h"
#include "cpu/pool_loops.h"
#include "pooled.h"

namespace sparsekit {
namespace {

/// About this many accumulated elements per chunk of the read: far more work than taking a
/// chunk costs (embedding_bag's rule).
constexpr int64_t kChunkElements = int64_t{1} << 16;
/// Lookups per piece of the indexing pass.
constexpr int64_t kBagGrain = int64_t{1} << 12;

/// @brief The call's output, zeroed where no feature of the call writes.
Tensor pooled_output(const PooledLayout& layout, const Device& device) {
  int64_t covered = 0;
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = layout.feature_tables[f];
    if (t >= 0) covered += layout.table_dims[t];
  }
  return covered == layout.total_dim ? empty({layout.batch, layout.total_dim}, layout.dtype, device)
                                     : zeros({layout.batch, layout.total_dim}, layout.dtype, device);
}

/// @brief Reports the first bad bag and the first bad lookup a pass recorded: into `errors`
/// when the caller gives it (see pooled.h), else raised (the bag first).
void report_pooled_errors(const char* op, int64_t bad_bag, int64_t bad_position, const PooledLayout& layout,
                          const int64_t* offsets, const int64_t* rows, const std::optional<Tensor>& errors) {
  if (errors.has_value()) {
    int64_t* slots = errors->mutable_data_ptr<int64_t>();
    slots[0] = std::min(slots[0], bad_bag);
    slots[1] = std::min(slots[1], bad_position);
    return;
  }
  const int64_t bags = layout.num_features * layout.batch;
  if (bad_bag != kNoBadPosition) {
    const int64_t end = bad_bag + 1 <= bags ? offsets[bad_bag + 1] : layout.nnz;
    fail(pooled_offsets_message(op, bad_bag, offsets[bad_bag], end, layout.nnz));
  }
  if (bad_position != kNoBadPosition) {
    // The bag of the bad lookup names its table: the last bag starting at or before it.
    const int64_t* bag_end = std::upper_bound(offsets, offsets + bags + 1, bad_position);
    const int64_t bag = std::max<int64_t>(0, (bag_end - offsets) - 1);
    const int64_t t = layout.feature_tables[std::min(bag, bags - 1) / std::max<int64_t>(layout.batch, 1)];
    fail(pooled_row_message(op, bad_position, rows[bad_position], t, t >= 0 ? layout.table_rows[t] : 0));
  }
}

/// @brief With no bag, offsets must be [0] and there must be no lookup (else bag 0 is bad).
void check_no_bags(const char* op, const PooledLayout& layout, const int64_t* offsets,
                   const std::optional<Tensor>& errors) {
  if (errors.has_value()) {
    if (layout.nnz != 0 || offsets[0] != 0) report_pooled_errors(op, 0, kNoBadPosition, layout, offsets, nullptr, errors);
    return;
  }
  SK_CHECK(layout.nnz == 0 && offsets[0] == 0, op,
           ": a batch of no bags (B = 0) must have no values and offsets [0]; got nnz = ", layout.nnz);
}

}  // namespace

Tensor pooled_read_cpu(const std::vector<Tensor>& weights_in, const Tensor& rows_in, const Tensor& offsets_in,
                       const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                       std::vector<int64_t> feature_columns, std::vector<int64_t> feature_means, int64_t total_dim,
                       const std::optional<Tensor>& errors) {
  const char* op = "pooled_read";
  const PooledLayout layout = check_pooled_args(op, weights_in, rows_in, offsets_in, per_sample_weights_in,
                                                feature_tables, feature_columns, feature_means, total_dim);
  std::vector<Tensor> weights;
  for (const Tensor& w : weights_in) weights.push_back(rows_stride_ready(w));
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  Tensor out = pooled_output(layout, weights[0].device());
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const int64_t* rows_ptr = rows.const_data_ptr<int64_t>();
  check_error_slots(op, errors, weights[0].device());
  if (layout.batch == 0) {
    check_no_bags(op, layout, offsets_ptr, errors);
    return out;
  }
  const int64_t bags = layout.num_features * layout.batch;
  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_cpu", [&] {
    std::vector<BagProblem<scalar_t, int64_t>> problems;
    struct Chunk {
      size_t problem;
      int64_t begin, end;
    };
    std::vector<Chunk> chunks;
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    for (int64_t f = 0; f < layout.num_features; ++f) {
      const int64_t t = layout.feature_tables[f];
      if (t < 0) continue;
      const int64_t dim = layout.table_dims[t];
      BagProblem<scalar_t, int64_t> p{weights[t].const_data_ptr<scalar_t>(),
                                      weights[t].stride(0),
                                      layout.table_rows[t],
                                      dim,
                                      rows_ptr,
                                      offsets_ptr,
                                      bags + 1,
                                      bags,
                                      layout.nnz,
                                      -1,
                                      nullptr,
                                      layout.feature_means[f] ? BagMode::kMeanOfLength : BagMode::kSum,
                                      out_ptr + layout.feature_columns[f],
                                      false,
                                      PrefetchPlan::kEveryLine,
                                      &first_bad_bag,
                                      &first_bad_position};
      p.out_stride = layout.total_dim;
      p.out_first_bag = f * layout.batch;
      p.per_sample_weights_f32 = psw_ptr;
      // The feature's lookups per bag, read from offsets that may still be bad: clamped,
      // they only size the chunks.
      const int64_t first = std::clamp<int64_t>(offsets_ptr[f * layout.batch], 0, layout.nnz);
      const int64_t last = std::clamp<int64_t>(offsets_ptr[(f + 1) * layout.batch], first, layout.nnz);
      const int64_t per_bag = ((last - first) / layout.batch + 1) * std::max<int64_t>(dim, 1);
      const int64_t chunk = std::max<int64_t>(1, kChunkElements / per_bag);
      problems.push_back(p);
      for (int64_t b = f * layout.batch; b < (f + 1) * layout.batch; b += chunk) {
        chunks.push_back({problems.size() - 1, b, std::min(b + chunk, (f + 1) * layout.batch)});
      }
    }
    parallel_chunks(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        pool_bag_range_dispatch(problems[chunks[c].problem], chunks[c].begin, chunks[c].end);
      }
    });
  });
  report_pooled_errors(op, first_bad_bag.load(), first_bad_position.load(), layout, offsets_ptr, rows_ptr, errors);
  return out;
}

namespace {

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

/// @brief Calls fn(f, begin, end) for the bags [begin, end) cut at the features' bounds
/// (feature f's bags are f * B ... (f + 1) * B - 1): one division a feature, not a bag.
template <typename F>
void for_each_feature_span(const PooledLayout& layout, int64_t begin, int64_t end, const F& fn) {
  while (begin < end) {
    const int64_t f = begin / layout.batch;
    const int64_t stop = std::min(end, (f + 1) * layout.batch);
    fn(f, begin, stop);
    begin = stop;
  }
}

/// @brief Checks offsets and rows (raising for the first bad bag or lookup, before the
/// caller changes anything; with `errors`, recording them there and leaving them out) and
/// gives every lookup its bag and its code.
IndexedLookups index_lookups(const char* op, const PooledLayout& layout, const int64_t* offsets, const int64_t* rows,
                             const std::vector<Tensor>& grads, const Device& device,
                             const std::optional<Tensor>& errors) {
  IndexedLookups out;
  const int64_t bags = layout.num_features * layout.batch;
  const size_t num_tables = layout.table_rows.size();
  out.grad_at.reset(new int64_t[static_cast<size_t>(layout.nnz)]);
  const bool any_mean =
      std::any_of(layout.feature_means.begin(), layout.feature_means.end(), [](int64_t m) { return m != 0; });
  if (any_mean) out.mean_length.reset(new int64_t[static_cast<size_t>(layout.nnz)]);
  out.codes = empty({layout.nnz}, kLong, device);
  int64_t* codes = out.codes.mutable_data_ptr<int64_t>();
  // Bad offsets leave lookups in no bag: with errors recorded they stay out of every group.
  if (errors.has_value()) std::fill(codes, codes + layout.nnz, int64_t{-1});
  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  const int64_t per_bag = std::max<int64_t>(1, layout.nnz / std::max<int64_t>(bags, 1));
  const int64_t bag_chunk = std::max<int64_t>(1, kBagGrain / per_bag);
  // Pass 1: the checks, each lookup's bag, and each table's highest row read. The codes
  // then span the rows read, not the tables' capacities: a hash table's rows in use are
  // few beside its capacity, and a small code space lets the grouping use its bitmap.
  std::vector<std::atomic<int64_t>> highest(num_tables);
  for (auto& h : highest) h.store(-1, std::memory_order_relaxed);
  parallel_chunks(bags, bag_chunk, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine(num_tables, -1);
    for_each_feature_span(layout, begin, end, [&](int64_t f, int64_t span_begin, int64_t span_end) {
      const int64_t t = layout.feature_tables[f];
      const int64_t num_rows = t >= 0 ? layout.table_rows[t] : 0;
      int64_t top = t >= 0 ? mine[t] : -1;
      for (int64_t bag = span_begin; bag < span_end; ++bag) {
        const int64_t first = offsets[bag], last = offsets[bag + 1];
        if (C10_UNLIKELY(bag_offsets_bad(bag, bags, first, last, layout.nnz))) {
          record_first_bad(&first_bad_bag, bag);
          continue;
        }
        for (int64_t k = first; k < last; ++k) {
          const int64_t row = rows[k];
          if (t < 0 || row == -1) continue;
          if (C10_LIKELY(row_in_range(row, num_rows))) {
            top = std::max(top, row);
          } else {
            record_first_bad(&first_bad_position, k);
          }
        }
      }
      if (t >= 0) mine[t] = top;
    });
    for (size_t t = 0; t < num_tables; ++t) {
      int64_t seen = highest[t].load(std::memory_order_relaxed);
      while (mine[t] > seen && !highest[t].compare_exchange_weak(seen, mine[t], std::memory_order_relaxed)) {
      }
    }
  });
  report_pooled_errors(op, first_bad_bag.load(), first_bad_position.load(), layout, offsets, rows, errors);
  out.spans.resize(num_tables);
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = layout.feature_tables[f];
    if (t < 0) continue;
    if (first_bad_bag.load() != kNoBadPosition) {
      if (out.spans[t].empty()) out.spans[t].emplace_back(0, layout.nnz);
      continue;
    }
    out.spans[t].emplace_back(offsets[f * layout.batch], offsets[(f + 1) * layout.batch]);
  }
  out.bases.assign(num_tables + 1, 0);
  for (size_t t = 0; t < num_tables; ++t) out.bases[t + 1] = out.bases[t] + highest[t].load() + 1;
  // Pass 2: the codes (a bad bag's lookups keep -1 from above), and where each lookup's
  // gradient comes from (worked out once a bag, so the sums divide nothing per lookup).
  int64_t* grad_at = out.grad_at.get();
  int64_t* mean_length = out.mean_length.get();
  parallel_chunks(bags, bag_chunk, [&](int64_t begin, int64_t end) {
    for_each_feature_span(layout, begin, end, [&](int64_t f, int64_t span_begin, int64_t span_end) {
      const int64_t t = layout.feature_tables[f];
      const int64_t num_rows = t >= 0 ? layout.table_rows[t] : 0;
      const int64_t base = t >= 0 ? out.bases[t] : 0;
      const bool mean = layout.feature_means[f] != 0;
      const int64_t row_bytes = t >= 0 ? grads[f].stride(0) * static_cast<int64_t>(grads[f].element_size()) : 0;
      int64_t at = t >= 0 ? reinterpret_cast<int64_t>(grads[f].const_data_ptr()) +
                                (span_begin - f * layout.batch) * row_bytes
                          : 0;
      for (int64_t bag = span_begin; bag < span_end; ++bag, at += row_bytes) {
        const int64_t first = offsets[bag], last = offsets[bag + 1];
        if (C10_UNLIKELY(bag_offsets_bad(bag, bags, first, last, layout.nnz))) continue;
        const int64_t length = mean ? last - first : 0;
        for (int64_t k = first; k < last; ++k) {
          const int64_t row = rows[k];
          codes[k] = t >= 0 && row_in_range(row, num_rows) ? base + row : -1;
          grad_at[k] = at;
          if (mean_length != nullptr) mean_length[k] = length;
        }
      }
    });
  });
  return out;
}

/// Loads one element of the output gradient widened to the sums' type.
template <typename acc_t, typename grad_t>
inline acc_t widened(const grad_t* p) {
  return static_cast<acc_t>(*p);
}

/// The distinct rows a call's lookups read, table after table and ascending within a table,
/// each lookup's place among them, and where each table's rows lie in a values block whose
/// rows are their table's dim wide.
struct RowRanks {
  RankedCodes ranked;
  std::vector<int64_t> table_first;  // [T + 1]: table t's distinct rows are ranks [table_first[t], table_first[t + 1])
  std::vector<int64_t> value_start;  // [T + 1]: where table t's rows start in the values block
};

RowRanks rank_rows(const IndexedLookups& lookups, const PooledLayout& layout) {
  RowRanks out;
  out.ranked = rank_codes(lookups.codes, lookups.bases.back(), lookups.bases);
  const int64_t* distinct = out.ranked.distinct.const_data_ptr<int64_t>();
  const int64_t num_distinct = out.ranked.distinct.size(0);
  const size_t num_tables = layout.table_dims.size();
  out.table_first.resize(num_tables + 1);
  out.value_start.assign(num_tables + 1, 0);
  for (size_t t = 0; t <= num_tables; ++t) {
    out.table_first[t] = std::lower_bound(distinct, distinct + num_distinct, lookups.bases[t]) - distinct;
  }
  for (size_t t = 0; t < num_tables; ++t) {
    out.value_start[t + 1] = out.value_start[t] + (out.table_first[t + 1] - out.table_first[t]) * layout.table_dims[t];
  }
  return out;
}

/// Each distinct row's lookups, in lookup order: slots [start[r], start[r + 1]) are rank r's
/// (a stable counting sort by rank; lookups in no valid bag are left out). Each slot holds
/// the lookup's gradient row and, where a mean or a weight scales it, the lookup itself:
/// read in slot order, neither is then a random read of the per-lookup arrays.
struct RowLookups {
  std::vector<int64_t> start;   // [U + 1]
  std::vector<int64_t> source;  // the address of each slot's output-gradient row
  std::vector<int64_t> order;   // each slot's lookup, or empty when no lookup is scaled
};

/// @brief Groups the lookups by rank. The ranks are cut into parts that never cross a table
/// (a big table's into several); a part's worker scans only its table's positions, in order,
/// so the sort is stable whatever the threads, and the counters and slots it touches are one
/// table's, where a part spanning many tables touched theirs all over (bench_torchrec's
/// training cells: the grouping 20-30% faster at 26 tables).
RowLookups group_lookups(const RowRanks& ranks, const IndexedLookups& lookups, int64_t n, bool scaled) {
  const int64_t num_distinct = ranks.ranked.distinct.size(0);
  const int64_t* rank = ranks.ranked.rank.const_data_ptr<int64_t>();
  RowLookups out;
  out.start.assign(static_cast<size_t>(num_distinct) + 1, 0);
  if (n == 0 || num_distinct == 0) return out;
  // A part per table while the tables are enough to share among the threads. Else a table is
  // cut into parts of at least kMinRowsPerPart ranks, as many as the threads at most: each
  // scans all the table's lookups, and the test of a lookup's rank against its part's range
  // is then a branch the CPU cannot predict, which one part per table never takes.
  constexpr int64_t kMinRowsPerPart = 4096;
  struct Part {
    int64_t table, low, high;
  };
  std::vector<Part> parts;
  const int64_t threads = num_threads();
  int64_t tables_read = 0;
  for (size_t t = 0; t + 1 < ranks.table_first.size(); ++t) {
    tables_read += ranks.table_first[t + 1] > ranks.table_first[t] ? 1 : 0;
  }
  const bool cut = tables_read < 2 * threads;
  for (size_t t = 0; t + 1 < ranks.table_first.size(); ++t) {
    const int64_t low = ranks.table_first[t], high = ranks.table_first[t + 1];
    if (high == low) continue;
    const int64_t pieces = cut ? std::max<int64_t>(1, std::min(threads, (high - low) / kMinRowsPerPart)) : 1;
    for (int64_t p = 0; p < pieces; ++p) {
      parts.push_back({static_cast<int64_t>(t), low + (high - low) * p / pieces, low + (high - low) * (p + 1) / pieces});
    }
  }
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  std::vector<int64_t> count(static_cast<size_t>(num_distinct), 0);
  std::vector<int64_t> part_first(static_cast<size_t>(num_parts) + 1, 0);
  // Calls fn(k, r) for each of part's lookups k (rank r), in position order.
  const auto each_lookup = [&](const Part& part, const auto& fn) {
    for (const auto& [begin, end] : lookups.spans[static_cast<size_t>(part.table)]) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t r = rank[k];
        if (r >= part.low && r < part.high) fn(k, r);
      }
    }
  };
  parallel_for(0, num_parts, 1, [&](int64_t first_part, int64_t last_part) {
    for (int64_t p = first_part; p < last_part; ++p) {
      int64_t total = 0;
      each_lookup(parts[p], [&](int64_t, int64_t r) {
        ++count[r];
        ++total;
      });
      part_first[p + 1] = total;
    }
  });
  for (int64_t p = 0; p < num_parts; ++p) part_first[p + 1] += part_first[p];
  out.source.resize(static_cast<size_t>(part_first[num_parts]));
  if (scaled) out.order.resize(out.source.size());
  int64_t* start = out.start.data();
  int64_t* source = out.source.data();
  int64_t* order = scaled ? out.order.data() : nullptr;
  const int64_t* grad_at = lookups.grad_at.get();
  parallel_for(0, num_parts, 1, [&](int64_t first_part, int64_t last_part) {
    for (int64_t p = first_part; p < last_part; ++p) {
      const Part& part = parts[p];
      // The parts tile the ranks in order: this one's slots begin after every earlier part's.
      int64_t at = part_first[p];
      for (int64_t r = part.low; r < part.high; ++r) {
        const int64_t c = count[r];
        count[r] = at;  // from here on: the rank's next free slot
        at += c;
        start[r + 1] = at;
      }
      each_lookup(part, [&](int64_t k, int64_t r) {
        const int64_t slot = count[r]++;
        source[slot] = grad_at[k];
        if (order != nullptr) order[slot] = k;
      });
    }
  });
  return out;
}

/// @brief g[0, dim) = the summed output gradient of rank r's lookups, in lookup order: each
/// its bag's gradient columns, divided by the bag's length for a mean feature, then times its
/// per-sample weight (the backward of the forward's weighted sum, then mean).
template <typename acc_t, typename grad_t>
inline void sum_row(acc_t* g, int64_t dim, const RowLookups& groups, int64_t r, const IndexedLookups& lookups,
                    const float* psw) {
  std::fill(g, g + dim, acc_t(0));
  const int64_t first = groups.start[r], last = groups.start[r + 1];
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
inline int64_t table_of_rank(const RowRanks& ranks, int64_t r) {
  return std::upper_bound(ranks.table_first.begin(), ranks.table_first.end(), r) - ranks.table_first.begin() - 1;
}

/// Rows per task of the update loop: about 64 KiB of rows.
int64_t row_grain(const PooledLayout& layout) {
  const int64_t widest = std::max<int64_t>(1, *std::max_element(layout.table_dims.begin(), layout.table_dims.end()));
  return std::max<int64_t>(1, 16384 / widest);
}

/// @brief The summed gradient of every distinct row, in RowRanks' layout (float32, float64
/// for float64 weights), each row written once, in rank order.
Tensor row_gradients(const RowRanks& ranks, const IndexedLookups& lookups, const PooledLayout& layout,
                     const float* psw, const Device& device) {
  const ScalarType value_dtype = layout.dtype == kDouble ? kDouble : kFloat;
  Tensor values = empty({ranks.value_start.back()}, value_dtype, device);
  const RowLookups groups = group_lookups(ranks, lookups, layout.nnz, lookups_scaled(layout, psw));
  const int64_t num_distinct = ranks.ranked.distinct.size(0);
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_row_gradients", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    acc_t* values_ptr = values.mutable_data_ptr<acc_t>();
    parallel_for(0, num_distinct, row_grain(layout), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = table_of_rank(ranks, r);
        const int64_t dim = layout.table_dims[t];
        sum_row<acc_t, scalar_t>(values_ptr + ranks.value_start[t] + (r - ranks.table_first[t]) * dim, dim, groups,
                                 r, lookups, psw);
      }
    });
  });
  return values;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> pooled_read_backward_cpu(
    const std::vector<Tensor>& grads_in, const std::vector<Tensor>& weights, const Tensor& rows_in,
    const Tensor& offsets_in, const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
    std::vector<int64_t> feature_means, const std::optional<Tensor>& errors, std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_backward";
  const PooledLayout layout = check_pooled_backward_args(op, weights, rows_in, offsets_in, per_sample_weights_in,
                                                         feature_tables, feature_means);
  const Device device = weights[0].device();
  const std::vector<Tensor> grads = feature_grad_views(op, grads_in, grad_columns, layout);
  check_pooled_grads(op, grads, layout, device);
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const size_t num_tables = weights.size();
  check_error_slots(op, errors, device);
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, rows.const_data_ptr<int64_t>(), grads, device, errors);
  const RowRanks ranks = rank_rows(lookups, layout);
  Tensor values = row_gradients(ranks, lookups, layout, psw_ptr, device);
  const int64_t num_distinct = ranks.ranked.distinct.size(0);
  Tensor out_rows = empty({num_distinct}, kLong, device);
  Tensor per_table = empty({static_cast<int64_t>(num_tables)}, kLong, device);
  const int64_t* distinct = ranks.ranked.distinct.const_data_ptr<int64_t>();
  int64_t* rows_out = out_rows.mutable_data_ptr<int64_t>();
  for (size_t t = 0; t < num_tables; ++t) {
    per_table.mutable_data_ptr<int64_t>()[t] = ranks.table_first[t + 1] - ranks.table_first[t];
    for (int64_t r = ranks.table_first[t]; r < ranks.table_first[t + 1]; ++r) rows_out[r] = distinct[r] - lookups.bases[t];
  }
  return {out_rows, per_table, values};
}

namespace {

/// The numbers of one table's update.
struct TableUpdate {
  AdamScalars<float> adam;
  AdamScalars<double> adam64;
  bool read;  // a feature of the call reads the table: its step counts
};

template <typename acc_t>
const AdamScalars<acc_t>& adam_scalars_of(const TableUpdate& table);
template <>
const AdamScalars<float>& adam_scalars_of<float>(const TableUpdate& table) {
  return table.adam;
}
template <>
const AdamScalars<double>& adam_scalars_of<double>(const TableUpdate& table) {
  return table.adam64;
}

/// @brief Row-wise Adagrad (FBGEMM's exact one: one accumulator per row, of the row's mean
/// squared gradient), first part: adds the L2 decay to g and returns mean(g^2). Eight partial
/// sums in a fixed order, not one chain of dim dependent adds: the sum vectorises and is the
/// same whatever the threads (bench_torchrec's training cells).
template <typename acc_t>
inline acc_t rowwise_mean_square(const acc_t* w, acc_t* g, int64_t dim, const FusedScalars& h) {
  const acc_t decay = static_cast<acc_t>(h.weight_decay);
  if (decay != acc_t(0)) {
    for (int64_t j = 0; j < dim; ++j) g[j] += decay * w[j];
  }
  constexpr int64_t kLanes = 8;
  acc_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += g[j + l] * g[j + l];
  }
  for (int64_t l = 0; j < dim; ++j, ++l) lanes[l] += g[j] * g[j];
  const acc_t squares = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  return squares / static_cast<acc_t>(std::max<int64_t>(dim, 1));
}

/// Row-wise Adagrad's step size for an accumulator that already holds this step's square.
template <typename acc_t>
inline acc_t rowwise_step(acc_t sum, const FusedScalars& h) {
  return static_cast<acc_t>(h.lr) / (std::sqrt(sum) + static_cast<acc_t>(h.eps));
}

template <typename acc_t>
inline void apply_rowwise_step(acc_t* w, const acc_t* g, int64_t dim, acc_t step) {
  for (int64_t j = 0; j < dim; ++j) w[j] -= step * g[j];
}

/// A weight row as its accumulator type where the two are one type (else never called).
template <typename acc_t, typename weight_t>
inline acc_t* as_accumulator(weight_t* row) {
  if constexpr (std::is_same_v<weight_t, acc_t>) {
    return row;
  } else {
    return nullptr;
  }
}

/// @brief Applies the optimizer to one row: `w` (dim values, updated in place; float32 or
/// float64 arithmetic in acc_t), its state s1 / s2 (per optimizer), the summed gradient g.
template <typename acc_t>
void update_row(FusedOptimizer optimizer, acc_t* w, acc_t* s1, acc_t* s2, acc_t* g, int64_t dim,
                const FusedScalars& h, const AdamScalars<acc_t>& adam) {
  switch (optimizer) {
    case FusedOptimizer::kSgd: {
      const acc_t lr = static_cast<acc_t>(h.lr), decay = static_cast<acc_t>(h.weight_decay);
      for (int64_t j = 0; j < dim; ++j) w[j] = w[j] - lr * (decay != acc_t(0) ? g[j] + decay * w[j] : g[j]);
      return;
    }
    case FusedOptimizer::kLazyAdam:
      adam_row<acc_t, acc_t>(w, s1, s2, g, dim, adam, h.weight_decay != 0.0);
      return;
    case FusedOptimizer::kRowWiseAdagrad:
      *s1 += rowwise_mean_square(w, g, dim, h);
      apply_rowwise_step(w, g, dim, rowwise_step(*s1, h));
      return;
    case FusedOptimizer::kAdagrad: {
      // FBGEMM's exact Adagrad (torch.optim.Adagrad without lr decay): a sum of squares per
      // element; the L2 decay added to the gradient first.
      const acc_t lr = static_cast<acc_t>(h.lr), eps = static_cast<acc_t>(h.eps);
      const acc_t decay = static_cast<acc_t>(h.weight_decay);
      for (int64_t j = 0; j < dim; ++j) {
        const acc_t gj = decay != acc_t(0) ? g[j] + decay * w[j] : g[j];
        s1[j] += gj * gj;
        w[j] -= lr * gj / (std::sqrt(s1[j]) + eps);
      }
      return;
    }
  }
}

/// @brief update_row on a weight row of any dtype: a float32 / float64 row in place, a
/// float16 / bfloat16 one widened into `wide`, updated in float32 and rounded to nearest.
template <typename weight_t, typename acc_t>
void update_weight_row(FusedOptimizer optimizer, weight_t* w, acc_t* s1, acc_t* s2, acc_t* g, int64_t dim,
                       const FusedScalars& h, const AdamScalars<acc_t>& adam, std::vector<acc_t>& wide) {
  if constexpr (std::is_same_v<weight_t, acc_t>) {
    update_row(optimizer, w, s1, s2, g, dim, h, adam);
  } else {
    wide.resize(static_cast<size_t>(dim));
    if constexpr (std::is_same_v<weight_t, Half>) {
      widen_half(w, wide.data(), dim);
    } else {
      for (int64_t j = 0; j < dim; ++j) wide[j] = static_cast<acc_t>(w[j]);
    }
    update_row(optimizer, wide.data(), s1, s2, g, dim, h, adam);
    if constexpr (std::is_same_v<weight_t, Half>) {
      narrow_half(wide.data(), w, dim);
    } else {
      for (int64_t j = 0; j < dim; ++j) w[j] = static_cast<weight_t>(wide[j]);
    }
  }
}

}  // namespace

void pooled_read_update_cpu(const std::vector<Tensor>& weights, const std::vector<Tensor>& state1,
                            const std::vector<Tensor>& state2, const std::vector<Tensor>& steps,
                            const std::vector<Tensor>& grads_in, const Tensor& rows_in, const Tensor& offsets_in,
                            const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                            std::vector<int64_t> feature_means,
                            StrArg optimizer_name, std::vector<double> hyper, const std::optional<Tensor>& lr,
                            const std::optional<Tensor>& errors,
                            std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_update_";
  const FusedOptimizer optimizer = parse_fused_optimizer(optimizer_name.value);
  const PooledLayout layout = check_pooled_backward_args(op, weights, rows_in, offsets_in, per_sample_weights_in,
                                                         feature_tables, feature_means);
  const Device device = weights[0].device();
  const std::vector<Tensor> grads = feature_grad_views(op, grads_in, grad_columns, layout);
  check_pooled_grads(op, grads, layout, device);
  FusedScalars h = check_fused_hyper(op, optimizer, hyper);
  check_fused_state(op, optimizer, weights, state1, state2, steps);
  if (lr.has_value()) {
    SK_CHECK(lr->numel() == 1 && (lr->scalar_type() == kFloat || lr->scalar_type() == kDouble) &&
                 lr->device().is_cpu(),
             op, ": lr must be a float32 or float64 tensor of one element on the CPU, got ", lr->scalar_type(),
             " of shape ", lr->sizes(), " on ", lr->device());
    h.lr = lr->scalar_type() == kFloat ? static_cast<double>(*lr->const_data_ptr<float>())
                                       : *lr->const_data_ptr<double>();
    SK_CHECK(h.lr >= 0.0, op, ": lr must be >= 0, got ", h.lr);
  }
  std::vector<TensorUse> uses;
  for (size_t t = 0; t < weights.size(); ++t) uses.push_back({&weights[t], "weights", t, true});
  for (size_t t = 0; t < state1.size(); ++t) uses.push_back({&state1[t], "state1", t, true});
  for (size_t t = 0; t < state2.size(); ++t) uses.push_back({&state2[t], "state2", t, true});
  for (size_t t = 0; t < steps.size(); ++t) uses.push_back({&steps[t], "steps", t, true});
  for (size_t f = 0; f < grads.size(); ++f) {
    if (layout.feature_tables[f] >= 0) uses.push_back({&grads[f], "grads", f, false});
  }
  uses.push_back({&rows_in, "rows", 0, false});
  uses.push_back({&offsets_in, "offsets", 0, false});
  if (per_sample_weights_in.has_value()) uses.push_back({&*per_sample_weights_in, "per_sample_weights", 0, false});
  check_error_slots(op, errors, device);
  if (errors.has_value()) uses.push_back({&*errors, "errors", 0, true});
  check_no_shared_writes(op, uses);
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const size_t num_tables = weights.size();
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  // Everything that can fail comes before the first write: the lookups' checks, then the
  // grouping's memory.
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, rows.const_data_ptr<int64_t>(), grads, device, errors);
  const RowRanks ranks = rank_rows(lookups, layout);
  const RowLookups groups = group_lookups(ranks, lookups, layout.nnz, lookups_scaled(layout, psw_ptr));
  std::vector<TableUpdate> tables(num_tables);
  for (int64_t f = 0; f < layout.num_features; ++f) {
    if (layout.feature_tables[f] >= 0) tables[layout.feature_tables[f]].read = true;
  }
  for (size_t t = 0; t < num_tables; ++t) {
    if (optimizer != FusedOptimizer::kLazyAdam || !tables[t].read) continue;
    const int64_t step = *steps[t].const_data_ptr<int64_t>();
    SK_CHECK(step >= 0 && step < INT64_MAX, op, ": steps[", t, "] must lie in [0, 2^63 - 1), got ", step);
    const double size = lazy_adam_step_size(step + 1, h.lr, h.beta1, h.beta2);
    tables[t].adam = AdamScalars<float>::make(size, h.beta1, h.beta2, h.eps, h.weight_decay);
    tables[t].adam64 = AdamScalars<double>::make(size, h.beta1, h.beta2, h.eps, h.weight_decay);
  }
  const int64_t num_distinct = ranks.ranked.distinct.size(0);
  const int64_t* distinct = ranks.ranked.distinct.const_data_ptr<int64_t>();
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_update_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    // Each table's pointers, taken once: through the stable ABI every data pointer is a call.
    std::vector<scalar_t*> weight_of(num_tables);
    std::vector<acc_t*> first_of(num_tables, nullptr), second_of(num_tables, nullptr);
    for (size_t t = 0; t < num_tables; ++t) {
      weight_of[t] = weights[t].mutable_data_ptr<scalar_t>();
      if (!state1.empty()) first_of[t] = state1[t].mutable_data_ptr<acc_t>();
      if (!state2.empty()) second_of[t] = state2[t].mutable_data_ptr<acc_t>();
    }
    const int64_t widest = *std::max_element(layout.table_dims.begin(), layout.table_dims.end());
    // The rows are scattered over tables far larger than the caches: their weight and state
    // rows are fetched ahead, as lazy_adam_'s are (adam_row.h).
    const int64_t ahead = prefetch_rows_ahead(std::max<int64_t>(widest, 1) * static_cast<int64_t>(sizeof(acc_t)));
    parallel_for(0, num_distinct, row_grain(layout), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> wide;
      // The row's summed gradient: its lookups' output gradients are few and cached, so
      // each row is summed right before its update and no gradient block is written.
      // Row-wise Adagrad on float32 / float64 rows goes a block of rows at a time: a row's step
      // size is a chain of a division, a square root and a division, and the independent
      // chains of a block overlap where one row's would stall (bench_torchrec's training cells).
      constexpr int64_t kBlock = 8;
      const bool blocked = std::is_same_v<scalar_t, acc_t> && optimizer == FusedOptimizer::kRowWiseAdagrad;
      const int64_t stride = std::max<int64_t>(widest, 1);
      std::vector<acc_t> gradient(static_cast<size_t>(stride * (blocked ? kBlock : 1)));
      for (int64_t first = begin; first < end; first += kBlock) {
        const int64_t last = std::min(end, first + kBlock);
        acc_t* block_weight[kBlock];
        acc_t* block_sum[kBlock];
        acc_t block_mean[kBlock];
        int64_t block_dim[kBlock];
        for (int64_t r = first; r < last; ++r) {
          if (r + ahead < end) {
            const int64_t t = table_of_rank(ranks, r + ahead);
            const int64_t dim = layout.table_dims[t];
            const int64_t row = distinct[r + ahead] - lookups.bases[t];
            const int64_t bytes = dim * static_cast<int64_t>(sizeof(acc_t));
            const int64_t state_row = optimizer == FusedOptimizer::kRowWiseAdagrad ? row : row * dim;
            const void* weight_row = weight_of[t] + row * dim;
            prefetch_row(weight_row, first_of[t] != nullptr ? static_cast<const void*>(first_of[t] + state_row) : weight_row,
                         second_of[t] != nullptr ? static_cast<const void*>(second_of[t] + row * dim) : weight_row, bytes);
          }
          const int64_t t = table_of_rank(ranks, r);
          const int64_t dim = layout.table_dims[t];
          const int64_t row = distinct[r] - lookups.bases[t];
          acc_t* g = gradient.data() + (blocked ? (r - first) * stride : 0);
          sum_row<acc_t, scalar_t>(g, dim, groups, r, lookups, psw_ptr);
          if (blocked) {
            const int64_t i = r - first;
            block_weight[i] = as_accumulator<acc_t>(weight_of[t] + row * dim);
            block_sum[i] = first_of[t] + row;
            block_dim[i] = dim;
            block_mean[i] = rowwise_mean_square(block_weight[i], g, dim, h);
            continue;
          }
          acc_t* s1 = nullptr;
          acc_t* s2 = nullptr;
          if (optimizer == FusedOptimizer::kLazyAdam) {
            s1 = first_of[t] + row * dim;
            s2 = second_of[t] + row * dim;
          } else if (optimizer == FusedOptimizer::kRowWiseAdagrad) {
            s1 = first_of[t] + row;
          } else if (optimizer == FusedOptimizer::kAdagrad) {
            s1 = first_of[t] + row * dim;
          }
          update_weight_row(optimizer, weight_of[t] + row * dim, s1, s2, g, dim, h, adam_scalars_of<acc_t>(tables[t]),
                            wide);
        }
        if (blocked) {
          acc_t block_step[kBlock];
          for (int64_t i = 0; i < last - first; ++i) {
            *block_sum[i] += block_mean[i];
            block_step[i] = rowwise_step(*block_sum[i], h);
          }
          for (int64_t i = 0; i < last - first; ++i) {
            apply_rowwise_step(block_weight[i], gradient.data() + i * stride, block_dim[i], block_step[i]);
          }
        }
      }
    });
  });
  if (optimizer == FusedOptimizer::kLazyAdam) {
    for (size_t t = 0; t < num_tables; ++t) *steps[t].mutable_data_ptr<int64_t>() += tables[t].read ? 1 : 0;
  }
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("pooled_read", TORCH_BOX(&pooled_read_cpu));
  m.impl("pooled_read_backward", TORCH_BOX(&pooled_read_backward_cpu));
  m.impl("pooled_read_update_", TORCH_BOX(&pooled_read_update_cpu));
}

}  // namespace sparsekit

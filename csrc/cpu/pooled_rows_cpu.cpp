// The pooled read's lookups checked, coded and grouped by row (pooled_rows.h): what its
// gradient and its fused update share. Each row's lookups are listed in position order, so
// the sums made from them do not depend on the thread count.
// 32-byte vector arguments of pool_loops.h's always_inline helpers never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/grouping.h"
#include "cpu/pool_loops.h"
#include "cpu/pooled_rows.h"
#include "parallel.h"
#include "scratch.h"

namespace sparsekit {
namespace {

/// Lookups per piece of the indexing pass.
constexpr int64_t kBagGrain = int64_t{1} << 12;

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

}  // namespace

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

namespace {

// Ranks per part at least, where a table's are cut into parts for the threads.
constexpr int64_t kMinRanksPerPart = 4096;

/// A table's ranks [low, high), or a part of them: one worker's share of the grouping.
struct Part {
  int64_t table, low, high;
};

/// @brief Parts over the tables' ranks (table t's: [table_first[t], table_first[t + 1])). A
/// part per table while the tables are enough to share among the threads: its worker scans
/// only its table's positions, and the counters and slots it touches are one table's (a part
/// spanning many tables touched theirs all over: bench_torchrec's training cells, the
/// grouping 20-30% faster at 26 tables). Else a table is cut into parts of at least
/// kMinRanksPerPart ranks, as many as the threads at most: each then scans all the table's
/// lookups, and the test of a lookup's rank against its part's range is a branch the CPU
/// cannot predict, which one part per table never takes.
std::vector<Part> rank_parts(const std::vector<int64_t>& table_first) {
  const size_t num_tables = table_first.size() - 1;
  const int64_t threads = num_threads();
  int64_t tables_read = 0;
  for (size_t t = 0; t < num_tables; ++t) tables_read += table_first[t + 1] > table_first[t] ? 1 : 0;
  const bool cut = tables_read < 2 * threads;
  std::vector<Part> parts;
  for (size_t t = 0; t < num_tables; ++t) {
    const int64_t low = table_first[t], high = table_first[t + 1];
    if (high == low) continue;
    const int64_t pieces = cut ? std::max<int64_t>(1, std::min(threads, (high - low) / kMinRanksPerPart)) : 1;
    for (int64_t p = 0; p < pieces; ++p) {
      parts.push_back({static_cast<int64_t>(t), low + (high - low) * p / pieces, low + (high - low) * (p + 1) / pieces});
    }
  }
  return parts;
}

/// @brief Groups the lookups by rank into out's slots (a stable counting sort): a part's
/// worker counts its lookups, a counter per rank, turns its counts into slots and scatters its
/// lookups, each pass in position order, so the order does not depend on the threads. The
/// counters: 32 bits below 2^32 - 1 lookups, in memory the thread keeps between calls.
template <typename count_t>
void group_by_rank(const char* op, const int64_t* rank, const IndexedLookups& lookups, bool scaled, RowGroups& out) {
  const int64_t num_distinct = out.distinct.size(0);
  const std::vector<Part> parts = rank_parts(out.table_first);
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  thread_local Scratch counter_scratch;
  const TrimOnExit trim_counters{counter_scratch};
  count_t* const count = static_cast<count_t*>(allocate_host_or_fail(
      op, "the grouping's counters", static_cast<double>(sizeof(count_t)) * num_distinct,
      [&] { return counter_scratch.get(sizeof(count_t) * static_cast<size_t>(std::max<int64_t>(num_distinct, 1))); }));
  const auto& spans = lookups.spans;
  std::vector<int64_t> slots(static_cast<size_t>(num_parts) + 1, 0);
  parallel_chunks(num_parts, 1, [&](int64_t first_part, int64_t last_part) {
    for (int64_t p = first_part; p < last_part; ++p) {
      const int64_t low = parts[p].low, high = parts[p].high;
      std::memset(count + low, 0, sizeof(count_t) * static_cast<size_t>(high - low));
      int64_t total = 0;
      for (const auto& [begin, end] : spans[static_cast<size_t>(parts[p].table)]) {
        for (int64_t k = begin; k < end; ++k) {
          const int64_t r = rank[k];
          if (r < low || r >= high) continue;
          ++count[r];
          ++total;
        }
      }
      slots[p + 1] = total;
    }
  });
  for (int64_t p = 0; p < num_parts; ++p) slots[p + 1] += slots[p];
  out.start.assign(static_cast<size_t>(num_distinct) + 1, 0);
  out.source.resize(static_cast<size_t>(slots[num_parts]));
  if (scaled) out.order.resize(out.source.size());
  int64_t* const start = out.start.data();
  int64_t* const source = out.source.data();
  int64_t* const order = scaled ? out.order.data() : nullptr;
  const int64_t* const grad_at = lookups.grad_at.get();
  parallel_chunks(num_parts, 1, [&](int64_t first_part, int64_t last_part) {
    for (int64_t p = first_part; p < last_part; ++p) {
      const int64_t low = parts[p].low, high = parts[p].high;
      // The parts tile the ranks in order: this one's slots begin after every earlier part's.
      int64_t at = slots[p];
      for (int64_t r = low; r < high; ++r) {
        const int64_t c = static_cast<int64_t>(count[r]);
        count[r] = static_cast<count_t>(at);  // from here on: the rank's next free slot
        at += c;
        start[r + 1] = at;
      }
      for (const auto& [begin, end] : spans[static_cast<size_t>(parts[p].table)]) {
        for (int64_t k = begin; k < end; ++k) {
          const int64_t r = rank[k];
          if (r < low || r >= high) continue;
          const int64_t slot = static_cast<int64_t>(count[r]++);
          source[slot] = grad_at[k];
          if (order != nullptr) order[slot] = k;
        }
      }
    }
  });
}

}  // namespace

RowGroups group_rows(const char* op, const IndexedLookups& lookups, const PooledLayout& layout, bool scaled) {
  RowGroups out;
  const RankedCodes ranked = rank_codes(lookups.codes, lookups.bases.back(), lookups.bases);
  out.distinct = ranked.distinct;
  const int64_t* distinct = ranked.distinct.const_data_ptr<int64_t>();
  const int64_t num_distinct = ranked.distinct.size(0);
  const size_t num_tables = layout.table_dims.size();
  out.table_first.resize(num_tables + 1);
  for (size_t t = 0; t <= num_tables; ++t) {
    out.table_first[t] = std::lower_bound(distinct, distinct + num_distinct, lookups.bases[t]) - distinct;
  }
  out.value_start.assign(num_tables + 1, 0);
  for (size_t t = 0; t < num_tables; ++t) {
    out.value_start[t + 1] = out.value_start[t] + (out.table_first[t + 1] - out.table_first[t]) * layout.table_dims[t];
  }
  const int64_t* rank = ranked.rank.const_data_ptr<int64_t>();
  if (layout.nnz < int64_t{UINT32_MAX}) {
    group_by_rank<uint32_t>(op, rank, lookups, scaled, out);
  } else {
    group_by_rank<int64_t>(op, rank, lookups, scaled, out);
  }
  return out;
}

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

void check_no_bags(const char* op, const PooledLayout& layout, const int64_t* offsets,
                   const std::optional<Tensor>& errors) {
  if (errors.has_value()) {
    if (layout.nnz != 0 || offsets[0] != 0) report_pooled_errors(op, 0, kNoBadPosition, layout, offsets, nullptr, errors);
    return;
  }
  SK_CHECK(layout.nnz == 0 && offsets[0] == 0, op,
           ": a batch of no bags (B = 0) must have no values and offsets [0]; got nnz = ", layout.nnz);
}

}  // namespace sparsekit

#pragma once
// Work sharing of the CPU kernels.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "torch_api.h"

namespace sparsekit {

namespace detail {
/// Depth of sparsekit's own parallel regions on this thread (the stable ABI has no
/// at::in_parallel_region): a kernel called from inside one runs inline.
inline thread_local int parallel_depth = 0;
struct ParallelRegion {
  ParallelRegion() { ++parallel_depth; }
  ~ParallelRegion() { --parallel_depth; }
};
}  // namespace detail

/// @brief True inside a sparsekit parallel region (parallel_for or parallel_chunks).
inline bool in_parallel_region() { return detail::parallel_depth > 0; }

/// @brief torch's intra-op thread count.
inline int64_t num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }

/// @brief at::parallel_for on the stable ABI: fn(begin, end) over [0, n) split into at most
/// num_threads() ranges of at least `grain` items (inline when small or nested).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (begin >= end) return;
  if (end - begin <= grain || in_parallel_region() || num_threads() == 1) {
    detail::ParallelRegion region;
    fn(begin, end);
    return;
  }
  // An exception must not cross torch's C shim (it would come back as a bare error code,
  // its message lost): the first one a worker raises is kept and rethrown here.
  std::exception_ptr error;
  std::mutex error_mutex;
  torch::stable::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    detail::ParallelRegion region;
    try {
      fn(b, e);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

/// @brief The number of workers parallel_chunks_indexed uses for n items in chunks of
/// `chunk`: 1 when it runs inline.
inline int64_t chunk_workers(int64_t n, int64_t chunk) {
  const int64_t chunks = (n + std::max<int64_t>(chunk, 1) - 1) / std::max<int64_t>(chunk, 1);
  if (chunks <= 1 || in_parallel_region()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(chunks, num_threads()));
}

/// @brief Runs fn(worker, begin, end) over [0, n) in chunks of `chunk` items handed out
/// from a shared counter; worker in [0, chunk_workers(n, chunk)) names the worker that
/// runs the chunk (for per-worker scratch or counters), and one worker's calls never
/// overlap. A thread that the OS deschedules (its core busy with other work) or that drew
/// the slow part of the input then delays only its current chunk, where at::parallel_for's
/// fixed 1/threads shares make the whole call wait for the slowest thread. Runs inline on
/// one thread, or when already inside a parallel region.
template <typename F>
void parallel_chunks_indexed(int64_t n, int64_t chunk, const F& fn) {
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = chunk_workers(n, chunk);
  if (workers == 1) {
    fn(int64_t{0}, int64_t{0}, n);
    return;
  }
  std::atomic<int64_t> next{0};
  parallel_for(0, workers, 1, [&](int64_t w_begin, int64_t w_end) {
    for (int64_t worker = w_begin; worker < w_end; ++worker) {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        fn(worker, c * chunk, std::min(n, (c + 1) * chunk));
      }
    }
  });
}

/// @brief parallel_chunks_indexed without the worker: fn(begin, end).
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  parallel_chunks_indexed(n, chunk, [&](int64_t, int64_t begin, int64_t end) { fn(begin, end); });
}

/// @brief The exclusive scan of a counting sort with several counting threads, in place:
/// counts is a [rows, columns] row-major matrix (row r: the counts of one thread or block
/// of positions, column c: one key or bucket); each entry becomes the number of items before
/// it when the columns are laid out one after another, rows in order within a column, i.e.
/// where row r's items of column c start. column_starts ([columns + 1]) gets where each
/// column starts, and the total last. Parallel over blocks of columns.
inline void scan_counts_by_column(int64_t* counts, int64_t rows, int64_t columns, int64_t* column_starts) {
  constexpr int64_t kColumnGrain = int64_t{1} << 12;
  const int64_t num_blocks = (columns + kColumnGrain - 1) / kColumnGrain;
  std::vector<int64_t> block_start(num_blocks + 1, 0);
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t total = 0;
      for (int64_t c = b * kColumnGrain, e = std::min(columns, (b + 1) * kColumnGrain); c < e; ++c) {
        for (int64_t r = 0; r < rows; ++r) total += counts[r * columns + c];
      }
      block_start[b + 1] = total;
    }
  });
  for (int64_t b = 0; b < num_blocks; ++b) block_start[b + 1] += block_start[b];
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t next = block_start[b];
      for (int64_t c = b * kColumnGrain, e = std::min(columns, (b + 1) * kColumnGrain); c < e; ++c) {
        column_starts[c] = next;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t count = counts[r * columns + c];
          counts[r * columns + c] = next;
          next += count;
        }
      }
    }
  });
  column_starts[columns] = block_start[num_blocks];
}

/// @brief fn(t, begin, end) for each table's part of the entries in [begin, end), table t
/// holding entries [offsets[t], offsets[t + 1]): the parallel ranges of a multi-table op
/// ignore table boundaries, so small tables share a task.
template <typename F>
void for_each_table_range(const std::vector<int64_t>& offsets, int64_t begin, int64_t end, const F& fn) {
  int64_t t = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
  for (int64_t i = begin; i < end; ++t) {
    const int64_t stop = std::min(end, offsets[t + 1]);
    if (stop > i) fn(t, i, stop);
    i = std::max(i, stop);
  }
}

}  // namespace sparsekit

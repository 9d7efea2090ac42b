#pragma once
// Work sharing of the CPU kernels.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
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

// ---- busy cores ------------------------------------------------------------------------
// A region ends when its last thread does, and a worker woken while another process keeps
// a core busy may wait a whole scheduler time slice. A region whose workers start late marks
// the cores contended for a while; meanwhile small regions (< kContendedGrains) run inline.
namespace detail {
constexpr int64_t kLateStartNs = 500'000;         // a worker starting this late: contended
constexpr int64_t kContendedNs = 1'000'000'000;   // for the next second
constexpr int64_t kContendedGrains = 64;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline std::atomic<int64_t>& contended_until() {
  static std::atomic<int64_t> until{0};
  return until;
}

/// SPARSEKIT_CORES_CONTENDED=1 in the environment (read once): the cores always count as
/// contended, so that tests take the contended paths on an idle machine.
inline bool always_contended() {
  static const bool always = [] {
    const char* value = std::getenv("SPARSEKIT_CORES_CONTENDED");
    return value != nullptr && value[0] == '1';
  }();
  return always;
}
}  // namespace detail

/// @brief Whether a worker of a recent parallel region started late (another process has
/// the cores): small regions then run inline.
inline bool cores_contended() {
  return detail::always_contended() ||
         detail::now_ns() < detail::contended_until().load(std::memory_order_relaxed);
}

/// @brief The work (in the caller's units) below which a region runs inline: `grain`, or
/// kContendedGrains grains while the cores are contended.
inline int64_t inline_below(int64_t grain) {
  grain = std::max<int64_t>(grain, 1);
  return cores_contended() ? grain * detail::kContendedGrains : grain;
}

/// @brief at::parallel_for on the stable ABI: fn(begin, end) over [0, n) split into at most
/// num_threads() ranges of at least `grain` items (inline when small or nested, and while
/// the cores are contended when under kContendedGrains grains: see above).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (begin >= end) return;
  // (A grain of 1 counts units the caller sized itself: the rule is not applied to them.)
  if (end - begin <= grain || in_parallel_region() || num_threads() == 1 ||
      (grain > 1 && end - begin <= inline_below(grain))) {
    detail::ParallelRegion region;
    fn(begin, end);
    return;
  }
  // An exception must not cross torch's C shim (it would come back as a bare error code,
  // its message lost): the first one a worker raises is kept and rethrown here.
  std::exception_ptr error;
  std::mutex error_mutex;
  const int64_t forked = detail::now_ns();
  std::atomic<int64_t> last_start{forked};
  torch::stable::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const int64_t started = detail::now_ns();
    int64_t seen = last_start.load(std::memory_order_relaxed);
    while (seen < started && !last_start.compare_exchange_weak(seen, started, std::memory_order_relaxed)) {
    }
    detail::ParallelRegion region;
    try {
      fn(b, e);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  });
  if (last_start.load(std::memory_order_relaxed) - forked > detail::kLateStartNs) {
    detail::contended_until().store(detail::now_ns() + detail::kContendedNs, std::memory_order_relaxed);
  }
  if (error) std::rethrow_exception(error);
}

/// @brief The number of workers parallel_chunks_indexed uses for n items in chunks of
/// `chunk`: 1 when it runs inline. (It does not depend on the cores' contention, so that a
/// kernel's scratch sized by it matches the workers of its later parallel_chunks_indexed;
/// those run one after another on the calling thread while the cores are contended.)
inline int64_t chunk_workers(int64_t n, int64_t chunk) {
  const int64_t chunks = (n + std::max<int64_t>(chunk, 1) - 1) / std::max<int64_t>(chunk, 1);
  if (chunks <= 1 || in_parallel_region()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(chunks, num_threads()));
}

/// @brief Runs the rest of a kernel inline (every parallel region in it, and chunk_workers
/// says 1) while the cores are contended and its work, `work` items, is under
/// kContendedGrains grains: for kernels whose passes run over units they size themselves
/// (ranges per thread, blocks), which the grain rule of parallel_for does not reach.
class InlineWhileContended {
 public:
  InlineWhileContended(int64_t work, int64_t grain)
      : active_(work <= std::max<int64_t>(grain, 1) * detail::kContendedGrains && cores_contended()) {
    if (active_) ++detail::parallel_depth;
  }
  ~InlineWhileContended() {
    if (active_) --detail::parallel_depth;
  }
  InlineWhileContended(const InlineWhileContended&) = delete;
  InlineWhileContended& operator=(const InlineWhileContended&) = delete;

 private:
  bool active_;
};

namespace detail {
/// One worker's chunks [front, back), packed in one word (front in the low half) so that the
/// owner's take of its next chunk and a thief's take of the back half are each a single
/// compare-exchange. Padded to a cache line: the owner's takes stay in its own core's cache.
struct alignas(64) ChunkShare {
  std::atomic<uint64_t> range{0};

  static uint64_t pack(uint64_t front, uint64_t back) { return front | (back << 32); }
  static int64_t front(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }
  static int64_t back(uint64_t r) { return static_cast<int64_t>(r >> 32); }
  static int64_t left(uint64_t r) { return std::max<int64_t>(0, back(r) - front(r)); }

  /// The owner takes the front chunk into *chunk; false once the share is empty.
  bool take_front(int64_t* chunk) {
    uint64_t r = range.load(std::memory_order_relaxed);
    while (left(r) > 0) {
      if (range.compare_exchange_weak(r, pack(front(r) + 1, back(r)), std::memory_order_relaxed)) {
        *chunk = front(r);
        return true;
      }
    }
    return false;
  }
  /// A thief takes the back half (rounded up) of what is left: [*first, *last); false when
  /// nothing is left or the owner or another thief got there first.
  bool take_back_half(int64_t* first, int64_t* last) {
    uint64_t r = range.load(std::memory_order_relaxed);
    const int64_t n = left(r);
    if (n == 0) return false;
    const int64_t split = back(r) - (n + 1) / 2;
    const int64_t end = back(r);
    if (!range.compare_exchange_strong(r, pack(front(r), split), std::memory_order_relaxed)) return false;
    *first = split;
    *last = end;
    return true;
  }
};

/// Worker `worker`'s share is done: takes the back half of the fullest other share into
/// [*first, *last), trying again while another worker gets there first; false once every
/// other share is empty.
inline bool steal_back_half(std::vector<ChunkShare>& shares, int64_t worker, int64_t* first, int64_t* last) {
  for (;;) {
    int64_t victim = -1, most = 0;
    for (int64_t v = 0; v < static_cast<int64_t>(shares.size()); ++v) {
      const int64_t left = ChunkShare::left(shares[v].range.load(std::memory_order_relaxed));
      if (v != worker && left > most) {
        victim = v;
        most = left;
      }
    }
    if (victim < 0) return false;
    if (shares[victim].take_back_half(first, last)) return true;
  }
}
}  // namespace detail

/// @brief Runs fn(worker, begin, end) over [0, n) in chunks of `chunk` items; worker in
/// [0, chunk_workers(n, chunk)) names the worker that runs the chunk (for per-worker
/// scratch or counters), and one worker's calls never overlap. Each worker takes its own
/// contiguous share in order (its prefetches run into its own next chunk), then steals the
/// back half of the fullest other share: a descheduled thread delays one chunk, not the call.
/// Runs inline on one thread, or when already inside a parallel region.
template <typename F>
void parallel_chunks_indexed(int64_t n, int64_t chunk, const F& fn) {
  chunk = std::max<int64_t>(chunk, 1);
  // Chunk numbers fit the 32-bit halves of a share.
  chunk = std::max<int64_t>(chunk, (n >> 31) + 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = chunk_workers(n, chunk);
  if (workers == 1) {
    fn(int64_t{0}, int64_t{0}, n);
    return;
  }
  std::vector<detail::ChunkShare> shares(workers);
  for (int64_t w = 0; w < workers; ++w) {
    shares[w].range.store(detail::ChunkShare::pack(chunks * w / workers, chunks * (w + 1) / workers),
                          std::memory_order_relaxed);
  }
  auto run_workers = [&](int64_t w_begin, int64_t w_end) {
    for (int64_t worker = w_begin; worker < w_end; ++worker) {
      detail::ChunkShare& own = shares[worker];
      int64_t first = 0, last = 0;
      for (;;) {
        int64_t c = 0;
        while (own.take_front(&c)) fn(worker, c * chunk, std::min(n, (c + 1) * chunk));
        if (!detail::steal_back_half(shares, worker, &first, &last)) break;
        // Only this worker writes its own empty share (a thief skips an empty one).
        own.range.store(detail::ChunkShare::pack(first, last), std::memory_order_relaxed);
      }
    }
  };
  if (chunk > 1 && n <= inline_below(chunk)) {
    // Contended and small: the same workers, one after another on this thread.
    detail::ParallelRegion region;
    run_workers(0, workers);
    return;
  }
  parallel_for(0, workers, 1, run_workers);
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

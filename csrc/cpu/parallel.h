#pragma once
// Work sharing of the CPU kernels.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace sparsekit {

/// @brief Runs fn(begin, end) over [0, n) in chunks of `chunk` items handed out from a
/// shared counter. A thread that the OS deschedules (its core busy with other work) or
/// that drew the slow part of the input then delays only its current chunk, where
/// at::parallel_for's fixed 1/threads shares make the whole call wait for the slowest
/// thread. Runs inline on one thread, or when already inside a parallel region.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = at::get_num_threads();
  if (chunks <= 1 || threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(chunks, threads), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
}

}  // namespace sparsekit

// Hash-based unique on the CPU, in order of first occurrence.
//
// One shared open-addressing table of positions (not keys: every int64 is a valid key,
// so no key can serve as the empty marker). A slot holds the smallest position seen for
// its key, and the key itself is read back as keys[position]. Positions are claimed with
// a CAS and lowered with a CAS loop, so the table ends up identical whatever the thread
// count or schedule, and the output order (first occurrence) is deterministic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace sparsekit {
namespace {

constexpr int64_t kGrain = 1 << 14;
constexpr int64_t kBlock = 1 << 16;  // scan block: fixed, so output never depends on threads

template <typename T>
inline T load_relaxed(const T* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}

template <typename T>
inline bool cas_relaxed(T* p, T* expected, T desired) {
  return __atomic_compare_exchange_n(p, expected, desired, /*weak=*/false, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED);
}

template <typename key_t, typename pos_t>
void unique_kernel(const key_t* keys, int64_t n, at::Tensor& unique_keys, int64_t* inverse,
                   at::Tensor& counts) {
  const int64_t num_slots = scratch_table_slots(n);
  const uint64_t mask = static_cast<uint64_t>(num_slots) - 1;
  constexpr pos_t kEmpty = static_cast<pos_t>(-1);
  std::unique_ptr<pos_t[]> slots(new pos_t[num_slots]);
  std::unique_ptr<pos_t[]> slot_of(new pos_t[n]);  // num_slots <= 2^31 when pos_t is 32-bit
  at::parallel_for(0, num_slots, kGrain * 4, [&](int64_t begin, int64_t end) {
    std::fill(slots.get() + begin, slots.get() + end, kEmpty);
  });

  // Phase 1: every position lands in its key's slot, which keeps the smallest position.
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const key_t key = keys[i];
      uint64_t s = mix_key(static_cast<int64_t>(key)) & mask;
      const pos_t me = static_cast<pos_t>(i);
      while (true) {
        pos_t held = load_relaxed(&slots[s]);
        if (held == kEmpty) {
          if (cas_relaxed(&slots[s], &held, me)) break;
          // Lost the race: `held` now has the winner's position; fall through to compare.
        }
        if (keys[held] == key) {
          while (me < held && !cas_relaxed(&slots[s], &held, me)) {
          }
          break;
        }
        s = (s + 1) & mask;
      }
      slot_of[i] = static_cast<pos_t>(s);
    }
  });

  // Phase 2: a position is a first occurrence when its slot kept it. Count per block,
  // then number the first occurrences in position order.
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  std::vector<int64_t> block_firsts(num_blocks + 1, 0);
  std::unique_ptr<uint8_t[]> is_first(new uint8_t[n]);
  at::parallel_for(0, num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t firsts = 0;
      for (int64_t i = b * kBlock, e = std::min(n, (b + 1) * kBlock); i < e; ++i) {
        const uint8_t first = slots[slot_of[i]] == static_cast<pos_t>(i);
        is_first[i] = first;
        firsts += first;
      }
      block_firsts[b + 1] = firsts;
    }
  });
  for (int64_t b = 0; b < num_blocks; ++b) block_firsts[b + 1] += block_firsts[b];
  const int64_t num_unique = block_firsts[num_blocks];

  unique_keys = at::empty({num_unique}, unique_keys.options());
  key_t* out_keys = unique_keys.data_ptr<key_t>();
  // The slot of a first occurrence now takes its unique id, so phase 3 needs one lookup.
  at::parallel_for(0, num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t id = block_firsts[b];
      for (int64_t i = b * kBlock, e = std::min(n, (b + 1) * kBlock); i < e; ++i) {
        if (is_first[i]) {
          out_keys[id] = keys[i];
          slots[slot_of[i]] = static_cast<pos_t>(id);
          ++id;
        }
      }
    }
  });

  // Phase 3: inverse, and counts from per-thread tallies (no contended atomics on hot keys)
  // when they fit in a small multiple of the input, atomics otherwise. Tallies are int32, so
  // only while no thread can see a key more than INT32_MAX times.
  counts = at::zeros({num_unique}, counts.options());
  int64_t* out_counts = counts.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  const bool per_thread_tallies = threads > 1 && n <= std::numeric_limits<int32_t>::max() &&
                                  threads * num_unique <= std::max<int64_t>(n, 1 << 20);
  std::vector<int32_t> tallies(per_thread_tallies ? threads * num_unique : 0, 0);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int32_t* mine = per_thread_tallies ? tallies.data() + at::get_thread_num() * num_unique : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(slots[slot_of[i]]);
      inverse[i] = id;
      if (mine) {
        ++mine[id];
      } else if (threads > 1) {
        __atomic_fetch_add(&out_counts[id], 1, __ATOMIC_RELAXED);
      } else {
        ++out_counts[id];
      }
    }
  });
  if (per_thread_tallies) {
    at::parallel_for(0, num_unique, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = 0; t < threads; ++t) {
        const int32_t* tally = tallies.data() + t * num_unique;
        for (int64_t u = begin; u < end; ++u) out_counts[u] += tally[u];
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> unique_cpu(const at::Tensor& keys_in) {
  check_key_tensor(keys_in, "unique", "keys");
  TORCH_CHECK(keys_in.device().is_cpu(), "unique: expected a CPU tensor, got ", keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const int64_t n = keys.numel();
  at::Tensor unique_keys = at::empty({0}, keys.options());
  at::Tensor inverse = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  at::Tensor counts = at::empty({0}, keys.options().dtype(at::kLong));
  if (n == 0) return {unique_keys, inverse, counts};
  int64_t* inv = inverse.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_cpu", [&] {
    using key_t = index_t;
    if (n < (int64_t{1} << 30)) {
      unique_kernel<key_t, int32_t>(keys.data_ptr<key_t>(), n, unique_keys, inv, counts);
    } else {
      unique_kernel<key_t, int64_t>(keys.data_ptr<key_t>(), n, unique_keys, inv, counts);
    }
  });
  return {unique_keys, inverse, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("unique", &unique_cpu);
}

}  // namespace sparsekit

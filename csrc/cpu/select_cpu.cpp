// select_smallest on the CPU: the radix select of csrc/select.h, each pass a parallel
// loop over fixed chunks (per-chunk histograms, extremes and lists, merged in chunk order,
// so the result never depends on the thread count). Only the first passes read all n
// entries; once the bucket is small its entries are listed and later passes read the list.
#include <algorithm>
#include <limits>
#include <vector>

#include "cpu/parallel.h"

#include "select.h"

namespace sparsekit {
namespace {

constexpr int64_t kSelectGrain = 1 << 14;

// A bucket of at most n / kListBelow entries is listed, so later passes skip the rest.
constexpr int64_t kListBelow = 2;

/// Fixed chunks of a range of positions: entries 0..n-1, or the listed ones.
struct Chunks {
  int64_t n;
  int64_t count;
  const int64_t* list;  // nullptr: position p is entry p
  int64_t begin(int64_t chunk) const { return chunk * n / count; }
  int64_t entry(int64_t p) const { return list == nullptr ? p : list[p]; }

  static Chunks over(int64_t n, const int64_t* list) {
    return {n, std::max<int64_t>(1, std::min<int64_t>(num_threads() * 4, (n + kSelectGrain - 1) / kSelectGrain)),
            list};
  }

  template <typename F>
  void each(const F& f) const {
    parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      for (int64_t chunk = first; chunk < last; ++chunk) f(chunk, begin(chunk), begin(chunk + 1));
    });
  }
};

/// Per-chunk vectors joined in chunk order.
std::vector<int64_t> join(std::vector<std::vector<int64_t>>& parts) {
  size_t total = 0;
  for (const auto& part : parts) total += part.size();
  std::vector<int64_t> out;
  out.reserve(total);
  for (auto& part : parts) {
    out.insert(out.end(), part.begin(), part.end());
    std::vector<int64_t>().swap(part);
  }
  return out;
}

}  // namespace

/// @brief Indices (ascending) of the k lexicographically smallest eligible entries of
/// int64 columns; whole-tuple ties go to the smaller index.
/// @param columns 1 to 4 int64 [n] tensors, compared in order (column 0 first).
/// @param eligible bool [n]: only these entries may be chosen.
/// @param k how many to choose; at most the number of eligible entries.
/// @return int64 [k], ascending.
Tensor select_smallest_cpu(const std::vector<Tensor>& columns, const Tensor& eligible, int64_t k) {
  check_select_args(columns, eligible, k);
  const int64_t n = eligible.size(0);
  std::vector<Tensor> columns_c;
  SelectColumns cols{};
  cols.num_columns = static_cast<int>(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    columns_c.push_back(as_contiguous(columns[c]));
    cols.data[c] = columns_c.back().mutable_data_ptr<int64_t>();
  }
  const Tensor eligible_c = as_contiguous(eligible);
  const bool* ok = eligible_c.mutable_data_ptr<bool>();

  // First pass: the eligible count, and column 0's extremes over the eligible entries
  // (the whole first bucket).
  const Chunks all = Chunks::over(n, nullptr);
  std::vector<int64_t> counts(all.count);
  std::vector<uint64_t> extremes(all.count * 2);
  // side[i]: 0 in the bucket, 1 less, 2 greater (or not eligible). A histogram pass
  // keeps each bucket entry's digit; the next pass splits the bucket by the chosen digit
  // (`split`) as it reads the entries still marked 0. So a pass reads one byte per entry,
  // and the column and a 16-bit digit only for the bucket's entries.
  std::vector<uint8_t> side(n);
  all.each([&](int64_t chunk, int64_t begin, int64_t end) {
    int64_t count = 0;
    uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
    for (int64_t i = begin; i < end; ++i) {
      side[i] = ok[i] ? 0 : 2;
      if (!ok[i]) continue;
      ++count;
      const uint64_t v = ordered_bits(cols.data[0][i]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    counts[chunk] = count;
    extremes[2 * chunk] = lo;
    extremes[2 * chunk + 1] = hi;
  });
  int64_t num_eligible = 0;
  uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
  for (int64_t chunk = 0; chunk < all.count; ++chunk) {
    num_eligible += counts[chunk];
    lo = std::min(lo, extremes[2 * chunk]);
    hi = std::max(hi, extremes[2 * chunk + 1]);
  }
  SK_CHECK(k <= num_eligible, "select_smallest: k=", k, " but only ", num_eligible, " of ", n,
              " entries are eligible");
  Tensor out = empty({k}, kLong, eligible.device());
  if (k == 0) return out;

  SelectState state;
  state.max_digit_bits = kSelectCpuDigitBits;
  state.need = k;
  state.bucket = num_eligible;
  state.settle(cols.num_columns);
  if (!state.done) state.step_min_max(lo, hi, cols.num_columns);

  std::vector<uint16_t> digits;
  struct Split {
    bool active = false;
    uint16_t digit = 0;
  } split;
  auto in_bucket = [&](const Split& cut, int64_t i) {
    if (side[i] != 0) return false;
    if (!cut.active || digits[i] == cut.digit) return true;
    side[i] = digits[i] < cut.digit ? 1 : 2;
    return false;
  };

  std::vector<int64_t> listed;  // the bucket's entries once it is small (a superset later)
  bool use_list = false;
  std::vector<uint32_t> histograms;
  std::vector<int64_t> totals;
  while (!state.done) {
    const Chunks chunks = use_list ? Chunks::over(static_cast<int64_t>(listed.size()), listed.data()) : all;
    const bool make_list = !use_list && state.bucket * kListBelow <= n;
    std::vector<std::vector<int64_t>> parts(make_list ? chunks.count : 0);
    const SelectState pass = state;
    const Split cut = split;
    const int64_t* column = cols.data[pass.column];
    if (state.wants_min_max()) {
      chunks.each([&](int64_t chunk, int64_t begin, int64_t end) {
        uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
        for (int64_t p = begin; p < end; ++p) {
          const int64_t i = chunks.entry(p);
          if (!in_bucket(cut, i)) continue;
          if (make_list) parts[chunk].push_back(i);
          const uint64_t v = ordered_bits(column[i]);
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
      split = Split{};  // every bucket entry shares the fixed prefix: nothing to split
    } else {
      const int bits = pass.digit_bits();
      const int bins = 1 << bits;
      const int shift = 64 - pass.nbits - bits;
      if (digits.empty()) digits.resize(n);
      // One histogram per thread-sized chunk (fewer than the other passes: 2^16 bins each).
      const Chunks wide{chunks.n, std::max<int64_t>(1, std::min<int64_t>(num_threads(), chunks.count)),
                        chunks.list};
      if (make_list) parts.resize(wide.count);
      histograms.assign(wide.count * bins, 0);
      wide.each([&](int64_t chunk, int64_t begin, int64_t end) {
        uint32_t* histogram = histograms.data() + chunk * bins;
        for (int64_t p = begin; p < end; ++p) {
          const int64_t i = wide.entry(p);
          if (!in_bucket(cut, i)) continue;
          if (make_list) parts[chunk].push_back(i);
          const auto digit = static_cast<uint16_t>((ordered_bits(column[i]) >> shift) & (bins - 1));
          digits[i] = digit;
          ++histogram[digit];
        }
      });
      totals.assign(bins, 0);
      parallel_for(0, bins, 4096, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          int64_t total = 0;
          for (int64_t chunk = 0; chunk < wide.count; ++chunk) total += histograms[chunk * bins + b];
          totals[b] = total;
        }
      });
      state.step_histogram(totals.data(), cols.num_columns);
      // The bucket is now the entries of the chosen digit: the low bits of the column's new
      // prefix (moved to `fixed` when the column is whole).
      const uint64_t prefix = state.column != pass.column ? state.fixed[pass.column] : state.prefix;
      split = Split{true, static_cast<uint16_t>(prefix & (bins - 1))};
    }
    if (make_list) {
      listed = join(parts);
      use_list = true;
    }
  }

  // Compaction, one full pass: every less entry, then the first `need` bucket entries by
  // index; chunks keep their finds in order and are joined in chunk order.
  std::vector<std::vector<int64_t>> less(all.count), bucket(all.count);
  const Split cut = split;
  all.each([&](int64_t chunk, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (in_bucket(cut, i)) bucket[chunk].push_back(i);
      else if (side[i] == 1) less[chunk].push_back(i);
    }
  });
  int64_t taken = 0;
  std::vector<int64_t> offsets(all.count + 1, 0), take(all.count);
  for (int64_t chunk = 0; chunk < all.count; ++chunk) {
    take[chunk] = std::min<int64_t>(static_cast<int64_t>(bucket[chunk].size()), state.need - taken);
    taken += take[chunk];
    offsets[chunk + 1] = offsets[chunk] + static_cast<int64_t>(less[chunk].size()) + take[chunk];
  }
  SK_CHECK(offsets[all.count] == k, "select_smallest: chose ", offsets[all.count], " of ", k);
  int64_t* out_ptr = out.mutable_data_ptr<int64_t>();
  all.each([&](int64_t chunk, int64_t, int64_t) {
    // Merge the chunk's less entries and its taken bucket entries in index order.
    const auto& a = less[chunk];
    const auto& b = bucket[chunk];
    std::merge(a.begin(), a.end(), b.begin(), b.begin() + take[chunk], out_ptr + offsets[chunk]);
  });
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("select_smallest", TORCH_BOX(&select_smallest_cpu));
}

}  // namespace sparsekit

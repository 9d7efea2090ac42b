#pragma once
// select_smallest: the k lexicographically smallest entries of a set of int64 columns,
// shared by the CPU and CUDA kernels (the victims of a dynamic table's eviction).
// A radix select over the columns in order: each pass narrows the bucket of entries that
// share the fixed prefix (min/max, then a digit histogram) until it holds `need` entries.
// The answer is every smaller entry plus the first `need` of the bucket by index (ties by
// the smaller index), written in ascending order. The control runs on the host.
#include "torch_api.h"

#include "common.h"

namespace sparsekit {

constexpr int kSelectMaxColumns = 4;
constexpr int kSelectDigitBits = 11;
constexpr int kSelectBins = 1 << kSelectDigitBits;
// The CPU's histograms are per thread (uint32, 256 KiB at 16 bits): one pass fixes a
// clock or count column whose bucket spans up to 65536 values.
constexpr int kSelectCpuDigitBits = 16;

/// int64 -> uint64 with the same order (the sign bit flipped).
C10_HOST_DEVICE inline uint64_t ordered_bits(int64_t value) {
  return static_cast<uint64_t>(value) ^ (uint64_t{1} << 63);
}

struct SelectColumns {
  const int64_t* data[kSelectMaxColumns];
  int num_columns;
};

struct SelectState {
  int column = 0;             // the column being narrowed (num_columns: all fixed)
  int nbits = 0;              // bits of that column fixed in `prefix` (0..64)
  uint64_t prefix = 0;        // its top nbits bits (ordered encoding)
  uint64_t fixed[kSelectMaxColumns] = {0, 0, 0, 0};  // ordered values of the earlier columns
  int64_t need = 0;           // bucket entries still to take
  int64_t bucket = 0;         // entries in the bucket
  bool done = false;

  /// -1: less than the bucket, 0: in it, 1: greater.
  C10_HOST_DEVICE int classify(const SelectColumns& columns, int64_t i) const {
    for (int c = 0; c < column; ++c) {
      const uint64_t v = ordered_bits(columns.data[c][i]);
      if (v != fixed[c]) return v < fixed[c] ? -1 : 1;
    }
    if (column == columns.num_columns || nbits == 0) return 0;
    const uint64_t top = ordered_bits(columns.data[column][i]) >> (64 - nbits);
    if (top != prefix) return top < prefix ? -1 : 1;
    return 0;
  }

  /// The digit of entry i below the fixed bits of the current column.
  C10_HOST_DEVICE int digit(const SelectColumns& columns, int64_t i) const {
    const int bits = digit_bits();
    const uint64_t v = ordered_bits(columns.data[column][i]);
    return static_cast<int>((v >> (64 - nbits - bits)) & ((uint64_t{1} << bits) - 1));
  }

  C10_HOST_DEVICE int digit_bits() const { return 64 - nbits < max_digit_bits ? 64 - nbits : max_digit_bits; }

  /// Whether the next pass is a min/max pass (a fresh column) rather than a histogram.
  bool wants_min_max() const { return fresh_column; }

  /// Moves to the next column once every bit of this one is fixed; sets done when the
  /// bucket is exactly what is needed or nothing is left to narrow.
  void settle(int num_columns) {
    if (bucket == need) done = true;
    while (!done && nbits == 64) {
      fixed[column] = prefix;
      ++column;
      nbits = 0;
      prefix = 0;
      fresh_column = true;
      if (column == num_columns) done = true;
    }
  }

  /// Applies the bucket's min and max (ordered encoding) in the current column: fixes
  /// their common prefix.
  void step_min_max(uint64_t lo, uint64_t hi, int num_columns) {
    const uint64_t diff = lo ^ hi;
    int common = 0;
    while (common < 64 && !((diff >> (63 - common)) & 1)) ++common;
    nbits = common;
    prefix = common == 0 ? 0 : lo >> (64 - common);
    fresh_column = false;
    settle(num_columns);
  }

  /// Applies a histogram of the bucket's next digit: keeps the digit holding the
  /// need-th entry.
  void step_histogram(const int64_t* histogram, int num_columns) {
    const int bits = digit_bits();
    int64_t below = 0;
    int d = 0;
    for (; d < (1 << bits) - 1; ++d) {
      if (below + histogram[d] >= need) break;
      below += histogram[d];
    }
    need -= below;
    bucket = histogram[d];
    prefix = nbits == 0 ? static_cast<uint64_t>(d) : (prefix << bits) | static_cast<uint64_t>(d);
    nbits += bits;
    settle(num_columns);
  }

  bool fresh_column = true;  // the next pass over this column is its min/max
  int max_digit_bits = kSelectDigitBits;  // bits per histogram pass (the CPU takes more)
};

/// @brief Checks the arguments of select_smallest.
inline void check_select_args(const std::vector<Tensor>& columns, const Tensor& eligible, int64_t k) {
  SK_CHECK(!columns.empty() && columns.size() <= static_cast<size_t>(kSelectMaxColumns),
              "select_smallest: columns must hold 1 to ", kSelectMaxColumns, " tensors, got ", columns.size());
  SK_CHECK(eligible.scalar_type() == kBool && eligible.dim() == 1,
              "select_smallest: eligible must be a 1-D bool tensor, got ", eligible.scalar_type(), " with shape ",
              eligible.sizes());
  const int64_t n = eligible.size(0);
  for (size_t c = 0; c < columns.size(); ++c) {
    SK_CHECK(columns[c].scalar_type() == kLong && columns[c].dim() == 1 && columns[c].size(0) == n,
                "select_smallest: columns[", c, "] must be int64 [", n, "] like eligible, got ",
                columns[c].scalar_type(), " with shape ", columns[c].sizes());
    SK_CHECK(columns[c].device() == eligible.device(), "select_smallest: columns[", c, "] is on ",
                columns[c].device(), " but eligible is on ", eligible.device());
  }
  SK_CHECK(k >= 0, "select_smallest: k must be >= 0, got ", k);
}

}  // namespace sparsekit

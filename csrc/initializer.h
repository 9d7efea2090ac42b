#pragma once
// The key-seeded uniform initializer shared bit for bit by the CPU and CUDA kernels.
#include <cmath>
#include <limits>

#include "common.h"

namespace sparsekit {

/// @brief Per-key state of key_seeded_uniform: a hash of (seed, key), computed once per key.
C10_HOST_DEVICE inline uint64_t key_seeded_state(int64_t key, int64_t seed) {
  return mix_key(static_cast<int64_t>(static_cast<uint64_t>(key) ^ mix_key(seed)));
}

/// @brief The affine map from a unit draw u in [0, 1) to [low, high]: fma(scale, u * unit_factor, low).
/// Normally scale = high - low and unit_factor = 1. When high - low overflows (finite bounds
/// more than DBL_MAX apart) scale is half the width and unit_factor 2: u * 2 is exact and
/// the fma rounds once without an intermediate overflow, so values stay finite and in
/// [low, high] instead of becoming inf or NaN (inf * 0).
struct UniformRange {
  double low;
  double scale;
  double unit_factor;
};

inline UniformRange make_uniform_range(double low, double high) {
  const double width = high - low;
  if (std::isfinite(width)) return {low, width, 1.0};
  return {low, 0.5 * high - 0.5 * low, 2.0};
}

/// @brief Value of column `column` for a key with state `key_state`: uniform in [low, high].
/// Only integer arithmetic and one correctly rounded fma, so the CPU and the GPU agree to
/// the last bit.
C10_HOST_DEVICE inline double key_seeded_value(uint64_t key_state, int64_t column, const UniformRange& range) {
  const uint64_t h = mix_key(static_cast<int64_t>(key_state + static_cast<uint64_t>(column + 1) * 0x9E3779B97F4A7C15ULL));
  const double unit = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1), 53 random bits
  return ::fma(range.scale, unit * range.unit_factor, range.low);
}

inline void check_key_seeded_uniform_args(const Tensor& keys, int64_t dim, double low, double high,
                                          ScalarType dtype) {
  check_key_tensor(keys, "key_seeded_uniform", "keys");
  SK_CHECK(keys.dim() == 1, "key_seeded_uniform: keys must be 1-D [N], got shape ", keys.sizes());
  SK_CHECK(dim >= 0, "key_seeded_uniform: dim must be >= 0, got ", dim);
  SK_CHECK(std::isfinite(low) && std::isfinite(high) && low <= high,
              "key_seeded_uniform: need finite low <= high, got low=", low, " high=", high);
  SK_CHECK(is_floating(dtype),
              "key_seeded_uniform: dtype must be float32, float64, float16 or bfloat16, got ", dtype);
  // Every value lies in [low, high], so bounds the dtype holds keep the rows finite (rounding
  // to nearest never passes the largest finite value); float16 rows of low=1e5 would be inf.
  const double largest = dtype == kHalf       ? 65504.0
                         : dtype == kBFloat16 ? 3.3895313892515355e38
                         : dtype == kFloat    ? 3.4028234663852886e38
                                              : std::numeric_limits<double>::max();
  SK_CHECK(std::fabs(low) <= largest && std::fabs(high) <= largest, "key_seeded_uniform: low and high must lie in ",
           dtype, "'s finite range [", -largest, ", ", largest, "], got low=", low, " high=", high);
}

}  // namespace sparsekit

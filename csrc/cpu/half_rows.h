#pragma once
// float16 rows to float32 and back, with the F16C instructions when the CPU has them.
//
// The library is built for baseline x86-64, where a c10::Half converts by a dozen scalar
// integer and float operations per element; vcvtph2ps / vcvtps2ph convert eight per
// instruction. Rounding to float16 is to nearest, ties to even, as c10::Half's (NaNs keep
// their sign and top payload bits where c10 makes them 0x7e00).
#include <cstdint>

#include "cpu/cpu_features.h"
#include "torch_api.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define SPARSEKIT_HALF_ROWS_F16C 1
#else
#define SPARSEKIT_HALF_ROWS_F16C 0
#endif

namespace sparsekit {

namespace detail {
#if SPARSEKIT_HALF_ROWS_F16C
__attribute__((target("avx,f16c"))) inline void widen_half_f16c(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

__attribute__((target("avx,f16c"))) inline void narrow_half_f16c(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = static_cast<Half>(src[i]);
}
#endif
}  // namespace detail

/// @brief dst[0, n) = src[0, n) widened to float32 (exact).
inline void widen_half(const Half* src, float* dst, int64_t n) {
#if SPARSEKIT_HALF_ROWS_F16C
  if (kCpuFeatures.f16c) return detail::widen_half_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// @brief dst[0, n) = src[0, n) rounded to float16 (to nearest, ties to even).
inline void narrow_half(const float* src, Half* dst, int64_t n) {
#if SPARSEKIT_HALF_ROWS_F16C
  if (kCpuFeatures.f16c) return detail::narrow_half_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Half>(src[i]);
}

}  // namespace sparsekit

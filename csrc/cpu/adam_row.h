#pragma once
// One row of the lazy Adam update (lazy_adam_, lazy_adam_tables_ and the fused optimizer of
// pooled_read_update_ share it, so their numbers agree bit for bit), and the prefetch of a
// row's state ahead of it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/cpu_features.h"
#include "lazy_adam.h"

namespace sparsekit {
namespace {

// The vector paths below exist because the compiler cannot vectorize the scalar loop
// itself: without -fno-math-errno, std::sqrt must be able to set errno. SSE2 is the x86-64
// baseline, so no extra build flag is needed. Each intrinsic rounds once, exactly like
// the scalar code, so both paths agree bit for bit, and their moments with
// torch.optim.SparseAdam's; its weight update multiplies by a step size held in double
// where this one rounds it to the weight's dtype first, a last-bit difference in some
// weights.
#if defined(__SSE2__)
struct SimdFloat {
  using vec = __m128;
  static constexpr int64_t width = 4;
  static vec load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, vec x) { _mm_storeu_ps(p, x); }
  static vec set1(float x) { return _mm_set1_ps(x); }
  static vec add(vec a, vec b) { return _mm_add_ps(a, b); }
  static vec sub(vec a, vec b) { return _mm_sub_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm_mul_ps(a, b); }
  static vec div(vec a, vec b) { return _mm_div_ps(a, b); }
  static vec sqrt(vec a) { return _mm_sqrt_ps(a); }
};

struct SimdDouble {
  using vec = __m128d;
  static constexpr int64_t width = 2;
  static vec load(const double* p) { return _mm_loadu_pd(p); }
  static void store(double* p, vec x) { _mm_storeu_pd(p, x); }
  static vec set1(double x) { return _mm_set1_pd(x); }
  static vec add(vec a, vec b) { return _mm_add_pd(a, b); }
  static vec sub(vec a, vec b) { return _mm_sub_pd(a, b); }
  static vec mul(vec a, vec b) { return _mm_mul_pd(a, b); }
  static vec div(vec a, vec b) { return _mm_div_pd(a, b); }
  static vec sqrt(vec a) { return _mm_sqrt_pd(a); }
};

template <typename scalar_t>
struct SimdFor {
  using type = void;
};
template <>
struct SimdFor<float> {
  using type = SimdFloat;
};
template <>
struct SimdFor<double> {
  using type = SimdDouble;
};

/// @brief Updates the first (dim / width) * width entries of a row; returns how many.
template <typename Simd, typename scalar_t>
inline int64_t adam_row_simd(scalar_t* weight, scalar_t* exp_avg, scalar_t* exp_avg_sq, const scalar_t* grad,
                             int64_t dim, const AdamScalars<scalar_t>& s, bool use_weight_decay) {
  using vec = typename Simd::vec;
  const vec one_minus_beta1 = Simd::set1(s.one_minus_beta1);
  const vec one_minus_beta2 = Simd::set1(s.one_minus_beta2);
  const vec eps = Simd::set1(s.eps);
  const vec weight_decay = Simd::set1(s.weight_decay);
  const vec neg_step_size = Simd::set1(s.neg_step_size);
  int64_t j = 0;
  for (; j + Simd::width <= dim; j += Simd::width) {
    const vec w = Simd::load(weight + j);
    vec g = Simd::load(grad + j);
    if (use_weight_decay) g = Simd::add(g, Simd::mul(weight_decay, w));
    const vec m_old = Simd::load(exp_avg + j);
    const vec v_old = Simd::load(exp_avg_sq + j);
    const vec m = Simd::add(m_old, Simd::mul(Simd::sub(g, m_old), one_minus_beta1));
    const vec v = Simd::add(v_old, Simd::mul(Simd::sub(Simd::mul(g, g), v_old), one_minus_beta2));
    const vec update = Simd::mul(neg_step_size, Simd::div(m, Simd::add(Simd::sqrt(v), eps)));
    Simd::store(exp_avg + j, m);
    Simd::store(exp_avg_sq + j, v);
    Simd::store(weight + j, Simd::add(w, update));
  }
  return j;
}
#endif

template <typename scalar_t, typename opmath_t>
inline void adam_row(scalar_t* __restrict__ weight, scalar_t* __restrict__ exp_avg,
                     scalar_t* __restrict__ exp_avg_sq, const scalar_t* __restrict__ grad, int64_t dim,
                     const AdamScalars<opmath_t>& s, bool use_weight_decay) {
  int64_t j = 0;
#if defined(__SSE2__)
  if constexpr (!std::is_void_v<typename SimdFor<scalar_t>::type>) {
    j = adam_row_simd<typename SimdFor<scalar_t>::type, scalar_t>(weight, exp_avg, exp_avg_sq, grad, dim, s,
                                                                  use_weight_decay);
  }
#endif
  for (; j < dim; ++j) {
    const opmath_t w = static_cast<opmath_t>(weight[j]);
    opmath_t g = static_cast<opmath_t>(grad[j]);
    if (use_weight_decay) g = g + s.weight_decay * w;
    const opmath_t m_old = static_cast<opmath_t>(exp_avg[j]);
    const opmath_t v_old = static_cast<opmath_t>(exp_avg_sq[j]);
    const opmath_t m = m_old + (g - m_old) * s.one_minus_beta1;
    const opmath_t v = v_old + (g * g - v_old) * s.one_minus_beta2;
    const opmath_t update = s.neg_step_size * (m / (std::sqrt(v) + s.eps));
    exp_avg[j] = static_cast<scalar_t>(m);
    exp_avg_sq[j] = static_cast<scalar_t>(v);
    weight[j] = static_cast<scalar_t>(w + update);
  }
}

// Rows are scattered over tables far larger than the caches, so the update is bound by
// memory latency (a TLB and cache miss per row of each state tensor), not arithmetic:
// fetching rows ahead overlaps those misses. kPrefetchLines / (lines of a row) rows ahead,
// within [kMinPrefetchRows, kMaxPrefetchRows]. Tuned by benchmarks/bench_lazy_adam.py.
constexpr int64_t kPrefetchLines = 32;
constexpr int64_t kMinPrefetchRows = 4;
constexpr int64_t kMaxPrefetchRows = 32;
constexpr int64_t kCacheLine = 64;

/// @brief Rows ahead whose state the update prefetches, for rows of `row_bytes` bytes.
inline int64_t prefetch_rows_ahead(int64_t row_bytes) {
  const int64_t lines = std::max<int64_t>(1, (row_bytes + kCacheLine - 1) / kCacheLine);
  return std::clamp<int64_t>(kPrefetchLines / lines, kMinPrefetchRows, kMaxPrefetchRows);
}

// Always inlined: GCC finds a function of prefetches alone free of side effects and deletes
// the calls that it does not inline.
SPARSEKIT_ALWAYS_INLINE void prefetch_row(const void* weight, const void* exp_avg, const void* exp_avg_sq,
                                          int64_t row_bytes) {
  for (int64_t byte = 0; byte < row_bytes; byte += kCacheLine) {
    __builtin_prefetch(static_cast<const char*>(weight) + byte, /*rw=*/1);
    __builtin_prefetch(static_cast<const char*>(exp_avg) + byte, /*rw=*/1);
    __builtin_prefetch(static_cast<const char*>(exp_avg_sq) + byte, /*rw=*/1);
  }
}

}  // namespace
}  // namespace sparsekit

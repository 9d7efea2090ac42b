#pragma once
// The vector loads and stores of the pooling loops (pool_loops.h): elements widened to the
// accumulator type (float16 by integer operations or F16C, bfloat16 by a shift), the
// accumulator vector types, and streaming stores. The F16C and streaming versions carry
// their target attributes; the rest is always_inline and takes its caller's instruction set.
#include "cpu/cpu_features.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "torch_api.h"

namespace sparsekit {
namespace {

// 32-byte vector arguments of the always_inline helpers never cross a real call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

// Element loads widened to the accumulator type (the scalar tails). float16 goes through
// c10::Half's conversion (the vector loads below widen it with F16C or integer vector
// operations); bfloat16 is the top half of a float32, a shift that vectorises everywhere.
template <typename acc_t>
SPARSEKIT_ALWAYS_INLINE acc_t load_widened(const float* p) {
  return static_cast<acc_t>(*p);
}
template <typename acc_t>
SPARSEKIT_ALWAYS_INLINE acc_t load_widened(const double* p) {
  return static_cast<acc_t>(*p);
}
template <typename acc_t>
SPARSEKIT_ALWAYS_INLINE acc_t load_widened(const Half* p) {
  return static_cast<acc_t>(static_cast<float>(*p));
}
template <typename acc_t>
SPARSEKIT_ALWAYS_INLINE acc_t load_widened(const BFloat16* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return static_cast<acc_t>(f);
}

// Vectors of kBytes bytes of T (GCC/Clang vector extensions). The accumulators: 32 bytes,
// one AVX2 register in the AVX2 instantiation, two SSE registers in the baseline one; 64
// bytes, one AVX-512 register, used only by the AVX-512 instantiation.
template <typename T, int kBytes>
struct VectorOf {
  typedef T type __attribute__((vector_size(kBytes)));
};

/// The accumulator vector of acc_t that is kBytes (32 or 64) wide.
template <typename acc_t, int kBytes>
struct AccVec {
  using type = typename VectorOf<acc_t, kBytes>::type;
  static constexpr int kLanes = kBytes / static_cast<int>(sizeof(acc_t));
};

// load_into(v, p): the vector's worth of elements at p, widened to the accumulator type
// (vec_t: a float vector for float, float16 and bfloat16 elements, a double one for double).
template <typename vec_t>
SPARSEKIT_ALWAYS_INLINE void load_into(vec_t& v, const float* p) {
  std::memcpy(&v, p, sizeof(v));
}
template <typename vec_t>
SPARSEKIT_ALWAYS_INLINE void load_into(vec_t& v, const double* p) {
  std::memcpy(&v, p, sizeof(v));
}

/// The vectors of 16-bit elements that widen to a float vector of kLanes lanes.
template <int kLanes>
struct HalfLanes {
  using bits = typename VectorOf<uint16_t, 2 * kLanes>::type;
  using wide_bits = typename VectorOf<uint32_t, 4 * kLanes>::type;
};

// float16 widens with integer vector operations (exact for every value, subnormals, inf and
// NaN included): GCC converts a _Float16 vector one element at a time. The exponent is
// rebiased by 127 - 15; inf/NaN go to 255; subnormals are 2^-14 * (1 + m) minus 2^-14.
template <typename vec_t>
SPARSEKIT_ALWAYS_INLINE void load_into(vec_t& v, const Half* p) {
  using Lanes = HalfLanes<sizeof(vec_t) / sizeof(float)>;
  using u32v = typename Lanes::wide_bits;
  constexpr uint32_t kExponent = 0x7c00u << 13;  // the exponent bits after the shift
  constexpr uint32_t kTwoToMinus14 = 113u << 23;
  typename Lanes::bits bits;
  std::memcpy(&bits, p, sizeof(bits));
  const u32v h = __builtin_convertvector(bits, u32v);
  u32v o = (h & 0x7fffu) << 13;
  const u32v exponent = o & kExponent;
  o += (127u - 15u) << 23;
  const u32v inf_nan = (u32v)(exponent == kExponent);  // all ones where true
  const u32v small = (u32v)(exponent == 0u);
  o += inf_nan & ((128u - 16u) << 23);
  o += small & (1u << 23);
  vec_t f, magic, less;
  std::memcpy(&f, &o, sizeof(f));
  const u32v magic_bits = u32v{} + kTwoToMinus14;
  std::memcpy(&magic, &magic_bits, sizeof(magic));
  less = f - magic;
  u32v less_bits, out;
  std::memcpy(&less_bits, &less, sizeof(less_bits));
  out = (small & less_bits) | (~small & o);
  out |= (h & 0x8000u) << 16;
  std::memcpy(&v, &out, sizeof(v));
}
#if SPARSEKIT_X86_DISPATCH
// load_into for float16 with F16C (vcvtph2ps), for the AVX2 and AVX-512 instantiations.
// Not always_inline: GCC inlines a target function only into callers of that target, which
// these become once inlined into pool_bag_range_avx2/_avx512.
SPARSEKIT_TARGET_AVX2 inline void load_into_f16c(AccVec<float, 32>::type& v, const Half* p) {
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
}
// _mm512_cvtph_ps passes an undefined vector as the (unused) source of masked-off lanes.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
SPARSEKIT_TARGET_AVX512 inline void load_into_f16c(AccVec<float, 64>::type& v, const Half* p) {
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
}
#pragma GCC diagnostic pop
#else
template <typename vec_t>
SPARSEKIT_ALWAYS_INLINE void load_into_f16c(vec_t& v, const Half* p) {
  load_into(v, p);
}
#endif

// Streaming (non-temporal) stores of one vector to an address aligned to its size: the line
// goes to memory without first being read in (no read-for-ownership), and without pushing
// out of the caches the table rows the lookups ahead have prefetched. Only the AVX2 and
// AVX-512 instantiations use them (see load_into_f16c on why these are not always_inline);
// stores_done orders them before the call's return.
#if SPARSEKIT_X86_DISPATCH
SPARSEKIT_TARGET_AVX2 inline void stream_vector(float* dst, const AccVec<float, 32>::type& v) {
  __m256 x;
  std::memcpy(&x, &v, sizeof(x));
  _mm256_stream_ps(dst, x);
}
SPARSEKIT_TARGET_AVX2 inline void stream_vector(double* dst, const AccVec<double, 32>::type& v) {
  __m256d x;
  std::memcpy(&x, &v, sizeof(x));
  _mm256_stream_pd(dst, x);
}
SPARSEKIT_TARGET_AVX512 inline void stream_vector(float* dst, const AccVec<float, 64>::type& v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  _mm512_stream_ps(dst, x);
}
SPARSEKIT_TARGET_AVX512 inline void stream_vector(double* dst, const AccVec<double, 64>::type& v) {
  __m512d x;
  std::memcpy(&x, &v, sizeof(x));
  _mm512_stream_pd(dst, x);
}
inline void stores_done() { _mm_sfence(); }
#else
template <typename scalar_t, typename vec_t>
SPARSEKIT_ALWAYS_INLINE void stream_vector(scalar_t* dst, const vec_t& v) {
  std::memcpy(dst, &v, sizeof(v));
}
inline void stores_done() {}
#endif

template <typename vec_t>
SPARSEKIT_ALWAYS_INLINE void load_into(vec_t& v, const BFloat16* p) {
  using Lanes = HalfLanes<sizeof(vec_t) / sizeof(float)>;
  typename Lanes::bits bits;
  std::memcpy(&bits, p, sizeof(bits));
  const typename Lanes::wide_bits wide = __builtin_convertvector(bits, typename Lanes::wide_bits) << 16;
  std::memcpy(&v, &wide, sizeof(v));
}

}  // namespace
}  // namespace sparsekit

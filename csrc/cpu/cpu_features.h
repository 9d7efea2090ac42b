#pragma once
// What the CPU offers beyond baseline x86-64, read once per process: the .so is built
// without -march flags, so kernels pick AVX2 / AVX-512, popcnt and F16C at run time.
// SPARSEKIT_CPU_CAPABILITY=default|avx2|avx512 lowers the choice so that the tests run every
// fallback on one machine; any other value changes nothing.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

// The attributes of the functions that hold a kernel's vector loops: one instantiation per
// instruction set, chosen at run time from kCpuFeatures (the library is built for baseline
// x86-64). Their always_inline helpers take the caller's instruction set.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SPARSEKIT_X86_DISPATCH 1
#define SPARSEKIT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPARSEKIT_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#else
#define SPARSEKIT_X86_DISPATCH 0
#define SPARSEKIT_TARGET_AVX2
#define SPARSEKIT_TARGET_AVX512
#endif

#if defined(__GNUC__)
#define SPARSEKIT_ALWAYS_INLINE inline __attribute__((always_inline))
#define SPARSEKIT_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define SPARSEKIT_ALWAYS_INLINE inline
#define SPARSEKIT_ALWAYS_INLINE_LAMBDA
#endif

namespace sparsekit {

/// The widest vector instructions of the pooling loops: AVX2 needs FMA and F16C with it.
enum class Isa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  Isa isa = Isa::kBaseline;
  bool popcnt = false;  // the popcnt instruction (x86-64-v2)
  bool f16c = false;    // vcvtph2ps / vcvtps2ph with their AVX encoding
};

namespace detail {
inline CpuFeatures detect_cpu_features() {
  CpuFeatures found;
#if defined(__GNUC__) && defined(__x86_64__)
  __builtin_cpu_init();
  found.popcnt = __builtin_cpu_supports("popcnt") != 0;
  found.f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && found.f16c) {
    found.isa = __builtin_cpu_supports("avx512f") ? Isa::kAvx512 : Isa::kAvx2;
  }
#endif
  const char* cap = std::getenv("SPARSEKIT_CPU_CAPABILITY");
  if (cap != nullptr && std::strcmp(cap, "default") == 0) {
    found = CpuFeatures{};
  } else if (cap != nullptr && std::strcmp(cap, "avx2") == 0) {
    found.isa = std::min(found.isa, Isa::kAvx2);
  }
  return found;
}
}  // namespace detail

/// The CPU's features, lowered by SPARSEKIT_CPU_CAPABILITY; one copy for the whole library.
inline const CpuFeatures kCpuFeatures = detail::detect_cpu_features();

/// @brief What kCpuFeatures holds, as "avx512 popcnt f16c" ("default" when nothing).
inline std::string describe_cpu_features() {
  std::string text = kCpuFeatures.isa == Isa::kAvx512 ? "avx512" : kCpuFeatures.isa == Isa::kAvx2 ? "avx2" : "default";
  if (kCpuFeatures.popcnt) text += " popcnt";
  if (kCpuFeatures.f16c) text += " f16c";
  return text;
}

}  // namespace sparsekit

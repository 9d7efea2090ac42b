// DLRM's pairwise interaction on the CPU: the dot products of the vector pairs i < j of
// each sample (_pair_dots) and their gradient (_pair_dots_backward), for the training
// harness's model (sparsekit/train/model.py).
// A sample holds few short vectors, so a batched V V^T is mostly per-matrix overhead: here
// each vector lane holds one sample (a block transposed into [n][d][lane] scratch). Every
// output element depends on its own sample and is summed in a fixed order, so the results
// do not depend on the thread count.
#include "cpu/cpu_features.h"
#include "cpu/parallel.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace sparsekit {
namespace {

#pragma GCC diagnostic ignored "-Wpsabi"

// Pairs whose dot products the forward sums at once (independent chains), and column
// vectors the backward sums at once (their sums in registers).
constexpr int kForwardPairs = 4;
constexpr int kBackwardColumns = 8;
// Multiply-adds a parallel task gets at least.
constexpr int64_t kPairGrainWork = 1 << 16;

/// A vector of kBytes (the instruction set's width: 64, 32 or 16) holding one sample per lane.
template <typename scalar_t, int kBytes>
struct SampleLanes {
  static constexpr int kLanes = kBytes / static_cast<int>(sizeof(scalar_t));
  typedef scalar_t vec __attribute__((vector_size(kBytes)));
};

/// Scratch of `count` vectors, aligned to the vector size (std::vector's allocator does not
/// align over-aligned element types in this build).
template <typename vec>
class VectorScratch {
 public:
  explicit VectorScratch(int64_t count) : bytes_(static_cast<size_t>(count) * sizeof(vec) + sizeof(vec)) {
    void* at = bytes_.data();
    size_t space = bytes_.size();
    data_ = static_cast<vec*>(std::align(sizeof(vec), static_cast<size_t>(count) * sizeof(vec), at, space));
  }
  vec* data() { return data_; }

 private:
  std::vector<unsigned char> bytes_;
  vec* data_;
};

/// Position of the pair (i, j), i < j, of n vectors in triu_indices order.
inline int64_t pair_index(int64_t i, int64_t j, int64_t n) { return i * (2 * n - i - 1) / 2 + (j - i - 1); }

#if defined(__GNUC__) && !defined(__clang__)
#define SPARSEKIT_VECTOR_TRANSPOSE 1
/// Transposes the kLanes x kLanes matrix whose rows are m[0..kLanes): log2(kLanes) rounds of
/// interleaving row r with row r + kLanes / 2 (their low halves into row 2r, their high
/// halves into row 2r + 1), each interleave one two-vector shuffle.
template <typename scalar_t, int kBytes, typename vec>
SPARSEKIT_ALWAYS_INLINE void transpose_square(vec* m) {
  constexpr int kLanes = SampleLanes<scalar_t, kBytes>::kLanes;
  using mask_t = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
  typedef mask_t mask __attribute__((vector_size(kBytes)));
  mask low, high;
  for (int l = 0; l < kLanes; ++l) {
    low[l] = (l % 2) * kLanes + l / 2;
    high[l] = low[l] + kLanes / 2;
  }
  for (int round = 1; round < kLanes; round *= 2) {
    vec next[kLanes];
    for (int r = 0; r < kLanes / 2; ++r) {
      next[2 * r] = __builtin_shuffle(m[r], m[r + kLanes / 2], low);
      next[2 * r + 1] = __builtin_shuffle(m[r], m[r + kLanes / 2], high);
    }
    for (int r = 0; r < kLanes; ++r) m[r] = next[r];
  }
}
#else
#define SPARSEKIT_VECTOR_TRANSPOSE 0
#endif

/// Rows [b0, b0 + count) of a row-major [rows, width] matrix (rows `stride` apart) into
/// lanes: lanes[e][l] = src[(b0 + l) * stride + e]; lanes past `count` are zero. A whole
/// block goes kLanes columns at a time through transpose_square.
template <typename scalar_t, int kBytes, typename vec>
SPARSEKIT_ALWAYS_INLINE void to_lanes(const scalar_t* src, int64_t stride, int64_t b0, int64_t count, int64_t width,
                                      vec* lanes) {
  constexpr int kLanes = SampleLanes<scalar_t, kBytes>::kLanes;
  scalar_t* out = reinterpret_cast<scalar_t*>(lanes);
  int64_t e0 = 0;
#if SPARSEKIT_VECTOR_TRANSPOSE
  if (count == kLanes) {
    for (; e0 + kLanes <= width; e0 += kLanes) {
      vec m[kLanes];
      for (int l = 0; l < kLanes; ++l) std::memcpy(&m[l], src + (b0 + l) * stride + e0, sizeof(vec));
      transpose_square<scalar_t, kBytes>(m);
      for (int c = 0; c < kLanes; ++c) lanes[e0 + c] = m[c];
    }
  }
#endif
  if (count < kLanes) std::fill(out + e0 * kLanes, out + width * kLanes, scalar_t(0));
  for (int64_t l = 0; l < count; ++l) {
    const scalar_t* row = src + (b0 + l) * stride;
    for (int64_t e = e0; e < width; ++e) out[e * kLanes + l] = row[e];
  }
}

/// The inverse of to_lanes for the first `count` lanes.
template <typename scalar_t, int kBytes, typename vec>
SPARSEKIT_ALWAYS_INLINE void from_lanes(const vec* lanes, int64_t b0, int64_t count, int64_t width, scalar_t* dst,
                                        int64_t stride) {
  constexpr int kLanes = SampleLanes<scalar_t, kBytes>::kLanes;
  const scalar_t* in = reinterpret_cast<const scalar_t*>(lanes);
  int64_t e0 = 0;
#if SPARSEKIT_VECTOR_TRANSPOSE
  if (count == kLanes) {
    for (; e0 + kLanes <= width; e0 += kLanes) {
      vec m[kLanes];
      for (int c = 0; c < kLanes; ++c) m[c] = lanes[e0 + c];
      transpose_square<scalar_t, kBytes>(m);
      for (int l = 0; l < kLanes; ++l) std::memcpy(dst + (b0 + l) * stride + e0, &m[l], sizeof(vec));
    }
  }
#endif
  for (int64_t l = 0; l < count; ++l) {
    scalar_t* row = dst + (b0 + l) * stride;
    for (int64_t e = e0; e < width; ++e) row[e] = in[e * kLanes + l];
  }
}

struct PairProblem {
  int64_t batch, n, dim, pairs;
};

/// res[q] = the dot products of vector vi with the kPairs vectors after one another at vj
/// (d columns each): kPairs independent chains of multiply-adds.
template <int kPairs, typename vec>
SPARSEKIT_ALWAYS_INLINE void dots_with(const vec* vi, const vec* vj, int64_t d, vec* res) {
  vec acc[kPairs];
  for (int q = 0; q < kPairs; ++q) acc[q] = vec{};
  for (int64_t k = 0; k < d; ++k) {
    const vec x = vi[k];
    for (int q = 0; q < kPairs; ++q) acc[q] += x * vj[q * d + k];
  }
  for (int q = 0; q < kPairs; ++q) res[q] = acc[q];
}

/// Forward over the sample blocks [first, last): out[b][pair(i, j)] = V[b, i] . V[b, j].
template <typename scalar_t, int kBytes>
SPARSEKIT_ALWAYS_INLINE void pair_dots_blocks(const PairProblem& p, const scalar_t* vectors, scalar_t* out,
                                              int64_t first, int64_t last) {
  using vec = typename SampleLanes<scalar_t, kBytes>::vec;
  constexpr int kLanes = SampleLanes<scalar_t, kBytes>::kLanes;
  const int64_t n = p.n, d = p.dim, width = n * d;
  VectorScratch<vec> lanes(width), dots(p.pairs);
  for (int64_t block = first; block < last; ++block) {
    const int64_t b0 = block * kLanes;
    const int64_t count = std::min<int64_t>(kLanes, p.batch - b0);
    to_lanes<scalar_t, kBytes>(vectors, width, b0, count, width, lanes.data());
    vec* res = dots.data();
    for (int64_t i = 0; i < n; ++i) {
      const vec* vi = lanes.data() + i * d;
      int64_t j = i + 1;
      for (; j + kForwardPairs <= n; j += kForwardPairs) {
        dots_with<kForwardPairs>(vi, lanes.data() + j * d, d, res);
        res += kForwardPairs;
      }
      for (; j < n; ++j) {
        const vec* vj = lanes.data() + j * d;
        vec a = {};
        for (int64_t k = 0; k < d; ++k) a += vi[k] * vj[k];
        *res++ = a;
      }
    }
    from_lanes<scalar_t, kBytes>(dots.data(), b0, count, p.pairs, out, p.pairs);
  }
}

/// Columns [k0, k0 + kColumns) of vector i's gradient in a block: the sum over j != i,
/// ascending, of the pair's gradient times column k of vector j (sums in registers).
template <int kColumns, typename vec>
SPARSEKIT_ALWAYS_INLINE void sum_pair_gradients(const vec* lanes, const vec* grads, int64_t n, int64_t d, int64_t i,
                                                int64_t k0, vec* sums) {
  vec acc[kColumns];
  for (int c = 0; c < kColumns; ++c) acc[c] = vec{};
  // The pairs (j < i, i): pair_index(j + 1, i) is pair_index(j, i) + n - j - 2.
  int64_t at = i - 1;
  for (int64_t j = 0; j < i; ++j) {
    const vec g = grads[at];
    const vec* vj = lanes + j * d + k0;
    for (int c = 0; c < kColumns; ++c) acc[c] += g * vj[c];
    at += n - j - 2;
  }
  // The pairs (i, j > i) lie one after another.
  const vec* g_row = grads + pair_index(i, i + 1, n) - (i + 1);
  for (int64_t j = i + 1; j < n; ++j) {
    const vec g = g_row[j];
    const vec* vj = lanes + j * d + k0;
    for (int c = 0; c < kColumns; ++c) acc[c] += g * vj[c];
  }
  for (int c = 0; c < kColumns; ++c) sums[i * d + k0 + c] = acc[c];
}

/// Backward over the sample blocks [first, last): grad_vectors[b, i] = sum over j != i,
/// ascending, of grad[b][pair(min(i, j), max(i, j))] * V[b, j].
template <typename scalar_t, int kBytes>
SPARSEKIT_ALWAYS_INLINE void pair_dots_backward_blocks(const PairProblem& p, const scalar_t* grad,
                                                       int64_t grad_stride, const scalar_t* vectors,
                                                       scalar_t* grad_vectors, int64_t first, int64_t last) {
  using vec = typename SampleLanes<scalar_t, kBytes>::vec;
  constexpr int kLanes = SampleLanes<scalar_t, kBytes>::kLanes;
  const int64_t n = p.n, d = p.dim, width = n * d;
  VectorScratch<vec> lanes(width), grads(p.pairs), sums(width);
  for (int64_t block = first; block < last; ++block) {
    const int64_t b0 = block * kLanes;
    const int64_t count = std::min<int64_t>(kLanes, p.batch - b0);
    to_lanes<scalar_t, kBytes>(vectors, width, b0, count, width, lanes.data());
    to_lanes<scalar_t, kBytes>(grad, grad_stride, b0, count, p.pairs, grads.data());
    for (int64_t i = 0; i < n; ++i) {
      int64_t k0 = 0;
      for (; k0 + kBackwardColumns <= d; k0 += kBackwardColumns) {
        sum_pair_gradients<kBackwardColumns>(lanes.data(), grads.data(), n, d, i, k0, sums.data());
      }
      if (k0 + 4 <= d) {
        sum_pair_gradients<4>(lanes.data(), grads.data(), n, d, i, k0, sums.data());
        k0 += 4;
      }
      if (k0 + 2 <= d) {
        sum_pair_gradients<2>(lanes.data(), grads.data(), n, d, i, k0, sums.data());
        k0 += 2;
      }
      if (k0 < d) sum_pair_gradients<1>(lanes.data(), grads.data(), n, d, i, k0, sums.data());
    }
    from_lanes<scalar_t, kBytes>(sums.data(), b0, count, width, grad_vectors, width);
  }
}

template <typename scalar_t>
SPARSEKIT_TARGET_AVX512 void pair_dots_avx512(const PairProblem& p, const scalar_t* vectors, scalar_t* out,
                                              int64_t first, int64_t last) {
  pair_dots_blocks<scalar_t, 64>(p, vectors, out, first, last);
}
template <typename scalar_t>
SPARSEKIT_TARGET_AVX2 void pair_dots_avx2(const PairProblem& p, const scalar_t* vectors, scalar_t* out,
                                          int64_t first, int64_t last) {
  pair_dots_blocks<scalar_t, 32>(p, vectors, out, first, last);
}
template <typename scalar_t>
void pair_dots_baseline(const PairProblem& p, const scalar_t* vectors, scalar_t* out, int64_t first, int64_t last) {
  pair_dots_blocks<scalar_t, 16>(p, vectors, out, first, last);
}

template <typename scalar_t>
SPARSEKIT_TARGET_AVX512 void pair_dots_backward_avx512(const PairProblem& p, const scalar_t* grad,
                                                       int64_t grad_stride, const scalar_t* vectors,
                                                       scalar_t* grad_vectors, int64_t first, int64_t last) {
  pair_dots_backward_blocks<scalar_t, 64>(p, grad, grad_stride, vectors, grad_vectors, first, last);
}
template <typename scalar_t>
SPARSEKIT_TARGET_AVX2 void pair_dots_backward_avx2(const PairProblem& p, const scalar_t* grad, int64_t grad_stride,
                                                   const scalar_t* vectors, scalar_t* grad_vectors, int64_t first,
                                                   int64_t last) {
  pair_dots_backward_blocks<scalar_t, 32>(p, grad, grad_stride, vectors, grad_vectors, first, last);
}
template <typename scalar_t>
void pair_dots_backward_baseline(const PairProblem& p, const scalar_t* grad, int64_t grad_stride,
                                 const scalar_t* vectors, scalar_t* grad_vectors, int64_t first, int64_t last) {
  pair_dots_backward_blocks<scalar_t, 16>(p, grad, grad_stride, vectors, grad_vectors, first, last);
}

/// Checks `vectors` and returns the problem it poses.
PairProblem pair_problem(const char* op, const Tensor& vectors) {
  SK_CHECK(vectors.device().is_cpu(), op, ": vectors must be a CPU tensor, got ", vectors.device());
  SK_CHECK(vectors.dim() == 3, op, ": vectors must be 3-D [batch, n, dim], got shape ", vectors.sizes());
  SK_CHECK(vectors.scalar_type() == kFloat || vectors.scalar_type() == kDouble, op,
           ": vectors must be float32 or float64, got ", vectors.scalar_type());
  const int64_t n = vectors.size(1);
  // (Its pairs' count must fit an int64; an output that large is refused by the allocator.)
  SK_CHECK(n <= (int64_t{1} << 31), op, ": vectors must hold at most 2^31 vectors per sample, got ", n);
  return {vectors.size(0), n, vectors.size(2), n * (n - 1) / 2};
}

/// Samples per block: the lanes of the instruction set's vectors (64, 32 or 16 bytes).
int64_t block_lanes(Isa isa, size_t element_bytes) {
  const int64_t bytes = isa == Isa::kAvx512 ? 64 : isa == Isa::kAvx2 ? 32 : 16;
  return bytes / static_cast<int64_t>(element_bytes);
}

/// Sample blocks of `lanes` samples per parallel task: at least kPairGrainWork multiply-adds.
int64_t block_grain(const PairProblem& p, int64_t lanes) {
  const int64_t work = std::max<int64_t>(1, p.pairs * std::max<int64_t>(p.dim, 1) * lanes);
  return std::max<int64_t>(1, kPairGrainWork / work);
}

/// How a call's samples go to tasks: blocks of `lanes` samples, one lane each, for the
/// instruction set in use.
struct PairBlocks {
  Isa isa;
  int64_t lanes, blocks;
};

/// The call's blocks, once its per-task scratch (`vectors` vectors of a block for each of
/// at most num_threads() tasks) is known to fit the machine's memory: a few samples with
/// many vectors each take up to a block's worth of lanes more than their own size. Checked
/// before any output is allocated.
PairBlocks plan_blocks(const char* op, const PairProblem& p, ScalarType dtype, int64_t vectors) {
  const Isa isa = kCpuFeatures.isa;
  const int64_t element = element_size(dtype);
  const int64_t lanes = block_lanes(isa, static_cast<size_t>(element));
  const int64_t blocks = (p.batch + lanes - 1) / lanes;
  const double tasks = static_cast<double>(std::min<int64_t>(blocks, num_threads()));
  check_host_fits(op, message("the scratch of its sample blocks (n = ", p.n, ", dim = ", p.dim, ")"),
                  tasks * static_cast<double>(vectors) * static_cast<double>(lanes * element));
  return {isa, lanes, blocks};
}

/// Runs fn(scalar_t{}) with the C++ type of `dtype` (float32 or float64, checked before).
template <typename F>
void with_pair_type(ScalarType dtype, const F& fn) {
  if (dtype == kFloat) {
    fn(float{});
  } else {
    fn(double{});
  }
}

Tensor pair_dots_cpu(const Tensor& vectors_in) {
  const char* op = "_pair_dots";
  const PairProblem p = pair_problem(op, vectors_in);
  const Tensor vectors = as_contiguous(vectors_in);
  const ScalarType dtype = vectors.scalar_type();
  const PairBlocks plan = plan_blocks(op, p, dtype, p.n * p.dim + p.pairs);
  // The pairs' count comes from n alone: [1, 2^21, 0] asks for 2^41 outputs.
  Tensor out = allocate_host_or_fail(
      op, message("the output ([", p.batch, ", n * (n - 1) / 2 = ", p.pairs, "])"),
      static_cast<double>(p.batch) * static_cast<double>(p.pairs) * static_cast<double>(element_size(dtype)),
      [&] { return empty({p.batch, p.pairs}, dtype, vectors.device()); });
  if (p.batch == 0 || p.pairs == 0) return out;
  with_pair_type(dtype, [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* v = vectors.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const Isa isa = plan.isa;
    parallel_for(0, plan.blocks, block_grain(p, plan.lanes), [&](int64_t first, int64_t last) {
      if (isa == Isa::kAvx512) {
        pair_dots_avx512(p, v, o, first, last);
      } else if (isa == Isa::kAvx2) {
        pair_dots_avx2(p, v, o, first, last);
      } else {
        pair_dots_baseline(p, v, o, first, last);
      }
    });
  });
  return out;
}

Tensor pair_dots_backward_cpu(const Tensor& grad_in, const Tensor& vectors_in) {
  const char* op = "_pair_dots_backward";
  const PairProblem p = pair_problem(op, vectors_in);
  SK_CHECK(grad_in.device().is_cpu(), op, ": grad must be a CPU tensor, got ", grad_in.device());
  SK_CHECK(grad_in.dim() == 2 && grad_in.size(0) == p.batch && grad_in.size(1) == p.pairs, op,
           ": grad must be [batch, n * (n - 1) / 2] = [", p.batch, ", ", p.pairs, "] for vectors of shape ",
           vectors_in.sizes(), ", got shape ", grad_in.sizes());
  SK_CHECK(grad_in.scalar_type() == vectors_in.scalar_type(), op, ": grad must have the dtype of vectors (",
           vectors_in.scalar_type(), "), got ", grad_in.scalar_type());
  const Tensor vectors = as_contiguous(vectors_in);
  // Rows any stride apart (a slice of a wider gradient), each row contiguous.
  const Tensor grad = grad_in.size(1) <= 1 || grad_in.stride(1) == 1 ? grad_in : as_contiguous(grad_in);
  const ScalarType dtype = vectors.scalar_type();
  if (p.pairs == 0) return zeros({p.batch, p.n, p.dim}, dtype, vectors.device());
  if (p.batch == 0 || p.dim == 0) return empty({p.batch, p.n, p.dim}, dtype, vectors.device());
  // (The output is the size of vectors; the pairs' scratch of each block is not.)
  const PairBlocks plan = plan_blocks(op, p, dtype, 2 * p.n * p.dim + p.pairs);
  Tensor out = empty({p.batch, p.n, p.dim}, dtype, vectors.device());
  with_pair_type(dtype, [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const int64_t g_stride = grad.size(0) <= 1 ? p.pairs : grad.stride(0);
    const scalar_t* v = vectors.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const Isa isa = plan.isa;
    parallel_for(0, plan.blocks, block_grain(p, 2 * plan.lanes), [&](int64_t first, int64_t last) {
      if (isa == Isa::kAvx512) {
        pair_dots_backward_avx512(p, g, g_stride, v, o, first, last);
      } else if (isa == Isa::kAvx2) {
        pair_dots_backward_avx2(p, g, g_stride, v, o, first, last);
      } else {
        pair_dots_backward_baseline(p, g, g_stride, v, o, first, last);
      }
    });
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("_pair_dots", TORCH_BOX(&pair_dots_cpu));
  m.impl("_pair_dots_backward", TORCH_BOX(&pair_dots_backward_cpu));
}

}  // namespace sparsekit

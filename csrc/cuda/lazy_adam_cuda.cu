// CUDA kernel of lazy_adam_: Adam on the rows of a sparse gradient only.
#include "cuda/cuda_api.h"
#include "cuda/rounding.cuh"

#include "lazy_adam.h"

namespace sparsekit {
namespace {



// A warp-wide row of the block works on one gradient row at a time.
constexpr int kRowThreads = 32;
constexpr int kRowsPerBlock = 8;

// Flag bits of check_rows_kernel.
constexpr int32_t kRowOutOfRange = 1;
constexpr int32_t kRowRepeated = 2;

/// Flags a row outside [0, num_rows) (kRowOutOfRange, the row in bad_rows[0]) and a row
/// seen twice (kRowRepeated, the row in bad_rows[1]), marking each row in `seen`, a zeroed
/// bitmap of num_rows bits.
template <typename index_t>
__global__ void check_rows_kernel(const index_t* __restrict__ rows, int64_t num_updates, int64_t num_rows,
                                  unsigned int* __restrict__ seen, int32_t* bad_flag, unsigned long long* bad_rows) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_updates;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = static_cast<int64_t>(rows[i]);
    if (row < 0 || row >= num_rows) {
      atomicOr(bad_flag, kRowOutOfRange);
      atomicExch(bad_rows, static_cast<unsigned long long>(row));
      continue;
    }
    const unsigned int bit = 1u << (row & 31);
    if (atomicOr(seen + (row >> 5), bit) & bit) {
      atomicOr(bad_flag, kRowRepeated);
      atomicExch(bad_rows + 1, static_cast<unsigned long long>(row));
    }
  }
}

template <typename scalar_t, typename opmath_t, typename index_t>
__global__ void lazy_adam_kernel(scalar_t* __restrict__ weight, scalar_t* __restrict__ exp_avg,
                                 scalar_t* __restrict__ exp_avg_sq, const index_t* __restrict__ rows,
                                 const scalar_t* __restrict__ grad, int64_t num_updates, int64_t dim,
                                 AdamScalars<opmath_t> s, bool use_weight_decay, const int32_t* bad_flag) {
  // A row out of range or repeated, seen by check_rows_kernel: update nothing.
  if (*bad_flag != 0) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.y; i < num_updates;
       i += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t offset = static_cast<int64_t>(rows[i]) * dim;
    const scalar_t* grad_row = grad + i * dim;
    for (int64_t j = threadIdx.x; j < dim; j += kRowThreads) {
      const opmath_t w = static_cast<opmath_t>(weight[offset + j]);
      opmath_t g = static_cast<opmath_t>(grad_row[j]);
      if (use_weight_decay) g = add_rn(g, mul_rn(s.weight_decay, w));
      const opmath_t m_old = static_cast<opmath_t>(exp_avg[offset + j]);
      const opmath_t v_old = static_cast<opmath_t>(exp_avg_sq[offset + j]);
      const opmath_t m = add_rn(m_old, mul_rn(sub_rn(g, m_old), s.one_minus_beta1));
      const opmath_t v = add_rn(v_old, mul_rn(sub_rn(mul_rn(g, g), v_old), s.one_minus_beta2));
      const opmath_t update = mul_rn(s.neg_step_size, div_rn(m, add_rn(sqrt_rn(v), s.eps)));
      exp_avg[offset + j] = static_cast<scalar_t>(m);
      exp_avg_sq[offset + j] = static_cast<scalar_t>(v);
      weight[offset + j] = static_cast<scalar_t>(add_rn(w, update));
    }
  }
}

}  // namespace

/// @brief In-place lazy Adam: updates weight, exp_avg and exp_avg_sq at `rows` only.
/// Host sync: one, reading the bad-row flag after the launches (a bad call writes nothing).
/// @param weight [R, ...] parameter, contiguous, updated in place.
/// @param exp_avg, exp_avg_sq [R, ...] moments with weight's dtype and shape, updated in place.
/// @param rows int64 or int32 [u], distinct row indices in [0, R) (both checked first).
/// @param grad [u, ...] gradient rows with weight's dtype.
/// @param step the step number after incrementing (>= 1), for the bias correction.
void lazy_adam_cuda(Tensor& weight, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& rows,
                    const Tensor& grad, int64_t step, double lr, double beta1, double beta2, double eps,
                    double weight_decay) {
  check_lazy_adam_args(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay);
  check_lazy_adam_disjoint("lazy_adam_", weight, exp_avg, exp_avg_sq, rows, grad);
  const DeviceGuard device_guard(weight.get_device_index());
  const int64_t num_updates = rows.size(0);
  const int64_t num_rows = weight.size(0);
  const int64_t dim = num_rows == 0 ? 0 : weight.numel() / num_rows;
  if (num_updates == 0) return;
  const Tensor rows_c = as_contiguous(rows);
  const Tensor grad_c = as_contiguous(grad);
  // [flag, row out of range, repeated row] in one allocation so the host reads them with
  // one copy; a bitmap of weight's rows to find a repeated row.
  Tensor bad = zeros_cuda({3}, kLong, rows.device());
  int32_t* bad_flag = reinterpret_cast<int32_t*>(bad.mutable_data_ptr<int64_t>());
  auto* bad_rows = reinterpret_cast<unsigned long long*>(bad.mutable_data_ptr<int64_t>() + 1);
  Tensor seen = zeros_cuda({(num_rows + 31) / 32}, kInt, rows.device());
  const cudaStream_t stream = current_stream(weight);
  const double step_size = lazy_adam_step_size(step, lr, beta1, beta2);
  const bool use_weight_decay = weight_decay != 0.0;
  const int64_t check_blocks = std::min<int64_t>((num_updates + 255) / 256, int64_t{1} << 16);
  const int64_t update_blocks = std::min<int64_t>((num_updates + kRowsPerBlock - 1) / kRowsPerBlock, int64_t{1} << 20);
  SK_DISPATCH_INDEX_TYPES(rows_c.scalar_type(), "lazy_adam_cuda_rows", [&] {
    check_rows_kernel<index_t><<<check_blocks, 256, 0, stream>>>(
        rows_c.mutable_data_ptr<index_t>(), num_updates, num_rows,
        reinterpret_cast<unsigned int*>(seen.mutable_data_ptr<int32_t>()), bad_flag, bad_rows);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
    if (dim == 0) return;
    SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "lazy_adam_cuda", [&] {
      using opmath_t = acc_type<scalar_t>;
      const auto scalars = AdamScalars<opmath_t>::make(step_size, beta1, beta2, eps, weight_decay);
      lazy_adam_kernel<scalar_t, opmath_t, index_t><<<update_blocks, dim3(kRowThreads, kRowsPerBlock), 0, stream>>>(
          weight.mutable_data_ptr<scalar_t>(), exp_avg.mutable_data_ptr<scalar_t>(), exp_avg_sq.mutable_data_ptr<scalar_t>(),
          rows_c.mutable_data_ptr<index_t>(), grad_c.mutable_data_ptr<scalar_t>(), num_updates, dim, scalars, use_weight_decay,
          bad_flag);
      SK_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // The documented host sync.
  const Tensor bad_host = cpu(bad);
  const int64_t* bad_host_ptr = bad_host.const_data_ptr<int64_t>();
  const int32_t flag = *reinterpret_cast<const int32_t*>(bad_host_ptr);
  SK_CHECK((flag & kRowOutOfRange) == 0, lazy_adam_row_range_message(bad_host_ptr[1], num_rows));
  SK_CHECK((flag & kRowRepeated) == 0, lazy_adam_repeated_row_message(bad_host_ptr[2]));
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("lazy_adam_", TORCH_BOX(&lazy_adam_cuda));
}

}  // namespace sparsekit

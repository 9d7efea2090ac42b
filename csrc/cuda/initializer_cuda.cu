// key_seeded_uniform on the GPU: the same integer hash and fma as the CPU kernel, so the
// two agree bit for bit.
#include "cuda/cuda_api.h"

#include <algorithm>
#include <optional>

#include "initializer.h"

namespace sparsekit {

namespace {

constexpr int kThreads = 256;

template <typename key_t, typename scalar_t>
__global__ void key_seeded_uniform_kernel(const key_t* __restrict__ keys, int64_t n, int64_t dim, int64_t seed,
                                          UniformRange range, scalar_t* __restrict__ out) {
  const int64_t total = n * dim;
  for (int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; flat < total;
       flat += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = flat / dim;
    const uint64_t state = key_seeded_state(static_cast<int64_t>(keys[row]), seed);
    out[flat] = static_cast<scalar_t>(key_seeded_value(state, flat - row * dim, range));
  }
}

}  // namespace

/// @brief Initial embedding rows seeded by key (see the CPU kernel for the contract).
Tensor key_seeded_uniform_cuda(const Tensor& keys, int64_t dim, int64_t seed, double low, double high,
                                   std::optional<ScalarType> dtype) {
  const ScalarType out_dtype = dtype.value_or(kFloat);
  check_key_seeded_uniform_args(keys, dim, low, high, out_dtype);
  DeviceGuard device_guard(keys.get_device_index());
  const Tensor keys_contig = as_contiguous(keys);
  const int64_t n = keys_contig.numel();
  Tensor out = allocate_or_fail("key_seeded_uniform", "dim=" + std::to_string(dim) + " for " + std::to_string(n) +
                                " keys (the output)", [&] { return empty({n, dim}, out_dtype, keys.device()); });
  if (n == 0 || dim == 0) return out;
  const int64_t blocks = std::min<int64_t>((n * dim + kThreads - 1) / kThreads, 65535);
  cudaStream_t stream = current_stream(keys);
  SK_DISPATCH_INDEX_TYPES(keys_contig.scalar_type(), "key_seeded_uniform_cuda", [&] {
    SK_DISPATCH_FLOATING_TYPES(out_dtype, "key_seeded_uniform_cuda", [&] {
      key_seeded_uniform_kernel<index_t, scalar_t><<<blocks, kThreads, 0, stream>>>(
          keys_contig.const_data_ptr<index_t>(), n, dim, seed, make_uniform_range(low, high),
          out.mutable_data_ptr<scalar_t>());
      SK_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("key_seeded_uniform", TORCH_BOX(&key_seeded_uniform_cuda));
}

}  // namespace sparsekit

// select_smallest on CUDA: the radix select of csrc/select.h. Each pass is one kernel
// over the entries (shared-memory histograms, or a min/max); the host reads the pass's
// small result and steps the control (one host sync per pass: at most two per column,
// usually three or four in all for a table's scores), then one compaction.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "select.h"

namespace sparsekit {
namespace {

constexpr int kThreads = 256;

inline int64_t blocks_for(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
}

__global__ void min_max_kernel(SelectColumns cols, SelectState state, const bool* __restrict__ eligible, int64_t n,
                               unsigned long long* __restrict__ extremes) {
  unsigned long long lo = ~0ULL, hi = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!eligible[i] || state.classify(cols, i) != 0) continue;
    const unsigned long long v = ordered_bits(cols.data[state.column][i]);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  if (lo <= hi) {
    atomicMin(extremes, lo);
    atomicMax(extremes + 1, hi);
  }
}

__global__ void histogram_kernel(SelectColumns cols, SelectState state, const bool* __restrict__ eligible, int64_t n,
                                 int bins, unsigned long long* __restrict__ histogram) {
  __shared__ unsigned int local[kSelectBins];
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (eligible[i] && state.classify(cols, i) == 0) atomicAdd(&local[state.digit(cols, i)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(histogram + b, static_cast<unsigned long long>(local[b]));
  }
}

// side[i]: -1 less than the bucket, 0 in it, 1 greater or not eligible.
__global__ void classify_kernel(SelectColumns cols, SelectState state, const bool* __restrict__ eligible, int64_t n,
                                int8_t* __restrict__ side) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    side[i] = eligible[i] ? static_cast<int8_t>(state.classify(cols, i)) : int8_t{1};
  }
}

}  // namespace

/// @brief Indices (ascending) of the k lexicographically smallest eligible entries of
/// int64 columns; whole-tuple ties go to the smaller index.
/// @param columns 1 to 4 int64 [n] tensors, compared in order (column 0 first).
/// @param eligible bool [n]: only these entries may be chosen.
/// @param k how many to choose; at most the number of eligible entries.
/// @return int64 [k], ascending.
at::Tensor select_smallest_cuda(at::TensorList columns, const at::Tensor& eligible, int64_t k) {
  check_select_args(columns, eligible, k);
  const c10::cuda::CUDAGuard device_guard(eligible.device());
  const int64_t n = eligible.size(0);
  std::vector<at::Tensor> columns_c;
  SelectColumns cols{};
  cols.num_columns = static_cast<int>(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    columns_c.push_back(columns[c].contiguous());
    cols.data[c] = columns_c.back().data_ptr<int64_t>();
  }
  const at::Tensor eligible_c = eligible.contiguous();
  const bool* ok = eligible_c.data_ptr<bool>();
  // Host sync: the eligible count bounds k.
  const int64_t num_eligible = eligible_c.sum().item<int64_t>();
  TORCH_CHECK(k <= num_eligible, "select_smallest: k=", k, " but only ", num_eligible, " of ", n,
              " entries are eligible");
  if (k == 0) return at::empty({0}, eligible.options().dtype(at::kLong));

  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = blocks_for(n);
  SelectState state;
  state.need = k;
  state.bucket = num_eligible;
  state.settle(cols.num_columns);
  at::Tensor scratch = at::empty({kSelectBins}, eligible.options().dtype(at::kLong));
  auto* scratch_ptr = reinterpret_cast<unsigned long long*>(scratch.data_ptr<int64_t>());
  std::vector<int64_t> host(kSelectBins);
  while (!state.done) {
    if (state.wants_min_max()) {
      const int64_t init[2] = {-1, 0};  // all ones (the largest unsigned), zero
      C10_CUDA_CHECK(cudaMemcpyAsync(scratch_ptr, init, sizeof(init), cudaMemcpyHostToDevice, stream));
      min_max_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, scratch_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // Host sync: the bucket's extremes.
      C10_CUDA_CHECK(cudaMemcpyAsync(host.data(), scratch_ptr, 2 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
      C10_CUDA_CHECK(cudaStreamSynchronize(stream));
      state.step_min_max(static_cast<uint64_t>(host[0]), static_cast<uint64_t>(host[1]), cols.num_columns);
      continue;
    }
    const int bins = 1 << state.digit_bits();
    C10_CUDA_CHECK(cudaMemsetAsync(scratch_ptr, 0, bins * sizeof(int64_t), stream));
    histogram_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, bins, scratch_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // Host sync: the histogram of the bucket's next digit.
    C10_CUDA_CHECK(cudaMemcpyAsync(host.data(), scratch_ptr, bins * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    state.step_histogram(host.data(), cols.num_columns);
  }

  at::Tensor side = at::empty({n}, eligible.options().dtype(at::kChar));
  classify_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, side.data_ptr<int8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor in_bucket = side.eq(0);
  const at::Tensor bucket_rank = in_bucket.cumsum(0);  // 1-based among bucket entries
  const at::Tensor take = side.eq(-1).logical_or_(in_bucket.logical_and(bucket_rank.le(state.need)));
  // nonzero lists indices in ascending order; k of them by construction (one more host
  // sync, for its output size).
  return at::nonzero(take).view({-1});
}

TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("select_smallest", &select_smallest_cuda);
}

}  // namespace sparsekit

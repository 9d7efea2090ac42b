// select_smallest on CUDA: the radix select of csrc/select.h. Each pass is one kernel
// over the entries (shared-memory histograms, or a min/max); the host reads the pass's
// small result and steps the control (one host sync per pass: at most two per column,
// usually three or four in all for a table's scores), then one compaction.
#include "cuda/cuda_api.h"

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
  // One atomic pair per block, not per thread: the block's extremes are reduced first (a
  // thread that saw no entry holds the identities ~0 and 0). blockDim.x is kThreads, whole
  // warps, and every thread gets here, so the full-mask shuffles are safe.
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned long long other_lo = __shfl_down_sync(0xffffffffu, lo, offset);
    const unsigned long long other_hi = __shfl_down_sync(0xffffffffu, hi, offset);
    lo = other_lo < lo ? other_lo : lo;
    hi = other_hi > hi ? other_hi : hi;
  }
  __shared__ unsigned long long warp_lo[kThreads / 32], warp_hi[kThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_lo[threadIdx.x / 32] = lo;
    warp_hi[threadIdx.x / 32] = hi;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) {
    lo = warp_lo[w] < lo ? warp_lo[w] : lo;
    hi = warp_hi[w] > hi ? warp_hi[w] : hi;
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

/// in_bucket[i] = 1 for the entries still tied in the bucket (side 0), else 0.
__global__ void bucket_flags_kernel(const int8_t* __restrict__ side, int64_t n, int64_t* __restrict__ in_bucket) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    in_bucket[i] = side[i] == 0;
  }
}

/// take[i]: entry i is below the bucket (side -1), or among the first `need` of it.
__global__ void take_kernel(const int8_t* __restrict__ side, const int64_t* __restrict__ bucket_rank, int64_t n,
                            int64_t need, bool* __restrict__ take) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    take[i] = side[i] == -1 || (side[i] == 0 && bucket_rank[i] <= need);
  }
}

}  // namespace

/// @brief Indices (ascending) of the k lexicographically smallest eligible entries of
/// int64 columns; whole-tuple ties go to the smaller index.
/// @param columns 1 to 4 int64 [n] tensors, compared in order (column 0 first).
/// @param eligible bool [n]: only these entries may be chosen.
/// @param k how many to choose; at most the number of eligible entries.
/// @return int64 [k], ascending.
Tensor select_smallest_cuda(const std::vector<Tensor>& columns, const Tensor& eligible, int64_t k) {
  check_select_args(columns, eligible, k);
  const DeviceGuard device_guard(eligible.get_device_index());
  const int64_t n = eligible.size(0);
  std::vector<Tensor> columns_c;
  SelectColumns cols{};
  cols.num_columns = static_cast<int>(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    columns_c.push_back(as_contiguous(columns[c]));
    cols.data[c] = columns_c.back().mutable_data_ptr<int64_t>();
  }
  const Tensor eligible_c = as_contiguous(eligible);
  const bool* ok = eligible_c.mutable_data_ptr<bool>();
  // Host sync: the eligible count bounds k.
  const int64_t num_eligible = sum_to_host(eligible_c);
  SK_CHECK(k <= num_eligible, "select_smallest: k=", k, " but only ", num_eligible, " of ", n,
              " entries are eligible");
  if (k == 0) return empty({0}, kLong, eligible.device());

  const cudaStream_t stream = current_stream(eligible);
  const int64_t blocks = blocks_for(n);
  SelectState state;
  state.need = k;
  state.bucket = num_eligible;
  state.settle(cols.num_columns);
  Tensor scratch = empty({kSelectBins}, kLong, eligible.device());
  auto* scratch_ptr = reinterpret_cast<unsigned long long*>(scratch.mutable_data_ptr<int64_t>());
  while (!state.done) {
    if (state.wants_min_max()) {
      // The running minimum starts at all ones (the largest unsigned), the maximum at zero;
      // set on the stream, not copied from pageable host memory (which would wait for it).
      SK_CUDA_CHECK(cudaMemsetAsync(scratch_ptr, 0xFF, sizeof(unsigned long long), stream));
      SK_CUDA_CHECK(cudaMemsetAsync(scratch_ptr + 1, 0, sizeof(unsigned long long), stream));
      min_max_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, scratch_ptr);
      SK_CUDA_KERNEL_LAUNCH_CHECK();
      // Host sync: the bucket's extremes (through torch's copy, which
      // torch.cuda.set_sync_debug_mode sees).
      const Tensor extremes = cpu(slice0(scratch, 0, 2));
      const int64_t* read = extremes.const_data_ptr<int64_t>();
      state.step_min_max(static_cast<uint64_t>(read[0]), static_cast<uint64_t>(read[1]), cols.num_columns);
      continue;
    }
    const int bins = 1 << state.digit_bits();
    SK_CUDA_CHECK(cudaMemsetAsync(scratch_ptr, 0, bins * sizeof(int64_t), stream));
    histogram_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, bins, scratch_ptr);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
    // Host sync: the histogram of the bucket's next digit.
    const Tensor histogram = cpu(slice0(scratch, 0, bins));
    state.step_histogram(histogram.const_data_ptr<int64_t>(), cols.num_columns);
  }

  Tensor side = empty({n}, kChar, eligible.device());
  classify_kernel<<<blocks, kThreads, 0, stream>>>(cols, state, ok, n, side.mutable_data_ptr<int8_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor in_bucket = empty({n}, kLong, eligible.device());
  bucket_flags_kernel<<<blocks, kThreads, 0, stream>>>(side.const_data_ptr<int8_t>(), n,
                                                       in_bucket.mutable_data_ptr<int64_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  const Tensor bucket_rank = cumsum(in_bucket, 0);  // 1-based among bucket entries
  Tensor take = empty({n}, kBool, eligible.device());
  take_kernel<<<blocks, kThreads, 0, stream>>>(side.const_data_ptr<int8_t>(), bucket_rank.const_data_ptr<int64_t>(),
                                               n, state.need, take.mutable_data_ptr<bool>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  // nonzero lists indices in ascending order; k of them by construction (one more host
  // sync, for its output size).
  return nonzero_1d(take);
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("select_smallest", TORCH_BOX(&select_smallest_cuda));
}

}  // namespace sparsekit

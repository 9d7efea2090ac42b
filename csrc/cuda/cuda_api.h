#pragma once
// The CUDA side of sparsekit's view of torch (csrc/torch_api.h): the current stream and
// device guard through the stable shim, error checks, and the small fills the stable ops
// lack. Included by csrc/cuda/*.cu only.
#include <cuda_runtime.h>

#include <torch/csrc/stable/accelerator.h>

#include "torch_api.h"

// The stable C shim's current-stream query (torch/csrc/inductor/aoti_torch/c/shim.h
// declares it only for CUDA builds of torch).
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);

namespace sparsekit {

#define SK_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    const cudaError_t sk_cuda_error = (expr);                                                 \
    if (C10_UNLIKELY(sk_cuda_error != cudaSuccess))                                           \
      ::sparsekit::fail("CUDA error: ", cudaGetErrorString(sk_cuda_error), " (", #expr, ")"); \
  } while (0)

/// Raises when the last kernel launch failed (bad configuration, no kernel image).
#define SK_CUDA_KERNEL_LAUNCH_CHECK() SK_CUDA_CHECK(cudaGetLastError())

/// Makes the tensor's device current for the guard's lifetime.
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

/// @brief torch's current CUDA stream of the tensor's device.
inline cudaStream_t current_stream(const Tensor& on) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(on.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

/// @brief A zero-filled tensor on a CUDA device: one cudaMemsetAsync on the device's current
/// stream rather than a dispatch of torch's fill kernel (less host time per call; and the
/// write is seen by compute-sanitizer's initcheck whichever kernels it instruments).
inline Tensor zeros_cuda(IntArrayRef sizes, ScalarType dtype, const Device& device) {
  Tensor out = empty(sizes, dtype, device);
  const size_t bytes = static_cast<size_t>(out.numel()) * out.element_size();
  if (bytes == 0) return out;
  const DeviceGuard device_guard(out.get_device_index());
  SK_CUDA_CHECK(cudaMemsetAsync(out.mutable_data_ptr(), 0, bytes, current_stream(out)));
  return out;
}

template <typename T>
__global__ void fill_sequence_kernel(T* out, int64_t n, T start, T step) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = start + static_cast<T>(i) * step;
  }
}

/// @brief int64 start, start + step, ... (n of them) like `like`'s device, on the current stream.
inline Tensor int64_sequence_cuda(int64_t n, int64_t start, int64_t step, const Tensor& like) {
  Tensor out = empty({n}, kLong, like.device());
  if (n == 0) return out;
  const DeviceGuard device_guard(like.get_device_index());  // the launch goes to like's device
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
  fill_sequence_kernel<int64_t><<<static_cast<unsigned>(blocks), threads, 0, current_stream(like)>>>(
      out.mutable_data_ptr<int64_t>(), n, start, step);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

/// @brief 0, 1, ..., n-1 as int64 on `like`'s CUDA device.
inline Tensor arange_cuda(int64_t n, const Tensor& like) { return int64_sequence_cuda(n, 0, 1, like); }

/// @brief n copies of an int64 value (exact: no round trip through double).
inline Tensor full_long_cuda(int64_t n, int64_t value, const Tensor& like) { return int64_sequence_cuda(n, value, 0, like); }

}  // namespace sparsekit

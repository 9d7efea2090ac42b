// CUDA kernels of embedding_bag (pooled lookup over CSR bags) and embedding_gather
// (unpooled lookup).
//
// A group of G lanes (a power of two <= 32, sized to the row) owns one bag or one output
// row; each lane owns 16-byte packets of columns (float4 for float32, 8 halves for
// float16/bfloat16) when the dim and the pointers allow it, single elements otherwise.
// Rows are consumed four at a time so that four independent row loads are in flight per
// lane. Sums are accumulated in float32 (float64 for float64 tables).
//
// Bad input (a row outside [-1, R), offsets that are not CSR) never trips a device
// assert: the kernel records the first offence in a small device buffer, skips it, and
// the host reads that buffer once after the launch and raises a TORCH_CHECK error. That
// read is the one host synchronisation of these ops.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "embedding.h"

namespace sparsekit {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kRowsInFlight = 4;
// Codes written to error[0]; error[1] holds the offending value for kBadRow.
constexpr unsigned long long kBadRow = 1;
constexpr unsigned long long kBadOffsets = 2;

template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Packet {
  scalar_t v[kVec];
};

__device__ __forceinline__ void report_error(unsigned long long* error, unsigned long long code, int64_t value) {
  if (atomicCAS(error, 0ull, code) == 0ull) error[1] = static_cast<unsigned long long>(value);
}

template <typename index_t>
__device__ __forceinline__ bool row_in_range(index_t row, int64_t num_rows) {
  return static_cast<uint64_t>(static_cast<int64_t>(row)) < static_cast<uint64_t>(num_rows);
}

/// One group of `group` lanes per bag (grid-stride over bags). With kWeighted the rows are
/// scaled by per_sample_weights; with mean the bag is divided by its count of valid rows
/// (weighted: by the sum of their weights), and a bag with nothing valid pools to zeros.
template <typename scalar_t, typename index_t, int kVec, bool kWeighted>
__global__ void embedding_bag_kernel(const scalar_t* __restrict__ weight, int64_t row_stride, int64_t num_rows,
                                     int64_t dim, const index_t* __restrict__ rows,
                                     const int64_t* __restrict__ offsets, int64_t nnz, int64_t bags,
                                     const scalar_t* __restrict__ per_sample_weights, bool mean,
                                     scalar_t* __restrict__ out, int group_log2,
                                     unsigned long long* __restrict__ error) {
  using acc = acc_t<scalar_t>;
  using packet = Packet<scalar_t, kVec>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  const int64_t packets = dim / kVec;
  for (int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; bag < bags;
       bag += groups_in_grid) {
    const int64_t begin = offsets[bag];
    const int64_t end = offsets[bag + 1];
    scalar_t* out_row = out + bag * dim;
    const bool bad_ends = (bag == 0 && begin != 0) || (bag == bags - 1 && end != nnz);
    if (bad_ends || !(0 <= begin && begin <= end && end <= nnz)) {
      if (lane == 0) report_error(error, kBadOffsets, bag);
      for (int64_t c = lane; c < dim; c += group) out_row[c] = scalar_t(0);
      continue;
    }
    for (int64_t p = lane; p < packets; p += group) {
      acc sum[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum[e] = acc(0);
      acc weight_sum = 0;
      int64_t valid = 0;
      const scalar_t* column = weight + p * kVec;
      for (int64_t k = begin; k < end; k += kRowsInFlight) {
        index_t row[kRowsInFlight];
        bool ok[kRowsInFlight];
        packet data[kRowsInFlight];
        acc w[kRowsInFlight];
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
          row[j] = k + j < end ? rows[k + j] : index_t(-1);
          ok[j] = row_in_range(row[j], num_rows);
          if (!ok[j] && row[j] != index_t(-1) && p == lane) report_error(error, kBadRow, row[j]);
        }
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
          if (ok[j]) {
            data[j] = *reinterpret_cast<const packet*>(column + static_cast<int64_t>(row[j]) * row_stride);
            w[j] = kWeighted ? static_cast<acc>(per_sample_weights[k + j]) : acc(1);
          }
        }
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
          if (ok[j]) {
            ++valid;
            if constexpr (kWeighted) {
              weight_sum += w[j];
#pragma unroll
              for (int e = 0; e < kVec; ++e) sum[e] += w[j] * static_cast<acc>(data[j].v[e]);
            } else {
#pragma unroll
              for (int e = 0; e < kVec; ++e) sum[e] += static_cast<acc>(data[j].v[e]);
            }
          }
        }
      }
      acc scale = 1;
      if (mean) {
        const acc denominator = kWeighted ? weight_sum : static_cast<acc>(valid);
        scale = (valid > 0 && denominator != acc(0)) ? acc(1) / denominator : acc(0);
      }
      packet result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) result.v[e] = static_cast<scalar_t>(sum[e] * scale);
      *reinterpret_cast<packet*>(out_row + p * kVec) = result;
    }
  }
}

/// One group of lanes per looked-up row: copies weight[rows[i]] (or zeros for -1) to out[i].
template <typename scalar_t, typename index_t, int kVec>
__global__ void embedding_gather_kernel(const scalar_t* __restrict__ weight, int64_t row_stride, int64_t num_rows,
                                        int64_t dim, const index_t* __restrict__ rows, int64_t n,
                                        scalar_t* __restrict__ out, int group_log2,
                                        unsigned long long* __restrict__ error) {
  using packet = Packet<scalar_t, kVec>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  const int64_t packets = dim / kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; i < n;
       i += groups_in_grid) {
    const index_t row = rows[i];
    packet* dst = reinterpret_cast<packet*>(out + i * dim);
    if (row_in_range(row, num_rows)) {
      const packet* src = reinterpret_cast<const packet*>(weight + static_cast<int64_t>(row) * row_stride);
      for (int64_t p = lane; p < packets; p += group) dst[p] = src[p];
    } else {
      if (row != index_t(-1) && lane == 0) report_error(error, kBadRow, row);
      packet zero;
#pragma unroll
      for (int e = 0; e < kVec; ++e) zero.v[e] = scalar_t(0);
      for (int64_t p = lane; p < packets; p += group) dst[p] = zero;
    }
  }
}

/// Elements per 16-byte packet when the dim, the row stride and both base pointers allow
/// aligned 16-byte accesses; 1 otherwise.
template <typename scalar_t>
int packet_width(const at::Tensor& weight, const at::Tensor& out) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  const bool aligned = weight.size(1) % kWide == 0 && weight.stride(0) % kWide == 0 &&
                       reinterpret_cast<uintptr_t>(weight.const_data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 == 0;
  return aligned ? kWide : 1;
}

/// log2 of the group size: the smallest power of two covering one row's packets, at most a warp.
int group_log2_for(int64_t packets) {
  int log2 = 0;
  while (log2 < 5 && (int64_t{1} << log2) < packets) ++log2;
  return log2;
}

int64_t grid_for(int64_t items, int group_log2) {
  const int64_t threads = items << group_log2;
  const int64_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  // Grid-stride loops cover the rest; this cap keeps gridDim.x legal.
  return std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{1} << 20));
}

/// Reads the error buffer (the one host sync of these ops) and raises what it holds.
void raise_recorded_error(const at::Tensor& error, const char* op, int64_t num_rows, int64_t nnz) {
  const at::Tensor host = error.cpu();
  const int64_t code = host[0].item<int64_t>();
  const int64_t value = host[1].item<int64_t>();
  TORCH_CHECK(code != static_cast<int64_t>(kBadOffsets), embedding_offsets_message(nnz),
              "; the offsets around bag ", value, " break that");
  TORCH_CHECK(code != static_cast<int64_t>(kBadRow), embedding_row_range_message(op, value, num_rows));
}


}  // namespace

at::Tensor embedding_bag_cuda(const at::Tensor& weight_in, const at::Tensor& rows_in, const at::Tensor& offsets_in,
                              const c10::optional<at::Tensor>& per_sample_weights_in, c10::string_view mode) {
  check_embedding_bag_args(weight_in, rows_in, offsets_in, per_sample_weights_in);
  const BagMode bag_mode = parse_bag_mode(mode);
  c10::cuda::CUDAGuard guard(weight_in.device());
  const at::Tensor weight = rows_stride_ready(weight_in);
  const at::Tensor rows = rows_in.contiguous();
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  at::Tensor per_sample_weights;
  if (per_sample_weights_in.has_value()) per_sample_weights = per_sample_weights_in->contiguous();

  const int64_t nnz = rows.size(0);
  const int64_t bags = offsets.size(0) - 1;
  const int64_t dim = weight.size(1);
  at::Tensor out = at::empty({bags, dim}, weight.options());
  if (bags == 0) {
    // No bag to carry the check: offsets is the single number that must be 0 == nnz.
    TORCH_CHECK(nnz == 0 && offsets.cpu().item<int64_t>() == 0, embedding_offsets_message(nnz));
    return out;
  }
  at::Tensor error = at::zeros({2}, weight.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "embedding_bag_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_cuda_rows", [&] {
      const int vec = packet_width<scalar_t>(weight, out);
      const int group_log2 = group_log2_for(std::max<int64_t>(dim / vec, 1));
      const int64_t grid = grid_for(bags, group_log2);
      const scalar_t* psw = per_sample_weights.defined() ? per_sample_weights.const_data_ptr<scalar_t>() : nullptr;
      auto launch = [&](auto kernel) {
        kernel<<<grid, kThreadsPerBlock, 0, stream>>>(
            weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.size(0), dim, rows.const_data_ptr<index_t>(),
            offsets.const_data_ptr<int64_t>(), nnz, bags, psw, bag_mode == BagMode::kMean,
            out.mutable_data_ptr<scalar_t>(), group_log2,
            reinterpret_cast<unsigned long long*>(error.mutable_data_ptr<int64_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      constexpr int kWide = 16 / sizeof(scalar_t);
      if (vec == kWide) {
        psw ? launch(embedding_bag_kernel<scalar_t, index_t, kWide, true>)
            : launch(embedding_bag_kernel<scalar_t, index_t, kWide, false>);
      } else {
        psw ? launch(embedding_bag_kernel<scalar_t, index_t, 1, true>)
            : launch(embedding_bag_kernel<scalar_t, index_t, 1, false>);
      }
    });
  });
  raise_recorded_error(error, "embedding_bag", weight.size(0), nnz);
  return out;
}

at::Tensor embedding_gather_cuda(const at::Tensor& weight_in, const at::Tensor& rows_in) {
  check_embedding_gather_args(weight_in, rows_in);
  c10::cuda::CUDAGuard guard(weight_in.device());
  const at::Tensor weight = rows_stride_ready(weight_in);
  const at::Tensor rows = rows_in.contiguous();
  const int64_t n = rows.numel();
  const int64_t dim = weight.size(1);
  std::vector<int64_t> out_shape(rows.sizes().begin(), rows.sizes().end());
  out_shape.push_back(dim);
  at::Tensor out = at::empty(out_shape, weight.options());
  if (n == 0) return out;
  at::Tensor error = at::zeros({2}, weight.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "embedding_gather_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_gather_cuda_rows", [&] {
      const int vec = packet_width<scalar_t>(weight, out);
      const int group_log2 = group_log2_for(std::max<int64_t>(dim / vec, 1));
      const int64_t grid = grid_for(n, group_log2);
      auto launch = [&](auto kernel) {
        kernel<<<grid, kThreadsPerBlock, 0, stream>>>(weight.const_data_ptr<scalar_t>(), weight.stride(0),
                                                      weight.size(0), dim, rows.const_data_ptr<index_t>(), n,
                                                      out.mutable_data_ptr<scalar_t>(), group_log2,
                                                      reinterpret_cast<unsigned long long*>(
                                                          error.mutable_data_ptr<int64_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      constexpr int kWide = 16 / sizeof(scalar_t);
      if (vec == kWide) {
        launch(embedding_gather_kernel<scalar_t, index_t, kWide>);
      } else {
        launch(embedding_gather_kernel<scalar_t, index_t, 1>);
      }
    });
  });
  raise_recorded_error(error, "embedding_gather", weight.size(0), 0);
  return out;
}

TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("embedding_bag", &embedding_bag_cuda);
  m.impl("embedding_gather", &embedding_gather_cuda);
}

}  // namespace sparsekit

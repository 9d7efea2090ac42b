// CUDA kernel of the collection's pooled read (pooled_read); the layout is in pooled.h. Table
// pointers go to the kernel by value, so a CUDA graph captures them. Bad input is recorded in
// the errors slots; without the caller's slots the op reads them back (its one host sync) and
// raises as the CPU kernel does. The gradient and the fused update: pooled_backward_cuda.cu.
#include "cuda/pooled_cuda.cuh"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pooled.h"

namespace sparsekit {
namespace {

template <typename scalar_t>
struct ReadFeature {
  const scalar_t* weight;
  int64_t row_stride;
  int64_t num_rows;
  int64_t dim;
  int64_t column;
  int64_t feature;  // its index in the call (its bags are feature * B ...)
  int mean;
};

template <typename scalar_t>
struct ReadLaunch {
  ReadFeature<scalar_t> features[kFeaturesPerLaunch];
  int count;
};

template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Packet {
  scalar_t v[kVec];
};

template <typename scalar_t, int kVec>
__global__ void pooled_read_kernel(ReadLaunch<scalar_t> launch, const int64_t* __restrict__ rows,
                                   const int64_t* __restrict__ offsets, const float* __restrict__ psw, int64_t batch,
                                   int64_t bags, int64_t nnz, int64_t total_dim, scalar_t* __restrict__ out,
                                   long long* __restrict__ errors, int group_log2) {
  using acc = acc_type<scalar_t>;
  using packet = Packet<scalar_t, kVec>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t items = static_cast<int64_t>(launch.count) * batch;
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; item < items;
       item += groups_in_grid) {
    const ReadFeature<scalar_t>& f = launch.features[item / batch];
    const int64_t b = item % batch;
    const int64_t bag = f.feature * batch + b;
    const int64_t begin = offsets[bag], end = offsets[bag + 1];
    scalar_t* out_row = out + b * total_dim + f.column;
    const int64_t packets = f.dim / kVec;
    if (bag_offsets_bad(bag, bags, begin, end, nnz)) {
      if (lane == 0) record_min(errors, bag);
      for (int64_t c = lane; c < f.dim; c += group) out_row[c] = scalar_t(0);
      continue;
    }
    for (int64_t p = lane; p < packets; p += group) {
      acc sum[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum[e] = acc(0);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t row = rows[k];
        if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(f.num_rows)) {
          if (row != -1 && p == lane) record_min(errors + 1, k);
          continue;
        }
        const packet data = *reinterpret_cast<const packet*>(f.weight + row * f.row_stride + p * kVec);
        if (psw != nullptr) {
          const acc w = static_cast<acc>(psw[k]);
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum[e] += w * static_cast<acc>(data.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum[e] += static_cast<acc>(data.v[e]);
        }
      }
      packet result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        // The collection's mean divides by the bag's length, skipped lookups included.
        result.v[e] = static_cast<scalar_t>(f.mean && end > begin ? sum[e] / static_cast<acc>(end - begin) : sum[e]);
      }
      *reinterpret_cast<packet*>(out_row + p * kVec) = result;
    }
  }
}

}  // namespace

Tensor pooled_read_cuda(const std::vector<Tensor>& weights_in, const Tensor& rows_in, const Tensor& offsets_in,
                        const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                        std::vector<int64_t> feature_columns, std::vector<int64_t> feature_means, int64_t total_dim,
                        const std::optional<Tensor>& errors) {
  const char* op = "pooled_read";
  const PooledLayout layout = check_pooled_args(op, weights_in, rows_in, offsets_in, per_sample_weights_in,
                                                feature_tables, feature_columns, feature_means, total_dim);
  const Device device = weights_in[0].device();
  SK_CHECK(device.is_cuda(), op, ": expected CUDA tensors, got ", device);
  check_error_slots(op, errors, device);
  const DeviceGuard guard(weights_in[0].get_device_index());
  const cudaStream_t stream = current_stream(weights_in[0]);
  std::vector<Tensor> weights;
  for (const Tensor& w : weights_in) weights.push_back(rows_stride_ready(w));
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  Tensor out = zeros_cuda({layout.batch, layout.total_dim}, layout.dtype, device);
  Tensor slots = error_slots(errors, out, stream);
  long long* slots_ptr = reinterpret_cast<long long*>(slots.mutable_data_ptr<int64_t>());
  if (layout.batch == 0) {
    check_no_bags_kernel<<<1, 1, 0, stream>>>(offsets.const_data_ptr<int64_t>(), layout.nnz, slots_ptr);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
    raise_recorded(op, errors, slots, offsets, rows, layout);
    return out;
  }
  const int64_t bags = layout.num_features * layout.batch;
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_cuda", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    // Launch classes: features whose packets are whole 16-byte vectors (rows, output row
    // and column aligned) and the others, each in launches of at most kFeaturesPerLaunch.
    const auto wide_ok = [&](int64_t f) {
      const Tensor& w = weights[layout.feature_tables[f]];
      const int64_t dim = w.size(1);
      return dim % kWide == 0 && w.stride(0) % kWide == 0 &&
             reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 16 == 0 && layout.total_dim % kWide == 0 &&
             layout.feature_columns[f] % kWide == 0;
    };
    for (int wide = 1; wide >= 0; --wide) {
      std::vector<int64_t> members;
      for (int64_t f = 0; f < layout.num_features; ++f) {
        if (layout.feature_tables[f] >= 0 && wide_ok(f) == (wide == 1)) members.push_back(f);
      }
      for (size_t first = 0; first < members.size(); first += kFeaturesPerLaunch) {
        ReadLaunch<scalar_t> launch{};
        int64_t widest = 1;
        for (size_t i = first; i < std::min(members.size(), first + kFeaturesPerLaunch); ++i) {
          const int64_t f = members[i];
          const Tensor& w = weights[layout.feature_tables[f]];
          launch.features[launch.count++] = ReadFeature<scalar_t>{
              w.const_data_ptr<scalar_t>(), w.stride(0), w.size(0), w.size(1), layout.feature_columns[f], f,
              static_cast<int>(layout.feature_means[f])};
          widest = std::max(widest, w.size(1) / (wide ? kWide : 1));
        }
        int group_log2 = 0;
        while ((1 << group_log2) < widest && group_log2 < 5) ++group_log2;
        const int64_t threads = (static_cast<int64_t>(launch.count) * layout.batch) << group_log2;
        if (wide) {
          pooled_read_kernel<scalar_t, kWide><<<blocks_for(threads), kThreads, 0, stream>>>(
              launch, rows.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), psw_ptr, layout.batch, bags,
              layout.nnz, layout.total_dim, out_ptr, slots_ptr, group_log2);
        } else {
          pooled_read_kernel<scalar_t, 1><<<blocks_for(threads), kThreads, 0, stream>>>(
              launch, rows.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), psw_ptr, layout.batch, bags,
              layout.nnz, layout.total_dim, out_ptr, slots_ptr, group_log2);
        }
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
  raise_recorded(op, errors, slots, offsets, rows, layout);
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("pooled_read", TORCH_BOX(&pooled_read_cuda));
}

}  // namespace sparsekit

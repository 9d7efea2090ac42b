// CUDA kernels of the pooled read's gradient grouped by row (pooled_read_backward) and the
// fused optimizer step (pooled_read_update_); the layout is in pooled.h, the read in
// pooled_cuda.cu. Both stably radix-sort (code, position) and sum each row's lookups in
// position order; sizes follow from the number of lookups, so the update never waits for the
// host. Table pointers go to the kernels by value, so a CUDA graph captures them; bad input
// goes to the errors slots as in the read (pooled_cuda.cuh).
#include "cuda/pooled_cuda.cuh"
#include "cuda/rounding.cuh"

#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lazy_adam.h"
#include "pooled.h"

namespace sparsekit {
namespace {

// Tables whose pointers one launch takes by value (the backward's rows, the update).
constexpr int kTablesPerLaunch = 32;


// ---------------------------------------------------------------------------------------
// The backward's grouping.

struct CodeFeature {
  int64_t table_base;
  int64_t num_rows;  // -1: the feature is not this call's (its lookups are skipped)
  int64_t grad_address;    // its output gradient's first row
  int64_t grad_row_bytes;  // between its rows
  int mean;
};

struct CodeLaunch {
  CodeFeature features[kFeaturesPerLaunch];
  int64_t first_feature;
  int count;
};

/// Per lookup of the launch's features: its code (invalid: skip, sorted last), its position,
/// the address of its bag's output gradient row, and its bag's length (0: no mean). A lane
/// group of 32 per bag.
__global__ void lookup_codes_kernel(CodeLaunch launch, const int64_t* __restrict__ rows,
                                    const int64_t* __restrict__ offsets, int64_t batch, int64_t bags, int64_t nnz,
                                    uint64_t invalid, uint64_t* __restrict__ codes,
                                    int64_t* __restrict__ positions, int64_t* __restrict__ grad_at,
                                    int32_t* __restrict__ lengths, long long* __restrict__ errors) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int64_t items = static_cast<int64_t>(launch.count) * batch;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / kWarp;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; item < items;
       item += warps) {
    const CodeFeature& f = launch.features[item / batch];
    const int64_t b = item % batch;
    const int64_t bag = (launch.first_feature + item / batch) * batch + b;
    const int64_t begin = offsets[bag], end = offsets[bag + 1];
    if (bag_offsets_bad(bag, bags, begin, end, nnz)) {
      if (lane == 0) record_min(errors, bag);
      continue;
    }
    for (int64_t k = begin + lane; k < end; k += kWarp) {
      const int64_t row = rows[k];
      uint64_t code = invalid;
      if (f.num_rows >= 0 && row != -1) {
        if (static_cast<uint64_t>(row) < static_cast<uint64_t>(f.num_rows)) {
          code = static_cast<uint64_t>(f.table_base + row);
        } else {
          record_min(errors + 1, k);
        }
      }
      codes[k] = code;
      positions[k] = k;
      grad_at[k] = f.grad_address + b * f.grad_row_bytes;
      lengths[k] = f.mean ? static_cast<int32_t>(end - begin) : 0;
    }
  }
}

__global__ void fill_invalid_kernel(uint64_t* codes, int64_t* positions, int64_t n, uint64_t invalid) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    codes[i] = invalid;
    positions[i] = i;
  }
}

/// The lookups sorted by code: sorted codes and, for each, its lookup's position.
struct SortedLookups {
  Tensor codes_storage, positions_storage, temp, grad_at, lengths;
  const uint64_t* codes;
  const int64_t* positions;
  uint64_t invalid;
};

SortedLookups sort_lookups(const PooledLayout& layout, const Tensor& rows, const Tensor& offsets,
                           const std::vector<Tensor>& grads, long long* slots, cudaStream_t stream) {
  const Device device = rows.device();
  const int64_t n = layout.nnz;
  const std::vector<int64_t> bases = code_bases(layout);
  SortedLookups out;
  out.invalid = static_cast<uint64_t>(bases.back());
  Tensor codes_a = empty({n}, kLong, device), codes_b = empty({n}, kLong, device);
  Tensor pos_a = empty({n}, kLong, device), pos_b = empty({n}, kLong, device);
  out.grad_at = empty({n}, kLong, device);
  out.lengths = empty({n}, kInt, device);
  uint64_t* codes_a_ptr = reinterpret_cast<uint64_t*>(codes_a.mutable_data_ptr<int64_t>());
  uint64_t* codes_b_ptr = reinterpret_cast<uint64_t*>(codes_b.mutable_data_ptr<int64_t>());
  // Lookups of bad bags are in no bag: they keep these (skipped) codes.
  fill_invalid_kernel<<<blocks_for(n), kThreads, 0, stream>>>(codes_a_ptr, pos_a.mutable_data_ptr<int64_t>(), n,
                                                              out.invalid);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t bags = layout.num_features * layout.batch;
  for (int64_t first = 0; first < layout.num_features; first += kFeaturesPerLaunch) {
    CodeLaunch launch{};
    launch.first_feature = first;
    for (int64_t f = first; f < std::min(layout.num_features, first + kFeaturesPerLaunch); ++f) {
      const int64_t t = layout.feature_tables[f];
      launch.features[launch.count++] = CodeFeature{
          t >= 0 ? bases[t] : 0, t >= 0 ? layout.table_rows[t] : -1,
          t >= 0 ? reinterpret_cast<int64_t>(grads[f].const_data_ptr()) : 0,
          t >= 0 ? grads[f].stride(0) * static_cast<int64_t>(grads[f].element_size()) : 0,
          static_cast<int>(layout.feature_means[f])};
    }
    const int64_t threads = static_cast<int64_t>(launch.count) * layout.batch * kWarp;
    lookup_codes_kernel<<<blocks_for(threads), kThreads, 0, stream>>>(
        launch, rows.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), layout.batch, bags, n,
        out.invalid, codes_a_ptr, pos_a.mutable_data_ptr<int64_t>(),
        out.grad_at.mutable_data_ptr<int64_t>(), out.lengths.mutable_data_ptr<int32_t>(), slots);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // A stable LSD radix sort over the code space's bits: equal codes keep position order.
  const int end_bit = 64 - __builtin_clzll(static_cast<unsigned long long>(out.invalid) | 1ULL);
  cub::DoubleBuffer<uint64_t> keys(codes_a_ptr, codes_b_ptr);
  cub::DoubleBuffer<int64_t> values(pos_a.mutable_data_ptr<int64_t>(), pos_b.mutable_data_ptr<int64_t>());
  size_t temp_bytes = 0;
  SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, values, n, 0, end_bit, stream));
  out.temp = empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))}, kByte, device);
  SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(out.temp.data_ptr(), temp_bytes, keys, values, n, 0, end_bit, stream));
  out.codes = keys.Current();
  out.positions = values.Current();
  out.codes_storage = keys.Current() == codes_a_ptr ? codes_a : codes_b;
  out.positions_storage = values.Current() == pos_a.mutable_data_ptr<int64_t>() ? pos_a : pos_b;
  return out;
}

/// The table of a code among the launch's tables: the last whose base is <= code.
template <typename Table>
__device__ __forceinline__ int table_of(const Table* tables, int count, uint64_t code) {
  int t = -1;
  for (int i = 0; i < count; ++i) {
    if (static_cast<uint64_t>(tables[i].base) <= code) t = i;
  }
  return t;
}

/// Sums lane `lane`'s columns (c = lane, lane + 32, ...) of one run of lookups' gradient
/// rows in position order, each divided by its bag's length for a mean feature, then times
/// its weight; `g` holds up to kColumnsPerLane columns per lane.
constexpr int kColumnsPerLane = 8;  // dims up to 256

template <typename scalar_t, typename acc>
__device__ __forceinline__ void sum_run(acc (&g)[kColumnsPerLane], int64_t dim, int lane, int64_t run_begin,
                                        int64_t run_end, const int64_t* positions, const int64_t* grad_at,
                                        const int32_t* lengths, const float* psw) {
#pragma unroll
  for (int c = 0; c < kColumnsPerLane; ++c) g[c] = acc(0);
  for (int64_t i = run_begin; i < run_end; ++i) {
    const int64_t k = positions[i];
    const scalar_t* src = reinterpret_cast<const scalar_t*>(grad_at[k]);
    const int32_t length = lengths[k];
    const acc w = psw != nullptr ? static_cast<acc>(psw[k]) : acc(1);
#pragma unroll
    for (int c = 0; c < kColumnsPerLane; ++c) {
      const int64_t j = lane + c * kWarp;
      if (j < dim) {
        acc x = static_cast<acc>(src[j]);
        if (length > 0) x = div_rn(x, static_cast<acc>(length));
        if (psw != nullptr) x = mul_rn(x, w);
        g[c] = add_rn(g[c], x);
      }
    }
  }
}

/// Whether sorted entry i starts a run of a valid code; its run's end.
__device__ __forceinline__ bool run_head(const uint64_t* codes, int64_t n, int64_t i, uint64_t invalid,
                                         int64_t& run_end) {
  const uint64_t code = codes[i];
  if (code >= invalid || (i > 0 && codes[i - 1] == code)) return false;
  run_end = i + 1;
  while (run_end < n && codes[run_end] == code) ++run_end;
  return true;
}

// ---------------------------------------------------------------------------------------
// pooled_read_backward.

struct GradTable {
  int64_t base;
  int64_t dim;
};

struct GradLaunch {
  GradTable tables[kTablesPerLaunch];
  int count;
  int first_table;
};

// Tables of one call whose bases and dims the backward's counting kernels take by value
// (within the 4 KiB of a launch's parameters).
constexpr int kMaxBackwardTables = 240;

struct TableMeta {
  int64_t base[kMaxBackwardTables];
  int64_t dim[kMaxBackwardTables];
  int count;
};

/// Marks run heads (1) and counts each table's distinct rows.
__global__ void count_heads_kernel(const uint64_t* __restrict__ codes, int64_t n, uint64_t invalid, TableMeta meta,
                                   int64_t* __restrict__ head, int64_t* __restrict__ per_table) {
  const int64_t* bases = meta.base;
  const int num_tables = meta.count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t code = codes[i];
    const bool is_head = code < invalid && (i == 0 || codes[i - 1] != code);
    head[i] = is_head ? 1 : 0;
    if (is_head) {
      int t = 0;
      while (t + 1 < num_tables && static_cast<uint64_t>(bases[t + 1]) <= code) ++t;
      atomicAdd(reinterpret_cast<unsigned long long*>(per_table + t), 1ULL);
    }
  }
}

/// One warp per run head: the row's summed gradient at its place in the table's block.
/// rank[i]: the inclusive count of heads up to i (its distinct row's index, plus one);
/// value_start[t] / first_rank[t]: where table t's block and its distinct rows begin.
template <typename scalar_t, typename acc>
__global__ void write_grad_rows_kernel(GradLaunch launch, const uint64_t* __restrict__ codes,
                                       const int64_t* __restrict__ positions, int64_t n, uint64_t invalid,
                                       const int64_t* __restrict__ grad_at, const int32_t* __restrict__ lengths,
                                       const float* __restrict__ psw, const int64_t* __restrict__ rank,
                                       const int64_t* __restrict__ value_start,
                                       const int64_t* __restrict__ first_rank, int64_t* __restrict__ rows_out,
                                       acc* __restrict__ values) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / kWarp;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; i < n; i += warps) {
    int64_t run_end;
    if (!run_head(codes, n, i, invalid, run_end)) continue;
    const int local = table_of(launch.tables, launch.count, codes[i]);
    if (local < 0) continue;
    if (local + 1 < launch.count && static_cast<uint64_t>(launch.tables[local + 1].base) <= codes[i]) continue;
    const int t = launch.first_table + local;
    const GradTable& table = launch.tables[local];
    const int64_t u = rank[i] - 1;
    acc g[kColumnsPerLane];
    sum_run<scalar_t, acc>(g, table.dim, lane, i, run_end, positions, grad_at, lengths, psw);
    acc* dst = values + value_start[t] + (u - first_rank[t]) * table.dim;
#pragma unroll
    for (int c = 0; c < kColumnsPerLane; ++c) {
      const int64_t j = lane + c * kWarp;
      if (j < table.dim) dst[j] = g[c];
    }
    if (lane == 0) rows_out[u] = static_cast<int64_t>(codes[i]) - table.base;
  }
}

/// value_start[t] and first_rank[t] from the tables' distinct counts (one thread).
__global__ void table_starts_kernel(const int64_t* per_table, TableMeta meta, int64_t* value_start,
                                    int64_t* first_rank) {
  int64_t values = 0, ranks = 0;
  for (int t = 0; t < meta.count; ++t) {
    value_start[t] = values;
    first_rank[t] = ranks;
    values += per_table[t] * meta.dim[t];
    ranks += per_table[t];
  }
  value_start[meta.count] = values;
  first_rank[meta.count] = ranks;
}

/// @brief Refuses a table wider than a warp's columns.
void check_cuda_dims(const char* op, const std::vector<Tensor>& weights) {
  for (const Tensor& w : weights) {
    SK_CHECK(w.size(1) <= kColumnsPerLane * kWarp, op, ": on CUDA a table's dim must be at most ",
             kColumnsPerLane * kWarp, ", got ", w.size(1));
  }
}

/// The lookups of a backward or a fused update (checked arguments), on `stream`: contiguous
/// inputs, the error slots (the caller's, or the op's own), a batch of no bags checked, and
/// the lookups sorted by row code. Holds every tensor the pointers point into.
struct PreparedLookups {
  Tensor rows, offsets, psw, slots;
  const float* psw_ptr;
  long long* slots_ptr;
  SortedLookups sorted;
};

PreparedLookups prepare_lookups(const PooledLayout& layout, const Tensor& rows_in, const Tensor& offsets_in,
                                const std::optional<Tensor>& per_sample_weights_in, const std::vector<Tensor>& grads,
                                const std::optional<Tensor>& errors, cudaStream_t stream) {
  PreparedLookups out;
  out.rows = as_contiguous(rows_in);
  out.offsets = as_contiguous(offsets_in);
  out.psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  out.psw_ptr = per_sample_weights_in.has_value() ? out.psw.const_data_ptr<float>() : nullptr;
  out.slots = error_slots(errors, out.rows, stream);
  out.slots_ptr = reinterpret_cast<long long*>(out.slots.mutable_data_ptr<int64_t>());
  if (layout.batch == 0) {
    check_no_bags_kernel<<<1, 1, 0, stream>>>(out.offsets.const_data_ptr<int64_t>(), layout.nnz, out.slots_ptr);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  }
  out.sorted = sort_lookups(layout, out.rows, out.offsets, grads, out.slots_ptr, stream);
  return out;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> pooled_read_backward_cuda(
    const std::vector<Tensor>& grads_in, const std::vector<Tensor>& weights, const Tensor& rows_in,
    const Tensor& offsets_in, const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
    std::vector<int64_t> feature_means, const std::optional<Tensor>& errors, std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_backward";
  const PooledLayout layout = check_pooled_backward_args(op, weights, rows_in, offsets_in, per_sample_weights_in,
                                                         feature_tables, feature_means);
  const Device device = weights[0].device();
  SK_CHECK(device.is_cuda(), op, ": expected CUDA tensors, got ", device);
  const std::vector<Tensor> grads = feature_grad_views(op, grads_in, grad_columns, layout);
  check_pooled_grads(op, grads, layout, device);
  check_error_slots(op, errors, device);
  check_cuda_dims(op, weights);
  SK_CHECK(weights.size() <= static_cast<size_t>(kMaxBackwardTables), op, ": on CUDA one call reads at most ",
           kMaxBackwardTables, " tables, got ", weights.size());
  const DeviceGuard guard(weights[0].get_device_index());
  const cudaStream_t stream = current_stream(weights[0]);
  const PreparedLookups prepared =
      prepare_lookups(layout, rows_in, offsets_in, per_sample_weights_in, grads, errors, stream);
  const SortedLookups& sorted = prepared.sorted;
  const int num_tables = static_cast<int>(weights.size());
  const int64_t n = layout.nnz;
  const ScalarType value_dtype = layout.dtype == kDouble ? kDouble : kFloat;
  const std::vector<int64_t> bases = code_bases(layout);
  TableMeta meta{};
  meta.count = num_tables;
  for (int t = 0; t < num_tables; ++t) {
    meta.base[t] = bases[t];
    meta.dim[t] = layout.table_dims[t];
  }
  Tensor head = empty({n}, kLong, device);
  Tensor per_table = zeros_cuda({num_tables}, kLong, device);
  count_heads_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sorted.codes, n, sorted.invalid, meta,
                                                             head.mutable_data_ptr<int64_t>(),
                                                             per_table.mutable_data_ptr<int64_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor rank = empty({n}, kLong, device);
  size_t temp_bytes = 0;
  SK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, head.const_data_ptr<int64_t>(),
                                              rank.mutable_data_ptr<int64_t>(), n, stream));
  Tensor temp = empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))}, kByte, device);
  SK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(temp.data_ptr(), temp_bytes, head.const_data_ptr<int64_t>(),
                                              rank.mutable_data_ptr<int64_t>(), n, stream));
  Tensor starts = empty({2, num_tables + 1}, kLong, device);
  int64_t* value_start = starts.mutable_data_ptr<int64_t>();
  int64_t* first_rank = value_start + num_tables + 1;
  table_starts_kernel<<<1, 1, 0, stream>>>(per_table.const_data_ptr<int64_t>(), meta, value_start, first_rank);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  // The sizes of the outputs: the op's host read (the sparse gradients need them anyway).
  const Tensor host_starts = cpu(starts);
  const int64_t total_values = host_starts.const_data_ptr<int64_t>()[num_tables];
  const int64_t total_rows = host_starts.const_data_ptr<int64_t>()[2 * num_tables + 1];
  raise_recorded(op, errors, prepared.slots, prepared.offsets, prepared.rows, layout);
  Tensor rows_out = empty({total_rows}, kLong, device);
  Tensor values = empty({total_values}, value_dtype, device);
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_backward_cuda", [&] {
    using acc = acc_type<scalar_t>;
    for (int first = 0; first < num_tables; first += kTablesPerLaunch) {
      GradLaunch launch{};
      launch.first_table = first;
      for (int t = first; t < std::min(num_tables, first + kTablesPerLaunch); ++t) {
        launch.tables[launch.count++] = GradTable{bases[t], layout.table_dims[t]};
      }
      write_grad_rows_kernel<scalar_t, acc><<<blocks_for(n * kWarp), kThreads, 0, stream>>>(
          launch, sorted.codes, sorted.positions, n, sorted.invalid, sorted.grad_at.const_data_ptr<int64_t>(),
          sorted.lengths.const_data_ptr<int32_t>(), prepared.psw_ptr, rank.const_data_ptr<int64_t>(), value_start,
          first_rank, rows_out.mutable_data_ptr<int64_t>(),
          values.mutable_data_ptr<acc>());
      SK_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {rows_out, per_table, values};
}

namespace {

// ---------------------------------------------------------------------------------------
// pooled_read_update_.

template <typename scalar_t, typename acc>
struct UpdateTable {
  scalar_t* weight;
  acc* state1;
  acc* state2;
  int64_t* step;  // LazyAdam's count before this update
  int64_t base;
  int64_t dim;
};

template <typename scalar_t, typename acc>
struct UpdateLaunch {
  UpdateTable<scalar_t, acc> tables[kTablesPerLaunch];
  int count;
};

struct UpdateSettings {
  int optimizer;  // FusedOptimizer
  double lr, beta1, beta2, eps, weight_decay;
  const float* lr_f32;  // the tensor lr, when given
  const double* lr_f64;
};

template <typename acc>
__device__ __forceinline__ acc warp_sum(acc x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

/// One warp per run head: the row's summed gradient applied in place by the optimizer, as
/// update_row of the CPU kernel (LazyAdam as lazy_adam_'s kernel, operation by operation).
template <typename scalar_t, typename acc>
__global__ void update_rows_kernel(UpdateLaunch<scalar_t, acc> launch, UpdateSettings s,
                                   const uint64_t* __restrict__ codes, const int64_t* __restrict__ positions,
                                   int64_t n, uint64_t invalid, const int64_t* __restrict__ grad_at,
                                   const int32_t* __restrict__ lengths, const float* __restrict__ psw) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) / kWarp;
  double lr = s.lr;
  if (s.lr_f32 != nullptr) lr = static_cast<double>(*s.lr_f32);
  if (s.lr_f64 != nullptr) lr = *s.lr_f64;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; i < n; i += warps) {
    int64_t run_end;
    if (!run_head(codes, n, i, invalid, run_end)) continue;
    const int local = table_of(launch.tables, launch.count, codes[i]);
    if (local < 0) continue;
    if (local + 1 < launch.count && static_cast<uint64_t>(launch.tables[local + 1].base) <= codes[i]) continue;
    const UpdateTable<scalar_t, acc>& table = launch.tables[local];
    const int64_t row = static_cast<int64_t>(codes[i]) - table.base;
    const int64_t dim = table.dim;
    acc g[kColumnsPerLane];
    sum_run<scalar_t, acc>(g, dim, lane, i, run_end, positions, grad_at, lengths, psw);
    scalar_t* w = table.weight + row * dim;
    const acc decay = static_cast<acc>(s.weight_decay);
    // Each lane updates its columns j = lane + c * kWarp (c < kColumnsPerLane, j < dim).
    const auto each_column = [&](auto&& update) {
#pragma unroll
      for (int c = 0; c < kColumnsPerLane; ++c) {
        const int64_t j = lane + c * kWarp;
        if (j < dim) update(c, j);
      }
    };
    if (s.optimizer == static_cast<int>(FusedOptimizer::kSgd)) {
      const acc rate = static_cast<acc>(lr);
      each_column([&](int c, int64_t j) {
        const acc x = static_cast<acc>(w[j]);
        const acc step = decay != acc(0) ? add_rn(g[c], mul_rn(decay, x)) : g[c];
        w[j] = static_cast<scalar_t>(sub_rn(x, mul_rn(rate, step)));
      });
    } else if (s.optimizer == static_cast<int>(FusedOptimizer::kLazyAdam)) {
      const double step = static_cast<double>(*table.step + 1);
      const double size = lr * sqrt(1.0 - pow(s.beta2, step)) / (1.0 - pow(s.beta1, step));
      const acc one_minus_beta1 = static_cast<acc>(1.0 - s.beta1), one_minus_beta2 = static_cast<acc>(1.0 - s.beta2);
      const acc eps = static_cast<acc>(s.eps), neg_step = static_cast<acc>(-size);
      acc* m_row = table.state1 + row * dim;
      acc* v_row = table.state2 + row * dim;
      each_column([&](int c, int64_t j) {
        const acc x = static_cast<acc>(w[j]);
        acc gj = g[c];
        if (decay != acc(0)) gj = add_rn(gj, mul_rn(decay, x));
        const acc m = add_rn(m_row[j], mul_rn(sub_rn(gj, m_row[j]), one_minus_beta1));
        const acc v = add_rn(v_row[j], mul_rn(sub_rn(mul_rn(gj, gj), v_row[j]), one_minus_beta2));
        m_row[j] = m;
        v_row[j] = v;
        w[j] = static_cast<scalar_t>(add_rn(x, mul_rn(neg_step, div_rn(m, add_rn(sqrt_rn(v), eps)))));
      });
    } else if (s.optimizer == static_cast<int>(FusedOptimizer::kAdagrad)) {
      const acc rate = static_cast<acc>(lr), eps = static_cast<acc>(s.eps);
      acc* sum_row = table.state1 + row * dim;
      each_column([&](int c, int64_t j) {
        const acc x = static_cast<acc>(w[j]);
        const acc gj = decay != acc(0) ? add_rn(g[c], mul_rn(decay, x)) : g[c];
        const acc total = add_rn(sum_row[j], mul_rn(gj, gj));
        sum_row[j] = total;
        w[j] = static_cast<scalar_t>(sub_rn(x, div_rn(mul_rn(rate, gj), add_rn(sqrt_rn(total), eps))));
      });
    } else {
      acc squares = 0;
      each_column([&](int c, int64_t j) {
        if (decay != acc(0)) g[c] = add_rn(g[c], mul_rn(decay, static_cast<acc>(w[j])));
        squares += g[c] * g[c];
      });
      squares = warp_sum(squares);
      acc* sum = table.state1 + row;
      const acc total = add_rn(*sum, div_rn(squares, static_cast<acc>(dim > 0 ? dim : 1)));
      __syncwarp();
      if (lane == 0) *sum = total;
      const acc rate = div_rn(static_cast<acc>(lr), add_rn(sqrt_rn(total), static_cast<acc>(s.eps)));
      each_column([&](int c, int64_t j) {
        w[j] = static_cast<scalar_t>(sub_rn(static_cast<acc>(w[j]), mul_rn(rate, g[c])));
      });
    }
  }
}

/// LazyAdam's step counts of the tables read, after their rows were updated.
struct StepCounts {
  int64_t* steps[kTablesPerLaunch];
  int count;
};

__global__ void count_steps_kernel(StepCounts counts) {
  const int t = threadIdx.x;
  if (t < counts.count) *counts.steps[t] += 1;
}

}  // namespace

void pooled_read_update_cuda(const std::vector<Tensor>& weights, const std::vector<Tensor>& state1,
                             const std::vector<Tensor>& state2, const std::vector<Tensor>& steps,
                             const std::vector<Tensor>& grads_in, const Tensor& rows_in, const Tensor& offsets_in,
                             const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                             std::vector<int64_t> feature_means,
                             StrArg optimizer_name, std::vector<double> hyper, const std::optional<Tensor>& lr,
                             const std::optional<Tensor>& errors,
                             std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_update_";
  const FusedUpdateArgs args =
      check_fused_update_args(op, weights, state1, state2, steps, grads_in, rows_in, offsets_in, per_sample_weights_in,
                              feature_tables, feature_means, optimizer_name.value, hyper, lr, errors, grad_columns);
  const FusedOptimizer optimizer = args.optimizer;
  const PooledLayout& layout = args.layout;
  const std::vector<Tensor>& grads = args.grads;
  const FusedScalars& h = args.h;
  SK_CHECK(weights[0].device().is_cuda(), op, ": expected CUDA tensors, got ", weights[0].device());
  check_cuda_dims(op, weights);
  const DeviceGuard guard(weights[0].get_device_index());
  const cudaStream_t stream = current_stream(weights[0]);
  const PreparedLookups prepared =
      prepare_lookups(layout, rows_in, offsets_in, per_sample_weights_in, grads, errors, stream);
  const SortedLookups& sorted = prepared.sorted;
  const int num_tables = static_cast<int>(weights.size());
  const int64_t n = layout.nnz;
  if (!errors.has_value()) {
    // Refused before anything is written: the read back of the checks (this mode's sync).
    raise_recorded(op, errors, prepared.slots, prepared.offsets, prepared.rows, layout);
  }
  const std::vector<int64_t> bases = code_bases(layout);
  std::vector<bool> read(num_tables, false);
  for (int64_t f = 0; f < layout.num_features; ++f) {
    if (layout.feature_tables[f] >= 0) read[layout.feature_tables[f]] = true;
  }
  UpdateSettings settings{static_cast<int>(optimizer), h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, nullptr,
                          nullptr};
  if (lr.has_value()) {
    if (lr->scalar_type() == kFloat) {
      settings.lr_f32 = lr->const_data_ptr<float>();
    } else {
      settings.lr_f64 = lr->const_data_ptr<double>();
    }
  }
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_update_cuda", [&] {
    using acc = acc_type<scalar_t>;
    for (int first = 0; first < num_tables; first += kTablesPerLaunch) {
      UpdateLaunch<scalar_t, acc> launch{};
      StepCounts counts{};
      for (int t = first; t < std::min(num_tables, first + kTablesPerLaunch); ++t) {
        const bool adam = optimizer == FusedOptimizer::kLazyAdam;
        int64_t* step = adam ? steps[t].mutable_data_ptr<int64_t>() : nullptr;
        launch.tables[launch.count++] = UpdateTable<scalar_t, acc>{
            weights[t].mutable_data_ptr<scalar_t>(), state1.empty() ? nullptr : state1[t].mutable_data_ptr<acc>(),
            state2.empty() ? nullptr : state2[t].mutable_data_ptr<acc>(), step, bases[t], layout.table_dims[t]};
        if (adam && read[t]) counts.steps[counts.count++] = step;
      }
      update_rows_kernel<scalar_t, acc><<<blocks_for(n * kWarp), kThreads, 0, stream>>>(
          launch, settings, sorted.codes, sorted.positions, n, sorted.invalid, sorted.grad_at.const_data_ptr<int64_t>(),
          sorted.lengths.const_data_ptr<int32_t>(), prepared.psw_ptr);
      SK_CUDA_KERNEL_LAUNCH_CHECK();
      if (counts.count > 0) {
        count_steps_kernel<<<1, kTablesPerLaunch, 0, stream>>>(counts);
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("pooled_read_backward", TORCH_BOX(&pooled_read_backward_cuda));
  m.impl("pooled_read_update_", TORCH_BOX(&pooled_read_update_cuda));
}

}  // namespace sparsekit

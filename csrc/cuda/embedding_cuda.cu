// CUDA kernels of embedding_bag (pooled lookup over bags), its arg-max (max mode's
// backward) and embedding_gather (unpooled lookup).
// A lane group (sized to the row) owns one bag; sums accumulate in float32 (float64 for
// float64 tables). Bags longer than kChunk are split at fixed multiples of kChunk and their
// partials added in chunk order, so results are bit-identical run to run. Bad input is
// recorded (first bad bag and lookup, by atomicMin) and skipped, and the host reads that
// record once to raise the CPU kernel's error: the one host sync of these ops.
#include "cuda/cuda_api.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "embedding.h"

namespace sparsekit {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kRowsInFlight = 4;
// Bags longer than this are pooled in pieces of (at most) this many lookups.
constexpr int64_t kChunk = 1024;

template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Packet {
  scalar_t v[kVec];
};

/// error[0]: first bad bag, error[1]: first bad lookup (both start at kNoBadPosition).
__device__ __forceinline__ void record_first_bad(unsigned long long* slot, int64_t position) {
  atomicMin(slot, static_cast<unsigned long long>(position));
}

template <typename index_t>
__device__ __forceinline__ bool row_in_range(index_t row, int64_t num_rows) {
  return static_cast<uint64_t>(static_cast<int64_t>(row)) < static_cast<uint64_t>(num_rows);
}

__device__ __forceinline__ int64_t bag_end(const int64_t* offsets, int64_t num_offsets, int64_t bag, int64_t nnz) {
  return bag + 1 < num_offsets ? offsets[bag + 1] : nnz;
}

/// The last bag whose start offsets[b] is <= value (strict: < value), -1 when none. Bag
/// starts are offsets[0 .. bags); on broken (decreasing) offsets the answer is still an
/// index in [-1, bags), and the caller's checks drop it.
__device__ __forceinline__ int64_t last_bag_starting_by(const int64_t* offsets, int64_t bags, int64_t value,
                                                        bool strict) {
  int64_t lo = 0, hi = bags;  // first index whose start passes value lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    const bool before = strict ? offsets[mid] < value : offsets[mid] <= value;
    if (before) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

/// Everything a lane needs to pool its packets of one span of lookups.
template <typename scalar_t, typename index_t>
struct BagArgs {
  const scalar_t* __restrict__ weight;
  int64_t row_stride;
  int64_t num_rows;
  int64_t dim;
  const index_t* __restrict__ rows;
  const int64_t* __restrict__ offsets;
  int64_t num_offsets;
  int64_t bags;
  int64_t nnz;
  int64_t padding_row;  // skipped like -1; -1 when none
  const scalar_t* __restrict__ per_sample_weights;
  unsigned long long* __restrict__ error;
};

/// Checks rows[begin, end) (lanes striding) when no column pass will: a zero-width table.
template <typename scalar_t, typename index_t>
__device__ void check_span_rows(const BagArgs<scalar_t, index_t>& a, int64_t begin, int64_t end, int lane,
                                int group) {
  for (int64_t k = begin + lane; k < end; k += group) {
    const index_t row = a.rows[k];
    if (!row_in_range(row, a.num_rows) && row != index_t(-1)) record_first_bad(a.error + 1, k);
  }
}

/// Pools packet p of lookups [begin, end) in lookup order: a (weighted) sum, or with kMax
/// nn.EmbeddingBag's maximum (the first valid lookup, then any strictly larger value: a NaN
/// only when it comes first, ties keep the earlier lookup). Counts the valid lookups and, weighted, sums their weights. `report`
/// makes this call record bad rows (one packet pass per lane suffices).
template <typename scalar_t, typename index_t, int kVec, bool kWeighted, bool kMax>
__device__ __forceinline__ void pool_span(const BagArgs<scalar_t, index_t>& a, int64_t begin, int64_t end, int64_t p,
                                          bool report, acc_type<scalar_t> (&sum)[kVec], acc_type<scalar_t>& weight_sum,
                                          int64_t& valid) {
  using acc = acc_type<scalar_t>;
  using packet = Packet<scalar_t, kVec>;
#pragma unroll
  for (int e = 0; e < kVec; ++e) sum[e] = acc(0);
  weight_sum = 0;
  valid = 0;
  const scalar_t* column = a.weight + p * kVec;
  for (int64_t k = begin; k < end; k += kRowsInFlight) {
    index_t row[kRowsInFlight];
    bool ok[kRowsInFlight];
    packet data[kRowsInFlight];
    acc w[kRowsInFlight];
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j) {
      row[j] = k + j < end ? a.rows[k + j] : index_t(-1);
      const bool in_range = row_in_range(row[j], a.num_rows);
      if (!in_range && row[j] != index_t(-1) && report) record_first_bad(a.error + 1, k + j);
      ok[j] = in_range && static_cast<int64_t>(row[j]) != a.padding_row;
    }
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j) {
      if (ok[j]) {
        data[j] = *reinterpret_cast<const packet*>(column + static_cast<int64_t>(row[j]) * a.row_stride);
        w[j] = kWeighted ? static_cast<acc>(a.per_sample_weights[k + j]) : acc(1);
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j) {
      if (ok[j]) {
        if constexpr (kMax) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const acc v = static_cast<acc>(data[j].v[e]);
            if (valid == 0 || v > sum[e]) sum[e] = v;
          }
        } else if constexpr (kWeighted) {
          weight_sum += w[j];
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum[e] += w[j] * static_cast<acc>(data[j].v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum[e] += static_cast<acc>(data[j].v[e]);
        }
        ++valid;
      }
    }
  }
}

/// A column's pooled value: the sum, or in mean mode the sum divided (not multiplied by a
/// reciprocal, which is 1 ulp off a quarter of the time) by the number of valid lookups,
/// weighted by their weights' sum. A bag without a valid lookup keeps its zero sum; a
/// weighted one whose valid weights sum to zero pools to zeros (as on the CPU).
template <typename acc>
__device__ __forceinline__ acc pooled_value(acc sum, bool mean, bool weighted, acc weight_sum, int64_t valid) {
  if (!mean || valid == 0) return sum;
  const acc divisor = weighted ? weight_sum : static_cast<acc>(valid);
  return divisor != acc(0) ? sum / divisor : acc(0);
}

/// One group of `group` lanes per bag (grid-stride over bags). Bags longer than kChunk are
/// left to the piece kernels, except in max mode.
template <typename scalar_t, typename index_t, int kVec, bool kWeighted, bool kMax>
__global__ void embedding_bag_kernel(BagArgs<scalar_t, index_t> a, bool mean, scalar_t* __restrict__ out,
                                     int group_log2) {
  using acc = acc_type<scalar_t>;
  using packet = Packet<scalar_t, kVec>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  const int64_t packets = a.dim / kVec;
  for (int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; bag < a.bags;
       bag += groups_in_grid) {
    const int64_t begin = a.offsets[bag];
    const int64_t end = bag_end(a.offsets, a.num_offsets, bag, a.nnz);
    scalar_t* out_row = out + bag * a.dim;
    if (bag_offsets_bad(bag, a.bags, begin, end, a.nnz)) {
      if (lane == 0) record_first_bad(a.error, bag);
      for (int64_t c = lane; c < a.dim; c += group) out_row[c] = scalar_t(0);
      continue;
    }
    if (!kMax && end - begin > kChunk) continue;
    if (packets == 0) {
      check_span_rows(a, begin, end, lane, group);
      continue;
    }
    for (int64_t p = lane; p < packets; p += group) {
      acc sum[kVec];
      acc weight_sum;
      int64_t valid;
      pool_span<scalar_t, index_t, kVec, kWeighted, kMax>(a, begin, end, p, p == lane, sum, weight_sum, valid);
      packet result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        result.v[e] = static_cast<scalar_t>(kMax ? sum[e] : pooled_value(sum[e], mean, kWeighted, weight_sum, valid));
      }
      *reinterpret_cast<packet*>(out_row + p * kVec) = result;
    }
  }
}

/// The piece of a long bag (more than kChunk lookups) that falls in chunk `chunk` of the
/// flat lookups [chunk * kChunk, (chunk + 1) * kChunk): slot 0 for the bag that covers the
/// chunk's first lookup, slot 1 for a long bag that starts inside the chunk. No third long
/// bag fits in one chunk. Returns false when the slot holds no such piece.
template <typename scalar_t, typename index_t>
__device__ bool long_bag_piece(const BagArgs<scalar_t, index_t>& a, int64_t chunk, int slot, int64_t& piece_begin,
                               int64_t& piece_end) {
  const int64_t chunk_begin = chunk * kChunk;
  const int64_t chunk_end = a.nnz < chunk_begin + kChunk ? a.nnz : chunk_begin + kChunk;
  const int64_t bag = slot == 0 ? last_bag_starting_by(a.offsets, a.bags, chunk_begin, false)
                                : last_bag_starting_by(a.offsets, a.bags, chunk_end, true);
  if (bag < 0) return false;
  const int64_t begin = a.offsets[bag];
  const int64_t end = bag_end(a.offsets, a.num_offsets, bag, a.nnz);
  if (bag_offsets_bad(bag, a.bags, begin, end, a.nnz) || end - begin <= kChunk) return false;
  if (slot == 0 ? !(begin <= chunk_begin && chunk_begin < end) : !(chunk_begin < begin && begin < chunk_end)) {
    return false;
  }
  piece_begin = begin > chunk_begin ? begin : chunk_begin;
  piece_end = end < chunk_end ? end : chunk_end;
  return true;
}

/// One group per (chunk, slot): pools that piece of a long bag into partial[chunk * 2 + slot].
template <typename scalar_t, typename index_t, int kVec, bool kWeighted>
__global__ void long_bag_pieces_kernel(BagArgs<scalar_t, index_t> a, int64_t chunks,
                                       acc_type<scalar_t>* __restrict__ partial, int64_t* __restrict__ partial_valid,
                                       acc_type<scalar_t>* __restrict__ partial_weight, int group_log2) {
  using acc = acc_type<scalar_t>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  const int64_t packets = a.dim / kVec;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2;
       item < chunks * 2; item += groups_in_grid) {
    int64_t begin, end;
    if (!long_bag_piece(a, item >> 1, static_cast<int>(item & 1), begin, end)) continue;
    if (packets == 0) check_span_rows(a, begin, end, lane, group);
    for (int64_t p = lane; p < packets; p += group) {
      acc sum[kVec];
      acc weight_sum;
      int64_t valid;
      pool_span<scalar_t, index_t, kVec, kWeighted, false>(a, begin, end, p, p == lane, sum, weight_sum, valid);
#pragma unroll
      for (int e = 0; e < kVec; ++e) partial[item * a.dim + p * kVec + e] = sum[e];
      if (p == 0) {
        partial_valid[item] = valid;
        partial_weight[item] = weight_sum;
      }
    }
  }
}

/// One group per chunk: the long bag that starts in the chunk (if any) adds its pieces'
/// partials in chunk order and writes its output row.
template <typename scalar_t, typename index_t, bool kWeighted>
__global__ void long_bag_combine_kernel(BagArgs<scalar_t, index_t> a, int64_t chunks, bool mean,
                                        const acc_type<scalar_t>* __restrict__ partial,
                                        const int64_t* __restrict__ partial_valid,
                                        const acc_type<scalar_t>* __restrict__ partial_weight,
                                        scalar_t* __restrict__ out, int group_log2) {
  using acc = acc_type<scalar_t>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  for (int64_t chunk = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; chunk < chunks;
       chunk += groups_in_grid) {
    const int64_t chunk_begin = chunk * kChunk;
    const int64_t chunk_end = a.nnz < chunk_begin + kChunk ? a.nnz : chunk_begin + kChunk;
    const int64_t bag = last_bag_starting_by(a.offsets, a.bags, chunk_end, true);
    if (bag < 0) continue;
    const int64_t begin = a.offsets[bag];
    const int64_t end = bag_end(a.offsets, a.num_offsets, bag, a.nnz);
    if (bag_offsets_bad(bag, a.bags, begin, end, a.nnz) || end - begin <= kChunk || begin < chunk_begin) continue;
    const int64_t first = chunk;
    const int64_t last = (end - 1) / kChunk;
    // The first piece sits in slot 0 when the bag starts on the chunk boundary.
    const int64_t first_item = first * 2 + (begin == chunk_begin ? 0 : 1);
    int64_t valid = 0;
    acc weight_sum = 0;
    for (int64_t c = first; c <= last; ++c) {
      const int64_t item = c == first ? first_item : c * 2;
      valid += partial_valid[item];
      weight_sum += partial_weight[item];
    }
    scalar_t* out_row = out + bag * a.dim;
    for (int64_t col = lane; col < a.dim; col += group) {
      acc sum = 0;
      for (int64_t c = first; c <= last; ++c) {
        const int64_t item = c == first ? first_item : c * 2;
        sum += partial[item * a.dim + col];
      }
      out_row[col] = static_cast<scalar_t>(pooled_value(sum, mean, kWeighted, weight_sum, valid));
    }
  }
}

/// One group per bag, lanes over columns: the lookup holding each column's maximum under
/// pool_span<kMax>'s rule, -1 for a bag without a valid lookup.
template <typename scalar_t, typename index_t>
__global__ void embedding_bag_argmax_kernel(BagArgs<scalar_t, index_t> a, int64_t* __restrict__ positions,
                                            int group_log2) {
  using acc = acc_type<scalar_t>;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int64_t groups_in_grid = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_log2;
  for (int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; bag < a.bags;
       bag += groups_in_grid) {
    const int64_t begin = a.offsets[bag];
    const int64_t end = bag_end(a.offsets, a.num_offsets, bag, a.nnz);
    int64_t* out_row = positions + bag * a.dim;
    if (bag_offsets_bad(bag, a.bags, begin, end, a.nnz)) {
      if (lane == 0) record_first_bad(a.error, bag);
      for (int64_t c = lane; c < a.dim; c += group) out_row[c] = -1;
      continue;
    }
    if (a.dim == 0) {
      check_span_rows(a, begin, end, lane, group);
      continue;
    }
    for (int64_t c = lane; c < a.dim; c += group) {
      acc best = 0;
      int64_t position = -1;
      for (int64_t k = begin; k < end; ++k) {
        const index_t row = a.rows[k];
        if (!row_in_range(row, a.num_rows)) {
          if (row != index_t(-1) && c == lane) record_first_bad(a.error + 1, k);
          continue;
        }
        if (static_cast<int64_t>(row) == a.padding_row) continue;
        const acc v = static_cast<acc>(a.weight[static_cast<int64_t>(row) * a.row_stride + c]);
        if (position < 0 || v > best) {
          best = v;
          position = k;
        }
      }
      out_row[c] = position;
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
      if (row != index_t(-1) && lane == 0) record_first_bad(error + 1, i);
      packet zero;
#pragma unroll
      for (int e = 0; e < kVec; ++e) zero.v[e] = scalar_t(0);
      for (int64_t p = lane; p < packets; p += group) dst[p] = zero;
    }
  }
}

/// Elements per 16-byte packet when the dim, the row stride and both base pointers allow
/// aligned 16-byte accesses; 1 otherwise (a view such as big[:, 1:33] takes that path).
template <typename scalar_t>
int packet_width(const Tensor& weight, const Tensor& out) {
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

/// The error buffer: [first bad bag, first bad lookup], both kNoBadPosition until set.
Tensor new_error_buffer(const Tensor& like) {
  return full_long_cuda(2, kNoBadPosition, like);
}

unsigned long long* error_slots(Tensor& error) {
  return reinterpret_cast<unsigned long long*>(error.mutable_data_ptr<int64_t>());
}

template <typename scalar_t, typename index_t>
BagArgs<scalar_t, index_t> bag_args(const Tensor& weight, const Tensor& rows, const Tensor& offsets,
                                    int64_t bags, int64_t padding_row, const Tensor& per_sample_weights,
                                    Tensor& error) {
  return BagArgs<scalar_t, index_t>{
      weight.const_data_ptr<scalar_t>(),
      weight.stride(0),
      weight.size(0),
      weight.size(1),
      rows.const_data_ptr<index_t>(),
      offsets.const_data_ptr<int64_t>(),
      offsets.size(0),
      bags,
      rows.size(0),
      padding_row,
      per_sample_weights.defined() ? per_sample_weights.const_data_ptr<scalar_t>() : nullptr,
      error_slots(error)};
}

}  // namespace

Tensor embedding_bag_cuda(const Tensor& weight_in, const Tensor& rows_in, const Tensor& offsets_in,
                              const std::optional<Tensor>& per_sample_weights_in, StrArg mode,
                              std::optional<int64_t> padding_idx, bool include_last_offset) {
  const BagMode bag_mode = parse_bag_mode(mode.value);
  DeviceGuard guard(weight_in.get_device_index());
  const BagInputs in = prepare_bag_inputs(weight_in, rows_in, offsets_in, per_sample_weights_in, bag_mode,
                                          padding_idx, include_last_offset);
  const Tensor &weight = in.weight, &rows = in.rows, &offsets = in.offsets;
  const Tensor& per_sample_weights = in.per_sample_weights;
  const int64_t nnz = in.nnz, bags = in.bags, dim = in.dim, padding_row = in.padding_row;
  Tensor out = empty({bags, dim}, weight.scalar_type(), weight.device());
  if (bags == 0) {
    check_offsets_without_bags(offsets, nnz, include_last_offset);
    return out;
  }
  const bool max = bag_mode == BagMode::kMax;
  const bool mean = bag_mode == BagMode::kMean;
  // Chunks of the flat lookups; only sum/mean split long bags, and only a batch longer
  // than one chunk can hold one.
  const int64_t chunks = !max && nnz > kChunk ? (nnz + kChunk - 1) / kChunk : 0;
  Tensor error = new_error_buffer(weight);
  const cudaStream_t stream = current_stream(weight);
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "embedding_bag_cuda", [&] {
    SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_cuda_rows", [&] {
      using acc = acc_type<scalar_t>;
      const auto args = bag_args<scalar_t, index_t>(weight, rows, offsets, bags, padding_row, per_sample_weights,
                                                    error);
      const bool weighted = per_sample_weights.defined();
      const int vec = packet_width<scalar_t>(weight, out);
      const int group_log2 = group_log2_for(std::max<int64_t>(dim / vec, 1));
      scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
      constexpr int kWide = 16 / sizeof(scalar_t);
      auto launch_bags = [&](auto kernel) {
        kernel<<<grid_for(bags, group_log2), kThreadsPerBlock, 0, stream>>>(args, mean, out_ptr, group_log2);
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (max) {
        vec == kWide ? launch_bags(embedding_bag_kernel<scalar_t, index_t, kWide, false, true>)
                     : launch_bags(embedding_bag_kernel<scalar_t, index_t, 1, false, true>);
      } else if (vec == kWide) {
        weighted ? launch_bags(embedding_bag_kernel<scalar_t, index_t, kWide, true, false>)
                 : launch_bags(embedding_bag_kernel<scalar_t, index_t, kWide, false, false>);
      } else {
        weighted ? launch_bags(embedding_bag_kernel<scalar_t, index_t, 1, true, false>)
                 : launch_bags(embedding_bag_kernel<scalar_t, index_t, 1, false, false>);
      }
      if (chunks == 0) return;
      const auto acc_dtype = scalar_type_of<acc>();
      const Tensor partial = empty({chunks * 2, dim}, acc_dtype, weight.device());
      const Tensor partial_weight = empty({chunks * 2}, partial.scalar_type(), partial.device());
      const Tensor partial_valid = empty({chunks * 2}, kLong, weight.device());
      acc* partial_ptr = static_cast<acc*>(partial.data_ptr());
      acc* partial_weight_ptr = static_cast<acc*>(partial_weight.data_ptr());
      int64_t* partial_valid_ptr = partial_valid.mutable_data_ptr<int64_t>();
      auto launch_pieces = [&](auto kernel) {
        kernel<<<grid_for(chunks * 2, group_log2), kThreadsPerBlock, 0, stream>>>(
            args, chunks, partial_ptr, partial_valid_ptr, partial_weight_ptr, group_log2);
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (vec == kWide) {
        weighted ? launch_pieces(long_bag_pieces_kernel<scalar_t, index_t, kWide, true>)
                 : launch_pieces(long_bag_pieces_kernel<scalar_t, index_t, kWide, false>);
      } else {
        weighted ? launch_pieces(long_bag_pieces_kernel<scalar_t, index_t, 1, true>)
                 : launch_pieces(long_bag_pieces_kernel<scalar_t, index_t, 1, false>);
      }
      // With no column the pieces only checked their rows and wrote no partial: nothing to
      // combine (the combine would read the unwritten counts).
      if (dim == 0) return;
      auto launch_combine = [&](auto kernel) {
        kernel<<<grid_for(chunks, group_log2), kThreadsPerBlock, 0, stream>>>(
            args, chunks, mean, partial_ptr, partial_valid_ptr, partial_weight_ptr, out_ptr, group_log2);
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      };
      weighted ? launch_combine(long_bag_combine_kernel<scalar_t, index_t, true>)
               : launch_combine(long_bag_combine_kernel<scalar_t, index_t, false>);
    });
  });
  // The one host sync of the op (the error path reads a few more entries).
  const Tensor first_bad = cpu(error);
  raise_first_bag_error(first_bad.const_data_ptr<int64_t>()[0], first_bad.const_data_ptr<int64_t>()[1], offsets, rows, bags,
                        weight.size(0), include_last_offset);
  return out;
}

Tensor embedding_bag_argmax_cuda(const Tensor& weight_in, const Tensor& rows_in,
                                     const Tensor& offsets_in, std::optional<int64_t> padding_idx,
                                     bool include_last_offset) {
  DeviceGuard guard(weight_in.get_device_index());
  const BagInputs in = prepare_bag_inputs(weight_in, rows_in, offsets_in, std::nullopt, BagMode::kMax,
                                          padding_idx, include_last_offset);
  const Tensor &weight = in.weight, &rows = in.rows, &offsets = in.offsets;
  const int64_t nnz = in.nnz, bags = in.bags, dim = in.dim, padding_row = in.padding_row;
  Tensor positions = empty({bags, dim}, kLong, rows.device());
  if (bags == 0) {
    check_offsets_without_bags(offsets, nnz, include_last_offset);
    return positions;
  }
  Tensor error = new_error_buffer(weight);
  const cudaStream_t stream = current_stream(weight);
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "embedding_bag_argmax_cuda", [&] {
    SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_bag_argmax_cuda_rows", [&] {
      const auto args = bag_args<scalar_t, index_t>(weight, rows, offsets, bags, padding_row, Tensor(), error);
      const int group_log2 = group_log2_for(std::max<int64_t>(dim, 1));
      embedding_bag_argmax_kernel<scalar_t, index_t><<<grid_for(bags, group_log2), kThreadsPerBlock, 0, stream>>>(
          args, positions.mutable_data_ptr<int64_t>(), group_log2);
      SK_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const Tensor first_bad = cpu(error);  // the one host sync
  raise_first_bag_error(first_bad.const_data_ptr<int64_t>()[0], first_bad.const_data_ptr<int64_t>()[1], offsets, rows, bags,
                        weight.size(0), include_last_offset);
  return positions;
}

Tensor embedding_gather_cuda(const Tensor& weight_in, const Tensor& rows_in) {
  check_embedding_gather_args(weight_in, rows_in);
  DeviceGuard guard(weight_in.get_device_index());
  const Tensor weight = rows_stride_ready(weight_in);
  const Tensor rows = as_contiguous(rows_in);
  const int64_t n = rows.numel();
  const int64_t dim = weight.size(1);
  std::vector<int64_t> out_shape(rows.sizes().begin(), rows.sizes().end());
  out_shape.push_back(dim);
  Tensor out = empty(out_shape, weight.scalar_type(), weight.device());
  if (n == 0) return out;
  Tensor error = new_error_buffer(weight);
  const cudaStream_t stream = current_stream(weight);
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "embedding_gather_cuda", [&] {
    SK_DISPATCH_INDEX_TYPES(rows.scalar_type(), "embedding_gather_cuda_rows", [&] {
      const int vec = packet_width<scalar_t>(weight, out);
      const int group_log2 = group_log2_for(std::max<int64_t>(dim / vec, 1));
      const int64_t grid = grid_for(n, group_log2);
      auto launch = [&](auto kernel) {
        kernel<<<grid, kThreadsPerBlock, 0, stream>>>(weight.const_data_ptr<scalar_t>(), weight.stride(0),
                                                      weight.size(0), dim, rows.const_data_ptr<index_t>(), n,
                                                      out.mutable_data_ptr<scalar_t>(), group_log2,
                                                      error_slots(error));
        SK_CUDA_KERNEL_LAUNCH_CHECK();
      };
      constexpr int kWide = 16 / sizeof(scalar_t);
      if (vec == kWide) {
        launch(embedding_gather_kernel<scalar_t, index_t, kWide>);
      } else {
        launch(embedding_gather_kernel<scalar_t, index_t, 1>);
      }
    });
  });
  const Tensor first_bad = cpu(error);  // the one host sync
  raise_first_gather_error(first_bad.const_data_ptr<int64_t>()[1], rows, weight.size(0));
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("embedding_bag", TORCH_BOX(&embedding_bag_cuda));
  m.impl("embedding_bag_argmax", TORCH_BOX(&embedding_bag_argmax_cuda));
  m.impl("embedding_gather", TORCH_BOX(&embedding_gather_cuda));
}

}  // namespace sparsekit

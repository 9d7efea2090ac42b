// unsorted_segment_sum on the GPU. deterministic=False: atomics, one per run of equal ids.
// deterministic=True: rows radix-sorted by (id, position), each segment summed over a fixed
// tree (kTileRows, kFanIn), so the bits depend on the data alone, not the grid; a segment
// shorter than kTileRows is a left-to-right sum, bit-identical to the CPU. Ids >=
// num_segments are skipped and their maximum read back once at the end to raise.
#include "cuda/cuda_api.h"

#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "segment.h"

namespace sparsekit {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;  // grid-stride beyond this
// Fast path: rows per thread run; more when there is plenty of parallel work.
constexpr int64_t kMaxRowsPerRun = 16;
constexpr int64_t kTargetThreads = int64_t{1} << 18;
// Deterministic path: the fixed reduction tree, and the rows/nodes loaded ahead per batch.
constexpr int64_t kTileRows = 64;
constexpr int64_t kFanIn = 32;
constexpr int kMaxLevels = 10;  // 64 * 32^9 = 2^51 rows: more than any tensor
constexpr int kBatchElements = 32;  // per thread in flight: e.g. 8 rows of float4

/// VEC consecutive elements moved as one aligned load (16 bytes at the widest).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

/// How many packs a thread gathers before adding them (bounded so registers stay low).
template <int VEC>
constexpr int batch_of() {
  constexpr int batch = kBatchElements / VEC;
  return batch < 1 ? 1 : (batch > 8 ? 8 : batch);
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* src) {
  return *reinterpret_cast<const Pack<T, VEC>*>(src);
}

/// dst[0..VEC) = acc converted to T, as one aligned store.
template <typename T, typename acc_t, int VEC>
__device__ __forceinline__ void store_pack(T* dst, const acc_t (&acc)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int v = 0; v < VEC; ++v) pack.v[v] = static_cast<T>(acc[v]);
  *reinterpret_cast<Pack<T, VEC>*>(dst) = pack;
}

template <typename acc_t, int VEC>
__device__ __forceinline__ void zero(acc_t (&acc)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = acc_t(0);
}

template <typename acc_t, typename T, int VEC>
__device__ __forceinline__ void accumulate(acc_t (&acc)[VEC], const Pack<T, VEC>& pack) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] += static_cast<acc_t>(pack.v[v]);
}

template <int VEC>
__device__ __forceinline__ void atomic_add_pack(float* dst, const float (&acc)[VEC]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int v = 0; v < VEC; v += 4) {
      atomicAdd(reinterpret_cast<float4*>(dst + v), make_float4(acc[v], acc[v + 1], acc[v + 2], acc[v + 3]));
    }
  } else if constexpr (VEC == 2) {
    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[0], acc[1]));
  } else {
    atomicAdd(dst, acc[0]);
  }
#else
#pragma unroll
  for (int v = 0; v < VEC; ++v) atomicAdd(dst + v, acc[v]);
#endif
}

template <int VEC>
__device__ __forceinline__ void atomic_add_pack(double* dst, const double (&acc)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) atomicAdd(dst + v, acc[v]);
}

__device__ __forceinline__ void record_out_of_range(long long* bad_id, int64_t id) {
  atomicMax(bad_id, static_cast<long long>(id));
}

/// @brief Records in *bad_id the largest id >= num_segments (bad_id starts at -1).
template <typename id_t>
__global__ void __launch_bounds__(kThreads)
    find_out_of_range_kernel(const id_t* __restrict__ ids, int64_t n, int64_t num_segments, long long* bad_id) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id >= num_segments) record_out_of_range(bad_id, id);
  }
}

// ---- deterministic=False: atomics ----

/// @brief out[ids[r], :] += data[r, :] for rows with 0 <= id < num_segments. A thread owns
/// one column chunk of a run of rows_per_run consecutive rows at a time, and flushes its
/// running sum with one atomic per change of id.
template <typename scalar_t, typename acc_t, typename id_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    segment_sum_atomic_kernel(const scalar_t* __restrict__ data, const id_t* __restrict__ ids,
                              acc_t* __restrict__ out, int64_t num_rows, int64_t dim, int64_t num_segments,
                              int64_t rows_per_run, long long* __restrict__ bad_id) {
  const int64_t chunks = dim / VEC;
  // Column chunks: threadIdx.x within a block, blockIdx.y across blocks (wide rows).
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t num_runs = (num_rows + rows_per_run - 1) / rows_per_run;
  const int64_t run_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t run = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; run < num_runs;
       run += run_stride) {
    const int64_t row_begin = run * rows_per_run;
    const int64_t row_end = row_begin + rows_per_run < num_rows ? row_begin + rows_per_run : num_rows;
    for (int64_t chunk = chunk_begin; chunk < chunks; chunk += chunk_stride) {
      const int64_t col = chunk * VEC;
      int64_t current = -1;
      acc_t acc[VEC];
      zero(acc);
      for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t id = static_cast<int64_t>(ids[row]);
        if (id < 0) continue;  // padding: dropped, and does not break a run
        if (id >= num_segments) {
          if (chunk == 0) record_out_of_range(bad_id, id);
          continue;
        }
        if (id != current) {
          if (current >= 0) atomic_add_pack(out + current * dim + col, acc);
          current = id;
          zero(acc);
        }
        accumulate(acc, load_pack<scalar_t, VEC>(data + row * dim + col));
      }
      if (current >= 0) atomic_add_pack(out + current * dim + col, acc);
    }
  }
}

// ---- deterministic=True: sort + fixed tree ----

/// @brief Sort input: key = segment id, or num_segments (a bucket sorted last and ignored)
/// for padding and out-of-range ids; value = position.
template <typename id_t, typename key_t, typename pos_t>
__global__ void __launch_bounds__(kThreads)
    make_sort_pairs_kernel(const id_t* __restrict__ ids, int64_t n, int64_t num_segments, key_t* __restrict__ keys,
                           pos_t* __restrict__ positions, long long* __restrict__ bad_id) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    int64_t key = num_segments;
    if (id >= num_segments) {
      record_out_of_range(bad_id, id);
    } else if (id >= 0) {
      key = id;
    }
    keys[i] = static_cast<key_t>(key);
    positions[i] = static_cast<pos_t>(i);
  }
}

/// @brief [seg_begin[s], seg_end[s]) = the sorted range of segment s; both arrays must be
/// zero on entry, so empty segments keep an empty range.
template <typename key_t, typename pos_t>
__global__ void __launch_bounds__(kThreads)
    segment_bounds_kernel(const key_t* __restrict__ sorted_keys, int64_t n, int64_t num_segments,
                          pos_t* __restrict__ seg_begin, pos_t* __restrict__ seg_end) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    const key_t key = sorted_keys[j];
    if (static_cast<int64_t>(key) >= num_segments) continue;
    if (j == 0 || sorted_keys[j - 1] != key) seg_begin[key] = static_cast<pos_t>(j);
    if (j == n - 1 || sorted_keys[j + 1] != key) seg_end[key] = static_cast<pos_t>(j + 1);
  }
}

/// acc += data rows sorted_pos[from..to) in order; rows are gathered a batch at a time so a
/// thread keeps several loads in flight. kWholeBatches: to - from is a multiple of the
/// batch (no bounds tests, which also keeps the batch in registers).
template <typename scalar_t, typename acc_t, typename pos_t, int VEC, bool kWholeBatches = false>
__device__ __forceinline__ void add_rows(acc_t (&acc)[VEC], const scalar_t* __restrict__ data,
                                         const pos_t* __restrict__ sorted_pos, int64_t dim, int64_t col,
                                         int64_t from, int64_t to) {
  constexpr int kBatch = batch_of<VEC>();
  for (int64_t r = from; r < to; r += kBatch) {
    Pack<scalar_t, VEC> packs[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kWholeBatches || r + b < to) {
        packs[b] = load_pack<scalar_t, VEC>(data + static_cast<int64_t>(sorted_pos[r + b]) * dim + col);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kWholeBatches || r + b < to) accumulate(acc, packs[b]);
    }
  }
}

/// acc += nodes[first .. first + count) in order (rows of width dim), a batch at a time.
template <typename acc_t, int VEC, bool kWholeBatches = false>
__device__ __forceinline__ void add_nodes(acc_t (&acc)[VEC], const acc_t* __restrict__ nodes, int64_t dim,
                                          int64_t col, int64_t first, int64_t count) {
  constexpr int kBatch = batch_of<VEC>();
  for (int64_t i = 0; i < count; i += kBatch) {
    Pack<acc_t, VEC> packs[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kWholeBatches || i + b < count) packs[b] = load_pack<acc_t, VEC>(nodes + (first + i + b) * dim + col);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kWholeBatches || i + b < count) accumulate(acc, packs[b]);
    }
  }
}

/// The levels of the reduction tree: level l >= 1 covers aligned ranges of span[l] sorted
/// rows; nodes[l - 1][i] is the sum of range i, valid only where the range is "full" (all
/// rows in one segment). Level 0 is the rows themselves (span 1).
template <typename acc_t>
struct TreeLevels {
  const acc_t* nodes[kMaxLevels];
  int64_t span[kMaxLevels + 1];
  int count;
};

/// @brief Level 1: node[t] = sum of the kTileRows sorted rows of tile t, in order, for
/// tiles that lie in one segment (others are left unwritten and never read).
template <typename scalar_t, typename acc_t, typename key_t, typename pos_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    tile_sums_kernel(const scalar_t* __restrict__ data, const key_t* __restrict__ sorted_keys,
                     const pos_t* __restrict__ sorted_pos, int64_t num_tiles, int64_t dim, int64_t num_segments,
                     acc_t* __restrict__ nodes) {
  const int64_t chunks = dim / VEC;
  // Column chunks: threadIdx.x within a block, blockIdx.y across blocks (wide rows).
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t tile_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; tile < num_tiles;
       tile += tile_stride) {
    const int64_t first = tile * kTileRows;
    const key_t key = sorted_keys[first];
    if (key != sorted_keys[first + kTileRows - 1] || static_cast<int64_t>(key) >= num_segments) continue;
    for (int64_t chunk = chunk_begin; chunk < chunks; chunk += chunk_stride) {
      const int64_t col = chunk * VEC;
      acc_t acc[VEC];
      zero(acc);
      static_assert(kTileRows % batch_of<VEC>() == 0, "a tile must be whole batches");
      add_rows<scalar_t, acc_t, pos_t, VEC, true>(acc, data, sorted_pos, dim, col, first, first + kTileRows);
      store_pack(nodes + tile * dim + col, acc);
    }
  }
}

/// @brief Level l >= 2: parents[p] = sum of its kFanIn children in order, for parents
/// whose span[l] sorted rows lie in one segment.
template <typename acc_t, typename key_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    node_sums_kernel(const key_t* __restrict__ sorted_keys, const acc_t* __restrict__ children,
                     acc_t* __restrict__ parents, int64_t num_parents, int64_t span, int64_t dim,
                     int64_t num_segments) {
  const int64_t chunks = dim / VEC;
  // Column chunks: threadIdx.x within a block, blockIdx.y across blocks (wide rows).
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t parent_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t parent = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; parent < num_parents;
       parent += parent_stride) {
    const int64_t first = parent * span;
    const key_t key = sorted_keys[first];
    if (key != sorted_keys[first + span - 1] || static_cast<int64_t>(key) >= num_segments) continue;
    for (int64_t chunk = chunk_begin; chunk < chunks; chunk += chunk_stride) {
      const int64_t col = chunk * VEC;
      acc_t acc[VEC];
      zero(acc);
      static_assert(kFanIn % batch_of<VEC>() == 0, "a node's children must be whole batches");
      add_nodes<acc_t, VEC, true>(acc, children, dim, col, parent * kFanIn, kFanIn);
      store_pack(parents + parent * dim + col, acc);
    }
  }
}

/// acc += the level-`level` units covering sorted rows [from, to) (multiples of its span).
template <typename scalar_t, typename acc_t, typename pos_t, int VEC>
__device__ __forceinline__ void add_units(acc_t (&acc)[VEC], const scalar_t* __restrict__ data,
                                          const pos_t* __restrict__ sorted_pos, const TreeLevels<acc_t>& levels,
                                          int level, int64_t dim, int64_t col, int64_t from, int64_t to) {
  if (level == 0) {
    add_rows(acc, data, sorted_pos, dim, col, from, to);
  } else {
    const int64_t span = levels.span[level];
    add_nodes(acc, levels.nodes[level - 1], dim, col, from / span, (to - from) / span);
  }
}

/// @brief out[s] = sum of segment s's sorted rows [seg_begin[s], seg_end[s]), left to
/// right over the canonical decomposition: rows up to the first tile boundary, then ever
/// larger aligned full nodes, then ever smaller ones down to single rows. Segments with an
/// empty range are left as they are (zero).
template <typename scalar_t, typename acc_t, typename pos_t, int VEC>
__global__ void __launch_bounds__(kThreads, 2)
    segment_combine_kernel(const scalar_t* __restrict__ data, const pos_t* __restrict__ sorted_pos,
                           const pos_t* __restrict__ seg_begin, const pos_t* __restrict__ seg_end,
                           int64_t num_segments, int64_t dim, const TreeLevels<acc_t> levels,
                           scalar_t* __restrict__ out) {
  const int64_t chunks = dim / VEC;
  // Column chunks: threadIdx.x within a block, blockIdx.y across blocks (wide rows).
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t segment_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t segment = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; segment < num_segments;
       segment += segment_stride) {
    const int64_t begin = static_cast<int64_t>(seg_begin[segment]);
    const int64_t end = static_cast<int64_t>(seg_end[segment]);
    if (begin >= end) continue;
    for (int64_t chunk = chunk_begin; chunk < chunks; chunk += chunk_stride) {
      const int64_t col = chunk * VEC;
      acc_t acc[VEC];
      zero(acc);
      // Climb: finish each level until p is aligned to the next one, and go up while a
      // whole node of the next level fits. Then descend: the largest units that fit at
      // each level, down to single rows (span 1 always reaches end). One call site keeps
      // the inlined gathers, and so the registers, to one copy.
      int64_t p = begin;
      int level = 0;
      bool climbing = true;
      while (p < end) {
        const int64_t span = levels.span[level];
        int64_t stop = p + (end - p) / span * span;
        bool climb_next = false;
        if (climbing && level < levels.count) {
          const int64_t up = levels.span[level + 1];
          const int64_t aligned = (p + up - 1) / up * up;
          if (aligned < stop) stop = aligned;
          climb_next = stop == aligned && aligned + up <= end;
        }
        add_units(acc, data, sorted_pos, levels, level, dim, col, p, stop);
        p = stop;
        if (climb_next) {
          ++level;
        } else if (climbing) {
          climbing = false;  // the same level continues downwards
        } else {
          --level;
        }
      }
      store_pack(out + segment * dim + col, acc);
    }
  }
}

// ---- host side ----

int64_t grid_for(int64_t items, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, kMaxGridBlocks));
}

/// Threads over (column chunks) x (rows, tiles or segments): x covers a row's chunks (all
/// of them when there are at most kThreads), y the rest of the block.
dim3 block_for(int64_t chunks) {
  const int x = chunks >= kThreads ? kThreads : static_cast<int>(chunks);
  return dim3(x, kThreads / x);
}

/// Grid for block_for(chunks): x strides over the items (rows, tiles or segments), y over
/// the column chunks that one block row cannot cover.
dim3 grid_2d(int64_t items, dim3 block, int64_t chunks) {
  const int64_t column_blocks = std::min<int64_t>((chunks + block.x - 1) / block.x, 65535);
  return dim3(static_cast<unsigned int>(grid_for(items, block.y)), static_cast<unsigned int>(column_blocks));
}

/// Widest load that divides D and matches the pointer's alignment.
template <typename scalar_t>
int pick_vec(const void* ptr, int64_t dim) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  return dim % kWide == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0 ? kWide : 1;
}

template <typename scalar_t, typename id_t, int VEC>
void launch_atomic(const Tensor& data, const Tensor& ids, Tensor& acc, int64_t dim,
                   int64_t num_segments, long long* bad_id, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const int64_t n = data.size(0);
  const int64_t chunks = dim / VEC;
  const int64_t rows_per_run = std::clamp<int64_t>(n * chunks / kTargetThreads, 1, kMaxRowsPerRun);
  const dim3 block = block_for(chunks);
  const int64_t runs = (n + rows_per_run - 1) / rows_per_run;
  segment_sum_atomic_kernel<scalar_t, acc_t, id_t, VEC>
      <<<grid_2d(runs, block, chunks), block, 0, stream>>>(
          data.mutable_data_ptr<scalar_t>(), ids.mutable_data_ptr<id_t>(), acc.mutable_data_ptr<acc_t>(), n, dim, num_segments,
          rows_per_run, bad_id);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename id_t>
void segment_sum_atomic(const Tensor& data, const Tensor& ids, Tensor& out, int64_t dim,
                        int64_t num_segments, long long* bad_id, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  constexpr int kWide = 16 / sizeof(scalar_t);
  // float16/bfloat16 sum in float32 and round once, as on the CPU.
  Tensor acc = std::is_same_v<acc_t, scalar_t>
                   ? out
                   : allocate_or_fail("segment_sum", "num_segments=" + std::to_string(num_segments) +
                                                         " (the float32 accumulator)",
                                      [&] { return zeros_cuda(out.sizes(), kFloat, out.device()); });
  if (pick_vec<scalar_t>(data.data_ptr(), dim) == kWide) {
    launch_atomic<scalar_t, id_t, kWide>(data, ids, acc, dim, num_segments, bad_id, stream);
  } else {
    launch_atomic<scalar_t, id_t, 1>(data, ids, acc, dim, num_segments, bad_id, stream);
  }
  if (!std::is_same_v<acc_t, scalar_t>) torch::stable::copy_(out, acc);
}

template <typename scalar_t, typename key_t, typename pos_t, int VEC>
void launch_tree(const Tensor& data, const key_t* sorted_keys, const pos_t* sorted_pos, const pos_t* seg_begin,
                 const pos_t* seg_end, Tensor& out, int64_t dim, int64_t num_segments, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const int64_t n = data.size(0);
  const int64_t chunks = dim / VEC;
  const dim3 block = block_for(chunks);
  const ScalarType acc_dtype = scalar_type_of<acc_t>();

  TreeLevels<acc_t> levels{};
  levels.span[0] = 1;
  std::vector<Tensor> level_nodes;
  int64_t span = kTileRows;
  while (levels.count < kMaxLevels && span <= n) {
    const int64_t count = n / span;  // only whole ranges can be full
    Tensor nodes = empty({count, dim}, acc_dtype, data.device());
    acc_t* node_ptr = nodes.mutable_data_ptr<acc_t>();
    const dim3 grid = grid_2d(count, block, chunks);
    if (levels.count == 0) {
      tile_sums_kernel<scalar_t, acc_t, key_t, pos_t, VEC><<<grid, block, 0, stream>>>(
          data.mutable_data_ptr<scalar_t>(), sorted_keys, sorted_pos, count, dim, num_segments, node_ptr);
    } else {
      node_sums_kernel<acc_t, key_t, VEC><<<grid, block, 0, stream>>>(
          sorted_keys, levels.nodes[levels.count - 1], node_ptr, count, span, dim, num_segments);
    }
    SK_CUDA_KERNEL_LAUNCH_CHECK();
    levels.nodes[levels.count] = node_ptr;
    levels.span[levels.count + 1] = span;
    ++levels.count;
    level_nodes.push_back(std::move(nodes));
    if (span > std::numeric_limits<int64_t>::max() / kFanIn) break;
    span *= kFanIn;
  }

  segment_combine_kernel<scalar_t, acc_t, pos_t, VEC>
      <<<grid_2d(num_segments, block, chunks), block, 0, stream>>>(
          data.mutable_data_ptr<scalar_t>(), sorted_pos, seg_begin, seg_end, num_segments, dim, levels,
          out.mutable_data_ptr<scalar_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  // level_nodes are freed here: the caching allocator reuses them only in stream order.
}

template <typename scalar_t, typename id_t, typename key_t, typename pos_t>
void segment_sum_sorted(const Tensor& data, const Tensor& ids, Tensor& out, int64_t dim,
                        int64_t num_segments, long long* bad_id, cudaStream_t stream) {
  const int64_t n = data.size(0);
  const ScalarType key_dtype = scalar_type_of<std::make_signed_t<key_t>>();
  const ScalarType pos_dtype = scalar_type_of<pos_t>();
  Tensor keys_a = empty({n}, key_dtype, ids.device()), keys_b = empty({n}, key_dtype, ids.device());
  Tensor pos_a = empty({n}, pos_dtype, ids.device()), pos_b = empty({n}, pos_dtype, ids.device());
  key_t* keys_a_ptr = reinterpret_cast<key_t*>(keys_a.data_ptr());
  key_t* keys_b_ptr = reinterpret_cast<key_t*>(keys_b.data_ptr());

  make_sort_pairs_kernel<id_t, key_t, pos_t><<<static_cast<unsigned int>(grid_for(n, kThreads)), kThreads, 0, stream>>>(
      ids.mutable_data_ptr<id_t>(), n, num_segments, keys_a_ptr, pos_a.mutable_data_ptr<pos_t>(), bad_id);
  SK_CUDA_KERNEL_LAUNCH_CHECK();

  // LSD radix sort is stable, so equal ids keep position order. Keys are <= num_segments,
  // so only its bit width needs sorting.
  const int end_bit = 64 - __builtin_clzll(static_cast<unsigned long long>(num_segments));
  cub::DoubleBuffer<key_t> sort_keys(keys_a_ptr, keys_b_ptr);
  cub::DoubleBuffer<pos_t> sort_pos(pos_a.mutable_data_ptr<pos_t>(), pos_b.mutable_data_ptr<pos_t>());
  const pos_t num_items = static_cast<pos_t>(n);  // n fits pos_t by the choice of pos_t
  size_t temp_bytes = 0;
  SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, sort_keys, sort_pos, num_items, 0, end_bit,
                                                 stream));
  // At least one byte: a null temp pointer would make the second call a size query.
  Tensor temp =
      empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))}, kByte, ids.device());
  SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, sort_keys, sort_pos, num_items, 0,
                                                 end_bit, stream));
  const key_t* sorted_keys = sort_keys.Current();
  const pos_t* sorted_pos = sort_pos.Current();

  Tensor bounds = allocate_or_fail("segment_sum", "num_segments=" + std::to_string(num_segments) +
                                                      " (the segments' bounds)",
                                   [&] { return empty({2, num_segments}, pos_dtype, ids.device()); });
  pos_t* seg_begin = bounds.mutable_data_ptr<pos_t>();
  pos_t* seg_end = seg_begin + num_segments;
  SK_CUDA_CHECK(cudaMemsetAsync(seg_begin, 0, 2 * num_segments * sizeof(pos_t), stream));
  segment_bounds_kernel<key_t, pos_t><<<static_cast<unsigned int>(grid_for(n, kThreads)), kThreads, 0, stream>>>(
      sorted_keys, n, num_segments, seg_begin, seg_end);
  SK_CUDA_KERNEL_LAUNCH_CHECK();

  constexpr int kWide = 16 / sizeof(scalar_t);
  if (pick_vec<scalar_t>(data.data_ptr(), dim) == kWide) {
    launch_tree<scalar_t, key_t, pos_t, kWide>(data, sorted_keys, sorted_pos, seg_begin, seg_end, out, dim,
                                               num_segments, stream);
  } else {
    launch_tree<scalar_t, key_t, pos_t, 1>(data, sorted_keys, sorted_pos, seg_begin, seg_end, out, dim,
                                           num_segments, stream);
  }
}

/// @brief TensorFlow unsorted_segment_sum of CUDA tensors.
/// @param data_in [N, ...] float32/float64/float16/bfloat16.
/// @param ids_in [N] int32/int64 segment ids; negative ids are dropped, ids >= num_segments raise.
/// @param num_segments number of output rows (>= 0).
/// @param deterministic sort-based and bit-identical run to run (else atomics).
/// @return [num_segments, ...] of data's dtype, zero for empty segments. Syncs the host
/// once (to check the ids) when N > 0.
Tensor segment_sum_cuda(const Tensor& data_in, const Tensor& ids_in, int64_t num_segments,
                            bool deterministic) {
  check_segment_sum_args(data_in, ids_in, num_segments);
  SK_CHECK(data_in.is_cuda(), "segment_sum: expected CUDA tensors, got ", data_in.device());
  const DeviceGuard guard(data_in.get_device_index());
  const cudaStream_t stream = current_stream(data_in);
  const Tensor data = as_contiguous(data_in);
  const Tensor ids = as_contiguous(ids_in);
  const int64_t n = data.size(0);
  int64_t dim = 1;
  for (int64_t d = 1; d < data.dim(); ++d) dim *= data.size(d);
  std::vector<int64_t> out_shape = data.sizes().vec();
  out_shape[0] = num_segments;
  Tensor out = allocate_or_fail("segment_sum", "num_segments=" + std::to_string(num_segments) + " (the output)",
                                [&] { return zeros_cuda(out_shape, data.scalar_type(), data.device()); });
  if (n == 0) return out;

  Tensor bad_id = empty({1}, kLong, ids.device());
  long long* bad_id_ptr = reinterpret_cast<long long*>(bad_id.mutable_data_ptr<int64_t>());
  SK_CUDA_CHECK(cudaMemsetAsync(bad_id_ptr, 0xFF, sizeof(long long), stream));  // -1: none yet

  SK_DISPATCH_INDEX_TYPES(ids.scalar_type(), "segment_sum_cuda_ids", [&] {
    using id_t = index_t;
    if (dim == 0 || num_segments == 0) {
      find_out_of_range_kernel<id_t><<<static_cast<unsigned int>(grid_for(n, kThreads)), kThreads, 0, stream>>>(
          ids.mutable_data_ptr<id_t>(), n, num_segments, bad_id_ptr);
      SK_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    SK_DISPATCH_FLOATING_TYPES(data.scalar_type(), "segment_sum_cuda", [&] {
      if (!deterministic) {
        segment_sum_atomic<scalar_t, id_t>(data, ids, out, dim, num_segments, bad_id_ptr, stream);
      } else if (n <= std::numeric_limits<int32_t>::max() &&
                 num_segments < static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
        segment_sum_sorted<scalar_t, id_t, uint32_t, int32_t>(data, ids, out, dim, num_segments, bad_id_ptr,
                                                              stream);
      } else {
        segment_sum_sorted<scalar_t, id_t, uint64_t, int64_t>(data, ids, out, dim, num_segments, bad_id_ptr,
                                                              stream);
      }
    });
  });

  // The one host sync of segment_sum: an id >= num_segments must raise on the host (no
  // device assert, so the CUDA context stays usable). The kernels skipped such ids.
  // torch's own device-to-host copy, so torch.cuda.set_sync_debug_mode sees it like
  // torch's own syncs.
  const int64_t bad = *cpu(bad_id).const_data_ptr<int64_t>();
  SK_CHECK(bad < 0, segment_id_range_message(static_cast<int64_t>(bad), num_segments));
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("segment_sum", TORCH_BOX(&segment_sum_cuda));
}

}  // namespace sparsekit

// key_seeded_uniform on the CPU: one row of uniform values per key, a pure function of
// (seed, key, column), so a key gets the same initial vector on every rank and device.
#include "cpu/parallel.h"

#include <algorithm>
#include <optional>

#include "initializer.h"

namespace sparsekit {

/// @brief Initial embedding rows seeded by key.
/// @param keys int64 or int32 [N].
/// @param dim columns per row.
/// @param seed any int64; different seeds give independent tables.
/// @param low, high bounds of the uniform distribution.
/// @param dtype floating dtype of the result (float32 when absent).
/// @return [N, dim] on the keys' device; row i depends only on (seed, keys[i]).
Tensor key_seeded_uniform_cpu(const Tensor& keys, int64_t dim, int64_t seed, double low, double high,
                                  std::optional<ScalarType> dtype) {
  const ScalarType out_dtype = dtype.value_or(kFloat);
  check_key_seeded_uniform_args(keys, dim, low, high, out_dtype);
  const Tensor keys_contig = as_contiguous(keys);
  const int64_t n = keys_contig.numel();
  Tensor out = allocate_host_or_fail(
      "key_seeded_uniform", "dim=" + std::to_string(dim) + " for " + std::to_string(n) + " keys (the output)",
      static_cast<double>(n) * static_cast<double>(dim) * static_cast<double>(element_size(out_dtype)),
      [&] { return empty({n, dim}, out_dtype, keys.device()); });
  if (n == 0 || dim == 0) return out;
  const UniformRange range = make_uniform_range(low, high);
  SK_DISPATCH_INDEX_TYPES(keys_contig.scalar_type(), "key_seeded_uniform_cpu", [&] {
    const index_t* key_data = keys_contig.const_data_ptr<index_t>();
    SK_DISPATCH_FLOATING_TYPES(out_dtype, "key_seeded_uniform_cpu", [&] {
      scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
      const int64_t keys_per_task = std::max<int64_t>(1, 4096 / dim);
      parallel_for(0, n, keys_per_task, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const uint64_t state = key_seeded_state(static_cast<int64_t>(key_data[i]), seed);
          for (int64_t column = 0; column < dim; ++column) {
            out_data[i * dim + column] = static_cast<scalar_t>(key_seeded_value(state, column, range));
          }
        }
      });
    });
  });
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("key_seeded_uniform", TORCH_BOX(&key_seeded_uniform_cpu));
}

}  // namespace sparsekit

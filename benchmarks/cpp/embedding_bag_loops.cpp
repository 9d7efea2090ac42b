// embedding_bag forward on one CPU thread, side by side in one process: torch's
// at::embedding_bag (FBGEMM's JIT kernel), sparsekit's op through the dispatcher, and plain
// prefetching loops with other prefetch distances, line counts and placements. It answers
// "is there a loop that beats FBGEMM here?" without Python, autograd or allocator noise.
//
// Build and run (from the repository root, after the extension is built in place):
//   TP=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   PYLIB=$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
//   PYVER=$(python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
//   g++ -O3 -std=c++17 benchmarks/cpp/embedding_bag_loops.cpp -Wl,--no-as-needed \
//     -I$TP/include -I$TP/include/torch/csrc/api/include -L$TP/lib -ltorch -ltorch_cpu -lc10 \
//     -L$PYLIB -lpython$PYVER -Wl,-rpath,$TP/lib -Wl,-rpath,$PYLIB -o /tmp/embedding_bag_loops
//   /tmp/embedding_bag_loops sparsekit/_C.abi3.so zipf 64
// Arguments: the extension, uniform|zipf rows (Zipf ranks hashed onto the rows, as
// benchmarks/common.py draws them), and D (16, 64 or 128).
#include <dlfcn.h>
#include <sys/resource.h>
#include <time.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

long minor_faults() {
  rusage usage;
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

typedef float float8 __attribute__((vector_size(32)));
inline float8 load8(const float* p) {
  float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

enum Placement { kBefore = 0, kInterleaved = 1, kAfter = 2 };

// Sum-pools [bags] bags of CSR rows with kVecs 8-float vectors per row held in registers;
// the row kDistance lookups ahead gets kLines prefetched lines, placed before, between or
// after the current row's adds; kFar > 0 adds a first-line prefetch kFar lookups ahead.
template <int kVecs, int kDistance, int kLines, int kPlacement, int kFar = 0>
__attribute__((target("avx2,fma"))) void pool(const float* weight, int64_t num_rows, int64_t dim, const int64_t* rows,
                                              const int64_t* offsets, int64_t bags, float* out) {
  const int64_t last = offsets[bags] - 1;
  for (int64_t bag = 0; bag < bags; ++bag) {
    float8 acc[kVecs];
    for (int i = 0; i < kVecs; ++i) acc[i] = float8{};
    for (int64_t k = offsets[bag]; k < offsets[bag + 1]; ++k) {
      int64_t ahead = rows[std::min(k + kDistance, last)];
      ahead = static_cast<uint64_t>(ahead) < static_cast<uint64_t>(num_rows) ? ahead : 0;
      const char* line = reinterpret_cast<const char*>(weight + ahead * dim);
      if (kPlacement == kBefore) for (int l = 0; l < kLines; ++l) __builtin_prefetch(line + 64 * l, 0, 3);
      if (kFar > 0) {
        int64_t far = rows[std::min(k + kFar, last)];
        far = static_cast<uint64_t>(far) < static_cast<uint64_t>(num_rows) ? far : 0;
        __builtin_prefetch(weight + far * dim, 0, 2);
      }
      const int64_t row = rows[k];
      if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(num_rows)) continue;
      const float* src = weight + row * dim;
      for (int i = 0; i < kVecs; ++i) {
        acc[i] += load8(src + 8 * i);
        if (kPlacement == kInterleaved && i % 2 == 0 && i / 2 < kLines) __builtin_prefetch(line + 32 * i, 0, 3);
      }
      if (kPlacement == kAfter) for (int l = 0; l < kLines; ++l) __builtin_prefetch(line + 64 * l, 0, 3);
    }
    for (int i = 0; i < kVecs; ++i) std::memcpy(out + bag * dim + 8 * i, &acc[i], sizeof(float8));
  }
}

using PoolFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const int64_t*, int64_t, float*);

template <int kVecs>
std::vector<std::pair<std::string, PoolFn>> loops() {
  constexpr int kAll = kVecs / 2 > 0 ? kVecs / 2 : 1;  // every line of the row
  return {
      {"loop d16 all-lines", pool<kVecs, 16, kAll, kBefore>},
      {"loop d24 all-lines", pool<kVecs, 24, kAll, kBefore>},
      {"loop d32 all-lines", pool<kVecs, 32, kAll, kBefore>},
      {"loop d16 one-line", pool<kVecs, 16, 1, kBefore>},
      {"loop d16 interleaved", pool<kVecs, 16, kAll, kInterleaved>},
      {"loop d24 interleaved", pool<kVecs, 24, kAll, kInterleaved>},
      {"loop d16 after-adds", pool<kVecs, 16, kAll, kAfter>},
      {"loop d16 + far64", pool<kVecs, 16, kAll, kBefore, 64>},
      {"loop no prefetch", pool<kVecs, 0, 0, kBefore>},
  };
}

std::vector<int64_t> make_rows(const std::string& distribution, int64_t n, int64_t num_rows) {
  std::mt19937_64 rng(0);
  std::vector<int64_t> rows(n);
  if (distribution == "uniform") {
    for (auto& r : rows) r = static_cast<int64_t>(rng() % static_cast<uint64_t>(num_rows));
    return rows;
  }
  // Zipf(1.2) ranks by inversion of a truncated power law, hashed onto the rows.
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (auto& r : rows) {
    const double rank = std::floor(std::pow(1.0 - uniform(rng), -1.0 / 0.2));
    const uint64_t mixed = static_cast<uint64_t>(std::min(rank, 1e18)) * 0x9E3779B97F4A7C15ull;
    r = static_cast<int64_t>(mixed % static_cast<uint64_t>(num_rows));
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s path/to/_C.abi3.so uniform|zipf 16|64|128\n", argv[0]);
    return 2;
  }
  if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  at::set_num_threads(1);
  const std::string distribution = argv[2];
  const int64_t dim = std::atoi(argv[3]);
  const int64_t num_rows = 1000000, bags = 16384, pooling = 20, nnz = bags * pooling;
  std::vector<int64_t> row_ids = make_rows(distribution, nnz, num_rows);
  const at::Tensor rows = torch::from_blob(row_ids.data(), {nnz}, torch::kLong).clone();
  const at::Tensor offsets = torch::arange(0, nnz + 1, pooling, torch::kLong);
  // One copy of the table per contestant, so no side reads rows another one cached.
  const at::Tensor table = torch::randn({num_rows, dim});
  const at::Tensor torch_table = table.clone(), op_table = table.clone();
  at::Tensor out = torch::empty({bags, dim});
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("sparsekit::embedding_bag", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&, c10::string_view, std::optional<int64_t>, bool)>();

  std::vector<std::pair<std::string, std::function<void()>>> sides = {
      {"at::embedding_bag", [&] { at::embedding_bag(torch_table, rows, offsets, false, 0, false, {}, true); }},
      {"sparsekit op", [&] { op.call(op_table, rows, offsets, std::nullopt, "sum", std::nullopt, true); }},
  };
  auto variants = dim == 16 ? loops<2>() : dim == 64 ? loops<8>() : loops<16>();
  for (const auto& [name, fn] : variants) {
    sides.push_back({name, [&, fn = fn] {
                       fn(table.data_ptr<float>(), num_rows, dim, rows.data_ptr<int64_t>(),
                          offsets.data_ptr<int64_t>(), bags, out.data_ptr<float>());
                     }});
  }
  // Every contestant pools the same sums.
  const at::Tensor expected = std::get<0>(at::embedding_bag(torch_table, rows, offsets, false, 0, false, {}, true));
  TORCH_CHECK(at::allclose(expected, op.call(op_table, rows, offsets, std::nullopt, "sum", std::nullopt, true),
                           1e-4, 1e-4), "sparsekit's op disagrees with at::embedding_bag");
  for (size_t s = 2; s < sides.size(); ++s) {
    out.zero_();
    sides[s].second();
    TORCH_CHECK(at::allclose(expected, out, 1e-4, 1e-4), sides[s].first, " disagrees with at::embedding_bag");
  }

  constexpr int kRounds = 9, kRepeat = 5;
  std::vector<std::vector<double>> seconds(sides.size());
  std::vector<long> faults(sides.size(), 0);
  for (int round = 0; round < kRounds; ++round) {
    for (size_t s = 0; s < sides.size(); ++s) {
      double best = 1e9;
      for (int r = 0; r < kRepeat; ++r) {
        const long faults_before = minor_faults();
        const double start = thread_seconds();
        sides[s].second();
        best = std::min(best, thread_seconds() - start);
        faults[s] += minor_faults() - faults_before;
      }
      seconds[s].push_back(best);
    }
  }
  std::printf("D=%lld %s, one thread, best of %d per round, %d interleaved rounds\n", static_cast<long long>(dim),
              distribution.c_str(), kRepeat, kRounds);
  for (size_t s = 0; s < sides.size(); ++s) {
    std::vector<double> ratios, times = seconds[s];
    for (int round = 0; round < kRounds; ++round) ratios.push_back(seconds[0][round] / seconds[s][round]);
    std::sort(ratios.begin(), ratios.end());
    std::sort(times.begin(), times.end());
    std::printf("%-22s median %6.2f ms   vs at::embedding_bag x%.2f (%.2f-%.2f)   page faults per call %ld\n",
                sides[s].first.c_str(), times[kRounds / 2] * 1e3, ratios[kRounds / 2], ratios[0],
                ratios[kRounds - 1], faults[s] / (kRounds * kRepeat));
  }
  return 0;
}

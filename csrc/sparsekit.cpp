// The one operator library of sparsekit: every schema lives here, so every build
// (CPU-only too) knows every op. Device kernels are registered by csrc/cpu/*.cpp and
// csrc/cuda/*.cu with STABLE_TORCH_LIBRARY_IMPL; fakes and autograd live in
// sparsekit/ops.py. Like every kernel file it uses torch's stable ABI only (see
// csrc/torch_api.h), so one binary loads under every torch from its target version on.
#include <Python.h>

#include "cpu/cpu_features.h"
#include "torch_api.h"

namespace {
// sparsekit._C.cpu_features(): the instructions the CPU kernels use in this process
// ("avx512 popcnt f16c"; "default" under SPARSEKIT_CPU_CAPABILITY=default), for the tests
// that run the fallbacks and for bug reports.
PyObject* cpu_features(PyObject*, PyObject*) {
  return PyUnicode_FromString(sparsekit::describe_cpu_features().c_str());
}

PyMethodDef module_methods[] = {
    {"cpu_features", cpu_features, METH_NOARGS, "The instructions the CPU kernels use in this process."},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace

extern "C" {
// Importing sparsekit._C runs the static registrations below; the module has one function.
// The only exported symbol: the library is compiled with -fvisibility=hidden.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_methods};
  return PyModule_Create(&module_def);
}
}

STABLE_TORCH_LIBRARY(sparsekit, m) {
  // The "Internal, C++ on CPU" ops have a C++ kernel for the CPU only; their CUDA kernels are
  // Python composites of the per-table ops (sparsekit/tables_cuda.py).
  // Hash-based unique in order of first occurrence: keys == unique_keys[inverse].
  m.def("unique(Tensor keys) -> (Tensor unique_keys, Tensor inverse, Tensor counts)");
  // Internal, C++ on CPU: unique per table. Segment s (keys[offsets[s]:offsets[s+1]]) belongs
  // to table tables[s]; the distinct keys come table after table, each table's in order of
  // first occurrence over its segments, with keys == unique_keys[inverse] and per_table
  // the distinct count of each table. Dedups an EmbeddingBagCollection's (table, key) pairs.
  m.def("unique_tables(Tensor keys, int[] offsets, int[] tables, int num_tables) -> (Tensor unique_keys, Tensor inverse, Tensor per_table)");
  // Internal, C++ on CPU: sorted unique of keys in [-1, bound) (a bitmap of the range), with
  // keys == unique_keys[inverse]. With group: the positions grouped by key, ascending within
  // a group (order [nnz]), and the groups' CSR bounds in it (offsets [U + 1]); else both
  // empty. Numbers embedding rows for their sparse gradient.
  m.def("unique_bounded(Tensor keys, SymInt bound, bool group=False) -> (Tensor unique_keys, Tensor inverse, Tensor offsets, Tensor order)");
  // TensorFlow unsorted_segment_sum: negative ids are dropped, ids >= num_segments raise.
  // SymInt keeps torch.compile's symbolic sizes flowing; the stable kernels receive it as
  // an int64 (a concrete value by the time a kernel runs).
  m.def("segment_sum(Tensor data, Tensor segment_ids, SymInt num_segments, bool deterministic=False) -> Tensor");
  // Internal, C++ on CPU: segment_sum of the rows of several tensors one after the other
  // (segment_ids spans them all), without concatenating them.
  m.def("segment_sum_parts(Tensor[] data, Tensor segment_ids, int num_segments) -> Tensor");
  // Open-addressing table over plain tensors: slot_rows[s] == -1 marks an empty slot, so
  // every int64 value is a valid key.
  m.def("hash_table_find(Tensor slot_keys, Tensor slot_rows, Tensor keys) -> Tensor");
  // Places keys that are distinct and absent from the table; rows[i] is stored for keys[i].
  m.def("hash_table_insert_absent_(Tensor(a!) slot_keys, Tensor(b!) slot_rows, Tensor keys, Tensor rows, int? num_occupied=None) -> ()");
  // Internal, C++ on CPU: hash_table_find over several tables in one call, keys[offsets[t]
  // : offsets[t + 1]] looked up in table t (an EmbeddingBagCollection's owner step).
  m.def("hash_table_find_tables(Tensor[] slot_keys, Tensor[] slot_rows, Tensor keys, int[] offsets) -> Tensor");
  // Internal, C++ on CPU: scores the rows of several tables, rows[offsets[t] : offsets[t + 1]]
  // of table t: last_seen[t][row] = clocks[t], count[t][row] += 1 per occurrence; -1 skipped.
  m.def("hash_table_score_tables_(Tensor(a!)[] last_seen, Tensor(b!)[] count, Tensor rows, int[] offsets, "
        "int[] clocks) -> ()");
  // Internal, C++ on CPU: places the new keys of several growing tables, keys[offsets[t] :
  // offsets[t + 1]] (distinct, absent) of table t at rows sizes[t], sizes[t] + 1, ...: their
  // slots, row_keys[t][row] = key, count[t][row] = 0.
  m.def("hash_table_place_tables_(Tensor(a!)[] slot_keys, Tensor(b!)[] slot_rows, Tensor(c!)[] row_keys, "
        "Tensor(d!)[] count, Tensor keys, int[] offsets, int[] sizes) -> ()");
  // The row of every value of a collection's batch, segment by segment (a feature's
  // values keys[bounds[s] : bounds[s + 1]], bounds int64 [S + 1] on the keys' device): found
  // in hash table segment_tables[s] (-1: absent), the key itself for a direct table
  // (segment_tables[s] == -1, direct_rows[s] rows; -2 for a key outside them), or -3, left to
  // the caller (segment_tables[s] == -2); and report int64 [3]: the first position of a key
  // outside its direct table (nnz: none), the number of keys absent from their hash table,
  // and 1 when the bounds do not run from 0 to nnz without decreasing (every row then -1).
  // With write_rows=False every segment must be direct: only the report, rows empty [0] (the
  // caller reads the keys as rows, the report telling which are outside their tables).
  // Nothing is read back to the host.
  // Folds a collection step's verdict (flags, lookup_rows' report, the error word, the first
  // bad key's table and value found through bounds and feature_tables, nnz) into record
  // (int64 [9]) unless it already holds an error, empties the error word, and writes to
  // clean (bool [1]) whether record is clean. Nothing is read back.
  m.def("record_verdict_(Tensor(a!) record, Tensor(b!) errors, Tensor(c!) clean, Tensor flags, Tensor report, "
        "Tensor bounds, Tensor keys, Tensor feature_tables) -> ()");
  m.def("lookup_rows(Tensor[] slot_keys, Tensor[] slot_rows, Tensor keys, Tensor bounds, int[] segment_tables, "
        "int[] direct_rows, bool write_rows=True) -> (Tensor rows, Tensor report)");
  // Scores each distinct row a batch read once per table (last_seen = clock, count += 1),
  // rows[bounds[s] : bounds[s + 1]] of table segment_tables[s] (-1: not scored); rows of
  // -1 skipped; every row checked against sizes[t] first. errors (int64 [2], as the pooled
  // family's), when given, records bad bounds (slot 0) and the first bad row (slot 1) instead
  // of raising, and nothing is scored while it holds an error.
  m.def("hash_table_touch_tables_(Tensor(a!)[] last_seen, Tensor(b!)[] count, Tensor rows, Tensor bounds, "
        "int[] segment_tables, int[] sizes, int[] clocks, Tensor(e!)? errors=None) -> ()");
  // Erases keys: their slots become tombstones (-2). Returns the rows they held (-1: absent).
  m.def("hash_table_erase_(Tensor slot_keys, Tensor(a!) slot_rows, Tensor keys) -> Tensor");
  // Ascending indices of the k lexicographically smallest eligible entries of the int64
  // columns (column 0 first; whole-tuple ties by the smaller index): eviction's victims.
  m.def("select_smallest(Tensor[] columns, Tensor eligible, int k) -> Tensor");
  m.def("embedding_bag(Tensor weight, Tensor rows, Tensor offsets, Tensor? per_sample_weights=None, str mode=\"sum\", "
        "int? padding_idx=None, bool include_last_offset=True) -> Tensor");
  // [bags, D] int64: per column, the lookup (index into rows) holding the bag's maximum as
  // embedding_bag(mode="max") picks it, -1 for a bag without a valid lookup. Max mode's
  // backward recomputes it rather than keeping [bags, D] int64 alive from the forward.
  m.def("embedding_bag_argmax(Tensor weight, Tensor rows, Tensor offsets, int? padding_idx=None, "
        "bool include_last_offset=True) -> Tensor");
  m.def("embedding_gather(Tensor weight, Tensor rows) -> Tensor");
  m.def("lazy_adam_(Tensor(a!) weight, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor rows, Tensor grad, int step, float lr, float beta1, float beta2, float eps, float weight_decay=0.0) -> ()");
  // Internal, C++ on CPU: lazy_adam_ over several tables at once (float32 moments and
  // gradients; float32 weights, or float16 / bfloat16 ones updated in float32 and rounded;
  // hyper: lr, beta1, beta2, eps, weight_decay per table); every row is checked first.
  m.def("lazy_adam_tables_(Tensor(a!)[] weights, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor[] rows, Tensor[] grads, int[] steps, float[] hyper) -> ()");
  // The pooled read of a collection's features (layout: csrc/pooled.h): feature f's B bags
  // of table feature_tables[f] pooled into columns [feature_columns[f], + D) of the
  // [B, total_dim] output. errors (int64 [2]: first bad bag, first bad lookup), when given,
  // records bad input instead of raising.
  m.def("pooled_read(Tensor[] weights, Tensor rows, Tensor offsets, Tensor? per_sample_weights, int[] feature_tables, "
        "int[] feature_columns, int[] feature_means, SymInt total_dim, Tensor(e!)? errors=None) -> Tensor");
  // Its gradient, grouped by row, from each feature's output gradient (grads[f]: [B, D], a
  // column view of the output's will do; or, with grad_columns, grads = [the [B, W] output
  // gradient] and feature f's its columns from grad_columns[f]): the distinct rows read (table after table,
  // ascending in each), how many of them each table has, and each one's gradient summed in
  // lookup order (float32; float64 for float64 weights), table t's D_t wide, one table after
  // another.
  m.def("pooled_read_backward(Tensor[] grads, Tensor[] weights, Tensor rows, Tensor offsets, "
        "Tensor? per_sample_weights, int[] feature_tables, int[] feature_means, Tensor(e!)? errors=None, "
        "int[] grad_columns=[]) -> (Tensor rows, Tensor per_table, Tensor grad_rows)");
  // That gradient applied in place, each distinct row updated once by "sgd", "lazy_adam"
  // (state1, state2: the moments, like the weights) or "rowwise_adagrad" (state1: one float
  // per row); hyper = (lr, beta1, beta2, eps, weight_decay), lr replaced by the tensor lr
  // when given; steps (LazyAdam: an int64 scalar per table) counts each table's updates. Every
  // lookup is checked before anything is written.
  m.def("pooled_read_update_(Tensor(a!)[] weights, Tensor(b!)[] state1, Tensor(c!)[] state2, Tensor(d!)[] steps, "
        "Tensor[] grads, Tensor rows, Tensor offsets, Tensor? per_sample_weights, int[] feature_tables, "
        "int[] feature_means, str optimizer, float[] hyper, Tensor? lr=None, "
        "Tensor(e!)? errors=None, int[] grad_columns=[]) -> ()");
  // Stable counting sort of keys by owner rank uint64(key) % world_size:
  // keys_by_owner[positions[i]] == keys[i], counts[r] keys go to rank r.
  m.def("partition_by_owner(Tensor keys, int world_size) -> (Tensor keys_by_owner, Tensor positions, Tensor counts)");
  // Initial embedding rows [N, dim], uniform in [low, high], a pure function of (seed, key,
  // column): a key's first vector is the same on every rank, world size and device.
  m.def("key_seeded_uniform(Tensor keys, int dim, int seed, float low, float high, ScalarType? dtype=None) -> Tensor");
  // Internal, CPU only (the training harness's DLRM interaction; elsewhere it runs torch's
  // batched products): the dot products of each sample's vector pairs i < j, [batch, n, dim]
  // float32 / float64 -> [batch, n * (n - 1) / 2] in triu_indices order, and their gradient
  // with respect to the vectors.
  m.def("_pair_dots(Tensor vectors) -> Tensor");
  m.def("_pair_dots_backward(Tensor grad, Tensor vectors) -> Tensor");
}

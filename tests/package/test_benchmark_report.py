"""benchmarks/report.py: the generated docs/benchmarks.md and docs/design.md table match the JSON in
benchmarks/results/, two runs write the same bytes, each results schema gives its row, and a
broken file is named. Pure Python over small JSON files: no torch, no GPU, no timing."""

import json
import os
import sys

import pytest

# The repository root, wherever under tests/ this file sits.
ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.isdir(os.path.join(ROOT, "benchmarks")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from benchmarks import report
from benchmarks.report import (
    ReportError,
    load_runs,
    main,
    render_page,
    render_readme_block,
    summary_lines,
    update_readme,
)

CPU = {"device": "Test CPU (2 threads)", "device_type": "cpu", "torch": "9.9.0",
       "commit": "abcdef0123456789abcdef0123456789abcdef01", "uncommitted_changes": [],
       "rounds": 3, "repeat": 2, "busy_core": False}
GPU = {**CPU, "device": "Test GPU", "device_type": "cuda", "uncommitted_changes": ["a.cu", "b.cu"]}


def stats(median, low, high):
    return {"min": low, "median": median, "max": high, "rounds": [low, median, high]}


# (file, record, lines the page must hold): one record of each schema the benchmarks write.
CASES = [
    ("ops_cpu.json",
     {"benchmark": "ops", **CPU, "results": [
         {"op": "unique", "distribution": "zipf", "keys": 4_000_000, "zipf_alpha": 1.2,
          "unique_keys": 421_424, "ratio": stats(3.1, 3.0, 3.2)},
         {"op": "segment_sum", "rows": 4_000_000, "dim": 64, "segments": 100_000, "deterministic": True,
          "ratio": stats(0.9, 0.85, 0.95)}]},
     [("| `unique`, 4M int64 keys, Zipf(1.2), 421,424 distinct | `torch.unique` (faster of sorted / "
      "unsorted, inverse + counts) | x3.10 | 3.00-3.20 (3 rounds) | Test CPU (2 threads) | 9.9.0 | `abcdef0` |"),
      ("| `segment_sum`, 4M x 64 rows into 100k segments, deterministic | `index_add_` | x0.90 | "
      "0.85-0.95 (3 rounds) |"),
      "`python benchmarks/bench_ops.py --device cpu --distributions zipf --rounds 3 --repeat 2`"]),
    ("embedding_busy_cpu.json",
     {"benchmark": "embedding_busy", **CPU, "busy_core": True, "threads": [1], "modes": ["sum"], "results": [
         {"phase": "forward", "distribution": "uniform", "rows": 1_000_000, "dim": 64, "bags": 16384,
          "pooling": 20, "threads": 1, "ratios": {"nn.EmbeddingBag": stats(1.43, 1.37, 1.47)}}]},
     [("| busy core: `embedding_bag` forward, 1M x 64 table, 16,384 bags of 20, uniform rows, 1 thread | "
      "`nn.EmbeddingBag` | x1.43 | 1.37-1.47 (3 rounds) |"),
      ("`python benchmarks/bench_embedding.py --device cpu --dims 64 --modes sum --skew-lookups 0 "
      "--threads 1 --rounds 3 --repeat 2 --busy-core`")]),
    ("bags_cpu.json",
     {"benchmark": "bags", **CPU, "threads": 2, "results": [
         {"dim": 16, "rows": 100_000, "keys": "zipf", "batch": 1024, "ids_per_bag": [10, 30],
          "forward_vs_torchrec": stats(1.2, 1.1, 1.3)}]},
     [("| tables of 100k x 16, batch 1,024, bags of 10-30 zipf ids: forward, direct tables | TorchRec "
      "`EmbeddingBagCollection` | x1.20 | 1.10-1.30 (3 rounds) |"),
      "--cells 16x100k --keys zipf --no-train --threads 2"]),  # a record with no training cells
    ("bags_one_id_cpu.json",
     {"benchmark": "bags", **CPU, "threads": 2, "results": [
         {"dim": 16, "rows": 100_000, "keys": "zipf", "batch": 1024, "ids_per_bag": [1, 1],
          "forward_vs_torchrec": stats(1.4, 1.3, 1.5), "train_s": {}}]},
     [("| tables of 100k x 16, batch 1,024, bags of 1 zipf id: forward, direct tables | TorchRec "
      "`EmbeddingBagCollection` | x1.40 | 1.30-1.50 (3 rounds) |"),
      "--cells 16x100k --keys zipf --min-ids 1 --max-ids 1 --threads 2"]),
    ("collection_cpu.json",
     {"benchmark": "collection", **CPU, "threads_per_process": 2, "results": [
         {"world_size": 1, "config": "dim16", "dims": [16] * 26, "batch": 4096, "pooling": 1,
          "speedup_vs_torch": stats(4.14, 3.38, 4.58)}]},
     [("| dim16 (26 tables, D 16), batch 4,096, 1 key a bag, world 1 | one `nn.EmbeddingBag` per table + "
      "`SparseAdam` | x4.14 | 3.38-4.58 (3 rounds) |")]),
    ("compile_cpu.json",
     {"benchmark": "compile", **CPU, "results": [
         {"tables": "shared", "batch": 1024, "steps_per_call": 16, "backend": "inductor",
          "compiled_speedup": stats(0.93, 0.89, 1.09)}]},
     [("| harness step compiled (inductor), shared tables, batch 1,024, 16 steps a call | the same step "
      "eager | x0.93 | 0.89-1.09 (3 rounds) |")]),
    ("criteo_reader_cpu.json",  # an early record: no torch version, no commit, one figure
     {"benchmark": "criteo_reader", "device": "Test CPU (2 threads)", "device_type": "cpu", "results": [
         {"lines": 196_608, "batch_size": 4096, "lines_per_s": 136862.7, "fraction_of_split_only": 0.1343}]},
     [("| Criteo TSV reader, 196,608 lines, batch 4,096: 136,863 lines/s | reading and splitting the lines "
      "only | x0.13 | - | Test CPU (2 threads) | - | - |")]),
    ("dynamic_cpu.json",
     {"benchmark": "dynamic", **CPU, "results": [
         {"load": 1.0, "policy": "lru", "capacity": 1 << 20, "new_keys_per_call": 65536,
          "ratio_evict_vs_plain": stats(2.22, 2.15, 2.45)}]},
     [("| `HashTable.insert` of 2^16 new keys into a table with room, capacity 2^20, load 1.0 | the same "
      "insert into a full LRU table (evicting) | x2.22 | 2.15-2.45 (3 rounds) |"),
      "`python benchmarks/bench_dynamic.py --device cpu --loads 1.0 --repeat 3`"]),
    ("hashtable_cuda.json",
     {"benchmark": "hashtable", **GPU, "results": [
         {"distribution": "uniform", "load_factor": 0.5, "capacity": 1 << 20, "queries": 1 << 20,
          "resident_keys": 1 << 19, "ratio": stats(23.0, 22.5, 23.3)}]},
     [("| `HashTable.find` of 2^20 keys, capacity 2^20, load 0.5, uniform keys | `torch.searchsorted` on a "
      "sorted key array | x23.00 | 22.50-23.30 (3 rounds) | Test GPU | 9.9.0 | `abcdef0` +2 files |")]),
    ("huge_pages_cpu.json",
     {"benchmark": "huge_pages", **CPU, "thp": "madvise", "results": [
         {"what": "embedding_bag", "dim": 16, "speedup": stats(1.39, 1.17, 1.5)}]},
     [("| `embedding_bag`, D=16, table in huge pages (THP madvise) | the same table in 4 KiB pages | x1.39 | "
      "1.17-1.50 (3 rounds) |")]),
    ("layers_cpu.json",
     {"benchmark": "layers", **CPU, "results": [
         {"world_size": 1, "batch": 2048, "slots": 26, "max_nnz": 2, "dim": 16,
          "ratio": stats(2.07, 1.59, 2.25)},
         {"world_size": 2, "batch": 2048, "slots": 26, "max_nnz": 2, "dim": 16, "backend": "gloo",
          "step_time_vs_world_1": 1.25}]},
     [("| `DistributedEmbedding` + `LazyAdam` step, batch 2,048, 26 slots of up to 2 keys, D=16 | "
      "`nn.EmbeddingBag(sparse=True)` + `SparseAdam` | x2.07 | 1.59-2.25 (3 rounds) |"),
      "D=16, world 2 (gloo) | the same layers at world 1 | x0.80 | - |"]),
    ("lazy_adam_cpu.json",
     {"benchmark": "lazy_adam", **CPU, "results": [
         {"case": "coalesced", "rows": 1_000_000, "dim": 64, "unique_rows": 100_000,
          "gradient_entries": 100_000, "ratio": stats(8.26, 7.85, 8.44)}]},
     [("| `LazyAdam.step`, 1M x 64 table, 100k rows touched, 100k gradient entries (coalesced) | "
      "`torch.optim.SparseAdam` | x8.26 | 7.85-8.44 (3 rounds) |")]),
    ("train_cuda.json",
     {"benchmark": "train", **GPU, "results": [
         {"batch_size": 1024, "embedding_dim": 16, "table_rows": 1 << 20, "steps_per_round": 20, "rounds": 3,
          "ratio": stats(0.66, 0.58, 0.66), "harness_ratio": stats(0.71, 0.68, 0.71)}]},
     [("| DLRM training step, batch 1,024, D=16, 2^20-row table, 20 steps a round, each batch made before "
      "its step (harness samples/s) | `--embedding torch` | x0.71 | 0.68-0.71 (3 rounds) | Test GPU |"),
      "`python benchmarks/bench_train.py --device cuda --rounds 3`"]),
    ("torchrec_cpu.json",
     {"benchmark": "torchrec", **CPU, "results": [
         {"dim": 16, "rows": 100_000, "keys": "uniform", "batch": 1024, "ids_per_bag": [10, 30],
          "forward_vs_tbe": stats(1.86, 1.85, 1.87)}]},
     [("| tables of 100k x 16, batch 1,024, bags of 10-30 uniform ids: forward | FBGEMM TBE (TorchRec's "
      "kernel) | x1.86 | 1.85-1.87 (3 rounds) |")]),
    ("newbench_cpu.json",  # a schema the report does not know: every ratio it finds
     {"benchmark": "newbench", **CPU, "results": [{"size": 8, "speedup_vs_x": stats(1.5, 1.4, 1.6)}]},
     ["## newbench", "| size=8 | speedup_vs_x | x1.50 | 1.40-1.60 (3 rounds) |"]),
    ("gpu_check_cuda.json",
     {"what": "a check run", "runs": [
         {"env": ["commit: 0123456789abcdef", "torch 2.11.0+cu130 cuda 13.0 gpu Test GPU"],
          "stages": [{"stage": "build", "status": "pass"}, {"stage": "tests", "status": "fail"}]}]},
     ["| `gpu_check_cuda.json` | 1 | build pass, tests fail | Test GPU | 2.11.0+cu130 | `0123456` |"]),
]


def write(directory, name, content):
    path = os.path.join(directory, name)
    with open(path, "w") as out:
        out.write(content if isinstance(content, str) else json.dumps(content, indent=2))
    return path


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    for name, record, _ in CASES:
        write(directory, name, record)
    return str(directory)


def test_committed_page_is_generated():
    with open(report.PAGE_PATH) as page:
        assert page.read() == render_page(), "run `python -m benchmarks.report`"


def test_committed_readme_block_is_generated():
    with open(report.README_PATH) as readme:
        text = readme.read()
    updated = update_readme(text, render_readme_block())
    if updated is None:
        pytest.skip("README.md has no benchmark markers")
    assert updated == text, "run `python -m benchmarks.report`"


def test_committed_summary_fits_the_readme():
    runs, _ = load_runs(report.RESULTS_DIR)
    lines = summary_lines(runs)
    assert 0 < len(lines) <= report.MAX_SUMMARY_LINES
    assert len({line[:3] for line in lines}) == len(lines)  # one line per benchmark and device


def test_generating_twice_gives_the_same_bytes(results, tmp_path):
    assert render_page(results) == render_page(results)
    assert render_readme_block(results) == render_readme_block(results)
    page, readme = tmp_path / "page.md", tmp_path / "README.md"
    readme.write_text("intro\n<!-- benchmarks:begin (x) -->\nold\n<!-- benchmarks:end -->\nrest\n")
    args = ["--results-dir", results, "--page", str(page), "--readme", str(readme)]
    assert main(args) == 0
    first = page.read_bytes(), readme.read_bytes()
    assert main(args) == 0
    assert (page.read_bytes(), readme.read_bytes()) == first


@pytest.mark.parametrize("name,record,expected", CASES, ids=[case[0] for case in CASES])
def test_each_schema_gives_its_row(tmp_path, name, record, expected):
    write(str(tmp_path), name, record)
    page = render_page(str(tmp_path))
    for line in expected:
        assert line in page


def test_page_states_how_ratios_are_measured(results):
    page = render_page(results)
    assert page.startswith("# Benchmarks\n")
    assert "do not edit" in page and "interleaved rounds" in page and "one process" in page
    # Families in the page's fixed order, CPU files before CUDA files within one.
    assert page.index("## `unique` and `segment_sum`") < page.index("## `embedding_bag`")


def test_readme_block_summarises_per_device(results):
    block = render_readme_block(results)
    assert ("| `unique`, Zipf keys | `torch.unique` | Test CPU (2 threads) | "
            "x3.10 (3.00-3.20, 3 rounds) |") in block
    assert ("| training harness, samples/s | `--embedding torch` | Test GPU | "
            "x0.71 (0.68-0.71, 3 rounds) |") in block
    assert "busy" not in block  # busy-core runs stay on the page


def test_readme_markers_keep_the_rest():
    text = "a\n<!-- benchmarks:begin (python -m benchmarks.report writes this table) -->\nold\n" \
           "<!-- benchmarks:end -->\nb\n"
    updated = update_readme(text, "new\n")
    assert updated == ("a\n<!-- benchmarks:begin (python -m benchmarks.report writes this table) -->\nnew\n"
                       "<!-- benchmarks:end -->\nb\n")
    assert update_readme(updated, "new\n") == updated
    assert update_readme("no markers\n", "new\n") is None


def test_check_reports_a_stale_file_and_writes_nothing(results, tmp_path, capsys):
    page, readme = tmp_path / "page.md", tmp_path / "README.md"
    readme.write_text("no markers\n")
    args = ["--results-dir", results, "--page", str(page), "--readme", str(readme)]
    assert main(["--check", *args]) == 1
    assert not page.exists()
    output = capsys.readouterr().out
    assert "page.md differs" in output and "python -m benchmarks.report" in output
    assert main(args) == 0
    assert main(["--check", *args]) == 0
    page.write_text(page.read_text() + "hand edit\n")
    assert main(["--check", *args]) == 1


@pytest.mark.parametrize("content,message", [
    ("{not json", "not readable JSON"),
    ([1, 2], "expected a JSON object"),
    ({"benchmark": "ops", "results": 3}, "'results' must be a list"),
    ({"what": "neither"}, "neither a benchmark record"),
    ({"benchmark": "ops", "results": [{"op": "unique", "ratio": "fast"}]}, r"results\[0\]"),
])
def test_a_broken_file_is_named(tmp_path, content, message):
    write(str(tmp_path), "ops_cpu.json", CASES[0][1])
    write(str(tmp_path), "broken_cpu.json", content)
    with pytest.raises(ReportError, match=message) as error:
        render_page(str(tmp_path))
    assert "broken_cpu.json" in str(error.value)

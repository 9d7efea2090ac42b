"""The benchmarks' own machinery (benchmarks/common.py and the checks the bench_*.py scripts
make before timing): tiny sizes, CPU only."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# Importing benchmarks.common would keep this whole pytest process's freed memory
# (sk.keep_freed_memory, a mallopt): the rest of the suite runs with glibc's defaults.
os.environ.setdefault("SPARSEKIT_BENCH_SYSTEM_MALLOC", "1")

import sparsekit
from benchmarks import (
    bench_collection,
    bench_compile,
    bench_embedding,
    bench_hashtable,
    bench_huge_pages,
    bench_lazy_adam,
    bench_ops,
    common,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _keep_threads_and_malloc(monkeypatch):
    """The benchmarks set the thread count and keep freed memory: not for the rest of the suite."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(sparsekit, "keep_freed_memory", lambda *args, **kwargs: None)
    yield
    torch.set_num_threads(threads)


def _children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _spawned(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"spawn_main" in cmdline.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_core_spinner_dies_with_a_killed_benchmark():
    child = (f"import sys, time\nsys.path.insert(0, {ROOT!r})\nfrom benchmarks.common import busy_core\n"
             "with busy_core(True):\n    print('busy', flush=True)\n    time.sleep(120)\n")
    bench = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "busy"
        spinners = [pid for pid in _children(bench.pid) if _spawned(pid)]
        assert spinners
    finally:
        bench.send_signal(signal.SIGTERM)  # no finally runs in the benchmark
        bench.wait()
    deadline = time.time() + 30
    while any(_spawned(pid) for pid in spinners) and time.time() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in spinners if _spawned(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the busy-core spinner outlived its benchmark"


def test_json_names_the_cpu_and_records_uncommitted_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    with open(common.write_results("probe", CPU, [])) as f:
        record = json.load(f)
    assert record["device"].startswith(common.cpu_model())
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        if "model name" in cpuinfo.read():
            assert common.cpu_model() not in ("x86_64", "aarch64", "")
    assert "uncommitted_changes" in record
    monkeypatch.setattr(common, "_git", lambda *args: " M csrc/cpu/embedding_cpu.cpp\nM  sparsekit/ops.py\n")
    assert common.uncommitted_changes() == ["csrc/cpu/embedding_cpu.cpp", "sparsekit/ops.py"]


@pytest.mark.parametrize("module, argv", [
    (bench_collection, ["--world-sizes", "1", "--configs", "dim16"]),
    (bench_compile, []),
    (bench_huge_pages, ["--dims", "", "--layer-dims", ""]),
])
def test_busy_core_runs_do_not_overwrite_the_idle_json(module, argv, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(module, "busy_core", lambda enabled: contextlib.nullcontext())
    if module is bench_collection:
        monkeypatch.setattr(module, "bench_world_one", lambda args, device, config: {"world_size": 1})
        monkeypatch.setattr(module, "print_table", lambda rows, device: None)
    if module is bench_compile:
        monkeypatch.setattr(module, "bench", lambda args, device, tables: {"tables": tables})
    monkeypatch.setattr(sys, "argv", ["bench", "--busy-core", *argv])
    module.main()
    assert all("_busy_" in name for name in os.listdir(tmp_path)), os.listdir(tmp_path)


def test_hashtable_bench_skips_insert_existing_that_does_not_fit():
    torch.set_num_threads(1)
    row = bench_hashtable.bench_cell("zipf", 0.25, 1024, 16384, CPU, 1, 1)
    assert row["insert_existing_keys_per_s"] is None
    assert row["find_keys_per_s"] > 0


def test_benchmarks_refuse_to_time_a_wrong_answer(monkeypatch):
    real_unique = sparsekit.ops.unique

    def wrong_inverse(keys, return_inverse=True, return_counts=False):
        unique_keys, inverse, *rest = real_unique(keys, return_inverse=True, return_counts=return_counts)
        return (unique_keys, torch.zeros_like(inverse), *rest)

    with monkeypatch.context() as patch:
        patch.setattr(sparsekit.ops, "unique", wrong_inverse)
        with pytest.raises(RuntimeError, match="not timing a wrong answer"):
            bench_ops.bench_unique(CPU, "zipf", 2000, 1.2, 1, 1)
    with monkeypatch.context() as patch:
        patch.setattr(sparsekit.ops, "segment_sum", lambda data, ids, n, deterministic=False:
                      torch.zeros(n, *data.shape[1:], dtype=data.dtype))
        with pytest.raises(RuntimeError, match="not timing a wrong answer"):
            bench_ops.bench_segment_sum(CPU, 2000, 4, 50, None, 1, 1)

    class NoOpLazyAdam(sparsekit.LazyAdam):
        def step(self, closure=None):
            return None

    with monkeypatch.context() as patch:
        patch.setattr(sparsekit, "LazyAdam", NoOpLazyAdam)
        with pytest.raises(RuntimeError, match="not timing a wrong answer"):
            bench_lazy_adam.bench_case("coalesced", 1000, 4, 100, 1, CPU, None, 1, 1)
    # The unbroken library passes the same checks.
    bench_ops.bench_unique(CPU, "zipf", 2000, 1.2, 1, 1)
    bench_ops.bench_segment_sum(CPU, 2000, 4, 50, None, 1, 1)
    bench_lazy_adam.bench_case("duplicates", 1000, 4, 100, 3, CPU, None, 1, 1)


def test_embedding_bench_refuses_a_gradient_off_by_a_thousandth(monkeypatch):
    """The gradient check allows for the rounding of long sums (a Zipf row's), not more."""
    args = bench_embedding.parse_args(["--device", "cpu", "--rows", "20000", "--bags", "512", "--dims", "16",
                                       "--threads", "1", "--rounds", "1", "--repeat", "1", "--skew-lookups", "0"])
    real = sparsekit.ops.embedding_bag

    def scaled_gradient(weight, rows, offsets, *rest, **kwargs):
        out = real(weight, rows, offsets, *rest, **kwargs)
        return out.detach() + 1.001 * (out - out.detach())  # the same output, its gradient x1.001

    with monkeypatch.context() as patch:
        patch.setattr(bench_embedding.ops, "embedding_bag", scaled_gradient)
        with pytest.raises(RuntimeError, match="gradient differs .* not timing a wrong answer"):
            bench_embedding.bench_dim(args, 16, None, torch.device("cpu"), None)
    assert len(bench_embedding.bench_dim(args, 16, None, torch.device("cpu"), None)) > 0


def test_collection_bench_checks_the_three_sides_pool_alike(monkeypatch):
    torch.set_num_threads(1)
    caps, dims = bench_collection.capacities(True, "mixed"), bench_collection.dims_of("mixed")
    batches = bench_collection.make_batches(caps, 32, 1, 1)
    distinct = bench_collection.distinct_per_table(batches)
    steps = bench_collection.Steps(caps, distinct, dims, 32, 1, CPU, 1)
    bench_collection.check_same_pooling(steps, batches[0])
    real_forward = sparsekit.EmbeddingBagCollection.forward
    monkeypatch.setattr(sparsekit.EmbeddingBagCollection, "forward",
                        lambda self, kjt: {k: 2 * v for k, v in real_forward(self, kjt).items()})
    steps = bench_collection.Steps(caps, distinct, dims, 32, 1, CPU, 1)
    with pytest.raises(RuntimeError, match="not timing a wrong answer"):
        bench_collection.check_same_pooling(steps, batches[0])


def _sharded_check_rank(rank: int, world_size: int, init, broken: bool) -> None:
    init()
    caps, dims = bench_collection.capacities(True, "mixed"), bench_collection.dims_of("mixed")
    full = bench_collection.make_batches(caps, 32, 1, 1)
    per_rank = 32 // world_size
    batch = full[0][:, rank * per_rank:(rank + 1) * per_rank].contiguous()
    steps = bench_collection.Steps(caps, bench_collection.distinct_per_table(full), dims, per_rank, 1, CPU,
                                   world_size)
    if broken and rank == 1:  # one rank's collection pools twice its vectors
        real_forward = steps.collection.forward
        steps.collection.forward = lambda kjt: {k: 2 * v for k, v in real_forward(kjt).items()}
    if broken:  # every rank raises, not only the one whose outputs differ
        with pytest.raises(RuntimeError, match="not timing a wrong answer"):
            bench_collection.check_same_pooling_sharded(steps, batch)
    else:
        bench_collection.check_same_pooling_sharded(steps, batch)


@pytest.mark.distributed
@pytest.mark.parametrize("broken", [False, True])
def test_collection_bench_checks_the_sides_pool_alike_at_world_two(tmp_path, broken):
    from _distributed import spawn
    spawn(_sharded_check_rank, 2, str(tmp_path), broken)


def test_embedding_bench_runs_each_dim_and_the_skew_case_in_a_process_of_its_own(tmp_path, monkeypatch):
    """On the CPU a cell's timing must not depend on the cells run before it in the process."""
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    args = bench_embedding.parse_args(["--device", "cpu", "--rows", "2000", "--bags", "64", "--pooling", "4",
                                       "--dims", "8,16", "--threads", "1", "--rounds", "1", "--repeat", "1",
                                       "--skew-lookups", "256", "--skew-dim", "8"])
    parts = bench_embedding.parts_of(args)
    assert [(p.dims, p.skew_lookups, p.skip_main) for p in parts] == [([8], 0, False), ([16], 0, False),
                                                                      ([], 256, True)]
    started = []
    real = bench_embedding.run_in_child
    monkeypatch.setattr(bench_embedding, "run_in_child", lambda part: started.append(part) or real(part))
    bench_embedding.run(args)
    with open(os.path.join(tmp_path, "embedding_cpu.json")) as f:
        record = json.load(f)
    assert len(started) == 3 and record["processes"] == "one per dim and one for the skew case"
    cells = {(row["phase"], row["dim"]) for row in record["results"]}
    assert {("forward", 8), ("forward+backward", 8), ("forward", 16), ("forward+backward", 16),
            ("backward_skew", 8)} <= cells, cells
    # --one-process keeps every part in this process.
    monkeypatch.setattr(bench_embedding, "run_in_child", lambda part: pytest.fail("a child process was started"))
    bench_embedding.run(bench_embedding.parse_args(["--device", "cpu", "--rows", "2000", "--bags", "64",
                                                    "--pooling", "4", "--dims", "8,16", "--threads", "1",
                                                    "--rounds", "1", "--repeat", "1", "--skew-lookups", "0",
                                                    "--one-process"]))
    with open(os.path.join(tmp_path, "embedding_cpu.json")) as f:
        assert json.load(f)["processes"] == "one"

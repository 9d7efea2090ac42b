"""The CPU kernels' work sharing (csrc/cpu/parallel.h, over torch's intra-op threads):
answers must not depend on which thread ran what, on callers from several Python threads at
once, on cores kept busy by other processes (threads that start late or stop midway), or
on more threads than cores; an error raised in a worker's range reaches the caller."""

import multiprocessing
import os
import threading

import pytest
import torch

import sparsekit  # noqa: F401  (registers torch.ops.sparsekit)
from properties import num_threads as torch_threads

ops = torch.ops.sparsekit


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2**40, 2**40, (200_000,), generator=g) // 97  # repeats
    data = torch.randn(60_000, 16, generator=g)
    ids = torch.randint(0, 5_000, (60_000,), generator=g)
    return keys, data, ids


def _answers(keys, data, ids):
    unique, inverse, counts = ops.unique(keys)
    return unique, inverse, counts, ops.segment_sum(data, ids, 5_000, False)


def _references(keys, data, ids):
    unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    return unique, inverse, counts, torch.zeros(5_000, 16, dtype=torch.float64).index_add_(0, ids, data.double())


def _check(answers, references):
    unique, inverse, counts, sums = answers
    ref_unique, ref_inverse, ref_counts, ref_sums = references
    # unique's order is its own: compare as sets, with inverse and counts through it.
    order = torch.argsort(unique)
    assert torch.equal(unique[order], ref_unique)
    assert torch.equal(unique[inverse], ref_unique[ref_inverse])
    assert torch.equal(counts[order], ref_counts)
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_callers_on_several_python_threads_get_the_right_answers(threads):
    """Four Python threads call multi-threaded kernels at once, more torch threads than
    cores included: each call's ranges, chunks and scratch are its own."""
    cases = [_inputs(seed) for seed in range(4)]
    references = [_references(*case) for case in cases]
    errors = []

    def caller(index):
        try:
            for _ in range(5):
                _check(_answers(*cases[index]), references[index])
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            errors.append(exc)

    with torch_threads(threads):
        workers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert not any(worker.is_alive() for worker in workers), "a caller hung"
    assert not errors, errors[0]


def _spin(stop):
    while not stop.is_set():
        pass


def test_busy_cores_change_no_answer():
    """With every core kept busy by other processes, a worker often starts late or is
    descheduled midway, so chunks handed out from a shared counter land on other threads:
    the answers stay the same."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    # Under pytest-xdist the workers share the cores (and keep them busy themselves): a
    # worker spins its share of them, not all, which would slow every other worker's tests
    # (16 spinners, each importing torch, on a 16-core GPU machine running 12 workers).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    count = max(1, (os.cpu_count() or 1) // max(1, workers))
    spinners = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        case = _inputs(7)
        reference = _references(*case)
        with torch_threads(2):
            for _ in range(10):
                _check(_answers(*case), reference)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=30)


def test_an_error_in_a_worker_s_range_is_raised_by_the_caller_and_the_next_call_works():
    """An id out of range in the last rows (a worker's range at 2 threads) raises the op's
    error on the calling thread; the next calls work."""
    data = torch.randn(100_000, 16)
    ids = torch.randint(0, 1_000, (100_000,))
    ids[-1] = 1_000
    with torch_threads(2):
        for _ in range(3):
            with pytest.raises(RuntimeError, match=r"segment_ids holds 1000 but num_segments is 1000"):
                ops.segment_sum(data, ids, 1_000, False)
            ids[-1] = 0
            expected = torch.zeros(1_000, 16, dtype=torch.float64).index_add_(0, ids, data.double())
            torch.testing.assert_close(ops.segment_sum(data, ids, 1_000, False).double(), expected,
                                       rtol=1e-5, atol=1e-4)
            ids[-1] = 1_000


@pytest.mark.parametrize("threads", [2, 3, 5, 8])
def test_every_chunk_runs_once_whoever_takes_it(threads):
    """parallel_chunks gives each worker a contiguous share and lets a worker that is done
    take the back half of the fullest other share: with more threads than cores workers
    start late and are descheduled midway, so shares are split again and again. Every bag
    is pooled exactly once: fewer chunks than workers, as many, and many more, each call on
    a table of its own (a skipped chunk cannot show an earlier call's answer)."""
    g = torch.Generator().manual_seed(threads)
    with torch_threads(threads):
        # 2^16 accumulated elements a chunk: 16 columns, bags of 4 -> 819 bags a chunk.
        for bags in (1, 819 * threads - 1, 819 * threads + 1, 50_000):
            for _ in range(3):
                weight = torch.randn(1000, 16, generator=g)
                rows = torch.randint(0, 1000, (4 * bags,), generator=g)
                offsets = torch.arange(0, 4 * bags + 1, 4)
                want = weight[rows].view(bags, 4, 16).sum(1)
                torch.testing.assert_close(ops.embedding_bag(weight, rows, offsets, None, "sum", None, True), want)


@pytest.mark.parametrize("size", [0, 1, 7, 1000, 70_000])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_serial_repeat_interleave_matches_torch(size, dtype):
    """sparsekit's CPU repeat_interleave (numpy's, on the calling thread) gives torch's
    answer, zero repeats included, and torch's errors."""
    from sparsekit import ops as sk_ops

    g = torch.Generator().manual_seed(size)
    values = torch.randint(-2**31, 2**31, (size,), generator=g).to(dtype)
    repeats = torch.randint(0, 4, (size,), generator=g)
    want = torch.repeat_interleave(values, repeats)
    got = sk_ops._repeat_interleave(values, repeats, want.numel())
    assert got.dtype == want.dtype and torch.equal(got, want)
    if want.numel():  # (torch returns an empty result for empty inputs whatever output_size)
        with pytest.raises(RuntimeError, match="allocated size does not match required size"):
            sk_ops._repeat_interleave(values, repeats, want.numel() + 1)
        with pytest.raises(RuntimeError, match="repeats can not be negative"):
            sk_ops._repeat_interleave(values, torch.full((size,), -1), 0)


def test_cpu_lookups_never_call_torchs_parallel_repeat_interleave(monkeypatch):
    """torch's CPU repeat_interleave splits a few hundred repeats over the threads: with a
    core busy, 1 call in 25 waited 4-8 ms for its second thread. The layers' and the ops'
    CPU paths (a multi-key lookup, its backward, the collection's step) use the serial one."""
    import sparsekit as sk

    def refuse(*args, **kwargs):
        raise AssertionError("torch.repeat_interleave called on the CPU path")

    layer = sk.DistributedEmbedding("sum", 1000, 8, 2, 2)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t", 8, 1000, ["a", "b"]),
                                     sk.TableConfig("u", 4, 1000, ["c"], combiner="mean")])
    weight = torch.randn(50, 4, requires_grad=True)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    keys = sk.Ragged(torch.tensor([3, 5, 5, 9, 11, 3, 2]), torch.tensor([0, 2, 3, 5, 7]))
    layer(keys).sum().backward()
    kjt = sk.KeyedJagged(["a", "b", "c"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
                         lengths=torch.tensor([2, 1, 0, 3, 1, 1]))
    sum(v.sum() for v in ebc(kjt).values()).backward()
    sk.ops.embedding_bag(weight, torch.tensor([1, 2, 3, 4, 49]), torch.tensor([0, 2, 5]), mode="mean").sum().backward()
    assert weight.grad is not None and layer.weight.grad is not None


_CONTENDED_CASES = """
import sys, torch, sparsekit as sk
torch.set_num_threads(2)
ops = torch.ops.sparsekit
g = torch.Generator().manual_seed(3)
out = []
for n in (5_000, 40_000, 300_000):  # under, across and over the kernels' grains x 64
    keys = torch.randint(0, n // 3, (n,), generator=g)
    out += list(ops.unique(keys))
    out += list(ops.unique_bounded(keys, n // 3, True))
    data = torch.randn(n, 16, generator=g)
    out.append(ops.segment_sum(data, keys, n // 3, False))
    out.append(ops.embedding_bag(data, keys, torch.arange(0, n + 1, 4), None, "sum", None, True))
    out += list(ops.unique_tables(keys, [0, n // 2, n], [0, 1], 2))
    param, m, v = torch.randn(n // 3, 16, generator=g), torch.zeros(n // 3, 16), torch.zeros(n // 3, 16)
    rows = torch.randperm(n // 3, generator=g)[: n // 6]
    ops.lazy_adam_(param, m, v, rows, torch.randn(rows.numel(), 16, generator=g), 1, 0.01, 0.9, 0.999, 1e-8)
    out += [param, m, v]
    table = sk.HashTable(n)
    out += [table.insert(keys), table.find(keys + 1)]
torch.save(out, sys.argv[1])
"""


def test_the_contended_paths_give_the_same_answers(tmp_path):
    """SPARSEKIT_CORES_CONTENDED=1 takes the paths a busy machine takes (small regions
    inline, a kernel's workers one after another on the calling thread) on every call: the
    answers are bit for bit those of the normal paths, on sizes across the kernels' grains."""
    import subprocess
    import sys

    answers = {}
    for contended in ("0", "1"):
        path = tmp_path / f"out{contended}.pt"
        env = dict(os.environ, SPARSEKIT_CORES_CONTENDED=contended)
        subprocess.run([sys.executable, "-c", _CONTENDED_CASES, str(path)], env=env, check=True, timeout=300)
        answers[contended] = torch.load(path)
    assert len(answers["0"]) == len(answers["1"]) > 0
    for normal, contended in zip(answers["0"], answers["1"]):
        assert normal.dtype == contended.dtype and torch.equal(normal, contended)

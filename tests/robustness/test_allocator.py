"""sk.keep_freed_memory: glibc keeps freed blocks, so a training-step-like loop stops
faulting in fresh pages; bad thresholds raise naming the argument."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import sparsekit as sk

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A "step": three 24 MiB temporaries alive at once, then all freed. Under glibc's initial
# settings (blocks from 128 KiB get their own mmap, set explicitly first: glibc raises its
# thresholds as a process runs, so history would decide) every step faults its pages in
# again.
_STEPS = textwrap.dedent("""
    import ctypes, resource, sys
    import torch
    import sparsekit as sk
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    assert mallopt(-3, 128 << 10) == 1 and mallopt(-1, 128 << 10) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    if sys.argv[1] == "keep":
        assert sk.keep_freed_memory()
    torch.set_num_threads(1)
    def step():
        blocks = [torch.ones(6 << 20) for _ in range(3)]  # 3 x 24 MiB
        del blocks
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
""")


def _faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_keep_freed_memory_stops_page_faults_of_a_repeated_step():
    pages = 3 * (24 << 20) // 4096
    # The control: with glibc's initial settings each step faults in most of its pages again.
    assert _faults_per_step("system") > pages // 2
    assert _faults_per_step("keep") < pages // 20


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_keep_freed_memory_reports_success_and_is_recorded():
    code = "import sparsekit as sk; from sparsekit.allocator import freed_memory_kept as k; " \
           "a = k(); print(a, sk.keep_freed_memory(), k())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "True"]


@pytest.mark.parametrize("kwargs, name", [
    ({"mmap_threshold": (32 << 20) + 1}, "mmap_threshold"),
    ({"mmap_threshold": -1}, "mmap_threshold"),
    ({"mmap_threshold": 1.5}, "mmap_threshold"),
    ({"trim_threshold": True}, "trim_threshold"),
    ({"trim_threshold": 1 << 31}, "trim_threshold"),
])
def test_keep_freed_memory_rejects_bad_thresholds(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sk.keep_freed_memory(**kwargs)


# ---- tables in huge pages ----

from sparsekit import allocator  # noqa: E402


@pytest.mark.parametrize("shape, fill, dtype", [((5, 3), 0, torch.float32), ((1 << 20,), -1, torch.int64),
                                                ((3 << 18, 4), 0, torch.bfloat16), ((0, 16), 0, torch.float32)])
def test_table_full_is_torch_full(shape, fill, dtype):
    table = allocator.table_full(shape, fill, dtype, "cpu")
    assert table.shape == shape and table.dtype == dtype and table.is_contiguous()
    assert torch.equal(table, torch.full(shape, fill, dtype=dtype))
    assert torch.equal(allocator.table_zeros(shape, dtype, None), torch.zeros(shape, dtype=dtype))
    for device in ("meta", torch.device("cpu")):  # a size as an int, on every device
        assert allocator.table_full(shape[0], fill, dtype, device).shape == shape[:1]
        assert allocator.table_full(list(shape), fill, dtype, device).device.type == torch.device(device).type


def test_table_full_advises_the_aligned_interior_of_large_tables(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_libc_madvise", lambda: lambda address, length, advice: calls.append(
        (address, length, advice)) or 0)
    huge = 1 << 21
    table = allocator.table_zeros((allocator.HUGE_TABLE_BYTES // 4 + 5,), torch.float32, "cpu")
    (address, length, advice), = calls
    begin, end = table.data_ptr(), table.data_ptr() + table.numel() * 4
    assert advice == 14 and address % huge == 0 and length % huge == 0 and length > 0
    assert begin <= address and address + length <= end and address - begin < huge and end - address - length < huge
    calls.clear()
    allocator.table_zeros((allocator.HUGE_TABLE_BYTES // 4 - 1,), torch.float32, "cpu")  # below the threshold
    assert calls == []


def test_huge_tables_advises_every_table_of_a_huge_page_within(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_libc_madvise", lambda: lambda address, length, advice: calls.append(length) or 0)
    small = (3 << 21) // 4  # three huge pages of float32: below the threshold alone
    with allocator.huge_tables(True):
        allocator.table_zeros((small,), torch.float32, "cpu")
        with allocator.huge_tables(False):  # an inner "no" keeps the outer "yes"
            allocator.table_zeros((small,), torch.float32, "cpu")
        allocator.table_zeros((1000,), torch.float32, "cpu")  # under one huge page: nothing to advise
    assert len(calls) == 2 and all(length > 0 for length in calls)
    calls.clear()
    allocator.table_zeros((small,), torch.float32, "cpu")  # outside: the size threshold again
    assert calls == []


def _collection_advice(monkeypatch, rows, fused_params=None):
    calls = []
    monkeypatch.setattr(allocator, "_libc_madvise", lambda: lambda address, length, advice: calls.append(length) or 0)
    import sparsekit as sk
    names = [f"f{i}" for i in range(4)]
    ebc = sk.EmbeddingBagCollection([sk.TableConfig(f"t{i}", 16, rows, [names[i]], use_hashtable=False)
                                     for i in range(4)], fused_params=fused_params)
    if fused_params is not None:
        kjt = sk.KeyedJagged(names, torch.arange(8), lengths=torch.ones(8, dtype=torch.int64))
        sum(v.sum() for v in ebc(kjt).values()).backward()  # the fused state is made here
    return calls


def test_a_collection_puts_its_tables_in_huge_pages_when_together_they_pass_the_threshold(monkeypatch):
    # Four tables of a quarter of the threshold each: each alone is below it, together not.
    monkeypatch.setattr(allocator, "HUGE_TABLE_BYTES", 16 << 20)  # tables of 4 MiB: two huge pages each
    rows = allocator.HUGE_TABLE_BYTES // (4 * 16 * 4)
    calls = _collection_advice(monkeypatch, rows, {"optimizer": "lazy_adam", "lr": 0.1})
    assert len(calls) == 4 * 3, calls  # each table's weight and its two moments
    assert _collection_advice(monkeypatch, rows // 2) == []  # half of it: none


def test_layer_tables_and_moments_use_table_full(monkeypatch):
    sizes = []
    original = allocator.table_full

    def spy(shape, fill_value, dtype, device):
        sizes.append((tuple(shape) if not isinstance(shape, int) else (shape,), dtype))
        return original(shape, fill_value, dtype, device)
    monkeypatch.setattr(allocator, "table_full", spy)
    layer = sk.DistributedEmbedding("sum", 1000, 8, 1, 1, use_hashtable=True)
    optimizer = sk.LazyAdam(layer.parameters())
    layer(torch.tensor([[[1]], [[2]]])).sum().backward()
    optimizer.step()
    assert sizes.count(((1000, 8), torch.float32)) == 3  # the weight and its two moments
    assert any(dtype == torch.int64 and shape[0] >= 1000 for shape, dtype in sizes)  # the hash table's slots


@pytest.mark.skipif(not GLIBC or not os.path.exists("/proc/self/smaps"), reason="needs glibc and Linux's smaps")
def test_a_large_table_asks_for_huge_pages():
    """The table's aligned middle is advised MADV_HUGEPAGE (smaps flag ``hg``); a small
    table is not. Whether the kernel then finds free huge pages depends on the machine's
    load, so the page faults themselves are not asserted."""
    code = textwrap.dedent("""
        import torch
        from sparsekit import allocator

        def flags(address):
            lines = open("/proc/self/smaps").read().splitlines()
            for i, line in enumerate(lines):
                span = line.split()[0]
                if "-" in span and all(c in "0123456789abcdef-" for c in span):
                    begin, end = (int(part, 16) for part in span.split("-"))
                    if begin <= address < end:
                        flag_line = next(l for l in lines[i + 1:] if l.startswith("VmFlags:"))
                        return flag_line.split()[1:]
            raise AssertionError(hex(address))

        huge = 2 << 20
        table = allocator.table_zeros((1 << 26,), torch.float32, "cpu")  # 256 MiB
        middle = (table.data_ptr() + huge - 1) // huge * huge + huge
        small = allocator.table_zeros((1 << 20,), torch.float32, "cpu")  # 4 MiB
        print("hg" in flags(middle), "hg" in flags(small.data_ptr() + (2 << 20)))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["True", "False"], out


def test_tables_follow_the_default_device():
    """device=None is the current default device, as for torch's factories: a model built
    under torch.device("meta") gets meta tables (to_empty() then reset_parameters())."""
    with torch.device("meta"):
        layer = sk.DistributedEmbedding("sum", 1000, 8, 1, 1, use_hashtable=True)
        direct = sk.DistributedEmbedding("sum", 1000, 8, 1, 1, use_hashtable=False)
        table = sk.HashTable(100)
        assert allocator.table_full(4, -1, torch.int64, None).is_meta
    assert layer.weight.is_meta and direct.weight.is_meta
    assert all(t.is_meta for t in layer.hash_table._tensors()) and all(t.is_meta for t in table._tensors())
    assert allocator.table_full((2, 3), 0, None, "meta").dtype == torch.get_default_dtype()


def test_no_advice_for_a_fake_table(monkeypatch):
    """Under FakeTensorMode (tracing) a tensor has no memory (data_ptr 0): nothing is advised."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    calls = []
    monkeypatch.setattr(allocator, "_libc_madvise", lambda: lambda *args: calls.append(args) or 0)
    with FakeTensorMode():
        table = allocator.table_zeros((allocator.HUGE_TABLE_BYTES // 4 + 1,), torch.float32, "cpu")
    assert table.shape[0] == allocator.HUGE_TABLE_BYTES // 4 + 1 and calls == []

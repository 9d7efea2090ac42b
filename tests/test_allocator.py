"""sk.keep_freed_memory: glibc keeps freed blocks, so a training-step-like loop stops
faulting in fresh pages; bad thresholds raise naming the argument."""

import platform
import subprocess
import sys
import textwrap

import pytest

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

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import sparsekit

# The repository root (this file is tests/package/test_build.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _thread_cpu_ticks() -> dict:
    """User + system clock ticks of each thread of this process, by thread id."""
    ticks = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[task] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_cpu_kernels_run_on_several_threads():
    """The kernels hand work to torch's intra-op pool through the stable ABI's parallel_for:
    with two threads, a big call keeps more than one thread of the process busy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        keys = torch.randint(0, 1 << 40, (1 << 22,))
        data = torch.randn(1 << 20, 64)
        ids = torch.randint(0, 1 << 16, (1 << 20,))
        sparsekit.ops.unique(keys)  # starts the pool
        before = _thread_cpu_ticks()
        for _ in range(5):
            sparsekit.ops.unique(keys)
            sparsekit.ops.segment_sum(data, ids, 1 << 16)
        after = _thread_cpu_ticks()
    finally:
        torch.set_num_threads(previous)
    busy = [task for task, ticks in after.items() if ticks - before.get(task, 0) >= 2]
    assert len(busy) >= 2, f"only threads {busy} ran sparsekit's kernels"


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_library_uses_the_stable_abi_only():
    """No symbol of torch's C++ API (c10::, at::, torch:: mangled names) is imported: the
    library calls torch only through the stable C shim, so it loads under every torch from
    its target version on."""
    (library,) = glob.glob(os.path.join(os.path.dirname(sparsekit.__file__), "_C*.so"))
    undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True,
                               check=True).stdout.split()
    unstable = [s for s in undefined if re.match(r"_ZNK?(3c10|2at|5torch)", s)]
    assert not unstable, f"sparsekit._C imports symbols outside the stable ABI: {unstable[:5]}"
    assert "torch_parallel_for" in undefined and "torch_call_dispatcher" in undefined


def test_kernel_sources_include_no_unstable_torch_header():
    """csrc/ (but its C++ test, which drives the ops through the full dispatcher) includes
    torch only through csrc/torch_api.h: no ATen, c10 or torch/library.h header."""
    root = os.path.join(ROOT, "csrc")
    if not os.path.isdir(root):
        pytest.skip("no source tree (an installed wheel)")
    offenders = []
    for folder, _, files in os.walk(root):
        if os.path.basename(folder) == "test":
            continue
        for name in files:
            path = os.path.join(folder, name)
            with open(path) as f:
                for line in f:
                    if re.match(r"\s*#\s*include\s*<(ATen|c10|torch/library|torch/extension|torch/all)", line):
                        offenders.append(f"{os.path.relpath(path, root)}: {line.strip()}")
    assert not offenders, offenders


def test_every_op_has_a_cpu_kernel():
    ops = ["unique", "segment_sum", "hash_table_find", "hash_table_insert_absent_", "hash_table_erase_", "embedding_bag",
           "embedding_bag_argmax", "embedding_gather", "lazy_adam_", "partition_by_owner", "key_seeded_uniform",
           "select_smallest"]
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekit::{op}", "CPU")]
    assert not missing


def test_a_build_without_its_requirements_stops_at_once_naming_them(tmp_path):
    """setup.py in a Python with no setuptools and no torch (a bare venv, as a
    `--no-build-isolation` build would see it) stops before compiling, naming both."""
    setup_py = os.path.join(ROOT, "setup.py")
    if not os.path.exists(setup_py):
        pytest.skip("no source tree (an installed wheel)")
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    result = subprocess.run([str(venv / "bin" / "python"), setup_py, "--version"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert "sparsekit's build needs setuptools>=77 (not installed); torch>=2.10 (not installed)" in result.stderr
    assert "Traceback" not in result.stderr

"""The import errors a new user meets say what is wrong and what to do."""

import os
import shutil
import subprocess
import sys

import torch

from sparsekit import _loading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unbuilt_source_tree_says_so(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "sparsekit"), tree / "sparsekit",
                    ignore=shutil.ignore_patterns("_C*.so", "_build_info.py", "__pycache__"))
    result = subprocess.run([sys.executable, "-c", "import sparsekit"], cwd=tree, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    assert result.returncode != 0
    assert "compiled library is missing" in result.stderr and "setup.py build_ext --inplace" in result.stderr
    assert "circular import" not in result.stderr.splitlines()[-1]


def test_a_torch_older_than_the_stable_abi_target_says_so():
    message = _loading.explain(ImportError("/x/_C.abi3.so: undefined symbol: torch_parallel_for"))
    assert f"needs torch >= {_loading.TARGET_TORCH}" in message and f"torch {torch.__version__} is installed" in message


def test_a_torch_without_the_cuda_runtime_of_the_build_says_so(monkeypatch):
    monkeypatch.setattr(_loading, "_built_for", lambda: ("2.13.0+cu130", "13.0"))
    message = _loading.explain(ImportError("libcudart.so.13: cannot open shared object file: No such file"))
    assert "built with CUDA 13.0 kernels" in message and "torch built for CUDA 13" in message
    assert "SPARSEKIT_CUDA=0" in message


def test_a_shadowing_folder_is_named(tmp_path):
    """Run from the parent of a clone called "sparsekit", the clone (no __init__.py) is
    found as a namespace package; the harness's package then names the folder."""
    shutil.copytree(os.path.join(ROOT, "sparsekit", "train"), tmp_path / "sparsekit" / "train",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site-packages, so nothing but the folder can answer to "sparsekit".
    result = subprocess.run([sys.executable, "-S", "-c", "import sparsekit.train"], cwd=tmp_path,
                            capture_output=True, text=True, env={"PATH": os.environ.get("PATH", "")})
    assert result.returncode != 0
    assert "shadows it" in result.stderr and str(tmp_path) in result.stderr

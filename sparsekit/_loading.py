"""Loading the compiled library, with errors that say what is wrong and what to do."""

from __future__ import annotations

import glob
import importlib
import os
from types import ModuleType

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# The oldest torch whose stable ABI the library targets (setup.py's TARGET_TORCH).
TARGET_TORCH = "2.10"


def _built_for() -> tuple:
    try:
        from . import _build_info as info
    except ImportError:
        return None, None
    return info.TORCH_VERSION, info.CUDA_VERSION


def load_library() -> ModuleType:
    """Imports ``sparsekit._C``; on failure raises an ImportError that names the cause:
    an unbuilt source tree, or a library built for another torch."""
    try:
        return importlib.import_module("sparsekit._C")
    except ImportError as error:
        raise ImportError(explain(error)) from error


def explain(error: ImportError) -> str:
    built_torch, _ = _built_for()
    running = torch.__version__
    if not glob.glob(os.path.join(_HERE, "_C*.so")) and not glob.glob(os.path.join(_HERE, "_C*.pyd")):
        return (f"sparsekit's compiled library is missing from {_HERE}: this is a source tree that was never "
                "built. Build it in place with `SPARSEKIT_CUDA=0 python setup.py build_ext --inplace` (about "
                "two minutes without the CUDA kernels; with torch, setuptools and ninja installed), or install "
                "sparsekit (`pip install --no-build-isolation .`) and import it from outside the source tree.")
    text = str(error)
    if "undefined symbol" in text:
        return (f"sparsekit._C needs torch >= {TARGET_TORCH} (it calls torch only through the stable ABI of that "
                f"version and later) but torch {running} is installed ({text}). Install a newer torch "
                f"(`pip install 'torch>={TARGET_TORCH}'`).")
    built_cuda = _built_for()[1]
    if "libcudart" in text or "libcuda" in text:
        return (f"sparsekit._C was built with CUDA {built_cuda} kernels but torch {running} (CUDA "
                f"{torch.version.cuda}) does not bring that CUDA runtime ({text}). Install a torch built for CUDA "
                f"{str(built_cuda).split('.')[0]}, or rebuild sparsekit against this torch "
                "(`pip install --no-build-isolation --force-reinstall --no-deps .`; `SPARSEKIT_CUDA=0` for the CPU "
                "kernels only).")
    return f"sparsekit._C failed to load ({text}); built with torch {built_torch or 'unknown'}, running {running}"

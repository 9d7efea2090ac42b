"""Loading the compiled library, with errors that say what is wrong and what to do."""

from __future__ import annotations

import glob
import importlib
import os
from types import ModuleType

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


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
                "built. Build it in place with `bash scripts/test.sh` (or `python setup.py build_ext --inplace` "
                "with torch installed), or install sparsekit (`pip install --no-build-isolation .`) and import "
                "it from outside the source tree.")
    text = str(error)
    if "undefined symbol" in text:
        built = f"torch {built_torch}" if built_torch else "another torch"
        return (f"sparsekit._C was built for {built} but torch {running} is installed, and a compiled torch "
                f"extension only loads under the torch minor version it was built against ({text}). Rebuild "
                "sparsekit against this torch (`pip install --no-build-isolation --force-reinstall --no-deps .`, "
                "or `bash scripts/test.sh` in a clone), or install the torch it was built for.")
    return f"sparsekit._C failed to load ({text}); built for torch {built_torch or 'unknown'}, running {running}"

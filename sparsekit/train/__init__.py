"""The training harness: ``python -m sparsekit.train`` (see ``__main__.py``)."""

import os as _os

import sparsekit as _sparsekit

if not hasattr(_sparsekit, "EmbeddingBagCollection"):
    # Run from the parent of a clone called "sparsekit", that folder (no __init__.py) is
    # found first and shadows the package.
    _where = list(getattr(_sparsekit, "__path__", [])) or [getattr(_sparsekit, "__file__", "?")]
    raise ImportError(
        f"'sparsekit' resolved to {_where}, not the sparsekit package: a folder named sparsekit in the current "
        f"directory ({_os.getcwd()}) shadows it. Run from another directory, or from inside the clone.")

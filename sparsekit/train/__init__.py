"""The training harness: ``python -m sparsekit.train`` (see ``__main__.py``)."""

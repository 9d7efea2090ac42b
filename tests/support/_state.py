"""Helpers of the tests that save, load and compare module and optimizer states."""

import io

import torch


def saved_and_loaded(state):
    """``state`` through torch.save / torch.load(weights_only=True), as a file would take it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_equal_nested(now, before, where="state"):
    """``now`` equals ``before`` exactly, through nested dicts, lists and tuples (tensors
    bit for bit with their dtypes); the assertion names the first path that differs."""
    assert type(now) is type(before), where
    if isinstance(before, torch.Tensor):
        assert now.dtype == before.dtype and torch.equal(now, before), where
    elif isinstance(before, dict):
        assert set(now) == set(before), where
        for key in before:
            assert_equal_nested(now[key], before[key], f"{where}[{key!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(now) == len(before), where
        for index, (a, b) in enumerate(zip(now, before)):
            assert_equal_nested(a, b, f"{where}[{index}]")
    else:
        assert now == before, where

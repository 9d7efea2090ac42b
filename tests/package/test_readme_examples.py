"""The README's code runs as written: its Quick start on the CPU, its CUDA graph example
where a GPU is present."""

from __future__ import annotations

import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_has_its_two_examples():
    blocks = _blocks()
    assert len(blocks) == 2 and "import sparsekit as sk" in blocks[0] and "torch.cuda.graph" in blocks[1]


@pytest.mark.heavy
def test_the_quick_start_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes a checkpoint directory
    exec(compile(_blocks()[0], "README.md (Quick start)", "exec"), {})
    assert (tmp_path / "ckpt").is_dir()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_cuda_graph_example_replays_the_step_it_captured():
    scope = {}
    exec(compile("import torch\nimport sparsekit as sk\n" + _blocks()[1], "README.md (CUDA graph)", "exec"), scope)
    ebc, graph = scope["ebc"], scope["graph"]
    before = ebc.weights["t"].detach().clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(before, ebc.weights["t"].detach())  # each replay trains the rows read

"""The fused optimizer under a process group: each rank updates the rows it owns in the
backward, with the numbers of the unfused path on the same ranks (LazyAdam bit for bit)
and of one process on the same global batches (to rounding), for every fused optimizer."""

from __future__ import annotations

import pytest
import torch
from _distributed import spawn
from test_collection import BATCH, STEPS, _rank_slice, batch, tables

import sparsekit as sk

OPTIMIZERS = ("lazy_adam", "sgd", "rowwise_adagrad", "adagrad")
WORLD = 2


def _fused_params(optimizer):
    return {"optimizer": optimizer, "lr": 0.05, **({"weight_decay": 0.01} if optimizer == "lazy_adam" else {}),
            **({"eps": 1e-10} if optimizer == "adagrad" else {})}  # torch.optim.Adagrad's default


def _train(ebc, rank, world_size, step_optimizer=None, global_batch=BATCH * WORLD):
    """STEPS steps on this rank's slices of global batches (the loss sums the local samples,
    so the ranks' gradients add up to one process's); the outputs of each step."""
    per = global_batch // world_size
    outputs = []
    for step in range(STEPS):
        out = ebc(_rank_slice(batch(step, global_batch, weighted=True), rank, world_size))
        g = torch.Generator().manual_seed(step)
        loss = 0
        for value in out.values():
            target = torch.randn(global_batch, value.shape[1], generator=g)[rank * per:(rank + 1) * per]
            loss = loss + (value.float() * target).sum()
        loss.backward()
        if step_optimizer is not None:
            step_optimizer.step()
            step_optimizer.zero_grad()
        outputs.append({f: v.detach().float() for f, v in out.items()})
    return outputs


def _tables_of(ebc):
    return {t.name: ebc.export(t.name) for t in ebc.tables}


def _worker(rank, world_size, init, out_dir):
    init()
    results = {}
    for optimizer in OPTIMIZERS:
        fused = sk.EmbeddingBagCollection(tables(), fused_params=_fused_params(optimizer))
        outputs = _train(fused, rank, world_size)
        assert all(p.grad is None for p in fused.parameters())
        results[optimizer] = (outputs, _tables_of(fused))
        if optimizer == "rowwise_adagrad":
            continue
        plain = sk.EmbeddingBagCollection(tables())
        step = (sk.LazyAdam(plain.parameters(), lr=0.05, weight_decay=0.01) if optimizer == "lazy_adam"
                else torch.optim.Adagrad(plain.parameters(), lr=0.05, eps=1e-10) if optimizer == "adagrad"
                else torch.optim.SGD(plain.parameters(), lr=0.05))
        _train(plain, rank, world_size, step)
        for name, (keys, vectors) in _tables_of(plain).items():
            got_keys, got_vectors = results[optimizer][1][name]
            assert torch.equal(got_keys, keys), (optimizer, name)
            if optimizer == "lazy_adam":
                assert torch.equal(got_vectors, vectors), (optimizer, name)
            else:  # torch's SGD rounds a bfloat16 step in bfloat16; the fused update once, from float32
                tolerance = dict(rtol=1e-2, atol=1e-3) if name == "half" else dict(rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(got_vectors, vectors, **tolerance, msg=lambda m: f"{name}: {m}")
        if optimizer == "lazy_adam":
            for a, b in zip(fused.parameters(), plain.parameters()):
                state_a, state_b = fused.fused_optimizer.state.get(a), step.state.get(b)
                assert bool(state_a) == bool(state_b)
                if state_a:
                    assert int(state_a["step"]) == int(state_b["step"])
                    assert torch.equal(state_a["exp_avg"], state_b["exp_avg"])
    torch.save(results, f"{out_dir}/fused-{rank}.pt")


@pytest.mark.distributed
def test_fused_optimizers_under_a_process_group_train_as_one_process(tmp_path):
    world_size = WORLD
    spawn(_worker, world_size, str(tmp_path), str(tmp_path))
    per_rank = [torch.load(tmp_path / f"fused-{rank}.pt") for rank in range(world_size)]
    for optimizer in OPTIMIZERS:
        reference = sk.EmbeddingBagCollection(tables(), fused_params=_fused_params(optimizer))
        ref_outputs = _train(reference, 0, 1)
        # Each rank's outputs: its samples of the one-process outputs.
        for rank, results in enumerate(per_rank):
            outputs, _ = results[optimizer]
            for step in range(STEPS):
                for feature, value in outputs[step].items():
                    expected = ref_outputs[step][feature][rank * BATCH:(rank + 1) * BATCH]
                    tolerance = dict(rtol=2e-2, atol=2e-3) if feature == "cat" else dict(rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(value, expected, **tolerance,
                                               msg=lambda m: f"{optimizer} {feature} {step}: {m}")
        # The ranks' keys together are the one-process table, vector for vector.
        for name, (ref_keys, ref_vectors) in _tables_of(reference).items():
            got = {}
            for results in per_rank:
                keys, vectors = results[optimizer][1][name]
                got.update(zip(keys.tolist(), vectors.float()))
            if name != "ids":  # a direct table: every rank holds its own rows
                assert sorted(got) == sorted(ref_keys.tolist()), (optimizer, name)
            for key, vector in zip(ref_keys.tolist(), ref_vectors.float()):
                if key in got:
                    torch.testing.assert_close(got[key], vector, rtol=2e-2 if name == "half" else 1e-5,
                                               atol=1e-3 if name == "half" else 1e-5,
                                               msg=lambda m: f"{optimizer} {name} {key}: {m}")

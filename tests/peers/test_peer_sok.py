"""SOK's own test cases, ported to sparsekit's SOK-compatible layers.

Each test names the SOK test (NVIDIA-Merlin/HugeCTR, ``sparse_operation_kit/``) whose
checks it follows. SOK compares its layers on several GPUs (MirroredStrategy / Horovod)
against plain TensorFlow on the global batch; here the ranks are spawned gloo processes
(world 1 and 2) and the reference is plain torch (``nn.EmbeddingBag`` / ``nn.Embedding``
with ``sparse=True``, ``torch.optim.SparseAdam`` / ``Adam`` / ``SGD``) on the gathered
global batch, computed in each rank before it joins the group.

SOK's ``Saver.load_embedding_values`` (explicit initial tables) becomes a key-dependent
``embedding_initializer``, so the reference table is that function of the row index.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _distributed import spawn
from torch import nn

import sparsekit as sk

DIM = 4
SLOTS = 3
MAX_NNZ = 3
GLOBAL_BATCH = 8
STEPS = 4
LR = 0.1
TOL = {"rtol": 1e-4, "atol": 1e-4}  # SOK's assert_near tolerances


def run(fn, world_size, tmp_dir, *args):
    """``fn(rank, world_size, init, *args)`` on spawned gloo ranks; world size 1 runs in
    this process without a process group (a layer without one is one shard)."""
    if world_size == 1:
        fn(0, 1, lambda: None, *args)
    else:
        spawn(fn, world_size, tmp_dir, *args)


def sok_initializer(keys: torch.Tensor, dim: int) -> torch.Tensor:
    """A deterministic, key-dependent initial table (SOK's tests load explicit init tensors)."""
    k = keys.double().unsqueeze(1)
    return (0.05 * torch.sin(0.37 * k + torch.arange(dim, dtype=torch.float64))).float()


def sok_samples(step: int, vocabulary_size: int, sparse_mask: bool = True, width: int = MAX_NNZ):
    """SOK's ``generate_random_samples``: ``[B, slot, width]`` keys, slot ``s`` drawn from
    ``[s * vocab_per_slot, (s + 1) * vocab_per_slot)``; with the sparse mask about half the
    keys are -1 (padding), moved to the end of each bag; labels 0/1."""
    g = torch.Generator().manual_seed(9000 + step)
    per_slot = vocabulary_size // SLOTS
    keys = torch.randint(0, per_slot, (GLOBAL_BATCH, SLOTS, width), generator=g)
    keys += (torch.arange(SLOTS) * per_slot).view(1, SLOTS, 1)
    if sparse_mask:
        mask = torch.rand(keys.shape, generator=g) < 0.5
        keys[mask] = -1
        keys = keys.sort(dim=-1, descending=True).values
    labels = torch.randint(0, 2, (GLOBAL_BATCH, 1), generator=g).float()
    return keys, labels


# ---- the demo models (SOKDemo / TfDemo, SOKDenseDemo / TfDenseDemo) ----------------------


class SOKDemo(nn.Module):
    def __init__(self, embedding: nn.Module, width: int):
        super().__init__()
        self.embedding_layer = embedding
        self.dense_layer = nn.Linear(width, 1)
        with torch.no_grad():  # SOK: kernel_initializer="ones", bias_initializer="zeros"
            self.dense_layer.weight.fill_(1.0)
            self.dense_layer.bias.zero_()

    def forward(self, keys):
        vectors = self.embedding_layer(keys)
        flat = vectors.reshape(vectors.shape[0], -1)
        return self.dense_layer(flat), flat


class TorchSparseDemo(nn.Module):
    """TfDemo: ``tf.nn.embedding_lookup_sparse`` on the global batch -> nn.EmbeddingBag."""

    def __init__(self, combiner: str, vocabulary_size: int):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocabulary_size, DIM, mode=combiner, sparse=True)
        with torch.no_grad():
            self.embedding.weight.copy_(sok_initializer(torch.arange(vocabulary_size), DIM))
        self.dense_layer = nn.Linear(SLOTS * DIM, 1)
        with torch.no_grad():
            self.dense_layer.weight.fill_(1.0)
            self.dense_layer.bias.zero_()

    def forward(self, keys):
        flat_bags = keys.reshape(-1, keys.shape[-1])
        valid = flat_bags >= 0
        values = flat_bags[valid]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), valid.sum(1).cumsum(0)[:-1]])
        flat = self.embedding(values, offsets).reshape(keys.shape[0], SLOTS * DIM)
        return self.dense_layer(flat), flat


class TorchDenseDemo(nn.Module):
    """TfDenseDemo: ``tf.nn.embedding_lookup`` on the global batch -> nn.Embedding."""

    def __init__(self, vocabulary_size: int, width: int):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary_size, DIM, sparse=True)
        with torch.no_grad():
            self.embedding.weight.copy_(sok_initializer(torch.arange(vocabulary_size), DIM))
        self.dense_layer = nn.Linear(width, 1)
        with torch.no_grad():
            self.dense_layer.weight.fill_(1.0)
            self.dense_layer.bias.zero_()

    def forward(self, keys):
        flat = self.embedding(keys).reshape(keys.shape[0], -1)
        return self.dense_layer(flat), flat


def _loss(logits, labels):
    # SOK: BinaryCrossentropy(from_logits) with compute_average_loss(global_batch_size)
    return nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / GLOBAL_BATCH


def torch_reference(model, batches, steps, tables=None):
    """Plain torch on the global batch: SparseAdam for the tables (``tables``, else
    ``model.embedding``), Adam for the dense layer."""
    sparse_opt = torch.optim.SparseAdam([t.weight for t in tables] if tables else [model.embedding.weight], lr=LR)
    dense_opt = torch.optim.Adam(model.dense_layer.parameters(), lr=LR)
    outputs = []
    for step in range(steps):
        keys, labels = batches[step]
        logits, flat = model(keys)
        _loss(logits, labels).backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        outputs.append(flat.detach())
    return outputs


def sok_train(model, optimizer, batches, steps, rank, world_size, first_step=0):
    """This rank's part of each global batch; the dense gradients summed over the ranks
    (the loss is already divided by the global batch)."""
    per_rank = GLOBAL_BATCH // world_size
    outputs = []
    for step in range(first_step, first_step + steps):
        keys, labels = batches[step]
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        logits, flat = model(keys[mine])
        _loss(logits, labels[mine]).backward()
        if world_size > 1:
            for p in model.dense_layer.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(flat.detach())
    return outputs


def _check_exported(layer, reference_weight, rank, world_size, seen_keys, name):
    """SOK's ``check_saved_embedding_variables``: the dumped (key, vector) pairs equal the
    reference table's rows of those keys; every key lives on rank ``key % world_size``."""
    keys, vectors = layer.export()
    if layer.use_hashtable:
        mine = sorted(k for k in seen_keys if k % world_size == rank)
        assert sorted(keys.tolist()) == mine, name
    else:
        keep = keys < reference_weight.shape[0]
        keys, vectors = keys[keep], vectors[keep]
        assert (keys % world_size == rank).all(), name
    torch.testing.assert_close(vectors, reference_weight[keys.long()], **TOL, msg=lambda m, where=f"{name} export": f"{where}: {m}")


# ---- DistributedEmbedding: test_sparse_emb_demo_model_{single,multi}_worker ---------------


SPARSE_CASES = [(combiner, use_hashtable) for combiner in ("mean", "sum") for use_hashtable in (True, False)]


def _train_save_restore(build, model, batches, ref_outputs, directory, rank, world_size, name):
    """STEPS steps of ``model`` with LazyAdam, each rank's outputs equal to its part of the
    reference's; then save_params / restore_params (a checkpoint, a ``build()`` model
    loading it) and STEPS more steps of the restored model, equal to the reference's
    continuation. Returns the restored model."""
    per_rank = GLOBAL_BATCH // world_size
    optimizer = sk.LazyAdam(model.parameters(), lr=LR)
    for step, out in enumerate(sok_train(model, optimizer, batches, STEPS, rank, world_size)):
        expected = ref_outputs[step][rank * per_rank:(rank + 1) * per_rank]
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m, where=f"{name} step {step}": f"{where}: {m}")
    sk.save_checkpoint(directory, model, optimizer)
    restored = build()
    restored_optimizer = sk.LazyAdam(restored.parameters(), lr=LR)
    sk.load_checkpoint(directory, restored, restored_optimizer)
    outputs = sok_train(restored, restored_optimizer, batches, STEPS, rank, world_size, first_step=STEPS)
    for step, out in enumerate(outputs, start=STEPS):
        expected = ref_outputs[step][rank * per_rank:(rank + 1) * per_rank]
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m, where=f"{name} restored step {step}": f"{where}: {m}")
    return restored


def _sparse_demo_worker(rank, world_size, init, checkpoint_dir):
    for combiner, use_hashtable in SPARSE_CASES:
        name = f"DistributedEmbedding {combiner} use_hashtable={use_hashtable} world={world_size}"
        max_vocab_per_gpu = 30 // world_size if use_hashtable else 30
        vocabulary_size = max_vocab_per_gpu * world_size if use_hashtable else max_vocab_per_gpu
        batches = [sok_samples(step, vocabulary_size) for step in range(2 * STEPS)]
        reference = TorchSparseDemo(combiner, vocabulary_size)
        ref_outputs = torch_reference(reference, batches, 2 * STEPS)
        if not dist.is_initialized():
            init()

        def build(combiner=combiner, max_vocab_per_gpu=max_vocab_per_gpu, use_hashtable=use_hashtable):
            embedding = sk.DistributedEmbedding(combiner, max_vocab_per_gpu, DIM, SLOTS, MAX_NNZ,
                                                use_hashtable=use_hashtable, embedding_initializer=sok_initializer)
            return SOKDemo(embedding, SLOTS * DIM)

        directory = os.path.join(checkpoint_dir, f"sparse-{combiner}-{use_hashtable}-{world_size}")
        restored = _train_save_restore(build, build(), batches, ref_outputs, directory, rank, world_size, name)
        seen = {k for keys, _ in batches for k in keys.flatten().tolist() if k >= 0}
        _check_exported(restored.embedding_layer, reference.embedding.weight.detach(), rank, world_size, seen, name)
        torch.testing.assert_close(restored.dense_layer.weight.detach(), reference.dense_layer.weight.detach(), **TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_sparse_emb_demo_model_matches_torch_on_the_global_batch(tmp_path, world_size):
    """Follows unit_test/test_scripts/tf2/test_sparse_emb_demo_model_single_worker.py and
    ..._multi_worker.py: SOKDemo (DistributedEmbedding + Dense(ones)) against TfDemo
    (embedding_lookup_sparse on the global batch) for mean / sum, with and without hash
    table, padded (-1) inputs with empty bags and repeated keys; embedding vectors equal at
    every step, then save_params / restore_params (a checkpoint, a new model loading it,
    training on) and check_saved_embedding_variables (the exported keys and vectors)."""
    run(_sparse_demo_worker, world_size, str(tmp_path), str(tmp_path))


# ---- All2AllDenseEmbedding: test_dense_emb_demo_model_{single,multi}_worker ---------------


def _dense_demo_worker(rank, world_size, init, checkpoint_dir):
    for use_hashtable in (True, False):
        name = f"All2AllDenseEmbedding use_hashtable={use_hashtable} world={world_size}"
        max_vocab_per_gpu = 30 // world_size if use_hashtable else 30
        vocabulary_size = max_vocab_per_gpu * world_size if use_hashtable else max_vocab_per_gpu
        batches = [sok_samples(step, vocabulary_size, sparse_mask=False) for step in range(2 * STEPS)]
        width = SLOTS * MAX_NNZ * DIM
        reference = TorchDenseDemo(vocabulary_size, width)
        ref_outputs = torch_reference(reference, batches, 2 * STEPS)
        if not dist.is_initialized():
            init()

        def build(max_vocab_per_gpu=max_vocab_per_gpu, use_hashtable=use_hashtable, width=width):
            embedding = sk.All2AllDenseEmbedding(max_vocab_per_gpu, DIM, SLOTS, MAX_NNZ, use_hashtable=use_hashtable,
                                                 embedding_initializer=sok_initializer)
            return SOKDemo(embedding, width)

        model = build()
        # [B, slot_num, nnz_per_slot] -> [B, slot_num, nnz_per_slot, dim]
        shape = model.embedding_layer(batches[0][0][:2]).shape
        assert tuple(shape) == (2, SLOTS, MAX_NNZ, DIM), name
        model.embedding_layer.weight.grad = None
        directory = os.path.join(checkpoint_dir, f"dense-{use_hashtable}-{world_size}")
        restored = _train_save_restore(build, model, batches, ref_outputs, directory, rank, world_size, name)
        seen = {k for keys, _ in batches for k in keys.flatten().tolist()}
        _check_exported(restored.embedding_layer, reference.embedding.weight.detach(), rank, world_size, seen, name)
    _multi_dense_worker(rank, world_size, init)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_dense_emb_demo_model_matches_torch_on_the_global_batch(tmp_path, world_size):
    """Follows unit_test/test_scripts/tf2/test_dense_emb_demo_model_single_worker.py and
    ..._multi_worker.py: SOKDenseDemo (All2AllDenseEmbedding [B, slot_num, nnz_per_slot]
    -> [B, slot_num, nnz_per_slot, dim], + Dense(ones)) against TfDenseDemo
    (embedding_lookup on the global batch), with and without hash table; then
    save / restore and the exported variables. Then, in the same ranks,
    test_multi_dense_emb_demo_model_mpi.py (and ..._hvd.py): several All2AllDenseEmbedding
    layers of different widths and slot counts in one model, static input and
    dynamic_input=True (unique -> lookup -> gather), the dense gradients summed by hand
    over the ranks; the concatenated vectors equal TFDenseModel's (plain torch) at every
    step."""
    run(_dense_demo_worker, world_size, str(tmp_path), str(tmp_path))


def _restore_on_one(directory):
    """The mean / hash-table model saved after STEPS steps (capacity 30 keys over the
    saving world) restored in this process, without a group, and trained on."""
    vocabulary_size = 30
    batches = [sok_samples(step, vocabulary_size) for step in range(2 * STEPS)]
    reference = TorchSparseDemo("mean", vocabulary_size)
    ref_outputs = torch_reference(reference, batches, 2 * STEPS)
    embedding = sk.DistributedEmbedding("mean", vocabulary_size, DIM, SLOTS, MAX_NNZ,
                                        embedding_initializer=sok_initializer)
    model = SOKDemo(embedding, SLOTS * DIM)
    optimizer = sk.LazyAdam(model.parameters(), lr=LR)
    sk.load_checkpoint(directory, model, optimizer)
    outputs = sok_train(model, optimizer, batches, STEPS, 0, 1, first_step=STEPS)
    for step, out in enumerate(outputs, start=STEPS):
        torch.testing.assert_close(out, ref_outputs[step], **TOL, msg=lambda m, where=f"restored on one, step {step}": f"{where}: {m}")


# ---- several dense embedding layers: test_multi_dense_emb_demo_model_{mpi,hvd} -------------


MULTI_SLOTS = [2, 1]
MULTI_DIMS = [4, 8]
MULTI_NNZ = 2


class MultiDenseModel(nn.Module):
    """SOKDenseModel / TFDenseModel of SOK's DenseDemo: one dense embedding per group of
    slots (its own table and width), their outputs concatenated, then an MLP. ``lookups``
    maps (layer index, keys [B, slots, nnz]) -> [B, slots, nnz, dim]."""

    def __init__(self, embeddings: nn.ModuleList, lookups):
        super().__init__()
        self.embedding_layers = embeddings
        self.lookups = lookups
        width = sum(s * MULTI_NNZ * d for s, d in zip(MULTI_SLOTS, MULTI_DIMS))
        with torch.random.fork_rng():
            torch.manual_seed(3)  # the same dense layers on every rank and in the reference
            self.dense_layer = nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, keys):
        vectors, first = [], 0
        for i, slots in enumerate(MULTI_SLOTS):
            part = keys[:, first:first + slots]
            vectors.append(self.lookups(self.embedding_layers[i], part).reshape(keys.shape[0], -1))
            first += slots
        flat = torch.cat(vectors, dim=1)
        return self.dense_layer(flat), flat


def _static_lookup(layer, keys):
    return layer(keys)


def _unique_lookup(layer, keys):
    # dynamic_input=True: unique -> lookup -> gather, as SOK's DenseDemo with --dynamic_input 1.
    unique, inverse = sk.ops.unique(keys.reshape(-1))
    return layer(unique)[inverse].view(*keys.shape, -1)


def _torch_lookup(embedding, keys):
    return embedding(keys)


def _multi_dense_worker(rank, world_size, init):
    vocabulary_size = 24
    for dynamic_input in (False, True):
        name = f"multi dense dynamic_input={dynamic_input} world={world_size}"
        batches = [sok_samples(step, vocabulary_size, sparse_mask=False, width=MULTI_NNZ) for step in range(STEPS)]
        tables = nn.ModuleList(nn.Embedding(vocabulary_size, d, sparse=True) for d in MULTI_DIMS)
        for table in tables:
            with torch.no_grad():
                table.weight.copy_(sok_initializer(torch.arange(vocabulary_size), table.embedding_dim))
        reference = MultiDenseModel(tables, _torch_lookup)
        ref_outputs = torch_reference(reference, batches, STEPS, tables)
        if not dist.is_initialized():
            init()
        layers = nn.ModuleList(
            sk.All2AllDenseEmbedding(vocabulary_size // world_size, d, s, MULTI_NNZ, dynamic_input=dynamic_input,
                                     embedding_initializer=sok_initializer)
            for s, d in zip(MULTI_SLOTS, MULTI_DIMS))
        model = MultiDenseModel(layers, _unique_lookup if dynamic_input else _static_lookup)
        optimizer = sk.LazyAdam(model.parameters(), lr=LR)
        outputs = sok_train(model, optimizer, batches, STEPS, rank, world_size)
        per_rank = GLOBAL_BATCH // world_size
        for step, out in enumerate(outputs):
            expected = ref_outputs[step][rank * per_rank:(rank + 1) * per_rank]
            torch.testing.assert_close(out, expected, **TOL, msg=lambda m, where=f"{name} step {step}": f"{where}: {m}")
        for mine, theirs in zip(model.dense_layer.parameters(), reference.dense_layer.parameters()):
            torch.testing.assert_close(mine.detach(), theirs.detach(), **TOL)


# ---- lookup_sparse over several tables: lookup_sparse_distributed_test --------------------


ROWS = [40, 16]
COLS = [8, 4]
HOTNESS = [4, 2]
COMBINERS = ["mean", "sum"]
LOOKUP_ITERS = 4
LOOKUP_BATCH = 8


def _lookup_indices(table: int, step: int):
    """Ragged, 1..hotness keys per sample in [0, rows) (as SOK's test: no empty rows)."""
    g = torch.Generator().manual_seed(100 * table + step)
    lengths = torch.randint(1, HOTNESS[table] + 1, (LOOKUP_BATCH,), generator=g)
    values = torch.randint(0, ROWS[table], (int(lengths.sum()),), generator=g)
    return values, lengths


def _lookup_sparse_worker(rank, world_size, init):
    # Reference: tf.nn.embedding_lookup_sparse per table, SGD(lr=1), loss = sum of every output.
    ref_tables = [nn.EmbeddingBag(ROWS[i], COLS[i], mode=COMBINERS[i], sparse=True) for i in range(2)]
    configs = [sk.TableConfig(f"t{i}", COLS[i], ROWS[i], [f"f{i}"], combiner=COMBINERS[i],
                              initializer=sok_initializer) for i in range(2)]
    for i, table in enumerate(ref_tables):
        with torch.no_grad():
            table.weight.copy_(sok_initializer(torch.arange(ROWS[i]), COLS[i]))
    ref_opt = torch.optim.SGD([t.weight for t in ref_tables], lr=1.0)
    ref_losses = []
    for step in range(LOOKUP_ITERS):
        loss = 0
        for i, table in enumerate(ref_tables):
            values, lengths = _lookup_indices(i, step)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
            loss = loss + table(values, offsets).sum()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    init()
    ebc = sk.EmbeddingBagCollection(configs)
    opt = torch.optim.SGD(ebc.parameters(), lr=1.0)
    per_rank = LOOKUP_BATCH // world_size
    for step in range(LOOKUP_ITERS):
        values, lengths = [], []
        for i in range(2):
            v, ln = _lookup_indices(i, step)
            start = int(ln[:rank * per_rank].sum())
            mine = ln[rank * per_rank:(rank + 1) * per_rank]
            values.append(v[start:start + int(mine.sum())])
            lengths.append(mine)
        kjt = sk.KeyedJagged(["f0", "f1"], torch.cat(values), lengths=torch.cat(lengths))
        out = ebc(kjt)
        loss = out["f0"].sum() + out["f1"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total)  # hvd.allreduce(loss, op=Sum)
        assert abs(total.item() - ref_losses[step]) <= 1e-4 * max(1.0, abs(ref_losses[step])), (step, total, ref_losses)
    for i in range(2):
        keys, vectors = ebc.export(f"t{i}")
        torch.testing.assert_close(vectors, ref_tables[i].weight.detach()[keys.long()], **TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_lookup_sparse_over_two_tables_matches_torch(tmp_path, world_size):
    """Follows sparse_operation_kit/examples/lookup_example_tf2/lookup_sparse_distributed_test.py:
    two tables of different widths, combiners mean and sum, ragged batches of 1..hotness
    keys, SGD(lr=1.0) on the sum of every output; the per-step global loss and the tables'
    rows after training equal plain torch on the global batch."""
    run(_lookup_sparse_worker, world_size, str(tmp_path))


# ---- unpooled lookups with repeated keys: dynamic_variable_test ---------------------------


def _dynamic_variable_worker(rank, world_size, init):
    for optimizer_name in ("sgd", "lazy_adam"):
        _dynamic_variable_case(rank, world_size, init, optimizer_name)


def _dynamic_variable_case(rank, world_size, init, optimizer_name):
    vocab, iters, batch = 24, 5, 10
    ref_weight = nn.Parameter(sok_initializer(torch.arange(vocab), DIM))
    ref_opt = torch.optim.SGD([ref_weight], lr=1.0) if optimizer_name == "sgd" else \
        torch.optim.SparseAdam([ref_weight], lr=LR)
    draws = []
    for step in range(iters):
        g = torch.Generator().manual_seed(500 + step)
        indices = torch.randint(0, vocab, (world_size * batch,), generator=g)  # repeats within and across ranks
        weight = torch.rand(world_size * batch, DIM, generator=g)
        draws.append((indices, weight))
        loss = (nn.functional.embedding(indices, ref_weight, sparse=True) * weight).sum()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    if not dist.is_initialized():
        init()
    layer = sk.All2AllDenseEmbedding(vocab, DIM, 1, 1, dynamic_input=True, embedding_initializer=sok_initializer)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0) if optimizer_name == "sgd" else \
        sk.LazyAdam(layer.parameters(), lr=LR)
    for indices, weight in draws:
        mine = slice(rank * batch, (rank + 1) * batch)
        emb = layer(indices[mine])
        assert emb.shape == (batch, DIM)
        (emb * weight[mine]).sum().backward()
        opt.step()
        opt.zero_grad()
    keys, vectors = layer.export()  # sok.export
    assert all(k % world_size == rank for k in keys.tolist())
    torch.testing.assert_close(vectors, ref_weight.detach()[keys.long()], **TOL)
    # The whole table read back in eval (tf.nn.embedding_lookup(sok_var, range(vocab))).
    layer.eval()
    with torch.no_grad():
        everything = layer(torch.arange(vocab))
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.cat([d[0] for d in draws])] = True
    expected = torch.where(seen.unsqueeze(1), ref_weight.detach(), torch.zeros(()))
    torch.testing.assert_close(everything, expected, **TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_dynamic_variable_lookup_with_repeated_keys_matches_torch(tmp_path, world_size):
    """Follows sparse_operation_kit/examples/utils_example_tf2/dynamic_variable_test.py (and
    assign_and_export_test.py's export check): embedding_lookup of random indices with
    repeats (within and across ranks), times a random weight, summed; SGD(lr=1) and a
    lazy Adam; the exported table equals torch's rows for the keys seen."""
    run(_dynamic_variable_worker, world_size, str(tmp_path))


# ---- filter_variables_test ----------------------------------------------------------------


def test_split_embedding_variable_from_others():
    """Follows sparse_operation_kit/examples/utils_example_tf2/filter_variables_test.py and
    SOK's split_embedding_variable_from_others: every layer's shard, and only those, is an
    embedding variable; the order of the given list is kept in each part."""
    dense = sk.All2AllDenseEmbedding(8, DIM, SLOTS, MAX_NNZ)
    sparse = sk.DistributedEmbedding("sum", 8, DIM, SLOTS, MAX_NNZ, use_hashtable=False)
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("a", DIM, 8, ["fa"]), sk.TableConfig("b", 2, 8, ["fb"])])
    top = nn.Linear(3, 1)
    model = nn.ModuleDict({"d": dense, "top": top, "s": sparse, "c": ebc})
    embedding, others = sk.split_embedding_variable_from_others(model.parameters())
    assert [id(p) for p in embedding] == [id(dense.weight), id(sparse.weight), id(ebc.weights["a"]),
                                          id(ebc.weights["b"])]
    assert [id(p) for p in others] == [id(top.weight), id(top.bias)]
    named_embedding, named_others = sk.split_embedding_variable_from_others(model.named_parameters())
    assert [name for name, _ in named_others] == ["top.weight", "top.bias"]
    assert len(named_embedding) == 4

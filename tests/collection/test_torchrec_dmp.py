"""Model-parallel collections in TorchRec's setting: the keyed output over a process group,
and TorchRec's DistributedModelParallel around a DLRM whose collection is sparsekit's. DMP
shards none of sparsekit's tables (the collection shards itself over the process group),
and its DDP wrapper leaves them alone when given ``sk.keep_out_of_ddp(model)``; the dense
part is then data-parallel. The DMP test runs where torchrec installs, at world 1 and 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import sparsekit as sk
from _distributed import spawn

pytestmark = pytest.mark.distributed

FEATURES = ["f0", "f1", "f2"]


def _dmp_worker(rank, world_size, init):
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    init()
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f])
               for i, f in enumerate(FEATURES)]
    ebc = sk.EmbeddingBagCollection(configs)
    assert ebc.world_size == world_size
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8],
                 over_arch_layer_sizes=[8, 1])
    ignored = sk.keep_out_of_ddp(model)
    assert ignored == [f"sparse_arch.embedding_bag_collection.shards.{i}.weight" for i in range(3)]
    shards = [p.detach().clone() for p in ebc.parameters()]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   data_parallel_wrapper=DefaultDataParallelWrapper(params_to_ignore=ignored))
    ddp = dmp._dmp_wrapped_module
    assert isinstance(ddp, DistributedDataParallel)
    assert set(ignored) <= set(ddp.parameters_to_ignore)
    assert all(torch.equal(a, b) for a, b in zip(shards, ebc.parameters()))  # no broadcast of a shard

    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (len(FEATURES) * 16,), generator=g)
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.randint(0, 100, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    dense = torch.randn(16, 4, generator=g)
    target = torch.rand(16, generator=g).round()
    optimizer = sk.LazyAdam(dmp.parameters(), lr=0.02)
    losses = []
    for _ in range(40):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7, losses
    # The dense part is data-parallel: every rank holds the same numbers.
    for param in model.dense_arch.parameters():
        gathered = [torch.empty_like(param) for _ in range(world_size)]
        dist.all_gather(gathered, param.detach().contiguous())
        assert all(torch.equal(gathered[0], other) for other in gathered)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_dlrm_trains_under_distributed_model_parallel(tmp_path, world_size):
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    spawn(_dmp_worker, world_size, str(tmp_path))


def _keyed_worker(rank, world_size, init):
    init()
    tables = [sk.TableConfig("a", 4, 64, ["f0", "f2"]), sk.TableConfig("b", 8, 64, ["f1"])]
    keyed, plain = sk.EmbeddingBagCollection(tables, output="keyed"), sk.EmbeddingBagCollection(tables)
    g = torch.Generator().manual_seed(rank)
    for features in (["f1", "f0", "f2"], ["f2"] if rank == 0 else ["f0", "f1"]):
        lengths = torch.randint(0, 3, (len(features) * 5,), generator=g)
        kjt = sk.KeyedJagged(features, torch.randint(0, 1000, (int(lengths.sum()),), generator=g), lengths=lengths)
        out, reference = keyed(kjt), plain(kjt)
        assert out.keys() == ["f0", "f2", "f1"] and out.length_per_key() == [4, 4, 8]
        want = torch.cat([reference[f] if f in reference else torch.zeros(5, d)
                          for f, d in (("f0", 4), ("f2", 4), ("f1", 8))], dim=1)
        torch.testing.assert_close(out.values(), want)
        out.values().square().sum().backward()
        sum(v.square().sum() for v in reference.values()).backward()
        for a, b in zip(keyed.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense())
            a.grad = b.grad = None


def test_a_keyed_output_over_a_process_group_is_the_dict_in_config_order(tmp_path):
    spawn(_keyed_worker, 2, str(tmp_path))


def _pipeline_worker(rank, world_size, init):
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineBase
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    init()
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f])
               for i, f in enumerate(FEATURES)]
    ebc = sk.EmbeddingBagCollection(configs, fused_params={"optimizer": "rowwise_adagrad", "lr": 0.1})
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8],
                           over_arch_layer_sizes=[8, 1]))
    ignored = sk.keep_out_of_ddp(model)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   data_parallel_wrapper=DefaultDataParallelWrapper(params_to_ignore=ignored))
    dense = KeyedOptimizerWrapper({n: p for n, p in dmp.named_parameters() if "embedding_bag_collection" not in n},
                                  lambda params: torch.optim.Adagrad(params, lr=0.1))
    # TorchRec's way of stepping its fused and dense optimizers together.
    optimizer = CombinedOptimizer([dmp.fused_optimizer, ("embeddings", ebc.fused_optimizer), dense])
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (len(FEATURES) * 16,), generator=g)
    batch = Batch(dense_features=torch.randn(16, 4, generator=g),
                  sparse_features=KeyedJaggedTensor(keys=FEATURES, lengths=lengths,
                                                    values=torch.randint(0, 100, (int(lengths.sum()),), generator=g)),
                  labels=torch.rand(16, generator=g).round())
    pipeline = TrainPipelineBase(dmp, optimizer, torch.device("cpu"))
    batches, losses = iter([batch] * 40), []
    while True:
        try:
            losses.append(float(pipeline.progress(batches)[0]))
        except StopIteration:
            break
    assert len(losses) == 40
    assert losses[-1] < losses[0] * 0.7, losses
    keys = set(optimizer.state_dict()["state"])
    assert {f"embeddings.shards.{i}.weight" for i in range(3)} <= keys, sorted(keys)


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchrecs_train_pipeline_and_combined_optimizer_train_a_dlrm_with_fused_tables(tmp_path, world_size):
    """TorchRec's TrainPipelineBase over a DMP-wrapped DLRMTrain, stepping one
    CombinedOptimizer of DMP's fused optimizer, the collection's and the dense one."""
    pytest.importorskip("torchrec", reason="torchrec (and fbgemm-gpu-cpu) not installed")
    spawn(_pipeline_worker, world_size, str(tmp_path))

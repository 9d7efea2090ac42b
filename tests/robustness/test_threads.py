"""Training forwards of one layer or collection from several Python threads at once: each
forward's table work holds the layer's step lock, so the threads' steps act in some serial
order (docs/design.md, "Threads")."""

import copy
import pickle
import threading

import pytest
import torch

import sparsekit as sk

D = 4


@pytest.fixture(autouse=True)
def _one_thread():
    # The race is between the two Python threads; torch's own pool would only slow it down.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _in_threads(functions):
    barrier = threading.Barrier(len(functions))
    errors = []

    def run(function):
        barrier.wait()
        try:
            function()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in functions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _key_state(shard, stats):
    """Key -> vector and key -> gradient, the stats and the clock: what a serial order fixes."""
    keys, vectors = shard.export()
    rows = shard.hash_table.find(keys)
    assert rows.unique().numel() == keys.numel(), "two keys share a row"
    grad = shard.weight.grad.to_dense()
    return ({k: v for k, v in zip(keys.tolist(), vectors)}, {k: grad[r] for k, r in zip(keys.tolist(), rows.tolist())},
            stats, shard.hash_table.clock)


def _same(a, b):
    return (a[0].keys() == b[0].keys() and a[2:] == b[2:] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and all(torch.allclose(a[1][k], b[1][k], atol=1e-5) for k in a[1]))


def _check_serial(make, forward, states, batches, trials, evicting=False):
    """Two threads, each a training step (forward and backward) of its batch on one layer,
    give the result of one of the two serial orders, every time. With ``evicting`` the
    threads run the forwards only and the backwards follow in this thread (docs/design.md: a
    backward running while another thread's forward evicts is not covered, and the steps'
    gradients then match no serial order: the test failed about one run in ten); two
    forwards then two backwards give the serial steps' result."""

    def step(layer, keys, scale):
        out = forward(layer, keys)
        (out * scale).sum().backward()
        return out.detach()

    serial = []
    for order in ((0, 1), (1, 0)):
        layer = make()
        outs = [step(layer, batches[i], i + 1) for i in order]
        serial.append((states(layer), [outs[order.index(i)] for i in range(2)]))
    for _ in range(trials):
        layer = make()
        outs = [None, None]

        def one(i, layer=layer, outs=outs):
            outs[i] = forward(layer, batches[i]) if evicting else step(layer, batches[i], i + 1)

        _in_threads([lambda: one(0), lambda: one(1)])
        if evicting:
            for i in range(2):
                (outs[i] * (i + 1)).sum().backward()
            outs = [out.detach() for out in outs]
        got = states(layer)
        assert any(all(_same(g, s) for g, s in zip(got, st)) and all(torch.equal(o, e) for o, e in zip(outs, so))
                   for st, so in serial), f"stats {[g[2] for g in got]}, serial {[s[2] for s in serial[0][0]]}"


def _batches(n, span):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, span, (n,), generator=g), torch.randint(span // 2, span + span // 2, (n,), generator=g)]


def _layer_forward(layer, keys):
    return layer(keys.view(-1, 1, 1)) if isinstance(layer, sk.DistributedEmbedding) else layer(keys)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: sk.DistributedEmbedding("sum", 100_000, D, 1, 1), id="hash"),
    pytest.param(lambda: sk.All2AllDenseEmbedding(12_000, D, 1, 1, dynamic_input=True, eviction="lru"), id="evicting"),
    pytest.param(lambda: sk.All2AllDenseEmbedding(100_000, D, 1, 1, dynamic_input=True, admit_after=2),
                 id="admission"),
])
def test_training_steps_of_one_layer_in_two_threads_act_in_a_serial_order(make):
    # Before the step lock: keys shared rows, the table counted rows no key held, admission
    # counts of keys both batches saw were lost, and an evicting table's export raised.
    _check_serial(make, _layer_forward, lambda layer: [_key_state(layer, layer.stats())], _batches(8_000, 80_000),
                  trials=4, evicting=make().eviction is not None)


def test_training_steps_of_one_collection_in_two_threads_act_in_a_serial_order():
    n = 4_000
    names = ("plain", "lru", "admit")

    def make():
        return sk.EmbeddingBagCollection([sk.TableConfig("plain", D, 100_000, ["a"]),
                                          sk.TableConfig("lru", D, 6_000, ["b"], eviction="lru"),
                                          sk.TableConfig("admit", D, 100_000, ["c"], admit_after=2)])

    def forward(ebc, values):
        out = ebc(sk.KeyedJagged(["a", "b", "c"], values, lengths=torch.ones(3 * n, dtype=torch.int64)))
        return torch.cat([out[f] for f in "abc"])

    # The "lru" table evicts: forwards in the threads, backwards after them (see _check_serial).
    _check_serial(make, forward, lambda ebc: [_key_state(ebc._shard(t), ebc.stats(t)) for t in names],
                  _batches(3 * n, 40_000), trials=4, evicting=True)


@pytest.mark.parametrize("kind", ["layer", "collection"])
def test_a_training_forward_waits_for_the_step_lock_and_eval_does_not(kind):
    if kind == "layer":
        module = sk.All2AllDenseEmbedding(16, D, 1, 1, dynamic_input=True)

        def forward():
            return module(torch.tensor([1, 2]))
    else:
        module = sk.EmbeddingBagCollection([sk.TableConfig("t", D, 16, ["f"])])

        def forward():
            return module(sk.KeyedJagged(["f"], torch.tensor([1, 2]), lengths=torch.tensor([2])))["f"]
    done = threading.Event()
    thread = threading.Thread(target=lambda: (forward(), done.set()))
    with module._step_lock:  # another thread's step halfway
        thread.start()
        assert not done.wait(0.3), "a training forward ran while another step held the layer"
    thread.join(10)
    assert done.is_set()
    module.eval()
    # Eval lookups of one process only read: they do not wait. (In another thread: the lock
    # is re-entrant, so one held by this thread would let this thread's forward through anyway.)
    done.clear()
    thread = threading.Thread(target=lambda: (forward(), done.set()))
    with module._step_lock:
        thread.start()
        assert done.wait(30), "an eval forward waited for another thread's step"
    thread.join(10)


@pytest.mark.parametrize("kind", ["layer", "collection"])
def test_copies_get_their_own_step_lock(kind):
    module = (sk.DistributedEmbedding("sum", 16, D, 1, 2) if kind == "layer"
              else sk.EmbeddingBagCollection([sk.TableConfig("t", D, 16, ["f"])]))
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert copied._step_lock is not module._step_lock
        with copied._step_lock, copied._step_lock:  # a working re-entrant lock
            pass
    state = module.__getstate__()
    assert "_step_lock" not in state and "_step_lock" in module.__dict__  # the state is a copy

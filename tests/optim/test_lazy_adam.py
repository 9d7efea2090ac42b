import copy
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples, num_threads, thread_counts

import sparsekit as sk
from sparsekit import shard_registry

# torch's CPU sqrt (vectorized through MKL) can differ from the correctly rounded one in
# the last bit, so weights are compared to torch within a few ulps; moments, which need
# no sqrt, are compared bit for bit.
WEIGHT_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float64: dict(rtol=1e-13, atol=1e-15)}
# Sums of the same gradients in another order: an absolute error of a few ulps of the terms.
SUM_ORDER_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-14)}


def reference_lazy_adam(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay=0.0):
    """The SparseAdam update in plain torch (in the dtype of weight, or float32 for half types)."""
    compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    weight, exp_avg, exp_avg_sq = weight.clone(), exp_avg.clone(), exp_avg_sq.clone()
    r = rows.long()
    w = weight[r].to(compute)
    g = grad.to(compute)
    if weight_decay != 0.0:
        g = g + weight_decay * w
    m_old, v_old = exp_avg[r].to(compute), exp_avg_sq[r].to(compute)
    m = m_old + (g - m_old) * (1 - beta1)
    v = v_old + (g * g - v_old) * (1 - beta2)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    weight[r] = (w + (-step_size) * (m / (v.sqrt() + eps))).to(weight.dtype)
    exp_avg[r] = m.to(weight.dtype)
    exp_avg_sq[r] = v.to(weight.dtype)
    return weight, exp_avg, exp_avg_sq


def random_state(num_rows, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen, dtype=torch.float64).to(dtype)
    exp_avg = (0.1 * torch.randn(num_rows, dim, generator=gen, dtype=torch.float64)).to(dtype)
    exp_avg_sq = (0.01 * torch.rand(num_rows, dim, generator=gen, dtype=torch.float64)).to(dtype)
    return weight.to(device), exp_avg.to(device), exp_avg_sq.to(device)


def random_rows_and_grad(num_rows, num_updates, dim, dtype, device, seed=1, index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(num_rows, generator=gen)[:num_updates].to(index_dtype)
    grad = torch.randn(num_updates, dim, generator=gen, dtype=torch.float64).to(dtype)
    return rows.to(device), grad.to(device)


# ---- the op ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_op_against_reference(device, dtype, weight_decay, index_dtype):
    weight, exp_avg, exp_avg_sq = random_state(300, 37, dtype, device)
    rows, grad = random_rows_and_grad(300, 120, 37, dtype, device, index_dtype=index_dtype)
    args = (rows, grad, 3, 0.01, 0.9, 0.999, 1e-8, weight_decay)
    want = reference_lazy_adam(weight, exp_avg, exp_avg_sq, *args)
    before = weight.clone(), exp_avg.clone(), exp_avg_sq.clone()
    sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, *args)
    assert torch.equal(exp_avg, want[1])
    assert torch.equal(exp_avg_sq, want[2])
    torch.testing.assert_close(weight, want[0], **WEIGHT_TOL[dtype])
    untouched = torch.ones(300, dtype=torch.bool, device=device)
    untouched[rows.long()] = False
    for got, old in zip((weight, exp_avg, exp_avg_sq), before):
        assert torch.equal(got[untouched], old[untouched])
        assert not torch.equal(got[~untouched], old[~untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_half_types(device, dtype):
    weight, exp_avg, exp_avg_sq = random_state(64, 16, dtype, device)
    rows, grad = random_rows_and_grad(64, 20, 16, dtype, device)
    want = reference_lazy_adam(weight, exp_avg, exp_avg_sq, rows, grad, 1, 0.01, 0.9, 0.999, 1e-8)
    sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, grad, 1, 0.01, 0.9, 0.999, 1e-8)
    for got, ref in zip((weight, exp_avg, exp_avg_sq), want):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)


def test_op_matches_cpu_bit_for_bit(device):
    """The CUDA kernel rounds once per operation, as the CPU kernel does."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        state = random_state(200, 33, dtype, "cpu")
        rows, grad = random_rows_and_grad(200, 90, 33, dtype, "cpu")
        on_device = [t.to(device) for t in state]
        sk.ops.lazy_adam_(*state, rows, grad, 7, 0.003, 0.8, 0.99, 1e-6, 0.01)
        sk.ops.lazy_adam_(*on_device, rows.to(device), grad.to(device), 7, 0.003, 0.8, 0.99, 1e-6, 0.01)
        for got, want in zip(on_device, state):
            assert torch.equal(got.cpu(), want)


def test_op_higher_dim_and_noncontiguous_grad(device):
    weight, exp_avg, exp_avg_sq = (t.view(50, 4, 3) for t in random_state(50, 12, torch.float64, device))
    rows, grad = random_rows_and_grad(50, 10, 12, torch.float64, device)
    grad = grad.view(10, 3, 4).transpose(1, 2)  # [10, 4, 3], not contiguous
    want = reference_lazy_adam(weight, exp_avg, exp_avg_sq, rows, grad, 2, 0.1, 0.9, 0.99, 1e-8)
    sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, grad, 2, 0.1, 0.9, 0.99, 1e-8)
    assert torch.equal(exp_avg, want[1])
    torch.testing.assert_close(weight, want[0], **WEIGHT_TOL[torch.float64])


def test_op_empty(device):
    weight, exp_avg, exp_avg_sq = random_state(10, 4, torch.float32, device)
    before = weight.clone()
    empty_rows = torch.empty(0, dtype=torch.int64, device=device)
    sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, empty_rows, torch.empty(0, 4, device=device),
                      1, 0.1, 0.9, 0.999, 1e-8)
    assert torch.equal(weight, before)
    empty_table = torch.empty(0, 4, device=device)
    sk.ops.lazy_adam_(empty_table, empty_table.clone(), empty_table.clone(), empty_rows,
                      torch.empty(0, 4, device=device), 1, 0.1, 0.9, 0.999, 1e-8)


@pytest.mark.parametrize("num_rows", [20, 1_000_000])  # the bitmap of weight's rows, the sorted copy
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_op_repeated_row_names_it(device, num_rows, index_dtype):
    weight, exp_avg, exp_avg_sq = (torch.zeros(num_rows, 3, device=device) for _ in range(3))
    rows = torch.tensor([5, num_rows - 1, 0, 5], dtype=index_dtype, device=device)
    with pytest.raises(RuntimeError, match=r"rows holds row 5 more than once; rows must be distinct"):
        sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows, torch.ones(4, 3, device=device), 1, 0.1, 0.9, 0.999,
                          1e-8)
    assert not weight.any() and not exp_avg.any() and not exp_avg_sq.any()


@given(num_rows=st.sampled_from([1, 2, 64, 1000, 70_000, 300_000, 1_000_000]), num_updates=st.integers(2, 3000),
       repeat=st.booleans(), ascending=st.booleans(), index_dtype=st.sampled_from([torch.int64, torch.int32]),
       threads=thread_counts, seed=st.integers(0, 2**31))
@examples(10)
def test_op_repeated_rows_raise_and_write_nothing(device, num_rows, num_updates, repeat, ascending, index_dtype,
                                                  threads, seed):
    """A row given twice raises (it would be updated twice, by racing threads) and nothing
    changes; distinct rows update. Strictly ascending rows pass on one compare a row; others
    are checked, up to 128 rows per update (+ 2^16), with a bitmap of their rows, larger
    ones with a sorted copy: all three are crossed, and sorted rows with their repeat side
    by side, which ascend but not strictly."""
    g = torch.Generator().manual_seed(seed)
    num_updates = min(num_updates, num_rows + int(repeat))
    if num_updates < 2:
        return
    rows = torch.randperm(num_rows, generator=g)[:num_updates - int(repeat)]
    if repeat:
        position = int(torch.randint(0, rows.numel() + 1, (1,), generator=g))
        rows = torch.cat([rows[:position], rows[int(torch.randint(0, rows.numel(), (1,), generator=g))].view(1),
                          rows[position:]])
    if ascending:
        rows = rows.sort().values
    weight, exp_avg, exp_avg_sq = (torch.zeros(num_rows, 2, device=device) for _ in range(3))
    grad = torch.ones(rows.numel(), 2, device=device)
    with num_threads(threads):
        if repeat:
            row = int(torch.nonzero(torch.bincount(rows) > 1).view(-1)[0])  # the one row given twice
            with pytest.raises(RuntimeError, match=rf"rows holds row {row} more than once.*nothing was updated"):
                sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows.to(device, index_dtype), grad, 1, 0.1, 0.9,
                                  0.999, 1e-8)
            assert not weight.any() and not exp_avg.any() and not exp_avg_sq.any()
        else:
            sk.ops.lazy_adam_(weight, exp_avg, exp_avg_sq, rows.to(device, index_dtype), grad, 1, 0.1, 0.9, 0.999,
                              1e-8)
            assert int(torch.count_nonzero(exp_avg.any(dim=1))) == rows.numel()


def test_op_opcheck(device):
    weight, exp_avg, exp_avg_sq = random_state(20, 8, torch.float32, device)
    rows, grad = random_rows_and_grad(20, 6, 8, torch.float32, device)
    torch.library.opcheck(torch.ops.sparsekit.lazy_adam_,
                          (weight, exp_avg, exp_avg_sq, rows, grad, 1, 0.01, 0.9, 0.999, 1e-8),
                          {"weight_decay": 0.1})


def test_op_bad_inputs(device):
    weight, exp_avg, exp_avg_sq = random_state(20, 8, torch.float32, device)
    rows, grad = random_rows_and_grad(20, 6, 8, torch.float32, device)
    hyper = (1, 0.01, 0.9, 0.999, 1e-8)

    def call(w=weight, m=exp_avg, v=exp_avg_sq, r=rows, g=grad, h=hyper, wd=0.0):
        sk.ops.lazy_adam_(w, m, v, r, g, *h, wd)

    before = weight.clone(), exp_avg.clone(), exp_avg_sq.clone()
    for bad_row in (20, -1, 2**40):
        bad_rows = rows.clone()
        bad_rows[3] = bad_row
        with pytest.raises(RuntimeError, match=rf"rows holds {bad_row}, outside \[0, 20\).*nothing was updated"):
            call(r=bad_rows)
    for got, old in zip((weight, exp_avg, exp_avg_sq), before):
        assert torch.equal(got, old), "a rejected update must write nothing"
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        call(h=(0, 0.01, 0.9, 0.999, 1e-8))
    with pytest.raises(RuntimeError, match="lr must be >= 0"):
        call(h=(1, -0.01, 0.9, 0.999, 1e-8))
    with pytest.raises(RuntimeError, match=r"beta1 must be in \[0, 1\)"):
        call(h=(1, 0.01, 1.0, 0.999, 1e-8))
    with pytest.raises(RuntimeError, match=r"beta2 must be in \[0, 1\)"):
        call(h=(1, 0.01, 0.9, -0.1, 1e-8))
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        call(h=(1, 0.01, 0.9, 0.999, -1.0))
    with pytest.raises(RuntimeError, match="weight_decay must be >= 0"):
        call(wd=-0.5)
    with pytest.raises(RuntimeError, match="must have the dtype of weight"):
        call(g=grad.double())
    with pytest.raises(RuntimeError, match="must have the shape of weight"):
        call(m=exp_avg[:10])
    with pytest.raises(RuntimeError, match="grad must have shape"):
        call(g=grad[:, :4])
    with pytest.raises(RuntimeError, match="grad must have shape"):
        call(g=grad[:5])
    with pytest.raises(RuntimeError, match="must be contiguous"):
        call(w=weight.t().contiguous().t())
    with pytest.raises(RuntimeError, match="rows must be an int64 or int32"):
        call(r=rows.float())
    with pytest.raises(RuntimeError, match="weight must be float32"):
        call(w=weight.long(), m=exp_avg.long(), v=exp_avg_sq.long(), g=grad.long())
    if device.type != "cpu":
        with pytest.raises(RuntimeError, match="on one device"):
            call(r=rows.cpu())


# ---- the optimizer ----


def embedding_model(num_rows, dim, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(num_rows, dim, sparse=True).to(dtype)
    return emb


def embedding_batches(num_rows, steps, batch, seed=5):
    gen = torch.Generator().manual_seed(seed)
    # Few distinct ids per batch, so gradients are uncoalesced with many duplicate rows.
    return [torch.randint(0, num_rows // 3, (batch,), generator=gen) * 3 for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "duplicates"])
def test_lazy_adam_matches_sparse_adam(device, dtype, coalesce):
    """Step by step against torch.optim.SparseAdam on nn.Embedding(sparse=True) gradients.

    With coalesced gradients both optimizers see the same numbers and the moments match
    bit for bit. With nn.Embedding's raw gradients (duplicate rows), SparseAdam sums the
    duplicates in .coalesce()'s order and LazyAdam in position order (segment_sum), so
    the sums, and with them the moments, may differ in the last bit.
    """
    num_rows, dim = 60, 8
    ours, theirs = embedding_model(num_rows, dim, dtype).to(device), embedding_model(num_rows, dim, dtype).to(device)
    opt_ours = sk.LazyAdam(ours.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-7)
    opt_theirs = torch.optim.SparseAdam(theirs.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-7)
    initial = ours.weight.detach().clone()
    touched = torch.zeros(num_rows, dtype=torch.bool, device=device)
    gen = torch.Generator().manual_seed(2)
    for ids in embedding_batches(num_rows, 6, 40):
        ids = ids.to(device)
        touched[ids] = True
        # A loss linear in the weights: the gradients stay exactly comparable even when
        # torch's sqrt moves a weight by an ulp.
        coefficients = torch.randn(40, dim, generator=gen, dtype=dtype).to(device)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            (model(ids) * coefficients).sum().backward()
            if coalesce:
                model.weight.grad = model.weight.grad.coalesce()
        assert ours.weight.grad.is_coalesced() == coalesce
        opt_ours.step()
        opt_theirs.step()
        ours_state, theirs_state = opt_ours.state[ours.weight], opt_theirs.state[theirs.weight]
        for key in ("exp_avg", "exp_avg_sq"):
            if coalesce:
                assert torch.equal(ours_state[key], theirs_state[key])
            else:
                torch.testing.assert_close(ours_state[key], theirs_state[key], **SUM_ORDER_TOL[dtype])
        torch.testing.assert_close(ours.weight, theirs.weight, **(WEIGHT_TOL if coalesce else SUM_ORDER_TOL)[dtype])
        assert int(ours_state["step"]) == theirs_state["step"]
    # Rows never in a batch keep their initial weights and zero moments, bit for bit.
    state = opt_ours.state[ours.weight]
    assert bool((~touched).any())
    assert torch.equal(ours.weight.detach()[~touched], initial[~touched])
    assert not bool(state["exp_avg"][~touched].any()) and not bool(state["exp_avg_sq"][~touched].any())


def test_lazy_adam_uncoalesced_duplicates_equal_coalesced(device):
    weight = torch.randn(10, 3, dtype=torch.float64, device=device)
    indices = torch.tensor([[4, 1, 4, 4, 7, 1]], device=device)
    values = torch.randn(6, 3, dtype=torch.float64, device=device)
    grads = {
        "uncoalesced": torch.sparse_coo_tensor(indices, values, (10, 3)),
        "coalesced": torch.sparse_coo_tensor(indices, values, (10, 3)).coalesce(),
    }
    results = {}
    for name, grad in grads.items():
        param = torch.nn.Parameter(weight.clone())
        opt = sk.LazyAdam([param], lr=0.1)
        param.grad = grad
        opt.step()
        results[name] = (param.detach(), opt.state[param]["exp_avg"])
    torch.testing.assert_close(results["uncoalesced"][0], results["coalesced"][0], rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(results["uncoalesced"][1], results["coalesced"][1], rtol=1e-14, atol=1e-15)
    # The summed gradient of row 4 is the sum of its three entries.
    torch.testing.assert_close(results["coalesced"][1][4], 0.1 * values[[0, 2, 3]].sum(0))


def test_lazy_adam_dense_matches_adam(device):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).to(device)
    theirs = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).to(device)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = sk.LazyAdam(ours.parameters(), lr=0.02, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.01)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=0.02, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(16, 5, generator=gen).to(device)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_ours.state[p][key], opt_theirs.state[q][key])


def test_lazy_adam_mixed_model_and_weight_decay(device):
    """One optimizer for an embedding (sparse) and a linear layer (dense)."""
    emb = embedding_model(30, 4, torch.float64).to(device)
    linear = torch.nn.Linear(4, 1, dtype=torch.float64).to(device)
    opt = sk.LazyAdam([{"params": emb.parameters(), "weight_decay": 0.1}, {"params": linear.parameters()}],
                      lr=0.01)
    w0 = emb.weight.detach().clone()
    m, v = torch.zeros_like(w0), torch.zeros_like(w0)
    for step, ids in enumerate(embedding_batches(30, 3, 12), start=1):
        ids = ids.to(device)
        opt.zero_grad()
        linear(emb(ids)).sum().backward()
        grad = emb.weight.grad.coalesce()
        w0, m, v = reference_lazy_adam(w0, m, v, grad.indices()[0], grad.values(), step, 0.01, 0.9, 0.999,
                                       1e-8, 0.1)
        opt.step()
        torch.testing.assert_close(emb.weight.detach(), w0, **WEIGHT_TOL[torch.float64])
        assert torch.equal(opt.state[emb.weight]["exp_avg"], m)
    assert int(opt.state[linear.weight]["step"]) == 3


def test_lazy_adam_empty_sparse_grad_counts_step(device):
    param = torch.nn.Parameter(torch.randn(5, 2, device=device))
    opt = sk.LazyAdam([param])
    before = param.detach().clone()
    param.grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64), torch.empty(0, 2), (5, 2)).to(device)
    opt.step()
    assert torch.equal(param.detach(), before)
    assert int(opt.state[param]["step"]) == 1


def test_lazy_adam_state_dict_round_trip(device):
    batches = embedding_batches(40, 6, 16)

    def run(model, opt, ids_list):
        for ids in ids_list:
            opt.zero_grad()
            model(ids.to(device)).pow(2).sum().backward()
            opt.step()

    straight = embedding_model(40, 4).to(device)
    opt_straight = sk.LazyAdam(straight.parameters(), lr=0.03)
    run(straight, opt_straight, batches)

    first = embedding_model(40, 4).to(device)
    opt_first = sk.LazyAdam(first.parameters(), lr=0.03)
    run(first, opt_first, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert torch.is_tensor(saved["optim"]["state"][0]["step"])

    resumed = embedding_model(40, 4, seed=9).to(device)
    resumed.load_state_dict(saved["model"])
    opt_resumed = sk.LazyAdam(resumed.parameters(), lr=0.03)
    opt_resumed.load_state_dict(saved["optim"])
    run(resumed, opt_resumed, batches[3:])
    assert torch.equal(resumed.weight, straight.weight)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt_resumed.state[resumed.weight][key], opt_straight.state[straight.weight][key])


def test_lazy_adam_bad_arguments(device):
    params = [torch.nn.Parameter(torch.zeros(3, 2, device=device))]
    with pytest.raises(ValueError, match="learning rate"):
        sk.LazyAdam(params, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        sk.LazyAdam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        sk.LazyAdam(params, eps=-1e-8)
    with pytest.raises(ValueError, match="weight_decay"):
        sk.LazyAdam(params, weight_decay=-0.1)
    param = torch.nn.Parameter(torch.zeros(3, 2, device=device))
    opt = sk.LazyAdam([param])
    param.grad = torch.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.int64), torch.ones(1, 3, 2), (3, 2)).to(device)
    with pytest.raises(RuntimeError, match="must have the parameter's shape and at least one sparse dimension; got "
                                           r"sparse_dim 0, shape \(3, 2\)"):
        opt.step()


@pytest.mark.parametrize("shape, sparse_dim", [((8, 3), 2), ((4, 3, 5), 2), ((4, 3, 5), 3), ((6,), 1),
                                               ((4, 3, 5), 1)])
@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_element_wise_sparse_gradients_step_as_sparse_adam(device, shape, sparse_dim, coalesced, maximize):
    """torch.optim.SparseAdam takes a gradient with several sparse dimensions (an entry per
    element or per slice); LazyAdam refused it. It now updates exactly the entries named,
    with SparseAdam's numbers (its weight decay too: no SparseAdam twin for that)."""
    gen = torch.Generator().manual_seed(sparse_dim * 10 + len(shape))
    weight = torch.randn(shape, dtype=torch.float64, generator=gen)
    mine, ref = (torch.nn.Parameter(weight.clone().to(device)) for _ in range(2))
    opt, ref_opt = sk.LazyAdam([mine], lr=0.1, maximize=maximize), torch.optim.SparseAdam([ref], lr=0.1,
                                                                                          maximize=maximize)
    for _ in range(3):
        indices = torch.stack([torch.randint(0, shape[d], (6,), generator=gen) for d in range(sparse_dim)])
        grad = torch.sparse_coo_tensor(indices, torch.randn((6,) + shape[sparse_dim:], dtype=torch.float64,
                                                            generator=gen), shape).to(device)
        grad = grad.coalesce() if coalesced else grad
        mine.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-14)
    untouched = (ref.detach() == weight.to(device))
    assert torch.equal(mine.detach()[untouched], weight.to(device)[untouched])


def test_element_wise_sparse_gradient_errors_change_nothing(device):
    param = torch.nn.Parameter(torch.zeros(4, 3, device=device))
    opt = sk.LazyAdam([param])
    for indices in ([[1], [3]], [[4], [0]], [[-1], [0]], [[0], [-1]]):  # each dim checked against its size
        param.grad = torch.sparse_coo_tensor(torch.tensor(indices), torch.ones(1), (4, 3),
                                             check_invariants=False).to(device)
        with pytest.raises(RuntimeError, match=r"names an index outside the parameter's shape \(4, 3\); nothing "
                                               "was updated"):
            opt.step()
        assert not param.detach().any() and not opt.state[param]
    strided = torch.nn.Parameter(torch.zeros(3, 4, device=device).t())
    opt = sk.LazyAdam([strided])
    strided.grad = torch.sparse_coo_tensor(torch.tensor([[1], [1]]), torch.ones(1), (4, 3)).to(device)
    with pytest.raises(RuntimeError, match="updates only on a contiguous parameter with contiguous moments"):
        opt.step()
    layer = sk.DistributedEmbedding("sum", 4, 3, 1, 1, device=device)
    opt = sk.LazyAdam(layer.parameters())
    layer.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1], [1]]), torch.ones(1), (4, 3)).to(device)
    with pytest.raises(RuntimeError, match="it is an embedding shard, whose gradient names rows"):
        opt.step()


# ---- parity with torch.optim.SparseAdam / Adam, and all-or-nothing steps --------------------


def _sparse_grad(rows, values, shape):
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, shape).coalesce()


def _run_pair(make_param, maximize, steps=3):
    """LazyAdam and SparseAdam on the same parameter layout and coalesced gradients."""
    ours, theirs = make_param(), make_param()
    opt_ours = sk.LazyAdam([ours], lr=0.01, maximize=maximize)
    opt_theirs = torch.optim.SparseAdam([theirs], lr=0.01, maximize=maximize)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randperm(ours.shape[0], generator=g)[:7].tolist()
        values = torch.randn(7, *ours.shape[1:], generator=g)
        ours.grad = _sparse_grad(rows, values, ours.shape)
        theirs.grad = _sparse_grad(rows, values, theirs.shape)
        opt_ours.step()
        opt_theirs.step()
    return ours, theirs, opt_ours, opt_theirs


@pytest.mark.parametrize("layout", ["column_slice", "transposed", "contiguous"])
@pytest.mark.parametrize("maximize", [False, True])
def test_lazy_adam_matches_sparse_adam_on_any_layout(layout, maximize):
    """Non-contiguous parameters (a column slice of a wider table, a transposed one) are
    accepted as SparseAdam accepts them; maximize as SparseAdam's; bit for bit."""
    def make_param():
        base = torch.randn(40, 50, generator=torch.Generator().manual_seed(1))
        tensor = {"column_slice": base[:, 1:33], "transposed": base.t()[:, :20], "contiguous": base[:30]}[layout]
        return torch.nn.Parameter(tensor)

    ours, theirs, opt_ours, opt_theirs = _run_pair(make_param, maximize)
    assert ours.is_contiguous() == (layout == "contiguous")
    # Moments bit for bit; weights to an ulp or two (torch's vectorised CPU sqrt is not
    # correctly rounded, the kernel's is).
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt_ours.state[ours][key], opt_theirs.state[theirs][key])
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    # The gathered path for a non-contiguous parameter is the contiguous path, bit for bit.
    same, _, opt_same, _ = _run_pair(lambda: torch.nn.Parameter(make_param().detach().contiguous()), maximize)
    assert torch.equal(ours.detach(), same.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt_ours.state[ours][key], opt_same.state[same][key])


def test_lazy_adam_maximize_dense_matches_adam():
    ours = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(2)))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt_ours, opt_theirs = sk.LazyAdam([ours], lr=0.01, maximize=True), torch.optim.Adam([theirs], lr=0.01,
                                                                                          maximize=True)
    for step in range(3):
        grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 + step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(opt_ours.state[ours]["exp_avg"], opt_theirs.state[theirs]["exp_avg"])


def test_lazy_adam_refuses_sparse_parameters_at_construction():
    dense = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"sparse parameters at indices \[\[0, 1\]\]"):
        sk.LazyAdam([dense, torch.zeros(3, 2).to_sparse().requires_grad_()])


def test_lazy_adam_refuses_sparse_parameters_added_later_and_changes_nothing():
    """add_param_group refuses a sparse parameter as the constructor does; it was accepted,
    and the next step then failed with torch's "memory format option is only supported by
    strided tensors" after the dense parameters before it had been updated."""
    dense = torch.nn.Parameter(torch.zeros(3, 2))
    opt = sk.LazyAdam([dense], lr=0.1)
    sparse = torch.zeros(3, 2).to_sparse().requires_grad_()
    with pytest.raises(ValueError, match=r"sparse parameters at indices \[\[1, 0\]\]"):
        opt.add_param_group({"params": [sparse]})
    assert len(opt.param_groups) == 1
    dense.grad = torch.ones(3, 2)
    opt.step()
    assert int(opt.state[dense]["step"].item()) == 1 and sparse not in opt.state


@pytest.mark.parametrize("betas", [0.9, (0.9,), (0.9, 0.99, 0.5), ("a", 0.9)])
def test_lazy_adam_betas_must_be_a_pair(betas):
    with pytest.raises(ValueError, match="betas must be a pair"):
        sk.LazyAdam([torch.nn.Parameter(torch.zeros(2))], betas=betas)


def test_lazy_adam_loads_plain_number_steps_and_old_states():
    """A state whose step is a plain number (older checkpoints) and without maximize loads
    and steps on, as torch's optimizers allow."""
    param = torch.nn.Parameter(torch.zeros(4, 2))
    opt = sk.LazyAdam([param], lr=0.1)
    param.grad = _sparse_grad([1], torch.ones(1, 2), param.shape)
    opt.step()
    state = opt.state_dict()
    state["state"][0]["step"] = 1.0
    del state["param_groups"][0]["maximize"]
    fresh = sk.LazyAdam([param], lr=0.1)
    fresh.load_state_dict(state)
    assert torch.is_tensor(fresh.state[param]["step"]) and fresh.param_groups[0]["maximize"] is False
    param.grad = _sparse_grad([1], torch.ones(1, 2), param.shape)
    fresh.step()
    assert fresh.state[param]["step"].item() == 2


def test_lazy_adam_refuses_another_optimizers_state():
    param = torch.nn.Parameter(torch.zeros(4, 2))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(4, 2)
    sgd.step()
    opt = sk.LazyAdam([param])
    with pytest.raises(ValueError, match=r"lacks \['betas', 'eps'\]: it was saved by another optimizer"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and len(opt.state) == 0
    with pytest.raises(ValueError, match="expected what LazyAdam.state_dict"):
        opt.load_state_dict(None)


@pytest.mark.parametrize("bad_row", [-1, 4, 2**63 - 1])
def test_lazy_adam_step_is_all_or_nothing(bad_row):
    """A bad sparse gradient on the second parameter: nothing is updated, on any parameter,
    and no step counter moves."""
    first = torch.nn.Parameter(torch.zeros(4, 2))
    second = torch.nn.Parameter(torch.zeros(4, 2))
    dense = torch.nn.Parameter(torch.zeros(3))
    opt = sk.LazyAdam([first, dense, second], lr=0.1)
    for step in range(2):
        first.grad = _sparse_grad([0], torch.ones(1, 2), first.shape)
        dense.grad = torch.ones(3)
        second.grad = torch.sparse_coo_tensor(torch.tensor([[1, bad_row]]), torch.ones(2, 2), (4, 2),
                                              check_invariants=False) if step else _sparse_grad([1], torch.ones(1, 2),
                                                                                                second.shape)
        if step == 0:
            opt.step()
            before = {id(p): (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                      for p in (first, dense, second)}
            continue
        with pytest.raises(RuntimeError, match=rf"parameter 2 of group 0 names row {bad_row}"):
            opt.step()
    for p in (first, dense, second):
        weight, state = before[id(p)]
        assert torch.equal(p.detach(), weight)
        for key, value in state.items():
            assert torch.equal(opt.state[p][key], value), key


# ---- damaged gradients and states: refused before anything changes ---------------------------


def _three_kinds(device):
    """A contiguous float32 table (the fused CPU update), a column slice of a wider one (the
    per-table update) and a dense vector (torch's Adam), in two groups, after one step: every
    kind of state exists."""
    gen = torch.Generator().manual_seed(0)
    fused = torch.nn.Parameter(torch.randn(6, 3, generator=gen).to(device))
    sliced = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(device)[:, 1:4])
    dense = torch.nn.Parameter(torch.randn(3, generator=gen).to(device))
    params = [fused, sliced, dense]
    opt = sk.LazyAdam([{"params": [fused, sliced]}, {"params": [dense], "lr": 0.01}], lr=0.1)
    _three_grads(params)
    opt.step()
    _three_grads(params)
    return opt, params


def _three_grads(params, dtype=torch.float32):
    fused, sliced, dense = params
    fused.grad = _sparse_grad([1, 4], torch.ones(2, 3, dtype=dtype), fused.shape).to(fused.device)
    sliced.grad = _sparse_grad([0, 2], torch.full((2, 3), 0.5, dtype=dtype), sliced.shape).to(sliced.device)
    dense.grad = torch.full((3,), 2.0, dtype=dtype, device=dense.device)


def _snapshot(opt, params):
    return [(p.detach().clone(), {key: value.clone() if torch.is_tensor(value) else value
                                  for key, value in opt.state[p].items()}) for p in params]


def _assert_unchanged(opt, params, before):
    """Every weight, and every state entry (same keys, dtype, device and values), as before."""
    for index, (param, (weight, state)) in enumerate(zip(params, before)):
        assert torch.equal(param.detach(), weight), index
        assert set(opt.state[param]) == set(state), index
        for key, value in state.items():
            now = opt.state[param][key]
            if torch.is_tensor(value):
                assert torch.is_tensor(now) and now.dtype == value.dtype and now.device == value.device, (index, key)
                assert torch.equal(now, value), (index, key)
            else:
                assert now == value, (index, key)


def _wrong_grad_dtype(params, index):
    param = params[index]
    param.grad = None
    param.grad_dtype = None  # torch refuses a float64 gradient for a float32 parameter otherwise
    if index == 2:
        param.grad = torch.full((3,), 2.0, dtype=torch.float64, device=param.device)
    else:
        param.grad = _sparse_grad([1], torch.ones(1, 3, dtype=torch.float64), param.shape).to(param.device)


BAD_STEP_INPUTS = {
    # What breaks (set after a good first step), and what the RuntimeError must name.
    "dense moment shape": (lambda opt, ps: opt.state[ps[2]].__setitem__("exp_avg", torch.zeros(5, device=ps[2].device)),
                           r"state of parameter 0 of group 1 \(shape \(3,\)\): 'exp_avg' must be"),
    "dense moment dtype": (lambda opt, ps: opt.state[ps[2]].__setitem__(
                               "exp_avg_sq", opt.state[ps[2]]["exp_avg_sq"].double()),
                           r"state of parameter 0 of group 1 .*'exp_avg_sq' must be a dense torch.float32"),
    "sparse moment missing": (lambda opt, ps: opt.state[ps[1]].pop("exp_avg"),
                              r"state of parameter 1 of group 0 .* lacks \['exp_avg'\]"),
    "sparse moment shape": (lambda opt, ps: opt.state[ps[1]].__setitem__(
                                "exp_avg_sq", torch.zeros(6, 4, device=ps[1].device)),
                            r"state of parameter 1 of group 0 .*'exp_avg_sq' must be"),
    "sliced moments of two dtypes": (lambda opt, ps: opt.state[ps[1]].__setitem__(
                                         "exp_avg_sq", opt.state[ps[1]]["exp_avg_sq"].double()),
                                     r"state of parameter 1 of group 0 .*'exp_avg_sq' must be a dense torch.float32 "
                                     r"tensor .* got torch.strided torch.float64"),
    "fused step not a tensor": (lambda opt, ps: opt.state[ps[0]].__setitem__("step", 1),
                                r"state of parameter 0 of group 0 .*'step' must be a one-element"),
    "fused step integer tensor": (lambda opt, ps: opt.state[ps[0]].__setitem__("step", torch.tensor(1)),
                                  r"state of parameter 0 of group 0 .*'step' must be a one-element"),
    "dense grad dtype": (lambda opt, ps: _wrong_grad_dtype(ps, 2),
                         (r"gradient of parameter 0 of group 1 .* is torch.float64 on .* "
                          r"but the parameter is torch.float32")),
    "sliced grad dtype": (lambda opt, ps: _wrong_grad_dtype(ps, 1),
                          r"gradient of parameter 1 of group 0 .* is torch.float64"),
    "fused grad dtype": (lambda opt, ps: _wrong_grad_dtype(ps, 0),
                         r"gradient of parameter 0 of group 0 .* is torch.float64"),
    "dense moment device": (lambda opt, ps: opt.state[ps[2]].__setitem__("exp_avg", opt.state[ps[2]]["exp_avg"].cpu()),
                            r"state of parameter 0 of group 1 .*'exp_avg' must be .* on cuda"),
    # Shared memory: the kernel refuses it (after the tables before it were updated), torch's
    # Adam silently computes garbage.
    "sliced moments shared": (lambda opt, ps: opt.state[ps[1]].__setitem__("exp_avg_sq", opt.state[ps[1]]["exp_avg"]),
                              r"state of parameter 1 of group 0 .*'exp_avg' and 'exp_avg_sq' share memory"),
    "fused moment is the weight": (lambda opt, ps: opt.state[ps[0]].__setitem__("exp_avg", ps[0].detach()),
                                   r"state of parameter 0 of group 0 .*the parameter and 'exp_avg' share memory"),
    "dense gradient is the weight": (lambda opt, ps: setattr(ps[2], "grad", ps[2].detach()),
                                     r"state of parameter 0 of group 1 .*the parameter and the gradient share memory"),
}


@pytest.mark.parametrize("case", sorted(BAD_STEP_INPUTS))
def test_lazy_adam_bad_gradient_or_state_changes_nothing(device, case):
    """A gradient of the wrong dtype or a damaged state on any parameter (sparse or dense)
    raises before the first update: no weight, moment or step counter of any parameter moves.
    (Before, the sparse tables were updated and torch's Adam failed after them.)"""
    if case == "dense moment device" and device.type != "cuda":
        pytest.skip("needs a second device")
    opt, params = _three_kinds(device)
    damage, message = BAD_STEP_INPUTS[case]
    damage(opt, params)
    before = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    _assert_unchanged(opt, params, before)


def test_lazy_adam_bad_state_loaded_from_the_issue_changes_nothing():
    """The reported sequence: a dense moment of the wrong shape used to load, then a step
    updated the embedding and failed in torch's Adam. Now the load raises and changes
    nothing, and the next step is the one an untouched optimizer takes."""
    opt, params = _three_kinds("cpu")
    twin, twin_params = _three_kinds("cpu")
    state = copy.deepcopy(opt.state_dict())  # state_dict() shares the per-parameter dicts
    state["state"][2]["exp_avg"] = torch.zeros(5)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"parameter 2 \(index 0 of group 1, shape \(3,\)\): 'exp_avg' must be .* "
                                         r"shape \(3,\), got a torch.strided torch.float32 tensor of shape \(5,\)"):
        opt.load_state_dict(state)
    _assert_unchanged(opt, params, before)
    opt.step()
    twin.step()
    _assert_unchanged(opt, params, _snapshot(twin, twin_params))


def _nan_step(state):
    state["step"] = torch.tensor(float("nan"))


BAD_SAVED_STATES = {
    # (saved id, damage, what the ValueError must name after the parameter)
    "missing exp_avg": (0, lambda s: s.pop("exp_avg"), r"lacks \['exp_avg'\]"),
    "missing step": (2, lambda s: s.pop("step"), r"lacks \['step'\]"),
    "nan step": (2, _nan_step, r"'step' must be a finite integer >= 0 .* holding nan"),
    "negative step": (1, lambda s: s.__setitem__("step", torch.tensor(-3.0)), r"'step' .* holding -3.0"),
    "fractional step": (0, lambda s: s.__setitem__("step", 1.5), r"'step' must be a finite integer >= 0 .* got 1.5"),
    "infinite step": (0, lambda s: s.__setitem__("step", float("inf")), r"'step' .* got inf"),
    "bool step": (0, lambda s: s.__setitem__("step", True), r"'step' .* got True"),
    "string step": (0, lambda s: s.__setitem__("step", "1"), r"'step' .* got '1'"),
    "step of two elements": (2, lambda s: s.__setitem__("step", torch.tensor([1.0, 1.0])),
                             r"'step' .* got a torch.float32 tensor of shape \(2,\)"),
    "dense moment shape": (2, lambda s: s.__setitem__("exp_avg", torch.zeros(5)), r"'exp_avg' must be .* shape \(3,\)"),
    "sparse moment shape": (1, lambda s: s.__setitem__("exp_avg_sq", torch.zeros(6, 4)),
                            r"'exp_avg_sq' must be .* shape \(6, 3\), got .* shape \(6, 4\)"),
    "embedding moment transposed": (0, lambda s: s.__setitem__("exp_avg", s["exp_avg"].t()), r"'exp_avg' must be"),
    "integer moment": (0, lambda s: s.__setitem__("exp_avg", torch.zeros(6, 3, dtype=torch.int64)),
                       r"'exp_avg' must be a dense floating-point tensor .* got .* torch.int64"),
    "complex moment": (2, lambda s: s.__setitem__("exp_avg_sq", torch.zeros(3, dtype=torch.complex64)),
                       r"'exp_avg_sq' must be a dense floating-point"),
    "sparse moment": (0, lambda s: s.__setitem__("exp_avg", torch.zeros(6, 3).to_sparse()),
                      r"'exp_avg' must be a dense .* got a torch.sparse_coo"),
    "list moment": (2, lambda s: s.__setitem__("exp_avg", [0.0, 0.0, 0.0]), r"'exp_avg' must be .* got list"),
}

WHERE = {0: r"parameter 0 \(index 0 of group 0, shape \(6, 3\)\)",
         1: r"parameter 1 \(index 1 of group 0, shape \(6, 3\)\)",
         2: r"parameter 2 \(index 0 of group 1, shape \(3,\)\)"}


@pytest.mark.parametrize("case", sorted(BAD_SAVED_STATES))
def test_lazy_adam_load_state_dict_refuses_a_bad_state(device, case):
    """Missing entries, a step that is not a finite integer >= 0, moments of another shape
    or of no floating type: ValueError naming the parameter, its group and the field, with
    the optimizer (settings, weights, moments, steps) as it was; it then steps as usual."""
    opt, params = _three_kinds(device)
    saved_id, damage, message = BAD_SAVED_STATES[case]
    state = opt.state_dict()
    state = {"state": {k: dict(v) for k, v in state["state"].items()},
             "param_groups": [dict(g, lr=0.5) for g in state["param_groups"]]}
    damage(state["state"][saved_id])
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=f"LazyAdam.load_state_dict: the state of {WHERE[saved_id]}.*{message}"):
        opt.load_state_dict(state)
    _assert_unchanged(opt, params, before)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    opt.step()
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2]


def test_lazy_adam_load_state_dict_refuses_a_state_that_is_no_dict():
    opt, params = _three_kinds("cpu")
    state = copy.deepcopy(opt.state_dict())
    state["state"][1] = torch.zeros(6, 3)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=rf"the state of {WHERE[1]} must be a dict, got Tensor"):
        opt.load_state_dict(state)
    _assert_unchanged(opt, params, before)
    with pytest.raises(ValueError, match="'state' must map parameter ids"):
        opt.load_state_dict({"state": [], "param_groups": state["param_groups"]})
    _assert_unchanged(opt, params, before)


def test_lazy_adam_load_state_dict_keeps_accepting_good_states(device):
    """Round trips (before any step, after steps, through torch.save), numbers and integer
    tensors as steps, and torch.optim.Adam's states (foreach, fused, amsgrad) load and
    continue as the optimizer that saved them would."""
    # Before any step: nothing to check, nothing loaded; the first step creates the state.
    opt, params = _three_kinds(device)
    fresh = sk.LazyAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], lr=0.1)
    empty = fresh.state_dict()
    assert empty["state"] == {}
    again = sk.LazyAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], lr=0.1)
    again.load_state_dict(empty)
    assert len(again.state) == 0

    # After a step, through torch.save / torch.load(weights_only=True): the same continuation.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = sk.LazyAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], lr=0.1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_unchanged(resumed, params, _snapshot(opt, params))

    # Steps as numbers or integer tensors (older or hand-made states): CPU float tensors.
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["step"], state["state"][2]["step"] = 1, torch.tensor(1, device=device)
    resumed.load_state_dict(state)
    for p in params:
        step = resumed.state[p]["step"]
        assert step.device.type == "cpu" and step.dtype == torch.float32 and step.dim() == 0 and step.item() == 1
    resumed.step()
    opt.step()
    _assert_unchanged(resumed, params, _snapshot(opt, params))


@pytest.mark.parametrize("maximize", [False, True])
def test_lazy_adam_loads_a_sparse_adam_state_and_continues_it(maximize):
    """torch.optim.SparseAdam's state (Adam's settings without weight_decay) was refused as
    another optimizer's; it continues as SparseAdam would, and the caller's dict is kept."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(10, 3, generator=gen))
    twin = torch.nn.Parameter(weight.detach().clone())

    def grad():
        rows = torch.tensor([1, 4, 7])
        return torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(3, 3, generator=gen), (10, 3)).coalesce()
    sparse_adam = torch.optim.SparseAdam([weight], lr=0.01, maximize=maximize)
    for _ in range(2):
        weight.grad = grad()
        sparse_adam.step()
    twin.data.copy_(weight.detach())
    saved = copy.deepcopy(sparse_adam.state_dict())  # (a live state dict shares its moments, as torch's)
    kept = copy.deepcopy(saved)
    lazy = sk.LazyAdam([twin], lr=0.5)
    lazy.load_state_dict(saved)
    assert saved["param_groups"] == kept["param_groups"]
    assert lazy.param_groups[0]["weight_decay"] == 0.0 and lazy.param_groups[0]["lr"] == 0.01
    g = grad()
    weight.grad, twin.grad = g, g.clone()
    sparse_adam.step()
    lazy.step()
    torch.testing.assert_close(twin.detach(), weight.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("settings", [{}, {"foreach": True}, {"fused": True}, {"maximize": True},
                                      {"decoupled_weight_decay": True}, {"saved_flags": True}],
                         ids=["default", "foreach", "fused", "maximize", "adamw_without_decay",
                              "capturable_differentiable_saved"])
def test_lazy_adam_loads_torch_adam_states(device, settings):
    """torch.optim.Adam's state of a dense model loads (a fused Adam's step comes back to the
    CPU from the parameter's device) and LazyAdam continues it as torch's default Adam does:
    execution flags are ignored, maximize is honoured, and AdamW's decoupled decay of 0 is
    Adam's update."""
    gen = torch.Generator().manual_seed(3)
    ours = torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(device))
    theirs = torch.nn.Parameter(ours.detach().clone())
    settings = dict(settings)
    saved_flags = settings.pop("saved_flags", False)
    adam = torch.optim.Adam([ours], lr=0.01, **settings)
    for _ in range(2):
        ours.grad = torch.randn(4, 3, generator=gen).to(device)
        adam.step()
    theirs.data.copy_(ours.detach())
    if saved_flags:  # as a capturable / differentiable Adam saves them (neither steps a CPU leaf)
        adam.param_groups[0].update(capturable=True, differentiable=True)
    opt = sk.LazyAdam([ours], lr=0.01)
    opt.load_state_dict(adam.state_dict())
    assert opt.state[ours]["step"].device.type == "cpu" and opt.state[ours]["step"].item() == 2
    reference = torch.optim.Adam([theirs], lr=0.01)
    state = copy.deepcopy(adam.state_dict())
    state["param_groups"][0].update(fused=None, foreach=None, capturable=False, differentiable=False)
    reference.load_state_dict(state)
    grad = torch.randn(4, 3, generator=gen).to(device)
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    opt.step()
    reference.step()
    assert torch.equal(ours.detach(), theirs.detach())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[ours][key], reference.state[theirs][key].cpu() if key == "step"
                           else reference.state[theirs][key])


def test_lazy_adam_sparse_moments_of_another_precision_still_step():
    """float64 moments of a float32 table (or float32 of a float64 one: a checkpoint of another
    precision keeps its moments' dtype) are not refused: the lazy update runs in them."""
    opt, params = _three_kinds("cpu")
    for param in params[:2]:
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[param][key] = opt.state[param][key].double()
    opt.step()
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2]
    assert all(opt.state[p]["exp_avg"].dtype == torch.float64 for p in params[:2])


def test_lazy_adam_half_shard_state_round_trip():
    """A bfloat16 embedding shard keeps float32 moments through state_dict / load_state_dict,
    and a damaged one is refused there too."""
    shard = torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))
    shard_registry.register(shard)
    opt = sk.LazyAdam([shard], lr=0.1)
    shard.grad = _sparse_grad([2, 5], torch.ones(2, 4, dtype=torch.bfloat16), shard.shape)
    opt.step()
    assert opt.state[shard]["exp_avg"].dtype == torch.float32
    resumed = sk.LazyAdam([shard], lr=0.1)
    resumed.load_state_dict(opt.state_dict())
    _assert_unchanged(resumed, [shard], _snapshot(opt, [shard]))
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["exp_avg_sq"] = torch.zeros(8, 3)
    with pytest.raises(ValueError, match=r"parameter 0 \(index 0 of group 0, shape \(8, 4\)\): 'exp_avg_sq'"):
        resumed.load_state_dict(state)
    _assert_unchanged(resumed, [shard], _snapshot(opt, [shard]))
    shard.grad = _sparse_grad([2], torch.ones(1, 4, dtype=torch.bfloat16), shard.shape)
    resumed.step()
    assert resumed.state[shard]["step"].item() == 2 and resumed.state[shard]["exp_avg"].dtype == torch.float32


def test_update_marks_the_tensors_modified_for_autograd(device):
    # As torch's own optimizers: a backward that saved the weight before the step raises
    # instead of silently using the updated rows (the dispatcher does not bump the version
    # counters of ops registered in C++; sparsekit's kernel for autograd's in-place key does,
    # for the raw torch.ops.sparsekit ops too, and only after a call that succeeded).
    weight = torch.nn.Parameter(torch.randn(4, 2, device=device))
    scale = torch.ones(2, device=device, requires_grad=True)
    loss = sk.ops.embedding_bag(weight, torch.tensor([1, 2], device=device), torch.tensor([0, 2], device=device),
                                scale).sum()
    weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 2), (4, 2)).to(device)
    sk.LazyAdam([weight], lr=1.0).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    tensors = [torch.randn(8, 4, device=device), torch.zeros(8, 4, device=device), torch.zeros(8, 4, device=device)]
    before = [t._version for t in tensors]
    sk.ops.lazy_adam_(*tensors, torch.tensor([1], device=device), torch.ones(1, 4, device=device), 1, .1, .9, .999,
                      1e-8)
    assert [t._version for t in tensors] == [v + 1 for v in before]
    torch.ops.sparsekit.lazy_adam_(*tensors, torch.tensor([1], device=device), torch.ones(1, 4, device=device), 1,
                                   .1, .9, .999, 1e-8)
    assert [t._version for t in tensors] == [v + 2 for v in before]
    with pytest.raises(RuntimeError, match="rows holds 8"):
        torch.ops.sparsekit.lazy_adam_(*tensors, torch.tensor([8], device=device), torch.ones(1, 4, device=device),
                                       1, .1, .9, .999, 1e-8)
    assert [t._version for t in tensors] == [v + 2 for v in before]
    lists = [[t.clone()] for t in tensors]
    torch.ops.sparsekit.lazy_adam_tables_(*lists, [torch.tensor([1], device=device)],
                                          [torch.ones(1, 4, device=device)], [1], [.1, .9, .999, 1e-8, 0.0])
    assert [t[0]._version for t in lists] == [1, 1, 1]
    # A saved weight updated by the raw op: the backward raises.
    weight = torch.randn(4, 2, device=device, requires_grad=True)
    out = weight.exp()  # saves its output
    with torch.no_grad():
        torch.ops.sparsekit.lazy_adam_(out, torch.zeros_like(out), torch.zeros_like(out),
                                       torch.tensor([1], device=device), torch.ones(1, 2, device=device), 1, .1, .9,
                                       .999, 1e-8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_op_refuses_a_tensor_requiring_grad_in_grad_mode_and_a_step_beyond_int64():
    args = [torch.tensor([1]), torch.ones(1, 4), 1, .1, .9, .999, 1e-8]
    for position, name in enumerate(["weight", "exp_avg", "exp_avg_sq"]):
        tensors = [torch.randn(8, 4), torch.zeros(8, 4), torch.zeros(8, 4)]
        tensors[position].requires_grad_()
        before = [t.detach().clone() for t in tensors]
        with pytest.raises(RuntimeError, match=f"lazy_adam_: {name} requires grad and grad mode is on"):
            sk.ops.lazy_adam_(*tensors, *args)
        assert all(torch.equal(t.detach(), b) for t, b in zip(tensors, before))
        with torch.no_grad():
            sk.ops.lazy_adam_(*tensors, *args)  # as optimizers call it
    with pytest.raises(ValueError, match=r"lazy_adam_: step must fit in int64"):
        sk.ops.lazy_adam_(torch.randn(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), torch.tensor([1]),
                          torch.ones(1, 4), 2**64, .1, .9, .999, 1e-8)


@pytest.mark.parametrize("edit", ["param_groups", "add_param_group"])
def test_lazy_adam_bad_settings_of_a_later_group_change_nothing(edit):
    """Two eviction layers' tables in two groups: a bad beta1 in the second group (edited
    after the constructor or added by add_param_group) raises before the first is stepped."""
    layers = [sk.DistributedEmbedding("sum", 4, 2, 1, 2, eviction="lru") for _ in range(2)]
    optimizer = sk.LazyAdam(layers[0].parameters(), lr=0.1)
    if edit == "add_param_group":
        with pytest.raises(ValueError, match=r"add_param_group \(parameter group 1\): invalid betas"):
            optimizer.add_param_group({"params": list(layers[1].parameters()), "betas": (1.0, 0.9)})
        assert len(optimizer.param_groups) == 1
        optimizer.add_param_group({"params": list(layers[1].parameters())})
        optimizer.param_groups[1]["betas"] = (1.0, 0.9)
    else:
        optimizer.add_param_group({"params": list(layers[1].parameters())})
        optimizer.param_groups[1]["lr"] = "fast"
    keys = sk.Ragged(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    sum(layer(keys).sum() for layer in layers).backward()
    weights = [layer.weight.detach().clone() for layer in layers]
    with pytest.raises(ValueError, match=r"LazyAdam.step \(parameter group 1\)"):
        optimizer.step()
    assert all(torch.equal(layer.weight.detach(), w) for layer, w in zip(layers, weights))
    assert not optimizer.state


@pytest.mark.parametrize("rows", [[1, 4, 9], [4, 1, 9], [1, 4, 4, 9], [2]], ids=["ascending", "unordered", "duplicate",
                                                                              "one"])
def test_lazy_adam_sums_rows_again_only_when_they_may_repeat(monkeypatch, rows):
    """A CPU gradient flagged uncoalesced whose rows ascend (sparsekit.ops' lookups: autograd
    drops the flag) is applied as it is; rows out of order or repeated are summed first.
    Either way the step equals the one on the coalesced gradient."""
    summed = []
    sum_rows = sk.optim._sum_repeated_rows
    monkeypatch.setattr(sk.optim, "_sum_repeated_rows", lambda *a, **k: summed.append(1) or sum_rows(*a, **k))
    indices = torch.tensor([rows])
    values = torch.arange(len(rows) * 3, dtype=torch.float32).view(-1, 3) - 2
    weights = []
    for grad in (torch.sparse_coo_tensor(indices, values, (10, 3)),
                 torch.sparse_coo_tensor(indices, values, (10, 3)).coalesce()):
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 30).view(10, 3))
        weight.grad = grad
        sk.LazyAdam([weight], lr=0.1).step()
        weights.append(weight.detach())
    assert summed == ([] if rows in ([1, 4, 9], [2]) else [1])
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,entries,distinct", [(1, 5, 1), (50, 7, 4), (1000, 3000, 700),
                                                       (200_000, 1000, 300), (10_000, 70_000, 9000)])
def test_repeated_rows_are_summed_alike_on_both_paths(dtype, num_rows, entries, distinct):
    """The bitmap path (unique_bounded + one bag per row) gives the rows and sums of unique +
    segment_sum bit for bit, the rows ascending; a table far larger than the gradient
    (200k rows for 1000 entries) and rows outside it take unique + segment_sum."""
    generator = torch.Generator().manual_seed(num_rows + entries)
    touched = torch.randperm(num_rows, generator=generator)[:distinct]
    indices = touched[torch.randint(0, touched.numel(), (entries,), generator=generator)]
    values = torch.randn(entries, 24, generator=generator).to(dtype)
    rows, summed = sk.optim._sum_repeated_rows(indices, values, num_rows)
    want_rows, inverse = sk.ops.unique(indices, return_inverse=True)
    want = sk.ops.segment_sum(values, inverse, want_rows.numel())
    order = torch.argsort(want_rows)
    assert torch.equal(torch.sort(rows).values, want_rows[order])
    assert torch.equal(summed[torch.argsort(rows)], want[order])
    bitmap = num_rows <= sk.ops._BOUNDED_UNIQUE_BITS_PER_KEY * entries + (1 << 16)
    assert bitmap == (num_rows != 200_000)
    if bitmap:
        assert bool((rows[1:] > rows[:-1]).all())
    # A row outside the table falls back, and the step names it with nothing changed.
    bad = indices.clone()
    bad[-1] = num_rows
    weight = torch.nn.Parameter(torch.zeros(num_rows, 24))
    weight.grad = torch.sparse_coo_tensor(bad.unsqueeze(0), values.float(), (num_rows, 24))
    optimizer = sk.LazyAdam([weight], lr=0.1)
    with pytest.raises(RuntimeError, match=f"names row {num_rows}, outside"):
        optimizer.step()
    assert not bool(weight.detach().any()) and not optimizer.state


# ---- torch.optim.Adam's settings, dtypes and LR schedulers ----


def _adam_state(optimizer_class, **settings):
    """A dense parameter and the state of ``optimizer_class`` after two steps on it."""
    gen = torch.Generator().manual_seed(4)
    param = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
    optimizer = optimizer_class([param], lr=0.1, **settings)
    for _ in range(2):
        param.grad = torch.randn(4, 3, generator=gen)
        optimizer.step()
    return param, optimizer.state_dict()


@pytest.mark.parametrize("optimizer_class, settings, message", [
    (torch.optim.Adam, {"amsgrad": True}, r"amsgrad=True \(LazyAdam keeps no max_exp_avg_sq\); use"),
    (torch.optim.AdamW, {"weight_decay": 0.1}, r"decoupled_weight_decay=True with weight_decay=0.1 \(AdamW's"),
    (torch.optim.AdamW, {}, r"decoupled_weight_decay=True with weight_decay=0.01 \(AdamW's"),
    (torch.optim.Adam, {"decoupled_weight_decay": True, "weight_decay": 0.1}, r"decoupled_weight_decay=True with"),
    (torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True},
     r"amsgrad=True .* and decoupled_weight_decay=True with weight_decay=0.1"),
], ids=["adam_amsgrad", "adamw", "adamw_default_decay", "adam_decoupled", "adamw_amsgrad"])
def test_lazy_adam_load_state_dict_refuses_adam_settings_it_cannot_honour(optimizer_class, settings, message):
    """A torch.optim.Adam / AdamW state with AMSGrad or a non-zero decoupled weight decay is
    refused, naming each setting, with LazyAdam's settings and state (of a step it took)
    unchanged; it then steps as before. Turned off in the state, it loads."""
    param, saved = _adam_state(optimizer_class, **settings)
    opt = sk.LazyAdam([param], lr=0.01)
    param.grad = torch.ones(4, 3)
    opt.step()
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = _snapshot(opt, [param])
    with pytest.raises(ValueError, match=r"LazyAdam.load_state_dict \(parameter group 0\): LazyAdam cannot honour "
                       + ".*" + message):
        opt.load_state_dict(saved)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before
    _assert_unchanged(opt, [param], before)
    opt.step()
    assert opt.state[param]["step"].item() == 2
    saved["param_groups"][0].update(amsgrad=False, decoupled_weight_decay=False)
    opt.load_state_dict(saved)
    assert opt.state[param]["step"].item() == 2 and opt.param_groups[0]["lr"] == 0.1


def test_lazy_adam_refuses_a_nadam_state():
    """Its state holds Adam's moments under Adam's names; loaded, it continued as plain
    Adam. Refused, naming the optimizer, with LazyAdam's settings and state unchanged."""
    optimizer_class = torch.optim.NAdam
    param, saved = _adam_state(optimizer_class)
    opt = sk.LazyAdam([param], lr=0.01)
    param.grad = torch.ones(4, 3)
    opt.step()
    before = _snapshot(opt, [param])
    with pytest.raises(ValueError, match=rf"LazyAdam.load_state_dict \(parameter group 0\): these are "
                                         rf"torch.optim.{optimizer_class.__name__}'s settings"):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, [param], before)
    assert opt.param_groups[0]["lr"] == 0.01
    # An Adam / AdamW state (amsgrad in every group) still loads.
    opt.load_state_dict(_adam_state(torch.optim.Adam)[1])


@pytest.mark.parametrize("edit", ["constructor_group", "add_param_group", "param_groups"])
@pytest.mark.parametrize("setting", [{"amsgrad": True}, {"decoupled_weight_decay": True, "weight_decay": 0.1}],
                         ids=["amsgrad", "decoupled"])
def test_lazy_adam_refuses_adam_settings_in_groups(edit, setting):
    """The same settings in a group LazyAdam is given (or edited into param_groups) are
    refused too, before anything is updated; decoupled_weight_decay with a decay of 0 is not."""
    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    if edit == "constructor_group":
        with pytest.raises(ValueError, match="LazyAdam cannot honour"):
            sk.LazyAdam([{"params": [first]}, {"params": [second], **setting}])
        return
    opt = sk.LazyAdam([first])
    if edit == "add_param_group":
        with pytest.raises(ValueError, match=r"add_param_group \(parameter group 1\): LazyAdam cannot honour"):
            opt.add_param_group({"params": [second], **setting})
        assert len(opt.param_groups) == 1
        opt.add_param_group({"params": [second], "decoupled_weight_decay": True})
        return
    opt.add_param_group({"params": [second]})
    opt.param_groups[1].update(setting)
    first.grad, second.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match=r"LazyAdam.step \(parameter group 1\): LazyAdam cannot honour"):
        opt.step()
    assert not opt.state and torch.equal(first.detach(), torch.zeros(3))


def _bits(tensor):
    """The tensor's bits as integers: NaNs (a float16 eps of 1e-8 is 0) compare as bits."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.detach().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


DENSE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
# torch's default settings, and larger ones under which its multi-tensor and one-tensor
# paths round bfloat16 differently (float16 differs at both, complex with weight decay).
ADAM_SETTINGS = {"default_lr": dict(), "large_lr": dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3)}


@pytest.mark.parametrize("dtype", DENSE_DTYPES, ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("settings", sorted(ADAM_SETTINGS))
def test_lazy_adam_dense_matches_torch_adam_bit_for_bit_on_every_dtype(dtype, weight_decay, maximize, settings):
    """Dense parameters of every dtype (odd sizes, a non-contiguous slice, a 0-d tensor):
    weights, moments and steps equal torch.optim.Adam's with its default execution on the CPU,
    bit for bit, over 12 steps."""
    torch.manual_seed(0)
    kwargs = dict(ADAM_SETTINGS[settings], weight_decay=weight_decay, maximize=maximize)
    # The slice of each side is a slice of its own copy: torch's own numbers for a half-type
    # slice differ from those of the same values contiguous.
    initial = [torch.randn(shape, dtype=torch.float64).to(dtype) for shape in [(1000,), (17, 3), (), (9, 10)]]
    ours, theirs = ([torch.nn.Parameter(t.clone()) for t in initial[:3]]
                    + [torch.nn.Parameter(initial[3].clone()[:, ::3])] for _ in range(2))
    assert not ours[3].is_contiguous() and ours[3].stride() == theirs[3].stride()
    opt_ours, opt_theirs = sk.LazyAdam(ours, **kwargs), torch.optim.Adam(theirs, **kwargs)
    for _ in range(12):
        for mine, other in zip(ours, theirs):
            grad = torch.randn(mine.shape, dtype=torch.float64).to(dtype)
            mine.grad, other.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for index, (mine, other) in enumerate(zip(ours, theirs)):
        assert torch.equal(_bits(mine), _bits(other)), index
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_bits(opt_ours.state[mine][key]), _bits(opt_theirs.state[other][key])), (index, key)


def test_lazy_adam_dense_dtypes_mixed_in_one_group_match_torch_adam():
    """One group of every dtype (some take torch's multi-tensor path, the others its loop):
    the same numbers as torch.optim.Adam's, bit for bit."""
    torch.manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(300, dtype=torch.float64).to(dtype)) for dtype in DENSE_DTYPES * 2]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_ours = sk.LazyAdam(ours, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    opt_theirs = torch.optim.Adam(theirs, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(10):
        for mine, other in zip(ours, theirs):
            grad = torch.randn(300, dtype=torch.float64).to(mine.dtype)
            mine.grad, other.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for mine, other in zip(ours, theirs):
        assert torch.equal(_bits(mine), _bits(other)), mine.dtype
        assert torch.equal(_bits(opt_ours.state[mine]["exp_avg_sq"]), _bits(opt_theirs.state[other]["exp_avg_sq"]))


def _numpy_settings():
    """Settings as NumPy numbers of several types."""
    return dict(lr=np.float32(0.01), betas=(np.float32(0.9), np.float64(0.99)), eps=np.float16(1e-4),
                weight_decay=np.int64(0))


@pytest.mark.parametrize("where", ["constructor", "param_groups", "load_state_dict"])
def test_lazy_adam_takes_numpy_settings(where):
    """NumPy numbers (and any numbers.Real) as settings, at construction, edited in
    param_groups or loaded: a sparse table and a dense vector step with them, the table as
    with the same values as floats, the vector as torch.optim.Adam with the same lr."""
    settings = _numpy_settings()
    as_floats = dict(lr=float(settings["lr"]), betas=tuple(map(float, settings["betas"])),
                     eps=float(settings["eps"]), weight_decay=0.0)

    def model():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(6, 3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]

    params, reference_params = model(), model()
    if where == "constructor":
        opt = sk.LazyAdam(params, **settings)
    else:
        opt = sk.LazyAdam(params)
        if where == "param_groups":
            opt.param_groups[0].update(settings)
        else:
            state = opt.state_dict()
            state["param_groups"][0].update(settings)
            opt.load_state_dict(state)
    reference = sk.LazyAdam(reference_params, **as_floats)
    dense_reference = torch.nn.Parameter(reference_params[1].detach().clone())
    # torch.optim.Adam refuses NumPy float32 betas: it gets them as floats, as LazyAdam passes them.
    torch_adam = torch.optim.Adam([dense_reference], lr=settings["lr"], betas=as_floats["betas"], eps=settings["eps"])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        rows, values = [1, 4], torch.randn(2, 3, generator=gen)
        dense_grad = torch.randn(5, generator=gen)
        for ps in (params, reference_params):
            ps[0].grad, ps[1].grad = _sparse_grad(rows, values, (6, 3)), dense_grad.clone()
        dense_reference.grad = dense_grad.clone()
        opt.step()
        reference.step()
        torch_adam.step()
    assert torch.equal(params[0].detach(), reference_params[0].detach())
    assert not torch.equal(params[0].detach(), model()[0].detach())
    # The dense vector: torch's Adam with the same NumPy lr (its step size then a float32).
    assert torch.equal(params[1].detach(), dense_reference.detach())
    assert isinstance(opt.param_groups[0]["lr"], np.float32)


@pytest.mark.parametrize("value, message", [
    (True, r"invalid learning rate lr True; it must be a real number >= 0"),
    ("0.1", r"invalid learning rate lr '0.1'"),
    (float("nan"), r"invalid learning rate lr nan"),
    (-1e-3, r"invalid learning rate lr -0.001"),
    (torch.tensor(-0.5), r"invalid learning rate lr -0.5"),
    (torch.tensor([0.01, 0.01]), r"a tensor learning rate lr must be a floating-point tensor of one element"),
    (torch.tensor(1), r"a tensor learning rate lr must be a floating-point tensor of one element"),
    (torch.tensor(0.1, device="meta"), r"a tensor learning rate lr must be .* \(not on the meta device\)"),
], ids=["bool", "str", "nan", "negative", "negative tensor", "two-element tensor", "int tensor", "meta tensor"])
def test_lazy_adam_refuses_lr_that_is_no_real_number(value, message):
    """A bool, a string, NaN, a negative number or a tensor that is no learning rate as lr:
    refused at construction, in add_param_group and at step time (with nothing updated)."""
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"LazyAdam: " + message):
        sk.LazyAdam([param], lr=value)
    opt = sk.LazyAdam([param], lr=np.float32(0.1))
    with pytest.raises(ValueError, match=r"add_param_group \(parameter group 1\): " + message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": value})
    opt.param_groups[0]["lr"] = value
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"LazyAdam.step \(parameter group 0\): " + message):
        opt.step()
    assert not opt.state and torch.equal(param.detach(), torch.zeros(3))
    with pytest.raises(ValueError, match=r"a tensor beta is not supported"):
        sk.LazyAdam([param], betas=(torch.tensor(0.9), 0.99))


def _schedulers():
    return {
        "lambda_numpy": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: np.float32(0.5) ** epoch),
        "lambda_numpy_float64": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: np.float64(0.7) ** e),
        "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12),
    }


@pytest.mark.parametrize("scheduler", ["lambda_numpy", "lambda_numpy_float64", "step", "one_cycle"])
def test_lazy_adam_under_lr_schedulers_mid_run(scheduler):
    """An LR scheduler attached mid-run (after 3 plain steps; OneCycleLR also sets beta1):
    a dense model's numbers are torch.optim.Adam's under the same scheduler, bit for bit, and
    an embedding table's those of LazyAdam given each step's settings as floats."""
    make = _schedulers()[scheduler]
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    table = torch.nn.Parameter(torch.randn(10, 3))
    twin_linear = copy.deepcopy(linear)
    float_table = torch.nn.Parameter(table.detach().clone())
    opt = sk.LazyAdam([table, *linear.parameters()], lr=0.01)
    torch_adam = torch.optim.Adam(twin_linear.parameters(), lr=0.01)
    float_lazy = sk.LazyAdam([float_table], lr=0.01)
    gen = torch.Generator().manual_seed(2)
    schedulers = []
    for step in range(10):
        if step == 3:
            schedulers = [make(opt), make(torch_adam)]
        x = torch.randn(8, 4, generator=gen)
        rows = torch.randperm(10, generator=gen)[:4].tolist()
        values = torch.randn(4, 3, generator=gen)
        for model, optimizer in ((linear, opt), (twin_linear, torch_adam)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
        table.grad = _sparse_grad(rows, values, (10, 3))
        float_table.grad = _sparse_grad(rows, values, (10, 3))
        group = opt.param_groups[0]
        float_lazy.param_groups[0].update(lr=float(group["lr"]), betas=tuple(map(float, group["betas"])))
        opt.step()
        torch_adam.step()
        float_lazy.step()
        for s in schedulers:
            s.step()
    assert schedulers and opt.param_groups[0]["lr"] != 0.01
    assert opt.param_groups[0]["lr"] == torch_adam.param_groups[0]["lr"]
    for mine, other in zip(linear.parameters(), twin_linear.parameters()):
        assert torch.equal(mine, other)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[mine][key], torch_adam.state[other][key])
    assert torch.equal(table.detach(), float_table.detach())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[table][key], float_lazy.state[float_table][key])


def test_every_op_that_writes_in_place_marks_what_it_wrote():
    """Each op whose schema writes an argument has the version-marking autograd kernel."""
    writing = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sparsekit::")
               and not name.startswith("sparsekit::_")
               and any(a.alias_info is not None and a.alias_info.is_write
                       for a in getattr(torch.ops.sparsekit, name.split("::")[1]).default._schema.arguments)]
    assert {"sparsekit::lazy_adam_", "sparsekit::lazy_adam_tables_", "sparsekit::hash_table_insert_absent_",
            "sparsekit::hash_table_erase_"} <= set(writing)
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView") for name in writing)
    slot_keys, slot_rows = torch.full((16,), -1, dtype=torch.int64), torch.full((16,), -1, dtype=torch.int64)
    torch.ops.sparsekit.hash_table_insert_absent_(slot_keys, slot_rows, torch.tensor([5]), torch.tensor([0]))
    assert (slot_keys._version, slot_rows._version) == (1, 1)


def test_one_sparse_table_steps_through_the_lazy_adam_kernel():
    """DESIGN: sparse gradients -> the fused lazy_adam_ op (one float32 table calls it
    itself; several, or a half table, go through the multi-table kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    table = torch.nn.Embedding(10, 4, sparse=True)
    reference = copy.deepcopy(table)
    optimizer, sparse_adam = sk.LazyAdam(table.parameters(), lr=0.1), torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    for keys in ([1, 2, 2], [7], [2, 9]):
        for module, opt in ((table, optimizer), (reference, sparse_adam)):
            opt.zero_grad()
            module(torch.tensor(keys)).pow(2).sum().backward()
        with Calls() as calls:
            optimizer.step()
        sparse_adam.step()
        assert calls.ops.count("sparsekit.lazy_adam_.default") == 1 and not any("tables" in op for op in calls.ops)
        torch.testing.assert_close(table.weight, reference.weight, **WEIGHT_TOL[torch.float32])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -3.0, 2.5, 2.0**70])
def test_a_step_counter_no_update_can_advance_changes_nothing(bad):
    """A step value edited into the state failed in the update (NaN, inf, 2**70 in torch's
    or the kernel's conversion, -3 in the kernel's check) after the parameters before it had
    been updated; every counter is now checked first."""
    first = torch.nn.Parameter(torch.randn(20, 4))                         # the fused path
    second = torch.nn.Parameter(torch.randn(20, 4, dtype=torch.float64))   # one table at a time
    optimizer = sk.LazyAdam([first, second], lr=0.01)

    def gradients():
        for p in (first, second):
            p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.ones(2, 4, dtype=p.dtype), (20, 4))
    gradients()
    optimizer.step()
    optimizer.state[second]["step"] = torch.tensor(bad, dtype=torch.float64)
    gradients()
    before = copy.deepcopy(optimizer.state_dict()), first.detach().clone(), second.detach().clone()
    with pytest.raises(RuntimeError, match=r"^LazyAdam: the state of parameter 1 of group 0 \(shape \(20, 4\)\): "
                                           r"'step' must be a finite integer >= 0 below 2\*\*63 - 1, got "):
        optimizer.step()
    assert torch.equal(first, before[1]) and torch.equal(second, before[2])
    assert optimizer.state[first]["step"].item() == 1
    optimizer.state[second]["step"] = torch.tensor(1.0, dtype=torch.float64)
    optimizer.step()
    assert optimizer.state[first]["step"].item() == optimizer.state[second]["step"].item() == 2


@pytest.mark.parametrize("saved", [2**63 - 2, float(2**63 - 1024), 2**63 - 1, 2.0**70])
def test_a_step_counter_that_loads_is_one_a_step_advances(saved):
    """load_state_dict checked the saved value and step the kept one (a float, where
    2**63 - 2 is 2**63): such a state loaded, then every step raised."""
    param = torch.nn.Parameter(torch.zeros(4, 2))
    optimizer = sk.LazyAdam([param], lr=0.1)
    state = {"state": {0: {"step": saved, "exp_avg": torch.zeros(4, 2), "exp_avg_sq": torch.zeros(4, 2)}},
             "param_groups": [dict(optimizer.param_groups[0], params=[0])]}
    with pytest.raises(ValueError, match=r"'step' must be a finite integer >= 0 below 2\*\*63 - 1"):
        optimizer.load_state_dict(state)
    assert not optimizer.state
    state["state"][0]["step"] = torch.tensor(2.0**63 - 1024, dtype=torch.float64)  # kept as it is
    optimizer.load_state_dict(state)
    param.grad = torch.ones(4, 2)
    optimizer.step()


def test_state_made_under_inference_mode_is_refused_before_anything_changes():
    """Moments loaded under torch.inference_mode() cannot be updated in place outside it:
    the step raises naming them, with every parameter unchanged (an embedding shard's rows
    and moments were updated before the step counter's add failed)."""
    torch.manual_seed(0)
    emb = sk.DistributedEmbedding("sum", 32, 4, 1, 2)
    dense = torch.nn.Linear(4, 1)
    optimizer = sk.LazyAdam([*emb.parameters(), *dense.parameters()], lr=0.1)
    keys = torch.tensor([[[1, 5]], [[3, 9]]])

    def backward():
        dense(emb(keys).flatten(1)).sum().backward()

    backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.inference_mode():  # as a state copied or loaded there holds them
        optimizer.state[emb.weight] = {key: value.clone() for key, value in optimizer.state[emb.weight].items()}
    backward()
    before = [p.detach().clone() for p in (emb.weight, dense.weight, dense.bias)]
    with pytest.raises(RuntimeError, match=r"made under torch.inference_mode\(\).*nothing was updated"):
        optimizer.step()
    for p, b in zip((emb.weight, dense.weight, dense.bias), before):
        assert torch.equal(p.detach(), b)


def test_load_state_dict_pre_hooks_run_before_lazy_adams_checks():
    """torch runs register_load_state_dict_pre_hook hooks first and loads what they return
    (the documented way to migrate a saved state): LazyAdam checks and loads that, once."""
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = sk.LazyAdam([param])
    param.grad = torch.ones(3)
    optimizer.step()
    saved = optimizer.state_dict()
    old = {"state": {0: {"t": saved["state"][0]["step"], "m": saved["state"][0]["exp_avg"],
                         "v": saved["state"][0]["exp_avg_sq"]}},
           "param_groups": saved["param_groups"]}
    calls = []

    def migrate(opt, state_dict):
        calls.append(1)
        return {"state": {k: {"step": v["t"], "exp_avg": v["m"], "exp_avg_sq": v["v"]}
                          for k, v in state_dict["state"].items()},
                "param_groups": state_dict["param_groups"]}

    other = torch.nn.Parameter(torch.randn(3))
    loaded = sk.LazyAdam([other])
    handle = loaded.register_load_state_dict_pre_hook(migrate)
    loaded.load_state_dict(old)
    assert len(calls) == 1
    state = loaded.state[other]
    assert state["step"].item() == 1
    assert torch.equal(state["exp_avg"], saved["state"][0]["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])
    handle.remove()  # the handle still reaches the optimizer's hooks
    with pytest.raises(ValueError, match="lacks"):
        loaded.load_state_dict(old)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_shard_dense_gradient_is_adam_on_a_float32_copy(dtype):
    """A float16 / bfloat16 embedding shard (float32 moments) with a dense gradient (an L2
    term over the whole weight, say) is updated: torch.optim.Adam's numbers on a float32 copy
    of the weight, rounded to the shard's dtype once per step."""
    start = torch.randn(6, 4, generator=torch.Generator().manual_seed(5)).to(dtype)
    shard = torch.nn.Parameter(start.clone())
    shard_registry.register(shard)
    reference = torch.nn.Parameter(start.float())
    ours = sk.LazyAdam([shard], lr=0.05)
    adam = torch.optim.Adam([reference], lr=0.05, foreach=False)
    for step in range(3):
        grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 + step))
        shard.grad = grad.to(dtype)
        reference.grad = grad.to(dtype).float()
        ours.step()
        adam.step()
        with torch.no_grad():
            reference.copy_(reference.to(dtype).float())  # the shard holds the rounded weight
        assert not torch.equal(shard.detach(), start)
        torch.testing.assert_close(shard.detach().float(), reference.detach(), rtol=0, atol=0)
        torch.testing.assert_close(ours.state[shard]["exp_avg"], adam.state[reference]["exp_avg"])


def test_lazy_adam_takes_a_tensor_lr_as_torch_adam_does():
    """lr as a one-element tensor (torch.optim.Adam's, a scheduler may change it in place):
    the same numbers as the float lr, sparse and dense, and an in-place change takes effect
    at the next step."""
    torch.manual_seed(0)
    results = []
    for lr in (0.01, torch.tensor(0.01)):
        table = torch.nn.Parameter(torch.arange(18.0).view(6, 3) / 7)
        dense = torch.nn.Parameter(torch.arange(4.0) / 3)
        opt = sk.LazyAdam([table, dense], lr=lr)
        for step in range(3):
            table.grad = _sparse_grad([1, 4], torch.full((2, 3), 0.5 + step), (6, 3))
            dense.grad = torch.full((4,), 0.25 * (step + 1))
            opt.step()
            if isinstance(lr, torch.Tensor):
                lr.fill_(0.02)
            else:
                opt.param_groups[0]["lr"] = 0.02
        results.append((table.detach().clone(), dense.detach().clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])

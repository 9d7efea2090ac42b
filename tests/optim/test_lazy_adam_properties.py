"""Property-based tests of the raw lazy_adam_ op against torch.optim.SparseAdam.

Thresholds crossed (csrc/cpu/lazy_adam_cpu.cpp, csrc/cuda/lazy_adam_cuda.cu): CPU tasks of
max(1, 16384 / D) rows and the row-range check in tasks of 2^14; rows prefetched 4 ahead;
SSE2 lanes of 4 floats / 2 doubles with a scalar tail (D mod 4, D mod 2); CUDA warps of 32
columns, 8 rows per block, grids capped at 2^20 / 2^16 blocks.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples, num_threads, sizes, thread_counts
from test_lazy_adam import reference_lazy_adam

import sparsekit as sk

EPS = {torch.float32: 2.0**-23, torch.float64: 2.0**-52}


def assert_weight_close(got, want, old):
    """Weights go through sqrt, where torch's vectorized CPU sqrt may differ from the
    correctly rounded one in the last bit (the kernel's is correctly rounded): a few ulps of
    the larger of w and the update apart (more than an ulp of w when they cancel)."""
    # eps == 0 with v rounded to 0 (beta2 == 0, a tiny gradient): m / 0 is inf and lr == 0
    # makes 0 * inf NaN, in SparseAdam as in the kernel.
    odd = ~want.isfinite()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[odd & ~want.isnan()], want[odd & ~want.isnan()])
    got, want, old = got[~odd], want[~odd], old[~odd]
    bound = 4 * EPS[got.dtype] * (old.abs() + (want - old).abs()) + torch.finfo(got.dtype).tiny
    assert bool(((got - want).abs() <= bound).all()), (got - want).abs().max()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, except that a NaN equals any NaN (x86 and CUDA make NaNs with
    different payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    keep = ~a.isnan()
    return torch.equal(a[keep].view(as_int), b[keep].view(as_int))


TRAILING = st.sampled_from([(1,), (2,), (3,), (4,), (5,), (7,), (8,), (16,), (33,), (64,), (2, 3), (0,)])
HYPER = st.fixed_dictionaries(dict(
    step=st.one_of(st.sampled_from([1, 2, 10, 1000, 10**6]), st.integers(1, 10**7)),
    lr=st.sampled_from([0.0, 1e-3, 0.01, 1.0]),
    beta1=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    beta2=st.sampled_from([0.0, 0.9, 0.999, 0.9999]),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]),
))


def random_state(num_rows, trailing, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (num_rows,) + trailing
    weight = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    exp_avg = (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    exp_avg_sq = (0.01 * torch.rand(shape, generator=g, dtype=torch.float64) + 1e-6).to(dtype)
    return weight, exp_avg, exp_avg_sq


def sparse_adam_reference(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.SparseAdam from the given state, on the coalesced gradient; weight decay
    folded into the gradient first (g + wd * w, as the op documents)."""
    param = torch.nn.Parameter(weight.clone())
    order = torch.argsort(rows.long())
    r, g = rows.long()[order], grad[order]
    if weight_decay != 0.0:
        g = g + weight_decay * weight[r]
    param.grad = torch.sparse_coo_tensor(r.unsqueeze(0), g, weight.shape, check_invariants=True).coalesce()
    opt = torch.optim.SparseAdam([param])
    # SparseAdam's constructor refuses lr == 0 and eps == 0; the update formula takes them.
    opt.param_groups[0].update(lr=lr, betas=(beta1, beta2), eps=eps)
    opt.state[param] = {"step": step - 1, "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    if g.numel() > 0:
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@st.composite
def adam_problems(draw, max_updates: int = 200_000):
    trailing = draw(TRAILING)
    width = math.prod(trailing)
    num_updates = draw(sizes(max_updates))
    if num_updates * max(width, 1) > 1 << 20:
        num_updates = (1 << 20) // max(width, 1)
    num_rows = num_updates + draw(st.sampled_from([0, 1, 5, 1000]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    index_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    seed = draw(st.integers(0, 2**31 - 1))
    hyper = draw(HYPER)
    weight_decay = draw(st.sampled_from([0.0, 0.0, 0.01, 0.5]))
    g = torch.Generator().manual_seed(seed + 1)
    rows = torch.randperm(num_rows, generator=g)[:num_updates].to(index_dtype)
    grad = torch.randn((num_updates,) + trailing, generator=g, dtype=torch.float64).to(dtype)
    return random_state(num_rows, trailing, dtype, seed), rows, grad, hyper, weight_decay


@examples(30)
@given(problem=adam_problems(), threads=thread_counts)
def test_lazy_adam_property_matches_sparse_adam(device, problem, threads):
    """float32/float64: moments bit-identical to SparseAdam, weights within ulps; half
    types: the float32 computation rounded once; untouched rows keep weights and moments
    bit for bit; CUDA equals the CPU kernel bit for bit."""
    (weight, exp_avg, exp_avg_sq), rows, grad, hyper, weight_decay = problem
    args = (hyper["step"], hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], weight_decay)
    # Clones: on the CPU .to(device) would alias the inputs the reference starts from.
    w, m, v = (t.clone().to(device) for t in (weight, exp_avg, exp_avg_sq))
    with num_threads(threads):
        sk.ops.lazy_adam_(w, m, v, rows.to(device), grad.to(device), *args)
    w, m, v = w.cpu(), m.cpu(), v.cpu()
    touched = torch.zeros(weight.shape[0], dtype=torch.bool)
    touched[rows.long()] = True
    for new, old in ((w, weight), (m, exp_avg), (v, exp_avg_sq)):
        assert same_bits(new[~touched], old[~touched])
    if weight.dtype in (torch.float32, torch.float64):
        want_w, want_m, want_v = sparse_adam_reference(weight, exp_avg, exp_avg_sq, rows, grad, *args)
        assert same_bits(m, want_m)
        assert same_bits(v, want_v)
        assert_weight_close(w, want_w, weight)
    else:
        # The documented update in float32 op by op, rounded to the half type once.
        want_w, want_m, want_v = reference_lazy_adam(weight, exp_avg, exp_avg_sq, rows, grad, *args)
        assert same_bits(m, want_m) and same_bits(v, want_v)
        # One ulp of the half type: a last-bit sqrt difference in float32 may flip a rounding.
        ulp = 2**-10 if weight.dtype == torch.float16 else 2**-7
        torch.testing.assert_close(w.float(), want_w.float(), rtol=ulp, atol=1e-6, equal_nan=True)
    if device.type == "cuda":
        cw, cm, cv = weight.clone(), exp_avg.clone(), exp_avg_sq.clone()
        sk.ops.lazy_adam_(cw, cm, cv, rows, grad, *args)
        assert same_bits(w, cw) and same_bits(m, cm) and same_bits(v, cv)


@examples(5)
@given(problem=adam_problems(max_updates=100_000))
def test_lazy_adam_property_thread_invariant(problem):
    """CPU: the same bits on 1..4 threads (rows are distinct, so tasks never share a row)."""
    (weight, exp_avg, exp_avg_sq), rows, grad, hyper, weight_decay = problem
    args = (hyper["step"], hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], weight_decay)
    results = []
    for threads in (1, 2, 3, 4):
        w, m, v = weight.clone(), exp_avg.clone(), exp_avg_sq.clone()
        with num_threads(threads):
            sk.ops.lazy_adam_(w, m, v, rows, grad, *args)
        results.append((w, m, v))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert same_bits(a, b)


@pytest.mark.parametrize("bad_at", [0, (1 << 14) - 1, 1 << 14, 50_000 - 1])
def test_lazy_adam_bad_row_anywhere_writes_nothing(device, bad_at):
    """A row out of range at any task edge raises and leaves every tensor untouched."""
    weight, exp_avg, exp_avg_sq = random_state(60_000, (4,), torch.float32, 0)
    rows = torch.randperm(60_000, generator=torch.Generator().manual_seed(1))[:50_000]
    rows[bad_at] = 60_000
    grad = torch.randn(50_000, 4)
    w, m, v = (t.clone().to(device) for t in (weight, exp_avg, exp_avg_sq))
    with pytest.raises(RuntimeError, match="lazy_adam_: rows holds 60000"):
        sk.ops.lazy_adam_(w, m, v, rows.to(device), grad.to(device), 1, 0.1, 0.9, 0.999, 1e-8)
    assert torch.equal(w.cpu(), weight) and torch.equal(m.cpu(), exp_avg) and torch.equal(v.cpu(), exp_avg_sq)


@st.composite
def element_wise_problems(draw):
    """A parameter of 1 to 3 dims and sparse gradients of sparse_dim 1..ndim, with repeated
    entries or not, entry counts across the kernel's task edges (2^14 rows) and empty."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5, 17, 64, 130]), min_size=ndim, max_size=ndim)))
    if math.prod(shape) < 1 << 14 and draw(st.booleans()):
        shape = (shape[0] * 128,) + shape[1:]  # enough rows for more than one task
    sparse_dim = draw(st.integers(1, ndim))
    rows = math.prod(shape[:sparse_dim])
    entries = min(draw(sizes(1 << 16)), max(1, (1 << 20) // max(1, math.prod(shape[sparse_dim:]))))
    return dict(shape=shape, sparse_dim=sparse_dim, entries=entries, rows=rows,
                coalesced=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                maximize=draw(st.booleans()), weight_decay=draw(st.sampled_from([0.0, 0.1])),
                seed=draw(st.integers(0, 2**31 - 1)))


@examples(20)
@given(problem=element_wise_problems(), threads=thread_counts)
def test_lazy_adam_property_element_wise_gradients_match_sparse_adam(device, problem, threads):
    """LazyAdam on element-wise sparse gradients (sparse_dim > 1, as torch.optim.SparseAdam
    takes them) and on row gradients of the same parameters: two steps, moments bit for bit
    SparseAdam's, weights within ulps (on CUDA with repeated entries: within float
    tolerances), every entry no gradient names untouched."""
    p = problem
    g = torch.Generator().manual_seed(p["seed"])
    weight = torch.randn(p["shape"], generator=g, dtype=torch.float64).to(p["dtype"])
    mine, ref = (torch.nn.Parameter(weight.clone().to(device)) for _ in range(2))
    opt = sk.LazyAdam([mine], lr=0.01, maximize=p["maximize"], weight_decay=p["weight_decay"])
    ref_opt = torch.optim.SparseAdam([ref], lr=0.01)  # maximize folded into its gradient below
    named = torch.zeros(p["shape"][:p["sparse_dim"]], dtype=torch.bool)
    # CUDA sums an uncoalesced gradient's repeated entries with atomics, in no fixed order:
    # there the numbers are compared within float tolerances, elsewhere bit for bit.
    exact = device.type == "cpu" or p["coalesced"]
    for _ in range(2):
        flat = torch.randint(0, p["rows"], (p["entries"],), generator=g)
        if p["coalesced"]:
            flat = flat.unique()
        indices = torch.stack(torch.unravel_index(flat, p["shape"][:p["sparse_dim"]])) if flat.numel() else \
            torch.zeros((p["sparse_dim"], 0), dtype=torch.long)
        named[tuple(indices)] = True
        values = torch.randn((flat.numel(),) + p["shape"][p["sparse_dim"]:], generator=g,
                             dtype=torch.float64).to(p["dtype"])
        grad = torch.sparse_coo_tensor(indices, values, p["shape"], check_invariants=True)
        grad = grad.coalesce() if p["coalesced"] else grad
        mine.grad = grad.clone().to(device)
        # SparseAdam's gradient: repeated entries summed in their order (as LazyAdam does;
        # torch's coalesce() adds them in another order), negated for maximize, then the
        # weight decay added (SparseAdam has none), in torch.optim.Adam's order.
        trailing = p["shape"][p["sparse_dim"]:]
        summed = torch.zeros((p["rows"],) + trailing, dtype=p["dtype"]).index_add_(0, flat, values)
        distinct = flat.unique()
        ref_values = -summed[distinct] if p["maximize"] else summed[distinct]
        if p["weight_decay"]:
            ref_values = ref_values + p["weight_decay"] * ref.detach().cpu().reshape((p["rows"],) + trailing)[distinct]
        ref_indices = torch.stack(torch.unravel_index(distinct, p["shape"][:p["sparse_dim"]])) if distinct.numel() \
            else torch.zeros((p["sparse_dim"], 0), dtype=torch.long)
        ref_grad = torch.sparse_coo_tensor(ref_indices, ref_values, p["shape"], is_coalesced=True,
                                           check_invariants=True)
        ref.grad = ref_grad.to(device)
        before = mine.detach().clone()
        with num_threads(threads):
            opt.step()
        if ref_grad._nnz():
            ref_opt.step()
        # Entries no gradient named so far keep their first value, bit for bit.
        assert same_bits(mine.detach()[~named.to(device)].cpu(), weight[~named])
        if exact:
            assert_weight_close(mine.detach().cpu(), ref.detach().cpu(), before.cpu())
        else:
            torch.testing.assert_close(mine.detach().cpu(), ref.detach().cpu())
        if ref_grad._nnz():
            state, ref_state = opt.state[mine], ref_opt.state[ref]
            for name in ("exp_avg", "exp_avg_sq"):
                if exact:
                    assert same_bits(state[name].cpu(), ref_state[name].cpu())
                else:
                    torch.testing.assert_close(state[name].cpu(), ref_state[name].cpu())
        # Make the two parameters equal again so that ulp differences do not compound.
        with torch.no_grad():
            mine.copy_(ref)

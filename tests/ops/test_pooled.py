"""The pooled-read family (pooled_read, pooled_read_backward, pooled_read_update_) against
plain-torch references, on every device: drawn layouts that cross the kernels' vector
widths, chunking and grouping paths, every dtype, weights and means, skipped rows, thread
counts; the optimizers' arithmetic; bad input refused (or recorded in the errors slots)
with nothing written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from properties import examples, num_threads, thread_counts

import sparsekit as sk  # noqa: F401  (registers the ops)

ops = torch.ops.sparsekit
NO_BAD = 2**63 - 1


def _problem(seed, num_tables, num_features, batch, max_len, dims, rows_per_table, dtype, device, weighted,
             missing=0.1, hot=False):
    """A random call: tables, each feature's table (some -1: another call's), CSR bags."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(r, d, generator=g) * 0.5).to(dtype).to(device) for r, d in zip(rows_per_table, dims)]
    tables = [int(torch.randint(-1, num_tables, (1,), generator=g)) if f else
              int(torch.randint(0, num_tables, (1,), generator=g)) for f in range(num_features)]
    columns, total = [], 0
    for t in tables:
        columns.append(total)
        total += dims[t] if t >= 0 else 0
    means = [int(torch.randint(0, 2, (1,), generator=g)) for _ in tables]
    lengths = torch.randint(0, max_len + 1, (num_features * batch,), generator=g)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    nnz = int(offsets[-1])
    rows = torch.empty(nnz, dtype=torch.int64)
    for bag in range(num_features * batch):
        t = tables[bag // batch] if batch else 0
        bound = rows_per_table[max(t, 0)]
        part = torch.randint(0, max(bound, 1), (int(lengths[bag]),), generator=g)
        if hot:
            part[torch.rand(part.numel(), generator=g) < 0.6] = 0
        part[torch.rand(part.numel(), generator=g) < missing] = -1
        rows[offsets[bag]:offsets[bag + 1]] = part if bound > 0 else -1
    psw = torch.rand(nnz, generator=g).to(device) if weighted else None
    return weights, rows.to(device), offsets.to(device), psw, tables, columns, means, total



def _split(grad, weights, tables, columns):
    """Each feature's output gradient: a column view of the [B, total_dim] block (an empty
    placeholder for a feature of another call)."""
    return [grad[:, c:c + weights[t].shape[1]] if t >= 0 else grad.new_empty(0) for t, c in zip(tables, columns)]


def _reference(weights, rows, offsets, psw, tables, columns, means, total):
    """Float64 pooled read (the kernels sum in float32; half tables round their output)."""
    num_features = len(tables)
    batch = (offsets.numel() - 1) // num_features
    out = torch.zeros(batch, total, dtype=torch.float64)
    offsets, rows = offsets.cpu(), rows.cpu()
    for f, t in enumerate(tables):
        if t < 0:
            continue
        w64 = weights[t].double().cpu()
        for b in range(batch):
            bag = f * batch + b
            s, e = int(offsets[bag]), int(offsets[bag + 1])
            acc = torch.zeros(w64.shape[1], dtype=torch.float64)
            for k in range(s, e):
                r = int(rows[k])
                if r >= 0:
                    acc += w64[r] * (float(psw[k]) if psw is not None else 1.0)
            if means[f] and e > s:
                acc /= e - s
            out[b, columns[f]:columns[f] + w64.shape[1]] = acc
    return out


def _tolerance(dtype):
    return {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


layouts = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31),
    "num_tables": st.integers(1, 4),
    "num_features": st.integers(1, 5),
    "batch": st.sampled_from([0, 1, 2, 7, 64, 300]),
    "max_len": st.sampled_from([0, 1, 3, 20, 40]),
    # Dims crossing every vector width: scalar tails, 1-16 vectors of 8 / 16 lanes, 2 passes.
    "dims": st.lists(st.sampled_from([1, 3, 8, 16, 17, 32, 64, 100, 128, 256]), min_size=4, max_size=4),
    "rows": st.lists(st.sampled_from([1, 5, 64, 1000]), min_size=4, max_size=4),
    "dtype": st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    "weighted": st.booleans(),
    "hot": st.booleans(),
})


@examples(12)
@given(layout=layouts, threads=thread_counts)
def test_pooled_read_matches_a_reference(device, layout, threads):
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        layout["seed"], layout["num_tables"], layout["num_features"], layout["batch"], layout["max_len"],
        layout["dims"], layout["rows"], layout["dtype"], device, layout["weighted"], hot=layout["hot"])
    weights = weights[:layout["num_tables"]]
    with num_threads(threads):
        out = ops.pooled_read(weights, rows, offsets, psw, tables, columns, means, total)
    assert out.dtype == layout["dtype"] and tuple(out.shape) == (layout["batch"], total)
    rtol, atol = _tolerance(layout["dtype"])
    torch.testing.assert_close(out.cpu().double(), _reference(weights, rows, offsets, psw, tables, columns, means,
                                                              total), rtol=rtol, atol=atol)


def _autograd_reference(weights, rows, offsets, psw, tables, columns, means, total, grad):
    """Each table's dense gradient of sum(out * grad), by torch's autograd in float64."""
    leaves = [w.detach().double().cpu().requires_grad_() for w in weights]
    num_features = len(tables)
    batch = (offsets.numel() - 1) // num_features
    offsets, rows = offsets.cpu(), rows.cpu()
    loss = torch.zeros((), dtype=torch.float64)
    for f, t in enumerate(tables):
        if t < 0:
            continue
        lengths = offsets[f * batch + 1:(f + 1) * batch + 1] - offsets[f * batch:(f + 1) * batch]
        bag = torch.repeat_interleave(torch.arange(batch), lengths)
        start, end = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
        r = rows[start:end]
        keep = r >= 0
        vectors = leaves[t][r.clamp(min=0)] * keep.unsqueeze(1)
        if psw is not None:
            vectors = vectors * psw[start:end].double().cpu().unsqueeze(1)
        pooled = torch.zeros(batch, leaves[t].shape[1], dtype=torch.float64).index_add(0, bag, vectors)
        if means[f]:
            pooled = pooled / lengths.clamp(min=1).double().unsqueeze(1)
        loss = loss + (pooled * grad[:, columns[f]:columns[f] + leaves[t].shape[1]].double().cpu()).sum()
    loss.backward()
    return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


@examples(10)
@given(layout=layouts, threads=thread_counts)
def test_pooled_read_backward_groups_rows_and_sums_their_gradient(device, layout, threads):
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        layout["seed"], layout["num_tables"], layout["num_features"], layout["batch"], layout["max_len"],
        layout["dims"], layout["rows"], layout["dtype"], device, layout["weighted"], hot=layout["hot"])
    weights = weights[:layout["num_tables"]]
    grad = torch.randn(layout["batch"], total, generator=torch.Generator().manual_seed(1)).to(layout["dtype"])
    grad = grad.to(device)
    with num_threads(threads):
        unique_rows, per_table, values = ops.pooled_read_backward(_split(grad, weights, tables, columns), weights, rows,
                                                                  offsets, psw, tables, means)
    expected = _autograd_reference(weights, rows, offsets, psw, tables, columns, means, total, grad)
    counts = per_table.tolist()
    assert sum(counts) == unique_rows.numel()
    row_start = value_start = 0
    for t, (weight, count) in enumerate(zip(weights, counts)):
        mine = unique_rows[row_start:row_start + count].cpu()
        assert torch.equal(mine, torch.unique(mine)), "each table's rows distinct and ascending"
        block = values[value_start:value_start + count * weight.shape[1]].view(count, weight.shape[1]).cpu()
        dense = torch.zeros(weight.shape, dtype=torch.float64)
        dense[mine] = block.double()
        touched = set(mine.tolist())
        read = {int(r) for f, tt in enumerate(tables) if tt == t for r in rows.cpu()[
            int(offsets[f * layout["batch"]]):int(offsets[(f + 1) * layout["batch"]])].tolist() if r >= 0}
        assert touched == read
        rtol, atol = _tolerance(layout["dtype"])
        torch.testing.assert_close(dense, expected[t], rtol=rtol, atol=atol * 10)
        row_start += count
        value_start += count * weight.shape[1]


@pytest.mark.parametrize("high_row", [20_000, 200_000])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_backward_ranks_rows_on_both_sides_of_the_bitmap_threshold(device, high_row, threads):
    """The backward numbers distinct rows with a bitmap while the rows' span is small next to
    the lookups (128 bits a lookup plus 64 Ki), else by hashing then sorting table by table:
    few lookups into two tables reaching row 20k rank by bitmap, row 200k by hash; both give each
    table's rows ascending with their summed gradients."""
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(high_row + 1, 2, generator=g).to(device), torch.randn(high_row + 1, 3, generator=g).to(device)]
    tables, columns, means, batch = [0, 1, 0], [0, 2, 5], [0, 1, 0], 5
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    rows = torch.randint(0, high_row + 1, (int(offsets[-1]),), generator=g)
    rows[::3] = high_row  # a hot row at the top of both tables
    rows[1::7] = -1
    rows, offsets = rows.to(device), offsets.to(device)
    grad = torch.randn(batch, 7, generator=g).to(device)
    with num_threads(threads):
        got = _grouped_gradient(weights, rows, offsets, None, tables, columns, means, grad)
    expected = _autograd_reference(weights, rows, offsets, None, tables, columns, means, 7, grad)
    cpu_rows, bounds = rows.cpu(), offsets.cpu()
    for t, ((r, values), dense) in enumerate(zip(got, expected)):
        read = torch.cat([cpu_rows[int(bounds[f * batch]):int(bounds[(f + 1) * batch])]
                          for f, tt in enumerate(tables) if tt == t])
        assert torch.equal(r.cpu(), torch.unique(read[read >= 0]))
        torch.testing.assert_close(values.cpu().double(), dense[r.cpu()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("num_tables", [1, 2])
def test_a_table_cut_among_the_threads_groups_its_rows_as_one_thread_does(num_tables, scaled):
    """With fewer tables than twice the threads, a table of more than 8192 distinct rows is
    cut into parts that the threads group apart (each part scanning all its table's lookups):
    the gradient and every fused update come out bit for bit as on one thread, and the
    gradient is autograd's; hot rows sit near the middle, a part's bound. Scaled: mean
    features and per-value weights (each slot then keeps its lookup too)."""
    g = torch.Generator().manual_seed(5)
    high, batch = 30_000, 600
    weights = [torch.randn(high, 8, generator=g) for _ in range(num_tables)]
    tables, means = list(range(num_tables)), [int(scaled)] * num_tables
    columns = [8 * t for t in range(num_tables)]
    lengths = torch.randint(0, 60, (num_tables * batch,), generator=g)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    rows = torch.randint(0, high, (int(offsets[-1]),), generator=g)
    rows[::5] = rows[::5] % 3 + high // 2  # hot rows in the middle of the rank range
    rows[1::11] = -1
    grad = torch.randn(batch, 8 * num_tables, generator=g)
    psw = torch.rand(rows.numel(), generator=g) if scaled else None
    results = []
    for threads in (1, 2, 3, 4):
        with num_threads(threads):
            got = _grouped_gradient(weights, rows, offsets, psw, tables, columns, means, grad)
            updated = []
            for optimizer, hyper in (("rowwise_adagrad", [0.1, 0.0, 0.0, 1e-8, 0.01]), ("sgd", [0.1, 0.0, 0.0, 0.0, 0.0])):
                new = [w.clone() for w in weights]
                state = [torch.zeros(high) for _ in weights] if optimizer == "rowwise_adagrad" else []
                ops.pooled_read_update_(new, state, [], [], _split(grad, weights, tables, columns), rows, offsets,
                                        psw, tables, means, optimizer, hyper)
                updated.append((new, state))
        results.append((got, updated))
    expected = _autograd_reference(weights, rows, offsets, psw, tables, columns, means, 8 * num_tables, grad)
    for (r, values), dense in zip(results[0][0], expected):
        # float32 sums of up to thousands of lookups (the hot rows) against float64
        torch.testing.assert_close(values.double(), dense[r], rtol=1e-4, atol=1e-4)
    for got, updated in results[1:]:
        for (r, values), (r0, values0) in zip(got, results[0][0]):
            assert torch.equal(r, r0) and torch.equal(values, values0)
        for (new, state), (new0, state0) in zip(updated, results[0][1]):
            assert all(torch.equal(a, b) for a, b in zip(new + state, new0 + state0))


def _grouped_gradient(weights, rows, offsets, psw, tables, columns, means, grad):
    unique_rows, per_table, values = ops.pooled_read_backward(_split(grad, weights, tables, columns), weights, rows,
                                                              offsets, psw, tables, means)
    out, row_start, value_start = [], 0, 0
    for weight, count in zip(weights, per_table.tolist()):
        out.append((unique_rows[row_start:row_start + count],
                    values[value_start:value_start + count * weight.shape[1]].view(count, weight.shape[1])))
        row_start += count
        value_start += count * weight.shape[1]
    return out


@examples(10)
@given(layout=layouts, threads=thread_counts, steps=st.integers(1, 3), decay=st.sampled_from([0.0, 0.01]))
def test_fused_lazy_adam_is_lazy_adam_bit_for_bit(device, layout, threads, steps, decay):
    """pooled_read_update_("lazy_adam") == pooled_read_backward then lazy_adam_ per table, bit
    for bit for float32 and float64 tables, step after step (LazyAdam's unfused arithmetic)."""
    dtype = layout["dtype"] if layout["dtype"] in (torch.float32, torch.float64) else torch.float32
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        layout["seed"], layout["num_tables"], layout["num_features"], layout["batch"], layout["max_len"],
        layout["dims"], layout["rows"], dtype, device, layout["weighted"], hot=layout["hot"])
    weights = weights[:layout["num_tables"]]
    fused = [w.clone() for w in weights]
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    counters = [torch.zeros((), dtype=torch.int64, device=device) for _ in weights]
    plain = [w.clone() for w in weights]
    plain_moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    read = {t for t in tables if t >= 0}
    hyper = [0.01, 0.9, 0.999, 1e-8, decay]
    for step in range(1, steps + 1):
        grad = torch.randn(layout["batch"], total, generator=torch.Generator().manual_seed(step)).to(dtype).to(device)
        with num_threads(threads):
            ops.pooled_read_update_(fused, [m for m, _ in moments], [v for _, v in moments], counters,
                                    _split(grad, fused, tables, columns), rows, offsets, psw, tables, means,
                                    "lazy_adam", hyper)
        for t, (r, values) in enumerate(_grouped_gradient(plain, rows, offsets, psw, tables, columns, means, grad)):
            if t in read:
                ops.lazy_adam_(plain[t], *plain_moments[t], r, values.to(dtype).contiguous(), step, *hyper)
    for t in range(len(weights)):
        assert torch.equal(fused[t], plain[t]), t
        assert torch.equal(moments[t][0], plain_moments[t][0]) and torch.equal(moments[t][1], plain_moments[t][1])
        assert int(counters[t]) == (steps if t in read else 0)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_sgd_and_adagrads_follow_their_formulas(device, optimizer, dtype):
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        3, 3, 4, 32, 6, [4, 16, 33, 8], [50, 20, 7, 9], dtype, device, True, hot=True)
    weights = weights[:3]
    grad = torch.randn(32, total, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    lr, eps, decay = 0.1, 1e-6, 0.01
    state = [torch.full((w.shape[0],) if optimizer == "rowwise_adagrad" else tuple(w.shape), 0.5,
                        dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
             for w in weights]
    before = [w.clone() for w in weights]
    state_before = [s.clone() for s in state]
    ops.pooled_read_update_(weights, state if optimizer != "sgd" else [], [], [],
                            _split(grad, weights, tables, columns), rows, offsets, psw, tables, means, optimizer,
                            [lr, 0.9, 0.999, eps, decay])
    for t, (r, g) in enumerate(_grouped_gradient(before, rows, offsets, psw, tables, columns, means, grad)):
        w = before[t].double().cpu()
        r, g = r.cpu(), g.double().cpu()
        g = g + decay * w[r]
        if optimizer == "sgd":
            w[r] -= lr * g
        elif optimizer == "adagrad":  # torch.optim.Adagrad's update, per element
            total_sq = state_before[t].double().cpu()[r] + g * g
            torch.testing.assert_close(state[t].double().cpu()[r], total_sq, rtol=1e-5, atol=1e-6)
            w[r] -= lr * g / (total_sq.sqrt() + eps)
        else:
            total_sq = state_before[t].double().cpu()[r] + (g * g).mean(1)
            torch.testing.assert_close(state[t].double().cpu()[r], total_sq, rtol=1e-5, atol=1e-6)
            w[r] -= (lr / (total_sq.sqrt() + eps)).unsqueeze(1) * g
        rtol, atol = _tolerance(dtype)
        torch.testing.assert_close(weights[t].double().cpu(), w, rtol=rtol, atol=atol)


def test_a_tensor_lr_is_read_by_the_update(device):
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        4, 2, 2, 8, 4, [8, 8, 8, 8], [30, 30, 30, 30], torch.float32, device, False)
    weights = weights[:2]
    grad = torch.ones(8, total, device=device)
    a, b = [w.clone() for w in weights], [w.clone() for w in weights]
    grads = _split(grad, a, tables, columns)
    ops.pooled_read_update_(a, [], [], [], grads, rows, offsets, psw, tables, means, "sgd", [0.25, 0, 0, 0, 0])
    ops.pooled_read_update_(b, [], [], [], grads, rows, offsets, psw, tables, means, "sgd", [99.0, 0, 0, 0, 0],
                            torch.tensor([0.25], device=device))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _small_call(device):
    weights = [torch.randn(5, 4, device=device), torch.randn(3, 2, device=device)]
    rows = torch.tensor([0, 4, -1, 2, 1, 0], device=device)
    offsets = torch.tensor([0, 2, 3, 4, 6], device=device)
    return weights, rows, offsets, [0, 1], [0, 4], [0, 1], 6


@pytest.mark.parametrize("bad", ["row", "offsets", "decreasing", "nnz"])
def test_bad_input_raises_naming_it_and_writes_nothing(device, bad):
    weights, rows, offsets, tables, columns, means, total = _small_call(device)
    if bad == "row":
        rows = rows.clone()
        rows[4] = 3  # table 1 has 3 rows
        match = r"rows\[4\] is 3 but its table \(1\) has 3 rows"
    elif bad == "offsets":
        offsets = torch.tensor([1, 2, 3, 4, 6], device=device)
        match = "offsets must rise from 0 to nnz"
    elif bad == "decreasing":
        offsets = torch.tensor([0, 3, 2, 4, 6], device=device)
        match = "offsets must rise from 0 to nnz"
    else:
        offsets = torch.tensor([0, 2, 3, 4, 5], device=device)
        match = "offsets must rise from 0 to nnz"
    grad = torch.ones(2, total, device=device)
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read(weights, rows, offsets, None, tables, columns, means, total)
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read_backward(_split(grad, weights, tables, columns), weights, rows, offsets, None, tables,
                                 means)
    before = [w.clone() for w in weights]
    moments = [torch.zeros_like(w) for w in weights]
    steps = [torch.zeros((), dtype=torch.int64, device=device) for _ in weights]
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read_update_(weights, moments, [m.clone() for m in moments], steps,
                                _split(grad, weights, tables, columns), rows, offsets, None, tables, means,
                                "lazy_adam", [0.1, 0.9, 0.99, 1e-8, 0.0])
    assert all(torch.equal(w, b) for w, b in zip(weights, before))
    assert all(int(s) == 0 for s in steps) and all(not m.any() for m in moments)
    # With error slots the bad part is recorded and left out, the rest done.
    slots = torch.full((2,), NO_BAD, dtype=torch.int64, device=device)
    ops.pooled_read(weights, rows, offsets, None, tables, columns, means, total, slots)
    assert slots.tolist() != [NO_BAD, NO_BAD]


def test_lookups_with_no_bag_are_recorded_as_bag_0_and_left_out(device):
    """B = 0 with values left over: bag 0 is bad. With error slots, the gradient, the fused
    update and the read record bag 0 and leave the values out (nothing changes, nothing
    raised), whatever the memory their codes would have been read from."""
    weights = [torch.randn(4, 3, device=device)]
    rows = torch.tensor([0, 2, 3, 1, 0], device=device)
    offsets = torch.zeros(1, dtype=torch.int64, device=device)
    grads = [torch.empty(0, 3, device=device)]
    for _ in range(3):  # fresh and reused memory alike
        slots = torch.full((2,), NO_BAD, dtype=torch.int64, device=device)
        unique_rows, per_table, values = ops.pooled_read_backward(grads, weights, rows, offsets, None, [0], [0], slots)
        assert slots.tolist() == [0, NO_BAD]
        assert unique_rows.numel() == 0 and per_table.tolist() == [0] and values.numel() == 0
        before = weights[0].clone()
        state = [torch.zeros(4, device=device)]
        slots = torch.full((2,), NO_BAD, dtype=torch.int64, device=device)
        ops.pooled_read_update_(weights, state, [], [], grads, rows, offsets, None, [0], [0], "rowwise_adagrad",
                                [0.1, 0.0, 0.0, 1e-8, 0.0], None, slots)
        assert slots.tolist() == [0, NO_BAD]
        assert torch.equal(weights[0], before) and not state[0].any()


@pytest.mark.parametrize("case", ["no weights", "mixed dtypes", "grads count", "table outside", "grad shape",
                                  "grad dtype", "weights dtype", "state shape", "optimizer", "hyper", "shared",
                                  "errors"])
def test_argument_errors_name_the_argument(case):
    weights, rows, offsets, tables, columns, means, total = _small_call("cpu")
    grads = [torch.ones(2, 4), torch.ones(2, 2)]
    steps = [torch.zeros((), dtype=torch.int64) for _ in weights]
    moments = [torch.zeros_like(w) for w in weights]
    second = [torch.zeros_like(w) for w in weights]
    hyper = [0.1, 0.9, 0.99, 1e-8, 0.0]
    optimizer, errors = "lazy_adam", None
    if case == "no weights":
        weights, match = [], "weights must hold at least one table"
    elif case == "mixed dtypes":
        weights, match = [weights[0], weights[1].double()], "every weight of one call has one dtype"
    elif case == "grads count":
        grads, match = grads[:1], r"grads must hold one tensor per feature \(2\), got 1"
    elif case == "table outside":
        tables, match = [0, 2], r"feature_tables\[1\] must lie in \[-1, 2\)"
    elif case == "grad shape":
        grads, match = [grads[0], torch.ones(3, 2)], r"grads\[1\] must be \[B, D\] = \[2, 2\]"
    elif case == "grad dtype":
        grads, match = [grads[0].double(), grads[1]], r"grads\[0\] is Double on cpu but the weights are Float"
    elif case == "weights dtype":
        weights, match = [w.long() for w in weights], "weights must be float32, float64, float16 or bfloat16"
    elif case == "state shape":
        moments, match = [torch.zeros(5, 3), moments[1]], "the state of table 0 must be"
    elif case == "optimizer":
        optimizer, match = "adadelta", "optimizer must be"
    elif case == "hyper":
        hyper, match = [0.1, 1.5, 0.99, 1e-8, 0.0], "beta1 must be in"
    elif case == "shared":
        second, match = [moments[0], second[1]], "share memory"
    else:
        errors, match = torch.zeros(3, dtype=torch.int64), r"errors must be a contiguous int64 tensor \[2\]"
    before = [w.clone() for w in weights]
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read_update_(weights, moments, second, steps, grads, rows, offsets, None, tables, means,
                                optimizer, hyper, None, errors)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))


def test_opcheck_of_the_family(device):
    weights, rows, offsets, tables, columns, means, total = _small_call(device)
    psw = torch.rand(rows.numel(), device=device)
    torch.library.opcheck(ops.pooled_read.default, (weights, rows, offsets, psw, tables, columns, means, total))
    grad = torch.randn(2, total, device=device)
    grads = _split(grad, weights, tables, columns)
    torch.library.opcheck(ops.pooled_read_backward.default, (grads, weights, rows, offsets, psw, tables, means),
                          test_utils=("test_schema", "test_faketensor"))
    steps = [torch.zeros((), dtype=torch.int64, device=device) for _ in weights]
    torch.library.opcheck(ops.pooled_read_update_.default,
                          ([w.clone() for w in weights], [torch.zeros_like(w) for w in weights],
                           [torch.zeros_like(w) for w in weights], steps, grads, rows, offsets, psw, tables, means,
                           "lazy_adam", [0.1, 0.9, 0.99, 1e-8, 0.0]),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.pooled_read_update_.default,
                          ([w.clone() for w in weights], [], [], [], [grad], rows, offsets, psw, tables, means, "sgd",
                           [0.1, 0.0, 0.0, 0.0, 0.0], None, None, columns),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.pooled_read_backward.default,
                          ([grad], weights, rows, offsets, psw, tables, means, None, columns),
                          test_utils=("test_schema", "test_faketensor"))


def test_results_do_not_depend_on_the_thread_count():
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        11, 3, 5, 700, 25, [16, 64, 3, 8], [2000, 50, 1, 9], torch.float32, "cpu", True, hot=True)
    weights = weights[:3]
    grad = torch.randn(700, total, generator=torch.Generator().manual_seed(2))
    results = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            out = ops.pooled_read(weights, rows, offsets, psw, tables, columns, means, total)
            backward = ops.pooled_read_backward(_split(grad, weights, tables, columns), weights, rows, offsets, psw,
                                                tables, means)
        results.append((out, *backward))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@examples(8)
@given(layout=layouts, optimizer=st.sampled_from(["sgd", "lazy_adam", "rowwise_adagrad", "adagrad"]))
def test_a_block_with_grad_columns_is_its_column_views(device, layout, optimizer):
    """grads = [the [B, W] block] with grad_columns reads each feature's columns of it: the
    same bits as the per-feature views, for the gradient and for every fused update, on a
    block wider than the features (a padded or shared output) and one whose rows are strided."""
    dtype = layout["dtype"]
    weights, rows, offsets, psw, tables, columns, means, total = _problem(
        layout["seed"], layout["num_tables"], layout["num_features"], layout["batch"], layout["max_len"],
        layout["dims"], layout["rows"], dtype, device, layout["weighted"], hot=layout["hot"])
    weights = weights[:layout["num_tables"]]
    shifted = [c + 3 for c in columns]
    wide = torch.randn(layout["batch"], 2 * (total + 3) + 1, generator=torch.Generator().manual_seed(7))
    block = wide.to(dtype).to(device)[:, :total + 3]  # rows strided (the wide row), columns dense
    views = _split(block, weights, tables, shifted)
    expected = ops.pooled_read_backward(views, weights, rows, offsets, psw, tables, means)
    got = ops.pooled_read_backward([block], weights, rows, offsets, psw, tables, means, None, shifted)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def state():
        if optimizer == "sgd":
            return [], [], []
        if optimizer == "rowwise_adagrad":
            return [torch.zeros(w.shape[0], dtype=state_dtype, device=device) for w in weights], [], []
        one = [torch.zeros(w.shape, dtype=state_dtype, device=device) for w in weights]
        if optimizer == "adagrad":
            return one, [], []
        return one, [torch.zeros_like(s) for s in one], [torch.zeros((), dtype=torch.int64, device=device)
                                                         for _ in weights]

    if optimizer == "lazy_adam" and dtype not in (torch.float32, torch.float64):
        return
    a, b = [w.clone() for w in weights], [w.clone() for w in weights]
    sa, sb = state(), state()
    hyper = [0.05, 0.9, 0.999, 1e-6, 0.01]
    ops.pooled_read_update_(a, *sa, _split(block, a, tables, shifted), rows, offsets, psw, tables, means, optimizer,
                            hyper)
    ops.pooled_read_update_(b, *sb, [block], rows, offsets, psw, tables, means, optimizer, hyper, None, None, shifted)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for xs, ys in zip(sa, sb) for x, y in zip(xs, ys))


@pytest.mark.parametrize("case", ["two blocks", "columns count", "column outside", "negative column", "1-D block"])
def test_bad_grad_columns_are_named_and_write_nothing(case):
    weights, rows, offsets, tables, columns, means, total = _small_call("cpu")
    block, grad_columns = torch.ones(2, total), list(columns)
    grads = [block]
    if case == "two blocks":
        grads, match = [block, block], r"with grad_columns, grads must hold one \[B, W\] block, got 2"
    elif case == "columns count":
        grad_columns, match = [0], r"grad_columns must hold one column per feature \(2\), got 1"
    elif case == "column outside":
        grad_columns, match = [0, 5], r"grad_columns\[1\] = 5 puts feature 1's 2 columns outside the block's 6"
    elif case == "negative column":
        grad_columns, match = [-1, 4], r"grad_columns\[0\] = -1"
    else:
        grads, match = [torch.ones(total)], r"grads\[0\] must be a \[B, W\] block"
    before = [w.clone() for w in weights]
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read_update_(weights, [], [], [], grads, rows, offsets, None, tables, means, "sgd",
                                [0.1, 0, 0, 0, 0], None, None, grad_columns)
    with pytest.raises(RuntimeError, match=match):
        ops.pooled_read_backward(grads, weights, rows, offsets, None, tables, means, None, grad_columns)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))

import numpy as np
import pytest
import torch

import sparsekit as sk

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def reference_segment_sum(data: torch.Tensor, ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """index_add_ in float64 over the non-negative ids."""
    keep = ids >= 0
    out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=torch.float64, device=data.device)
    out.index_add_(0, ids[keep].long(), data[keep].double())
    return out


def random_case(device, n=1000, dim=(16,), num_segments=37, dtype=torch.float32, id_dtype=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((n,) + dim, generator=gen).to(dtype).to(device)
    ids = torch.randint(-3, num_segments, (n,), generator=gen).to(id_dtype).to(device)
    return data, ids


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("deterministic", [False, True])
def test_segment_sum_reference(device, dtype, id_dtype, deterministic):
    data, ids = random_case(device, dtype=dtype, id_dtype=id_dtype)
    out = sk.ops.segment_sum(data, ids, 37, deterministic=deterministic)
    assert out.dtype == dtype and out.shape == (37, 16) and out.device == data.device
    want = reference_segment_sum(data, ids, 37)
    torch.testing.assert_close(out.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (200,)])
def test_segment_sum_trailing_shapes(device, shape):
    data, ids = random_case(device, n=300, dim=shape, num_segments=11)
    out = sk.ops.segment_sum(data, ids, 11)
    assert out.shape == (11,) + shape
    torch.testing.assert_close(out.double(), reference_segment_sum(data, ids, 11), rtol=1e-5, atol=1e-4)


def test_segment_sum_large_zipf_like(device):
    """Many rows into a few hot segments: the column split must still add every row once."""
    gen = torch.Generator().manual_seed(4)
    ids = (torch.rand(200_000, generator=gen) ** 4 * 5_000).long()
    data = torch.randn(200_000, 64, generator=gen, dtype=torch.float64)
    out = sk.ops.segment_sum(data.to(device), ids.to(device), 5_000)
    torch.testing.assert_close(out.cpu(), reference_segment_sum(data, ids, 5_000), rtol=1e-9, atol=1e-9)


def test_segment_sum_negative_ids_dropped(device):
    data = torch.arange(12, dtype=torch.float32, device=device).view(6, 2)
    ids = torch.tensor([0, -1, 2, -7, 0, -(2**63)], device=device)
    out = sk.ops.segment_sum(data, ids, 3)
    assert torch.equal(out.cpu(), torch.tensor([[8.0, 10.0], [0.0, 0.0], [4.0, 5.0]]))


def test_segment_sum_empty(device):
    out = sk.ops.segment_sum(torch.empty(0, 4, device=device), torch.empty(0, dtype=torch.int64, device=device), 3)
    assert torch.equal(out.cpu(), torch.zeros(3, 4))
    out = sk.ops.segment_sum(torch.randn(5, 4, device=device), torch.full((5,), -1, device=device), 0)
    assert out.shape == (0, 4)
    out = sk.ops.segment_sum(torch.empty(3, 0, device=device), torch.tensor([0, 1, 1], device=device), 2)
    assert out.shape == (2, 0)


def test_segment_sum_all_in_one_segment(device):
    data = torch.ones(10_000, 3, dtype=torch.float64, device=device)
    out = sk.ops.segment_sum(data, torch.zeros(10_000, dtype=torch.int64, device=device), 2)
    assert torch.equal(out.cpu(), torch.tensor([[10_000.0] * 3, [0.0] * 3], dtype=torch.float64))


def test_segment_sum_out_of_range_raises_and_recovers(device):
    data, ids = random_case(device, num_segments=5)
    ids[17] = 5
    ids[3] = 2**40
    with pytest.raises(RuntimeError, match=r"segment_ids holds 1099511627776 but num_segments is 5"):
        sk.ops.segment_sum(data, ids, 5)
    # The process (and the CUDA context) is still usable.
    ids[17] = ids[3] = 0
    out = sk.ops.segment_sum(data, ids, 5)
    torch.testing.assert_close(out.double(), reference_segment_sum(data, ids, 5), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_segment_sum_bit_identical_run_to_run(device, deterministic):
    data, ids = random_case(device, n=50_000, dim=(64,), num_segments=100)
    first = sk.ops.segment_sum(data, ids, 100, deterministic=True)
    again = sk.ops.segment_sum(data, ids, 100, deterministic=True)
    assert torch.equal(first, again)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            single = sk.ops.segment_sum(data, ids, 100, deterministic=deterministic)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(first, single)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: compares the CUDA kernel with the CPU kernel")
def test_segment_sum_cuda_matches_cpu():
    device = torch.device("cuda")
    data, ids = random_case("cpu", n=100_000, dim=(33,), num_segments=1000, dtype=torch.float64)
    want = sk.ops.segment_sum(data, ids, 1000)
    for deterministic in (False, True):
        got = sk.ops.segment_sum(data.to(device), ids.to(device), 1000, deterministic=deterministic)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


def test_segment_sum_gradcheck(device):
    data, ids = random_case(device, n=20, dim=(3,), num_segments=6, dtype=torch.float64)
    data.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: sk.ops.segment_sum(x, ids, 6), (data,))
    assert torch.autograd.gradcheck(lambda x: sk.ops.segment_mean(x, ids, 6), (data,))


def test_segment_sum_gradient_values(device):
    data = torch.ones(4, 2, device=device, requires_grad=True)
    ids = torch.tensor([1, -1, 0, 1], device=device)
    out = sk.ops.segment_sum(data, ids, 2)
    out.backward(torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device))
    assert torch.equal(data.grad.cpu(), torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 2.0], [3.0, 4.0]]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_segment_mean(device, dtype):
    data, ids = random_case(device, n=500, num_segments=40, dtype=dtype)
    out = sk.ops.segment_mean(data, ids, 40)
    total = reference_segment_sum(data, ids, 40)
    count = reference_segment_sum(torch.ones(500, 1, device=device), ids, 40).clamp(min=1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), total / count, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    empty = sk.ops.segment_mean(torch.ones(2, 3, device=device), torch.tensor([0, 0], device=device), 2)
    assert torch.equal(empty.cpu(), torch.tensor([[1.0] * 3, [0.0] * 3]))
    # The same sums in the same order: on CUDA the default (atomic) sums are ordered by the
    # scheduler, so there the three spellings are compared on the deterministic path.
    out = sk.ops.segment_mean(data, ids, 40, deterministic=True)
    assert torch.equal(sk.ops.segment_reduce(data, ids, 40, reduce="mean", deterministic=True), out)
    assert torch.equal(sk.ops.segment_sum(data, ids, 40, reduce="mean", deterministic=True), out)  # DESIGN's
    assert torch.equal(sk.ops.segment_sum(data, ids, 40, reduce="sum", deterministic=True),
                       sk.ops.segment_sum(data, ids, 40, deterministic=True))
    for reduce_of in (sk.ops.segment_reduce, sk.ops.segment_sum):
        with pytest.raises(ValueError, match="reduce must be 'sum' or 'mean', got 'max'"):
            reduce_of(data, ids, 40, reduce="max")
        with pytest.raises(TypeError, match="reduce must be a str, got None"):
            reduce_of(data, ids, 40, reduce=None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_segment_mean_is_the_float32_mean_rounded_once(device, dtype):
    """It was the sum rounded to the half type, then divided: two float16 rows of 60000
    gave inf (as torch.segment_reduce does) and a quarter of random means were off by one
    unit in the last place."""
    big = torch.tensor([[60000.0], [60000.0]], device=device).to(dtype)
    ids = torch.tensor([0, 0], device=device)
    assert sk.ops.segment_mean(big, ids, 1).item() == torch.tensor(60000.0).to(dtype).item()
    data, ids = random_case(device, n=3000, num_segments=300, dtype=dtype)
    valid = ids >= 0
    total = torch.zeros(300, data.shape[1], dtype=torch.float64, device=device).index_add_(
        0, ids[valid], data[valid].double())
    count = torch.bincount(ids[valid], minlength=300).clamp(min=1).unsqueeze(1)
    exact = (total / count).to(dtype)  # the mean rounded once
    # A float32 sum misses the exact one only near a rounding boundary of the half type.
    assert (sk.ops.segment_mean(data, ids, 300) != exact).float().mean() < 0.01
    empty_rows = torch.zeros(3, 0, dtype=dtype, device=device)  # no column: the dtype still the data's
    assert sk.ops.segment_mean(empty_rows, torch.tensor([0, 1, 1], device=device), 2).dtype == dtype


def test_segment_sum_opcheck(device):
    data, ids = random_case(device, n=50, dim=(4,), num_segments=7)
    for deterministic in (False, True):
        torch.library.opcheck(torch.ops.sparsekit.segment_sum.default,
                              (data.requires_grad_(True), ids, 7, deterministic))
    torch.library.opcheck(torch.ops.sparsekit.segment_sum.default,
                          (torch.empty(0, 4, device=device), torch.empty(0, dtype=torch.int64, device=device), 3, False))


BAD_INPUTS = {
    "integer data": (lambda d: (torch.ones(3, 2, dtype=torch.int64, device=d), torch.zeros(3, dtype=torch.int64, device=d), 2),
                     "data must be float32, float64, float16 or bfloat16"),
    "float ids": (lambda d: (torch.ones(3, 2, device=d), torch.zeros(3, device=d), 2),
                  "segment_ids must be an int64 or int32"),
    "2-D ids": (lambda d: (torch.ones(3, 2, device=d), torch.zeros(3, 1, dtype=torch.int64, device=d), 2),
                "segment_ids must be 1-D"),
    "length mismatch": (lambda d: (torch.ones(3, 2, device=d), torch.zeros(4, dtype=torch.int64, device=d), 2),
                        "segment_ids has 4 entries but data has 3 rows"),
    "negative num_segments": (lambda d: (torch.ones(3, 2, device=d), torch.zeros(3, dtype=torch.int64, device=d), -1),
                              "num_segments must be >= 0"),
    "scalar data": (lambda d: (torch.tensor(1.0, device=d), torch.zeros(1, dtype=torch.int64, device=d), 2),
                    "data must have at least one dimension"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_segment_sum_bad_inputs(device, case):
    make, message = BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.sparsekit.segment_sum(*make(device), False)


@pytest.mark.parametrize("case", list(BAD_INPUTS) + ["id beyond num_segments"])
def test_segment_mean_bad_inputs_name_segment_mean(device, case):
    if case in BAD_INPUTS:
        make, message = BAD_INPUTS[case]
    else:
        make, message = (lambda d: (torch.ones(3, 2, device=d), torch.tensor([0, 5, 1], device=d), 2)), "holds 5"
    with pytest.raises(RuntimeError, match="^segment_mean: .*" + message):
        sk.ops.segment_mean(*make(device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: needs a CPU and a CUDA tensor")
def test_segment_sum_device_mismatch():
    device = torch.device("cuda")
    with pytest.raises(RuntimeError, match="segment_ids is on"):
        sk.ops.segment_sum(torch.ones(3, 2, device=device), torch.zeros(3, dtype=torch.int64), 2)


@pytest.mark.parametrize("rows_per_segment", [2047, 2048, 2049, 5000, 100_000, 3 * 2048 * 2048])
def test_deterministic_tree_above_one_level(device, rows_per_segment):
    """Segments longer than one level of CUDA's deterministic tree (~2048 rows), up to three
    levels: bit-identical run to run, and within float32 rounding of a float64 sum. The CPU
    runs the same cases for the reference."""
    g = torch.Generator().manual_seed(rows_per_segment)
    dim = 1 if rows_per_segment > 100_000 else 4
    ids = torch.cat([torch.zeros(rows_per_segment, dtype=torch.int64), torch.randint(-1, 3, (1000,), generator=g)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    data = torch.randn(ids.numel(), dim, generator=g)
    first = sk.ops.segment_sum(data.to(device), ids.to(device), 3, deterministic=True)
    again = sk.ops.segment_sum(data.to(device), ids.to(device), 3, deterministic=True)
    assert torch.equal(first, again)
    keep = ids >= 0
    want = torch.zeros(3, dim, dtype=torch.float64).index_add_(0, ids[keep], data[keep].double())
    bound = 1e-6 * float(data.abs().sum()) + 1e-5
    assert float((first.cpu().double() - want).abs().max()) <= bound


def test_use_deterministic_algorithms_selects_the_deterministic_path(device, monkeypatch):
    """torch.use_deterministic_algorithms(True) turns deterministic=False into True, in
    segment_sum, segment_mean and everything built on them, as torch's index_add_ does."""
    calls = []
    real = sk.ops._ops

    class Recorder:
        def __getattr__(self, name):
            op = getattr(real, name)
            if name != "segment_sum":
                return op

            def record(*args):
                calls.append(args[3])
                return op(*args)
            return record

    monkeypatch.setattr(sk.ops._segment, "_ops", Recorder())  # the namespace segment_sum calls
    data = torch.randn(3000, 8, device=device)
    ids = torch.randint(-1, 7, (3000,), device=device)
    sk.ops.segment_sum(data, ids, 7)
    assert calls == [False]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        outs = [sk.ops.segment_sum(data, ids, 7) for _ in range(2)] + [sk.ops.segment_mean(data, ids, 7)]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert calls[1:] == [True, True, True]
    assert torch.equal(outs[0], outs[1])


def test_wrappers_trace_under_torch_compile_fullgraph():
    """The Python wrappers (deterministic flag, exact mean counts, allocation messages)
    stay traceable in one graph."""
    def f(data, ids):
        return sk.ops.segment_sum(data, ids, 5) + sk.ops.segment_mean(data, ids, 5) \
            + sk.ops.key_seeded_uniform(torch.arange(5), 2)

    data, ids = torch.randn(6, 2), torch.tensor([0, 1, 1, 4, -1, 0])
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(data, ids), f(data, ids))


@pytest.mark.parametrize("call, message", [
    (lambda d, i: sk.ops.segment_sum(d, i, True), "segment_sum: num_segments must be an int, got True"),
    (lambda d, i: sk.ops.segment_sum(d, i, 3.0), "segment_sum: num_segments must be an int, got 3.0"),
    (lambda d, i: sk.ops.segment_sum(d, i, None), "segment_sum: num_segments must be an int, got None"),
    (lambda d, i: sk.ops.segment_sum(d, i, 3, None), "segment_sum: deterministic must be a bool, got None"),
    (lambda d, i: sk.ops.segment_sum(d, i, 3, deterministic=1), "segment_sum: deterministic must be a bool, got 1"),
    (lambda d, i: sk.ops.segment_mean(d, i, True), "segment_mean: num_segments must be an int, got True"),
    (lambda d, i: sk.ops.segment_mean(d, i, 3, "yes"), "segment_mean: deterministic must be a bool, got 'yes'"),
    (lambda d, i: sk.ops.segment_reduce(d, i, 3, None), "segment_reduce: reduce must be a str, got None"),
    (lambda d, i: sk.ops.segment_reduce(d, i, False), "segment_reduce: num_segments must be an int, got False"),
])
def test_segment_wrappers_refuse_mistyped_arguments(device, call, message):
    """The dispatcher reads True as num_segments=1 (then complains about the ids instead) and
    None or 1 as a deterministic flag; the wrappers raise TypeError naming the argument."""
    data, ids = torch.ones(4, 2, device=device), torch.tensor([0, 1, 0, 2], device=device)
    with pytest.raises(TypeError, match=message):
        call(data, ids)
    # Integer types other than int still work.
    expected = sk.ops.segment_sum(data, ids, 3)
    assert torch.equal(sk.ops.segment_sum(data, ids, np.int64(3)), expected)
    assert torch.equal(sk.ops.segment_reduce(data, ids, torch.tensor(3)), expected)


def test_segment_double_backward(device):
    """segment_sum's backward is made of differentiable ops: second derivatives work (here the
    gradient in grad_output; the ops are linear in data)."""
    data, ids = random_case(device, n=20, dim=(3,), num_segments=6, dtype=torch.float64)
    data.requires_grad_(True)
    for flag in (False, True):
        assert torch.autograd.gradgradcheck(lambda x, d=flag: sk.ops.segment_sum(x, ids, 6, d), (data,))
        assert torch.autograd.gradgradcheck(lambda x, d=flag: sk.ops.segment_mean(x, ids, 6, d), (data,))
    assert torch.autograd.gradgradcheck(lambda x: sk.ops.segment_sum(x, torch.full_like(ids, -1), 0), (data,))


def test_segment_sum_parts_is_differentiable_as_segment_sum_of_the_concatenation():
    """The op's gradient reaches every part (it had no autograd kernel: the output required
    grad, and backward left the parts' .grad None), twice over, dropped rows getting zeros."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(rows, 3, dtype=torch.float64, generator=g, requires_grad=True) for rows in (4, 0, 5)]
    ids = torch.tensor([2, -1, 0, 2, 1, 1, -5, 3, 0])

    def parts_sum(*data):
        return torch.ops.sparsekit.segment_sum_parts(list(data), ids, 4)

    torch.autograd.gradcheck(parts_sum, parts)
    torch.autograd.gradgradcheck(parts_sum, parts)
    weights = torch.randn(4, 3, dtype=torch.float64, generator=g)
    (parts_sum(*parts) * weights).sum().backward()
    expected = torch.autograd.grad((sk.ops.segment_sum(torch.cat(parts), ids, 4) * weights).sum(), parts)
    for part, want in zip(parts, expected):
        torch.testing.assert_close(part.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_segment_mean_names_its_float32_copy_of_half_data(dtype):
    """segment_mean sums float16 / bfloat16 rows through a float32 copy of data: when that
    copy cannot be allocated, the error names the op and the argument, as its other
    allocations do (it was torch's bare "DefaultCPUAllocator: can't allocate memory")."""
    # A stride-0 view: no memory until copied, and a copy whose byte count overflows int64,
    # so no machine can allocate it (whatever its overcommit policy).
    data = torch.ones(1, 1, dtype=dtype).expand(1, 2**62)
    with pytest.raises(MemoryError, match=r"^segment_mean: a float32 copy of data .*\[1, 4611686018427387904\] "
                                          r"torch\.float32"):
        sk.ops.segment_mean(data, torch.tensor([0]), 1)


def test_the_raw_op_follows_use_deterministic_algorithms(device):
    """docs/api.md: under torch.use_deterministic_algorithms(True) every op is
    bit-reproducible, torch.ops.sparsekit.segment_sum (schema default deterministic=False)
    too, not only the typed wrapper: its CUDA entry takes the deterministic twin."""
    if device.type != "cuda":
        pytest.skip("the CPU kernel is deterministic whatever the flag")
    torch.manual_seed(0)
    data = torch.randn(1 << 20, 4, device=device)
    ids = torch.randint(0, 8, (1 << 20,), device=device)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        twin = torch.ops.sparsekit.segment_sum(data, ids, 8, True)
        for _ in range(3):
            assert torch.equal(torch.ops.sparsekit.segment_sum(data, ids, 8), twin)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])

"""tfuse.add against torch's own sum and a float64 reference, on both backends."""

from __future__ import annotations

import pytest
import torch

import tfuse
import tfuse.ops.add as add_op
from tfuse.nn import FusedAdd
from tfuse.ops import _tiles
from tfuse.ops._tiles import COL, LINEAR, ROW, SCALAR, STRIDED

from conftest import ON_CUDA
from helpers import assert_matches_torch_sum, assert_sum_accurate, make_input

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["triton", "torch"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fills every output with NaN before the op writes it, so an unwritten element fails."""
    allocate = _tiles.empty_broadcast_output

    def poisoned(*args, **kwargs):
        return allocate(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(add_op, "empty_broadcast_output", poisoned)


def run_add(backend: str, *tensors: torch.Tensor) -> torch.Tensor:
    """tfuse.add on ``backend``, checking the launch count that backend must show."""
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        out = tfuse.add(*tensors)
    expected_launches = 1 if backend == "triton" and out.numel() > 0 else 0
    assert launches.total == expected_launches, launches
    if expected_launches:
        assert launches.by_kernel == {"_add_fwd_kernel": 1}
    return out


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 17, 100_003])
def test_same_shape_1d(backend, dtype, size, device):
    inputs = [make_input((size,), dtype, device) for _ in range(3)]
    out = run_add(backend, *inputs)
    assert_sum_accurate(out, inputs)
    assert_matches_torch_sum(out, inputs)


BROADCASTS = {
    # name: input shapes (the output shape is their broadcast)
    "bias_over_rows": [(37, 129), (129,)],
    "bias_and_residual": [(37, 129), (129,), (37, 129)],
    "per_channel_4d": [(3, 6, 7, 5), (6, 1, 1), (3, 6, 7, 5)],
    "zero_dim_and_one": [(17, 9), (), (1,)],
    "outer_product": [(33, 1), (1, 65)],
    "row_and_column_4d": [(2, 5, 6, 7), (2, 1, 6, 7), (1, 5, 1, 7)],
    "rank_6_mixed": [(2, 3, 1, 4, 5, 3), (3, 4, 1, 1), (2, 1, 3, 1, 5, 3)],
    "all_size_one": [(1, 1), (1,), ()],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", BROADCASTS)
def test_broadcasting(backend, dtype, pattern, device):
    inputs = [make_input(shape, dtype, device) for shape in BROADCASTS[pattern]]
    out = run_add(backend, *inputs)
    assert out.shape == torch.broadcast_shapes(*(t.shape for t in inputs))
    assert_sum_accurate(out, inputs)
    assert_matches_torch_sum(out, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(backend, layout, dtype, device):
    shape = (3, 5, 9, 11)
    inputs = [
        make_input(shape, dtype, device, layout),
        make_input(shape, dtype, device),
        make_input(shape[1:2] + (1, 1), dtype, device),
    ]
    out = run_add(backend, *inputs)
    assert_sum_accurate(out, inputs)
    assert_matches_torch_sum(out, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_channels_last_in_gives_channels_last_out(backend, device):
    x = make_input((2, 8, 5, 3), torch.float32, device, "channels_last")
    skip = make_input((2, 8, 5, 3), torch.float32, device, "channels_last")
    bias = make_input((8, 1, 1), torch.float32, device)
    out = run_add(backend, x, bias, skip)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_sum_accurate(out, [x, bias, skip])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", range(2, add_op.MAX_INPUTS + 1))
def test_every_input_count(backend, count, device):
    inputs = [make_input((5, 300), torch.float32, device) for _ in range(count)]
    out = run_add(backend, *inputs)
    assert_sum_accurate(out, inputs)
    assert_matches_torch_sum(out, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtypes, shapes",
    [
        ((torch.float16, torch.bfloat16), ((40,), (40,))),  # -> float32
        ((torch.float16, torch.float32), ((40,), ())),  # 0-dim float32 does not promote
        ((torch.bfloat16, torch.float32, torch.float16), ((3, 40), (40,), (3, 1))),
        ((torch.float32, torch.float64), ((40,), (40,))),
        ((torch.float64, torch.float64, torch.float64), ((7, 9), (9,), (7, 1))),
    ],
)
def test_type_promotion(backend, dtypes, shapes, device):
    inputs = [make_input(shape, dtype, device) for dtype, shape in zip(dtypes, shapes)]
    out = run_add(backend, *inputs)
    assert_matches_torch_sum(out, inputs)
    assert_sum_accurate(out, inputs)


def test_float16_accumulates_in_float32(device):
    # 2048 + 1 + 1 in float16: torch's chain rounds 2049 back to 2048 twice;
    # one float32 accumulation gives 2050, exactly representable in float16.
    big = torch.full((64,), 2048.0, dtype=torch.float16, device=device)
    one = torch.ones(64, dtype=torch.float16, device=device)
    for backend in BACKENDS:
        out = run_add(backend, big, one, one)
        assert (out == 2050).all()
    assert ((big + one + one) == 2048).all()  # torch's chain, for contrast


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", [[(0, 5), (5,)], [(4, 0, 3), (4, 1, 3), (1,)], [(0,), (1,)]])
def test_zero_size(backend, shapes, device):
    inputs = [make_input(shape, torch.float32, device) for shape in shapes]
    out = run_add(backend, *inputs)  # no launch for an empty output
    assert out.shape == torch.broadcast_shapes(*shapes)


def test_int64_offsets_path(monkeypatch, device):
    # Tensors past 2**31 elements cannot be built here; lowering the bound makes
    # the launcher take the int64 path on small data, which must agree.
    inputs = [make_input((37, 129), torch.float32, device), make_input((129,), torch.float32, device)]
    monkeypatch.setattr(_tiles, "INT32_LIMIT", 1000)
    out = run_add("triton", *inputs)
    assert _tiles.plan_tiles(out, inputs).index_64
    assert_matches_torch_sum(out, inputs)


def test_int64_chosen_past_2_31_elements():
    # Planning reads only shapes and strides, so meta tensors stand in for huge ones.
    limit = _tiles.INT32_LIMIT
    big = [torch.empty(2**31 + 7, device="meta") for _ in range(3)]
    assert _tiles.plan_tiles(torch.empty(2**31 + 7, device="meta"), big).index_64
    small = [torch.empty(2**20, device="meta") for _ in range(3)]
    assert not _tiles.plan_tiles(torch.empty(2**20, device="meta"), small).index_64
    # A small output may still read past 2**31 through a large stride.
    wide = torch.empty(2, limit, device="meta")[:, :3]
    assert _tiles.plan_tiles(torch.empty(2, 3, device="meta"), [wide, wide]).index_64


@pytest.mark.parametrize(
    "shapes, modes, rank",
    [
        ([(8, 9), (8, 9)], (LINEAR, LINEAR), 1),
        ([(8, 9), (9,)], (LINEAR, COL), 2),
        ([(4, 6, 5, 5), (6, 1, 1)], (LINEAR, ROW), 3),
        ([(8, 9), ()], (LINEAR, SCALAR), 1),
        ([(4, 6, 5), (4, 1, 5)], (LINEAR, STRIDED), 3),
    ],
)
def test_tile_plan_modes(shapes, modes, rank):
    inputs = [torch.empty(shape) for shape in shapes]
    out = torch.empty(torch.broadcast_shapes(*shapes))
    plan = _tiles.plan_tiles(out, inputs)
    assert plan.modes == modes
    assert len(plan.outer_sizes) + 1 == rank


# ---------------------------------------------------------------- wide columns

# Per-channel adds whose pixel count is not a multiple of 16 (7x7, 14x14, odd
# sizes): the launcher widens the columns to (channels, pixels) or to the whole
# tensor, so that contiguous operands are read 128 bits at a time, and finds
# broadcast operands by dividing the column index (magic numbers).
WIDE = {
    # name: (input shapes, x layout, expected column rank, expected modes)
    "nchw_7x7": ([(2, 16, 7, 7), (16, 1, 1), (2, 16, 7, 7)], "contiguous", 2, (LINEAR, COL, LINEAR)),
    "nchw_14x14": ([(3, 32, 14, 14), (32, 1, 1), (3, 32, 14, 14)], "contiguous", 2, (LINEAR, COL, LINEAR)),
    "nchw_odd_channels": ([(3, 5, 7, 7), (5, 1, 1)], "contiguous", 3, (LINEAR, COL)),
    "per_sample_channel": ([(4, 16, 7, 7), (4, 16, 1, 1), (1, 16, 7, 7)], "contiguous", 2, (LINEAR, STRIDED, COL)),
    "three_column_dims": ([(4, 8, 7, 7), (4, 8, 1, 1), (1, 8, 7, 7)], "contiguous", 3, (LINEAR, COL, COL)),
    "rows_of_1000": ([(6, 1000), (1000,), (6, 1)], "contiguous", 2, (LINEAR, COL, COL)),
    "channels_last_24": ([(2, 24, 7, 7), (24, 1, 1), (2, 24, 7, 7)], "channels_last", 2, (LINEAR, COL, LINEAR)),
    "strided_x_7x7": ([(2, 16, 7, 7), (16, 1, 1)], "strided", 3, (STRIDED, COL)),
}


def _wide_inputs(shapes, layout, dtype, device):
    """x in ``layout``, other full-size inputs channels_last when x is, the rest contiguous."""
    return [make_input(shapes[0], dtype, device, layout)] + [
        make_input(s, dtype, device, "channels_last" if layout == "channels_last" and s == shapes[0] else "contiguous")
        for s in shapes[1:]
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", WIDE)
def test_wide_columns(backend, dtype, pattern, device):
    shapes, layout, _, _ = WIDE[pattern]
    inputs = _wide_inputs(shapes, layout, dtype, device)
    out = run_add(backend, *inputs)
    assert out.shape == torch.broadcast_shapes(*shapes)
    assert_sum_accurate(out, inputs)
    assert_matches_torch_sum(out, inputs)


@pytest.mark.parametrize("pattern", WIDE)
def test_wide_column_plans(pattern):
    shapes, layout, col_rank, modes = WIDE[pattern]
    inputs = _wide_inputs(shapes, layout, torch.float32, torch.device("cpu"))
    out = _tiles.empty_broadcast_output(inputs, torch.broadcast_shapes(*shapes), torch.float32)
    plan = _tiles.plan_tiles(out, inputs, max_col_rank=None)
    assert plan.col_rank == col_rank and plan.modes == modes
    assert plan.n_cols % _tiles.COL_ALIGN == 0 or plan.n_rows == 1
    assert plan.n_rows * plan.n_cols == out.numel()
    # The default (one column dimension) plan is unchanged.
    assert _tiles.plan_tiles(out, inputs).col_rank == 1


def test_wide_columns_int64_path(monkeypatch, device):
    # With int64 offsets the kernel divides plainly instead of by magic numbers.
    inputs = [make_input((2, 16, 7, 7), torch.float32, device), make_input((16, 1, 1), torch.float32, device)]
    monkeypatch.setattr(_tiles, "INT32_LIMIT", 1000)
    out = run_add("triton", *inputs)
    plan = _tiles.plan_tiles(out, inputs, max_col_rank=None)
    assert plan.index_64 and plan.col_rank == 2
    assert_matches_torch_sum(out, inputs)


@pytest.mark.parametrize("divisor", [2, 3, 5, 7, 9, 14, 49, 196, 1000, 3136, 12544, 65537, 2**20 + 1, 2**31 - 1])
def test_magic_divisor_divides_every_int32(divisor):
    # umulhi(j, m) >> s == j // d for 0 <= j < 2**31: checked at every multiple of d
    # near the ends and around a sample in the middle, where an off-by-one shows.
    d, m, s = _tiles.magic_divisor(divisor)
    assert d == divisor and -(2**31) <= m < 2**31 and 0 <= s < 31
    m &= 0xFFFFFFFF
    js = {0, 1, 2**31 - 1, 2**31 - 2}
    for q in list(range(0, 64)) + list(range((2**31 - 1) // d - 64, (2**31 - 1) // d + 1)) + [12345, 777777]:
        for j in (q * d - 1, q * d, q * d + 1, q * d + d - 1):
            if 0 <= j < 2**31:
                js.add(j)
    for j in js:
        assert ((j * m) >> 32) >> s == j // d, (j, d)


# ---------------------------------------------------------------- autograd


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["bias_and_residual", "per_channel_4d", "row_and_column_4d", "zero_dim_and_one"])
def test_gradients_match_torch(backend, dtype, pattern, device):
    shapes = BROADCASTS[pattern]
    ours = [make_input(shape, dtype, device).requires_grad_() for shape in shapes]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    with tfuse.use_backend(backend):
        out = tfuse.add(*ours)
    expected = theirs[0]
    for t in theirs[1:]:
        expected = expected + t
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for mine, reference in zip(ours, theirs):
        assert mine.grad.dtype == mine.dtype
        assert mine.grad.shape == mine.shape
        # Both reduce the same float values; only the summation order may differ.
        torch.testing.assert_close(mine.grad, reference.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_inputs_that_require_grad_get_one(backend, device):
    x = make_input((6, 4), torch.float32, device).requires_grad_()
    bias = make_input((4,), torch.float32, device)
    skip = make_input((6, 4), torch.float32, device).requires_grad_()
    with tfuse.use_backend(backend):
        out = tfuse.add(x, bias, skip)
    out.sum().backward()
    assert bias.grad is None
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(skip.grad, torch.ones_like(skip))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    inputs = [
        make_input((2, 3, 4), torch.float64, device).requires_grad_(),
        make_input((3, 1), torch.float64, device).requires_grad_(),
        make_input((), torch.float64, device).requires_grad_(),
    ]
    with tfuse.use_backend(backend):
        assert torch.autograd.gradcheck(tfuse.add, inputs)
        assert torch.autograd.gradgradcheck(tfuse.add, inputs)


def test_no_graph_without_grad(device):
    x = make_input((4,), torch.float32, device).requires_grad_()
    with torch.no_grad():
        out = tfuse.add(x, x)
    assert out.grad_fn is None and not out.requires_grad


# ---------------------------------------------------------------- module


def test_fused_add_module(device):
    module = FusedAdd()
    inputs = [make_input((2, 4, 6, 6), torch.float32, device), make_input((4, 1, 1), torch.float32, device)]
    with tfuse.count_launches() as launches:
        out = module(*inputs)
    assert launches.total == (1 if tfuse.select_backend(device, "add") is tfuse.Backend.TRITON else 0)
    assert_matches_torch_sum(out, inputs)
    assert list(module.state_dict()) == []


# ---------------------------------------------------------------- errors


def test_too_few_tensors(device):
    with pytest.raises(TypeError, match=r"tfuse.add takes 2 to 8 tensors, got 1"):
        tfuse.add(torch.ones(3, device=device))
    with pytest.raises(TypeError, match=r"got 0"):
        tfuse.add()


def test_too_many_tensors(device):
    with pytest.raises(TypeError, match=r"takes 2 to 8 tensors, got 9"):
        tfuse.add(*[torch.ones(3, device=device)] * 9)


@pytest.mark.parametrize("bad", [1.5, 2, None, [1.0, 2.0]])
def test_non_tensor_argument(bad, device):
    with pytest.raises(TypeError, match=rf"argument 1 must be a torch.Tensor, got {type(bad).__name__}"):
        tfuse.add(torch.ones(3, device=device), bad)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_unsupported_dtype(dtype, device):
    with pytest.raises(TypeError, match=rf"argument 1 has dtype {dtype}; supported dtypes are float16"):
        tfuse.add(torch.ones(3, device=device), torch.ones(3, device=device).to(dtype))


def test_sparse_tensor(device):
    sparse = torch.eye(3, device=device).to_sparse()
    with pytest.raises(TypeError, match=r"argument 0 has layout torch.sparse_coo"):
        tfuse.add(sparse, torch.ones(3, 3, device=device))


def test_devices_differ():
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device.*cpu and meta"):
        tfuse.add(torch.ones(3), torch.ones(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"cpu and meta"):
        tfuse.add(torch.ones(1), torch.ones(3, device="meta"))  # 1-dim, not a scalar


def test_zero_dim_cpu_tensor_joins_another_device():
    # torch treats a 0-dim CPU tensor as a scalar on any device; so does tfuse.
    # (meta stands in for a GPU here; on a GPU machine the CUDA case runs below.)
    out = tfuse.add(torch.ones(3, device="meta"), torch.tensor(2.0))
    assert out.device.type == "meta" and out.shape == (3,)


@pytest.mark.skipif(not ON_CUDA, reason="mixes CUDA and CPU tensors: needs a GPU")
def test_zero_dim_cpu_tensor_with_cuda_tensors(device):
    x = make_input((5, 7), torch.float32, device).requires_grad_()
    scale = torch.tensor(0.5, requires_grad=True)
    out = run_add("triton", x, scale)
    torch.testing.assert_close(out, x + scale)
    out.sum().backward()
    assert scale.grad.device.type == "cpu"
    torch.testing.assert_close(scale.grad, torch.tensor(35.0))


@pytest.mark.parametrize(
    "shapes, message",
    [
        ([(2, 3), (4,)], r"size of tensor 0 \(3\) must match the size of tensor 1 \(4\) at non-singleton dimension 1"),
        ([(5, 1), (1, 3), (4, 3)], r"size of tensor 0 \(5\) must match the size of tensor 2 \(4\) at non-singleton dimension 0"),
    ],
)
def test_shapes_that_do_not_broadcast(shapes, message, device):
    inputs = [torch.ones(shape, device=device) for shape in shapes]
    with pytest.raises(RuntimeError, match=message):
        tfuse.add(*inputs)


def test_errors_come_before_any_launch(device):
    with tfuse.count_launches() as launches:
        with pytest.raises(RuntimeError):
            tfuse.add(torch.ones(2, 3, device=device), torch.ones(4, device=device))
    assert launches.total == 0


@pytest.mark.skipif(
    not ON_CUDA or torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs a GPU with 40 GB: four float16 tensors of 2**31 + 4099 elements "
    "(the interpreter on a CPU would take hours; the int64 logic itself is tested above)",
)
def test_more_than_2_31_elements_on_gpu(device):
    numel = 2**31 + 4099
    inputs = [torch.randn(numel, device=device, dtype=torch.float16) for _ in range(3)]
    out = run_add("triton", *inputs)
    for start in (0, 2**31 - 2048, numel - 4096):
        window = slice(start, start + 4096)
        assert_sum_accurate(out[window], [t[window] for t in inputs])

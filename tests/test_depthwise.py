"""relu_depthwise_conv2d and FusedActDepthwiseConv2d against act + F.conv2d(groups=C), both backends.

References are torch's activation and ``F.conv2d`` in float64 on the same
(rounded) inputs; results are checked against the error bound of the
algorithm (float32 accumulation of at most kH*kW terms per output, or of
N*OH*OW terms per weight gradient, one rounding to the output dtype), not
a tolerance tuned to pass.
"""

from __future__ import annotations

import copy
import io
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfuse
from tfuse import _launch
from tfuse.functional import relu_depthwise_conv2d
from tfuse.nn import FusedActDepthwiseConv2d
from tfuse.ops import _arrivals, _depthwise_triton
from tfuse.ops import depthwise as dw_ops

from conftest import ON_CUDA
from helpers import ACTIVATION_NAMES, _assert_within, torch_activation, unit_roundoff

BACKENDS = ["triton", "torch"]
SLOPE = 0.2  # leaky_relu's slope (not a float32 number: the kernels take it split in two, test_float_args.py)


def ref_activation(name: str, torch_formulas: bool = False):
    """torch's activation, except two whose float64 torch formulas are less exact than the kernels': gelu_tanh as
    z * sigmoid(2u) (equal to torch's 0.5 z (1 + tanh(u)), which cancels for negative z; ``torch_formulas``
    keeps torch's, which the PyTorch path runs) and hardsigmoid's derivative (see
    tfuse.ops._activations._hardsigmoid_backward)."""
    if name == "gelu_tanh" and not torch_formulas:
        return lambda z: z * torch.sigmoid(2 * 0.7978845608028654 * (z + 0.044715 * z**3))
    if name == "hardsigmoid":  # torch's float64 hardsigmoid backward multiplies by a float32 1/6
        return lambda z: F.relu6(z + 3) / 6
    return torch_activation(name, SLOPE)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest):
    with tfuse.use_backend(request.param):
        yield request.param


def make_case(shape, kernel, dtype, device, layout="contiguous", bias=True):
    n, c, h, w = shape
    x = torch.randn(shape, device=device).to(dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.randn(n, 2 * c, h, w + 3, device=device).to(dtype)[:, ::2, :, 1 : w + 1]
    weight = torch.randn(c, 1, *kernel, device=device).to(dtype)
    b = torch.randn(c, device=device).to(dtype) if bias else None
    return x, weight, b


def reference(x, weight, bias, stride, padding, dilation, act_in, act_out, torch_formulas=False):
    """float64 act_out(conv2d(act_in(x))) and the magnitude sum |act_in(x)| * |w| + |b| of its terms."""
    x64, w64 = x.double(), weight.double()
    b64 = bias.double() if bias is not None else None
    a = ref_activation(act_in, torch_formulas)(x64)
    z = F.conv2d(a, w64, b64, stride, padding, dilation, x.shape[1])
    magnitude = F.conv2d(a.abs(), w64.abs(), b64.abs() if b64 is not None else None, stride, padding, dilation,
                         x.shape[1])
    return ref_activation(act_out or "identity", torch_formulas)(z), z, magnitude


#: Activations computed through exp of an argument a (gelu_tanh's a = 2u reaches 80 where it is capped): the
#: rounding of a becomes |a| ulps of exp(-a), in the kernels and in any float64 reference alike.
EXP_ACTIVATIONS = {"gelu_tanh", "silu", "sigmoid", "mish", "elu", "gelu", "tanh"}


def error_bound(result_dtype: torch.dtype, exact: torch.Tensor, magnitude: torch.Tensor, n_terms: int,
                act_ulps: int = 16) -> torch.Tensor:
    """One rounding to the result dtype plus float32 (float64) accumulation of n_terms, each from an
    activation (or its derivative) evaluated within ``act_ulps`` ulps of the accumulator
    (kernels/activations.py; torch's own float64 formulas are no closer)."""
    acc = torch.float64 if result_dtype == torch.float64 else torch.float32
    finfo = torch.finfo(result_dtype)
    bound = unit_roundoff(result_dtype) * exact.abs() + (n_terms + act_ulps) * unit_roundoff(acc) * magnitude
    return 2 * bound + finfo.tiny * finfo.eps


def activation_ulps(*acts: str | None) -> int:
    return 96 if EXP_ACTIVATIONS & set(acts) else 16


def check_forward(y, x, weight, bias, stride, padding, dilation, act_in, act_out, torch_formulas=False):
    ref, z, magnitude = reference(x, weight, bias, stride, padding, dilation, act_in, act_out, torch_formulas)
    assert y.shape == ref.shape and y.dtype == x.dtype
    if act_out in (None, "identity", "relu"):
        bound = error_bound(y.dtype, ref, magnitude, weight.shape[2] * weight.shape[3] + 1,
                            activation_ulps(act_in, act_out))
    else:  # the epilogue's derivative is at most ~1.1 (gelu, silu, mish...): scale the bound of z
        bound = 1.2 * error_bound(y.dtype, z, magnitude, weight.shape[2] * weight.shape[3] + 1,
                                  activation_ulps(act_in, act_out))
        bound += 8 * unit_roundoff(torch.float32 if y.dtype != torch.float64 else torch.float64) * ref.abs()
    _assert_within((y.double() - ref).abs(), bound, "forward: ")


def reference_grads(x, weight, bias, gy, stride, padding, dilation, act_in, act_out, torch_formulas=False):
    """float64 gradients and the magnitudes of their sums' terms."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    leaves = [x64, w64] + ([b64] if b64 is not None else [])
    y, _, _ = reference(x64, w64, b64, stride, padding, dilation, act_in, act_out, torch_formulas)
    grads = torch.autograd.grad(y, leaves, gy.double())
    # Magnitudes: the same sums over |terms| (gz bounded by |gy| * max|act_out'| <= 1.2 |gy|).
    absolute = [t.detach().abs().requires_grad_() for t in leaves]
    a = ref_activation(act_in)(x64.detach()).abs()
    zmag = F.conv2d(a.requires_grad_(), absolute[1], None, stride, padding, dilation, x.shape[1])
    ga, gw = torch.autograd.grad(zmag, [a, absolute[1]], 1.2 * gy.double().abs())
    mags = [1.2 * ga, gw] + ([1.2 * gy.double().abs().sum((0, 2, 3))] if b64 is not None else [])
    return grads, mags


def check_backward(grads, x, weight, bias, gy, stride, padding, dilation, act_in, act_out, torch_formulas=False):
    ref, mags = reference_grads(x, weight, bias, gy, stride, padding, dilation, act_in, act_out, torch_formulas)
    n, _, oh, ow = gy.shape
    terms = [weight.shape[2] * weight.shape[3] + 1, n * oh * ow, n * oh * ow]
    for name, g, r, m, k in zip(("dx", "dweight", "dbias"), grads, ref, mags, terms):
        assert g.shape == r.shape and g.dtype == x.dtype, name
        bound = error_bound(g.dtype, r, m, k, activation_ulps(act_in, act_out))
        _assert_within((g.double() - r).abs(), bound, f"{name}: ")


def run(x, weight, bias, stride=1, padding=0, dilation=1, act_in="relu", act_out=None, gy=None):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    leaves = [x, weight]
    if bias is not None:
        bias = bias.detach().requires_grad_()
        leaves.append(bias)
    slope = SLOPE if "leaky_relu" in (act_in, act_out) else None
    y = relu_depthwise_conv2d(x, weight, bias, stride, padding, dilation, act_in=act_in, act_out=act_out,
                              negative_slope=slope)
    gy = torch.randn_like(y) if gy is None else gy
    grads = torch.autograd.grad(y, leaves, gy)
    return y, gy, grads


# ------------------------------------------------------------------------------------------------ values


GEOMETRIES = [  # kernel, stride, padding, dilation, shape
    ((3, 3), 1, 1, 1, (2, 5, 9, 11)),
    ((3, 3), 2, 1, 1, (2, 6, 9, 10)),
    ((5, 5), 1, 2, 1, (1, 4, 8, 9)),
    ((5, 5), 2, 2, 1, (2, 3, 11, 7)),
    ((7, 7), 1, 3, 1, (1, 3, 8, 8)),
    ((3, 3), 1, 2, 2, (1, 4, 9, 9)),
    ((3, 1), (2, 1), (1, 0), 1, (2, 3, 7, 5)),
    ((2, 4), (1, 3), (0, 2), (2, 1), (1, 3, 6, 10)),
    ((1, 1), 1, 0, 1, (2, 3, 4, 4)),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"k{g[0]}s{g[1]}p{g[2]}d{g[3]}")
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_every_geometry_float64(backend, device, geometry, layout):
    kernel, stride, padding, dilation, shape = geometry
    x, weight, bias = make_case(shape, kernel, torch.float64, device, layout)
    y, gy, grads = run(x, weight, bias, stride, padding, dilation)
    check_forward(y, x, weight, bias, stride, padding, dilation, "relu", None)
    check_backward(grads, x, weight, bias, gy, stride, padding, dilation, "relu", None)
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("act_in", ACTIVATION_NAMES)
def test_every_input_activation(backend, device, act_in):
    x, weight, bias = make_case((1, 3, 6, 7), (3, 3), torch.float64, device)
    x = x * 4  # reach the corners of relu6, hardtanh, hardswish, hardsigmoid
    y, gy, grads = run(x, weight, bias, 2, 1, 1, act_in=act_in)
    # The PyTorch path computes with torch's formulas: its gelu_tanh derivative cancels in float64 for large |z|.
    torch_formulas = backend == "torch"
    check_forward(y, x, weight, bias, 2, 1, 1, act_in, None, torch_formulas)
    check_backward(grads, x, weight, bias, gy, 2, 1, 1, act_in, None, torch_formulas)


EPILOGUES = [  # every derivative path of the epilogue (from the output: select, multiply; from z), each in one layout
    ("relu", "channels_last"), ("leaky_relu", "contiguous"), ("sigmoid", "contiguous"), ("gelu", "channels_last"),
    ("silu", "contiguous"), ("hardswish", "channels_last"), ("relu6", "contiguous"),
]


@pytest.mark.parametrize("act_out, layout", EPILOGUES)
def test_output_activation_epilogue(backend, device, act_out, layout):
    x, weight, bias = make_case((2, 4, 7, 6), (3, 3), torch.float64, device, layout)
    y, gy, grads = run(x, weight, bias, 1, 1, 1, act_in="silu", act_out=act_out)
    check_forward(y, x, weight, bias, 1, 1, 1, "silu", act_out)
    check_backward(grads, x, weight, bias, gy, 1, 1, 1, "silu", act_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_dtypes_within_their_error_bound(backend, device, dtype, layout):
    x, weight, bias = make_case((2, 6, 8, 9), (3, 3), dtype, device, layout)
    y, gy, grads = run(x, weight, bias, 2, 1, 1, act_in="relu6")
    if backend == "torch" and dtype != torch.float32:
        # The PyTorch path is torch's relu6 + conv2d, whose 16-bit accumulation is torch's and varies by device
        # and CPU vector unit (float16 on CPUs; bfloat16 dx beyond the float32-accumulation bound on an AVX2
        # EPYC; 16-bit channels_last through cuDNN on an H100): it is held to what those ops compute (the
        # dtype's default tolerance: a convolution's weight gradient may sum in another order between calls).
        # The bound below is the Triton kernels' promise (float32 accumulation, one rounding).
        leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
        expected = F.conv2d(F.relu6(leaves[0]), leaves[1], leaves[2], 2, 1, 1, x.shape[1])
        torch.testing.assert_close(y, expected)
        for mine, theirs in zip(grads, torch.autograd.grad(expected, leaves, gy)):
            torch.testing.assert_close(mine, theirs)
        return
    check_forward(y, x, weight, bias, 2, 1, 1, "relu6", None)
    check_backward(grads, x, weight, bias, gy, 2, 1, 1, "relu6", None)


def test_without_bias_and_partial_gradients(backend, device):
    x, weight, _ = make_case((2, 3, 6, 6), (3, 3), torch.float64, device, bias=False)
    y, gy, grads = run(x, weight, None, 1, 1, 1)
    check_backward(grads, x, weight, None, gy, 1, 1, 1, "relu", None)
    # Only x needs a gradient, then only the weight: each alone matches the reference.
    ref, _ = reference_grads(x, weight, None, gy, 1, 1, 1, "relu", None)
    xg = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(relu_depthwise_conv2d(xg, weight, padding=1), xg, gy)
    torch.testing.assert_close(dx.double(), ref[0])
    wg = weight.detach().requires_grad_()
    (dw,) = torch.autograd.grad(relu_depthwise_conv2d(x, wg, padding=1), wg, gy)
    torch.testing.assert_close(dw.double(), ref[1])


def test_strided_weight_and_expanded_output_gradient(backend, device):
    """model.to(memory_format=torch.channels_last) makes the weight [C, 1, kH, kW] channels_last, and
    y.sum().backward() hands backward a stride-0 gradient: both are read through their strides."""
    x, weight, bias = make_case((2, 5, 7, 6), (3, 3), torch.float64, device, "channels_last")
    weight = weight.contiguous(memory_format=torch.channels_last).requires_grad_()
    xg = x.detach().requires_grad_()
    relu_depthwise_conv2d(xg, weight, bias, padding=1).sum().backward()
    x64, w64 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.conv2d(F.relu(x64), w64, bias, padding=1, groups=5).sum().backward()
    torch.testing.assert_close(xg.grad, x64.grad)
    torch.testing.assert_close(weight.grad, w64.grad)
    assert weight.grad.stride() == weight.stride()


def test_unbatched_and_empty_inputs(backend, device):
    x, weight, bias = make_case((1, 4, 6, 6), (3, 3), torch.float64, device)
    y = relu_depthwise_conv2d(x[0], weight, bias, padding=1)
    torch.testing.assert_close(y, F.conv2d(F.relu(x[0]), weight, bias, padding=1, groups=4))
    empty = torch.empty(0, 4, 6, 6, dtype=torch.float64, device=device, requires_grad=True)
    w = weight.detach().requires_grad_()
    out = relu_depthwise_conv2d(empty, w, padding=1)
    assert out.shape == (0, 4, 6, 6)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_special_values_follow_torch(backend, device):
    x, weight, bias = make_case((1, 3, 5, 5), (3, 3), torch.float32, device)
    x[0, 0, 2, 2] = float("nan")
    x[0, 1, 1, 1] = float("inf")
    x[0, 2, 0, 0] = -float("inf")
    y = relu_depthwise_conv2d(x, weight, bias, padding=1)
    ref = F.conv2d(F.relu(x), weight, bias, padding=1, groups=3)
    torch.testing.assert_close(y, ref, equal_nan=True)


def test_weight_gradient_is_deterministic(backend, device):
    x, weight, bias = make_case((2, 8, 8, 8), (3, 3), torch.float32, device, "channels_last")
    gy = torch.randn(2, 8, 8, 8, device=device)
    first = run(x, weight, bias, 1, 1, 1, gy=gy)[2]
    second = run(x, weight, bias, 1, 1, 1, gy=gy)[2]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


MERGES = [  # shape, layout, bias, merge step (None: the launcher's), the merge's (chunks, MK, MERGE_LOOP)
    ((3, 2, 30, 30), "contiguous", True, None, (3, 4, False)),  # one step of 4 loads, the last past the chunks
    ((2, 40, 6, 6), "channels_last", False, None, (5, 8, False)),  # one step of 8 loads, the last 3 past the chunks
    ((2, 40, 4, 5), "channels_last", True, 2, (3, 2, True)),  # a loop of 2 steps, the last one half past the end
]
# channels_last: 16 outputs (n, oh, ow) per chunk; in both such cases a chunk crosses from the first image into the
# second. Their shapes are the smallest that make those merges: each program of a chunk is an interpreted one.


@pytest.mark.parametrize("shape, layout, bias, step, merge", MERGES)
def test_weight_gradient_merges_many_chunks(device, monkeypatch, shape, layout, bias, step, merge):
    """Chunks of one tile each, as many as a GPU's grid has (the interpreter's target makes one): the last program
    of each (tap, channel block) to arrive adds them up, in chunk order, and leaves its counter at 0."""
    monkeypatch.setattr(_depthwise_triton, "_chunks", lambda tiles, programs_per_chunk, device: (tiles, 1))
    if step is not None:
        monkeypatch.setattr(_depthwise_triton, "_MERGE_CHUNKS", step)
    x, weight, b = make_case(shape, (3, 3), torch.float32, device, layout, bias)
    seen = []
    with tfuse.use_backend("triton"), _launch.watch_launches(lambda *launch: seen.append(launch)):
        y, gy, grads = run(x, weight, b, 1, 1, 1)
        again = run(x, weight, b, 1, 1, 1, gy=gy)[2]
    ((_, grid, args, meta, _),) = [launch for launch in seen[:3] if "_dw_bwd_dw" in _launch.kernel_name(launch[0])]
    assert (grid[1], meta["MK"], meta["MERGE_LOOP"]) == merge
    check_backward(grads, x, weight, b, gy, 1, 1, 1, "relu", None)
    assert all(torch.equal(first, second) for first, second in zip(grads, again))
    counters = args[6]
    assert counters.numel() == grid[0] * grid[2] and not counters.any()


def test_arrival_counters_are_shared_per_size_and_zeroed_after_a_capture(device, monkeypatch):
    """One buffer per (device, size), kept (a captured CUDA graph may still launch with it); one allocated while a
    stream captures (its zero fill runs on replay only) is filled at its first use outside the capture."""
    monkeypatch.setattr(_arrivals, "_counters", {})
    first = _arrivals.arrival_counters(5, device)
    assert _arrivals.arrival_counters(5, device) is first and first.dtype == torch.int32 and not first.any()
    assert _arrivals.arrival_counters(6, device) is not first
    monkeypatch.setattr(_arrivals, "_capturing", lambda device: True)
    captured = _arrivals.arrival_counters(3, device)
    monkeypatch.setattr(_arrivals, "_capturing", lambda device: False)
    captured.fill_(7)  # what the memory may hold before a replay has run the fill
    assert _arrivals.arrival_counters(3, device) is captured and not captured.any()
    captured.fill_(7)  # filled once outside a capture: later uses trust the launches to leave them 0
    assert _arrivals.arrival_counters(3, device).eq(7).all()


def test_int64_offsets(device, monkeypatch):
    x, weight, bias = make_case((2, 3, 7, 7), (3, 3), torch.float64, device, "channels_last")
    with tfuse.use_backend("triton"):
        expected = run(x, weight, bias, 2, 1, 1)
        monkeypatch.setattr(_depthwise_triton, "needs_int64", lambda largest: True)
        got = run(x, weight, bias, 2, 1, 1, gy=expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for a, b in zip(got[2], expected[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("act_in, act_out", [("relu", None), ("silu", "gelu"), ("sigmoid", "tanh")])
def test_gradcheck_float64(backend, device, act_in, act_out):
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(2, 1, 3, 3, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda x, w, b: relu_depthwise_conv2d(x, w, b, 2, 1, act_in=act_in, act_out=act_out)  # noqa: E731
    # fast_mode: one random projection of the Jacobian (the interpreter runs a launch in ~0.1 s).
    assert torch.autograd.gradcheck(fn, (x, w, b), fast_mode=True)
    # Double backward runs torch ops on every backend (create_graph=True): once is enough.
    if backend == "torch":
        assert torch.autograd.gradgradcheck(fn, (x, w, b), fast_mode=True)


# ------------------------------------------------------------------------------------------------ costs


def test_launch_counts(device):
    x, weight, bias = make_case((2, 4, 6, 6), (3, 3), torch.float32, device)
    with tfuse.use_backend("triton"):
        x.requires_grad_()
        weight.requires_grad_()
        bias.requires_grad_()
        with tfuse.count_launches() as forward:
            y = relu_depthwise_conv2d(x, weight, bias, padding=1)
        with tfuse.count_launches() as backward:
            y.sum().backward()
        assert forward.by_kernel == {"_dw_fwd_kernel": 1}
        # dw/db in one launch: its last programs merge the chunk partials (no merge launch).
        assert backward.by_kernel == {"_dw_bwd_dx_kernel": 1, "_dw_bwd_dw_partial_kernel": 1}
        with tfuse.count_launches() as dx_only:
            relu_depthwise_conv2d(x, weight.detach(), padding=1).sum().backward()
        assert dx_only.by_kernel == {"_dw_fwd_kernel": 1, "_dw_bwd_dx_kernel": 1}
    with tfuse.use_backend("torch"), tfuse.count_launches() as torch_path:
        relu_depthwise_conv2d(x, weight, bias, padding=1).sum().backward()
    assert torch_path.total == 0


@pytest.mark.parametrize("act_out, extra", [(None, 0), ("relu", 1), ("gelu", 1)])
def test_backward_keeps_x_and_weight_only(backend, device, act_out, extra):
    """The activation output is never saved: x and the parameters (and act_out's one tensor) are all backward keeps."""
    x, weight, bias = make_case((2, 4, 6, 6), (3, 3), torch.float32, device)
    x.requires_grad_()
    weight.requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = relu_depthwise_conv2d(x, weight, bias, padding=1, act_out=act_out)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    expected = {t.untyped_storage().data_ptr() for t in (x, weight, bias)}
    if act_out == "relu":  # relu's derivative follows from its output: that is the one more tensor kept
        expected.add(y.untyped_storage().data_ptr())
    assert expected <= storages and len(storages) == 3 + extra


def activation_bytes_kept(fn, x: torch.Tensor, parameters) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters left out."""
    kept: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(kept.values())


@pytest.mark.parametrize("act, eager_tensors", [("relu", 1), ("sigmoid", 1), ("relu6", 2), ("silu", 2),
                                                ("hardswish", 2)])
@pytest.mark.parametrize("inplace", [False, True])
def test_memory_kept_against_the_eager_pair(device, act, eager_tensors, inplace):
    """What docs/layers.md states: the fused pair keeps one activation tensor (its input); the eager pair keeps
    act(x) for the convolution, and x too where the activation's backward reads its input, in place or not."""
    pointwise = nn.Conv2d(4, 4, 1, device=device)  # makes x a fresh tensor an in-place activation may overwrite
    depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4, device=device)
    fused = FusedActDepthwiseConv2d.from_conv(depthwise, act_in=act)
    module = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish}
    activation = module[act]() if act == "sigmoid" else module[act](inplace=inplace)
    parameters = [*pointwise.parameters(), *depthwise.parameters()]
    x = torch.randn(2, 4, 8, 8, device=device, requires_grad=True)
    one = 2 * 4 * 8 * 8 * 4  # bytes of one float32 activation tensor
    base = activation_bytes_kept(lambda x: pointwise(x), x, parameters)  # the pointwise conv keeps x itself
    with tfuse.use_backend("torch"):
        fused_kept = activation_bytes_kept(lambda x: fused(pointwise(x)), x, parameters) - base
    eager_kept = activation_bytes_kept(lambda x: depthwise(activation(pointwise(x))), x, parameters) - base
    assert fused_kept == one
    assert eager_kept == eager_tensors * one


# ------------------------------------------------------------------------------------------------ bad input


BAD_CALLS = [
    ("weight of groups=1", lambda x, w: relu_depthwise_conv2d(x, torch.randn(4, 4, 3, 3)), ValueError, "depth"),
    ("depth multiplier 2", lambda x, w: relu_depthwise_conv2d(x, torch.randn(8, 1, 3, 3)), ValueError, "C = 4"),
    ("3-d weight", lambda x, w: relu_depthwise_conv2d(x, torch.randn(4, 3, 3)), ValueError, "weight must be"),
    ("bias shape", lambda x, w: relu_depthwise_conv2d(x, w, torch.randn(5)), ValueError, "bias must be"),
    ("dtype mismatch", lambda x, w: relu_depthwise_conv2d(x, w.double()), TypeError, "one dtype"),
    ("integer x", lambda x, w: relu_depthwise_conv2d(x.long(), w), TypeError, "dtype"),
    ("5-d x", lambda x, w: relu_depthwise_conv2d(x[None], w), ValueError, "x must be"),
    ("stride 0", lambda x, w: relu_depthwise_conv2d(x, w, stride=0), ValueError, "stride"),
    ("float stride", lambda x, w: relu_depthwise_conv2d(x, w, stride=1.5), TypeError, "stride"),
    ("negative padding", lambda x, w: relu_depthwise_conv2d(x, w, padding=-1), ValueError, "padding"),
    ("same with stride", lambda x, w: relu_depthwise_conv2d(x, w, stride=2, padding="same"), ValueError, "same"),
    ("bad padding word", lambda x, w: relu_depthwise_conv2d(x, w, padding="full"), ValueError, "padding"),
    ("kernel too large", lambda x, w: relu_depthwise_conv2d(x[..., :2, :2], w), ValueError, "smaller"),
    ("unknown act", lambda x, w: relu_depthwise_conv2d(x, w, act_in="swish"), ValueError, "unknown activation"),
    ("slope without leaky", lambda x, w: relu_depthwise_conv2d(x, w, negative_slope=0.1), ValueError, "no effect"),
    ("weight not a tensor", lambda x, w: relu_depthwise_conv2d(x, w.tolist()), TypeError, "weight"),
    ("device mismatch", lambda x, w: relu_depthwise_conv2d(x, w.to("meta")), RuntimeError, "same device"),
]


@pytest.mark.parametrize("what, call, error, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_any_launch(what, call, error, match):
    x, w = torch.randn(2, 4, 6, 6), torch.randn(4, 1, 3, 3)
    with tfuse.count_launches() as launches, pytest.raises(error, match=match):
        call(x, w)
    assert launches.total == 0


# ------------------------------------------------------------------------------------------------ dispatch


def test_dispatch_rule():
    x = torch.randn(2, 8, 14, 14)
    key = dw_ops.shape_class(x, (3, 3), (1, 1))
    assert key == ((3, 3), (1, 1), False, torch.float32, 256)
    assert dw_ops.shape_class(x.to(memory_format=torch.channels_last), (3, 3), (2, 2))[2:4] == (True, torch.float32)
    assert dw_ops.eager_reason(key) is None
    assert "taps" in dw_ops.eager_reason(((9, 9), (1, 1), False, torch.float32, 256))
    dw_ops.EAGER_SHAPE_CLASSES = frozenset({key})
    try:
        assert "measured" in dw_ops.eager_reason(key)
    finally:
        dw_ops.EAGER_SHAPE_CLASSES = frozenset()
    with tfuse.use_backend("torch"):
        assert dw_ops.depthwise_backend(x, (3, 3), (1, 1)) is tfuse.Backend.TORCH


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA dispatch to cuDNN needs a GPU")
def test_cuda_dispatch_logs_eager_classes_once(caplog):
    x = torch.randn(2, 8, 14, 14, device="cuda")
    w = torch.randn(8, 1, 9, 9, device="cuda")
    with caplog.at_level(logging.INFO, logger="tfuse.ops.depthwise"):
        with tfuse.count_launches() as launches:
            relu_depthwise_conv2d(x, w, padding=4)
            relu_depthwise_conv2d(x, w, padding=4)
    assert launches.total == 0
    assert sum("cuDNN" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------------------------------------ module


def test_module_is_a_drop_in_depthwise_conv(backend, device):
    conv = nn.Conv2d(6, 6, 3, 2, 1, 1, 6, True, device=device, dtype=torch.float64)
    fused = FusedActDepthwiseConv2d(6, 6, 3, 2, 1, 1, 6, True, device=device, dtype=torch.float64, act_in="relu6")
    assert fused.state_dict().keys() == conv.state_dict().keys()
    fused.load_state_dict(conv.state_dict())
    x = torch.randn(2, 6, 9, 9, dtype=torch.float64, device=device)
    torch.testing.assert_close(fused(x), conv(F.relu6(x)))
    assert isinstance(fused, nn.Conv2d) and fused.groups == 6
    assert "act_in='relu6'" in repr(fused)
    shared = FusedActDepthwiseConv2d.from_conv(conv, act_in="silu")
    assert shared.weight is conv.weight and shared.bias is conv.bias
    torch.testing.assert_close(shared(x), conv(F.silu(x)))


def test_module_copies_save_and_meta_init(device):
    layer = FusedActDepthwiseConv2d(4, 4, 3, padding=1, act_in="leaky_relu", negative_slope=SLOPE, device=device)
    x = torch.randn(1, 4, 5, 5, device=device)
    clone = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        torch.testing.assert_close(other(x), layer(x))
        assert other.negative_slope == SLOPE and other.act_in == "leaky_relu"
    meta = FusedActDepthwiseConv2d(4, 4, 3, padding=1, device="meta")
    meta.to_empty(device=device)
    meta.load_state_dict(layer.state_dict())
    torch.testing.assert_close(meta(x), F.conv2d(F.relu(x), layer.weight, layer.bias, padding=1, groups=4))


def test_meta_tensors_give_shapes_without_data():
    layer = FusedActDepthwiseConv2d(8, 8, 3, stride=2, padding=1, device="meta")
    x = torch.empty(2, 8, 15, 15, device="meta", requires_grad=True)
    y = layer(x)
    assert y.device.type == "meta" and y.shape == (2, 8, 8, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape


MODULE_ERRORS = [
    (lambda: FusedActDepthwiseConv2d(4, 8, 3), "depth multiplier"),
    (lambda: FusedActDepthwiseConv2d(4, 4, 3, groups=2), "groups"),
    (lambda: FusedActDepthwiseConv2d(4, 4, 3, padding_mode="reflect"), "padding_mode"),
    (lambda: FusedActDepthwiseConv2d(4, 4, 3, act_in="swish"), "unknown activation"),
    (lambda: FusedActDepthwiseConv2d(4, 4, 3, negative_slope=0.1), "no effect"),
    (lambda: FusedActDepthwiseConv2d.from_conv(nn.Conv2d(4, 4, 3)), "groups"),
]


@pytest.mark.parametrize("make, match", MODULE_ERRORS)
def test_module_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_from_conv_refuses_other_layers():
    with pytest.raises(TypeError, match="nn.Conv2d"):
        FusedActDepthwiseConv2d.from_conv(nn.Linear(3, 3))


def test_module_under_autocast_computes_in_the_autocast_dtype():
    layer = FusedActDepthwiseConv2d(4, 4, 3, padding=1)
    x = torch.randn(2, 4, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = F.conv2d(F.relu(x), layer.weight, layer.bias, padding=1, groups=4)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)


def test_torch_compile_matches_eager():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), FusedActDepthwiseConv2d(8, 8, 3, padding=1, act_in="relu6"))
    x = torch.randn(2, 3, 6, 6)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_geometries_cover_the_issue_list():
    """Kernel 3/5/7 and others, stride 1 and 2, padding and dilation: all in GEOMETRIES."""
    kernels = {g[0] for g in GEOMETRIES}
    strides = {s for g in GEOMETRIES for s in itertools.chain((g[1],) if isinstance(g[1], int) else g[1])}
    assert {(3, 3), (5, 5), (7, 7)} <= kernels and {1, 2} <= strides
    assert any(g[3] != 1 for g in GEOMETRIES) and any(g[2] != 0 for g in GEOMETRIES)

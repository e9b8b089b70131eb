"""group_norm_act / layer_norm_act and their modules: group norm or layer norm (+ residual) + activation.

References are eager torch compositions (F.group_norm / F.layer_norm, + residual, the activation) in float64:
tfuse in float64 must equal them within float64 rounding; in float32/bfloat16/float16 its error against the
float64 reference must stay within twice the error of the same eager composition run in that dtype, plus the
statistics' rounding over a row (sqrt(n) ulps).

The kernels' paths (one tile per row, rows looped in tiles, rows split across programs, d(weight) summed in
registers or in memory, several rows per backward program) are reached on small shapes by shrinking the tile
limits (the ``tiles`` fixture), so each runs in the interpreter in well under a second.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import torch_activation
from torch import nn

import tfuse
from tfuse._launch import count_launches
from tfuse.functional import group_norm_act, layer_norm_act
from tfuse.nn import FusedGroupNormAct, FusedLayerNormAct
from tfuse.ops import _norm_act_triton

ACTS = ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "relu6", "hardtanh", "hardswish",
        "hardsigmoid", "mish", "elu", "identity"]
BACKENDS = ["triton", "torch"]
#: (tile, one-tile limit) of each path: the defaults (rows held whole), and small ones (rows looped, split).
TILES = {"whole": (2048, 8192), "looped": (16, 32)}


@pytest.fixture
def tiles(monkeypatch):
    """Sets the kernels' tile limits (``tiles("looped")``); plans are rebuilt for the new limits."""

    def use(name):
        tile, one_tile = TILES[name]
        monkeypatch.setattr(_norm_act_triton, "_TILE", tile)
        monkeypatch.setattr(_norm_act_triton, "_MAX_ONE_TILE", one_tile)
        _norm_act_triton.clear_plans()

    yield use
    _norm_act_triton.clear_plans()


def _eager_group(x, w, b, r, groups, act, slope, eps=1e-5):
    if w is None and b is not None:  # torch's group norm backward fails for a bias alone; ones compute the same
        w = torch.ones_like(b)
    z = F.group_norm(x, groups, w, b, eps)
    return torch_activation(act, slope)(z + r if r is not None else z)


def _eager_layer(x, w, b, r, shape, act, slope, eps=1e-5):
    z = F.layer_norm(x, shape, w, b, eps)
    return torch_activation(act, slope)(z + r if r is not None else z)


def _leaves(tensors: dict, dtype=None, device=None) -> dict:
    out = {}
    for k, v in tensors.items():
        if v is None:
            out[k] = None
            continue
        t = v.detach().clone() if device is None else v.detach().to(device, copy=True)
        if dtype is not None and k in ("x", "r"):
            t = t.to(dtype)
        out[k] = t.requires_grad_()
    return out


def _run(fn, tensors: dict, dtype=None, seed=1, device=None):
    """(output, {name: grad}) of fn(**leaves) under a fixed random output gradient (on ``device``)."""
    leaves = _leaves(tensors, dtype, device)
    y = fn(**leaves)
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, dtype=torch.float64, generator=gen).to(y.dtype).to(y.device)
    y.backward(gy)
    return y, {k: v.grad for k, v in leaves.items() if v is not None}


def _assert_close64(got, want, what):
    scale = want.abs().max().clamp_min(1.0)
    err = (got.to(torch.float64) - want).abs().max()
    assert err <= 1e-12 * scale, f"{what}: max error {err:.3e} (scale {scale:.3e})"


def _group_tensors(shape, layout, affine, residual, dtype=torch.float64):
    x = torch.randn(shape, dtype=dtype) * 1.5 + 0.5
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    elif layout == "strided":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # neither contiguous nor channels-innermost
    c = shape[1]
    w = torch.rand(c, dtype=dtype) + 0.5 if affine in ("both", "weight") else None
    b = torch.randn(c, dtype=dtype) if affine in ("both", "bias") else None
    r = torch.randn(shape, dtype=dtype) if residual else None
    return {"x": x, "w": w, "b": b, "r": r}


# Every activation on each backend; the options rotate with the activation's index, so that every value of each
# option meets both backends (the class, not the cross product).
_SHAPES = [((2, 8, 5, 7), 4), ((1, 8, 6, 6), 2), ((3, 4, 9), 4), ((2, 6), 3), ((1, 4, 3, 4, 5), 2)]
_LAYOUTS = ["contiguous", "channels_last", "strided"]
_AFFINE = ["both", "none", "weight", "bias"]
_GROUP_CASES = [
    (act, backend, *_SHAPES[(j + k) % 5], _LAYOUTS[(j + 2 * k) % 3], _AFFINE[(j + k) % 4], (j + k) % 2 == 0,
     ["whole", "looped"][(j // 2 + k) % 2])
    for j, act in enumerate(ACTS)
    for k, backend in enumerate(BACKENDS)
]


@pytest.mark.parametrize("act, backend, shape, groups, layout, affine, residual, tile", _GROUP_CASES)
def test_group_norm_act_float64_matches_eager(act, backend, shape, groups, layout, affine, residual, tile, tiles,
                                               device):
    if layout == "channels_last" and len(shape) < 4:
        layout = "contiguous"  # no channels_last for 2-D/3-D inputs
    tiles(tile)
    slope = [0.2, -0.3][len(shape) % 2] if act == "leaky_relu" else None
    tensors = _group_tensors(shape, layout, affine, residual)
    with tfuse.use_backend(backend):
        y, grads = _run(lambda x, w, b, r: group_norm_act(x, groups, w, b, act=act, negative_slope=slope,
                                                          residual=r), tensors, device=device)
    want, want_grads = _run(lambda x, w, b, r: _eager_group(x, w, b, r, groups, act, slope if slope else 0.01),
                            tensors, device=device)
    _assert_close64(y, want, "y")
    if layout != "strided" and backend == "triton":
        assert y.stride() == tensors["x"].stride(), "the output keeps x's layout"
    assert y.device.type == device.type
    for k in want_grads:
        _assert_close64(grads[k], want_grads[k], f"d{k}")


_LAYER_SHAPES = [((5, 8, 24), (24,)), ((2, 3, 4, 5), (4, 5)), ((9, 40), (40,)), ((2, 2, 3), 3)]
_LAYER_CASES = [
    (act, backend, *_LAYER_SHAPES[(j + k) % 4], _AFFINE[(j + 3 * k) % 4], (j + k) % 2 == 1,
     ["whole", "looped"][(j // 2 + k) % 2])
    for j, act in enumerate(ACTS)
    for k, backend in enumerate(BACKENDS)
]


@pytest.mark.parametrize("act, backend, shape, normalized, affine, residual, tile", _LAYER_CASES)
def test_layer_norm_act_float64_matches_eager(act, backend, shape, normalized, affine, residual, tile, tiles,
                                               device):
    tiles(tile)
    slope = -0.25 if act == "leaky_relu" and len(shape) == 3 else (0.1 if act == "leaky_relu" else None)
    dims = (normalized,) if isinstance(normalized, int) else normalized
    x = torch.randn(shape, dtype=torch.float64) * 2 - 1
    tensors = {
        "x": x,
        "w": torch.rand(dims, dtype=torch.float64) + 0.5 if affine in ("both", "weight") else None,
        "b": torch.randn(dims, dtype=torch.float64) if affine in ("both", "bias") else None,
        "r": torch.randn(shape, dtype=torch.float64) if residual else None,
    }
    with tfuse.use_backend(backend):
        y, grads = _run(lambda x, w, b, r: layer_norm_act(x, normalized, w, b, act=act, negative_slope=slope,
                                                          residual=r), tensors, device=device)
    want, want_grads = _run(lambda x, w, b, r: _eager_layer(x, w, b, r, dims, act, slope if slope else 0.01),
                            tensors, device=device)
    _assert_close64(y, want, "y")
    for k in want_grads:
        _assert_close64(grads[k], want_grads[k], f"d{k}")


def test_paths_reached(tiles):
    """The cases above reach every kernel path: split rows (stats + normalise, reduce + dx), looped rows, whole
    rows, d(weight) in memory, several rows per backward program."""
    call = tfuse.ops._norm_act_checks.check_group_norm_call
    layer_call = tfuse.ops._norm_act_checks.check_layer_norm_call
    tiles("looped")
    seen = set()
    for shape, groups in _SHAPES:
        for layout in ("contiguous", "channels_last"):
            x = torch.randn(shape)
            if layout == "channels_last" and x.dim() >= 4:
                x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
            x, view = _norm_act_triton.norm_view(x, call(x, groups, None, None, None, 1e-5, "relu", None))
            plan = _norm_act_triton.norm_plan(view, x.dtype, x.device, x.numel())
            seen.add(("split" if plan.split else "one" if plan.one_tile else "looped", view.ch))
    for shape, normalized in _LAYER_SHAPES:
        x = torch.randn(shape)
        x, view = _norm_act_triton.norm_view(x, layer_call(x, normalized, None, None, None, 1e-5, "relu", None))
        plan = _norm_act_triton.norm_plan(view, x.dtype, x.device, x.numel())
        seen.add(("layer", plan.bb < view.b, plan.rows_per_prog > 1))
    assert {("split", 0), ("split", 1), ("looped", 0), ("one", 0)} <= seen, seen
    assert {("layer", True, True), ("layer", False, True)} <= seen, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["group", "layer"])
def test_low_precision_within_eager_error(kind, dtype, tiles, device):
    """tfuse's error against float64 is at most twice eager's own in the same dtype, plus sqrt(n) ulps of the
    statistics (float32 sums over a row of n)."""
    tiles("looped" if dtype == torch.float16 else "whole")
    torch.manual_seed(3)
    act = {torch.float32: "silu", torch.bfloat16: "gelu", torch.float16: "mish"}[dtype]
    if kind == "group":
        shape, n = (2, 8, 6, 6), 4 * 36
        tensors = _group_tensors(shape, "channels_last" if dtype == torch.bfloat16 else "contiguous", "both", True)
        fused = lambda x, w, b, r: group_norm_act(x, 2, w, b, act=act, residual=r)  # noqa: E731
        eager = lambda x, w, b, r: _eager_group(x, w, b, r, 2, act, 0.01)  # noqa: E731
    else:
        shape, n = (4, 6, 48), 48
        tensors = {"x": torch.randn(shape, dtype=torch.float64) + 3, "w": torch.rand(48, dtype=torch.float64) + 0.5,
                   "b": torch.randn(48, dtype=torch.float64), "r": torch.randn(shape, dtype=torch.float64)}
        fused = lambda x, w, b, r: layer_norm_act(x, 48, w, b, act=act, residual=r)  # noqa: E731
        eager = lambda x, w, b, r: _eager_layer(x, w, b, r, (48,), act, 0.01)  # noqa: E731
    # Parameters stay float32 as AMP keeps them; x and the residual are in the low dtype.
    tensors = {k: (v.float() if k in ("w", "b") else v) for k, v in tensors.items()}
    ref, ref_grads = _run(eager, {k: v.double() for k, v in tensors.items()}, device=device)
    with tfuse.use_backend("triton"):
        got, got_grads = _run(fused, tensors, dtype, device=device)
    low = {k: (v.to(dtype) if k in ("w", "b") else v) for k, v in tensors.items()}
    eag, eag_grads = _run(eager, low, dtype, device=device)
    ulp = torch.finfo(dtype).eps
    for name, g, e, r in [("y", got, eag, ref)] + [(k, got_grads[k], eag_grads[k], ref_grads[k]) for k in ref_grads]:
        err = (g.double() - r).abs().max().item()
        eager_err = (e.double() - r).abs().max().item()
        bound = 2 * eager_err + (n ** 0.5) * ulp * r.abs().max().item() * (4 if name in ("w", "b") else 1)
        assert err <= bound, f"{kind} {dtype} {name}: error {err:.3e} > bound {bound:.3e} (eager {eager_err:.3e})"


@pytest.mark.parametrize("kind", ["group", "layer"])
def test_gradcheck(kind, tiles, device):
    tiles("looped")
    torch.manual_seed(0)
    if kind == "group":
        x = torch.randn(1, 4, 5, 5, dtype=torch.float64, device=device)
        x = x.to(memory_format=torch.channels_last).requires_grad_()
        fn = lambda x, w, b, r: group_norm_act(x, 2, w, b, act="silu", residual=r)  # noqa: E731
        c = 4
    else:
        x = torch.randn(3, 40, dtype=torch.float64, device=device, requires_grad=True)
        fn = lambda x, w, b, r: layer_norm_act(x, 40, w, b, act="gelu_tanh", residual=r)  # noqa: E731
        c = 40
    w = torch.rand(c, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(c, dtype=torch.float64, device=device, requires_grad=True)
    r = torch.randn(x.shape, dtype=torch.float64, device=device, requires_grad=True)
    # fast_mode: the Jacobian checked along random directions (the full one costs 100+ interpreted calls; the
    # float64 comparisons above check every gradient element against torch's).
    with tfuse.use_backend("triton"):
        assert torch.autograd.gradcheck(fn, (x, w, b, r), fast_mode=True)


@pytest.mark.parametrize("tile, forward, backward", [("whole", 1, 1), ("looped", 2, 2)])
def test_launch_counts(tile, forward, backward, tiles, device):
    """One launch each way (two when a group norm's rows are split); d(weight)/d(bias) add torch's sum."""
    tiles(tile)
    x = torch.randn(1, 8, 6, 6, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    b = torch.zeros(8, device=device, requires_grad=True)
    with tfuse.use_backend("triton"):
        with count_launches() as launches:
            y = group_norm_act(x, 2, w, b, act="silu")
        assert launches.total == forward, launches
        with count_launches() as launches:
            y.sum().backward()
        assert launches.total == backward, launches
        x2 = torch.randn(4, 6, 10, device=device, requires_grad=True)
        with count_launches() as launches:
            layer_norm_act(x2, 10, act="gelu").sum().backward()
        assert launches.total == 2, launches


def test_saves_less_than_eager(device):
    """Backward keeps x and the per-row statistics (plus the output for activations that need it), never the
    normalised tensor: eager keeps the normalised tensor and the activation's input as well."""

    def saved_bytes(fn, *args):
        seen = []

        def pack(t):
            seen.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        unique = {(t.untyped_storage().data_ptr(), t.dtype): t.untyped_storage().nbytes() for t in seen}
        return sum(unique.values())

    x = torch.randn(2, 8, 16, 16, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    b = torch.zeros(8, device=device, requires_grad=True)
    with tfuse.use_backend("triton"):
        fused = saved_bytes(lambda: group_norm_act(x, 4, w, b, act="silu"))
    eager = saved_bytes(lambda: F.silu(F.group_norm(x, 4, w, b)))
    assert fused < x.numel() * 4 * 1.05 < eager, (fused, eager)


def test_autocast_dtype_like_torch(device):
    """Autocast gives what torch's ops give: CPU autocast leaves group_norm and layer_norm in x's dtype, CUDA's runs
    them in float32 (the kernels then read the 16-bit x and write float32)."""
    x = torch.randn(2, 8, 4, 4, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.rand(8, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want = F.silu(F.group_norm(x, 4, w, b))
        want_ln = F.gelu(F.layer_norm(x, (4,)))
        with tfuse.use_backend("triton"):
            got = group_norm_act(x, 4, w, b, act="silu")
            got_ln = layer_norm_act(x, 4, act="gelu")
    assert got.dtype == want.dtype and got_ln.dtype == want_ln.dtype
    assert got.dtype == (torch.float32 if device.type == "cuda" else torch.bfloat16)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_ln, want_ln, atol=2e-2, rtol=2e-2)
    got.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_double_backward_raises(device):
    """Second derivatives are not implemented: asking for one is an error, never a silent zero."""
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(2, 4, 3, 3, dtype=torch.float64, device=device, requires_grad=True)
    with tfuse.use_backend("triton"):
        y = group_norm_act(x, 2, act="silu")
        (g,) = torch.autograd.grad(y, x, grad_outputs=v, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()
        (g,) = torch.autograd.grad(group_norm_act(x, 2, act="silu").sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(g.sum(), x)


def test_empty_and_no_grad(device):
    x = torch.randn(0, 4, 3, 3, device=device, requires_grad=True)
    y = group_norm_act(x, 2, act="silu")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    z = torch.randn(3, 8, device=device)
    with torch.no_grad(), tfuse.use_backend("triton"), count_launches() as launches:
        y = layer_norm_act(z, 8, act="tanh")
    assert launches.total == 1 and not y.requires_grad
    torch.testing.assert_close(y, torch.tanh(F.layer_norm(z, (8,))))


_X = torch.randn(2, 4, 3, 3)
_BAD_GROUP = [
    (dict(x=[1.0]), TypeError, "x must be a tensor"),
    (dict(x=torch.ones(2, 4, dtype=torch.int32)), TypeError, "x has dtype"),
    (dict(x=torch.randn(4)), ValueError, "at least 2 dimensions"),
    (dict(num_groups=3), ValueError, "num_groups=3 must be positive and divide"),
    (dict(num_groups=2.0), TypeError, "num_groups must be an int"),
    (dict(num_groups=True), TypeError, "num_groups must be an int"),
    (dict(weight=torch.ones(3)), ValueError, r"weight must have shape \[4\]"),
    (dict(weight=torch.ones(4, dtype=torch.float64)), TypeError, "weight has dtype"),
    (dict(weight=torch.ones(4), bias=torch.ones(4, dtype=torch.bfloat16)), TypeError, "bias has dtype"),
    (dict(residual=torch.randn(2, 4, 3)), ValueError, "residual must have shape"),
    (dict(residual=torch.randn(2, 4, 3, 3, device="meta")), RuntimeError, "residual is on meta"),
    (dict(eps=-1e-5), ValueError, "eps must be finite and non-negative"),
    (dict(eps=float("nan")), ValueError, "eps must be finite"),
    (dict(eps="1e-5"), TypeError, "eps must be a number"),
    (dict(act="swish"), ValueError, "unknown activation 'swish'"),
    (dict(act="relu", negative_slope=0.1), ValueError, "no effect"),
]


@pytest.mark.parametrize("bad, error, match", _BAD_GROUP)
def test_group_norm_bad_inputs_rejected_before_launch(bad, error, match):
    args = dict(x=_X, num_groups=2, weight=None, bias=None, eps=1e-5, act="relu", negative_slope=None, residual=None)
    args.update(bad)
    with tfuse.use_backend("triton"), count_launches() as launches, pytest.raises(error, match=match):
        group_norm_act(**args)
    assert launches.total == 0


_BAD_LAYER = [
    (dict(normalized_shape=4), ValueError, r"does not end in normalized_shape \[4\]"),
    (dict(normalized_shape=()), ValueError, "at least one dimension"),
    (dict(normalized_shape="3"), TypeError, "normalized_shape must be an int or a sequence"),
    (dict(normalized_shape=(2, 3, 3, 3, 3)), ValueError, "at least 5 dimensions"),
    (dict(weight=torch.ones(3, 3)), ValueError, r"weight must have shape \[3\]"),
    (dict(bias=torch.zeros(3, device="meta")), RuntimeError, "bias is on meta"),
    (dict(act=None), TypeError, "act must be a string"),
]


@pytest.mark.parametrize("bad, error, match", _BAD_LAYER)
def test_layer_norm_bad_inputs_rejected_before_launch(bad, error, match):
    args = dict(x=_X, normalized_shape=3, weight=None, bias=None, eps=1e-5, act="relu", negative_slope=None,
                residual=None)
    args.update(bad)
    with tfuse.use_backend("triton"), count_launches() as launches, pytest.raises(error, match=match):
        layer_norm_act(**args)
    assert launches.total == 0


# ---- modules -------------------------------------------------------------------------------------------------

_MODULES = [
    (lambda **kw: FusedGroupNormAct(2, 6, **kw), lambda: nn.GroupNorm(2, 6), (3, 6, 4, 5)),
    (lambda **kw: FusedLayerNormAct((4, 5), **kw), lambda: nn.LayerNorm((4, 5)), (3, 6, 4, 5)),
]


@pytest.mark.parametrize("fused, plain, shape", _MODULES)
def test_module_is_drop_in(fused, plain, shape):
    torch.manual_seed(0)
    reference = plain()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    layer = fused(act="silu")
    assert layer.state_dict().keys() == reference.state_dict().keys()
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(shape)
    torch.testing.assert_close(layer(x), F.silu(reference(x)))
    residual = torch.randn(shape)
    torch.testing.assert_close(layer(x, residual), F.silu(reference(x) + residual))
    # identity by default: exactly the torch layer
    default = fused()
    default.load_state_dict(reference.state_dict())
    torch.testing.assert_close(default(x), reference(x))
    # copies, save/load, meta init
    clone = copy.deepcopy(layer)
    assert clone.act == "silu" and all(a is not b for a, b in zip(clone.parameters(), layer.parameters()))
    torch.testing.assert_close(clone(x), layer(x))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = fused(act="silu")
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(fresh(x), layer(x))
    whole = io.BytesIO()
    torch.save(layer, whole)
    whole.seek(0)
    torch.testing.assert_close(torch.load(whole, weights_only=False)(x), layer(x))
    meta = fused(act="silu", device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    torch.testing.assert_close(meta(x), fused(act="silu")(x))


def test_module_options_and_conversion():
    gn = nn.GroupNorm(2, 6, affine=False)
    fused = FusedGroupNormAct.from_groupnorm(gn, act="leaky_relu", negative_slope=0.2)
    assert fused.weight is None and fused.act == "leaky_relu" and "negative_slope=0.2" in repr(fused)
    x = torch.randn(2, 6, 3, 3)
    torch.testing.assert_close(fused(x), F.leaky_relu(gn(x), 0.2))
    ln = nn.LayerNorm(8, bias=False)
    fused_ln = FusedLayerNormAct.from_layernorm(ln, act="hardswish")
    assert fused_ln.weight is ln.weight and fused_ln.bias is None
    y = torch.randn(5, 8)
    torch.testing.assert_close(fused_ln(y), F.hardswish(ln(y)))
    no_bias = FusedGroupNormAct(2, 6, bias=False, act="relu")
    assert no_bias.bias is None and no_bias.weight is not None
    with pytest.raises(TypeError, match="expects an nn.GroupNorm"):
        FusedGroupNormAct.from_groupnorm(ln)
    with pytest.raises(ValueError, match="unknown activation"):
        FusedLayerNormAct(8, act="swishy")
    with pytest.raises(ValueError, match="needs act='leaky_relu'"):
        FusedLayerNormAct.from_layernorm(ln, negative_slope=0.1)


@pytest.mark.parametrize("fused, plain, shape", _MODULES)
def test_module_compiles_without_graph_breaks(fused, plain, shape):
    torch._dynamo.reset()
    layer = fused(act="gelu")
    x = torch.randn(shape, requires_grad=True)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, layer(x))
    y.sum().backward()
    assert x.grad is not None


def test_module_traces_as_a_leaf():
    model = nn.Sequential(nn.Conv2d(3, 6, 1), FusedGroupNormAct(3, 6, act="silu"))
    graph = torch.fx.symbolic_trace(model)
    assert [n.op for n in graph.graph.nodes].count("call_module") == 2
    x = torch.randn(1, 3, 4, 4)
    torch.testing.assert_close(graph(x), model(x))


def test_torch_path_survives_torch_channels_last_weight_only_backward():
    """torch 2.13's CPU group norm backward crashes (segmentation fault) for a channels_last x that needs no
    gradient while weight and bias do; the PyTorch path computes it from a contiguous x instead."""
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    w, b = torch.rand(8, requires_grad=True), torch.randn(8, requires_grad=True)
    with tfuse.use_backend("torch"):
        y = group_norm_act(x, 4, w, b, act="silu")
    assert y.is_contiguous(memory_format=torch.channels_last)
    y.sum().backward()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    F.silu(F.group_norm(x.contiguous(), 4, w2, b2)).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_shape_classes_and_the_eager_rule(monkeypatch, device):
    """The dispatch key, and the rule: a class in EAGER_SHAPE_CLASSES takes the PyTorch path on CUDA only, and
    never where a backend is forced."""
    from tfuse.ops import norm_act
    from tfuse.ops._norm_act_checks import check_group_norm_call

    x = torch.randn(2, 64, 16, 16)
    call = check_group_norm_call(x, 32, None, None, None, 1e-5, "silu", None)
    key = norm_act.shape_class("group_norm_act", x, call)
    assert key == ("group_norm_act", False, torch.float32, 1024)  # rows of 2 channels x 256 pixels = 512
    assert norm_act.shape_class("group_norm_act", x.to(memory_format=torch.channels_last), call)[1] is True
    monkeypatch.setattr(norm_act, "EAGER_SHAPE_CLASSES", frozenset({key}))
    assert not norm_act._eager_class("group_norm_act", x, call)  # a CPU tensor: the rule is CUDA's
    with tfuse.use_backend("triton"), count_launches() as launches:  # a forced backend wins over the rule
        group_norm_act(x.to(device), 32, act="silu")
    assert launches.total == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA eager-class rule needs a GPU")
def test_cuda_eager_class_runs_torch(monkeypatch):
    from tfuse.ops import norm_act
    from tfuse.ops._norm_act_checks import check_group_norm_call

    x = torch.randn(2, 64, 16, 16, device="cuda")
    call = check_group_norm_call(x, 32, None, None, None, 1e-5, "silu", None)
    monkeypatch.setattr(norm_act, "EAGER_SHAPE_CLASSES", frozenset({norm_act.shape_class("group_norm_act", x, call)}))
    with count_launches() as launches:
        y = group_norm_act(x, 32, act="silu")
    assert launches.total == 0
    torch.testing.assert_close(y, F.silu(F.group_norm(x, 32)))

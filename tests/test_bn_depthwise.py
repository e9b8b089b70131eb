"""batch_norm_act_depthwise_conv2d and its modules: batch norm -> activation -> depthwise conv, the normalised
activation never written.

References are eager torch compositions (F.batch_norm, the activation, F.conv2d) in float64: tfuse in float64
must equal them within float64 rounding; in float32/bfloat16 its error against the float64 reference must stay
within twice the error of the same eager composition run in that dtype (the algorithm's own rounding).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import torch_activation
from torch import nn

import tfuse
from tfuse.functional import batch_norm_act_depthwise_conv2d
from tfuse.nn import BatchNormBoundDepthwiseConv2d, FusedBatchNormActDepthwiseConv2d

ACTS = ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "relu6", "hardtanh", "hardswish",
        "hardsigmoid", "mish", "elu", "identity"]
BACKENDS = ["triton", "torch"]


def _eager(x, rm, rv, w, b, cw, cb, training, act, slope, stride, padding, dilation, momentum=0.1, eps=1e-5):
    z = F.batch_norm(x, rm, rv, w, b, training, momentum, eps)
    a = torch_activation(act, slope if slope is not None else 0.01)(z)
    return F.conv2d(a, cw, cb, stride, padding, dilation, x.shape[1])


def _inputs(dtype, channels_last, affine, conv_bias, tracked, seed_shift=0.0):
    n, c, h, w = 2, 5, 7, 9
    x = torch.randn(n, c, h, w, dtype=torch.float64) * 1.5 + 0.5 + seed_shift
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    params = {
        "x": x,
        "w": torch.rand(c, dtype=torch.float64) + 0.5 if affine else None,
        "b": torch.randn(c, dtype=torch.float64) if affine else None,
        "cw": torch.randn(c, 1, 3, 3, dtype=torch.float64),
        "cb": torch.randn(c, dtype=torch.float64) if conv_bias else None,
    }
    stats = (torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5) if tracked else (None, None)
    return {k: (v.to(dtype) if v is not None and k == "x" else v) for k, v in params.items()}, stats


def _run(fn, params, stats, dtype, **kwargs):
    """fn's output, the gradients of every input that has one, and the running statistics after the call."""
    leaves = {k: (v.detach().to(dtype if k in ("x", "cw", "cb") else v.dtype).clone().requires_grad_()
                  if v is not None else None) for k, v in params.items()}
    if dtype != torch.float64 and leaves["w"] is not None:  # batch norm parameters stay float32, as AMP keeps them
        leaves["w"] = params["w"].detach().float().clone().requires_grad_()
        leaves["b"] = params["b"].detach().float().clone().requires_grad_()
    rm, rv = (s.clone().to(torch.float64 if dtype == torch.float64 else torch.float32) if s is not None else None
              for s in stats)
    y = fn(leaves["x"], rm, rv, leaves["w"], leaves["b"], leaves["cw"], leaves["cb"], **kwargs)
    torch.manual_seed(1)
    gy = torch.randn(y.shape, dtype=torch.float64).to(y.dtype)
    y.backward(gy)
    grads = {k: v.grad for k, v in leaves.items() if v is not None}
    return y, grads, (rm, rv)


def _fused(x, rm, rv, w, b, cw, cb, training, act, slope, stride, padding, dilation):
    return batch_norm_act_depthwise_conv2d(x, rm, rv, w, b, cw, cb, training=training, act=act, negative_slope=slope,
                                           stride=stride, padding=padding, dilation=dilation)


# Every activation on each backend; the options rotate with the activation's index, so that every value of each
# option meets both backends (the class, not the cross product).
_CASES = [
    (act, backend, (j + k) % 2 == 0, (j + k) % 3 != 0, (j + k) % 5 != 1, (j // 2 + k) % 2 == 1, (j + k) % 7 != 2,
     *[(1, 1, 1), (2, 1, 1), (1, "same", 2), (2, 0, 1)][(j + 2 * k) % 4])
    for j, act in enumerate(ACTS)
    for k, backend in enumerate(BACKENDS)
    if (j + k) % 3 != 0 or (j + k) % 7 != 2  # eval needs running statistics
]


@pytest.mark.parametrize("act,backend,channels_last,training,affine,conv_bias,tracked,stride,padding,dilation", _CASES)
def test_equals_the_eager_composition_in_float64(act, backend, channels_last, training, affine, conv_bias, tracked,
                                                 stride, padding, dilation):
    params, stats = _inputs(torch.float64, channels_last, affine, conv_bias, tracked)
    slope = 0.2 if act == "leaky_relu" else None
    kwargs = dict(training=training, act=act, slope=slope, stride=stride, padding=padding, dilation=dilation)
    with tfuse.use_backend(backend):
        y, grads, running = _run(_fused, params, stats, torch.float64, **kwargs)
    y_ref, grads_ref, running_ref = _run(_eager, params, stats, torch.float64, **kwargs)
    assert y.dtype == torch.float64 and y.shape == y_ref.shape
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last or y.shape[-1] == 1
    scale = y_ref.abs().max().item() + 1.0
    assert (y - y_ref).abs().max().item() <= 1e-12 * scale
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        bound = 1e-11 * (grads_ref[name].abs().max().item() + 1.0)
        assert (grads[name] - grads_ref[name]).abs().max().item() <= bound, name
    for mine, ref in zip(running, running_ref):
        if ref is not None:
            assert (mine - ref).abs().max().item() <= 1e-13


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "triton"), (torch.bfloat16, "triton"),
                                           (torch.float16, "torch"), (torch.bfloat16, "torch")])
def test_low_precision_within_the_eager_compositions_rounding(dtype, backend):
    params, stats = _inputs(torch.float64, True, True, True, True)
    kwargs = dict(training=True, act="silu", slope=None, stride=1, padding=1, dilation=1)
    y64, g64, _ = _run(_eager, params, stats, torch.float64, **kwargs)
    with tfuse.use_backend(backend):
        y, grads, _ = _run(_fused, params, stats, dtype, **kwargs)
    y_eager, grads_eager, _ = _run(_eager, params, stats, dtype, **kwargs)
    assert y.dtype == dtype

    def err(a, ref):
        return (a.double() - ref).abs().max().item()

    # Statistics and parameter gradients are sums over the n = N*H*W values of a channel, in float32: their
    # rounding error grows like sqrt(n) ulps. (torch's CPU batch norm accumulates its float32 statistics in
    # float64, so eager's own float32 error can be far under that.)
    unit = torch.finfo(dtype).eps * (params["x"].numel() / params["x"].shape[1]) ** 0.5
    assert err(y, y64) <= 2 * err(y_eager, y64) + 4 * unit * y64.abs().max().item()
    for name in g64:
        ref = g64[name]
        assert err(grads[name], ref) <= 2 * err(grads_eager[name], ref) + 4 * unit * ref.abs().max().item(), name


def test_launches_and_what_backward_keeps():
    params, stats = _inputs(torch.float32, True, True, False, True)
    x = params["x"].requires_grad_()
    w, b, cw = (params[k].float().requires_grad_() for k in ("w", "b", "cw"))
    rm, rv = (s.float() for s in stats)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = batch_norm_act_depthwise_conv2d(x, rm, rv, w, b, cw, training=True, act="relu6", padding=1)
        with tfuse.count_launches() as backward:
            y.sum().backward()
        with tfuse.count_launches() as evaluation, torch.no_grad():
            batch_norm_act_depthwise_conv2d(x, rm, rv, w, b, cw, training=False, act="relu6", padding=1)
    assert forward.by_kernel == {"_bn_stats_partial_kernel": 1, "_dw_fwd_kernel": 1}
    assert backward.by_kernel == {"_dw_bwd_dx_kernel": 1, "_dw_bwd_dw_partial_kernel": 1,
                                  "_bn_act_bwd_reduce_kernel": 1, "_bn_act_bwd_dx_kernel": 1}
    assert evaluation.by_kernel == {"_dw_fwd_kernel": 1}
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and big[0] is x  # x only: no normalised or activated tensor
    eager_saved = []

    def pack_eager(t):
        eager_saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_eager, lambda t: t):
        _eager(x, rm.clone(), rv.clone(), w, b, cw, None, True, "relu6", None, 1, 1, 1)
    # Eager keeps x (batch norm), the batch norm's output (relu6's backward reads its input) and the activation
    # (the convolution's weight gradient): two activation-sized tensors more.
    assert len({id(t) for t in eager_saved if t.numel() == x.numel()}) == 3


@pytest.mark.parametrize("call", [
    lambda x, cw: batch_norm_act_depthwise_conv2d(x[0], None, None, None, None, cw, training=True),  # 3-D x
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, None, None, None, None, cw[:, :, :2], training=True,
                                                  act="bogus"),
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, None, None, None, None, cw.repeat(1, 2, 1, 1), training=True),
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, None, None, None, None, cw, training=True, negative_slope=0.1),
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, None, None, None, None, cw, training=False),  # no statistics
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, None, None, None, None, cw, training=True, stride=0),
    lambda x, cw: batch_norm_act_depthwise_conv2d(x, torch.zeros(3), torch.ones(3), None, None, cw, training=True),
])
def test_bad_inputs_are_rejected_before_any_launch(call):
    x, cw = torch.randn(2, 4, 6, 6), torch.randn(4, 1, 3, 3)
    with tfuse.use_backend("triton"), tfuse.count_launches() as launches:
        with pytest.raises((TypeError, ValueError, RuntimeError)) as error:
            call(x, cw)
    assert "tfuse" in str(error.value) or "must" in str(error.value)
    assert launches.total == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_is_the_three_layers_it_replaces(backend):
    torch.manual_seed(0)
    block = FusedBatchNormActDepthwiseConv2d(6, 3, stride=2, padding=1, act="hardswish", momentum=None).double()
    eager = nn.Sequential(copy.deepcopy(block.bn), nn.Hardswish(), copy.deepcopy(block.conv))
    assert [k.replace("bn.", "0.").replace("conv.", "2.") for k in block.state_dict()] == list(eager.state_dict())
    for step in range(3):  # momentum=None: a cumulative average over the steps, as nn.BatchNorm2d keeps it
        x = torch.randn(3, 6, 8, 8, dtype=torch.float64)
        with tfuse.use_backend(backend):
            y = block(x)
        torch.testing.assert_close(y, eager(x), rtol=0, atol=1e-12)
    for mine, ref in zip(block.state_dict().values(), eager.state_dict().values()):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-13)
    block.eval(), eager.eval()
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    with tfuse.use_backend(backend):
        torch.testing.assert_close(block(x), eager(x), rtol=0, atol=1e-12)
    clone = copy.deepcopy(block)
    torch.testing.assert_close(clone(x), block(x), rtol=0, atol=0)
    shared = FusedBatchNormActDepthwiseConv2d.from_modules(eager[0], eager[2], act="hardswish")
    assert shared.bn is eager[0] and shared.conv is eager[2] and not shared.training


def test_modules_refuse_what_they_cannot_fuse():
    bn, conv = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=4)
    with pytest.raises(ValueError, match="depthwise"):
        FusedBatchNormActDepthwiseConv2d.from_modules(bn, nn.Conv2d(4, 4, 3))
    with pytest.raises(TypeError, match="not a subclass"):
        BatchNormBoundDepthwiseConv2d.from_modules(tfuse.nn.FusedBatchNormAct2d(4, act="relu"), conv)
    with pytest.raises(ValueError, match="zeros"):
        BatchNormBoundDepthwiseConv2d.from_modules(bn, nn.Conv2d(4, 4, 3, groups=4, padding_mode="reflect"))
    with pytest.raises(ValueError, match="negative_slope"):
        FusedBatchNormActDepthwiseConv2d(4, 3, act="relu", negative_slope=0.1)


def test_traces_without_a_graph_break():
    block = FusedBatchNormActDepthwiseConv2d(4, 3, padding=1, act="silu")
    x = torch.randn(2, 4, 6, 6)
    expected = copy.deepcopy(block)(x)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


class _MBConv(nn.Module):
    """EfficientNet-B0's block: expand 1x1, BN, SiLU, depthwise 5x5, BN, SiLU, squeeze-excite, project 1x1, BN."""

    def __init__(self, c: int, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.depthwise = nn.Sequential(nn.Conv2d(h, h, 5, padding=2, groups=h, bias=False), nn.BatchNorm2d(h),
                                       nn.SiLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(h, 4, 1), nn.SiLU(), nn.Conv2d(4, h, 1),
                                nn.Sigmoid())
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        return x + self.project(h * self.se(h))


@pytest.mark.parametrize("net", ["mobilenet_v2", "efficientnet"])
def test_fused_networks_run_the_block_and_compute_what_the_originals_do(net):
    """MobileNetV2 (benchmarks/e2e_models.py, torchvision's layout) and EfficientNet-B0 blocks, fused by fuse_model:
    the depthwise convolutions after a BatchNorm2d + activation become the fused block, and the fused network
    equals the original in train and eval mode (float64), on the Triton kernels (interpreted) where it is small."""
    torch.manual_seed(0)
    if net == "mobilenet_v2":
        root = Path(__file__).resolve().parents[1]
        if not (root / "benchmarks" / "e2e_models.py").is_file():
            # An installed-package run has no benchmarks/; the EfficientNet case still covers the fused network.
            pytest.skip("needs the source tree: benchmarks/ (the in-repo MobileNetV2) is not installed")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from benchmarks.e2e_models import MobileNetV2

        model, shape, blocks, backend = MobileNetV2(0.25, num_classes=10), (2, 3, 32, 32), 16, "torch"
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(), _MBConv(8))
        shape, blocks, backend = (2, 3, 8, 8), 1, "triton"
    model = model.double()
    fused, report = tfuse.fuse_model(model)
    assert report.counts().get(f"BatchNorm2d+{'ReLU6' if net == 'mobilenet_v2' else 'SiLU'}+depthwise Conv2d") == blocks
    assert sum(type(m) is BatchNormBoundDepthwiseConv2d for m in fused.modules()) == blocks
    assert list(fused.state_dict()) == list(model.state_dict())
    for train in (True, False):
        reference, candidate = copy.deepcopy(model).train(train), copy.deepcopy(fused).train(train)
        x = torch.randn(shape, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout mask for both (MobileNetV2's classifier)
        with tfuse.use_backend(backend), tfuse.count_launches() as launches:
            yb = candidate(xb)
            yb.sum().backward()
        torch.manual_seed(1)
        ya = reference(xa)
        ya.sum().backward()
        torch.testing.assert_close(yb, ya, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-9, atol=1e-9)
        for (name, a), b in zip(reference.named_parameters(), candidate.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-9, msg=name)
        for (name, a), b in zip(reference.state_dict().items(), candidate.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)  # running statistics
        if backend == "triton":
            assert launches.by_kernel["_dw_fwd_kernel"] == blocks
            assert launches.by_kernel["_dw_bwd_dx_kernel"] == blocks

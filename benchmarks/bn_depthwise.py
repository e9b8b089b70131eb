"""Benchmark of ``tfuse.functional.batch_norm_act_depthwise_conv2d`` (batch norm -> activation -> depthwise conv,
the normalised activation never written) in training.

Compared, at the depthwise layers of MobileNetV2 (ReLU6, 3x3) and EfficientNet-B0 (SiLU, 5x5):

* tfuse: the fused block (on a CPU its PyTorch path: torch's batch norm, activation and conv2d, the
  intermediate tensors freed after forward and recomputed in backward);
* BN+act, conv: tfuse's fused batch norm + activation, then ``F.conv2d`` (cuDNN's depthwise kernel on a GPU):
  what ``fuse_model`` made of the block before this fusion;
* eager: ``F.batch_norm``, the activation, ``F.conv2d``; torch.compile: that composition compiled.

Minimum bytes (e: element size; X, Y, K: elements of x, y and the weight): a training forward reads x twice
(the statistics must be known before anything is normalised) and w once and writes y, ``(2X + K + Y) e``;
its backward reads gy and x for the convolution's gradients and the batch norm's sums, then gy and x again for
dx, and writes dx and dw: ``(3X + 2Y + 2K) e`` more. Memory: what autograd keeps for backward (x counted,
parameters and the output not), as in the depthwise benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

import tfuse

from .depthwise import EFFICIENTNET_B0, MOBILENET_V2, TORCH_ACT, Layer, _output_size
from .harness import (
    CHECK_COLUMN,
    Column,
    Context,
    Progress,
    Report,
    copy_note,
    finish_row,
    grid,
    saved_for_backward_bytes,
    training_call,
)

NAME = "bn_depthwise"


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    small = dataclasses.replace
    if ctx.machine.on_gpu:
        batch = 64 if ctx.quick else 128
        layers = [MOBILENET_V2[2], EFFICIENTNET_B0[2]] if ctx.quick else MOBILENET_V2 + EFFICIENTNET_B0
        formats = [(torch.bfloat16, True)] if ctx.quick else [(torch.bfloat16, True), (torch.bfloat16, False)]
    elif ctx.quick:
        batch, layers, formats = 2, [small(MOBILENET_V2[6], channels=16)], [(torch.float32, True)]
    else:
        batch = 4
        layers = [small(MOBILENET_V2[4], channels=96), small(EFFICIENTNET_B0[0], channels=48, size=28)]
        formats = [(torch.float32, True), (torch.float32, False)]
    return [
        triton.testing.Benchmark(
            x_names=["layer"], x_vals=layers, line_arg="provider", line_vals=["tfuse", "bn_act_conv", "eager", "compile"],
            line_names=["tfuse", "tfuse BN+act, F.conv2d", "eager", "torch.compile"],
            plot_name=f"bn_depthwise-{dtype}-{'cl' if channels_last else 'nchw'}",
            args={"batch": batch, "dtype": dtype, "channels_last": channels_last},
        )
        for dtype, channels_last in formats
    ]


def min_bytes(batch: int, layer: Layer, element_size: int, backward: bool) -> int:
    """Forward (2X + K + Y) e; with backward (5X + 3Y + 3K) e (module docstring)."""
    x = batch * layer.channels * layer.size**2
    y = batch * layer.channels * _output_size(layer.size, layer) ** 2
    k = layer.channels * layer.kernel**2
    return ((5 * x + 3 * y + 3 * k) if backward else (2 * x + y + k)) * element_size


class _Block:
    """The block's parameters and running statistics, and its three implementations."""

    def __init__(self, layer: Layer, batch: int, dtype: torch.dtype, channels_last: bool, device: torch.device):
        c = layer.channels
        self.layer, self.padding = layer, layer.kernel // 2
        self.x = torch.randn(batch, c, layer.size, layer.size, device=device, dtype=dtype) * 2 + 0.5
        if channels_last:
            self.x = self.x.to(memory_format=torch.channels_last)
        self.weight = torch.rand(c, device=device) + 0.5  # batch norm parameters stay float32, as AMP keeps them
        self.bias = torch.randn(c, device=device)
        self.conv = torch.randn(c, 1, layer.kernel, layer.kernel, device=device, dtype=dtype) / layer.kernel
        self.mean, self.var = torch.zeros(c, device=device), torch.ones(c, device=device)

    def leaves(self, grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(grad) for t in (self.x, self.weight, self.bias, self.conv))

    def fused(self, x, w, b, cw):
        return tfuse.functional.batch_norm_act_depthwise_conv2d(
            x, self.mean, self.var, w, b, cw, training=True, act=self.layer.act, stride=self.layer.stride,
            padding=self.padding)

    def bn_act_conv(self, x, w, b, cw):
        a = tfuse.functional.batch_norm_act(x, self.mean, self.var, w, b, training=True, act=self.layer.act)
        return F.conv2d(a, cw, None, self.layer.stride, self.padding, 1, x.shape[1])

    def eager(self, x, w, b, cw):
        z = F.batch_norm(x, self.mean, self.var, w, b, True)
        return F.conv2d(TORCH_ACT[self.layer.act](z), cw, None, self.layer.stride, self.padding, 1, x.shape[1])


def _check(name: str, fn, reference, leaves, dtype: torch.dtype, backward: bool) -> None:
    """A benchmark of a wrong result means nothing: relative to the largest value."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    y, expected = fn(*leaves), reference(*leaves)
    pairs = [("y", y, expected)]
    if backward:
        gy = torch.randn_like(y)
        got, want = torch.autograd.grad(y, leaves, gy), torch.autograd.grad(expected, leaves, gy)
        pairs += list(zip(("dx", "dweight", "dbias", "dconv"), got, want))
    for what, a, b in pairs:
        scale = b.float().abs().max().item() or 1.0
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda m, what=what: f"{name} {what}: {m}")


def _launches(block: _Block, backward: bool) -> str:
    """Triton launches of the fused block (interpreted on a CPU, on the benchmark's small input)."""
    leaves = block.leaves(backward)
    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward:
            y = block.fused(*leaves)
        if not backward:
            return str(forward.total)
        with tfuse.count_launches() as grads:
            torch.autograd.grad(y, leaves, torch.randn_like(y))
    return f"{forward.total} + {grads.total}"


def _measure(ctx: Context, layer: Layer, batch: int, dtype: torch.dtype, channels_last: bool) -> list[dict[str, Any]]:
    block = _Block(layer, batch, dtype, channels_last, ctx.machine.device)
    compiled = ctx.compile_reference(block.eager) if ctx.use_compile else None
    backend = "auto" if ctx.machine.on_gpu else "torch"
    rows = []
    for passes in ("forward", "forward+backward"):
        training = passes == "forward+backward"
        leaves = block.leaves(training)
        gy = torch.randn_like(block.eager(*leaves)) if training else None
        nbytes = min_bytes(batch, layer, block.x.element_size(), training)

        def run(fn, leaves=leaves, gy=gy):
            return training_call(fn, leaves, gy)

        row: dict[str, Any] = {
            "net": layer.net, "act": layer.act, "dtype": str(dtype).replace("torch.", ""),
            "layout": "channels_last" if channels_last else "NCHW", "layer": layer.label, "passes": passes,
            "mbytes": nbytes / 1e6,
        }
        with tfuse.use_backend(backend):
            _check("tfuse", block.fused, block.eager, leaves, dtype, training)
            _check("tfuse BN+act, conv", block.bn_act_conv, block.eager, leaves, dtype, training)
            if training:
                row["x_mb"] = block.x.numel() * block.x.element_size() / 1e6
                for key, fn in (("tfuse", block.fused), ("bn_act_conv", block.bn_act_conv), ("eager", block.eager)):
                    row[f"{key}_saved_mb"] = saved_for_backward_bytes(lambda fn=fn: fn(*leaves), leaves[1:])[0] / 1e6
        if ctx.machine.on_gpu or ctx.machine.interpreted:
            row["launches"] = _launches(block, training)
        providers = {"tfuse": run(block.fused), "bn_act_conv": run(block.bn_act_conv), "eager": run(block.eager)}
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
        with tfuse.use_backend(backend):
            timings, copy_nbytes = ctx.measure(providers, nbytes)
        finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
                   ratios={"vs_eager": "eager", "vs_bn_act_conv": "bn_act_conv", "vs_compile": "compile"})
        row["series"] = f"{passes}, {row['dtype']}, {row['layout']}"
        rows.append(row)
    return rows


def run(ctx: Context) -> Report:
    rows = []
    configs = [config for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for config in configs:
        layout = "channels_last" if config["channels_last"] else "NCHW"
        progress.step(f"{config['layer'].net} {config['layer'].label}, {config['dtype']}, {layout}")
        rows.extend(_measure(ctx, config["layer"], config["batch"], config["dtype"], config["channels_last"]))
    on_gpu = ctx.machine.on_gpu
    label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    notes = [
        copy_note(ctx),
        "Training mode throughout (batch statistics, running statistics updated). GB/s = minimum bytes / median "
        "time (e: element size; X, Y, K: elements of x, y and the weight). Forward: x read twice (statistics, then "
        "the normalised convolution), w read, y written: (2X + K + Y) e. Forward+backward adds gy and x read for the "
        "convolution's gradients and batch norm's sums, gy and x read again for dx, dx and dw written: "
        "(5X + 3Y + 3K) e in all. tfuse's Triton backward moves more: its four passes read x four times and write "
        "and read back dz (the gradient at the batch norm's output).",
        "Layers: the depthwise convolutions of MobileNetV2 (3x3, ReLU6) and EfficientNet-B0 (5x5, SiLU) with the "
        "batch norm and activation before them, padding k // 2, no convolution bias; batch norm parameters float32. "
        "eager = F.batch_norm, the activation, F.conv2d(groups=C); tfuse BN+act, F.conv2d = "
        "tfuse.functional.batch_norm_act then F.conv2d (cuDNN on a GPU); torch.compile compiles eager.",
        "launches: Triton launches of the fused block, forward + backward (statistics and the normalising "
        "convolution; the convolution's weight and input gradients, batch norm's reduction and dx).",
        "kept MB: what autograd keeps for backward (saved_tensors_hooks, distinct storages; parameters and the "
        "output not counted, x counted). The fused block keeps x alone; eager keeps x, the batch norm output and the "
        "activation (ReLU6 and SiLU read their input); tfuse BN+act then conv keeps x and the activation on the Triton "
        "path, and the batch norm output too on its PyTorch path (torch's batch norm and activation).",
    ]
    if not on_gpu:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path (torch's batch norm, activation and conv2d, with the "
            "intermediate tensors freed after forward and recomputed in backward: more passes than eager). The "
            "Triton kernels ran through the interpreter only for launch counts; their speed needs a GPU run.")
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("act", "act"), Column("dtype", "dtype"), Column("layout", "layout"), Column("layer", "layer"),
        Column("passes", "passes"), Column("mbytes", "MB moved", "{:.2f}"),
        Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True), Column("tfuse_gbps", "GB/s", "{:.1f}"),
        Column("pct_copy", "% of copy BW", "{:.0f}%"), Column("launches", "launches"),
        Column("bn_act_conv_ms", "BN+act, conv ms", "{:.4f}", spread=True),
        Column("eager_ms", "eager ms", "{:.4f}", spread=True),
        Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "vs eager", "{:.2f}x"), Column("vs_bn_act_conv", "vs BN+act, conv", "{:.2f}x"),
        Column("vs_compile", "vs compile", "{:.2f}x"), Column("x_mb", "x MB", "{:.4g}"),
        Column("tfuse_saved_mb", "tfuse kept MB", "{:.4g}"), Column("bn_act_conv_saved_mb", "BN+act, conv kept MB",
                                                                     "{:.4g}"),
        Column("eager_saved_mb", "eager kept MB", "{:.4g}"), CHECK_COLUMN,
    ]
    plot_lines = [("tfuse_gbps", label), ("bn_act_conv_gbps", "tfuse BN+act, F.conv2d"), ("eager_gbps", "eager"),
                  ("compile_gbps", "torch.compile"), ("copy_gbps", "copy of the same bytes")]
    return Report(
        name=NAME, title="tfuse.functional.batch_norm_act_depthwise_conv2d: batch norm + activation + depthwise conv",
        notes=notes, columns=columns, rows=rows, plot_x="layer", plot_xlabel="layer (C x H x W, kernel, stride)",
        plot_lines=plot_lines, reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )

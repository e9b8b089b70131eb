"""Benchmark of ``FusedBatchNormAct2d`` against ``nn.BatchNorm2d`` + (residual add) + ReLU and torch.compile.

Bytes are the traffic of a two-read forward: training reads x for the
statistics and again to normalise, and writes y (plus the residual read);
eval reads x once. Backward reads x, dy and y in each of its two passes and
writes dx: 7 tensor passes (the residual needs no gradient here; when it
does, the first pass also writes d(residual) and the second reads it in place
of dy and y, again 7). No training batch norm can do with less than two reads
of x unless x stays on chip.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import triton.testing
from torch import nn

import tfuse
from tfuse.nn import FusedBatchNormAct2d

from .harness import CHECK_COLUMN, Column, Context, Progress, Report, copy_note, finish_row, grid

NAME = "bn_act"


class _EagerBlock(nn.Module):
    """nn.BatchNorm2d, then the residual add, then ReLU: what FusedBatchNormAct2d replaces."""

    def __init__(self, bn: nn.BatchNorm2d) -> None:
        super().__init__()
        self.bn = bn
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.bn(x)
        return self.relu(y if residual is None else y + residual)


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    if ctx.machine.on_gpu:
        shapes = [(32, 64, 112, 112), (64, 256, 56, 56), (128, 512, 28, 28), (256, 1024, 14, 14), (256, 2048, 7, 7)]
        shapes = shapes[:2] if ctx.quick else shapes
        dtypes = [torch.bfloat16, torch.float32]
    else:
        shapes = [(2, 16, 14, 14)] if ctx.quick else [(8, 64, 28, 28), (8, 256, 14, 14)]
        dtypes = [torch.float32]
    return [
        triton.testing.Benchmark(
            x_names=["shape"], x_vals=shapes, line_arg="provider", line_vals=["tfuse", "eager", "compile"],
            line_names=["FusedBatchNormAct2d", "BatchNorm2d + ReLU", "torch.compile"],
            plot_name=f"bn-relu-{dtype}-{residual}", args={"dtype": dtype, "residual": residual},
        )
        for dtype in dtypes
        for residual in (False, True)
    ]


def _measure(ctx: Context, shape: tuple[int, ...], dtype: torch.dtype, residual: bool) -> list[dict[str, Any]]:
    device = ctx.machine.device
    channels = shape[1]
    eager = _EagerBlock(nn.BatchNorm2d(channels)).to(device=device, dtype=dtype)
    fused = FusedBatchNormAct2d.from_batchnorm(copy.deepcopy(eager.bn), act="relu")
    compiled = None
    if ctx.use_compile:
        compiled = ctx.compile_reference(copy.deepcopy(eager))
    x = torch.randn(shape, device=device, dtype=dtype)
    skip = torch.randn(shape, device=device, dtype=dtype) if residual else None
    size = x.numel() * x.element_size()
    backend = "triton" if ctx.machine.on_gpu else "torch"
    rows = []
    for mode in ("eval forward", "train forward", "train forward+backward"):
        training = mode.startswith("train")
        backward = mode.endswith("backward")
        for model in (eager, fused) + ((compiled,) if compiled is not None else ()):
            model.train(training)
        xs = x.detach().requires_grad_(backward)
        dy = torch.randn_like(x) if backward else None
        reads = (1 if not training else 2) + (1 if residual else 0)
        nbytes = (reads + 1) * size + ((3 + 4) * size if backward else 0)

        def run(model):
            def step():
                y = model(xs, skip)
                if backward:
                    y.backward(dy)
                return y
            return step

        row: dict[str, Any] = {
            "mode": mode, "residual": "yes" if residual else "no", "dtype": str(dtype).replace("torch.", ""),
            "shape": "x".join(map(str, shape)), "numel": x.numel(), "mbytes": nbytes / 1e6,
        }
        with tfuse.use_backend(backend):
            if ctx.machine.on_gpu:
                with tfuse.count_launches() as launches:
                    run(fused)()
                row["launches"] = launches.total
        providers = {"tfuse": run(fused), "eager": run(eager)}
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
        with tfuse.use_backend(backend):  # tfuse's path; the eager and compiled blocks do not call tfuse
            timings, copy_nbytes = ctx.measure(providers, nbytes)
        finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
                   ratios={"vs_eager": "eager", "vs_compile": "compile"})
        row["series"] = f"{mode}, residual {row['residual']}, {row['dtype']}"
        rows.append(row)
    return rows


def _interpreted_launches(ctx: Context) -> str | None:
    """Launch counts of the Triton path, counted through the interpreter on a small input (CPU runs)."""
    if ctx.machine.on_gpu or not ctx.machine.interpreted:
        return None
    layer = FusedBatchNormAct2d(8, act="relu")
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    skip = torch.randn(2, 8, 5, 5)
    counts = []
    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward:
            y = layer(x, skip)
        with tfuse.count_launches() as backward:
            y.backward(torch.ones_like(y))
        layer.eval()
        with tfuse.count_launches() as eval_forward:
            layer(x, skip)
    counts.append(f"train forward {forward.total}, train backward {backward.total}, eval forward {eval_forward.total}")
    return counts[0]


def run(ctx: Context) -> Report:
    rows = []
    configs = [config for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for config in configs:
        residual = ", residual" if config["residual"] else ""
        progress.step(f"{'x'.join(map(str, config['shape']))}{residual}, {config['dtype']}")
        rows.extend(_measure(ctx, config["shape"], config["dtype"], config["residual"]))
    on_gpu = ctx.machine.on_gpu
    label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    notes = [
        copy_note(ctx),
        "GB/s = bytes / median time, bytes as in the module docstring: eval reads x (+ residual) and writes y; "
        "training forward reads x twice; backward reads x, dy, y twice and writes dx "
        "(the residual needs no gradient).",
        "Layout NCHW, activation ReLU; eager = nn.BatchNorm2d, then + residual, then nn.ReLU.",
    ]
    counted = _interpreted_launches(ctx)
    if counted:
        notes.append(f"Triton launches, counted through the interpreter: {counted}.")
    if not on_gpu:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path (F.batch_norm + add + activation); "
            "interpreter timings are not performance and are not reported."
        )
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("mode", "mode"), Column("residual", "residual"), Column("dtype", "dtype"), Column("shape", "shape"),
        Column("mbytes", "MB moved", "{:.1f}"), Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True),
        Column("tfuse_gbps", "GB/s", "{:.1f}"), Column("pct_copy", "% of copy BW", "{:.0f}%"),
        Column("launches", "launches"), Column("eager_ms", "eager ms", "{:.4f}", spread=True),
        Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "vs eager", "{:.2f}x"), Column("vs_compile", "vs compile", "{:.2f}x"), CHECK_COLUMN,
    ]
    return Report(
        name=NAME, title="FusedBatchNormAct2d: batch norm (+ residual) + ReLU", notes=notes, columns=columns,
        rows=rows, plot_x="shape", plot_xlabel="shape (N x C x H x W)",
        plot_lines=[("tfuse_gbps", label), ("eager_gbps", "eager"), ("compile_gbps", "torch.compile"),
                    ("copy_gbps", "copy of the same bytes")],
        reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )

"""Benchmark of ``tfuse.nn.FusedLinear`` against ``nn.Linear`` + activation and torch.compile.

The matmul is torch's in all three; what differs is the epilogue (bias +
activation forward, activation derivative + bias gradient backward) and the
memory the layer keeps and allocates.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import triton.testing
from torch import nn

import tfuse
from tfuse.nn import FusedLinear

from .harness import CHECK_COLUMN, Column, Context, Progress, Report, finish_row, grid, saved_for_backward_bytes

NAME = "linear"
TORCH_ACT = {"relu": nn.ReLU, "gelu": nn.GELU}


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    if ctx.machine.on_gpu:
        shapes = [(4096, 1024, 4096), (8192, 4096, 16384), (16384, 4096, 4096)] if not ctx.quick else [(4096, 1024, 4096)]
        dtypes = [torch.bfloat16]
    else:
        shapes = [(512, 256, 1024), (2048, 512, 2048)] if not ctx.quick else [(128, 64, 256)]
        dtypes = [torch.float32]
    return [
        triton.testing.Benchmark(
            x_names=["shape"], x_vals=shapes, line_arg="provider", line_vals=["tfuse", "eager", "compile"],
            line_names=["FusedLinear", "nn.Linear + act", "torch.compile"], plot_name=f"linear-{act}-{dtype}",
            args={"act": act, "dtype": dtype},
        )
        for dtype in dtypes
        for act in ("relu", "gelu")
    ]


def _peak_mb(fn, device: torch.device) -> float | None:
    """Peak memory above the starting point while ``fn`` runs (GPU only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 1e6


def _measure(ctx: Context, act: str, dtype: torch.dtype, shape: tuple[int, int, int]) -> list[dict[str, Any]]:
    device = ctx.machine.device
    tokens, d_in, d_out = shape
    reference = nn.Sequential(nn.Linear(d_in, d_out), TORCH_ACT[act]()).to(device=device, dtype=dtype)
    fused = FusedLinear.from_linear(copy.deepcopy(reference[0]), act=act)
    compiled = None
    if ctx.use_compile:
        compiled = ctx.compile_reference(copy.deepcopy(reference))
    x = torch.randn(tokens, d_in, device=device, dtype=dtype)
    backend = "triton" if ctx.machine.on_gpu else "torch"
    flops = 2 * tokens * d_in * d_out
    rows = []
    for passes in ("forward", "forward+backward"):
        training = passes == "forward+backward"
        xs = x.detach().requires_grad_(training)
        dy = torch.randn(tokens, d_out, device=device, dtype=dtype) if training else None

        def run(model):
            def step():
                y = model(xs)
                if training:
                    y.backward(dy)
                return y
            return step

        row: dict[str, Any] = {
            "act": act, "dtype": str(dtype).replace("torch.", ""), "shape": f"{tokens}x{d_in} -> {d_out}",
            "passes": passes, "numel": tokens * d_out,
        }
        with tfuse.use_backend(backend):
            torch.testing.assert_close(
                fused(xs).float(), reference(xs).float(), rtol=3e-2 if dtype != torch.float32 else 1e-4, atol=3e-2 if dtype != torch.float32 else 1e-4
            )
            row["tfuse_peak_mb"] = _peak_mb(run(fused), device)
            if training:
                row["tfuse_saved_mb"] = saved_for_backward_bytes(lambda: fused(xs), (xs, *fused.parameters()))[0] / 1e6
        row["eager_peak_mb"] = _peak_mb(run(reference), device)
        if training:
            row["eager_saved_mb"] = saved_for_backward_bytes(lambda: reference(xs), (xs, *reference.parameters()))[0] / 1e6
        providers = {"tfuse": run(fused), "eager": run(reference)}
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
        with tfuse.use_backend(backend):  # tfuse's path; nn.Linear and compiled code do not call tfuse
            timings, _ = ctx.measure(providers)  # no byte count: the matmul is compute-bound
        finish_row(row, timings, ctx, ratios={"vs_eager": "eager", "vs_compile": "compile"})
        row["tflops"] = (3 if training else 1) * flops / row["tfuse_ms"] / 1e9
        if "tfuse_ms" in row["flags"]:
            row["flags"]["tflops"] = row["flags"]["tfuse_ms"]
        row["series"] = f"{act}, {row['dtype']}, {passes}"
        rows.append(row)
    return rows


def run(ctx: Context) -> Report:
    rows = []
    configs = [config for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for config in configs:
        tokens, d_in, d_out = config["shape"]
        progress.step(f"{config['act']}, {tokens}x{d_in} -> {d_out}, {config['dtype']}")
        rows.extend(_measure(ctx, config["act"], config["dtype"], config["shape"]))
    on_gpu = ctx.machine.on_gpu
    label = "FusedLinear" if on_gpu else "FusedLinear (PyTorch path)"
    notes = [
        "shape: tokens x in_features -> out_features. TFLOP/s counts the matmul FLOPs (2*T*in*out, x3 with backward).",
        "saved MB: memory autograd keeps beyond the input, the parameters and the output. "
        "peak MB (GPU only): peak allocation above the start during the step.",
        "FusedLinear writes its relu epilogue into the matmul output (one output tensor, not two); "
        "for gelu it keeps the matmul output for backward, as torch keeps x W^T + b.",
        "A Triton matmul with the epilogue fused was not tried: that choice needs GPU measurements.",
    ]
    if not on_gpu:
        notes.append("CPU run: FusedLinear's epilogue runs on tfuse's PyTorch path; not a measure of the GPU kernels.")
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("act", "act"), Column("dtype", "dtype"), Column("shape", "shape"), Column("passes", "passes"),
        Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True), Column("tflops", "TFLOP/s", "{:.2f}"),
        Column("eager_ms", "Linear + act ms", "{:.4f}", spread=True), Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "vs Linear + act", "{:.2f}x"), Column("vs_compile", "vs compile", "{:.2f}x"),
        Column("tfuse_saved_mb", "saved MB", "{:.2f}"), Column("eager_saved_mb", "Linear + act saved MB", "{:.2f}"),
        Column("tfuse_peak_mb", "peak MB", "{:.1f}"), Column("eager_peak_mb", "Linear + act peak MB", "{:.1f}"),
        CHECK_COLUMN,
    ]
    return Report(
        name=NAME, title="tfuse.nn.FusedLinear: Linear + activation with a fused epilogue", notes=notes,
        columns=columns, rows=rows, plot_lines=[("tfuse_ms", label), ("eager_ms", "nn.Linear + act"), ("compile_ms", "torch.compile")],
        plot_ylabel="ms (lower is better)", plot_xlabel="output elements",
    )

"""Benchmark of ``tfuse.add_act`` (bias/residual add + activation) against eager and torch.compile.

Minimum bytes: forward reads x and the bias and writes y; backward reads dy
and what the derivative needs (y, or x to recompute z) and writes dx (the
bias gradient is small). Eager ``act(x + b)`` also writes and re-reads the
sum, and backward does the activation derivative and the bias reduction as
separate passes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

import tfuse

from .harness import (
    CHECK_COLUMN, RATIO_SLACK, Column, Context, Progress, Report, copy_note, finish_row, grid, saved_for_backward_bytes,
)

NAME = "add_act"
INTERPRETER_MAX_ELEMENTS = 1 << 20

TORCH_ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    if ctx.machine.on_gpu:
        mlp = [(4096, 4096), (8192, 8192), (16384, 16384)] if not ctx.quick else [(4096, 4096)]
        # 14x14 and 7x7 pixels per channel are not multiples of 16: the wide-column path (tfuse/ops/_tiles.py).
        cnn = [(32, 256, 56, 56), (64, 512, 28, 28), (128, 256, 56, 56), (256, 1024, 14, 14), (256, 2048, 7, 7)]
        cnn = cnn if not ctx.quick else [(32, 256, 56, 56)]
        dtypes = [torch.bfloat16, torch.float32]
    else:
        mlp = [(512, 1024), (2048, 2048)] if not ctx.quick else [(128, 256)]
        cnn = [(8, 64, 28, 28), (8, 128, 7, 7)] if not ctx.quick else [(2, 16, 14, 14)]
        dtypes = [torch.float32]
    acts = ["relu", "gelu"]
    benches = []
    for dtype in dtypes:
        for act in acts:
            for pattern, shapes in (("bias [T, H] + [H]", mlp), ("per-channel [N, C, H, W] + [C, 1, 1]", cnn)):
                benches.append(
                    triton.testing.Benchmark(
                        x_names=["shape"], x_vals=list(shapes), line_arg="provider",
                        line_vals=["tfuse", "eager", "compile"], line_names=["tfuse", "eager", "torch.compile"],
                        plot_name=f"{pattern}-{act}-{dtype}", args={"pattern": pattern, "act": act, "dtype": dtype},
                    )
                )
    return benches


def _inputs(pattern: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(shape, device=device, dtype=dtype)
    bias_shape = (shape[-1],) if pattern.startswith("bias") else (shape[1], 1, 1)
    return x, torch.randn(bias_shape, device=device, dtype=dtype)


def _measure(ctx: Context, pattern: str, act: str, dtype: torch.dtype, shape: tuple[int, ...]) -> list[dict[str, Any]]:
    device = ctx.machine.device
    x, bias = _inputs(pattern, shape, dtype, device)
    size = x.numel() * x.element_size()
    backend = "triton" if ctx.machine.on_gpu else "torch"
    torch_act = TORCH_ACT[act]

    def eager(a, b):
        return torch_act(a + b)

    def fused(a, b):
        return tfuse.add_act(a, b, act=act)

    compiled = None
    if ctx.use_compile:
        compiled = ctx.compile_reference(eager)

    rows = []
    for passes in ("forward", "forward+backward"):
        training = passes == "forward+backward"
        xs = x.detach().requires_grad_(training)
        bs = bias.detach().requires_grad_(training)
        dy = torch.randn_like(x) if training else None
        nbytes = 2 * size + bias.numel() * bias.element_size() + (3 * size if training else 0)

        def run(fn):
            def step():
                y = fn(xs, bs)
                if training:
                    torch.autograd.grad(y, (xs, bs), dy)
                return y
            return step

        with tfuse.use_backend(backend):
            _check(fused(xs, bs), eager(xs, bs), dtype)
            if training:
                tfuse_saved = saved_for_backward_bytes(lambda: fused(xs, bs), (xs, bs))[0]
        row: dict[str, Any] = {
            "pattern": pattern, "act": act, "dtype": str(dtype).replace("torch.", ""),
            "shape": "x".join(map(str, shape)), "numel": x.numel(), "passes": passes, "mbytes": nbytes / 1e6,
        }
        if training:
            row["tfuse_saved_mb"] = tfuse_saved / 1e6
            row["eager_saved_mb"] = saved_for_backward_bytes(lambda: eager(xs, bs), (xs, bs))[0] / 1e6
        row["launches"] = _launches(ctx, fused, xs, bs, dy)
        providers = {"tfuse": run(fused), "eager": run(eager)}
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
            if training:
                row["compile_saved_mb"] = saved_for_backward_bytes(lambda: compiled(xs, bs), (xs, bs))[0] / 1e6
        with tfuse.use_backend(backend):  # tfuse's path; eager and compiled code do not call tfuse
            timings, copy_nbytes = ctx.measure(providers, nbytes)
        # Eager act(x + b) writes and re-reads the sum (4 passes forward against 2) in as many launches;
        # backward adds the derivative and the bias reduction as separate passes. At most 2x either way.
        finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
                   ratios={"vs_eager": "eager", "vs_compile": "compile"}, ratio_bounds={"vs_eager": RATIO_SLACK * 2})
        row["series"] = f"{pattern.split(' ')[0]}, {act}, {row['dtype']}, {passes}"
        rows.append(row)
    return rows


def _check(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """A benchmark of a wrong result means nothing."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(result.float(), expected.float(), rtol=tolerance, atol=tolerance)


def _launches(ctx: Context, fused, x, bias, dy) -> str | None:
    """Triton launches of forward (and backward), e.g. '1 + 2'."""
    if not ctx.machine.on_gpu and not (ctx.machine.interpreted and x.numel() <= INTERPRETER_MAX_ELEMENTS):
        return None
    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward:
            y = fused(x, bias)
        if dy is None:
            return str(forward.total)
        with tfuse.count_launches() as backward:
            torch.autograd.grad(y, (x, bias), dy)
    return f"{forward.total} + {backward.total}"


def run(ctx: Context) -> Report:
    rows = []
    configs = [config for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for config in configs:
        progress.step(f"{config['pattern']}, {config['act']}, {'x'.join(map(str, config['shape']))}, {config['dtype']}")
        rows.extend(_measure(ctx, config["pattern"], config["act"], config["dtype"], config["shape"]))
    on_gpu = ctx.machine.on_gpu
    label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    notes = [
        copy_note(ctx),
        "GB/s = minimum bytes / median time. Forward: x and bias read, y written. "
        "Forward+backward adds dy and the saved tensor read and dx written (5 x-sized passes in all).",
        "launches: Triton launches of tfuse (forward + backward). saved MB: memory autograd keeps for "
        "backward beyond the inputs and the output (eager keeps x + b for gelu; tfuse recomputes it).",
        f"A speed-up over eager above {2 * RATIO_SLACK:g}x is marked implausible: eager moves at most twice the "
        "bytes in at most twice the launches.",
    ]
    if not on_gpu:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path; the Triton kernels ran through the interpreter "
            "only for launch counts (small sizes). Interpreter timings are not performance and are not reported."
        )
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("pattern", "pattern"), Column("act", "act"), Column("dtype", "dtype"), Column("shape", "shape"),
        Column("passes", "passes"), Column("mbytes", "MB moved", "{:.1f}"),
        Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True), Column("tfuse_gbps", "GB/s", "{:.1f}"),
        Column("pct_copy", "% of copy BW", "{:.0f}%"), Column("launches", "launches"),
        Column("eager_ms", "eager ms", "{:.4f}", spread=True), Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "vs eager", "{:.2f}x"), Column("vs_compile", "vs compile", "{:.2f}x"),
        Column("tfuse_saved_mb", "tfuse saved MB", "{:.2f}"), Column("eager_saved_mb", "eager saved MB", "{:.2f}"),
        Column("compile_saved_mb", "compile saved MB", "{:.2f}"), CHECK_COLUMN,
    ]
    return Report(
        name=NAME, title="tfuse.add_act: fused bias/residual add + activation", notes=notes, columns=columns,
        rows=rows, plot_lines=[("tfuse_gbps", label), ("eager_gbps", "eager"), ("compile_gbps", "torch.compile"),
                               ("copy_gbps", "copy of the same bytes")],
        reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )

"""Benchmark of ``tfuse.add`` (the seeds' add3 fusion) against eager and torch.compile.

Bytes moved are counted as the op's minimum: every input read once and the
output written once. Eager ``a + b + c`` moves more (it writes and re-reads
the intermediate ``a + b``); its GB/s here is the same byte count over its
own time, so the columns compare times on one scale.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.testing

import tfuse

from .harness import CHECK_COLUMN, RATIO_SLACK, Column, Context, Progress, Report, copy_note, count_aten_ops, finish_row, grid

NAME = "add"

# Largest size whose Triton path is also run through the interpreter on a CPU
# (for the launch count and a value check; never timed).
INTERPRETER_MAX_ELEMENTS = 1 << 20
BIAS_WIDTH = 1024  # channels of the [N, C] + [C] + [N, C] pattern


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    on_gpu = ctx.machine.on_gpu
    if ctx.quick:
        # On a CPU the Triton path runs through the interpreter (~50 ms a program): a smoke run stays small.
        sizes = [20_000] if not on_gpu else [100_000, 10_000_000]
    elif on_gpu:
        sizes = [100_000, 300_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000]
    else:
        sizes = [10_000, 100_000, 1_000_000, 4_000_000]
    dtypes = [torch.float32, torch.bfloat16] if on_gpu else [torch.float32]
    sweep_size = (10_000_000 if on_gpu else 1_000_000) if not ctx.quick else (100_000 if on_gpu else 20_000)
    lines = dict(line_arg="provider", line_vals=["tfuse", "eager", "compile"], line_names=["tfuse", "eager", "torch.compile"])
    benches = [
        triton.testing.Benchmark(
            x_names=["numel"], x_vals=sizes, plot_name=f"add3-{dtype}", args={"pattern": "same", "n_inputs": 3, "dtype": dtype}, **lines
        )
        for dtype in dtypes
    ]
    benches.append(
        triton.testing.Benchmark(
            x_names=["numel"], x_vals=sizes, plot_name="bias-residual", args={"pattern": "bias", "n_inputs": 3, "dtype": dtypes[-1]}, **lines
        )
    )
    # Per-channel bias + residual over 14x14 and 7x7 pixels (not multiples of 16:
    # the wide-column path of tfuse/ops/_tiles.py), from a few MB to ResNet-50 batch 256.
    batches = ([16, 64, 256] if on_gpu else [4, 16]) if not ctx.quick else [1]
    # A CPU smoke run checks the same wide-column path through the interpreter with fewer channels.
    shapes = ((64, 14), (128, 7)) if ctx.quick and not on_gpu else ((1024, 14), (2048, 7))
    for channels, pixels in shapes:
        benches.append(
            triton.testing.Benchmark(
                x_names=["numel"], x_vals=[n * channels * pixels * pixels for n in batches],
                plot_name=f"per-channel-{pixels}x{pixels}", args={"pattern": f"nchw-{channels}-{pixels}", "n_inputs": 3, "dtype": dtypes[-1]}, **lines
            )
        )
    benches.append(
        triton.testing.Benchmark(
            x_names=["n_inputs"], x_vals=[2, 4, 8], plot_name="inputs", args={"pattern": "same", "numel": sweep_size, "dtype": dtypes[0]}, **lines
        )
    )
    return benches


def _make_inputs(pattern: str, n_inputs: int, numel: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    if pattern == "same":
        return [torch.randn(numel, device=device, dtype=dtype) for _ in range(n_inputs)]
    if pattern.startswith("nchw"):
        _, channels, pixels = pattern.split("-")
        channels, pixels = int(channels), int(pixels)
        x = torch.randn(max(numel // (channels * pixels * pixels), 1), channels, pixels, pixels, device=device, dtype=dtype)
        bias = torch.randn(channels, 1, 1, device=device, dtype=dtype)
        return [x, bias] + [torch.randn_like(x) for _ in range(n_inputs - 2)]
    rows = max(numel // BIAS_WIDTH, 1)
    x = torch.randn(rows, BIAS_WIDTH, device=device, dtype=dtype)
    bias = torch.randn(BIAS_WIDTH, device=device, dtype=dtype)
    return [x, bias] + [torch.randn_like(x) for _ in range(n_inputs - 2)]


def _eager_sum(*tensors: torch.Tensor) -> torch.Tensor:
    out = tensors[0] + tensors[1]
    for tensor in tensors[2:]:
        out = out + tensor
    return out


def _check(result: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """A benchmark of a wrong result means nothing: compare with float64 first."""
    exact = _eager_sum(*(t.double() for t in inputs))
    scale = sum(t.double().abs() for t in inputs)
    tolerance = len(inputs) * torch.finfo(result.dtype).eps * scale + 1e-30
    if not ((result.double() - exact).abs() <= tolerance).all():
        raise AssertionError("tfuse.add disagrees with the float64 sum; not benchmarking a wrong result")


def _pattern_name(pattern: str, n_inputs: int, x: torch.Tensor) -> str:
    if pattern == "same":
        return "a + b + c" if n_inputs == 3 else f"{n_inputs} inputs"
    if pattern == "bias":
        return "x + bias[C] + residual"
    return f"x + bias[C, 1, 1] + residual, C={x.shape[1]} {x.shape[2]}x{x.shape[3]}"


def _measure(ctx: Context, pattern: str, n_inputs: int, numel: int, dtype: torch.dtype) -> dict[str, Any]:
    device = ctx.machine.device
    inputs = _make_inputs(pattern, n_inputs, numel, dtype, device)
    out_numel = inputs[0].numel()
    nbytes = sum(t.numel() * t.element_size() for t in inputs) + out_numel * inputs[0].element_size()
    # On a GPU tfuse runs its Triton kernel; on a CPU its PyTorch path (the
    # interpreted kernel is checked below, never timed).
    backend = "triton" if ctx.machine.on_gpu else "torch"

    def fused() -> torch.Tensor:
        return tfuse.add(*inputs)

    with tfuse.use_backend(backend):
        _check(fused(), inputs)
    row: dict[str, Any] = {
        "pattern": _pattern_name(pattern, n_inputs, inputs[0]),
        "dtype": str(dtype).replace("torch.", ""),
        "n_inputs": n_inputs,
        "numel": out_numel,
        "mbytes": nbytes / 1e6,
    }
    launches = None
    if ctx.machine.on_gpu:
        with tfuse.use_backend(backend), tfuse.count_launches() as counted:
            fused()
        launches = counted.total
    elif ctx.machine.interpreted and out_numel <= INTERPRETER_MAX_ELEMENTS:
        with tfuse.use_backend("triton"), tfuse.count_launches() as counted:
            interpreted = tfuse.add(*inputs)
        _check(interpreted, inputs)
        launches = counted.total
    row["launches"] = launches
    row["eager_ops"] = count_aten_ops(lambda: _eager_sum(*inputs))

    def eager() -> torch.Tensor:
        return _eager_sum(*inputs)

    providers = {"tfuse": fused, "eager": eager}
    if ctx.use_compile:
        compiled = ctx.compile_reference(_eager_sum)
        compiled(*inputs)
        providers["compile"] = lambda: compiled(*inputs)
    with tfuse.use_backend(backend):  # tfuse's path; eager and compiled code do not call tfuse
        timings, copy_nbytes = ctx.measure(providers, nbytes)
    finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
               ratios={"vs_eager": "eager", "vs_compile": "compile"},
               ratio_bounds={"vs_eager": _max_speedup(pattern, n_inputs, row["eager_ops"], launches)})
    return row


def _max_speedup(pattern: str, n_inputs: int, eager_ops: int, launches: int | None) -> float:
    """The largest speed-up over eager the traffic or the launch count allows, with RATIO_SLACK on top.

    Eager adds two operands per op, writing an intermediate that the next op
    reads: 3 tensor passes per op where a full-size tensor is added ("same"),
    against n + 1 passes (n inputs read, one output written) for the fused
    op; a broadcast bias adds next to no traffic. A launch-bound size can gain
    at most the ratio of launches.
    """
    if pattern == "same":
        traffic = 3 * (n_inputs - 1) / (n_inputs + 1)
    else:  # x + bias + residuals: the bias op reads x and writes t; each residual op reads 2, writes 1
        full = n_inputs - 1  # full-size inputs
        traffic = (2 + 3 * (n_inputs - 2)) / (full + 1)
    return RATIO_SLACK * max(traffic, eager_ops / max(launches or 1, 1))


def run(ctx: Context) -> Report:
    rows = []
    configs = [(bench, config) for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for bench, config in configs:
        progress.step(f"{config['pattern']}, {config['n_inputs']} inputs, {config['numel']:,} elements, {config['dtype']}")
        row = _measure(ctx, config["pattern"], config["n_inputs"], config["numel"], config["dtype"])
        row["series"] = f"{row['pattern']}, {row['dtype']}"
        row["plot"] = bench.x_names == ["numel"]
        rows.append(row)

    on_gpu = ctx.machine.on_gpu
    tfuse_label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    notes = [
        copy_note(ctx),
        "GB/s = minimum bytes (inputs read once, output written once) / median time; "
        "the same byte count is used for every column.",
        "launches: Triton kernel launches of one tfuse.add call (tfuse.count_launches); "
        "eager ops: ATen operators of the eager expression (one kernel and one intermediate each, but the last).",
        f"A speed-up over eager above {RATIO_SLACK:g}x the traffic ratio (eager's passes over the fused op's) or "
        "the launch ratio is marked implausible.",
    ]
    if not on_gpu:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path. Triton kernels run here only through "
            "Triton's interpreter, which checked the values and counted the launches below; "
            "interpreter timings are not performance and are not reported."
        )
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("pattern", "pattern"),
        Column("dtype", "dtype"),
        Column("numel", "elements", "{:,}"),
        Column("mbytes", "MB moved", "{:.2f}"),
        Column("tfuse_ms", f"{tfuse_label} ms", "{:.4f}", spread=True),
        Column("tfuse_gbps", f"{tfuse_label} GB/s", "{:.1f}"),
        Column("pct_copy", "% of copy BW", "{:.0f}%"),
        Column("launches", "launches", "{}"),
        Column("eager_ms", "eager ms", "{:.4f}", spread=True),
        Column("eager_ops", "eager ops", "{}"),
        Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "speed-up vs eager", "{:.2f}x"),
        Column("vs_compile", "speed-up vs compile", "{:.2f}x"),
        CHECK_COLUMN,
    ]
    return Report(
        name=NAME,
        title="tfuse.add: N-ary fused add",
        notes=notes,
        columns=columns,
        rows=rows,
        plot_lines=[("tfuse_gbps", tfuse_label), ("eager_gbps", "eager"), ("compile_gbps", "torch.compile"),
                    ("copy_gbps", "copy of the same bytes")],
        reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )


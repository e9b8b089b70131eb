"""Benchmark of ``tfuse.functional.relu_depthwise_conv2d`` against act + ``F.conv2d(groups=C)`` and torch.compile.

Shapes are depthwise convolutions of MobileNetV2 (3x3, ReLU6 before each)
and of EfficientNet-B0 (its 5x5 ones, SiLU before each) at a 224x224 input,
run as their users run them on a GPU: bfloat16/float16, channels_last or
NCHW; on a CPU much smaller, float32.

Minimum bytes (e: element size; X, Y, K: elements of x, y and the weight):
forward reads x and w once and writes y, ``(X + K + Y) e``; forward+backward
adds reading gy, writing dx, reading x again (for dw and act'(x)), reading w
and writing dw, ``(3X + 2Y + 3K) e``. The Triton path moves more than that in
backward: its dx kernel and its dw kernel each read gy and x.

Memory: the bytes autograd keeps for backward per activation + convolution
pair, counted with ``torch.autograd.graph.saved_tensors_hooks`` as distinct
storages, the weight and the pair's output not counted (they exist anyway),
x counted (it is the previous layer's output, freed when nothing keeps it).
tfuse keeps x; eager keeps what its activation's backward needs (relu: its
output; relu6, silu: their input, cloned first when in place) and act(x) for
the convolution's weight gradient.

On a GPU the tfuse column is the dispatched call (``depthwise_backend``:
Triton, or eager + cuDNN for the shape classes of ``EAGER_SHAPE_CLASSES``);
the Triton column forces the Triton kernels, and per shape class the run says
which path the rule chose and whether the Triton kernels lost to eager there.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

import tfuse
from tfuse.ops import depthwise

from .harness import (
    CHECK_COLUMN, Column, Context, Flag, Progress, Report, check_ratio, copy_note, finish_row, grid,
    saved_for_backward_bytes, worse_flag,
)

NAME = "depthwise"
TORCH_ACT = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu}
#: Launch counts on a CPU: the interpreter runs the row's kernel, stride, activation and layout on this input.
INTERPRETER_SHAPE = (1, 8, 10, 10)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One depthwise convolution of a network: channels, input height = width, kernel, stride, activation."""

    net: str
    channels: int
    size: int
    kernel: int
    stride: int
    act: str

    @property
    def label(self) -> str:
        return f"{self.channels}x{self.size}x{self.size} k{self.kernel} s{self.stride}"


#: MobileNetV2's depthwise convolutions, one per (size, stride) (7x7 to 112x112: every spatial shape class).
MOBILENET_V2 = [
    Layer("MobileNetV2", c, hw, 3, s, "relu6")
    for c, hw, s in ((32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2),
                     (384, 14, 1), (576, 14, 2), (960, 7, 1))
]
#: EfficientNet-B0's 5x5 depthwise convolutions.
EFFICIENTNET_B0 = [
    Layer("EfficientNet-B0", c, hw, 5, s, "silu")
    for c, hw, s in ((144, 56, 2), (240, 28, 1), (672, 14, 1), (672, 14, 2), (1152, 7, 1))
]


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    small = dataclasses.replace
    if ctx.machine.on_gpu:
        batch = 64 if ctx.quick else 128
        layers = [MOBILENET_V2[0], MOBILENET_V2[5], EFFICIENTNET_B0[2]] if ctx.quick else MOBILENET_V2 + EFFICIENTNET_B0
        # Mixed-precision MobileNet/EfficientNet training runs channels_last; NCHW is PyTorch's default layout.
        # float16 NCHW and float32 are not measured: their shape classes stay on Triton.
        formats = [(torch.bfloat16, True)] if ctx.quick else [
            (torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)]
        by_format = [(dtype, channels_last, layers) for dtype, channels_last in formats]
    elif ctx.quick:
        batch = 2
        by_format = [
            (torch.float32, False, [small(MOBILENET_V2[6], channels=16, act="relu")]),  # 16x14x14 3x3 s1, relu
            (torch.float32, True, [small(EFFICIENTNET_B0[3], channels=16)]),  # 16x14x14 5x5 s2, silu
        ]
    else:
        batch = 8
        by_format = [
            (torch.float32, False, [
                small(MOBILENET_V2[2], channels=32),  # 32x56x56 3x3 s1, relu6
                small(MOBILENET_V2[4], act="relu"),  # 192x28x28 3x3 s1, relu: the op's namesake
            ]),
            (torch.float32, True, [
                small(EFFICIENTNET_B0[0], size=28),  # 144x28x28 5x5 s2, silu
                small(MOBILENET_V2[7], channels=384),  # 384x14x14 3x3 s2, relu6
            ]),
        ]
    return [
        triton.testing.Benchmark(
            x_names=["layer"], x_vals=layers, line_arg="provider", line_vals=["tfuse", "triton", "eager", "compile"],
            line_names=["tfuse", "Triton kernels", "act + F.conv2d", "torch.compile"],
            plot_name=f"depthwise-{dtype}-{'cl' if channels_last else 'nchw'}",
            args={"batch": batch, "dtype": dtype, "channels_last": channels_last},
        )
        for dtype, channels_last, layers in by_format
    ]


def _output_size(size: int, layer: Layer) -> int:
    return (size + 2 * (layer.kernel // 2) - layer.kernel) // layer.stride + 1


def min_bytes(batch: int, layer: Layer, element_size: int, backward: bool) -> int:
    """The bytes the op must move at least (module docstring): forward (X + K + Y) e, with backward (3X + 2Y + 3K) e."""
    x = batch * layer.channels * layer.size**2
    y = batch * layer.channels * _output_size(layer.size, layer) ** 2
    k = layer.channels * layer.kernel**2
    return ((3 * x + 2 * y + 3 * k) if backward else (x + y + k)) * element_size


def _inputs(shape: tuple[int, ...], layer: Layer, dtype: torch.dtype, channels_last: bool, device: torch.device):
    x = torch.randn(shape, device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    weight = torch.randn(shape[1], 1, layer.kernel, layer.kernel, device=device, dtype=dtype) / layer.kernel
    return x, weight


def _pair(layer: Layer, channels: int, inplace: bool = False):
    """Eager act + depthwise F.conv2d (the activation in place when ``inplace``)."""
    act = TORCH_ACT[layer.act]
    padding = layer.kernel // 2

    def eager(x, w):
        a = act(x, inplace=True) if inplace else act(x)
        return F.conv2d(a, w, None, layer.stride, padding, 1, channels)

    return eager


def _fused(layer: Layer):
    def fused(x, w):
        return tfuse.functional.relu_depthwise_conv2d(x, w, stride=layer.stride, padding=layer.kernel // 2,
                                                      act_in=layer.act)
    return fused


def _forced_triton(fn):
    def forced(x, w):
        with tfuse.use_backend("triton"):
            return fn(x, w)
    return forced


def _check(name: str, result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """A benchmark of a wrong result means nothing: relative to the largest value (dw sums N*H*W products)."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]
    scale = expected.float().abs().max().item() or 1.0
    torch.testing.assert_close(result.float(), expected.float(), rtol=tolerance, atol=tolerance * scale,
                               msg=lambda m: f"{name}: {m}")


def _check_call(fn, reference, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, backward: bool, what: str) -> None:
    xs, ws = (t.detach().requires_grad_(backward) for t in (x, w))
    y, expected = fn(xs, ws), reference(xs, ws)
    _check(f"{what} y", y, expected, dtype)
    if backward:
        gy = torch.randn_like(y)
        got, want = torch.autograd.grad(y, (xs, ws), gy), torch.autograd.grad(expected, (xs, ws), gy)
        for name, a, b in zip(("dx", "dw"), got, want):
            _check(f"{what} {name}", a, b, dtype)


def _launches(ctx: Context, layer: Layer, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
              channels_last: bool, backward: bool) -> str | None:
    """Triton launches of forward (+ backward), e.g. '1 + 2'; on a CPU through the interpreter on a small input,
    whose values are checked against eager on the way."""
    if not ctx.machine.on_gpu:
        if not ctx.machine.interpreted:
            return None
        x, w = _inputs(INTERPRETER_SHAPE, layer, dtype, channels_last, x.device)
    xs, ws = (t.detach().requires_grad_(backward) for t in (x, w))
    fused = _fused(layer)
    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward:
            y = fused(xs, ws)
        if not ctx.machine.on_gpu:
            _check_call(fused, _pair(layer, x.shape[1]), x, w, dtype, backward, "interpreted Triton")
        if not backward:
            return str(forward.total)
        with tfuse.count_launches() as grads:
            torch.autograd.grad(y, (xs, ws), torch.randn_like(y))
    return f"{forward.total} + {grads.total}"


def _kept_mb(fn, x: torch.Tensor, w: torch.Tensor) -> float:
    """MB autograd keeps for backward while ``fn(x, w)`` runs: x counted, the weight and the output not."""
    return saved_for_backward_bytes(lambda: fn(x, w), (w,))[0] / 1e6


def _measure(ctx: Context, layer: Layer, batch: int, dtype: torch.dtype, channels_last: bool) -> list[dict[str, Any]]:
    device = ctx.machine.device
    on_gpu = ctx.machine.on_gpu
    shape = (batch, layer.channels, layer.size, layer.size)
    x, w = _inputs(shape, layer, dtype, channels_last, device)
    kernel, stride = (layer.kernel, layer.kernel), (layer.stride, layer.stride)
    eager = _pair(layer, layer.channels)
    fused = _fused(layer)
    triton_fused = _forced_triton(fused)
    compiled = None
    if ctx.use_compile:
        compiled = ctx.compile_reference(_pair(layer, layer.channels))
    # tfuse's own path on a CPU (without the interpreter); on a GPU the dispatch rule's choice.
    path_backend = "auto" if on_gpu else "torch"
    with tfuse.use_backend(path_backend):
        path = depthwise.depthwise_backend(x, kernel, stride).value
    rows = []
    for passes in ("forward", "forward+backward"):
        training = passes == "forward+backward"
        xs, ws = (t.detach().requires_grad_(training) for t in (x, w))
        gy = torch.randn_like(eager(xs, ws)) if training else None
        nbytes = min_bytes(batch, layer, x.element_size(), training)

        def run(fn, xs=xs, ws=ws, gy=gy):
            def step():
                y = fn(xs, ws)
                if gy is not None:
                    torch.autograd.grad(y, (xs, ws), gy)
                return y
            return step

        row: dict[str, Any] = {
            "net": layer.net, "act": layer.act, "dtype": str(dtype).replace("torch.", ""),
            "layout": "channels_last" if channels_last else "NCHW", "layer": layer.label,
            "shape": "x".join(map(str, shape)), "passes": passes, "mbytes": nbytes / 1e6, "path": path,
            "shape_class": depthwise.shape_class(x, kernel, stride),
        }
        with tfuse.use_backend(path_backend):
            _check_call(fused, eager, x, w, dtype, training, "tfuse")
            if training:
                row["x_mb"] = x.numel() * x.element_size() / 1e6
                row["tfuse_saved_mb"] = _kept_mb(fused, xs, ws)
        if on_gpu:
            _check_call(triton_fused, eager, x, w, dtype, training, "Triton kernels")
        if training:
            row["eager_saved_mb"] = _kept_mb(eager, xs, ws)
            # In place needs a non-leaf input, as the batch norm output before it is: a clone of x.
            row["inplace_saved_mb"] = _kept_mb(_pair(layer, layer.channels, inplace=True), xs.clone(), ws)
        row["launches"] = _launches(ctx, layer, x, w, dtype, channels_last, training)
        providers = {"tfuse": run(fused)}
        if on_gpu:
            providers["triton"] = run(triton_fused)
        providers["eager"] = run(eager)
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
            if training:
                row["compile_saved_mb"] = _kept_mb(compiled, xs, ws)
        with tfuse.use_backend(path_backend):  # eager and compiled code do not call tfuse; "triton" forces its own
            timings, copy_nbytes = ctx.measure(providers, nbytes)
        # No bound on the speed-ups: cuDNN's depthwise kernels are not bandwidth-bound everywhere, so the bytes
        # do not cap how much faster another kernel can be.
        finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
                   ratios={"vs_eager": "eager", "vs_compile": "compile"})
        if "triton" in timings:
            value = timings["eager"].median / timings["triton"].median
            row["triton_vs_eager"] = value
            flag = worse_flag(worse_flag(row["flags"].get("triton_ms"), row["flags"].get("eager_ms")),
                              check_ratio("triton_vs_eager", value, None))
            if flag is not None:
                row["flags"]["triton_vs_eager"] = flag
        row["series"] = f"{passes}, {row['dtype']}, {row['layout']}"
        rows.append(row)
    return rows


def class_verdicts(rows: list[dict[str, Any]]) -> list[tuple[tuple, str, str]]:
    """Per shape class of the forward+backward rows with a Triton timing: (class, path chosen, verdict).

    A class belongs in ``EAGER_SHAPE_CLASSES`` when the Triton kernels were slower than eager in every
    measured row of it (numbers without a mark only); a mixed or marked class is said to be so.
    """
    by_class: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["passes"] == "forward+backward" and row.get("triton_vs_eager") is not None:
            by_class[row["shape_class"]].append(row)
    verdicts = []
    for key, members in by_class.items():
        paths = "/".join(sorted({row["path"] for row in members}))
        ratios = ", ".join(f"{row['layer']} {row['triton_vs_eager']:.2f}x" for row in members)
        if any(isinstance(row["flags"].get("triton_vs_eager"), Flag) for row in members):
            verdict = f"not decided: a marked timing ({ratios})"
        elif all(row["triton_vs_eager"] < 1 for row in members):
            verdict = f"Triton slower than eager ({ratios}): belongs in EAGER_SHAPE_CLASSES"
            if key in depthwise.EAGER_SHAPE_CLASSES:
                verdict = f"Triton slower than eager ({ratios}): in EAGER_SHAPE_CLASSES, as it should be"
        elif any(row["triton_vs_eager"] < 1 for row in members):
            verdict = f"mixed ({ratios}): Triton faster in some rows, keep it off EAGER_SHAPE_CLASSES"
        else:
            verdict = f"Triton faster than eager ({ratios})"
            if key in depthwise.EAGER_SHAPE_CLASSES:
                verdict += ": in EAGER_SHAPE_CLASSES, but should come out of it"
        verdicts.append((key, paths, verdict))
    return verdicts


def _class_text(key: tuple) -> str:
    kernel, stride, channels_last, dtype, spatial = key
    return (f"{kernel[0]}x{kernel[1]} stride {stride[0]}, {'channels_last' if channels_last else 'NCHW'}, "
            f"{str(dtype).replace('torch.', '')}, H*W <= {spatial}")


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
        "GB/s = minimum bytes / median time (e: element size; X, Y, K: elements of x, y and the weight). "
        "Forward: x and w read once, y written, (X + K + Y) e. Forward+backward adds gy read, dx written, x read "
        "again (for dw and act'(x)), w read and dw written: (3X + 2Y + 3K) e. The Triton path moves more in "
        "backward (its dx and dw kernels each read gy and x), so its GB/s is under what its kernels move.",
        "Layers: depthwise convolutions of MobileNetV2 (3x3, ReLU6 before them) and EfficientNet-B0 (5x5, SiLU), "
        "padding k // 2, no bias (batch norm follows them); layer = C x H x W, kernel, stride. eager = the activation "
        "(out of place) then F.conv2d(groups=C); torch.compile compiles that pair (dynamic=False).",
        "launches: Triton launches of tfuse's Triton path, forward + backward (dx, then dw/db in one launch).",
        "kept MB: what autograd keeps for backward per activation + convolution pair (saved_tensors_hooks, distinct "
        "storages; the weight and the output not counted, x counted: it is the previous layer's output, freed when "
        "nothing keeps it). x MB is one x-sized tensor. tfuse keeps x alone. Eager relu keeps only its output, which "
        "the convolution keeps too: one x-sized tensor, the same as tfuse. relu6 (hardtanh) and silu keep their "
        "input and the convolution their output: two; in place (a clone of x as input, as a batch norm output "
        "would be) autograd clones the input first for them, still two, and relu in place keeps one.",
    ]
    counted = sorted({row["launches"] for row in rows if row["launches"] and row["passes"] == "forward+backward"})
    if not on_gpu and counted:
        notes.append(
            f"Triton launches counted through the interpreter on a {'x'.join(map(str, INTERPRETER_SHAPE))} input of "
            f"the row's kernel, stride, activation and layout (values checked against eager): {', '.join(counted)}."
        )
    if on_gpu:
        notes.append(
            "path: what the dispatch rule (tfuse.ops.depthwise.depthwise_backend) chose for the row; the tfuse column "
            "times that dispatched call, the Triton column the Triton kernels forced (tfuse.use_backend('triton')).")
        verdicts = class_verdicts(rows)
        for key, paths, verdict in verdicts:
            notes.append(f"Shape class {key!r} ({_class_text(key)}): dispatch chose {paths}; {verdict}.")
        slower = sorted((key for key, _, verdict in verdicts if verdict.endswith("belongs in EAGER_SHAPE_CLASSES")),
                        key=repr)
        listed = ", ".join(repr(key) for key in slower)
        notes.append(
            "EAGER_SHAPE_CLASSES from this run (classes where the Triton kernels lost to eager in forward+backward; "
            f"classes not measured here stay on Triton): frozenset({{{listed}}})." if slower else
            "EAGER_SHAPE_CLASSES from this run: none (the Triton kernels beat eager, or tied, in every measured "
            "class).")
        print("\n".join(note for note in notes if note.startswith(("Shape class", "EAGER_SHAPE_CLASSES"))))
    else:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path (torch's activation and conv2d, the activation "
            "freed after forward and recomputed in backward: one more elementwise pass than eager); the Triton kernels "
            "ran through the interpreter only for launch counts and values. Interpreter timings are not performance "
            "and are not reported, and the dispatch rule's per-class verdicts need a GPU run."
        )
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    columns = [
        Column("act", "act"), Column("dtype", "dtype"), Column("layout", "layout"), Column("layer", "layer"),
        Column("passes", "passes"), Column("mbytes", "MB moved", "{:.2f}"),
    ]
    columns += [Column("path", "path")] if on_gpu else []
    columns += [
        Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True), Column("tfuse_gbps", "GB/s", "{:.1f}"),
        Column("pct_copy", "% of copy BW", "{:.0f}%"), Column("launches", "launches"),
    ]
    columns += [Column("triton_ms", "Triton kernels ms", "{:.4f}", spread=True)] if on_gpu else []
    columns += [
        Column("eager_ms", "eager ms", "{:.4f}", spread=True),
        Column("compile_ms", "compile ms", "{:.4f}", spread=True),
        Column("vs_eager", "vs eager", "{:.2f}x"), Column("vs_compile", "vs compile", "{:.2f}x"),
    ]
    columns += [Column("triton_vs_eager", "Triton vs eager", "{:.2f}x")] if on_gpu else []
    columns += [
        Column("x_mb", "x MB", "{:.4g}"), Column("tfuse_saved_mb", "tfuse kept MB", "{:.4g}"),
        Column("eager_saved_mb", "eager kept MB", "{:.4g}"),
        Column("inplace_saved_mb", "eager in-place kept MB", "{:.4g}"),
        Column("compile_saved_mb", "compile kept MB", "{:.4g}"), CHECK_COLUMN,
    ]
    plot_lines = [("tfuse_gbps", label)] + ([("triton_gbps", "Triton kernels")] if on_gpu else [])
    plot_lines += [("eager_gbps", "act + F.conv2d"), ("compile_gbps", "torch.compile"),
                   ("copy_gbps", "copy of the same bytes")]
    return Report(
        name=NAME, title="tfuse.functional.relu_depthwise_conv2d: activation + depthwise convolution", notes=notes,
        columns=columns, rows=rows, plot_x="layer", plot_xlabel="layer (C x H x W, kernel, stride)",
        plot_lines=plot_lines, reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )

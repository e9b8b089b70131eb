"""Benchmarks of ``tfuse.functional.group_norm_act`` and ``layer_norm_act``: a normalisation and the activation
after it in one pass forward and one backward (``--only group_norm_act``, ``--only layer_norm_act``).

Compared, in training (forward, and forward+backward with gradients for x, weight and bias):

* tfuse: the fused op (on a CPU its PyTorch path, torch's own composition; the Triton kernels then run through
  the interpreter for launch counts, values and the memory they keep);
* eager: ``F.group_norm`` / ``F.layer_norm``, then the activation; torch.compile: that function compiled.

Shapes: group norm + SiLU with 32 groups at Stable Diffusion 1.5's UNet resolutions (320 x 64 x 64, 640 x 32 x 32,
1280 x 16 x 16), NCHW and channels_last, and group norm + ReLU at a ResNet-50-GN stage (256 x 56 x 56); layer
norm + GELU over the channels of ConvNeXt-T's channels-last stages ([N, 56, 56, 96], [N, 7, 7, 768]) and over
ViT-B/16's tokens ([N, 197, 768]). A CPU run keeps the channel counts and groups and shrinks the rest.

Minimum bytes (e: element size of x; X: elements of x, = y; P: elements of weight and bias together, e_p their
element size): forward reads x and writes y, ``2X e``, and reads the parameters, ``P e_p``; backward reads x and
dy and writes dx, ``3X e``, reads the parameters and writes their gradients, ``2P e_p``. Memory: what autograd
keeps for backward (x counted, the parameters and the output not), as in the depthwise benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

import tfuse
from tfuse.ops import norm_act as norm_act_ops
from tfuse.ops._norm_act_checks import checked_call

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

GROUP_NORM = "group_norm_act"
LAYER_NORM = "layer_norm_act"
#: The module's two benchmarks (benchmarks/__main__.py maps both names here): run_<name>(context) runs each.
NAMES = (GROUP_NORM, LAYER_NORM)

TORCH_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One normalisation of a network: x's shape without the batch, and how it is normalised.

    Group norm: ``dims`` is (C, H, W) and ``groups`` divides C. Layer norm (``groups`` None): x is
    ``[N, *dims]``, normalised over its last dimension.
    """

    net: str
    dims: tuple[int, ...]
    act: str
    groups: int | None = None
    eps: float = 1e-5

    @property
    def label(self) -> str:
        text = "x".join(map(str, self.dims))
        return f"{text}, G={self.groups}" if self.groups else f"{text} over {self.dims[-1]}"

    @property
    def channels(self) -> int:
        """Elements of weight (and of bias)."""
        return self.dims[0] if self.groups else self.dims[-1]


#: Stable Diffusion 1.5's UNet: GroupNorm(32) + SiLU at each resolution (64x64 latents); a ResNet-50-GN stage.
SD15_UNET = [Shape("SD1.5 UNet", (c, hw, hw), "silu", 32) for c, hw in ((320, 64), (640, 32), (1280, 16))]
RESNET50_GN = Shape("ResNet-50-GN", (256, 56, 56), "relu", 32)
#: ConvNeXt-T's channels-last LayerNorm (first and last stage), ViT-B/16's pre-norm over 197 tokens.
CONVNEXT_T = [Shape("ConvNeXt-T", (56, 56, 96), "gelu", eps=1e-6), Shape("ConvNeXt-T", (7, 7, 768), "gelu", eps=1e-6)]
VIT_B = Shape("ViT-B/16", (197, 768), "gelu", eps=1e-6)


def _small(shape: Shape, size: int) -> Shape:
    """``shape`` with its spatial (group norm) or leading (layer norm) extent shrunk for a CPU run."""
    if shape.groups:
        return dataclasses.replace(shape, dims=(shape.dims[0], size, size))
    return dataclasses.replace(shape, dims=(size,) * (len(shape.dims) - 1) + shape.dims[-1:])


def _configs(ctx: Context, family: str) -> list[tuple[Shape, int, torch.dtype, str]]:
    """(shape, batch, dtype, layout) of each configuration of ``family``, as ``triton.testing.Benchmark`` grids."""
    gpu, quick = ctx.machine.on_gpu, ctx.quick
    if family == GROUP_NORM:
        if gpu:
            shapes = [(s, 8) for s in SD15_UNET] + [(RESNET50_GN, 32)]
            shapes = [(SD15_UNET[0], 2), (RESNET50_GN, 8)] if quick else shapes
            formats = [(torch.bfloat16, "channels_last"), (torch.bfloat16, "NCHW")]
        elif quick:
            shapes = [(_small(SD15_UNET[0], 4), 2)]
            formats = [(torch.float32, "channels_last"), (torch.float32, "NCHW")]
        else:
            shapes = [(_small(s, hw), 4) for s, hw in zip(SD15_UNET, (16, 8, 4))] + [(_small(RESNET50_GN, 14), 4)]
            formats = [(torch.float32, "channels_last"), (torch.float32, "NCHW")]
    else:
        if gpu:
            shapes = [(s, 64) for s in CONVNEXT_T] + [(VIT_B, 64)]
            shapes = [(CONVNEXT_T[0], 16), (VIT_B, 16)] if quick else shapes
            formats = [(torch.bfloat16, "contiguous")]
        elif quick:
            shapes, formats = [(_small(CONVNEXT_T[1], 4), 2)], [(torch.float32, "contiguous")]
        else:
            shapes = [(_small(CONVNEXT_T[0], 28), 4), (CONVNEXT_T[1], 4), (VIT_B, 4)]
            formats = [(torch.float32, "contiguous")]
    benches = [
        triton.testing.Benchmark(
            x_names=["shape", "batch"], x_vals=shapes, line_arg="provider", line_vals=["tfuse", "eager", "compile"],
            line_names=["tfuse", "eager", "torch.compile"], plot_name=f"{family}-{dtype}-{layout}",
            args={"dtype": dtype, "layout": layout},
        )
        for dtype, layout in formats
    ]
    return [(c["shape"], c["batch"], c["dtype"], c["layout"]) for bench in benches for c in grid(bench)]


def min_bytes(x_numel: int, params: int, element_size: int, param_size: int, backward: bool) -> int:
    """Forward 2X e + P e_p; with backward 5X e + 3P e_p (module docstring)."""
    return (5 * x_numel * element_size + 3 * params * param_size) if backward else (
        2 * x_numel * element_size + params * param_size)


class _Case:
    """x, the parameters, and the fused and eager functions of one configuration."""

    def __init__(self, shape: Shape, batch: int, dtype: torch.dtype, layout: str, device: torch.device):
        self.shape = shape
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(batch, *shape.dims, generator=generator, dtype=torch.float32) * 2 + 0.5
        self.x = x.to(device=device, dtype=dtype)
        if layout == "channels_last":
            self.x = self.x.to(memory_format=torch.channels_last)
        c = shape.channels  # parameters in x's dtype, as a model cast with .to(dtype) holds them
        self.weight = (torch.rand(c, generator=generator) + 0.5).to(device=device, dtype=dtype)
        self.bias = torch.randn(c, generator=generator).to(device=device, dtype=dtype)
        act = TORCH_ACT[shape.act]
        if shape.groups:
            groups, eps = shape.groups, shape.eps

            def fused(x, w, b):
                return tfuse.functional.group_norm_act(x, groups, w, b, eps, act=shape.act)

            def eager(x, w, b):
                return act(F.group_norm(x, groups, w, b, eps))
        else:
            normalized, eps = shape.dims[-1:], shape.eps

            def fused(x, w, b):
                return tfuse.functional.layer_norm_act(x, normalized, w, b, eps, act=shape.act)

            def eager(x, w, b):
                return act(F.layer_norm(x, normalized, w, b, eps))

        self.fused, self.eager = fused, eager

    def shape_class(self) -> tuple:
        """The key of the op's dispatch rule (``tfuse.ops.norm_act.EAGER_SHAPE_CLASSES``) for this input."""
        op = GROUP_NORM if self.shape.groups else LAYER_NORM
        shape_arg = self.shape.groups if self.shape.groups else self.shape.dims[-1:]
        call = checked_call(op, self.x, shape_arg, self.weight, self.bias, None, self.shape.eps, self.shape.act, None)
        return norm_act_ops.shape_class(op, self.x, call)

    def leaves(self, grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(grad) for t in (self.x, self.weight, self.bias))

    @property
    def params(self) -> int:
        return 2 * self.weight.numel()


def _assert_close(name: str, pairs, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """A benchmark of a wrong result means nothing: each (what, got, expected), relative to the largest value."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    for what, a, b in pairs:
        scale = b.float().abs().max().item() or 1.0
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda m, what=what: f"{name} {what}: {m}")


def _check(name: str, fn, reference, leaves, dtype: torch.dtype, backward: bool) -> None:  # type: ignore[no-untyped-def]
    """``fn`` against ``reference`` on ``leaves``: the output, and with ``backward`` the three gradients."""
    y, expected = fn(*leaves), reference(*leaves)
    pairs = [("y", y, expected)]
    if backward:
        gy = torch.randn_like(y)
        got, want = torch.autograd.grad(y, leaves, gy), torch.autograd.grad(expected, leaves, gy)
        pairs += list(zip(("dx", "dweight", "dbias"), got, want))
    _assert_close(name, pairs, dtype)


def _kept_mb(fn, leaves: tuple[torch.Tensor, ...]) -> float:
    """MB autograd keeps for backward of ``fn(*leaves)`` (x counted, the parameters and the output not)."""
    return saved_for_backward_bytes(lambda: fn(*leaves), leaves[1:])[0] / 1e6


def _triton_path(case: _Case, dtype: torch.dtype) -> tuple[int, int, float]:
    """One training call of the fused op on its Triton path (through the interpreter on a CPU, on the benchmark's
    input): its forward and backward launches and the MB it keeps for backward; its values checked against eager."""
    leaves = case.leaves(True)
    with tfuse.use_backend("triton"):
        with tfuse.count_launches() as forward:
            kept, y = saved_for_backward_bytes(lambda: case.fused(*leaves), leaves[1:])
        gy = torch.randn_like(y)
        with tfuse.count_launches() as backward:
            got = torch.autograd.grad(y, leaves, gy)
    expected = case.eager(*leaves)
    want = torch.autograd.grad(expected, leaves, gy)
    _assert_close("tfuse (Triton path)", zip(("y", "dx", "dweight", "dbias"), (y, *got), (expected, *want)), dtype)
    return forward.total, backward.total, kept / 1e6


def _measure(ctx: Context, shape: Shape, batch: int, dtype: torch.dtype, layout: str) -> list[dict[str, Any]]:
    case = _Case(shape, batch, dtype, layout, ctx.machine.device)
    compiled = ctx.compile_reference(case.eager) if ctx.use_compile else None
    backend = "auto" if ctx.machine.on_gpu else "torch"
    # The Triton path once per configuration (the forward launches are the same with or without autograd).
    triton_path = _triton_path(case, dtype) if ctx.machine.on_gpu or ctx.machine.interpreted else None
    rows = []
    for passes in ("forward", "forward+backward"):
        training = passes == "forward+backward"
        leaves = case.leaves(training)
        gy = torch.randn_like(case.eager(*leaves)) if training else None
        nbytes = min_bytes(case.x.numel(), case.params, case.x.element_size(), case.weight.element_size(), training)

        def run(fn, leaves=leaves, gy=gy):
            return training_call(fn, leaves, gy)

        row: dict[str, Any] = {
            "net": shape.net, "act": shape.act, "dtype": str(dtype).replace("torch.", ""), "layout": layout,
            "shape": f"{batch}x{shape.label}", "passes": passes, "mbytes": nbytes / 1e6,
            "shape_class": case.shape_class(),
        }
        with tfuse.use_backend(backend):
            _check("tfuse", case.fused, case.eager, leaves, dtype, training)
            if training:
                row["x_mb"] = case.x.numel() * case.x.element_size() / 1e6
                row["eager_saved_mb"] = _kept_mb(case.eager, leaves)
                if triton_path is None:  # the PyTorch path's: torch's composition keeps what eager keeps
                    row["tfuse_saved_mb"] = _kept_mb(case.fused, leaves)
        if triton_path is not None:
            forward_launches, backward_launches, kept = triton_path
            row["launches"] = f"{forward_launches} + {backward_launches}" if training else str(forward_launches)
            if training:
                row["tfuse_saved_mb"] = kept
        providers = {"tfuse": run(case.fused), "eager": run(case.eager)}
        if compiled is not None:
            run(compiled)()
            providers["compile"] = run(compiled)
        with tfuse.use_backend(backend):
            timings, copy_nbytes = ctx.measure(providers, nbytes)
        finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
                   ratios={"vs_eager": "eager", "vs_compile": "compile"})
        row["series"] = f"{passes}, {row['dtype']}, {layout}"
        rows.append(row)
    return rows


def _notes(ctx: Context, family: str) -> list[str]:
    on_gpu = ctx.machine.on_gpu
    group = family == GROUP_NORM
    notes = [
        copy_note(ctx),
        "Training throughout: forward, and forward+backward with gradients for x, weight and bias. GB/s = minimum "
        "bytes / median time (e: element size of x; X: elements of x, = y; P: elements of weight and bias, e_p "
        "theirs). Forward: x read, y written, the parameters read: 2X e + P e_p. Forward+backward adds x and dy read, "
        "dx written, the parameters read and their gradients written: 5X e + 3P e_p in all.",
    ]
    if group:
        notes += [
            "Shapes: group norm (32 groups) + SiLU at Stable Diffusion 1.5's UNet resolutions (320x64x64, "
            "640x32x32, 1280x16x16 for 64x64 latents) and group norm + ReLU at a ResNet-50-GN stage (256x56x56), "
            "eps 1e-5, NCHW and channels_last (both read in place by the kernels), weight and bias in x's dtype. "
            "eager = F.silu/F.relu(F.group_norm(x, 32, weight, bias, eps)); torch.compile compiles eager."
            + ("" if on_gpu else " CPU run: the channel counts and groups kept, height and width shrunk (16, 8, 4 "
               "for SD, 14 for ResNet), batch 4 (2 in --quick)."),
            "Bytes tfuse's Triton path moves beyond the minimum: a row (one sample's group) of more than 8192 "
            "elements does not fit one tile, so forward reads x twice (statistics, then normalise) and backward "
            "reads x and dy twice (row sums, then dx); every full-size row here is that long (the CPU run's rows fit "
            "one tile). SiLU's derivative is recomputed from x; ReLU's is read off the saved output (y read in "
            "backward).",
            "launches: Triton launches of tfuse.functional.group_norm_act, forward + backward (1 + 1, or 2 + 2 when "
            "samples x groups are too few rows to fill the device and each row is split: a statistics kernel before "
            "the normalising one, a dx kernel after the sums), counted with tfuse.count_launches. Not counted there: "
            "backward's torch sum of the per-channel partials into d(weight) and d(bias) (one sum for both).",
            "kept MB: what autograd keeps for backward (saved_tensors_hooks, distinct storages; parameters and the "
            "output not counted, x counted). tfuse keeps x and each row's mean and 1/std (and the output for ReLU, "
            "uncounted); eager keeps x and F.group_norm's statistics, and F.silu its input (the normalised tensor, "
            "a second x-sized tensor); F.relu keeps its output, so eager GN + ReLU keeps about as much as tfuse.",
        ]
    else:
        notes += [
            "Shapes: layer norm + GELU (erf) over the last dimension, eps 1e-6: ConvNeXt-T's channels-last stages "
            "([N, 56, 56, 96] and [N, 7, 7, 768], over the channels) and ViT-B/16's tokens ([N, 197, 768]), "
            "x contiguous, weight and bias in x's dtype. eager = F.gelu(F.layer_norm(x, (D,), weight, bias, eps)); "
            "torch.compile compiles eager."
            + ("" if on_gpu else " CPU run: ConvNeXt's first stage at 28x28 (not 56x56), batch 4 (2 in --quick)."),
            "Every row here (96 or 768 elements) fits one tile, so tfuse's Triton path reads x once forward and x "
            "and dy once backward: the minimum bytes, plus the per-row statistics and d(weight)/d(bias) partials. "
            "GELU's derivative is recomputed from x.",
            "launches: Triton launches of tfuse.functional.layer_norm_act, forward + backward (1 + 1), counted with "
            "tfuse.count_launches. Not counted there: backward's torch sum of the per-block partials into "
            "d(weight) and d(bias) (one sum for both).",
            "kept MB: what autograd keeps for backward (saved_tensors_hooks, distinct storages; parameters and the "
            "output not counted, x counted). tfuse keeps x and each row's mean and 1/std; eager keeps x, "
            "F.layer_norm's statistics and F.gelu's input (the normalised tensor, a second x-sized tensor).",
        ]
    if not on_gpu:
        torch_op = "F.group_norm" if group else "F.layer_norm"
        notes.append(
            f"CPU run: the tfuse column times tfuse's PyTorch path (torch's own {torch_op} and activation, plus the "
            "call's Python), the work of eager, so it shows the fallback's cost, not what fusion gains. "
            + ("The Triton kernels ran through the interpreter on each row's input for the launch count, a value "
               "check against eager and tfuse kept MB (the Triton path's; the PyTorch path keeps what eager keeps); "
               "interpreter timings are not performance, and the kernels' speed needs a GPU run."
               if ctx.machine.interpreted else
               "The interpreter was off (TRITON_INTERPRET unset): no launch counts; tfuse kept MB is the PyTorch "
               "path's."))
    if not ctx.use_compile:
        notes.append("torch.compile was not measured (--no-compile).")
    return notes


def class_verdicts(rows: list[dict[str, Any]]) -> list[tuple[tuple, str]]:
    """Per shape class of the forward+backward rows (GPU: the Triton path against eager): (class, verdict).

    A class belongs in ``EAGER_SHAPE_CLASSES`` when the kernels were slower than eager in every measured row of
    it, with no marked timing; a mixed or marked class is said to be so.
    """
    by_class: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["passes"] == "forward+backward" and row.get("vs_eager") is not None:
            by_class[row["shape_class"]].append(row)
    verdicts = []
    for key, members in by_class.items():
        ratios = ", ".join(f"{row['net']} {row['shape']} {row['vs_eager']:.2f}x" for row in members)
        listed = key in norm_act_ops.EAGER_SHAPE_CLASSES
        if any(row.get("flags", {}).get("vs_eager") for row in members):
            verdict = f"not decided: a marked timing ({ratios})"
        elif all(row["vs_eager"] < 1 for row in members):
            verdict = f"slower than eager ({ratios}): " + (
                "in EAGER_SHAPE_CLASSES, as it should be" if listed else "belongs in EAGER_SHAPE_CLASSES")
        elif any(row["vs_eager"] < 1 for row in members):
            verdict = f"mixed ({ratios}): keep it off EAGER_SHAPE_CLASSES"
        else:
            verdict = f"faster than eager ({ratios})" + (
                ": in EAGER_SHAPE_CLASSES, but should come out of it" if listed else "")
        verdicts.append((key, verdict))
    return verdicts


def _report(ctx: Context, family: str) -> Report:
    configs = _configs(ctx, family)
    progress = Progress(family, len(configs))
    rows = []
    for shape, batch, dtype, layout in configs:
        progress.step(f"{shape.net} {batch}x{shape.label}, {str(dtype).replace('torch.', '')}, {layout}")
        rows.extend(_measure(ctx, shape, batch, dtype, layout))
    on_gpu = ctx.machine.on_gpu
    label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    columns = [
        Column("net", "net"), Column("act", "act"), Column("dtype", "dtype"), Column("layout", "layout"),
        Column("shape", "shape"), Column("passes", "passes"), Column("mbytes", "MB moved", "{:.2f}"),
        Column("tfuse_ms", f"{label} ms", "{:.4f}", spread=True), Column("tfuse_gbps", "GB/s", "{:.1f}"),
        Column("pct_copy", "% of copy BW", "{:.0f}%"), Column("launches", "launches"),
        Column("eager_ms", "eager ms", "{:.4f}", spread=True), Column("eager_gbps", "eager GB/s", "{:.1f}"),
        Column("compile_ms", "compile ms", "{:.4f}", spread=True), Column("compile_gbps", "compile GB/s", "{:.1f}"),
        Column("vs_eager", "vs eager", "{:.2f}x"), Column("vs_compile", "vs compile", "{:.2f}x"),
        Column("x_mb", "x MB", "{:.4g}"), Column("tfuse_saved_mb", "tfuse kept MB", "{:.4g}"),
        Column("eager_saved_mb", "eager kept MB", "{:.4g}"), CHECK_COLUMN,
    ]
    notes = _notes(ctx, family)
    if on_gpu:  # the dispatch rule's table is filled from these
        notes += [f"Shape class {key!r}: {verdict}." for key, verdict in class_verdicts(rows)]
    flagged = sum(bool(row.get("flags")) for row in rows)
    if flagged and not on_gpu:
        load = f" (load average {ctx.machine.load:.2f} at the start)" if ctx.machine.load is not None else ""
        notes.append(
            f"Noise: this CPU is shared{load}, and {flagged} of {len(rows)} rows have numbers marked noisy or "
            "implausible (check column). Those are not results; read the ratios of the unmarked rows, and rerun on "
            "a quiet machine for the rest.")
    title = ("tfuse.functional.group_norm_act: group norm + activation" if family == GROUP_NORM else
             "tfuse.functional.layer_norm_act: layer norm + activation")
    return Report(
        name=family, title=title, notes=notes, columns=columns, rows=rows, plot_x="shape",
        plot_xlabel="x (N x dims)", plot_lines=[("tfuse_gbps", label), ("eager_gbps", "eager"),
                                                 ("compile_gbps", "torch.compile"),
                                                 ("copy_gbps", "copy of the same bytes")],
        reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )


def run_group_norm_act(ctx: Context) -> Report:
    """``--only group_norm_act``."""
    return _report(ctx, GROUP_NORM)


def run_layer_norm_act(ctx: Context) -> Report:
    """``--only layer_norm_act``."""
    return _report(ctx, LAYER_NORM)


"""Benchmark of the fused optimizers against torch.optim's for-loop, foreach and fused implementations.

Parameters are synthetic tensors with the shapes of two real models:
ResNet-50 (161 tensors, 25.6M elements) and GPT-2 small (148 tensors, 124.4M
elements, lm_head tied to the embedding). Every parameter has a gradient.
The minimum traffic of an update is what each element must read and write
once: Adam float32 reads param, grad, exp_avg, exp_avg_sq and writes param,
exp_avg, exp_avg_sq (28 bytes per parameter); SGD with momentum reads param,
grad, momentum buffer and writes param and buffer (20 bytes); Adagrad (param,
grad, sum), Lion (param, grad, exp_avg) and LARS (param, grad, velocity)
likewise 20 bytes, LAMB as Adam 28 bytes (LAMB's two passes move 40 and
LARS's 28: the norms are needed before any element is updated). torch has no
Lion, LAMB or LARS: their rows have the tfuse column only. Muon's minimum is
20 bytes (param, grad, momentum); its Newton-Schulz iterations are matmuls
(compute, not traffic: 4 GFLOP/s in bfloat16 on this CPU), so on the CPU it
runs on a small transformer's shapes (d=64, 4 layers), where torch.optim.Muon
(a loop over the matrices) with torch's fused AdamW for the other parameters
is the comparison; on a GPU on the large models too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.testing

import tfuse
from tfuse.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedMuon

from .harness import CHECK_COLUMN, Column, Context, Progress, Report, copy_note, count_aten_ops, finish_row, grid

NAME = "optim"


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50, in registration order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out = 4 * width
            shapes += [(width, in_channels, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, in_channels, 1, 1), (out,), (out,)]
            in_channels = out
    return shapes + [(1000, 2048), (1000,)]


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (Hugging Face layout, lm_head tied to wte)."""
    d, vocab, context = 768, 50257, 1024
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def small_transformer_shapes() -> list[tuple[int, ...]]:
    """A small GPT-style transformer (d=64, 4 layers, vocabulary 512, weights as nn.Linear keeps them)."""
    d = 64
    shapes: list[tuple[int, ...]] = [(512, d), (128, d)]
    for _ in range(4):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def tiny_shapes() -> list[tuple[int, ...]]:
    """A few odd shapes for --quick smoke runs."""
    return [(64, 3, 7, 7), (64,), (33, 17), (1000,), (5,)]


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "ResNet-50": resnet50_shapes, "GPT-2 small": gpt2_small_shapes, "transformer d64": small_transformer_shapes,
    "tiny": tiny_shapes,
}
BYTES_PER_PARAM = {"adam": 28, "momentum": 20, "adagrad": 20, "lion": 20, "lamb": 28, "lars": 20, "muon": 20}
ALGORITHMS = {"adam": "Adam", "momentum": "SGD momentum", "adagrad": "Adagrad", "lion": "Lion", "lamb": "LAMB",
              "lars": "LARS", "muon": "Muon + AdamW"}
PROVIDERS = ("tfuse", "for-loop", "foreach", "fused")
TORCH_LESS = {"lion", "lamb", "lars"}  # no torch.optim implementation to time against


def _configurations(models: list[str], on_gpu: bool) -> list[tuple[str, str]]:
    """(model, algorithm) rows: every algorithm on every model, but Muon's matmuls only on the GPU for the large
    models (minutes per step on 2 CPU cores), and the small transformer for Muon only."""
    rows = []
    for model in models:
        for algorithm in ALGORITHMS:
            small = model == "transformer d64"
            if (algorithm == "muon" and (small or on_gpu or model == "tiny")) or (algorithm != "muon" and not small):
                rows.append((model, algorithm))
    return rows


def _benchmarks(ctx: Context) -> list[triton.testing.Benchmark]:
    models = ["tiny"] if ctx.quick else ["ResNet-50", "GPT-2 small", "transformer d64"]
    return [
        triton.testing.Benchmark(
            x_names=["model", "algorithm"], x_vals=_configurations(models, ctx.machine.on_gpu),
            line_arg="provider", line_vals=["tfuse", "for-loop", "foreach", "fused"],
            line_names=["tfuse", "torch for-loop", "torch foreach", "torch fused=True"],
            plot_name="optimizer-step", args={},
        )
    ]


def _params(shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    return params


def _make(provider: str, algorithm: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if provider == "tfuse":
        fused = {"adam": lambda: FusedAdam(params, lr=1e-4), "adagrad": lambda: FusedAdagrad(params, lr=1e-4),
                 "lion": lambda: FusedLion(params, lr=1e-5, weight_decay=0.1),
                 "lamb": lambda: FusedLAMB(params, lr=1e-3, weight_decay=0.01),
                 "lars": lambda: FusedLARS(params, lr=1.0, weight_decay=5e-5),
                 "momentum": lambda: FusedMomentum(params, lr=1e-4, momentum=0.9),
                 "muon": lambda: FusedMuon(params, lr=0.02, adamw_lr=3e-4)}
        return fused[algorithm]()
    if algorithm == "muon":
        return _TorchMuonWithAdamW(params)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[provider]
    if algorithm == "adam":
        return torch.optim.Adam(params, lr=1e-4, **flags)
    if algorithm == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-4, **flags)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9, **flags)


class _TorchMuonWithAdamW:
    """torch.optim.Muon over the 2-D parameters and torch's fused AdamW over the others, stepped together (torch's
    Muon takes matrices only and has no foreach or fused implementation)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.muon = torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.02)
        others = [p for p in params if p.dim() != 2]
        self.adamw = torch.optim.AdamW(others, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0, fused=True)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def torch_has_fused(cls: type[torch.optim.Optimizer], device: torch.device) -> bool:
    """Whether torch has a ``fused=True`` kernel of ``cls`` on ``device`` (none of Adagrad's on CUDA)."""
    parameter = torch.nn.Parameter(torch.zeros(1, device=device))
    parameter.grad = torch.ones(1, device=device)
    try:
        cls([parameter], fused=True).step()
    except RuntimeError as error:  # "`fused=True` requires all the params to be ... of supported devices"
        if "fused" not in str(error):
            raise
        return False
    return True


def _torch_providers(algorithm: str, shapes: list[tuple[int, ...]], device: torch.device) -> tuple[str, ...]:
    if algorithm in TORCH_LESS or (algorithm == "muon" and any(len(s) > 2 for s in shapes)):
        return PROVIDERS[:1]  # (torch's Muon refuses convolution weights)
    if algorithm == "muon":
        return PROVIDERS[:2]
    if algorithm == "adagrad" and not torch_has_fused(torch.optim.Adagrad, device):
        return PROVIDERS[:-1]
    return PROVIDERS


def _measure(ctx: Context, model: str, algorithm: str) -> dict[str, Any]:
    device = ctx.machine.device
    shapes = MODELS[model]()
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    nbytes = BYTES_PER_PARAM[algorithm] * numel
    row: dict[str, Any] = {
        "model": model, "algorithm": ALGORITHMS[algorithm], "tensors": len(shapes),
        "numel": numel, "mbytes": nbytes / 1e6, "series": "optimizer step",
    }
    backend = "triton" if ctx.machine.on_gpu else "torch"
    providers = {}
    # All optimizers exist at once (their steps are timed interleaved). tfuse re-homes its parameters into flat
    # buffers, so it gets its own; torch's three share one set (each keeps its own state), which saves memory.
    shared = _params(shapes, device)
    with tfuse.use_backend(backend):
        for provider in _torch_providers(algorithm, shapes, device):
            params = _params(shapes, device) if provider == "tfuse" else shared
            optimizer = _make(provider, algorithm, params)
            optimizer.step()  # state created, gradients re-homed into the flat buffers
            if provider == "tfuse":
                with tfuse.count_launches() as launches:
                    optimizer.step()
                if backend == "triton":
                    row["tfuse_launches"] = launches.total
                if algorithm == "muon":  # the batched iterations' torch ops (matmuls), against torch's loop
                    row["tfuse_ops"] = count_aten_ops(optimizer.step)
            else:
                row[f"{provider}_ops"] = count_aten_ops(optimizer.step)
            providers[provider] = optimizer.step
        if not ctx.machine.on_gpu and model == "ResNet-50" and algorithm == "adam":
            providers["flat"] = _flat_torch_fused_step(numel, device)
        timings, copy_nbytes = ctx.measure(providers, nbytes)
    finish_row(row, timings, ctx, nbytes=nbytes, copy_nbytes=copy_nbytes,
               ratios={"vs_fused": "fused", "vs_foreach": "foreach", "vs_loop": "for-loop"})
    return row


def _flat_torch_fused_step(numel: int, device: torch.device) -> Callable[[], Any]:
    """torch's fused Adam over ONE flat tensor of ``numel`` elements: the floor of the CPU path."""
    flat = torch.nn.Parameter(torch.randn(numel, device=device) * 0.02)
    flat.grad = torch.randn_like(flat) * 1e-3
    optimizer = torch.optim.Adam([flat], lr=1e-4, fused=True)
    optimizer.step()
    return optimizer.step


def run(ctx: Context) -> Report:
    rows = []
    configs = [config for bench in _benchmarks(ctx) for config in grid(bench)]
    progress = Progress(NAME, len(configs))
    for config in configs:
        progress.step(f"{config['model']}, {config['algorithm']}")
        rows.append(_measure(ctx, config["model"], config["algorithm"]))
    on_gpu = ctx.machine.on_gpu
    label = "tfuse" if on_gpu else "tfuse (PyTorch path)"
    notes = [
        copy_note(ctx),
        "GB/s = minimum bytes / median step time: Adam and LAMB float32 28 B/parameter, SGD momentum, Adagrad, "
        "Lion and LARS 20 B/parameter (each element read and written once; LAMB's two passes move 40, LARS's 28).",
        "Synthetic float32 parameters with the shapes of the named model, every one with a gradient; "
        "lr 1e-4, Adam betas (0.9, 0.999), SGD momentum 0.9; Lion lr 1e-5, weight decay 0.1, betas (0.9, 0.99); "
        "LAMB lr 1e-3, weight decay 0.01; LARS lr 1, weight decay 5e-5, momentum 0.9; Muon lr 0.02 (torch's "
        "defaults otherwise: 5 bfloat16 iterations), its other parameters AdamW lr 3e-4, betas (0.9, 0.95).",
        "Muon + AdamW: FusedMuon (matrices and convolution weights to Muon, the rest to its AdamW groups) against "
        "torch.optim.Muon over the matrices plus torch.optim.AdamW(fused=True) over the rest, in the for-loop "
        "column (torch's Muon has no other); tfuse ops = the torch ops of its step (the batched iterations: three "
        "matmuls per iteration per matrix shape; on the PyTorch path also its foreach ops). Its GB/s counts the "
        "elementwise minimum only; the time is mostly the iterations' matmuls.",
        "tfuse: FusedAdam / FusedMomentum / FusedAdagrad / FusedLion / FusedLAMB / FusedLARS / FusedMuon over the "
        "parameters coalesced into one flat buffer (FusedMuon: one per kind); torch columns: torch.optim.Adam / SGD / Adagrad with foreach=False, "
        "foreach=True and fused=True (torch has no Lion, LAMB or LARS, and no fused Adagrad on CUDA: that cell "
        "stays empty on a GPU).",
        "ops = ATen operator calls per torch step (each is at least one kernel launch on a GPU); "
        "launches = Triton launches per tfuse step.",
    ]
    floor = next((row for row in rows if row.get("flat_ms") is not None), None)
    if floor is not None:
        flag = floor["flags"].get("flat_ms")
        notes.append(f"torch's fused CPU Adam over ONE flat tensor of ResNet-50's 25.6M elements, timed in the same rounds "
                     f"as the ResNet-50 Adam row: {Column('flat_ms', '', '{:.2f}', spread=True).render(floor)} ms per step "
                     "(the same kernel the PyTorch path runs over its flat buffers)"
                     + (f"; {flag.kind}: {flag.reason}." if flag else "."))
    if not on_gpu:
        notes.append(
            "CPU run: the tfuse column times tfuse's PyTorch path (torch's fused CPU kernels over whole runs of "
            "the flat buffers, no per-parameter work; Lion: torch's foreach ops over those runs; LAMB and LARS: "
            "torch's foreach ops over whole parameters); it launches no "
            "Triton kernel. Through the interpreter the Triton path launches one kernel (LAMB, LARS: three) per flat "
            "buffer per step (tests/test_optim.py and tests/test_optim_api.py check it). The PyTorch paths of "
            "Lion, LAMB and LARS are unfused foreach ops, one memory pass each (LAMB about 15 passes): a fallback, "
            "not the product."
        )
    columns = [
        Column("model", "model"), Column("algorithm", "optimizer"), Column("tensors", "tensors"),
        Column("mbytes", "min MB moved", "{:.0f}"), Column("tfuse_ms", f"{label} ms", "{:.3f}", spread=True),
        Column("tfuse_gbps", "GB/s", "{:.1f}"), Column("pct_copy", "% of copy BW", "{:.0f}%"),
        Column("tfuse_launches", "launches"), Column("tfuse_ops", "tfuse ops"),
        Column("for-loop_ms", "for-loop ms", "{:.3f}", spread=True),
        Column("for-loop_ops", "loop ops"), Column("foreach_ms", "foreach ms", "{:.3f}", spread=True),
        Column("foreach_ops", "foreach ops"), Column("fused_ms", "fused=True ms", "{:.3f}", spread=True),
        Column("fused_ops", "fused ops"), Column("vs_loop", "vs for-loop", "{:.2f}x"),
        Column("vs_foreach", "vs foreach", "{:.2f}x"),
        Column("vs_fused", "vs fused=True", "{:.2f}x"), CHECK_COLUMN,
    ]
    return Report(
        name=NAME, title="Optimizer step: tfuse's fused optimizers vs torch.optim", notes=notes, columns=columns,
        rows=rows, plot_panels="algorithm", plot_x="numel", plot_xlabel="parameters (elements)",
        plot_lines=[("tfuse_gbps", label), ("for-loop_gbps", "for-loop"), ("foreach_gbps", "foreach"),
                    ("fused_gbps", "fused=True"), ("copy_gbps", "copy (same bytes, at most 1 GiB)")],
        reference_line=(ctx.copy_gbps, "device copy bandwidth") if on_gpu else None,
    )

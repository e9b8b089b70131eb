"""torch.compile and CUDA graphs: a training step of torch layers and of tfuse layers, eager and compiled.

``python -m benchmarks --only compile``. Two models, each in a torch version
(nn layers, ``torch.optim.Adam(fused=True)``) and a tfuse version (fused
layers, ``FusedAdam``), with the same shapes and initial weights:

* mlp: a transformer MLP block, LayerNorm -> Linear + GELU -> Linear -> + residual;
* cnn: a small residual CNN, Conv -> BatchNorm + ReLU (twice, the second
  with the residual add) -> pooling -> Linear.

A step is zero_grad, forward, loss, backward and the optimizer step. Rows:
eager torch, ``torch.compile`` of torch's model, eager tfuse, ``torch.compile``
of tfuse's model (the optimizer step runs eagerly in both compiled rows),
and on a GPU the whole tfuse step captured in a CUDA graph
(``FusedAdam(capturable=True)``) and replayed. Compiled tfuse is Inductor's
code of tfuse's ops' PyTorch path. On a CPU, eager tfuse runs its PyTorch
path too (the Triton interpreter is for checking values, not for timing).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .harness import CHECK_COLUMN, Column, Context, Progress, Report, check_stall, check_timing, worse_flag

NAME = "compile"


class _TorchMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class _TfuseMLP(nn.Module):
    def __init__(self, width: int) -> None:
        import tfuse

        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = tfuse.nn.FusedLinear(width, 4 * width, act="gelu")
        self.down = nn.Linear(4 * width, width)
        self.add = tfuse.nn.FusedAdd()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add(x, self.down(self.up(self.norm(x))))


class _TorchCNN(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = torch.relu(self.bn1(self.conv1(h)) + h)
        return self.head(h.mean((2, 3)))


class _TfuseCNN(nn.Module):
    def __init__(self, channels: int) -> None:
        import tfuse

        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn0 = tfuse.nn.FusedBatchNormAct2d(channels, act="relu")
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = tfuse.nn.FusedBatchNormAct2d(channels, act="relu")
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn0(self.stem(x))
        h = self.bn1(self.conv1(h), residual=h)
        return self.head(h.mean((2, 3)))


def _models(quick: bool, on_gpu: bool) -> list[tuple[str, Callable[[], nn.Module], Callable[[], nn.Module], tuple]]:
    """(name, torch model, tfuse model, input shape): the same parameters, in the same order."""
    if on_gpu:
        mlp_shape, cnn_shape, width, channels = (64, 128, 768), (64, 3, 32, 32), 768, 64
    else:
        mlp_shape, cnn_shape, width, channels = (8, 64, 128), (16, 3, 16, 16), 128, 16
    models = [("mlp", lambda: _TorchMLP(width), lambda: _TfuseMLP(width), mlp_shape)]
    if not quick:
        models.append(("cnn", lambda: _TorchCNN(channels), lambda: _TfuseCNN(channels), cnn_shape))
    return models


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()

    return step


def _graphed(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """The whole tfuse step (capturable FusedAdam) captured in a CUDA graph; the callable replays it."""
    from tfuse.optim import FusedAdam

    optimizer = FusedAdam(model.parameters(), lr=torch.tensor(1e-3, device=x.device), capturable=True)
    step = _step(model, optimizer, x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # Triton compiles, the optimizer creates its state and tables
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def run(ctx: Context) -> Report:
    import tfuse
    from tfuse.optim import FusedAdam

    device = ctx.machine.device
    on_gpu = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    models = _models(ctx.quick, on_gpu)
    # A --quick smoke run compiles with aot_eager (dynamo and AOTAutograd, fullgraph checked; no inductor code
    # generation, which costs most of the run on a CPU); its notes say so. Full runs compile with inductor.
    backend = "aot_eager" if ctx.quick else "inductor"
    progress = Progress(NAME, len(models))
    for name, make_torch, make_tfuse, shape in models:
        torch.manual_seed(0)
        x = torch.randn(shape, device=device)
        reference = make_torch().to(device)
        fns: dict[str, Callable[[], None]] = {}
        variants: list[tuple[str, nn.Module, bool]] = [("eager torch", reference, False)]
        variants.append(("compiled torch", copy.deepcopy(reference), True))
        fused = make_tfuse().to(device)
        fused.load_state_dict(reference.state_dict())
        variants.append(("eager tfuse", fused, False))
        variants.append(("compiled tfuse", copy.deepcopy(fused), True))
        with _eager_tfuse_backend(on_gpu):
            for label, model, compiled in variants:
                is_tfuse = "tfuse" in label
                optimizer = (
                    FusedAdam(model.parameters(), lr=1e-3)
                    if is_tfuse
                    else torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
                )
                forward = torch.compile(model, fullgraph=True, dynamic=False, backend=backend) if compiled else model
                fns[label] = _step(forward, optimizer, x)
            if on_gpu:
                fns["CUDA graph tfuse"] = _graphed(copy.deepcopy(fused), x)
            timings, _ = ctx.measure(fns)
        canary = timings.pop("canary", None)
        stall = check_stall(canary, ctx.stall_reference_gbps) if canary is not None else None
        progress.step(f"{name}: {', '.join(f'{k} {t.median:.2f} ms' for k, t in timings.items())}")
        eager_torch = timings["eager torch"].median
        compiled_torch = timings["compiled torch"].median
        for label, timing in timings.items():
            row: dict[str, Any] = {
                "model": name,
                "variant": label,
                "shape": "x".join(map(str, shape)),
                "ms": timing.median,
                "ms_range": timing.quartiles,
                "vs_eager": eager_torch / timing.median,
                "vs_compiled": compiled_torch / timing.median,
                "flags": {},
            }
            flag = worse_flag(check_timing(label, timing), stall)
            if flag is not None:
                row["flags"]["ms"] = flag
            rows.append(row)
    notes = [
        "One training step (zero_grad, forward, loss, backward, Adam step) per call; same weights and input for "
        "every variant of a model.",
        "torch rows: nn layers and torch.optim.Adam(fused=True); tfuse rows: fused layers and tfuse.optim.FusedAdam. "
        "Compiled rows: torch.compile(model, fullgraph=True); the optimizer step runs eagerly. Compiled tfuse is "
        "Inductor's code of tfuse's ops' PyTorch path (traced ops do not hand Inductor tfuse's Triton kernels yet).",
        "'x faster than eager torch' / 'than compiled torch': the torch row's time over this row's (above 1: faster).",
    ]
    if ctx.quick:
        notes.append(
            "Quick run (--quick, a smoke run): the compiled rows are torch.compile's aot_eager backend (dynamo and "
            "AOTAutograd, no inductor code generation); full runs compile with inductor."
        )
    if not on_gpu:
        notes.append(
            "CPU run: eager tfuse runs its PyTorch path (tfuse.use_backend('torch')), not the Triton interpreter; "
            + ("" if ctx.quick else "compiled rows are Inductor's C++ code. ")
            + "Eager tfuse's Triton kernels and the CUDA-graph row need a GPU run."
        )
    notes.append(f"tfuse {tfuse.__version__}, torch {torch.__version__}.")
    return Report(
        name=NAME,
        title="torch.compile and CUDA graphs: training step of torch and tfuse layers",
        notes=notes,
        columns=[
            Column("model", "model"),
            Column("shape", "input"),
            Column("variant", "variant"),
            Column("ms", "ms / step", "{:.3f}", spread=True),
            Column("vs_eager", "x faster than eager torch", "{:.2f}"),
            Column("vs_compiled", "x faster than compiled torch", "{:.2f}"),
            CHECK_COLUMN,
        ],
        rows=rows,
        plot_panels="model",
        plot_x="variant",
        plot_lines=(("ms", "ms per training step"),),
        plot_xlabel="",
        plot_ylabel="ms per step",
    )


def _eager_tfuse_backend(on_gpu: bool):
    """The backend eager tfuse runs on: its default on a GPU, the PyTorch path on a CPU (not the interpreter)."""
    import contextlib

    import tfuse

    return contextlib.nullcontext() if on_gpu else tfuse.use_backend("torch")

"""Benchmark of gradient all-reduce: per-tensor, tfuse's fused buckets and torch DDP.

Launches its own ranks (2 processes, gloo on the CPU; NCCL with one GPU per
rank when the machine has two or more GPUs) and measures, in one run:

1. ResNet-50's gradient set (161 float32 tensors, 25.6M elements, 102 MB)
   with a cheap forward (each parameter times a scalar, summed), so that
   gradient synchronisation dominates the step: backward alone, backward then
   one all-reduce per tensor, backward then one all-reduce of the whole flat
   buffer, :class:`tfuse.distributed.FusedDataParallel` with a bucket_mb sweep
   and a count-cap sweep (all-reduces overlapping backward), and torch DDP
   with ``bucket_cap_mb=25``.
2. A whole training step (forward, backward, SGD with momentum) of a small
   CNN: local only, DDP, and FusedDataParallel with FusedMomentum and with
   torch's SGD.

Collectives need every rank to run the same number of iterations, so the
timing loop is a fixed count (``triton.testing.do_bench`` picks its own
count per process) with a barrier before each timed iteration; an
iteration's time is the slowest rank's, and the table shows the median over
rounds that cycle through every configuration (so drift on a shared
machine hits them all alike).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .harness import (
    CANARY_BYTES,
    CHECK_COLUMN,
    NOISY_REL_IQR,
    Column,
    Context,
    Report,
    Timing,
    check_stall,
    check_timing,
    copy_reference,
    difference,
    worse_flag,
)
from .ranks import launch, rank_group, time_steps, step_flag_from

NAME = "allreduce"
WORLD_SIZE = 2
BUCKET_MB_SWEEP = (1, 4, 16, 25, 64)
COUNT_CAP_SWEEP = (1, 8, 32, 128)
DDP_BUCKET_MB = 25
CANARY = "copy canary"
HOOK_PARAMS = 200  # the per-gradient host cost panel: this many parameters of HOOK_NUMEL elements
HOOK_NUMEL = 16
# The CNN block's reference: the fastest torch combination (DDP with torch's fused SGD).
DDP_FUSED_SGD = f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}, torch SGD fused=True"


@dataclasses.dataclass
class _Config:
    label: str
    panel: str  # "resnet50-sync" or "cnn-step"
    step: Callable[[], None]
    calls: Callable[[], int | None]
    x: float | None = None  # plotted against (bucket_mb or count cap)
    sweep: str = ""


class _CheapModel(torch.nn.Module):
    """Parameters with given shapes and a forward that costs one multiply per element."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.01).to(device)) for shape in shapes
        )

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return torch.stack([(weight * scale).sum() for weight in self.weights]).sum()


def _small_cnn(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10),
    ).to(device)


def _ddp_bucket_count(model: torch.nn.parallel.DistributedDataParallel) -> int | None:
    """DDP's current bucket count (after its rebuild); private API, so None if it is gone."""
    try:
        return len(model.reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return None


def _sync_configs(shapes: list[tuple[int, ...]], device: torch.device) -> list[_Config]:
    from tfuse.distributed import FusedDataParallel
    from tfuse.flat import FlatParams

    world = dist.get_world_size()
    scale = torch.tensor(1.0 + dist.get_rank(), device=device)
    configs = []

    local = _CheapModel(shapes, device)

    def backward_only() -> None:
        local.zero_grad()
        local(scale).backward()

    def per_tensor() -> None:
        backward_only()
        works = [dist.all_reduce(p.grad.div_(world), async_op=True) for p in local.parameters()]
        for work in works:
            work.wait()

    flat_model = _CheapModel(shapes, device)
    flat = FlatParams(flat_model.parameters())

    def one_flat_all_reduce() -> None:
        flat.zero_grad()
        flat_model(scale).backward()
        for buffer in flat.grad_buffers:
            dist.all_reduce(buffer.div_(world))

    n = len(shapes)
    configs += [
        _Config("backward only (no sync)", "resnet50-sync", backward_only, lambda: 0),
        _Config("per-tensor all-reduce after backward", "resnet50-sync", per_tensor, lambda: n),
        _Config("one flat all-reduce after backward", "resnet50-sync", one_flat_all_reduce, lambda: len(flat.grad_buffers)),
    ]
    for bucket_mb in BUCKET_MB_SWEEP:
        configs.append(_fdp_config(FusedDataParallel, shapes, device, scale, f"tfuse bucket_mb={bucket_mb}", bucket_mb, None,
                                   x=bucket_mb, sweep="bucket_mb sweep"))
    for cap in COUNT_CAP_SWEEP:
        configs.append(_fdp_config(FusedDataParallel, shapes, device, scale, f"tfuse max_params_per_bucket={cap}", None, cap,
                                   x=cap, sweep="count-cap sweep (bucket_mb=None)"))
    for as_view in (False, True):
        ddp = torch.nn.parallel.DistributedDataParallel(
            _CheapModel(shapes, device), bucket_cap_mb=DDP_BUCKET_MB, gradient_as_bucket_view=as_view
        )

        def ddp_step(model: torch.nn.Module = ddp) -> None:
            model.zero_grad()
            model(scale).backward()

        label = f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}" + (", gradient_as_bucket_view" if as_view else "")
        configs.append(_Config(label, "resnet50-sync", ddp_step, lambda model=ddp: _ddp_bucket_count(model)))
    return configs


def _fdp_config(wrapper: type, shapes, device, scale, label, bucket_mb, cap, x, sweep) -> _Config:
    model = wrapper(_CheapModel(shapes, device), bucket_mb=bucket_mb, max_params_per_bucket=cap)

    def step() -> None:
        model.flat.zero_grad()
        model(scale).backward()

    return _Config(label, "resnet50-sync", step, lambda: model.num_allreduce_calls, x=x, sweep=sweep)


def _hook_configs(device: torch.device) -> list[_Config]:
    """Per-gradient host cost: HOOK_PARAMS tiny parameters, so that a backward is mostly per-tensor bookkeeping.

    Local (no wrapper), DDP and FusedDataParallel, each one bucket; their difference over HOOK_PARAMS is
    what each wrapper spends per gradient (DDP in C++, tfuse in one Python hook).
    """
    from tfuse.distributed import FusedDataParallel

    scale = torch.tensor(1.0 + dist.get_rank(), device=device)
    shapes = [(HOOK_NUMEL,)] * HOOK_PARAMS

    def make(model: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad()
            model(scale).backward()

        return step

    ddp = torch.nn.parallel.DistributedDataParallel(_CheapModel(shapes, device), bucket_cap_mb=DDP_BUCKET_MB)
    fdp = FusedDataParallel(_CheapModel(shapes, device), bucket_mb=DDP_BUCKET_MB)
    return [
        _Config(f"backward only, {HOOK_PARAMS} tiny parameters", "hook-cost", make(_CheapModel(shapes, device)),
                lambda: 0),
        _Config(f"torch DDP, {HOOK_PARAMS} tiny parameters", "hook-cost", make(ddp), lambda: _ddp_bucket_count(ddp)),
        _Config(f"tfuse FusedDataParallel, {HOOK_PARAMS} tiny parameters", "hook-cost", make(fdp),
                lambda: fdp.num_allreduce_calls),
    ]


def _cnn_configs(device: torch.device, quick: bool) -> list[_Config]:
    from tfuse.distributed import FusedDataParallel
    from tfuse.optim import FusedMomentum

    generator = torch.Generator().manual_seed(dist.get_rank())
    batch = 8 if quick else 32
    images = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            optimizer.zero_grad()
            loss_fn(model(images), labels).backward()
            optimizer.step()

        return step

    local = _small_cnn(device)
    ddp = torch.nn.parallel.DistributedDataParallel(_small_cnn(device), bucket_cap_mb=DDP_BUCKET_MB)
    ddp_fused = torch.nn.parallel.DistributedDataParallel(_small_cnn(device), bucket_cap_mb=DDP_BUCKET_MB)
    fdp_fused = FusedDataParallel(_small_cnn(device), bucket_mb=DDP_BUCKET_MB)
    fdp_torch = FusedDataParallel(_small_cnn(device), bucket_mb=DDP_BUCKET_MB)
    sgd = dict(lr=0.01, momentum=0.9)
    return [
        _Config("local step (no sync), torch SGD", "cnn-step", make_step(local, torch.optim.SGD(local.parameters(), **sgd)),
                lambda: 0),
        _Config(f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}, torch SGD", "cnn-step",
                make_step(ddp, torch.optim.SGD(ddp.parameters(), **sgd)), lambda: _ddp_bucket_count(ddp)),
        _Config(DDP_FUSED_SGD, "cnn-step", make_step(ddp_fused, torch.optim.SGD(ddp_fused.parameters(), fused=True, **sgd)),
                lambda: _ddp_bucket_count(ddp_fused)),
        _Config(f"tfuse bucket_mb={DDP_BUCKET_MB}, FusedMomentum", "cnn-step",
                make_step(fdp_fused, FusedMomentum(fdp_fused.parameters(), **sgd)), lambda: fdp_fused.num_allreduce_calls),
        _Config(f"tfuse bucket_mb={DDP_BUCKET_MB}, torch SGD", "cnn-step",
                make_step(fdp_torch, torch.optim.SGD(fdp_torch.parameters(), **sgd)), lambda: fdp_torch.num_allreduce_calls),
    ]


def _canary(device: torch.device) -> _Config:
    """A copy timed in the same rounds (CPU runs): far slower than on an idle core, it shows a stalled machine."""
    copy, _ = copy_reference(CANARY_BYTES, device)
    return _Config(CANARY, "canary", copy, lambda: None)


def _time_configs(configs: list[_Config], device: torch.device, rounds: int, iterations: int) -> list[list[float]]:
    """Per config, the slowest rank's time of every timed step (ms): rounds x iterations samples.

    Rounds cycle through every configuration, each round starting from the next
    one, so drift on a shared machine hits them all alike.
    """
    for config in configs:  # warm-up (DDP rebuilds its buckets after its first iteration)
        for _ in range(2):
            config.step()
    return time_steps([c.step for c in configs], device, rounds, iterations, "allreduce")


def _rank_main(rank: int, world: int, backend: str, init_file: str, out_file: str, quick: bool) -> None:
    from .optim import resnet50_shapes, tiny_shapes

    with rank_group(rank, world, backend, init_file) as device:
        shapes = tiny_shapes() if quick else resnet50_shapes()
        rounds, iterations = (3, 2) if quick else (7, 3)
        configs = _sync_configs(shapes, device) + _cnn_configs(device, quick) + _hook_configs(device)
        if backend == "gloo":
            configs.append(_canary(device))
        samples = _time_configs(configs, device, rounds, iterations)
        rows = [
            {"panel": c.panel, "label": c.label, "calls": c.calls(), "samples": times, "x": c.x, "sweep": c.sweep}
            for c, times in zip(configs, samples)
        ]
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "tensors": len(shapes), "rounds": rounds,
                                                  "iterations": iterations,
                                                  "mbytes": sum(torch.Size(s).numel() for s in shapes) * 4 / 1e6}))


def _launch(backend: str, quick: bool) -> dict[str, Any]:
    return launch("allreduce", _rank_main, WORLD_SIZE, backend, quick, deadline_s=300 if quick else 1200)


def _finish(rows: list[dict[str, Any]], stall_reference_gbps: float | None) -> None:
    """Medians, spreads and flags of the rows (in place); removes the canary row, flagging every row if it stalled.

    A rank runs one torch thread on a CPU, so its canary copy is set against the
    same copy on one thread measured at the start.
    """
    if len({row["label"] for row in rows}) != len(rows):
        raise ValueError("allreduce benchmark: two configurations share a label")  # the timings are keyed by it
    timings = {row["label"]: Timing(tuple(row.pop("samples"))) for row in rows}
    stall = None
    canary = next((row for row in rows if row["label"] == CANARY), None)
    if canary is not None:
        rows.remove(canary)
        stall = check_stall(timings[CANARY], stall_reference_gbps)
    for row in rows:
        timing = timings[row["label"]]
        row["ms"] = row["step_ms"] = timing.median
        row["ms_range"] = row["step_ms_range"] = timing.quartiles
        row["flags"] = {}
        flag = stall or check_timing("step", timing)
        if flag is not None:
            row["flags"]["ms"] = row["flags"]["step_ms"] = flag
    by_label = {row["label"]: row for row in rows}
    baseline = {row["panel"]: row for row in rows if row["calls"] == 0}
    ddp = {"resnet50-sync": by_label[f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}"],
           "cnn-step": by_label.get(DDP_FUSED_SGD) or by_label[f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}, torch SGD"]}
    hook_rows = [row for row in rows if row["panel"] == "hook-cost"]
    if hook_rows:
        ddp["hook-cost"] = next(row for row in hook_rows if row["label"].startswith("torch DDP"))
    for row in rows:
        if row["calls"] == 0:
            row["sync_ms"] = row["vs_ddp"] = None
            continue
        base, reference = baseline[row["panel"]], ddp[row["panel"]]
        # The difference's own check weighs both rows' spreads; only an implausible step (a stall) carries over.
        row["sync_ms"], flag = difference(timings[row["label"]], timings[base["label"]], "sync")
        for other in (step_flag_from(row, row), step_flag_from(base, row)):
            if other is not None and other.kind == "implausible":
                flag = worse_flag(flag, other)
        if flag is not None:
            row["flags"]["sync_ms"] = flag
        row["vs_ddp"] = row["ms"] / reference["ms"]
        flag = worse_flag(row["flags"].get("ms"), step_flag_from(reference, row))
        if flag is not None:
            row["flags"]["vs_ddp"] = flag


def run(ctx: Context) -> Report:
    multi_gpu = ctx.machine.on_gpu and torch.cuda.device_count() >= WORLD_SIZE
    backend = "nccl" if multi_gpu else "gloo"
    result = _launch(backend, ctx.quick)
    rows = result["rows"]
    _finish(rows, ctx.stall_reference_gbps)
    ddp_sync = next(
        row["ms"] for row in rows if row["label"] == f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}" and row["panel"] == "resnet50-sync"
    )
    shapes = "tiny shapes (--quick)" if ctx.quick else "ResNet-50"
    for row in rows:
        row["what"] = {
            "resnet50-sync": f"{shapes} gradients, cheap forward",
            "cnn-step": "small CNN training step",
            "hook-cost": f"per-gradient host cost, {HOOK_PARAMS} x {HOOK_NUMEL}-element parameters",
        }[row["panel"]]
        sync = row.get("sync_ms")
        row["us_per_grad"] = sync * 1e3 / HOOK_PARAMS if row["panel"] == "hook-cost" and sync is not None else None
    notes = [
        f"{WORLD_SIZE} ranks, {backend}"
        + (", one GPU each." if backend == "nccl" else f", one process each on this {os.cpu_count()}-core CPU "
           f"({max(1, (os.cpu_count() or 1) // WORLD_SIZE)} torch thread per rank)."),
        f"Sync rows: {shapes} gradient shapes ({result['tensors']} float32 tensors, {result['mbytes']:.1f} MB); "
        "forward = each parameter times a scalar, summed, so a step is mostly backward + gradient synchronisation. "
        "step ms = zero_grad + forward + backward + synchronisation (the all-reduces tfuse and DDP overlap with "
        "backward); sync ms = step ms minus the 'backward only' row (flagged when it is within the two rows' "
        "spread, or below zero by more than it).",
        f"CNN rows: a whole training step (zero_grad, forward, cross-entropy, backward, SGD momentum 0.9) of a "
        f"3-conv CNN on a {8 if ctx.quick else 32}x3x32x32 batch per rank.",
        f"Every step's time is the slowest rank's; a time is the median over {result['rounds']} rounds x "
        f"{result['iterations']} steps, ± half the interquartile range relative to it, rounds cycling through all "
        "configurations from a different start each (so drift on a shared machine hits them all alike). "
        "calls = all-reduce calls per step (DDP: its buckets after the rebuild).",
        f"Per-gradient rows: {HOOK_PARAMS} parameters of {HOOK_NUMEL} elements (one bucket, a 12.8 KB all-reduce), so "
        "that a step is mostly per-tensor work; us/grad = (step - backward only) / parameters: what the wrapper "
        "spends per gradient (DDP in C++, tfuse in one Python hook), plus the one small all-reduce.",
        "vs DDP = step time / the DDP row of the same block (below 1: faster than DDP): DDP bucket_cap_mb="
        f"{DDP_BUCKET_MB} for the sync rows, DDP with torch's fused SGD for the CNN rows.",
    ]
    if backend == "gloo":
        notes.append(
            "CPU run: both ranks, their gloo threads and backward share the same cores, so overlapping "
            "communication with backward buys less than on GPUs, where NCCL runs beside the compute. "
            f"A {CANARY_BYTES >> 20} MiB copy per rank, timed in the same rounds, checks that the machine did not stall "
            "(a stalled row is marked implausible)."
        )
    columns = [
        Column("what", "what"), Column("label", "configuration"), Column("calls", "all-reduce calls"),
        Column("ms", "step ms", "{:.1f}", spread=True), Column("sync_ms", "sync ms", "{:.1f}"),
        Column("us_per_grad", "us/grad", "{:.1f}"), Column("vs_ddp", "vs DDP", "{:.2f}x"), CHECK_COLUMN,
    ]
    plotted = [dict(row, plot=bool(row["sweep"])) for row in rows]
    return Report(
        name=NAME, title="Gradient all-reduce: per-tensor vs tfuse FusedDataParallel vs torch DDP",
        notes=notes, columns=columns, rows=plotted, plot_panels="sweep", plot_x="x",
        plot_lines=[("step_ms", "tfuse FusedDataParallel step")], plot_xlabel="bucket_mb / max_params_per_bucket",
        plot_ylabel="ms per step", reference_line=(ddp_sync, f"torch DDP bucket_cap_mb={DDP_BUCKET_MB}"),
        timing_note=(
            f"Timing: see the notes above. A number marked (noisy) has an interquartile range over {NOISY_REL_IQR:.0%} of its median, "
            "or is a difference within the spread; (implausible) is physically impossible (a time at or below zero, "
            "a synchronisation below zero by more than the spread, a stalled machine). Marked numbers are not results."
        ),
    )

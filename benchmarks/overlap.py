"""Benchmark of ``FusedDataParallel.overlap_step``: the optimizer stepped bucket by bucket during backward.

Launches its own ranks (2 processes, gloo on the CPU; NCCL with one GPU per
rank when the machine has two or more GPUs) and times one whole training step
as a user runs it (forward, backward, ``optimizer.step()``,
``optimizer.zero_grad()``) for three setups, interleaved round by round:

1. torch DDP (``gradient_as_bucket_view=True``, the same bucket size) with
   ``torch.optim.SGD(momentum=0.9, fused=True)``;
2. :class:`tfuse.distributed.FusedDataParallel` with
   :class:`tfuse.optim.FusedMomentum`, stepped after backward (plain);
3. the same with ``model.overlap_step(optimizer)``: each bucket's update runs
   as soon as its all-reduce has landed, during backward.

Two workloads: ResNet-50's gradient set (ResNet-50's 161 parameter shapes,
25.6M elements; from torchvision when it is installed) behind a cheap forward
(each parameter times a per-parameter scalar, summed), so that backward
produces every gradient in reverse order and a step is communication plus the
optimizer, 25 MB buckets; and a small CNN (conv/BN/ReLU x 4, a linear head)
with a real backward at a small batch. ``--quick`` narrows ResNet-50's
channels by 8 (the same 161 tensors, 0.4M elements, 0.4 MB buckets) and
shrinks the CNN's batch.

Before timing, every setup runs CHECK_STEPS steps (the warm-up: DDP rebuilds
its buckets after its first iteration, and the first step after
``overlap_step`` is a plain one that probes for a GradScaler or clipping);
then the overlapped and the plain FusedMomentum must hold bit-identical
parameters and momentum buffers on every rank, and the overlapped one must
have stepped every bucket ahead, or the run fails: the table never shows a
broken overlap. On a CPU the ranks run tfuse's PyTorch path (torch's fused
CPU kernels, ``TFUSE_BACKEND=torch``, see ranks.py), not Triton's
interpreter; the Triton launches of a step are counted and must be 0.

Timing is allreduce.py's: a fixed number of steps per round with a barrier
before each, the slowest rank's time, rounds cycling through the setups of a
workload (and a copy canary on a CPU) from a different start each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .allreduce import _canary, _CheapModel, _ddp_bucket_count
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
    worse_flag,
)
from .ranks import launch, rank_group, time_steps, step_flag_from

NAME = "overlap"
WORLD_SIZE = 2
CANARY = "copy canary"
SGD = dict(lr=0.01, momentum=0.9)
CHECK_STEPS = 3  # steps before the bit-identity check; the warm-up of every setup (>= 2: the first one probes)
RESNET = "ResNet-50 gradient set"
CNN = "small CNN"
# FusedDataParallel's bucket_mb is in 10**6 bytes; DDP's bucket_cap_mb in MiB: DDP gets the same bytes.
BUCKET_MB = {RESNET: 25.0, CNN: 0.25}
QUICK_BUCKET_MB = {RESNET: 0.4, CNN: 0.25}
QUICK_NARROWING = 8  # --quick: ResNet-50's channel counts (those >= 64) divided by this
CNN_BATCH = {False: (16, 32), True: (4, 16)}  # (batch per rank, image side), full and --quick
DDP = "torch DDP + torch SGD(momentum=0.9, fused=True)"
PLAIN = "tfuse FusedDataParallel + FusedMomentum"
OVERLAP = "tfuse FusedDataParallel + FusedMomentum, overlap_step"
SETUPS = (DDP, PLAIN, OVERLAP)
RESNET50_TENSORS, RESNET50_ELEMENTS = 161, 25_557_032


@dataclasses.dataclass
class _Setup:
    label: str
    step: Callable[[], None]
    calls: Callable[[], int | None] = lambda: None  # all-reduce calls (buckets) per step
    ahead: Callable[[], Any] = lambda: None  # (buckets stepped ahead, of which during backward) in the last pass


class _PerParameterScale(_CheapModel):
    """ResNet-50's parameters; forward = sum over parameters of (parameter x its own scalar input), summed."""

    def forward(self, scales: torch.Tensor) -> torch.Tensor:
        return torch.stack([(weight * scale).sum() for weight, scale in zip(self.weights, scales.unbind())]).sum()


def resnet50_shapes() -> tuple[list[tuple[int, ...]], str]:
    """ResNet-50's parameter shapes in registration order, and where they came from (torchvision if installed)."""
    try:
        import torchvision
    except ImportError:
        from .optim import resnet50_shapes as hard_coded

        shapes, source = hard_coded(), "hard-coded (torchvision is not installed)"
    else:
        model = torchvision.models.resnet50(weights=None)
        shapes, source = [tuple(p.shape) for p in model.parameters()], f"torchvision {torchvision.__version__}"
    elements = sum(torch.Size(s).numel() for s in shapes)
    if (len(shapes), elements) != (RESNET50_TENSORS, RESNET50_ELEMENTS):
        raise AssertionError(f"overlap benchmark: ResNet-50 shapes from {source}: {len(shapes)} tensors, {elements} "
                             f"elements, expected {RESNET50_TENSORS} and {RESNET50_ELEMENTS}")
    return shapes, source


def narrowed(shapes: list[tuple[int, ...]], factor: int) -> list[tuple[int, ...]]:
    """``shapes`` with every dimension of 64 or more divided by ``factor`` (channels, classes; not kernels, not RGB)."""
    return [tuple(max(1, d // factor) if d >= 64 else d for d in shape) for shape in shapes]


def small_cnn(device: torch.device) -> torch.nn.Module:
    """Four conv (no bias) + BatchNorm + ReLU blocks and a linear head; the same weights on every call."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    channels = 3
    for width, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
        layers += [torch.nn.Conv2d(channels, width, 3, stride=stride, padding=1, bias=False),
                   torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
        channels = width
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)]
    return torch.nn.Sequential(*layers).to(device)


def _workload(name: str, device: torch.device, quick: bool) -> tuple[Callable[[], torch.nn.Module],
                                                                      Callable[[torch.nn.Module], torch.Tensor],
                                                                      dict[str, Any]]:
    """(build the model, its loss, what the table says about it); every rank builds the same weights."""
    rank = dist.get_rank()
    if name == RESNET:
        shapes, source = resnet50_shapes()
        if quick:
            shapes, source = narrowed(shapes, QUICK_NARROWING), f"{source}, channels / {QUICK_NARROWING} (--quick)"
        # Per rank and per parameter: every gradient differs, between ranks too (so the all-reduce matters).
        scales = (1.0 + rank + torch.arange(len(shapes), dtype=torch.float32) / len(shapes)).to(device)
        info = dict(tensors=len(shapes), numel=sum(torch.Size(s).numel() for s in shapes), source=source)
        return (lambda: _PerParameterScale(shapes, device)), (lambda model: model(scales)), info
    batch, side = CNN_BATCH[quick]
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(batch, 3, side, side, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    params = list(small_cnn(device).parameters())
    info = dict(tensors=len(params), numel=sum(p.numel() for p in params), batch=batch, side=side)
    return (lambda: small_cnn(device)), (lambda model: loss_fn(model(images), labels)), info


def _setups(build: Callable[[], torch.nn.Module], loss: Callable[[torch.nn.Module], torch.Tensor],
            bucket_mb: float) -> tuple[list[_Setup], dict[str, Any]]:
    """The three setups of one workload, and the models and optimizers the check reads."""
    from tfuse.distributed import FusedDataParallel
    from tfuse.optim import FusedMomentum

    def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:  # the whole step, as a user writes it
            loss(model).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    # gradient_as_bucket_view: DDP's gradients are views of its buckets, as FusedDataParallel's are (no copies).
    ddp = torch.nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=bucket_mb * 1e6 / 2**20,
                                                    gradient_as_bucket_view=True)
    ddp_sgd = torch.optim.SGD(ddp.parameters(), fused=True, **SGD)
    plain = FusedDataParallel(build(), bucket_mb=bucket_mb)
    plain_opt = FusedMomentum(plain.parameters(), **SGD)
    overlapped = FusedDataParallel(build(), bucket_mb=bucket_mb)
    overlap_opt = FusedMomentum(overlapped.parameters(), **SGD)
    overlapped.overlap_step(overlap_opt)
    setups = [
        _Setup(DDP, make_step(ddp, ddp_sgd), lambda: _ddp_bucket_count(ddp)),
        _Setup(PLAIN, make_step(plain, plain_opt), lambda: plain.num_allreduce_calls),
        _Setup(OVERLAP, make_step(overlapped, overlap_opt), lambda: overlapped.num_allreduce_calls,
               lambda: (_stepped_ahead(overlapped), _stepped_in_backward(overlapped))),
    ]
    return setups, dict(plain=plain, plain_opt=plain_opt, overlapped=overlapped, overlap_opt=overlap_opt)


def _stepped_ahead(model: torch.nn.Module) -> int | None:
    """Buckets the overlap stepped in the last synchronizing backward (private API: None if it is gone)."""
    overlap = getattr(getattr(model, "_reducer", None), "overlap", None)
    return getattr(overlap, "stepped_buckets", None)


def _stepped_in_backward(model: torch.nn.Module) -> int | None:
    """Of those, the buckets stepped while backward still ran (the others were stepped when it ended)."""
    overlap = getattr(getattr(model, "_reducer", None), "overlap", None)
    return getattr(overlap, "stepped_in_backward", None)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return [value for key in sorted(state) for _, value in sorted(state[key].items())
            if isinstance(value, torch.Tensor)]


def check_overlap_identical(models: dict[str, Any], workload: str) -> str:
    """Raises AssertionError on every rank unless, on every rank, the overlapped and the plain setup hold
    bit-identical parameters and momentum buffers and the overlap stepped every bucket ahead.

    Returns what it checked, in words.
    """
    plain, overlapped = models["plain"], models["overlapped"]
    pairs = list(zip(plain.parameters(), overlapped.parameters()))
    state_pairs = list(zip(_state_tensors(models["plain_opt"]), _state_tensors(models["overlap_opt"])))
    problems = []
    differing = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    if differing:
        problems.append(f"{len(differing)} of {len(pairs)} parameters differ (first: #{differing[0]})")
    if not state_pairs or any(not torch.equal(a, b) for a, b in state_pairs):
        problems.append("momentum buffers differ or are missing")
    ahead, buckets = _stepped_ahead(overlapped), overlapped.num_allreduce_calls
    if ahead is not None and ahead != buckets:
        problems.append(f"the overlap stepped {ahead} of {buckets} buckets ahead (not engaged)")
    failed = torch.tensor([int(bool(problems))], device=next(iter(plain.parameters())).device)
    dist.all_reduce(failed)  # every rank raises together (a lone raise would leave the other at a barrier)
    if failed.item():
        here = "; ".join(problems) or "on another rank"
        raise AssertionError(f"overlap benchmark, {workload}: overlapped and plain FusedMomentum disagree after "
                             f"{CHECK_STEPS} steps on {int(failed.item())} rank(s): {here}")
    return (f"{workload}: overlapped and plain FusedMomentum bit-identical after {CHECK_STEPS} steps on each of the "
            f"{dist.get_world_size()} ranks ({len(pairs)} parameters, {len(state_pairs)} momentum buffers; "
            f"{'every bucket' if ahead is None else f'{ahead} of {buckets} buckets'} stepped ahead)")


def _triton_launches(setups: list[_Setup]) -> dict[str, int]:
    """Triton launches of one step of each setup (through the interpreter they would not be a timing)."""
    import tfuse

    counts = {}
    for setup in setups:
        with tfuse.count_launches() as launches:
            setup.step()
        counts[setup.label] = launches.total
    return counts


def _rank_main(rank: int, world: int, backend: str, init_file: str, out_file: str, quick: bool) -> None:
    with rank_group(rank, world, backend, init_file) as device:
        rounds, iterations = (3, 2) if quick else (20, 3)
        rows, checks, workloads = [], [], {}
        for workload in (RESNET, CNN):  # one at a time: ResNet-50's three copies take ~1 GB a rank
            build, loss, info = _workload(workload, device, quick)
            bucket_mb = (QUICK_BUCKET_MB if quick else BUCKET_MB)[workload]
            setups, models = _setups(build, loss, bucket_mb)
            for setup in setups:  # the warm-up, and the steps the check compares
                for _ in range(CHECK_STEPS):
                    setup.step()
            checks.append(check_overlap_identical(models, workload))
            if rank == 0:
                print(f"[overlap] checked: {checks[-1]}", file=sys.stderr, flush=True)
            launches = _triton_launches(setups)
            if backend == "gloo" and any(launches.values()):
                raise AssertionError(f"overlap benchmark: Triton launches in a CPU step {launches}; the timing must "
                                     "run tfuse's PyTorch path, not the interpreter")
            if backend == "gloo":
                setups.append(_Setup(CANARY, _canary(device).step))
            samples = time_steps([s.step for s in setups], device, rounds, iterations, f"overlap {workload},")
            workloads[workload] = dict(info, bucket_mb=bucket_mb, optimizer=models["plain_opt"].describe())
            rows += [dict(workload=workload, label=s.label, samples=times, calls=s.calls(), ahead=s.ahead(),
                          launches=launches.get(s.label)) for s, times in zip(setups, samples)]
            del setups, models
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "rounds": rounds, "iterations": iterations,
                                                  "checks": checks, "workloads": workloads}))


def _launch(backend: str, quick: bool) -> dict[str, Any]:
    return launch("overlap", _rank_main, WORLD_SIZE, backend, quick, deadline_s=300 if quick else 1200)


def finish(rows: list[dict[str, Any]], stall_reference_gbps: float | None) -> list[dict[str, Any]]:
    """Medians, spreads, ratios to DDP and flags per workload; drops the canary rows, flagging a workload's rows
    when its canary shows a stalled machine."""
    finished = []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        block = [row for row in rows if row["workload"] == workload]
        timings = {row["label"]: Timing(tuple(row.pop("samples"))) for row in block}
        if len(timings) != len(block):
            raise ValueError(f"overlap benchmark: two rows of {workload} share a label")
        stall = check_stall(timings[CANARY], stall_reference_gbps) if CANARY in timings else None
        block = [row for row in block if row["label"] != CANARY]
        for row in block:
            timing = timings[row["label"]]
            row["ms"], row["ms_range"] = timing.median, timing.quartiles
            row["min_max"] = f"{timing.lo:.1f}–{timing.hi:.1f}"
            row["flags"] = {}
            flag = stall or check_timing("step", timing)
            if flag is not None:
                row["flags"]["ms"] = flag
        ddp = next(row for row in block if row["label"] == DDP)
        for row in block:
            row["vs_ddp"] = row["ms"] / ddp["ms"]
            flag = worse_flag(row["flags"].get("ms"), step_flag_from(ddp, row))
            if flag is not None:
                row["flags"]["vs_ddp"] = flag
            ahead = row.get("ahead")
            if isinstance(ahead, (tuple, list)):  # (a list once it has been through JSON)
                row["stepped_ahead"] = f"{ahead[0]} of {row['calls']} ({ahead[1]} in backward)"
            else:
                row["stepped_ahead"] = f"{ahead} of {row['calls']}" if ahead is not None else None
        finished += block
    return finished


def run(ctx: Context) -> Report:
    multi_gpu = ctx.machine.on_gpu and torch.cuda.device_count() >= WORLD_SIZE
    backend = "nccl" if multi_gpu else "gloo"
    result = _launch(backend, ctx.quick)
    return report(result, backend, ctx)


def report(result: dict[str, Any], backend: str, ctx: Context) -> Report:
    """The table of a run's result (what rank 0 wrote)."""
    rows = finish(result["rows"], ctx.stall_reference_gbps)
    resnet, cnn = result["workloads"][RESNET], result["workloads"][CNN]
    threads = max(1, (os.cpu_count() or 1) // WORLD_SIZE)
    for row in rows:
        row["what"] = row["workload"] + (" (--quick)" if ctx.quick and row["workload"] == RESNET else "")
    launches = {row["launches"] for row in rows if row.get("launches") is not None}
    notes = [
        f"{WORLD_SIZE} ranks, {backend}"
        + (", one GPU each." if backend == "nccl" else f", one process each on this {os.cpu_count()}-core CPU "
           f"({threads} torch thread{'s' if threads != 1 else ''} per rank)."),
        "step ms = one whole training step as a user runs it: forward, backward (the all-reduces overlap it), "
        "optimizer.step(), optimizer.zero_grad(); SGD lr 0.01, momentum 0.9.",
        f"{RESNET}: {resnet['tensors']} float32 tensors, {resnet['numel'] / 1e6:.2f}M elements "
        f"({resnet['numel'] * 4 / 1e6:.1f} MB; shapes {resnet['source']}); forward = each parameter times its own "
        "scalar input, summed, so backward yields every gradient in reverse order and a step is mostly "
        f"communication and the optimizer. Buckets: {resnet['bucket_mb']:g} MB.",
        f"{CNN}: 4 x (3x3 conv, BatchNorm, ReLU), 32-64-128-256 channels, and a linear head ({cnn['tensors']} tensors, "
        f"{cnn['numel'] / 1e3:.0f}K elements); cross-entropy on a {cnn['batch']}x3x{cnn['side']}x{cnn['side']} batch "
        f"per rank. Buckets: {cnn['bucket_mb']:g} MB.",
        f"Setups: {DDP} (gradient_as_bucket_view=True; bucket_cap_mb set to the same bytes, in MiB); "
        f"{PLAIN} (stepped after backward); {OVERLAP} (model.overlap_step(optimizer): each "
        "bucket stepped as soon as its all-reduce lands, during backward; optimizer.step() steps what is left). "
        "all-reduce calls = buckets per step (DDP: after its rebuild); stepped ahead = buckets the overlap stepped in "
        "the last timed backward (in backward: while backward still ran; the others when it ended).",
        "Checked before timing, after a warm-up of "
        f"{CHECK_STEPS} steps per setup (the first step after overlap_step is a plain one): "
        + "; ".join(result["checks"]) + ".",
        "tfuse's optimizer: " + "; ".join(f"{name}: {info['optimizer']}" for name, info in result["workloads"].items())
        + "."
        + (f" Triton launches counted in one step of each setup: {', '.join(str(n) for n in sorted(launches))}."
           if launches else ""),
        f"Every step's time is the slowest rank's; a time is the median over {result['rounds']} rounds x "
        f"{result['iterations']} steps, ± half the interquartile range relative to it (min–max: the fastest and "
        "slowest step), rounds cycling through the setups of a workload from a different start each.",
        "vs DDP = step time over the DDP row of the same workload (below 1: faster than DDP).",
    ]
    if backend == "gloo":
        notes.append(
            f"CPU run: both ranks, gloo's threads, backward and the optimizer share the same {os.cpu_count()} cores, "
            "so an update overlapped with communication competes with it for the cores; on GPUs NCCL runs beside the "
            f"compute. tfuse runs its PyTorch path (TFUSE_BACKEND=torch: torch's fused CPU kernels), not Triton's "
            f"interpreter. A {CANARY_BYTES >> 20} MiB copy per rank, timed in the same rounds, checks that the machine "
            "did not stall (a stalled row is marked implausible)."
        )
    columns = [
        Column("what", "workload"), Column("label", "setup"), Column("calls", "all-reduce calls"),
        Column("stepped_ahead", "stepped ahead"), Column("ms", "step ms", "{:.1f}", spread=True),
        Column("min_max", "min–max ms"), Column("vs_ddp", "vs DDP", "{:.2f}x"), CHECK_COLUMN,
    ]
    short = {DDP: "torch DDP", PLAIN: "tfuse FDP", OVERLAP: "tfuse FDP, overlap_step"}
    plotted = [dict(row, step_ms=row["ms"], step_ms_range=row["ms_range"], short=short[row["label"]],
                    flags=dict(row["flags"], **({"step_ms": row["flags"]["ms"]} if "ms" in row["flags"] else {})))
               for row in rows]
    return Report(
        name=NAME,
        title="Overlapped optimizer step: FusedDataParallel.overlap_step vs plain FusedMomentum vs torch DDP",
        notes=notes, columns=columns, rows=plotted, plot_panels="what", plot_x="short",
        plot_lines=[("step_ms", "step time")], plot_xlabel="setup", plot_ylabel="ms per training step",
        timing_note=(
            f"Timing: see the notes above. A number marked (noisy) has an interquartile range over {NOISY_REL_IQR:.0%} "
            "of its median (or derives from one); (implausible) is physically impossible (a time at or below zero, a "
            "stalled machine). Marked numbers are not results."
        ),
    )

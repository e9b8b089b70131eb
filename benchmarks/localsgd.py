"""Benchmark of tfuse's LocalSGD against every-step FusedDataParallel.

Launches its own ranks (2 processes, gloo on the CPU; NCCL with one GPU per
rank when the machine has two or more GPUs) and measures, in one run:

1. communication, on ResNet-50's parameter set (tiny shapes with --quick) and
   a cheap forward (each parameter times a scalar, summed): bytes sent per
   training step and communication time per step, for every-step
   FusedDataParallel (its bucket all-reduces) and LocalSGD with k = 1, 4, 16
   (one sync's collectives, divided by k); plus the whole step time over 16
   iterations (so every k's syncs are included in proportion);
2. a short real training run of a small CNN on a learnable synthetic task
   (labels from a fixed random linear map of the channel means), every-step
   FusedDataParallel against LocalSGD at each k, the same data on each rank
   for every configuration: the final training loss and the accuracy on a
   held-out set.

Communication is timed on its own (barrier, the collectives, the slowest
rank), not subtracted from a step, so the ratio compares what each scheme
sends, not how much of it a CPU could overlap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .allreduce import _CheapModel, _small_cnn
from .harness import CHECK_COLUMN, NOISY_REL_IQR, Column, Context, Report, Timing, check_timing, round_order
from .ranks import launch, rank_group

NAME = "localsgd"
WORLD_SIZE = 2
KS = (1, 4, 16)
WINDOW = 16  # iterations per timed sample: a multiple of every k
EVERY_STEP = "FusedDataParallel (every-step all-reduce)"
SGD = dict(lr=0.05, momentum=0.9)


@dataclasses.dataclass
class _Config:
    label: str
    k: int | None
    step: Callable[[], None]
    communicate: Callable[[], None]  # one step's worth of collectives (a sync for LocalSGD: divided by k)
    bytes_per_step: float


def _local_label(k: int) -> str:
    return f"LocalSGD k={k}"


def _communication_configs(shapes: list[tuple[int, ...]], device: torch.device) -> list[_Config]:
    from tfuse.distributed import FusedDataParallel, LocalSGD
    from tfuse.optim import FusedMomentum

    scale = torch.tensor(1.0 + dist.get_rank(), device=device)

    def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, after: Callable[[], Any]):
        def step() -> None:
            optimizer.zero_grad()
            model(scale).backward()
            after()

        return step

    fdp = FusedDataParallel(_CheapModel(shapes, device))
    fdp_opt = FusedMomentum(fdp.parameters(), **SGD)

    def fdp_collectives() -> None:
        for bucket in fdp.buckets:  # what its backward issues, one all-reduce per bucket
            dist.all_reduce(bucket.grad)

    grad_bytes = sum(b.grad.numel() * b.grad.element_size() for b in fdp.buckets)
    configs = [_Config(EVERY_STEP, None, make_step(fdp, fdp_opt, fdp_opt.step), fdp_collectives, grad_bytes)]
    for k in KS:
        model = _CheapModel(shapes, device)
        optimizer = FusedMomentum(model.parameters(), **SGD)
        local = LocalSGD(model, optimizer, sync_every=k)
        configs.append(_Config(_local_label(k), k, make_step(model, optimizer, local.step), local.sync,
                               local.bytes_per_sync / k))
    return configs


def _slowest(samples: list[list[float]], device: torch.device) -> list[list[float]]:
    slowest = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.cpu().tolist()


def _timed(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - begin) * 1e3 / repeats


def _measure(configs: list[_Config], device: torch.device, rounds: int) -> tuple[list[list[float]], list[list[float]]]:
    """Per config: step-time samples (ms per iteration over WINDOW iterations) and communication-time samples
    (ms per step); rounds cycle through the configurations from a different start each."""
    for config in configs:  # warm-up
        config.step()
        config.communicate()
    steps: list[list[float]] = [[] for _ in configs]
    comms: list[list[float]] = [[] for _ in configs]
    start = time.perf_counter()
    for round_index in range(rounds):
        if dist.get_rank() == 0:
            print(f"[localsgd round {round_index + 1}/{rounds}, {time.perf_counter() - start:.0f} s] "
                  f"{len(configs)} configurations x {WINDOW} steps", file=sys.stderr, flush=True)
        for index in round_order(round_index, len(configs)):
            config = configs[index]
            steps[index].append(_timed(config.step, WINDOW, device))
            comms[index].append(_timed(config.communicate, 1, device) / (config.k or 1))
    return _slowest(steps, device), _slowest(comms, device)


# ---------------------------------------------------------------------------- training


def _task(device: torch.device, samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of a learnable task: noise plus a random shade per channel; label = argmax of a fixed
    linear map of the three channel means (a small CNN reaches ~60% held-out accuracy in 96 steps)."""
    teacher = torch.randn(10, 3, generator=torch.Generator().manual_seed(7))
    images = torch.randn(samples, 3, 16, 16, generator=generator) + torch.randn(samples, 3, 1, 1, generator=generator)
    labels = (images.mean((2, 3)) @ teacher.T).argmax(1)
    return images.to(device), labels.to(device)


def _train(label: str, k: int | None, device: torch.device, steps: int, batch: int) -> dict[str, Any]:
    from tfuse.distributed import FusedDataParallel, LocalSGD
    from tfuse.optim import FusedMomentum

    rank = dist.get_rank()
    if k is None:
        model = FusedDataParallel(_small_cnn(device))
        optimizer = FusedMomentum(model.parameters(), **SGD)
        advance = optimizer.step
    else:
        model = _small_cnn(device)
        optimizer = FusedMomentum(model.parameters(), **SGD)
        advance = LocalSGD(model, optimizer, sync_every=k).step
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data, the same for every config
    losses = []
    for _ in range(steps):
        images, labels = _task(device, batch, generator)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        advance()
        losses.append(loss.detach())
    tail = torch.stack(losses[-8:]).mean().reshape(1)
    dist.all_reduce(tail)
    eval_images, eval_labels = _task(device, 512, torch.Generator().manual_seed(999))
    with torch.no_grad():
        net = model.module if k is None else model
        accuracy = (net(eval_images).argmax(1) == eval_labels).float().mean().item()
    return {"label": label, "k": k, "final_loss": tail.item() / dist.get_world_size(), "accuracy": accuracy}


def _rank_main(rank: int, world: int, backend: str, init_file: str, out_file: str, quick: bool) -> None:
    from .optim import resnet50_shapes, tiny_shapes

    with rank_group(rank, world, backend, init_file) as device:
        shapes = tiny_shapes() if quick else resnet50_shapes()
        rounds = 3 if quick else 5
        configs = _communication_configs(shapes, device)
        steps, comms = _measure(configs, device, rounds)
        rows = [{"part": "communication", "label": c.label, "k": c.k, "bytes_per_step": c.bytes_per_step,
                 "steps": s, "comms": m} for c, s, m in zip(configs, steps, comms)]
        del configs
        train_steps, batch = (16, 8) if quick else (96, 32)
        for label, k in [(EVERY_STEP, None)] + [(_local_label(k), k) for k in KS]:
            rows.append({"part": "training", **_train(label, k, device, train_steps, batch)})
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "rounds": rounds, "train_steps": train_steps,
                                                  "batch": batch, "tensors": len(shapes),
                                                  "numel": sum(torch.Size(s).numel() for s in shapes)}))


def _finish(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians, spreads, ratios to every-step synchronisation and flags; training rows joined to their config."""
    timing = [row for row in rows if row["part"] == "communication"]
    training = {row["label"]: row for row in rows if row["part"] == "training"}
    for row in timing:
        step, comm = Timing(tuple(row.pop("steps"))), Timing(tuple(row.pop("comms")))
        row["step_ms"], row["step_ms_range"] = step.median, step.quartiles
        row["comm_ms"], row["comm_ms_range"] = comm.median, comm.quartiles
        row["flags"] = {}
        for key, value in (("step_ms", step), ("comm_ms", comm)):
            flag = check_timing(key, value)
            if flag is not None:
                row["flags"][key] = flag
        trained = training.get(row["label"], {})
        row["final_loss"], row["accuracy"] = trained.get("final_loss"), trained.get("accuracy")
    every = next(row for row in timing if row["k"] is None)
    for row in timing:
        row["mb_per_step"] = row["bytes_per_step"] / 1e6
        row["comm_vs_every_step"] = row["comm_ms"] / every["comm_ms"]
        row["bytes_vs_every_step"] = row["bytes_per_step"] / every["bytes_per_step"]
        row["k_text"] = "every step" if row["k"] is None else str(row["k"])
        row["x"] = 0 if row["k"] is None else row["k"]
    return timing


def run(ctx: Context) -> Report:
    multi_gpu = ctx.machine.on_gpu and torch.cuda.device_count() >= WORLD_SIZE
    backend = "nccl" if multi_gpu else "gloo"
    result = launch(NAME, _rank_main, WORLD_SIZE, backend, ctx.quick, deadline_s=300 if ctx.quick else 1800)
    rows = _finish(result["rows"])
    notes = [
        f"{WORLD_SIZE} ranks, {backend}"
        + (", one GPU each." if backend == "nccl" else f", one process each on this {os.cpu_count()}-core CPU "
           f"({max(1, (os.cpu_count() or 1) // WORLD_SIZE)} torch thread per rank; tfuse on its PyTorch path, "
           "TFUSE_BACKEND=torch)."),
        f"Communication part: {'ResNet-50' if not ctx.quick else 'tiny (--quick)'} parameter set, "
        f"{result['tensors']} float32 tensors, {result['numel'] / 1e6:.1f}M elements, a cheap forward (each "
        "parameter times a scalar, summed), FusedMomentum (lr 0.05, momentum 0.9). MB/step = bytes all-reduced per "
        "training step: the gradient buckets every step for FusedDataParallel, one sync's bytes (the flat parameter "
        "buffer's trainable range, once) divided by k for LocalSGD.",
        "comm ms/step = the collectives of one step, timed on their own (barrier, then FusedDataParallel's bucket "
        "all-reduces, or one LocalSGD sync divided by k), the slowest rank; comm vs every step = that over the "
        "FusedDataParallel row's. step ms = a whole training step averaged over 16 iterations (so LocalSGD's "
        "syncs are included in proportion).",
        f"Training part: the small CNN of the allreduce benchmark on a learnable synthetic task (3x16x16 noise plus a "
        "random shade per channel; label = argmax of a fixed random linear map of the three channel means), "
        f"{result['train_steps']} steps of "
        f"{result['batch']} images per rank, each rank its own data, the same for every configuration; final loss "
        "= mean training loss of the last 8 steps over the ranks; accuracy on 512 held-out images after the last "
        "step (a multiple of every k, so the ranks hold the same model).",
        f"Times are medians over {result['rounds']} rounds cycling through the configurations from a different "
        "start each, ± half the interquartile range relative to the median.",
    ]
    if backend == "gloo":
        notes.append(
            "CPU run: both ranks, their gloo threads and the training share the same cores, so a CPU shows what each "
            "scheme sends and how long gloo takes for it, not the overlap a GPU machine would get."
        )
    columns = [
        Column("label", "configuration"), Column("k_text", "sync every"),
        Column("mb_per_step", "MB/step", "{:.2f}"), Column("bytes_vs_every_step", "bytes vs every step", "{:.3f}x"),
        Column("comm_ms", "comm ms/step", "{:.2f}", spread=True),
        Column("comm_vs_every_step", "comm vs every step", "{:.3f}x"),
        Column("step_ms", "step ms", "{:.1f}", spread=True),
        Column("final_loss", "final loss", "{:.3f}"), Column("accuracy", "held-out accuracy", "{:.1%}"),
        CHECK_COLUMN,
    ]
    plotted = [dict(row, panel="communication per step", comm=row["comm_ms"]) for row in rows]
    return Report(
        name=NAME,
        title="LocalSGD: communication per step and training against every-step FusedDataParallel",
        notes=notes, columns=columns, rows=plotted, plot_panels="panel", plot_x="x",
        plot_lines=[("comm", "comm ms/step"), ("step_ms", "step ms")],
        plot_xlabel="sync every k iterations (0: every-step FusedDataParallel)", plot_ylabel="ms",
        timing_note=(
            f"Timing: see the notes above. A number marked (noisy) has an interquartile range over {NOISY_REL_IQR:.0%} "
            "of its median; marked numbers are not results."
        ),
    )

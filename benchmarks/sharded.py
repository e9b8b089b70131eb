"""Benchmark of tfuse's ShardedOptimizer against unsharded FusedDataParallel and torch's ZeroRedundancyOptimizer.

Launches its own ranks (2 processes, gloo on the CPU; NCCL with one GPU per
rank when the machine has two or more GPUs) and measures, in one run, for
ResNet-50's and GPT-2 small's parameter sets (tiny shapes with --quick),
each with a cheap forward (each parameter times a scalar, summed) so that a
step is mostly backward + gradient synchronisation + Adam:

1. optimizer-state bytes per rank (the largest over the ranks: torch's
   ZeroRedundancyOptimizer assigns whole parameters to ranks, so its shares
   can be uneven);
2. the tensor bytes a rank holds during a step (parameters, gradients,
   optimizer state), computed from the tensors, not measured: torch has no
   allocator statistics for CPU memory, and a process's peak RSS covers every
   configuration of the run at once;
3. step time of ``ShardedOptimizer(FusedAdam)`` on a plain model (it reduces
   the gradients itself), ``FusedDataParallel`` + ``FusedAdam`` (unsharded),
   and torch DDP + ``ZeroRedundancyOptimizer(Adam)`` with
   ``overlap_with_ddp=False``.

Timing is allreduce.py's: a fixed number of steps per round with a barrier
before each, the slowest rank's time, rounds cycling through every
configuration of a parameter set from a different start each.
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

from .allreduce import _canary, _CheapModel
from .harness import (
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

NAME = "sharded"
WORLD_SIZE = 2
CANARY = "copy canary"
ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
SHARDED = "tfuse ShardedOptimizer(FusedAdam)"
SHARDED_FDP = "tfuse FusedDataParallel + ShardedOptimizer(FusedAdam)"
SHARDED_FDP_ALLREDUCE = "tfuse FusedDataParallel + ShardedOptimizer(FusedAdam, reduce='all_reduce')"
UNSHARDED = "tfuse FusedDataParallel + FusedAdam (unsharded)"
ZERO = "torch DDP + ZeroRedundancyOptimizer(Adam)"


@dataclasses.dataclass
class _Config:
    label: str
    model: str  # the parameter set: "ResNet-50", "GPT-2 small" or "tiny (--quick)"
    step: Callable[[], None]
    state_bytes: int = 0  # this rank's optimizer state
    held_bytes: int = 0  # parameters + gradients + optimizer state on this rank


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _torch_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch.optim optimizer's per-parameter state tensors (Adam's moments and its step counts)."""
    return sum(_tensor_bytes(state.values()) for state in optimizer.state.values())


def _configs(model_name: str, shapes: list[tuple[int, ...]], device: torch.device) -> list[_Config]:
    """The five steps for one parameter set; each rank builds the same models (same seed)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tfuse.distributed import FusedDataParallel, ShardedOptimizer
    from tfuse.optim import FusedAdam

    scale = torch.tensor(1.0 + dist.get_rank(), device=device)
    param_bytes = sum(torch.Size(s).numel() for s in shapes) * 4

    def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            optimizer.zero_grad()
            model(scale).backward()
            optimizer.step()

        return step

    plain = _CheapModel(shapes, device)
    sharded = ShardedOptimizer(plain.parameters(), FusedAdam, **ADAM)
    wrapped = FusedDataParallel(_CheapModel(shapes, device))
    sharded_fdp = ShardedOptimizer(wrapped, FusedAdam, **ADAM)  # the wrapper reduces to the owners in backward
    wrapped_ar = FusedDataParallel(_CheapModel(shapes, device))
    sharded_fdp_ar = ShardedOptimizer(wrapped_ar, FusedAdam, reduce="all_reduce", **ADAM)  # all-reduce in backward
    fdp = FusedDataParallel(_CheapModel(shapes, device))
    fused_adam = FusedAdam(fdp.parameters(), **ADAM)
    # gradient_as_bucket_view: DDP's gradients are views of its buckets, as tfuse's are of its flat buffers,
    # so no configuration holds a second copy of the gradients.
    ddp = torch.nn.parallel.DistributedDataParallel(_CheapModel(shapes, device), gradient_as_bucket_view=True)
    # torch's fastest Adam on this device: fused where it has a fused kernel (CPU and CUDA in recent torch).
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=False,
                                   fused=True, **ADAM)
    configs = [
        _Config(SHARDED, model_name, make_step(plain, sharded)),
        _Config(SHARDED_FDP, model_name, make_step(wrapped, sharded_fdp)),
        _Config(SHARDED_FDP_ALLREDUCE, model_name, make_step(wrapped_ar, sharded_fdp_ar)),
        _Config(UNSHARDED, model_name, make_step(fdp, fused_adam)),
        _Config(ZERO, model_name, make_step(ddp, zero)),
    ]
    for config in configs:  # the first step creates the optimizer state
        config.step()
    # The flat state buffers of the unsharded FusedAdam (its per-parameter state are views), one span per buffer.
    unsharded_state = sum(_tensor_bytes(span.state.buffers.values()) for span in fused_adam.spans)
    states = (sharded.state_bytes(), sharded_fdp.state_bytes(), sharded_fdp_ar.state_bytes(), unsharded_state,
              _torch_state_bytes(zero.optim))
    for config, state in zip(configs, states):
        config.state_bytes = state
        config.held_bytes = 2 * param_bytes + state  # parameters and gradients, whole on every rank, + state
    return configs


def _time_configs(configs: list[_Config], device: torch.device, rounds: int, iterations: int) -> list[list[float]]:
    """Per config, the slowest rank's time of every timed step (ms), rounds cycling from a different start each."""
    for config in configs:  # warm-up (DDP rebuilds its buckets after its first iteration)
        config.step()
    return time_steps([c.step for c in configs], device, rounds, iterations, f"sharded {configs[0].model},")


def _max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.cpu().tolist()]


def _rank_main(rank: int, world: int, backend: str, init_file: str, out_file: str, quick: bool) -> None:
    from .optim import gpt2_small_shapes, resnet50_shapes, tiny_shapes

    with rank_group(rank, world, backend, init_file) as device:
        sets = [("tiny (--quick)", tiny_shapes())] if quick else [("ResNet-50", resnet50_shapes()),
                                                                   ("GPT-2 small", gpt2_small_shapes())]
        rounds, iterations = (3, 2) if quick else (7, 3)
        rows = []
        for model_name, shapes in sets:  # one parameter set at a time: GPT-2's five copies take ~8 GB a rank
            configs = _configs(model_name, shapes, device)
            if backend == "gloo":
                canary = _canary(device)
                configs.append(_Config(CANARY, model_name, canary.step))
            samples = _time_configs(configs, device, rounds, iterations)
            state = _max_over_ranks([c.state_bytes for c in configs], device)
            held = _max_over_ranks([c.held_bytes for c in configs], device)
            numel = sum(torch.Size(s).numel() for s in shapes)
            rows += [dict(label=c.label, model=model_name, samples=times, state_bytes=s, held_bytes=h,
                          tensors=len(shapes), numel=numel)
                     for c, times, s, h in zip(configs, samples, state, held)]
            del configs
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "rounds": rounds, "iterations": iterations}))


def _launch(backend: str, quick: bool) -> dict[str, Any]:
    return launch("sharded", _rank_main, WORLD_SIZE, backend, quick, deadline_s=300 if quick else 1800)


def _finish(rows: list[dict[str, Any]], stall_reference_gbps: float | None) -> list[dict[str, Any]]:
    """Medians, spreads, ratios and flags; drops the canary rows, flagging a parameter set's rows if it stalled."""
    finished = []
    for model in dict.fromkeys(row["model"] for row in rows):
        block = [row for row in rows if row["model"] == model]
        timings = {row["label"]: Timing(tuple(row.pop("samples"))) for row in block}
        stall = check_stall(timings[CANARY], stall_reference_gbps) if CANARY in timings else None
        block = [row for row in block if row["label"] != CANARY]
        for row in block:
            timing = timings[row["label"]]
            row["ms"], row["ms_range"] = timing.median, timing.quartiles
            row["state_mb"], row["held_mb"] = row["state_bytes"] / 1e6, row["held_bytes"] / 1e6
            row["flags"] = {}
            flag = stall or check_timing("step", timing)
            if flag is not None:
                row["flags"]["ms"] = flag
        by_label = {row["label"]: row for row in block}
        unsharded = by_label[UNSHARDED]
        for row in block:
            row["state_vs_unsharded"] = row["state_bytes"] / unsharded["state_bytes"]
            for key, reference in (("vs_unsharded", unsharded), ("vs_zero", by_label[ZERO])):
                row[key] = row["ms"] / reference["ms"]
                flag = worse_flag(row["flags"].get("ms"), step_flag_from(reference, row))
                if flag is not None:
                    row["flags"][key] = flag
        finished += block
    return finished


def run(ctx: Context) -> Report:
    multi_gpu = ctx.machine.on_gpu and torch.cuda.device_count() >= WORLD_SIZE
    backend = "nccl" if multi_gpu else "gloo"
    result = _launch(backend, ctx.quick)
    rows = _finish(result["rows"], ctx.stall_reference_gbps)
    sets = {row["model"]: (row["tensors"], row["numel"]) for row in rows}
    notes = [
        f"{WORLD_SIZE} ranks, {backend}"
        + (", one GPU each." if backend == "nccl" else f", one process each on this {os.cpu_count()}-core CPU "
           f"({max(1, (os.cpu_count() or 1) // WORLD_SIZE)} torch thread per rank; tfuse on its PyTorch path, "
           "TFUSE_BACKEND=torch)."),
        "Parameter sets: " + "; ".join(f"{name}: {tensors} float32 tensors, {numel / 1e6:.1f}M elements"
                                       for name, (tensors, numel) in sets.items())
        + ". Forward = each parameter times a scalar, summed, so a step is zero_grad + backward + gradient "
        "synchronisation + Adam (lr 1e-3).",
        f"Configurations: {SHARDED} on a plain model (it averages the gradients into their owners itself: "
        f"{'reduce-scatter' if backend == 'nccl' else 'one reduce per shard'}, then "
        f"{'one all-gather per buffer' if backend == 'nccl' else 'one broadcast per shard'}); "
        f"{SHARDED_FDP} (the wrapper reduces each bucket to the owners of its shards while backward runs, no "
        "all-reduce; then one fused Adam per shard and one parameter gather per buffer); "
        f"{SHARDED_FDP_ALLREDUCE} (the same, but the wrapper all-reduces its buckets in backward, as unsharded); "
        f"{UNSHARDED} (bucketed all-reduces overlapping backward, Adam on every element on every rank); "
        f"{ZERO} (torch.distributed.optim, overlap_with_ddp=False, fused=True; DDP with "
        "gradient_as_bucket_view=True).",
        "state MB = optimizer-state bytes on one rank (the larger of the two: ZeroRedundancyOptimizer gives whole "
        "parameters to ranks, so its shares can be uneven); state vs unsharded = that over the unsharded FusedAdam's.",
        "held MB = parameters + gradients + optimizer state on one rank, computed from the tensors, not measured: "
        "torch keeps no allocator statistics for CPU memory, and a process's peak RSS covers every configuration "
        "of the run at once. Communication temporaries (gloo's, ShardedOptimizer's per-shard reduce, DDP's) are "
        "not counted.",
        f"Every step's time is the slowest rank's; a time is the median over {result['rounds']} rounds x "
        f"{result['iterations']} steps, ± half the interquartile range relative to it, rounds cycling through the "
        "five configurations of a parameter set from a different start each.",
        "vs unsharded / vs ZeRO = step time over the FusedDataParallel + FusedAdam / ZeroRedundancyOptimizer row of "
        "the same parameter set (below 1: faster).",
    ]
    if backend == "gloo":
        notes.append(
            "CPU run: both ranks, their gloo threads and the optimizer share the same cores. A 4 MiB copy per rank, "
            "timed in the same rounds, checks that the machine did not stall (a stalled row is marked implausible)."
        )
    columns = [
        Column("model", "parameters"), Column("label", "configuration"),
        Column("state_mb", "state MB/rank", "{:.2f}"), Column("state_vs_unsharded", "state vs unsharded", "{:.2f}x"),
        Column("held_mb", "held MB/rank (computed)", "{:.1f}"),
        Column("ms", "step ms", "{:.1f}", spread=True), Column("vs_unsharded", "vs unsharded", "{:.2f}x"),
        Column("vs_zero", "vs ZeRO", "{:.2f}x"), CHECK_COLUMN,
    ]
    short = {SHARDED: "tfuse sharded", SHARDED_FDP: "tfuse FDP + sharded", SHARDED_FDP_ALLREDUCE: "FDP + sharded, all-reduce", UNSHARDED: "tfuse FDP (unsharded)", ZERO: "torch ZeRO-1"}
    plotted = [dict(row, step_ms=row["ms"], step_ms_range=row["ms_range"], short=short[row["label"]],
                    flags=dict(row["flags"], **({"step_ms": row["flags"]["ms"]} if "ms" in row["flags"] else {})))
               for row in rows]
    return Report(
        name=NAME,
        title="Sharded Adam (ZeRO-1): tfuse ShardedOptimizer vs FusedDataParallel vs torch ZeroRedundancyOptimizer",
        notes=notes, columns=columns, rows=plotted, plot_panels="model", plot_x="short",
        plot_lines=[("step_ms", "step time")], plot_xlabel="configuration", plot_ylabel="ms per step",
        timing_note=(
            f"Timing: see the notes above. A number marked (noisy) has an interquartile range over {NOISY_REL_IQR:.0%} "
            "of its median (or derives from one); (implausible) is physically impossible (a time at or below zero, a "
            "stalled machine). Marked numbers are not results."
        ),
    )

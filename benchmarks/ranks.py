"""Processes for the multi-rank benchmarks: start the ranks, join and leave their process group.

Each rank runs ``target(rank, world, backend, init_file, out_file, quick)`` in a
spawned process; rank 0 writes its results as JSON to ``out_file``, which
:func:`launch` reads back. :func:`rank_group` is the set-up and teardown every
rank shares:

- tfuse.distributed is imported before the process group exists (see its
  ``__init__``: otherwise torch pins the group past destroy_process_group and a
  rank can die with SIGABRT at exit after a successful run);
- a rank that finished meets the others at a barrier before tearing down, so
  nobody closes its connections while a peer still talks to it; a rank that
  raised skips the barrier (its peers would wait for it until the timeout).

:func:`time_steps` times step functions on every rank in interleaved rounds
(the slowest rank's time of each call).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .harness import Flag, round_order


@contextlib.contextmanager
def rank_group(rank: int, world: int, backend: str, init_file: str) -> Iterator[torch.device]:
    """Joins the benchmark's process group and yields this rank's device; leaves it on exit."""
    import tfuse.distributed  # noqa: F401  (before the group: see the module docstring)

    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Fused optimizers on the CPU: the PyTorch path (the interpreter is for values, not speed).
        os.environ["TFUSE_BACKEND"] = "torch"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    finished = False
    try:
        yield device
        finished = True
    finally:
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def _rank_context() -> multiprocessing.context.BaseContext:
    """Ranks fork from a server that imported torch, tfuse and torch._dynamo once (a fresh process that
    initialised no CUDA and started no thread, so safe to fork) instead of each importing them again; spawn where
    there is no fork server. (torch.optim imports torch._dynamo at a rank's first optimizer, and tfuse registers
    its ops then: about 3 s of CPU per rank.)"""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "tfuse", "torch._dynamo"])
    return context


def launch(name: str, target: Callable[..., None], world: int, backend: str, quick: bool,
           deadline_s: float) -> dict[str, Any]:
    """Runs ``target`` on ``world`` ranks (new processes) and returns what rank 0 wrote.

    Ranks still alive after ``deadline_s`` are killed; any rank that did not exit
    cleanly makes this raise, naming the benchmark and the exit codes.
    """
    context = _rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.json")
        ranks = [context.Process(target=target, args=(rank, world, backend, init_file, out_file, quick))
                 for rank in range(world)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + deadline_s
        for process in ranks:
            process.join(max(1.0, deadline - time.monotonic()))
        stuck = [p for p in ranks if p.is_alive()]
        for process in stuck:
            process.kill()
        codes = [p.exitcode for p in ranks]
        if stuck or any(code != 0 for code in codes):
            raise RuntimeError(f"{name} benchmark: ranks exited with {codes} ({len(stuck)} killed after the deadline)")
        return json.loads(Path(out_file).read_text())


def time_steps(steps: Sequence[Callable[[], Any]], device: torch.device, rounds: int, iterations: int,
               progress: str) -> list[list[float]]:
    """Per function of ``steps``, the slowest rank's time of every timed call (ms): ``rounds x iterations`` samples.

    Every rank calls this with the same steps in the same order (they may run
    collectives). Round r runs each step ``iterations`` times, starting from a
    different one each round (:func:`~benchmarks.harness.round_order`), so drift
    on a shared machine hits them all alike; a barrier precedes every timed call
    (and on a GPU a synchronize, before and after). No warm-up: the caller warms
    up. Rank 0 prints ``[<progress> round i/n, t s]`` to stderr before each round.
    """
    times: list[list[float]] = [[] for _ in steps]
    start = time.perf_counter()
    for round_index in range(rounds):
        if dist.get_rank() == 0:
            print(f"[{progress} round {round_index + 1}/{rounds}, {time.perf_counter() - start:.0f} s] "
                  f"{len(steps)} configurations x {iterations} steps", file=sys.stderr, flush=True)
        for index in round_order(round_index, len(steps)):
            for _ in range(iterations):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                begin = time.perf_counter()
                steps[index]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[index].append((time.perf_counter() - begin) * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.cpu().tolist()


def step_flag_from(other: dict[str, Any], row: dict[str, Any]) -> Flag | None:
    """``other``'s step flag as seen from ``row`` (named after ``other`` unless it is the same row or a stall):
    what a ratio of ``row`` to ``other`` inherits."""
    flag = other["flags"].get("ms")
    if flag is None or other is row or flag.reason.startswith("stalled"):
        return flag
    return Flag(flag.kind, f"'{other['label']}' {flag.reason}")

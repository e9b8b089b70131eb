"""Runs a function on N gloo ranks (separate processes) and brings back each rank's result.

Every rank joins a gloo process group through a temp-file init on localhost,
runs ``fn(rank, world_size, **kwargs)`` and saves what it returned, or the
exception it raised, with torch.save. The parent waits at most ``timeout``
seconds, then kills what is left, so a deadlock fails a test instead of
hanging CI.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist


@dataclasses.dataclass
class RankResult:
    """What one rank returned, or the exception it raised (``error`` is then "TypeName: message")."""

    value: Any = None
    error: str | None = None
    traceback: str | None = None
    exited: bool = True  # False: the rank was killed (it never wrote a result)

    def unwrap(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank raised {self.error}\n{self.traceback}")
        if not self.exited:
            raise AssertionError("rank did not finish (killed after the deadline, or died)")
        return self.value


def _rank_entry(fn: Callable, rank: int, world_size: int, init_file: str, result_file: str, pg_timeout_s: float,
                kwargs: dict, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now (the fork server's is from when it started)
    os.environ.update(environ)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tfuse._interpreter import install

        install()  # as importing tfuse does in the test process (a server started without the interpreter on)
    torch.set_num_threads(1)  # ranks share the machine's cores
    torch.manual_seed(1000 + rank)
    outcome = RankResult()
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        outcome.value = fn(rank, world_size, **kwargs)
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.traceback = traceback.format_exc()
    torch.save(dataclasses.asdict(outcome), result_file)
    if dist.is_initialized():
        try:
            if outcome.error is None:
                dist.barrier()  # nobody tears the group down while a peer still talks to it
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group (killed peer) may refuse; the process ends anyway
            pass


# torch._dynamo too: torch.optim imports it at a rank's first optimizer, and tfuse registers its ops then
# (tfuse.ops.register_library): about 3 s of CPU in every rank of every world, paid once in the server instead.
# It starts no thread (the server stays safe to fork) and comes before any process group, as in scripts.
_PRELOAD = ["torch", "torch.distributed", "tfuse", "torch._dynamo"]


def _rank_context() -> multiprocessing.context.BaseContext:
    """Ranks fork from a server that imported torch, tfuse and torch._dynamo once (a fresh, single-threaded
    process: safe to fork), instead of each importing them again (seconds of CPU per rank); spawn where there is
    no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float = 120.0,
    pg_timeout_s: float = 60.0,
    wait_for: list[int] | None = None,
    **kwargs: Any,
) -> list[RankResult]:
    """Runs ``fn`` on ``world_size`` gloo ranks; returns one RankResult per rank.

    ``fn`` must be importable (a module-level function). ``wait_for``: ranks
    whose end is awaited (default all); the others are killed once those are
    done (for tests where a rank stalls on purpose).
    """
    context = _rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        results = [os.path.join(tmp, f"rank{rank}.pt") for rank in range(world_size)]
        processes = [
            context.Process(target=_rank_entry,
                            args=(fn, rank, world_size, init_file, results[rank], pg_timeout_s, kwargs, dict(os.environ)))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        awaited = range(world_size) if wait_for is None else wait_for
        for rank in awaited:
            processes[rank].join(max(0.1, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
        outcomes = []
        for rank in range(world_size):
            if os.path.exists(results[rank]):
                outcomes.append(RankResult(**torch.load(results[rank], weights_only=False)))
            else:
                outcomes.append(RankResult(exited=False))
        return outcomes


def scenario(ranks: list[dict], name: str) -> list[dict]:
    """Each rank's result of a scenario; fails with the rank's traceback if it raised."""
    values = []
    for rank, results in enumerate(ranks):
        outcome = results[name]
        if "error" in outcome:
            pytest.fail(f"rank {rank} raised in scenario {name!r}:\n{outcome['error']}")
        values.append(outcome["value"])
    return values


def run_named(suite: dict[str, Callable[[int, int], Any]], rank: int, world: int, names: list[str],
              barrier: bool = True) -> dict:
    """Runs the named scenarios of ``suite`` one after another in one process group (ranks start once).

    Each result is ``{"value": ...}`` or ``{"error": "Type: message\ntraceback"}`` (see :func:`scenario`).
    ``barrier``: ranks meet after each scenario, so that one that failed on one rank cannot pair its
    collectives with the next one's.
    """
    results = {}
    for name in names:
        try:
            results[name] = {"value": suite[name](rank, world)}
        except Exception as error:  # noqa: BLE001 - reported by the test of that scenario
            results[name] = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
        if barrier:
            dist.barrier()
    return results


def assert_a_killed_rank_makes_the_others_raise(fn: Callable[..., Any], world: int = 2) -> None:
    """``fn`` makes its last rank die mid-run (``os._exit``): the others must raise, not hang or finish."""
    outcomes = run_world(fn, world, timeout=120, pg_timeout_s=30)
    assert not outcomes[-1].exited
    assert all(o.error is not None for o in outcomes[:-1]), "a surviving rank finished as if nothing happened"


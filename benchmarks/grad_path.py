"""The host cost of the gradient path: torch DDP vs tfuse FusedDataParallel vs no data parallelism.

``python -m benchmarks.grad_path [--rounds N]`` prints a markdown table.

One process, a gloo process group of world size 1 on localhost (a FileStore),
a CPU model of many small parameters (64 ``Linear(8, 8)`` layers: 128
parameters, 4,608 elements) on a batch of 2 rows, so that the host's
per-parameter work dominates what is timed. Each step is
``optimizer.zero_grad(); model(x).sum().backward()`` with torch's default
``set_to_none=True`` (the optimizer only zeroes: no step is taken, the
gradient path is what is timed):

* plain: the module alone, ``torch.optim.SGD``'s ``zero_grad``: autograd
  hands each parameter its fresh gradient, nothing else happens (the floor);
* torch DDP: ``DistributedDataParallel(model)`` (its C++ reducer copies each
  gradient into its bucket and, at the end, back out), and with
  ``gradient_as_bucket_view=True``; ``torch.optim.SGD``'s ``zero_grad``;
* tfuse FusedDataParallel with ``tfuse.optim.FusedSGD``'s ``zero_grad`` (one
  fill of the flat buffer; backward attaches each zeroed slot before
  autograd adds into it), and with ``torch.optim.SGD``'s (grads set to None
  only: backward fills the buffer once, at the first gradient).

Modes run in interleaved rounds (each round runs every mode's steps, in a
rotated order); the table gives medians and quartiles of the step and of its
``backward()`` alone, and the extra host time per gradient over plain:
(median step - plain's median step) / parameters, and the same paired by
round (each round's fastest step of the mode minus plain's fastest of that
round, the median over rounds), which a shared machine's drifting load
disturbs less.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LAYERS = 64  # Linear(8, 8) layers: 2 parameters each
WIDTH = 8
BATCH = 2
STEPS_PER_ROUND = 3  # short blocks: the modes share the machine's noise
WARMUP_STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A world-size-1 gloo group on a FileStore (the existing default group, if one is initialized)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _modes() -> dict[str, tuple[Callable[[], Any], Callable[[], None], int]]:
    """label -> (the module to call, the zero_grad of its optimizer, gradients per step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tfuse.distributed import FusedDataParallel
    from tfuse.optim import FusedSGD

    base = _model()
    count = sum(1 for _ in base.parameters())
    modes = {}
    for label, wrap, optimizer in (
        ("plain (no data parallelism)", lambda m: m, torch.optim.SGD),
        ("torch DDP", DDP, torch.optim.SGD),
        ("torch DDP, gradient_as_bucket_view=True", lambda m: DDP(m, gradient_as_bucket_view=True), torch.optim.SGD),
        ("tfuse FusedDataParallel, FusedSGD.zero_grad()", FusedDataParallel, FusedSGD),
        ("tfuse FusedDataParallel, torch.optim.SGD.zero_grad()", FusedDataParallel, torch.optim.SGD),
    ):
        module = wrap(copy.deepcopy(base))
        modes[label] = (module, optimizer(module.parameters(), lr=0.1).zero_grad, count)
    return modes


def measure(rounds: int) -> list[dict[str, Any]]:
    """One row per mode: step and backward host ms (median, quartiles) and the extra host us per gradient.

    ``rounds`` interleaved rounds of STEPS_PER_ROUND timed steps per mode (after WARMUP_STEPS untimed ones).
    """
    if rounds < 1:
        raise ValueError(f"grad_path.measure: rounds must be at least 1, got {rounds}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host cost: no intra-op thread pool noise on a shared CPU
    try:
        with _process_group():
            modes = _modes()
            x = torch.randn(BATCH, WIDTH)
            steps: dict[str, list[float]] = {label: [] for label in modes}
            backwards: dict[str, list[float]] = {label: [] for label in modes}
            round_minima: dict[str, list[float]] = {label: [] for label in modes}

            def run(label: str, record: bool) -> None:
                module, zero_grad, _ = modes[label]
                start = time.perf_counter()
                zero_grad()
                loss = module(x).sum()
                middle = time.perf_counter()
                loss.backward()
                end = time.perf_counter()
                if record:
                    steps[label].append((end - start) * 1e3)
                    backwards[label].append((end - middle) * 1e3)

            labels = list(modes)
            for label in labels:
                for _ in range(WARMUP_STEPS):
                    run(label, record=False)
            for round_index in range(rounds):
                shift = round_index % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    for _ in range(STEPS_PER_ROUND):
                        run(label, record=True)
                    round_minima[label].append(min(steps[label][-STEPS_PER_ROUND:]))
            rows = []
            floor = statistics.median(steps[labels[0]])
            floors = round_minima[labels[0]]
            for label in labels:
                step_q1, step_median, step_q3 = _quartiles(steps[label])
                back_q1, back_median, back_q3 = _quartiles(backwards[label])
                gradients = modes[label][2]
                rows.append({
                    "mode": label, "gradients": gradients, "samples": len(steps[label]),
                    "step_ms": step_median, "step_q1": step_q1, "step_q3": step_q3,
                    "backward_ms": back_median, "backward_q1": back_q1, "backward_q3": back_q3,
                    "extra_us_per_gradient": (step_median - floor) * 1e3 / gradients,
                    # Paired: per round, this mode's fastest step minus plain's fastest of the same round (the
                    # machine's load drifts less within a round than across the run), the median over rounds.
                    "extra_us_per_gradient_paired": statistics.median(
                        (mine - plain) * 1e3 / gradients for mine, plain in zip(round_minima[label], floors)
                    ),
                })
            return rows
    finally:
        torch.set_num_threads(threads)


def _quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, median, q3


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | step ms, median (q1-q3) | of it backward() ms, median (q1-q3) "
        "| extra host us per gradient vs plain: medians | paired, per round |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['step_ms']:.3f} ({row['step_q1']:.3f}-{row['step_q3']:.3f}) "
            f"| {row['backward_ms']:.3f} ({row['backward_q1']:.3f}-{row['backward_q3']:.3f}) "
            f"| {row['extra_us_per_gradient']:.2f} | {row['extra_us_per_gradient_paired']:.2f} |"
        )
    first = rows[0]
    lines.append("")
    lines.append(
        f"{first['gradients']} gradients per step ({LAYERS} Linear({WIDTH}, {WIDTH}) layers, batch {BATCH}), "
        f"{first['samples']} timed steps per mode, one gloo rank on localhost, torch {torch.__version__}, "
        f"1 intra-op thread. Paired: per round, each mode's fastest of its {STEPS_PER_ROUND} steps minus "
        "plain's fastest of the same round, per gradient, median over rounds."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds (default 100)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(markdown(measure(args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tfuse.tune_buckets: the bucket size and count cap that make the user's own training step fastest here."""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

#: Candidates tried by default: (bucket_mb, max_params_per_bucket); None is "no cap".
DEFAULT_CANDIDATES: tuple[tuple[float | None, int | None], ...] = ((1, None), (4, None), (16, None), (64, None),
                                                                   (None, None))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class BucketTiming:
    """One candidate's measurement: its setting, the buckets it made, its step time (median and quartiles, ms)."""

    bucket_mb: float | None
    max_params_per_bucket: int | None
    buckets: int
    median_ms: float
    q1_ms: float
    q3_ms: float
    #: Other candidates that made exactly these buckets (timed once, under this row).
    same_buckets: tuple[tuple[float | None, int | None], ...] = ()


@dataclasses.dataclass
class BucketTuning:
    """What :func:`tune_buckets` measured, and the setting it recommends (the fastest median).

    ``str()`` is a markdown table with the recommendation.
    """

    rows: list[BucketTiming]
    best: BucketTiming
    world_size: int
    steps: int

    @property
    def measurable(self) -> bool:
        """Whether the fastest row's quartile range is clear of every other row's (else: no measurable difference)."""
        return all(row is self.best or row.q1_ms > self.best.q3_ms for row in self.rows)

    def verdict(self) -> str:
        """One sentence: the recommendation, or why there is none to make."""
        setting = (
            f"FusionStrategy(fuse_grad_size_in_mb={self.best.bucket_mb}, "
            f"max_params_per_bucket={self.best.max_params_per_bucket}) (or FusedDataParallel(bucket_mb=..., "
            "max_params_per_bucket=...))"
        )
        if len(self.rows) == 1:
            return f"Recommended: {setting}; every candidate made the same buckets: the setting does not matter here."
        if not self.measurable:
            return (
                f"Recommended: {setting}, the fastest median, but with no measurable difference: its quartile range "
                "overlaps another candidate's (measure with more steps or rounds, or keep the default)."
            )
        return f"Recommended: {setting}."

    def __str__(self) -> str:
        lines = [
            f"Step time (forward + backward + gradient all-reduce) of this model over {self.world_size} ranks, "
            f"median of {self.steps} steps per candidate (slowest rank per step):",
            "",
            "| bucket_mb | max_params_per_bucket | all-reduce calls | ms / step | vs best |",
            "|---|---|---|---|---|",
        ]
        for row in self.rows:
            mark = " (best)" if row is self.best else ""
            same = "".join(f"; same buckets: {mb}, {cap}" for mb, cap in row.same_buckets)
            lines.append(
                f"| {row.bucket_mb} | {row.max_params_per_bucket}{same} | {row.buckets} | {row.median_ms:.2f} "
                f"({row.q1_ms:.2f}-{row.q3_ms:.2f}) | {row.median_ms / self.best.median_ms:.2f}x{mark} |"
            )
        lines += ["", self.verdict()]
        return "\n".join(lines)


def tune_buckets(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: tuple[Any, Any],
    candidates: Sequence[tuple[float | None, int | None]] = DEFAULT_CANDIDATES,
    *,
    steps: int = 10,
    warmup: int = 2,
    rounds: int = 3,
    process_group: dist.ProcessGroup | None = None,
) -> BucketTuning:
    """Times the user's training step under FusedDataParallel for each bucket setting; recommends the fastest.

    Every rank calls it, with its own batch. A step is zero_grad, forward,
    ``loss_fn(model(inputs), target)`` and backward (with the all-reduce of
    the gradient buckets); a step's time is the slowest rank's. Candidates are
    measured in ``rounds`` rounds of ``steps`` steps, one after another in
    each round, so that a drift of the machine's speed spreads over all of
    them. The model is copied (the original is not changed, trained or
    wrapped), and every rank gets the same recommendation.

    Candidates that make exactly the same buckets (a small model fits in
    one bucket under every size cap) are timed once, as one row. When the
    fastest row's quartile range overlaps another's, the table says that
    there is no measurable difference. The table is logged once (rank 0).

    Args:
        model: the model (on this rank's device).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        example_batch: ``(inputs, target)``; ``inputs`` a tensor or a tuple of positional inputs.
        candidates: ``(bucket_mb, max_params_per_bucket)`` pairs; None means no cap.
        steps, warmup, rounds: timed steps per candidate and round, untimed steps before, rounds.
        process_group: the data-parallel group (None: the default group).

    Example (every rank, after ``dist.init_process_group``)::

        tuning = tfuse.tune_buckets(model, F.cross_entropy, (images, labels))
        if dist.get_rank() == 0:
            print(tuning)  # a table, and the recommended FusionStrategy(fuse_grad_size_in_mb=..., ...)

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: no candidates, a malformed candidate, steps/rounds below 1,
            a model without parameters, or ``example_batch`` not an ``(inputs, target)`` pair.
    """
    from tfuse.distributed import FusedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tfuse.tune_buckets: torch.distributed is not initialized (call init_process_group first)")
    candidates = [tuple(c) for c in candidates]
    if not candidates or any(len(c) != 2 for c in candidates):
        raise ValueError(
            f"tfuse.tune_buckets: candidates must be (bucket_mb, max_params_per_bucket) pairs, got {candidates}"
        )
    for name, value in (("steps", steps), ("rounds", rounds), ("warmup + 1", warmup + 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"tfuse.tune_buckets: {name} must be an int >= 1, got {value!r}")
    if not isinstance(example_batch, (tuple, list)) or len(example_batch) != 2:
        raise ValueError(
            "tfuse.tune_buckets: example_batch must be an (inputs, target) pair, as loss_fn(model(*inputs), target) "
            f"takes them; got {type(example_batch).__name__}"
            + (f" of length {len(example_batch)}" if isinstance(example_batch, (tuple, list)) else "")
        )
    inputs, target = example_batch
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    first = next(iter(model.parameters()), None)
    if first is None:
        raise ValueError("tfuse.tune_buckets: the model has no parameters: there are no gradients to all-reduce")
    device = first.device
    world = dist.get_world_size(process_group)
    work = copy.deepcopy(model)
    distinct, same = _distinct_layouts(work, candidates)
    samples: dict[int, list[float]] = {index: [] for index in distinct}
    buckets: dict[int, int] = {}
    for _ in range(rounds):
        for index in distinct:
            bucket_mb, max_params = candidates[index]
            wrapped = FusedDataParallel(
                work, bucket_mb=bucket_mb, max_params_per_bucket=max_params, process_group=process_group
            )
            buckets[index] = wrapped.num_allreduce_calls
            for step in range(warmup + steps):
                begin = time.perf_counter()
                wrapped.zero_grad(set_to_none=False)
                loss_fn(wrapped(*inputs), target).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64, device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=process_group)
                if step >= warmup:
                    samples[index].append(float(elapsed) * 1e3)
            del wrapped
    rows = []
    for index in distinct:
        bucket_mb, max_params = candidates[index]
        values = samples[index]
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
        rows.append(BucketTiming(bucket_mb, max_params, buckets[index], median, q1, q3, tuple(same[index])))
    best = min(rows, key=lambda row: row.median_ms)
    tuning = BucketTuning(rows, best, world, steps * rounds)
    level = logging.INFO if dist.get_rank(process_group) == 0 else logging.DEBUG  # one table, not one per rank
    logger.log(level, "tfuse.tune_buckets:\n%s", tuning)
    return tuning


def _distinct_layouts(model: nn.Module, candidates: list) -> tuple[list[int], dict[int, list]]:
    """The candidates that make different buckets (first of each), and per kept one the others that match it.

    Lays the (copied) model's parameters out in one FlatParams, as FusedDataParallel would, and re-buckets it
    per candidate: no collective, no copy; the wrappers then reuse it.
    """
    from tfuse.flat import FlatParams, flat_params_of

    names = {param: name for name, param in model.named_parameters()}  # (tied parameters once)
    params = list(names)
    flat = flat_params_of(params[0]) or FlatParams([(names[p], p) for p in params])
    kept: dict[tuple, int] = {}
    same: dict[int, list] = {}
    for index, (bucket_mb, max_params) in enumerate(candidates):
        flat.set_buckets(bucket_mb, max_params)
        key = tuple((b.buffer_index, b.start, b.end) for b in flat.buckets)
        if key in kept:
            same[kept[key]].append(candidates[index])
        else:
            kept[key] = index
            same[index] = []
    return list(kept.values()), same

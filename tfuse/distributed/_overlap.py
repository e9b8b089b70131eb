"""The overlapped step: each gradient bucket's optimizer update runs as soon as its all-reduce has landed.

:meth:`FusedDataParallel.overlap_step <tfuse.distributed.FusedDataParallel.overlap_step>`
hands the wrapper a fused optimizer. In a backward pass that synchronizes,
the reducer tells :class:`OverlappedStep` each bucket it issues; whenever
the oldest issued bucket's collective has completed (polled when the next
bucket is issued, and at the end of backward for the rest), its parameters
are stepped with :meth:`tfuse.optim.FlatOptimizer.step_ahead`: the same
update, rows and step counts ``optimizer.step()`` would have used, so the
result is bit for bit the plain step's. ``optimizer.step()`` then steps
only what was not stepped ahead (parameters outside the wrapper).

What cannot overlap, and what happens instead:

* A GradScaler: a non-finite gradient in the last bucket must skip the
  first bucket's update too, and backward cannot know that. The first
  synchronizing iteration after ``overlap_step`` is always stepped plainly;
  if GradScaler drives that step, the overlap turns itself off for good (one
  INFO line): the step waits for the whole backward, as without overlap.
* Anything that edits the gradients between backward and ``step()``
  (``clip_grad_norm_``, ``GradScaler.unscale_``, gradient noise): seen at
  the first step (the gradient buffers' version counters moved) and
  refused with a RuntimeError before anything is stepped. Once overlapping,
  such an edit can only be seen after the update ran: ``step()`` raises.
* Gradient accumulation (``no_sync``, ``gradient_merge_steps``): a pass that
  does not synchronize steps nothing; the synchronizing one steps. Two
  synchronizing passes without ``step()`` between them would step twice, so
  the second raises.
* ``find_unused_parameters=True``: which parameters step is known when the
  used flags are agreed at the end of backward, so buckets are stepped then.
* A ShardedOptimizer of LAMB or LARS sums each parameter's norms across the
  ranks as it steps (a blocking collective of its own group): its buckets
  are stepped when backward ends too, bucket by bucket, in the same order on
  every rank (stepping one while backward runs could leave a rank waiting
  there for another that waits for a gradient bucket the first has not sent).
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tfuse.flat import Bucket, FlatParams
from tfuse.optim.span import SpanStepper

logger = logging.getLogger(__name__)

PROBING, ON, OFF = "probing", "on", "off"


class SteppedAhead(Protocol):
    """What the overlapped step needs of an optimizer: a FlatOptimizer, or a ShardedOptimizer (its shards)."""

    @property
    def spans(self) -> tuple[SpanStepper, ...]: ...

    @property
    def flat_params(self) -> tuple[FlatParams, ...]: ...

    def step_ahead(self, span: SpanStepper, members: tuple[bool, ...]) -> None: ...

    def register_step_pre_hook(self, hook: Callable) -> Any: ...


class OverlappedStep:
    """Steps a fused optimizer bucket by bucket during a FusedDataParallel backward (see the module doc).

    Args:
        flat: the wrapper's FlatParams (its buckets are the all-reduce messages).
        optimizer: a fused optimizer over (some of) the wrapper's parameters, or the wrapper's ShardedOptimizer.
        finish: called when backward ends, after the last bucket was stepped (a ShardedOptimizer's
            ``gather_ahead``: the owners' updated shards go to every rank).
    """

    def __init__(self, flat: FlatParams, optimizer: SteppedAhead, finish: Callable[[], None] | None = None) -> None:
        self.flat = flat
        self.optimizer = weakref.ref(optimizer)
        self._finish = finish
        self.mode = PROBING
        self.stepped_buckets = 0  # buckets stepped ahead in the last synchronizing pass
        self.stepped_in_backward = 0  # of which while backward still ran (the rest: when it ended)
        # Per bucket: (index into optimizer.spans, which of that span's members are in the bucket). Indices, not
        # the spans: a span holds its optimizer (its rule), which this object must not keep alive.
        self._masks: list[list[tuple[int, tuple[bool, ...]]]] = []
        self._masks_key: Any = None
        self._pending: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self._poll = True
        self._ahead = False  # stepped ahead since the last optimizer.step()
        self._grad_versions: list[int] | None = None  # the gradient buffers' versions when backward ended
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def remove(self) -> None:
        """Detaches from the optimizer (its steps are plain again)."""
        self._hook.remove()

    # ------------------------------------------------------------------ the reducer's calls

    def start_pass(self, buckets: tuple[Bucket, ...], find_unused: bool) -> None:
        """A synchronizing backward pass begins."""
        self._pending.clear()
        self.stepped_buckets = self.stepped_in_backward = 0
        if self.mode == ON and self.optimizer() is None:
            self.mode = OFF
            logger.warning(
                "FusedDataParallel.overlap_step: its optimizer was deleted; backward steps nothing from now on"
            )
        if self.mode != ON:
            return
        if self._ahead:
            raise RuntimeError(
                "FusedDataParallel: a second synchronizing backward pass before optimizer.step(), with overlap_step: "
                "the first pass stepped the optimizer already. Call optimizer.step() after each synchronizing "
                "backward, and accumulate gradients with no_sync() or gradient_merge_steps"
            )
        # With find_unused, which parameters step is agreed at the end only. A sharded LAMB or LARS sums each
        # parameter's norms across the ranks as it steps (a blocking collective): stepped while backward runs, a
        # rank would wait there for a rank that waits for a gradient bucket it cannot issue, so its buckets are
        # stepped when backward ends, in order on every rank.
        self._poll = not find_unused and not getattr(self._optimizer(), "sums_across_ranks", False)
        self._read_masks(buckets)

    def issued(self, index: int, works: list[Any]) -> None:
        """Bucket ``index``'s collectives were issued: steps every bucket, oldest first, whose collectives are done."""
        if self.mode != ON:
            return
        self._pending.append((index, works))
        if self._poll:
            while self._pending and all(work.is_completed() for work in self._pending[0][1]):
                self._step_bucket(*self._pending.popleft())

    def finish_pass(self) -> None:
        """Backward ended and every collective completed: steps the buckets left, then notes the gradients' state."""
        self.stepped_in_backward = self.stepped_buckets
        while self._pending:
            self._step_bucket(*self._pending.popleft())
        if self._finish is not None and self._ahead:
            self._finish()
        self._grad_versions = self._versions()

    # ------------------------------------------------------------------ stepping

    def _read_masks(self, buckets: tuple[Bucket, ...]) -> None:
        """Per bucket, the optimizer's spans it meets and which of their members are in it (cached per layout)."""
        spans = self._optimizer().spans
        key = (self.flat.layout_version, tuple((id(s), len(s.members)) for s in spans), len(buckets))
        if key == self._masks_key:
            return
        self._masks = []
        for bucket in buckets:
            inside = {id(p) for p in bucket.params}
            entries = []
            for index, span in enumerate(spans):
                mask = tuple(id(p) in inside for p in span.params)
                if span.flat is self.flat and any(mask):
                    entries.append((index, mask))
            self._masks.append(entries)
        self._masks_key = key

    def _step_bucket(self, index: int, works: list[Any]) -> None:
        for work in works:
            work.wait()  # (done already on the host; on CUDA it orders the update after the collective)
        optimizer = self._optimizer()
        if not self._ahead:
            for flat in optimizer.flat_params:
                flat.check_storage()  # what optimizer.step() checks first (a replaced storage is taken back)
        spans = optimizer.spans
        for at, mask in self._masks[index]:
            optimizer.step_ahead(spans[at], mask)
        self._ahead = True
        self.stepped_buckets += 1

    def _optimizer(self) -> SteppedAhead:
        optimizer = self.optimizer()
        if optimizer is None:
            raise RuntimeError("FusedDataParallel: the optimizer given to overlap_step was deleted")
        return optimizer

    def _versions(self) -> list[int]:
        return [g.grad._version for g in self.flat.groups if g.grad is not None]

    # ------------------------------------------------------------------ optimizer.step()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """optimizer.step() pre-hook: decides whether to overlap from what drives the first step, and refuses
        what an overlapped step cannot honour."""
        scaled = getattr(optimizer, "found_inf", None) is not None or getattr(optimizer, "grad_scale", None) is not None
        edited = self._grad_versions is not None and self._versions() != self._grad_versions
        ahead, self._ahead = self._ahead, False
        if self.mode == PROBING and self._grad_versions is not None:
            if scaled:
                self.mode = OFF
                logger.log(
                    logging.INFO if dist.get_rank() == 0 else logging.DEBUG,
                    "FusedDataParallel.overlap_step: a GradScaler drives the step; the update waits for the whole "
                    "backward (an inf/NaN in a late bucket must skip the early ones too), as without overlap",
                )
            elif edited:
                raise RuntimeError(_EDITED + " Nothing was stepped.")
            else:
                self.mode = ON
        elif ahead and scaled:
            raise RuntimeError(
                "FusedDataParallel.overlap_step: a GradScaler drives this step, but the overlapped step already "
                "updated the parameters during backward with the gradients as they were (scaled). Create the "
                "optimizer and call overlap_step again with the GradScaler in use from the first step"
            )
        elif ahead and edited:
            raise RuntimeError(_EDITED + " The overlapped update already ran with the gradients before the edit.")
        self._grad_versions = None


_EDITED = (
    "FusedDataParallel.overlap_step: the gradients were changed between backward and optimizer.step() "
    "(clip_grad_norm_? GradScaler.unscale_?), but the overlapped step updates each bucket during backward, "
    "before any such edit. A global-norm clip cannot overlap: drop overlap_step for this model, or stop editing "
    "the gradients."
)

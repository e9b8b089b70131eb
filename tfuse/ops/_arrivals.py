"""Arrival counters of the reductions whose last program merges (depthwise's dw/db: kernels/depthwise.py).

Such a kernel's programs each add 1 to an int32 counter of their group when
their partial is stored; the one that arrives last merges the group and puts
the counter back to 0 (kernels/depthwise.py). So a counter is 0 between
launches, and one buffer can serve every launch of a size on a device, one
after the other on a stream: :func:`arrival_counters` keeps one per (device,
size), never freed, since a captured CUDA graph may replay with it. Batch
norm keeps :class:`ArrivalCounters` per launch plan instead
(tfuse/ops/batch_norm.py).

Two launches that share counters must not run at the same time: launches of
one size on two streams at once (a backward of two branches on two streams)
would count into one buffer. Batch norm's per-plan counters make the same
assumption for launches of one plan.
"""

from __future__ import annotations

import torch

__all__ = ["ArrivalCounters", "arrival_counters"]


class ArrivalCounters:
    """int32 arrival counters, all 0 between launches.

    ``pending``: allocated while the current CUDA stream was capturing a graph,
    whose zero fill then runs on replay only; until a fill has run outside a
    capture, each use fills them again (captured where capturing).
    """

    __slots__ = ("pending", "tensor")

    def __init__(self, size: int, device: torch.device) -> None:
        self.pending = _capturing(device)
        self.tensor = torch.zeros(size, dtype=torch.int32, device=device)

    def ready(self) -> torch.Tensor:
        """The counters, all 0 when the launch that takes them runs."""
        if self.pending:
            self.tensor.zero_()
            self.pending = _capturing(self.tensor.device)
        return self.tensor


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


#: (device, size) -> the counters every launch of that size on that device shares.
_counters: dict[tuple[torch.device, int], ArrivalCounters] = {}


def arrival_counters(size: int, device: torch.device) -> torch.Tensor:
    """``size`` int32 arrival counters on ``device``, all 0 (each launch that takes them leaves them 0)."""
    counters = _counters.get((device, size))
    if counters is None:
        counters = _counters.setdefault((device, size), ArrivalCounters(size, device))
    return counters.ready()

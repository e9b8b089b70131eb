"""LocalSGD's outer step (DiLoCo): the span engine over the snapshot, stepped with SGD on the pseudo-gradient.

At a sync every rank holds the average pseudo-gradient ``G = mean(snapshot -
params)`` in its parameters' own storage. The outer step is an SGD step of
the snapshot with gradient ``G``: :func:`outer_span` builds a
:class:`~tfuse.optim.span.SpanStepper` over a twin of the flat buffer's
layout whose parameters are the snapshot and whose gradients are ``G``, with
FusedSGD's update rule and the outer momentum as its state, so the outer step
is the same fused update (one Triton launch per buffer, or torch's fused
kernels) as any optimizer step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tfuse.distributed.local_sgd_options import OuterSGD
from tfuse.flat import FlatGroup, FlatParams
from tfuse.optim import FusedSGD
from tfuse.optim.span import SpanMember, SpanStepper


class _OuterRule:
    """The outer step's update rule for the span engine: FusedSGD's update on the pseudo-gradient."""

    family = FusedSGD.family
    state_names = FusedSGD.state_names
    update_row = staticmethod(FusedSGD.update_row)

    def state_names_of(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.update_row(group, 1, True).state_names

    def pads_stay_zero(self) -> bool:
        return True  # (padding: snapshot and parameters hold zeros there, so does the pseudo-gradient)

    def initial_state(self, name: str, group: dict[str, Any]) -> float:
        return 0.0  # the outer momentum starts at zero


_OUTER_RULE = _OuterRule()


def outer_group(outer: OuterSGD) -> dict[str, Any]:
    """The outer optimizer's hyperparameters as a parameter group of torch's SGD."""
    return dict(
        lr=outer.lr, momentum=outer.momentum, dampening=0.0, weight_decay=0.0, nesterov=outer.nesterov, maximize=False
    )


def outer_span(
    flat: FlatParams,
    group: FlatGroup,
    snapshot: torch.Tensor,
    pseudo_grad: torch.Tensor,
    momentum: torch.Tensor | None,
    started: bool,
) -> SpanStepper:
    """The span engine over ``snapshot`` (the trainable range of ``group``): ``pseudo_grad`` as its gradients,
    ``momentum`` (kept by LocalSGD: its state dict has it) as its state; ``started``: not the first outer step."""
    twin = dataclasses.replace(group, data=snapshot, grad=pseudo_grad)
    span = SpanStepper(flat, twin, _OUTER_RULE, span=(0, group.trainable_numel))
    span.set_members([SpanMember(p, 0, started=started) for p in group.params[: group.n_trainable]])
    if momentum is not None:
        span.state.buffers["momentum_buffer"] = momentum
    return span

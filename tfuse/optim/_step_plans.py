"""What a span step reuses from one step to the next: the plan of a set of members, its run tables and,
for capturable steps, its device tensors.

Most steps look like the last (the same parameters have gradients, one
step count throughout), so :class:`~tfuse.optim.span.SpanStepper` caches a
:class:`StepPlan` per set of active members, and each plan its
:class:`~tfuse.optim._update.RunTable` per row assignment and its
:class:`DeviceSetup` per hyperparameter values.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tfuse.optim._update import RunTable

if TYPE_CHECKING:
    from tfuse.optim.span import SpanMember, UpdateRule

CACHE_SIZE = 8  # step plans per span, and run tables and device set-ups per plan


class StepPlan:
    """What a step does for one set of active members (those with a gradient), in buffer order."""

    def __init__(self, members: list[SpanMember]) -> None:
        self.members = members
        self.positions = np.array([m.index for m in members], dtype=np.int64)  # into FlatState.steps
        self.groups = list(dict.fromkeys(m.group for m in members))  # distinct parameter groups
        rank = {group: row for row, group in enumerate(self.groups)}
        self.group_rows = tuple(rank[m.group] for m in members)  # each member's row when all share a step count
        self.tables: collections.OrderedDict[Any, RunTable] = collections.OrderedDict()
        self.device_setups: dict[Any, DeviceSetup] = {}

    def table(
        self, member_rows: tuple[int, ...], align: int, pad: bool, separate: bool = False, slots: int | None = None
    ) -> RunTable | None:
        """The runs of a step: maximal ranges of adjacent members that share a row (None: no element to update).

        ``separate``: one run per member, never merged (an update with per-parameter norms: LAMB); the table then
        knows each run's parameter and its member's position in the buffer (``slots``: the buffer's parameters).

        ``pad``: runs may cross the zero padding between neighbours (never
        another parameter) and end rounded up into it, when the update keeps
        zeros at zero: fewer, aligned runs. Members with no element in the
        span (a shard owner's view of a parameter outside its shard) get no run.
        """
        key = (member_rows, pad, separate)
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        runs: list[tuple[int, int, int]] = []
        params, positions = [], []
        previous = -2
        for member, row in zip(self.members, member_rows):
            if member.end <= member.start:
                continue
            end = -(-member.end // align) * align if pad else member.end
            if pad and not separate and runs and runs[-1][2] == row and member.index == previous + 1:
                runs[-1] = (runs[-1][0], end, row)
            else:
                runs.append((member.start, end, row))
                params.append(member.param)
                positions.append(member.index)  # (the same on every rank, whatever is active where)
            previous = member.index
        table = RunTable(runs, start_align=align, end_align=align if pad else 1) if runs else None
        if table is not None and separate:
            table.with_params(params, positions, slots)
        self.tables[key] = table
        if len(self.tables) > CACHE_SIZE:
            self.tables.popitem(last=False)
        return table

    def device_setup(
        self, rule: UpdateRule, groups: list[dict[str, Any]], fresh: tuple[bool, ...], device: torch.device
    ) -> DeviceSetup:
        """What a capturable step of this plan keeps on the device, for these hyperparameters."""
        # Rows at lr 0: a tensor lr is read on the device, never here (item() would sync).
        rows = {}
        for index in self.groups:
            at_zero = {**groups[index], "lr": 0.0}
            rows[index] = (rule.update_row(at_zero, 1, False), rule.update_row(at_zero, 1, True))
        hypers = tuple(rows[m.group][first] for m, first in zip(self.members, fresh))
        floats = tuple(None if isinstance(g["lr"], torch.Tensor) else float(g["lr"]) for g in groups)
        key = (hypers, floats)
        setup = self.device_setups.get(key)
        if setup is None:
            if len(self.device_setups) >= CACHE_SIZE:
                self.device_setups.clear()
            setup = self.device_setups[key] = DeviceSetup(self, hypers, floats, device)
        return setup


class DeviceSetup:
    """A capturable step's device tensors for one plan: member positions, the static coefficient table,
    the float learning rates of the rows (tensor learning rates are gathered at each step)."""

    def __init__(
        self, plan: StepPlan, hypers: tuple[Any, ...], floats: tuple[float | None, ...], device: torch.device
    ) -> None:
        self.hypers = list(hypers)
        self.positions = torch.as_tensor(plan.positions, device=device)
        self.ones = torch.ones(len(plan.members), dtype=torch.float32, device=device)
        self.static = torch.tensor([h.static_coefficients() for h in hypers], dtype=torch.float64, device=device)
        self.member_groups = [m.group for m in plan.members]
        self.float_lr = torch.tensor(
            [floats[g] if floats[g] is not None else 0.0 for g in self.member_groups],
            dtype=torch.float64,
            device=device,
        )
        self.tensor_groups = sorted({g for g in self.member_groups if floats[g] is None})
        # For each tensor-lr group: the rows it fills (device index tensors, made once).
        self.rows_of = {
            g: torch.tensor([i for i, mg in enumerate(self.member_groups) if mg == g], device=device)
            for g in self.tensor_groups
        }

    def lr_rows(self, groups: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """Each row's learning rate on the device (float64): tensors are read there, not on the host."""
        if not self.tensor_groups:
            return self.float_lr
        lr = self.float_lr.clone()
        for g in self.tensor_groups:
            value = groups[g]["lr"].to(device=device, dtype=torch.float64).reshape(1)
            lr.index_copy_(0, self.rows_of[g], value.expand(len(self.rows_of[g])))
        return lr

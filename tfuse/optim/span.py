"""The span engine: the optimizer state and the update of one span ``[start, end)`` of one flat buffer.

Every optimizer step in tfuse is "step a span of a flat buffer": a fused
optimizer steps each of its buffers whole, a shard owner
(:class:`~tfuse.distributed.ShardedOptimizer`) its shard of each buffer.
:class:`SpanStepper` is that step, written once. It owns the span's state
(:class:`~tfuse.optim._state.FlatState`: optimizer state, float32 masters,
step counts), remembers which parameters had their first step, and runs the
family's update over the span: one Triton launch, or torch's fused kernels
on the PyTorch path; with ``capturable=True`` from step counts kept on the
device. It also loads torch-format state for the parameters in the span.

What the update is comes from an :class:`UpdateRule` (the fused optimizer
classes are rules: ``update_row``, ``state_names_of``, ``pads_stay_zero``);
the hyperparameters come from the caller's parameter groups at each step,
so LR schedulers and ``load_state_dict`` act on the next step.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from tfuse._backend import Backend, select_backend
from tfuse._kit import acc_dtype
from tfuse.flat import FlatGroup, FlatParams
from tfuse.optim._state import FlatState
from tfuse.optim._step_plans import CACHE_SIZE, StepPlan
from tfuse.optim._update import LOW_PRECISION, MAX_ALIGN, UpdateFamily, update

MASTER_KEY = "master_param"  # torch-format state entry of a parameter's float32 master copy


class UpdateRule(Protocol):
    """What an optimizer family tells the engine (every :class:`~tfuse.optim.FusedAdam`-like optimizer is one)."""

    family: UpdateFamily
    state_names: tuple[str, ...]  # every state tensor the family keeps per parameter (torch's names)

    def update_row(self, group: dict[str, Any], step: int, first: bool) -> Any:
        """The update's row of hyperparameters for ``group`` at step ``step`` (``first``: a parameter's first)."""

    def state_names_of(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state a parameter of ``group`` gets at its first step (torch's names)."""

    def pads_stay_zero(self) -> bool:
        """Whether the update keeps zero padding at zero (runs may then cross it)."""

    def initial_state(self, name: str, group: dict[str, Any]) -> float:
        """The value state ``name`` of a parameter of ``group`` starts from (0 but for Adagrad's ``sum``)."""


@dataclasses.dataclass(eq=False)
class SpanMember:
    """One parameter a span stepper updates (maybe partly), and what it remembers of it between steps."""

    param: torch.nn.Parameter
    group: int  # index of its parameter group
    index: int = 0  # position in its FlatGroup: its step count in FlatState.steps; neighbours differ by one
    start: int = 0  # its elements [start, end) of the span (relative to the span's start; empty outside it)
    end: int = 0
    started: bool = False  # had its first step: torch creates state lazily, at a parameter's first gradient
    has_entry: bool = False  # the owning optimizer's torch-format state holds an entry for it
    version: int = -1  # param._version when the engine last wrote it or took its masters from it
    ahead: bool = False  # stepped ahead of its optimizer's step() (FlatOptimizer.step_ahead), not again there


class SpanStepper:
    """Steps the span ``[start, end)`` of one flat buffer of a FlatParams with one update rule.

    Args:
        flat: the :class:`~tfuse.flat.FlatParams` holding the buffer.
        group: the buffer (one of ``flat.groups``).
        rule: the update family and its rows (a fused optimizer, see :class:`UpdateRule`); held weakly,
            so the caller keeps it alive (an optimizer holds its own spans).
        span: the element range to update (None: the whole buffer).
        master_weights: keep float32 masters and state (float16/bfloat16 buffers only).
        capturable: keep step counts on the device; a step reads nothing on the host.
        state: the FlatState of another span stepper over the same buffer and range, to share (its members and
            this one's must differ); None: a new one (with the rule's ``state_aliases``).

    The members (:meth:`set_members`) are the parameters to update with
    their parameter group; a member outside the span gets an empty range (it
    is counted, not updated).

    Example: the second half of a buffer, stepped like torch's Adam.
        >>> import torch
        >>> from tfuse.flat import FlatParams
        >>> from tfuse.optim import FusedAdam
        >>> from tfuse.optim.span import SpanMember, SpanStepper
        >>> layer = torch.nn.Linear(100, 3)
        >>> flat = FlatParams(layer, world_size=2)
        >>> rule = FusedAdam(flat, lr=0.1)  # the rule and the parameter groups
        >>> shard = flat.shards(2)[0][1]
        >>> span = SpanStepper(flat, flat.groups[0], rule, span=(shard.start, shard.end))
        >>> span.set_members([SpanMember(p, 0) for p in (layer.weight, layer.bias)])
        >>> layer(torch.randn(2, 100)).sum().backward()
        >>> before = layer.weight.detach().clone()
        >>> started = span.step(rule.param_groups, (True, True))
        >>> [m.param.shape for m in started], span.state.ensure("exp_avg").shape
        ([torch.Size([3]), torch.Size([3, 100])], torch.Size([192]))
        >>> changed = (layer.weight != before).flatten()  # the weight's elements in the span only
        >>> bool(changed[:128].any()), bool(changed[128:].all())
        (False, True)
    """

    def __init__(
        self,
        flat: FlatParams,
        group: FlatGroup,
        rule: UpdateRule,
        *,
        span: tuple[int, int] | None = None,
        master_weights: bool = False,
        capturable: bool = False,
        state: FlatState | None = None,
    ) -> None:
        self.flat = flat
        # Held weakly: the rule is usually the optimizer that holds this span (a cycle would keep a deleted
        # optimizer's state alive until the garbage collector runs).
        self.rule = weakref.proxy(rule)
        self.rule_id = id(rule)  # (a proxy hides its referent's identity)
        self.device, self.dtype = group.device, group.dtype
        self.master_weights = master_weights and group.dtype in LOW_PRECISION
        self.capturable = capturable
        start, end = (0, None) if span is None else span
        if state is None:
            aliases = getattr(rule, "state_aliases", None)
            state = FlatState(group, start, end, master_weights=self.master_weights, steps_on_device=capturable,
                              aliases=aliases)  # fmt: skip
        elif state.group is not group or (state.start, state.end) != (
            start,
            group.data.numel() if end is None else end,
        ):
            raise ValueError("SpanStepper: a shared FlatState must cover the same buffer and range")
        self.state = state  # (shared by the span steppers of several rules over one buffer: FusedMuon's kinds)
        # Parameter offsets are multiples of this many elements (capped: 16 is enough for 128-bit accesses).
        self.align = min(MAX_ALIGN, max(1, flat.align_bytes // group.data.element_size()))
        self.layout_version = flat.layout_version
        self.members: list[SpanMember] = []
        self.params: list[torch.nn.Parameter] = []  # the members' parameters (read at every step)
        self.plans: collections.OrderedDict[tuple[bool, ...], StepPlan] = collections.OrderedDict()
        self.last_backend: Backend | None = None  # what ran the last update (the owner logs it)
        # A shard owner's sum across ranks of per-parameter partial sums (LAMB's and LARS's norms); every rank
        # calls it once per step of a per-parameter family, with zeros when its shard holds no active element.
        self.reduce_sums: Callable[[torch.Tensor], None] | None = None

    # ------------------------------------------------------------------ members and layout

    def set_members(self, members: list[SpanMember]) -> None:
        """The parameters to update (sorted into buffer order; each gets its range in the span)."""
        self.members = members
        self._place()

    def follow_layout(self) -> None:
        """Moves the state to the new offsets after the FlatParams laid its buffers out again (whole-buffer spans)."""
        group = next(g for g in self.flat.groups if g.device == self.device and g.dtype == self.dtype)
        self.state.follow(group)
        self.layout_version = self.flat.layout_version
        self._place()

    def _place(self) -> None:
        # Member ranges are relative to the state's range and clipped to it (a shard owner updates the
        # part of a straddling parameter inside its shard; a parameter outside it gets an empty range).
        lo, hi = self.state.start, self.state.end
        for member in self.members:
            where = self.flat.range_of(member.param)  # the layout, as the FlatParams states it
            member.index = self.state.index_of(member.param)
            member.start = min(max(where.start, lo), hi) - lo
            member.end = min(max(where.end, lo), hi) - lo
        self.members.sort(key=lambda m: m.index)
        self.params = [m.param for m in self.members]
        self.plans.clear()

    def plan(self, active: tuple[bool, ...]) -> StepPlan:
        """The (cached) plan of a step in which the members flagged in ``active`` have gradients."""
        plan = self.plans.get(active)
        if plan is None:
            plan = self.plans[active] = StepPlan([m for m, on in zip(self.members, active) if on])
            if len(self.plans) > CACHE_SIZE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(active)
        return plan

    # ------------------------------------------------------------------ step

    def step(
        self,
        groups: list[dict[str, Any]],
        active: tuple[bool, ...],
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
        owner: str = "",
    ) -> list[SpanMember]:
        """One update of the span for the members flagged in ``active``; returns those that had their first step.

        Args:
            groups: the parameter groups (each member's ``group`` indexes them).
            active: per member (in :attr:`members` order), whether it steps now (has a gradient).
            grad_scale: GradScaler's scale, divided out of the gradients by the update.
            found_inf: GradScaler's flag, read on the device (capturable spans only: the update and the step
                counts stand still where it is set; a host-side caller skips the whole step instead).
            owner: the optimizer's name, for error messages.

        Step counts advance for every active member, even one with no
        element in the span (every shard owner counts every parameter).
        """
        plan = self.plan(active)
        reduce_sums = self.reduce_sums if self.rule.family.per_parameter else None
        if not plan.members:
            if reduce_sums is not None:  # nothing active here: the other ranks' norms still need our (zero) sums
                reduce_sums(self._zero_sums())
            return []
        fresh = tuple(not m.started for m in plan.members)
        started = [m for m, first in zip(plan.members, fresh) if first]
        if started:
            self.start(started, groups)
        backend = select_backend(self.device, owner or self.rule.__class__.__name__)
        if self.capturable:
            self._step_on_device(plan, fresh, groups, grad_scale, found_inf, backend)
        else:
            counts = None
            if self.rule.family.uses_step:
                steps = self.state.steps.numpy()  # shares memory with torch-format 'step' entries
                steps[plan.positions] += 1
                counts = steps[plan.positions]
            if self.master_weights:
                self.refresh_masters(plan.members)
            rows, member_rows = self._rows(plan, counts, fresh, groups)
            family = self.rule.family
            slots = len(self.state.steps)
            table = plan.table(member_rows, self.align, self.rule.pads_stay_zero(), family.per_parameter, slots)
            if table is not None:
                buffers = dataclasses.replace(self.state.buffers_for_update(), reduce_sums=reduce_sums)
                update(family, buffers, table, rows, grad_scale=grad_scale, backend=backend)
            elif reduce_sums is not None:  # nothing of the active parameters here: the others' sums still need ours
                reduce_sums(self._zero_sums())
        self.last_backend = backend
        if self.master_weights:
            self.note_versions(plan.members)  # masters and parameters agree
        return started

    def _zero_sums(self) -> torch.Tensor:
        """A shard owner's per-parameter sums when it holds nothing of the active parameters (LAMB, LARS)."""
        return torch.zeros(len(self.state.steps), 2, dtype=acc_dtype(self.dtype), device=self.device)

    def _step_on_device(
        self,
        plan: StepPlan,
        fresh: tuple[bool, ...],
        groups: list[dict[str, Any]],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        backend: Backend,
    ) -> None:
        """A capturable step: one row per member, its coefficients computed from device tensors.

        Each member keeps its own step count on the device (as torch's
        capturable optimizers do); the count advances by ``1 - found_inf`` and
        the kernel skips the update when ``found_inf`` is set. The static part
        of the table (betas, eps, flags) is made once per plan and hyperparameter
        values and kept on the device; lr comes from each group, a tensor read
        on the device, or a float (kept with the static part, so a new float lr
        costs one copy and a captured graph keeps the lr it was captured with).
        """
        device, family = self.device, self.rule.family
        setup = plan.device_setup(self.rule, groups, fresh, device)
        steps = None
        if family.uses_step:
            state_steps = self.state.steps
            increment = setup.ones if found_inf is None else (1 - found_inf.to(torch.float32)).expand_as(setup.ones)
            state_steps.index_add_(0, setup.positions, increment)
            steps = state_steps[setup.positions]
        lr = setup.lr_rows(groups, device)
        if self.master_weights:
            self.refresh_masters(plan.members)
        if backend is Backend.TRITON:
            coefficients = family.device_coefficients(setup.static, lr, steps)
            rows = setup.hypers
        else:
            coefficients = None
            rows = [
                dataclasses.replace(
                    hyper,
                    lr=groups[m.group]["lr"],
                    **({"step": self.state.steps[m.index]} if family.uses_step else {}),
                )
                for hyper, m in zip(setup.hypers, plan.members)
            ]
        per_parameter = self.rule.family.per_parameter
        table = plan.table(tuple(range(len(plan.members))), self.align, self.rule.pads_stay_zero(), per_parameter)
        if table is None:
            return
        update(
            family,
            self.state.buffers_for_update(),
            table,
            rows,
            grad_scale=grad_scale,
            found_inf=found_inf,
            coefficients=coefficients,
            backend=backend,
        )

    def _rows(
        self, plan: StepPlan, counts: np.ndarray | None, fresh: tuple[bool, ...], groups: list[dict[str, Any]]
    ) -> tuple[list[Any], tuple[int, ...]]:
        """This step's rows of hyperparameters (one per distinct group, step count and first step) and each
        member's row."""
        row = self.rule.update_row
        if not any(fresh) and (counts is None or bool((counts == counts[0]).all())):
            # The usual step: no first step, one step count throughout, so one row per group.
            step = 0 if counts is None else int(counts[0])
            return [row(groups[g], step, False) for g in plan.groups], plan.group_rows
        steps = itertools.repeat(0) if counts is None else counts.astype(np.int64).tolist()
        keys: dict[tuple[int, int, bool], int] = {}
        member_keys = zip((m.group for m in plan.members), steps, fresh)
        member_rows = tuple(keys.setdefault(key, len(keys)) for key in member_keys)
        return [row(groups[g], step, first) for g, step, first in keys], member_rows

    # ------------------------------------------------------------------ state

    def start(self, members: list[SpanMember], groups: list[dict[str, Any]]) -> None:
        """torch's state creation for members (at their first step, lazily; or eagerly, as Adagrad does): their part
        of the state starts at the rule's initial value (zero but for Adagrad's ``sum``), their step count at 0
        and their masters at the parameters' values."""
        state, uses_step = self.state, self.rule.family.uses_step
        for member in members:
            member.started = True
            member.version = -1  # masters from the parameter (refresh_masters)
            if uses_step:
                state.steps[member.index] = 0.0
            group = groups[member.group]
            for name in self.rule.state_names_of(group):
                state.ensure(name)[member.start : member.end].fill_(self.rule.initial_state(name, group))
        if self.master_weights:
            self.refresh_masters(members)

    def refresh_masters(self, members: list[SpanMember]) -> None:
        """Float32 masters of the members' part of the span, taken from their parameters where the parameter was
        written since the engine last wrote it (its first step; the model's ``load_state_dict``; ``p.copy_``):
        nothing the user set is lost."""
        self.state.ensure_master()
        for member in members:
            if member.param._version != member.version:
                self._take_master(member)

    def _take_master(self, member: SpanMember) -> None:
        state = self.state
        if state.covers(member.param):
            state.master_view(member.param).copy_(member.param.detach())
        elif member.end > member.start:
            state.master[member.start : member.end].copy_(
                state.group.data[state.start + member.start : state.start + member.end]
            )
        member.version = member.param._version

    def note_versions(self, members: list[SpanMember]) -> None:
        """The engine (or a gather of its shards) wrote these members' parameters: their masters still agree."""
        for member in members:
            member.version = member.param._version

    def current_members(self) -> list[SpanMember]:
        """With master weights: the members whose masters agree with their parameters now."""
        if not self.master_weights:
            return []
        return [m for m in self.members if m.version == m.param._version]

    def reset(self) -> None:
        """Forgets every member's state (zeroes; no member has started): before loading a state dict."""
        self.state.reset()
        for member in self.members:
            member.started = member.has_entry = False
            member.version = -1

    def entry_views(self, member: SpanMember, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """A fully covered member's torch-format state: views of the span's step count, state and master."""
        state, entry = self.state, {}
        if names and self.rule.family.uses_step:
            entry["step"] = state.step(member.param)
        for name in names:
            entry[name] = state.view(name, member.param)
        if self.master_weights:
            entry[MASTER_KEY] = state.master_view(member.param)
        return entry

    def load_member(self, member: SpanMember, saved: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
        """Writes one parameter's torch-format state (``saved``, already checked) into its part of the span.

        Returns its torch-format entry: views into the span's state for a
        parameter the span covers whole, plus copies of the entry's other
        values; tensors of a partly covered parameter are left out. Masters
        not in ``saved`` are taken from the parameter. The member counts as
        started when ``saved`` is not empty.
        """
        state, param, names = self.state, member.param, self.rule.state_names
        covered = state.covers(param)
        entry: dict[str, Any] = {}
        member.version = -1
        for name, value in saved.items():
            if name == "step":
                state.steps[member.index] = float(value)
                entry["step"] = state.step(param)
            elif name == MASTER_KEY:
                if self.master_weights and isinstance(value, torch.Tensor):
                    self._write(state.ensure_master(), member, value.to(self.device, torch.float32))
                    member.version = param._version
                    if covered:
                        entry[MASTER_KEY] = state.master_view(param)
            elif isinstance(value, torch.Tensor) and name in names:
                self._write(state.ensure(name), member, value)
                if covered:
                    entry[name] = state.view(name, param)
            elif value is not None:
                entry[name] = copy.deepcopy(value)
        member.started = bool(entry)
        if not entry:
            return entry
        for name in self.rule.state_names_of(groups[member.group]):
            state.ensure(name)  # every owner of a span holds the same buffers (the next step updates them)
        if self.master_weights and member.version == -1:
            state.ensure_master()
            self._take_master(member)
        if self.master_weights and covered:
            entry.setdefault(MASTER_KEY, state.master_view(param))
        if self.rule.family.uses_step:
            entry.setdefault("step", state.step(param))
        return entry

    def _write(self, target: torch.Tensor, member: SpanMember, value: torch.Tensor) -> None:
        """Copies a parameter-shaped ``value`` into the member's part of ``target`` (a state buffer of the span)."""
        if member.end <= member.start:
            return
        state, param = self.state, member.param
        group, index = state.group, member.index
        offset = group.offsets[index] - state.start
        if state.covers(param):
            where = target.storage_offset() + offset
            target.as_strided(group.shapes[index], group.strides[index], where).copy_(value)
            return
        # The value in slot order (element k = element k of the parameter's slot), then the span's part of it.
        slot = torch.empty(param.numel(), dtype=target.dtype, device=target.device)
        slot.as_strided(group.shapes[index], group.strides[index]).copy_(value)
        target[member.start : member.end].copy_(slot[member.start - offset : member.end - offset])


def closure_and_amp(
    optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None
) -> tuple[float | None, torch.Tensor | None, torch.Tensor | None]:
    """The start of a step: the closure's loss (run with gradients on), and GradScaler's ``grad_scale`` and
    ``found_inf`` (set on the optimizer when it declares ``_step_supports_amp_scaling``; None otherwise)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    return loss, getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)

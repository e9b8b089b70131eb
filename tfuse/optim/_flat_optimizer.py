"""The fused optimizers' base: a torch.optim.Optimizer whose parameters live in flat buffers.

:class:`FlatOptimizer` is a thin layer between torch.optim's bookkeeping and
the flat update:

* Parameter groups, defaults, ``state_dict()``, step hooks and the
  implementation checks of ``add_param_group`` are torch.optim's own.
* Each parameter is bound once, when its group is added, to the
  :class:`~tfuse.flat.FlatParams` that holds it (the one passed as ``params``,
  the one its memory belongs to, or a new one the optimizer coalesces it into).
  The optimizer holds every FlatParams it updates (:attr:`FlatOptimizer.flat_params`).
* The state of each flat buffer is a :class:`~tfuse.optim._state.FlatState`;
  ``optimizer.state[p]`` holds views of it in torch.optim's format.
* A step updates each flat buffer with one call of the family's update
  (:mod:`tfuse.optim._update`): one Triton launch, or torch's fused kernels
  over whole runs of the buffer on the PyTorch path.

Subclasses declare their update family, the state they keep and the
torch.optim class they replace, check their hyperparameters and turn a group
into a row of hyperparameters (:meth:`FlatOptimizer._hyper`).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from tfuse._backend import Backend, requested_backend, select_backend, triton_available
from tfuse._eager import eager_in_compiled_code
from tfuse.flat import FlatGroup, FlatParams, flat_params_of
from tfuse.optim._checks import IMPLEMENTATION_FLAGS, check_implementation_flags, check_params
from tfuse.optim._state import FlatState
from tfuse.optim._update import LOW_PRECISION, MAX_ALIGN, RunTable, UpdateFamily, upcasts, update

logger = logging.getLogger(__name__)

MASTER_KEY = "master_param"
_CACHE_SIZE = 8  # step plans per flat buffer, and run tables per plan


@dataclasses.dataclass(eq=False)
class _Member:
    """One parameter the optimizer updates, and what the optimizer remembers of it between steps."""

    param: torch.nn.Parameter
    group: int  # index of its group in optimizer.param_groups
    index: int = 0  # position in its FlatGroup: its step count in FlatState.steps; neighbours differ by one
    start: int = 0  # its elements [start, end) of the flat buffer
    end: int = 0
    started: bool = False  # had its first step: torch creates state lazily, at a parameter's first gradient
    has_entry: bool = False  # optimizer.state holds an entry for it
    version: int = -1  # param._version when the optimizer last wrote it (master weights, see _refresh_masters)


class _Plan:
    """What a step does for one set of members with gradients (cached per set: most steps look like the last)."""

    def __init__(self, members: list[_Member]) -> None:
        self.members = members
        self.positions = np.array([m.index for m in members], dtype=np.int64)  # into FlatState.steps
        self.groups = list(dict.fromkeys(m.group for m in members))  # distinct parameter groups
        rank = {group: row for row, group in enumerate(self.groups)}
        self.group_rows = tuple(rank[m.group] for m in members)  # each member's row when all share a step count
        self.tables: collections.OrderedDict[Any, RunTable] = collections.OrderedDict()
        self.device_setups: dict[Any, _DeviceSetup] = {}

    def device_setup(self, optimizer: FlatOptimizer, fresh: tuple[bool, ...], device: torch.device) -> _DeviceSetup:
        """What a capturable step of this plan keeps on the device, for these hyperparameters."""
        groups = optimizer.param_groups
        # Rows at lr 0: a tensor lr is read on the device, never here (item() would sync).
        rows = {}
        for index in self.groups:
            at_zero = {**groups[index], "lr": 0.0}
            rows[index] = (optimizer._hyper(at_zero, 1, False), optimizer._hyper(at_zero, 1, True))
        hypers = tuple(rows[m.group][first] for m, first in zip(self.members, fresh))
        floats = tuple(None if isinstance(g["lr"], torch.Tensor) else float(g["lr"]) for g in groups)
        key = (hypers, floats)
        setup = self.device_setups.get(key)
        if setup is None:
            if len(self.device_setups) >= _CACHE_SIZE:
                self.device_setups.clear()
            setup = self.device_setups[key] = _DeviceSetup(self, hypers, floats, device)
        return setup


class _DeviceSetup:
    """A capturable step's device tensors for one plan: member positions, the static coefficient table,
    the float learning rates of the rows (tensor learning rates are gathered at each step)."""

    def __init__(
        self, plan: _Plan, hypers: tuple[Any, ...], floats: tuple[float | None, ...], device: torch.device
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


class _Buffer:
    """One flat parameter buffer the optimizer updates.

    Holds the FlatParams it belongs to, the optimizer's parameters in it (in
    buffer order), their :class:`FlatState` and the cached step plans.
    """

    def __init__(
        self,
        flat: FlatParams,
        group: FlatGroup,
        master_weights: bool,
        span: tuple[int, int] | None = None,
        capturable: bool = False,
    ) -> None:
        self.flat = flat
        self.device, self.dtype = group.device, group.dtype
        self.master_weights = master_weights and group.dtype in LOW_PRECISION
        # span: the element range this optimizer updates (a shard owner's share); None: the whole buffer.
        start, end = (0, None) if span is None else span
        self.state = FlatState(group, start, end, master_weights=self.master_weights, steps_on_device=capturable)
        # Parameter offsets are multiples of this many elements (capped: 16 is enough for 128-bit accesses).
        self.align = min(MAX_ALIGN, max(1, flat.align_bytes // group.data.element_size()))
        self.layout_version = flat.layout_version
        self.members: list[_Member] = []
        self.params: list[torch.nn.Parameter] = []  # the members' parameters (read at every step)
        self.plans: collections.OrderedDict[tuple[bool, ...], _Plan] = collections.OrderedDict()

    def set_members(self, members: list[_Member]) -> None:
        self.members = members
        self._place()

    def follow_layout(self) -> None:
        """Moves the state to the new offsets after the FlatParams laid its buffers out again."""
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

    def plan(self, active: tuple[bool, ...]) -> _Plan:
        plan = self.plans.get(active)
        if plan is None:
            plan = self.plans[active] = _Plan([m for m, on in zip(self.members, active) if on])
            if len(self.plans) > _CACHE_SIZE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(active)
        return plan

    def table(self, plan: _Plan, member_rows: tuple[int, ...], pad: bool) -> RunTable:
        """The runs of this step: maximal ranges of adjacent members that share a row.

        ``pad``: runs may cross the zero padding between neighbours (never
        another parameter) and end rounded up into it, when the update keeps
        zeros at zero: fewer, aligned runs.
        """
        key = (member_rows, pad)
        table = plan.tables.get(key)
        if table is not None:
            plan.tables.move_to_end(key)
            return table
        align = self.align
        runs: list[tuple[int, int, int]] = []
        previous = -2
        for member, row in zip(plan.members, member_rows):
            end = -(-member.end // align) * align if pad else member.end
            if pad and runs and runs[-1][2] == row and member.index == previous + 1:
                runs[-1] = (runs[-1][0], end, row)
            else:
                runs.append((member.start, end, row))
            previous = member.index
        table = plan.tables[key] = RunTable(runs, start_align=align, end_align=align if pad else 1)
        if len(plan.tables) > _CACHE_SIZE:
            plan.tables.popitem(last=False)
        return table


class FlatOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: parameters in flat buffers, one update per buffer.

    Subclasses set :attr:`family` (the update maths), :attr:`state_names`
    (every per-parameter state tensor they keep, by torch's names) and
    :attr:`torch_name`, and implement :meth:`_check_group` and :meth:`_hyper`.
    """

    family: ClassVar[UpdateFamily]
    state_names: ClassVar[tuple[str, ...]]
    torch_name: ClassVar[str]  # the torch.optim class this one replaces (named in error messages)
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init__(
        self, params: Any, defaults: dict[str, Any], master_weights: bool = False, capturable: bool | None = None
    ) -> None:
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        # torch's switch in the groups (Adam), or an argument of optimizers whose torch class has none (SGD).
        self.capturable = bool(defaults.get("capturable", False)) if capturable is None else capturable
        self._check_flags(defaults)
        self.master_weights = master_weights
        self._init_runtime()
        if isinstance(params, FlatParams):
            self._flats.append(params)  # bound to this very FlatParams
        # The constructor's groups are coalesced together (one buffer per device and dtype,
        # so one launch whatever the number of groups); later add_param_group calls coalesce
        # their own new parameters.
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self._bind([p for group in self.param_groups for p in group["params"]])

    def _init_runtime(self) -> None:
        """What the optimizer keeps besides torch's defaults/state/param_groups (rebuilt after a copy)."""
        self._buffers: list[_Buffer] = []
        self._flats: list[FlatParams] = []  # every FlatParams it updates; held here (nothing else keeps them alive)
        self._entries = 0  # members with an entry in self.state (a drop in len(self.state) shows a clear())
        self._announced: set[tuple] = set()  # (device, dtype, backend) already logged
        self._constructing = False

    @property
    def flat_params(self) -> tuple[FlatParams, ...]:
        """The FlatParams whose buffers the optimizer updates (each holds some of its parameters)."""
        return tuple(self._flats)

    # ------------------------------------------------------------------ groups

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises ValueError (torch's wording) for a bad hyperparameter of ``group``."""
        raise NotImplementedError

    def _check_flags(self, group: dict[str, Any]) -> None:
        """Checks torch.optim's implementation switches in ``group`` (see :func:`check_implementation_flags`)."""
        check_implementation_flags(type(self).__name__, self.torch_name, group)
        if "capturable" in group and bool(group["capturable"]) != self.capturable:
            raise ValueError(
                f"{type(self).__name__}: capturable={group.get('capturable')} in a parameter group of an optimizer "
                f"built with capturable={self.capturable}: the step counts of one optimizer live in one place "
                "(on the device when capturable), so every group must agree"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group as torch does, checks it, and binds its parameters to flat buffers.

        A :class:`~tfuse.flat.FlatParams` given as the group's ``params`` is
        the one its parameters are updated in; parameters in no FlatParams are
        coalesced into a new one.
        """
        flat = None
        if isinstance(param_group, dict):
            flat = param_group.get("params")
            param_group = dict(param_group)  # torch edits the dict it is given; the caller's stays as it was
        with warnings.catch_warnings():
            # torch only warns about duplicates (an error "in future"); check_params raises it now.
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)  # Tensors, leaves, names, defaults, no parameter in two groups
        group = self.param_groups[-1]
        try:
            check_params(type(self).__name__, group["params"])
            self._check_group(group)
            self._check_flags(group)
        except Exception:
            self.param_groups.pop()
            raise
        if isinstance(flat, FlatParams) and flat not in self._flats:
            self._flats.append(flat)
        if not self._constructing:
            self._bind(group["params"])

    def _flat_of(self, param: torch.Tensor) -> FlatParams | None:
        for flat in self._flats:
            if flat.holds(param):
                return flat
        return flat_params_of(param)

    def _bind(self, new: list[torch.Tensor]) -> None:
        """Binds new parameters to the FlatParams holding them (coalescing loose ones) and rebuilds the buffers.

        Members already bound keep their records and state; a buffer whose
        FlatParams was laid out again since the last step follows first.
        """
        loose = [p for p in new if self._flat_of(p) is None]
        if loose:
            self._flats.append(FlatParams(loose))
        known = {id(m.param): m for b in self._buffers for m in b.members}
        existing = {(id(b.flat), b.device, b.dtype): b for b in self._buffers}
        buffers: dict[tuple, tuple[_Buffer, list[_Member]]] = {}
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                flat = self._flat_of(param)
                key = (id(flat), param.device, param.dtype)
                if key not in buffers:
                    buffer = existing.get(key)
                    if buffer is None:
                        buffer = _Buffer(
                            flat, flat.groups[flat.range_of(param).buffer], self.master_weights, None, self.capturable
                        )
                    elif buffer.layout_version != flat.layout_version:
                        self._follow_layout(buffer)
                    buffers[key] = (buffer, [])
                member = known.get(id(param)) or _Member(param, index)
                member.group = index
                buffers[key][1].append(member)
        for buffer, members in buffers.values():
            buffer.set_members(members)
        self._buffers = [buffer for buffer, _ in buffers.values()]
        self._flats = list(dict.fromkeys(buffer.flat for buffer in self._buffers))

    def _follow_layout(self, buffer: _Buffer) -> None:
        logger.info("tfuse: flat layout changed; moving optimizer state to the new offsets")
        buffer.follow_layout()
        state = buffer.state
        for member in buffer.members:
            entry = self.state.get(member.param)
            for name in entry or ():
                if name == "step":
                    entry[name] = state.step(member.param)
                elif name == MASTER_KEY:
                    entry[name] = state.master_view(member.param)
                elif name in state.buffers:
                    entry[name] = state.view(name, member.param)

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's picklable state, plus ``master_weights``.

        State tensors are handed out compact (cloned): each is a view of a whole
        flat state buffer, and pickle would otherwise write the whole buffer once
        per view. The flat buffers themselves are not part of the state; they are
        rebuilt by :meth:`__setstate__`.
        """
        state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for p, entry in self.state.items()
        }
        return {**self._raw_state(), "state": state}

    def _raw_state(self) -> dict[str, Any]:
        # The FlatParams the parameters live in travel along: copied in the same deepcopy call as the
        # parameters (or unpickled with them), they coalesce the copies again with the same layout, whichever
        # of the model, the FlatParams and the optimizer the call reaches first; the copy then holds them.
        return {
            "defaults": self.defaults,
            "state": self.state,
            "param_groups": self.param_groups,
            "master_weights": self.master_weights,
            "capturable": self.capturable,
            "flat_params": list(self._flats),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds an optimizer from :meth:`__getstate__`'s state (unpickling, copy.deepcopy).

        As with torch.optim, the copy holds the parameters it was given (the
        copies a deepcopy or unpickle made), bound to the copied FlatParams
        that hold them; parameters in none are coalesced into new ones, and the
        per-parameter state is copied into the new flat state buffers.
        """
        state = dict(state)
        saved_state = state.pop("state", {})
        flats = state.pop("flat_params", []) + state.pop("owned_flat_params", [])  # (the latter: older pickles)
        state.setdefault("master_weights", False)
        capturable = state.pop("capturable", None)
        super().__setstate__(state)
        self.capturable = bool(self.defaults.get("capturable", False)) if capturable is None else capturable
        self._init_runtime()
        self._flats = list(flats)
        for group in self.param_groups:
            for name, default in self.defaults.items():
                group.setdefault(name, default)
        self.state = collections.defaultdict(dict)
        self._bind([p for group in self.param_groups for p in group["params"]])
        place = {id(m.param): (b, m) for b in self._buffers for m in b.members}
        for param, entry in saved_state.items():
            where = place.get(id(param))
            if where is not None and entry:
                self.state[param] = self._adopt(*where, entry)

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatOptimizer:
        """A deep copy like torch.optim's: copies of the parameters (shared with whatever else
        the same ``copy.deepcopy`` call copies, e.g. the model), copies of the state."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        # The views go to deepcopy as they are: it copies each flat buffer's storage once.
        copied.__setstate__(copy.deepcopy(self._raw_state(), memo))
        return copied

    # ------------------------------------------------------------------ what subclasses say

    def _hyper(self, group: dict[str, Any], step: int, first: bool) -> Any:
        """The update row (:class:`~tfuse.optim._update.AdamStep`...) of ``group`` at step ``step``;
        ``first``: the parameters' first step."""
        raise NotImplementedError

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The flat state a parameter of ``group`` gets at its first step (none: SGD without momentum)."""
        return self._hyper(group, 1, True).state_names

    def _pads_stay_zero(self) -> bool:
        """Whether the update keeps zero padding at zero (runs may then cross it)."""
        return True

    # ------------------------------------------------------------------ step

    @eager_in_compiled_code  # runs eagerly inside compiled code: one launch per buffer, nothing to trace
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step: one update launch per flat buffer.

        Args:
            closure: reevaluates the model and returns the loss (as in torch.optim).

        With ``capturable=True`` the step reads nothing on the host and copies
        nothing to the device: step counts and the coefficient table are
        computed on the device, and a GradScaler's ``found_inf`` is read by the
        kernel (the step is skipped there). Otherwise the step counts are on
        the host, the coefficient table is sent from pinned memory (no sync),
        and under a GradScaler ``found_inf`` is read once (one sync per step).
        """
        loss, grad_scale, found_inf = closure_and_amp(self, closure)
        if found_inf is not None and not self.capturable and bool(found_inf.item()):
            # GradScaler found inf/NaN: skip the step, nothing changes. The host step counts must not advance,
            # so this reads one scalar (capturable=True decides on the device instead).
            return loss
        for flat in self._flats:
            flat.sync_grads()
        if self._entries > len(self.state):
            self._forget_removed_entries()  # someone cleared optimizer.state (or deleted entries)
        for buffer in self._buffers:
            if buffer.layout_version != buffer.flat.layout_version:
                self._follow_layout(buffer)
            self._step_buffer(buffer, grad_scale, found_inf if self.capturable else None)
        return loss

    def _step_buffer(self, buffer: _Buffer, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        plan = buffer.plan(tuple([p.grad is not None for p in buffer.params]))
        if not plan.members:
            return
        fresh = [not m.started for m in plan.members]
        if any(fresh):
            self._start(buffer, [m for m, first in zip(plan.members, fresh) if first])
        if self.capturable:
            self._step_on_device(buffer, plan, tuple(fresh), grad_scale, found_inf)
            return
        counts = None
        if self.family.uses_step:
            steps = buffer.state.steps.numpy()  # shares memory with the 'step' entries of optimizer.state
            steps[plan.positions] += 1
            counts = steps[plan.positions]
        if buffer.master_weights:
            self._refresh_masters(buffer, plan.members)
        rows, member_rows = self._rows(plan, counts, fresh)
        table = buffer.table(plan, member_rows, self._pads_stay_zero())
        backend = select_backend(buffer.device, type(self).__name__)
        update(self.family, buffer.state.buffers_for_update(), table, rows, grad_scale=grad_scale, backend=backend)
        self._announce(buffer, backend)
        if buffer.master_weights:
            for member in plan.members:
                member.version = member.param._version

    def _step_on_device(
        self,
        buffer: _Buffer,
        plan: _Plan,
        fresh: tuple[bool, ...],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
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
        device = buffer.device
        groups = self.param_groups
        setup = plan.device_setup(self, fresh, device)
        steps = None
        if self.family.uses_step:
            state_steps = buffer.state.steps
            increment = setup.ones if found_inf is None else (1 - found_inf.to(torch.float32)).expand_as(setup.ones)
            state_steps.index_add_(0, setup.positions, increment)
            steps = state_steps[setup.positions]
        lr = setup.lr_rows(groups, device)
        if buffer.master_weights:
            self._refresh_masters(buffer, plan.members)
        backend = select_backend(device, type(self).__name__)
        if backend is Backend.TRITON:
            coefficients = self.family.device_coefficients(setup.static, lr, steps)
            rows = setup.hypers
        else:
            coefficients = None
            rows = [
                dataclasses.replace(
                    hyper,
                    lr=groups[m.group]["lr"],
                    **({"step": buffer.state.steps[m.index]} if self.family.uses_step else {}),
                )
                for hyper, m in zip(setup.hypers, plan.members)
            ]
        table = buffer.table(plan, tuple(range(len(plan.members))), self._pads_stay_zero())
        update(
            self.family,
            buffer.state.buffers_for_update(),
            table,
            rows,
            grad_scale=grad_scale,
            found_inf=found_inf,
            coefficients=coefficients,
            backend=backend,
        )
        self._announce(buffer, backend)
        if buffer.master_weights:
            for member in plan.members:
                member.version = member.param._version

    def _rows(self, plan: _Plan, counts: np.ndarray | None, fresh: list[bool]) -> tuple[list[Any], tuple[int, ...]]:
        """This step's rows of hyperparameters (one per distinct group, step count and first step) and each
        member's row."""
        groups = self.param_groups
        if not any(fresh) and (counts is None or bool((counts == counts[0]).all())):
            # The usual step: no first step, one step count throughout, so one row per group.
            step = 0 if counts is None else int(counts[0])
            return [self._hyper(groups[g], step, False) for g in plan.groups], plan.group_rows
        steps = itertools.repeat(0) if counts is None else counts.astype(np.int64).tolist()
        keys: dict[tuple[int, int, bool], int] = {}
        member_keys = zip((m.group for m in plan.members), steps, fresh)
        member_rows = tuple(keys.setdefault(key, len(keys)) for key in member_keys)
        return [self._hyper(groups[g], step, first) for g, step, first in keys], member_rows

    def _start(self, buffer: _Buffer, members: list[_Member]) -> None:
        """torch's lazy state creation, for members getting their first gradient: zeroed views."""
        state = buffer.state
        names_of: dict[int, tuple[str, ...]] = {}
        for member in members:
            member.started = True
            names = names_of.get(member.group)
            if names is None:
                names = names_of[member.group] = self._state_names(self.param_groups[member.group])
            if not (names or buffer.master_weights):
                continue
            entry = self.state[member.param]
            entry.clear()
            if names and self.family.uses_step:
                state.steps[member.index] = 0.0
                entry["step"] = state.step(member.param)
            for name in names:
                state.ensure(name)
                view = state.view(name, member.param)
                view.zero_()
                entry[name] = view
            if buffer.master_weights:
                self._init_master(buffer, member)
                entry[MASTER_KEY] = state.master_view(member.param)
            self._set_has_entry(member, True)

    def _set_has_entry(self, member: _Member, has_entry: bool) -> None:
        self._entries += has_entry - member.has_entry
        member.has_entry = has_entry

    def _forget_removed_entries(self) -> None:
        for buffer in self._buffers:
            for member in buffer.members:
                if member.has_entry and not self.state.get(member.param):
                    self._set_has_entry(member, False)
                    member.started = False

    def _init_master(self, buffer: _Buffer, member: _Member, value: torch.Tensor | None = None) -> None:
        buffer.state.ensure_master()
        buffer.state.master_view(member.param).copy_(member.param.detach() if value is None else value)
        member.version = member.param._version

    def _refresh_masters(self, buffer: _Buffer, members: list[_Member]) -> None:
        """A parameter written through its Parameter since our last step (load_state_dict of the
        model, ``p.copy_``): its master copy takes the new value, so nothing the user set is lost."""
        buffer.state.ensure_master()
        for member in members:
            if member.param._version != member.version:
                self._init_master(buffer, member)

    # ------------------------------------------------------------------ zero_grad / state_dict

    @eager_in_compiled_code  # a flat buffer's zeroing, run eagerly inside compiled code
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like torch's, but a flat buffer whose parameters are all ours is zeroed in one op."""
        ours = {id(p) for group in self.param_groups for p in group["params"]}
        loose = []
        for flat in self._flats:
            params = flat.params
            if all(id(p) in ours for p in params if p.requires_grad):
                flat.zero_grad(set_to_none)
            else:
                loose.extend(p for p in params if id(p) in ours)
        for param in loose:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the matching torch.optim class.

        Values are copied into the flat state buffers (the loaded tensors are
        not adopted); hyperparameters come from the state dict, as in torch.
        torch's implementation switches (``foreach``, ``fused``, ``capturable``,
        ``differentiable``) stay this optimizer's own: they say how the saving
        optimizer ran, not what the state is, and a checkpoint of a
        ``capturable=True`` torch optimizer loads like any other.
        Raises ValueError for a different number of groups, a group of a
        different size, or a state tensor whose shape differs from its
        parameter's; nothing is changed then.

        The steps are torch.optim's, in its order and words (pre-hooks, group
        checks, matching parameters by position, post-hooks), but not its
        code: torch casts every state tensor to its parameter's dtype (the
        float32 state and masters of float16/bfloat16 parameters would lose
        their precision) and copies the whole state once more before it could
        be copied into the flat buffers.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        id_map = dict(
            zip(
                itertools.chain.from_iterable(g["params"] for g in saved_groups),
                itertools.chain.from_iterable(g["params"] for g in groups),
            )
        )
        flat_names = {*self.state_names, MASTER_KEY}
        required = self._required_state(saved_groups)
        for saved_id, entry in state_dict["state"].items():
            param = id_map.get(saved_id)
            if param is None:
                continue
            self._check_state_entry(saved_id, entry, required[saved_id])
            for name, value in entry.items():
                if name in flat_names and isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise ValueError(
                        f"loaded state dict has '{name}' of shape {tuple(value.shape)} for a parameter of shape "
                        f"{tuple(param.shape)} (parameter {saved_id})"
                    )
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            for name, default in self.defaults.items():
                saved.setdefault(name, default)
            for flag in IMPLEMENTATION_FLAGS:  # how this optimizer runs is its own, not the saver's
                if flag in group:
                    saved[flag] = group[flag]
                else:
                    saved.pop(flag, None)
            self._check_group(saved)
            new_groups.append(saved)
        self.param_groups = new_groups
        self.state = collections.defaultdict(dict)
        place = {}
        for buffer in self._buffers:
            buffer.state.reset()
            for member in buffer.members:
                member.started = member.has_entry = False
                place[id(member.param)] = (buffer, member)
        self._entries = 0
        for saved_id, entry in state_dict["state"].items():
            param = id_map.get(saved_id)
            if param is not None:
                self.state[param] = self._adopt(*place[id(param)], entry)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_state_entry(self, saved_id: Any, entry: dict[str, Any], required: set[str], owner: str = "") -> None:
        """Raises ValueError when a saved parameter's state is another family's (a tensor this optimizer does not
        keep, or one it needs missing): torch.optim fails at load too, not at the next step."""
        known = {*self.state_names, MASTER_KEY, "step"}
        foreign = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and k not in known)
        missing = sorted(required - set(entry)) if entry else []
        if foreign or missing:
            what = f"has {', '.join(map(repr, foreign))}" if foreign else f"lacks {', '.join(map(repr, missing))}"
            name = owner or type(self).__name__
            raise ValueError(
                f"{name}.load_state_dict: the state of parameter {saved_id} {what}: a state dict of another "
                f"optimizer? {type(self).__name__} keeps {', '.join(map(repr, self.state_names))} per parameter"
            )

    def _required_state(self, saved_groups: list[dict[str, Any]]) -> dict[Any, set[str]]:
        """Per saved parameter id, the state tensors a non-empty entry of it must hold (its family's, by its
        group's options as saved)."""
        required: dict[Any, set[str]] = {}
        for saved in saved_groups:
            names = self.family.required_state(saved)
            for saved_id in saved["params"]:
                required[saved_id] = names
        return required

    def _adopt(self, buffer: _Buffer, member: _Member, saved: dict[str, Any]) -> dict[str, Any]:
        """Copies one parameter's saved state into the flat buffers; returns its state entry."""
        state, param = buffer.state, member.param
        entry: dict[str, Any] = {}
        for name, value in saved.items():
            if name == "step":
                state.steps[member.index] = float(value)
                entry["step"] = state.step(param)
            elif name == MASTER_KEY:
                if buffer.master_weights and isinstance(value, torch.Tensor):
                    self._init_master(buffer, member, value.to(buffer.device, torch.float32))
                    entry[MASTER_KEY] = state.master_view(param)
            elif isinstance(value, torch.Tensor) and name in self.state_names:
                state.ensure(name)
                view = state.view(name, param)
                view.copy_(value)
                entry[name] = view
            elif value is not None:
                entry[name] = copy.deepcopy(value)
        if buffer.master_weights and MASTER_KEY not in entry and entry:
            self._init_master(buffer, member)
            entry[MASTER_KEY] = state.master_view(param)
        if self.family.uses_step and "step" not in entry and entry:
            entry["step"] = state.step(param)
        member.started = bool(entry)
        self._set_has_entry(member, bool(entry))
        return entry

    # ------------------------------------------------------------------ report

    def _route(self, buffer: _Buffer, backend: Backend) -> str:
        """How ``backend`` updates ``buffer`` each step, in words."""
        if backend is Backend.TRITON:
            return f"the Triton kernel {self.family.kernel_name} (one launch per flat buffer)"
        kernels = sorted({self._hyper(group, 1, True).torch_kernel for group in self.param_groups})
        routes = []
        for kernel in kernels:
            if buffer.master_weights:
                routes.append(f"torch.{kernel} on the float32 master weights")
            elif upcasts(self.family, kernel, buffer.dtype, buffer.device, master=False):
                routes.append(
                    f"torch.{kernel} on float32 copies rounded to {_name(buffer.dtype)}, as torch's "
                    f"{_name(buffer.dtype)} kernel on {buffer.device.type} failed tfuse's check"
                )
            else:
                routes.append(f"torch.{kernel}")
        return f"the PyTorch path ({', '.join(routes)}; no Triton kernel runs)"

    def _backend_of(self, buffer: _Buffer) -> tuple[Backend | None, str]:
        try:
            backend = select_backend(buffer.device, type(self).__name__)
        except RuntimeError as error:  # the Triton backend forced where it cannot run: step() raises this
            return None, f"no backend ({error})"
        return backend, self._route(buffer, backend)

    def _announce(self, buffer: _Buffer, backend: Backend) -> None:
        """Logs once, at INFO, which backend serves the updates of a flat buffer."""
        key = (buffer.device, buffer.dtype, backend)
        if key in self._announced:
            return
        self._announced.add(key)
        logger.info(
            "%s: the %s %s flat buffer (%d parameters) is updated by %s [%s]",
            type(self).__name__,
            buffer.device,
            _name(buffer.dtype),
            len(buffer.members),
            self._route(buffer, backend),
            _why(backend, buffer.device),
        )

    def _service(self) -> str:
        """What serves a step now: Triton launches per step, and the route of each flat buffer."""
        routes: dict[str, list[_Buffer]] = {}
        launches = 0
        for buffer in self._buffers:
            backend, route = self._backend_of(buffer)
            launches += backend is Backend.TRITON
            routes.setdefault(route, []).append(buffer)
        parts = [
            route if len(routes) == 1 else f"{', '.join(f'{b.device} {_name(b.dtype)}' for b in buffers)} by {route}"
            for route, buffers in routes.items()
        ]
        return f"{launches} Triton launch{'es' if launches != 1 else ''} per step; served by {'; '.join(parts)}"

    def describe(self) -> str:
        """One line: the flat buffers the optimizer updates, and what serves each step.

        Says which backend runs the update of each buffer as things stand now
        (``TFUSE_BACKEND``, ``tfuse.use_backend``, the device and the Triton
        interpreter decide): the Triton kernel, one launch per buffer per step,
        or the PyTorch path (torch's fused kernels; no Triton kernel runs).
        """
        params = sum(len(b.members) for b in self._buffers)
        elements = sum(m.end - m.start for b in self._buffers for m in b.members)
        buffers = len(self._buffers)
        return (
            f"{type(self).__name__}: {params} parameters ({elements} elements) in {buffers} flat "
            f"buffer{'s' if buffers != 1 else ''}, {self._service()}"
        )

    def __repr__(self) -> str:
        """torch.optim's repr, with a first line saying what serves the step (see :meth:`describe`)."""
        text = super().__repr__()
        head = type(self).__name__ + " ("
        return f"{head}\nStep: {self._service()}{text[len(head) :]}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _why(backend: Backend, device: torch.device) -> str:
    """Why ``backend`` serves tensors of ``device`` (the rules of tfuse._backend)."""
    forced = requested_backend()
    if forced is not None:
        return f"forced: backend {forced.value!r} requested (tfuse.use_backend or TFUSE_BACKEND)"
    if backend is Backend.TRITON:
        return "CUDA tensors" if device.type == "cuda" else f"{device.type} tensors through Triton's interpreter"
    if not triton_available():
        return "Triton is not installed"
    if device.type == "cpu":
        return "CPU tensors without TRITON_INTERPRET=1"
    return f"no Triton kernels for device type {device.type}"

"""Shared machinery of the fused optimizers: flat units, block tables, state, state_dict.

A fused optimizer owns one :class:`_Unit` per flat parameter buffer its
parameters live in (one :class:`~tfuse.flat.FlatGroup`). The unit keeps the
optimizer state of all its parameters in flat buffers with the parameter
buffer's layout, so ``exp_avg`` of a parameter is the same element range as
the parameter, and hands out per-parameter views of them as
``optimizer.state[p][name]`` (torch.optim's format). A step is one kernel
launch per unit on the Triton backend, or a few calls of torch's fused
kernels (``torch._fused_adam_`` and friends) over whole contiguous runs of the
buffer on the PyTorch backend.

torch's fused CPU kernels are not trusted blindly for float16/bfloat16:
torch 2.13's ``_fused_sgd_`` leaves low-precision parameters unchanged
(its vectorized loop never stores them). The first low-precision update of a
kind runs a small probe of torch's kernel against the same kernel on float32
copies (:func:`native_low_precision_ok`); a kernel that disagrees is routed
around by computing in float32 and rounding (the Triton kernel's maths).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from tfuse._backend import Backend, interpreter_active, requested_backend, select_backend
from tfuse.flat import FlatGroup, FlatParams, flat_params_of

logger = logging.getLogger(__name__)

BLOCK = 4096  # elements per program; blocks never cross a run's end
NUM_WARPS = 8
TORCH_PIECE = 1 << 20  # elements per tensor handed to torch's fused CPU kernels
UPCAST_BATCH = 8 * TORCH_PIECE  # most elements upcast to float32 at once on the PyTorch path (bounds the copies)
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TABLE_CACHE_SIZE = 8
MASTER_KEY = "master_param"
# torch.optim's implementation switches; tfuse has one implementation (the fused update).
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")

# (torch kernel name, dtype, device type) -> whether torch's fused kernel computes that dtype right.
_NATIVE_OK: dict[tuple[str, torch.dtype, str], bool] = {}


@dataclasses.dataclass
class BlockTable:
    """Which element ranges a step updates, and with which coefficient row.

    ``runs`` are maximal contiguous ranges of parameters that have a gradient
    and share a row; ``starts``/``ends``/``rows`` cut them into blocks of at
    most BLOCK elements (device tensors, for the kernel).
    """

    runs: list[tuple[int, int, int]]  # (start, end, row)
    starts: torch.Tensor
    ends: torch.Tensor
    rows: torch.Tensor
    end_align: int  # every block end is a multiple of this many elements

    @property
    def n_blocks(self) -> int:
        return self.starts.numel()


class _Unit:
    """The optimizer's parameters that live in one flat parameter buffer, and their flat state."""

    def __init__(self, owner: FlatParams, device: torch.device, dtype: torch.dtype, master_weights: bool) -> None:
        self.owner = owner
        self.device = device
        self.dtype = dtype
        self.master_weights = master_weights and dtype in _LOW_PRECISION
        self.state_dtype = torch.float32 if self.master_weights else dtype
        self.members: list[torch.nn.Parameter] = []
        # Parameter offsets are multiples of this many elements (capped at 16: enough for 128-bit accesses).
        self.align_elements = min(16, max(1, owner.align_bytes // torch.empty((), dtype=dtype).element_size()))
        self.buffers: dict[str, torch.Tensor] = {}  # flat optimizer state, parameter-buffer layout
        self.master: torch.Tensor | None = None
        self.steps = torch.zeros(0, dtype=torch.float32)  # per member, torch's 'step' (CPU float32)
        self.initialized = np.zeros(0, dtype=bool)  # per member: had its first step (torch's lazy state init)
        self.has_entry = np.zeros(0, dtype=bool)  # per member: optimizer.state holds an entry for it
        self.versions = np.zeros(0, dtype=np.int64)  # per member: param._version after our last write
        self.layout_version = -1
        self._tables: collections.OrderedDict = collections.OrderedDict()

    # ------------------------------------------------------------------ layout

    @property
    def flat_group(self) -> FlatGroup:
        for group in self.owner.groups:
            if group.device == self.device and group.dtype == self.dtype:
                return group
        raise RuntimeError("tfuse: a fused optimizer lost track of its flat buffer")  # cannot happen: groups never vanish

    @property
    def data(self) -> torch.Tensor:
        return self._data

    def set_members(self, params: list[torch.nn.Parameter], group_of: dict[int, int], state: dict) -> None:
        """Takes ``params`` (all in this unit) in buffer order; keeps the state of members that stay."""
        flat = self.flat_group
        position = {id(p): i for i, p in enumerate(flat.params)}
        ordered = sorted(params, key=lambda p: position[id(p)])
        old_index = {id(p): i for i, p in enumerate(self.members)}
        old_offsets = dict(getattr(self, "_offset_of", {}))
        keep = [old_index.get(id(p), -1) for p in ordered]

        self._data = flat.data
        self._grad = flat.grad
        self.positions = np.array([position[id(p)] for p in ordered], dtype=np.int64)
        self.offsets = np.array([flat.offsets[position[id(p)]] for p in ordered], dtype=np.int64)
        self.numels = np.array([p.numel() for p in ordered], dtype=np.int64)
        # Each parameter's slot keeps its memory format (channels_last...): state views get its strides, so that
        # optimizer.state[p][name] pairs element by element with p, and the flat update pairs them in memory.
        shapes, strides = getattr(flat, "shapes", None), getattr(flat, "strides", None)
        self.geometry = [
            (tuple(shapes[position]), tuple(strides[position])) if shapes and strides else (tuple(p.shape), None)
            for p, position in zip(ordered, self.positions.tolist())
        ]
        # Runs may cross the padding between neighbours, never another parameter.
        self.adjacent_next = np.zeros(len(ordered), dtype=bool)
        self.adjacent_next[:-1] = self.positions[1:] == self.positions[:-1] + 1
        self.group_index = np.array([group_of[id(p)] for p in ordered], dtype=np.int64)
        self._offset_of = {id(p): int(o) for p, o in zip(ordered, self.offsets)}

        steps = torch.zeros(len(ordered), dtype=torch.float32)
        initialized = np.zeros(len(ordered), dtype=bool)
        has_entry = np.zeros(len(ordered), dtype=bool)
        versions = np.zeros(len(ordered), dtype=np.int64)
        for new, old in enumerate(keep):
            if old >= 0:
                steps[new] = self.steps[old]
                initialized[new] = self.initialized[old]
                has_entry[new] = self.has_entry[old]
                versions[new] = self.versions[old]
        relaid = self.layout_version != self.owner.layout_version
        old_buffers, old_master = self.buffers, self.master
        if relaid:
            self.buffers = {name: torch.zeros_like(flat.data, dtype=self.state_dtype) for name in old_buffers}
            if self.master_weights:
                self.master = flat.data.to(torch.float32)
        self.members, self.steps, self.versions = ordered, steps, versions
        self.initialized, self.has_entry = initialized, has_entry
        self.layout_version = self.owner.layout_version
        self._tables.clear()
        for index, param in enumerate(ordered):
            entry = state.get(param)
            if entry is None:
                continue
            if "step" in entry:
                entry["step"] = steps[index]
            if relaid and id(param) in old_offsets:
                old, new, n = old_offsets[id(param)], int(self.offsets[index]), int(self.numels[index])
                for name, buffer in self.buffers.items():
                    buffer[new : new + n].copy_(old_buffers[name][old : old + n])
                if self.master is not None and old_master is not None:
                    self.master[new : new + n].copy_(old_master[old : old + n])
            for name in list(entry):
                if name in self.buffers or name == MASTER_KEY:
                    entry[name] = self.view(name, index)

    def follow_layout(self, group_of: dict[int, int], state: dict) -> None:
        """Moves the state to the new offsets after the FlatParams laid its buffers out again."""
        if self.layout_version != self.owner.layout_version:
            logger.info("tfuse: flat layout changed; moving optimizer state to the new offsets")
            self.set_members(self.members, group_of, state)

    def view(self, name: str, index: int) -> torch.Tensor:
        """Member ``index``'s view of state buffer ``name`` (or of the master buffer)."""
        buffer = self.master if name == MASTER_KEY else self.buffers[name]
        offset, numel = int(self.offsets[index]), int(self.numels[index])
        shape, strides = self.geometry[index]
        if strides is None:
            return buffer[offset : offset + numel].view(shape)
        return buffer.as_strided(shape, strides, buffer.storage_offset() + offset)

    def ensure_buffer(self, name: str) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.zeros_like(self._data, dtype=self.state_dtype)
        return self.buffers[name]

    @property
    def grad(self) -> torch.Tensor:
        return self._grad

    # ------------------------------------------------------------------ blocks

    def block_table(self, active: np.ndarray, member_rows: np.ndarray, merge: bool) -> BlockTable:
        """Block table for this step's active members (cached: most steps look like the last)."""
        key = (active.tobytes(), member_rows.tobytes(), merge)
        table = self._tables.get(key)
        if table is not None:
            self._tables.move_to_end(key)
            return table
        runs = []
        index, n = 0, len(self.members)
        while index < n:
            if not active[index]:
                index += 1
                continue
            first, row = index, member_rows[index]
            while merge and index + 1 < n and self.adjacent_next[index] and active[index + 1] and member_rows[index + 1] == row:
                index += 1
            end = int(self.offsets[index] + self.numels[index])
            if merge:  # into the zero padding, so that block ends are aligned too
                end = -(-end // self.align_elements) * self.align_elements
            runs.append((int(self.offsets[first]), end, int(row)))
            index += 1
        starts, ends, rows = [], [], []
        for start, end, row in runs:
            block_starts = range(start, end, BLOCK)
            starts.extend(block_starts)
            ends.extend(min(s + BLOCK, end) for s in block_starts)
            rows.extend([row] * len(block_starts))
        packed = torch.tensor([starts, ends, rows], dtype=torch.int64).to(self.device)
        table = BlockTable(runs, packed[0], packed[1], packed[2], self.align_elements if merge else 1)
        self._tables[key] = table
        if len(self._tables) > _TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        return table


class FlatOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: parameters in flat buffers, one update per buffer.

    Subclasses name their per-parameter state (:meth:`_state_names`), build
    the coefficient row of a (group, step) pair and run the update of a unit
    with the Triton kernel or with torch's fused CPU kernels.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    _uses_step = True  # per-parameter 'step' in the state (Adam); SGD has none
    _triton_kernel = ""  # name of the update kernel (for describe() and the log)

    def __init__(self, params: Any, defaults: dict[str, Any], master_weights: bool = False) -> None:
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        self._check_flags(defaults)
        self.master_weights = master_weights
        self._init_runtime()
        # The constructor's groups are coalesced together (one buffer per device and dtype,
        # so one launch whatever the number of groups); later add_param_group calls coalesce
        # their own new parameters.
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self._coalesce([p for group in self.param_groups for p in group["params"]])
        self._build_units()

    def _init_runtime(self) -> None:
        """What the optimizer keeps besides torch's defaults/state/param_groups (rebuilt after a copy)."""
        self._units: list[_Unit] = []
        self._owned: list[FlatParams] = []  # FlatParams created by this optimizer
        self._announced: set[tuple] = set()  # (device, dtype, backend) already logged
        self._constructing = False

    # ------------------------------------------------------------------ groups

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises ValueError (torch's wording) for a bad hyperparameter of ``group``."""
        raise NotImplementedError

    def _check_flags(self, group: dict[str, Any]) -> None:
        """Checks torch.optim's implementation switches in ``group`` (see :func:`check_implementation_flags`)."""
        check_implementation_flags(type(self).__name__, self._torch_class_name(), group)

    @classmethod
    def _torch_class_name(cls) -> str:
        """The torch.optim class this one replaces (named in error messages)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group like torch, checks it, and coalesces its parameters that are not in a flat buffer yet."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets will change between runs. Please use a list instead.")
        else:
            params = list(params) if params is not None else []
        named = [p for p in params if isinstance(p, tuple)]
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        seen: set[int] = set()
        for param in tensors:
            if not isinstance(param, torch.Tensor):
                raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(param))
            if id(param) in seen:
                raise ValueError("optimizer contains a parameter group with duplicate parameters")
            seen.add(id(param))
            if param.is_complex() or param.dtype not in _SUPPORTED:
                raise ValueError(
                    f"`{type(self).__name__}` requires all the params to be floating point Tensors "
                    f"(float16, bfloat16, float32 or float64), but got {param.dtype}"
                )
            if param.layout != torch.strided:
                raise ValueError(f"`{type(self).__name__}` does not support sparse parameters ({param.layout})")
        param_group = dict(param_group)
        param_group["params"] = params if named else tensors
        for name, default in self.defaults.items():
            param_group.setdefault(name, default)
        self._check_group(param_group)
        self._check_flags(param_group)
        super().add_param_group(param_group)  # leaf check, "appear in more than one parameter group"
        if not self._constructing:
            self._coalesce(self.param_groups[-1]["params"])
            self._build_units()

    def _coalesce(self, params: list[torch.Tensor]) -> None:
        loose = [p for p in params if flat_params_of(p) is None]
        if loose:
            self._owned.append(FlatParams(loose))

    def _group_of(self) -> dict[int, int]:
        return {id(p): index for index, group in enumerate(self.param_groups) for p in group["params"]}

    def _build_units(self) -> None:
        by_place: dict[tuple[int, torch.device, torch.dtype], list] = {}
        owners: dict[int, FlatParams] = {}
        for group in self.param_groups:
            for param in group["params"]:
                owner = flat_params_of(param)
                owners[id(owner)] = owner
                by_place.setdefault((id(owner), param.device, param.dtype), []).append(param)
        existing = {(id(u.owner), u.device, u.dtype): u for u in self._units}
        group_of = self._group_of()
        units = []
        for (owner_id, device, dtype), params in by_place.items():
            unit = existing.get((owner_id, device, dtype)) or _Unit(owners[owner_id], device, dtype, self.master_weights)
            unit.set_members(params, group_of, self.state)
            units.append(unit)
        self._units = units

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's picklable state, plus ``master_weights``.

        State tensors are handed out compact (cloned): each is a view of a whole
        flat state buffer, and pickle would otherwise write the whole buffer once
        per view. The flat buffers themselves are not part of the state; they are
        rebuilt by :meth:`__setstate__`.
        """
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                 for p, entry in self.state.items()}
        return {**self._raw_state(), "state": state}

    def _raw_state(self) -> dict[str, Any]:
        # The FlatParams the parameters live in travel along: copied in the same deepcopy call as the
        # parameters (or unpickled with them), they coalesce the copies again with the same layout, whichever
        # of the model, the FlatParams and the optimizer the call reaches first.
        owners = list({id(u.owner): u.owner for u in self._units}.values())
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups,
                "master_weights": self.master_weights, "flat_params": owners, "owned_flat_params": self._owned}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds an optimizer from :meth:`__getstate__`'s state (unpickling, copy.deepcopy).

        As with torch.optim, the copy holds the parameters it was given (the
        copies a deepcopy or unpickle made); parameters not in a flat buffer yet
        are coalesced into new ones, and the per-parameter state is copied
        into the new flat state buffers.
        """
        state = dict(state)
        saved_state = state.pop("state", {})
        state.pop("flat_params", None)  # they re-registered their (copied) parameters as they were rebuilt
        owned = state.pop("owned_flat_params", [])
        state.setdefault("master_weights", False)
        super().__setstate__(state)
        self._init_runtime()
        self._owned = list(owned)
        for group in self.param_groups:
            for name, default in self.defaults.items():
                group.setdefault(name, default)
        self.state = collections.defaultdict(dict)
        self._coalesce([p for group in self.param_groups for p in group["params"]])
        self._build_units()
        place = {id(p): (unit, index) for unit in self._units for index, p in enumerate(unit.members)}
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

    # ------------------------------------------------------------------ step

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Flat state names a parameter of ``group`` gets at its first step (torch's keys)."""
        raise NotImplementedError

    def _has_state(self, group: dict[str, Any]) -> bool:
        """Whether parameters of ``group`` keep state at all (SGD without momentum does not)."""
        return True

    def _row(self, group: dict[str, Any], step: int, first: bool) -> tuple[list[float], dict[str, Any]]:
        """Coefficient row for the kernel and keyword arguments for the torch path."""
        raise NotImplementedError

    def _launch(self, unit: _Unit, table: BlockTable, rows: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _kernel_meta(self, unit: _Unit, table: BlockTable, grad_scale: torch.Tensor | None) -> dict[str, Any]:
        """Compile-time arguments every update kernel takes."""
        return dict(
            ACC_FP64=unit.dtype == torch.float64, MASTER=unit.master_weights, GRAD_SCALE=grad_scale is not None,
            EMULATE_BF16_RTNE=interpreter_active(), BLOCK=BLOCK, START_ALIGN=unit.align_elements,
            END_ALIGN=table.end_align, num_warps=NUM_WARPS,
        )

    # ------------------------------------------------------------------ the PyTorch path

    def _torch_kernel(self, group: dict[str, Any]) -> str:
        """Name of the torch fused kernel (``torch._fused_adam_``...) that updates ``group`` on the PyTorch path."""
        raise NotImplementedError

    @staticmethod
    def _torch_state_names(spec: dict[str, Any]) -> tuple[str, ...]:
        """State buffers the torch kernel of a coefficient row reads and writes."""
        raise NotImplementedError

    @staticmethod
    def _torch_call(spec: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    states: dict[str, list[torch.Tensor]], grad_scale: torch.Tensor | None) -> None:
        """One call of torch's fused kernel ``spec["kernel"]`` over lists of slices (updated in place)."""
        raise NotImplementedError

    @staticmethod
    def _probe_specs(kernel: str) -> list[list[dict[str, Any]]]:
        """Step sequences (specs as :meth:`_row` makes them) the probe of ``kernel`` runs."""
        raise NotImplementedError

    def _upcasts(self, unit: _Unit, kernel: str) -> bool:
        """Whether the PyTorch path computes this unit's update on float32 copies.

        With master weights it always does (on the masters). Low-precision
        parameters without masters go through float32 only when torch's fused
        kernel for their dtype failed the probe (torch 2.13's ``_fused_sgd_`` does).
        """
        if unit.master_weights:
            return True
        return unit.dtype in _LOW_PRECISION and not native_low_precision_ok(type(self), kernel, unit.dtype, unit.device)

    def _torch_update(self, unit: _Unit, table: BlockTable, specs: list[dict[str, Any]], grad_scale: torch.Tensor | None) -> None:
        """torch's fused kernels over whole runs of the flat buffers (one call per coefficient row).

        Runs are cut into pieces of TORCH_PIECE elements: torch's fused CPU kernels
        parallelize over a list of tensors better than inside one huge tensor
        (measured: ResNet-50's 25.6M elements in one tensor 14.5 ms, in 1M pieces
        10.7 ms, 2 cores). When the update goes through float32 (master weights, or
        a low-precision dtype torch's kernel gets wrong), at most UPCAST_BATCH elements
        are upcast at a time; the parameters, the low-precision state and, under AMP,
        the unscaled gradients are written back rounded to nearest even.
        """
        by_row: dict[int, list[tuple[int, int]]] = {}
        for start, end, row in table.runs:
            by_row.setdefault(row, []).extend((s, min(s + TORCH_PIECE, end)) for s in range(start, end, TORCH_PIECE))
        scale = None if grad_scale is None else grad_scale.to(torch.float32)
        for row, spans in by_row.items():
            spec = specs[row]
            names = self._torch_state_names(spec)
            if not self._upcasts(unit, spec["kernel"]):
                self._torch_call(
                    spec, [unit.data[s:e] for s, e in spans], [unit.grad[s:e] for s, e in spans],
                    {name: [unit.buffers[name][s:e] for s, e in spans] for name in names}, scale,
                )
                continue
            for batch in _batches(spans, UPCAST_BATCH):
                if unit.master_weights:
                    params = [unit.master[s:e] for s, e in batch]
                else:
                    params = [unit.data[s:e].float() for s, e in batch]
                grads = [unit.grad[s:e].float() for s, e in batch]
                states = {name: [unit.buffers[name][s:e].float() for s, e in batch] for name in names}
                self._torch_call(spec, params, grads, states, scale)
                for index, (s, e) in enumerate(batch):
                    unit.data[s:e].copy_(params[index])
                    if grad_scale is not None:
                        unit.grad[s:e].copy_(grads[index])
                    for name in names:
                        buffer = unit.buffers[name]
                        if buffer.dtype != torch.float32:  # float32 state (masters): updated in place already
                            buffer[s:e].copy_(states[name][index])

    def _merge_runs(self) -> bool:
        """Whether runs may cross padding (the update must keep zero padding at zero)."""
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step: one update launch per flat buffer.

        Args:
            closure: reevaluates the model and returns the loss (as in torch.optim).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item()):
            # GradScaler found inf/NaN: skip the step, nothing changes (reads one scalar, as GradScaler does).
            return loss
        for owner in {id(u.owner): u.owner for u in self._units}.values():
            owner.sync_grads()
        group_of = None
        for unit in self._units:
            if unit.layout_version != unit.owner.layout_version:
                group_of = group_of or self._group_of()
                unit.follow_layout(group_of, self.state)
        for unit in self._units:
            self._step_unit(unit, grad_scale)
        return loss

    def _step_unit(self, unit: _Unit, grad_scale: torch.Tensor | None) -> None:
        members = unit.members
        active = np.fromiter((p.grad is not None for p in members), dtype=bool, count=len(members))
        if not active.any():
            return
        groups = self.param_groups
        if self._state_out_of_sync(unit):
            self._resync_flags(unit)
        first = active & ~unit.initialized
        if first.any():
            self._init_state(unit, np.flatnonzero(first))
        steps_now = unit.steps.numpy()
        if self._uses_step:
            steps_now[active] += 1
        if unit.master_weights:
            self._refresh_masters(unit, active)
        # One coefficient row per distinct (group, step, first step) among the active members,
        # found with numpy: a per-member Python loop would cost more than the GPU update itself.
        active_index = np.flatnonzero(active)
        codes = (unit.group_index[active_index] << 41) | (steps_now[active_index].astype(np.int64) << 1) | first[active_index]
        distinct, inverse = np.unique(codes, return_inverse=True)
        member_rows = np.full(len(members), -1, dtype=np.int64)
        member_rows[active_index] = inverse
        rows, specs = [], []
        for code in distinct.tolist():
            values, spec = self._row(groups[code >> 41], (code >> 1) & ((1 << 40) - 1), bool(code & 1))
            rows.append(values)
            specs.append(spec)
        table = unit.block_table(active, member_rows, self._merge_runs())
        backend = select_backend(unit.device, type(self).__name__)
        if backend is Backend.TRITON:
            self._launch(unit, table, torch.tensor(rows, dtype=torch.float64).to(unit.device, non_blocking=True), grad_scale)
        else:
            self._torch_update(unit, table, specs, grad_scale)
        self._announce(unit, backend)
        if unit.master_weights:
            unit.versions[active] = [p._version for p, on in zip(members, active) if on]

    def _state_out_of_sync(self, unit: _Unit) -> bool:
        # Cheap check that nobody removed state entries behind our back (e.g. optimizer.state.clear()).
        return int(unit.has_entry.sum()) > len(self.state)

    def _resync_flags(self, unit: _Unit) -> None:
        for index, param in enumerate(unit.members):
            if unit.has_entry[index] and not self.state.get(param):
                unit.has_entry[index] = unit.initialized[index] = False

    def _init_state(self, unit: _Unit, indices: np.ndarray) -> None:
        """torch's lazy state creation, for members getting their first gradient: zeroed views."""
        groups = self.param_groups
        for index in indices:
            param = unit.members[index]
            group = groups[unit.group_index[index]]
            unit.initialized[index] = True
            has_state = self._has_state(group)
            if not (has_state or unit.master_weights):
                continue
            entry = self.state[param]
            entry.clear()
            if self._uses_step and has_state:
                unit.steps[index] = 0.0
                entry["step"] = unit.steps[index]
            for name in self._state_names(group) if has_state else ():
                unit.ensure_buffer(name)
                view = unit.view(name, index)
                view.zero_()
                entry[name] = view
            if unit.master_weights:
                self._init_master(unit, index)
                entry[MASTER_KEY] = unit.view(MASTER_KEY, index)
            unit.has_entry[index] = True

    def _init_master(self, unit: _Unit, index: int, value: torch.Tensor | None = None) -> None:
        if unit.master is None:
            unit.master = unit.data.to(torch.float32)
        param = unit.members[index]
        unit.view(MASTER_KEY, index).copy_(param.detach() if value is None else value)
        unit.versions[index] = param._version

    def _refresh_masters(self, unit: _Unit, active: np.ndarray) -> None:
        """A parameter written through its Parameter since our last step (load_state_dict of the
        model, ``p.copy_``): its master copy takes the new value, so nothing the user set is lost."""
        if unit.master is None:
            unit.master = unit.data.to(torch.float32)
        for index in np.flatnonzero(active):
            param = unit.members[index]
            if param._version != unit.versions[index]:
                self._init_master(unit, index)

    # ------------------------------------------------------------------ zero_grad / state_dict

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like torch's, but a flat buffer whose parameters are all ours is zeroed in one op."""
        ours = {id(p) for group in self.param_groups for p in group["params"]}
        loose = []
        for owner in {id(u.owner): u.owner for u in self._units}.values():
            params = owner.params
            if all(id(p) in ours for p in params if p.requires_grad):
                owner.zero_grad(set_to_none)
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
        parameter's.
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
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in groups)))
        flat_names = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", MASTER_KEY}
        for saved_id, entry in state_dict["state"].items():
            param = id_map.get(saved_id)
            if param is None:
                continue
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
        group_of = self._group_of()
        for unit in self._units:
            unit.group_index = np.array([group_of[id(p)] for p in unit.members], dtype=np.int64)
            unit._tables.clear()
            for buffer in unit.buffers.values():
                buffer.zero_()
            unit.initialized[:] = False
            unit.has_entry[:] = False
            unit.steps.zero_()
        place = {id(p): (unit, index) for unit in self._units for index, p in enumerate(unit.members)}
        for saved_id, entry in state_dict["state"].items():
            param = id_map.get(saved_id)
            if param is None:
                continue
            unit, index = place[id(param)]
            self.state[param] = self._adopt(unit, index, entry)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _adopt(self, unit: _Unit, index: int, saved: dict[str, Any]) -> dict[str, Any]:
        """Copies one parameter's saved state into the flat buffers; returns its state entry."""
        entry: dict[str, Any] = {}
        for name, value in saved.items():
            if name == "step":
                unit.steps[index] = float(value)
                entry["step"] = unit.steps[index]
            elif name == MASTER_KEY:
                if unit.master_weights and isinstance(value, torch.Tensor):
                    self._init_master(unit, index, value.to(unit.device, torch.float32))
                    entry[MASTER_KEY] = unit.view(MASTER_KEY, index)
            elif isinstance(value, torch.Tensor) and name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
                unit.ensure_buffer(name)
                view = unit.view(name, index)
                view.copy_(value)
                entry[name] = view
            elif value is not None:
                entry[name] = copy.deepcopy(value)
        if unit.master_weights and MASTER_KEY not in entry and entry:
            self._init_master(unit, index)
            entry[MASTER_KEY] = unit.view(MASTER_KEY, index)
        if self._uses_step and "step" not in entry and entry:
            entry["step"] = unit.steps[index]
        unit.initialized[index] = unit.has_entry[index] = bool(entry)
        return entry

    # ------------------------------------------------------------------ report

    def _route(self, unit: _Unit, backend: Backend) -> str:
        """How ``backend`` updates ``unit`` each step, in words."""
        if backend is Backend.TRITON:
            return f"the Triton kernel {self._triton_kernel} (one launch per flat buffer)"
        kernels = sorted({self._torch_kernel(group) for group in self.param_groups})
        routes = []
        for kernel in kernels:
            if unit.master_weights:
                routes.append(f"torch.{kernel} on the float32 master weights")
            elif self._upcasts(unit, kernel):
                routes.append(f"torch.{kernel} on float32 copies rounded to {_name(unit.dtype)}, as torch's "
                              f"{_name(unit.dtype)} kernel on {unit.device.type} failed tfuse's check")
            else:
                routes.append(f"torch.{kernel}")
        return f"the PyTorch path ({', '.join(routes)}; no Triton kernel runs)"

    def _backend_of(self, unit: _Unit) -> tuple[Backend | None, str]:
        try:
            backend = select_backend(unit.device, type(self).__name__)
        except RuntimeError as error:  # the Triton backend forced where it cannot run: step() raises this
            return None, f"no backend ({error})"
        return backend, self._route(unit, backend)

    def _announce(self, unit: _Unit, backend: Backend) -> None:
        """Logs once, at INFO, which backend serves the updates of a flat buffer."""
        key = (unit.device, unit.dtype, backend)
        if key in self._announced:
            return
        self._announced.add(key)
        logger.info("%s: the %s %s flat buffer (%d parameters) is updated by %s [%s]", type(self).__name__,
                    unit.device, _name(unit.dtype), len(unit.members), self._route(unit, backend),
                    _why(backend, unit.device))

    def _service(self) -> str:
        """What serves a step now: Triton launches per step, and the route of each flat buffer."""
        routes: dict[str, list[_Unit]] = {}
        launches = 0
        for unit in self._units:
            backend, route = self._backend_of(unit)
            launches += backend is Backend.TRITON
            routes.setdefault(route, []).append(unit)
        parts = [
            route if len(routes) == 1 else f"{', '.join(f'{u.device} {_name(u.dtype)}' for u in units)} by {route}"
            for route, units in routes.items()
        ]
        return f"{launches} Triton launch{'es' if launches != 1 else ''} per step; served by {'; '.join(parts)}"

    def describe(self) -> str:
        """One line: the flat buffers the optimizer updates, and what serves each step.

        Says which backend runs the update of each buffer as things stand now
        (``TFUSE_BACKEND``, ``tfuse.use_backend``, the device and the Triton
        interpreter decide): the Triton kernel, one launch per buffer per step,
        or the PyTorch path (torch's fused kernels; no Triton kernel runs).
        """
        params = sum(len(u.members) for u in self._units)
        elements = sum(int(u.numels.sum()) for u in self._units)
        buffers = len(self._units)
        return (f"{type(self).__name__}: {params} parameters ({elements} elements) in {buffers} flat "
                f"buffer{'s' if buffers != 1 else ''}, {self._service()}")

    def __repr__(self) -> str:
        """torch.optim's repr, with a first line saying what serves the step (see :meth:`describe`)."""
        text = super().__repr__()
        head = type(self).__name__ + " ("
        return f"{head}\nStep: {self._service()}{text[len(head):]}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _why(backend: Backend, device: torch.device) -> str:
    """Why ``backend`` serves tensors of ``device`` (the rules of tfuse._backend)."""
    forced = requested_backend()
    if forced is not None:
        return f"forced: backend {forced.value!r} requested (tfuse.use_backend or TFUSE_BACKEND)"
    if backend is Backend.TRITON:
        return "CUDA tensors" if device.type == "cuda" else f"{device.type} tensors through Triton's interpreter"
    if device.type == "cpu":
        return "CPU tensors without TRITON_INTERPRET=1"
    return f"no Triton kernels for device type {device.type}"


def _batches(spans: list[tuple[int, int]], limit: int) -> Iterable[list[tuple[int, int]]]:
    """Consecutive spans in lists of at most ``limit`` elements (at least one span each)."""
    batch: list[tuple[int, int]] = []
    size = 0
    for span in spans:
        length = span[1] - span[0]
        if batch and size + length > limit:
            yield batch
            batch, size = [], 0
        batch.append(span)
        size += length
    if batch:
        yield batch


def native_low_precision_ok(optimizer: type[FlatOptimizer], kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's fused ``kernel`` updates ``dtype`` tensors on ``device``'s type correctly.

    Checked once per process and (kernel, dtype, device type): a few steps of
    the option sets of ``optimizer._probe_specs(kernel)`` on a 331-element
    tensor (vector bodies of every CPU ISA and a tail), with and without a grad
    scale, against the same kernel on float32 copies rounded back to ``dtype``.
    Parameters, state and unscaled gradients must agree within 2 units in the
    last place. torch 2.13's ``_fused_sgd_`` fails it on CPU for float16 and
    bfloat16: it leaves the parameters unchanged.
    """
    if device.type == "meta":
        return True  # nothing is computed on the meta device
    key = (kernel, dtype, device.type)
    ok = _NATIVE_OK.get(key)
    if ok is None:
        with torch.no_grad():
            ok = _probe(optimizer, kernel, dtype, device)
        _NATIVE_OK[key] = ok
        if not ok:
            logger.info(
                "tfuse: torch.%s gives wrong results for %s tensors on %s (torch %s); tfuse computes these "
                "updates on float32 copies and rounds them instead", kernel, _name(dtype), device.type, torch.__version__,
            )
    return ok


def _probe(optimizer: type[FlatOptimizer], kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)  # never the global generator: the user's randomness stays theirs
    n = 331
    finfo = torch.finfo(dtype)

    def random(scale: float = 1.0, positive: bool = False) -> torch.Tensor:
        values = torch.randn(n, generator=generator) * scale
        return (values.abs() if positive else values).to(device=device, dtype=dtype)

    def agree(native: torch.Tensor, reference: torch.Tensor) -> bool:
        return bool(torch.isclose(native.float(), reference.float(), rtol=2 * finfo.eps, atol=finfo.tiny).all())

    for sequence in optimizer._probe_specs(kernel):
        for grad_scale in (None, torch.tensor(8.0, device=device)):
            names = optimizer._torch_state_names(sequence[0])
            param = random()
            states = {name: random(0.1, positive=True) for name in names}
            for spec in sequence:
                grad = random(1.0 if grad_scale is None else 8.0)
                native = [param.clone()], [grad.clone()], {k: [v.clone()] for k, v in states.items()}
                optimizer._torch_call(spec, *native, grad_scale)
                upcast = [param.float()], [grad.float()], {k: [v.float()] for k, v in states.items()}
                optimizer._torch_call(spec, *upcast, grad_scale)
                param, grad = upcast[0][0].to(dtype), upcast[1][0].to(dtype)
                states = {k: v[0].to(dtype) for k, v in upcast[2].items()}
                if not agree(native[0][0], param) or (grad_scale is not None and not agree(native[1][0], grad)):
                    return False
                if not all(agree(native[2][k][0], states[k]) for k in names):
                    return False
    return True


def check_implementation_flags(name: str, torch_name: str, group: dict[str, Any]) -> None:
    """Checks torch.optim's implementation switches: accepts those tfuse honours, refuses the others.

    * ``foreach`` (None or a bool): accepted and ignored. It picks among torch's
      for-loop and multi-tensor implementations, which compute the same update;
      tfuse has one implementation, the fused update of whole flat buffers.
    * ``fused``: None or True (tfuse is always fused). False asks for an
      implementation tfuse does not have: ValueError.
    * ``fused=True`` with ``foreach=True``: torch's RuntimeError.
    * ``differentiable=True``, ``capturable=True``: ValueError (see the messages).
    """
    foreach = group.get("foreach")
    fused = group.get("fused")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"{name}: foreach must be None or a bool, got {foreach!r}")
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"{name}: fused must be None or a bool, got {fused!r}")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused is False:
        raise ValueError(
            f"{name}: fused=False asks for one of torch's non-fused implementations, which tfuse does not have: "
            f"{name} always updates whole flat buffers with one fused update per buffer. Pass fused=None or "
            f"fused=True (foreach is accepted and ignored), or use {torch_name} for its for-loop implementation."
        )
    if group.get("differentiable"):
        raise ValueError(
            f"{name}: differentiable=True is not supported: the fused update runs outside autograd (under "
            f"torch.no_grad), so no gradient flows through step(). Use {torch_name}(..., differentiable=True) to "
            "differentiate through optimizer steps."
        )
    if group.get("capturable"):
        raise ValueError(
            f"{name}: capturable=True is not supported yet: tfuse reads the step counts and hyperparameters on the "
            "host at every step (the 'step' state is a CPU tensor, as with torch's capturable=False), so step() "
            f"cannot be captured in a CUDA graph. Use capturable=False (the default), or {torch_name}(..., "
            "capturable=True) to capture the optimizer step."
        )


def as_float(value: float | torch.Tensor) -> float:
    """A hyperparameter as a Python float (a 0-dim tensor lr is read once per step)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_non_negative(value: Any, what: str) -> None:
    if not 0.0 <= value:
        raise ValueError(f"Invalid {what} value: {value}")

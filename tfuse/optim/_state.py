"""Optimizer state kept flat: one buffer per state name, laid out like a flat parameter buffer.

:class:`FlatState` holds the state of one flat parameter buffer (one
:class:`~tfuse.flat.FlatGroup`) over an element range of it: all of it for a
plain fused optimizer, one shard for a shard owner. Element ``i`` of each state
buffer belongs to element ``start + i`` of the parameter buffer, so an update
reads and writes the same range of parameters, gradients and state (see
:func:`~tfuse.optim._update.adam_update`), and torch.optim's per-parameter
format (``optimizer.state[p]["exp_avg"]`` with ``p``'s shape and strides) is a
view, not a copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tfuse.flat import FlatGroup, mark_compact
from tfuse.optim._update import FlatBuffers


class FlatState:
    """The optimizer state of elements ``[start, end)`` of one flat parameter buffer.

    State buffers (``exp_avg``, ``momentum_buffer``...) are created on first
    use (:meth:`ensure`), zero, ``end - start`` elements each, in float32 with
    master weights and in the parameters' dtype otherwise. Float32 master
    copies of the parameters (:meth:`ensure_master`) cover the same range.
    Per-parameter step counts (torch's ``step``: 0-dim float32 CPU tensors,
    :meth:`step`) live in one tensor, so a step increments them all at once.

    Args:
        group: the flat buffer's :class:`~tfuse.flat.FlatGroup`.
        start, end: the element range the state covers (default: the whole buffer).
        master_weights: keep float32 masters and float32 state (for float16/bfloat16 parameters).

    Example: a shard owner's state (rank 1 of 2), for its share of the buffer only.
        >>> import torch
        >>> from tfuse.flat import FlatParams
        >>> from tfuse.optim._state import FlatState
        >>> layer = torch.nn.Linear(100, 3)
        >>> flat = FlatParams(layer, world_size=2)  # bias at [0, 3), weight at [64, 364), padded to 384
        >>> shard = flat.shards(2)[0][1]
        >>> state = FlatState(flat.groups[shard.buffer], shard.start, shard.end)
        >>> shard.start, shard.end, state.ensure("exp_avg").shape
        (192, 384, torch.Size([192]))
        >>> state.covers(layer.weight), state.span(layer.weight)  # its part of the weight, from start
        (False, (0, 172))
        >>> whole = FlatState(flat.groups[0])
        >>> whole.ensure("exp_avg").shape, whole.view("exp_avg", layer.weight).shape  # torch.optim's format
        (torch.Size([384]), torch.Size([3, 100]))
    """

    def __init__(
        self,
        group: FlatGroup,
        start: int = 0,
        end: int | None = None,
        *,
        master_weights: bool = False,
        steps_on_device: bool = False,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.master_weights = master_weights
        # State names kept in another name's buffer (FusedMuon's momentum in its AdamW groups' exp_avg: the two
        # kinds never hold the same element, so a buffer shared by both holds each element's state once).
        self.aliases = dict(aliases or {})
        # Step counts on the parameters' device (capturable optimizers: read and advanced by device ops
        # only), else on the CPU (read by the host to build each step's coefficients).
        self.steps_device = group.device if steps_on_device else torch.device("cpu")
        self.dtype = torch.float32 if master_weights else group.dtype
        self.buffers: dict[str, torch.Tensor] = {}
        self.master: torch.Tensor | None = None
        self._set_range(group, start, end)
        self.steps = torch.zeros(len(group.params), dtype=torch.float32, device=self.steps_device)

    def _set_range(self, group: FlatGroup, start: int, end: int | None) -> None:
        size = group.data.numel()
        end = size if end is None else end
        if not 0 <= start <= end <= size:
            raise ValueError(f"FlatState: range [{start}, {end}) is not within the buffer's {size} elements")
        self.group, self.start, self.end = group, start, end
        self._index = {id(param): index for index, param in enumerate(group.params)}

    @property
    def numel(self) -> int:
        """Elements each state buffer has (the range's length)."""
        return self.end - self.start

    # ------------------------------------------------------------------ buffers

    def ensure(self, name: str) -> torch.Tensor:
        """State buffer ``name``, created (zero) on first use."""
        buffer = self.buffers.get(name)
        if buffer is None:
            if name in self.aliases:
                buffer = self.buffers[name] = self.ensure(self.aliases[name])
            else:
                buffer = self.buffers[name] = torch.zeros(self.numel, dtype=self.dtype, device=self.group.device)
                mark_compact(buffer)  # a parameter's state pickles as its own elements, not the buffer
        return buffer

    def ensure_master(self) -> torch.Tensor:
        """The float32 master copies, created from the parameters' values on first use."""
        if not self.master_weights:
            raise RuntimeError("FlatState: master copies are kept only with master_weights=True")
        if self.master is None:
            self.master = self.group.data[self.start : self.end].to(torch.float32)
            mark_compact(self.master)
        return self.master

    def buffers_for_update(self) -> FlatBuffers:
        """Parameters, gradients, state and masters of the range, indexed alike from 0 (for the update functions).

        Run ranges given to the update are then relative to ``start``. The
        gradient buffer covers only the trainable parameters: runs must stay there.
        """
        group = self.group
        param, grad = group.data, group.grad
        if self.start or self.end != param.numel():
            param = param[self.start : self.end]
            grad = None if grad is None else grad[self.start : self.end]
        return FlatBuffers(param, grad, self.buffers, self.master)

    def reset(self) -> None:
        """Zeroes every state buffer and step count (masters are kept: they are the parameters' values)."""
        for buffer in self.buffers.values():
            buffer.zero_()
        self.steps.zero_()

    # ------------------------------------------------------------------ per parameter

    def index_of(self, param: torch.Tensor) -> int:
        """``param``'s position in ``group.params`` (the index of its step count in :attr:`steps`)."""
        index = self._index.get(id(param))
        if index is None:
            raise KeyError("FlatState: this parameter does not live in the state's flat buffer")
        return index

    def span(self, param: torch.Tensor) -> tuple[int, int]:
        """The part of ``param``'s slot inside the range, relative to ``start`` (empty if none)."""
        offset = self.group.offsets[self.index_of(param)]
        lo = min(max(offset, self.start), self.end)
        return lo - self.start, min(max(offset + param.numel(), lo), self.end) - self.start

    def covers(self, param: torch.Tensor) -> bool:
        """Whether all of ``param`` lies inside the range."""
        offset = self.group.offsets[self.index_of(param)]
        return self.start <= offset and offset + param.numel() <= self.end

    def view(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """``param``'s view of state buffer ``name``: its shape and strides (torch.optim's format).

        The parameter must lie inside the range (see :meth:`covers`); element
        for element, the view pairs with the parameter, whatever its memory format.
        """
        return self._slot(self.buffers[name], param)

    def master_view(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s float32 master copy, with the parameter's shape and strides."""
        if self.master is None:
            raise RuntimeError("FlatState: no master copies yet (ensure_master creates them)")
        return self._slot(self.master, param)

    def step(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s step count: a 0-dim float32 tensor that follows the counts (on the CPU, or on the
        parameters' device with ``steps_on_device``, as torch's capturable optimizers keep it)."""
        return self.steps[self.index_of(param)]

    def _slot(self, buffer: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        index = self.index_of(param)
        group = self.group
        offset = group.offsets[index]
        if not (self.start <= offset and offset + param.numel() <= self.end):
            raise ValueError(
                f"FlatState: the parameter at elements [{offset}, {offset + param.numel()}) is not inside the "
                f"state's range [{self.start}, {self.end})"
            )
        storage_offset = buffer.storage_offset() + offset - self.start
        return buffer.as_strided(group.shapes[index], group.strides[index], storage_offset)

    # ------------------------------------------------------------------ layout changes

    def follow(self, group: FlatGroup, start: int = 0, end: int | None = None) -> None:
        """Moves the state to ``group``, the same buffer laid out again (or another range of it).

        Each parameter's state, master copy and step count go to its new
        offsets; elements the old range did not cover start at zero (masters:
        at the parameters' values).
        """
        if group is self.group and (start, end if end is not None else group.data.numel()) == (self.start, self.end):
            return  # moved already (a state shared by two span steppers is followed by both)
        old_group, old_start, old_end, old_index = self.group, self.start, self.end, self._index
        old_buffers, old_master, old_steps = self.buffers, self.master, self.steps
        self._set_range(group, start, end)
        self.buffers = {}
        for name in old_buffers:
            self.ensure(name)  # (aliases share their buffer again)
        self.master = None
        if old_master is not None:
            self.ensure_master()
        self.steps = torch.zeros(len(group.params), dtype=torch.float32, device=self.steps_device)
        for index, param in enumerate(group.params):
            old = old_index.get(id(param))
            if old is None:
                continue
            self.steps[index] = old_steps[old]
            # The elements of the parameter both ranges cover, counted from its first element: a slot is
            # dense with the same strides in every layout, so element k of the slot is the same element.
            old_offset, offset, numel = old_group.offsets[old], group.offsets[index], param.numel()
            lo = max(old_start - old_offset, self.start - offset, 0)
            hi = min(old_end - old_offset, self.end - offset, numel)
            if lo >= hi:
                continue
            src = slice(old_offset + lo - old_start, old_offset + hi - old_start)
            dst = slice(offset + lo - self.start, offset + hi - self.start)
            for name, buffer in self.buffers.items():
                buffer[dst].copy_(old_buffers[name][src])  # (an alias copies the same values twice)
            if old_master is not None:
                self.master[dst].copy_(old_master[src])

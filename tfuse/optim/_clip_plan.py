"""What clip_grad_norm_ keeps between calls: per set of parameters, where each gradient lives.

A clip over parameters coalesced in flat buffers takes the norm of whole
gradient buffers (one partial-norm launch per buffer) instead of one tensor
at a time. :class:`_Plan` says, for one list of parameters, which flat
buffer (a :class:`_Segment`) holds each gradient and which are loose; each
segment caches the run :class:`_Table` of the slots that hold gradients.
Plans are cached per parameter list, and checked at every call
(:meth:`_Plan.valid_for`) against the gradients as they are.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import weakref
from collections.abc import Callable

import numpy as np
import torch

from tfuse.flat import FlatParams, flat_params_of

BLOCK = 4096  # elements per program of the partial-norm and scaling kernels (the run tables' block size)
_PLAN_CACHE_SIZE = 8
_TABLE_CACHE_SIZE = 8


@dataclasses.dataclass(eq=False)
class _Table:
    """The blocks of a segment's slots that hold gradients.

    ``blocks`` is int64 ``[n_blocks, 2]`` (start, length), on the device: built once, read by every call.
    """

    blocks: torch.Tensor
    n_blocks: int
    has_tail: bool  # some block length is not a multiple of the segment's ALIGN


class _Segment:
    """The slots of one flat gradient buffer that a parameter list covers, in buffer order.

    They are slots ``first:stop`` of the plan (the plan orders its slots
    segment by segment). Holds the buffer and its FlatParams weakly. Its
    block tables are cached by which of its slots hold a gradient; the
    buffer and the layout version are fixed for the segment's life (a plan
    whose FlatParams laid its buffers out again is replaced, tables and all).
    """

    def __init__(
        self, owner: FlatParams, buffer: torch.Tensor, first: int, offsets: list[int], numels: list[int]
    ) -> None:
        self.owner = weakref.ref(owner)
        self.layout_version = owner.layout_version
        self._buffer = weakref.ref(buffer)
        self.device = buffer.device
        self.dtype = buffer.dtype
        self.first, self.stop = first, first + len(offsets)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.numels = np.asarray(numels, dtype=np.int64)
        # Block starts are slot offsets plus multiples of BLOCK: aligned to the largest power of two
        # that divides every slot offset, up to one 128-bit vector.
        vector = max(16 // buffer.element_size(), 1)
        common = int(np.bitwise_or.reduce(self.offsets)) if len(offsets) else 0
        self.align = vector if common == 0 else min(vector, common & -common)
        self._tables: collections.OrderedDict[bytes, _Table] = collections.OrderedDict()

    def buffer(self) -> torch.Tensor | None:
        return self._buffer()

    def table(self, active: bytes) -> _Table:
        """The block table for the slots flagged in ``active`` (cached by that key)."""
        table = self._tables.get(active)
        if table is not None:
            self._tables.move_to_end(active)
            return table
        mask = np.frombuffer(active, dtype=np.uint8).astype(bool)
        starts, numels = self.offsets[mask], self.numels[mask]
        keep = numels > 0
        starts, numels = starts[keep], numels[keep]
        counts = -(-numels // BLOCK)
        n_blocks = int(counts.sum())
        within = np.arange(n_blocks, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        block_starts = np.repeat(starts, counts) + within * BLOCK
        lengths = np.minimum(np.repeat(starts + numels, counts) - block_starts, BLOCK)
        blocks = torch.from_numpy(np.stack([block_starts, lengths], axis=1))
        if self.device.type == "cuda":  # a copy from pinned memory does not block the host
            blocks = blocks.pin_memory()
        table = _Table(blocks.to(self.device, non_blocking=True), n_blocks, bool((lengths % self.align).any()))
        self._tables[active] = table
        if len(self._tables) > _TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        return table

    def grads(self, grads: list, active: bytes, slot_index: tuple[int, ...]) -> list[torch.Tensor]:
        """The gradients of the slots flagged in ``active`` (for the PyTorch path)."""
        return [grads[slot_index[self.first + i]] for i, on in enumerate(active) if on]


class _Plan:
    """Where the gradients of one parameter list live. See the module docstring."""

    def __init__(self, params: list[torch.Tensor], homes: tuple[FlatParams, ...] | None) -> None:
        self.refs = [weakref.ref(param) for param in params]
        self.homes = None if homes is None else tuple(weakref.ref(home) for home in homes)
        home_of = _home_finder(homes)
        seen: set[int] = set()
        # (owner id, buffer index) -> (owner, gradient buffer, [(offset, index in params, view)])
        by_buffer: dict[tuple[int, int], tuple[FlatParams, torch.Tensor, list]] = {}
        other = []
        for index, param in enumerate(params):
            owner = home_of(param) if id(param) not in seen else None  # a repeat counts again, as a loose grad
            seen.add(id(param))
            where = owner.range_of(param) if owner is not None else None
            if where is None or not where.trainable:
                other.append(index)
                continue
            buffer = owner.groups[where.buffer].grad
            entry = by_buffer.setdefault((id(owner), where.buffer), (owner, buffer, []))
            entry[2].append((where.start, index, owner.grad_view(param)))
        self.other_index = tuple(other)
        # Parameters in no FlatParams when the plan was made: one coalesced since then must make a new plan.
        self.unowned = tuple(i for i in other if home_of(params[i]) is None)
        self.segments: list[_Segment] = []
        slot_index, views = [], []
        for owner, buffer, slots in by_buffer.values():
            slots.sort(key=operator.itemgetter(0))
            self.segments.append(
                _Segment(owner, buffer, len(slot_index), [s[0] for s in slots], [s[2].numel() for s in slots])
            )
            slot_index.extend(s[1] for s in slots)
            views.extend(s[2] for s in slots)
        self.slot_index = tuple(slot_index)
        self._gather = operator.itemgetter(*slot_index) if len(slot_index) > 1 else None
        self.view_refs = [weakref.ref(view) for view in views]

    def valid_for(self, params: list[torch.Tensor], grads: list) -> bool:
        """The same live parameters, every FlatParams still in the layout the plan was made for, and no
        parameter coalesced since (checked for gradients that are views, as coalesced ones are)."""
        if len(params) != len(self.refs) or not all(map(operator.is_, [ref() for ref in self.refs], params)):
            return False
        for segment in self.segments:
            owner = segment.owner()
            if owner is None or owner.layout_version != segment.layout_version or segment.buffer() is None:
                return False
        if self.homes is not None and any(ref() is None for ref in self.homes):
            return False
        for index in self.unowned:
            grad = grads[index]
            if grad is not None and grad._base is not None and flat_params_of(params[index]) is not None:
                return False
        return True

    def slot_flags(self, grads: list, loose: list[torch.Tensor]) -> bytes:
        """Per slot, 1 if the parameter's gradient is in it; gradients elsewhere are appended to ``loose``."""
        if not self.slot_index:
            return b""
        views = [ref() for ref in self.view_refs]
        slot_grads = self._gather(grads) if self._gather is not None else (grads[self.slot_index[0]],)
        flags = bytes(map(operator.is_, slot_grads, views))
        if 0 not in flags:
            return flags
        fixed = bytearray(flags)
        position = fixed.find(0)
        while position >= 0:
            grad = slot_grads[position]
            if grad is not None:
                if _same_memory(grad, views[position]):
                    fixed[position] = 1
                else:
                    loose.append(grad)
            position = fixed.find(0, position + 1)
        return bytes(fixed)


def _home_finder(homes: tuple[FlatParams, ...] | None) -> Callable[[torch.Tensor], FlatParams | None]:
    """param -> the FlatParams holding it: among ``homes`` when given, else read from the parameter's memory."""
    if homes is None:
        return flat_params_of
    by_id = {id(param): home for home in homes for param in home.params}
    return lambda param: by_id.get(id(param))


def _same_memory(grad: torch.Tensor, view: torch.Tensor | None) -> bool:
    """Whether ``grad`` is ``view``'s memory seen through another tensor object (same place, shape and strides)."""
    return (
        view is not None
        and not grad.requires_grad
        and grad.device == view.device
        and grad.dtype == view.dtype
        and grad.data_ptr() == view.data_ptr()
        and grad.shape == view.shape
        and grad.stride() == view.stride()
    )


_plans: collections.OrderedDict[tuple[int, ...], _Plan] = collections.OrderedDict()


def _plan_for(params: list[torch.Tensor], grads: list, homes: tuple[FlatParams, ...] | None) -> _Plan:
    key = tuple(map(id, params)) + (() if homes is None else (None, *map(id, homes)))
    plan = _plans.get(key)
    if plan is not None and plan.valid_for(params, grads):
        _plans.move_to_end(key)
        return plan
    plan = _plans[key] = _Plan(params, homes)
    _plans.move_to_end(key)
    if len(_plans) > _PLAN_CACHE_SIZE:
        _plans.popitem(last=False)
    return plan


# ---------------------------------------------------------------------------------------------- norms

"""FlatParams: lays parameters and gradients out in flat buffers, and states the layout.

The class coalesces each (device, dtype) group of parameters into one
aligned buffer (``param.data`` becomes a view of it) with a gradient buffer
over its trainable prefix, cuts the gradient buffers into buckets and the
trainable ranges into shards, and answers where everything is
(:meth:`~FlatParams.range_of`, :attr:`~FlatParams.buckets`,
:meth:`~FlatParams.shards`). Its gradient methods come from
:class:`~tfuse.flat._grad_path._GradPath`; the storage check, copies and
pickling delegate to ``_storage_guard`` and ``_copies``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tfuse.flat import _copies
from tfuse.flat import _storage_guard as guard
from tfuse.flat._checks import (
    _check_options,
    _check_world_size,
    _count,
    _dense_strides,
    _group_by_device_and_dtype,
    _plural,
    _size,
    _unique_params,
)
from tfuse.flat._compact_pickle import mark_compact
from tfuse.flat._copies import register_compact_state_dict
from tfuse.flat._grad_path import _GradPath
from tfuse.flat._home import _HOME_ATTR
from tfuse.flat._records import Bucket, FlatGroup, ParamRange, Shard, _Slot
from tfuse.flat._whole_shards import whole_parameter_offsets

logger = logging.getLogger(__package__)  # "tfuse.flat": the package logs under one name


class FlatParams(_GradPath):
    """Parameters and gradients coalesced into a few aligned flat buffers.

    Args:
        params: parameters (e.g. ``model.parameters()``), ``(name, parameter)``
            pairs (``model.named_parameters()``: error messages then use the
            names), or a module (its named parameters; its ``state_dict()``
            then serialises each parameter's own elements only, see
            :func:`register_compact_state_dict`). Tied parameters appear
            once, in the order first seen.
        bucket_mb: largest gradient bucket in MB (10**6 bytes); None: no size cap.
            A bucket always holds at least one parameter.
        max_params_per_bucket: most parameters in one bucket; None: no cap.
        align_bytes: every parameter and gradient starts on a multiple of
            this many bytes (256 keeps 128-bit vector loads aligned and suits
            NCCL); a power of two.
        world_size: pad each buffer's trainable range so that it splits into
            this many equal, aligned shards (see :meth:`shards`); None: no
            padding beyond alignment.

    A parameter's gradient sits at the same offset in the gradient buffer as
    the parameter in the parameter buffer (see :class:`FlatGroup`), with the
    parameter's strides: memory formats are kept. When the set of trainable
    parameters changes (a layer unfrozen), :meth:`sync_grads` (or
    :meth:`zero_grad`) lays the group out again: new buffers, ``param.data``
    re-homed, values and gradients kept, and ``layout_version``
    incremented so that holders of offsets (optimizers) know to follow. When a parameter's storage is replaced
    behind its back (``param.data = ...``, ``model.double()``, ...),
    :meth:`check_storage` re-homes it or raises; docs/architecture.md
    ("Storage replaced behind the buffers' back") lists the cases.

    Attributes:
        buckets: the all-reduce buckets, :class:`Bucket` views of the gradient
            buffers in backward order (:meth:`set_buckets` re-cuts them).
        layout_version: incremented at every re-layout; holders of offsets
            compare it with the version they read.

    Example:
        >>> import torch
        >>> from tfuse.flat import FlatParams
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> flat = FlatParams(model.parameters(), bucket_mb=1)
        >>> flat
        FlatParams(4 parameters (178 elements, 712 B) coalesced into 1 buffer, 1 bucket)
        >>> model(torch.randn(3, 8)).sum().backward()
        >>> flat.grad_buffers[0].abs().sum() > 0  # gradients landed in the flat buffer
        tensor(True)
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]] | torch.nn.Module,
        bucket_mb: float | None = None,
        max_params_per_bucket: int | None = None,
        align_bytes: int = 256,
        world_size: int | None = None,
    ) -> None:
        module = params if isinstance(params, torch.nn.Module) else None
        unique, names = _unique_params(params.named_parameters() if module is not None else params)
        _check_options(bucket_mb, max_params_per_bucket, align_bytes)
        _check_world_size(world_size)
        self._setup(unique, names, bucket_mb, max_params_per_bucket, align_bytes, world_size or 1)
        if module is not None:
            register_compact_state_dict(module)
        logger.info("%s", self.describe())

    def _setup(
        self,
        unique: list[torch.nn.Parameter],
        names: dict[torch.nn.Parameter, str],
        bucket_mb: float | None,
        max_params_per_bucket: int | None,
        align_bytes: int,
        shard_multiple: int = 1,
    ) -> None:
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.align_bytes = align_bytes
        self._shard_multiple = shard_multiple  # the trainable range splits into this many equal aligned shards
        self._whole_shards = False  # and each parameter lies inside one shard (sharded Muon)
        self.layout_version = 0
        self._registered = unique
        self._names = names
        self._groups: list[FlatGroup] = []
        self._hooks: list = []  # the parameters' gradient hooks (they attach the views before accumulation)
        self._accumulating: tuple[int, bool] = (-1, False)  # (autograd graph task, whether it accumulates)
        self._grad_views: dict[torch.nn.Parameter, torch.Tensor] = {}
        # id(param) -> its gradient slot holds exact zeros and was not handed out since (see _attach)
        self._clean: dict[int, bool] = {}
        self._group_keys: list[list[int]] = []  # per group: id() of its trainable parameters
        self._homes: dict[int, tuple[torch.Tensor, _Slot]] = {}  # id(param) -> (gradient view, slot): the hot path
        # The receiver: a bound method is held as (its function, a weak reference to its object), so that a
        # reducer is not kept alive by the buffers it reduces; any other callable as (itself, None).
        self._receiver: Callable[..., None] | None = None
        self._receiver_of: weakref.ref | None = None
        self._sharder: Callable[[], Any] | None = None  # weak reference to the ShardedOptimizer of these buffers
        self._refused = False  # backward met a replaced storage it refused: check_storage looks at every parameter
        self._param_ptrs: list[int] = []
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self._watched: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._trainable_flags: list[bool] = []
        self.buckets: list[Bucket] = []
        self._lay_out()

    # ------------------------------------------------------------------ layout

    def _lay_out(self) -> None:
        """(Re)builds every group's buffers for the parameters that are trainable now.

        Values, existing gradients, memory formats and the Parameter objects
        are kept; only the storage behind ``param.data`` and ``param.grad`` moves.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._grad_views = {}
        self._clean = {}
        self._homes = {}
        self.buckets = []
        groups = []
        for (device, dtype), members in _group_by_device_and_dtype(self._registered).items():
            trainable = [p for p in reversed(members) if p.requires_grad]  # backward order
            frozen = [p for p in members if not p.requires_grad]
            groups.append(self._coalesce(device, dtype, trainable, frozen))
        self._groups = groups
        for index, group in enumerate(g for g in groups if g.grad is not None):
            self._split_buckets(index, group)
        self._index_slots()
        for param, view in self._grad_views.items():
            # A hook on the parameter, not on its AccumulateGrad node: autograd makes a new node per forward, on
            # that forward's stream, and reads the parameter's hooks from it. Holding one node instead pins it
            # to the stream it was made on (the default stream), which breaks a CUDA graph captured on another.
            self._hooks.append(param.register_hook(self._attach_hook(param, view, self._slots[param])))
        self.layout_version += 1

    def _coalesce(self, device: torch.device, dtype: torch.dtype, trainable: list, frozen: list) -> FlatGroup:
        ordered = trainable + frozen
        align = max(self.align_bytes // torch.empty((), dtype=dtype).element_size(), 1)
        offsets, cursor = [], 0
        for param in ordered:
            offsets.append(cursor)
            cursor += -(-param.numel() // align) * align
        trainable_end = offsets[len(trainable)] if len(trainable) < len(ordered) else cursor
        if trainable and self._shard_multiple > 1 and self._whole_shards:  # each parameter inside one shard
            offsets[: len(trainable)], shard = whole_parameter_offsets(
                [p.numel() for p in trainable], self._shard_multiple, align
            )
            padding = shard * self._shard_multiple - trainable_end
            trainable_end += padding
            cursor += padding
            offsets[len(trainable) :] = [offset + padding for offset in offsets[len(trainable) :]]
        elif trainable and self._shard_multiple > 1:  # padding, so that the shards have equal aligned sizes
            shard = -(-trainable_end // (align * self._shard_multiple)) * align
            padding = shard * self._shard_multiple - trainable_end
            trainable_end += padding
            cursor += padding
            offsets[len(trainable) :] = [offset + padding for offset in offsets[len(trainable) :]]
        data = torch.zeros(cursor, dtype=dtype, device=device)
        grad = torch.zeros(trainable_end, dtype=dtype, device=device) if trainable else None
        home = weakref.ref(self)
        for buffer in (data, grad):
            if buffer is not None:
                setattr(buffer.untyped_storage(), _HOME_ATTR, home)
        mark_compact(data, grad)  # a parameter or gradient pickles as its own elements, not the buffer
        group = FlatGroup(
            device,
            dtype,
            ordered,
            offsets,
            data,
            grad,
            len(trainable),
            [tuple(p.shape) for p in ordered],
            [_dense_strides(p) for p in ordered],
        )
        for position, param in enumerate(ordered):
            view = group.slot(data, position)
            with torch.no_grad():
                view.copy_(param.data)
            param.data = view
            if position >= len(trainable):
                continue
            grad_view = group.slot(grad, position)
            previous = param.grad
            if previous is not None:  # keep gradients that exist (from old views or set elsewhere)
                with torch.no_grad():
                    grad_view.copy_(previous)
                param.grad = grad_view
            self._grad_views[param] = grad_view
            self._clean[id(param)] = previous is None
        return group

    def _split_buckets(self, index: int, group: FlatGroup) -> None:
        cap_bytes = None if self.bucket_mb is None else self.bucket_mb * 1e6
        element_size = group.data.element_size()
        total = group.trainable_numel
        params, offsets = group.params[: group.n_trainable], group.offsets[: group.n_trainable]
        start, members = 0, []
        for position, (param, offset) in enumerate(zip(params, offsets)):
            end = offsets[position + 1] if position + 1 < len(params) else total
            too_big = cap_bytes is not None and members and (end - start) * element_size > cap_bytes
            too_many = self.max_params_per_bucket is not None and len(members) >= self.max_params_per_bucket
            if too_big or too_many:
                self.buckets.append(Bucket(index, start, offset, tuple(members), group.grad[start:offset]))
                start, members = offset, []
            members.append(param)
        self.buckets.append(Bucket(index, start, total, tuple(members), group.grad[start:total]))

    def _index_slots(self) -> None:
        """Caches each parameter's slot and the data pointers :meth:`check_storage` compares.

        Watched are the parameters and our gradient views: a view handed out as
        ``param.grad`` can have its storage replaced too (``module._apply`` does
        ``param.grad.data = ...`` in ``to_empty``, ``.to()``, ``.double()``).
        """
        slots = {}
        for group_index, group in enumerate(self._groups):
            size = group.data.element_size()
            base = group.data.data_ptr()
            grad_base = None if group.grad is None else group.grad.data_ptr()
            for position, (param, offset) in enumerate(zip(group.params, group.offsets)):
                grad_ptr = grad_base + offset * size if position < group.n_trainable else None
                slots[param] = _Slot(
                    group_index,
                    position,
                    offset,
                    group.shapes[position],
                    group.strides[position],
                    base + offset * size,
                    grad_ptr,
                )
        self._slots = slots
        self._homes = {id(param): (view, slots[param]) for param, view in self._grad_views.items()}
        self._group_keys = [[id(p) for p in group.params[: group.n_trainable]] for group in self._groups]
        self._watched = list(self._registered) + list(self._grad_views.values())
        self._ptrs = [slots[p].ptr for p in self._registered] + [slots[p].grad_ptr for p in self._grad_views]
        self._param_ptrs = self._ptrs[: len(self._registered)]
        self._trainable_flags = [p.requires_grad for p in self._registered]
        self._on_meta = any(group.device.type == "meta" for group in self._groups)

    # ------------------------------------------------------------------ storage replaced behind our back

    def check_storage(self) -> None:
        """Finds parameters whose storage was replaced since coalescing; re-homes them or raises.

        The common case costs one ``data_ptr()`` per parameter against a
        cached list (docs/architecture.md gives the measured cost).
        A parameter with new storage of the same device, dtype, shape and
        memory layout is re-homed: its values are copied into its slot and
        ``param.data`` becomes the slot again (layout and optimizer state
        unchanged; the in-place copy bumps ``param._version``, so optimizers
        keeping master copies take the new values). Any other change raises a
        RuntimeError naming the parameters, what changed and what to do
        instead, and changes nothing. (A parameter given other strides over
        the same memory, ``param.data = param.data.t()``, keeps its pointer:
        the backward hook that would attach its slot and any copy of a
        gradient into its slot catch that; once they refused it, this checks
        every parameter.)
        :meth:`sync_grads` (every fused optimizer step) and FusedDataParallel's
        forward call this.
        """
        guard.check_storage(self)

    # ------------------------------------------------------------------ public API

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every coalesced parameter, in registration order."""
        return list(self._registered)

    @property
    def groups(self) -> list[FlatGroup]:
        """One :class:`FlatGroup` per (device, dtype), in order of first appearance."""
        return list(self._groups)

    @property
    def param_buffers(self) -> list[torch.Tensor]:
        """The flat parameter buffers, one per (device, dtype)."""
        return [group.data for group in self._groups]

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffers, one per (device, dtype) that has a trainable parameter.

        Handing them out counts as writing every slot (see :meth:`note_synchronized`).
        """
        self.note_synchronized()
        return [group.grad for group in self._groups if group.grad is not None]

    # ------------------------------------------------------------------ the layout, stated

    def range_of(self, param: torch.nn.Parameter) -> ParamRange:
        """Where ``param`` lives: its buffer (an index into :attr:`groups`) and element range."""
        slot = self._slots.get(param)
        if slot is None:
            raise KeyError("this parameter is not coalesced in this FlatParams")
        group = self._groups[slot.group]
        return ParamRange(
            slot.group,
            slot.offset,
            slot.offset + param.numel(),
            slot.shape,
            slot.strides,
            slot.position < group.n_trainable,
        )

    def ranges(self) -> list[ParamRange]:
        """Every parameter's range, buffer by buffer in buffer order (trainable ones first in each)."""
        return [self.range_of(param) for group in self._groups for param in group.params]

    def shards(self, world_size: int, whole_params: bool = False) -> list[list[Shard]]:
        """Each flat buffer's trainable range cut into ``world_size`` equal, aligned shards.

        ``whole_params``: every parameter lies inside one shard (a parameter is never split across ranks; ranks
        hold consecutive parameters, balanced by size, each shard padded to the largest). Asking for it lays the
        buffers out again once, and they stay so (later calls without it get the same shards).

        Returns ``shards[b][rank]`` for every buffer ``b`` of :attr:`groups`
        that has a gradient buffer (``[]`` for one that has none). Shard
        sizes are a multiple of the alignment and equal within a buffer; the
        trainable range is padded (zeros no parameter uses) to make them so.
        When the buffers are not padded for ``world_size`` yet, they are laid
        out again with that padding first (values and gradients kept,
        ``layout_version`` bumped, as on any re-layout); create the
        FlatParams with ``world_size=`` to lay it out once.

        Example:
            >>> import torch
            >>> from tfuse.flat import FlatParams
            >>> flat = FlatParams(torch.nn.Linear(100, 3).parameters(), world_size=4)
            >>> [(s.start, s.end) for s in flat.shards(4)[0]]
            [(0, 128), (128, 256), (256, 384), (384, 512)]
        """
        _check_world_size(world_size)
        if world_size > 1 and whole_params and (self._shard_multiple != world_size or not self._whole_shards):
            logger.info("FlatParams: laying the flat buffers out in %d equal shards of whole parameters", world_size)
            self._shard_multiple, self._whole_shards = world_size, True
            self._lay_out()
        elif world_size > 1 and self._shard_multiple != world_size and not self._splits_evenly(world_size):
            logger.info("FlatParams: padding the flat buffers to split into %d equal shards", world_size)
            self._shard_multiple, self._whole_shards = world_size, False
            self._lay_out()
        result: list[list[Shard]] = []
        for index, group in enumerate(self._groups):
            total = group.trainable_numel
            if group.grad is None:
                result.append([])
                continue
            size = total // world_size
            trainable = list(zip(group.params[: group.n_trainable], group.offsets))
            shards = []
            for rank in range(world_size):
                start, end = rank * size, (rank + 1) * size
                pieces = tuple(
                    (param, max(start, offset), min(end, offset + param.numel()))
                    for param, offset in trainable
                    if offset < end and offset + param.numel() > start
                )
                shards.append(Shard(index, rank, world_size, start, end, pieces))
            result.append(shards)
        return result

    def _splits_evenly(self, world_size: int) -> bool:
        for group in self._groups:
            align = max(self.align_bytes // group.data.element_size(), 1)
            if group.trainable_numel % (align * world_size):
                return False
        return True

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the coalesced parameters (by identity)."""
        return param in self._slots

    def name_of(self, param: torch.nn.Parameter) -> str | None:
        """The name ``param`` was given (named parameters or a module), if any."""
        return self._names.get(param)

    def set_names(self, names: dict[torch.nn.Parameter, str]) -> None:
        """Names parameters for error messages (those already named keep their names)."""
        for param, name in names.items():
            if param in self._slots:
                self._names.setdefault(param, name)

    def set_buckets(self, bucket_mb: float | None, max_params_per_bucket: int | None = None) -> None:
        """Splits the gradient buffers into buckets again with new caps.

        Only ``buckets`` changes: no storage moves, offsets stay, so an
        optimizer that already uses this FlatParams is unaffected.
        """
        _check_options(bucket_mb, max_params_per_bucket, self.align_bytes)
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.buckets = []
        for index, group in enumerate(g for g in self._groups if g.grad is not None):
            self._split_buckets(index, group)

    def describe(self) -> str:
        """One line: parameters, elements, bytes, buffers and buckets."""
        params = self.params
        elements = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return (
            f"{_plural(len(params), 'parameter')} ({_count(elements)} element{'' if elements == 1 else 's'}, "
            f"{_size(nbytes)}) coalesced into {_plural(len(self._groups), 'buffer')}, "
            f"{_plural(len(self.buckets), 'bucket')}"
        )

    def __repr__(self) -> str:
        return f"FlatParams({self.describe()})"

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self._registered)

    # ------------------------------------------------------------------ copies and pickling

    def __copy__(self) -> FlatParams:
        raise TypeError(
            "FlatParams cannot be copied shallowly: a parameter lives in one FlatParams. Use copy.deepcopy "
            "(which copies the parameters too, into a new FlatParams)"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatParams:
        """A new FlatParams over deep copies of the parameters (those already copied in this call reused).

        Same options and layout; values copied, gradients not (a deep-copied
        Parameter has none); a different layout_version.
        """
        return _copies.deep_copy(self, memo)

    def __getstate__(self) -> dict[str, Any]:
        return _copies.pickled_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling coalesces the loaded parameters again, into new buffers."""
        _copies.restore_pickled(self, state)

"""Coalesced flat storage for parameters and their gradients.

:class:`FlatParams` lays the parameters of each (device, dtype) group out in
one contiguous buffer, every parameter starting on an aligned offset, and
re-homes each ``param.data`` as a view into it (values unchanged, the
Parameter objects the same, so modules and optimizers keep working). Each
trainable parameter gets a gradient that is a view into a matching flat
gradient buffer, so autograd accumulates straight into it; one kernel can
then update a whole buffer and one all-reduce can move a whole bucket.

Parameters and gradients share one layout: trainable parameters first, in
reverse registration order (the order gradients become ready in backward),
then frozen ones; the gradient buffer covers only the trainable prefix, so a
parameter's gradient sits at the parameter's own offset. Gradient buffers are
split into buckets by a size cap and a parameter-count cap, the knobs of the
seeds (``fuse_grad_size_in_MB``, ``_fuse_grad_size_in_TFLOPS``).

Memory format: each parameter keeps its memory format. Its slot holds it as
a dense view with the strides it had (a channels_last convolution weight
stays channels_last, so convolutions do not silently convert it on every
call), and its gradient view has the same strides, as DDP's bucket views do.
Elementwise updates over a slot then pair each element of the parameter
with the same element of its gradient and of any state kept in the same
layout.

How gradients come to live in the buffer: a post-accumulate-grad hook on
every trainable parameter runs in backward once autograd has accumulated the
parameter's gradient. If ``param.grad`` is then not the parameter's view of
the flat buffer (it was None, so autograd stole its freshly computed
gradient, or a gradient was set by hand), the hook copies it into the view,
dividing by :attr:`FlatParams.fresh_grad_divisor` on the way (a data-parallel
wrapper averages there for free), and makes the view ``param.grad``. Once
``param.grad`` is the view, later backward passes accumulate into it in
place. One copy replaces what attaching a zeroed view before accumulation
would cost (a zeroing pass and a read-add-write pass), so
``zero_grad(set_to_none=True)`` does not touch the buffers at all: a slot
whose parameter has ``grad is None`` holds stale values until the parameter
gets a gradient again (read gradients through ``param.grad``, or use
``zero_grad(set_to_none=False)`` to zero the buffers). Parameters that take
no part in a backward keep ``grad is None``, exactly as in torch.

Storage replaced behind the buffers' back. Code that swaps a parameter's
storage (``layer.weight.data = tensor``, ``module.to_empty(device=...)``,
``model.double()``, ``model.to(memory_format=torch.channels_last)``) leaves
the flat slot behind while the live parameter uses new memory; an optimizer
updating the slot would then never train the parameter. :meth:`FlatParams.check_storage`
finds such parameters and runs every time gradients are synced
(:meth:`~FlatParams.sync_grads`, which fused optimizers call at each step)
and at each training forward of FusedDataParallel; the backward hook checks
its own parameter too. It compares one ``data_ptr()`` per parameter and per
gradient view (``module._apply`` replaces ``param.grad``'s storage as well)
with a cached list in one vectorised pass: measured 48 us per call for
ResNet-50's 161 parameters (322 pointers) on a shared 2-core CPU, torch 2.13;
``sync_grads`` as a whole takes 94 us there, less than the 166 us it took
before the check existed, because its other per-parameter tests are
vectorised the same way. What it does, per case:

* Same device, dtype, shape and memory layout (``.data = new_values``,
  ``to_empty`` on the same device): the parameter is *re-homed*: the new
  values are copied into its slot and ``param.data`` becomes the slot again.
  Layout, offsets and optimizer state stay as they are, as with torch.optim,
  whose state survives ``.data =``. (The tensor that was assigned is no
  longer the parameter's storage afterwards: writes to it do not reach the
  parameter once re-homed.)
* Another dtype (``model.double()/half()/bfloat16()``), another device
  (``model.to(device)``, ``to_empty`` of a model built on the meta device),
  another memory layout (``model.to(memory_format=torch.channels_last)``),
  another shape, or memory shared with another coalesced parameter
  (``a.data = b.data``): a RuntimeError that names the parameters, says what
  changed and how to do it instead (convert or move the model *before*
  creating the FlatParams, the fused optimizer or FusedDataParallel). A flat
  buffer and the optimizer state laid out over it have one dtype, one device
  and one element order, so following such a change would need the optimizer
  state to be converted or permuted too; the error comes before any update,
  so nothing is trained wrongly.

Copies and serialisation behave as they do for plain torch objects:

* ``copy.deepcopy(model)`` gives plain, independent parameters (torch's
  ``Parameter.__deepcopy__`` clones each one); ``copy.deepcopy`` of a
  FlatParams (alone or with the model, in one call) gives a new FlatParams
  holding the copied parameters, laid out the same way, with no gradients
  (as deep-copied parameters have none) and a different
  :attr:`~FlatParams.layout_version`, so copied holders of offsets re-map.
  A shallow ``copy.copy`` is refused: a parameter lives in one FlatParams.
* Pickling a FlatParams (``torch.save``) stores its parameters and options;
  loading coalesces the loaded parameters again.
* ``state_dict()`` tensors are views of the flat buffer, which ``torch.save``
  would write whole. :func:`register_compact_state_dict` (done for you by
  ``FlatParams(module)`` and by FusedDataParallel) makes every ``state_dict()``
  of the module and its submodules return tensors that still alias the
  parameters (in-place writes reach them, as in torch) but serialise only
  their own elements.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Which FlatParams a parameter lives in (a parameter can live in only one).
# Keyed by identity: tensors compare elementwise, so a plain weak dict cannot hold them.
# Known leak: the values hold their FlatParams strongly and a FlatParams holds its parameters, so an
# entry never dies (a weak key whose value refers back to it); FlatParams and their buffers are never
# freed. The strong parameter -> FlatParams edge would have to live where the garbage collector sees
# it: not in a post-accumulate-grad hook (torch 2.13 does not traverse those), and a Parameter's
# __dict__ would be pickled with it.
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_MAX_NAMED = 6  # parameters named in one error message


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A contiguous range of one gradient buffer, all-reduced as one message.

    Attributes:
        buffer_index: which gradient buffer (an index into ``FlatParams.grad_buffers``).
        start, end: element range in that buffer.
        params: the parameters whose gradients lie in the range, in the order they get them in backward.
    """

    buffer_index: int
    start: int
    end: int
    params: tuple[torch.nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class FlatGroup:
    """The parameters of one (device, dtype) and their flat buffers.

    Parameters and gradients share one layout: ``params[i]`` lives in the
    ``params[i].numel()`` elements of ``data`` from ``offsets[i]`` on, as a
    dense view of shape ``shapes[i]`` and strides ``strides[i]`` (its memory
    format when coalesced: contiguous, channels_last, ...), and its gradient
    in the same elements of ``grad`` with the same strides (:meth:`slot`
    gives such a view of any buffer laid out like ``data``). Trainable
    parameters come first, in reverse registration order (the order
    gradients become ready in backward), then frozen ones, which have no
    gradient slot: ``grad`` covers only the first ``n_trainable``
    parameters. Same offsets let a fused optimizer treat a run of
    parameters, their gradients and their optimizer state as three slices of
    one range; elementwise maths over a range is right whatever the strides,
    because all three share them.

    Attributes:
        device, dtype: what every parameter of the group has.
        params: trainable parameters (backward order), then frozen ones.
        offsets: element offset of each parameter, aligned.
        data: the flat parameter buffer.
        grad: the flat gradient buffer (None when no parameter is trainable).
        n_trainable: how many of ``params`` have a gradient slot.
        shapes, strides: each parameter's shape and strides in its slot.
    """

    device: torch.device
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    offsets: list[int]
    data: torch.Tensor
    grad: torch.Tensor | None
    n_trainable: int
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

    @property
    def trainable_numel(self) -> int:
        """Length of the gradient buffer (the trainable prefix of ``data``)."""
        return 0 if self.grad is None else self.grad.numel()

    def slot(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The view of ``buffer`` (a 1-D tensor laid out like ``data``) that holds ``params[index]``.

        It has the parameter's shape and strides, so it pairs element by
        element with the parameter (e.g. for optimizer state kept in a buffer
        of this layout).
        """
        return buffer.as_strided(self.shapes[index], self.strides[index], buffer.storage_offset() + self.offsets[index])


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one parameter lives: its group, position in the group, and the view's address and geometry."""

    group: int
    position: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    ptr: int
    grad_ptr: int | None  # None: frozen (no gradient slot)


class FlatParams:
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

    A parameter's gradient sits at the same offset in the gradient buffer as
    the parameter in the parameter buffer (see :class:`FlatGroup`), with the
    parameter's strides: memory formats are kept. When the set of trainable
    parameters changes (a layer unfrozen), :meth:`sync_grads` lays the group
    out again: new buffers, ``param.data`` re-homed, values and gradients
    kept, and :attr:`layout_version` incremented so that holders of offsets
    (optimizers) know to follow. When a parameter's storage is replaced
    behind its back (``param.data = ...``, ``model.double()``, ...),
    :meth:`check_storage` re-homes it or raises; the module docstring lists
    the cases.

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
    ) -> None:
        module = params if isinstance(params, torch.nn.Module) else None
        unique, names = _unique_params(params.named_parameters() if module is not None else params)
        _check_options(bucket_mb, max_params_per_bucket, align_bytes)
        self._setup(unique, names, bucket_mb, max_params_per_bucket, align_bytes)
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
    ) -> None:
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.align_bytes = align_bytes
        self.layout_version = 0
        self._registered = unique
        self._names = names
        self._groups: list[FlatGroup] = []
        self._hooks: list = []
        self._grad_views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._clean: dict[torch.nn.Parameter, bool] = {}
        self._listeners: list[Callable[[torch.nn.Parameter, bool], None]] = []
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self._watched: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._trainable_flags: list[bool] = []
        self.fresh_grad_divisor = 1.0
        self.buckets: list[Bucket] = []
        for param in unique:
            _OWNER[param] = self
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
        self.layout_version += 1

    def _coalesce(self, device: torch.device, dtype: torch.dtype, trainable: list, frozen: list) -> FlatGroup:
        ordered = trainable + frozen
        align = max(self.align_bytes // torch.empty((), dtype=dtype).element_size(), 1)
        offsets, cursor = [], 0
        for param in ordered:
            offsets.append(cursor)
            cursor += -(-param.numel() // align) * align
        trainable_end = offsets[len(trainable)] if len(trainable) < len(ordered) else cursor
        data = torch.zeros(cursor, dtype=dtype, device=device)
        grad = torch.zeros(trainable_end, dtype=dtype, device=device) if trainable else None
        group = FlatGroup(device, dtype, ordered, offsets, data, grad, len(trainable),
                          [tuple(p.shape) for p in ordered], [_dense_strides(p) for p in ordered])
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
            self._clean[param] = previous is None
            self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready_hook()))
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
                self.buckets.append(Bucket(index, start, offset, tuple(members)))
                start, members = offset, []
            members.append(param)
        self.buckets.append(Bucket(index, start, total, tuple(members)))

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
                slots[param] = _Slot(group_index, position, offset, group.shapes[position], group.strides[position],
                                     base + offset * size, grad_ptr)
        self._slots = slots
        self._watched = list(self._registered) + list(self._grad_views.values())
        self._ptrs = [slots[p].ptr for p in self._registered] + [slots[p].grad_ptr for p in self._grad_views]
        self._trainable_flags = [p.requires_grad for p in self._registered]
        self._on_meta = any(group.device.type == "meta" for group in self._groups)

    def _grad_ready_hook(self):
        flat = weakref.ref(self)

        def grad_ready(param: torch.Tensor) -> None:
            # Runs in backward once autograd has accumulated param.grad.
            owner = flat()
            if owner is not None:
                owner._bring_home(param)

        return grad_ready

    def _bring_home(self, param: torch.nn.Parameter) -> None:
        view = self._grad_views.get(param)
        if view is None:
            return
        slot = self._slots[param]
        if param.data_ptr() != slot.ptr or param.stride() != slot.strides:
            # Storage replaced since coalescing: an incompatible change raises here, before its
            # gradient (of another dtype, say) is copied anywhere; a compatible one is re-homed
            # by the next check_storage (not in the middle of backward).
            if self._problem(param, slot) is not None:
                raise RuntimeError(self._message(self._problems()))
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            self._restore_grad_view(param, slot, view)  # what autograd accumulated into it goes home too
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError(
                "FlatParams: a coalesced parameter received a sparse gradient; sparse gradients cannot live in a "
                "flat buffer (use dense gradients, e.g. nn.Embedding(..., sparse=False))"
            )
        divided = False
        if grad.requires_grad:
            return  # backward(create_graph=True): keep the graph; sync_grads copies it later
        if grad is not view and not _same_memory(grad, view):
            divisor = self.fresh_grad_divisor
            with torch.no_grad():
                if divisor == 1:
                    view.copy_(grad)
                else:
                    torch.div(grad, divisor, out=view)
                    divided = True
            param.grad = view
        self._clean[param] = False
        for listener in list(self._listeners):
            listener(param, divided)

    def add_grad_ready_listener(self, listener: Callable[[torch.nn.Parameter, bool], None]) -> Callable[[], None]:
        """Calls ``listener(param, divided)`` each time backward finishes a parameter's gradient.

        By then the gradient is in the flat buffer; ``divided`` says whether
        it was divided by :attr:`fresh_grad_divisor` as it was copied in
        (False when it was accumulated in place, or the divisor was 1).
        Returns a function that removes the listener.
        """
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    # ------------------------------------------------------------------ storage replaced behind our back

    def check_storage(self) -> None:
        """Finds parameters whose storage was replaced since coalescing; re-homes them or raises.

        The common case costs one ``data_ptr()`` per parameter against a
        cached list (see the module docstring for the measured cost).
        A parameter with new storage of the same device, dtype, shape and
        memory layout is re-homed: its values are copied into its slot and
        ``param.data`` becomes the slot again (layout and optimizer state
        unchanged; the in-place copy bumps ``param._version``, so optimizers
        keeping master copies take the new values). Any other change raises a
        RuntimeError naming the parameters, what changed and what to do
        instead, and changes nothing. (A parameter given other strides over
        the same memory, ``param.data = param.data.t()``, keeps its pointer:
        the backward hook and any copy of a gradient into its slot catch that.)
        :meth:`sync_grads` (every fused optimizer step) and FusedDataParallel's
        forward call this.
        """
        if list(map(_DATA_PTR, self._watched)) == self._ptrs:
            return
        problems = self._problems()
        if problems:
            raise RuntimeError(self._message(problems))
        for param, slot in self._slots.items():
            if param.data_ptr() != slot.ptr or param.stride() != slot.strides:
                self._rehome(param, slot)
        for param, view in self._grad_views.items():
            slot = self._slots[param]
            if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
                self._restore_grad_view(param, slot, view)

    def _problems(self) -> list[tuple[str, torch.nn.Parameter, str]]:
        """Every parameter (and gradient view) whose replaced storage cannot be taken back."""
        problems = []
        for param in self._registered:
            slot = self._slots[param]
            if param.data_ptr() != slot.ptr or param.stride() != slot.strides:
                problem = self._problem(param, slot)
                if problem is not None:
                    problems.append(problem)
        flagged = {id(p) for _, p, _ in problems}
        for param, view in self._grad_views.items():
            slot = self._slots[param]
            if id(param) in flagged or (view.data_ptr() == slot.grad_ptr and view.stride() == slot.strides):
                continue
            group = self._groups[slot.group]
            if view.device != group.device or view.dtype != group.dtype or tuple(view.shape) != slot.shape:
                problems.append(("grad", param, f"has a gradient whose storage was replaced by a "
                                 f"{tuple(view.shape)} {view.dtype} tensor on {view.device}"))
        return problems

    def _problem(self, param: torch.nn.Parameter, slot: _Slot) -> tuple[str, torch.nn.Parameter, str] | None:
        """(kind, parameter, what changed) when the parameter's new storage cannot be re-homed, else None."""
        group = self._groups[slot.group]
        if param.device != group.device:
            return "device", param, f"moved from {group.device} to {param.device}"
        if param.dtype != group.dtype:
            return "dtype", param, f"changed dtype from {group.dtype} to {param.dtype}"
        if tuple(param.shape) != slot.shape:
            return "shape", param, f"changed shape from {slot.shape} to {tuple(param.shape)}"
        if not _same_element_order(slot.shape, _dense_strides(param), slot.strides):
            return "layout", param, f"changed memory layout from strides {slot.strides} to {tuple(param.stride())}"
        other = self._param_at(param.data_ptr(), param.element_size())
        if other is not None and other is not param:
            return "alias", param, f"now shares memory with {self._label(other)}"
        return None

    def _check_meta(self) -> None:
        """Refuses a step over meta parameters none of which has a gradient: they were left behind.

        ``module.to_empty(device=...)`` (and any move off the meta device)
        gives the module *new* Parameter objects, because torch cannot re-home
        a meta parameter in place; the FlatParams and the optimizer keep the
        old ones, so a training step would update nothing, silently (as it
        would with torch.optim).
        """
        for group in self._groups:
            if group.device.type == "meta" and group.grad is not None and all(p.grad is None for p in group.params):
                one = len(group.params) == 1
                raise RuntimeError(
                    f"FlatParams: its {_plural(len(group.params), 'parameter')} {'is' if one else 'are'} still on "
                    f"the meta device and {'has no gradient' if one else 'none has a gradient'}. "
                    "module.to_empty(device=...) (or any move off the meta device) after creating the FlatParams or "
                    "a fused optimizer gives the module new Parameter objects, which they do not hold, so nothing "
                    "would be trained. Move or materialize the model first, then create them."
                )

    def _restore_grad_view(self, param: torch.nn.Parameter, slot: _Slot, view: torch.Tensor) -> None:
        """Points our gradient view (the same tensor object, which others hold) back at its slot, values kept."""
        group = self._groups[slot.group]
        values = view.data
        if values.device != group.device or values.dtype != group.dtype or tuple(values.shape) != slot.shape:
            raise RuntimeError(self._message(self._problems()))
        view.data = group.slot(group.grad, slot.position)
        with torch.no_grad():
            view.copy_(values)

    def _rehome(self, param: torch.nn.Parameter, slot: _Slot) -> None:
        group = self._groups[slot.group]
        values = param.data
        param.data = group.slot(group.data, slot.position)
        with torch.no_grad():
            param.copy_(values)  # in place on the parameter: bumps its version, like any write to it
        logger.debug("FlatParams: re-homed %s (its storage had been replaced)", self._label(param))

    def _param_at(self, ptr: int, element_size: int) -> torch.nn.Parameter | None:
        """The coalesced parameter whose slot holds address ``ptr``, if any."""
        for group in self._groups:
            base = group.data.data_ptr()
            if group.data.element_size() != element_size or not base <= ptr < base + group.data.numel() * element_size:
                continue
            position = bisect.bisect_right(group.offsets, (ptr - base) // element_size) - 1
            return group.params[position] if position >= 0 else None
        return None

    def _label(self, param: torch.nn.Parameter) -> str:
        name = self._names.get(param)
        if name is not None:
            return repr(name)
        index = next(i for i, p in enumerate(self._registered) if p is param)
        return f"parameter {index} (shape {self._slots[param].shape})"

    def _message(self, problems: list[tuple[str, torch.nn.Parameter, str]]) -> str:
        shown = "; ".join(f"{self._label(param)} {what}" for _, param, what in problems[:_MAX_NAMED])
        if len(problems) > _MAX_NAMED:
            shown += f"; and {len(problems) - _MAX_NAMED} more"
        kinds = list(dict.fromkeys(kind for kind, _, _ in problems))
        count = _plural(len(problems), "parameter")
        return (
            f"FlatParams: the storage of {count} was replaced after {'it was' if len(problems) == 1 else 'they were'} "
            f"coalesced into flat buffers, and the flat buffers cannot follow: {shown}. "
            + " ".join(_ADVICE[kind] for kind in kinds)
            + " Nothing was updated: the parameters hold the values they were given."
        )

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
        """The flat gradient buffers, one per (device, dtype) that has a trainable parameter."""
        return [group.grad for group in self._groups if group.grad is not None]

    def name_of(self, param: torch.nn.Parameter) -> str | None:
        """The name ``param`` was given (named parameters or a module), if any."""
        return self._names.get(param)

    def set_names(self, names: dict[torch.nn.Parameter, str]) -> None:
        """Names parameters for error messages (those already named keep their names)."""
        for param, name in names.items():
            if param in self._slots:
                self._names.setdefault(param, name)

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The view of the flat gradient buffer that holds ``param``'s gradient (with ``param``'s strides)."""
        if param not in self._grad_views:
            raise KeyError("this parameter has no gradient slot here (requires_grad=False, or not coalesced)")
        return self._grad_views[param]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets every gradient, as ``Optimizer.zero_grad`` does.

        ``set_to_none=True`` (torch's default) sets every ``param.grad`` to
        None without touching the buffers: the next backward copies each new
        gradient into its slot, overwriting what was there. ``set_to_none=False``
        zeroes the buffers (one op each) and keeps the views of parameters
        that have a gradient, as zeros.
        """
        if set_to_none:
            for param in self._grad_views:
                param.grad = None
            return
        for buffer in self.grad_buffers:
            buffer.zero_()
        for param, view in self._grad_views.items():
            self._clean[param] = True
            if param.grad is not None:
                param.grad = view

    def sync_grads(self) -> None:
        """Brings every parameter and gradient back into the flat buffers.

        First :meth:`check_storage` (a parameter whose storage was replaced
        is re-homed, or a clear error raised). A gradient set by hand
        (``param.grad = tensor``) is copied into the parameter's view; a
        parameter unfrozen since coalescing (or frozen) since the last layout
        makes the group be laid out again (see :attr:`layout_version`).
        Optimizers call this before a fused step.
        """
        self.check_storage()
        if self._on_meta:
            self._check_meta()
        if list(map(_REQUIRES_GRAD, self._registered)) != self._trainable_flags:
            logger.info("FlatParams: the set of trainable parameters changed; rebuilding gradient buffers")
            self._lay_out()
        for param, view in self._grad_views.items():
            grad = param.grad
            if grad is None or grad is view:
                continue
            if grad.is_sparse:
                raise RuntimeError("FlatParams: sparse gradients cannot live in a flat buffer")
            if _same_memory(grad, view):
                continue
            self._check_layout(param)
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
            self._clean[param] = False

    def _check_layout(self, param: torch.nn.Parameter) -> None:
        """Before copying a gradient into a slot: the parameter must still have the slot's strides.

        (The data-pointer check cannot see ``param.data = param.data.t()``, which keeps the pointer.)
        """
        if param.stride() != self._slots[param].strides and self._problem(param, self._slots[param]) is not None:
            raise RuntimeError(self._message(self._problems()))

    def set_buckets(self, bucket_mb: float | None, max_params_per_bucket: int | None = None) -> None:
        """Splits the gradient buffers into buckets again with new caps.

        Only :attr:`buckets` changes: no storage moves, offsets stay, so an
        optimizer that already uses this FlatParams is unaffected.
        """
        _check_options(bucket_mb, max_params_per_bucket, self.align_bytes)
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.buckets = []
        for index, group in enumerate(g for g in self._groups if g.grad is not None):
            self._split_buckets(index, group)

    def adopt_grad(self, param: torch.nn.Parameter) -> bool:
        """Makes ``param.grad`` its view of the flat buffer; returns whether it has a gradient.

        A gradient living elsewhere (set by hand, or accumulated into a tensor
        set by hand) is copied into the view first. A parameter whose
        ``grad`` is None keeps None, and its view is zeroed (unless already
        zero) so that the buffer holds exactly zero for it.
        """
        view = self.grad_view(param)
        grad = param.grad
        if grad is None:
            if not self._clean[param]:
                view.zero_()
                self._clean[param] = True
            return False
        if grad is not view and not _same_memory(grad, view):
            if grad.is_sparse:
                raise RuntimeError("FlatParams: sparse gradients cannot live in a flat buffer")
            self._check_layout(param)
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        self._clean[param] = False
        return True

    def attach_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Sets ``param.grad`` to its view of the flat buffer as it is (no zeroing) and returns it.

        For code that wrote the gradient into the buffer itself, e.g. an
        all-reduce that filled in a gradient this process never computed.
        """
        view = self.grad_view(param)
        param.grad = view
        self._clean[param] = False
        return view

    def describe(self) -> str:
        """One line: parameters, elements, bytes, buffers and buckets."""
        params = self.params
        elements = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return (
            f"{_plural(len(params), 'parameter')} ({_count(elements)} element{'' if elements == 1 else 's'}, "
            f"{_size(nbytes)}) coalesced into {_plural(len(self._groups), 'buffer')}, {_plural(len(self.buckets), 'bucket')}"
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
        params = [copy.deepcopy(p, memo) for p in self._registered]
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        names = {copy_: self._names[p] for p, copy_ in zip(self._registered, params) if p in self._names}
        new._setup(_unique_params(params)[0], names, self.bucket_mb, self.max_params_per_bucket, self.align_bytes)
        new.layout_version = self.layout_version + 1
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {
            "params": [(self._names.get(p), p) for p in self._registered],
            "bucket_mb": self.bucket_mb,
            "max_params_per_bucket": self.max_params_per_bucket,
            "align_bytes": self.align_bytes,
            "layout_version": self.layout_version,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling coalesces the loaded parameters again, into new buffers."""
        names = {p: name for name, p in state["params"] if name is not None}
        params = _unique_params([p for _, p in state["params"]])[0]
        self._setup(params, names, state["bucket_mb"], state["max_params_per_bucket"], state["align_bytes"])
        self.layout_version = state["layout_version"] + 1


_ADVICE = {
    "dtype": (
        "A dtype change (model.double(), .half(), .bfloat16(), .to(dtype)) after creating the FlatParams, a fused "
        "optimizer or FusedDataParallel cannot be followed: the flat buffers and the optimizer state over them have "
        "one dtype. Convert the model first, then create them."
    ),
    "device": (
        "A device change (model.to(device), .cuda(), module.to_empty(device=...) of a model built on the meta device) "
        "after creating the FlatParams, a fused optimizer or FusedDataParallel cannot be followed: the flat buffers "
        "and the optimizer state over them live on one device. Move or materialize the model first, then create them."
    ),
    "layout": (
        "A memory-format change (model.to(memory_format=torch.channels_last)) after creating the FlatParams, a fused "
        "optimizer or FusedDataParallel cannot be followed: the optimizer state is laid out like the parameters were. "
        "Convert the memory format first, then create them (coalescing keeps each parameter's memory format)."
    ),
    "shape": (
        "A coalesced parameter's shape is fixed (param.data = a tensor of another shape?); register a new "
        "nn.Parameter instead, and create the optimizer for it."
    ),
    "grad": (
        "A gradient that FlatParams handed out (param.grad) had its storage replaced by a tensor that cannot go back "
        "into its slot; set param.grad = tensor (or None) instead of assigning param.grad.data."
    ),
    "alias": (
        "To tie parameters, assign the Parameter itself (module.weight = other.weight) before coalescing, "
        "not its .data."
    ),
}


def _same_memory(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor with ``tensor``'s memory format (torch.preserve_format's rule)."""
    return tuple(torch.empty_like(tensor, device="meta").stride())


def _same_element_order(shape: tuple[int, ...], strides: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether two dense layouts of ``shape`` put every element at the same position (size-1 dims do not count)."""
    return all(a == b for size, a, b in zip(shape, strides, other) if size > 1)


def owner_of(param: torch.Tensor) -> FlatParams | None:
    """The FlatParams a parameter was coalesced into, if any."""
    return _OWNER.get(param)


def _unique_params(
    params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
) -> tuple[list[torch.nn.Parameter], dict[torch.nn.Parameter, str]]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "FlatParams: params argument given to FlatParams should be an iterable of Tensors, "
            f"but got {torch.typename(params)}"
        )
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            "FlatParams: params should be an iterable of Tensors (e.g. model.parameters()), of (name, Tensor) pairs, "
            f"or an nn.Module, but got {type(params).__name__}"
        )
    unique: list[torch.nn.Parameter] = []
    names: dict[torch.nn.Parameter, str] = {}
    seen: set[int] = set()
    for index, item in enumerate(params):
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, param = item
        else:
            param = item
        what = f"parameter {index}" if name is None else f"parameter {index} ({name!r})"
        if isinstance(param, torch.nn.Module):
            raise TypeError(
                f"FlatParams: {what} is a module ({type(param).__name__}), not a torch.Tensor; pass "
                "module.parameters(), or the module itself"
            )
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"FlatParams: {what} is a {type(param).__name__}, not a torch.Tensor")
        if id(param) in seen:
            continue  # tied parameters appear once
        if param.is_sparse or param.layout != torch.strided:
            raise TypeError(f"FlatParams: {what} is sparse ({param.layout}); sparse parameters cannot be coalesced")
        if param.dtype not in _SUPPORTED:
            raise TypeError(
                f"FlatParams: {what} has dtype {param.dtype}; only float16, bfloat16, float32 and "
                "float64 parameters can be coalesced"
            )
        if not param.is_leaf:
            raise ValueError(f"FlatParams: can't coalesce a non-leaf Tensor ({what})")
        owner = _OWNER.get(param)
        if owner is not None:
            raise ValueError(f"FlatParams: {what} already lives in another FlatParams ({owner.describe()})")
        seen.add(id(param))
        unique.append(param)
        if name is not None:
            names[param] = name
    if not unique:
        raise ValueError("FlatParams got an empty parameter list")
    return unique, names


def _check_options(bucket_mb: float | None, max_params_per_bucket: int | None, align_bytes: int) -> None:
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0):
        raise ValueError(f"FlatParams: bucket_mb must be a positive number or None, got {bucket_mb!r}")
    if max_params_per_bucket is not None and (
        isinstance(max_params_per_bucket, bool) or not isinstance(max_params_per_bucket, int) or max_params_per_bucket < 1
    ):
        raise ValueError(f"FlatParams: max_params_per_bucket must be a positive int or None, got {max_params_per_bucket!r}")
    if isinstance(align_bytes, bool) or not isinstance(align_bytes, int) or align_bytes < 1 or align_bytes & (align_bytes - 1):
        raise ValueError(f"FlatParams: align_bytes must be a power of two, got {align_bytes!r}")


def _group_by_device_and_dtype(params: list[torch.nn.Parameter]) -> dict[tuple[torch.device, torch.dtype], list]:
    groups: dict[tuple[torch.device, torch.dtype], list] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    return groups


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _count(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------------- serialisation


class _OwnElements(torch.Tensor):
    """A ``state_dict()`` entry of a coalesced parameter: aliases it, pickles only its own elements.

    It is the detached parameter (same memory, same version counter: in-place
    writes reach the parameter, as with torch's state_dict entries), typed so
    that pickling (``torch.save``) writes a storage that covers just its own
    elements, a zero-copy slice of the flat buffer's storage, instead of the
    whole buffer. Operations on it return plain tensors; it loads back as a
    plain tensor (also with ``weights_only=True``).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol: int) -> Any:
        return _own_storage_alias(self.as_subclass(torch.Tensor)).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A plain tensor holding a copy of its own elements (entries of one tied parameter: one copy)."""
        alias = _own_storage_alias(self.as_subclass(torch.Tensor))
        memo.setdefault(id(_SLICES), []).append(alias)  # keeps the storage slice alive for the whole deepcopy
        return copy.deepcopy(alias, memo)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return self.as_subclass(torch.Tensor).__repr__()


# Storage slices handed out while pickling, so that two entries of one tied parameter pickle as one storage.
_SLICES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _own_storage_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a plain tensor on a storage that spans only its elements (no copy)."""
    if tensor.device.type == "meta" or tensor.numel() == 0 or any(s < 0 for s in tensor.stride()):
        return tensor
    storage = tensor.untyped_storage()
    size = tensor.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    start, stop = tensor.storage_offset() * size, (tensor.storage_offset() + span) * size
    if start == 0 and stop == storage.nbytes():
        return tensor
    key = (storage.data_ptr(), start, stop, tensor.device)
    piece = _SLICES.get(key)
    if piece is None:
        piece = storage[start:stop]
        _SLICES[key] = piece
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(piece, 0, tensor.shape, tensor.stride())


def _compact_state_dict_hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, param in module._parameters.items():
        if param is None:
            continue
        key = prefix + name
        value = state_dict.get(key)
        # Not keep_vars=True (the Parameter itself); any view of a bigger storage: a flat buffer, or the one
        # storage a whole pickled coalesced model loads its parameters from.
        if type(value) is torch.Tensor and value.device.type != "meta" and _spans_less_than_storage(value):
            state_dict[key] = value.as_subclass(_OwnElements)


def _spans_less_than_storage(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return tensor.untyped_storage().nbytes() > 0
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size() < tensor.untyped_storage().nbytes()


def register_compact_state_dict(module: torch.nn.Module) -> None:
    """Makes ``state_dict()`` of ``module`` and of each submodule serialise coalesced parameters compactly.

    A coalesced parameter is a view of a flat buffer, and ``torch.save``
    writes a view's whole storage: one layer's ``state_dict()`` would carry
    every parameter of the buffer. After this call each parameter entry that
    is a view of a bigger storage is an alias of the parameter (as torch's
    entries are: in-place writes reach it) that pickles only its own
    elements, sharing no storage with other entries (tied parameters still
    share one). Idempotent; the hooks travel with deep copies and pickles of
    the module (a whole coalesced model pickled with ``torch.save(model)``
    loads as a plain model whose parameters are views of one storage: its
    state dicts stay compact too).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_compact_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    for submodule in module.modules():
        if not any(hook is _compact_state_dict_hook for hook in submodule._state_dict_hooks.values()):
            submodule.register_state_dict_post_hook(_compact_state_dict_hook)

"""Coalesced flat storage for parameters and their gradients.

:class:`FlatParams` lays the parameters of each (device, dtype) group out in
one contiguous buffer, every parameter starting on an aligned offset, and
re-homes each ``param.data`` as a view into it (values unchanged, the
Parameter objects the same, so modules and optimizers keep working). Each
trainable parameter gets a gradient that is a view into a matching flat
gradient buffer, so autograd accumulates straight into it (see "How
gradients come to live in the buffer" below); one kernel can then update a
whole buffer and one all-reduce can move a whole bucket.

Parameters and gradients share one layout: trainable parameters first, in
reverse registration order (the order gradients become ready in backward),
then frozen ones; the gradient buffer covers only the trainable prefix, so a
parameter's gradient sits at the parameter's own offset. Gradient buffers are
split into buckets by a size cap and a parameter-count cap, the knobs of the
seeds (``fuse_grad_size_in_MB``, ``_fuse_grad_size_in_TFLOPS``).

The layout is stated once, here, and read by everyone who works on the
buffers (optimizers, clipping, the all-reduce, sharding, averaging), who are
handed the FlatParams explicitly. One (device, dtype) group, three
parameters ``c, b, a`` trainable (backward order) and ``f`` frozen, cut into
two buckets and, for ``world_size=2``, two shards::

    groups[0].data   |c c c . |b b b b b b . . |a a . . |pad     |f f . . |
    groups[0].grad   |c c c . |b b b b b b . . |a a . . |pad     |
    range_of(b)               ^start=16        ^end=22 (ParamRange: buffer 0)
    buckets          |bucket 0 ...............|bucket 1 ..........|
    shards(2)[0]     |rank 0 ..........................|rank 1 ..........|

(``.``: alignment padding, zeros; ``pad``: padding so the trainable range
splits into equal aligned shards, present when created with ``world_size``
or after :meth:`FlatParams.shards`.) :meth:`FlatParams.range_of` gives a
parameter's (buffer, start, end), :attr:`FlatParams.buckets` the all-reduce
messages (each with a view of its range), :meth:`FlatParams.shards` the
ranges each rank owns; a buffer laid out like ``data`` (optimizer state)
pairs with it range for range.

Memory format: each parameter keeps its memory format. Its slot holds it as
a dense view with the strides it had (a channels_last convolution weight
stays channels_last, so convolutions do not silently convert it on every
call), and its gradient view has the same strides, as DDP's bucket views do.
Elementwise updates over a slot then pair each element of the parameter
with the same element of its gradient and of any state kept in the same
layout.

How gradients come to live in the buffer: autograd accumulates them there,
in place, and nothing is copied. Each trainable parameter's AccumulateGrad
node (the autograd node that writes ``param.grad``) is kept alive by the
FlatParams, so autograd uses the same node in every backward, and carries
one pre-hook. Just before autograd accumulates a gradient, the pre-hook
finds ``param.grad is None`` (after ``zero_grad(set_to_none=True)``, or never
set) and makes the parameter's view of the flat gradient buffer, zeroed,
its ``.grad``; AccumulateGrad then adds the new gradient into it in place
(``grad += new``, its rule when ``.grad`` exists and grad mode is off) and
keeps no fresh tensor. ``zero_grad`` fills each gradient buffer with zeros
(one op per buffer, whichever ``set_to_none``); ``set_to_none=True`` also sets
every ``param.grad`` to None (attribute writes, no op). So in steady state a
step runs no op per parameter on the gradient path besides autograd's own
accumulation. The decisions behind it:

* ``param.grad is None`` means what it means in torch. After
  ``zero_grad(set_to_none=True)`` every gradient is None; a parameter that
  gets no gradient in a backward keeps None (its pre-hook never runs), so
  fused optimizers skip it as torch's do (no momentum, no weight decay, no
  state created), where a zero gradient would have been updated.
  ``torch.autograd.grad`` runs no AccumulateGrad node and so no pre-hook:
  every ``.grad`` stays as it was (a tensor hook, ``param.register_hook``,
  would also run there, which is why the hook sits on the node).
  ``zero_grad(set_to_none=False)`` keeps the views of parameters that have a
  gradient, as zeros; several backward passes without ``zero_grad``
  accumulate in place, as in torch.
* A slot is handed to autograd only when it is known to hold zeros: the
  FlatParams keeps one flag per parameter, set by the fill of ``zero_grad``
  and cleared whenever the slot is handed out (attached as ``.grad``,
  :meth:`FlatParams.grad_view`, :attr:`FlatParams.grad_buffers`, a copy into
  it, or :meth:`FlatParams.note_written` from code that writes whole buffers
  or buckets, like a collective). A gradient set to None by someone else
  (``model.zero_grad()``, a ``torch.optim`` optimizer, ``p.grad = None``)
  leaves its slot with old values: the pre-hook zeroes it first, the whole
  buffer at once (one fill) when no parameter of the buffer has a gradient
  any more, else the slot alone. (A gradient tensor kept from before
  ``zero_grad`` is the slot: it reads zeros afterwards, and writing into it
  writes into the next gradient, as with DDP's ``gradient_as_bucket_view``.)
* ``backward(create_graph=True)`` runs with grad mode on, where
  AccumulateGrad adds out of place and the gradient keeps its graph: the
  pre-hook attaches nothing then, and the gradient lives outside the buffer
  until :meth:`FlatParams.sync_grads` (which fused optimizers call at each
  step) copies it in. So does a gradient set by hand (``param.grad =
  tensor``, which autograd accumulates into, as in torch). A sparse gradient
  is refused (it cannot live in a flat buffer).
* Keeping the AccumulateGrad nodes alive ties them to the parameters as
  coalesced: a parameter whose ``.data`` is replaced by one of another dtype,
  device or shape gets a new node (or a mismatched one) that the flat
  buffers cannot follow. :meth:`FlatParams.zero_grad` therefore compares the
  parameters' data pointers first (~12 us for 128 parameters on a shared
  2-core CPU) and runs :meth:`FlatParams.check_storage` when one changed, so
  such a change raises the error described below before the next backward.
* Device cost, stated honestly: one copy (read the fresh gradient, write the
  slot) is replaced by a fill (write the slot) and autograd's read-add-write,
  so about two more passes over the gradient bytes per step (a fill of the
  whole buffer plus one more read of it), against a Python hook after
  accumulation and a ``copy_`` dispatch per parameter saved on the host
  (issue 27 measured ~2.5 ms of them per ResNet-50 step, 161 parameters, on a
  shared 2-core CPU; ``benchmarks/grad_path.py`` compares the whole
  data-parallel path with DDP's). The aten op count of a step stays the
  same but for the fills: one ``add_`` per parameter where there was a
  ``copy_``, plus one fill per buffer.

A data-parallel reducer (:meth:`FlatParams.set_grad_receiver`) is told about
each parameter by the same pre-hook (no hook runs after accumulation): since
autograd runs one device's nodes one at a time, the parameter announced
before is complete by then, and the last one when backward ends. It divides
each bucket by the averaging divisor (one op per bucket) before its
all-reduce.

Storage replaced behind the buffers' back. Code that swaps a parameter's
storage (``layer.weight.data = tensor``, ``module.to_empty(device=...)``,
``model.double()``, ``model.to(memory_format=torch.channels_last)``) leaves
the flat slot behind while the live parameter uses new memory; an optimizer
updating the slot would then never train the parameter. :meth:`FlatParams.check_storage`
finds such parameters and runs every time gradients are synced
(:meth:`~FlatParams.sync_grads`, which fused optimizers call at each step)
and at each training forward of FusedDataParallel (and by
:meth:`~FlatParams.zero_grad` when a parameter's pointer changed); the
backward pre-hook checks its own parameter too. It compares one
``data_ptr()`` per parameter and per gradient view (``module._apply``
replaces ``param.grad``'s storage as well) with a cached list in one
vectorised pass: measured 48 us per call for
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
import inspect
import itertools
import logging
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from tfuse._eager import never_traced

logger = logging.getLogger(__name__)

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A flat buffer's storage carries a weak reference to its FlatParams under this attribute (torch keeps one
# Python object per storage alive as long as the storage lives, so the attribute stays). That is how a
# parameter leads to the FlatParams holding it (see flat_params_of) without any registry: nothing global,
# nothing kept alive, and copies (deepcopy, torch.save/load) get new storages without it.
_HOME_ATTR = "_tfuse_flat_params"
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_MAX_NAMED = 6  # parameters named in one error message


@dataclasses.dataclass(frozen=True)
class ParamRange:
    """Where one parameter lives: elements ``start:end`` of flat buffer ``buffer``.

    ``buffer`` indexes :attr:`FlatParams.groups` (and ``param_buffers``); a
    trainable parameter's gradient lies in the same elements of that group's
    gradient buffer. The elements hold the parameter as a dense view of
    ``shape`` and ``strides`` (its memory format), so any buffer laid out
    like the parameter buffer (gradients, optimizer state) pairs element by
    element with it over the same range.
    """

    buffer: int
    start: int
    end: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    trainable: bool

    @property
    def numel(self) -> int:
        return self.end - self.start

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This parameter's view of ``buffer`` (a 1-D tensor laid out like its parameter buffer)."""
        return buffer.as_strided(self.shape, self.strides, buffer.storage_offset() + self.start)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A contiguous range of one gradient buffer, all-reduced as one message.

    Attributes:
        buffer_index: which gradient buffer (an index into ``FlatParams.grad_buffers``).
        start, end: element range in that buffer.
        params: the parameters whose gradients lie in the range, in the order they get them in backward.
        grad: the range as a view of the gradient buffer (what a collective sends and receives).
    """

    buffer_index: int
    start: int
    end: int
    params: tuple[torch.nn.Parameter, ...]
    grad: torch.Tensor = dataclasses.field(compare=False, repr=False, default=None)  # type: ignore[assignment]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's equal, aligned share of a flat buffer's trainable range.

    Elements ``start:end`` of parameter buffer ``buffer`` (and of its
    gradient buffer); every shard of a buffer has the same size and starts
    on an aligned offset. The last shards may cover padding (elements no
    parameter uses, kept at zero) so that the sizes match.

    Attributes:
        buffer: index into :attr:`FlatParams.groups`.
        rank, world_size: whose share, out of how many.
        start, end: element range.
        ranges: the parts of parameters inside the shard, clipped to it.
    """

    buffer: int
    rank: int
    world_size: int
    start: int
    end: int
    ranges: tuple[tuple[torch.nn.Parameter, int, int], ...]  # (parameter, start, end) clipped to the shard

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
        world_size: pad each buffer's trainable range so that it splits into
            this many equal, aligned shards (see :meth:`shards`); None: no
            padding beyond alignment.

    A parameter's gradient sits at the same offset in the gradient buffer as
    the parameter in the parameter buffer (see :class:`FlatGroup`), with the
    parameter's strides: memory formats are kept. When the set of trainable
    parameters changes (a layer unfrozen), :meth:`sync_grads` (or
    :meth:`zero_grad`) lays the group out again: new buffers, ``param.data``
    re-homed, values and gradients kept, and :attr:`layout_version`
    incremented so that holders of offsets (optimizers) know to follow. When a parameter's storage is replaced
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
        self.layout_version = 0
        self._registered = unique
        self._names = names
        self._groups: list[FlatGroup] = []
        self._hooks: list = []  # pre-hooks on the parameters' AccumulateGrad nodes (they attach the views)
        self._accumulators: list = []  # those nodes, kept alive so that autograd uses them (and their hooks)
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
        self._hooks, self._accumulators = [], []
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
            # Kept alive by us, the node autograd accumulates this parameter's gradients with stays the same
            # across backward passes (otherwise a new one per graph), and so does its pre-hook.
            accumulator = get_gradient_edge(param).node
            self._accumulators.append(accumulator)
            self._hooks.append(accumulator.register_prehook(self._attach_hook(param, view, self._slots[param])))
        self.layout_version += 1

    def _coalesce(self, device: torch.device, dtype: torch.dtype, trainable: list, frozen: list) -> FlatGroup:
        ordered = trainable + frozen
        align = max(self.align_bytes // torch.empty((), dtype=dtype).element_size(), 1)
        offsets, cursor = [], 0
        for param in ordered:
            offsets.append(cursor)
            cursor += -(-param.numel() // align) * align
        trainable_end = offsets[len(trainable)] if len(trainable) < len(ordered) else cursor
        if trainable and self._shard_multiple > 1:  # padding, so that the shards have equal aligned sizes
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

    def _attach_hook(self, param: torch.nn.Parameter, view: torch.Tensor, slot: _Slot) -> Callable[[tuple], None]:
        flat = weakref.ref(self)  # the hook must not keep the FlatParams alive
        key, ptr, strides = id(param), slot.ptr, slot.strides
        grad_enabled = torch.is_grad_enabled

        @never_traced  # bookkeeping on the host (backward called inside compiled code), no cost per call
        def attach_view(grad_outputs: tuple) -> None:
            # Runs in backward just before autograd accumulates the parameter's gradient (a pre-hook of its
            # AccumulateGrad node: torch.autograd.grad, which accumulates nothing, never runs it).
            owner = flat()
            if owner is None:
                return
            # With grad mode on (create_graph=True) autograd accumulates out of place: nothing to attach to.
            if param.grad is None and not grad_enabled():
                clean = owner._clean
                grad = grad_outputs[0]
                # The common case inline: a zeroed slot, the parameter where it was coalesced, a dense gradient.
                if clean[key] and param.data_ptr() == ptr and param.stride() == strides and not grad.is_sparse:
                    clean[key] = False
                    param.grad = view
                else:
                    owner._attach(param, key, view, grad)
            receiver = owner._receiver
            if receiver is not None:
                of = owner._receiver_of
                if of is None:
                    receiver(param)
                else:
                    target = of()
                    if target is not None:
                        receiver(target, param)

        return attach_view

    def _attach(self, param: torch.nn.Parameter, key: int, view: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Makes the parameter's zeroed slot its ``.grad``, so that autograd adds the new gradient into it in place."""
        slot = self._homes[key][1]
        # Storage replaced since coalescing: an incompatible change raises here, before any gradient lands; a
        # compatible one is re-homed by the next check_storage (not in the middle of backward).
        if (param.data_ptr() != slot.ptr or param.stride() != slot.strides) and self._problem(param, slot) is not None:
            self._refused = True  # (other strides over the same memory: the pointer check cannot see it)
            raise RuntimeError(self._message(self._problems()))
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            self._restore_grad_view(param, slot, view)
            self._clean[key] = False
        if grad is not None and grad.is_sparse:
            raise RuntimeError(
                "FlatParams: a coalesced parameter received a sparse gradient; sparse gradients cannot live in a "
                "flat buffer (use dense gradients, e.g. nn.Embedding(..., sparse=False))"
            )
        if not self._clean[key]:
            self._zero_slot(slot, view)
        self._clean[key] = False
        param.grad = view

    def _zero_slot(self, slot: _Slot, view: torch.Tensor) -> None:
        """Zeroes a slot that may hold old values: the whole buffer (one fill) when no parameter of the group
        has a gradient (``grad is None`` everywhere: e.g. after ``model.zero_grad()``), else the slot alone."""
        group = self._groups[slot.group]
        with torch.no_grad():
            if all(p.grad is None for p in itertools.islice(group.params, group.n_trainable)):
                group.grad.zero_()
                self._clean.update(dict.fromkeys(self._group_keys[slot.group], True))
            else:
                view.zero_()

    def set_grad_receiver(self, receiver: Callable[[torch.nn.Parameter], None] | None) -> None:
        """Announces each gradient to ``receiver(param)`` as autograd is about to accumulate it (a data-parallel
        reducer: it learns when a bucket is complete).

        Backward calls it once per trainable parameter that gets a gradient,
        from the pre-hook of the parameter's AccumulateGrad node that
        attaches the flat buffer's view (no hook of its own): just before
        autograd adds the gradient into ``param.grad``. Autograd runs one
        device's nodes one at a time, so by the time ``receiver(q)`` is
        called, the accumulation of every parameter announced before ``q``
        on the same device has finished, and every one has finished when the
        callbacks queued on the engine (``queue_callback``) run at the end of
        backward. The gradient then normally lives in the parameter's view of
        the flat buffer; one that lives elsewhere (set by hand) is the
        receiver's to bring in with :meth:`bring_home`. One receiver at a
        time; None: none. A bound method is held weakly (a reducer is not
        kept alive by the buffers it reduces: once it is gone, gradients are
        simply not announced), any other callable strongly. (Dynamo never
        traces the hook, nor the receiver it calls.)
        """
        if inspect.ismethod(receiver):
            self._receiver, self._receiver_of = receiver.__func__, weakref.ref(receiver.__self__)
        else:
            self._receiver, self._receiver_of = receiver, None

    @property
    def sharded_by(self) -> Any:
        """The live ShardedOptimizer whose shards these buffers are (None: not sharded).

        Gradient clipping reads it: a per-rank norm of sharded gradients would be wrong.
        """
        return None if self._sharder is None else self._sharder()

    def set_sharded_by(self, optimizer: Any) -> None:
        """Records (weakly) the ShardedOptimizer that owns shards of these buffers; None clears it."""
        self._sharder = None if optimizer is None else weakref.ref(optimizer)

    @property
    def grad_receiver(self) -> Callable[[torch.nn.Parameter], None] | None:
        """The receiver set by :meth:`set_grad_receiver`, if any (None once a bound method's object is gone)."""
        if self._receiver_of is None:
            return self._receiver
        target = self._receiver_of()
        return None if target is None else self._receiver.__get__(target)

    def bring_home(self, param: torch.nn.Parameter) -> bool:
        """Makes ``param.grad`` its view of the flat gradient buffer; returns whether the gradient is in the buffer.

        A gradient that lives elsewhere (set by hand, or accumulated into a
        tensor set by hand) is copied into the view, which becomes
        ``param.grad``. Returns False, changing nothing, when ``param`` has no
        gradient, no gradient slot here, or a gradient that keeps its graph
        (``backward(create_graph=True)``; a later :meth:`sync_grads` copies it).
        """
        home = self._homes.get(id(param))
        if home is None:
            return False
        view, slot = home
        grad = param.grad
        if grad is view:
            return True
        if grad is None or grad.requires_grad:
            return False
        if (param.data_ptr() != slot.ptr or param.stride() != slot.strides) and self._problem(param, slot) is not None:
            self._refused = True  # (other strides over the same memory: the pointer check cannot see it)
            raise RuntimeError(self._message(self._problems()))
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            self._restore_grad_view(param, slot, view)
        if grad.is_sparse:
            raise RuntimeError(
                "FlatParams: a coalesced parameter received a sparse gradient; sparse gradients cannot live in a "
                "flat buffer (use dense gradients, e.g. nn.Embedding(..., sparse=False))"
            )
        self._clean[id(param)] = False
        if _same_memory(grad, view):
            return True
        with torch.no_grad():
            view.copy_(grad)
        param.grad = view
        return True

    def note_written(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Tells the FlatParams that gradient slots were written through the buffers, not through ``param.grad``.

        For code that writes whole gradient buffers or buckets (a collective,
        a scaling pass) while some parameters' ``grad`` is None: their slots
        may then hold values, so the next backward that gives such a
        parameter a gradient zeroes its slot first (see the module
        docstring). ``params``: those whose slots were written; None: all.
        :meth:`zero_grad` makes every slot known zero again.
        """
        if params is None:
            self._clean = dict.fromkeys(self._clean, False)
            return
        for param in params:
            if id(param) in self._clean:
                self._clean[id(param)] = False

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
        the backward pre-hook that would attach its slot and any copy of a
        gradient into its slot catch that; once they refused it, this checks
        every parameter.)
        :meth:`sync_grads` (every fused optimizer step) and FusedDataParallel's
        forward call this.
        """
        if list(map(_DATA_PTR, self._watched)) == self._ptrs and not self._refused:
            return
        problems = self._problems()
        if problems:
            raise RuntimeError(self._message(problems))
        self._refused = False
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
                problems.append(
                    (
                        "grad",
                        param,
                        f"has a gradient whose storage was replaced by a "
                        f"{tuple(view.shape)} {view.dtype} tensor on {view.device}",
                    )
                )
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
        """The flat gradient buffers, one per (device, dtype) that has a trainable parameter.

        Handing them out counts as writing every slot (see :meth:`note_written`).
        """
        self.note_written()
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

    def shards(self, world_size: int) -> list[list[Shard]]:
        """Each flat buffer's trainable range cut into ``world_size`` equal, aligned shards.

        Returns ``shards[b][rank]`` for every buffer ``b`` of :attr:`groups`
        that has a gradient buffer (``[]`` for one that has none). Shard
        sizes are a multiple of the alignment and equal within a buffer; the
        trainable range is padded (zeros no parameter uses) to make them so.
        When the buffers are not padded for ``world_size`` yet, they are laid
        out again with that padding first (values and gradients kept,
        :attr:`layout_version` bumped, as on any re-layout); create the
        FlatParams with ``world_size=`` to lay it out once.

        Example:
            >>> import torch
            >>> from tfuse.flat import FlatParams
            >>> flat = FlatParams(torch.nn.Linear(100, 3).parameters(), world_size=4)
            >>> [(s.start, s.end) for s in flat.shards(4)[0]]
            [(0, 128), (128, 256), (256, 384), (384, 512)]
        """
        _check_world_size(world_size)
        if world_size > 1 and self._shard_multiple != world_size and not self._splits_evenly(world_size):
            logger.info("FlatParams: padding the flat buffers to split into %d equal shards", world_size)
            self._shard_multiple = world_size
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

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The view of the flat gradient buffer that holds ``param``'s gradient (with ``param``'s strides).

        Handing it out counts as writing the slot (see :meth:`note_written`).
        """
        view = self._view(param)
        self._clean[id(param)] = False
        return view

    def _view(self, param: torch.nn.Parameter) -> torch.Tensor:
        view = self._grad_views.get(param)
        if view is None:
            raise KeyError("this parameter has no gradient slot here (requires_grad=False, or not coalesced)")
        return view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets every gradient, as ``Optimizer.zero_grad`` does: one fill per gradient buffer.

        Every gradient buffer is filled with zeros (one op each, no op per
        parameter). ``set_to_none=True`` (torch's default) sets every
        ``param.grad`` to None; the next backward makes each parameter that
        gets a gradient point at its zeroed slot just before autograd adds
        the gradient into it (see the module docstring). ``set_to_none=False``
        keeps the views of parameters that have a gradient, as zeros (a
        frozen parameter's gradient, which has no slot, is zeroed where it is).
        First, when a parameter's data pointer changed, runs
        :meth:`check_storage`: a parameter whose storage was replaced since
        coalescing is re-homed, or a clear error raised here, before the
        backward that would meet it; and when the set of trainable parameters
        changed, lays the buffers out again (as :meth:`sync_grads` does).
        """
        # (The parameters' pointers only: a gradient view whose storage was replaced is taken back by the
        # next check_storage, at the step or FusedDataParallel's forward, before anyone reads the buffer.)
        if list(map(_DATA_PTR, self._registered)) != self._param_ptrs or self._refused:
            self.check_storage()
        relayout = list(map(_REQUIRES_GRAD, self._registered)) != self._trainable_flags
        if set_to_none:
            for param in self._registered:
                param.grad = None
        if relayout:
            logger.info("FlatParams: the set of trainable parameters changed; rebuilding gradient buffers")
            self._lay_out()
        with torch.no_grad():
            for group in self._groups:
                if group.grad is not None:
                    group.grad.zero_()
        if set_to_none:
            self._clean = dict.fromkeys(self._clean, True)
            return
        for param in self._registered:
            grad = param.grad
            view = self._grad_views.get(param)
            if view is None:
                if grad is not None:
                    with torch.no_grad():
                        grad.zero_()
                continue
            self._clean[id(param)] = grad is None
            if grad is not None and grad is not view:
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
            self._clean[id(param)] = False

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
        view = self._view(param)
        grad = param.grad
        if grad is None:
            if not self._clean[id(param)]:
                with torch.no_grad():
                    view.zero_()
                self._clean[id(param)] = True
            return False
        if grad is not view and not _same_memory(grad, view):
            if grad.is_sparse:
                raise RuntimeError("FlatParams: sparse gradients cannot live in a flat buffer")
            self._check_layout(param)
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        self._clean[id(param)] = False
        return True

    def attach_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Sets ``param.grad`` to its view of the flat buffer as it is (no zeroing) and returns it.

        For code that wrote the gradient into the buffer itself, e.g. an
        all-reduce that filled in a gradient this process never computed.
        """
        view = self._view(param)
        param.grad = view
        self._clean[id(param)] = False
        return view

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
        params = [copy.deepcopy(p, memo) for p in self._registered]
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        names = {copy_: self._names[p] for p, copy_ in zip(self._registered, params) if p in self._names}
        new._setup(
            _unique_params(params)[0],
            names,
            self.bucket_mb,
            self.max_params_per_bucket,
            self.align_bytes,
            self._shard_multiple,
        )
        new.layout_version = self.layout_version + 1
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {
            "params": [(self._names.get(p), p) for p in self._registered],
            "bucket_mb": self.bucket_mb,
            "max_params_per_bucket": self.max_params_per_bucket,
            "align_bytes": self.align_bytes,
            "shard_multiple": self._shard_multiple,
            "layout_version": self.layout_version,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling coalesces the loaded parameters again, into new buffers."""
        names = {p: name for name, p in state["params"] if name is not None}
        params = _unique_params([p for _, p in state["params"]])[0]
        self._setup(
            params,
            names,
            state["bucket_mb"],
            state["max_params_per_bucket"],
            state["align_bytes"],
            state.get("shard_multiple", 1),
        )
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


def flat_params_of(param: torch.Tensor) -> FlatParams | None:
    """The live FlatParams whose buffers hold ``param``, if any.

    Read from the parameter's memory: each flat buffer's storage carries a
    weak reference to its FlatParams. No registry is involved, so a
    FlatParams nobody holds any more is freed (and its parameters count as
    loose again). Meant for set-up code that is handed plain parameters
    (``FusedAdam(model.parameters())`` after ``FusedDataParallel(model)``);
    everything that works on a FlatParams afterwards holds it explicitly.

    Example:
        >>> import torch
        >>> from tfuse.flat import FlatParams, flat_params_of
        >>> layer = torch.nn.Linear(4, 2)
        >>> flat = FlatParams(layer)
        >>> flat_params_of(layer.weight) is flat
        True
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"flat_params_of: expected a torch.Tensor, got {type(param).__name__}")
    ref = getattr(param.untyped_storage(), _HOME_ATTR, None)
    flat = ref() if ref is not None else None
    return flat if flat is not None and flat.holds(param) else None


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
        owner = flat_params_of(param)
        if owner is not None:
            raise ValueError(f"FlatParams: {what} already lives in another FlatParams ({owner.describe()})")
        seen.add(id(param))
        unique.append(param)
        if name is not None:
            names[param] = name
    if not unique:
        raise ValueError("FlatParams got an empty parameter list")
    return unique, names


def _check_world_size(world_size: int | None) -> None:
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"FlatParams: world_size must be a positive int or None, got {world_size!r}")


def _check_options(bucket_mb: float | None, max_params_per_bucket: int | None, align_bytes: int) -> None:
    if bucket_mb is not None and (
        isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0
    ):
        raise ValueError(f"FlatParams: bucket_mb must be a positive number or None, got {bucket_mb!r}")
    if max_params_per_bucket is not None and (
        isinstance(max_params_per_bucket, bool)
        or not isinstance(max_params_per_bucket, int)
        or max_params_per_bucket < 1
    ):
        raise ValueError(
            f"FlatParams: max_params_per_bucket must be a positive int or None, got {max_params_per_bucket!r}"
        )
    if (
        isinstance(align_bytes, bool)
        or not isinstance(align_bytes, int)
        or align_bytes < 1
        or align_bytes & (align_bytes - 1)
    ):
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


def _compact_state_dict_hook(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
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

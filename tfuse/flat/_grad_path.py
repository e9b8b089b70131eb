"""The gradient path of FlatParams: how gradients come to live in the flat gradient buffers.

Each trainable parameter carries a gradient hook (which autograd's
AccumulateGrad node runs first) that makes the parameter's zeroed view of the
gradient buffer its ``.grad`` just before autograd accumulates into it, and
announces the parameter to a receiver (a data-parallel reducer); ``zero_grad``, ``sync_grads`` and the methods that
hand out or adopt gradient views keep the buffers and ``param.grad`` in
step. docs/architecture.md ("How a gradient reaches its bucket") says how
and why.

:class:`_GradPath` holds these methods; :class:`~tfuse.flat.FlatParams`
inherits them and owns the state they work on (set up by its ``_setup`` and
``_lay_out``).
"""

from __future__ import annotations

import enum
import inspect
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import unserializable_hook

from tfuse._eager import never_traced
from tfuse.flat import _storage_guard as guard
from tfuse.flat._checks import _DATA_PTR, _REQUIRES_GRAD, _same_memory
from tfuse.flat._records import FlatGroup, _Slot

logger = logging.getLogger(__package__)  # "tfuse.flat": the package logs under one name


_graph_task_id = torch._C._current_graph_task_id
_will_engine_execute = torch._C._will_engine_execute_node


def _task_accumulates(owner: Any, param: torch.nn.Parameter) -> bool:
    """Whether the backward pass running now accumulates into leaves' ``.grad`` (``backward()``, with or without
    ``inputs=``) or only returns gradients (``torch.autograd.grad``).

    The answer is the same for every leaf whose hook runs in one pass, so it is
    asked once per pass (autograd's graph-task id) and kept on ``owner``: a
    C call per parameter, not a node lookup.
    """
    task = _graph_task_id()
    cached = owner._accumulating
    if cached[0] == task:
        return cached[1]
    try:
        answer = _will_engine_execute(get_gradient_edge(param).node)
    except RuntimeError:  # torch refuses the question for a leaf only inside torch.autograd.grad
        answer = False
    owner._accumulating = (task, answer)
    return answer


class GradHome(enum.Enum):
    """Where :meth:`FlatParams.bring_home <tfuse.flat.FlatParams.bring_home>` left a parameter's gradient."""

    IN_BUFFER = "in its slot of the flat buffer (param.grad is the view)"
    ZEROS = "none; its slot holds zeros (grad stays None)"
    NONE = "none"
    KEEPS_GRAPH = "outside the buffer: it keeps its graph (create_graph=True)"
    NO_SLOT = "no gradient slot here"


class _GradPath:
    """The gradient methods of :class:`~tfuse.flat.FlatParams` (a base class of it, never used alone)."""

    # FlatParams' state these methods read and write (see FlatParams._setup and _lay_out).
    _registered: list[torch.nn.Parameter]
    _groups: list[FlatGroup]
    _group_keys: list[list[int]]
    _grad_views: dict[torch.nn.Parameter, torch.Tensor]
    _slots: dict[torch.nn.Parameter, _Slot]
    _homes: dict[int, tuple[torch.Tensor, _Slot]]
    _clean: dict[int, bool]
    _receiver: Callable[..., None] | None
    _receiver_of: weakref.ref | None
    _sharder: Callable[[], Any] | None
    _refused: bool
    _param_ptrs: list[int]
    _trainable_flags: list[bool]
    _on_meta: bool
    # (and its methods _lay_out and check_storage, which zero_grad and sync_grads call)

    def _attach_hook(
        self, param: torch.nn.Parameter, view: torch.Tensor, slot: _Slot
    ) -> Callable[[torch.Tensor], None]:
        flat = weakref.ref(self)  # the hook must not keep the FlatParams alive
        key, ptr, strides = id(param), slot.ptr, slot.strides
        grad_enabled = torch.is_grad_enabled

        @unserializable_hook  # torch.save of the parameter: the hook is not saved, and says so by this mark
        @never_traced  # bookkeeping on the host (backward called inside compiled code), no cost per call
        def attach_view(grad: torch.Tensor) -> None:
            # Runs in backward just before autograd accumulates the parameter's gradient (a gradient hook of the
            # parameter, which its AccumulateGrad node runs first), and also when torch.autograd.grad takes the
            # gradient without accumulating it: then there is nothing to attach nor to announce.
            owner = flat()
            if owner is None or not _task_accumulates(owner, param):
                return
            # With grad mode on (create_graph=True) autograd accumulates out of place: nothing to attach to.
            if param.grad is None and not grad_enabled():
                clean = owner._clean
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
        moved = param.data_ptr() != slot.ptr or param.stride() != slot.strides
        if moved and guard.problem(self, param, slot) is not None:
            self._refused = True  # (other strides over the same memory: the pointer check cannot see it)
            raise RuntimeError(guard.message(self, guard.problems(self)))
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            guard.restore_grad_view(self, param, slot, view)
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
        from the parameter's gradient hook that attaches the flat buffer's
        view (no hook of its own): just before autograd adds the gradient
        into ``param.grad`` (never in ``torch.autograd.grad``, which adds
        nothing). Autograd runs one
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

    def bring_home(self, param: torch.nn.Parameter, *, final: bool = False, filled: bool = False) -> GradHome:
        """Makes ``param.grad`` its view of the flat gradient buffer where it can; says where the gradient is.

        A gradient that lives elsewhere (set by hand, or accumulated into a
        tensor set by hand) is copied into the view, which becomes
        ``param.grad``: :attr:`GradHome.IN_BUFFER`. Otherwise nothing changes
        and the result says why: no gradient (:attr:`GradHome.NONE`), no slot
        here (:attr:`GradHome.NO_SLOT`), or a gradient that keeps its graph
        (``backward(create_graph=True)``, :attr:`GradHome.KEEPS_GRAPH`; a
        later :meth:`sync_grads` copies it in).

        Args:
            final: backward is over and the buffer is about to be read whole
                (a collective): a gradient that keeps its graph is copied in
                too, and a parameter without a gradient keeps ``grad=None``
                with its slot made exactly zero (:attr:`GradHome.ZEROS`).
            filled: the slot holds a gradient written through the buffer (a
                collective filled in one this process never computed):
                ``param.grad`` becomes the view as it is.

        Example:
            >>> import torch
            >>> from tfuse.flat import FlatParams
            >>> layer = torch.nn.Linear(2, 1)
            >>> flat = FlatParams(layer)
            >>> layer.weight.grad = torch.ones(1, 2)  # set by hand, outside the buffer
            >>> flat.bring_home(layer.weight).name, flat.bring_home(layer.bias).name
            ('IN_BUFFER', 'NONE')
            >>> layer.weight.grad.data_ptr() == flat.grad_view(layer.weight).data_ptr()
            True
            >>> flat.bring_home(layer.bias, final=True).name, layer.bias.grad  # its slot made exactly zero
            ('ZEROS', None)
        """
        home = self._homes.get(id(param))
        if home is None:
            if filled or final:
                self._view(param)  # (raises KeyError naming the problem)
            return GradHome.NO_SLOT
        view, slot = home
        if filled:
            param.grad = view
            self._clean[id(param)] = False
            return GradHome.IN_BUFFER
        grad = param.grad
        if grad is view:
            return GradHome.IN_BUFFER
        if grad is None:
            if not final:
                return GradHome.NONE
            if not self._clean[id(param)]:
                with torch.no_grad():
                    view.zero_()
                self._clean[id(param)] = True
            return GradHome.ZEROS
        if grad.requires_grad and not final:
            return GradHome.KEEPS_GRAPH
        moved = param.data_ptr() != slot.ptr or param.stride() != slot.strides
        if moved and guard.problem(self, param, slot) is not None:
            self._refused = True  # (other strides over the same memory: the pointer check cannot see it)
            raise RuntimeError(guard.message(self, guard.problems(self)))
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            guard.restore_grad_view(self, param, slot, view)
        if grad.is_sparse:
            raise RuntimeError(
                "FlatParams: a coalesced parameter received a sparse gradient; sparse gradients cannot live in a "
                "flat buffer (use dense gradients, e.g. nn.Embedding(..., sparse=False))"
            )
        self._clean[id(param)] = False
        if _same_memory(grad, view):
            return GradHome.IN_BUFFER
        with torch.no_grad():
            view.copy_(grad)
        param.grad = view
        return GradHome.IN_BUFFER

    def note_synchronized(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Tells the FlatParams that gradient slots were written through the buffers, not through ``param.grad``.

        For code that writes whole gradient buffers or buckets (a collective,
        a scaling pass) while some parameters' ``grad`` is None: their slots
        may then hold values, so the next backward that gives such a
        parameter a gradient zeroes its slot first (see docs/architecture.md).
        ``params``: those whose slots were written; None: all.
        :meth:`zero_grad` makes every slot known zero again.
        """
        if params is None:
            self._clean = dict.fromkeys(self._clean, False)
            return
        for param in params:
            if id(param) in self._clean:
                self._clean[id(param)] = False

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The view of the flat gradient buffer that holds ``param``'s gradient (with ``param``'s strides).

        Handing it out counts as writing the slot (see :meth:`note_synchronized`).
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
        the gradient into it (see docs/architecture.md). ``set_to_none=False``
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
        makes the group be laid out again (see ``layout_version``).
        Optimizers call this before a fused step.
        """
        self.check_storage()
        if self._on_meta:
            guard.check_meta(self)
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
        if param.stride() != self._slots[param].strides and guard.problem(self, param, self._slots[param]) is not None:
            raise RuntimeError(guard.message(self, guard.problems(self)))

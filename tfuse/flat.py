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
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Which FlatParams a parameter lives in (a parameter can live in only one).
# Keyed by identity: tensors compare elementwise, so a plain weak dict cannot hold them.
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


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

    Parameters and gradients share one layout: ``params[i]`` lives at
    ``data[offsets[i] : offsets[i] + params[i].numel()]`` and its gradient at
    the same range of ``grad``. Trainable parameters come first, in reverse
    registration order (the order gradients become ready in backward), then
    frozen ones, which have no gradient slot: ``grad`` covers only the first
    ``n_trainable`` parameters. Same offsets let a fused optimizer treat a run
    of parameters, their gradients and their optimizer state as three slices
    of one range.

    Attributes:
        device, dtype: what every parameter of the group has.
        params: trainable parameters (backward order), then frozen ones.
        offsets: element offset of each parameter, aligned.
        data: the flat parameter buffer.
        grad: the flat gradient buffer (None when no parameter is trainable).
        n_trainable: how many of ``params`` have a gradient slot.
    """

    device: torch.device
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    offsets: list[int]
    data: torch.Tensor
    grad: torch.Tensor | None
    n_trainable: int

    @property
    def trainable_numel(self) -> int:
        """Length of the gradient buffer (the trainable prefix of ``data``)."""
        return 0 if self.grad is None else self.grad.numel()


class FlatParams:
    """Parameters and gradients coalesced into a few aligned flat buffers.

    Args:
        params: parameters (e.g. ``model.parameters()``); tied parameters
            appear once, in the order first seen.
        bucket_mb: largest gradient bucket in MB (10**6 bytes); None: no size cap.
            A bucket always holds at least one parameter.
        max_params_per_bucket: most parameters in one bucket; None: no cap.
        align_bytes: every parameter and gradient starts on a multiple of
            this many bytes (256 keeps 128-bit vector loads aligned and suits
            NCCL); a power of two, at least the element size.

    A parameter's gradient sits at the same offset in the gradient buffer as
    the parameter in the parameter buffer (see :class:`FlatGroup`). When the
    set of trainable parameters changes (a layer unfrozen), :meth:`sync_grads`
    lays the group out again: new buffers, ``param.data`` re-homed, values and
    gradients kept, and :attr:`layout_version` incremented so that holders of
    offsets (optimizers) know to follow.

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
        params: Iterable[torch.nn.Parameter],
        bucket_mb: float | None = None,
        max_params_per_bucket: int | None = None,
        align_bytes: int = 256,
    ) -> None:
        unique = _unique_params(params)
        _check_options(bucket_mb, max_params_per_bucket, align_bytes)
        self.bucket_mb = bucket_mb
        self.max_params_per_bucket = max_params_per_bucket
        self.align_bytes = align_bytes
        self.layout_version = 0
        self._registered = unique
        self._groups: list[FlatGroup] = []
        self._hooks: list = []
        self._grad_views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._clean: dict[torch.nn.Parameter, bool] = {}
        self._listeners: list[Callable[[torch.nn.Parameter, bool], None]] = []
        self.fresh_grad_divisor = 1.0
        self.buckets: list[Bucket] = []
        for param in unique:
            _OWNER[param] = self
        self._lay_out()
        logger.info("%s", self.describe())

    # ------------------------------------------------------------------ layout

    def _lay_out(self) -> None:
        """(Re)builds every group's buffers for the parameters that are trainable now.

        Values, existing gradients and the Parameter objects are kept; only
        the storage behind ``param.data`` and ``param.grad`` moves.
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
        for position, (param, offset) in enumerate(zip(ordered, offsets)):
            view = data[offset : offset + param.numel()].view(param.shape)
            with torch.no_grad():
                view.copy_(param.data)
            param.data = view
            if position >= len(trainable):
                continue
            grad_view = grad[offset : offset + param.numel()].view(param.shape)
            previous = param.grad
            if previous is not None:  # keep gradients that exist (from old views or set elsewhere)
                with torch.no_grad():
                    grad_view.copy_(previous)
                param.grad = grad_view
            self._grad_views[param] = grad_view
            self._clean[param] = previous is None
            self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready_hook()))
        return FlatGroup(device, dtype, ordered, offsets, data, grad, len(trainable))

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

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The view of the flat gradient buffer that holds ``param``'s gradient."""
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
        """Brings every gradient back into the flat buffers.

        A gradient set by hand (``param.grad = tensor``) is copied into the
        parameter's view; a parameter unfrozen since coalescing
        (or frozen) since the last layout makes the group be laid out again
        (see :attr:`layout_version`).
        Optimizers call this before a fused step.
        """
        trainable_now = {p for p in self.params if p.requires_grad}
        if trainable_now != set(self._grad_views):
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
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
            self._clean[param] = False

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
        buffers = len(self._groups)
        return (
            f"{len(params)} parameters ({_count(elements)} elements, {_size(nbytes)}) coalesced into "
            f"{buffers} buffer{'s' if buffers != 1 else ''}, {len(self.buckets)} bucket{'s' if len(self.buckets) != 1 else ''}"
        )

    def __repr__(self) -> str:
        return f"FlatParams({self.describe()})"

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self._registered)


def _same_memory(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


def owner_of(param: torch.Tensor) -> FlatParams | None:
    """The FlatParams a parameter was coalesced into, if any."""
    return _OWNER.get(param)


def _unique_params(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "FlatParams: params argument given to FlatParams should be an iterable of Tensors, "
            f"but got {torch.typename(params)}"
        )
    unique: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"FlatParams: parameter {index} is a {type(param).__name__}, not a torch.Tensor")
        if id(param) in seen:
            continue  # tied parameters appear once
        if param.is_sparse or param.layout != torch.strided:
            raise TypeError(f"FlatParams: parameter {index} is sparse ({param.layout}); sparse parameters cannot be coalesced")
        if param.dtype not in _SUPPORTED:
            raise TypeError(
                f"FlatParams: parameter {index} has dtype {param.dtype}; only float16, bfloat16, float32 and "
                "float64 parameters can be coalesced"
            )
        if not param.is_leaf:
            raise ValueError(f"FlatParams: can't coalesce a non-leaf Tensor (parameter {index})")
        owner = _OWNER.get(param)
        if owner is not None:
            raise ValueError(f"FlatParams: parameter {index} already lives in another FlatParams ({owner.describe()})")
        seen.add(id(param))
        unique.append(param)
    if not unique:
        raise ValueError("FlatParams got an empty parameter list")
    return unique


def _check_options(bucket_mb: float | None, max_params_per_bucket: int | None, align_bytes: int) -> None:
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0):
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

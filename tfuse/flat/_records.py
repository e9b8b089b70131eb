"""The plain records of the flat layout: where a parameter, a bucket or a shard lies in the flat buffers.

:class:`ParamRange`, :class:`Bucket`, :class:`Shard` and :class:`FlatGroup`
are what :class:`~tfuse.flat.FlatParams` hands out to say where things are;
``_Slot`` is its own per-parameter cache of the same (with the addresses its
storage check compares). They hold data and compute views; nothing here
changes a buffer.
"""

from __future__ import annotations

import dataclasses

import torch


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
        divisor: what the range is divided by before it is summed over the ranks (a data-parallel
            average: the world size, times the merged backward passes when those are averaged too;
            1: a plain sum). Divided before the sum so that float16/bfloat16 sums stay in range.
    """

    buffer_index: int
    start: int
    end: int
    params: tuple[torch.nn.Parameter, ...]
    grad: torch.Tensor = dataclasses.field(compare=False, repr=False, default=None)  # type: ignore[assignment]
    divisor: float = 1.0

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

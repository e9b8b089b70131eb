"""The storage guard: coalesced parameters whose storage was replaced behind the flat buffers' back.

Code that swaps a parameter's storage (``layer.weight.data = tensor``,
``module.to_empty(device=...)``, ``model.double()``) leaves its flat slot
behind. :func:`check_storage` (:meth:`FlatParams.check_storage` delegates to
it) re-homes each parameter whose new storage can go back into its slot and
raises a RuntimeError naming the others; :func:`problem`, :func:`problems`,
:func:`message` and :func:`restore_grad_view` also serve the gradient path,
which refuses a replaced storage before a gradient lands in its slot.
docs/architecture.md ("Storage replaced behind the buffers' back") says
what happens in each case.

These are functions of a FlatParams, not methods: they read and repair its
private state (``_slots``, ``_groups``, ``_grad_views``, ...), which the
modules of this package share.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from tfuse.flat._checks import _DATA_PTR, _dense_strides, _plural, _same_element_order
from tfuse.flat._records import _Slot

if TYPE_CHECKING:
    from tfuse.flat._flat_params import FlatParams

logger = logging.getLogger(__package__)  # "tfuse.flat": the package logs under one name

_MAX_NAMED = 6  # parameters named in one error message


def check_storage(flat: FlatParams) -> None:
    """Re-homes every parameter and gradient view whose storage was replaced, or raises (changing nothing).

    See :meth:`FlatParams.check_storage`, which is this.
    """
    if list(map(_DATA_PTR, flat._watched)) == flat._ptrs and not flat._refused:
        return
    found = problems(flat)
    if found:
        raise RuntimeError(message(flat, found))
    flat._refused = False
    for param, slot in flat._slots.items():
        if param.data_ptr() != slot.ptr or param.stride() != slot.strides:
            _rehome(flat, param, slot)
    for param, view in flat._grad_views.items():
        slot = flat._slots[param]
        if view.data_ptr() != slot.grad_ptr or view.stride() != slot.strides:
            restore_grad_view(flat, param, slot, view)


def problems(flat: FlatParams) -> list[tuple[str, torch.nn.Parameter, str]]:
    """Every parameter (and gradient view) whose replaced storage cannot be taken back."""
    found = []
    for param in flat._registered:
        slot = flat._slots[param]
        if param.data_ptr() != slot.ptr or param.stride() != slot.strides:
            one = problem(flat, param, slot)
            if one is not None:
                found.append(one)
    flagged = {id(p) for _, p, _ in found}
    for param, view in flat._grad_views.items():
        slot = flat._slots[param]
        if id(param) in flagged or (view.data_ptr() == slot.grad_ptr and view.stride() == slot.strides):
            continue
        group = flat._groups[slot.group]
        if view.device != group.device or view.dtype != group.dtype or tuple(view.shape) != slot.shape:
            found.append(
                (
                    "grad",
                    param,
                    f"has a gradient whose storage was replaced by a "
                    f"{tuple(view.shape)} {view.dtype} tensor on {view.device}",
                )
            )
    return found


def problem(flat: FlatParams, param: torch.nn.Parameter, slot: _Slot) -> tuple[str, torch.nn.Parameter, str] | None:
    """(kind, parameter, what changed) when the parameter's new storage cannot be re-homed, else None."""
    group = flat._groups[slot.group]
    if param.device != group.device:
        return "device", param, f"moved from {group.device} to {param.device}"
    if param.dtype != group.dtype:
        return "dtype", param, f"changed dtype from {group.dtype} to {param.dtype}"
    if tuple(param.shape) != slot.shape:
        return "shape", param, f"changed shape from {slot.shape} to {tuple(param.shape)}"
    if not _same_element_order(slot.shape, _dense_strides(param), slot.strides):
        return "layout", param, f"changed memory layout from strides {slot.strides} to {tuple(param.stride())}"
    other = _param_at(flat, param.data_ptr(), param.element_size())
    if other is not None and other is not param:
        return "alias", param, f"now shares memory with {_label(flat, other)}"
    return None


def check_meta(flat: FlatParams) -> None:
    """Refuses a step over meta parameters none of which has a gradient: they were left behind.

    ``module.to_empty(device=...)`` (and any move off the meta device)
    gives the module *new* Parameter objects, because torch cannot re-home
    a meta parameter in place; the FlatParams and the optimizer keep the
    old ones, so a training step would update nothing, silently (as it
    would with torch.optim).
    """
    for group in flat._groups:
        if group.device.type == "meta" and group.grad is not None and all(p.grad is None for p in group.params):
            one = len(group.params) == 1
            raise RuntimeError(
                f"FlatParams: its {_plural(len(group.params), 'parameter')} {'is' if one else 'are'} still on "
                f"the meta device and {'has no gradient' if one else 'none has a gradient'}. "
                "module.to_empty(device=...) (or any move off the meta device) after creating the FlatParams or "
                "a fused optimizer gives the module new Parameter objects, which they do not hold, so nothing "
                "would be trained. Move or materialize the model first, then create them."
            )


def restore_grad_view(flat: FlatParams, param: torch.nn.Parameter, slot: _Slot, view: torch.Tensor) -> None:
    """Points the gradient view (the same tensor object, which others hold) back at its slot, values kept."""
    group = flat._groups[slot.group]
    values = view.data
    if values.device != group.device or values.dtype != group.dtype or tuple(values.shape) != slot.shape:
        raise RuntimeError(message(flat, problems(flat)))
    view.data = group.slot(group.grad, slot.position)
    with torch.no_grad():
        view.copy_(values)


def message(flat: FlatParams, found: list[tuple[str, torch.nn.Parameter, str]]) -> str:
    """The RuntimeError's text for ``found`` (from :func:`problems`): who, what changed, what to do instead."""
    shown = "; ".join(f"{_label(flat, param)} {what}" for _, param, what in found[:_MAX_NAMED])
    if len(found) > _MAX_NAMED:
        shown += f"; and {len(found) - _MAX_NAMED} more"
    kinds = list(dict.fromkeys(kind for kind, _, _ in found))
    count = _plural(len(found), "parameter")
    return (
        f"FlatParams: the storage of {count} was replaced after {'it was' if len(found) == 1 else 'they were'} "
        f"coalesced into flat buffers, and the flat buffers cannot follow: {shown}. "
        + " ".join(_ADVICE[kind] for kind in kinds)
        + " Nothing was updated: the parameters hold the values they were given."
    )


def _rehome(flat: FlatParams, param: torch.nn.Parameter, slot: _Slot) -> None:
    group = flat._groups[slot.group]
    values = param.data
    param.data = group.slot(group.data, slot.position)
    with torch.no_grad():
        param.copy_(values)  # in place on the parameter: bumps its version, like any write to it
    logger.debug("FlatParams: re-homed %s (its storage had been replaced)", _label(flat, param))


def _param_at(flat: FlatParams, ptr: int, element_size: int) -> torch.nn.Parameter | None:
    """The coalesced parameter whose slot holds address ``ptr``, if any."""
    for group in flat._groups:
        base = group.data.data_ptr()
        if group.data.element_size() != element_size or not base <= ptr < base + group.data.numel() * element_size:
            continue
        position = bisect.bisect_right(group.offsets, (ptr - base) // element_size) - 1
        return group.params[position] if position >= 0 else None
    return None


def _label(flat: FlatParams, param: torch.nn.Parameter) -> str:
    name = flat._names.get(param)
    if name is not None:
        return repr(name)
    index = next(i for i, p in enumerate(flat._registered) if p is param)
    return f"parameter {index} (shape {flat._slots[param].shape})"


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

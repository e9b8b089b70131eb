"""Copies and serialisation: deep copies and pickles of a FlatParams, and compact state dicts.

A deep copy of a FlatParams is a new FlatParams over deep copies of its
parameters, and a pickle stores the parameters and options and coalesces
them again on loading (:func:`deep_copy`, :func:`pickled_state`,
:func:`restore_pickled`, behind FlatParams' ``__deepcopy__``,
``__getstate__`` and ``__setstate__``). A coalesced parameter is a view of a
whole flat buffer, which ``torch.save`` would write whole: views of flat
buffers pickle as their own elements (``_compact_pickle``), and
:func:`register_compact_state_dict` makes ``state_dict()`` entries *deep-copy*
as their own elements too. docs/architecture.md ("Copies and serialisation")
has the whole account.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tfuse.flat._checks import _unique_params

if TYPE_CHECKING:
    from tfuse.flat._flat_params import FlatParams


def deep_copy(flat: FlatParams, memo: dict[int, Any]) -> FlatParams:
    """``copy.deepcopy(flat, memo)``: see :meth:`FlatParams.__deepcopy__`."""
    params = [copy.deepcopy(p, memo) for p in flat._registered]
    new = type(flat).__new__(type(flat))
    memo[id(flat)] = new
    names = {copy_: flat._names[p] for p, copy_ in zip(flat._registered, params) if p in flat._names}
    new._setup(
        _unique_params(params)[0],
        names,
        flat.bucket_mb,
        flat.max_params_per_bucket,
        flat.align_bytes,
        flat._shard_multiple,
    )
    new.layout_version = flat.layout_version + 1
    return new


def pickled_state(flat: FlatParams) -> dict[str, Any]:
    """What a pickle of ``flat`` stores: its (name, parameter) pairs and options."""
    return {
        "params": [(flat._names.get(p), p) for p in flat._registered],
        "bucket_mb": flat.bucket_mb,
        "max_params_per_bucket": flat.max_params_per_bucket,
        "align_bytes": flat.align_bytes,
        "shard_multiple": flat._shard_multiple,
        "layout_version": flat.layout_version,
    }


def restore_pickled(flat: FlatParams, state: dict[str, Any]) -> None:
    """Sets up an unpickled (empty) ``flat`` from :func:`pickled_state`: the parameters coalesced again."""
    names = {p: name for name, p in state["params"] if name is not None}
    params = _unique_params([p for _, p in state["params"]])[0]
    flat._setup(
        params,
        names,
        state["bucket_mb"],
        state["max_params_per_bucket"],
        state["align_bytes"],
        state.get("shard_multiple", 1),
    )
    flat.layout_version = state["layout_version"] + 1


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
    """Makes ``state_dict()`` of ``module`` and of each submodule copy coalesced parameters compactly.

    A coalesced parameter is a view of a flat buffer. Pickling one writes
    only its own elements already (tfuse marks its buffers: see
    docs/architecture.md), but ``copy.deepcopy`` of a tensor copies its whole
    storage, so a deep copy of one layer's state dict would copy the buffer.
    After this call each parameter entry that is a view of a bigger storage
    is an alias of the parameter (as torch's entries are: in-place writes
    reach it) whose deep copy and pickle hold only its own elements (tied
    parameters still share one). Idempotent; the hooks travel with deep
    copies and pickles of the module. ``FlatParams(module)``,
    FusedDataParallel, LocalSGD and ``tfuse.setup`` call it for you; a fused
    optimizer built from ``model.parameters()`` does not know the module:
    call it on the model there if you deep-copy parts of its state dict.

    Example:
        >>> import copy, io, torch
        >>> from tfuse.flat import register_compact_state_dict
        >>> from tfuse.optim import FusedAdam
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        >>> optimizer = FusedAdam(model.parameters())  # coalesces: the parameters are views of one buffer
        >>> register_compact_state_dict(model)
        >>> part = copy.deepcopy(model[0].state_dict())
        >>> part["weight"].untyped_storage().nbytes() == 64 * 64 * 4  # not the whole buffer
        True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_compact_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    for submodule in module.modules():
        if not any(hook is _compact_state_dict_hook for hook in submodule._state_dict_hooks.values()):
            submodule.register_state_dict_post_hook(_compact_state_dict_hook)

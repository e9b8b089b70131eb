"""Pickling a tensor that lives in one of tfuse's flat buffers writes only that tensor's elements.

Coalescing makes every parameter (and its gradient, and each optimizer
state) a view of a flat buffer, and torch serialises a view with its whole
storage: ``torch.save(model[0].state_dict())``, ``torch.save(param)`` or
``pickle.dumps(layer)`` would write every tensor of the buffer. So:

* every storage tfuse allocates to coalesce tensors is *marked*
  (:func:`mark_compact`: an attribute on the storage's Python object, which
  torch keeps for as long as the storage lives; copies and loaded tensors
  get new, unmarked storages);
* a reducer for plain ``torch.Tensor`` in ``copyreg``'s dispatch table,
  installed on the first mark, turns a tensor on a marked storage that
  covers less than that storage into a tensor on a storage slice spanning
  exactly its own elements (no copy) and reduces that instead. pickle and
  ``torch.save``'s pickler consult the dispatch table before a type's own
  ``__reduce_ex__``; a ``Parameter`` reduces to its ``.data``, a plain
  tensor, so parameters follow; entries of one tied parameter share one
  slice, so they are written once.

Every other tensor reduces exactly as before (its own ``__reduce_ex__``, or
the reducer that was registered before tfuse's), tensor subclasses are not
concerned (the table is looked up by exact type), and a tensor that requires
grad keeps torch's behaviour. ``torch.multiprocessing`` and Inductor's
caches pickle with their own reducers for tensors, which take precedence.

The result loads with ``torch.load(..., weights_only=True)`` as plain
tensors (their storages are their own elements), into any model.
"""

from __future__ import annotations

import copyreg
import logging
from typing import Any

import torch

from tfuse.flat._copies import _own_storage_alias

logger = logging.getLogger(__name__)

#: The storage attribute that marks a flat buffer's storage.
_MARK = "_tfuse_compact_pickle"
#: Tensor.__reduce_ex__ ignores the protocol; torch.save's default is passed for form's sake.
_PROTOCOL = 2
_installed = False
_previous: Any = None


def mark_compact(*buffers: torch.Tensor | None) -> None:
    """Marks the storages of ``buffers`` (flat buffers tfuse allocated): their views pickle compactly.

    Example:
        >>> import io, torch
        >>> from tfuse.flat._compact_pickle import mark_compact
        >>> def saved_bytes(tensor):
        ...     out = io.BytesIO()
        ...     torch.save(tensor, out)
        ...     return len(out.getvalue())
        >>> buffer = torch.zeros(1000)
        >>> mark_compact(buffer)
        >>> saved_bytes(buffer[:10]) == saved_bytes(torch.zeros(10))  # 10 elements written, not 1000
        True
    """
    for buffer in buffers:
        if buffer is not None and buffer.device.type != "meta":
            setattr(buffer.untyped_storage(), _MARK, True)
    _install()


def is_marked(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a storage tfuse marked."""
    try:
        return bool(getattr(tensor.untyped_storage(), _MARK, False))
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, functional: no plain storage
        return False


def _install() -> None:
    global _installed, _previous
    if _installed:
        return
    _previous = copyreg.dispatch_table.get(torch.Tensor)
    copyreg.dispatch_table[torch.Tensor] = _reduce_tensor
    _installed = True
    logger.debug("tfuse: views of flat buffers now pickle their own elements only")


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """copyreg's reducer for plain tensors: a view of a marked storage as its own elements, others as before."""
    if tensor.layout is torch.strided and not tensor.requires_grad and is_marked(tensor):
        alias = _compact_alias(tensor)
        if alias is not tensor:
            return alias.__reduce_ex__(_PROTOCOL)
    if _previous is not None:
        return _previous(tensor)
    return tensor.__reduce_ex__(_PROTOCOL)


def _compact_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage of its own elements (a zero-copy slice; an empty one for an empty tensor)."""
    if tensor.numel() == 0:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return _own_storage_alias(tensor)

"""Which FlatParams holds a parameter: read from the parameter's memory, with no registry.

Coalescing marks each flat buffer's storage with a weak reference to its
FlatParams (under ``_HOME_ATTR``); :func:`flat_params_of` reads it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tfuse.flat._flat_params import FlatParams

# A flat buffer's storage carries a weak reference to its FlatParams under this attribute (torch keeps one
# Python object per storage alive as long as the storage lives, so the attribute stays). That is how a
# parameter leads to the FlatParams holding it (see flat_params_of) without any registry: nothing global,
# nothing kept alive, and copies (deepcopy, torch.save/load) get new storages without it.
_HOME_ATTR = "_tfuse_flat_params"


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

"""Coalesced flat storage for parameters and their gradients.

:class:`FlatParams` lays the parameters of each (device, dtype) group out in
one contiguous buffer, every parameter starting on an aligned offset, and
re-homes each ``param.data`` as a view into it (values unchanged, the
Parameter objects the same, so modules and optimizers keep working). Each
trainable parameter's gradient is a view into a matching flat gradient
buffer, which autograd accumulates into in place: nothing is copied. One
kernel can then update a whole buffer and one all-reduce move a whole
bucket.

The layout is stated once, by the FlatParams (:meth:`FlatParams.range_of`,
``FlatParams.buckets``, :meth:`FlatParams.shards`), and read by everyone
who works on the buffers (optimizers, clipping, the all-reduce, sharding,
averaging), who are handed the FlatParams explicitly; :func:`flat_params_of`
serves set-up code that is handed plain parameters.

docs/architecture.md is the reference: the layout and memory formats ("The
flat layout"), how gradients come to live in the buffers and why ("How a
gradient reaches its bucket"), parameters whose storage is replaced
("Storage replaced behind the buffers' back"), and copies and serialisation
("Copies and serialisation").

Inside: ``_flat_params`` (FlatParams: the layout, and its statement),
``_grad_path`` (its gradient methods), ``_storage_guard`` (replaced
storage), ``_copies`` (deep copies, pickles, compact state dicts), ``_compact_pickle``
(views of flat buffers pickle as their own elements),
``_records`` (ParamRange, Bucket, Shard, FlatGroup), ``_checks`` (argument
checks, shared helpers) and ``_home`` (:func:`flat_params_of`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch  # noqa: F401  (the records' string annotations name torch: typing.get_type_hints resolves them here)

from tfuse.flat._compact_pickle import mark_compact
from tfuse.flat._copies import _compact_state_dict_hook, register_compact_state_dict
from tfuse.flat._flat_params import FlatParams
from tfuse.flat._grad_path import GradHome
from tfuse.flat._home import flat_params_of
from tfuse.flat._records import Bucket, FlatGroup, ParamRange, Shard

logger = logging.getLogger(__name__)  # the one logger of the package's modules (they name the package)

__all__ = [
    "Bucket",
    "FlatGroup",
    "FlatParams",
    "GradHome",
    "ParamRange",
    "Shard",
    "flat_params_of",
    "mark_compact",
    "register_compact_state_dict",
]


def _publish(*objects: Any) -> None:
    """Makes ``tfuse.flat`` each object's module, whichever private module defines it.

    Pickles name a class or function by its ``__module__``: ``torch.save``
    of a FlatParams, of a record, or of a module whose state-dict hook is
    ``_compact_state_dict_hook`` then keeps writing ``tfuse.flat.<name>``
    (what it wrote before the package was split, and an address that stays
    when the private modules change). help() and doctest find them here too;
    a class's own functions follow it, because doctest skips methods whose
    module is not the one it searches.
    """
    for obj in objects:
        obj.__module__ = __name__
        for member in vars(obj).values() if inspect.isclass(obj) else ():
            if inspect.isfunction(member):
                member.__module__ = __name__


_publish(
    FlatParams,
    ParamRange,
    Bucket,
    Shard,
    FlatGroup,
    flat_params_of,
    mark_compact,
    register_compact_state_dict,
    _compact_state_dict_hook,
)

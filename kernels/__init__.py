"""Triton kernels of tfuse, installed as ``tfuse.kernels``.

Only ``@triton.jit`` code lives here: one kernel family per module, no imports
of tfuse. Launchers in :mod:`tfuse.ops` check inputs, allocate outputs, pick
the grid and launch these kernels.

Importing this package imports no Triton: :mod:`codes` (the integer codes the
launchers pass) is plain Python, and the kernel modules and kernels
(``kernels.add_act``, ``kernels._adam_kernel``, ...) are imported on first
use, which only the Triton backend makes. tfuse therefore imports, and its
PyTorch path runs, where Triton is not installed.
"""

import importlib
from typing import Any

from . import codes  # noqa: F401

#: Kernel modules, imported on first attribute access.
_MODULES = (
    "activations",
    "add",
    "add_act",
    "batch_norm",
    "bn_merge",
    "cast",
    "depthwise",
    "kit",
    "muon",
    "norm",
    "norm_act",
    "optim",
    "tiles",
    "trust",
)
#: Kernels by name -> their module (``kernels._add_fwd_kernel`` and so on).
_KERNELS = {
    "_add_fwd_kernel": "add",
    "_add_act_bwd_kernel": "add_act",
    "_add_act_fwd_kernel": "add_act",
    "_sum_partials_kernel": "add_act",
    "_bn_act_bwd_dx_kernel": "batch_norm",
    "_bn_act_bwd_reduce_kernel": "batch_norm",
    "_bn_act_fwd_kernel": "batch_norm",
    "_bn_stats_partial_kernel": "batch_norm",
    "_dw_bwd_dw_partial_kernel": "depthwise",
    "_dw_bwd_dx_kernel": "depthwise",
    "_dw_fwd_kernel": "depthwise",
    "_clip_segments_kernel": "norm",
    "_norm_final_kernel": "norm",
    "_norm_partial_kernel": "norm",
    "_na_stats_kernel": "norm_act",
    "_na_fwd_kernel": "norm_act",
    "_na_bwd_kernel": "norm_act",
    "_na_bwd_dx_kernel": "norm_act",
    "_adam_kernel": "optim",
    "_sgd_kernel": "optim",
    "_lion_kernel": "optim",
    "_adagrad_kernel": "optim",
    "_lamb_moments_kernel": "trust",
    "_trust_ratio_kernel": "trust",
    "_lamb_update_kernel": "trust",
    "_lars_norms_kernel": "trust",
    "_lars_update_kernel": "trust",
    "_muon_momentum_kernel": "muon",
    "_muon_apply_kernel": "muon",
}
#: The tile modes, re-exported from kernels/tiles.py as ``tl.constexpr``.
_TILE_MODES = ("COL", "LINEAR", "ROW", "SCALAR", "STRIDED")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _KERNELS.get(name) or ("tiles" if name in _TILE_MODES else None)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads (launches read kernels on every call)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES, *_KERNELS, *_TILE_MODES})

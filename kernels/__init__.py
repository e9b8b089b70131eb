"""Triton kernels of tfuse, installed as ``tfuse.kernels``.

Only ``@triton.jit`` code lives here: one kernel family per module, no imports
of tfuse. Launchers in :mod:`tfuse.ops` check inputs, allocate outputs, pick
the grid and launch these kernels.
"""

from .add import (  # noqa: F401
    COL,
    LINEAR,
    ROW,
    SCALAR,
    STRIDED,
    _add_fwd_kernel,
)

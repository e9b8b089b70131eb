"""Triton kernels of tfuse, installed as ``tfuse.kernels``.

Only ``@triton.jit`` code lives here: one kernel family per module, no imports
of tfuse. Launchers in :mod:`tfuse.ops` check inputs, allocate outputs, pick
the grid and launch these kernels.
"""

from . import activations  # noqa: F401
from .add import _add_fwd_kernel  # noqa: F401
from .add_act import _add_act_bwd_kernel, _add_act_fwd_kernel, _sum_partials_kernel  # noqa: F401
from .batch_norm import (  # noqa: F401
    _bn_act_bwd_dx_kernel,
    _bn_act_bwd_reduce_kernel,
    _bn_act_fwd_kernel,
    _bn_bwd_final_kernel,
    _bn_stats_final_kernel,
    _bn_stats_partial_kernel,
)
from .norm import _clip_segments_kernel, _norm_final_kernel, _norm_partial_kernel  # noqa: F401
from .optim import _adam_kernel, _sgd_kernel  # noqa: F401
from .tiles import COL, LINEAR, ROW, SCALAR, STRIDED  # noqa: F401

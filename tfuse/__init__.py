"""tfuse: fused training operations for PyTorch, written in Triton.

Example:
    >>> import torch, tfuse
    >>> a, b, c = torch.randn(3, 1000).unbind()
    >>> torch.allclose(tfuse.add(a, b, c), a + b + c)
    True
"""

import os as _os

from tfuse._source_tree import ensure_kernels_importable

ensure_kernels_importable()

from tfuse import distributed, flat, functional, kernels, nn, optim  # noqa: E402
from tfuse._backend import BACKEND_ENV_VAR, Backend, interpreter_active, select_backend, use_backend  # noqa: E402
from tfuse._launch import LaunchCount, count_launches  # noqa: E402
from tfuse.capture import capture_step  # noqa: E402
from tfuse.functional import add, add_act  # noqa: E402
from tfuse.fusion import FusionReport, FusionStrategy, Setup, fuse_model, setup, tune_buckets  # noqa: E402

__version__ = "0.1.0"

# torch.library registration of tfuse's ops imports Inductor: done when torch._dynamo loads (torch.compile).
from tfuse.ops import register_when_dynamo_loads  # noqa: E402

register_when_dynamo_loads()

# CPU kernels through Triton's interpreter: without its redundant re-patching. Triton reads TRITON_INTERPRET when
# the kernels are decorated; without it, neither triton nor the kernels are imported here (import time).
if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and interpreter_active():
    from tfuse._interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()

__all__ = [
    "BACKEND_ENV_VAR",
    "Backend",
    "FusionReport",
    "FusionStrategy",
    "LaunchCount",
    "Setup",
    "add",
    "add_act",
    "capture_step",
    "count_launches",
    "distributed",
    "flat",
    "functional",
    "fuse_model",
    "interpreter_active",
    "kernels",
    "nn",
    "optim",
    "select_backend",
    "setup",
    "tune_buckets",
    "use_backend",
]

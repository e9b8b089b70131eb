"""Launchers and autograd Functions: check inputs, allocate, pick the backend, launch.

One module per op family (``tfuse.ops.add``, ...); the public entry points are
re-exported by :mod:`tfuse.functional`, not here, so that module names and
function names never shadow each other.
"""

from tfuse.ops._activations import DEFAULT_NEGATIVE_SLOPE, Activation, GradSource, check_activation
from tfuse.ops._library import register_library, register_when_dynamo_loads

__all__ = [
    "DEFAULT_NEGATIVE_SLOPE",
    "Activation",
    "GradSource",
    "check_activation",
    "register_library",
    "register_when_dynamo_loads",
]

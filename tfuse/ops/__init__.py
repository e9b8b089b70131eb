"""Launchers and autograd Functions: check inputs, allocate, pick the backend, launch.

One module per op family (``tfuse.ops.add``, ...); the public entry points are
re-exported by :mod:`tfuse.functional`, not here, so that module names and
function names never shadow each other.
"""

from tfuse.ops._library import register_library

__all__ = ["register_library"]

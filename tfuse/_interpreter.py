"""Triton's interpreter, without its re-patching of ``triton.language`` on every helper call.

To run a kernel on the CPU, the interpreter swaps ``triton.language``'s
builtins for NumPy versions (``_patch_lang``) around the grid, and then again
at every call of a nested ``@triton.jit`` helper, although the swap of the
grid is still in place (the helper finds nothing left to swap, after about a
millisecond of ``inspect.getmembers``). tfuse's kernels call small helpers a
dozen times a program: that re-patching was two thirds of an interpreted
launch (26 s of a 41 s benchmark run, measured with cProfile). While a grid's
swap is in place, a helper's is skipped here; the grid's is made and undone
exactly as Triton does. Values are unchanged: only the redundant work goes.

Installed by :func:`install` (tfuse calls it when its kernels are
interpreted); a Triton without these internals is left as it is.

Example:
    >>> from tfuse._interpreter import install
    >>> install() in (True, False)
    True
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger(__name__)
_installed = False


class _KeptScope:
    """What a skipped patch returns: nothing to undo (the grid's own scope undoes the swap)."""

    def restore(self) -> None:
        return None


def install() -> bool:
    """Makes nested helper calls reuse the enclosing grid's patch; returns whether it is installed."""
    global _installed
    if _installed:
        return True
    try:
        import triton.runtime.interpreter as interpreter

        real_patch = interpreter._patch_lang
        if not callable(real_patch) or not hasattr(interpreter, "GridExecutor"):
            return False
    except (ImportError, AttributeError):
        return False
    import inspect

    language = (interpreter.tl, interpreter.tl.core)
    real_call = interpreter.GridExecutor.__call__
    grid: dict[str, Any] = {"running": False, "swapped": None}  # the grid running now, and what it swapped

    def languages(fn: Any) -> set[int]:  # what Triton's _patch_lang swaps for fn: the language modules it sees
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in language}

    def run_grid(self: Any, *args: Any, **kwargs: Any) -> Any:
        grid["running"], grid["swapped"] = True, None
        try:
            return real_call(self, *args, **kwargs)
        finally:
            grid["running"], grid["swapped"] = False, None

    def patch_lang(fn: Any) -> Any:
        if not grid["running"]:
            return real_patch(fn)
        used = languages(fn)
        if grid["swapped"] is None:  # the grid's own swap, undone by the grid as Triton does
            grid["swapped"] = used
            return real_patch(fn)
        if used <= grid["swapped"]:
            return _KeptScope()  # a helper of this grid: what it uses is swapped already
        grid["swapped"] = grid["swapped"] | used
        return real_patch(fn)

    interpreter.GridExecutor.__call__ = run_grid
    interpreter._patch_lang = patch_lang
    _installed = True
    _log.debug("tfuse: Triton's interpreter reuses a grid's patch of triton.language in nested helper calls")
    return True

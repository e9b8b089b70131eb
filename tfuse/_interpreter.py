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

The interpreter also sanitizes every int32 add, sub and mul: it casts both
operands to int64, computes the op again, compares the result with the int32
range and hands that to ``device_assert``, which drops it unless the builder
runs with ``debug`` on; the interpreter's never does. That discarded work was
up to half of an interpreted launch. :func:`skip_unasserted_overflow_checks`
skips it while ``debug`` is off, as ``device_assert`` itself would: nothing
that was checked goes unchecked, and no value changes.

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


def skip_unasserted_overflow_checks() -> bool:
    """Skips the interpreter's int32 overflow check while ``debug`` is off (module docstring); returns whether it
    is installed. Only where ``device_assert``, the check's one reader, itself returns when debug is off."""
    import inspect

    try:
        from triton.language.semantic import TritonSemantic

        real = TritonSemantic.binary_op_sanitize_overflow_impl
        source = inspect.getsource(TritonSemantic.device_assert)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(real, "__wrapped__", None) is not None:
        return True  # installed already
    if "if not self.builder.options.debug" not in source:
        return False

    def sanitize(self: Any, lhs: Any, rhs: Any, binary_op: Any) -> Any:
        if not getattr(self.builder.options, "debug", True):
            return None
        return real(self, lhs, rhs, binary_op)

    sanitize.__wrapped__ = real  # type: ignore[attr-defined]
    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize
    return True


def install() -> bool:
    """Makes nested helper calls reuse the enclosing grid's patch, and skips the unasserted int32 overflow checks;
    returns whether the first is installed."""
    global _installed
    if _installed:
        return True
    skip_unasserted_overflow_checks()
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

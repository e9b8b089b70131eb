"""Decorators for tfuse's host-side code that must run eagerly inside ``torch.compile``'d code.

``torch.compiler.disable`` imports ``torch._dynamo`` (and with it Inductor and
sympy, about 2,000 modules: seconds) when it decorates, so used on a class
method it made ``import tfuse`` take twice ``import torch``. torch.optim uses
``torch._disable_dynamo`` instead, which imports dynamo at the first call; so
does tfuse, with ``torch.compiler.disable`` where a torch lacks it.

Example:
    >>> import sys, torch
    >>> from tfuse._eager import eager_in_compiled_code
    >>> @eager_in_compiled_code
    ... def bookkeeping(x):
    ...     return x + 1
    >>> bookkeeping(1)
    2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

eager_in_compiled_code: Callable[[Callable[..., Any]], Callable[..., Any]] = (
    getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
)


def never_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks ``fn`` so that dynamo never traces it, nor anything it calls, at no cost per call.

    For autograd hooks on the hot path (one call per parameter per backward):
    ``eager_in_compiled_code``'s wrapper costs several microseconds per call
    there (measured ~10 us in backward on a shared 2-core CPU), while a hook
    left unmarked would be traced by dynamo when backward runs inside
    compiled code. This sets the execution strategy of ``fn``'s code object
    (shared by every closure made from the same ``def``) to skip the frame
    and every frame it calls, which is what ``torch.compiler.disable`` does
    per call. Returns ``fn`` itself; on a torch without that interface,
    ``fn`` wrapped by :data:`eager_in_compiled_code`.

    Example:
        >>> from tfuse._eager import never_traced
        >>> @never_traced
        ... def hook(grad):
        ...     return None
        >>> hook(1) is None
        True
    """
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy = getattr(frames, "_FrameExecStrategy", None)
    action = getattr(frames, "_FrameAction", None)
    if strategy is None or action is None or not hasattr(frames, "set_code_exec_strategy"):
        return eager_in_compiled_code(fn)
    frames.set_code_exec_strategy(fn.__code__, strategy(action.SKIP, action.SKIP))
    return fn

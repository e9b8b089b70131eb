"""A decorator for tfuse's host-side code that must run eagerly inside ``torch.compile``'d code.

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

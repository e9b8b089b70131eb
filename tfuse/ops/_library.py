"""What tfuse's ``torch.library`` operators share: which backend a traced call takes, dtype codes.

tfuse's ops are registered with ``torch.library.triton_op`` (namespace
``tfuse``: ``torch.ops.tfuse.add``, ``torch.ops.tfuse.add_act``, ...), each
with its fake implementation and its autograd formula, when ``torch._dynamo``
is first imported (see :func:`register_library`: registering imports Inductor). An op's body is the
same code on every path:

* eager, real tensors: the backend chosen by tfuse's rules (Triton kernels on
  CUDA and under the interpreter, the PyTorch path otherwise);
* traced (``torch.compile``, ``make_fx``, ``torch.library.opcheck``), fake
  tensors: the PyTorch path, on every device, which Inductor compiles into
  its own fused code. Not the Triton kernels, yet: Triton's interpreter
  cannot run on fake tensors (CPU), and on CUDA several kernels write
  through tuple arguments (the add_act backward's partial sums, for one),
  whose writes ``torch.library.wrap_triton``'s functionalization does not
  track (it follows top-level tensor arguments only), so Inductor could
  reorder or reuse those buffers. Handing the kernels to Inductor needs
  those arguments flattened and a GPU to verify it.

The public functions (``tfuse.add_act``, the nn modules) call these ops when
``torch.compile`` traces them, and their autograd Functions in eager mode:
the same kernels either way, without the dispatcher's host overhead
(about 0.1 ms per call measured on a 2-core CPU) on the eager path.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterable

import torch

from tfuse._backend import Backend, select_backend, triton_available

#: dtypes by the small integer codes op schemas carry them as (schemas have no list of dtypes).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """The code of ``dtype`` in :data:`DTYPES`."""
    return DTYPES.index(dtype)


def is_traced(tensor: torch.Tensor | None) -> bool:
    """True for a fake tensor (or a functional wrapper of one): the op is being traced, not run."""
    if tensor is None:
        return False
    return torch._subclasses.fake_tensor.is_fake(tensor)


def op_backend(device: torch.device, op: str, probe: torch.Tensor, elements: int | None = None) -> Backend:
    """The backend an op body takes for tensors like ``probe`` on ``device`` (``elements``: the op's size).

    tfuse's rules (:func:`tfuse.select_backend`, with the size rule on
    ``elements``, ``probe``'s by default) for real tensors; the PyTorch path
    for a traced call (see the module docstring).
    """
    backend = select_backend(device, op, probe.numel() if elements is None else elements)
    if backend is Backend.TRITON and is_traced(probe):
        return Backend.TORCH
    return backend


def compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) traces the caller: public functions then call the ops."""
    return torch.compiler.is_compiling()


class _PendingOp:
    """An op waiting for its registration with torch.library (see :func:`register_library`)."""

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]) -> None:
        self.name, self.fn, self.mutates_args = name, fn, tuple(mutates_args)
        self.autograd: tuple[Callable, Callable] | None = None
        self.op: torch.library.CustomOpDef | None = None

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """Recorded now, registered with the op."""
        self.autograd = (backward, setup_context)
        if self.op is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

    def register(self) -> None:
        if self.op is not None:
            return
        if triton_available():
            op = torch.library.triton_op(self.name, mutates_args=self.mutates_args)(self.fn)
        else:
            op = torch.library.custom_op(self.name, mutates_args=self.mutates_args)(self.fn)
            op.register_fake(self.fn)
        if self.autograd is not None:
            op.register_autograd(self.autograd[0], setup_context=self.autograd[1])
        self.op = op

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.fn(*args, **kwargs)


_PENDING: list[_PendingOp] = []


def tfuse_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable], _PendingOp]:
    """Declares a function as the op ``name`` (``tfuse::...``), registered by :func:`register_library`:
    ``torch.library.triton_op`` where Triton is installed; without Triton, ``torch.library.custom_op`` with
    the function as its fake implementation too (the body then only ever takes the PyTorch path, and
    triton_op would warn that Triton is missing)."""

    def declare(fn: Callable) -> _PendingOp:
        pending = _PendingOp(name, fn, mutates_args)
        _PENDING.append(pending)
        return pending

    return declare


def register_library() -> None:
    """Registers tfuse's ops with torch.library (``torch.ops.tfuse.*``), once.

    Registering a ``triton_op`` imports Inductor (seconds on a small CPU), which
    a program that never compiles should not pay at ``import tfuse``. So tfuse
    registers its ops when ``torch._dynamo`` is first imported, which
    ``torch.compile`` (and torch.optim's first step) does anyway; this function
    registers them at once, for code that calls ``torch.ops.tfuse.*`` first.

    Example:
        >>> import torch, tfuse
        >>> tfuse.ops.register_library()
        >>> torch.ops.tfuse.add([torch.ones(2), torch.ones(2)])
        tensor([2., 2.])
    """
    # Registering imports torch._dynamo, whose import hook (below) registers every op: import it first, so
    # that the hook's registration is the one that happens (not a second one nested inside this loop's).
    import torch._dynamo  # noqa: F401

    for pending in _PENDING:
        pending.register()


class _RegisterAfterDynamo(importlib.abc.MetaPathFinder):
    """Registers tfuse's ops right after ``torch._dynamo`` is imported (by torch.compile, or anyone)."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # once; the spec is found by the finders after this one
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            register_library()

        loader.exec_module = exec_module
        return spec


def register_when_dynamo_loads() -> None:
    """Registers the ops now if ``torch._dynamo`` is loaded, else right after it is (see :func:`register_library`)."""
    if "torch._dynamo" in sys.modules:
        register_library()
    else:
        sys.meta_path.insert(0, _RegisterAfterDynamo())

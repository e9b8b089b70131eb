"""What tfuse's ``torch.library`` operators share: which backend a traced call takes, dtype codes.

tfuse's ops are registered with ``torch.library.triton_op`` (namespace
``tfuse``: ``torch.ops.tfuse.add``, ``torch.ops.tfuse.add_act``, ...), each
with its fake implementation and its autograd formula. An op's body is the
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


def op_backend(device: torch.device, op: str, probe: torch.Tensor) -> Backend:
    """The backend an op body takes for tensors like ``probe`` on ``device``.

    tfuse's rules (:func:`tfuse.select_backend`) for real tensors; the
    PyTorch path for a traced call (see the module docstring).
    """
    backend = select_backend(device, op)
    if backend is Backend.TRITON and is_traced(probe):
        return Backend.TORCH
    return backend


def compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) traces the caller: public functions then call the ops."""
    return torch.compiler.is_compiling()


def tfuse_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Registers a function as the op ``name`` (``tfuse::...``): ``torch.library.triton_op`` where Triton
    is installed; without Triton, ``torch.library.custom_op`` with the function as its fake implementation
    too (the body then only ever takes the PyTorch path, and triton_op would warn that Triton is missing)."""

    def register(fn: Callable) -> torch.library.CustomOpDef:
        if triton_available():
            return torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.register_fake(fn)
        return op

    return register

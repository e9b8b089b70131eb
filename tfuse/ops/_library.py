"""What tfuse's ``torch.library`` operators share: which backend a traced call takes, dtype codes.

tfuse's ops are registered with ``torch.library.triton_op`` (namespace
``tfuse``: ``torch.ops.tfuse.add``, ``torch.ops.tfuse.add_act``, ...). An
op's body is the same code on every path:

* eager, real tensors: the backend chosen by tfuse's rules (Triton kernels on
  CUDA and under the interpreter, the PyTorch path otherwise);
* traced (``torch.compile``, ``make_fx``, ``torch.library.opcheck``), fake
  tensors: on CUDA the kernels, which ``torch.library.wrap_triton`` (in
  :func:`tfuse._launch.launch`) records in the graph for Inductor; on CPU the
  PyTorch path, which Inductor compiles to C++ (the interpreter cannot run
  on fake tensors, and Inductor does not run Triton on CPU).

The public functions (``tfuse.add_act``, the nn modules) call these ops when
``torch.compile`` traces them, and their autograd Functions in eager mode:
the same kernels either way, without the dispatcher's host overhead
(tens of microseconds per call) on the eager path.
"""

from __future__ import annotations

import torch

from tfuse._backend import Backend, select_backend

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

    tfuse's rules (:func:`tfuse.select_backend`), except that a traced call on
    the CPU takes the PyTorch path: that is what Inductor compiles there.
    """
    backend = select_backend(device, op)
    if backend is Backend.TRITON and device.type != "cuda" and is_traced(probe):
        return Backend.TORCH
    return backend


def compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) traces the caller: public functions then call the ops."""
    return torch.compiler.is_compiling()

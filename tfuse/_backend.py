"""Which implementation of an op runs: the Triton kernel or the PyTorch path.

Rules, checked on every call (so a test or a script may change them at will):

* ``tfuse.use_backend(name)`` inside a ``with`` block wins over everything.
* Otherwise the environment variable ``TFUSE_BACKEND``: ``triton`` forces the
  kernels, ``torch`` forces the PyTorch path, ``auto`` or unset chooses.
* ``auto``: the Triton kernels for CUDA tensors, and for CPU tensors when
  Triton's interpreter is on (``TRITON_INTERPRET=1`` set before triton was
  imported); the PyTorch path for every other case, and everywhere when
  Triton is not installed (macOS, Windows, images without it).
* Size (``auto`` on CUDA only): an op whose tensors hold fewer elements than
  ``small_op_elements()`` (``TFUSE_SMALL_OP_ELEMENTS``, default
  32768: 64 KiB of bf16) is served by the PyTorch path. At that size every
  kernel is latency-bound (a few microseconds whatever it does), so fusing
  saves no device time, while each of tfuse's launches costs host time; eager
  torch's single cuDNN/ATen call is the cheaper one. Each (op, size class) is
  logged once at INFO and recorded in :func:`size_dispatch`, so a benchmark
  can report which shapes took which path. ``TFUSE_BACKEND=triton`` (or
  ``use_backend("triton")``) runs the kernels at every size;
  ``TFUSE_SMALL_OP_ELEMENTS=0`` turns the rule off. CPU behaviour does not
  depend on size.

A request that cannot be served is an error, never a silent switch.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import logging
import os
from collections.abc import Iterator

import torch

from tfuse import _launch

_log = logging.getLogger("tfuse")

BACKEND_ENV_VAR = "TFUSE_BACKEND"
SMALL_OP_ENV_VAR = "TFUSE_SMALL_OP_ELEMENTS"
#: The default of ``small_op_elements()``: a starting rule (see the module docstring), to be re-measured on GPUs.
SMALL_OP_ELEMENTS = 32768


class Backend(str, enum.Enum):
    """An implementation of a tfuse op."""

    TRITON = "triton"
    TORCH = "torch"


_CHOICES = ("auto", Backend.TRITON.value, Backend.TORCH.value)
_override: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("tfuse_backend_override", default=None)


@functools.lru_cache(maxsize=64)
def _parse(value: str, source: str) -> Backend | None:
    """Turns ``auto``/``triton``/``torch`` into a Backend (None for auto)."""
    name = value.strip().lower()
    if name in ("", "auto"):
        return None
    if name in (Backend.TRITON.value, Backend.TORCH.value):
        return Backend(name)
    raise ValueError(f"{source}={value!r} is not a tfuse backend; expected one of {', '.join(_CHOICES)}")


def requested_backend() -> Backend | None:
    """The backend forced by ``use_backend`` or ``TFUSE_BACKEND``; None means auto."""
    forced = _override.get()
    if forced is not None:
        return forced
    return _parse(os.environ.get(BACKEND_ENV_VAR, ""), BACKEND_ENV_VAR)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Forces a backend inside a ``with`` block (takes precedence over TFUSE_BACKEND).

    Example:
        >>> import torch, tfuse
        >>> with tfuse.use_backend("torch"):
        ...     out = tfuse.add(torch.ones(3), torch.ones(3))
        >>> out.tolist()
        [2.0, 2.0, 2.0]
    """
    backend = _parse(name, "use_backend")
    token = _override.set(backend)
    try:
        yield
    finally:
        _override.reset(token)


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported here (it is a dependency on Linux only; tfuse runs without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def interpreter_active() -> bool:
    """True when tfuse's kernels were built for Triton's interpreter.

    Triton decides at decoration time (when ``tfuse.kernels`` is imported)
    whether a ``@triton.jit`` function is compiled or interpreted, so the
    kernel objects themselves are the source of truth, not the environment;
    the answer cannot change afterwards and is cached.
    """
    if not triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from tfuse import kernels

    return isinstance(kernels._add_fwd_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=16)
def _parse_elements(value: str) -> int:
    try:
        elements = int(value.strip() or SMALL_OP_ELEMENTS)
    except ValueError:
        elements = -1
    if elements < 0:
        raise ValueError(f"{SMALL_OP_ENV_VAR}={value!r} must be a number of elements >= 0 (0 turns the rule off)")
    return elements


def small_op_elements() -> int:
    """Below how many elements an op on CUDA tensors takes the PyTorch path in ``auto`` mode (0: never).

    ``TFUSE_SMALL_OP_ELEMENTS`` when set, else :data:`SMALL_OP_ELEMENTS`.
    """
    return _parse_elements(os.environ.get(SMALL_OP_ENV_VAR, ""))


#: (op, size class) -> the backend chosen by the size rule; see :func:`size_dispatch`.
_size_choices: dict[tuple[str, int], Backend] = {}


def size_dispatch() -> dict[tuple[str, int], str]:
    """Which path the size rule sent each (op, size class) to so far: ``{(op, 2**k): "torch"|"triton"}``.

    A size class ``2**k`` holds the calls with ``2**k <= elements < 2**(k+1)``.
    """
    return {key: backend.value for key, backend in sorted(_size_choices.items())}


def _by_size(op: str, elements: int) -> Backend:
    """The size rule for an op on CUDA tensors in auto mode; logs each (op, size class) once."""
    threshold = small_op_elements()
    backend = Backend.TORCH if elements < threshold else Backend.TRITON
    key = (op, 1 << max(elements, 1).bit_length() - 1)
    if key not in _size_choices:
        _size_choices[key] = backend
        if backend is Backend.TORCH:
            _log.info(
                "tfuse.%s: PyTorch path for CUDA tensors of %d to %d elements (fewer than %s=%d; "
                "%s=triton runs the kernels at every size)",
                op,
                key[1],
                2 * key[1] - 1,
                SMALL_OP_ENV_VAR,
                threshold,
                BACKEND_ENV_VAR,
            )
    return backend


def select_backend(device: torch.device, op: str, elements: int | None = None) -> Backend:
    """The backend that runs ``op`` on tensors of ``device``; ``elements``: the op's size, for the size rule.

    Ops that fuse elementwise work pass the elements of their largest
    tensor; on CUDA in ``auto`` mode, fewer than ``small_op_elements()``
    take the PyTorch path (see the module docstring).

    Raises:
        RuntimeError: the Triton backend is forced but cannot run on ``device``.
    """
    forced = requested_backend()
    if forced is Backend.TORCH:
        return Backend.TORCH
    if _launch.simulated_gpu():  # a tool sizing grids as for a GPU (tfuse._launch.simulate_gpu)
        return Backend.TRITON
    if not triton_available():
        if forced is Backend.TRITON:
            raise RuntimeError(
                f"tfuse.{op}: the Triton backend was requested, but Triton is not installed here. Install it "
                "(pip install triton, on Linux), or let the PyTorch path serve the op: TFUSE_BACKEND=auto or torch."
            )
        return Backend.TORCH
    if device.type == "cuda":
        if forced is None and elements is not None:
            return _by_size(op, elements)
        return Backend.TRITON
    interpreted = device.type == "cpu" and interpreter_active()
    if interpreted:
        return Backend.TRITON
    if forced is Backend.TRITON:
        if device.type == "cpu":
            raise RuntimeError(
                f"tfuse.{op}: the Triton backend was requested for CPU tensors, but Triton's "
                "interpreter is off. Set TRITON_INTERPRET=1 in the environment before "
                "triton (or tfuse) is imported, or use TFUSE_BACKEND=torch."
            )
        raise RuntimeError(
            f"tfuse.{op}: the Triton backend cannot run on device {device}; "
            "it supports CUDA tensors, and CPU tensors under TRITON_INTERPRET=1"
        )
    return Backend.TORCH


#: (op, backend) pairs already announced by :func:`log_backend_once`.
_announced: set[tuple[str, Backend]] = set()


def log_backend_once(logger: logging.Logger, op: str, backend: Backend, device: torch.device) -> None:
    """Logs at INFO, the first time ``op`` runs on ``backend``, which implementation serves it and why.

    For example ``tfuse.add_act: PyTorch path (CPU without TRITON_INTERPRET=1;
    device cpu)`` or ``tfuse.add: Triton kernels (CUDA; device cuda:0)``,
    through the op module's logger (``tfuse.ops.add_act``, ...). Ops call
    this right after :func:`select_backend`; later calls cost one set lookup.
    """
    key = (op, backend)
    if key in _announced:
        return
    _announced.add(key)
    logger.info("tfuse.%s: %s", op, _why(backend, device))


def _why(backend: Backend, device: torch.device) -> str:
    forced = requested_backend()
    if forced is not None:
        source = "use_backend" if _override.get() is not None else BACKEND_ENV_VAR
        reason = f"forced by {source}={forced.value!r}"
    elif backend is Backend.TORCH and not triton_available():
        reason = "Triton is not installed"
    elif backend is Backend.TRITON and device.type == "cuda":
        reason = "CUDA"
    elif backend is Backend.TRITON:
        reason = f"{device.type.upper()} through Triton's interpreter, TRITON_INTERPRET=1"
    elif device.type == "cpu":
        reason = "CPU without TRITON_INTERPRET=1"
    else:
        reason = f"no Triton kernels for device {device.type}"
    kind = "Triton kernels" if backend is Backend.TRITON else "PyTorch path"
    return f"{kind} ({reason}; device {device})"

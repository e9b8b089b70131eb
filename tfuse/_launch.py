"""Launching Triton kernels, and counting the launches.

Every kernel launch in tfuse goes through :func:`launch`, which records it in
each active :func:`count_launches` block. Tests use the count to prove the
Triton path ran (and how many passes an op took); benchmarks use it to show
what fusion saved.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch


class LaunchCount:
    """Triton kernel launches seen inside a :func:`count_launches` block.

    Attributes:
        by_kernel: kernel name -> number of launches.
    """

    def __init__(self) -> None:
        self.by_kernel: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        """Number of launches of all kernels."""
        return sum(self.by_kernel.values())

    def __repr__(self) -> str:
        return f"LaunchCount(total={self.total}, by_kernel={dict(self.by_kernel)})"


# Launches can come from autograd's worker threads (backward of CUDA tensors),
# so the active counters are process-wide, guarded by a lock, not thread-local.
_active: list[LaunchCount] = []
_lock = threading.Lock()


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Counts the Triton kernel launches made inside the block.

    Blocks may nest; each counts every launch made while it is open, from any
    thread.

    Example:
        >>> import torch, tfuse
        >>> with tfuse.count_launches() as launches:
        ...     out = tfuse.add(torch.ones(4), torch.ones(4), torch.ones(4))
        >>> launches.total  # 1 on the Triton path, 0 on the PyTorch path
        1
    """
    counter = LaunchCount()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


def kernel_name(kernel: Any) -> str:
    """The Python name of a ``@triton.jit`` function (compiled or interpreted)."""
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(kernel))


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    meta: dict[str, Any],
    device: torch.device,
) -> None:
    """Launches ``kernel[grid](*args, **meta)`` on ``device``; records it in the active counters.

    Triton launches on the *current* CUDA device, so tensors on another GPU
    (``cuda:1`` while ``cuda:0`` is current) need the device switched first.
    """
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device.index):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
    if _active:
        name = kernel_name(kernel)
        with _lock:
            for counter in _active:
                counter.by_kernel[name] += 1


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """How many programs a reduction grid aims for: 4 per SM on a GPU, 8 under the interpreter.

    Enough resident work to keep a GPU's memory system busy, while partial
    buffers stay small; the interpreter runs programs one by one, so fewer is faster.
    """
    if device.type == "cuda":
        return 4 * _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8

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


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gpu_sm_count(device: torch.device) -> int | None:
    """The number of SMs of a CUDA device; None elsewhere (the interpreter runs programs one by one).

    Launchers that size a grid to one wave of resident programs ask this, so
    a static analysis can answer it as a given GPU would.
    """
    if device.type != "cuda":
        return None
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def target_programs(device: torch.device) -> int:
    """How many programs a reduction grid aims for: 4 per SM on a GPU, 8 under the interpreter.

    Enough resident work to keep a GPU's memory system busy, while partial
    buffers stay small; the interpreter runs programs one by one, so fewer is faster.
    """
    if device.type == "cuda":
        return 4 * _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8


def resident_programs(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any], device: torch.device) -> int:
    """How many programs of ``kernel``, compiled for ``args``/``meta``, the device runs at once.

    Reduction grids are sized with it: one wave of programs, each reducing its
    share in registers, so the partials to merge are as few as can keep every
    SM busy. On a GPU the kernel is compiled (not launched) for those
    arguments, and its registers per thread, warps and shared memory give the
    programs per SM (the same limits as CUDA's occupancy calculator: registers
    allocated per warp in units of 256, at most 64 warps and 32 blocks per
    SM), times the SM count. Elsewhere (the interpreter, or a compile that
    does not report its resources) it is :func:`target_programs`.
    """
    if device.type != "cuda" or not hasattr(kernel, "warmup"):
        return target_programs(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with torch.cuda.device(index):
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            if getattr(compiled, "module", None) is None and hasattr(compiled, "_init_handles"):
                compiled._init_handles()
        regs = int(compiled.n_regs)
        warps = int(compiled.metadata.num_warps)
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    except Exception:  # resources unknown: fall back to the fixed target
        return target_programs(device)
    props = torch.cuda.get_device_properties(index)
    regs_per_sm = int(getattr(props, "regs_per_multiprocessor", 0) or 65536)
    warps_per_sm = int(getattr(props, "max_threads_per_multi_processor", 0) or 2048) // 32
    shared_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    per_sm = min((regs_per_sm // regs_per_warp) // warps, warps_per_sm // warps, 32)
    if shared and shared_per_sm:
        per_sm = min(per_sm, shared_per_sm // (shared + 1024))
    return max(1, per_sm) * _multiprocessor_count(index)


def launch_cached(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    meta: dict[str, Any],
    device: torch.device,
    cache: dict[str, Any],
) -> None:
    """:func:`launch` for a launch site that repeats one specialisation: same grid, meta-parameters,
    integer arguments and tensor dtypes on every call (the caller keys ``cache`` on all of them).

    The first call launches through Triton as usual and keeps the compiled
    kernel in ``cache``. Later calls whose tensor arguments have the same
    dtypes and are all 16-byte aligned (as they were then, so Triton would
    pick the same compiled kernel) call its launcher directly, skipping
    Triton's per-call argument binding, specialisation and cache lookup
    (about half the host time of a launch with ~15 arguments and ~15
    meta-parameters on an H100 host: 21 us instead of 40). Anything else
    (unaligned tensors, other dtypes, a Triton without these internals)
    takes the ordinary path. Launches are counted as by :func:`launch`.
    """
    compiled = cache.get("compiled")
    if compiled is not None and _same_specialisation(args, cache):
        index = device.index
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                _run_compiled(compiled, grid, args, cache)
        else:
            _run_compiled(compiled, grid, args, cache)
    else:
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device.index):
                compiled = kernel[grid](*args, **meta)
        else:
            compiled = kernel[grid](*args, **meta)
        if device.type == "cuda" and "compiled" not in cache:
            _keep_compiled(kernel, compiled, args, meta, cache)
    if _active:
        name = kernel_name(kernel)
        with _lock:
            for counter in _active:
                counter.by_kernel[name] += 1


def _same_specialisation(args: tuple, cache: dict) -> bool:
    """Tensor arguments of the dtypes and 16-byte alignment the kept kernel was compiled for."""
    tensors = cache["tensors"]
    aligned = all(args[i].data_ptr() % 16 == 0 for i in tensors)
    return aligned and tuple(args[i].dtype for i in tensors) == cache["dtypes"]


def _keep_compiled(kernel: Any, compiled: Any, args: tuple, meta: dict, cache: dict) -> None:
    """Stores what :func:`launch_cached` needs to relaunch ``compiled``, or nothing if it cannot."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver

        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if not all(args[i].data_ptr() % 16 == 0 for i in tensors):
            return  # compiled for unaligned pointers: not the specialisation later calls should reuse
        names = list(kernel.arg_names)
        constexprs = tuple(meta[name] for name in names[len(args) :])  # every later parameter is a constexpr
        hooks = knobs.runtime
        compiled.run, compiled.function, compiled.packed_metadata, compiled.launch_metadata  # noqa: B018
        cache.update(
            tensors=tensors,
            dtypes=tuple(args[i].dtype for i in tensors),
            constexprs=constexprs,
            driver=driver.active,
            hooks=hooks,
        )
        cache["compiled"] = compiled
    except Exception:  # another Triton: this site keeps using the ordinary path
        cache["compiled"] = None


def _run_compiled(compiled: Any, grid: tuple[int, ...], args: tuple, cache: dict) -> None:
    driver = cache["driver"]
    stream = driver.get_current_stream(driver.get_current_device())
    full = args + cache["constexprs"]
    hooks = cache["hooks"]
    enter = hooks.launch_enter_hook
    metadata = compiled.launch_metadata(grid, stream, *full) if enter is not None else None
    compiled.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter,
        hooks.launch_exit_hook,
        *full,
    )

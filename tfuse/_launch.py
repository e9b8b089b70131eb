"""The one seam through which tfuse launches Triton kernels: prepared launches, counting, watching.

Every kernel launch in tfuse is a call of :func:`launch`. What it does:

* **Prepared launches.** The first launch of a kernel at a site (one grid,
  one set of meta-parameters) goes through Triton's own launch path, which
  binds the arguments, computes their specialisation and finds or compiles
  the kernel. tfuse then keeps a :class:`_Prepared` launch for that site:
  the compiled kernel, its launcher, its packed metadata and the constant
  arguments, plus what Triton specialised on (each tensor's dtype and
  16-byte alignment, each integer's class: 1, a multiple of 16, neither,
  and whether it needs 64 bits). A repeat call checks exactly those facts,
  then calls the driver's launcher with the new data pointers: about 3 us of
  host time on a 2-core CPU instead of ~58 through Triton's path (the host
  census measures both). Anything that differs (a tensor of another dtype,
  an unaligned view, an integer that became 1) takes Triton's path again and
  prepares that specialisation too; results never depend on which path ran.
* **Counting.** Each launch is recorded in every open :func:`count_launches`
  block: tests prove the Triton path ran and how many passes an op took.
* **Watching and redirecting.** :func:`watch_launches` hands every launch to a
  function (the tests record arguments; the census counts); with
  ``run=False`` the kernel is not launched at all (the roofline captures
  launches of CPU or meta tensors, the census times tfuse's Python alone).
  :func:`simulate_gpu` makes the device questions launchers ask (SMs,
  resident programs, which backend) answer as a given GPU would, so a CPU
  run builds the GPU's grids. Nothing in the library patches names for
  these tools.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
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


#: A function that sees a launch: ``watcher(kernel, grid, args, meta, device)``.
Watcher = Callable[[Any, tuple, tuple, dict, torch.device], None]

# Launches can come from autograd's worker threads (backward of CUDA tensors),
# so counters and watchers are process-wide, guarded by a lock, not thread-local.
_active: list[LaunchCount] = []
_watchers: list[tuple[Watcher, bool]] = []
_lock = threading.Lock()
#: False while a watcher with ``run=False`` is installed: launches are not made.
_launching = True


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


@contextlib.contextmanager
def watch_launches(watcher: Watcher, *, run: bool = True) -> Iterator[None]:
    """Calls ``watcher(kernel, grid, args, meta, device)`` for every launch made inside the block.

    With ``run=False`` the kernels are not launched (nor compiled): the
    watcher is all that happens, and outputs stay as allocated. Blocks nest;
    launches are skipped while any open block says ``run=False``.

    Example:
        >>> import torch, tfuse
        >>> from tfuse._launch import watch_launches, kernel_name
        >>> seen = []
        >>> with watch_launches(lambda kernel, *_: seen.append(kernel_name(kernel))):
        ...     _ = tfuse.add(torch.ones(4), torch.ones(4))
        >>> seen
        ['_add_fwd_kernel']
    """
    global _launching
    entry = (watcher, run)
    with _lock:
        _watchers.append(entry)
        _launching = all(runs for _, runs in _watchers)
    try:
        yield
    finally:
        with _lock:
            _watchers.remove(entry)
            _launching = all(runs for _, runs in _watchers)


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
    """Launches ``kernel[grid](*args, **meta)`` for tensors on ``device``; the only way tfuse launches.

    ``args`` are the kernel's runtime arguments in order; ``meta`` its
    constexpr parameters and launch options (``num_warps``...). A repeat of
    a specialisation seen before at this grid and meta is a prepared launch
    (see the module docstring). Triton launches on the *current* CUDA
    device, so tensors on another GPU (``cuda:1`` while ``cuda:0`` is
    current) have the device switched around the launch.
    """
    _plan_of_site(kernel, grid, meta, device.index)(args, device)


#: The current CUDA device, asked without torch.cuda.current_device()'s initialisation check (a tensor on
#: the device exists, so CUDA is initialised): about 1 us less per launch.
_cuda_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

#: (kernel, grid, device index, meta values) -> the LaunchPlan of that site.
_plans: dict[tuple, LaunchPlan] = {}
#: Specialisations a plan prepares before it stops preparing more (it keeps launching, through Triton).
MAX_SPECIALISATIONS = 8
#: Sites kept before the table starts over (many grids: varying shapes).
MAX_SITES = 4096


def _plan_of_site(kernel: Any, grid: Any, meta: dict, index: int | None) -> LaunchPlan:
    """The kept plan of a launch site; a plan of its own for an unhashable site (Triton's path every time)."""
    try:
        site = (kernel, grid, index, *meta.values())
        plan = _plans.get(site)
    except TypeError:  # a callable grid or an unhashable meta value: nothing to key a plan on
        return LaunchPlan(kernel, grid, meta)
    if plan is None:
        if len(_plans) >= MAX_SITES:
            _plans.clear()
        plan = _plans[site] = LaunchPlan(kernel, grid, meta)
    return plan


class LaunchPlan:
    """The launches of one kernel with one grid and one set of meta-parameters, prepared per specialisation.

    :func:`launch` keeps one per launch site; an op that keeps its own plans
    (per shape, dtype and flags) may hold one and call it, which skips even
    the site lookup. Either way the launch is counted and watched as by
    :func:`launch`.

    Example (launches counted, not run, so no real arguments are needed):
        >>> import torch
        >>> from tfuse import kernels
        >>> from tfuse._launch import LaunchPlan, count_launches, watch_launches
        >>> plan = LaunchPlan(kernels._add_fwd_kernel, (1,), {})
        >>> with count_launches() as launches, watch_launches(lambda *launch: None, run=False):
        ...     plan((torch.empty(4),), torch.device("cpu"))
        >>> launches.total
        1
    """

    __slots__ = ("grid", "kernel", "meta", "name", "prepared")

    def __init__(self, kernel: Any, grid: Any, meta: dict[str, Any]) -> None:
        self.kernel = kernel
        self.grid = grid if callable(grid) else tuple(grid)
        self.meta = meta
        self.prepared: list[Callable[[tuple, int | None], bool]] = []
        self.name = kernel_name(kernel)

    def __call__(self, args: tuple[Any, ...], device: torch.device) -> None:
        """Launches the kernel for ``args`` (its runtime arguments, in order) on ``device``."""
        if _watchers:
            for watcher, _ in tuple(_watchers):
                watcher(self.kernel, self.grid, args, self.meta, device)
        if _launching:
            index = device.index
            if index is not None and device.type == "cuda" and index != _cuda_device():
                with torch.cuda.device(index):
                    self.launch_here(args, index)
            else:
                self.launch_here(args, index)
        if _active:
            with _lock:
                for counter in _active:
                    counter.by_kernel[self.name] += 1

    def launch_here(self, args: tuple, index: int | None) -> None:
        """Launches on the current device: a prepared launch when one fits, else Triton's path (and prepares it)."""
        for prepared in self.prepared:
            if prepared(args, index):
                return
        compiled = self.kernel[self.grid](*args, **self.meta)
        if len(self.prepared) < MAX_SPECIALISATIONS:
            prepared = _prepare(self.kernel, self.grid, compiled, args, self.meta, index)
            if prepared is not None:
                self.prepared.append(prepared)


def _prepare(
    kernel: Any, grid: tuple, compiled: Any, args: tuple, meta: dict, index: int | None
) -> Callable[[tuple, int | None], bool] | None:
    """A function that relaunches ``compiled`` for arguments of ``args``' specialisation on device ``index``
    and returns True, or returns False (launching nothing) for arguments of another specialisation or another
    device; None if ``compiled`` cannot be relaunched.

    What Triton specialised on is checked: each tensor's dtype and 16-byte
    alignment, each integer's class (1, a multiple of 16, 64-bit) and every
    other argument's type. The check is generated as straight-line code for
    the argument list (as Triton generates its own binder). None under
    Triton's interpreter (nothing compiled) and for a Triton whose compiled
    kernels lack the launcher attributes.
    """
    if compiled is None or not hasattr(compiled, "run"):
        return None
    try:
        from triton import knobs
        from triton.runtime.driver import driver

        unpacked = ", ".join(f"a{i}" for i in range(len(args))) + ","
        names: dict[str, Any] = {}
        checks = [_check(f"a{position}", value, names) for position, value in enumerate(args)]
        defaults = {name: p.default for name, p in kernel.signature.parameters.items()}
        later = list(kernel.arg_names)[len(args) :]  # every parameter after the runtime ones is a constexpr
        constants = tuple(meta[name] if name in meta else defaults[name] for name in later)
        compiled.function, compiled.packed_metadata, compiled.launch_metadata  # noqa: B018 (present?)
        active = driver.active
        grid3 = (*grid, 1, 1)[:3]
        scope = dict(
            names,
            _int_class=_int_class,
            get_stream=active.get_current_stream,
            get_device=active.get_current_device,
            compiled=compiled,
            run=compiled.run,
            function=compiled.function,
            packed=compiled.packed_metadata,
            hooks=knobs.runtime,
            constants=constants,
            grid=grid,
        )
        # Triton 3.9's hooks are chains (never None, empty when nothing listens); earlier ones are None or a hook.
        chained = hasattr(knobs.runtime.launch_enter_hook, "calls")
        listening = "enter.calls" if chained else "enter is not None"
        condition = " or ".join(f"({c})" for c in checks) or "False"
        source = f"""
def prepared(args, index):
    try:
        {unpacked} = args
        if index != {index!r} or {condition}:
            return False
    except (ValueError, AttributeError, TypeError):  # another argument count; a tensor became a number or None
        return False
    stream = get_stream(get_device() if index is None else index)
    full = args + constants
    enter = hooks.launch_enter_hook
    metadata = compiled.launch_metadata(grid, stream, *full) if {listening} else None
    run({grid3[0]}, {grid3[1]}, {grid3[2]}, stream, function, packed, metadata, enter, hooks.launch_exit_hook, *full)
    return True
"""
        exec(compile(source, f"<tfuse prepared launch of {kernel_name(kernel)}>", "exec"), scope)
        return scope["prepared"]
    except Exception:  # another Triton's internals: this launch keeps Triton's path
        return None


def _check(expr: str, value: Any, names: dict[str, Any]) -> str:
    """Python source that is true when the argument ``expr`` is *not* of ``value``'s specialisation.

    Tensors: dtype and 16-byte alignment (aligned, or not: Triton compiles
    each case apart); integers: :func:`_int_class`; tuples: their length and
    each element, recursively (Triton specialises inside tuples too); None:
    None; anything else: its type. Objects the check compares against go
    into ``names``.
    """
    if isinstance(value, torch.Tensor):
        name = f"dtype{len(names)}"
        names[name] = value.dtype
        if value.data_ptr() % 16:  # compiled without the alignment hint: reused for unaligned pointers only
            return f"{expr}.dtype is not {name} or not {expr}.data_ptr() & 15"
        return f"{expr}.dtype is not {name} or {expr}.data_ptr() & 15"
    if type(value) is int:
        # The very object seen when preparing (an op's plan passes the same ints every call) needs no check.
        name = f"int{len(names)}"
        names[name] = value
        return f"{expr} is not {name} and (type({expr}) is not int or {_int_mismatch(expr, _int_class(value))})"
    if value is None:
        return f"{expr} is not None"
    if type(value) is tuple:
        parts = [f"type({expr}) is not tuple or len({expr}) != {len(value)}"]
        parts += [_check(f"{expr}[{i}]", item, names) for i, item in enumerate(value)]
        check = " or ".join(f"({part})" for part in parts)
        if not _holds_tensor(value):  # the same tuple object (a plan's strides): no check; tensors are not kept
            name = f"tuple{len(names)}"
            names[name] = value
            return f"{expr} is not {name} and ({check})"
        return check
    name = f"type{len(names)}"
    names[name] = type(value)
    return f"type({expr}) is not {name}"


def _holds_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (type(value) is tuple and any(_holds_tensor(v) for v in value))


def _int_mismatch(expr: str, int_class: int) -> str:
    """Python source, true when the integer ``expr`` is not of :func:`_int_class` ``int_class`` (inline: no call)."""
    if int_class == 1:
        return f"{expr} != 1"
    multiple = f"{expr} % 16" if int_class & 2 else f"not {expr} % 16"  # true when the multiple-of-16 bit differs
    wide = "" if int_class & 4 else "not "
    return f"{expr} == 1 or {multiple} or {wide}-2147483648 <= {expr} < 2147483648"


def _int_class(value: int) -> int:
    """What Triton specialises an integer argument on: 1, a multiple of 16, 64-bit, or neither."""
    if value == 1:
        return 1
    wide = 4 if not -(2**31) <= value < 2**31 else 0
    return (2 if value % 16 == 0 else 0) | wide


# ------------------------------------------------------------------------------ the device questions launchers ask


@dataclasses.dataclass(frozen=True)
class _SimulatedGpu:
    sms: int
    resident: Callable[[Any, tuple, dict], int] | None


_simulated: _SimulatedGpu | None = None


@contextlib.contextmanager
def simulate_gpu(sms: int, resident: Callable[[Any, tuple, dict], int] | None = None) -> Iterator[None]:
    """Inside the block, launchers size their grids as for a GPU of ``sms`` SMs, on any tensors.

    :func:`gpu_sm_count` answers ``sms``, :func:`target_programs` ``4 * sms``,
    :func:`resident_programs` ``resident(kernel, args, meta)`` (or
    ``4 * sms``), and ops choose their Triton path on every device (pair
    with :func:`watch_launches` ``(run=False)``, or a stub driver, when the
    tensors are not on a GPU). For tools: the roofline and the host census.
    """
    global _simulated
    previous, _simulated = _simulated, _SimulatedGpu(int(sms), resident)
    try:
        yield
    finally:
        _simulated = previous


def simulated_gpu() -> bool:
    """Whether a :func:`simulate_gpu` block is open (the backend rules then choose Triton everywhere)."""
    return _simulated is not None


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gpu_sm_count(device: torch.device) -> int | None:
    """The number of SMs of a CUDA device; None elsewhere (the interpreter runs programs one by one).

    Launchers that size a grid to one wave of resident programs ask this, so
    a static analysis can answer it as a given GPU would.
    """
    if _simulated is not None:
        return _simulated.sms
    if device.type != "cuda":
        return None
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def target_programs(device: torch.device) -> int:
    """How many programs a reduction grid aims for: 4 per SM on a GPU, 8 under the interpreter.

    Enough resident work to keep a GPU's memory system busy, while partial
    buffers stay small; the interpreter runs programs one by one, so fewer is faster.
    """
    sms = gpu_sm_count(device)
    return 8 if sms is None else 4 * sms


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
    if _simulated is not None:
        if _simulated.resident is not None:
            return _simulated.resident(kernel, args, meta)
        return 4 * _simulated.sms
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

"""Static roofline of tfuse's kernels on an H100 (sm_90), read from compiled code without a GPU.

    python -m benchmarks.roofline                 # every case; writes benchmarks/results/sm90-kernels.md
    python -m benchmarks.roofline --only bn_      # cases whose name contains "bn_"; prints, writes nothing
    python -m benchmarks.roofline --json          # one JSON line per launch and per op phase
    python3 -m benchmarks.roofline --validate-cuda   # on a GPU: the JIT's kernels against the static compile

Each case runs real tfuse calls at realistic shapes on meta tensors (shapes and
strides, no storage, so a 1e8-element add allocates nothing) with the Triton
path forced and every launch captured instead of run, the launcher's grid
included. Whatever a launcher asks of the device answers as an H100 would
(``target_programs`` of a 132-SM device; ``resident_programs`` from this
module's sm_90 compile and occupancy model), so grids are the GPU's. Each
captured launch is specialised exactly as Triton would
specialise it for real CUDA tensors (meta tensors report 16-byte aligned data
pointers, like CUDA allocations; views keep their offsets) and compiled to PTX
and cubin for sm_90 with Triton's bundled ptxas. Compilations are cached by
specialisation key, so a kernel shared by several cases compiles once, and the
distinct ones compile in parallel processes. tests/test_sm90_compile.py runs
the same cases and asserts the properties the kernels are designed to have.
Works with Triton 3.6 (the GPU machines) to 3.9 (CI); on another version the
specialisation step fails with a message naming the Triton internals it needs.

From the compiled code, per launch:

* registers, spill stores/loads and stack frame (``ptxas -v`` on the PTX with
  Triton's flags, checked against the cubin's own register count), dynamic
  shared memory (Triton's metadata);
* global loads and stores per pointer argument, with their width in bits: the
  PTX is traced back from each ``ld.global``/``st.global`` address to the
  kernel parameter it is based on;
* CTA barriers (``bar.sync``) inside the loop body (per tile) and in all;
* SASS instructions (decoded from the cubin), and for loop-free kernels the
  static SASS instructions per element each thread handles;
* programs per SM from the captured grid, and the occupancy the registers,
  warps and shared memory allow (:class:`Gpu`: H100 SXM, 132 SMs);
* bytes moved: every pointer argument the kernel loads counts its tensor's
  bytes once, and once more if it stores it; an op phase sums its launches and
  is set against the minimum the op must move.

These are static figures: they show a regression (a spill, a scalar stream, an
extra barrier, a grid that no longer fills the machine, an extra pass over a
tensor) without a GPU; they are not timings. ``--validate-cuda`` checks them on
a GPU: every case runs for real and each kernel the JIT built is compared with
the static compile (on an H100 with Triton 3.6: 109 of 109 launches with the
same registers, spills and PTX).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import inspect
import io
import json
import math
import multiprocessing
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if "triton" not in sys.modules:  # compiled JIT functions are needed, never the interpreter
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its notice

import torch  # noqa: E402
import triton  # noqa: E402

import tfuse  # noqa: E402
import tfuse._launch as launch_mod  # noqa: E402
from tfuse._backend import interpreter_active  # noqa: E402
from tfuse._launch import kernel_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TABLE = RESULTS / "sm90-kernels.md"
MEASURED = RESULTS / "sm90-measured.json"
META = torch.device("meta")


# --------------------------------------------------------------------------- the machine


@dataclasses.dataclass(frozen=True)
class Gpu:
    """The figures occupancy is computed from: an H100 SXM (sm_90), per SM unless said otherwise.

    Registers are allocated per warp in units of 256 (a thread's count rounded
    up to a multiple of 8); shared memory assumes the largest carveout (228 KiB
    per SM) and 1 KiB reserved per block; blocks are limited by registers,
    warps, shared memory and the 32-block cap, whichever binds first.
    """

    name: str = "H100 SXM (sm_90)"
    arch: int = 90
    sms: int = 132
    regs_per_sm: int = 65536
    reg_alloc_unit: int = 256  # registers per warp allocation
    max_warps: int = 64
    max_blocks: int = 32
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_block: int = 1024
    smem_alloc_unit: int = 128
    warp_size: int = 32


H100 = Gpu()


@dataclasses.dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM
    limiter: str  # what bounds them: regs, warps, smem or blocks
    warps: int  # resident warps per SM

    def fraction(self, gpu: Gpu) -> float:
        return self.warps / gpu.max_warps


def occupancy(regs: int, num_warps: int, shared: int, gpu: Gpu = H100) -> Occupancy:
    """Resident blocks per SM for a kernel of ``regs`` registers per thread, ``num_warps`` warps, ``shared`` bytes."""
    regs_per_warp = -(-max(regs, 1) * gpu.warp_size // gpu.reg_alloc_unit) * gpu.reg_alloc_unit
    smem = -(-shared // gpu.smem_alloc_unit) * gpu.smem_alloc_unit + gpu.smem_reserved_per_block
    limits = {
        "regs": (gpu.regs_per_sm // regs_per_warp) // num_warps,
        "warps": gpu.max_warps // num_warps,
        "smem": gpu.smem_per_sm // smem,
        "blocks": gpu.max_blocks,
    }
    limiter = min(limits, key=lambda k: limits[k])
    return Occupancy(limits[limiter], limiter, limits[limiter] * num_warps)


# --------------------------------------------------------------------------- capturing launches


@dataclasses.dataclass
class Launch:
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict
    phase: str

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


class Capture:
    """The launches of a block of tfuse calls, each tagged with the phase (``fwd``, ``bwd``, ...) it ran in."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.current = "op"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous


@contextlib.contextmanager
def captured_launches(gpu: Gpu = H100, compiler: Compiler | None = None) -> Iterator[Capture]:
    """Runs tfuse ops on CPU or meta tensors as if on ``gpu``: the Triton path, launches recorded, not run.

    What the launchers ask of the device answers as ``gpu`` would
    (:func:`tfuse._launch.simulate_gpu`): ``target_programs`` as for a CUDA
    device of ``gpu.sms`` SMs, and ``resident_programs`` (a reduction grid
    sized from the compiled kernel's occupancy) from the sm_90 compile of
    that kernel by ``compiler``, so the grids are the GPU's. Launches are
    recorded through :func:`tfuse._launch.watch_launches` with ``run=False``.
    """
    capture = Capture()

    def record(kernel, grid, args, meta, device):
        grid = tuple(grid(meta) if callable(grid) else grid)
        capture.launches.append(Launch(kernel, grid, tuple(args), dict(meta), capture.current))

    def resident_programs(kernel, args, meta):
        compiled, _ = (compiler or default_compiler()).compile(kernel, tuple(args), dict(meta))
        return max(1, occupancy(compiled.resources["regs"], compiled.num_warps, compiled.shared, gpu).blocks) * gpu.sms

    with launch_mod.simulate_gpu(gpu.sms, resident_programs), launch_mod.watch_launches(record, run=False):
        yield capture


@functools.cache
def default_compiler() -> Compiler:
    """The compiler of captures given none (occupancy questions of the launchers)."""
    return Compiler()


# --------------------------------------------------------------------------- compiling for sm_90


class TritonApiError(RuntimeError):
    """This Triton's JIT internals differ from those the compiler below was written for."""


def _triton_api():
    """The Triton internals a launch goes through to specialise and compile (Triton 3.4 to 3.9)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as error:
        raise TritonApiError(
            f"benchmarks.roofline specialises launches through Triton's JIT internals (GPUTarget, ASTSource, "
            f"make_backend, create_function_from_signature, as in Triton 3.4-3.9); Triton {triton.__version__} "
            f"lacks one: {error}"
        ) from error
    return GPUTarget, ASTSource, make_backend, create_function_from_signature


@dataclasses.dataclass
class Compiled:
    """One compiled specialisation and what was read from it."""

    name: str
    key: str
    ptx: str
    cubin: bytes
    num_warps: int
    shared: int
    params: list[dict]  # per PTX parameter: name, pointer?, loads/stores widths
    resources: dict  # registers, spills, stack
    loops: int
    barriers_loop: int
    barriers_total: int
    sass: dict  # SASS instruction counts
    seconds: float

    @property
    def short_key(self) -> str:
        """A short stable name of the specialisation (for tables and cross-references)."""
        return hashlib.sha1(self.key.encode()).hexdigest()[:10]


class Compiler:
    """Compiles captured launches for sm_90, once per specialisation key."""

    def __init__(self, gpu: Gpu = H100) -> None:
        if interpreter_active():
            raise RuntimeError(
                "benchmarks.roofline compiles kernels, but tfuse's kernels were built for Triton's interpreter: "
                "run it in a process without TRITON_INTERPRET (python -m benchmarks.roofline)"
            )
        GPUTarget, self._ASTSource, make_backend, self._binder_factory = _triton_api()
        self.gpu = gpu
        self.target = GPUTarget("cuda", gpu.arch, gpu.warp_size)
        self.backend = make_backend(self.target)
        self._binders: dict[int, Callable] = {}
        self.cache: dict[str, Compiled] = {}
        self.compile_seconds = 0.0  # summed over compiles (in several processes: more than the wall time)
        self.builds = 0  # specialisations compiled: equal to len(cache) unless one was compiled twice

    def _binder(self, kernel) -> Callable:
        binder = self._binders.get(id(kernel))
        if binder is None:
            binder = self._binder_factory(kernel.signature, kernel.params, self.backend)
            self._binders[id(kernel)] = binder
        return binder

    def _specialise(self, kernel, args: tuple, meta: dict) -> tuple[str, tuple, list]:
        """(key, compile inputs, runtime leaves) of ``kernel(*args, **meta)`` as a launch specialises it."""
        try:
            bound, specialization, options = self._binder(kernel)(*args, **meta)
            options_, signature, constexprs, attrs = kernel._pack_args(
                self.backend, meta, bound, specialization, options)
        except (AttributeError, TypeError, ValueError) as error:
            raise TritonApiError(
                f"benchmarks.roofline could not specialise {kernel_name(kernel)} through Triton {triton.__version__}'s "
                f"JIT internals (written for Triton 3.4-3.9): {type(error).__name__}: {error}"
            ) from error
        fn = getattr(kernel, "fn", kernel)
        key = f"{fn.__module__}.{fn.__qualname__}:{specialization!r}:{sorted(options.items())!r}"
        return key, (kernel, signature, constexprs, attrs, options_), _runtime_leaves(signature, bound)

    def _build(self, key: str, inputs: tuple, leaves: list) -> Compiled:
        kernel, signature, constexprs, attrs, options = inputs
        start = time.perf_counter()
        with _ptxas_log() as log:  # Triton's own ptxas -v output, when it runs ptxas (not on a cache hit)
            result = triton.compile(self._ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                    options=options.__dict__)
        ptx, cubin = result.asm["ptx"], result.asm["cubin"]
        loops, barriers_loop, barriers_total = analyse_loops(ptx)
        return Compiled(
            name=kernel_name(kernel), key=key, ptx=ptx, cubin=cubin, num_warps=result.metadata.num_warps,
            shared=result.metadata.shared,
            params=analyse_params(ptx, [(name, typ.startswith("*")) for name, typ, _ in leaves]),
            resources=ptxas_resources(ptx, cubin, kernel_name(kernel), options, self.gpu.arch, log.getvalue()),
            loops=loops, barriers_loop=barriers_loop, barriers_total=barriers_total,
            sass=sass_counts(cubin, kernel_name(kernel)), seconds=time.perf_counter() - start,
        )

    def compile(self, kernel, args: tuple, meta: dict) -> tuple[Compiled, list[Any]]:
        """The compiled specialisation of ``kernel(*args, **meta)``, and the argument behind each PTX parameter."""
        key, inputs, leaves = self._specialise(kernel, args, meta)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self._store(self._build(key, inputs, leaves))
        return compiled, [value for _, _, value in leaves]

    def _store(self, compiled: Compiled) -> Compiled:
        self.cache[compiled.key] = compiled
        self.compile_seconds += compiled.seconds
        self.builds += 1
        return compiled

    def prefetch(self, launches: Sequence[Launch], workers: int | None = None) -> None:
        """Compiles the distinct specialisations of ``launches`` not compiled yet, in ``workers`` processes.

        Triton's compiler holds the GIL, so parallel compiles need processes:
        forked workers (they inherit the captured launches) each build part of
        the specialisations and send back what was read from them.
        """
        pending: dict[str, tuple[tuple, list]] = {}
        for launch in launches:
            key, inputs, leaves = self._specialise(launch.kernel, launch.args, launch.meta)
            if key not in self.cache and key not in pending:
                pending[key] = (inputs, leaves)
        workers = default_workers() if workers is None else workers
        if workers < 2 or len(pending) < 2 or "fork" not in multiprocessing.get_all_start_methods():
            for key, (inputs, leaves) in pending.items():
                self._store(self._build(key, inputs, leaves))
            return
        global _PENDING
        _PENDING = (self, list(pending.items()))
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(pending))) as pool:
                for compiled in pool.imap_unordered(_build_pending, range(len(pending))):
                    self._store(compiled)
        finally:
            _PENDING = None


_PENDING: tuple[Compiler, list] | None = None  # what forked workers compile (see Compiler.prefetch)


def _build_pending(index: int) -> Compiled:
    compiler, items = _PENDING
    key, (inputs, leaves) = items[index]
    return compiler._build(key, inputs, leaves)


def default_workers() -> int:
    """Compile processes: the CPUs this process may use, at most 4 (TFUSE_ROOFLINE_WORKERS overrides)."""
    if os.environ.get("TFUSE_ROOFLINE_WORKERS"):
        return max(1, int(os.environ["TFUSE_ROOFLINE_WORKERS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, 4))


def _runtime_leaves(signature: dict, bound: dict) -> list[tuple[str, str, Any]]:
    """(name, type, value) of each runtime (non-constexpr) argument, tuples flattened, in PTX parameter order."""
    leaves: list[tuple[str, str, Any]] = []

    def walk(name: str, typ: Any, value: Any) -> None:
        if isinstance(typ, tuple):
            for index, (t, v) in enumerate(zip(typ, value)):
                walk(f"{name}.{index}", t, v)
        elif typ != "constexpr":
            leaves.append((name, typ, value))

    for name, typ in signature.items():
        walk(name, typ, bound[name])
    return leaves


# --------------------------------------------------------------------------- reading PTX

_PTX_REG = re.compile(r"%[A-Za-z_][\w.]*")
_PTX_LABEL = re.compile(r"^\s*(\$?[\w$]+):\s*$")
_PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$?[\w$]+)\s*;")
_PTX_BARRIER = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:bar|barrier)(?:\.cta)?\.(?:sync|red|arrive)\b")
_PTX_PARAM_REF = re.compile(r"\[\s*(\w+?)_param_(\d+)\s*\]")
_NO_DEST = ("st.", "bar", "barrier", "bra", "ret", "exit", "red.", "prefetch", "membar", "fence", "trap", "call")


def vector_widths(ptx: str, op: str) -> list[int]:
    """Vector widths (1 for scalar) of the ``ld.global``/``st.global`` instructions in ``ptx``."""
    widths = []
    for match in re.finditer(rf"\b{op}\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.(?:b|f|u|s)\d+", ptx):
        widths.append(int(match.group(1) or 1))
    return widths


def _access_bits(opcode: str) -> tuple[int, int]:
    """(vector length, bits) of a ld/st opcode such as ``ld.global.L1::evict_last.v4.b32``."""
    vec = re.search(r"\.v(\d)\b", opcode)
    size = re.search(r"\.(?:b|f|u|s)(\d+)$", opcode)
    n = int(vec.group(1)) if vec else 1
    return n, n * (int(size.group(1)) if size else 0)


def _split_operands(text: str) -> list[str]:
    operands, depth, current = [], 0, ""
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        operands.append(current.strip())
    return operands


def _statements(ptx: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number in ``ptx``, opcode, operands) of each instruction of the kernel body."""
    first = ptx[:ptx.index("{", ptx.index(".entry"))].count("\n") if ".entry" in ptx else 0
    for number, line in enumerate(ptx.splitlines()):
        line = line.split("//")[0].strip()
        if number < first or not line or line.endswith(":") or line.startswith((".", "{", "}")):
            continue
        line = re.sub(r"^@!?%\w+\s+", "", line).rstrip(";").strip()
        parts = line.split(None, 1)
        yield number, parts[0], _split_operands(parts[1]) if len(parts) > 1 else []


def analyse_params(ptx: str, params: Sequence[tuple[str, bool]]) -> list[dict]:
    """Global loads and stores of each kernel parameter (name, is_pointer), traced through the PTX.

    An access's address register is followed back through the instructions
    that define it to the ``ld.param`` of a pointer parameter; values loaded
    from global memory (a block table's offsets) end the walk, so an address
    ``grad_ptr + starts[i]`` belongs to ``grad_ptr`` alone.
    """
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    accesses: list[tuple[str, int, int, list[str], bool]] = []
    regions = _loop_regions(ptx)
    for number, opcode, operands in _statements(ptx):
        if opcode.startswith(("ld.global", "st.global")):
            address = next(op for op in operands if op.startswith("["))
            vec, bits = _access_bits(opcode)
            in_loop = any(start <= number <= end for start, end in regions)
            accesses.append((opcode[:2], vec, bits, _PTX_REG.findall(address), in_loop or not regions))
        if not operands or opcode.startswith(_NO_DEST):
            continue
        dests = _PTX_REG.findall(operands[0])
        sources = [reg for op in operands[1:] for reg in _PTX_REG.findall(op)]
        param = _PTX_PARAM_REF.search(" ".join(operands[1:]))
        for dest in dests:
            if opcode.startswith("ld.param") and param:
                defs.setdefault(dest, []).append(("param", [param.group(2)]))
            elif opcode.startswith("ld."):
                defs.setdefault(dest, []).append(("data", []))
            else:
                defs.setdefault(dest, []).append(("op", sources))

    @functools.cache
    def roots(reg: str) -> frozenset[int]:
        found: set[int] = set()
        seen, stack = {reg}, [reg]
        while stack:
            current = stack.pop()
            for kind, sources in defs.get(current, []):
                if kind == "param":
                    found.add(int(sources[0]))
                elif kind == "op":
                    for source in sources:
                        if source not in seen:
                            seen.add(source)
                            stack.append(source)
        return frozenset(found)

    result = [dict(name=name, pointer=pointer, loads=[], stores=[], per_tile=[], several_owners=False)
              for name, pointer in params]
    pointer_index = {i for i, (_, pointer) in enumerate(params) if pointer}
    for kind, vec, bits, regs, per_tile in accesses:
        owners = sorted({i for reg in regs for i in roots(reg)} & pointer_index)
        if not owners:
            raise RuntimeError(f"benchmarks.roofline: a global {kind} whose address comes from no pointer parameter")
        for owner in owners:
            result[owner]["loads" if kind == "ld" else "stores"].append(bits)
            if per_tile:  # in the loop body (every access of a loop-free kernel)
                result[owner]["per_tile"].append(bits)
            result[owner]["several_owners"] |= len(owners) > 1
    return result


def _loop_regions(ptx: str) -> list[list[int]]:
    """[first, last] line numbers of the loops of ``ptx``: a loop runs from a label to a later branch back
    to it; nested and overlapping loops merge into one region."""
    lines = [line.split("//")[0] for line in ptx.splitlines()]
    labels = {}
    for number, line in enumerate(lines):
        match = _PTX_LABEL.match(line)
        if match:
            labels[match.group(1)] = number
    regions = []
    for number, line in enumerate(lines):
        match = _PTX_BRANCH.search(line)
        if match and match.group(1) in labels and labels[match.group(1)] < number:
            regions.append((labels[match.group(1)], number))
    merged: list[list[int]] = []
    for start, end in sorted(regions):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def analyse_loops(ptx: str) -> tuple[int, int, int]:
    """(loops, CTA barriers inside loop bodies, CTA barriers in all) of the kernel's PTX."""
    merged = _loop_regions(ptx)
    lines = [line.split("//")[0] for line in ptx.splitlines()]
    barrier_lines = [n for n, line in enumerate(lines) if _PTX_BARRIER.match(line)]
    in_loops = sum(1 for n in barrier_lines if any(s <= n <= e for s, e in merged))
    return len(merged), in_loops, len(barrier_lines)


# --------------------------------------------------------------------------- reading the cubin

# Hopper SASS: each instruction is 128 bits; bits 0-11 of the first word are the opcode.
SASS_OPCODES = {"NOP": 0x918, "BRA": 0x947, "EXIT": 0x94D, "BAR": 0xB1D, "LDG": 0x981, "STG": 0x986}


def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """Section name -> (offset, size) of a 64-bit little-endian ELF file."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(offset: int) -> str:
        end = data.index(b"\0", names_offset + offset)
        return data[names_offset + offset:end].decode()

    return {name(h[0]): (h[4], h[5]) for h in headers}


def sass_opcodes(cubin: bytes, name: str) -> list[int]:
    """The opcode of each SASS instruction of kernel ``name`` in ``cubin``."""
    offset, size = _elf_sections(cubin)[f".text.{name}"]
    return [struct.unpack_from("<Q", cubin, offset + i)[0] & 0xFFF for i in range(0, size, 16)]


def sass_counts(cubin: bytes, name: str) -> dict[str, int]:
    """SASS instructions (without padding NOPs and the final self-branch), CTA barriers, LDG and STG."""
    ops = [op for op in sass_opcodes(cubin, name) if op != SASS_OPCODES["NOP"]]
    if ops and ops[-1] == SASS_OPCODES["BRA"]:
        ops = ops[:-1]
    return {
        "instructions": len(ops),
        "bar": sum(op == SASS_OPCODES["BAR"] for op in ops),
        "ldg": sum(op == SASS_OPCODES["LDG"] for op in ops),
        "stg": sum(op == SASS_OPCODES["STG"] for op in ops),
    }


def nvdisasm_counts(cubin: bytes, name: str) -> dict[str, int]:
    """:func:`sass_counts` from Triton's bundled nvdisasm listing (slow: about 0.4 s; for checks)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True,
                                 check=True).stdout
    mnemonics = []
    for line in listing.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if match:
            mnemonics.append(match.group(1))
    mnemonics = [m for m in mnemonics if m != "NOP"]
    if mnemonics and mnemonics[-1] == "BRA":
        mnemonics = mnemonics[:-1]
    return {
        "instructions": len(mnemonics),
        "bar": mnemonics.count("BAR"),
        "ldg": mnemonics.count("LDG"),
        "stg": mnemonics.count("STG"),
    }


@functools.cache
def _tool(name: str) -> str:
    """Path of one of Triton's bundled NVIDIA tools (ptxas, cuobjdump, nvdisasm)."""
    from triton.backends.nvidia import compiler as nvidia

    ptxas = Path(nvidia.get_ptxas(90).path if "arch" in inspect.signature(nvidia.get_ptxas).parameters
                 else nvidia.get_ptxas().path)
    if name == "ptxas":
        return str(ptxas)
    return str(ptxas.with_name(name))


@functools.cache
def _make_cubin_source() -> str:
    from triton.backends.nvidia import compiler as nvidia

    return inspect.getsource(nvidia.CUDABackend.make_cubin)


def _ptxas_flags(options: Any, arch: int) -> list[str]:
    """The flags Triton's make_cubin gives ptxas (so the register figures are the cubin's)."""
    flags = ["-lineinfo", "-v"]
    if not getattr(options, "enable_fp_fusion", True):
        flags.append("--fmad=false")
    if "regAllocOptLevel=2" in _make_cubin_source():
        flags.append("--regAllocOptLevel=2")
    if getattr(options, "ptx_options", None):
        flags += options.ptx_options.split()
    return flags + [f"--gpu-name=sm_{arch}a"]


@contextlib.contextmanager
def _ptxas_log() -> Iterator[io.StringIO]:
    """Collects the ptxas -v log Triton prints with its ``dump_ptxas_log`` knob (empty where it has none)."""
    buffer = io.StringIO()
    nvidia = getattr(getattr(triton, "knobs", None), "nvidia", None)
    if nvidia is None or not hasattr(nvidia, "dump_ptxas_log"):
        yield buffer
        return
    previous = nvidia.dump_ptxas_log
    nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buffer):
            yield buffer
    finally:
        nvidia.dump_ptxas_log = previous


_RERUN_LOG = "ptxas-v.log"


def _rerun_log(ptx: str, flags: list[str], log: str | None = None) -> str | None:
    """The output of ``ptxas <flags>`` on ``ptx`` kept from an earlier run (None when there is none), or, given
    ``log``, keeps it: in Triton's cache folder, under a key of the PTX, the flags and the ptxas binary (path,
    size and modification time), so a changed input or another ptxas runs it again. A cache that cannot be
    used (no cache folder) only means ptxas runs each time."""
    ptxas = Path(_tool("ptxas"))
    stat = ptxas.stat()
    digest = hashlib.sha256()
    for part in ("benchmarks.roofline ptxas -v", str(ptxas), str(stat.st_size), str(stat.st_mtime_ns), *flags, ptx):
        digest.update(part.encode())
        digest.update(b"\0")
    try:
        from triton.runtime.cache import get_cache_manager

        cache = get_cache_manager(digest.hexdigest())
        if log is not None:
            cache.put(log, _RERUN_LOG, binary=False)
            return log
        path = cache.get_file(_RERUN_LOG)
        return Path(path).read_text() if path else None
    except (ImportError, OSError, RuntimeError):
        return log


def ptxas_resources(ptx: str, cubin: bytes, name: str, options: Any, arch: int, log: str = "") -> dict[str, int]:
    """Registers, spill stores/loads and stack frame in bytes (``ptxas -v``), and the cubin's own figures.

    ``log`` is Triton's own ptxas -v output for this PTX when it ran ptxas; otherwise (a cache hit)
    ptxas runs again on the PTX with Triton's flags (its output kept beside Triton's cache, keyed by the PTX,
    the flags and the ptxas binary: ptxas is deterministic, so a later run reads it instead of running it again).
    """
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, out_path, cubin_path = (Path(folder) / n for n in ("k.ptx", "k.o", "k.cubin"))
        cubin_path.write_bytes(cubin)
        if not re.search(r"Used \d+ registers", log):
            flags = _ptxas_flags(options, arch)
            log = _rerun_log(ptx, flags)
            if log is None:
                ptx_path.write_text(ptx)
                rerun = subprocess.run([_tool("ptxas"), *flags, str(ptx_path), "-o", str(out_path)],
                                       capture_output=True, text=True, check=True)
                log = rerun.stdout + rerun.stderr
                _rerun_log(ptx, flags, log)
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin_path)], capture_output=True, text=True,
                               check=True).stdout
    text = log

    def number(pattern: str, source: str) -> int:
        match = re.search(pattern, source)
        if match is None:
            raise RuntimeError(f"benchmarks.roofline: no '{pattern}' in the output for {name}:\n{source}")
        return int(match.group(1))

    return {
        "regs": number(r"REG:(\d+)", usage),
        "ptxas_regs": number(r"Used (\d+) registers", text),
        "spill_stores": number(r"(\d+) bytes spill stores", text),
        "spill_loads": number(r"(\d+) bytes spill loads", text),
        "stack": number(r"STACK:(\d+)", usage),
        "local": number(r"LOCAL:(\d+)", usage),
    }


# --------------------------------------------------------------------------- cases


_case_device = META  # where cases allocate: meta (no storage) for the roofline, CUDA when validating on a GPU


def case_empty(*shape: int, dtype: torch.dtype = torch.float32, channels_last: bool = False,
               requires_grad: bool = False) -> torch.Tensor:
    """A tensor of the cases: on meta, shape, strides and dtype without storage (data pointer 0, so
    16-byte aligned as CUDA allocations are; views keep their offsets)."""
    t = torch.empty(shape, dtype=dtype, device=_case_device)
    if channels_last:
        t = t.to(memory_format=torch.channels_last)
    return t.requires_grad_(requires_grad)


@dataclasses.dataclass(frozen=True)
class Phase:
    """An op phase of a case: its elements and the bytes it must move at least."""

    name: str
    elements: int
    min_bytes: int
    note: str


@dataclasses.dataclass(frozen=True)
class Case:
    """A realistic call of a tfuse op, run on meta tensors; ``run(capture)`` tags launches with phases."""

    name: str
    family: str
    title: str
    run: Callable[[Capture], None]
    phases: tuple[Phase, ...]
    one_wave: frozenset[str] = frozenset()  # kernels whose grid is meant to be resident in one wave


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]


def bn_case(n: int, c: int, hw: int, channels_last: bool, dtype: torch.dtype) -> Case:
    """FusedBatchNormAct2d(relu) training step with a residual: forward, then backward into x and the residual."""
    numel, e = n * c * hw * hw, _esize(dtype)

    def run(capture: Capture) -> None:
        layer = tfuse.nn.FusedBatchNormAct2d(c, act="relu").to(_case_device, dtype).train()
        x = case_empty(n, c, hw, hw, dtype=dtype, channels_last=channels_last, requires_grad=True)
        skip = case_empty(n, c, hw, hw, dtype=dtype, channels_last=channels_last, requires_grad=True)
        with capture.phase("fwd"):
            y = layer(x, skip)
        with capture.phase("bwd"):
            y.backward(torch.empty_like(y))

    layout = "CL" if channels_last else "NCHW"
    return Case(
        name=f"bn_{c}x{hw}x{hw}_{layout.lower()}_{_dtype_name(dtype)}", family="batch norm",
        title=f"FusedBatchNormAct2d relu + residual, train, {n}x{c}x{hw}x{hw} {layout} {_dtype_name(dtype)}",
        run=run,
        phases=(
            Phase("fwd", numel, 4 * numel * e, "x twice (statistics, then normalise), residual, y"),
            Phase("bwd", numel, 7 * numel * e,
                  "dy, y, x for the sums while writing d(residual) = dy'; then d(residual), x again, and dx"),
        ),
        one_wave=frozenset({"_bn_stats_partial_kernel", "_bn_act_bwd_reduce_kernel"}),
    )


def add3_case(numel: int, dtype: torch.dtype) -> Case:
    def run(capture: Capture) -> None:
        with capture.phase("fwd"):
            tfuse.add(*(case_empty(numel, dtype=dtype) for _ in range(3)))

    return Case(
        name=f"add3_{numel:.0e}_{_dtype_name(dtype)}".replace("+0", ""), family="add",
        title=f"tfuse.add(a, b, c), {numel:.0e} elements {_dtype_name(dtype)}".replace("+0", ""), run=run,
        phases=(Phase("fwd", numel, 4 * numel * _esize(dtype), "three inputs, one output"),),
    )


def add_bias_residual_case(n: int, c: int, hw: int, dtype: torch.dtype) -> Case:
    numel, e = n * c * hw * hw, _esize(dtype)

    def run(capture: Capture) -> None:
        with capture.phase("fwd"):
            tfuse.add(case_empty(n, c, hw, hw, dtype=dtype), case_empty(c, 1, 1, dtype=dtype),
                      case_empty(n, c, hw, hw, dtype=dtype))

    return Case(
        name=f"add_bias_res_{c}x{hw}x{hw}_{_dtype_name(dtype)}", family="add",
        title=f"tfuse.add(x, bias[C,1,1], residual), {n}x{c}x{hw}x{hw} NCHW {_dtype_name(dtype)}", run=run,
        phases=(Phase("fwd", numel, 3 * numel * e + c * e, "x, residual, output, bias"),),
    )


def add_act_case(act: str, x_shape: tuple[int, ...], bias_shape: tuple[int, ...], dtype: torch.dtype) -> Case:
    """tfuse.add_act(x, bias) forward and backward (x and bias requiring grad)."""
    numel, e = math.prod(x_shape), _esize(dtype)
    bias_numel = math.prod(bias_shape)
    from_output = act in ("relu", "identity")

    def run(capture: Capture) -> None:
        x = case_empty(*x_shape, dtype=dtype, requires_grad=True)
        bias = case_empty(*bias_shape, dtype=dtype, requires_grad=True)
        with capture.phase("fwd"):
            y = tfuse.add_act(x, bias, act=act)
        with capture.phase("bwd"):
            y.backward(torch.empty_like(y))

    shape = "x".join(map(str, x_shape))
    pattern = "[H]" if len(bias_shape) == 1 else "[C,1,1]"
    bwd_min = (3 * numel + bias_numel) * e if from_output else (3 * numel + 2 * bias_numel) * e
    return Case(
        name=f"add_act_{act}_{shape}_{_dtype_name(dtype)}", family="add_act",
        title=f"tfuse.add_act(x, bias{pattern}, act={act}), {shape} {_dtype_name(dtype)}, forward and backward",
        run=run,
        phases=(
            Phase("fwd", numel, (2 * numel + bias_numel) * e, "x, bias, y"),
            Phase("bwd", numel, bwd_min,
                  "dy, y, dx, d(bias)" if from_output else "dy, x and bias (recompute z), dx, d(bias)"),
        ),
        one_wave=frozenset({"_add_act_bwd_kernel"}),
    )


def depthwise_case(n: int, c: int, hw: int, kernel: int, stride: int, channels_last: bool, dtype: torch.dtype,
                   act: str = "relu6") -> Case:
    """relu_depthwise_conv2d(act_in=act, no bias, padding k // 2) forward, then backward into x and the weight.

    The Triton path is forced: on CUDA (``--validate-cuda``) the dispatch rule could send a class of
    ``EAGER_SHAPE_CLASSES`` to cuDNN.
    """
    out = (hw + 2 * (kernel // 2) - kernel) // stride + 1
    x_numel, y_numel, k_numel, e = n * c * hw * hw, n * c * out * out, c * kernel * kernel, _esize(dtype)

    def run(capture: Capture) -> None:
        x = case_empty(n, c, hw, hw, dtype=dtype, channels_last=channels_last, requires_grad=True)
        weight = case_empty(c, 1, kernel, kernel, dtype=dtype, requires_grad=True)
        with tfuse.use_backend("triton"):
            with capture.phase("fwd"):
                y = tfuse.functional.relu_depthwise_conv2d(x, weight, stride=stride, padding=kernel // 2, act_in=act)
            with capture.phase("bwd"):
                y.backward(torch.empty_like(y))

    layout = "CL" if channels_last else "NCHW"
    return Case(
        name=f"dw_{c}x{hw}x{hw}_k{kernel}s{stride}_{layout.lower()}_{_dtype_name(dtype)}", family="depthwise conv",
        title=f"relu_depthwise_conv2d({act}), {n}x{c}x{hw}x{hw} {layout} {_dtype_name(dtype)}, {kernel}x{kernel} "
              f"stride {stride}, forward and backward (dx, dw)",
        run=run,
        # Streams are the tensors as large as the output (x, y, gy, dx); the weight and dw/db partials are not.
        phases=(
            Phase("fwd", y_numel, (x_numel + y_numel + k_numel) * e, "x and w once, y"),
            Phase("bwd", y_numel, (2 * x_numel + y_numel + 2 * k_numel) * e,
                  "gy, x once (act(x) for dw, act'(x) for dx), dx, w, dw"),
        ),
    )


def bn_depthwise_case(n: int, c: int, hw: int, kernel: int, stride: int, channels_last: bool, dtype: torch.dtype,
                      act: str = "relu6") -> Case:
    """batch_norm_act_depthwise_conv2d in training (float32 batch norm parameters, padding k // 2, no convolution
    bias): forward (statistics, the normalising convolution), then backward into x, the batch norm's parameters
    and the weight. The Triton path is forced, as for depthwise_case."""
    out = (hw + 2 * (kernel // 2) - kernel) // stride + 1
    x_numel, y_numel, k_numel, e = n * c * hw * hw, n * c * out * out, c * kernel * kernel, _esize(dtype)

    def run(capture: Capture) -> None:
        x = case_empty(n, c, hw, hw, dtype=dtype, channels_last=channels_last, requires_grad=True)
        weight = case_empty(c, 1, kernel, kernel, dtype=dtype, requires_grad=True)
        gamma, beta = (case_empty(c, dtype=torch.float32, requires_grad=True) for _ in range(2))
        mean, var = case_empty(c, dtype=torch.float32), case_empty(c, dtype=torch.float32)
        with tfuse.use_backend("triton"):
            with capture.phase("fwd"):
                y = tfuse.functional.batch_norm_act_depthwise_conv2d(
                    x, mean, var, gamma, beta, weight, training=True, act=act, stride=stride, padding=kernel // 2)
            with capture.phase("bwd"):
                y.backward(torch.empty_like(y))

    layout = "CL" if channels_last else "NCHW"
    return Case(
        name=f"bndw_{c}x{hw}x{hw}_k{kernel}s{stride}_{layout.lower()}_{_dtype_name(dtype)}",
        family="batch norm + act + depthwise conv",
        title=f"batch_norm_act_depthwise_conv2d({act}), {n}x{c}x{hw}x{hw} {layout} {_dtype_name(dtype)}, "
              f"{kernel}x{kernel} stride {stride}, training forward and backward",
        run=run,
        phases=(
            Phase("fwd", y_numel, (2 * x_numel + y_numel + k_numel) * e, "x twice (statistics, convolution), w, y"),
            Phase("bwd", y_numel, (3 * x_numel + 2 * y_numel + 2 * k_numel) * e,
                  "gy and x for dw and the sums, gy and x again for dx, dx, w, dw"),
        ),
    )


def _norm_act(op: str, x: torch.Tensor, *args: Any, act: str) -> torch.Tensor:
    """``tfuse.functional.<op>(x, *args, act=act)``, on meta tensors through the op's checks and its autograd
    Function directly: the op itself enters ``torch.autocast(x.device.type, enabled=False)``, which torch refuses
    for the meta device (no autocast there). The launches are the op's (tfuse/ops/_norm_act_triton.py)."""
    if x.device.type != "meta":
        return getattr(tfuse.functional, op)(x, *args, act=act)
    from tfuse.ops import _norm_act_checks as checks
    from tfuse.ops._norm_act_triton import NormActFunction

    weight, bias = args[1:3]
    call = getattr(checks, f"check_{op[:-4]}_call")(x, args[0], weight, bias, None, 1e-5, act, None)
    return NormActFunction.apply(call, x.dtype, x, weight, bias, None)


def group_norm_act_case(n: int, c: int, hw: int, groups: int, channels_last: bool, dtype: torch.dtype,
                        act: str = "silu") -> Case:
    """group_norm_act(x, groups, weight, bias, act) with weight and bias in x's dtype: forward, then backward into
    x, weight and bias. The Triton path is forced, as for depthwise_case."""
    numel, e = n * c * hw * hw, _esize(dtype)

    def run(capture: Capture) -> None:
        x = case_empty(n, c, hw, hw, dtype=dtype, channels_last=channels_last, requires_grad=True)
        weight, bias = (case_empty(c, dtype=dtype, requires_grad=True) for _ in range(2))
        with tfuse.use_backend("triton"):
            with capture.phase("fwd"):
                y = _norm_act("group_norm_act", x, groups, weight, bias, act=act)
            with capture.phase("bwd"):
                y.backward(torch.empty_like(y))

    layout = "CL" if channels_last else "NCHW"
    return Case(
        name=f"gn_{c}x{hw}x{hw}_g{groups}_{layout.lower()}_{_dtype_name(dtype)}", family="group norm + act",
        title=f"group_norm_act({act}), {n}x{c}x{hw}x{hw} {layout} {_dtype_name(dtype)}, {groups} groups, forward "
              f"and backward (dx, d(weight), d(bias))",
        run=run,
        # The op's own minimum: x read once, y written (forward); dy and x read once, dx written (backward; the
        # activation's derivative is recomputed from x). The weight-sized tensors are left out.
        phases=(
            Phase("fwd", numel, 2 * numel * e, "x once, y"),
            Phase("bwd", numel, 3 * numel * e, "dy and x once, dx"),
        ),
    )


def layer_norm_act_case(shape: tuple[int, ...], dtype: torch.dtype, act: str = "gelu") -> Case:
    """layer_norm_act over the last dimension, weight and bias in x's dtype: forward, then backward into x,
    weight and bias. The Triton path is forced, as for depthwise_case."""
    numel, e = math.prod(shape), _esize(dtype)

    def run(capture: Capture) -> None:
        x = case_empty(*shape, dtype=dtype, requires_grad=True)
        weight, bias = (case_empty(shape[-1], dtype=dtype, requires_grad=True) for _ in range(2))
        with tfuse.use_backend("triton"):
            with capture.phase("fwd"):
                y = _norm_act("layer_norm_act", x, shape[-1], weight, bias, act=act)
            with capture.phase("bwd"):
                y.backward(torch.empty_like(y))

    text = "x".join(map(str, shape))
    return Case(
        name=f"ln_{text}_{_dtype_name(dtype)}", family="layer norm + act",
        title=f"layer_norm_act({act}) over the last dimension, {text} {_dtype_name(dtype)}, forward and backward "
              f"(dx, d(weight), d(bias))",
        run=run,
        phases=(
            Phase("fwd", numel, 2 * numel * e, "x once, y"),
            Phase("bwd", numel, 3 * numel * e, "dy and x once, dx"),
        ),
    )


def _model_shapes(model: str) -> list[tuple[int, ...]]:
    from benchmarks.optim import gpt2_small_shapes, resnet50_shapes

    return {"resnet50": resnet50_shapes, "gpt2": gpt2_small_shapes}[model]()


_MODEL_TITLES = {"resnet50": "ResNet-50", "gpt2": "GPT-2 small"}


# algorithm -> (optimizer class name, its arguments, state tensors per parameter, label)
_OPTIMIZERS = {
    "adam": ("FusedAdam", dict(lr=1e-3), 2, "Adam"),
    "sgd_momentum": ("FusedMomentum", dict(lr=1e-3), 1, "SGD momentum"),
    "adagrad": ("FusedAdagrad", dict(lr=1e-3), 1, "Adagrad"),
    "lion": ("FusedLion", dict(lr=1e-4, weight_decay=0.1), 1, "Lion"),
    "lamb": ("FusedLAMB", dict(lr=1e-3, weight_decay=0.01), 2, "LAMB"),
    "lars": ("FusedLARS", dict(lr=1.0, weight_decay=5e-5), 1, "LARS"),
    "muon": ("FusedMuon", dict(lr=0.02), 1, "Muon (the elementwise phases; its AdamW groups keep 2 states)"),
}


def optim_case(algorithm: str, model: str, dtype: torch.dtype, master: bool) -> Case:
    """One step of a fused optimizer (_OPTIMIZERS) over a model's parameter set (every parameter with a gradient)."""
    shapes = _model_shapes(model)
    numel = sum(math.prod(s) for s in shapes)
    e = _esize(dtype)

    def run(capture: Capture) -> None:
        params = [torch.nn.Parameter(case_empty(*s, dtype=dtype)) for s in shapes]
        optimizer = getattr(tfuse.optim, class_name)(params, **options, master_weights=master)
        for param in params:
            param.grad = torch.empty_like(param)
        with capture.phase("step"):
            optimizer.step()

    class_name, options, states, label = _OPTIMIZERS[algorithm]
    state_e = 4 if master else e
    # grad read, parameter written (and read, without masters), each state read and written, masters read and written
    per_element = e + e + (0 if master else e) + 2 * states * state_e + (8 if master else 0)
    tag = _dtype_name(dtype) + ("+master" if master else "")
    return Case(
        name=f"{algorithm}_{model}_{tag.replace('+', '_')}", family="optimizer",
        title=f"{class_name}.step, {_MODEL_TITLES[model]} "
              f"({len(shapes)} tensors, {numel / 1e6:.1f}M) {tag}",
        run=run,
        phases=(Phase("step", numel, per_element * numel, f"{label}: {per_element} B/parameter"),),
    )


def clip_case(model: str, dtype: torch.dtype) -> Case:
    shapes = _model_shapes(model)
    numel = sum(math.prod(s) for s in shapes)

    def run(capture: Capture) -> None:
        params = [torch.nn.Parameter(case_empty(*s, dtype=dtype)) for s in shapes]
        flat = tfuse.flat.FlatParams(params)
        for param in flat.params:
            param.grad = flat.grad_view(param)
        with capture.phase("clip"):
            tfuse.optim.clip_grad_norm_(flat, 1.0)

    return Case(
        name=f"clip_{model}_{_dtype_name(dtype)}", family="clip_grad_norm_",
        title=f"clip_grad_norm_(L2), {_MODEL_TITLES[model]} gradients ({numel / 1e6:.1f}M) {_dtype_name(dtype)}",
        run=run,
        phases=(Phase("clip", numel, 3 * numel * _esize(dtype), "read for the norm, then read and write to scale"),),
    )


def cases() -> list[Case]:
    """The realistic shapes of the roofline table."""
    out: list[Case] = []
    for dtype in (torch.float32, torch.bfloat16):
        out.append(add3_case(100_000_000, dtype))
    for c, hw in ((64, 112), (1024, 14), (2048, 7)):
        out.append(add_bias_residual_case(256, c, hw, torch.bfloat16))
    for act in ("relu", "gelu", "gelu_tanh", "silu"):
        out.append(add_act_case(act, (16384, 16384), (16384,), torch.bfloat16))
    for c, hw in ((1024, 14), (2048, 7)):
        out.append(add_act_case("silu", (256, c, hw, hw), (c, 1, 1), torch.bfloat16))
    for c, hw in ((64, 112), (1024, 14), (2048, 7)):
        for channels_last in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                out.append(bn_case(256, c, hw, channels_last, dtype))
    # MobileNetV2's 3x3 depthwise convolutions (relu6) at batch 128: 144 channels at 56x56 (stride 1), 192 at
    # 28x28 (stride 2), 384 at 14x14 (stride 1); and EfficientNet-B0's 5x5 ones (silu): 240 channels at 28x28
    # (stride 1), 144 at 56x56 (stride 2).
    for c, hw, stride in ((144, 56, 1), (192, 28, 2), (384, 14, 1)):
        for channels_last in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                out.append(depthwise_case(128, c, hw, 3, stride, channels_last, dtype))
    out.append(depthwise_case(128, 240, 28, 5, 1, True, torch.bfloat16, act="silu"))
    out.append(depthwise_case(128, 144, 56, 5, 2, True, torch.bfloat16, act="silu"))
    out.append(depthwise_case(128, 144, 56, 5, 2, False, torch.bfloat16, act="silu"))
    out.append(depthwise_case(128, 144, 56, 5, 2, True, torch.float32, act="silu"))
    # The same layers with their batch norm fused in (MobileNetV2's expansion BN + ReLU6, EfficientNet-B0's SiLU).
    for channels_last in (False, True):
        out.append(bn_depthwise_case(128, 144, 56, 3, 1, channels_last, torch.bfloat16))
    out.append(bn_depthwise_case(128, 240, 28, 5, 1, True, torch.bfloat16, act="silu"))
    out.append(bn_depthwise_case(128, 192, 28, 3, 2, True, torch.float32))
    # A diffusion UNet's group norm + SiLU (32 groups): 320 channels at 64x64 and 1280 at 16x16 at batch 2 (too
    # few rows to fill the device: split rows), and 640 at 32x32 in float32 at batch 32 (looped rows, unsplit).
    for channels_last in (False, True):
        out.append(group_norm_act_case(2, 320, 64, 32, channels_last, torch.bfloat16))
    out.append(group_norm_act_case(2, 1280, 16, 32, False, torch.bfloat16))
    out.append(group_norm_act_case(32, 640, 32, 32, False, torch.float32))
    # Layer norm + GELU: ViT-B/16's tokens (one tile per row), ConvNeXt-T's first stage (channels last, 96 wide),
    # and rows of 16384 (looped).
    out.append(layer_norm_act_case((8, 197, 768), torch.bfloat16))
    out.append(layer_norm_act_case((8, 56, 56, 96), torch.bfloat16))
    out.append(layer_norm_act_case((16, 16384), torch.bfloat16))
    out.append(layer_norm_act_case((4096, 16384), torch.bfloat16))
    for model in ("resnet50", "gpt2"):
        for algorithm in ("adam", "sgd_momentum"):
            out.append(optim_case(algorithm, model, torch.float32, False))
            out.append(optim_case(algorithm, model, torch.bfloat16, True))
    for algorithm in ("adagrad", "lion", "lamb", "lars", "muon"):
        out.append(optim_case(algorithm, "resnet50", torch.float32, False))
    for model in ("resnet50", "gpt2"):
        out.append(clip_case(model, torch.float32))
    return out


# --------------------------------------------------------------------------- figures per launch


def _tile_elements(meta: dict) -> int | None:
    for rows, cols in (("BLOCK_ROWS", "BLOCK_COLS"), ("BLOCK_R", "BLOCK_C"), ("BLOCK_P", "BLOCK_C")):
        if rows in meta and cols in meta:
            return meta[rows] * meta[cols]
    return meta.get("BLOCK")


def _tensor_info(value: Any) -> dict | None:
    if not isinstance(value, torch.Tensor):
        return None
    return dict(numel=value.numel(), esize=value.element_size(), dtype=str(value.dtype).replace("torch.", ""),
                shape=list(value.shape))


def launch_record(compiler: Compiler, launch: Launch, case: str, gpu: Gpu = H100,
                  op_elements: int | None = None) -> dict:
    """Every static figure of one captured launch, as a JSON-able dict."""
    compiled, values = compiler.compile(launch.kernel, launch.args, launch.meta)
    occ = occupancy(compiled.resources["regs"], compiled.num_warps, compiled.shared, gpu)
    args, bytes_loaded, bytes_stored = [], 0, 0
    for param, value in zip(compiled.params, values):
        if not param["pointer"]:
            continue
        info = _tensor_info(value) or {}
        size = info.get("numel", 0) * info.get("esize", 0)
        loaded, stored = bool(param["loads"]), bool(param["stores"])
        bytes_loaded += size if loaded else 0
        bytes_stored += size if stored else 0
        args.append(dict(
            name=param["name"], **info, loads=sorted(set(param["loads"])), stores=sorted(set(param["stores"])),
            per_tile=sorted(set(param["per_tile"])), several_owners=param["several_owners"],
            stream=op_elements is not None and info.get("numel", 0) >= op_elements,
        ))
    tile = _tile_elements(launch.meta)
    threads = compiled.num_warps * gpu.warp_size
    per_thread = tile / threads if tile and not compiled.loops else None
    return dict(
        case=case, phase=launch.phase, kernel=compiled.name, grid=list(launch.grid), programs=launch.programs,
        programs_per_sm=launch.programs / gpu.sms, num_warps=compiled.num_warps, shared=compiled.shared,
        **compiled.resources,
        resident_blocks=occ.blocks, occupancy_limiter=occ.limiter, occupancy=occ.fraction(gpu),
        waves=launch.programs / (gpu.sms * occ.blocks),
        loads=sorted(set(vector_widths(compiled.ptx, "ld"))), stores=sorted(set(vector_widths(compiled.ptx, "st"))),
        args=args, loops=compiled.loops, barriers_loop=compiled.barriers_loop, barriers_total=compiled.barriers_total,
        sass_instructions=compiled.sass["instructions"], sass_bar=compiled.sass["bar"],
        sass_ldg=compiled.sass["ldg"], sass_stg=compiled.sass["stg"],
        tile_elements=tile,
        instructions_per_element=compiled.sass["instructions"] / per_thread if per_thread else None,
        bytes_loaded=bytes_loaded, bytes_stored=bytes_stored, key=compiled.short_key,
    )


def capture_cases(selected: Sequence[Case], gpu: Gpu = H100,
                  compiler: Compiler | None = None) -> list[tuple[Case, list[Launch]]]:
    """Each case's captured launches (``compiler`` answers the launchers' occupancy questions)."""
    captured = []
    for case in selected:
        with captured_launches(gpu, compiler) as capture:
            case.run(capture)
        captured.append((case, capture.launches))
    return captured


def run_cases(selected: Sequence[Case], compiler: Compiler, gpu: Gpu = H100,
              captured: list[tuple[Case, list[Launch]]] | None = None) -> tuple[list[dict], list[dict]]:
    """(launch records, phase records) of ``selected`` (or of the already ``captured`` cases)."""
    captured = capture_cases(selected, gpu, compiler) if captured is None else captured
    compiler.prefetch([launch for _, case_launches in captured for launch in case_launches])
    launches, phases = [], []
    for case, case_launches in captured:
        by_phase = {p.name: p for p in case.phases}
        records = []
        for launch in case_launches:
            phase = by_phase[launch.phase]
            record = launch_record(compiler, launch, case.name, gpu, op_elements=phase.elements)
            record["one_wave"] = record["kernel"] in case.one_wave
            records.append(record)
        launches += records
        for phase in case.phases:
            mine = [r for r in records if r["phase"] == phase.name]
            moved = sum(r["bytes_loaded"] + r["bytes_stored"] for r in mine)
            phases.append(dict(
                case=case.name, family=case.family, title=case.title, phase=phase.name, elements=phase.elements,
                launches=len(mine), kernels=[r["kernel"] for r in mine], bytes=moved, min_bytes=phase.min_bytes,
                bytes_per_element=moved / phase.elements, min_bytes_per_element=phase.min_bytes / phase.elements,
                ratio=moved / phase.min_bytes, note=phase.note,
            ))
    return launches, phases


def validate_on_cuda(selected: Sequence[Case], compiler: Compiler) -> list[dict]:
    """On a CUDA machine: runs every case for real and sets what the JIT built beside the static compile.

    Each launch goes through Triton as usual; afterwards the kernel the JIT
    compiled for it (same specialisation) is fetched with ``warmup`` and its
    registers and spills, read by the driver, are compared with the static
    figures, and its PTX with the PTX compiled here.
    """
    global _case_device
    records: list[dict] = []
    previous, _case_device = _case_device, torch.device("cuda")
    try:
        for case in selected:
            seen: list[Launch] = []

            def recording(kernel, grid, args, meta, device):
                seen.append(Launch(kernel, tuple(grid), tuple(args), dict(meta), "gpu"))

            with launch_mod.watch_launches(recording):
                case.run(Capture())
                torch.cuda.synchronize()
            for launch in seen:
                static, _ = compiler.compile(launch.kernel, launch.args, launch.meta)
                real = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
                if getattr(real, "n_regs", None) is None:
                    real._init_handles()
                records.append(dict(
                    kind="validate", case=case.name, kernel=static.name, grid=list(launch.grid),
                    static_regs=static.resources["regs"], gpu_regs=real.n_regs,
                    static_spill_bytes=static.resources["spill_stores"] + static.resources["spill_loads"],
                    gpu_spills=real.n_spills, same_ptx=real.asm["ptx"] == static.ptx,
                ))
            del seen
            torch.cuda.empty_cache()
    finally:
        _case_device = previous
    return records


# --------------------------------------------------------------------------- the table


def _widths(record: dict, kind: str) -> str:
    """Access widths in bits of the full-size streams (``x``: stream name) and of the rest, e.g. ``128 | 32``."""
    streams = sorted({w for a in record["args"] if a["stream"] for w in a[kind]})
    others = sorted({w for a in record["args"] if not a["stream"] for w in a[kind]})
    text = "/".join(map(str, streams)) or "-"
    return text + (f" (+{'/'.join(map(str, others))})" if others else "")


def load_measured(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    return json.loads(path.read_text())


def source_label() -> str:
    """Which kernels the figures describe: the git commit of the checkout, and whether it has local changes."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "tfuse"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "a source tree outside git"
    return f"commit {commit}" + (" with uncommitted changes to kernels/ or tfuse/" if dirty else "")


def markdown(launches: list[dict], phases: list[dict], compiler: Compiler, gpu: Gpu, seconds: float,
             measured: dict, source: str) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        "# Static roofline of tfuse's kernels on sm_90 (H100)",
        "",
        f"Generated by `python -m benchmarks.roofline` on {today} from {source}, with **Triton "
        f"{triton.__version__}** (its bundled ptxas, target sm_90a), torch {torch.__version__}, Python "
        f"{sys.version.split()[0]}. No GPU was used: {len(launches)} launches captured at the shapes below (meta "
        f"tensors, nothing allocated), {len(compiler.cache)} distinct specialisations compiled in {seconds:.0f} s.",
        "",
        f"Machine assumed for occupancy: {gpu.name}, {gpu.sms} SMs; per SM {gpu.regs_per_sm} registers (allocated "
        f"per warp in units of {gpu.reg_alloc_unit}), {gpu.max_warps} warps, {gpu.max_blocks} blocks, "
        f"{gpu.smem_per_sm // 1024} KiB shared memory with {gpu.smem_reserved_per_block} B reserved per block. "
        f"Reduction grids are what the launchers choose on a {gpu.sms}-SM device.",
        "",
        "Columns: **grid** programs launched; **/SM** programs per SM; **w** warps per program; **regs** registers "
        "per thread (from the cubin); **spill** spill stores/loads in bytes (ptxas -v); **smem** Triton's dynamic "
        "shared memory in bytes; **res** programs resident per SM and what limits them; **occ** theoretical "
        "occupancy; **ld / st** widths in bits of the global loads and stores of full-size operands (in parentheses: "
        "smaller operands such as per-channel parameters, block tables, partial sums; - none); **bar** `bar.sync` "
        "per tile: in the loop body for kernels with a loop (marked L), else in the whole kernel; **SASS/el** "
        "static SASS instructions per element a thread handles (loop-free kernels only); **MB** bytes the launch "
        "moves: each pointer argument it loads counts its tensor once, and once more if it stores it.",
        "",
        "These figures are static. They show a regression (a spill, a narrower access, an extra barrier, a grid "
        "that no longer fills the machine, an extra pass over a tensor) without a GPU; they are not timings.",
        "",
    ]
    titles = {p["case"]: p["title"] for p in phases}
    family = None
    for case in dict.fromkeys(p["case"] for p in phases):
        case_phases = [p for p in phases if p["case"] == case]
        if case_phases[0]["family"] != family:
            family = case_phases[0]["family"]
            cases_here = list(dict.fromkeys(p["case"] for p in phases if p["family"] == family))
            lines += [f"## {family}", ""]
            lines += [f"- `{c}`: {titles[c]}" for c in cases_here]
            lines += [
                "",
                "| case | phase | kernel | grid | /SM | w | regs | spill | smem | res | occ | ld | st | bar "
                "| SASS/el | MB |",
                "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|--:|--:|--:|",
            ]
        for r in (r for r in launches if r["case"] == case):
            per_elem = f"{r['instructions_per_element']:.1f}" if r["instructions_per_element"] else "-"
            bar = f"{r['barriers_loop']} L" if r["loops"] else f"{r['barriers_total']}"
            lines.append(
                f"| {case} | {r['phase']} | `{r['kernel']}` | {'x'.join(map(str, r['grid']))} "
                f"| {r['programs_per_sm']:.1f} | {r['num_warps']} | {r['regs']} "
                f"| {r['spill_stores']}/{r['spill_loads']} "
                f"| {r['shared']} | {r['resident_blocks']} {r['occupancy_limiter']} | {100 * r['occupancy']:.0f}% "
                f"| {_widths(r, 'loads')} | {_widths(r, 'stores')} | {bar} | {per_elem} "
                f"| {(r['bytes_loaded'] + r['bytes_stored']) / 1e6:,.1f} |"
            )
        if case == cases_here[-1]:
            lines.append("")
    lines += _bytes_section(phases)
    lines += _summary_section(launches)
    lines += _measured_section(launches, measured)
    return "\n".join(lines).rstrip() + "\n"


def _bytes_section(phases: list[dict]) -> list[str]:
    lines = [
        "## Bytes moved against the minimum, per op phase",
        "",
        "All launches of the phase, each pointer argument counted once per direction, against the bytes the op "
        "must move at least.",
        "",
        "| case | phase | launches | B/element | minimum | ratio | minimum counts |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for p in phases:
        lines.append(f"| {p['case']} | {p['phase']} | {p['launches']} | {p['bytes_per_element']:.2f} "
                     f"| {p['min_bytes_per_element']:.2f} | {p['ratio']:.2f}x | {p['note']} |")
    return lines + [""]


def _summary_section(launches: list[dict]) -> list[str]:
    worst: dict[str, dict] = {}
    for r in launches:
        w = worst.setdefault(r["kernel"], dict(launches=0, regs=0, spills=0, occ=1.0, bar=0, narrow=0, waves=[]))
        w["launches"] += 1
        w["regs"] = max(w["regs"], r["regs"])
        w["spills"] = max(w["spills"], r["spill_stores"] + r["spill_loads"])
        w["occ"] = min(w["occ"], r["occupancy"])
        w["bar"] = max(w["bar"], r["barriers_loop"] if r["loops"] else r["barriers_total"])
        w["narrow"] += any(a["stream"] and set(a["per_tile"]) - {128} for a in r["args"])
        if r["one_wave"]:
            w["waves"].append(r["programs_per_sm"] / r["resident_blocks"])
    lines = [
        "## Per kernel, over every case",
        "",
        "**one-wave fill**: for the two-stage reductions, whose grid is meant to be resident at once, programs per "
        "SM over programs resident per SM (1.0: every resident slot used; above 1.0: a second wave).",
        "",
        "| kernel | launches | max regs | max spill B | min occ | max bar | launches with a full-size operand under "
        "128 bits per tile | one-wave fill |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, w in sorted(worst.items()):
        fill = f"{min(w['waves']):.2f}-{max(w['waves']):.2f}" if w["waves"] else "-"
        lines.append(f"| `{name}` | {w['launches']} | {w['regs']} | {w['spills']} | {100 * w['occ']:.0f}% "
                     f"| {w['bar']} | {w['narrow']} | {fill} |")
    return lines + [""]


def _measured_section(launches: list[dict], measured: dict) -> list[str]:
    """Static figures next to the first H100 measurements (another Triton version; the kernels may have moved)."""
    if not measured:
        return []
    lines = [
        "## Next to the first H100 measurements",
        "",
        f"Measured on {measured.get('device', 'an H100')} with Triton {measured.get('triton', '?')}, "
        f"torch {measured.get('torch', '?')} ({measured.get('date', '?')}; {measured.get('source', '')}). "
        "The static columns are this table's (its Triton version, today's kernels); the kernels may have changed "
        "since the measurement, so a difference is a question, not a verdict.",
        "",
    ]
    check = measured.get("validation")
    if check:
        lines += [
            f"Static against real: on {check['date']} `{check['command']}` ran every case for real on an "
            f"{check['device']} (Triton {check['triton']}, {check['kernels']}) and fetched the kernel the JIT built "
            f"for each of its {check['launches']} launches: registers equal in {check['registers_equal']}, spills "
            f"agreeing in {check['spills_agree']}, PTX identical to the static compile's in {check['same_ptx']}.",
            "",
        ]
    by_key = {(r["case"], r["kernel"]): r for r in launches}
    ncu = measured.get("ncu", [])
    if ncu:
        lines += [f"Registers: static with Triton {triton.__version__} / ncu with Triton {measured.get('triton', '?')} "
                  "(the static compile with the measurement's Triton gives ncu's counts exactly: see above).", ""]
        lines += ["| kernel (case) | regs static / ncu | grid static / ncu | occ static / ncu theoretical / achieved "
                  "| ncu us |",
                  "|---|--:|--:|--:|--:|"]
        for entry in ncu:
            r = by_key.get((entry["case"], entry["kernel"]))
            if r is None:
                continue
            lines.append(
                f"| `{entry['kernel']}` ({entry['case']}) | {r['regs']} / {entry['regs']} "
                f"| {r['programs']} / {entry['grid']} | {100 * r['occupancy']:.0f}% / "
                f"{entry['theoretical_occupancy']:.0f}% / {entry['achieved_occupancy']:.0f}% "
                f"| {entry['duration_us']:.0f} |"
            )
        lines.append("")
    kernel_us = measured.get("kernels_us", [])
    if kernel_us:
        if measured.get("kernels_us_note"):
            lines += [f"Kernel times: {measured['kernels_us_note']}.", ""]
        lines += ["| case | kernel | us (measured) | static MB | GB/s (static bytes / measured time) |",
                  "|---|---|--:|--:|--:|"]
        for entry in kernel_us:
            for kernel, us in entry["us"].items():
                r = by_key.get((entry["case"], kernel))
                if r is None:
                    continue
                skipped = set(entry.get("not_written", []))
                moved = sum(a["numel"] * a["esize"] * (bool(a["loads"]) + bool(a["stores"]))
                            for a in r["args"] if a["name"] not in skipped and "numel" in a)
                lines.append(f"| {entry['case']} | `{kernel}` | {us:.1f} | {moved / 1e6:,.1f} | "
                             f"{moved / us / 1e3:,.0f} |")
        lines.append("")
    return lines


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", default=[], help="cases whose name contains this (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON lines (launches, then op phases), no table")
    parser.add_argument("--out", type=Path, default=None, help=f"table path (default {TABLE.relative_to(ROOT)})")
    parser.add_argument("--measured", type=Path, default=MEASURED, help="H100 measurements to set beside the figures")
    parser.add_argument("--source", default=None, help="what the figures describe (default: the git commit)")
    parser.add_argument("--validate-cuda", action="store_true",
                        help="on a GPU: run the cases for real and compare the JIT's kernels with the static compile")
    args = parser.parse_args(argv)
    selected = [c for c in cases() if not args.only or any(s in c.name for s in args.only)]
    if not selected:
        parser.error(f"no case matches {args.only}; cases: {', '.join(c.name for c in cases())}")
    start = time.perf_counter()
    compiler = Compiler()
    if args.validate_cuda:
        records = validate_on_cuda(selected, compiler)
        for record in records:
            print(json.dumps(record))
        bad = [r for r in records
               if r["static_regs"] != r["gpu_regs"] or (r["static_spill_bytes"] > 0) != (r["gpu_spills"] > 0)]
        print(json.dumps(dict(kind="validate_summary", triton=triton.__version__, launches=len(records),
                              mismatched=len(bad), same_ptx=sum(r["same_ptx"] for r in records),
                              seconds=round(time.perf_counter() - start, 1))))
        return 1 if bad else 0
    launches, phases = run_cases(selected, compiler)
    seconds = time.perf_counter() - start
    if args.json:
        for record in launches:
            print(json.dumps(dict(kind="launch", **record)))
        for record in phases:
            print(json.dumps(dict(kind="phase", **record)))
        return 0
    text = markdown(launches, phases, compiler, H100, seconds, load_measured(args.measured),
                    args.source or source_label())
    out = args.out or (TABLE if not args.only else None)
    if out is None:
        print(text)
    else:
        out.write_text(text)
        print(f"wrote {out} ({len(launches)} launches, {len(compiler.cache)} compiled, {seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared benchmark harness on ``triton.testing``.

* Configurations are ``triton.testing.Benchmark`` objects (x values, lines).
* The providers of a configuration (tfuse, eager, torch.compile, a reference
  copy) are timed interleaved over several rounds, in orders where every
  provider follows every other one equally often (a Williams design), so
  load from other processes and cache state left by the previous provider
  hit every column alike. GPU samples come from ``triton.testing.do_bench`` (CUDA
  events, L2 flushed between runs); on a CPU from ``time.perf_counter``
  around batches of calls, because ``do_bench`` needs a GPU driver.
* A time is the median of its samples, reported with its interquartile range.
* Bandwidth is computed from an explicit count of the bytes an op must move,
  and set against a copy: on a GPU the device copy bandwidth measured at the
  start of the run; on a CPU a copy of the same bytes timed in the same
  rounds (caches included).
* A number too noisy to mean anything (spread) or physically impossible
  (negative, faster than a copy allows, a speed-up beyond what the bytes
  allow) is flagged in the table and not drawn as a result.
* Reports are a markdown table and a PNG plot (a grid of panels with error
  bars), headed by the machine, the versions, the load and the date.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import gc
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where a benchmark ran."""

    device: torch.device
    name: str
    slug: str  # file-name form of the device, e.g. "cpu" or "nvidia-h200"
    torch_version: str
    triton_version: str
    python_version: str
    date: str
    interpreted: bool  # Triton kernels run through the interpreter (CPU only)
    load: float | None = None  # 1-minute load average when the run started (None where unknown)
    threads: int | None = None  # torch's intra-op threads (CPU runs)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def header(self) -> str:
        where = self.name + (" (GPU)" if self.on_gpu else " (CPU)")
        load = ""
        if not self.on_gpu:
            load = f" {self.threads} torch threads." if self.threads else ""
            load += f" Load average {self.load:.2f} when the run started." if self.load is not None else ""
        return (
            f"Machine: {where}; torch {self.torch_version}, triton {self.triton_version}, "
            f"Python {self.python_version}; measured {self.date}.{load}"
        )


def describe_machine() -> Machine:
    """The device benchmarks run on: the first CUDA GPU if any, else the CPU."""
    import tfuse

    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        name = _cpu_name()
    slug = "cpu" if device.type == "cpu" else gpu_slug(name)
    return Machine(
        device=device,
        name=name,
        slug=slug,
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        python_version=platform.python_version(),
        date=datetime.date.today().isoformat(),
        interpreted=device.type == "cpu" and tfuse.interpreter_active(),
        load=load_average(),
        threads=torch.get_num_threads(),
    )


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def gpu_slug(name: str) -> str:
    """File-name form of a GPU's name: the model for data-centre GPUs ("NVIDIA H100 80GB HBM3" -> "h100").

    Other names keep every word ("NVIDIA GeForce RTX 4090" -> "nvidia-geforce-rtx-4090").
    """
    model = re.search(r"\b([ABHL]\d{2,3})\b", name)
    if model:
        return model.group(1).lower()
    return "-".join(name.lower().replace("_", " ").split())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


# --- timing -----------------------------------------------------------------
#
# Every provider of a configuration (tfuse, eager, torch.compile, a reference
# copy) is timed in the same rounds: round r times each provider once, starting
# from a different one each round. A burst of load from another process then
# lands on every column alike instead of on whichever column was being timed,
# and the spread over rounds says how much to trust a median.

# A CPU sample is a batch of calls lasting at least this long (so the timer's
# overhead stays small against it), and rounds are added up to the budget. It is
# short on purpose: on a shared CPU another process takes a core for a scheduler
# tick (~4 ms) now and then, and the shorter a sample, the fewer samples such a
# pause spoils; the median skips them and the spread shows them.
_CPU_SAMPLE_S = 0.0002
_CPU_BUDGET_S = {False: 0.3, True: 0.03}  # per provider and configuration
_CPU_ROUNDS = {False: (15, 200), True: (4, 50)}  # (min, max); --quick is a smoke run: enough rounds for a spread
_CPU_ESTIMATE_CALLS = {False: 3, True: 1}  # calls timed to estimate one call (after the warm-up call)
# GPU: do_bench per round, its per-run times pooled over the rounds.
_GPU_ROUNDS = {False: 5, True: 3}
_GPU_WARMUP_MS = {False: 25, True: 5}
_GPU_REP_MS = {False: 100, True: 20}  # in all, split over the rounds

# A reference copy never moves more than this (a CPU's last-level cache can be
# hundreds of MB; beyond this a copy runs at DRAM speed whatever its size).
COPY_MAX_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Timing:
    """The samples (ms) of one provider in one configuration, with their median and spread."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(q1, q3): the interquartile range of the samples."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def lo(self) -> float:
        return min(self.samples)

    @property
    def hi(self) -> float:
        return max(self.samples)

    @property
    def rel_iqr(self) -> float:
        """Interquartile range over the median (0.1 = the middle half of the samples spans 10% of the median)."""
        q1, q3 = self.quartiles
        median = self.median
        return (q3 - q1) / median if median > 0 else math.inf


def time_interleaved(fns: Mapping[str, Callable[[], Any]], device: torch.device, quick: bool = False) -> dict[str, Timing]:
    """Times every function of ``fns`` in the same rounds (balanced orders: :func:`_rotated`); returns a Timing each.

    GPU: ``triton.testing.do_bench`` once per provider per round (device time,
    L2 flushed before each run); its per-run times are pooled over the rounds.
    CPU: ``time.perf_counter`` around batches of calls, garbage collection off.
    """
    names = list(fns)
    if not names:
        return {}
    if device.type == "cuda":
        return _time_gpu(fns, names, quick)
    return _time_cpu(fns, names, quick)


def _rotated(names: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: a row of a Williams design over the names.

    Rotating one fixed order would give every provider the same predecessor
    in every round, and on a CPU the one after the copy reference always ran
    with its data evicted from the caches (measured: a 6% penalty, always on
    the first provider, tfuse's column). Over a cycle of rows (n for an even
    number of names, 2n for odd: each row and its mirror), every provider
    follows every other one equally often, and starts a round equally often.
    """
    n = len(names)
    first = [0]
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...: consecutive differences all distinct mod n
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    row = round_index % (n if n % 2 == 0 else 2 * n)
    order = [names[(index + row) % n] for index in first]
    return order[::-1] if row >= n else order


def _time_gpu(fns: Mapping[str, Callable[[], Any]], names: list[str], quick: bool) -> dict[str, Timing]:
    rounds = _GPU_ROUNDS[quick]
    rep = max(5.0, _GPU_REP_MS[quick] / rounds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in _rotated(names, round_index):
            warmup = _GPU_WARMUP_MS[quick] if round_index == 0 else 2
            samples[name].extend(_do_bench_runs(fns[name], warmup, rep))
    return {name: Timing(tuple(samples[name])) for name in names}


def _do_bench_runs(fn: Callable[[], Any], warmup: float, rep: float) -> list[float]:
    """Per-run times of ``do_bench`` (return_mode="all"), or its quartiles where that mode is missing."""
    try:
        times = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
    except (AssertionError, TypeError, ValueError):
        times = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.1, 0.25, 0.5, 0.75, 0.9])
    return [float(t) for t in (times if isinstance(times, (list, tuple)) else [times])]


def _time_cpu(fns: Mapping[str, Callable[[], Any]], names: list[str], quick: bool) -> dict[str, Timing]:
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        calls = {}
        for name in names:  # warm-up, and an estimate of one call (the fastest of three; one in a smoke run)
            fn = fns[name]
            fn()
            estimate = math.inf
            for _ in range(_CPU_ESTIMATE_CALLS[quick]):
                begin = time.perf_counter()
                fn()
                estimate = min(estimate, time.perf_counter() - begin)
            calls[name] = (max(1, math.ceil(_CPU_SAMPLE_S / max(estimate, 1e-7))), estimate)
        round_s = sum(count * estimate for count, estimate in calls.values())
        low, high = _CPU_ROUNDS[quick]
        rounds = min(high, max(low, int(_CPU_BUDGET_S[quick] * len(names) / max(round_s, 1e-9))))
        samples: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            for name in _rotated(names, round_index):
                fn, count = fns[name], calls[name][0]
                begin = time.perf_counter()
                for _ in range(count):
                    fn()
                samples[name].append((time.perf_counter() - begin) * 1e3 / count)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(tuple(samples[name])) for name in names}


def median_ms(fn: Callable[[], Any], device: torch.device, quick: bool = False) -> float:
    """Median time of ``fn`` alone in milliseconds (a single provider; see time_interleaved for comparisons)."""
    return time_interleaved({"fn": fn}, device, quick)["fn"].median


def copy_reference(nbytes: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """A copy moving ``nbytes`` (read + write; at most COPY_MAX_BYTES) and the bytes it moves.

    Timed beside an op on a CPU, it is the bandwidth a kernel with the same
    working set can reach there, caches included.
    """
    elements = max(1, min(nbytes, COPY_MAX_BYTES) // 8)
    src = torch.empty(elements, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * elements * 4


def copy_bandwidth_gbps(device: torch.device, quick: bool = False) -> float:
    """Measured device copy bandwidth: bytes read + bytes written per second, in GB/s.

    The buffer is 256 MiB (well past a GPU's L2 and most CPUs' last-level
    cache); 16 MiB for --quick.
    """
    mib = 16 if quick else 256
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, quick)
    return gbps(2 * src.numel() * src.element_size(), ms)


def gbps(nbytes: int, ms: float) -> float:
    """Bytes per millisecond as GB/s (10**9 bytes per second)."""
    return nbytes / ms / 1e6


# --- plausibility -----------------------------------------------------------
#
# A number that is physically impossible or too noisy to mean anything is
# marked in the table and kept out of the plot's lines, never shown as a result.

NOISY_REL_IQR = 0.25  # the middle half of the samples spans more than 25% of the median
# How far above a copy's GB/s an op's minimum-byte GB/s may go. A GPU copy after
# do_bench's L2 flush runs near DRAM speed, and reads stream a little faster than
# copies. A CPU copy also reads every destination line before writing it (write-
# allocate), so it moves 1.5x its counted bytes, which an in-place or read-mostly
# op does not; and torch's copy_ of hundreds of MB stays below the peak (a fused
# in-place Adam step measured 2.1x the GB/s of a 716 MB copy on a 2-core Xeon).
COPY_SLACK = {"cuda": 1.25, "cpu": 3.0}
# A speed-up over eager can be at most the traffic (or launch) ratio; this is the slack on top.
RATIO_SLACK = 2.0
# On a loaded CPU a multi-threaded op waits a scheduler tick (~4 ms) for a
# thread whose core another process holds, and every time in a row becomes a
# multiple of it (7.99, 15.99, 31.99 ms) whatever the op: consistent, so no
# spread shows it. A canary shows it: a copy of CANARY_BYTES (multi-threaded:
# torch splits work above 32768 elements) timed in the same rounds as the row,
# against the same copy on one thread (which waits for no other) measured at the
# start. Healthy, more threads are never slower; STALL_FACTOR times slower is a stall.
STALL_FACTOR = 4.0
CANARY_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Flag:
    """Why a number is not a result: ``kind`` is "noisy" or "implausible"."""

    kind: str
    reason: str

    def __post_init__(self) -> None:
        if self.kind not in ("noisy", "implausible"):
            raise ValueError(f"Flag kind must be 'noisy' or 'implausible', got {self.kind!r}")


def round_order(round_index: int, count: int) -> list[int]:
    """The order in which round ``round_index`` visits ``count`` configurations: each round starts one later,
    so drift on a shared machine hits them all alike."""
    shift = round_index % count
    return list(range(shift, count)) + list(range(shift))


def worse_flag(a: Flag | None, b: Flag | None) -> Flag | None:
    """The graver of two flags (implausible over noisy; the first of equals), or None when neither is set."""
    if a is None or (b is not None and b.kind == "implausible" and a.kind == "noisy"):
        return b
    return a


def check_timing(
    name: str,
    timing: Timing,
    *,
    nbytes: int | None = None,
    reference_gbps: float | None = None,
    slack: float = COPY_SLACK["cpu"],
    max_rel_iqr: float = NOISY_REL_IQR,
) -> Flag | None:
    """The flag of one provider's timing, or None when it can be reported.

    Implausible: a time at or below zero, or (given the op's minimum bytes and a
    copy's GB/s) a bandwidth above ``slack`` times the copy's. Noisy: an
    interquartile range above ``max_rel_iqr`` of the median.
    """
    if not all(math.isfinite(t) for t in timing.samples) or timing.lo <= 0:
        return Flag("implausible", f"{name}: a time of {timing.lo:.4g} ms (not positive)")
    if nbytes and reference_gbps:
        achieved = gbps(nbytes, timing.median)
        if achieved > slack * reference_gbps:
            return Flag("implausible", f"{name}: {achieved:.1f} GB/s, over {slack:g}x a copy's {reference_gbps:.1f} GB/s")
    if timing.rel_iqr > max_rel_iqr:
        return Flag("noisy", f"{name}: spread (IQR) {timing.rel_iqr:.0%} of the median")
    return None


def check_stall(canary: Timing, reference_gbps: float | None, canary_nbytes: int = CANARY_BYTES) -> Flag | None:
    """Implausible when the canary copy timed with a row ran STALL_FACTOR times slower than ``reference_gbps``
    (the same copy on one thread, measured at the start of the run)."""
    if canary.median <= 0 or not reference_gbps:
        return None
    achieved = gbps(canary_nbytes, canary.median)
    if achieved * STALL_FACTOR < reference_gbps:
        return Flag("implausible", f"stalled: a {canary_nbytes >> 20} MiB copy timed with this row ran at {achieved:.2f} GB/s, "
                                   f"under 1/{STALL_FACTOR:g} of the {reference_gbps:.1f} GB/s of the same copy on one thread, "
                                   "so no time in this row is a result")
    return None


def single_thread_copy_gbps(device: torch.device) -> float | None:
    """GB/s of a CANARY_BYTES copy on one thread (CPU only; None on a GPU): the stall check's reference."""
    if device.type != "cpu":
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy, nbytes = copy_reference(CANARY_BYTES, device)
        return gbps(nbytes, time_interleaved({"copy": copy}, device)["copy"].median)
    finally:
        torch.set_num_threads(threads)


def check_ratio(name: str, value: float, bound: float | None) -> Flag | None:
    """Implausible when a speed-up is not positive or exceeds ``bound`` (what the bytes or launches allow)."""
    if not math.isfinite(value) or value <= 0:
        return Flag("implausible", f"{name}: {value:.3g}x (not positive)")
    if bound is not None and value > bound:
        return Flag("implausible", f"{name}: {value:.2f}x, more than the {bound:.2f}x the traffic allows")
    return None


def difference(minuend: Timing, subtrahend: Timing, name: str) -> tuple[float, Flag | None]:
    """``minuend - subtrahend`` of two medians (e.g. step time minus backward time) and its flag.

    The difference of two times that each include the same work cannot be
    negative: below zero by more than the two half-IQRs together it is
    implausible; within them (either sign) it is noise.
    """
    value = minuend.median - subtrahend.median
    spread = sum((t.quartiles[1] - t.quartiles[0]) / 2 for t in (minuend, subtrahend))
    if value < -spread:
        return value, Flag("implausible", f"{name}: {value:.3g} ms, below zero by more than the spread ({spread:.2g} ms)")
    if abs(value) <= spread:
        return value, Flag("noisy", f"{name}: {value:.3g} ms, within the spread ({spread:.2g} ms)")
    return value, None


def finish_row(
    row: dict[str, Any],
    timings: Mapping[str, Timing],
    ctx: "Context",
    *,
    nbytes: int | None = None,
    copy_nbytes: int | None = None,
    base: str = "tfuse",
    ratios: Mapping[str, str] | None = None,
    ratio_bounds: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Fills a row from interleaved timings: ``<p>_ms`` (median), ``<p>_ms_range`` (IQR), ``<p>_gbps``,
    ``pct_copy``, the speed-ups ``ratios`` (row key -> provider, e.g. {"vs_eager": "eager"}) of ``base``,
    and ``flags`` (row key -> Flag) for every number that is noisy or implausible.

    A "copy" entry in ``timings`` (a copy of ``copy_nbytes``, timed in the same
    rounds) is the bandwidth reference; without one, the run's device copy
    bandwidth is. A "canary" entry (CANARY_BYTES) is checked for a stall, which
    marks every time in the row.
    """
    flags: dict[str, Flag] = row.setdefault("flags", {})
    slack = COPY_SLACK.get(ctx.machine.device.type, COPY_SLACK["cpu"])
    reference = bound = ctx.copy_gbps
    copy_flag = None
    stall = check_stall(timings["canary"], ctx.stall_reference_gbps) if "canary" in timings else None
    copy_timing = timings.get("copy")
    if copy_timing is not None and copy_nbytes and copy_timing.lo > 0:
        reference = gbps(copy_nbytes, copy_timing.median)
        bound = gbps(copy_nbytes, copy_timing.lo)  # the fastest copy: a noisy copy does not lower the bound
        q1, q3 = copy_timing.quartiles
        row["copy_gbps"] = reference
        row["copy_gbps_range"] = (gbps(copy_nbytes, q3), gbps(copy_nbytes, q1))
        copy_flag = stall or check_timing("copy", copy_timing)
        if copy_flag is not None:
            flags["copy_gbps"] = copy_flag
    provider_flags: dict[str, Flag | None] = {}
    for name, timing in timings.items():
        if name in ("copy", "canary"):
            continue
        q1, q3 = timing.quartiles
        row[f"{name}_ms"] = timing.median
        row[f"{name}_ms_range"] = (q1, q3)
        flag = stall or check_timing(name, timing, nbytes=nbytes, reference_gbps=bound, slack=slack)
        provider_flags[name] = flag
        if nbytes:
            row[f"{name}_gbps"] = gbps(nbytes, timing.median)
            row[f"{name}_gbps_range"] = (gbps(nbytes, q3), gbps(nbytes, q1))
        for key in (f"{name}_ms", f"{name}_gbps"):
            if flag is not None:
                flags[key] = flag
    if nbytes and base in timings and reference:
        row["pct_copy"] = 100 * row[f"{base}_gbps"] / reference
        flag = worse_flag(provider_flags.get(base), copy_flag)
        if flag is not None:
            flags["pct_copy"] = flag
    for key, other in (ratios or {}).items():
        if other not in timings or base not in timings:
            continue
        value = timings[other].median / timings[base].median if timings[base].median > 0 else math.inf
        row[key] = value
        flag = worse_flag(worse_flag(provider_flags.get(base), provider_flags.get(other)),
                      check_ratio(key, value, (ratio_bounds or {}).get(key)))
        if flag is not None:
            flags[key] = flag
    return row


def flag_summary(rows: Sequence[dict[str, Any]]) -> str:
    """One line: how many rows carry implausible or noisy numbers."""
    kinds = [{flag.kind for flag in row.get("flags", {}).values()} for row in rows]
    implausible = sum("implausible" in k for k in kinds)
    noisy = sum(k == {"noisy"} for k in kinds)
    if not implausible and not noisy:
        return f"all {len(rows)} rows passed the plausibility and spread checks."
    return (f"{implausible + noisy} of {len(rows)} rows have marked numbers ({implausible} with implausible ones, "
            f"{noisy} with noisy ones only); see the check column. Marked numbers are not results: rerun on a quieter "
            "machine.")


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[[], Any]) -> int:
    """How many ATen operators ``fn`` dispatches (one kernel each for elementwise ops)."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def grid(bench: triton.testing.Benchmark) -> list[dict[str, Any]]:
    """Every configuration of a ``triton.testing.Benchmark``: its fixed args plus one x value."""
    configs = []
    for x in bench.x_vals:
        values = x if isinstance(x, (list, tuple)) and len(bench.x_names) > 1 else [x] * len(bench.x_names)
        configs.append({**bench.args, **dict(zip(bench.x_names, values))})
    return configs


@dataclasses.dataclass
class Column:
    """A column of a report table: row key, header, and number format.

    ``spread``: the cell also shows the half interquartile range of the
    samples, relative to the median (from ``<key>_range``). A number flagged
    in the row's ``flags`` is followed by its kind, e.g. "(noisy)".
    """

    key: str
    header: str
    fmt: str = "{}"
    spread: bool = False

    def render(self, row: dict[str, Any]) -> str:
        if self.key == "check":
            return check_text(row)
        value = row.get(self.key)
        if value is None:
            return "-"
        text = self.fmt.format(value)
        value_range = row.get(f"{self.key}_range")
        if self.spread and value_range and value:
            text += f" ±{(value_range[1] - value_range[0]) / 2 / abs(value):.0%}"
        flag = row.get("flags", {}).get(self.key)
        if flag is not None:
            text += f" ({flag.kind})"
        return text


CHECK_COLUMN = Column("check", "check")


def check_text(row: dict[str, Any]) -> str:
    """The row's check cell: "ok", or each distinct reason for a flag."""
    reasons = list(dict.fromkeys(f"{flag.kind}: {flag.reason}" for flag in row.get("flags", {}).values()))
    return "; ".join(reasons) if reasons else "ok"


def panel_grid(panels: int, max_columns: int = 3) -> tuple[int, int]:
    """(rows, columns) of a plot with ``panels`` panels, at most ``max_columns`` to a row."""
    columns = max(1, min(max_columns, panels))
    return max(1, math.ceil(panels / columns)), columns


@dataclasses.dataclass
class Report:
    """A benchmark's result: notes, a table, and the series to plot."""

    name: str
    title: str
    notes: list[str]
    columns: list[Column]
    rows: list[dict[str, Any]]
    # Plot: rows whose "plot" is not False, one panel per value of the
    # plot_panels key, x from plot_x, one line per (row key, label); error
    # bars from "<row key>_range" (the samples' interquartile range).
    plot_panels: str = "series"
    plot_x: str = "numel"
    plot_lines: Sequence[tuple[str, str]] = ()  # (row key, legend label)
    plot_xlabel: str = "elements per tensor"
    plot_ylabel: str = "GB/s"
    reference_line: tuple[float, str] | None = None  # (y, label), e.g. copy bandwidth
    timing_note: str | None = None  # how the times were taken, when not the harness's interleaved rounds

    def markdown(self, machine: Machine) -> str:
        lines = [f"# {self.title}", "", machine.header(), ""]
        lines += [f"- {note}" for note in self.notes]
        lines.append(f"- {self.timing_note or timing_note(machine)}")
        if machine.on_gpu:
            lines.append(
                "- GPU times are device times (triton.testing.do_bench): host overhead per call is hidden "
                "while it is shorter than do_bench's cache flush (~0.1 ms); `python -m benchmarks.micro --only host` "
                "measures it."
            )
        if any(c.key == "check" for c in self.columns):
            lines.append(f"- Checks: {flag_summary(self.rows)}")
        lines += ["", "| " + " | ".join(c.header for c in self.columns) + " |"]
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(c.render(row).replace("|", "/") for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def csv_rows(self) -> list[dict[str, Any]]:
        """The table as numbers, one dict per configuration, for users who plot their own: each column's raw
        value under its key (a time column's quartiles too, as ``<key>_q1`` and ``<key>_q3``; the check column
        as its text)."""
        result = []
        for row in self.rows:
            out: dict[str, Any] = {}
            for column in self.columns:
                out[column.key] = column.render(row) if column.key == "check" else row.get(column.key)
                if column.spread:
                    low, high = row.get(f"{column.key}_range") or (None, None)
                    out[f"{column.key}_q1"], out[f"{column.key}_q3"] = low, high
            result.append(out)
        return result

    def write(self, machine: Machine, out_dir: Path) -> list[Path]:
        """Writes ``<name>-<device>.md``, the same rows as numbers in ``.csv``, and, when there is something to
        plot, ``.png``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        table = out_dir / f"{self.name}-{machine.slug}.md"
        table.write_text(self.markdown(machine))
        rows = self.csv_rows()
        numbers = out_dir / f"{self.name}-{machine.slug}.csv"
        with numbers.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [c.key for c in self.columns])
            writer.writeheader()
            writer.writerows(rows)
        written = [table, numbers]
        if self.plot_lines and any(row.get("plot", True) for row in self.rows):
            plot = out_dir / f"{self.name}-{machine.slug}.png"
            self.plot(machine, plot)
            written.append(plot)
        return written

    def plot(self, machine: Machine, path: Path) -> Any:
        """Draws the plot to ``path``: a grid of panels (at most 3 to a row), error bars, flagged points as x."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plotted = [row for row in self.rows if row.get("plot", True)]
        panels = list(dict.fromkeys(row[self.plot_panels] for row in plotted))
        n_rows, n_cols = panel_grid(len(panels))
        fig, axes = plt.subplots(n_rows, n_cols, figsize=(5.2 * n_cols, 3.9 * n_rows + 0.6), squeeze=False)
        flat_axes = list(axes.flat)
        for ax, panel in zip(flat_axes, panels):
            rows = [r for r in plotted if r[self.plot_panels] == panel]
            xs_all = list(dict.fromkeys(r[self.plot_x] for r in rows))
            categorical = any(isinstance(x, str) for x in xs_all)
            position = {x: i for i, x in enumerate(xs_all)}

            def at(x: Any) -> Any:
                return position[x] if categorical else x

            noisy_points: list[tuple[Any, float]] = []
            for index, (key, label) in enumerate(self.plot_lines):
                color = f"C{index}"
                points = [r for r in rows if r.get(key) is not None]
                good = [r for r in points if getattr(r.get("flags", {}).get(key), "kind", None) != "implausible"]
                bad = [r for r in points if getattr(r.get("flags", {}).get(key), "kind", None) == "implausible"]
                if good:
                    xs = [at(r[self.plot_x]) for r in good]
                    ys = [r[key] for r in good]
                    ranges = [r.get(f"{key}_range") or (r[key], r[key]) for r in good]
                    yerr = [[max(0.0, y - lo) for y, (lo, _) in zip(ys, ranges)],
                            [max(0.0, hi - y) for y, (_, hi) in zip(ys, ranges)]]
                    ax.errorbar(xs, ys, yerr=yerr, marker="o", markersize=4, capsize=3, color=color, label=label)
                    noisy_points += [(x, y) for x, y, r in zip(xs, ys, good) if key in r.get("flags", {})]
                if bad:
                    ax.plot([at(r[self.plot_x]) for r in bad], [r[key] for r in bad], linestyle="none", marker="x",
                            markersize=8, color=color, label=f"{label}: implausible, not a result")
            if noisy_points:
                ax.plot(*zip(*noisy_points), linestyle="none", marker="o", markersize=10, markerfacecolor="none",
                        color="gray", label="noisy (wide spread)")
            if self.reference_line:
                y, label = self.reference_line
                ax.axhline(y, linestyle="--", color="gray", label=label)
            if categorical or len(xs_all) == 1:
                ax.set_xticks([at(x) for x in xs_all])
                ax.set_xticklabels([f"{x:,}" if isinstance(x, int) else str(x) for x in xs_all], rotation=20, fontsize=8)
                if not categorical:
                    ax.set_xlim(xs_all[0] * 0.9, xs_all[0] * 1.1)
            elif len(xs_all) > 1 and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 10:
                ax.set_xscale("log")
            ax.set_title(str(panel), fontsize=9)
            ax.set_xlabel(self.plot_xlabel)
            ax.set_ylabel(self.plot_ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        for ax in flat_axes[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(f"{self.title}\n{machine.name}, torch {machine.torch_version}, triton {machine.triton_version}; "
                     "bars: interquartile range", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return fig


def timing_note(machine: Machine) -> str:
    """How the harness times and flags, for the notes of a table."""
    if machine.on_gpu:
        how = "triton.testing.do_bench in every round, its per-run times pooled"
        copy = f"{COPY_SLACK['cuda']:g}x the device copy bandwidth"
    else:
        how = "time.perf_counter around batches of calls lasting at least 0.2 ms, garbage collection off"
        copy = f"{COPY_SLACK['cpu']:g}x the fastest copy of the same bytes in the same rounds"
    return (
        "Timing: the columns of a row are timed interleaved, over rounds whose orders let every column follow every "
        f"other equally often ({how}); a time is the median, ± half the interquartile range relative to it. A number marked "
        f"(noisy) has an interquartile range over {NOISY_REL_IQR:.0%} of its median (or derives from one); "
        f"(implausible) is physically impossible: a time at or below zero, a GB/s over {copy}, a speed-up beyond "
        "what the bytes or launches allow"
        + ("" if machine.on_gpu else
           f", or a row timed while the CPU stalled (a {CANARY_BYTES >> 20} MiB copy timed in the same rounds ran "
           f"{STALL_FACTOR:g}x slower than on one thread at the start)")
        + ". Marked numbers are not results."
    )


def copy_note(ctx: "Context") -> str:
    """The notes' sentence on the copy bandwidth and what "% of copy BW" compares with."""
    size = "16 MiB" if ctx.quick else "256 MiB"
    measured = f"Device copy bandwidth measured at the start of this run: {ctx.copy_gbps:.1f} GB/s (read + write, {size})."
    if ctx.machine.on_gpu:
        return measured + " % of copy BW is against it (do_bench flushes L2, so no row is cache-resident)."
    return (measured + " % of copy BW is against a copy of the same number of bytes (at most 1 GiB) timed in the "
            "same rounds as the row, so a row whose bytes fit in the CPU's caches is set against a cache-resident copy.")


QUICK_COMPILE_NOTE = (
    "Quick run (--quick, a smoke run): the compile columns are torch.compile's aot_eager backend (dynamo and "
    "AOTAutograd, no inductor code generation); full runs compile with inductor."
)


@dataclasses.dataclass
class Context:
    """What every benchmark gets: the machine and the run's options."""

    machine: Machine
    copy_gbps: float
    quick: bool
    use_compile: bool
    stall_reference_gbps: float | None = None  # single_thread_copy_gbps() at the start (CPU runs)
    compiled_references: int = 0  # compile_reference calls (the quick run's note)

    def compile_reference(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """torch.compile of an eager reference (the "compile" columns), from a fresh dynamo cache (no recompile
        limits, no reuse across configurations). A --quick smoke run compiles with the ``aot_eager`` backend
        (dynamo and AOTAutograd, no code generation: the columns' plumbing at a fraction of the cost; the
        report says so, see QUICK_COMPILE_NOTE); every other run with inductor."""
        torch._dynamo.reset()
        self.compiled_references += 1
        return torch.compile(fn, dynamic=False, backend="aot_eager" if self.quick else "inductor")

    def measure(self, providers: Mapping[str, Callable[[], Any]], nbytes: int | None = None) -> tuple[dict[str, Timing], int | None]:
        """Times ``providers`` interleaved. On a CPU it adds a "canary" (stall check) and, with ``nbytes``,
        a "copy" of as many bytes (the bandwidth reference).

        Returns the timings and the bytes the reference copy moved (None without one).
        """
        fns = dict(providers)
        copy_nbytes = None
        if not self.machine.on_gpu:
            if nbytes:
                fns["copy"], copy_nbytes = copy_reference(nbytes, self.machine.device)
            if self.stall_reference_gbps:
                fns["canary"], _ = copy_reference(CANARY_BYTES, self.machine.device)
        return time_interleaved(fns, self.machine.device, self.quick), copy_nbytes


class Progress:
    """Prints "[name i/n, elapsed] what" to stderr as a benchmark goes through its configurations."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, total, 0
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        print(f"[{self.name} {self.done}/{self.total}, {elapsed:.0f} s] {what}", file=sys.stderr, flush=True)


def training_call(fn: Callable[..., torch.Tensor], leaves: Sequence[torch.Tensor],
                  grad_out: torch.Tensor | None) -> Callable[[], None]:
    """A provider: ``fn(*leaves)``, then (with ``grad_out``) the gradients of ``leaves`` through it."""

    def step() -> None:
        y = fn(*leaves)
        if grad_out is not None:
            torch.autograd.grad(y, leaves, grad_out)

    return step


def saved_for_backward_bytes(fn: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors autograd keeps for backward while running ``fn``.

    Storages of ``exclude`` (the inputs, which exist anyway) and of ``fn``'s
    output (which the next layer holds anyway) are not counted, so the
    number is the activation memory the op itself adds. Returns it with the output.
    """
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in (*exclude, out)}
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), out

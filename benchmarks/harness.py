"""Shared benchmark harness on ``triton.testing``.

* Configurations are ``triton.testing.Benchmark`` objects (x values, lines).
* GPU timings are ``triton.testing.do_bench`` medians (CUDA events, L2 cache
  flushed between runs). On a CPU the same median comes from a wall-clock
  loop, because ``do_bench`` needs a GPU driver.
* Bandwidth is computed from an explicit count of the bytes an op must move,
  and set against the device's copy bandwidth measured in the same run.
* Reports are a markdown table and a PNG plot under ``benchmarks/results/``,
  headed by the machine, the versions and the date.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
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

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def header(self) -> str:
        where = self.name + (" (GPU)" if self.on_gpu else " (CPU)")
        return (
            f"Machine: {where}; torch {self.torch_version}, triton {self.triton_version}, "
            f"Python {self.python_version}; measured {self.date}."
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
    )


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


def median_ms(fn: Callable[[], Any], device: torch.device, quick: bool = False) -> float:
    """Median time of ``fn`` in milliseconds."""
    if device.type == "cuda":
        warmup, rep = (5, 20) if quick else (25, 100)
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    for _ in range(2 if quick else 3):
        fn()
    budget_s = 0.05 if quick else 0.5
    times = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 1000):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, quick: bool = False) -> float:
    """Measured device copy bandwidth: bytes read + bytes written per second, in GB/s.

    The buffer is 256 MiB (well past a GPU's L2 or a CPU's L3); 16 MiB for --quick.
    """
    mib = 16 if quick else 256
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, quick)
    return gbps(2 * src.numel() * src.element_size(), ms)


def gbps(nbytes: int, ms: float) -> float:
    """Bytes per millisecond as GB/s (10**9 bytes per second)."""
    return nbytes / ms / 1e6


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
    """A column of a report table: row key, header, and number format."""

    key: str
    header: str
    fmt: str = "{}"

    def render(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        return self.fmt.format(value)


@dataclasses.dataclass
class Report:
    """A benchmark's result: notes, a table, and the series to plot."""

    name: str
    title: str
    notes: list[str]
    columns: list[Column]
    rows: list[dict[str, Any]]
    # Plot: rows whose "plot" is not False, one panel per value of the
    # plot_panels key, x from plot_x, one line per (row key, label).
    plot_panels: str = "series"
    plot_x: str = "numel"
    plot_lines: Sequence[tuple[str, str]] = ()  # (row key, legend label)
    plot_xlabel: str = "elements per tensor"
    plot_ylabel: str = "GB/s"
    reference_line: tuple[float, str] | None = None  # (y, label), e.g. copy bandwidth

    def markdown(self, machine: Machine) -> str:
        lines = [f"# {self.title}", "", machine.header(), ""]
        lines += [f"- {note}" for note in self.notes]
        if machine.on_gpu:
            lines.append(
                "- GPU times are device times (triton.testing.do_bench, median): host overhead per call is hidden "
                "while it is shorter than do_bench's cache flush (~0.1 ms); `python -m benchmarks.micro --only host` "
                "measures it."
            )
        lines += ["", "| " + " | ".join(c.header for c in self.columns) + " |"]
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(c.render(row) for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def write(self, machine: Machine, out_dir: Path) -> list[Path]:
        """Writes ``<name>-<device>.md`` and, when there is something to plot, ``.png``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        table = out_dir / f"{self.name}-{machine.slug}.md"
        table.write_text(self.markdown(machine))
        written = [table]
        if self.plot_lines and self.rows:
            plot = out_dir / f"{self.name}-{machine.slug}.png"
            self._plot(machine, plot)
            written.append(plot)
        return written

    def _plot(self, machine: Machine, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plotted = [row for row in self.rows if row.get("plot", True)]
        panels = list(dict.fromkeys(row[self.plot_panels] for row in plotted))
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            rows = [r for r in plotted if r[self.plot_panels] == panel]
            for key, label in self.plot_lines:
                points = [(r[self.plot_x], r[key]) for r in rows if r.get(key) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=label)
            if self.reference_line:
                y, label = self.reference_line
                ax.axhline(y, linestyle="--", color="gray", label=label)
            ax.set_xscale("log")
            ax.set_title(str(panel))
            ax.set_xlabel(self.plot_xlabel)
            ax.set_ylabel(self.plot_ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"{self.title}\n{machine.name}, torch {machine.torch_version}, triton {machine.triton_version}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


@dataclasses.dataclass
class Context:
    """What every benchmark gets: the machine and the run's options."""

    machine: Machine
    copy_gbps: float
    quick: bool
    use_compile: bool


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

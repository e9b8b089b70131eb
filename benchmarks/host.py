"""Host census: what one training step costs the host, per model, on a CPU (``python -m benchmarks --only host``).

On a GPU the host queues kernels while the device runs earlier ones; when
the host is slower per step than the device, the host is the step time. This
census measures the host side on a machine without a GPU, for the three
models of the end-to-end benchmark at reduced width on tiny inputs (so that
the CPU's own arithmetic in torch's layers stays small), side by side:

* ``eager``: the eager step of :mod:`benchmarks.e2e_step` (nn layers,
  ``SGD(fused=True)``/``AdamW(fused=True)``, torch's clip);
* ``tfuse (Triton launch path)``: the tfuse step with tfuse's ops on their
  Triton path, launched as on a GPU into a stubbed driver: the first launch
  of a specialisation through Triton's own Python launch path (argument
  binding, specialisation key, kernel cache lookup, grid, launch metadata),
  later ones as tfuse's prepared launches (:mod:`tfuse._launch`); the
  compiled kernel's launcher (Triton's launcher object and
  ``cuLaunchKernel``, a few microseconds on a GPU host, the same for any
  caller) is a no-op and the kernels do not run;
* ``tfuse (launches as no-ops)``: the same step with every launch replaced by
  a counter: tfuse's own Python per op.

Per step it counts Triton launches by kernel, aten ops that are not views
(each is about one CUDA kernel on a GPU; the census lists ``copy_`` apart,
where gradient copies into flat buffers would show), and times host ms
(median and quartiles of single steps, modes interleaved round by round).
The host ms include the CPU arithmetic of torch's layers on the tiny inputs
(the same in every mode); kernels stubbed out leave uninitialised outputs,
so tfuse's step computes on garbage: its values are not checked here (the
test suite checks them).

The census runs in a child process without ``TRITON_INTERPRET`` (Triton's
launch path exists only for compiled kernels).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

NAME = "host"
MODELS = (("resnet50", "channels_last", 2), ("mobilenet_v2", "channels_last", 2), ("gpt2", "tokens", 2))
MODES = ("eager", "tfuse (Triton launch path)", "tfuse (launches as no-ops)")
SM_COUNT = 132  # what the launchers' grids are sized for (an H100 SXM)


# ------------------------------------------------------------------------------ the Triton path on a CPU


class _StubKernel:
    """What Triton's launch path gets from its kernel cache in place of a compiled kernel: launches do nothing."""

    function = None
    packed_metadata = None

    def __init__(self, name: str) -> None:
        self.name = name

    def launch_metadata(self, grid: Any, stream: Any, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


class _StubDriver:
    """The parts of a Triton driver that a launch asks for: device 0, stream 0, an sm_90 target."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


_STUB_PLANS: dict = {}


@contextlib.contextmanager
def triton_path(launches: str, *, count: bool = True) -> Iterator[collections.Counter]:
    """tfuse's ops on their Triton path on CPU tensors; ``launches`` is ``"stub"`` or ``"noop"``.

    Yields a counter of launches by kernel name, filled in either mode unless
    ``count`` is False (timing the stub path: a counter would add its own cost
    to each launch; no-op launches are counted always, that is all they do).
    """
    import triton.runtime.jit as jit
    from triton.runtime.driver import driver

    from tfuse import _launch

    counts: collections.Counter = collections.Counter()

    def tally(kernel, grid, args, meta, device):  # noqa: ANN001, ANN202
        counts[_launch.kernel_name(kernel)] += 1

    real_compile = jit.JITFunction._do_compile

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):  # noqa: ANN001, ANN202
        kernel = self.device_caches[device][0][key] = _StubKernel(_launch.kernel_name(self))
        return kernel

    jit.JITFunction._do_compile = stub_compile
    previous = driver._active  # (None until a launch asked; reset_active would look for a real driver)
    driver.set_active(_StubDriver())
    # Prepared launches of stub kernels live in their own table, kept from one block to the next (as a real
    # process keeps its prepared launches from step to step) and never seen outside these blocks.
    real_plans, _launch._plans = _launch._plans, _STUB_PLANS
    try:
        watching = _launch.watch_launches(tally, run=False) if launches == "noop" else (
            _launch.watch_launches(tally) if count else contextlib.nullcontext())
        with _launch.simulate_gpu(SM_COUNT), watching:
            yield counts
    finally:
        driver._active = previous
        jit.JITFunction._do_compile = real_compile
        _launch._plans = real_plans


# ------------------------------------------------------------------------------ one launch, three ways


def launch_micro(repeats: int = 2000, rounds: int = 5) -> list[dict[str, Any]]:
    """Host us per launch of tfuse's kernels into the stub driver, three ways, side by side.

    The launches are those of a training-mode batch norm forward (ResNet-50's
    shape at tiny width: statistics, merge, normalise; 7-15 runtime arguments,
    6-11 meta-parameters) and an n-ary add. Per launch, medians over
    ``rounds`` interleaved rounds of ``repeats`` launches:

    * ``triton``: ``kernel[grid](*args, **meta)``, Triton's own launch path;
    * ``launch()``: :func:`tfuse._launch.launch`, the seam every op uses
      (site lookup by grid and meta, then the prepared launch);
    * ``plan``: a :class:`tfuse._launch.LaunchPlan` held by the op (batch
      norm's plans hold one per pass): the prepared launch alone.

    No counter or watcher is open (each would add its own cost to a launch).
    """
    import tfuse
    from tfuse import _launch

    x = torch.randn(2, 64, 8, 8).to(memory_format=torch.channels_last)
    w, b, mean, var = torch.ones(64), torch.zeros(64), torch.zeros(64), torch.ones(64)
    seen: list[tuple] = []
    rows = []
    with triton_path("stub", count=False):
        with _launch.watch_launches(lambda *launch: seen.append(launch)):
            tfuse.functional.batch_norm_act(x, mean, var, w, b, training=True)
            tfuse.add(x, x, x)
        for kernel, grid, args, meta, device in seen:
            plan = _launch.LaunchPlan(kernel, grid, meta)
            ways = {
                "triton": lambda: kernel[grid](*args, **meta),
                "launch()": lambda: _launch.launch(kernel, grid, args, meta, device),
                "plan": lambda: plan(args, device),
            }
            samples: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(rounds):
                for way, call in ways.items():
                    for _ in range(20):
                        call()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        call()
                    samples[way].append((time.perf_counter() - start) / repeats * 1e6)
            rows.append({"kernel": _launch.kernel_name(kernel), "args": len(args), "meta": len(meta),
                         **{way: statistics.median(values) for way, values in samples.items()}})
    return rows


# ------------------------------------------------------------------------------ counting aten ops


def count_aten_ops(step: Callable[[], Any]) -> collections.Counter:
    """aten ops of one call of ``step`` that are not views (about one CUDA kernel each), by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "lift_fresh", "_to_copy"):
                counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return counts


# ------------------------------------------------------------------------------ one model


def census(model: str, layout: str, batch: int, *, rounds: int, steps: int) -> list[dict[str, Any]]:
    """Rows (one per mode) for one model: counts of one step, host ms over interleaved rounds."""
    from .e2e_models import build
    from .e2e_step import Workload, _build_step

    load = Workload(build(model, "tiny", prefer_torchvision=False), batch, layout, torch.device("cpu"))
    base = load.make_base()
    eager_step, eager_keep, _ = _build_step("eager", load, copy.deepcopy(base), graphed=False)
    tfuse_step, tfuse_keep, note = _build_step("tfuse", load, copy.deepcopy(base), graphed=False)
    modes: dict[str, tuple[Callable[[], Any], Callable[..., Any]]] = {
        "eager": (eager_step, lambda count: contextlib.nullcontext()),
        "tfuse (Triton launch path)": (tfuse_step, lambda count: triton_path("stub", count=count)),
        "tfuse (launches as no-ops)": (tfuse_step, lambda count: triton_path("noop", count=count)),
    }
    rows: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode, (step, context) in modes.items():
        with context(True) as launches:
            for _ in range(2):  # warm-up: caches, kernel specialisations, optimizer state
                step()
            launches_before = collections.Counter(launches) if launches is not None else collections.Counter()
            ops = count_aten_ops(step)
            per_step = (collections.Counter(launches) - launches_before) if launches is not None else None
        rows[mode] = {
            "model": model, "layout": layout, "batch": batch, "mode": mode,
            "triton_launches": sum(per_step.values()) if per_step is not None else 0,
            "launches_by_kernel": dict(sorted(per_step.items())) if per_step else {},
            "aten_ops": sum(ops.values()), "copies": ops.get("copy_", 0),
            "aten_by_op": dict(ops.most_common(12)),
        }
    for _ in range(rounds):
        for mode, (step, context) in modes.items():
            with context(False):
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    samples[mode].append((time.perf_counter() - start) * 1e3)
    if rounds == 0:  # counts only
        return list(rows.values())
    eager_median = statistics.median(samples["eager"])
    for mode, row in rows.items():
        q1, median, q3 = statistics.quantiles(samples[mode], n=4, method="inclusive")
        row.update(host_ms=median, host_q1=q1, host_q3=q3, vs_eager=median / eager_median, samples=len(samples[mode]))
    rows["tfuse (Triton launch path)"]["note"] = note
    del eager_keep, tfuse_keep
    return list(rows.values())


def _check_compiled_mode() -> None:
    from tfuse._backend import interpreter_active

    if interpreter_active():
        raise RuntimeError(
            "benchmarks.host times Triton's launch path, which only compiled kernels have: run it in a process "
            "without TRITON_INTERPRET (python -m benchmarks.host)"
        )


# ------------------------------------------------------------------------------ python -m benchmarks


def run(ctx: Any) -> Any:
    """``python -m benchmarks --only host``: the census in a child process without the interpreter."""
    from .harness import Column, Report

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "benchmarks.host", "--json"] + (["--quick"] if ctx.quick else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.host failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    micro = [row for row in rows if row.get("micro")]
    rows = [row for row in rows if not row.get("micro")]
    for row in rows:  # (the launches by kernel are not in the table: one line each on stderr)
        print(f"[host] {row['model']}, {row['mode']}: launches by kernel {json.dumps(row['launches_by_kernel'])}",
              file=sys.stderr, flush=True)
        row["host"] = f"{row['host_ms']:.2f} ({row['host_q1']:.2f}-{row['host_q3']:.2f})"
        row["plot"] = False
    return Report(
        name=NAME, title="Host census: one training step's launches, aten ops and host time, on the CPU",
        notes=NOTES + [_micro_note(micro), f"torch {torch.__version__}, triton {_triton_version()}."], rows=rows,
        columns=[Column("model", "model"), Column("mode", "mode"), Column("triton_launches", "Triton launches"),
                 Column("aten_ops", "aten ops (not views)"), Column("copies", "of them copy_"),
                 Column("host", "host ms/step, median (q1-q3)"), Column("vs_eager", "x eager", "{:.2f}")],
        timing_note="Timing: host ms of single steps on this CPU (everything synchronous), modes interleaved "
                    "round by round; the medians of one run compare, not figures from different runs.",
    )


NOTES = [
    "Models at reduced width on tiny inputs (benchmarks/e2e_models.py, scale tiny, batch 2): ResNet-50 "
    "(channels_last), MobileNetV2 (channels_last), a GPT-2 stack (2 blocks, d=64, 32 tokens); the step of the "
    "end-to-end benchmark (bf16 autocast, loss, backward, clip to norm 1, optimizer step).",
    "tfuse (Triton launch path): tfuse's ops on their Triton path, launched as on a GPU into a stubbed driver: the "
    "first launch of each specialisation through Triton's Python launch path, later ones as tfuse's prepared "
    "launches; the compiled kernel's launcher is a no-op (on a GPU it is Triton's launcher object, a few us of "
    "Python plus cuLaunchKernel, for every library alike), kernels do not run. tfuse (launches as no-ops): "
    "launches replaced by a counter. Host ms include torch's CPU arithmetic on the tiny inputs, the same in every "
    "mode.",
    "aten ops (not views): what runs through the dispatcher per step, each about one CUDA kernel on a GPU. "
    "copy_ among them: gradients accumulate in the flat buffers (autograd's add_, no copy); the one copy_ left in "
    "the CNNs is the backward of a view of the classifier's input.",
]


def _micro_note(micro: list[dict[str, Any]]) -> str:
    """The launch micro-benchmark (:func:`launch_micro`) as one note."""
    if not micro:
        return "Launch micro-benchmark: not run (--counts-only)."
    cells = "; ".join(
        f"{row['kernel']} ({row['args']} args, {row['meta']} meta): Triton {row['triton']:.1f}, "
        f"launch() {row['launch()']:.1f}, plan {row['plan']:.1f}"
        for row in micro
    )
    return (
        "Launch micro-benchmark (host us per launch into the stub driver, medians of interleaved rounds; "
        "Triton: its own launch path; launch(): tfuse's seam, site lookup + prepared launch; plan: a prepared "
        f"launch held by the op, as batch norm's plans hold them): {cells}."
    )


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON line per row (else a short table)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run")
    parser.add_argument("--counts-only", action="store_true", help="launches and aten ops of one step, no timing")
    parser.add_argument("--models", default=",".join(m for m, _, _ in MODELS), help="comma-separated models")
    args = parser.parse_args(argv)
    _check_compiled_mode()
    torch.set_flush_denormal(True)  # stubbed kernels leave garbage: keep denormal arithmetic out of the timings
    rounds, steps = (0, 0) if args.counts_only else ((1, 2) if args.quick else (7, 5))
    if not args.counts_only:
        for row in launch_micro(repeats=200 if args.quick else 2000, rounds=2 if args.quick else 7):
            if args.json:
                print(json.dumps({"micro": True, **row}), flush=True)
            else:
                print(f"launch of {row['kernel']:26} Triton {row['triton']:6.1f} us, launch() {row['launch()']:5.1f} "
                      f"us, plan {row['plan']:5.1f} us", flush=True)
    wanted = args.models.split(",")
    for model, layout, batch in MODELS:
        if model not in wanted:
            continue
        for row in census(model, layout, batch, rounds=rounds, steps=steps):
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                timing = f" host {row['host_ms']:8.2f} ms x{row['vs_eager']:.2f}" if "host_ms" in row else ""
                print(f"{row['model']:13} {row['mode']:28} launches {row['triton_launches']:4} aten {row['aten_ops']:5}"
                      f" copy_ {row['copies']:4}{timing}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs tfuse's benchmarks: ``python -m benchmarks [--only NAME] [--quick] [--no-compile] [--out DIR]``.

A run writes its tables and plots to a scratch folder (printed; by default
a new ``<tmp>/tfuse-benchmarks-*``), never over the measured tables committed in
``benchmarks/results/``: replacing those is an explicit ``--out benchmarks/results``.

On a machine without a GPU, Triton's interpreter is switched on before
triton is imported, so the benchmarks can check the kernels' values and count
their launches; they time only what is meaningful on a CPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# Module names under benchmarks/, each with NAME and run(), or names in SHARED.
BENCHMARKS = ["add", "add_act", "linear", "bn_act", "depthwise", "bn_depthwise", "group_norm_act", "layer_norm_act",
              "optim", "allreduce", "sharded", "overlap", "localsgd", "compile", "e2e", "host"]
# Benchmarks that share a module: name -> module under benchmarks/, whose run_<name>() runs each.
SHARED = {"group_norm_act": "norm_act", "layer_norm_act": "norm_act"}


def default_out_dir() -> Path:
    """Where a run writes when --out is not given: a new scratch folder (two runs never overwrite each other's
    tables), not the committed benchmarks/results/."""
    return Path(tempfile.mkdtemp(prefix="tfuse-benchmarks-"))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    parser.add_argument("--quick", action="store_true", help="few sizes and short timings: a smoke run")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default: a new folder {Path(tempfile.gettempdir()) / 'tfuse-benchmarks-*'}); "
                             "`--out benchmarks/results` replaces the committed tables")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from .harness import (
        QUICK_COMPILE_NOTE,
        RESULTS_DIR,
        Context,
        copy_bandwidth_gbps,
        describe_machine,
        single_thread_copy_gbps,
    )

    out_dir = args.out or default_out_dir()
    machine = describe_machine()
    print(machine.header())
    if not machine.on_gpu:
        print("No GPU: Triton kernels run through the interpreter, for values and launch counts only; "
              "interpreter timings are not performance.")
    replacing = out_dir.resolve() == RESULTS_DIR.resolve()
    print(f"Writing tables and plots to {out_dir}" + (" (replacing the committed tables)" if replacing else
                                                       " (--out benchmarks/results replaces the committed tables)"))
    started = time.perf_counter()
    context = Context(
        machine=machine,
        copy_gbps=copy_bandwidth_gbps(machine.device, args.quick),
        quick=args.quick,
        use_compile=not args.no_compile,
        stall_reference_gbps=single_thread_copy_gbps(machine.device),
    )
    if machine.load is not None and not machine.on_gpu and machine.load > 0.5:
        print(f"Load average {machine.load:.2f}: other processes are running, so expect rows marked noisy or "
              "stalled; a quiet machine gives results.", file=sys.stderr)
    for name in args.only or BENCHMARKS:
        begin = time.perf_counter()
        print(f"== {name}: running", file=sys.stderr, flush=True)
        module = importlib.import_module(f"benchmarks.{SHARED.get(name, name)}")
        context.compiled_references = 0
        report = getattr(module, f"run_{name}")(context) if name in SHARED else module.run(context)
        if context.quick and context.compiled_references:
            report.notes.append(QUICK_COMPILE_NOTE)
        print()
        print(report.markdown(machine))
        for path in report.write(machine, out_dir):
            print(f"wrote {path}")
        print(f"== {name}: done in {time.perf_counter() - begin:.0f} s", file=sys.stderr, flush=True)
    print(f"All done in {time.perf_counter() - started:.0f} s; tables and plots in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

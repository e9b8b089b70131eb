"""Runs tfuse's benchmarks: ``python -m benchmarks [--only NAME] [--quick] [--no-compile] [--out DIR]``.

On a machine without a GPU, Triton's interpreter is switched on before
triton is imported, so the benchmarks can check the kernels' values and count
their launches; they time only what is meaningful on a CPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

BENCHMARKS = ["add", "add_act", "linear", "bn_act", "optim", "allreduce"]  # module names under benchmarks/, each with NAME and run()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    parser.add_argument("--quick", action="store_true", help="few sizes and short timings: a smoke run")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from .harness import RESULTS_DIR, Context, copy_bandwidth_gbps, describe_machine

    machine = describe_machine()
    print(machine.header())
    if not machine.on_gpu:
        print("No GPU: Triton kernels run through the interpreter, for values and launch counts only; "
              "interpreter timings are not performance.")
    context = Context(
        machine=machine,
        copy_gbps=copy_bandwidth_gbps(machine.device, args.quick),
        quick=args.quick,
        use_compile=not args.no_compile,
    )
    out_dir = args.out or RESULTS_DIR
    for name in args.only or BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        report = module.run(context)
        print()
        print(report.markdown(machine))
        for path in report.write(machine, out_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tfuse's benchmarks: ``python -m benchmarks [--only NAME] [--quick] [--no-compile] [--out DIR]``.

Each benchmark module defines ``NAME`` and ``run(context) -> Report``; the
shared measuring, flagging and reporting code is in :mod:`benchmarks.harness`.
Beside them: ``python -m benchmarks.micro`` (per-family GPU micro-benchmark)
and ``python -m benchmarks.roofline`` (static sm_90 roofline, no GPU needed).
"""

"""tfuse's benchmarks: ``python -m benchmarks [--only NAME] [--quick]``.

Each benchmark module defines ``NAME`` and ``run(context) -> Report``; the
shared measuring and reporting code is in :mod:`benchmarks.harness`.
"""

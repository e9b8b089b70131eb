#!/usr/bin/env bash
# Every GPU check of tfuse in one call: install, the whole test suite on CUDA,
# the sm_90 compile check (part of the suite), and every benchmark.
# Meant for a GPU machine with torch and triton already installed and no
# network (e.g. the H200 reference machine: torch 2.11, triton 3.6).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]     # default: $OUT, else benchmarks/results
#
# Writes to OUT_DIR: gpu.txt, pytest-cuda.log, benchmarks.log and the
# benchmark tables/plots (add-<gpu>.md/.png ...). Exits non-zero if the tests fail.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"

python3 -m pip install --quiet --no-build-isolation --no-deps -e . || exit 1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/gpu.txt"

PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider 2>&1 | tee "$out/pytest-cuda.log"
tests_status=${PIPESTATUS[0]}

PYTHONUNBUFFERED=1 python3 -m benchmarks --out "$out" 2>&1 | tee "$out/benchmarks.log"
bench_status=${PIPESTATUS[0]}

echo "tests exit ${tests_status}, benchmarks exit ${bench_status}"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]

#!/usr/bin/env bash
# GPU campaign, call 1 of 2: environment, editable install, the CUDA test suite, per-family micro-benchmarks.
#
#   bash scripts/gpu/call1.sh          # on the GPU machine, from the repository root (timeout_s=590; ~6-9 min)
#   bash scripts/gpu/call1.sh --dry    # on a CPU machine: checks this script in seconds (collects the tests,
#                                      # runs the micro-benchmark at tiny shapes on the PyTorch path)
#
# Writes to $OUT (5 of the 8 files a device call may bring back):
#   env.txt     versions, GPU, install result, each phase's exit status and time, fuse_model on the model zoo
#   pytest.log  the test run (-rfE: failing test names even when the run is cut short)
#   junit.xml   the same as JUnit XML
#   micro.log   the micro-benchmark's output (table last)
#   micro.json  the micro-benchmark's numbers
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0; [ "${1:-}" = "--dry" ] && dry=1
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{
  date -u
  if [ "$dry" = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$py" -m pip install -q --no-build-isolation --no-deps -e . && echo "editable install ok"
  fi
  "$py" -c "import sys,torch,triton;print('python',sys.version.split()[0],'torch',torch.__version__,'triton',triton.__version__,'cuda',torch.cuda.is_available())"
  "$py" -m pip list 2>/dev/null | grep -i -E '^(pytest|pytest-xdist|pytest-timeout|numpy|matplotlib) ' || true
} > "$out/env.txt" 2>&1

# CUDA-relevant tests only: the distributed and packaging tests run on the CPU anyway (CI runs them), and
# the benchmark smoke tests spend minutes in torch.compile. -n 8 spreads the ~950 Triton compilations.
pytest_args=(-p no:cacheprovider -rfE --durations=25 --junitxml="$out/junit.xml" tests
             --ignore=tests/test_benchmarks.py --ignore=tests/test_packaging.py --ignore=tests/test_distributed.py)
"$py" -c "import xdist" 2>/dev/null && [ "$dry" = 0 ] && pytest_args+=(-n 8)
"$py" -c "import pytest_timeout" 2>/dev/null && pytest_args+=(--timeout=240)
[ "$dry" = 1 ] && pytest_args+=(--collect-only -q)
timeout 360 "$py" -m pytest "${pytest_args[@]}" > "$out/pytest.log" 2>&1
echo "pytest exit $? after ${SECONDS}s" | tee -a "$out/env.txt"

# fuse_model on torchvision/timm networks (the GPU image has both; a CPU without them prints "skipped").
{ echo "== fuse_model on the model zoo"; timeout 90 "$py" scripts/gpu/fuse_zoo.py 2>&1 | tail -n 20; } >> "$out/env.txt"
echo "zoo done after ${SECONDS}s" | tee -a "$out/env.txt"

micro_args=(); [ "$dry" = 1 ] && micro_args+=(--dry)
OUT="$out" timeout $((560 - SECONDS)) "$py" -m benchmarks.micro "${micro_args[@]}" > "$out/micro.log" 2>&1
status=$?
echo "micro exit $status after ${SECONDS}s" | tee -a "$out/env.txt"
tail -n 45 "$out/micro.log"; tail -n 15 "$out/pytest.log"
exit $status

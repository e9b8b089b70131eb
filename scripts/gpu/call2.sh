#!/usr/bin/env bash
# GPU campaign, call 2 of 2: the CUDA tests of what has not run on a GPU yet, fuse_model on the model zoo,
# the micro-benchmark of the host-heavy families, and the depthwise and norm + activation benchmarks.
#
#   bash scripts/gpu/call2.sh          # on the GPU machine, right after call 1 (timeout_s=CALL_LIMIT+10, 300)
#   bash scripts/gpu/call2.sh --dry    # on a CPU machine (seconds): collects the tests, tiny shapes elsewhere
#
# Planned time, with CALL_LIMIT=290 (default; each phase is cut at its share, SIGINT keeps what it wrote):
# install ~10 s; pytest up to 150 s; the zoo up to 35 s; benchmarks.micro (bn, clip, optim, host) up to 60 s;
# python -m benchmarks --only depthwise --only bn_depthwise --only group_norm_act --only layer_norm_act with what
# is left (SIGINT cuts it; each table is printed to bench.log when its benchmark finishes).
#
# Writes to $OUT (5 of the 8 files the two calls bring back):
#   pytest.log  the test run (-rfE: failing tests named even when the run is cut)
#   junit.xml   the same as JUnit XML
#   micro.log   the micro-benchmark's output (table last)
#   micro.json  its numbers
#   bench.log   phases' exit status and times, the zoo's lines, the benchmarks' tables
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0; [ "${1:-}" = "--dry" ] && dry=1
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
limit=${CALL_LIMIT:-290}
left() { echo $(( limit - SECONDS )); }
[ "$dry" = 0 ] && "$py" -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1

# What the GPU has not run yet: CUDA graphs and compile, depthwise, batch norm, optimizers, clip, flat buffers,
# fuse_model and setup, group/layer norm + activation. (tests/test_bn_depthwise.py forces the Triton path on CPU
# tensors, which needs the interpreter: it runs in CI, not here.) test_add*.py ran on the first GPU run and spends minutes compiling: left out.
tests=(tests/test_compile.py tests/test_depthwise.py tests/test_batch_norm_act.py tests/test_ops_batch_norm_args.py
       tests/test_optim.py tests/test_optim_trajectories.py tests/test_optim_core.py tests/test_optim_state.py tests/test_optim_low_precision.py
       tests/test_optim_copies.py tests/test_optim_api.py tests/test_clip_grad_norm.py tests/test_flat.py
       tests/test_flat_layout.py tests/test_flat_storage.py tests/test_flat_copies.py tests/test_fuse_model.py
       tests/test_setup.py tests/test_nn_modules.py tests/test_norm_act.py)
pytest_args=(-p no:cacheprovider -rfE -q --durations=15 --junitxml="$out/junit.xml" "${tests[@]}")
"$py" -c "import xdist" 2>/dev/null && [ "$dry" = 0 ] && pytest_args+=(-n 16 --dist load)
"$py" -c "import pytest_timeout" 2>/dev/null && pytest_args+=(--timeout=120)
[ "$dry" = 1 ] && pytest_args+=(--collect-only)
cap=$(( $(left) * 150 / 290 ))
timeout -s INT "$cap" "$py" -m pytest "${pytest_args[@]}" > "$out/pytest.log" 2>&1
echo "pytest exit $? after ${SECONDS}s" | tee -a "$out/bench.log"

timeout -s INT 35 "$py" scripts/gpu/fuse_zoo.py > /tmp/tfuse-zoo.txt 2>&1
{ echo "== fuse_model on the model zoo"; grep -E "^(== |torchvision|timm)|Error|error:|reproducer" /tmp/tfuse-zoo.txt | cut -c1-400 | head -n 80; } >> "$out/bench.log"
echo "zoo done after ${SECONDS}s" | tee -a "$out/bench.log"

micro_args=(--only bn,clip,optim,host --json "$out/micro.json"); [ "$dry" = 1 ] && micro_args+=(--dry)
timeout -s INT 60 "$py" -m benchmarks.micro "${micro_args[@]}" > "$out/micro.log" 2>&1
echo "micro exit $? after ${SECONDS}s" | tee -a "$out/bench.log"

# The depthwise dispatch classes, then batch norm + act + depthwise (the same rule governs it), then group norm and
# layer norm + activation (SD 1.5 UNet / ResNet-GN, ConvNeXt / ViT-B shapes).
bench_args=(--only depthwise --only bn_depthwise --only group_norm_act --only layer_norm_act --no-compile
            --out /tmp/tfuse-tables)
if [ "$dry" = 1 ]; then  # their quick runs are tested with every benchmark's (test_benchmarks.py)
  echo "depthwise: dry run, not run (python -m benchmarks ${bench_args[*]})" | tee -a "$out/bench.log"
elif [ "$(left)" -gt 20 ]; then
  timeout -s INT "$(left)" "$py" -m benchmarks "${bench_args[@]}" >> "$out/bench.log" 2>&1
  echo "depthwise exit $? after ${SECONDS}s" | tee -a "$out/bench.log"
else
  echo "depthwise skipped: out of time" | tee -a "$out/bench.log"
fi
tail -n 25 "$out/pytest.log" | cut -c1-300
grep -E "^\| (bn|clip|optim|host) " "$out/micro.log" | cut -c1-200
grep -E "^\| " "$out/bench.log" | tail -n 20 | cut -c1-250
exit 0  # each phase's exit status is in bench.log

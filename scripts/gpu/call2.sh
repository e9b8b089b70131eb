#!/usr/bin/env bash
# GPU campaign, call 2 of 2: the benchmark tables (without torch.compile) and hardware counters (ncu) of
# the kernels the static roofline singles out.
#
#   bash scripts/gpu/call2.sh          # on the GPU machine, right after call 1 (timeout_s=590; ~9 min)
#   bash scripts/gpu/call2.sh --dry    # on a CPU machine (seconds): one quick benchmark through the interpreter,
#                                      # the ncu commands printed instead of run
#
# Writes to $OUT (3 of the 8 files a device call may bring back):
#   bench.log   every benchmark's output
#   bench.tgz   the tables and plots (benchmarks/results form: <name>-<gpu>.md/.png)
#   ncu.txt     Nsight Compute sections for one launch of each suspected kernel
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0; [ "${1:-}" = "--dry" ] && dry=1
out=${OUT:-$(mktemp -d)}; mkdir -p "$out/tables"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# The kernels to read hardware counters of (one launch each, in the micro-benchmark of their family).
NCU_KERNELS=${NCU_KERNELS:-"_bn_stats_partial_kernel _bn_act_bwd_reduce_kernel _bn_act_fwd_kernel _add_act_fwd_kernel _add_act_bwd_kernel _adam_kernel _clip_segments_kernel"}
[ "$dry" = 0 ] && "$py" -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1

# depthwise first: its per-shape-class verdicts (Triton against eager + cuDNN) fill
# tfuse.ops.depthwise.EAGER_SHAPE_CLASSES, and no GPU table of it exists yet (the others have one).
bench_args=(--no-compile --out "$out/tables"); benches=(depthwise add add_act bn_act optim linear compile)
[ "$dry" = 1 ] && { bench_args+=(--quick); benches=(add); }
for b in "${benches[@]}"; do
  left=$((330 - SECONDS)); [ "$left" -gt 20 ] || { echo "skip $b: out of time" >> "$out/bench.log"; continue; }
  timeout "$left" "$py" -m benchmarks --only "$b" "${bench_args[@]}" >> "$out/bench.log" 2>&1
  echo "== $b exit $? at ${SECONDS}s" >> "$out/bench.log"
done
tar czf "$out/bench.tgz" -C "$out" tables && rm -rf "$out/tables"

: > "$out/ncu.txt"
# A renamed kernel would make ncu profile nothing: check the names first (a dry run fails on it).
if ! "$py" -c "import sys, tfuse.kernels as k; m=[n for n in sys.argv[1:] if not hasattr(k, n)]; sys.exit(f'not in tfuse.kernels: {m}' if m else 0)" $NCU_KERNELS >> "$out/ncu.txt" 2>&1; then
  cat "$out/ncu.txt"; [ "$dry" = 1 ] && exit 1
fi
# One launch of each kernel; --clock-control none leaves the GPU's clocks as they are. A dry run prints the commands.
ncu_run() { if [ "$dry" = 1 ]; then echo "dry run: $*" >> "$out/ncu.txt"; else "$@" >> "$out/ncu.txt" 2>&1; fi; }
for k in $NCU_KERNELS; do
  case $k in _bn*) fam=bn;; _add_act*) fam=add_act;; _adam*|_sgd*) fam=optim;; *) fam=clip;; esac
  left=$((560 - SECONDS)); [ "$left" -gt 30 ] || break
  ncu_run timeout "$left" ncu --clock-control none -k "regex:^${k}\$" -c 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis "$py" -m benchmarks.micro --no-profile --only "$fam" \
    --json /tmp/ncu-micro.json
  echo "== ncu $k exit $? at ${SECONDS}s" >> "$out/ncu.txt"
done
grep -E "^(==|\| )" "$out/bench.log" | tail -n 60
grep -E "==|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit|Grid Size" "$out/ncu.txt" | head -80

#!/usr/bin/env bash
# GPU campaign, call 1 of 2: versions, editable install, the end-to-end training-step benchmark.
#
#   bash scripts/gpu/call1.sh          # on the GPU machine, from the repository root (timeout_s = CALL_LIMIT + 10)
#   bash scripts/gpu/call1.sh --dry    # on a CPU machine: the same phases in seconds (tiny models, PyTorch path)
#
# Each phase runs in its own process, so that a fault that ends a CUDA context (an illegal address in a
# captured graph, say) costs that phase only. Planned time with CALL_LIMIT=380 (default), each phase cut at its
# share by SIGINT (Python unwinds; the rows already written stay):
#   ~25 s   install and versions
#   ~150 s  eager vs tfuse, every model, batch size and layout (45% of what is left)
#   ~60 s   each whole-step CUDA graph checked small (graph_check.py, one process per variant); on a fault,
#           compute-sanitizer names the kernel (up to 100 s)
#   rest    eager vs each graph variant that passed its check, then torch.compile with what is left
#
# Writes to $OUT (3 of the 8 files the two calls bring back):
#   env.txt     date, GPU, install result, versions, each phase's exit status and time
#   e2e.jsonl   one JSON line per measured row, written as each group of variants finishes (a cut run keeps them)
#   e2e.log     every phase's output, the graph checks, the rendered table last
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0; [ "${1:-}" = "--dry" ] && dry=1
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
limit=${CALL_LIMIT:-380}
left() { echo $(( limit - SECONDS )); }
log() { echo "$* after ${SECONDS}s" | tee -a "$out/env.txt"; }

{
  date -u
  if [ "$dry" = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$py" -m pip install -q --no-build-isolation --no-deps -e . && echo "editable install ok"
  fi
  "$py" -c "import sys,torch,triton;print('python',sys.version.split()[0],'torch',torch.__version__,'triton',triton.__version__,'cuda',torch.cuda.is_available())"
  "$py" -c "import torchvision; print('torchvision', torchvision.__version__)" 2>&1 | tail -n 1
} > "$out/env.txt" 2>&1
log "setup done"

e2e() {  # e2e BUDGET VARIANTS...: one process, interrupted 20 s after its budget
  local budget=$1; shift
  local args=(--jsonl "$out/e2e.jsonl" --budget "$budget" --variants "$*"); [ "$dry" = 1 ] && args+=(--dry)
  echo "== e2e --variants $*" >> "$out/e2e.log"
  timeout -s INT $((budget + 20)) "$py" -m benchmarks.e2e "${args[@]}" >> "$out/e2e.log" 2>&1
  log "e2e [$*] exit $?"
}

e2e $(( $(left) * 45 / 100 )) tfuse

passed=()
if [ "$dry" = 0 ]; then
  for variant in "tfuse + CUDA graph" "eager + CUDA graph"; do
    echo "== graph check: $variant" >> "$out/e2e.log"
    timeout -s INT 90 "$py" scripts/gpu/graph_check.py "$variant" > "$out/check.txt" 2>&1
    rc=$?; cat "$out/check.txt" >> "$out/e2e.log"
    if [ "$rc" = 0 ]; then
      passed+=("$variant")
    elif grep -q FAULT "$out/check.txt" && command -v compute-sanitizer > /dev/null && [ "$(left)" -gt 150 ]; then
      echo "== compute-sanitizer: $variant (batch 2, 32x32)" >> "$out/e2e.log"
      timeout -s INT 100 compute-sanitizer --tool memcheck --print-limit 3 "$py" scripts/gpu/graph_check.py \
        "$variant" --batch 2 --size 32 2>&1 | grep -v "^=========     " | head -n 60 >> "$out/e2e.log"
    fi
    rm -f "$out/check.txt"
    log "graph check [$variant] done"
  done
fi
for variant in "${passed[@]}"; do
  e2e $(( $(left) / 2 - 10 )) "$variant"
done
[ "$(left)" -gt 120 ] && [ "$dry" = 0 ] && e2e $(( $(left) - 25 )) torch.compile

table=$("$py" -m benchmarks.e2e --render "$out/e2e.jsonl" 2>&1)  # (rendered once: a process imports torch)
echo "$table" >> "$out/e2e.log"
grep -E "^\[e2e|graph_check|Error|========= (Invalid|  at|Program)" "$out/e2e.log" | cut -c1-300 | tail -n 40
echo "$table" | grep -E "^\|" | cut -c1-230
exit 0

#!/usr/bin/env bash
# The one-command GPU benchmark (issues #9, #27): compiled vs eager for isolated / shared / oxygen on the real pi0.5
# architecture (random weights, bf16, built directly on the GPU), S=10, H=10, N=30, k=5, 3 cameras, plus a compiled
# k/N subset, interleaved in one run; writes table + JSON + PNG under bench/results/<UTC timestamp>-<device name>/.
# Needs PyTorch + transformers only (no ROS): it runs from the checkout with PYTHONPATH=. .
# Phases (each prints its table when it ends and rewrites results.json, whose "phase" names the last one finished, so
# a time limit still leaves results): compile -> component costs (eager and compiled, op / kernel counts) -> the
# engine runs (compiled on --frames frames, the slow eager reference on --eager-frames) -> costs again -> bf16 check
# -> the k/N sweep (compiled only).  Compiled engines share KV pools across phases, so their decode graphs are built
# once, not per engine.
#
#   bench/gpu.sh                              # CUDA: eager vs cudagraphs, preset pi05, bf16 (target: <= 5 min, H200)
#   bench/gpu.sh --quick                      # a first look (target: <= 2 min): isolated + oxygen, 10 compiled and 3
#                                             #   eager frames, no sweep, no bf16 check
#   bench/gpu.sh --with-inductor-graphs       # then the same compiled runs with compile=inductor-graphs (autotuned
#                                             #   inductor in the package's own CUDA graphs; its compile time is unmeasured)
#   bench/gpu.sh --time-limit 290             # stop the run after 290 s (finished phases stay in results.json)
#   bench/gpu.sh --device cpu --preset tiny   # the same script end to end on a CPU (inductor, fp32): CI smoke test
#   PYTHON=.venv/bin/python bench/gpu.sh ...  # interpreter (default python3); extra arguments go to `oxygen bench`
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda PRESET=pi05 FRAMES=30 EAGER_FRAMES=8 SWEEP_FRAMES=10 OUT="" QUICK=0 IG=0 LIMIT=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --preset) PRESET="$2"; shift 2 ;;
    --frames) FRAMES="$2"; shift 2 ;;
    --eager-frames) EAGER_FRAMES="$2"; shift 2 ;;
    --sweep-frames) SWEEP_FRAMES="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --with-inductor-graphs) IG=1; shift ;;
    --time-limit) LIMIT="$2"; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
PY="${PYTHON:-python3}"
if [[ "$DEVICE" == cuda* ]]; then COMPILE=cudagraphs DTYPE=bfloat16; else COMPILE=inductor DTYPE=float32; fi
NAME=$(PYTHONPATH=. "$PY" -c "import sys, torch; d = sys.argv[1]; print(torch.cuda.get_device_name(torch.device(d)) \
  if d.startswith('cuda') else 'cpu')" "$DEVICE" | tr -c 'A-Za-z0-9.\n' '-')
OUT="${OUT:-bench/results/$(date -u +%Y%m%d-%H%M%S)-${NAME}-gpu-bench}"
if [ "$QUICK" = 1 ]; then
  RUN=(--frames 10 --eager-frames 3 --modes isolated,oxygen --no-shared-nk --reps 2)
else
  RUN=(--frames "$FRAMES" --eager-frames "$EAGER_FRAMES" --reps 3 --sweep --sweep-n 10,30 --sweep-k 5,10
       --sweep-frames "$SWEEP_FRAMES" --bf16-check)
fi
TIMEOUT=()
[ "$LIMIT" != 0 ] && TIMEOUT=(timeout --signal=TERM "$LIMIT")
echo "[gpu.sh] device=$DEVICE ($NAME) preset=$PRESET dtype=$DTYPE compile=$COMPILE quick=$QUICK -> $OUT"
start=$(date +%s)
status=0
PYTHONPATH=. ${TIMEOUT[@]+"${TIMEOUT[@]}"} "$PY" -m oxygen_ros.tools.bench --preset "$PRESET" --device "$DEVICE" \
  --dtype "$DTYPE" --compile "$COMPILE" --compile-batch-sizes 1,8 -S 10 --horizon 10 -N 30 --k 5 "${RUN[@]}" \
  --out "$OUT" ${EXTRA[@]+"${EXTRA[@]}"} || status=$?
if [ "$status" = 124 ]; then echo "[gpu.sh] time limit reached: $OUT/results.json holds the finished phases"; fi
if [ "$status" = 0 ] && [ "$IG" = 1 ]; then
  rem=$(( LIMIT - ($(date +%s) - start) ))
  if [ "$LIMIT" != 0 ]; then TIMEOUT=(timeout --signal=TERM "$(( rem > 1 ? rem : 1 ))"); fi
  PYTHONPATH=. ${TIMEOUT[@]+"${TIMEOUT[@]}"} "$PY" -m oxygen_ros.tools.bench --preset "$PRESET" --device "$DEVICE" \
    --dtype "$DTYPE" --compile inductor-graphs --no-eager --compile-batch-sizes 1,8 -S 10 --horizon 10 -N 30 --k 5 \
    --frames 10 --modes isolated,oxygen --no-shared-nk --reps 2 --out "$OUT/inductor-graphs" \
    ${EXTRA[@]+"${EXTRA[@]}"} || status=$?
fi
echo "[gpu.sh] done in $(( $(date +%s) - start )) s (exit $status): $OUT"
exit "$status"

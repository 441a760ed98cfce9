#!/usr/bin/env bash
# The one-command GPU benchmark (issue #9): eager vs compiled for isolated / shared / oxygen on the real pi0.5
# architecture (random weights, bf16, built directly on the GPU), S=10, H=10, N=30, k=5, 3 cameras, plus a small k/N
# subset, interleaved in one run; writes table + JSON + PNG under bench/results/<UTC timestamp>-<device name>/.
# Needs PyTorch + transformers only (no ROS): it runs from the checkout with PYTHONPATH=. .
#
#   bench/gpu.sh                              # CUDA: eager vs cudagraphs, preset pi05, bf16 (target: <= 8 min on an H200)
#   bench/gpu.sh --device cpu --preset tiny   # the same script end to end on a CPU (inductor, fp32): CI smoke test
#   PYTHON=.venv/bin/python bench/gpu.sh ...  # interpreter (default python3); extra arguments go to `oxygen bench`
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda PRESET=pi05 FRAMES=30 SWEEP_FRAMES=10 OUT=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --preset) PRESET="$2"; shift 2 ;;
    --frames) FRAMES="$2"; shift 2 ;;
    --sweep-frames) SWEEP_FRAMES="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
PY="${PYTHON:-python3}"
if [[ "$DEVICE" == cuda* ]]; then COMPILE=cudagraphs DTYPE=bfloat16; else COMPILE=inductor DTYPE=float32; fi
NAME=$(PYTHONPATH=. "$PY" -c "import sys, torch; d = sys.argv[1]; print(torch.cuda.get_device_name(torch.device(d)) \
  if d.startswith('cuda') else 'cpu')" "$DEVICE" | tr -c 'A-Za-z0-9.\n' '-')
OUT="${OUT:-bench/results/$(date -u +%Y%m%d-%H%M%S)-${NAME}-gpu-bench}"
echo "[gpu.sh] device=$DEVICE ($NAME) preset=$PRESET dtype=$DTYPE compile=$COMPILE -> $OUT"
start=$(date +%s)
PYTHONPATH=. "$PY" -m oxygen_ros.tools.bench --preset "$PRESET" --device "$DEVICE" --dtype "$DTYPE" \
  --compile "$COMPILE" --compile-batch-sizes 1,8 -S 10 --horizon 10 -N 30 --k 5 --frames "$FRAMES" --reps 3 \
  --sweep --sweep-n 10,30 --sweep-k 5,10 --sweep-frames "$SWEEP_FRAMES" --bf16-check --out "$OUT" \
  ${EXTRA[@]+"${EXTRA[@]}"}
echo "[gpu.sh] done in $(( $(date +%s) - start )) s: $OUT"

#!/usr/bin/env bash
# The closed-loop evaluations of the shipped demo policy recorded in the README and checkpoints/demo/README.md, each
# into bench/results/<UTC time>-<host>-sim-<name>/ (results.json, table.txt, plots, one video per cell).
#
#   bench/sim_evals.sh [main|joins|claim|expert ...]     (default: all four, one after another)
#
#   main    lockstep, the node's defaults (oxygen, blend, no injected delay), questions every 1 s + memory every 2 s of
#           sim time, 100 unseen seeds per task (issue 19's targets)
#   joins   chunk joins under latency: none / blend (5 rows cross-faded: one camera period) / rtc x injected delay
#           0 / 100 / 200 ms, lockstep, reach + pick
#   claim   the paper's claim, realtime (sim_node + oxygen_node over DDS, real-time factor 1.0: the engine's real
#           compute time is the delay, and it - not the 10 Hz camera - bounds the rate): isolated / oxygen x language
#           none / demo rates (q1m2) / one question and one memory request per camera frame (q0.1m0.1), reach
#   expert  the scripted expert through the node's action path (issue 18's >= 95 / 95 / 90 %)
#
# Seeds 0-99 are never used in training (training data: 100000 and up). SEEDS_JOINS / SEEDS_CLAIM shorten the grids.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
host=$(hostname -s 2>/dev/null || echo host)
out() { echo "bench/results/$(date -u +%Y%m%d-%H%M%S)-$host-sim-$1"; }
ev() { "$PY" -m oxygen_ros.tools.cli sim-eval --quiet "$@"; }

for what in "${@:-main joins claim expert}"; do
  for w in $what; do
    case "$w" in
      main)   ev --policy demo --task reach,pick,transfer --seeds 0:100 --language q1m2 --workers 2 --out "$(out main)" ;;
      joins)  ev --policy demo --task reach,pick --seeds "${SEEDS_JOINS:-0:30}" --chunking none,blend,rtc \
                 --delay-ms 0,100,200 -p blend_steps:=5 --workers 2 --no-video --out "$(out joins)" ;;
      claim)  ev --policy demo --clock realtime --real-time-factor 1.0 --task reach --seeds "${SEEDS_CLAIM:-0:20}" \
                 --engine-mode isolated,oxygen --language none,q1m2,q0.1m0.1 --no-video --out "$(out claim)" ;;
      expert) ev --policy expert --task reach,pick,transfer --seeds 0:100 --workers 2 --no-video --out "$(out expert)" ;;
      *) echo "unknown evaluation '$w' (main | joins | claim | expert)" >&2; exit 2 ;;
    esac
  done
done

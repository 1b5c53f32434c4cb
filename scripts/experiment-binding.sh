#!/usr/bin/env bash
# Reproduces the late-binding paper's experiments in flexstack labs and writes docs/experiments/late-binding.md
# with tables and SVG plots (Figures 4, 5 and 7 of the paper): see that file for what is measured and how.
#
#   sudo scripts/experiment-binding.sh                 # all variants: handoff x 4 buffers x SEEDS, urgent x 4
#   sudo SEEDS="1 2" BUFFERS="2 50" scripts/experiment-binding.sh
#
# Needs root (namespaces, veth pairs), python3 and a release build (made here). Runs from the repository's root;
# every lab run's results folder is kept under $WORK (printed). Runtime: about 16 s per handoff run and 90 s per
# urgent run (defaults: 12 + 4 runs, ~9.5 min). The machine's load (uptime) before and after goes into the page:
# run it at a quiet moment, the labs pace real flows.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/experiment.sh   # experiment_setup, lab_variant, run_lab
experiment_setup binding
SEEDS=${SEEDS:-"1 2 3"}
BUFFERS=${BUFFERS:-"50 5 2 1"}
load_now() { # "load average 0.42, 1.10, 2.00 (1, 5, 15 min)" from /proc/loadavg
  read -r l1 l5 l15 _ < /proc/loadavg
  echo "load average $l1, $l5, $l15 (1, 5, 15 min)"
}
load_start=$(load_now)
started_at=$(date -u +%Y-%m-%dT%H:%MZ)
labs_from=$SECONDS
load_max=0 # the highest 1-minute load average seen after a lab run
note_load() {
  local l1
  read -r l1 _ < /proc/loadavg
  load_max=$(awk -v a="$load_max" -v b="$l1" 'BEGIN { print (b > a ? b : a) }')
}

run_timed() { # FILE RESULTS: run_lab, then the time it took and the load
  local started=$SECONDS
  run_lab "$1" "$2"
  note_load
  echo "  done in $((SECONDS - started)) s (load $(cut -d' ' -f1 /proc/loadavg))"
}

total=0
for b in $BUFFERS; do for s in $SEEDS; do total=$((total + 1)); done; total=$((total + 1)); done
n=0
for b in $BUFFERS; do
  for s in $SEEDS; do
    n=$((n + 1))
    name="hb$b-s$s-$$"
    lab_variant "labs/handoff-b$b.toml" "$name" "$s" "$WORK/handoff-b$b-s$s.toml"
    echo "experiment-binding: [$n/$total] handoff, device buffer $b, seed $s"
    run_timed "$WORK/handoff-b$b-s$s.toml" "$WORK/handoff-b$b-s$s"
    python3 scripts/experiments/handoff_results.py "$WORK/handoff-b$b-s$s" > "$WORK/handoff-b$b-s$s/summary.json"
  done
done
for b in $BUFFERS; do
  n=$((n + 1))
  lab_variant "labs/urgent-b$b.toml" "ub$b-$$" 1 "$WORK/urgent-b$b.toml"
  echo "experiment-binding: [$n/$total] urgent, device buffer $b (50 repetitions)"
  run_timed "$WORK/urgent-b$b.toml" "$WORK/urgent-b$b"
done
load_end=$(load_now)
python3 scripts/experiments/binding_report.py "$WORK" "$OUT" \
  --command "sudo SEEDS=\"$SEEDS\" BUFFERS=\"$BUFFERS\" scripts/experiment-binding.sh" \
  --load "$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); run from $started_at, \
$(((SECONDS - labs_from) / 60)) min; at the start $load_start, at the end $load_end, highest 1-min load after a lab \
$load_max"
echo "experiment-binding: wrote $OUT/late-binding.md"

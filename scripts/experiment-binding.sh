#!/usr/bin/env bash
# Reproduces the late-binding paper's experiments in flexstack labs and writes docs/experiments/late-binding.md
# with tables and SVG plots (Figures 4, 5 and 7 of the paper): see that file for what is measured and how.
#
#   sudo scripts/experiment-binding.sh                 # all variants: handoff x 4 buffers x SEEDS, urgent x 4
#   sudo SEEDS="1 2" BUFFERS="2 50" scripts/experiment-binding.sh
#
# Needs root (namespaces, veth pairs), python3 and a release build (made here). Runs from the repository's root;
# every lab run's results folder is kept under $WORK (printed). Runtime: about 16 s per handoff run and 48 s per
# urgent run (defaults: 12 + 4 runs, ~6.5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "experiment-binding: needs root (network namespaces)" >&2; exit 1; }
SEEDS=${SEEDS:-"1 2 3"}
BUFFERS=${BUFFERS:-"50 5 2 1"}
OUT=${OUT:-docs/experiments}
WORK=${WORK:-$(mktemp -d /tmp/fs-binding.XXXXXX)}
STATE=$WORK/state
FS=target/release/flexstack
echo "experiment-binding: building (release)"
cargo build --release -q
mkdir -p "$WORK" "$OUT"
echo "experiment-binding: results under $WORK"

# A copy of a lab file with a unique name (labs are named globally by their namespaces), a seed, and absolute
# stack paths (the copy lives elsewhere).
variant() { # FILE NAME SEED DEST
  sed -e "s/^name = .*/name = \"$2\"/" -e "s/^seed = .*/seed = $3/" -e "s#\"\.\./stacks/#\"$PWD/stacks/#" "$1" > "$4"
}

run_lab() { # FILE RESULTS
  local started=$SECONDS
  if ! "$FS" --state-dir "$STATE" lab run "$1" --results "$2" --quiet > "$2.log" 2>&1; then
    echo "experiment-binding: $1 failed; see $2.log" >&2
    tail -5 "$2.log" >&2
    return 1
  fi
  if grep -q FAILED "$2/timeline.csv"; then
    echo "experiment-binding: an event failed in $2:" >&2
    grep FAILED "$2/timeline.csv" >&2
    return 1
  fi
  echo "  done in $((SECONDS - started)) s"
}

total=0
for b in $BUFFERS; do for s in $SEEDS; do total=$((total + 1)); done; total=$((total + 1)); done
n=0
for b in $BUFFERS; do
  for s in $SEEDS; do
    n=$((n + 1))
    name="hb$b-s$s-$$"
    variant "labs/handoff-b$b.toml" "$name" "$s" "$WORK/handoff-b$b-s$s.toml"
    echo "experiment-binding: [$n/$total] handoff, device buffer $b, seed $s"
    run_lab "$WORK/handoff-b$b-s$s.toml" "$WORK/handoff-b$b-s$s"
    python3 scripts/experiments/handoff_results.py "$WORK/handoff-b$b-s$s" > "$WORK/handoff-b$b-s$s/summary.json"
  done
done
for b in $BUFFERS; do
  n=$((n + 1))
  variant "labs/urgent-b$b.toml" "ub$b-$$" 1 "$WORK/urgent-b$b.toml"
  echo "experiment-binding: [$n/$total] urgent, device buffer $b (50 repetitions)"
  run_lab "$WORK/urgent-b$b.toml" "$WORK/urgent-b$b"
done
python3 scripts/experiments/binding_report.py "$WORK" "$OUT" \
  --command "sudo SEEDS=\"$SEEDS\" BUFFERS=\"$BUFFERS\" scripts/experiment-binding.sh"
echo "experiment-binding: wrote $OUT/late-binding.md"

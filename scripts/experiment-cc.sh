#!/usr/bin/env bash
# CRAWLER's TCP use case in a flexstack lab: goodput vs random loss for fixed cubic, fixed bbr and a rule that
# switches a running connection between the two on the loss the sender measures (labs/cc-adaptive.toml and
# labs/cc-adaptive.rules). Writes docs/experiments/cc-adaptive.md with tables and SVG plots.
#
#   sudo scripts/experiment-cc.sh                 # seeds 1 and 2 (~75 s per run)
#   sudo SEEDS="1 2 3" OUT=/tmp/cc scripts/experiment-cc.sh
#
# Needs root (namespaces, veth pairs), python3 (3.11: tomllib) and a release build (made here). Runs from the
# repository's root; every lab run's results folder is kept under $WORK (printed).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/experiment.sh   # experiment_setup, lab_variant, run_lab
experiment_setup cc
SEEDS=${SEEDS:-"1 2"}
cp labs/cc-adaptive.rules "$WORK/"
runs=()
for s in $SEEDS; do
  # The rule file is copied next to the copy of the lab (rules paths are relative to the lab file).
  lab="$WORK/cc-s$s.toml"
  lab_variant labs/cc-adaptive.toml "cc-s$s-$$" "$s" "$lab"
  echo "experiment-cc: seed $s"
  started=$SECONDS
  run_lab "$lab" "$WORK/cc-s$s"
  echo "  done in $((SECONDS - started)) s"
  runs+=("$WORK/cc-s$s")
done
python3 scripts/experiments/cc_report.py "$OUT" "${runs[@]}" --rules labs/cc-adaptive.rules \
  --command "sudo SEEDS=\"$SEEDS\" scripts/experiment-cc.sh"
echo "experiment-cc: wrote $OUT/cc-adaptive.md"

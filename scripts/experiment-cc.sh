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
[ "$(id -u)" = 0 ] || { echo "experiment-cc: needs root (network namespaces)" >&2; exit 1; }
SEEDS=${SEEDS:-"1 2"}
OUT=${OUT:-docs/experiments}
WORK=${WORK:-$(mktemp -d /tmp/fs-cc.XXXXXX)}
STATE=$WORK/state
FS=target/release/flexstack
echo "experiment-cc: building (release)"
cargo build --release -q
mkdir -p "$WORK" "$OUT"
echo "experiment-cc: results under $WORK"
cp labs/cc-adaptive.rules "$WORK/"
runs=()
for s in $SEEDS; do
  # A copy with a unique name (labs are named globally by their namespaces) and the seed; the rule file is
  # copied next to it (rules paths are relative to the lab file).
  lab="$WORK/cc-s$s.toml"
  sed -e "s/^name = .*/name = \"cc-s$s-$$\"/" -e "s/^seed = .*/seed = $s/" labs/cc-adaptive.toml > "$lab"
  echo "experiment-cc: seed $s"
  started=$SECONDS
  if ! "$FS" --state-dir "$STATE" lab run "$lab" --results "$WORK/cc-s$s" --quiet > "$WORK/cc-s$s.log" 2>&1; then
    echo "experiment-cc: $lab failed; see $WORK/cc-s$s.log" >&2
    tail -5 "$WORK/cc-s$s.log" >&2
    exit 1
  fi
  if grep -q FAILED "$WORK/cc-s$s/timeline.csv"; then
    echo "experiment-cc: an event failed:" >&2
    grep FAILED "$WORK/cc-s$s/timeline.csv" >&2
    exit 1
  fi
  echo "  done in $((SECONDS - started)) s"
  runs+=("$WORK/cc-s$s")
done
python3 scripts/experiments/cc_report.py "$OUT" "${runs[@]}" --rules labs/cc-adaptive.rules \
  --command "sudo SEEDS=\"$SEEDS\" scripts/experiment-cc.sh"
echo "experiment-cc: wrote $OUT/cc-adaptive.md"

# Shell helpers shared by the experiment scripts (scripts/experiment-*.sh source this file from the repository's
# root).

# experiment_setup NAME: needs root; sets OUT (default docs/experiments), WORK (default a new /tmp/fs-NAME.XXXXXX),
# STATE and FS, builds the release binary and makes the folders. NAME (binding, cc) also names the messages.
experiment_setup() {
  EXPERIMENT=experiment-$1
  [ "$(id -u)" = 0 ] || { echo "$EXPERIMENT: needs root (network namespaces)" >&2; exit 1; }
  OUT=${OUT:-docs/experiments}
  WORK=${WORK:-$(mktemp -d "/tmp/fs-$1.XXXXXX")}
  STATE=$WORK/state
  FS=target/release/flexstack
  echo "$EXPERIMENT: building (release)"
  cargo build --release -q
  mkdir -p "$WORK" "$OUT"
  echo "$EXPERIMENT: results under $WORK"
}

# lab_variant FILE NAME SEED DEST: writes to DEST a copy of the lab FILE with the name NAME (labs are named globally
# by their namespaces: make it unique), the seed SEED and absolute stack paths (the copy lives elsewhere).
lab_variant() {
  sed -e "s/^name = .*/name = \"$2\"/" -e "s/^seed = .*/seed = $3/" -e "s#\"\.\./stacks/#\"$PWD/stacks/#" "$1" > "$4"
}

# run_lab FILE RESULTS: runs the lab FILE, its results into the folder RESULTS and its output into RESULTS.log;
# fails, saying why, if the run or one of its events failed.
run_lab() {
  if ! "$FS" --state-dir "$STATE" lab run "$1" --results "$2" --quiet > "$2.log" 2>&1; then
    echo "$EXPERIMENT: $1 failed; see $2.log" >&2
    tail -5 "$2.log" >&2
    return 1
  fi
  if grep -q FAILED "$2/timeline.csv"; then
    echo "$EXPERIMENT: an event failed in $2:" >&2
    grep FAILED "$2/timeline.csv" >&2
    return 1
  fi
}

#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser with libFuzzer (cargo-fuzz, nightly toolchain): fuzz/README.md.
#
#   scripts/fuzz.sh [--check] [SECONDS] [TARGET...]
#
# Runs a campaign of SECONDS (default 60) per target (default: all of fuzz/fuzz_targets/), seeded from
# fuzz/corpus/TARGET/ (the hand-written seeds, also the stable fuzz tests' seeds) and fuzz/corpus/TARGET/found/ (what
# earlier campaigns found), then merges the inputs that add coverage into fuzz/corpus/TARGET/found/ and prints, per
# target, the runs, the coverage reached (libFuzzer's cov: edges and ft: features) and any crash with the path of its
# artifact (fuzz/artifacts/TARGET/). Exits 1 if a target crashed, timed out or ran out of memory.
#
# --check (CI, scripts/test.sh): nothing is merged into the corpus; a short run per target.
#
# Environment: FUZZ_JOBS (parallel targets, default 1), FUZZ_SANITIZER (cargo fuzz -s: none by default, as the code
# under test is safe Rust; address for a C dependency), FUZZ_TIMEOUT (seconds one input may take, default 10).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

check=0
if [[ ${1:-} == --check ]]; then
  check=1
  shift
fi
secs=60
if [[ ${1:-} =~ ^[0-9]+$ ]]; then
  secs=$1
  shift
fi
targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(ls fuzz_targets | sed -n 's/\.rs$//p' | sort)
fi
for t in "${targets[@]}"; do
  [[ -f fuzz_targets/$t.rs ]] || { echo "fuzz: no target $t (fuzz/fuzz_targets/$t.rs)" >&2; exit 2; }
done
sanitizer=${FUZZ_SANITIZER:-none}
timeout=${FUZZ_TIMEOUT:-10}
jobs=${FUZZ_JOBS:-1}

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz or the nightly toolchain is missing: rustup toolchain install nightly;" \
    "cargo install cargo-fuzz --locked (scripts/setup.sh does both)" >&2
  exit 2
fi

# One build for all targets, with libFuzzer's coverage instrumentation and debug assertions and overflow checks on
# (-a): optimized for campaigns; for --check a dev build, which after a change to a crate takes seconds instead of
# minutes (cargo-fuzz builds release with one codegen unit) and runs fast enough for a few seconds per target.
build_args=(-s "$sanitizer" -a)
if ((check)); then
  build_args+=(--dev)
fi
started=$SECONDS
cargo +nightly fuzz build "${build_args[@]}" >&2
echo "fuzz: built in $((SECONDS - started)) s"

# As root, each campaign runs in a network namespace of its own, with nothing but a loopback interface: the checks
# never configure device kinds (fuzz/src/parsers.rs: DEVICE_KINDS), and this keeps it so whatever the fuzzer finds.
isolate=()
if [[ $(id -u) == 0 ]] && command -v unshare >/dev/null; then
  isolate=(unshare --net --)
fi
export CARGO_NET_OFFLINE=true

# Files the checks create (a tap's capture) and libFuzzer's working corpora live here, removed on exit.
work=$(mktemp -d "${TMPDIR:-/tmp}/flexstack-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

# campaign TARGET: runs it, then merges; writes "$work/TARGET.result" (one summary line) and the log.
campaign() {
  local t=$1 log=$work/$t.log corpus=$work/$t
  mkdir -p "$corpus" "$work/tmp-$t" "artifacts/$t"
  local seeds=(corpus/"$t")
  [[ -d corpus/$t ]] || seeds=()
  local status=0
  # New inputs go to the scratch corpus (first folder); the repository's are read only.
  TMPDIR=$work/tmp-$t "${isolate[@]}" cargo +nightly fuzz run "${build_args[@]}" "$t" "$corpus" "${seeds[@]}" -- \
    -max_total_time="$secs" -timeout="$timeout" -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
  # What libFuzzer printed last (the DONE line, or the last status line before a crash); missing fields stay "-".
  local done runs cov ft corp execs crash="" kind
  done=$(grep -E '^#[0-9]+\s+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -1) || true
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1) || true
  execs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1) || true
  cov=$(grep -oE 'cov: [0-9]+' <<<"$done" | awk '{print $2}') || true
  ft=$(grep -oE 'ft: [0-9]+' <<<"$done" | awk '{print $2}') || true
  corp=$(grep -oE 'corp: [0-9]+/[0-9]+[a-zA-Z]*' <<<"$done" | awk '{print $2}') || true
  if ((status != 0)); then
    crash=$(grep -oE '(Test unit|artifact) written to \S+' "$log" | tail -1 | awk '{print $NF}') || true
    # A Rust panic (the check's message is on the line after "panicked at"), else libFuzzer's own error.
    kind=$(grep -A1 -m1 'panicked at' "$log" | sed -n '2s/^/panic: /p' | cut -c1-120) || true
    [[ -n $kind ]] || kind=$(grep -oE 'ERROR: libFuzzer: [a-z -]+' "$log" | head -1) || true
    crash="${kind:-exit $status}: ${crash:-(no artifact; see the log)}"
    cp "$log" "artifacts/$t/last-failure.log"
  fi
  local added=0 kept=-
  if ((check == 0)) && ((status == 0)); then
    # Merge, minimizing: found/ becomes the smallest set libFuzzer picks among the old found/ and this campaign's
    # inputs that covers every edge the seeds at the top of corpus/TARGET/ do not (edges only, not hit counts, so
    # that it stays a few hundred small files).
    local merged=$work/merge-$t
    mkdir -p "$merged" "corpus/$t/found"
    find "corpus/$t" -maxdepth 1 -type f -exec cp -t "$merged" {} +
    ls "$merged" | sort >"$work/$t.seeds"
    if TMPDIR=$work/tmp-$t "${isolate[@]}" cargo +nightly fuzz run "${build_args[@]}" "$t" "$merged" \
      "corpus/$t/found" "$corpus" -- -set_cover_merge=1 -use_counters=0 -timeout="$timeout" -rss_limit_mb=4096 \
      >"$work/$t.merge.log" 2>&1; then
      ls "corpus/$t/found" | sort >"$work/$t.found-before"
      comm -13 "$work/$t.seeds" <(ls "$merged" | sort) >"$work/$t.found-after"
      added=$(comm -13 "$work/$t.found-before" "$work/$t.found-after" | wc -l)
      kept=$(wc -l <"$work/$t.found-after")
      rm -rf "corpus/$t/found.new" && mkdir "corpus/$t/found.new"
      while read -r f; do cp "$merged/$f" "corpus/$t/found.new/$f"; done <"$work/$t.found-after"
      rm -rf "corpus/$t/found" && mv "corpus/$t/found.new" "corpus/$t/found"
    else
      crash="merge failed: $(tail -2 "$work/$t.merge.log" | tr '\n' ' ')"
    fi
  fi
  printf '%-8s %10s %8s %6s %7s %12s %6s %6s  %s\n' "$t" "${runs:--}" "${execs:--}" "${cov:--}" "${ft:--}" \
    "${corp:--}" "$added" "$kept" "${crash:-ok}" >"$work/$t.result"
}

echo "fuzz: ${#targets[@]} target(s), $secs s each, $jobs at a time$( ((check)) && echo ', no merge (check)')"
running=0
for t in "${targets[@]}"; do
  campaign "$t" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

printf '%-8s %10s %8s %6s %7s %12s %6s %6s  %s\n' target runs exec/s cov ft corpus added found result
failed=0
for t in "${targets[@]}"; do
  if [[ -f $work/$t.result ]]; then
    cat "$work/$t.result"
    grep -q '  ok$' "$work/$t.result" || failed=1
  else
    printf '%-8s did not finish\n' "$t"
    failed=1
  fi
done
if ((failed)); then
  echo "fuzz: FAILED; reproduce with: cd fuzz && cargo +nightly fuzz run ${build_args[*]} TARGET ARTIFACT" >&2
  echo "fuzz: fix it, then add the input to fuzz/corpus/TARGET/ under a name that says what it is" >&2
  exit 1
fi

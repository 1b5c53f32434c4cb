#!/usr/bin/env bash
# Lab benchmark (issue 19): how long labs of hundreds of hosts take to build and tear down, where the time of a
# 1,000-host build goes, and what 1,000 emulated links cost the wire daemon per frame. Needs root, python3, ping,
# strace and bc. Labs are built with the release binary, as `flexstack lab up -q` / `lab down -q` do.
#
# Part 1, 200 hosts: a binary tree of HOSTS (200) plain hosts (host i linked to (i - 1) / 2: 199 emulated links),
#   built with `lab up` and removed with `lab down`, RUNS (5) times; printed: each run's times, the medians, and the
#   build's phases (namespaces, links, addresses and routes, wire daemon) of the median run, from the runner's own
#   summary line. A ping from h199 to h127 (14 links through the root) checks each build.
# Part 2, BIG (1000) hosts: the same tree, built once with the phases printed, then built again under
#   `strace -f -c` (the runner and its threads, not the daemons it starts: strace leaves them at their exec) for
#   the system calls that take the time, and removed (timed).
# Part 3, the wire daemon's cost per frame with one emulated link and with LINKS (1000): two labs up at once, a
#   2-host lab and a star of LINKS + 1 hosts (every link's emulators and packet faces in one wire daemon). In each,
#   `ping -f -c PINGS` crosses one link; the wire daemon's CPU time (its threads' run time,
#   /proc/PID/task/*/schedstat) over the frames its two emulators of that link passed (frames_in_total) is the cost
#   per frame. ROUNDS (5) rounds alternate the
#   labs; the medians and their ratio are printed (issue target: within 20 %).
# PARTS="1 2 3" (default) selects the parts. FS=PATH benchmarks another binary; NO_BUILD=1 skips the build;
# PROFILE=ci builds and runs target/ci/flexstack instead of the release binary (quicker to build; say so with figures).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench.sh
RUNS=${RUNS:-5}
HOSTS=${HOSTS:-200}
BIG=${BIG:-1000}
LINKS=${LINKS:-1000}
ROUNDS=${ROUNDS:-5}
PINGS=${PINGS:-20000}
PARTS=${PARTS:-1 2 3}
bench_setup bench-lab "namespaces, veth pairs, daemons: run it with sudo" python3 ping strace bc
tag=fsb$$
work=$(mktemp -d /tmp/${tag}.XXXX)
state=$work/state
cleanup() {
  "$fs" --state-dir "$state" lab down --all -q >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "bench-lab: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src crates || echo '+changes'), ${FS:-profile $PROFILE}, $(nproc) cores, kernel $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"

# tree NAME N: a lab file of N hosts, host i linked to (i - 1) / 2.
tree() {
  python3 - "$1" "$2" <<'PY'
import sys
name, n = sys.argv[1], int(sys.argv[2])
print(f'[lab]\nname = "{name}"\nduration = "1s"')
for i in range(n): print(f'[hosts.h{i}]')
for i in range(1, n): print(f'[[links]]\na = "h{(i - 1) // 2}"\nb = "h{i}"')
PY
}

# star NAME N: a lab file of N + 1 hosts, h0 linked to each of h1..hN.
star() {
  python3 - "$1" "$2" <<'PY'
import sys
name, n = sys.argv[1], int(sys.argv[2])
print(f'[lab]\nname = "{name}"\nduration = "1s"')
for i in range(n + 1): print(f'[hosts.h{i}]')
for i in range(1, n + 1): print(f'[[links]]\na = "h0"\nb = "h{i}"')
PY
}

now() { date +%s.%N; }

# up NAME FILE: builds the lab (progress on stderr kept in $work/NAME.up), prints the seconds it took.
up() {
  local t0; t0=$(now)
  "$fs" --state-dir "$state" lab up "$2" --results "$work/res-$1-$RANDOM" >/dev/null 2>"$work/$1.up" \
    || { cat "$work/$1.up" >&2; exit 1; }
  echo "$(now) - $t0" | bc
}

# down NAME: removes the lab, prints the seconds it took.
down() {
  local t0; t0=$(now)
  "$fs" --state-dir "$state" lab down "$1" >/dev/null 2>"$work/$1.down" || { cat "$work/$1.down" >&2; exit 1; }
  echo "$(now) - $t0" | bc
}

if [[ " $PARTS " == *" 1 "* ]]; then
  name=${tag}t
  tree "$name" "$HOSTS" > "$work/tree.toml"
  echo
  echo "== Part 1: a tree of $HOSTS hosts ($((HOSTS - 1)) links), $RUNS builds and teardowns"
  : > "$work/builds"; : > "$work/downs"
  for r in $(seq 1 "$RUNS"); do
    b=$(up "$name" "$work/tree.toml")
    "$fs" --state-dir "$state" lab exec h$((HOSTS - 1)) -- ping -c 1 -W 3 h127 >/dev/null \
      || { echo "bench-lab: ping across the tree failed" >&2; exit 1; }
    d=$(down "$name")
    echo "$b" >> "$work/builds"; echo "$d" >> "$work/downs"
    grep "built in" "$work/$name.up" > "$work/summary.$r"
    printf '  run %d: built in %.2f s, torn down in %.2f s   (%s)\n' "$r" "$b" "$d" "$(sed 's/^lab [^:]*: //' "$work/summary.$r")"
  done
  printf '  median: built in %.2f s (target <= 10), torn down in %.2f s (target <= 5)\n' \
    "$(median < "$work/builds")" "$(median < "$work/downs")"
fi

if [[ " $PARTS " == *" 2 "* ]]; then
  name=${tag}b
  tree "$name" "$BIG" > "$work/big.toml"
  echo
  echo "== Part 2: a tree of $BIG hosts ($((BIG - 1)) links)"
  b=$(up "$name" "$work/big.toml")
  printf '  built in %.2f s: %s\n' "$b" "$(grep 'built in' "$work/$name.up" | sed 's/^lab [^:]*: built in [^:]*: //')"
  d=$(down "$name")
  printf '  torn down in %.2f s: %s\n' "$d" "$(grep 'torn down in' "$work/$name.down" | sed 's/^lab [^:]*: torn down in [^:]*: //')"
  echo "  under strace -f -c (the runner and its threads; times are inflated by tracing):"
  strace -f -c -b execve -o "$work/strace.txt" \
    "$fs" --state-dir "$state" lab up -q "$work/big.toml" --results "$work/res-strace" >/dev/null 2>&1
  head -14 "$work/strace.txt" | sed 's/^/    /'
  down "$name" >/dev/null
fi

if [[ " $PARTS " == *" 3 "* ]]; then
  one=${tag}o; many=${tag}m
  star "$one" 1 > "$work/one.toml"
  star "$many" "$LINKS" > "$work/many.toml"
  echo
  echo "== Part 3: the wire daemon's CPU time per frame, 1 emulated link against $LINKS"
  printf '  built the %s-link lab in %.2f s\n' "$LINKS" "$(up "$many" "$work/many.toml")"
  up "$one" "$work/one.toml" >/dev/null
  # cpu_ns NAME: the wire daemon's CPU time so far, in ns: the sum over its threads of the run time the scheduler
  # accounts (/proc/PID/task/*/schedstat, in ns; /proc/PID/stat counts in ticks of 10 ms).
  cpu_ns() {
    local pid; pid=$(cat "$state/labs/$1/wire/daemon.pid")
    cat /proc/"$pid"/task/*/schedstat | awk '{ s += $1 } END { printf "%.0f\n", s }'
  }
  # frames NAME: the frames the emulators of link h0-h1 took in.
  frames() {
    "$fs" --state-dir "$state/labs/$1/wire" -j get 'module.h0-h1_*.frames_in_total' \
      | python3 -c 'import json,sys; print(sum(v["value"] for v in json.load(sys.stdin).values()))'
  }
  : > "$work/cost.one"; : > "$work/cost.many"
  for r in $(seq 1 "$ROUNDS"); do
    for lab in "$one" "$many"; do
      c0=$(cpu_ns "$lab"); f0=$(frames "$lab")
      "$fs" --state-dir "$state" lab exec --lab "$lab" h1 -- ping -f -q -c "$PINGS" 10.0.0.1 >/dev/null
      c1=$(cpu_ns "$lab"); f1=$(frames "$lab")
      cost=$(echo "($c1 - $c0) / ($f1 - $f0)" | bc -l)
      if [[ $lab == "$one" ]]; then echo "$cost" >> "$work/cost.one"; else echo "$cost" >> "$work/cost.many"; fi
      printf '  round %d, %5s links: %6d frames, %7.0f ns of CPU per frame\n' "$r" \
        "$([[ $lab == "$one" ]] && echo 1 || echo "$LINKS")" "$((${f1%.*} - ${f0%.*}))" "$cost"
    done
  done
  m1=$(median < "$work/cost.one"); mm=$(median < "$work/cost.many")
  printf '  median: %.0f ns per frame with 1 link, %.0f ns with %s: ratio %.2f (target <= 1.20)\n' \
    "$m1" "$mm" "$LINKS" "$(echo "$mm / $m1" | bc -l)"
  down "$many" >/dev/null; down "$one" >/dev/null
fi
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

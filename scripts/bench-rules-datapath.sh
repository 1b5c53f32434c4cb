#!/usr/bin/env bash
# "Rule load does not slow packets" (issue 6): the data path's throughput and per-packet cost with 0 and with
# 1,000 active rule units, in the same run.
#
# A release daemon runs source -> count -> sel -> sink0 (sel[1] -> sink1), the source as fast as it can. Rounds
# alternate between no rules and a rule file of 1,000 units (200 rules of 5 units that read the counter's
# frames_total, which changes on every sample, so every unit is re-evaluated at every sample of the rules
# thread, every 5 ms; plus one rule that sets sel.select). Per round, over SECS seconds:
#   - throughput: frames/s arriving at sink0;
#   - per-packet cost: the data plane's busy time of all modules divided by the frames (`show runtime`), i.e.
#     the time a frame spends being processed along the path;
#   - the rules thread's CPU time (from /proc, thread name "rules").
# Prints each round, the medians per configuration and the ratios 1000-units / 0-units. Results: BENCHMARKS.md,
# "Rules". No root needed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
SECS=${SECS:-3}
UNITS_RULES=${UNITS_RULES:-200}
cargo build --release --quiet
fs=$PWD/target/release/flexstack
state=$(mktemp -d)
cleanup() {
  [[ -n "${daemon:-}" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

cat > "$state/stack.toml" <<'TOML'
links = ["src -> count", "count -> sel", "sel[0] -> sink0", "sel[1] -> sink1"]
[modules.src]
kind = "source"
rate = 1e9
size = 64
[modules.count]
kind = "counter"
[modules.sel]
kind = "select"
outputs = 2
select = 0
[modules.sink0]
kind = "sink"
[modules.sink1]
kind = "sink"
TOML

{
  echo '# 1,000 units: 200 rules of get -> History -> Avg -> Greater(_, constant), and one set.'
  for i in $(seq "$UNITS_RULES"); do
    echo "r$i: Greater(Avg(History(get(\"module.count.frames_total\"), 16)), $i)"
  done
  echo 'keep: set("module.sel.select", If(Greater(get("module.count.frames_total"), 0), 0, 0))'
} > "$state/load.rules"

"$fs" daemon --stack "$state/stack.toml" --state-dir "$state/d" 2>"$state/daemon.log" &
daemon=$!
for _ in $(seq 200); do "$fs" --state-dir "$state/d" status >/dev/null 2>&1 && break; sleep 0.05; done
cli() { "$fs" --state-dir "$state/d" "$@"; }

rules_cpu_ns() { # the rules thread's user+system time, in ns
  for t in /proc/$daemon/task/*; do
    if [[ $(cat "$t/comm") == rules ]]; then
      awk -v hz="$(getconf CLK_TCK)" '{print ($14+$15) * 1e9 / hz}' "$t/stat"; return
    fi
  done
  echo 0
}

sample() { # prints: sink0_frames busy_ns_total rules_cpu_ns time_ns
  local frames busy
  frames=$(cli -j get module.sink0.frames_total | python3 -c 'import json,sys; print(json.load(sys.stdin)["module.sink0.frames_total"]["value"])')
  busy=$(cli -j show runtime | python3 -c 'import json,sys; print(sum(m["busy_ns"] for m in json.load(sys.stdin)))')
  echo "$frames $busy $(rules_cpu_ns) $(date +%s%N)"
}

sleep 1
results=$state/results.txt
for r in $(seq "$ROUNDS"); do
  for mode in 0 1000; do
    if [[ $mode == 1000 ]]; then
      cli rules load "$state/load.rules" >/dev/null
    else
      cli rules unload ALL >/dev/null 2>&1 || true
    fi
    units=$(cli -j rules log | python3 -c 'import json,sys; print(json.load(sys.stdin)["units"])')
    sleep 0.5
    a=$(sample); sleep "$SECS"; b=$(sample)
    python3 - "$mode" "$units" "$a" "$b" >> "$results" <<'PY'
import sys
mode, units = sys.argv[1], int(sys.argv[2])
a = [float(x) for x in sys.argv[3].split()]; b = [float(x) for x in sys.argv[4].split()]
frames, busy, cpu, dt = b[0] - a[0], b[1] - a[1], b[2] - a[2], (b[3] - a[3]) / 1e9
print(mode, units, frames / dt, busy / frames, cpu / 1e9 / dt)
PY
    tail -1 "$results" | awk -v r="$r" '{printf "round %d  %5s-unit config (%4d units running): %12.0f frames/s  %7.1f ns/frame  rules thread %5.1f%% CPU\n", r, $1, $2, $3, $4, 100*$5}'
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
def med(mode, col):
    return statistics.median(float(r[col]) for r in rows if r[0] == mode)
t0, t1 = med("0", 2), med("1000", 2)
c0, c1 = med("0", 3), med("1000", 3)
u0, u1 = med("0", 4), med("1000", 4)
spread = lambda mode, col: (min(float(r[col]) for r in rows if r[0] == mode), max(float(r[col]) for r in rows if r[0] == mode))
print("median of %d rounds:" % (len(rows) // 2))
print("  0 units:    %12.0f frames/s (range %.0f-%.0f)  %7.1f ns/frame (range %.1f-%.1f)  rules thread %5.1f%% CPU" % (t0, *spread("0", 2), c0, *spread("0", 3), 100 * u0))
print("  1000 units: %12.0f frames/s (range %.0f-%.0f)  %7.1f ns/frame (range %.1f-%.1f)  rules thread %5.1f%% CPU" % (t1, *spread("1000", 2), c1, *spread("1000", 3), 100 * u1))
print("  ratio 1000/0: throughput %.3f  ns/frame %.3f" % (t1 / t0, c1 / c0))
PY

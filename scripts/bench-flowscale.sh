#!/usr/bin/env bash
# Flow-table scale benchmark (issue 16): what a packet costs the data plane when the flow table holds FLOWS flows,
# and the daemon's memory. flexstack TUN <-> TUN with the default app modules (ip, reassemble, classify with
# max_flows = MAX_FLOWS, direction) between two namespaces; bench/udp_flows.c sends 64-byte UDP datagrams
# round-robin over FLOWS distinct 5-tuples (ports 1024-65023 of consecutive addresses, which the receiving
# namespace drops silently: it does not forward). For each FLOWS value (default "10 100000"), in every round a fresh
# daemon: first every flow once (the table fills), then PPS datagrams a second for SECS seconds, during which
# - the daemon's CPU time (all its threads, /proc/PID/task/*/schedstat) over the datagrams it passed to namespace b
#   gives ns per packet;
# - delivered / sent shows that nothing was lost (a saturated data plane would make the cost figure meaningless);
# - VmRSS at the end is the daemon's resident memory with that table;
# - classify's own ns per packet (its busy_ns_total over its frames, `show runtime`): the flow table's share, apart
#   from the faces' system calls and the kernel work they trigger;
# - the daemon's context switches per packet (/proc/PID/task/*/status): how many packets a wake-up finds;
# - the daemon's write system calls per packet (`syscw` of /proc/PID/io): how many datagrams a TUN write carries.
#   With offloads (the default) the TUN face coalesces consecutive datagrams of one flow into one write (UDP GSO):
#   10 flows sent in turn give about 3 a write at this rate, 100,000 flows one, so the 10-flow figure has fewer
#   writes (and fewer packets for b's kernel) for reasons that are not the flow table's. OFFLOAD=0 (plain TUN
#   packets, scripts/lib/bench.sh) writes every datagram alone at any flow count: the flow table's cost apart;
# - after the window, the daemon's CPU time per `get` of one meter (GETS of them, default 20; /proc/PID/stat, which
#   keeps the time of the control connections' threads once they ended, in ticks of 10 ms: 0.5 ms resolution at
#   20): what a reader of one meter costs with that table (it is not in ns per packet: those threads have ended
#   when the schedstat sum is read);
# - then the rules thread's CPU time over 1 s with one rule loaded, sampled every 5 ms as the daemon does by default
#   ("rules ms/s"; RULES=name: the rule reads one meter by name; pattern: a per-name rule over a pattern, one instance
#   per module; flows: a per-name rule over every flow's packet count, one instance per flow, the daemon's caps
#   raised for them; none: skipped), RULES_SETTLE seconds after the load (default 0.3; the first samples make the
#   instances), and the sampling interval in use then ("sample ms", rules.engine.sample_interval_us; the thread
#   keeps sampling within `daemon --rules-max-cpu`, which RULES_CPU=N passes to every binary measured).
# A TUN write hands the packet to namespace b's stack synchronously, so b's handling of it is charged to the daemon's
# CPU time. SINK picks what b does with the datagrams: `drop` (default) drops them as they arrive on the device (an
# nftables ingress hook, before IP), so that the figure is flexstack's work; `route` leaves them to b's routing (no
# route, no forwarding: dropped after an uncached route lookup that allocates and RCU-frees a dst per packet; the
# sink of the figures before 2026-11-27 08:30 UTC). Either way a GSO write of several datagrams is one skb for b.
# Prints medians over RUNS rounds and the ratio of each FLOWS value's cost to the first's. Targets (issue 16):
# 100,000 flows within 1.2 x the cost of 10, RSS <= 128 MiB. Needs root. PROFILE/FS/NO_BUILD as in the other
# benchmarks (scripts/lib/bench.sh); WORKERS (default 1) is passed to `daemon --workers`. PERF=file records a profile
# of the daemon while it sends (file.new.FLOWS, overwritten each round). FS_OLD=binary measures that binary too, in the
# same rounds, alternating with FS (A/B: the old code against the new on a shared machine). PERF_STAT=events (perf
# stat -e syntax) prints each event per delivered datagram, e.g. PERF_STAT=cache-misses,syscalls:sys_enter_write.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-5}
PPS=${PPS:-50000}
FLOWS=${FLOWS:-10 100000}
MAX_FLOWS=${MAX_FLOWS:-262144}
WORKERS=${WORKERS:-1}
NET=${NET:-217}
SINK=${SINK:-drop}
[[ $SINK == drop || $SINK == route ]] || { echo "bench-flowscale: SINK is drop or route, not $SINK" >&2; exit 2; }
. scripts/lib/bench.sh # median, default_modules_stack, bench_setup
bench_setup bench-flowscale "namespaces, TUN devices" cc python3 nft
tag=fsk$$
state=$(mktemp -d)
daemon=
stop_daemon() {
  [[ -n "$daemon" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  daemon=
}
cleanup() {
  stop_daemon
  ns_cleanup ${tag}a ${tag}b
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
cc -O2 -o "$state/udp_flows" bench/udp_flows.c
ip netns add ${tag}a; ip netns add ${tag}b
ip -n ${tag}a link set lo up; ip -n ${tag}b link set lo up
default_modules_stack | sed "s/^kind = \"classify\"$/kind = \"classify\"\nmax_flows = $MAX_FLOWS/" > "$state/chain.toml"
grep -q "max_flows = $MAX_FLOWS" "$state/chain.toml" || { echo "bench-flowscale: could not set max_flows" >&2; exit 1; }

# Starts a daemon and places its TUN devices: ${tag}ta in a (10.NET.0.1, and the route to every destination),
# ${tag}tb in b (10.NET.0.2).
start_daemon() {
  "$1" daemon --workers "$WORKERS" --stack "$state/chain.toml" --state-dir "$state/d" "${rules_caps[@]}" \
    2>"$state/daemon.log" &
  daemon=$!
  wait_for '"$fs" --state-dir "$state/d" status >/dev/null 2>&1' "the daemon did not start (see its log)"
  ip link set ${tag}ta netns ${tag}a; ip link set ${tag}tb netns ${tag}b
  ip -n ${tag}a addr add 10.$NET.0.1/24 dev ${tag}ta; ip -n ${tag}a link set ${tag}ta up
  ip -n ${tag}a route add 10.$NET.0.0/16 dev ${tag}ta
  ip -n ${tag}b addr add 10.$NET.0.2/24 dev ${tag}tb; ip -n ${tag}b link set ${tag}tb up
  if [[ $SINK == drop ]]; then
    ip netns exec ${tag}b nft add table netdev sink
    ip netns exec ${tag}b nft add chain netdev sink in \
      "{ type filter hook ingress device ${tag}tb priority 0; policy drop; }"
  fi
}
# (A thread may end between the listing and its read: a control connection's; what it ran is left out.)
cpu_ns() { { cat /proc/"$daemon"/task/*/schedstat 2>/dev/null || true; } | awk '{s += $1} END {printf "%d\n", s}'; }
# The datagrams the data plane handed to the face of namespace b. (Namespace b's own counters cannot tell: the TUN
# face writes consecutive datagrams of a flow as one UDP GSO packet, which the device's rx_packets and the IP
# counters count once.)
rx() { "$fs" --state-dir "$state/d" get module.b.frames_in_total --json | python3 -c \
  'import json, sys; print(json.load(sys.stdin)["module.b.frames_in_total"]["value"])'; }
# classify's busy ns and frames in, "NS FRAMES".
flows_ns() { "$fs" --state-dir "$state/d" get 'module.flows.busy_ns_total' 'module.flows.frames_in_total' --json |
  python3 -c 'import json, sys; v = json.load(sys.stdin)
print(v["module.flows.busy_ns_total"]["value"], v["module.flows.frames_in_total"]["value"])'; }
switches() { { cat /proc/"$daemon"/task/*/status 2>/dev/null || true; } | awk '/ctxt_switches/ {s += $2} END {print s}'; }
writes() { awk '/^syscw:/ {print $2}' /proc/"$daemon"/io; }
# The daemon's CPU time (all its threads, ended ones included), in clock ticks.
ticks() { awk '{print $14 + $15}' /proc/"$daemon"/stat; }
# The rules thread's CPU time, ns.
rules_ns() { for t in /proc/"$daemon"/task/*; do [[ $(cat "$t/comm" 2>/dev/null) == rules ]] && cut -d' ' -f1 "$t/schedstat"; done; true; }
# A rule that reads one meter by name (sampled every 5 ms, the daemon's default), and a per-name rule over a pattern.
echo 'probe: Threshold(get("module.b.frames_in_total"), 1, 0)' > "$state/name.rules"
echo 'probe: Threshold(get("module.*.frames_in_total"), 1, 0)' > "$state/pattern.rules"
echo 'probe: Threshold(get("flow.*.packets_total"), 1, 0)' > "$state/flows.rules"
RULES=${RULES:-name}
rules_caps=()
# An instance per flow: past the daemon's default caps (10,000 instances, 64 MiB) at 100,000 flows.
[[ $RULES == flows ]] && rules_caps=(--rules-max-instances 400000 --rules-max-memory-mb 1024)
[[ -z ${RULES_CPU:-} ]] || rules_caps+=(--rules-max-cpu "$RULES_CPU")
RULES_SETTLE=${RULES_SETTLE:-0.3}
GETS=${GETS:-20}
send() { ip netns exec ${tag}a "$state/udp_flows" 10.$NET.1.0 "$1" "$PPS" "$2" | sed -n 's/^sent=//p'; }

declare -A cost loss rss bin cls wake wr getms rulesms sample
bin[new]=$fs
variants=new
if [[ -n ${FS_OLD:-} ]]; then bin[old]=$FS_OLD; variants="old new"; fi
for round in $(seq "$RUNS"); do
  echo "bench-flowscale: round $round/$RUNS" >&2
  for f in $FLOWS; do
   for v in $variants; do
    start_daemon "${bin[$v]}"
    send "$f" "$(python3 -c 'import sys; print(max(0.1, int(sys.argv[1]) / int(sys.argv[2])))' "$f" "$PPS")" >/dev/null
    sleep 0.5
    c0=$(cpu_ns); r0=$(rx); k0=$(flows_ns); w0=$(switches); y0=$(writes)
    perf=
    if [[ -n ${PERF:-} ]]; then perf record -q -g -p "$daemon" -o "$PERF.$v.$f" -- sleep "$SECS" 2>/dev/null & perf=$!; fi
    if [[ -n ${PERF_STAT:-} ]]; then
      perf stat -x, -e "$PERF_STAT" -p "$daemon" -o "$state/stat" -- sleep "$SECS" 2>/dev/null & perf=$!
    fi
    sent=$(send "$f" "$SECS")
    [[ -z $perf ]] || wait "$perf" || true
    sleep 0.3
    c1=$(cpu_ns); r1=$(rx); k1=$(flows_ns); w1=$(switches); y1=$(writes)
    got=$((r1 - r0))
    if [[ -n ${PERF_STAT:-} ]]; then # each event per datagram delivered (over about the same window)
      awk -F, -v n="$got" -v tag="$v $f" '$1 ~ /^[0-9]+$/ {printf "perf-stat %s %s %.3f per packet\n", tag, $3, $1 / n}' \
        "$state/stat" >&2
    fi
    cost[$v$f]+="$(python3 -c 'import sys; c, n = map(int, sys.argv[1:]); print(f"{c / n:.0f}" if n else "nan")' $((c1 - c0)) "$got") "
    loss[$v$f]+="$(python3 -c 'import sys; s, g = map(int, sys.argv[1:]); print(f"{100 * (s - g) / s:.2f}")' "$sent" "$got") "
    cls[$v$f]+="$(python3 -c 'import sys; a, b, c, d = map(int, sys.argv[1:])
print(f"{(c - a) / (d - b):.0f}" if d > b else "nan")' $k0 $k1) "
    wake[$v$f]+="$(python3 -c 'import sys; a, b, n = map(int, sys.argv[1:])
print(f"{(b - a) / n:.3f}" if n else "nan")' "$w0" "$w1" "$got") "
    wr[$v$f]+="$(python3 -c 'import sys; a, b, n = map(int, sys.argv[1:])
print(f"{(b - a) / n:.3f}" if n else "nan")' "$y0" "$y1" "$got") "
    rss[$v$f]+="$(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' /proc/"$daemon"/status) "
    g0=$(ticks)
    for _ in $(seq "$GETS"); do "$fs" --state-dir "$state/d" get module.b.frames_in_total >/dev/null; done
    getms[$v$f]+="$(python3 -c 'import sys; a, b, n, hz = map(int, sys.argv[1:])
print(f"{(b - a) * 1000 / hz / n:.2f}")' "$g0" "$(ticks)" "$GETS" "$(getconf CLK_TCK)") "
    if [[ $RULES == none ]]; then rulesms[$v$f]+="nan "; sample[$v$f]+="nan "; else
      "$fs" --state-dir "$state/d" rules load "$state/$RULES.rules" >/dev/null
      sleep "$RULES_SETTLE"; a=$(rules_ns); sleep 1; b=$(rules_ns)
      rulesms[$v$f]+="$(python3 -c 'import sys; print(f"{(int(sys.argv[2]) - int(sys.argv[1])) / 1e6:.1f}")' "$a" "$b") "
      sample[$v$f]+="$("$fs" --state-dir "$state/d" -j get rules.engine.sample_interval_us 2>/dev/null | python3 -c \
        'import json, sys; print(json.load(sys.stdin)["rules.engine.sample_interval_us"]["value"] / 1000)' 2>/dev/null ||
        echo nan) "
      "$fs" --state-dir "$state/d" rules unload ALL >/dev/null
    fi
    stop_daemon
   done
  done
done
m() { tr ' ' '\n' <<<"$1" | grep . | median; }
first=${FLOWS%% *}
printf 'UDP 64 bytes at %s datagrams/s, %s s, default modules, %s worker(s): medians of %s rounds\n' "$PPS" "$SECS" "$WORKERS" "$RUNS"
printf 'sink %s, offloads %s; classify ns = its own ns per packet; switches, writes = context switches, write calls per packet\n' \
  "$SINK" "$([[ ${OFFLOAD:-1} == 0 ]] && echo off || echo on)"
printf '%4s %10s %14s %10s %12s %10s %12s %8s %10s %10s %10s %11s %10s\n' code flows "ns/packet" "x first" "classify ns" \
  "x first" switches writes "lost %" "RSS MiB" "get ms" "rules ms/s" "sample ms"
ratio() { python3 -c 'import sys; print(float(sys.argv[1]) / float(sys.argv[2]))' "$1" "$2"; }
for v in $variants; do
  for f in $FLOWS; do
    c=$(m "${cost[$v$f]}"); k=$(m "${cls[$v$f]}")
    printf '%4s %10s %14.0f %10.2f %12.0f %10.2f %12.3f %8.3f %10.2f %10.1f %10.2f %11s %10s\n' "$v" "$f" "$c" \
      "$(ratio "$c" "$(m "${cost[$v$first]}")")" "$k" "$(ratio "$k" "$(m "${cls[$v$first]}")")" \
      "$(m "${wake[$v$f]}")" "$(m "${wr[$v$f]}")" "$(m "${loss[$v$f]}")" "$(m "${rss[$v$f]}")" "$(m "${getms[$v$f]}")" \
      "$(m "${rulesms[$v$f]}")" "$(m "${sample[$v$f]}")"
  done
done
for v in $variants; do
  for f in $FLOWS; do
    echo "rounds $v $f: ns/packet ${cost[$v$f]}| classify ns ${cls[$v$f]}| switches ${wake[$v$f]}| writes ${wr[$v$f]}|" \
      "lost % ${loss[$v$f]}| RSS ${rss[$v$f]}| get ms ${getms[$v$f]}| rules ms/s ${rulesms[$v$f]}|" \
      "sample ms ${sample[$v$f]}"
  done
done
echo "code version: $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty), fs $fs${FS_OLD:+, old $FS_OLD}"

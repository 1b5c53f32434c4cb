#!/usr/bin/env bash
# The late-binding scheduler's cost on the data path (issue 5): iperf3 TCP throughput between two network
# namespaces through flexstack stacks that differ only in the scheduler, measured in the same run:
#   (ref) TUN a -> ip -> classify -> TUN b, replies TUN b -> TUN a: the stack without the scheduler (reference);
#   (one) the same with a `late-binding` module between classify and b, over one link face (replies through its
#         up_in -> up_out);
#   (two) the same over two link faces, TUN b and TUN c (both in the server's namespace, which accepts on either:
#         rp_filter off), policy `weighted` (flows split by hash), iperf3's streams spread over both.
# By default each scheduler models no rate (`rate_mbit` 0: a packet is bound as soon as it is queued), so what is
# measured is its own per-packet work: parse, flow lookup, per-flow queue, class and deficit round robin, binding
# (source address rewritten with incremental checksums; 192.0.2.x, mapped back on the way up), metadata.
# RATE_MBIT (Mbit/s; RATE_BPS, in bit/s, as the earlier runs in BENCHMARKS.md have it, still works) and
# DEVICE_QUEUE set the modelled rate and device queue instead. EMIT (`f0.emit` / `f1.emit`) says when
# a bound packet is handed to its face: `start` (default) at its modelled transmission start, which takes a
# data-plane wake-up per packet or few; `admit` as soon as it enters the modelled device queue, the model only
# deciding when there is room (a wake-up when a transmission ends); see docs/binding.md and BENCHMARKS.md.
# REALTIME=N starts every daemon with `--realtime N` (its data plane under SCHED_FIFO; default 0, the normal policy).
# BIN=path runs that flexstack executable instead of building this tree's (to compare two builds, alternating).
# Rounds interleave the three stacks (a fresh daemon for each measurement), so that load drifting on a shared
# machine hits them alike; prints each stack's median over RUNS rounds of SECS seconds (iperf3 -P STREAMS), the
# ratio of the medians to the reference's and the median of the per-round ratios (each stack against the reference
# of the same round: on a shared machine the throughput of all three drifts together by +-15 % from round to
# round), target >= 0.9, and how the two-face stack split its packets. Needs root.
#
#   sudo scripts/bench-binding.sh                 # RUNS=7 SECS=4 STREAMS=4 RATE_MBIT=0 DEVICE_QUEUE=2 EMIT=start
#   sudo RATE_MBIT=10000 DEVICE_QUEUE=64 scripts/bench-binding.sh
#   sudo RATE_MBIT=10000 DEVICE_QUEUE=64 EMIT=admit scripts/bench-binding.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-7}
RATE_MBIT=${RATE_MBIT:-0}      # the schedulers' modelled interface rate in Mbit/s (0: unmodelled)
if [[ -n "${RATE_BPS:-}" ]]; then # the same in bit/s, as the earlier runs gave it
  RATE_MBIT=$(awk -v bps="$RATE_BPS" 'BEGIN { printf "%.6f", bps / 1e6 }')
fi
DEVICE_QUEUE=${DEVICE_QUEUE:-2} # their device queues, packets
EMIT=${EMIT:-start}            # when they hand a packet to the face: start (of its modelled transmission) or admit
REALTIME=${REALTIME:-0}        # every daemon's --realtime (0: the normal policy, as `flexstack run` starts a daemon)
[[ $EMIT == start || $EMIT == admit ]] || { echo "bench-binding: EMIT must be start or admit, got '$EMIT'" >&2; exit 1; }
SECS=${SECS:-4}
STREAMS=${STREAMS:-4}
if [[ -n ${BIN:-} ]]; then
  [[ -x $BIN ]] || { echo "bench-binding: BIN=$BIN is not an executable" >&2; exit 1; }
  FS=$(realpath "$BIN")   # another build of flexstack, to compare (nothing is built)
fi
. scripts/lib/bench.sh   # median, tun_faces, bench_setup
bench_setup bench-binding "namespaces, TUN devices" iperf3
tag=fsl$$
state=$(mktemp -d)
daemon=
cleanup() {
  if [[ -n "$daemon" ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  ns_cleanup ${tag}a ${tag}b
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
ip netns add ${tag}a
ip netns add ${tag}b
ip -n ${tag}a link set lo up
ip -n ${tag}b link set lo up
# The server's namespace takes packets for its address on either TUN device (the two-face stack sends on both).
ip netns exec ${tag}b sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
ip netns exec ${tag}b iperf3 -s -D -p 5299 -I "$state/iperf.pid" >/dev/null


# The stacks. Common: the app's TUN a (its packets go down), ip, classify; b (and c) face the server (up).
common_modules() {
  tun_faces
  cat <<TOML
[modules.ip]
kind = "ip"
[modules.flows]
kind = "classify"
TOML
}
to_flows='"a -> ip", "ip[out] -> flows"'
{
  echo "links = [$to_flows, \"flows[tcp] -> b\", \"flows[udp] -> b\", \"flows[icmp] -> b\", \"flows[other] -> b\", \"b -> a\"]"
  common_modules
} > "$state/ref.toml"
scheduler() { # $1 = interfaces array, $2 = policy
  cat <<TOML
[modules.lb]
kind = "late-binding"
interfaces = $1
policy = "$2"
virtual_v4 = "10.203.0.1"
"f0.address_v4" = "192.0.2.1"
"f0.rate_mbit" = $RATE_MBIT
"f0.device_queue" = $DEVICE_QUEUE
"f0.emit" = "$EMIT"
TOML
}
{
  echo "links = [$to_flows, \"flows[tcp] -> lb[in]\", \"flows[udp] -> lb[in]\", \"flows[icmp] -> lb[in]\","
  echo "  \"flows[other] -> lb[in]\", \"lb[f0] -> b\", \"b -> lb[up_in]\", \"lb[up_out] -> a\"]"
  common_modules
  scheduler '["f0"]' preferred
} > "$state/one.toml"
{
  echo "links = [$to_flows, \"flows[tcp] -> lb[in]\", \"flows[udp] -> lb[in]\", \"flows[icmp] -> lb[in]\","
  echo "  \"flows[other] -> lb[in]\", \"lb[f0] -> b\", \"lb[f1] -> c\", \"b -> lb[up_in]\", \"c -> lb[up_in]\","
  echo "  \"lb[up_out] -> a\"]"
  common_modules
  cat <<TOML
[modules.c]
kind = "tun"
name = "${tag}tc"
direction = "up"
TOML
  scheduler '["f0", "f1"]' weighted
  echo '"f1.address_v4" = "192.0.2.2"'
  echo "\"f1.rate_mbit\" = $RATE_MBIT"
  echo "\"f1.device_queue\" = $DEVICE_QUEUE"
  echo "\"f1.emit\" = \"$EMIT\""
} > "$state/two.toml"

# Starts the daemon on stack $1, moves its TUN devices into the namespaces, measures once; prints Gbit/s.
# The app (namespace a) has 10.203.0.1, the server (b) 10.203.0.2 on TUN b. With the scheduler the server sees the
# interfaces' addresses 192.0.2.1-2 as the source and answers them over TUN b; the scheduler maps them back to
# 10.203.0.1 on the way up.
measure_once() { # $1 = stack name
  "$fs" daemon --stack "$state/$1.toml" --state-dir "$state/d" --realtime "$REALTIME" 2>"$state/daemon-$1.log" &
  daemon=$!
  local ok=
  for _ in $(seq 200); do
    if "$fs" --state-dir "$state/d" status >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.05
  done
  [[ -n "$ok" ]] || { echo "bench-binding: the daemon did not start on $1:" >&2; cat "$state/daemon-$1.log" >&2; exit 1; }
  ip link set ${tag}ta netns ${tag}a
  ip -n ${tag}a addr add 10.203.0.1/24 dev ${tag}ta
  ip -n ${tag}a link set ${tag}ta up
  ip link set ${tag}tb netns ${tag}b
  ip -n ${tag}b addr add 10.203.0.2/24 dev ${tag}tb
  ip -n ${tag}b link set ${tag}tb up
  ip -n ${tag}b route add 192.0.2.0/24 dev ${tag}tb
  if [[ $1 == two ]]; then
    ip link set ${tag}tc netns ${tag}b
    ip -n ${tag}b link set ${tag}tc up
  fi
  ip netns exec ${tag}a iperf3 -c 10.203.0.2 -p 5299 -t "$SECS" -P "$STREAMS" -J \
    | python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))'
  if [[ $1 == two ]]; then
    "$fs" --state-dir "$state/d" get 'module.lb.f*.bound_packets_total' \
      | awk '$1 ~ /bound_packets_total/ { split($1, n, "."); v = v " " n[3] " " $2 } END { print v }' >> "$state/split.txt"
  fi
  kill "$daemon"
  wait "$daemon" 2>/dev/null || true
  daemon=
}

: > "$state/split.txt"
for round in $(seq "$RUNS"); do
  for s in ref one two; do
    g=$(measure_once $s)
    echo "$g" >> "$state/$s.gbps"
    echo "bench-binding: round $round, $s: $g Gbit/s" >&2
  done
done
ref=$(median < "$state/ref.gbps")
one=$(median < "$state/one.gbps")
two=$(median < "$state/two.gbps")
printf 'late-binding scheduler on the data path: iperf3 TCP, %s streams, median of %s rounds of %s s (Gbit/s)\n' \
  "$STREAMS" "$RUNS" "$SECS"
printf '  schedulers: rate_mbit %s, device_queue %s, emit %s\n' "$RATE_MBIT" "$DEVICE_QUEUE" "$EMIT"
printf '  reference: the same stack without the scheduler   %6.2f   (runs: %s)\n' "$ref" "$(paste -sd' ' "$state/ref.gbps")"
ratios() { # $1 = stack: its per-round ratios to the reference, one a line
  paste "$state/$1.gbps" "$state/ref.gbps" | awk '{ printf "%.3f\n", $1 / $2 }'
}
for s in one two; do
  printf -v "paired_$s" '%s' "$(ratios $s | median)"
  printf -v "rounds_$s" '%s' "$(ratios $s | paste -sd' ')"
done
printf '  late-binding over one link face                   %6.2f   ratio %.3f   (runs: %s)\n' \
  "$one" "$(echo "$one / $ref" | bc -l)" "$(paste -sd' ' "$state/one.gbps")"
printf '  late-binding over two link faces (weighted)       %6.2f   ratio %.3f   (runs: %s)\n' \
  "$two" "$(echo "$two / $ref" | bc -l)" "$(paste -sd' ' "$state/two.gbps")"
printf '  median of the per-round ratios (target >= 0.9): one face %.3f (%s), two faces %.3f (%s)\n' \
  "$paired_one" "$rounds_one" "$paired_two" "$rounds_two"
echo "  two faces, packets bound per face in each round:"
sed 's/^ */    /' "$state/split.txt"

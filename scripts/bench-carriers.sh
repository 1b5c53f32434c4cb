#!/usr/bin/env bash
# Peak throughput through terminate + carrier + re-originate (issue 14, experiment 2): an app on daemon A
# (`flexstack run`, host namespace) reaches an iperf3 server behind daemon B (namespace ${tag}b, joined to the host
# by a veth pair; the server in ${tag}s behind B), over
#   (f)  plain forwarding: the default app chain into the host, which routes through B's namespace (the kernel
#        forwards there; no daemon B in the path);
#   (K)  for each carrier kind K of KINDS (default "tcp quic udp udpplus"): `stacks/app-peer.toml` with
#        `transport = K` on A, `stacks/peer-in.toml` with the same transport on B (restarted for each kind), so the
#        app's flow is terminated on A, carried to B and opened again by B's kernel sockets.
# Each path: iperf3 TCP (one stream, SECS seconds) and iperf3 UDP (-b 0, LEN-byte datagrams, 4 MiB socket
# buffers: a GSO super-packet of datagrams arrives at once and overflows the default buffer; what the server
# received); the paths alternate in every round, medians of RUNS rounds, in Gbit/s and Gibit/s (VirtualStack's unit),
# with the ratios to (f) and, for quic, to the udp carrier. PROFILE=ci uses the ci profile's binary; NO_BUILD=1 /
# FS=PATH as in scripts/lib/bench.sh. FS_OLD=binary adds (K0) for each K: the same through daemons A and B of that
# binary, in the same rounds (A/B: the old code against the new; both daemons restart when the binary changes).
# STREAMS=N runs N parallel app streams (iperf3 -P) in both tests; BUDGET=BYTES sets the app's terminate's
# `budget` (bytes of a flow in flight in the stream chain) on the carrier paths. The letter c in KINDS (KINDS="c udp") adds
#   (c)  the ceiling of the app and its TUN device on this machine: the same iperf3 client in a namespace of its own
#        (${tag}c, 10.(NET+2).0.2) whose only device is a TUN drained by the C forwarder of bench/tun_forward.c (one
#        thread per direction, offloads on) into a TUN device in the host, which routes through B's namespace as
#        for (f): no flexstack at all on the path, only what any user-space stack behind a TUN device must pay;
# and the letter v adds
#   (v)  the app alone: the same iperf3 client in a namespace of its own (${tag}v, 10.(NET+3).0.2) joined to the
#        host by a veth pair, routed through B's namespace as for (f): no TUN and no user-space stack, the kernel
#        only (what this app can send here at all).
# Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-4}
LEN=${LEN:-1400}
STREAMS=${STREAMS:-1}
KINDS=${KINDS:-tcp quic udp udpplus}
NET=${NET:-225} # A-B 10.NET.1.0/24, B-server 10.NET.2.0/24, apps 10.(NET+1).0.0/16
. scripts/lib/bench.sh # median, bench_setup, peer_topology, start_peers, start_peer_b, carrier_stack
bench_setup bench-carriers "namespaces, veth, TUN devices" iperf3 python3 cc
tag=fsc$$
peer_bench_state "$NET"
peer_topology "$NET"
start_peers "$NET" tcp
app_sed=()
[[ -z ${BUDGET:-} ]] || app_sed=(-e "s|^app = \"{app}\"|&\nbudget = $BUDGET|")
for k in $KINDS; do [[ $k == [cv] ]] || carrier_stack "$k" "transport = \"$k\""; done
[[ " $KINDS " != *" c "* ]] || c_forwarder_ns $((NET + 2)) # (c)
if [[ " $KINDS " == *" v "* ]]; then # (v): ${tag}va in the client namespace, ${tag}vb in the host
  ip netns add ${tag}v
  ip -n ${tag}v link set lo up
  ip link add ${tag}va type veth peer name ${tag}vb
  ip link set ${tag}va netns ${tag}v
  ip -n ${tag}v addr add 10.$((NET + 3)).0.2/24 dev ${tag}va
  ip -n ${tag}v link set ${tag}va up
  ip -n ${tag}v route add default via 10.$((NET + 3)).0.1
  ip addr add 10.$((NET + 3)).0.1/24 dev ${tag}vb
  ip link set ${tag}vb up
fi
trap 'peer_bench_cleanup; ns_cleanup ${tag}c ${tag}v' EXIT INT TERM

new=$fs
# Runs daemons A and B (B with transport $2) of binary $1: A restarts when the binary changes (and is told B's key
# again), B every time.
daemons() {
  [[ $1 == "$fs" ]] && { start_peer_b "$NET" "$2"; return; }
  kill "${pids[0]}" && wait "${pids[0]}" 2>/dev/null || true
  fs=$1
  "$fs" daemon --state-dir "$state/a" --app-subnet 10.$((NET + 1)).0.0 2>>"$state/daemon-a.log" &
  pids[0]=$!
  wait_for '"$fs" --state-dir "$state/a" status >/dev/null 2>&1' "daemon A did not start (its log: $state/daemon-a.log)"
  start_peer_b "$NET" "$2"
  "$fs" --state-dir "$state/a" peer add gateway 10.$NET.1.2:7300 "$("$fs" --state-dir "$state/b" peer key)" >/dev/null
}

# iperf3 on PATH with the options given; prints what the server received in Gbit/s (or the error, and fails).
iperf() {
  local run=("$fs" --state-dir "$state/a" run --) p=${1%0}
  shift
  if [[ $p == c || $p == v ]]; then run=(ip netns exec ${tag}$p); elif [[ $p != f ]]; then run=("${run[@]:0:4}" --stack "$state/app-$p.toml" --); fi
  # The server may still hold a test whose client went away (--rcv-timeout, peer_topology).
  iperf3_retrying "${run[@]}" iperf3 -c $srv -p 5201 -t "$SECS" -P "$STREAMS" -J "$@" > "$state/iperf.json"
  python3 - "$state/iperf.json" "$p" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    sys.exit(f"bench-carriers: iperf3 over {sys.argv[2]}: {r['error']}")
e = r["end"]["sum_received"]
print(e["bytes"] * 8 / e["seconds"] / 1e9)
PY
}
# measure PATH: prints "TCP UDP" in Gbit/s.
measure() { echo "$(iperf "$1") $(iperf "$1" -u -b 0 -l "$LEN" -w 4M)"; }

paths=$KINDS
[[ -z ${FS_OLD:-} ]] || for k in $KINDS; do [[ $k == [cv] ]] || paths+=" ${k}0"; done
for i in $(seq "$RUNS"); do
  daemons "$new" tcp
  read -r t u < <(measure f)
  echo "$t" >> "$state/f.tcp"; echo "$u" >> "$state/f.udp"
  line="round $i: f $t/$u"
  for k in $paths; do
    if [[ $k == *0 ]]; then daemons "$FS_OLD" "${k%0}"; elif [[ $k != [cv] ]]; then daemons "$new" "$k"; fi
    read -r t u < <(measure "$k")
    echo "$t" >> "$state/$k.tcp"; echo "$u" >> "$state/$k.udp"
    line+=", $k $t/$u"
  done
  echo "$line (TCP/UDP Gbit/s)" >&2
done

printf 'carriers: iperf3 TCP and UDP (-b 0, %s-byte datagrams, received), %s stream(s), medians of %s rounds of %s s\n' \
  "$LEN" "$STREAMS" "$RUNS" "$SECS"
echo "code version: $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)${FS_OLD:+; old (K0): $FS_OLD}; $(uptime)"
printf '%-22s %9s %9s %9s %9s %8s %8s\n' path "TCP Gb/s" "TCP Gib/s" "UDP Gb/s" "UDP Gib/s" "TCP x f" "UDP x f"
ft=$(median < "$state/f.tcp"); fu=$(median < "$state/f.udp")
row() { # $1 = label, $2 = TCP, $3 = UDP
  printf '%-22s %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f\n' "$1" "$2" "$(echo "$2 * 10^9 / 2^30" | bc -l)" "$3" \
    "$(echo "$3 * 10^9 / 2^30" | bc -l)" "$(echo "$2 / $ft" | bc -l)" "$(echo "$3 / $fu" | bc -l)"
}
row "(f) forwarding" "$ft" "$fu"
for k in $paths; do
  [[ $k == c ]] && { row "(c) app+TUN ceiling" "$(median < "$state/c.tcp")" "$(median < "$state/c.udp")"; continue; }
  [[ $k == v ]] && { row "(v) app alone (veth)" "$(median < "$state/v.tcp")" "$(median < "$state/v.udp")"; continue; }
  row "($k) carrier" "$(median < "$state/$k.tcp")" "$(median < "$state/$k.udp")"
done
if [[ " $KINDS " == *" quic "* && " $KINDS " == *" udp "* ]]; then
  printf 'quic / udp carrier: TCP %.2f, UDP %.2f (goal >= 0.5); VirtualStack UDP: 4.36 Gibit/s\n' \
    "$(echo "$(median < "$state/quic.tcp") / $(median < "$state/udp.tcp")" | bc -l)" \
    "$(echo "$(median < "$state/quic.udp") / $(median < "$state/udp.udp")" | bc -l)"
fi

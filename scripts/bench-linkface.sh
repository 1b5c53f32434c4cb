#!/usr/bin/env bash
# The link face (issue 16: "Link face >= 0.8 x the TUN<->TUN figure, one stream"): iperf3 TCP, STREAMS parallel
# streams (default "1"), SECS seconds, medians of RUNS rounds, the two paths alternating in every round:
#   (t) flexstack TUN <-> TUN with the default app modules between two namespaces (as scripts/bench-datapath.sh);
#   (l) `flexstack run --stack stacks/app-link.toml`: the app's TUN face, ip, nat and the link module (ARP, NDP),
#       out through a packet face on one end of a veth pair that flexstack takes over; the server in a namespace
#       at the other end;
# and three bridges between two namespaces, each joined by a veth pair to the host, where the bridge joins the two
# host ends at layer 2 (the designs of a link face, compared):
#   (b) flexstack: two packet faces linked to each other (`take_over = false`), BRIDGE_WORKERS data-plane workers
#       (default 1);
#   (v) bench/packet_forward.c -m vnet: AF_PACKET with virtio-net headers, a frame per system call, GSO super-frames
#       whole (the packet face's design, in C);
#   (r) bench/packet_forward.c -m ring: PACKET_MMAP rings (TPACKET_V3 in, TPACKET_V2 out), which carry no virtio-net
#       header: every frame must be whole and checksummed, so the four veth ends have their offloads off
#       (ethtool -K: tx checksums, TSO, GSO, GRO) for this path only;
#   (r0) the same with (v)'s program (-m vnet), offloads off too: the rings' gain where both must segment.
# Prints the medians and the ratios (l) / (t), (b) / (v), (r) / (v). PROFILE=ci uses the ci profile's binary; NO_BUILD=1 / FS=PATH as in
# scripts/lib/bench.sh. Needs root. PATHS (default "t l b v r r0") picks the paths measured. FS_OLD=binary adds
# (lo): (l) through that binary's daemon, in the same rounds (A/B: the old code against the new). PERF=file records
# a profile of the (l) daemon during each (l) run (file.l, overwritten each round). RUNTIME=1 reads `show runtime`
# near the end of each (l) and (lo) run and prints the medians of the link module's ns per frame and of all the
# modules' busy ns over the link module's frames (CPU cost, which a loaded machine disturbs less than Gbit/s).
# For (t), (l) and (lo) it also prints the median of the daemon's CPU time (user + system, all its threads, from
# /proc/PID/stat) per GB received: the cost per byte, kernel work in the daemon's context included.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-4}
STREAMS=${STREAMS:-1}
PATHS=${PATHS:-t l b v r r0}
NET=${NET:-221} # the link 10.NET.9.0/24 (server .1, flexstack .2); TUN <-> TUN 10.(NET+1).0.0/24; apps 10.(NET+2)/16
. scripts/lib/bench.sh # median, bench_setup, tun_faces, default_modules_stack, ns_cleanup
bench_setup bench-linkface "namespaces, veth, TUN devices" iperf3 python3 cc ethtool
tag=fsk$$
state=$(mktemp -d)
chmod 755 "$state"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done
  ns_cleanup ${tag}a ${tag}b ${tag}s ${tag}x ${tag}y
  ip link del ${tag}o 2>/dev/null || true
  ip link del ${tag}xa 2>/dev/null || true
  ip link del ${tag}ya 2>/dev/null || true
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
gbits() { python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'; }

# (l): the server at one end of a veth pair; the other end (${tag}o) stays in the host for flexstack to take over.
ip netns add ${tag}s
ip -n ${tag}s link set lo up
ip link add ${tag}o type veth peer name ${tag}p
ip link set ${tag}p netns ${tag}s
ip -n ${tag}s addr add 10.$NET.9.1/24 dev ${tag}p
ip -n ${tag}s link set ${tag}p up
ip netns exec ${tag}s iperf3 -s -D -p 5201 -I "$state/iperf-l.pid" >/dev/null
mac=$(cat /sys/class/net/${tag}o/address)
sed -e "s|10.77.0.0/16|10.$((NET + 2)).0.0/16|" -e "s|192.0.2.2|10.$NET.9.2|" -e "s|192.0.2.1|10.$NET.9.1|" \
  -e "s|02:00:00:00:00:01|$mac|" -e "s|\"eth1\"|\"${tag}o\"|" stacks/app-link.toml > "$state/link-app.toml"
declare -A ldaemon
ldaemon[l]=$fs
[[ -z ${FS_OLD:-} ]] || { ldaemon[lo]=$FS_OLD; PATHS+=" lo"; }
for k in "${!ldaemon[@]}"; do
  "${ldaemon[$k]}" daemon --state-dir "$state/$k" --app-subnet 10.$((NET + 2)).0.0 2>"$state/daemon-$k.log" &
  pids+=($!)
  echo $! > "$state/daemon-$k.pid"
  wait_for '"$fs" --state-dir "$state/$k" status >/dev/null 2>&1' "the daemon did not start"
done
link() { # $1 = l or lo: the daemon
  local perf=
  if [[ -n ${PERF:-} ]]; then
    perf record -q -g -p "$(cat "$state/daemon-$1.pid")" -o "$PERF.$1" -- sleep "$SECS" 2>/dev/null & perf=$!
  fi
  local rt=
  if [[ -n ${RUNTIME:-} ]]; then
    (sleep "$((SECS > 1 ? SECS - 1 : 1))"; "${ldaemon[$1]}" --state-dir "$state/$1" show runtime -j > "$state/rt-$1.json") &
    rt=$!
  fi
  # (l) and (lo) share the server, which may still be ending the other's test.
  iperf3_retrying "${ldaemon[$1]}" --state-dir "$state/$1" run --stack "$state/link-app.toml" -- \
    iperf3 -c 10.$NET.9.1 -p 5201 -P "$STREAMS" -t "$SECS" -J | gbits
  [[ -z $perf ]] || wait "$perf" || true
  if [[ -n $rt ]] && wait "$rt"; then
    python3 -c 'import json,sys
rows = [r for r in json.load(open(sys.argv[1])) if r["kind"] != "worker"]
link = [r for r in rows if r["kind"] == "ethernet"][0]
print(link["ns_per_frame"], sum(r["busy_ns"] for r in rows) / max(link["frames"], 1))' "$state/rt-$1.json" \
      >> "$state/rt-$1.txt" || true
  fi
}

# (t): TUN <-> TUN between two namespaces, the default app modules between the faces.
ip netns add ${tag}a; ip netns add ${tag}b
ip -n ${tag}a link set lo up; ip -n ${tag}b link set lo up
default_modules_stack > "$state/chain.toml"
"$fs" daemon --stack "$state/chain.toml" --state-dir "$state/t" 2>"$state/daemon-t.log" &
pids+=($!)
echo $! > "$state/daemon-t.pid"
wait_for '"$fs" --state-dir "$state/t" status >/dev/null 2>&1' "the TUN <-> TUN daemon did not start"
ip link set ${tag}ta netns ${tag}a; ip link set ${tag}tb netns ${tag}b
ip -n ${tag}a addr add 10.$((NET + 1)).0.1/24 dev ${tag}ta; ip -n ${tag}a link set ${tag}ta up
ip -n ${tag}b addr add 10.$((NET + 1)).0.2/24 dev ${tag}tb; ip -n ${tag}b link set ${tag}tb up
ip netns exec ${tag}b iperf3 -s -D -p 5201 -I "$state/iperf-t.pid" >/dev/null
sleep 0.3
tuntun() { ip netns exec ${tag}a iperf3 -c 10.$((NET + 1)).0.2 -p 5201 -P "$STREAMS" -t "$SECS" -J | gbits; }

# The bridges: ${tag}x (10.(NET+3).0.1) ─ ${tag}xb|${tag}xa ─ bridge ─ ${tag}ya|${tag}yb ─ ${tag}y (10.(NET+3).0.2).
cc -O2 -pthread -o "$state/packet_forward" bench/packet_forward.c
for n in x y; do
  ip netns add ${tag}$n
  ip -n ${tag}$n link set lo up
  ip link add ${tag}${n}a type veth peer name ${tag}${n}b
  ip link set ${tag}${n}b netns ${tag}$n
  echo 1 > /proc/sys/net/ipv6/conf/${tag}${n}a/disable_ipv6
  ip link set ${tag}${n}a up
done
ip -n ${tag}x addr add 10.$((NET + 3)).0.1/24 dev ${tag}xb; ip -n ${tag}x link set ${tag}xb up
ip -n ${tag}y addr add 10.$((NET + 3)).0.2/24 dev ${tag}yb; ip -n ${tag}y link set ${tag}yb up
ip netns exec ${tag}y iperf3 -s -D -p 5201 -I "$state/iperf-b.pid" >/dev/null
cat > "$state/bridge.toml" <<TOML
links = ["x -> y", "y -> x"]
[modules.x]
kind = "packet"
interface = "${tag}xa"
take_over = false
[modules.y]
kind = "packet"
interface = "${tag}ya"
take_over = false
TOML
bridged() { ip netns exec ${tag}x iperf3 -c 10.$((NET + 3)).0.2 -p 5201 -P "$STREAMS" -t "$SECS" -J | gbits; }
# offloads on|off: the four veth ends' checksum and segmentation offloads (on: veth's defaults).
offloads() {
  local gro=off n
  for n in x y; do
    ip netns exec ${tag}$n ethtool -K ${tag}${n}b tx "$1" tso "$1" gso "$1" gro $gro >/dev/null 2>&1
    ethtool -K ${tag}${n}a tx "$1" tso "$1" gso "$1" gro $gro >/dev/null 2>&1
  done
}
bridge() { # $1 = b, v, r or r0: prints the Gbit/s through that bridge
  local pid
  [[ $1 == r* ]] && offloads off
  case $1 in
    b) "$fs" daemon --stack "$state/bridge.toml" --state-dir "$state/bridge" --workers "${BRIDGE_WORKERS:-1}" \
         2>"$state/daemon-b.log" &
       pid=$!
       wait_for '"$fs" --state-dir "$state/bridge" status >/dev/null 2>&1' "the bridge daemon did not start" ;;
    *) "$state/packet_forward" -m "$([[ $1 == r ]] && echo ring || echo vnet)" ${tag}xa ${tag}ya > "$state/fwd.out" &
       pid=$!
       wait_for 'grep -q ready "$state/fwd.out"' "packet_forward did not start" ;;
  esac
  sleep 0.2
  bridged
  kill "$pid"; wait "$pid" 2>/dev/null || true
  [[ $1 == r* ]] && offloads on
  return 0
}

ratio() { python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(a / b if b else float("nan"))' "$1" "$2"; }
# The CPU clock ticks (user + system) process $1 has used.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() { # $1: a path
  local pid= t0 g
  [[ $1 == t || $1 == l || $1 == lo ]] && { pid=$(cat "$state/daemon-$1.pid"); t0=$(ticks "$pid"); }
  case $1 in
    t) g=$(tuntun) ;;
    l | lo) g=$(link "$1") ;;
    *) g=$(bridge "$1") ;;
  esac
  # s of CPU per GB: ticks / CLK_TCK over Gbit/s * SECS / 8.
  [[ -z $pid ]] || python3 -c 'import os,sys; t, g, s = map(float, sys.argv[1:]); print(t / os.sysconf("SC_CLK_TCK") / (g * s / 8) if g else "nan")' \
    "$(($(ticks "$pid") - t0))" "$g" "$SECS" >> "$state/cpu-$1.txt"
  echo "$g"
}
for i in $(seq "$RUNS"); do
  line=
  for k in $PATHS; do
    g=$(measure "$k")
    echo "$g" >> "$state/$k.txt"
    line+=" ($k) $g"
  done
  echo "round $i:$line" >&2
done
for k in t l lo b v r r0; do declare "$k=nan"; [[ ! -s $state/$k.txt ]] || declare "$k=$(median < "$state/$k.txt")"; done
printf 'link face benchmark: iperf3 TCP, %s stream(s), median of %s rounds of %s s (Gbit/s)\n' "$STREAMS" "$RUNS" "$SECS"
printf '  (t) flexstack TUN <-> TUN, default modules        %6.2f\n' "$t"
printf '  (l) flexstack run over a link face                %6.2f   ratio to (t) %.2f (target >= 0.8)\n' "$l" \
  "$(ratio "$l" "$t")"
[[ -z ${FS_OLD:-} ]] || printf '  (lo) as (l), the old binary                       %6.2f   ratio to (t) %.2f\n' "$lo" \
  "$(ratio "$lo" "$t")"
for k in t l lo; do
  [[ -s $state/cpu-$k.txt ]] || continue
  printf '  (%s) daemon CPU per GB received: %.3f s\n' "$k" "$(median < "$state/cpu-$k.txt")"
done
if [[ -n ${RUNTIME:-} ]]; then
  for k in l lo; do
    [[ -s $state/rt-$k.txt ]] || continue
    printf '  (%s) show runtime: link module %.0f ns/frame, all modules %.0f ns per link frame\n' "$k" \
      "$(cut -d' ' -f1 "$state/rt-$k.txt" | median)" "$(cut -d' ' -f2 "$state/rt-$k.txt" | median)"
  done
fi
printf '  (b) bridge: flexstack, two packet faces           %6.2f   ratio to (v) %.2f\n' "$b" "$(ratio "$b" "$v")"
printf '  (v) bridge: C, AF_PACKET + virtio-net headers     %6.2f\n' "$v"
printf '  (r) bridge: C, TPACKET_V3/V2 rings, no offloads  %6.2f   ratio to (v) %.2f\n' "$r" "$(ratio "$r" "$v")"
printf '  (r0) bridge: C, as (v) but no offloads            %6.2f   (r) / (r0) %.2f\n' "$r0" "$(ratio "$r" "$r0")"

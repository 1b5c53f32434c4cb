#!/usr/bin/env bash
# Host-path benchmark (issue 16): an app in a network namespace reaching a server outside it through a user-space
# forwarder, as `flexstack run` and rootless containers do. The same server namespace (joined to the host by a
# veth pair: iperf3, the UDP echo of bench/udp_pp.c) is reached over
#   (c) the C TUN forwarder with offloads and one thread per direction (bench/tun_forward.c -o -t): a TUN device in
#       the client's namespace, the other in the host, routed by the host (the issue's reference "into the host");
#   (f) `flexstack run` with the default chain (stacks/app-default.toml), busy-poll off, with the daemon's default
#       data-plane workers (WORKERS=N: --workers N);
#   (g) the same with a second daemon of the same binary run with --workers WORKERS_G (default 1): workers A/B in
#       one run (PATHS="c f g");
#   (o) with FS_OLD=path (PATHS="c f o"): the same as (f) with another binary (one built from main, say), same
#       workers: an A/B of two versions in one run;
#   (s) slirp4netns (user-mode networking with libslirp);
#   (p) pasta (passt's namespace mode: a tap device, the host's sockets).
# Each round measures every path in turn (RUNS rounds, medians printed with the ratio to (c)):
#   - TCP: iperf3 -t SECS with 1 and MANY (4) parallel streams, Gbit/s received;
#   - UDP: iperf3 -u -b 0 with 1400-byte and 64-byte datagrams, thousands of datagrams per second delivered
#     (sent - lost as the server counted them), and the loss in percent;
#   - round-trip time of a 64-byte UDP ping-pong (bench/udp_pp.c), median and p99 of RR_N round trips.
# Then flexstack's daemon: its peak RSS (VmHWM, under the load above) and its CPU over IDLE_SECS (10) with nothing
# flowing (targets, issue 16: <= 64 MiB, 0 %); with (o), its peak RSS too and (f)/(o) ratios.
# Traffic goes only to the server namespace's address; slirp4netns and pasta are given no DNS and no port
# forwarding. Needs root. PROFILE/FS/NO_BUILD as in the other benchmarks (scripts/lib/bench.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-4}
MANY=${MANY:-4}
RR_N=${RR_N:-5000}
PATHS=${PATHS:-c f s p}
NET=${NET:-215} # the server is 10.NET.7.2; flexstack's apps 10.(NET+1)/16; (c) 10.(NET+2).0/24; (p) 10.(NET+3).0/24;
# (g)'s apps 10.(NET+4)/16; (o)'s 10.(NET+5)/16
. scripts/lib/bench.sh # median, bench_setup, server_ns
bench_setup bench-hostpath "namespaces, TUN devices" iperf3 cc python3 slirp4netns pasta
tag=fsz$$
state=$(mktemp -d)
chmod 755 "$state"
pids=()
fwd_old=$(sysctl -n net.ipv4.ip_forward)
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done
  ns_cleanup ${tag}c ${tag}l ${tag}q
  server_ns_cleanup
  sysctl -qw net.ipv4.ip_forward="$fwd_old"
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

server_ns "$NET"
srv=10.$NET.7.2
sysctl -qw net.ipv4.ip_forward=1
cc -O2 -o "$state/udp_pp" bench/udp_pp.c
ip netns exec ${tag}s iperf3 -s -D -p 5201 -I "$state/iperf.pid" >/dev/null
ip netns exec ${tag}s "$state/udp_pp" server 7000 &
pids+=($!)

# (c) the C forwarder: ${tag}ca in the client namespace, ${tag}cb in the host.
c_forwarder_ns $((NET + 2))

# (f) flexstack: a daemon whose apps run in sandboxes of their own (one per measurement).
"$fs" daemon --state-dir "$state/d" ${WORKERS:+--workers=$WORKERS} --app-subnet 10.$((NET + 1)).0.0 \
  2>"$state/daemon.log" &
daemon=$!
pids+=($daemon)
wait_for '"$fs" --state-dir "$state/d" status >/dev/null 2>&1' "the daemon did not start"
# (g) flexstack again, a daemon with WORKERS_G workers.
if [[ " $PATHS " == *" g "* ]]; then
  "$fs" daemon --state-dir "$state/g" --workers="${WORKERS_G:-1}" --app-subnet 10.$((NET + 4)).0.0 \
    2>"$state/daemon-g.log" &
  pids+=($!)
  wait_for '"$fs" --state-dir "$state/g" status >/dev/null 2>&1' "the second daemon (g) did not start"
fi

# (o) the same as (f) with the binary FS_OLD.
if [[ " $PATHS " == *" o "* ]]; then
  [[ -n "${FS_OLD:-}" ]] || { echo "bench-hostpath: path (o) needs FS_OLD=path" >&2; exit 1; }
  "$FS_OLD" daemon --state-dir "$state/o" ${WORKERS:+--workers=$WORKERS} --app-subnet 10.$((NET + 5)).0.0 \
    2>"$state/daemon-o.log" &
  daemon_o=$!
  pids+=($daemon_o)
  wait_for '"$FS_OLD" --state-dir "$state/o" status >/dev/null 2>&1' "the old daemon (o) did not start"
fi

# (s) slirp4netns, attached to a namespace of its own.
ip netns add ${tag}l
ip -n ${tag}l link set lo up
slirp4netns --configure --mtu=65520 --disable-host-loopback --disable-dns --netns-type=path \
  /run/netns/${tag}l tap0 > "$state/slirp.log" 2>&1 &
pids+=($!)
wait_for 'ip -n ${tag}l route | grep -q default' "slirp4netns did not configure its namespace ($(cat "$state/slirp.log"))"

# (p) pasta, attached to a namespace of its own.
ip netns add ${tag}q
ip -n ${tag}q link set lo up
pasta --config-net --netns ${tag}q --runas 0 -f -q -4 -I ${tag}qt -a 10.$((NET + 3)).0.2 -n 24 -g 10.$((NET + 3)).0.1 \
  -t none -u none -T none -U none --no-map-gw > "$state/pasta.log" 2>&1 &
pids+=($!)
wait_for 'ip -n ${tag}q route | grep -q default' "pasta did not configure its namespace ($(cat "$state/pasta.log"))"

# on PATH CMD...: runs CMD as the path's client.
on() {
  local p=$1
  shift
  case $p in
    c) ip netns exec ${tag}c "$@" ;;
    f) "$fs" --state-dir "$state/d" run -- "$@" ;;
    g) "$fs" --state-dir "$state/g" run -- "$@" ;;
    o) "$FS_OLD" --state-dir "$state/o" run -- "$@" ;;
    s) ip netns exec ${tag}l "$@" ;;
    p) ip netns exec ${tag}q "$@" ;;
  esac
}
tcp() { on "$1" iperf3 -c $srv -p 5201 -P "$2" -t "$SECS" -J | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'; }
# Prints "kpps loss%" of a UDP flood of $2-byte datagrams.
udp() { on "$1" iperf3 -c $srv -p 5201 -u -b 0 -l "$2" -t "$SECS" -J | python3 -c '
import json, sys
s = json.load(sys.stdin)["end"]["sum"]
print((s["packets"] - s["lost_packets"]) / float(sys.argv[1]) / 1e3, s["lost_percent"])' "$SECS"; }
rtt() { on "$1" "$state/udp_pp" pp $srv 7000 "$RR_N"; }

declare -A r
add() { r[$1]+="$2 "; }
for round in $(seq "$RUNS"); do
  echo "bench-hostpath: round $round/$RUNS" >&2
  for p in $PATHS; do
    add "$p.t1" "$(tcp "$p" 1)"
    add "$p.tn" "$(tcp "$p" "$MANY")"
    read -r k l < <(udp "$p" 1400); add "$p.u1400" "$k"; add "$p.l1400" "$l"
    read -r k l < <(udp "$p" 64); add "$p.u64" "$k"; add "$p.l64" "$l"
    out=$(rtt "$p")
    add "$p.rtt" "$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out")"
    add "$p.p99" "$(sed -n 's/.*p99_us=\([0-9.]*\).*/\1/p' <<<"$out")"
  done
done
m() { tr ' ' '\n' <<<"${r[$1]:-}" | grep . | median; }
ratio() { python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"{a / b:.2f}" if b else "-")' "$1" "$2"; }
printf 'Into the host: medians of %s rounds (TCP/UDP %s s each; RTT %s round trips)\n' "$RUNS" "$SECS" "$RR_N"
printf '%-40s %8s %8s %9s %7s %9s %7s %8s %8s\n' path "TCP 1" "TCP $MANY" "UDP1400" loss "UDP64" loss "RTT" p99
printf '%-40s %8s %8s %9s %7s %9s %7s %8s %8s\n' "" Gbit/s Gbit/s kpps % kpps % us us
for p in $PATHS; do
  case $p in
    c) name="(c) C forwarder, offloads, 2 threads" ;;
    f) name="(f) flexstack run, default chain${WORKERS:+, $WORKERS w}" ;;
    g) name="(g) flexstack run, ${WORKERS_G:-1} worker(s)" ;;
    o) name="(o) flexstack run, FS_OLD" ;;
    s) name="(s) slirp4netns" ;;
    p) name="(p) pasta" ;;
  esac
  printf '%-40s %8.2f %8.2f %9.1f %7.2f %9.1f %7.2f %8.1f %8.1f\n' "$name" "$(m $p.t1)" "$(m $p.tn)" "$(m $p.u1400)" \
    "$(m $p.l1400)" "$(m $p.u64)" "$(m $p.l64)" "$(m $p.rtt)" "$(m $p.p99)"
done
if [[ " $PATHS " == *" c "* ]]; then
  echo "ratios to (c): TCP 1, TCP $MANY, UDP1400 kpps, UDP64 kpps; RTT added over (c) in us"
  for p in $PATHS; do
    [[ $p == c ]] && continue
    printf '  (%s) %s %s %s %s %+.1f\n' "$p" "$(ratio "$(m $p.t1)" "$(m c.t1)")" "$(ratio "$(m $p.tn)" "$(m c.tn)")" \
      "$(ratio "$(m $p.u1400)" "$(m c.u1400)")" "$(ratio "$(m $p.u64)" "$(m c.u64)")" \
      "$(python3 -c 'import sys; print(float(sys.argv[1]) - float(sys.argv[2]))' "$(m $p.rtt)" "$(m c.rtt)")"
  done
fi
if [[ " $PATHS " == *" f "* ]]; then
  # The daemon's peak memory over all the rounds, and its CPU while nothing flows (apps gone, busy-poll off).
  ticks() { awk '{print $14 + $15}' /proc/"$daemon"/stat; }
  t0=$(ticks); sleep "${IDLE_SECS:-10}"; t1=$(ticks)
  printf 'flexstack daemon: peak RSS %.1f MiB under load; idle CPU %.2f %% over %s s\n' \
    "$(awk '/VmHWM/ {print $2 / 1024}' /proc/"$daemon"/status)" \
    "$(python3 -c 'import os, sys; print(100 * (int(sys.argv[2]) - int(sys.argv[1])) / os.sysconf("SC_CLK_TCK") / float(sys.argv[3]))' "$t0" "$t1" "${IDLE_SECS:-10}")" "${IDLE_SECS:-10}"
fi
if [[ " $PATHS " == *" o "* && " $PATHS " == *" f "* ]]; then
  printf '(f)/(o): TCP 1 %s, TCP %s %s, UDP1400 %s, UDP64 %s; (o) peak RSS %.1f MiB under load\n' \
    "$(ratio "$(m f.t1)" "$(m o.t1)")" "$MANY" "$(ratio "$(m f.tn)" "$(m o.tn)")" \
    "$(ratio "$(m f.u1400)" "$(m o.u1400)")" "$(ratio "$(m f.u64)" "$(m o.u64)")" \
    "$(awk '/VmHWM/ {print $2 / 1024}' /proc/"$daemon_o"/status)"
fi
for k in $(printf '%s\n' "${!r[@]}" | sort); do echo "rounds $k: ${r[$k]}"; done
echo "code version: $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty), fs $fs${FS_OLD:+, old (o) $FS_OLD}"

#!/usr/bin/env bash
# Latency benchmark (issue 16): round-trip time of a 64-byte UDP ping-pong, one datagram in flight
# (bench/udp_pp.c), between two namespaces over
#   (v) a veth pair (the reference),
#   (c) the trivial C TUN <-> TUN forwarder of bench/tun_forward.c (one thread polling both devices, one packet per
#       call),
#   (t) the same forwarder with offloads and one thread per direction, each blocked in read() (tun_forward -o -t:
#       the issue's reference),
#   (f) flexstack TUN <-> TUN with the default modules (ip, reassemble, classify, direction), busy-poll off,
#   (p) the same daemon with busy-poll on (`worker.all.busy_poll_us` = BUSY_US, 200 by default).
# All five paths exist at once (their own subnets), and each round measures them in turn; RUNS (5) rounds of N
# (5000) round trips. Printed: the medians over the rounds of each round's median and 99th percentile, and the
# time each path adds to the veth's median. Needs root. PROFILE=ci builds and runs target/ci/flexstack (say so
# with figures); FS=PATH runs that binary unbuilt.
# On a virtual machine the figures depend on what else runs: a vCPU that halted when idle pays a wake-up (an exit
# to the host and back, tens of microseconds) at each sleeping hop of a round trip; say how busy the machine was.
# WORKERS=N runs the daemon with N data-plane workers (default: the daemon's, one per core).
# CPU_LATENCY_US=N holds a PM QoS CPU latency request of N us (/dev/cpu_dma_latency) for the whole run, as
# latency-tuned hosts do (tuned's latency-performance profile): with 0 the idle CPUs poll instead of halting, so the
# figures are the paths' own and not the wake-ups of halted vCPUs. Printed with the results; unset: no request.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/bench.sh # median, default_modules_stack, bench_setup
RUNS=${RUNS:-5}
N=${N:-5000}
BUSY_US=${BUSY_US:-200}
bench_setup bench-latency "namespaces, TUN devices" cc python3
tag=fsl$$
state=$(mktemp -d)
daemon=
fwd=
fwd2=
cleanup() {
  [[ -n "$daemon" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  [[ -n "$fwd" ]] && kill "$fwd" 2>/dev/null && wait "$fwd" 2>/dev/null || true
  [[ -n "$fwd2" ]] && kill "$fwd2" 2>/dev/null && wait "$fwd2" 2>/dev/null || true
  ns_cleanup ${tag}a ${tag}b
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
if [[ -n ${CPU_LATENCY_US:-} ]]; then
  # The request holds while the file is open (fd 9, for the script's life); a value that is not a number is refused.
  [[ $CPU_LATENCY_US =~ ^[0-9]+$ ]] || { echo "bench-latency: CPU_LATENCY_US must be a number of us" >&2; exit 2; }
  exec 9>/dev/cpu_dma_latency
  printf '0x%08x' "$CPU_LATENCY_US" >&9 # 10 bytes: read as hex (4 bytes would be read as binary)
fi
cc -O2 -o "$state/udp_pp" bench/udp_pp.c
cc -O2 -pthread -o "$state/tun_forward" bench/tun_forward.c
ip netns add ${tag}a; ip netns add ${tag}b
ip -n ${tag}a link set lo up; ip -n ${tag}b link set lo up
# place DEV NET: moves a device's two ends (or a TUN pair) into the namespaces as 10.NET.0.1 and 10.NET.0.2.
place() {
  ip link set "$1" netns ${tag}a; ip link set "$2" netns ${tag}b
  ip -n ${tag}a addr add 10.$3.0.1/24 dev "$1"; ip -n ${tag}a link set "$1" up
  ip -n ${tag}b addr add 10.$3.0.2/24 dev "$2"; ip -n ${tag}b link set "$2" up
}
# (v) veth
ip link add ${tag}v type veth peer name ${tag}w
place ${tag}v ${tag}w 211
# (c) the C forwarder between two TUN devices of its own
"$state/tun_forward" ${tag}ca ${tag}cb > "$state/fwd.out" &
fwd=$!
wait_for 'grep -q ready "$state/fwd.out" 2>/dev/null' "the forwarder did not start"
place ${tag}ca ${tag}cb 212
# (t) the same forwarder, offloads and a thread per direction
"$state/tun_forward" -o -t ${tag}ka ${tag}kb > "$state/fwd2.out" &
fwd2=$!
wait_for 'grep -q ready "$state/fwd2.out" 2>/dev/null' "the forwarder did not start"
place ${tag}ka ${tag}kb 214
# (f, p) flexstack with the default modules
default_modules_stack > "$state/chain.toml"
"$fs" daemon ${WORKERS:+--workers "$WORKERS"} --stack "$state/chain.toml" --state-dir "$state/d" 2>"$state/daemon.log" &
daemon=$!
wait_for '"$fs" --state-dir "$state/d" status >/dev/null 2>&1' "the daemon did not start (see its log)"
place ${tag}ta ${tag}tb 213
ip netns exec ${tag}b "$state/udp_pp" server 7000 &
sleep 0.3
busy() { "$fs" --state-dir "$state/d" set worker.all.busy_poll_us "$1" >/dev/null; }
pp() { ip netns exec ${tag}a "$state/udp_pp" pp "10.$1.0.2" 7000 "$N"; }
declare -A med p99
for r in $(seq "$RUNS"); do
  echo "bench-latency: round $r/$RUNS" >&2
  for c in v c t f p; do
    case $c in
      v) out=$(pp 211) ;;
      c) out=$(pp 212) ;;
      t) out=$(pp 214) ;;
      f) busy 0; out=$(pp 213) ;;
      p) busy "$BUSY_US"; out=$(pp 213); busy 0 ;;
    esac
    med[$c]+="$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out") "
    p99[$c]+="$(sed -n 's/.*p99_us=\([0-9.]*\).*/\1/p' <<<"$out") "
  done
done
m() { tr ' ' '\n' <<<"$1" | grep . | median; }
v=$(m "${med[v]}")
printf 'UDP ping-pong, 64 bytes, one in flight: medians of %s rounds of %s round trips (us), load average %s, %s\n' \
  "$RUNS" "$N" "$(cut -d' ' -f1 /proc/loadavg)${WORKERS:+, $WORKERS workers}" \
  "$([[ -n ${CPU_LATENCY_US:-} ]] && echo "CPU latency request $CPU_LATENCY_US us" || echo "no CPU latency request")"
printf '%-44s %9s %9s %9s\n' path median p99 added
for c in v c t f p; do
  case $c in
    v) name="(v) veth (reference)" ;;
    c) name="(c) C TUN <-> TUN forwarder (reference)" ;;
    t) name="(t) C forwarder, offloads, 2 threads (ref.)" ;;
    f) name="(f) flexstack default modules, busy-poll off" ;;
    p) name="(p) flexstack default modules, busy-poll ${BUSY_US} us" ;;
  esac
  x=$(m "${med[$c]}")
  printf '%-44s %9.1f %9.1f %+9.1f\n' "$name" "$x" "$(m "${p99[$c]}")" "$(echo "$x - $v" | bc -l)"
done
echo "rounds (median us): v ${med[v]}| c ${med[c]}| t ${med[t]}| f ${med[f]}| p ${med[p]}"
echo "code version: $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty), fs $fs"

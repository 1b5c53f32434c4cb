#!/usr/bin/env bash
# Data-path benchmark (issue 3): iperf3 TCP throughput between two network namespaces
#   (1) through the kernel: a veth pair (reference), and through the C TUN <-> TUN forwarder of bench/tun_forward.c
#       twice: read()/write(), one packet per system call, no offloads; and with virtio-net headers and offloads
#       and a thread per direction (`-o -t`: GSO packets pass whole, issue 16's reference, which the ratios are
#       to); all measured in the same run;
#   (2) through flexstack: two TUN faces wired to each other ("a -> b", "b -> a");
#   (3) through flexstack with the modules of the default app chain on the way (ip, reassemble, classify).
# Each with STREAMS parallel iperf3 streams (-P; default "1 4"), flexstack with each of WORKERS data-plane workers
# (`daemon --workers`; default "1 2"). Prints the median of RUNS runs of SECS seconds each, and the ratios to the
# reference. PROFILE=ci uses the ci profile's binary (optimised, with debug info) instead of building a release.
# OFFLOAD=0 gives flexstack's TUN faces `offload = false` (plain packets, no virtio-net headers): compare them with
# the C forwarder without offloads.
# Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
SECS=${SECS:-5}
STREAMS=${STREAMS:-1 4}
WORKERS=${WORKERS:-1 2}
. scripts/lib/bench.sh   # median, tun_faces, default_modules_stack, bench_setup
bench_setup bench-datapath "namespaces, TUN devices" iperf3
tag=fsb$$
state=$(mktemp -d)
cleanup() {
  [[ -n "${daemon:-}" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  for ns in ${tag}a ${tag}b; do ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true; ip netns del "$ns" 2>/dev/null || true; done
  ip link del ${tag}v 2>/dev/null || true
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
ip netns add ${tag}a; ip netns add ${tag}b
ip -n ${tag}a link set lo up; ip -n ${tag}b link set lo up
measure() { # $1 = server address, $2 = parallel streams; prints Gbit/s of each run, one per line
  ip netns exec ${tag}b iperf3 -s -D -p 5299 -I "$state/iperf.pid" >/dev/null
  sleep 0.3
  for _ in $(seq "$RUNS"); do
    ip netns exec ${tag}a iperf3 -c "$1" -p 5299 -P "$2" -t "$SECS" -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'
  done
  kill "$(cat "$state/iperf.pid")" 2>/dev/null || true
  sleep 0.3
}

# (1) kernel veth
ip link add ${tag}v type veth peer name ${tag}w
ip link set ${tag}v netns ${tag}a; ip link set ${tag}w netns ${tag}b
ip -n ${tag}a addr add 10.201.0.1/24 dev ${tag}v; ip -n ${tag}a link set ${tag}v up
ip -n ${tag}b addr add 10.201.0.2/24 dev ${tag}w; ip -n ${tag}b link set ${tag}w up
declare -A veth cfwd cfwdo wire chain
for p in $STREAMS; do veth[$p]=$(measure 10.201.0.2 "$p" | median); done
ip -n ${tag}a link del ${tag}v

# (1b) the trivial C forwarder
cc -O2 -pthread -o "$state/tun_forward" bench/tun_forward.c
forwarder() { # $@ = the forwarder's options; prints the median Gbit/s of each of STREAMS, one a line
  "$state/tun_forward" "$@" ${tag}ta ${tag}tb > "$state/fwd.out" &
  fwd=$!
  wait_for 'grep -q ready "$state/fwd.out" 2>/dev/null' "the forwarder did not start"
  ip link set ${tag}ta netns ${tag}a; ip link set ${tag}tb netns ${tag}b
  ip -n ${tag}a addr add 10.202.0.1/24 dev ${tag}ta; ip -n ${tag}a link set ${tag}ta up
  ip -n ${tag}b addr add 10.202.0.2/24 dev ${tag}tb; ip -n ${tag}b link set ${tag}tb up
  for p in $STREAMS; do measure 10.202.0.2 "$p" | median; done
  kill "$fwd"; wait "$fwd" 2>/dev/null || true
}
mapfile -t got < <(forwarder)
i=0; for p in $STREAMS; do cfwd[$p]=${got[$i]}; i=$((i + 1)); done
# (1c) the same forwarder with offloads and a thread per direction: the issue's reference
mapfile -t got < <(forwarder -o -t)
i=0; for p in $STREAMS; do cfwdo[$p]=${got[$i]}; i=$((i + 1)); done

run_stack() { # $1 = stack file, $2 = workers, $3 = streams; prints the median Gbit/s
  "$fs" daemon --stack "$1" --state-dir "$state/d" --workers "$2" 2>"$state/daemon.log" &
  daemon=$!
  wait_for '"$fs" --state-dir "$state/d" status >/dev/null 2>&1' "the daemon did not start (see its log)"
  ip link set ${tag}ta netns ${tag}a; ip link set ${tag}tb netns ${tag}b
  ip -n ${tag}a addr add 10.202.0.1/24 dev ${tag}ta; ip -n ${tag}a link set ${tag}ta up
  ip -n ${tag}b addr add 10.202.0.2/24 dev ${tag}tb; ip -n ${tag}b link set ${tag}tb up
  measure 10.202.0.2 "$3" | median
  kill "$daemon"; wait "$daemon" 2>/dev/null || true; daemon=
}

{
  echo 'links = ["a -> b", "b -> a"]'
  tun_faces
} > "$state/wire.toml"
for w in $WORKERS; do for p in $STREAMS; do wire[$w,$p]=$(run_stack "$state/wire.toml" "$w" "$p"); done; done

default_modules_stack > "$state/chain.toml"
for w in $WORKERS; do for p in $STREAMS; do chain[$w,$p]=$(run_stack "$state/chain.toml" "$w" "$p"); done; done

printf 'data-path benchmark: iperf3 TCP, median of %s runs of %s s (Gbit/s)\n' "$RUNS" "$SECS"
for p in $STREAMS; do
  printf '%s stream(s):\n' "$p"
  printf '  kernel veth (reference)                            %6.2f\n' "${veth[$p]}"
  printf '  C TUN <-> TUN forwarder, no offloads (reference)   %6.2f\n' "${cfwd[$p]}"
  printf '  C forwarder, offloads, 2 threads (reference)       %6.2f\n' "${cfwdo[$p]}"
  for w in $WORKERS; do
    x=${wire[$w,$p]}; y=${chain[$w,$p]}
    printf '  flexstack TUN <-> TUN, %s worker(s)                 %6.2f   ratio to C forwarder with offloads %.2f, to veth %.2f\n' "$w" "$x" "$(echo "$x / ${cfwdo[$p]}" | bc -l)" "$(echo "$x / ${veth[$p]}" | bc -l)"
    printf '  flexstack default modules, %s worker(s)             %6.2f   ratio to C forwarder with offloads %.2f, to veth %.2f\n' "$w" "$y" "$(echo "$y / ${cfwdo[$p]}" | bc -l)" "$(echo "$y / ${veth[$p]}" | bc -l)"
  done
done

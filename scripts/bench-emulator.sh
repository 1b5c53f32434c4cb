#!/usr/bin/env bash
# Emulator cost benchmark (issue 4, "the emulator's own cost"): iperf3 TCP throughput h1 -> h2, median of RUNS runs
# of SECS seconds, all in the same run:
#   (a) over a plain veth pair between h1 and h2 (reference, kernel defaults: TSO/GSO on);
#   (a') the same veth pair with gso_max_segs 1 (MTU-sized frames only, as on the emulated link; for scale);
#   (b) through a flexstack emulated link with no impairment, built as the lab builds it: h1 and h2 each joined by a
#       veth pair to the host, whose host ends a flexstack daemon (release build) owns with `packet` faces
#       (take_over = false) and bridges through one `emulator` per direction. The namespace ends use
#       gso_max_segs 1: the faces carry whole frames, so TCP must hand the veth MTU-sized frames.
# Prints the medians and the ratio (b)/(a) (issue target >= 0.7). Needs root and iperf3.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
SECS=${SECS:-5}
[[ $(id -u) == 0 ]] || { echo "bench-emulator: needs root (namespaces, veth, AF_PACKET)" >&2; exit 1; }
command -v iperf3 >/dev/null || { echo "bench-emulator: needs iperf3 (scripts/setup.sh)" >&2; exit 1; }
cargo build --release --quiet
fs=$PWD/target/release/flexstack
tag=fse$$
h1=${tag}h1 h2=${tag}h2
state=$(mktemp -d)
daemon=
cleanup() {
  if [[ -n "$daemon" ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  for ns in "$h1" "$h2"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  for dev in ${tag}v ${tag}a ${tag}b; do ip link del "$dev" 2>/dev/null || true; done
  rm -rf "$state"
}
trap cleanup EXIT INT TERM
ip netns add "$h1"; ip netns add "$h2"
ip -n "$h1" link set lo up; ip -n "$h2" link set lo up

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
measure() { # $1 = server address; prints Gbit/s of each run, one per line
  ip netns exec "$h2" iperf3 -s -D -p 5299 -I "$state/iperf.pid" >/dev/null
  sleep 0.3
  for _ in $(seq "$RUNS"); do
    ip netns exec "$h1" iperf3 -c "$1" -p 5299 -t "$SECS" -J |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'
  done
  kill "$(cat "$state/iperf.pid")" 2>/dev/null || true
  sleep 0.3
}
plain_veth() { # $@ = extra link options for both ends; prints the median Gbit/s
  ip link add ${tag}v "$@" type veth peer name ${tag}w "$@"
  ip link set ${tag}v netns "$h1"; ip link set ${tag}w netns "$h2"
  ip -n "$h1" addr add 10.203.5.1/24 dev ${tag}v; ip -n "$h1" link set ${tag}v up
  ip -n "$h2" addr add 10.203.5.2/24 dev ${tag}w; ip -n "$h2" link set ${tag}w up
  measure 10.203.5.2 | median
  ip -n "$h1" link del ${tag}v
}

# (a) and (a'): plain veth pairs.
veth=$(plain_veth)
veth1=$(plain_veth gso_max_segs 1)

# (b) the emulated link.
for side in a:1:"$h1" b:2:"$h2"; do
  IFS=: read -r x n ns <<<"$side"
  ip link add ${tag}$x gso_max_segs 1 type veth peer name ${tag}p$n gso_max_segs 1
  echo 1 > /proc/sys/net/ipv6/conf/${tag}$x/disable_ipv6
  ip link set ${tag}$x up
  ip link set ${tag}p$n netns "$ns"
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.${tag}p$n.disable_ipv6=1
  ip -n "$ns" addr add 10.204.5.$n/24 dev ${tag}p$n
  ip -n "$ns" link set ${tag}p$n up
done
cat > "$state/link.toml" <<TOML
links = ["a -> e_ab", "e_ab -> b", "b -> e_ba", "e_ba -> a"]
[modules.a]
kind = "packet"
interface = "${tag}a"
take_over = false
[modules.b]
kind = "packet"
interface = "${tag}b"
take_over = false
[modules.e_ab]
kind = "emulator"
[modules.e_ba]
kind = "emulator"
TOML
FLEXSTACK_LOG=warn "$fs" daemon --stack "$state/link.toml" --state-dir "$state/d" 2>"$state/daemon.log" &
daemon=$!
for _ in $(seq 100); do "$fs" --state-dir "$state/d" status >/dev/null 2>&1 && break; sleep 0.05; done
ip netns exec "$h1" ping -c 1 -W 2 10.204.5.2 >/dev/null || { cat "$state/daemon.log" >&2; exit 1; }
emu=$(measure 10.204.5.2 | median)
drops=$("$fs" --state-dir "$state/d" get 'module.*.drop_*' 'module.*.tx_errors_total' | awk 'NR > 1 && $2 != 0' || true)

printf 'emulator cost benchmark: iperf3 TCP h1 -> h2, median of %s runs of %s s (Gbit/s)\n' "$RUNS" "$SECS"
printf '  plain veth (reference)                      %6.2f\n' "$veth"
printf '  plain veth, gso_max_segs 1                  %6.2f\n' "$veth1"
printf '  flexstack emulated link, no impairment      %6.2f   ratio to veth %.2f (target >= 0.7), to veth gso_max_segs 1 %.2f\n' \
  "$emu" "$(echo "$emu / $veth" | bc -l)" "$(echo "$emu / $veth1" | bc -l)"
[[ -n "$drops" ]] && printf 'non-zero drop/error meters on the emulated link:\n%s\n' "$drops"
exit 0

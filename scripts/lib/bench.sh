# Shell helpers shared by the benchmark scripts (scripts/bench-*.sh source this file).

# The checks and the build every benchmark starts with: `$1` (the script's name) must run as root (`$2` says what
# for) with the programs `$3...` installed; then the cargo profile $PROFILE (default release) is built and `fs` set to
# its daemon binary. FS=PATH benchmarks another build instead, NO_BUILD=1 the binary as it is (nothing is built).
# `bench_name` keeps `$1` for the messages of the helpers below.
bench_setup() {
  local name=$1 why=$2 p
  bench_name=$name
  shift 2
  [[ $(id -u) == 0 ]] || { echo "$name: needs root ($why)" >&2; exit 1; }
  for p in "$@"; do
    command -v "$p" >/dev/null || { echo "$name: needs $p (scripts/setup.sh)" >&2; exit 1; }
  done
  PROFILE=${PROFILE:-release}
  if [[ -z ${NO_BUILD:-}${FS:-} ]]; then
    echo "$name: building ($PROFILE)" >&2
    cargo build --profile "$PROFILE" --quiet
  fi
  fs=${FS:-$PWD/target/$PROFILE/flexstack}
}

# Prints the median of the numbers on stdin, one a line (the mean of the middle two for an even count).
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# Prints the TOML of two TUN faces: `a` (device ${tag}ta, whose packets travel down, from the app) and `b` (device
# ${tag}tb, whose packets travel up, from the server).
tun_faces() {
  local off=
  [[ ${OFFLOAD:-1} == 0 ]] && off='offload = false' # OFFLOAD=0: plain packets, no virtio-net headers
  cat <<TOML
[modules.a]
kind = "tun"
name = "${tag}ta"
$off
[modules.b]
kind = "tun"
name = "${tag}tb"
direction = "up"
$off
TOML
}

# Prints the TOML of a stack with the default app modules (ip, reassemble, classify, direction) between the TUN
# faces of tun_faces.
default_modules_stack() {
  cat <<'TOML'
links = ["a -> ip", "b -> ip", "ip[out] -> frag", "frag -> flows",
         "flows[tcp] -> dir", "flows[udp] -> dir", "flows[icmp] -> dir", "flows[other] -> dir",
         "dir[down] -> b", "dir[up] -> a"]
TOML
  tun_faces
  cat <<'TOML'
[modules.ip]
kind = "ip"
[modules.frag]
kind = "reassemble"
[modules.flows]
kind = "classify"
[modules.dir]
kind = "direction"
TOML
}

# Creates the server namespace ${tag}s joined to the host by a veth pair (${tag}h on the host, 10.$1.7.1/24; ${tag}p
# inside, 10.$1.7.2/24, default route through the host). Remove it with server_ns_cleanup.
server_ns() {
  ip netns add ${tag}s
  ip -n ${tag}s link set lo up
  ip link add ${tag}h type veth peer name ${tag}p
  ip link set ${tag}p netns ${tag}s
  ip addr add 10.$1.7.1/24 dev ${tag}h; ip link set ${tag}h up
  ip -n ${tag}s addr add 10.$1.7.2/24 dev ${tag}p; ip -n ${tag}s link set ${tag}p up
  ip -n ${tag}s route add default via 10.$1.7.1
}

# Kills what runs in each of the namespaces named and removes them (none need exist).
ns_cleanup() {
  local ns
  for ns in "$@"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}

# Kills what runs in ${tag}s and removes it and its veth pair.
server_ns_cleanup() {
  ip netns pids ${tag}s 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns del ${tag}s 2>/dev/null || true
  ip link del ${tag}h 2>/dev/null || true
}

# Two peers and a server (scripts/bench-carriers.sh, scripts/experiment-lossy.sh): the host (daemon A's, 10.$1.1.1)
# ─ veth ─ namespace ${tag}b (daemon B's, 10.$1.1.2) ─ veth ─ ${tag}s (the server, 10.$1.2.2, iperf3 on 5201). B's
# namespace forwards, so a plain app on A reaches the server through it. With $2 = bridge, the A-B link passes through
# namespace ${tag}m as two veth ends (${tag}1 towards A, ${tag}2 towards B, kernel IPv6 off) for a daemon to join.
# Sets srv; remove everything with peer_topology_cleanup.
peer_topology() {
  local net=$1 ns d
  fwd_old=$(sysctl -n net.ipv4.ip_forward)
  for ns in b s ${2:+m}; do ip netns add ${tag}$ns; ip -n ${tag}$ns link set lo up; done
  ip link add ${tag}h type veth peer name ${tag}1
  if [[ -n ${2:-} ]]; then
    ip link set ${tag}1 netns ${tag}m
    ip -n ${tag}m link add ${tag}2 type veth peer name ${tag}i
    ip -n ${tag}m link set ${tag}i netns ${tag}b
    for d in 1 2; do
      ip netns exec ${tag}m sysctl -qw net.ipv6.conf.${tag}$d.disable_ipv6=1
      ip -n ${tag}m link set ${tag}$d up
    done
  else
    ip link set ${tag}1 netns ${tag}b
    ip -n ${tag}b link set ${tag}1 name ${tag}i
  fi
  ip addr add 10.$net.1.1/24 dev ${tag}h; ip link set ${tag}h up
  ip -n ${tag}b addr add 10.$net.1.2/24 dev ${tag}i; ip -n ${tag}b link set ${tag}i up
  ip -n ${tag}b link add ${tag}j type veth peer name ${tag}k
  ip -n ${tag}b link set ${tag}k netns ${tag}s
  ip -n ${tag}b addr add 10.$net.2.1/24 dev ${tag}j; ip -n ${tag}b link set ${tag}j up
  ip -n ${tag}s addr add 10.$net.2.2/24 dev ${tag}k; ip -n ${tag}s link set ${tag}k up
  ip -n ${tag}s route add default via 10.$net.2.1
  ip -n ${tag}b route add default via 10.$net.1.1
  ip netns exec ${tag}b sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw net.ipv4.ip_forward=1
  ip route add 10.$net.2.0/24 via 10.$net.1.2
  srv=10.$net.2.2
  # A test whose client went away (an app's UDP flood can starve its control connection) holds the server for
  # --rcv-timeout, not for iperf3's default two minutes.
  ip netns exec ${tag}s iperf3 -s -D -p 5201 --rcv-timeout 5000 -I "$state/iperf.pid" >/dev/null
}

# Removes what peer_topology made (daemon B first, when b_daemon is set) and restores the host's forwarding.
peer_topology_cleanup() {
  [[ -n ${b_daemon:-} ]] && kill "$b_daemon" 2>/dev/null && wait "$b_daemon" 2>/dev/null || true
  ns_cleanup ${tag}m ${tag}b ${tag}s
  ip link del ${tag}h 2>/dev/null || true
  ip route del 10.$1.2.0/24 2>/dev/null || true
  [[ -n ${fwd_old:-} ]] && sysctl -qw net.ipv4.ip_forward="$fwd_old"
  return 0
}

# The state of a script on the two-peer topology (peer_topology $1): $state, a directory the sandboxed apps can read;
# $pids, the daemons the script starts; a trap that removes the topology, stops those daemons and B (start_peer_b)
# and removes $state (kept, with the daemons' logs, when KEEP_STATE=1).
peer_bench_state() {
  bench_net=$1
  state=$(mktemp -d)
  chmod 755 "$state"
  pids=()
  trap peer_bench_cleanup EXIT INT TERM
}
peer_bench_cleanup() {
  local p
  peer_topology_cleanup "$bench_net"
  for p in "${pids[@]}" ${b_daemon:-}; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done
  if [[ -n ${KEEP_STATE:-} ]]; then echo "$bench_name: logs kept in $state" >&2; else rm -rf "$state"; fi
}

# Waits up to 10 s for the command line $1 to succeed; otherwise fails the script, saying $2.
wait_for() {
  for _ in $(seq 200); do eval "$1" && return 0; sleep 0.05; done
  echo "${bench_name:-benchmark}: $2" >&2
  exit 1
}

# Runs the iperf3 client command "$@" (-J: its report on stdout) and prints the report; tried again up to twice, 3 s
# apart, when the server answered that it was still busy with an earlier test (whose client went away).
iperf3_retrying() {
  local out
  for _ in 1 2 3; do
    out=$("$@") || true
    grep -q '"error":.*busy' <<< "$out" || break
    sleep 3
  done
  printf '%s\n' "$out"
}

# The C forwarder's client namespace ${tag}c: its only device ${tag}ca (10.$1.0.2/24, the default route) is a TUN
# device drained by bench/tun_forward.c (offloads, a thread per direction) into ${tag}cb in the host (10.$1.0.1/24).
# Adds the forwarder to pids; the caller's cleanup removes ${tag}c (ns_cleanup).
c_forwarder_ns() {
  cc -O2 -pthread -o "$state/tun_forward" bench/tun_forward.c
  ip netns add ${tag}c
  ip -n ${tag}c link set lo up
  "$state/tun_forward" -o -t ${tag}ca ${tag}cb > "$state/fwd.out" &
  pids+=($!)
  wait_for 'grep -q ready "$state/fwd.out" 2>/dev/null' "the C forwarder did not start"
  ip link set ${tag}ca netns ${tag}c
  ip -n ${tag}c addr add 10.$1.0.2/24 dev ${tag}ca
  ip -n ${tag}c link set ${tag}ca up
  ip -n ${tag}c route add default dev ${tag}ca
  ip addr add 10.$1.0.1/24 dev ${tag}cb
  ip link set ${tag}cb up
}

# Starts daemon A (state $state/a, apps in 10.($1+1).0.0/16), then calls start_peer_b $2 and makes A and B peers
# (A calls B `gateway`, B calls A `a`).
start_peers() {
  "$fs" daemon --state-dir "$state/a" --app-subnet 10.$(($1 + 1)).0.0 2>"$state/daemon-a.log" &
  pids+=($!)
  wait_for '"$fs" --state-dir "$state/a" status >/dev/null 2>&1' "daemon A did not start (its log: $state/daemon-a.log)"
  start_peer_b "$1" "$2"
  "$fs" --state-dir "$state/a" peer add gateway 10.$1.1.2:7300 "$("$fs" --state-dir "$state/b" peer key)" >/dev/null
}

# (Re)starts daemon B in ${tag}b with stacks/peer-in.toml listening on 10.$1.1.2:7300 with transport $2, the sed
# expressions $3... applied to the stack too; B's key stays in its state directory, and it is told A's key again.
start_peer_b() {
  local net=$1 transport=$2 _
  shift 2
  [[ -n ${b_daemon:-} ]] && { kill "$b_daemon"; wait "$b_daemon" 2>/dev/null || true; }
  sed -e "s|listen = \"0.0.0.0:7300\"|listen = \"10.$net.1.2:7300\"\ntransport = \"$transport\"|" "$@" \
    stacks/peer-in.toml > "$state/peer-in.toml"
  ip netns exec ${tag}b "$fs" daemon --stack "$state/peer-in.toml" --state-dir "$state/b" 2>>"$state/daemon-b.log" &
  b_daemon=$!
  wait_for '"$fs" --state-dir "$state/b" status >/dev/null 2>&1' "daemon B did not start (its log: $state/daemon-b.log)"
  "$fs" --state-dir "$state/b" peer add a 10.$net.1.1:0 "$("$fs" --state-dir "$state/a" peer key)" >/dev/null
}

# Writes $state/app-$1.toml: stacks/app-peer.toml whose carrier has the settings $2... (TOML lines), with the sed
# expressions of the array app_sed applied too.
carrier_stack() {
  local name=$1 settings
  shift
  settings=$(printf '%s\\n' "$@")
  sed -e "s|peer = \"gateway\"|peer = \"gateway\"\\n$settings|" "${app_sed[@]}" stacks/app-peer.toml \
    > "$state/app-$name.toml"
}

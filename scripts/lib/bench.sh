# Shell helpers shared by the benchmark scripts (scripts/bench-*.sh source this file).

# The checks and the build every benchmark starts with: `$1` (the script's name) must run as root (`$2` says what
# for) with the programs `$3...` installed; then the cargo profile $PROFILE (default release) is built and `fs` set to
# its daemon binary. FS=PATH benchmarks another build instead, NO_BUILD=1 the binary as it is (nothing is built).
bench_setup() {
  local name=$1 why=$2 p
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
  cat <<TOML
[modules.a]
kind = "tun"
name = "${tag}ta"
[modules.b]
kind = "tun"
name = "${tag}tb"
direction = "up"
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

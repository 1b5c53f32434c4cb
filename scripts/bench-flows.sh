#!/usr/bin/env bash
# Flow-termination benchmark (issue 13). The same sandboxed client (`flexstack run`) and the same servers, in a
# namespace joined to the host by a veth pair, over
#   (a) the plain forwarding chain (stacks/app-default.toml),
#   (b) termination with the kernel back-ends (stacks/app-terminate.toml with backend = "kernel"),
#   (c) termination with smoltcp on both sides (stacks/app-terminate.toml),
# the three alternating in every round, RUNS rounds, medians printed with the ratios to (a):
#   - TCP one stream: iperf3 -t SECS, Gbit/s received;
#   - new connections per second: wrk -H "Connection: close" (one small HTTP request per connection) to nginx;
#   - round-trip time of a 1-byte request/response: bench/tcp_rr.c, the median of RR_N round trips;
#   - IDLE idle terminated connections (b, c): the daemon's RSS while they are held, and its CPU over IDLE_SECS,
#     measured from IDLE_SETTLE seconds (default 3) after the last one opened: by then each connection's one-time
#     work is done (smoltcp's buffers give their pages back after idle_discard_ms, 1 s), so the window shows what
#     idle connections cost while they stay idle.
# Targets (issue 13): (b) >= 0.8 x (a) and (c) >= 0.5 x (a) in throughput; (b), (c) >= 0.7 x (a) in connections/s;
# added RTT <= 50 us; RSS <= 256 MiB for 10,000 idle connections, CPU near 0. Needs root.
# PERF=file records a profile of the daemon (file.b, file.c) while the connections are idle; PERF_CPS=file while
# wrk opens connections (file.a, file.b, file.c; overwritten each round); PERF_TPUT=file the same during iperf3.
# CONFIGS (default "a b c") picks configurations, e.g. CONFIGS="a c" while a back-end is missing; PROFILE (default
# release) the cargo profile built and run (FS=path runs that binary instead, unbuilt: an A/B of two
# versions, e.g. one built from main); IDLE_SMAPS=PATH keeps the daemon's /proc/PID/smaps while the idle
# connections are held, as PATH.<configuration> (where its memory goes).
# STACK_X=file runs configuration X (a, b, c, or with FS_OLD a0, b0, c0) with that stack file instead: an A/B of
# two settings with one binary when FS_OLD is the same binary (e.g. STACK_c0=my-terminate.toml).
# IDLE=0 skips the idle connections (throughput, connections/s and RTT only).
# FS_OLD=path: an A/B in the same run: a second daemon runs that binary (one built from main, say; its apps in
# 10.(NET+2).0.0/16), and every configuration X is measured with it too, as X0 ("old"), right after X in every round
# (so both see the same machine); X0's ratios are to a0. PERF, PERF_CPS and IDLE_SMAPS name its files X0.
# WORKERS=N runs the daemon with --workers N (default: the daemon's default), WORKERS_OLD=N the FS_OLD daemon: with
# FS_OLD set to the same binary, an A/B of worker counts in one run (e.g. FS_OLD=target/release/flexstack WORKERS=2
# WORKERS_OLD=1 CONFIGS=a IDLE=0).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-5}
RR_N=${RR_N:-5000}
IDLE=${IDLE:-10000}
IDLE_SECS=${IDLE_SECS:-10}
IDLE_SETTLE=${IDLE_SETTLE:-3}
CONFIGS=${CONFIGS:-a b c}
NET=${NET:-213} # the server's subnet is 10.NET.7.0/24 and the apps' 10.(NET+1).0.0/16: another NET for a second run
. scripts/lib/bench.sh # median, bench_setup
bench_setup bench-flows "namespaces, TUN devices" iperf3 wrk nginx cc # PROFILE=ci reuses the test build
tag=fsf$$
state=$(mktemp -d)
chmod 755 "$state"
tw_host=$(sysctl -n net.netfilter.nf_conntrack_tcp_timeout_time_wait 2>/dev/null || true)
cleanup() {
  [[ -n "$tw_host" ]] && sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait="$tw_host" || true
  [[ -n "${daemon:-}" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  [[ -n "${daemon0:-}" ]] && kill "$daemon0" 2>/dev/null && wait "$daemon0" 2>/dev/null || true
  server_ns_cleanup
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

# The server namespace: veth to the host, iperf3, nginx (a 1 KiB page), the echo server.
server_ns "$NET"
# Tens of thousands of short connections per run must not leave the next configuration without ports: the
# server (which closes first) keeps no TIME-WAIT, and the host's conntrack forgets closed connections after 1 s
# (restored at exit). Without this, a configuration measured after another one found the (address, port) pairs
# towards the server still taken and its SYNs waited for retransmission.
ip netns exec ${tag}s sysctl -qw net.ipv4.tcp_max_tw_buckets=0
[[ -n "$tw_host" ]] && sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1
srv=10.$NET.7.2
cc -O2 -o "$state/tcp_rr" bench/tcp_rr.c
mkdir -p "$state/www"
head -c 1024 /dev/zero | tr '\0' x > "$state/www/small"
cat > "$state/nginx.conf" <<EOF
worker_processes 1;
pid $state/nginx.pid;
error_log $state/nginx.err;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $state; proxy_temp_path $state; fastcgi_temp_path $state;
  uwsgi_temp_path $state; scgi_temp_path $state;
  server { listen 8080; root $state/www; }
}
EOF
ip netns exec ${tag}s nginx -c "$state/nginx.conf"
ip netns exec ${tag}s iperf3 -s -D -p 5201 -I "$state/iperf.pid" >/dev/null
ip netns exec ${tag}s "$state/tcp_rr" server 7 > "$state/rr.out" &
for _ in $(seq 100); do grep -q ready "$state/rr.out" 2>/dev/null && break; sleep 0.05; done

workers_arg() { [[ -n "$1" ]] && echo "--workers=$1" || true; }
# shellcheck disable=SC2046 # an empty knob adds no argument
"$fs" daemon --state-dir "$state/d" $(workers_arg "${WORKERS:-}") --app-subnet 10.$((NET + 1)).0.0 2>"$state/daemon.log" &
daemon=$!
for _ in $(seq 200); do "$fs" --state-dir "$state/d" status >/dev/null 2>&1 && break; sleep 0.05; done
all=$CONFIGS
if [[ -n "${FS_OLD:-}" ]]; then
  # shellcheck disable=SC2046
  "$FS_OLD" daemon --state-dir "$state/d0" $(workers_arg "${WORKERS_OLD:-}") --app-subnet 10.$((NET + 2)).0.0 2>"$state/daemon0.log" &
  daemon0=$!
  for _ in $(seq 200); do "$FS_OLD" --state-dir "$state/d0" status >/dev/null 2>&1 && break; sleep 0.05; done
  all=$(for c in $CONFIGS; do printf '%s %s0 ' "$c" "$c"; done)
fi
# The daemon of a configuration (X0: the old one), its binary and state.
pid_of() { if [[ $1 == *0 ]]; then echo "$daemon0"; else echo "$daemon"; fi; }

# The stack of a configuration.
[[ -f stacks/app-terminate.toml ]] && sed 's/backend = "smoltcp"/backend = "kernel"/' stacks/app-terminate.toml > "$state/kernel.toml"
stack() {
  local own="STACK_$1"
  [[ -n "${!own:-}" ]] && { echo "${!own}"; return; }
  case ${1%0} in
    a) echo stacks/app-default.toml ;;
    b) echo "$state/kernel.toml" ;;
    c) echo stacks/app-terminate.toml ;;
  esac
}
run() { # $1 = configuration, then the command
  local c=$1; shift
  if [[ $c == *0 ]]; then
    "$FS_OLD" --state-dir "$state/d0" run --stack "$(stack "$c")" -- "$@"
  else
    "$fs" --state-dir "$state/d" run --stack "$(stack "$c")" -- "$@"
  fi
}

tput() {
  if [[ -n "${PERF_TPUT:-}" ]]; then # PERF_TPUT=file: a profile of the daemon during the TCP stream
    (sleep 1; perf record -q -g -o "$PERF_TPUT.$1" -p "$(pid_of "$1")" -- sleep $((SECS - 2)) 2>/dev/null) &
  fi
  run "$1" iperf3 -c $srv -p 5201 -t "$SECS" -J | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'
  wait
}
cps() {
  if [[ -n "${PERF_CPS:-}" ]]; then # PERF_CPS=file: a profile of the daemon while wrk opens connections
    (sleep 1; perf record -q -g -o "$PERF_CPS.$1" -p "$(pid_of "$1")" -- sleep $((SECS - 2)) 2>/dev/null) &
  fi
  run "$1" wrk -t1 -c8 -d"${SECS}s" -H "Connection: close" "http://$srv:8080/small" | awk '/Requests\/sec/ {print $2}'
  wait
}
rtt() { run "$1" "$state/tcp_rr" rr $srv 7 "$RR_N" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p'; }

declare -A results
for r in $(seq "$RUNS"); do
  for c in $all; do
    echo "bench-flows: round $r/$RUNS, configuration $c" >&2
    results[tput_$c]+="$(tput "$c") "
    results[cps_$c]+="$(cps "$c") "
    results[rtt_$c]+="$(rtt "$c") "
  done
done
med() { tr ' ' '\n' <<<"${results[$1]}" | grep . | median; }

idle() { # $1 = configuration; prints "RSS_MiB CPU_percent"
  local c=$1 out=$state/hold.out pid
  pid=$(pid_of "$1")
  run "$c" sh -c "exec $state/tcp_rr hold $srv 7 $IDLE $((IDLE_SETTLE + IDLE_SECS + 5))" > "$out" &
  local holder=$!
  for _ in $(seq 1200); do grep -q held "$out" 2>/dev/null && break; sleep 0.1; done
  grep -q held "$out" || {
    echo "bench-flows: $c: the $IDLE connections were not all opened: $(tail -2 "$out" | tr '\n' ' ')" >&2
    echo "bench-flows: the daemon's log ends:" >&2
    tail -5 "$state/daemon${c//[abc]/}.log" >&2
    kill "$holder" 2>/dev/null || true
    wait "$holder" 2>/dev/null || true
    echo "- -"
    return
  }
  sleep "$IDLE_SETTLE"
  local t0 t1 rss
  t0=$(awk '{print $14 + $15}' /proc/$pid/stat)
  if [[ -n "${PERF:-}" ]]; then # PERF=file: a profile of the daemon while the connections are idle
    perf record -q -g -o "$PERF.$c" -p "$pid" -- sleep "$IDLE_SECS" 2>/dev/null
  else
    sleep "$IDLE_SECS"
  fi
  t1=$(awk '{print $14 + $15}' /proc/$pid/stat)
  rss=$(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' /proc/$pid/status)
  [[ -n "${IDLE_SMAPS:-}" ]] && cp /proc/$pid/smaps "$IDLE_SMAPS.$c"
  echo "$rss $(awk -v a="$t0" -v b="$t1" -v s="$IDLE_SECS" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.1f", (b - a) / hz / s * 100}')"
  wait "$holder" || true
}

echo
echo "flow termination, medians of $RUNS (iperf3 ${SECS}s; wrk ${SECS}s, Connection: close; $RR_N round trips)"
printf '%-28s %10s %10s %10s\n' configuration "Gbit/s" "conn/s" "RTT us"
for c in $all; do
  case ${c%0} in a) name="(a) forwarding" ;; b) name="(b) terminate, kernel" ;; c) name="(c) terminate, smoltcp" ;; esac
  [[ $c == *0 ]] && name="$name, old"
  printf '%-28s %10.2f %10.0f %10.1f\n' "$name" "$(med tput_$c)" "$(med cps_$c)" "$(med rtt_$c)"
done
if [[ " $CONFIGS " == *" a "* ]]; then
  for c in $all; do
    [[ ${c%0} == a ]] && continue
    a=a
    [[ $c == *0 ]] && a=a0
    awk -v c=$c -v a=$a -v t="$(med tput_$c)" -v at="$(med tput_$a)" -v p="$(med cps_$c)" -v ap="$(med cps_$a)" \
      -v r="$(med rtt_$c)" -v ar="$(med rtt_$a)" \
      'BEGIN {printf "(%s)/(%s): throughput %.2f, connections/s %.2f, added RTT %+.1f us\n", c, a, t/at, p/ap, r-ar}'
  done
fi
for c in $all; do
  [[ ${c%0} == a || $IDLE == 0 ]] && continue
  read -r rss cpu < <(idle "$c")
  echo "($c) $IDLE idle terminated connections: daemon RSS $rss MiB, daemon CPU $cpu % over ${IDLE_SECS}s (from ${IDLE_SETTLE}s after they opened)"
done
echo "code version: ${FS:-$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)}${FS_OLD:+; old (X0): $FS_OLD}\
${WORKERS:+; workers $WORKERS}${WORKERS_OLD:+; old (X0) workers $WORKERS_OLD}"

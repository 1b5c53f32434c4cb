#!/usr/bin/env bash
# Emulator benchmark (issue 4): the emulator's own cost, and the highest rate it emulates faithfully. Needs root,
# iperf3, ping, python3 and bc. Everything runs in one invocation, so the figures compare like with like.
#
# The emulated link is built as the lab builds it: h1 and h2 are each joined by a veth pair to the host; a flexstack
# daemon (release build) owns the host ends with `packet` faces (take_over = false) and bridges them through one
# `emulator` per direction (a -> e_ab -> b, b -> e_ba -> a). The veths keep the kernel's offloads (TSO/GSO): the
# faces carry GSO super-frames whole (MetaKey::GSO) and the emulator charges its rate per on-wire segment.
#
# Part 1, cost: iperf3 TCP h1 -> h2, SECS seconds, RUNS rounds, each of one run (a) over a plain veth pair between
# h1 and h2 (the reference, kernel defaults) and then one run (b) over the emulated link with no impairment (all
# knobs at their defaults); both paths stay up, so the runs alternate and meet the same load. Printed: both medians,
# the ratio of the medians (b)/(a) (issue target >= 0.7) and the median of the per-round ratios; also how busy the
# whole machine was during each path's runs and its busy CPU time per GB received (from /proc/stat), which tells
# whether the throughput was bound by CPU time.
#
# Part 2, the highest rate emulated faithfully. Method, on the same emulated link:
#   1. Path RTT: the median RTT of PINGS pings h1 -> h2 (interval 10 ms), no delay, no rate, no load (the median:
#      one ping delayed by another program on the machine should not move the reference).
#   2. For each R in RATES (Mbit/s): both emulators get delay_ms = DELAY and rate_mbit = R (queue_packets at its
#      default, 1000). iperf3 TCP h1 -> h2 runs for SECS + 2 s, its sender paced to 90 % of R (--fq-rate, TCP's
#      own pacing; PACE_PCT changes the 90); after 1 s of ramp-up, PINGS pings h1 -> h2 at 10 ms intervals
#      measure the mean RTT under that load.
#      Around the pings the script reads both emulators' wire_wait_ns_s_total: its increase over the elapsed time
#      is W, the mean time a packet arriving at a random moment waits for the wire in the emulator's model (the
#      expected queueing; pings are sent independently of the queue's state, so they meet that mean).
#   3. Expected RTT = path RTT + 2 * DELAY + W(e_ab) + W(e_ba) + the ping's own serialization at R in both
#      directions (98 bytes on the wire each way). Delay error = mean RTT under load - expected RTT: the delay the
#      emulator added that its model did not (frames waiting in socket buffers before it sees them, late releases,
#      write delays), or took away.
#      Also printed: "late", the mean over the frames both emulators released in the ping window of how late
#      the data plane called them after a frame's release time (late_ns_total / delivered_total), one part of the
#      error.
#   4. Each R is measured RUNS times; the median error is reported with the median iperf3 throughput. R is
#      emulated faithfully when |median error| < 1 ms, no ping was lost and iperf3 carried at least 95 % of the
#      offered 90 % of R. The answer is the highest such R (the steps are not required to be contiguous).
#
# REALTIME=N runs the daemon's data plane at SCHED_FIFO priority N (default 10, as the lab's daemons; 0: the
# normal policy, to compare).
# DAEMON_ARGS="..." adds arguments to the daemon's command line (e.g. "--rx-hold-us 0" to compare without the
# data plane's moderation of wake-ups).
# PERF_OUT=FILE records a perf profile (perf record -g) of the daemon during part 1 (b) into FILE.
# PARTS="1" runs part 1 only (PARTS="1 2" by default). The machine's load average is printed before and after:
# these machines are shared, and a busy neighbour moves both figures (compare the ratio, measured in one run).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
REALTIME=${REALTIME:-10}   # the daemon's --realtime, as the lab starts its daemons (0: the normal policy)
SECS=${SECS:-5}
PINGS=${PINGS:-200}
DELAY=${DELAY:-10}
RATES=${RATES:-100 500 1000 2000 4000 6000 8000}
PARTS=${PARTS:-1 2}
. scripts/lib/bench.sh   # median, bench_setup
# NO_BUILD=1: use target/release/flexstack as it is; FS=PATH: benchmark another build (NO_BUILD implied).
bench_setup bench-emulator "namespaces, veth, AF_PACKET" iperf3 ping python3 bc
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
# TCP may grow its windows to 64 MB in both namespaces, so that the window does not cap the load of part 2 below
# 2 * DELAY * R (the default 6 MB limit held a 20 ms RTT to about 1.2 Gbit/s).
for ns in "$h1" "$h2"; do
  ip netns exec "$ns" sysctl -qw net.ipv4.tcp_rmem="4096 131072 67108864" net.ipv4.tcp_wmem="4096 16384 67108864"
done

gbps() { python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'; }
retransmits() { python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_sent"].get("retransmits", 0))'; }
cpu_now() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
one_run() { # $1 = server address, $2 = a tag; one iperf3 run to the server on port 5299 of h2: prints its Gbit/s;
  # its TCP retransmits go to $state/$2.retransmits; how busy the whole machine was during the run (fraction of
  # all its cores, from /proc/stat) and its busy CPU time per GB received go to $state/$2.cpu
  local busy0 total0 busy1 total1
  read -r busy0 total0 < <(cpu_now)
  ip netns exec "$h1" iperf3 -c "$1" -p 5299 -t "$SECS" -J >"$state/run.json"
  read -r busy1 total1 < <(cpu_now)
  gbps <"$state/run.json"
  retransmits <"$state/run.json" >>"$state/$2.retransmits"
  python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bytes"])' <"$state/run.json" |
    awk -v b=$((busy1 - busy0)) -v t=$((total1 - total0)) -v hz="$(getconf CLK_TCK)" \
      '{printf "%.3f %.1f\n", b / t, b * 1000 / hz / ($1 / 1e9)}' >>"$state/$2.cpu"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# (a) a plain veth pair (kept up during the whole part 1: its runs alternate with the emulated link's).
ip link add ${tag}v type veth peer name ${tag}w
ip link set ${tag}v netns "$h1"; ip link set ${tag}w netns "$h2"
ip -n "$h1" addr add 10.203.5.1/24 dev ${tag}v; ip -n "$h1" link set ${tag}v up
ip -n "$h2" addr add 10.203.5.2/24 dev ${tag}w; ip -n "$h2" link set ${tag}w up

# (b) the emulated link.
for side in a:1:"$h1" b:2:"$h2"; do
  IFS=: read -r x n ns <<<"$side"
  ip link add ${tag}$x type veth peer name ${tag}p$n
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
FLEXSTACK_LOG=warn "$fs" daemon --stack "$state/link.toml" --state-dir "$state/d" --realtime "$REALTIME" ${DAEMON_ARGS:-} \
  2>"$state/daemon.log" &
daemon=$!
fsc() { "$fs" --state-dir "$state/d" "$@"; }
wait_for 'fsc status >/dev/null 2>&1' "the daemon did not start (see its log)"
ip netns exec "$h1" ping -c 1 -W 2 10.204.5.2 >/dev/null || { cat "$state/daemon.log" >&2; exit 1; }
perf_pid=
if [[ -n ${PERF_OUT:-} ]]; then
  perf record -q -g -o "$PERF_OUT" -p "$daemon" 2>/dev/null &
  perf_pid=$!
fi
cpu_ticks() { awk '{print $14 + $15}' "/proc/$daemon/task/"*/stat | paste -sd+ | bc; }
# Rounds alternate the two paths (veth first, then the emulated link), so that both meet the same load on this
# shared machine; the daemon's CPU time is summed over the emulated runs only.
ip netns exec "$h2" iperf3 -s -D -p 5299 -I "$state/iperf.pid" >/dev/null
sleep 0.3
ticks=0
: >"$state/veth.runs"; : >"$state/emu.runs"; : >"$state/ratios"; : >"$state/veth.cpu"; : >"$state/emu.cpu"
for _ in $(seq "$RUNS"); do
  v=$(one_run 10.203.5.2 veth)
  t0=$(cpu_ticks)
  e=$(one_run 10.204.5.2 emu)
  t1=$(cpu_ticks)
  ticks=$((ticks + t1 - t0))
  echo "$v" >>"$state/veth.runs"; echo "$e" >>"$state/emu.runs"
  echo "$e / $v" | bc -l >>"$state/ratios"
done
kill "$(cat "$state/iperf.pid")" 2>/dev/null || true
sleep 0.3
veth=$(median <"$state/veth.runs")
emu=$(median <"$state/emu.runs")
round_ratio=$(median <"$state/ratios")
if [[ -n "$perf_pid" ]]; then kill -INT "$perf_pid"; wait "$perf_pid" || true; fi
frames=$(fsc get module.e_ab.frames_total | awk '$1 == "module.e_ab.frames_total" {print $2}')
wire=$(fsc get module.e_ab.wire_packets_total | awk '$1 == "module.e_ab.wire_packets_total" {print $2}')
drops=$(fsc get 'module.*.drop_*' 'module.*.tx_errors_total' | awk 'NR > 1 && $2 != 0' || true)

printf 'emulator cost: iperf3 TCP h1 -> h2, median of %s runs of %s s (Gbit/s); the daemon'"'"'s data plane: %s\n' \
  "$RUNS" "$SECS" "$("$fs" --json --state-dir "$state/d" status | python3 -c 'import json,sys; print(json.load(sys.stdin)["dataplane_scheduling"])')"
printf '  plain veth (reference)                      %6.2f\n' "$veth"
printf '  flexstack emulated link, no impairment      %6.2f   ratio to veth %.2f (target >= 0.7)\n' \
  "$emu" "$(echo "$emu / $veth" | bc -l)"
printf '  median of the per-round ratios (emulated / veth, runs alternating): %.2f (rounds: %s)\n' "$round_ratio" \
  "$(awk '{printf "%.2f ", $1}' "$state/ratios")"
printf '  (e_ab: %s frames carried %s on-wire packets, %.1f per frame)\n' "$frames" "$wire" \
  "$(echo "$wire / $frames" | bc -l)"
[[ -n "$drops" ]] && printf 'non-zero drop/error meters on the emulated link:\n%s\n' "$drops"
per_call() { # frames per call of module $1: how many frames one read of the face before it brought, on average
  fsc get "module.$1.frames_in_total" "module.$1.calls_total" |
    awk '$1 ~ /frames_in/ {f = $2} $1 ~ /calls/ {c = $2} END {printf "%.1f", c ? f / c : 0}'
}
carried=$(fsc get 'module.e_*.bytes_delivered_total' | awk '$1 ~ /bytes_delivered/ {b += $2} END {printf "%.0f", b}')
# The daemon's CPU time (user + system, all threads) per GB the emulators delivered: the emulated link's own cost
# per byte, less sensitive to a busy machine than the throughput.
printf '  (daemon CPU: %.2f s for %.1f GB carried, %.1f ms per GB)\n' "$(echo "$ticks / $(getconf CLK_TCK)" | bc -l)" \
  "$(echo "$carried / 1000000000" | bc -l)" "$(echo "$ticks * 1000 / $(getconf CLK_TCK) / ($carried / 1000000000)" | bc -l)"
printf '  (frames per call: e_ab %s, e_ba %s)\n' "$(per_call e_ab)" "$(per_call e_ba)"
printf '  (TCP retransmits per run: veth %s; emulated %s)\n' "$(paste -sd' ' "$state/veth.retransmits")" \
  "$(paste -sd' ' "$state/emu.retransmits")"
# Whole-machine CPU: when both paths keep every core busy, throughput is bound by CPU time per byte, and the ratio
# of the throughputs is the ratio of the machine's CPU time per GB (other programs on the machine count in both).
cpu_fig() { # $1 = tag: median busy fraction, median busy CPU ms per GB
  printf '%.0f %% busy, %.0f ms CPU per GB' "$(awk '{print 100 * $1}' "$state/$1.cpu" | median)" \
    "$(awk '{print $2}' "$state/$1.cpu" | median)"
}
printf '  (machine, %s cores, medians per run: veth %s; emulated %s)\n' "$(nproc)" "$(cpu_fig veth)" "$(cpu_fig emu)"
printf '  (load average before: %s; after: %s)\n' "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)"
[[ " $PARTS " == *" 2 "* ]] || exit 0

# Part 2.
snap() { # prints the sums over both emulators of wire_wait_ns_s_total, late_ns_total and delivered_total
  fsc get 'module.e_*.wire_wait_ns_s_total' 'module.e_*.late_ns_total' 'module.e_*.delivered_total' |
    awk '$1 ~ /wire_wait/ {w += $2} $1 ~ /late_ns/ {l += $2} $1 ~ /delivered/ {d += $2}
         END {printf "%.0f %.0f %.0f\n", w, l, d}'
}
set_both() { for e in e_ab e_ba; do fsc set "module.$e.$1" "$2" >/dev/null; done; }
pings() { # prints the mean RTT in ms, the median, then the number of replies
  ip netns exec "$h1" ping -n -c "$PINGS" -i 0.01 -W 2 10.204.5.2 |
    awk -F'time=' 'NF == 2 {split($2, t, " "); print t[1]}' | sort -g |
    awk '{a[NR] = $1; s += $1} END {if (NR == 0) {print "nan"; print "nan"; print 0; exit}
         print s / NR; print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2; print NR}'
}
read -r -d '' base_out < <(pings) || true
base=$(sed -n 2p <<<"$base_out")
ip netns exec "$h2" iperf3 -s -D -p 5298 -I "$state/iperf2.pid" >/dev/null
sleep 0.3
set_both delay_ms "$DELAY"
printf '\nhighest rate emulated faithfully: delay %s ms each way, load iperf3 TCP paced to 90 %% of R, %s pings per run,\n' \
  "$DELAY" "$PINGS"
printf 'path RTT %.3f ms; median of %s runs per R\n' "$base" "$RUNS"
printf '  %8s %9s %9s %7s %9s %8s %5s %10s  %s\n' "R Mbit/s" "RTT ms" "expect ms" "W ms" "error ms" "late ms" \
  "lost" "iperf Mb/s" "faithful"
best=none
for r in $RATES; do
  set_both rate_mbit "$r"
  errs=() tputs=() lines=()
  lost_total=0
  for _ in $(seq "$RUNS"); do
    pace=$(echo "$r * ${PACE_PCT:-90} / 100" | bc)
    ip netns exec "$h1" iperf3 -c 10.204.5.2 -p 5298 -t $((SECS + 2)) --fq-rate "${pace}M" -J >"$state/load.json" &
    load=$!
    sleep 1
    read -r w0 l0 d0 < <(snap); t0=$(date +%s.%N)
    read -r -d '' out < <(pings) || true
    read -r w1 l1 d1 < <(snap); t1=$(date +%s.%N)
    wait "$load" || true
    rtt=$(sed -n 1p <<<"$out"); rx=$(sed -n 3p <<<"$out")
    lost_total=$((lost_total + PINGS - rx))
    # W in ms: (ns * s) / s / 1e6; the ping's serialization: 98 bytes * 8 / (R * 1e6) s, both ways, in ms.
    w=$(echo "($w1 - $w0) / ($t1 - $t0) / 1000000" | bc -l)
    expect=$(echo "$base + 2 * $DELAY + $w + 2 * 98 * 8 / ($r * 1000)" | bc -l)
    errs+=("$(echo "$rtt - $expect" | bc -l)")
    tputs+=("$(gbps <"$state/load.json" | awk '{print $1 * 1000}')")
    late=$(echo "($l1 - $l0) / ($d1 - $d0) / 1000000" | bc -l)
    lines+=("$rtt $expect $w $late")
  done
  err=$(printf '%s\n' "${errs[@]}" | median)
  tput=$(printf '%s\n' "${tputs[@]}" | median)
  rtt=$(printf '%s\n' "${lines[@]}" | awk '{print $1}' | median)
  expect=$(printf '%s\n' "${lines[@]}" | awk '{print $2}' | median)
  w=$(printf '%s\n' "${lines[@]}" | awk '{print $3}' | median)
  late=$(printf '%s\n' "${lines[@]}" | awk '{print $4}' | median)
  ok=$(echo "e = $err; if (e < 0) e = -e; e < 1 && $tput >= 0.95 * 0.9 * $r && $lost_total == 0" | bc -l)
  verdict=no; [[ $ok == 1 ]] && { verdict=yes; best=$r; }
  printf '  %8s %9.3f %9.3f %7.3f %9.3f %8.3f %5s %10.1f  %-3s  (errors: %s)\n' "$r" "$rtt" "$expect" "$w" "$err" \
    "$late" "$lost_total" "$tput" "$verdict" "$(printf '%.3f ' "${errs[@]}")"
done
kill "$(cat "$state/iperf2.pid")" 2>/dev/null || true
printf 'highest R emulated faithfully (|delay error| < 1 ms, no ping lost, load carried): %s Mbit/s\n' "$best"
exit 0

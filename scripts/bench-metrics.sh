#!/usr/bin/env bash
# Metrics benchmark (issue 17). One daemon with `--metrics` (and `--metrics-flows 50`) holding ~200 modules (a
# stack of 194 counters and a source chain, plus each sandboxed app's chain) and 10,000 flows (a sandboxed app sends
# one UDP datagram to each of 10,000 ports of a server in a namespace of ours, then stays):
#   (a) the time of one scrape of /metrics (curl's time_total, and the daemon's own flexstack_metrics_collect_seconds),
#       median of SCRAPES; target <= 100 ms;
#   (b) iperf3 TCP throughput of a sandboxed app (`flexstack run -- iperf3 -c SERVER`) to the server, without and
#       with a scrape every second, alternating, RUNS rounds of SECS seconds; medians and their ratio.
# Needs root. PROFILE (default release) is the cargo profile built and run (PROFILE=ci reuses the test build).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SECS=${SECS:-5}
SCRAPES=${SCRAPES:-9}
FLOWS=${FLOWS:-10000}
. scripts/lib/bench.sh # median, bench_setup
bench_setup bench-metrics "namespaces, TUN devices" iperf3 curl python3
tag=fsm$$
state=$(mktemp -d)
chmod 755 "$state"
cleanup() {
  [[ -n "${scraper:-}" ]] && kill "$scraper" 2>/dev/null || true
  [[ -n "${flows_app:-}" ]] && kill "$flows_app" 2>/dev/null || true
  [[ -n "${daemon:-}" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  server_ns_cleanup
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

# The server namespace: a veth to the host, iperf3.
server_ns 214
srv=10.214.7.2
ip netns exec ${tag}s iperf3 -s -D -p 5201 -I "$state/iperf.pid" >/dev/null

# 194 counters and a source chain: with the apps' chains, more than 200 modules.
{
  echo 'links = ["src -> count", "count -> sink"]'
  printf '[modules.src]\nkind = "source"\nrate = 1000\n[modules.count]\nkind = "counter"\n[modules.sink]\nkind = "sink"\n'
  for i in $(seq 194); do printf '[modules.x%d]\nkind = "counter"\n' "$i"; done
} > "$state/stack.toml"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$fs" daemon --stack "$state/stack.toml" --state-dir "$state/d" --app-subnet 10.215.0.0 \
  --metrics 127.0.0.1:$port --metrics-flows 50 2>"$state/daemon.log" &
daemon=$!
wait_for '"$fs" --state-dir "$state/d" status >/dev/null 2>&1' "the daemon did not start (see its log)"

# The app holding the flows: one datagram to each of FLOWS ports, paced, then it stays (its flows with it).
"$fs" --state-dir "$state/d" run --name flows -- python3 -c "
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range($FLOWS):
    s.sendto(b'x', ('$srv', 20000 + i))
    if i % 50 == 0: time.sleep(0.005)
time.sleep(100000)" &
flows_app=$!
held=0
for _ in $(seq 600); do
  held=$(curl -s 127.0.0.1:$port/metrics | awk '$1 == "flexstack_metrics_flows" {print int($2)}')
  [[ "${held:-0}" -ge $FLOWS ]] && break
  sleep 0.1
done
modules=$("$fs" --state-dir "$state/d" -j module list | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')
echo "bench-metrics: $modules modules, ${held:-0} flows" >&2

# (a) one scrape
: > "$state/scrape"; : > "$state/collect"
for _ in $(seq "$SCRAPES"); do
  curl -s -o "$state/body" -w '%{time_total}\n' -H 'Accept: application/openmetrics-text' 127.0.0.1:$port/metrics >> "$state/scrape"
  awk '$1 == "flexstack_metrics_collect_seconds" {print $2}' "$state/body" >> "$state/collect"
done
bytes=$(wc -c < "$state/body")
series=$(grep -vc '^#' "$state/body")
scrape_ms=$(median < "$state/scrape" | awk '{printf "%.1f", $1 * 1000}')
collect_ms=$(median < "$state/collect" | awk '{printf "%.1f", $1 * 1000}')
echo "bench-metrics: (a) scrape median ${scrape_ms} ms (collect ${collect_ms} ms): $(sort -g "$state/scrape" | tr '\n' ' ')" >&2

# (b) throughput without and with a scrape every second, alternating
# A run right after another may find the previous app's TUN device not yet gone ("Device or resource busy"): retry.
iperf_run() {
  for _ in 1 2 3; do
    if "$fs" --state-dir "$state/d" run -- iperf3 -c $srv -p 5201 -t "$SECS" -J > "$state/iperf.json" 2>>"$state/run.err"; then
      python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)' < "$state/iperf.json"
      return
    fi
    sleep 1
  done
  echo "bench-metrics: iperf3 through flexstack run failed 3 times: $(tail -n2 "$state/run.err")" >&2
  return 1
}
: > "$state/plain"; : > "$state/scraped"
for r in $(seq "$RUNS"); do
  iperf_run >> "$state/plain"
  ( while :; do curl -s -o /dev/null 127.0.0.1:$port/metrics; sleep 1; done ) &
  scraper=$!
  iperf_run >> "$state/scraped"
  kill $scraper; wait $scraper 2>/dev/null || true; scraper=
  echo "bench-metrics: round $r: $(tail -n1 "$state/plain") / $(tail -n1 "$state/scraped") Gbit/s" >&2
done
plain=$(median < "$state/plain")
scraped=$(median < "$state/scraped")
ratio=$(awk -v a="$scraped" -v b="$plain" 'BEGIN {printf "%.3f", a / b}')
spread() { sort -g | awk '{a[NR]=$1} END {printf "%.2f-%.2f", a[1], a[NR]}'; }

echo "version: $(git describe --always --dirty 2>/dev/null || echo unknown), profile $PROFILE"
echo "(a) scrape of /metrics, $modules modules, ${held} flows (top 50 exported), $series samples, $bytes bytes:"
echo "    median of $SCRAPES: ${scrape_ms} ms (curl time_total), ${collect_ms} ms reading the registry (target <= 100 ms)"
echo "(b) iperf3 TCP through a sandboxed app, $RUNS alternating rounds of $SECS s:"
echo "    no scraping:        $plain Gbit/s (range $(spread < "$state/plain"))"
echo "    scraping every 1 s: $scraped Gbit/s (range $(spread < "$state/scraped"))"
echo "    ratio: $ratio"

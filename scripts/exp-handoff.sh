#!/usr/bin/env bash
# Experiment 4 of issue 14 (docs/peers.md "Several uplinks", docs/experiments/handoff.md): handoff between two
# uplinks with different addresses. Daemon A (host) and daemon B (namespace) are joined by two veth links, 10.N.1.0/24
# and 10.N.3.0/24; A routes by source address (the second uplink's address through table T, as a multi-homed host
# does). A server behind B sends a TCP stream at a steady RATE (bytes/s, in 10 ms slices) to an app on A, carried
# by a carrier with `uplinks` = both of A's addresses; CUT s into the stream A's end of the first link is set down,
# and the carrier moves (quic: connection migration; udp, udpplus: re-binding; tcp: its session resumed on a new
# connection from the second uplink). The app counts the bytes it receives
# per 10 ms and checks them (sha256, length). Per carrier kind: bytes lost to the app, the longest time without
# delivery around the cut, and the carrier's meters (migrations_total, migration_gap_us).
#
#   sudo scripts/exp-handoff.sh              # KINDS="quic udp udpplus tcp" SECS=10 CUT=4 RATE=4000000
#
# Writes docs/experiments/handoff-rx.csv (kind, ms, bytes per 10 ms), handoff-cuts.csv (kind, ms of the cut,
# migration_gap_us), handoff-rx.svg (bytes per 10 ms around the cut, a panel per kind) and prints the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench.sh
bench_setup exp-handoff.sh "namespaces, veth links, policy routing and a sandboxed app" python3 ip
KINDS=${KINDS:-quic udp udpplus tcp} SECS=${SECS:-10} CUT=${CUT:-4} RATE=${RATE:-4000000}
OUT=${OUT:-docs/experiments}
tag=fsxh$$
net=78
table=$((30000 + $$ % 20000))
state=$(mktemp -d /tmp/fs-exp-handoff.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  peer_topology_cleanup $net
  wait 2>/dev/null || true
  ip rule del from 10.$net.3.1 table $table 2>/dev/null || true
  ip route flush table $table 2>/dev/null || true
  ip route del unreachable 10.$net.1.0/24 metric 9999 2>/dev/null || true
  ip route del unreachable 10.$net.2.0/24 metric 9999 2>/dev/null || true
  ip link del ${tag}g 2>/dev/null || true
  rm -rf "$state"
}
trap cleanup EXIT

peer_topology $net
# The second uplink: host ${tag}g 10.N.3.1 <-> B's ${tag}u 10.N.3.2; what leaves from 10.N.3.1 goes through it.
ip link add ${tag}g type veth peer name ${tag}u
ip link set ${tag}u netns ${tag}b
ip addr add 10.$net.3.1/24 dev ${tag}g; ip link set ${tag}g up
ip -n ${tag}b addr add 10.$net.3.2/24 dev ${tag}u; ip -n ${tag}b link set ${tag}u up
ip rule add from 10.$net.3.1 table $table
ip route add 10.$net.1.2/32 via 10.$net.3.2 dev ${tag}g table $table
ip route add unreachable default table $table
# With the first link down, nothing may leave through the host's default route.
ip route add unreachable 10.$net.1.0/24 metric 9999
ip route add unreachable 10.$net.2.0/24 metric 9999
start_peers $net quic

# The server: per connection, RATE bytes/s of a deterministic pattern for SECS s, in 10 ms slices.
cat >"$state/srv.py" <<PY
import hashlib, socket, threading, time
def pattern(n):
    block = b''.join(hashlib.sha256(b'%d' % i).digest() for i in range(32768))
    return (block * (n // len(block) + 1))[:n]
slice_ = $RATE // 100
data = pattern(slice_ * 100 * $SECS)
def serve(c):
    t0 = time.time()
    for k in range(100 * $SECS):
        c.sendall(data[k * slice_:(k + 1) * slice_])
        time.sleep(max(0, t0 + (k + 1) / 100 - time.time()))
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$srv', 9100))
s.listen(8)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
PY
ip netns exec ${tag}s python3 "$state/srv.py" &
pids+=($!)
# The app: bytes per 10 ms (since its first byte), the total and the sha256, against the pattern's.
cat >"$state/app.py" <<PY
import hashlib, socket, sys, time
n = $RATE // 100 * 100 * $SECS
block = b''.join(hashlib.sha256(b'%d' % i).digest() for i in range(32768))
want = hashlib.sha256((block * (n // len(block) + 1))[:n]).hexdigest()
s = socket.create_connection(('$srv', 9100), timeout=30)
open(sys.argv[1] + '.t0', 'w').write(repr(time.time()))
h, got, bins, t0 = hashlib.sha256(), 0, {}, time.time()
while True:
    b = s.recv(1 << 16)
    if not b:
        break
    h.update(b)
    got += len(b)
    k = int((time.time() - t0) * 100)
    bins[k] = bins.get(k, 0) + len(b)
with open(sys.argv[1], 'w') as f:
    for k in range(max(bins) + 1):
        f.write('%d,%d\n' % (k * 10, bins.get(k, 0)))
print('bytes %d of %d, sha256 %s' % (got, n, 'equal' if h.hexdigest() == want else 'DIFFERENT'))
PY

echo "kind,ms,bytes" >"$state/rx.csv"
: >"$state/summary"
for kind in $KINDS; do
  ip link set ${tag}h up
  start_peer_b $net "$kind"
  ip route replace 10.$net.1.2/32 via 10.$net.3.2 dev ${tag}g table $table
  carrier_stack "$kind" "transport = \"$kind\"" "uplinks = \"10.$net.1.1,10.$net.3.1\""
  meters="module.h$kind-peer.migrations_total module.h$kind-peer.migration_gap_us module.h$kind-peer.uplink_active"
  "$fs" --state-dir "$state/a" run --stack "$state/app-$kind.toml" --name "h$kind" -- \
    sh -c "python3 $state/app.py $state/bins-$kind; $fs --state-dir $state/a -j get $meters" >"$state/out-$kind" 2>&1 &
  app=$!
  for _ in $(seq 100); do [[ -s $state/bins-$kind.t0 ]] && break; sleep 0.05; done
  sleep "$CUT"
  cut_at=$(python3 -c 'import time; print(repr(time.time()))')
  ip link set ${tag}h down
  wait $app || true
  t0=$(cat "$state/bins-$kind.t0")
  python3 - "$kind" "$state" "$t0" "$cut_at" "$RATE" >>"$state/summary" <<'PY'
import json, sys
kind, state, t0, cut, rate = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
out = open(state + '/out-' + kind).read()
line = next((l for l in out.split('\n') if l.startswith('bytes ')), 'no result: ' + out.replace('\n', ' | ')[:300])
try:
    m = json.loads(out[out.index('{'):])
    meters = {k.rsplit('.', 1)[1]: v['value'] for k, v in m.items()}
except ValueError:
    meters = {}
try:
    rows = [tuple(map(int, l.split(','))) for l in open(state + '/bins-' + kind).read().split()]
except OSError:
    rows = []
with open(state + '/rx.csv', 'a') as f:
    for ms, b in rows:
        f.write('%s,%d,%d\n' % (kind, ms, b))
cut_ms = int((cut - t0) * 1000)
with open(state + '/cuts.csv', 'a') as f:
    f.write('%s,%d,%s\n' % (kind, cut_ms, meters.get('migration_gap_us', '')))
def longest_gap(lo, hi):
    # The longest run of empty 10 ms bins that starts in [lo, hi) ms.
    longest, run, start = 0, 0, None
    for ms, b in rows + [(1 << 40, 1)]:
        if b == 0:
            run += 10
            start = ms if start is None else start
            continue
        if start is not None and lo <= start < hi:
            longest = max(longest, run)
        run, start = 0, None
    return longest
longest, before = longest_gap(cut_ms, cut_ms + 1000), longest_gap(cut_ms - 1000, cut_ms)
print('%s: cut at %d ms; %s; longest time without delivery in the 1 s after the cut %d ms (in the 1 s before it, '
      'no cut: %d ms); migrations_total %s, migration_gap_us %s, uplink_active %s'
      % (kind, cut_ms, line, longest, before, meters.get('migrations_total', '?'),
         meters.get('migration_gap_us', '?'), meters.get('uplink_active', '?')))
PY
done

mkdir -p "$OUT"
cp "$state/rx.csv" "$OUT/handoff-rx.csv"
cat "$state/summary"
cp "$state/cuts.csv" "$OUT/handoff-cuts.csv"
python3 - "$OUT" "$state/rx.csv" "$state/cuts.csv" "$RATE" <<'PY'
import sys
out, path, cuts_path, rate = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
series = {}
for l in open(path).read().split('\n')[1:]:
    if l:
        k, ms, b = l.split(',')
        series.setdefault(k, []).append((int(ms), int(b)))
cuts = {l.split(',')[0]: int(l.split(',')[1]) for l in open(cuts_path).read().split('\n') if l}
# One panel per carrier kind: bytes per 10 ms from 1 s before the cut to 2 s after it.
BEFORE, AFTER = 1000, 2000
W, PH, L, TOP = 1000, 150, 80, 30
H = TOP + PH * len(series) + 50
ymax = max((b for s in series.values() for _, b in s), default=1) * 1.15
x = lambda t: L + (W - L - 20) * (t + BEFORE) / (BEFORE + AFTER)
svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
       '<rect width="100%" height="100%" fill="white"/>',
       '<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#d62728" stroke-dasharray="4,3"/>'
       % (x(0), TOP - 10, x(0), TOP + PH * len(series)),
       '<text x="%.1f" y="%d" fill="#d62728">first uplink set down</text>' % (x(0) + 4, TOP - 14)]
for i, (k, s) in enumerate(series.items()):
    top, base = TOP + PH * i, TOP + PH * (i + 1) - 25
    y = lambda v: base - (base - top - 5) * v / ymax
    c0 = cuts.get(k, 0)
    pts = ' '.join('%.1f,%.1f' % (x(t - c0), y(v)) for t, v in s if -BEFORE <= t - c0 <= AFTER)
    svg.append('<polyline fill="none" stroke="#1f77b4" stroke-width="1" points="%s"/>' % pts)
    svg.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="black"/>' % (L, base, W - 20, base))
    svg.append('<line x1="%d" y1="%d" x2="%d" y2="%.1f" stroke="black"/>' % (L, top + 5, L, base))
    svg.append('<text x="%d" y="%d" font-weight="bold">%s</text>' % (L + 6, top + 14, k))
    for v in (0, rate // 100):
        svg.append('<text x="%d" y="%.1f" text-anchor="end">%d</text>' % (L - 6, y(v) + 4, v))
for t in range(-BEFORE, AFTER + 1, 500):
    svg.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x(t), TOP + PH * len(series) - 8, t))
svg.append('<text x="%d" y="%d" text-anchor="middle">ms from the cut; app bytes delivered per 10 ms of a TCP stream of '
           '%d bytes/s, the carrier moving to the second uplink</text>' % (W // 2, H - 20, rate))
svg.append('</svg>')
open(out + '/handoff-rx.svg', 'w').write('\n'.join(svg) + '\n')
PY
echo "exp-handoff.sh: wrote $OUT/handoff-rx.csv, $OUT/handoff-cuts.csv and $OUT/handoff-rx.svg" >&2

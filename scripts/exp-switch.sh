#!/usr/bin/env bash
# Experiment 1 of issue 14 (VirtualStack's Figure 1, docs/peers.md "Switching"): a UDP stream at a high rate from an
# app on daemon A, carried to peer daemon B by a carrier with the transports udp and quic, its carrier switched
# udp <-> quic every PERIOD seconds (`flexstack flow set ID carrier=...`); the receiver behind B counts the
# datagrams per 10 ms. The first move to quic builds its connection (its handshake, `switch_wait_us`); the later
# ones find both warm. Writes docs/experiments/switch-rx.csv (ms, datagrams), switch-events.csv (ms, transport,
# wait us) and switch-rx.svg, and prints the figures: per switch, the datagrams in the 10 ms bins around it and
# the longest gap.
#
#   sudo scripts/exp-switch.sh                 # SECS=32 RATE=5000 (datagrams/s) SIZE=1000 (bytes) PERIOD=5
#
# SIZE: QUIC DATAGRAM frames take about 1,150 bytes of app datagram without path MTU discovery (docs/peers.md), so
# the default is 1,000-byte datagrams rather than VirtualStack's 1,500.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench.sh
bench_setup exp-switch.sh "namespaces, TUN devices and a sandboxed app" python3 ip
SECS=${SECS:-32} RATE=${RATE:-5000} SIZE=${SIZE:-1000} PERIOD=${PERIOD:-5}
OUT=${OUT:-docs/experiments}
tag=fsxs$$
work=$(mktemp -d /tmp/fs-exp-switch.XXXXXX)
net=10.77
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ns_cleanup ${tag}b ${tag}s
  ip link del ${tag}h 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# A (host) -- 10.77.1.0/24 -- B (namespace) -- 10.77.2.0/24 -- the receiver (namespace).
ip netns add ${tag}b; ip -n ${tag}b link set lo up
ip netns add ${tag}s; ip -n ${tag}s link set lo up
ip link add ${tag}h type veth peer name ${tag}x; ip link set ${tag}x netns ${tag}b
ip addr add $net.1.1/24 dev ${tag}h; ip link set ${tag}h up
ip -n ${tag}b addr add $net.1.2/24 dev ${tag}x; ip -n ${tag}b link set ${tag}x up
ip -n ${tag}b link add ${tag}y type veth peer name ${tag}z; ip -n ${tag}b link set ${tag}z netns ${tag}s
ip -n ${tag}b addr add $net.2.1/24 dev ${tag}y; ip -n ${tag}b link set ${tag}y up
ip -n ${tag}s addr add $net.2.2/24 dev ${tag}z; ip -n ${tag}s link set ${tag}z up

carrier='transport = "udp"\ntransports = "quic"'   # sed makes the \n a line break
sed "s|listen = \"0.0.0.0:7300\"|listen = \"$net.1.2:7300\"\n$carrier|" stacks/peer-in.toml >"$work/b.toml"
sed "s|peer = \"gateway\"|peer = \"gateway\"\n$carrier|" stacks/app-peer.toml >"$work/a.toml"
a() { "$fs" --state-dir "$work/a" "$@"; }
b() { ip netns exec ${tag}b "$fs" --state-dir "$work/b" "$@"; }
FLEXSTACK_LOG=warn ip netns exec ${tag}b "$fs" daemon --stack "$work/b.toml" --state-dir "$work/b" >/dev/null &
pids+=($!)
FLEXSTACK_LOG=warn "$fs" daemon --app-subnet 10.213.0.0 --state-dir "$work/a" >/dev/null &
pids+=($!)
for _ in $(seq 100); do a status >/dev/null 2>&1 && b status >/dev/null 2>&1 && break; sleep 0.1; done
a peer add gateway $net.1.2:7300 "$(b peer key)" >/dev/null
b peer add a $net.1.1:0 "$(a peer key)" >/dev/null

# The receiver: datagrams per 10 ms since the first, and its clock's start (to place the switches).
cat >"$work/rx.py" <<PY
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
s.bind(('$net.2.2', 9000))
s.settimeout(3)
bins, t0, seen, dup = {}, None, set(), 0
while True:
    try:
        d = s.recv(65536)
    except socket.timeout:
        if t0 is not None:
            break
        continue
    now = time.time()
    if t0 is None:
        t0 = now
        open('$work/t0', 'w').write(repr(t0))
    n = int(d.split(b' ', 1)[0])
    dup += n in seen
    seen.add(n)
    k = int((now - t0) * 100)
    bins[k] = bins.get(k, 0) + 1
with open('$work/rx.csv', 'w') as f:
    f.write('ms,datagrams\n')
    for k in range(max(bins) + 1):
        f.write('%d,%d\n' % (k * 10, bins.get(k, 0)))
open('$work/rx.sum', 'w').write('%d %d %d' % (len(seen), dup, max(seen) + 1 if seen else 0))
PY
ip netns exec ${tag}s python3 "$work/rx.py" &
rx=$!
pids+=($rx)
sleep 0.5

# The sender, in the sandbox: RATE datagrams a second of SIZE bytes, numbered, paced per millisecond.
cat >"$work/tx.py" <<PY
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
pad = b'x' * $SIZE
t0, i, n = time.time(), 0, $SECS * $RATE
while i < n:
    due = int((time.time() - t0) * $RATE) + 1
    while i < min(due, n):
        s.sendto((b'%d ' % i + pad)[:$SIZE], ('$net.2.2', 9000))
        i += 1
    time.sleep(0.0005)
PY
a run --stack "$work/a.toml" --name xsw -- python3 "$work/tx.py" &
app=$!
pids+=($app)

# The switcher: finds the app's carried UDP flow, then moves it every PERIOD s, udp -> quic -> udp ...
flow=
for _ in $(seq 100); do
  flow=$(a -j flow list | python3 -c 'import json,sys; print(next((f["id"] for f in json.load(sys.stdin) if f["module"] == "xsw-peer" and f["protocol"] == "udp"), ""))')
  [[ -n $flow ]] && break
  sleep 0.1
done
[[ -n $flow ]] || { echo "exp-switch.sh: the app's flow was not carried" >&2; exit 1; }
: >"$work/events"
to=quic
for _ in $(seq $((SECS / PERIOD))); do
  sleep "$PERIOD"
  kill -0 $app 2>/dev/null || break
  t=$(python3 -c 'import time; print(repr(time.time()))')
  a flow set "$flow" carrier=$to >/dev/null
  sleep 0.5
  wait_us=$(a -j get module.xsw-peer.switch_wait_us | python3 -c 'import json,sys; print(json.load(sys.stdin)["module.xsw-peer.switch_wait_us"]["value"])')
  echo "$t $to $wait_us" >>"$work/events"
  if [[ $to == quic ]]; then to=udp; else to=quic; fi
done
wait $app || true
wait $rx || true

mkdir -p "$OUT"
cp "$work/rx.csv" "$OUT/switch-rx.csv"
python3 - "$work" "$OUT" "$RATE" "$SIZE" "$PERIOD" <<'PY'
import sys
work, out, rate, size, period = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t0 = float(open(work + '/t0').read())
rows = [l.split(',') for l in open(work + '/rx.csv').read().split('\n')[1:] if l]
ms = [int(a) for a, _ in rows]
n = [int(b) for _, b in rows]
events = [l.split() for l in open(work + '/events').read().split('\n') if l]
events = [(int((float(t) - t0) * 1000), to, int(w)) for t, to, w in events]
with open(out + '/switch-events.csv', 'w') as f:
    f.write('ms,transport,switch_wait_us\n')
    for e in events:
        f.write('%d,%s,%d\n' % e)
distinct, dup, sent = map(int, open(work + '/rx.sum').read().split())
per_bin = rate / 100
print('datagrams: %d of %d arrived (%.2f %% lost), %d duplicates; %.0f expected per 10 ms' %
      (distinct, sent, 100.0 * (sent - distinct) / max(sent, 1), dup, per_bin))
def around(k):
    # The 10 ms bins from 200 ms before bin k to 500 ms after: the longest run without a datagram, the datagrams,
    # and the bins under half the rate.
    window = n[max(0, k - 20):k + 50]
    gap = longest = 0
    for v in window:
        gap = gap + 10 if v == 0 else 0
        longest = max(longest, gap)
    return longest, sum(window), sum(1 for v in window if v < per_bin / 2)
half = int(float(period) * 50)  # bins in half a period: the baseline windows sit between switches
for i, (at, to, wait) in enumerate(events):
    k = at // 10
    g, got, low = around(k)
    bg, bgot, blow = around(max(20, k - half))
    print('switch %d at %d ms to %s (%s): waited %d us for the transport; -200..+500 ms around it: longest gap '
          '%d ms, %d datagrams, %d bins under half the rate (half a period before, no switch: %d ms, %d, %d)'
          % (i + 1, at, to, 'first' if i == 0 else 'cached', wait, g, got, low, bg, bgot, blow))
# The plot: an SVG of datagrams per 10 ms, the switches marked.
W, H, L, B = 1000, 360, 60, 40
xmax = max(ms) if ms else 1
ymax = max(n + [1]) * 1.1
x = lambda t: L + (W - L - 20) * t / xmax
y = lambda v: H - B - (H - B - 20) * v / ymax
pts = ' '.join('%.1f,%.1f' % (x(t), y(v)) for t, v in zip(ms, n))
svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
       '<rect width="100%" height="100%" fill="white"/>',
       '<polyline fill="none" stroke="#1f77b4" stroke-width="1" points="%s"/>' % pts,
       '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (L, H - B, W - 20, H - B),
       '<line x1="%d" y1="20" x2="%d" y2="%d" stroke="black"/>' % (L, L, H - B)]
for i, (at, to, wait) in enumerate(events):
    svg.append('<line x1="%.1f" y1="20" x2="%.1f" y2="%d" stroke="#d62728" stroke-dasharray="4,3"/>' %
               (x(at), x(at), H - B))
    svg.append('<text x="%.1f" y="16" fill="#d62728">%s%s</text>' % (x(at) + 3, to, ' (built)' if i == 0 else ''))
for s in range(0, xmax + 1, 5000):
    svg.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x(s), H - B + 16, s // 1000))
for v in range(0, int(ymax) + 1, max(1, int(ymax / 5))):
    svg.append('<text x="%d" y="%.1f" text-anchor="end">%d</text>' % (L - 6, y(v) + 4, v))
svg.append('<text x="%d" y="%d" text-anchor="middle">time (s); %d-byte datagrams, %d/s, udp &lt;-&gt; quic every %s s</text>'
           % (W // 2, H - 6, size, rate, period))
svg.append('<text x="14" y="%d" transform="rotate(-90 14 %d)" text-anchor="middle">datagrams per 10 ms</text>'
           % (H // 2, H // 2))
svg.append('</svg>')
open(out + '/switch-rx.svg', 'w').write('\n'.join(svg) + '\n')
PY
echo "exp-switch.sh: wrote $OUT/switch-rx.csv, $OUT/switch-events.csv and $OUT/switch-rx.svg" >&2

#!/usr/bin/env bash
# The slow-link lab of issue 15 (docs/experiments/compress-lab.md): an app on daemon A (`flexstack run`, host
# namespace) downloads from a server behind daemon B over a slow path that a third daemon emulates (namespace
# ${tag}m: two packet faces bridging A's veth to B's, an `emulator` each way: RATE_MBIT, DELAY_MS one way). The app's
# flows are carried to B (stacks/app-peer.toml, the `tcp` carrier) through A's services file (`compress` for the
# server's port); B has the restoring end after its carrier (`compress`, `mode = "decompress"`: it compresses the
# server's bytes going up), which starts out of the path (`active = false`). Halfway through each download a CRAWLER
# rule loaded on B (a `Timer`) sets its `active` to true: compress joins the running flow at a point both ends agree
# on (docs/services.md). Two downloads, one after the other: text (zstd shrinks it several times) and random bytes
# (it does not). The app (python3, in the sandbox) counts the body's bytes per BIN_MS and checks them (sha256 against
# the file's prefix). Writes OUT/compress-lab.csv (ms, text_mbit, random_mbit), OUT/compress-lab-events.csv (the
# insertions, ms from each download's start) and OUT/compress-lab.svg, and prints the mean goodput before and after
# the insertion.
#
#   sudo PROFILE=ci scripts/exp-compress-lab.sh    # SECS=30 RATE_MBIT=10 DELAY_MS=50 BIN_MS=500 LEVEL=3
#
# BUDGET (4 MiB) is each terminated flow's budget at both ends: above what the compressed flow needs in flight (the
# default 256 KiB a round trip of 100 ms would cap the restored bytes near 20 Mbit/s). NO_BUILD=1 / FS=PATH as in
# scripts/lib/bench.sh; KEEP_STATE=1 keeps the daemons' logs. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-30}
RATE_MBIT=${RATE_MBIT:-10}
DELAY_MS=${DELAY_MS:-50}
BIN_MS=${BIN_MS:-500}
LEVEL=${LEVEL:-3}
BUDGET=${BUDGET:-4194304}
OUT=${OUT:-docs/experiments}
NET=${NET:-233} # A-B link 10.NET.1.0/24 (A .1, B .2), B-server 10.NET.2.0/24, apps 10.(NET+1).0.0/16
. scripts/lib/bench.sh # bench_setup, peer_topology, start_peer_b
bench_setup exp-compress-lab "namespaces, veth, TUN devices" python3
tag=fsz$$
peer_bench_state "$NET"

# host (A, 10.NET.1.1) ─ veth ─ [${tag}1 ─ emulators ─ ${tag}2] (namespace m) ─ veth ─ B (10.NET.1.2) ─ veth ─ server.
peer_topology "$NET" bridge
emulator() { printf '[modules.%s]\nkind = "emulator"\ndelay_ms = %s\nrate_mbit = %s\nqueue_packets = 200\n' "$1" \
  "$DELAY_MS" "$RATE_MBIT"; }
{
  echo 'links = ["a -> e_ab", "e_ab -> b", "b -> e_ba", "e_ba -> a"]'
  for x in a:1 b:2; do
    printf '[modules.%s]\nkind = "packet"\ninterface = "%s"\ntake_over = false\n' "${x%%:*}" "${tag}${x##*:}"
  done
  emulator e_ab
  emulator e_ba
} > "$state/path.toml"
ip netns exec ${tag}m "$fs" daemon --stack "$state/path.toml" --state-dir "$state/m" 2>"$state/daemon-m.log" &
pids+=($!)
wait_for '"$fs" --state-dir "$state/m" status >/dev/null 2>&1' "the path's daemon did not start"

# B: stacks/peer-in.toml with `compress` (restoring A's, compressing the server's bytes, out of the path at first)
# between its carrier and `originate`, as `flexstack run --services` chains a service (crates/modules/src/stream/
# services/mod.rs, chain_links), for the flows to port 8081.
links='links = [\n  "peers[stream] -> unzip",\n  "orig[stream] -> unzip",\n  "unzip -> udir",\n  "udir[down] -> orig[stream_in]",\n  "udir[up] -> peers[stream_in]",\n  "peers[pass] -> orig[stream_in]",\n]\n\n[modules.unzip]\nkind = "compress"\nmode = "decompress"\nlevel = '$LEVEL'\nactive = false\nselect = ["use tcp port 8081"]\n\n[modules.udir]\nkind = "direction"\n'
b_sed=(-e '/^links = \[/,/^\]/d' -e "s|^\[modules.peers\]|$links\n[modules.peers]|"
  -e "s|backend = \"kernel\"|backend = \"kernel\"\nbudget = $BUDGET|")
# start_peers, with B's stack edited.
"$fs" daemon --state-dir "$state/a" --app-subnet 10.$((NET + 1)).0.0 2>"$state/daemon-a.log" &
pids+=($!)
wait_for '"$fs" --state-dir "$state/a" status >/dev/null 2>&1' "daemon A did not start"
start_peer_b "$NET" tcp "${b_sed[@]}"
"$fs" --state-dir "$state/a" peer add gateway 10.$NET.1.2:7300 "$("$fs" --state-dir "$state/b" peer key)" >/dev/null
grep -q '"udir\[up\] -> peers\[stream_in\]"' "$state/peer-in.toml" || { echo "exp-compress-lab: B's stack" >&2; exit 1; }
b() { "$fs" --state-dir "$state/b" "$@"; }
sed -e "s|backend = \"smoltcp\"|backend = \"smoltcp\"\nbudget = $BUDGET|" stacks/app-peer.toml > "$state/app.toml"
printf '[[rule]]\nuse = true\ntransport = "tcp"\nport = 8081\n\n[[service]]\nkind = "compress"\nlevel = %s\n' \
  "$LEVEL" > "$state/services.toml"

# The server's files: more than the download can take in SECS at the fastest (text shrinks about 5 times).
mb=$((RATE_MBIT * SECS * 6 / 8 + 8))
mkdir -p "$state/www"
python3 - "$state/www/text" $((mb * 1048576)) <<'PY'
import sys
n, out, i, parts = int(sys.argv[2]), [], 0, 0
with open(sys.argv[1], 'wb') as f:
    while parts < n:
        line = b'line %d: value %x the quick brown fox jumps over the lazy dog\n' % (i, (i * 0x9e3779b97f4a7c15 >> 40) & 0xffffff)
        out.append(line)
        parts += len(line)
        i += 1
        if len(out) == 4096:
            f.write(b''.join(out))
            out = []
    f.write(b''.join(out))
PY
head -c $((RATE_MBIT * SECS * 1048576 / 4 + 8388608)) /dev/urandom > "$state/www/random"
chmod -R a+rX "$state/www"
ip netns exec ${tag}s python3 -m http.server 8081 --bind $srv --directory "$state/www" >/dev/null 2>&1 &
pids+=($!)
wait_for "ip netns exec ${tag}s python3 -c 'import socket; socket.create_connection((\"$srv\", 8081), 1)' 2>/dev/null" \
  "the server did not start"

# The app: GET FILE for SECS seconds; the body's bytes per BIN_MS into $state/FILE.csv, then "start_time bytes sha256".
cat > "$state/fetch.py" <<PY
import hashlib, socket, sys, time
name = sys.argv[1]
s = socket.create_connection(('$srv', 8081))
s.sendall(b'GET /%s HTTP/1.0\r\nHost: $srv\r\n\r\n' % name.encode())
head, body, h, bins = b'', 0, hashlib.sha256(), {}
t0 = time.time()
while time.time() - t0 < $SECS:
    d = s.recv(1 << 16)
    if not d:
        break
    if head is not None:
        head += d
        if b'\r\n\r\n' not in head:
            continue
        head, d = head.split(b'\r\n\r\n', 1)
        assert head.startswith(b'HTTP/1.0 200'), head[:60]
        head = None
    body += len(d)
    h.update(d)
    k = int((time.time() - t0) * 1000 / $BIN_MS)
    bins[k] = bins.get(k, 0) + len(d)
with open('$state/%s.csv' % name, 'w') as f:
    for k in range(int($SECS * 1000 / $BIN_MS)):
        f.write('%d,%d\n' % (k * $BIN_MS, bins.get(k, 0)))
print('%r %d %s' % (t0, body, h.hexdigest()))
PY
# The rule: Timer ticks once a second from its loading; `active` turns true after SECS/2 ticks.
printf 'tick: Timer(1000)\ninsert: set("module.unzip.active", Greater(tick, %d))\n' $((SECS / 2 - 1)) > "$state/insert.rules"

: > "$state/events"
for f in text random; do
  b set module.unzip.active false >/dev/null
  switches0=$(b get module.unzip.switches_total | awk 'NR == 2 {print $2}')
  "$fs" --state-dir "$state/a" run --stack "$state/app.toml" --services "$state/services.toml" --name lab$f \
    -- python3 "$state/fetch.py" $f > "$state/$f.out" &
  app=$!
  b rules load "$state/insert.rules" >/dev/null
  # When the knob turned (polled every 50 ms; the rules engine samples every 5 ms).
  turned=
  while kill -0 $app 2>/dev/null; do
    if [[ -z $turned ]] && b get module.unzip.active | grep -q true; then turned=$(date +%s.%N); fi
    sleep 0.05
  done
  wait $app || { echo "exp-compress-lab: the $f download failed" >&2; exit 1; }
  b rules unload ALL >/dev/null
  read -r t0 bytes sum < "$state/$f.out"
  want=$(head -c "$bytes" "$state/www/$f" | sha256sum | cut -d' ' -f1)
  [[ $sum == "$want" ]] || { echo "exp-compress-lab: the $f download is corrupt ($bytes bytes)" >&2; exit 1; }
  [[ -n $turned ]] || { echo "exp-compress-lab: the rule did not insert compress" >&2; exit 1; }
  switches=$(( $(b get module.unzip.switches_total | awk 'NR == 2 {print $2}') - switches0 ))
  echo "$f $(python3 -c "print(int(($turned - $t0) * 1000))") $bytes $switches" >> "$state/events"
  echo "exp-compress-lab: $f: $bytes bytes intact (sha256 of the file's prefix), compress inserted by the rule" \
    "($switches marks)" >&2
done
bm() { b get "module.unzip.$1" | awk 'NR == 2 {print $2}'; }
echo "exp-compress-lab: B's compress: $(bm plain_bytes_total) bytes packed into $(bm packed_bytes_total)" \
  "in $(bm blocks_total) blocks ($(bm stored_blocks_total) stored as they were)" >&2

mkdir -p "$OUT"
python3 - "$state" "$OUT" "$BIN_MS" "$RATE_MBIT" "$DELAY_MS" <<'PY'
import sys
state, out, bin_ms, rate, delay = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
runs = ['text', 'random']
series = {}
for r in runs:
    rows = [l.split(',') for l in open('%s/%s.csv' % (state, r)).read().split('\n') if l]
    series[r] = [(int(a), int(b) * 8 / (bin_ms / 1000) / 1e6) for a, b in rows]
events = {}
for l in open(state + '/events').read().split('\n'):
    if l:
        name, at, total, marks = l.split()
        events[name] = (int(at), int(total), int(marks))
ms = [t for t, _ in series['text']]
with open(out + '/compress-lab.csv', 'w') as f:
    f.write('ms,text_mbit,random_mbit\n')
    for i, t in enumerate(ms):
        f.write('%d,%.3f,%.3f\n' % (t, series['text'][i][1], series['random'][i][1]))
with open(out + '/compress-lab-events.csv', 'w') as f:
    f.write('download,inserted_ms,bytes,marks\n')
    for r in runs:
        f.write('%s,%d,%d,%d\n' % ((r,) + events[r]))
for r in runs:
    at = events[r][0]
    # Before: the bins from 2 s to the insertion (TCP's start left out); after: from 2 s after it to the end.
    before = [v for t, v in series[r] if 2000 <= t and t + bin_ms <= at]
    after = [v for t, v in series[r] if t >= at + 2000]
    mean = lambda a: sum(a) / len(a) if a else 0
    print('%-6s goodput: %.2f Mbit/s without compress, %.2f Mbit/s with it (x %.2f); inserted at %.1f s; %d bytes'
          % (r, mean(before), mean(after), mean(after) / mean(before) if mean(before) else 0, at / 1000,
             events[r][1]))
W, H, L, B = 1000, 380, 60, 44
xmax = ms[-1] + bin_ms
ymax = max([v for r in runs for _, v in series[r]] + [rate]) * 1.1
x = lambda t: L + (W - L - 20) * t / xmax
y = lambda v: H - B - (H - B - 30) * v / ymax
colors = {'text': '#1f77b4', 'random': '#ff7f0e'}
svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
       '<rect width="100%" height="100%" fill="white"/>',
       '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (L, H - B, W - 20, H - B),
       '<line x1="%d" y1="30" x2="%d" y2="%d" stroke="black"/>' % (L, L, H - B),
       '<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#999" stroke-dasharray="2,3"/>' % (L, y(rate), W - 20, y(rate)),
       '<text x="%d" y="%.1f" fill="#999" text-anchor="end">link rate</text>' % (W - 24, y(rate) - 4)]
for i, r in enumerate(runs):
    pts = ' '.join('%.1f,%.1f' % (x(t + bin_ms / 2), y(v)) for t, v in series[r])
    svg.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (colors[r], pts))
    at = events[r][0]
    svg.append('<line x1="%.1f" y1="30" x2="%.1f" y2="%d" stroke="%s" stroke-dasharray="4,3"/>'
               % (x(at), x(at), H - B, colors[r]))
    svg.append('<text x="%.1f" y="%d" fill="%s">%s: compress inserted</text>' % (x(at) + 4, 42 + 14 * i, colors[r], r))
    svg.append('<text x="%d" y="%d" fill="%s">%s</text>' % (L + 10, 42 + 14 * i, colors[r],
               {'text': 'text (compressible)', 'random': 'random bytes (incompressible)'}[r]))
for s in range(0, xmax + 1, 5000):
    svg.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x(s), H - B + 16, s // 1000))
step = 10 if ymax > 30 else 5
for v in range(0, int(ymax) + 1, step):
    svg.append('<text x="%d" y="%.1f" text-anchor="end">%d</text>' % (L - 6, y(v) + 4, v))
svg.append('<text x="%d" y="%d" text-anchor="middle">time (s); a download over %g Mbit/s, %s ms each way; goodput '
           'per %d ms</text>' % (W // 2, H - 8, rate, delay, bin_ms))
svg.append('<text x="14" y="%d" transform="rotate(-90 14 %d)" text-anchor="middle">goodput (Mbit/s)</text>'
           % (H // 2, H // 2))
svg.append('</svg>')
open(out + '/compress-lab.svg', 'w').write('\n'.join(svg) + '\n')
PY
echo "exp-compress-lab: wrote $OUT/compress-lab.csv, $OUT/compress-lab-events.csv and $OUT/compress-lab.svg" >&2

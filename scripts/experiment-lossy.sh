#!/usr/bin/env bash
# Issue 14, experiment 3: a TCP app over a long lossy path. An app on daemon A (`flexstack run`, host namespace)
# sends with iperf3 (TCP, TIME seconds) to a server behind daemon B, over a path that a third daemon
# (namespace ${tag}m) emulates: two packet faces bridging A's veth to B's, with an `emulator` each way (DELAY_MS one
# way, so the RTT is twice that; RATE_MBIT; Gilbert-Elliott loss with mean LOSS % and mean burst BURST packets, the
# same on both directions, seeded). Paths, alternating for each (loss, seed):
#   (fwd)     end-to-end kernel TCP with cubic (iperf3 -C cubic; Linux's default, though this machine's is bbr): the
#             default app chain, the host routes through B's namespace; (fwdbbr, not in the default PATHS) with bbr;
#   (quic)    terminate on A + the quic carrier with BBR + B's kernel sockets (stacks/app-peer.toml, peer-in.toml);
#   (udpplus) terminate on A + the udpplus carrier with FEC (fec_k FEC_K) and ARQ; not in the default PATHS:
#             (udpplus_nofec) the same without FEC, (udp) the udp carrier.
# A terminated flow moves at most its budget per round trip (docs/streams.md): both ends get BUDGET (4 MiB), above
# the path's bandwidth-delay product (100 Mbit/s x 100 ms = 1.25 MB), where the default 256 KiB caps it near 20 Mbit/s.
# For each LOSSES level and each of SEEDS, the goodput the server received; writes results.csv and, through
# scripts/experiments/lossy_report.py, docs/experiments/lossy-path.md and its SVG into OUT (default
# docs/experiments). PROFILE=ci uses the ci profile's binary; NO_BUILD=1 / FS=PATH as in scripts/lib/bench.sh.
# KEEP_STATE=1 keeps the daemons' logs. Needs root. The whole run: LOSSES x SEEDS x 3 x TIME seconds (4 x 10 x 3 x 10 s: about 25 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
LOSSES=${LOSSES:-0 1 2 5}
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10}
TIME=${TIME:-10}
DELAY_MS=${DELAY_MS:-50}
RATE_MBIT=${RATE_MBIT:-100}
BURST=${BURST:-2}
FEC_K=${FEC_K:-8}
BUDGET=${BUDGET:-4194304} # each terminated flow's budget (bytes in flight per direction), above the path's BDP
PATHS=${PATHS:-fwd quic udpplus}
OUT=${OUT:-docs/experiments}
NET=${NET:-229} # A-B link 10.NET.1.0/24 (A .1, B .2), B-server 10.NET.2.0/24, apps 10.(NET+1).0.0/16
. scripts/lib/bench.sh # bench_setup, peer_topology, start_peers, start_peer_b, carrier_stack
bench_setup experiment-lossy "namespaces, veth, TUN devices" iperf3 python3
tag=fsy$$
peer_bench_state "$NET"
# host (A, 10.NET.1.1) ─ veth ─ [${tag}1 ─ emulators ─ ${tag}2] (namespace m) ─ veth ─ B (10.NET.1.2) ─ veth ─ server.
peer_topology "$NET" bridge

# M: the emulated path.
cat > "$state/path.toml" <<TOML
links = ["a -> e_ab", "e_ab -> b", "b -> e_ba", "e_ba -> a"]
[modules.a]
kind = "packet"
interface = "${tag}1"
take_over = false
[modules.b]
kind = "packet"
interface = "${tag}2"
take_over = false
[modules.e_ab]
kind = "emulator"
delay_ms = $DELAY_MS
rate_mbit = $RATE_MBIT
queue_packets = 2000
[modules.e_ba]
kind = "emulator"
delay_ms = $DELAY_MS
rate_mbit = $RATE_MBIT
queue_packets = 2000
TOML
ip netns exec ${tag}m "$fs" daemon --stack "$state/path.toml" --state-dir "$state/m" 2>"$state/daemon-m.log" &
pids+=($!)
wait_for '"$fs" --state-dir "$state/m" status >/dev/null 2>&1' "the path's daemon did not start"
set_loss() { # $1 = mean loss %, $2 = seed: Gilbert-Elliott, 100 % loss in the bad state, mean burst BURST packets
  local r p
  r=$(echo "1 / $BURST" | bc -l)
  p=$(echo "$1 / 100 * $r / (1 - $1 / 100)" | bc -l)
  local i=0 e
  for e in e_ab e_ba; do
    "$fs" --state-dir "$state/m" set "module.$e.ge_r" "$r" >/dev/null
    "$fs" --state-dir "$state/m" set "module.$e.ge_p" "$p" >/dev/null
    "$fs" --state-dir "$state/m" set "module.$e.seed" $(($2 * 2 + i)) >/dev/null
    i=$((i + 1))
  done
}

# A and B; each terminated flow gets BUDGET at both ends.
budget=(-e "s|backend = \"kernel\"|backend = \"kernel\"\nbudget = $BUDGET|")
start_peers "$NET" quic "${budget[@]}"
app_sed=(-e "s|backend = \"smoltcp\"|backend = \"smoltcp\"\nbudget = $BUDGET|")
carrier_stack quic 'transport = "quic"' "cc = \"${QUIC_CC:-bbr}\""
carrier_stack udpplus 'transport = "udpplus"' 'fec = true' "fec_k = $FEC_K" 'arq = true'
carrier_stack udpplus_nofec 'transport = "udpplus"' 'fec = false' 'arq = true'
carrier_stack udp 'transport = "udp"'

# goodput PATH: what the server received, Mbit/s (0 when the transfer failed, with the reason on stderr).
goodput() {
  local run=("$fs" --state-dir "$state/a" run)
  local cc=()
  case $1 in
    fwd) cc=(-C cubic) ;;
    fwdbbr) cc=(-C bbr) ;;
    *) run+=(--stack "$state/app-$1.toml") ;;
  esac
  timeout $((TIME * 3 + 90)) "${run[@]}" -- iperf3 -c $srv -p 5201 -t "$TIME" "${cc[@]}" -J > "$state/iperf.json" 2>&1 ||
    true
  python3 - "$state/iperf.json" "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
    e = r["end"]["sum_received"]
    print(e["bytes"] * 8 / e["seconds"] / 1e6)
except Exception as err:
    text = open(sys.argv[1]).read()
    reason = r.get("error", text[:300]) if isinstance(locals().get("r"), dict) else text[:300]
    print(f"experiment-lossy: {sys.argv[2]}: no result ({err}): {reason}", file=sys.stderr)
    print(0)
PY
}

csv=$state/results.csv
echo "loss_pct,seed,path,goodput_mbit" > "$csv"
current_b=quic
total=$(( $(wc -w <<< "$LOSSES") * $(wc -w <<< "$SEEDS") )); n=0
for loss in $LOSSES; do
  for seed in $SEEDS; do
    n=$((n + 1))
    line="[$n/$total] loss $loss %, seed $seed:"
    for p in $PATHS; do
      want=${p%%_*}; [[ $p == fwd* ]] && want=$current_b
      if [[ $want != "$current_b" ]]; then start_peer_b "$NET" "$want" "${budget[@]}"; current_b=$want; fi
      set_loss "$loss" "$seed"
      g=$(goodput "$p")
      echo "$loss,$seed,$p,$g" >> "$csv"
      line+=" $p $(printf '%.1f' "$g")"
    done
    echo "$line Mbit/s" >&2
  done
done
mkdir -p "$OUT"
cp "$csv" "$OUT/lossy-path.csv"
python3 scripts/experiments/lossy_report.py "$OUT/lossy-path.csv" --out "$OUT" --rtt-ms $((DELAY_MS * 2)) \
  --rate-mbit "$RATE_MBIT" --burst "$BURST" --fec-k "$FEC_K" --time "$TIME" \
  --command "sudo ${LOSSES:+LOSSES=\"$LOSSES\"} SEEDS=\"$SEEDS\" TIME=$TIME scripts/experiment-lossy.sh"
echo "experiment-lossy: $OUT/lossy-path.md" >&2

#!/usr/bin/env bash
# Services overhead benchmark (issue 15, "Overhead": FreeNA's Tables 4 and 5). The same sandboxed client
# (bench/svc_app.c, `flexstack run`) sends to the same server in a namespace joined to the host by a veth pair, over
# a terminated flow (stacks/app-terminate.toml) with
#   none      no service (the template's stream-pass)
#   null1/4/16  chains of 1, 4 and 16 `null` services
#   compress  the `compress` service (the server decodes its blocks)
#   compress-timer  the same with `notify = false`: the module polls on a timer while blocks are out instead of
#             being woken by the compression threads when a block is made (not in the default list; for comparisons)
#   tls       the `tls` service, client mode (the server speaks TLS, OpenSSL)
#   both      compress then tls
# and, against these, the app doing the same work itself over the terminated flow with no service:
#   app-zstd  the app compresses each write into one block of the same framing (libzstd, level 3)
#   app-tls   the app speaks TLS (OpenSSL)
#   app-both  both
# Two workloads each: SMALL_N sends of 1,024 bytes (FreeNA: 300,000) and a bulk transfer of BULK_MB MiB in writes
# of 64 KiB. The configurations alternate in every round; RUNS rounds; medians of the time (s) and Gbit/s printed,
# with each configuration's cost in percent of `none`'s throughput and, for compress/tls/both, the ratio of the
# app's own time to flexstack's, and the cost of one `null` fitted over the chains' lengths (0, 1, 4, 16).
# Targets: a `null` costs <= 1 % of `none`'s throughput; compress and tls within 5 %
# of the app doing it. The data is text (zstd shrinks it about 4 times). Needs root.
# Also printed: the daemon's CPU time during each bulk transfer (all its threads, from /proc: on a busy machine a
# steadier measure of what a service costs than the elapsed time). SMALL_N=0 runs the bulk transfers only;
# RUNS_PER_MB=1 prints how many times the switch ran per MiB of each bulk transfer.
# PERF=file records a profile of the daemon during each configuration's bulk transfer (file.CONFIG; overwritten
# each round; PERF_STAT=events counts those events instead, e.g. syscalls:sys_enter_writev,context-switches).
# PROFILE (default release) the cargo profile built and run (FS=path runs that binary, unbuilt); CONFIGS picks
# configurations (default: all, in the order above); NET the server's subnet 10.NET.7.0/24 (apps: 10.(NET+1).0.0/16).
# FS_OLD=path (A/B): a second daemon runs that binary (apps in 10.(NET+2).0.0/16), and each configuration but the
# app's own (app-*) is measured on it too, right after the same one on the daemon under test, as `old-CONFIG`;
# printed at the end: each configuration's time on the old binary / on the new one (above 1: the new is faster).
# BACKEND (kernel, the default, as `run --services` has it, or smoltcp) is the `backend` of the terminated flow's
# endpoints, for every configuration (docs/services.md, "Which back-end"; docs/streams.md, "The kernel back-end");
# TERMINATE,ORIGINATE (e.g. kernel,smoltcp) sets each endpoint's own.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SMALL_N=${SMALL_N:-300000}
BULK_MB=${BULK_MB:-512}
CONFIGS=${CONFIGS:-none null1 null4 null16 compress tls both app-zstd app-tls app-both}
NET=${NET:-243} # not 215: bench-hostpath.sh uses it, and the two may run at once
BACKEND=${BACKEND:-kernel}
TERM_BACKEND=${BACKEND%%,*} ORIG_BACKEND=${BACKEND#*,}
for b in "$TERM_BACKEND" "$ORIG_BACKEND"; do
  [[ $b == smoltcp || $b == kernel ]] ||
    { echo "bench-services: BACKEND is smoltcp, kernel or TERMINATE,ORIGINATE of those, not $BACKEND" >&2; exit 2; }
done
. scripts/lib/bench.sh # median, bench_setup, server_ns
bench_setup bench-services "namespaces, TUN devices" cc openssl
tag=fss$$
state=$(mktemp -d)
chmod 755 "$state"
cleanup() {
  [[ -n "${daemon:-}" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  [[ -n "${daemon_old:-}" ]] && kill "$daemon_old" 2>/dev/null && wait "$daemon_old" 2>/dev/null || true
  server_ns_cleanup
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

server_ns "$NET"
srv=10.$NET.7.2
cc -O2 -o "$state/svc_app" bench/svc_app.c -lzstd -lssl -lcrypto
# A CA and the server's certificate for its address (EC P-256, as the tests make them).
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 -days 1 -subj "/CN=bench CA" "${ec[@]}" -keyout "$state/ca.key" -out "$state/ca.pem" 2>/dev/null
openssl req -subj "/CN=bench server" "${ec[@]}" -keyout "$state/srv.key" -out "$state/srv.csr" 2>/dev/null
printf 'subjectAltName=IP:%s\nbasicConstraints=CA:FALSE\n' "$srv" > "$state/ext"
openssl x509 -req -days 1 -in "$state/srv.csr" -CA "$state/ca.pem" -CAkey "$state/ca.key" -CAcreateserial \
  -extfile "$state/ext" -out "$state/srv.pem" 2>/dev/null
chmod 644 "$state"/*.pem
# One server per mode: plain 9001, zstd 9002, tls 9003, tls+zstd 9004.
port=9000
for m in plain zstd tls tls+zstd; do
  port=$((port + 1))
  ip netns exec ${tag}s "$state/svc_app" server $port $m "$state/srv.pem" "$state/srv.key" 2>>"$state/server.log" &
done
for _ in $(seq 100); do [[ $(ip netns exec ${tag}s ss -Htln 'sport >= :9001 and sport <= :9004' | wc -l) == 4 ]] && break; sleep 0.05; done

"$fs" daemon --state-dir "$state/d" --app-subnet 10.$((NET + 1)).0.0 2>"$state/daemon.log" &
daemon=$!
for _ in $(seq 200); do "$fs" --state-dir "$state/d" status >/dev/null 2>&1 && break; sleep 0.05; done
if [[ -n ${FS_OLD:-} ]]; then
  "$FS_OLD" daemon --state-dir "$state/d-old" --app-subnet 10.$((NET + 2)).0.0 2>"$state/daemon-old.log" &
  daemon_old=$!
  for _ in $(seq 200); do "$FS_OLD" --state-dir "$state/d-old" status >/dev/null 2>&1 && break; sleep 0.05; done
  all=()
  # compress-timer is not measured on the old binary: binaries before its setting refuse it.
  for c in $CONFIGS; do all+=("$c"); [[ $c == app-* || $c == compress-timer ]] || all+=("old-$c"); done
  CONFIGS=${all[*]}
fi

# The services files: every TCP flow through the services.
services() { # $1 = file name, then one kind (with its settings, TOML lines joined by ";") per argument
  local f=$state/$1.toml
  shift
  printf '[[rule]]\nuse = true\ntransport = "tcp"\n' > "$f"
  for s in "$@"; do printf '\n[[service]]\n%s\n' "${s//;/$'\n'}" >> "$f"; done
  echo "$f"
}
nulls() { local n=$1 i a=(); for ((i = 0; i < n; i++)); do a+=("kind = \"null\""); done; services "null$n" "${a[@]}"; }
nulls 1 >/dev/null; nulls 4 >/dev/null; nulls 16 >/dev/null
services compress 'kind = "compress"' >/dev/null
services compress-timer 'kind = "compress";notify = false' >/dev/null
services tls "kind = \"tls\";ca = \"$state/ca.pem\"" >/dev/null
services both 'kind = "compress"' "kind = \"tls\";ca = \"$state/ca.pem\"" >/dev/null

# The terminated flow's stack: stacks/app-terminate.toml, with BACKEND's endpoints (terminate's first).
awk -v t="$TERM_BACKEND" -v o="$ORIG_BACKEND" '/^kind = "terminate"/ { b = t } /^kind = "originate"/ { b = o }
  /^backend = "smoltcp"/ && b != "" { $0 = "backend = \"" b "\""; b = ""; n++ } { print } END { exit n != 2 }' \
  stacks/app-terminate.toml > "$state/terminate.toml" ||
  { echo "bench-services: could not set the endpoints' backend in stacks/app-terminate.toml" >&2; exit 1; }

# A configuration's services file (- for none), the app's mode and the server's port.
config() {
  case $1 in
    none) echo "- plain 9001" ;;
    null1 | null4 | null16) echo "$state/$1.toml plain 9001" ;;
    compress | compress-timer) echo "$state/$1.toml plain 9002" ;;
    tls) echo "$state/tls.toml plain 9003" ;;
    both) echo "$state/both.toml plain 9004" ;;
    app-zstd) echo "- zstd 9002" ;;
    app-tls) echo "- tls 9003" ;;
    app-both) echo "- tls+zstd 9004" ;;
    *) echo "bench-services: unknown configuration $1" >&2; exit 2 ;;
  esac
}
measure() { # $1 = configuration (old-CONFIG: on the old daemon), $2 = sends, $3 = bytes each; prints "SECONDS BYTES"
  local file mode p bin=$fs d=d opts=(--stack "$state/terminate.toml")
  [[ $1 == old-* ]] && bin=$FS_OLD d=d-old
  read -r file mode p < <(config "${1#old-}")
  [[ $file == - ]] || opts+=(--services "$file")
  "$bin" --state-dir "$state/$d" run "${opts[@]}" -- "$state/svc_app" client $srv "$p" "$mode" "$2" "$3" "$state/ca.pem" ||
    { echo "bench-services: $1 failed; the daemon's log ends:" >&2; tail -5 "$state/daemon.log" >&2; exit 1; }
}

# The daemon's CPU time so far (ns, all its threads; $1 = old: the old daemon's): less disturbed by a busy machine
# than the elapsed time.
daemon_cpu() {
  local pid=$daemon
  [[ ${1:-} == old ]] && pid=$daemon_old
  # A thread may end between the listing and the read (cat then fails, and pipefail would end the script).
  { cat /proc/"$pid"/task/*/schedstat 2>/dev/null || true; } | awk '{t += $1} END {printf "%.0f\n", t}'
}
switch_runs() { "$fs" --state-dir "$state/d" get switch.runs_total | awk 'NR == 2 {print $2}'; }
bulk_n=$((BULK_MB * 16))
declare -A results
for r in $(seq "$RUNS"); do
  for c in $CONFIGS; do
    echo "bench-services: round $r/$RUNS, $c" >&2
    if ((SMALL_N > 0)); then
      results[small_$c]+="$(measure "$c" "$SMALL_N" 1024 | awk '{print $1}') "
    else
      results[small_$c]+="0 " # SMALL_N=0: the bulk transfer only
    fi
    if [[ -n "${PERF:-}" ]]; then # PERF=file: a profile of the daemon during the bulk transfer (file.CONFIG)
      if [[ -n "${PERF_STAT:-}" ]]; then # PERF_STAT=events: counts of those events instead (perf stat)
        (sleep 0.5; perf stat -e "$PERF_STAT" -o "$PERF.$c" -p "$daemon" -- sleep 2 2>/dev/null) &
      else
        (sleep 0.5; perf record -q -g -o "$PERF.$c" -p "$daemon" -- sleep 2 2>/dev/null) &
      fi
      perf=$!
    fi
    [[ -n "${RUNS_PER_MB:-}" ]] && runs0=$(switch_runs)
    which=${c%%-*}
    cpu0=$(daemon_cpu "$which")
    results[bulk_$c]+="$(measure "$c" "$bulk_n" 65536 | awk '{print $1}') "
    results[cpu_$c]+="$(($(daemon_cpu "$which") - cpu0)) "
    [[ -n "${RUNS_PER_MB:-}" ]] && echo "bench-services: $c bulk: $((($(switch_runs) - runs0) / BULK_MB)) switch runs per MiB" >&2
    [[ -n "${PERF:-}" ]] && wait "$perf"
  done
done
med() { tr ' ' '\n' <<<"${results[$1]}" | grep . | median; }
# The fastest and slowest round ("min-max" s): the small-sends rounds of one configuration can differ several times
# over (BENCHMARKS.md, "Services overhead": a terminated flow's stalls on the server's delayed ACKs), so a median alone
# hides whether a configuration was fast, or its rounds happened to be.
range() { tr ' ' '\n' <<<"${results[$1]}" | grep . | sort -g | awk 'NR == 1 {a = $1} {b = $1} END {printf "%.2f-%.2f", a, b}'; }

echo
echo "services overhead, medians of $RUNS rounds: $SMALL_N sends of 1,024 bytes; $BULK_MB MiB in writes of 64 KiB"
printf '%-13s %10s %10s %9s %12s   %10s %10s %9s\n' configuration "small s" "Gbit/s" "vs none" "small range" "bulk s" \
  "Gbit/s" "vs none"
small_bytes=$((SMALL_N * 1024))
bulk_bytes=$((bulk_n * 65536))
for c in $CONFIGS; do
  awk -v c="$c" -v s="$(med small_$c)" -v b="$(med bulk_$c)" -v sn="${results[small_none]:+$(med small_none)}" \
    -v bn="${results[bulk_none]:+$(med bulk_none)}" -v sb="$small_bytes" -v bb="$bulk_bytes" -v sr="$(range small_$c)" 'BEGIN {
      ps = (sn > 0 && s > 0) ? sprintf("%+8.1f%%", (sn / s - 1) * 100) : "        -"
      pb = (bn > 0) ? sprintf("%+8.1f%%", (bn / b - 1) * 100) : "        -"
      rs = (s > 0) ? sb * 8 / s / 1e9 : 0
      printf "%-13s %10.3f %10.3f %s %12s   %10.3f %10.3f %s\n", c, s, rs, ps, sr, b, bb * 8 / b / 1e9, pb }'
done
echo "(vs none: the change of throughput against the terminated flow with no service; negative: slower)"
# What one `null` costs, from all the chains at once: the least-squares slope of the median time over the chain's
# length (none = 0, null1, null4, null16, those measured), in percent of none's time per null. Less noisy than one
# chain's difference from none, which a round's noise can swing by several percent either way.
for w in small bulk; do
  pts=
  for c in none null1 null4 null16; do
    [[ -n "${results[${w}_$c]:-}" ]] || continue
    n=${c#null}; [[ $c == none ]] && n=0
    pts+="$n $(med ${w}_$c) "
  done
  awk -v w="$w" -v pts="$pts" 'BEGIN {
    k = split(pts, a, " ") / 2
    if (k < 3 || a[1] != 0 || a[2] <= 0) exit
    for (i = 1; i <= k; i++) { x[i] = a[2 * i - 1]; y[i] = a[2 * i]; sx += x[i]; sy += y[i] }
    mx = sx / k; my = sy / k
    for (i = 1; i <= k; i++) { sxy += (x[i] - mx) * (y[i] - my); sxx += (x[i] - mx) ^ 2 }
    printf "one null, fitted over %d chains (%s): %+.2f %% of none'"'"'s time per null\n", k, w, sxy / sxx / a[2] * 100 }'
done
echo
echo "the daemon's CPU time in the bulk transfer (medians; vs none: the change, positive: more CPU)"
for c in $CONFIGS; do
  awk -v c="$c" -v t="$(med cpu_$c)" -v tn="${results[cpu_none]:+$(med cpu_none)}" -v mb="$BULK_MB" 'BEGIN {
    p = (tn > 0) ? sprintf("%+8.1f%%", (t / tn - 1) * 100) : "        -"
    printf "%-13s %8.3f s %8.2f ms/MiB %s\n", c, t / 1e9, t / 1e6 / mb, p }'
done
for pair in compress:app-zstd compress-timer:app-zstd tls:app-tls both:app-both; do
  f=${pair%%:*} a=${pair##*:}
  [[ -n "${results[small_$f]:-}" && -n "${results[small_$a]:-}" ]] || continue
  awk -v f="$f" -v a="$a" -v fs="$(med small_$f)" -v as="$(med small_$a)" -v fb="$(med bulk_$f)" -v ab="$(med bulk_$a)" \
    'BEGIN {printf "%s / %s (app time / flexstack time): small %.2f, bulk %.2f\n", f, a, (fs > 0) ? as / fs : 0, ab / fb}'
done
 if [[ -n ${FS_OLD:-} ]]; then
  echo "A/B against $FS_OLD (old time / new time, medians; above 1: the new binary is faster):"
  for c in $CONFIGS; do
    [[ $c == old-* || -z "${results[bulk_old-$c]:-}" ]] && continue
    awk -v c="$c" -v s="$(med small_$c)" -v so="$(med small_old-$c)" -v b="$(med bulk_$c)" \
      -v bo="$(med bulk_old-$c)" -v t="$(med cpu_$c)" -v to="$(med cpu_old-$c)" \
      'BEGIN {printf "%-10s small %.3f, bulk %.3f, daemon CPU in bulk %.3f\n", c, (s > 0) ? so / s : 0, bo / b, to / t}'
  done
fi
echo "code version: ${FS:-$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)}; backend $BACKEND; $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

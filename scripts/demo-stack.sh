#!/usr/bin/env bash
# A tour of the control plane: build flexstack, start a daemon with stacks/example.toml, drive
# frames through it, change the running stack from the CLI, and show what happened. Leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "error: cargo (Rust stable) is needed: install it with rustup or your distribution's rustc/cargo packages" >&2
  exit 1
fi
echo "== building flexstack (release)"
cargo build --release --quiet
fs=./target/release/flexstack
state=$(mktemp -d -t flexstack-demo.XXXXXX)
pcap=/tmp/flexstack-example.pcapng
cleanup() {
  if [[ -n "${daemon:-}" ]] && kill -0 "$daemon" 2>/dev/null; then kill "$daemon"; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$state"
}
trap cleanup EXIT INT TERM

echo "== starting the daemon with stacks/example.toml (state dir $state)"
FLEXSTACK_LOG=warn "$fs" daemon --stack stacks/example.toml --state-dir "$state" &
daemon=$!
for _ in $(seq 100); do "$fs" --state-dir "$state" status >/dev/null 2>&1 && break; sleep 0.05; done
run() { echo "\$ flexstack $*"; "$fs" --state-dir "$state" "$@"; echo; }

run status
run link list
sleep 1
run get 'module.*.frames_in_total'
echo "== steering frames to branch 1 (sink1 + the pcapng tap) by a knob"
run set module.sel.select 1
sleep 1
run module list
echo "== adding a second counter on a copy of the stream, live"
run module load watcher counter
run link add "count -> watcher"
sleep 1
run get module.watcher.frames_total module.count.frames_total
run show runtime
run config log
echo "== rolling back to revision 1 (the stack as started)"
run config rollback 1
run link list
run config save "$state/saved.toml"
kill "$daemon"; wait "$daemon" 2>/dev/null || true
echo "== done: the tap wrote $(stat -c %s "$pcap") bytes of pcapng to $pcap (open it with tshark -r or wireshark)"

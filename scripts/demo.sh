#!/usr/bin/env bash
# flexstack's main job on its built-in default: runs the demonstration lab (labs/demo.toml) — a plain host and a
# stacked host (its apps run behind flexstack) reaching a server over emulated links, curl and iperf3, with a link
# made slower and another taken down mid-run — and prints where its results and report are.
#
# Installs what it needs (Debian: scripts/setup.sh) and builds flexstack (release). The lab needs root (network
# namespaces, veth pairs): run as a user, the privileged steps go through sudo; programs in the lab run as you.
# Leaves nothing running; `flexstack lab down --all` cleans up after a run that was killed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "error: cargo (Rust stable) is needed: install it with rustup or your distribution's rustc/cargo packages" >&2
  exit 1
fi
as_root=()
if [[ $(id -u) != 0 ]]; then
  command -v sudo >/dev/null || { echo "error: the lab needs root (namespaces, veth pairs); run as root" >&2; exit 1; }
  as_root=(sudo)
fi
echo "== installing what the lab runs (iproute2, iperf3, curl, python3, nftables ...)"
"${as_root[@]}" ./scripts/setup.sh
echo "== building flexstack (release)"
cargo build --release --quiet
results="results/demo-$(date -u +%Y%m%d-%H%M%S)"
echo "== running labs/demo.toml (20 s; Ctrl-C stops it cleanly)"
"${as_root[@]}" ./target/release/flexstack lab run labs/demo.toml --results "$results"
echo
echo "== programs (from $results/report.md)"
sed -n '/^## Programs/,/^## /p' "$results/report.md" | grep '^|' | cut -c1-160
echo
echo "== done: results in $results, report in $results/report.md, plots in $results/plots/"

#!/usr/bin/env bash
# The whole test suite: unit tests, doc tests (including the module example in docs/architecture.md) and the
# end-to-end tests that start real daemons. Run from anywhere; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# The `ci` profile is optimized with debug assertions on: the end-to-end tests move real traffic through the daemon.
cargo build --workspace --all-targets --profile ci
cargo test --workspace --profile ci --no-fail-fast -- --test-threads="$(nproc)"

# Nothing of flexstack may outlive the tests, pass or fail: namespaces (fs-*, and labs' fl-lab.* with their
# /etc/netns folders), interfaces (fs*), nftables tables (flexstack_*) and daemons (also `flexstack --state-dir D
# daemon`, as labs start them). Anything left is reported as a failure, then removed so the machine stays clean.
leftovers() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^(fs-|fl-lab\.)' | sed 's/^/namespace /'
  ip -br link 2>/dev/null | awk '{print $1}' | cut -d@ -f1 | grep '^fs' | sed 's/^/interface /'
  nft list tables 2>/dev/null | awk '{print $3}' | grep '^flexstack_' | sed 's/^/nftables table /'
  ls /etc/netns 2>/dev/null | grep '^fl-lab\.' | sed 's|^|folder /etc/netns/|'
  pgrep -a -f 'flexstack( --state-dir [^ ]+)? daemon' | sed 's/^/process /'
}
left=$(leftovers || true)
if [[ -n "$left" ]]; then
  echo "error: the tests left these behind:" >&2
  echo "$left" >&2
  for ns in $(ip netns list | awk '{print $1}' | grep -E '^(fs-|fl-lab\.)'); do ip netns pids "$ns" | xargs -r kill -9; ip netns del "$ns"; done
  for l in $(ip -br link | awk '{print $1}' | cut -d@ -f1 | grep '^fs'); do ip link del "$l" 2>/dev/null || true; done
  for t in $(nft list tables | awk '{print $3}' | grep '^flexstack_'); do nft delete table inet "$t"; done
  pkill -f 'flexstack( --state-dir [^ ]+)? daemon' || true
  rm -rf /etc/netns/fl-lab.*
  exit 1
fi

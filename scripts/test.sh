#!/usr/bin/env bash
# The whole test suite: unit tests, doc tests (including the module example in docs/architecture.md) and the
# end-to-end tests that start real daemons. Run from anywhere; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# The `ci` profile is optimized with debug assertions on: the end-to-end tests move real traffic through the daemon.
cargo build --workspace --all-targets --profile ci

# Nothing the tests create may outlive them, pass or fail: namespaces (fs-*, and labs' fl-lab.* with their
# /etc/netns folders), interfaces (fs*), nftables tables (flexstack_*) and daemons (also `flexstack --state-dir D
# daemon`, as labs start them). What existed before the tests (a daemon or lab of yours) is neither reported nor
# touched: only what is new afterwards is reported as a failure, then removed so the machine stays clean.
leftovers() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^(fs-|fl-lab\.)' | sed 's/^/namespace /'
  ip -br link 2>/dev/null | awk '{print $1}' | cut -d@ -f1 | grep '^fs' | sed 's/^/interface /'
  nft list tables 2>/dev/null | awk '{print $3}' | grep '^flexstack_' | sed 's/^/nftables-table /'
  ls /etc/netns 2>/dev/null | grep '^fl-lab\.' | sed 's|^|folder /etc/netns/|'
  pgrep -f 'flexstack( --state-dir [^ ]+)? daemon' | sed 's/^/process /'
}
before=$(leftovers | sort || true)

status=0
cargo test --workspace --profile ci --no-fail-fast -- --test-threads="$(nproc)" || status=$?
# The data path again with one data-plane worker (docs/architecture.md, "Workers"; the default above is one per
# core): the same tests, whose daemons then run a single switch.
FLEXSTACK_WORKERS=1 cargo test --profile ci --no-fail-fast --test datapath_e2e --test run_e2e --test daemon_e2e \
  --test tun_e2e --test flow_e2e --test link_e2e --test emulated_link_e2e -- --test-threads="$(nproc)" || status=$?
# Every libFuzzer target briefly (cargo-fuzz on nightly; nothing is added to the corpus): a crash fails the suite.
# Outside CI it is skipped, with a reason, where the nightly toolchain or cargo-fuzz is missing; in CI (CI=true)
# that fails the suite, as a privileged test that cannot run does.
if cargo +nightly fuzz --version >/dev/null 2>&1; then
  FUZZ_JOBS=$(nproc) ./scripts/fuzz.sh --check 4 || status=1
elif [[ ${CI:-} == true ]]; then
  echo "test: error: libFuzzer targets cannot run in CI: no nightly toolchain or cargo-fuzz (scripts/setup.sh)" >&2
  status=1
else
  # (The stable-Rust fuzz tests above ran all the same.)
  echo "test: libFuzzer targets NOT run: no nightly toolchain or cargo-fuzz (scripts/setup.sh installs them)" >&2
fi

left=$(comm -13 <(echo "$before") <(leftovers | sort || true))
if [[ -n "$left" ]]; then
  echo "error: the tests left these behind:" >&2
  while read -r kind name; do
    case $kind in
      process) echo "process $(ps -o args= -p "$name" 2>/dev/null || echo "$name (gone)")" >&2 ;;
      *) echo "$kind $name" >&2 ;;
    esac
  done <<<"$left"
  while read -r kind name; do
    case $kind in
      namespace) ip netns pids "$name" 2>/dev/null | xargs -r kill -9; ip netns del "$name" 2>/dev/null || true ;;
      interface) ip link del "$name" 2>/dev/null || true ;;
      nftables-table) nft delete table inet "$name" 2>/dev/null || true ;;
      folder) rm -rf "$name" ;;
      process) kill "$name" 2>/dev/null || true ;;
    esac
  done <<<"$left"
  exit 1
fi
exit "$status"

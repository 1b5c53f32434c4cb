#!/usr/bin/env bash
# The whole test suite: unit tests, doc tests (including the module example in docs/architecture.md) and the
# end-to-end tests that start real daemons. Run from anywhere; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# The `ci` profile is optimized with debug assertions on: the end-to-end tests move real traffic through the daemon.
cargo build --workspace --all-targets --profile ci
cargo test --workspace --profile ci --no-fail-fast -- --test-threads="$(nproc)"

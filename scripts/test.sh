#!/usr/bin/env bash
# The whole test suite: unit tests, doc tests (including the module example in docs/architecture.md) and the
# end-to-end tests that start real daemons. Run from anywhere; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
cargo test --workspace -- --test-threads="$(nproc)"

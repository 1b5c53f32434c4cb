#!/usr/bin/env bash
# Benchmark of the switch alone (issue 2): frames/s through chains of 1, 10 and 100 pass-through modules against
# direct function calls doing the same work, in the same run. Results and method: BENCHMARKS.md, "Switch (issue 2)".
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo bench -p flexstack-core --bench switch "$@"

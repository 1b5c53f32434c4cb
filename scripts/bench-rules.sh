#!/usr/bin/env bash
# Benchmark of rule signalling (issue 6): ns per hop by query and by event on chains of 1, 10, 100 and 1000
# Forwarder units, against a plain function call per hop (three variants: the value passed by value, or each
# stage copying the previous stage's output with clone_from or with the engine's own copy), in the same run.
# Prints the table and the ratios to the cheapest reference (target <= 1.5; the CRAWLER paper reports 2.1 for
# query and 2.8 for event). Method and results:
# BENCHMARKS.md, "Rules (issue 6)"; the code: crates/rules/benches/signalling.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo bench -p flexstack-rules --bench signalling "$@"

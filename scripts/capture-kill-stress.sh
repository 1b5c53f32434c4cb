#!/usr/bin/env bash
# Kills a daemon whose tap writes a capture fast (SIGKILL at a random moment) N times and counts the files tshark
# finds cut in the middle of a block, with the tap's page padding on and off (docs/taps.md, "A capture is never
# cut silently"). Usage: scripts/capture-kill-stress.sh [N] [FRAME_BYTES]; needs target/ci/flexstack and tshark.
set -euo pipefail
n=${1:-100}
size=${2:-700}
bin=${FLEXSTACK_BIN:-$(dirname "$0")/../target/ci/flexstack}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for whole_pages in true false; do
    cut=0
    for i in $(seq 1 "$n"); do
        rm -rf "$work/state" "$work/cap.pcapng"
        cat > "$work/stack.toml" <<EOT
links = ["src -> tap"]
[modules.src]
kind = "source"
rate = 200000
count = 100000000
size = $size
[modules.tap]
kind = "tap"
path = "$work/cap.pcapng"
passthrough = false
whole_pages = $whole_pages
EOT
        "$bin" daemon --stack "$work/stack.toml" --state-dir "$work/state" 2>/dev/null &
        pid=$!
        sleep "0.$((RANDOM % 5 + 3))"
        kill -9 "$pid"
        wait "$pid" 2>/dev/null || true
        err=$(tshark -n -r "$work/cap.pcapng" -T fields -e frame.number 2>&1 >/dev/null | grep -v 'Running as user' || true)
        if [ -n "$err" ]; then
            cut=$((cut + 1))
            echo "kill $i: $(stat -c %s "$work/cap.pcapng") bytes: $err"
        fi
    done
    echo "whole_pages = $whole_pages, frames of $size bytes: $cut of $n files cut in a block"
done

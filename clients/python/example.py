#!/usr/bin/env python3
"""Example: an application with one meter and one knob (the Python twin of clients/c/example.c).

    FLEXSTACK_STATE_DIR=/tmp/fs python3 clients/python/example.py demo 30
    flexstack --state-dir /tmp/fs get app.demo.ticks      # the meter, counting up ten times a second
    flexstack --state-dir /tmp/fs set app.demo.level 7    # the knob: prints "level=7"
    flexstack --state-dir /tmp/fs set app.demo.level -1   # refused by the callback: the set fails

Arguments: the application's name (default "demo") and how many seconds to run (default: until killed).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flexstack_app import App, Refused  # noqa: E402


def on_level(name, value):
    """Accepts levels 0..100, refuses anything else."""
    v = int(value)
    if not 0 <= v <= 100:
        raise Refused("level must be within 0..100")
    print("%s=%d" % (name, v), flush=True)


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "demo"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else None
    with App() as app:
        app.meter("ticks", "u64")
        app.knob("level", "i64", 0, on_level)
        app.register(name)
        print("registered app.%s.ticks and app.%s.level" % (name, name), flush=True)
        start, ticks = time.monotonic(), 0
        while seconds is None or time.monotonic() - start < seconds:
            ticks += 1
            app.update("ticks", ticks)
            app.poll(0.1)


if __name__ == "__main__":
    main()

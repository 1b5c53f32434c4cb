#!/usr/bin/env python3
"""TCP sink for the handoff labs: accepts one connection on PORT and counts the bytes received per --bin seconds.
Standard library only.

Output (stdout), CSV: first `start,<mono_s>` (CLOCK_MONOTONIC when it started: start it at the lab's 0 s on a
plain host and this is the lab's clock origin, to within a few ms), then `mono_s,bytes` per bin (the bin's end).

    tcp_sink.py PORT --duration 13 [--bin 0.1]
"""
import argparse
import select
import socket
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--duration", type=float, required=True, help="seconds from start until it stops")
    ap.add_argument("--bin", type=float, default=0.1, help="seconds per output line")
    args = ap.parse_args()
    start = time.monotonic()
    out = sys.stdout
    out.write(f"start,{start:.6f}\n")
    out.flush()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("0.0.0.0", args.port))
    lsock.listen(1)
    end = start + args.duration
    ready, _, _ = select.select([lsock], [], [], args.duration)
    if not ready:
        sys.exit("tcp_sink: no connection")
    conn, _ = lsock.accept()
    conn.setblocking(False)
    counted = 0
    bin_end = time.monotonic() + args.bin
    closed = False
    while time.monotonic() < end:
        timeout = max(0.0, min(bin_end, end) - time.monotonic())
        if not closed:
            r, _, _ = select.select([conn], [], [], timeout)
            if r:
                try:
                    data = conn.recv(1 << 20)
                except BlockingIOError:
                    data = None
                if data == b"":
                    closed = True
                elif data:
                    counted += len(data)
        else:
            time.sleep(timeout)
        now = time.monotonic()
        while now >= bin_end:
            out.write(f"{bin_end:.6f},{counted}\n")
            counted = 0
            bin_end += args.bin
    out.flush()


if __name__ == "__main__":
    main()
